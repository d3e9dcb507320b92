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


class ModelRequestRejected(StepguardError):
    """The model provider refused the request itself (400, 401, 403, 404, 422...): the same
    request gets the same answer, so neither the step nor the run sends it again."""

    code = "model_request_rejected"
    retryable = False


class UnpricedModel(StepguardError):
    """A model with no price was about to be called under a USD budget, which it could then
    never trip (STEPGUARD_REFUSE_UNPRICED_MODELS)."""

    code = "unpriced_model"
    retryable = False


class ControlFlow(BaseException):
    """Base of the signals that stop workflow code; never caught by `except Exception`."""


class LeaseLost(ControlFlow):
    """Another worker owns the run now: stop and write nothing more."""


class Released(ControlFlow):
    """This worker is shutting down: release the run at the step boundary."""


class Suspended(ControlFlow):
    """The run waits (timer, signal, approval, child): it was released with a wake-up time."""


class Cancelled(ControlFlow):
    """An operator cancelled the run: compensations run, then it ends `cancelled`."""


class WaitTimeout(StepguardError, TimeoutError):
    code = "wait_timeout"


class StepTimeout(StepguardError, TimeoutError):
    """A step's attempt ran past its `timeout=`: a failed attempt, retried per the step's
    RetryPolicy with the same idempotency key (the late call may still have happened)."""

    code = "step_timeout"


class ApprovalRejected(StepguardError):
    code = "approval_rejected"
    retryable = False


class ApprovalExpired(StepguardError):
    code = "approval_expired"
    retryable = False


class ApprovalRevoked(StepguardError):
    """The approval guarding a step was revoked after it was granted: the step did not start."""

    code = "approval_revoked"
    retryable = False


class ChildFailed(StepguardError):
    """A child run failed or was cancelled. Not retried at the parent: the child has retries."""

    code = "child_failed"
    retryable = False


class WorkerLost(StepguardError):
    """The run's worker died too often in a row without progress (a poison step): the run is
    failed, its compensations run, and the step that kept killing workers is not re-sent."""

    code = "worker_lost"
    retryable = False


class OperatorFailed(StepguardError):
    """A person decided an ambiguous step should fail the run."""

    code = "operator_failed"
    retryable = False


class DecisionError(StepguardError, ValueError):
    """A decision that cannot be taken: already decided, wrong kind, unknown request..."""

    code = "decision_error"


class InvalidInput(StepguardError, ValueError):
    """Input that cannot be taken as given (a schedule, a run's concurrency key); the message
    names what is wrong."""

    code = "invalid_input"


class TooLargeForRateLimit(StepguardError):
    """A call that needs more tokens than its resource's rate limit lets through in a whole
    window: waiting would never help."""

    code = "too_large_for_rate_limit"
    retryable = False


class OperationError(StepguardError, ValueError):
    """An operator action that cannot be taken in the run's current state."""

    code = "operation_error"


#: Errors a workflow can catch from a step, rebuilt from their recorded `code` on replay.
REPLAYED = {
    cls.code: cls
    for cls in (
        WaitTimeout,
        ApprovalRejected,
        ApprovalExpired,
        ApprovalRevoked,
        ChildFailed,
        OperatorFailed,
    )
}


class Halted(ControlFlow):
    """A person halted this run, its workflow, or everything: stop at this step boundary."""

    def __init__(self, scope: str, by: str, reason: str):
        self.scope, self.by, self.reason = scope, by, reason
        super().__init__(f"halted ({scope}) by {by}: {reason}")


class OverBudget(ControlFlow):
    """The next step would exceed a budget: the run pauses until a person raises it."""

    def __init__(
        self, budget: str, unit: str, limit: int, spent: int, estimate: int, scope: str = ""
    ):
        self.budget, self.unit, self.limit, self.spent, self.estimate = (
            budget, unit, limit, spent, estimate,
        )  # fmt: skip
        self.scope = scope  # a shared budget's Policy scope ("" for the run's own)
        super().__init__(f"{budget} budget: {spent} of {limit} {unit} spent, step needs {estimate}")


class NotFound(OperationError, LookupError):
    code = "not_found"


class Forbidden(OperationError, PermissionError):
    code = "forbidden"


class Conflict(OperationError, DecisionError):
    """The state changed first: already decided, already halted, not in a state for this."""

    code = "conflict"
