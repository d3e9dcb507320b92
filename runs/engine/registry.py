"""The workflows this process can run, by name and version."""

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from django.conf import settings

from runs.errors import UnknownWorkflow


@dataclass(frozen=True)
class WorkflowDef:
    name: str
    version: str
    fn: Callable

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


_workflows: dict[tuple[str, str], WorkflowDef] = {}
_latest: dict[str, str] = {}


def register(name: str, version: str, fn: Callable) -> WorkflowDef:
    if not name or not isinstance(name, str):
        raise ValueError("a workflow needs a non-empty name")
    if "*" in name:
        # "*" names everything in halts and budgets (Policy scope); a workflow must not alias it.
        raise ValueError(f"workflow name {name!r} contains '*', which stands for every workflow")
    version = str(version)
    existing = _workflows.get((name, version))
    if existing and existing.fn.__qualname__ != fn.__qualname__:
        raise ValueError(
            f"workflow {name}@{version} is already registered by {existing.fn.__module__}."
            f"{existing.fn.__qualname__}; give the new code a new version"
        )
    definition = WorkflowDef(name, version, fn)
    _workflows[(name, version)] = definition
    _latest[name] = version
    return definition


def get(name: str, version: str | None = None) -> WorkflowDef:
    if version is None:
        version = _latest.get(name)
    definition = _workflows.get((name, version)) if version is not None else None
    if definition is None:
        known = ", ".join(sorted(d.ref for d in _workflows.values())) or "none"
        wanted = name if version is None else f"{name}@{version}"
        raise UnknownWorkflow(f"unknown workflow {wanted!r} (registered here: {known})")
    return definition


def builtin(name: str) -> bool:
    """Stepguard's own workflows (notification deliveries): every process registers them."""
    return name.startswith("stepguard.")


def all_workflows() -> list[WorkflowDef]:
    return list(_workflows.values())


def import_modules(modules: Iterable[str]) -> None:
    """Import workflow modules; a failure names the module instead of dumping a traceback."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:
            raise ImportError(
                f"cannot import workflow module {module!r}: {type(exc).__name__}: {exc}"
            ) from exc


def load_configured() -> None:
    import_modules(settings.STEPGUARD_WORKFLOW_MODULES)
