"""The wheel ships the project's shared templates and static files (the top-level `templates/`
and `static/`: the base layout, the login pages, the stylesheet and the scripts every page
loads) inside the `runs` app, so a Django project that installs Stepguard finds them as app
files. The checkout's own settings read them where they are (TEMPLATES DIRS, STATICFILES_DIRS);
an editable install does too, so it copies nothing. Everything else is in pyproject.toml."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

SHARED = ("templates", "static")


class BuildWithSharedFiles(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for name in SHARED:
            target = Path(self.build_lib) / "runs" / name
            shutil.copytree(Path(__file__).parent / name, target, dirs_exist_ok=True)


setup(cmdclass={"build_py": BuildWithSharedFiles})
