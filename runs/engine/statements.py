"""The engine's hand-written SQL: named statements with named parameters (`%(name)s`).

As Procrastinate keeps its queries under names in one file (procrastinate/sql/queries.sql),
the claim's and the fenced write's statements are named here, and each is filled from a dict:
adding a condition cannot shift every value after it, as it did when 48 positional `%s` were
filled from hand-ordered lists. Their rendered text is checked in (tests/golden/sql/, compared
by tests/test_statements.py), so a change to a statement shows in review. Both drivers take
the same text: psycopg as it is; Django's SQLite backend turns `%(name)s` into sqlite3's
`:name` when the parameters are a mapping (SQLiteCursorWrapper.convert_query).

Table names and the hold condition (holds.covered_sql) are put in once, at import. What is
still assembled per call is only what varies with the write: which columns a step row's
write sets (fences.prep, whose placeholders are named after the part and the column) and
which checks a fence makes (fences.fence_statement).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from runs.engine.holds import covered_sql
from runs.models import Event, Run, Step

RUN = Run._meta.db_table
STEP = f'"{Step._meta.db_table}"'
EVENT = f'"{Event._meta.db_table}"'
_QUOTED_RUN = f'"{RUN}"'
_COVERED = covered_sql()
_RUN_COLUMNS = ", ".join(f'r."{f.column}"' for f in Run._meta.concrete_fields)
_LIMITED_ORDER = "aged DESC, CASE WHEN aged THEN 0 ELSE priority END DESC, wake_at"

#: Where a worker's own runs (its workflows at their versions) go in a claim statement.
MINE = "{mine}"


def mine_condition(count: int) -> str:
    """The condition `MINE` stands for: one (workflow, version) pair per parameter pair. An OR
    of equalities, not a join with an array: the claim's plans are the ones measured."""
    return " OR ".join(
        f"(workflow = %(mine_workflow_{i})s AND version = %(mine_version_{i})s)"
        for i in range(count)
    )


def mine_params(refs: Sequence[tuple[str, str]]) -> dict[str, str]:
    """The parameters of `mine_condition(len(refs))`."""
    params = {}
    for i, (workflow, version) in enumerate(refs):
        params[f"mine_workflow_{i}"] = workflow
        params[f"mine_version_{i}"] = version
    return params


#: Lock up to `limit` runnable runs of ours, in CTEs ending in `c` (id, was): runs whose
#: worker died and runs due for longer than the priority aging time (before `aged_before`)
#: first, oldest first, then the other due runs by priority; each part in the order of its own
#: partial index. Held runs, poison runs (`poison` losses) and the `limited` workflows' runs are
#: left out; without `suspects`, so are the lost runs that one more loss would make suspects
#: (claims.SUSPECT_AFTER: `suspect_after`). Completed by TAKE_CLAIMED.
CLAIM_DUE = f"""
            WITH aged AS (
                SELECT id, status AS was, 0 AS grp, 0 AS prio, wake_at AS at FROM {_QUOTED_RUN}
                WHERE status = ANY(%(wakeable)s) AND wake_at < %(aged_before)s AND ({MINE})
                  AND NOT (workflow = ANY(%(limited)s))
                  AND NOT {_COVERED}
                ORDER BY wake_at
                LIMIT %(limit)s
                FOR UPDATE SKIP LOCKED
            ), due AS (
                SELECT id, status AS was, 1 AS grp, -priority AS prio, wake_at AS at
                FROM {_QUOTED_RUN}
                WHERE status = ANY(%(wakeable)s) AND wake_at <= %(now)s
                  AND wake_at >= %(aged_before)s AND ({MINE})
                  AND NOT (workflow = ANY(%(limited)s))
                  AND NOT {_COVERED}
                ORDER BY priority DESC, wake_at
                LIMIT %(limit)s
                FOR UPDATE SKIP LOCKED
            ), lost AS (
                SELECT id, status AS was, 0 AS grp, 0 AS prio, lease_until AS at
                FROM {_QUOTED_RUN}
                WHERE status = %(running)s AND lease_until < %(now)s AND ({MINE})
                  AND recoveries + 1 < %(poison)s
                  AND (%(suspects)s OR recoveries + 1 < %(suspect_after)s)
                  AND NOT {_COVERED}
                ORDER BY lease_until
                LIMIT %(limit)s
                FOR UPDATE SKIP LOCKED
            ), c AS (
                SELECT id, was FROM (
                    SELECT * FROM lost UNION ALL SELECT * FROM aged UNION ALL SELECT * FROM due
                ) AS all_
                ORDER BY grp, prio, at LIMIT %(limit)s
            )"""

