"""docs/deploy.md's and docs/operations.md's `--import yourapp.agents`."""

from myagents.trips import *  # noqa: F403
