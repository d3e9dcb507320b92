"""Rate limits over REST: a resource's calls and tokens per window, across every worker."""

from __future__ import annotations

from django.utils import timezone
from ninja import Field, Schema, Status

from runs import operations
from runs.api.common import ERRORS, ERRORS_422, ReasonIn, Router, may
from runs.engine import rates
from runs.errors import OperationError
from runs.models import RateLimit

router = Router(tags=["runs"])


class RateLimitIn(ReasonIn):
    requests: int | None = Field(None, ge=1, le=10**9, description="calls per window")
    tokens: int | None = Field(None, ge=1, le=10**15, description="tokens per window")
    window_seconds: int = Field(60, ge=1, le=86400)


class RateLimitOut(Schema):
    resource: str
    requests: int | None
    tokens: int | None
    window_seconds: int
    used_requests: int = Field(description="granted inside the current window")
    used_tokens: int


def _rate_out(limit: RateLimit) -> dict:
    used = rates.usage(limit.resource, timezone.now())
    return {
        "resource": limit.resource, "requests": limit.requests, "tokens": limit.tokens,
        "window_seconds": limit.window_seconds, "used_requests": used["requests"],
        "used_tokens": used["tokens"],
    }  # fmt: skip


@router.get("/flow/rate-limits", response={200: list[RateLimitOut], **ERRORS}, tags=["flow"])
def list_rate_limits(request):
    """Every rate limit, with what its window holds now."""
    may(request, "runs.view_ratelimit", "view rate limits")
    return [_rate_out(limit) for limit in RateLimit.objects.order_by("resource")]


@router.put(
    "/flow/rate-limits/{path:resource}", response={200: RateLimitOut, **ERRORS_422}, tags=["flow"]
)
def set_rate_limit(request, resource: str, body: RateLimitIn):
    """Set a resource's limit (a model's name: `ctx.llm` declares it by itself)."""
    if body.requests is None and body.tokens is None:
        raise OperationError("give requests, tokens or both (DELETE removes a limit)")
    limit = operations.set_rate_limit(
        resource, request.user, body.reason, requests=body.requests, tokens=body.tokens,
        window_seconds=body.window_seconds,
    )  # fmt: skip
    assert limit is not None
    return _rate_out(limit)


@router.delete(
    "/flow/rate-limits/{path:resource}", response={204: None, **ERRORS_422}, tags=["flow"]
)
def remove_rate_limit(request, resource: str, body: ReasonIn):
    operations.set_rate_limit(resource, request.user, body.reason)
    return Status(204, None)