#: Lock the due runs of the limited workflow `workflow` that its running runs leave room for
#: (at most `free`, `total` in all, `per_key` per concurrency key: `row_number()` per key,
#: looking at `fetch` candidates), in CTEs ending in `c` (id, was). Completed by TAKE_CLAIMED.
CLAIM_LIMITED = f"""
            WITH running AS (
                SELECT concurrency_key AS k, count(*) AS n FROM {_QUOTED_RUN}
                WHERE workflow = %(workflow)s AND status = %(running)s GROUP BY concurrency_key
            ), room AS (
                SELECT GREATEST(0, LEAST(%(free)s::int,
                    COALESCE(%(total)s::int - (SELECT COALESCE(sum(n), 0) FROM running),
                        %(free)s::int)
                )) AS n
            ), locked AS (
                SELECT id, status AS was, concurrency_key AS k, priority, wake_at,
                    (status = ANY(%(wakeable)s) AND wake_at < %(aged_before)s) AS aged
                FROM {_QUOTED_RUN}
                WHERE workflow = %(workflow)s AND status = ANY(%(wakeable)s)
                  AND wake_at <= %(now)s AND ({MINE})
                  AND NOT {_COVERED}
                  AND concurrency_key NOT IN (
                      SELECT k FROM running
                      WHERE %(per_key)s::int IS NOT NULL AND n >= %(per_key)s::int
                  )
                ORDER BY (wake_at < %(aged_before)s) DESC,
                    CASE WHEN wake_at < %(aged_before)s THEN 0 ELSE priority END DESC, wake_at
                LIMIT %(fetch)s
                FOR UPDATE SKIP LOCKED
            ), ranked AS (
                SELECT l.id, l.was, l.aged, l.priority, l.wake_at,
                    row_number() OVER (PARTITION BY l.k ORDER BY {_LIMITED_ORDER})
                        + COALESCE(r.n, 0) AS load
                FROM locked l LEFT JOIN running r ON r.k = l.k
            ), c AS (
                SELECT id, was FROM ranked
                WHERE %(per_key)s::int IS NULL OR load <= %(per_key)s::int
                ORDER BY {_LIMITED_ORDER}
                LIMIT (SELECT n FROM room)
            )"""

#: Take the leases of the runs `c` chose for `worker` (until `lease_until`) and append their
#: claim events (`recovered` for a run whose worker died, `woken` for a waiting one, `claimed`
#: otherwise), in the statement that chose them.
TAKE_CLAIMED = f""", u AS (
                UPDATE {_QUOTED_RUN} r SET
                    status = %(running)s, worker_id = %(worker)s, lease_until = %(lease_until)s,
                    lease_epoch = r.lease_epoch + 1, event_seq = r.event_seq + 1,
                    recoveries = r.recoveries + CASE WHEN c.was = %(running)s THEN 1 ELSE 0 END,
                    started_at = CASE WHEN r.lease_epoch = 0 THEN %(now)s ELSE r.started_at END
                FROM c WHERE r.id = c.id
                RETURNING {_RUN_COLUMNS}, c.was
            ), e AS (
                INSERT INTO {EVENT}
                    (run_id, run_created_at, seq, step_key, type, actor, payload, created_at)
                SELECT id, created_at, event_seq, '',
                    CASE was WHEN %(running)s THEN %(recovered)s
                        WHEN %(waiting)s THEN %(woken)s ELSE %(claimed)s END,
                    'system', jsonb_build_object('worker', %(worker_text)s::text,
                        'epoch', lease_epoch), %(now)s
                FROM u
            )
            SELECT * FROM u ORDER BY wake_at
        """


def claim(chosen: str, mine_count: int) -> str:
    """A whole claim statement: `chosen` (CLAIM_DUE or CLAIM_LIMITED) for a worker with
    `mine_count` (workflow, version) pairs, completed by TAKE_CLAIMED."""
    return chosen.replace(MINE, mine_condition(mine_count)) + TAKE_CLAIMED


# -- the fence: the run-row UPDATE every fenced write starts with -------------------------------

