"""Errors agent code sees, and control-flow signals it cannot swallow.

User-facing errors share `StepguardError` and carry a stable `code`. Suspension, release and
lease loss derive from `BaseException`, so a workflow's `except Exception:` cannot swallow
them and keep running a run it no longer owns.
"""


class StepguardError(Exception):
    code = "stepguard_error"
    #: Whether a run that fails with this error may be retried from the top.
    retryable = True

    def as_record(self) -> dict:
        return {"code": self.code, "type": type(self).__name__, "message": str(self)}


class UnknownWorkflow(StepguardError, LookupError):
    code = "unknown_workflow"
    retryable = False


class NonDeterminismError(StepguardError):
    """Replay asked for a different step than history recorded at this position."""

    code = "non_determinism"
    retryable = False

    def __init__(self, *, seq: int, recorded: str, requested: str):
        self.seq, self.recorded, self.requested = seq, recorded, requested
        super().__init__(
            f"non-deterministic workflow: step #{seq} was recorded as {recorded!r} but the code "
            f"now asks for {requested!r}; the workflow changed under a running run "
            "(register the new code as a new version, or use a new step key at the end)"
        )


class OutputNotSerializable(StepguardError, TypeError):
    code = "output_not_serializable"
    retryable = False


class StepFailed(StepguardError):
    """A step failed after its retries; raised in the workflow on the first run and on replay."""

    code = "step_failed"

    def __init__(self, key: str, error: dict, *, retryable: bool = True):
        self.key = key
        self.error = error
        self.retryable = retryable
        super().__init__(f"step {key!r} failed: {error.get('type')}: {error.get('message')}")

    def as_record(self) -> dict:
        return {**super().as_record(), "step": self.key, "cause": self.error}


class StepMisuse(StepguardError, RuntimeError):
    """The SDK was called where it is not legal (a step inside a step, outside a run...)."""

    code = "sdk_misuse"
    retryable = False


class ControlFlow(BaseException):
    """Base of the signals that stop workflow code; never caught by `except Exception`."""


class LeaseLost(ControlFlow):
    """Another worker owns the run now: stop and write nothing more."""


class Released(ControlFlow):
    """This worker is shutting down: release the run at the step boundary."""
