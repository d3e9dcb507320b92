"""The workflows this process can run, by name and version."""

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.conf import settings

from runs.errors import InvalidInput, UnknownWorkflow


@dataclass(frozen=True)
class WorkflowDef:
    name: str
    version: str
    fn: Callable
    # Flow control (docs/flow-control.md); an operator's Policy overrides the limits.
    concurrency: int | None = None
    concurrency_key: Callable[[Any], Any] | None = None
    per_key: int | None = None
    priority: int = 0
    schedule: str | None = None
    timezone: str = "UTC"
    overlap: str = "skip"  # the schedule's overlap policy (runs.models.Overlap)
    debounce: timedelta | None = None
    debounce_key: Callable[[Any], Any] | None = None
    debounce_max: timedelta | None = None

    def key_for(self, input: Any, which: str = "concurrency") -> str:
        """The concurrency (or debounce) key of a run with `input`: "" without a function."""
        fn = self.concurrency_key if which == "concurrency" else self.debounce_key
        if fn is None:
            return ""
        try:
            key = str(fn(input))
        except Exception as exc:
            raise InvalidInput(
                f"the {which} key of workflow {self.name!r} failed on this input: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if len(key) > 200:
            raise InvalidInput(f"{which} key of workflow {self.name!r} is over 200 characters")
        return key

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"


_workflows: dict[tuple[str, str], WorkflowDef] = {}
_latest: dict[str, str] = {}


def register(name: str, version: str, fn: Callable, **options: Any) -> WorkflowDef:
    """Register `fn`; `options` are WorkflowDef's flow-control fields, checked here."""
    if not name or not isinstance(name, str):
        raise ValueError("a workflow needs a non-empty name")
    if "*" in name:
        # "*" names everything in halts and budgets (Policy scope); a workflow must not alias it.
        raise ValueError(f"workflow name {name!r} contains '*', which stands for every workflow")
    if name.startswith("label:"):
        # "label:<name>=<value>" is a label's budget (Policy scope, runs/labels.py).
        raise ValueError(f"workflow name {name!r} starts with 'label:', which names a label")
    version = str(version)
    existing = _workflows.get((name, version))
    if existing and existing.fn.__qualname__ != fn.__qualname__:
        raise ValueError(
            f"workflow {name}@{version} is already registered by {existing.fn.__module__}."
            f"{existing.fn.__qualname__}; give the new code a new version"
        )
    for limit in ("concurrency", "per_key"):
        value = options.get(limit)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"workflow {name!r}: {limit} must be a positive integer")
    if options.get("per_key") is not None and options.get("concurrency_key") is None:
        raise ValueError(f"workflow {name!r}: per_key needs a concurrency_key function")
    if not -1000 <= options.get("priority", 0) <= 1000:
        raise ValueError(f"workflow {name!r}: priority must be between -1000 and 1000")
    for option in ("debounce", "debounce_max"):
        value = options.get(option)
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = options[option] = timedelta(seconds=value)
        if value is not None and (not isinstance(value, timedelta) or value <= timedelta(0)):
            raise ValueError(f"workflow {name!r}: {option} must be a positive duration")
    if options.get("debounce") is None and (
        options.get("debounce_key") or options.get("debounce_max")
    ):
        raise ValueError(f"workflow {name!r}: debounce_key and debounce_max need debounce")
    if options.get("debounce_max") is not None and options["debounce_max"] < options["debounce"]:
        raise ValueError(f"workflow {name!r}: debounce_max is shorter than debounce")
    definition = WorkflowDef(name, version, fn, **options)
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