#: Allocate `events` event seqs (always).
FENCE_EVENTS = "event_seq = event_seq + %(events)s"
#: A starting step reserves its estimate against the run's budget.
FENCE_RESERVE = (
    ", reserved_micros = reserved_micros + %(reserve_micros)s"
    ", reserved_tokens = reserved_tokens + %(reserve_tokens)s"
)
#: A finishing step adds its usage and gives back what it held.
FENCE_SETTLE = (
    ", cost_micros = cost_micros + %(spent_micros)s, tokens_in = tokens_in + %(tokens_in)s"
    ", tokens_out = tokens_out + %(tokens_out)s"
    ", reserved_micros = CASE WHEN reserved_micros > %(given_micros)s"
    " THEN reserved_micros - %(given_micros)s ELSE 0 END"
    ", reserved_tokens = CASE WHEN reserved_tokens > %(given_tokens)s"
    " THEN reserved_tokens - %(given_tokens)s ELSE 0 END"
)
#: Interrupted model calls' estimates: maybe paid, held for good.
FENCE_POSSIBLY = (
    ", possibly_spent_micros = possibly_spent_micros + %(possibly_micros)s"
    ", possibly_spent_tokens = possibly_spent_tokens + %(possibly_tokens)s"
)
FENCE_PROGRESS = ", recoveries = 0"
#: The lease: the run is ours (`run`, at `epoch`) and running.
FENCE_WHERE = " WHERE id = %(run)s AND lease_epoch = %(epoch)s AND status = %(running)s"
FENCE_NOT_CANCELLED = " AND cancel_requested_at IS NULL"
FENCE_NOT_HELD = f" AND NOT {covered_sql(RUN)}"
_SPENT = {
    "micros": "cost_micros + reserved_micros + possibly_spent_micros",
    "tokens": "tokens_in + tokens_out + reserved_tokens + possibly_spent_tokens",
}
_LIMIT = {"micros": "budget_micros", "tokens": "budget_tokens"}
#: The estimate (`want_*`) fits the budget, which is not spent already by everything but what
#: this step holds (`held_*`).
FENCE_IN_BUDGET = "".join(
    f" AND ({_LIMIT[u]} IS NULL OR ({_SPENT[u]} + %(want_{u})s <= {_LIMIT[u]}"
    f" AND {_SPENT[u]} - %(held_{u})s < {_LIMIT[u]}))"
    for u in ("micros", "tokens")
)
FENCE_RETURNING = " RETURNING event_seq, created_at"


def fence(sets: str, conditions: str) -> str:
    return f"UPDATE {RUN} SET {FENCE_EVENTS}{sets}{FENCE_WHERE}{conditions}{FENCE_RETURNING}"


# -- the fenced write's other parts (data-modifying CTEs after the fence `f`) -------------------

#: The pending completion's step update (`p`) and event (`pe`, seq `after` before the fence's
#: last), only while the step (`pending_step`) is still `started`.
CARRIED = (
    "WITH f AS ({fence})"
    ", p AS (UPDATE " + STEP + " SET {sets} WHERE id = %(pending_step)s AND status = %(started)s"
    " AND EXISTS (SELECT 1 FROM f) RETURNING id)"
    ", pe AS (INSERT INTO " + EVENT + " (run_id, run_created_at, seq, {event_columns})"
    " SELECT %(run)s::uuid, f.created_at, f.event_seq - %(after)s, {event_values}"
    " FROM f WHERE EXISTS (SELECT 1 FROM p)) "
)
NOT_CARRIED = "WITH f AS ({fence}) "
STEP_INSERTED = (
    ", s AS (INSERT INTO " + STEP + " (run_id, {columns}) "
    "SELECT %(run)s::uuid, {values} FROM f RETURNING id)"
)
STEP_UPDATED = (
    ", s AS (UPDATE " + STEP + " SET {sets} "
    "WHERE id = %(step)s AND EXISTS (SELECT 1 FROM f) RETURNING id)"
)
NO_STEP = ", s AS (SELECT NULL::bigint AS id)"
EVENT_APPENDED = (
    ", e AS (INSERT INTO " + EVENT + " (run_id, run_created_at, seq, {columns})"
    " SELECT %(run)s::uuid, f.created_at, f.event_seq, {values} FROM f)"
)
#: With STEPGUARD_DURABLE_START=0: a start's commit does not wait for the disk.
ANSWER_ASYNCHRONOUS = (
    ", c AS (SELECT set_config('synchronous_commit', 'off', true) AS v)"
    " SELECT (SELECT event_seq FROM f), (SELECT id FROM s), (SELECT v FROM c)"
)
ANSWER = " SELECT (SELECT event_seq FROM f), (SELECT id FROM s), NULL"


#: An event appended without the lease (`run_event`): its seq, and the run's status after.
RUN_EVENT = (
    f"UPDATE {RUN} SET event_seq = event_seq + 1 WHERE id = %(run)s RETURNING event_seq, status"
)
#: The same, waking a waiting run now.
RUN_EVENT_WAKING = (
    f"UPDATE {RUN} SET event_seq = event_seq + 1"
    ", wake_at = CASE WHEN status = %(waiting)s THEN %(now)s ELSE wake_at END"
    ", status = CASE WHEN status = %(waiting)s THEN %(pending)s ELSE status END"
    " WHERE id = %(run)s RETURNING event_seq, status"
)


def assignments(columns: Iterable[str], placeholders: Iterable[str]) -> str:
    return ", ".join(f"{c} = {p}" for c, p in zip(columns, placeholders, strict=True))
