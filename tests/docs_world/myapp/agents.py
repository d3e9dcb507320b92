"""docs/install.md's `--import myapp.agents`."""

from myagents.trips import *  # noqa: F403
