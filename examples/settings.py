"""Settings of the demo (`make run`): Stepguard's own, in development mode, with the demo
agents and the stand-in world they talk to (the `examples` app) installed. Production settings
are controlplane.settings, which know nothing of this package."""

import os

os.environ.setdefault("DEBUG", "1")

from controlplane.settings import *  # noqa: F403

INSTALLED_APPS = [*INSTALLED_APPS, "examples"]  # noqa: F405
STEPGUARD_WORKFLOW_MODULES = STEPGUARD_WORKFLOW_MODULES or ["examples.demo"]  # noqa: F405
