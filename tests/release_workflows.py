"""A release to check before it ships (tests/test_replaycheck.py): three workflows as the code
shipped before had them (`OLD`: plain functions the tests register in place of the new ones)
and as this release changes them, registered at the same version, as a careless deploy does:

- release.compatible: a step added after the wait every live run is parked at (compatible);
- release.divergent: a step inserted before the first one (every recorded run diverges);
- release.patched: the same insertion, guarded by `ctx.patched` (old runs keep the old path).

Each step calls `url` (a server the test counts requests on): a replay must call nothing.
"""

from urllib.request import urlopen

from runs.sdk import RunContext, workflow


def call(url: str, label: str) -> str:
    with urlopen(f"{url}/{label}", timeout=10) as answer:
        answer.read()
    return label


def _old(ctx: RunContext, input: dict) -> str:
    ctx.step("reserve", call, input["url"], "reserve")
    paid = ctx.wait_for_event("paid", "paid")
    return ctx.step("charge", call, input["url"], f"charge-{paid}")


OLD = {"release.compatible": _old, "release.divergent": _old, "release.patched": _old}


@workflow("release.compatible")
def compatible(ctx: RunContext, input: dict) -> str:
    url = input["url"]
    ctx.step("reserve", call, url, "reserve")
    paid = ctx.wait_for_event("paid", "paid")
    charged = ctx.step("charge", call, url, f"charge-{paid}")
    ctx.step("receipt", call, url, "receipt")  # new: after every live run's position
    return charged


@workflow("release.divergent")
def divergent(ctx: RunContext, input: dict) -> str:
    url = input["url"]
    ctx.step("quote", call, url, "quote")  # new, unguarded: recorded runs have 'reserve' here
    ctx.step("reserve", call, url, "reserve")
    paid = ctx.wait_for_event("paid", "paid")
    return ctx.step("charge", call, url, f"charge-{paid}")


@workflow("release.patched")
def patched(ctx: RunContext, input: dict) -> str:
    url = input["url"]
    if ctx.patched("quote-first"):  # new runs quote first; recorded ones replay as they were
        ctx.step("quote", call, url, "quote")
    ctx.step("reserve", call, url, "reserve")
    paid = ctx.wait_for_event("paid", "paid")
    return ctx.step("charge", call, url, f"charge-{paid}")
