#!/usr/bin/env python
"""Django's manage.py for a checkout of Stepguard (an installed one has the `stepguard` command).

Run with a Python that has no Django (`python manage.py ...` outside the virtualenv), it runs
again with the checkout's `.venv`, so the commands `make run` prints work as pasted.
"""

import importlib.util
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    venv = Path(__file__).resolve().parent / ".venv" / "bin" / "python"
    if importlib.util.find_spec("django") is None and venv.exists():
        os.execv(venv, [str(venv), __file__, *sys.argv[1:]])
    from controlplane.cli import main

    main()
