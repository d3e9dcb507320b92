-- name: answer
SELECT (SELECT event_seq FROM f), (SELECT id FROM s), NULL

-- name: answer_asynchronous
, c AS (SELECT set_config('synchronous_commit', 'off', true) AS v) SELECT (SELECT event_seq FROM f), (SELECT id FROM s), (SELECT v FROM c)

-- name: carried
WITH f AS ({fence}), p AS (UPDATE "runs_step" SET {sets} WHERE id = %(pending_step)s AND status = %(started)s AND EXISTS (SELECT 1 FROM f) RETURNING id), pe AS (INSERT INTO "runs_event" (run_id, run_created_at, seq, {event_columns}) SELECT %(run)s::uuid, f.created_at, f.event_seq - %(after)s, {event_values} FROM f WHERE EXISTS (SELECT 1 FROM p))

-- name: claim_due
WITH aged AS (
                SELECT id, status AS was, 0 AS grp, 0 AS prio, wake_at AS at FROM "runs_run"
                WHERE status = ANY(%(wakeable)s) AND wake_at < %(aged_before)s AND ((workflow = %(mine_workflow_0)s AND version = %(mine_version_0)s) OR (workflow = %(mine_workflow_1)s AND version = %(mine_version_1)s))
                  AND NOT (workflow = ANY(%(limited)s))
                  AND NOT (runs_run.halted_at IS NOT NULL OR (substr(runs_run.workflow, 1, 10) <> 'stepguard.' AND EXISTS (SELECT 1 FROM runs_policy hp WHERE hp.halted_at IS NOT NULL AND (hp.scope = '*' OR hp.scope = runs_run.workflow))) OR (runs_run.parent_id IS NOT NULL AND EXISTS (WITH RECURSIVE up(id, parent_id, workflow, halted_at) AS (SELECT ha.id, ha.parent_id, ha.workflow, ha.halted_at FROM runs_run ha WHERE ha.id = runs_run.parent_id UNION ALL SELECT ha.id, ha.parent_id, ha.workflow, ha.halted_at FROM runs_run ha JOIN up ON ha.id = up.parent_id) SELECT 1 FROM up WHERE up.halted_at IS NOT NULL OR EXISTS (SELECT 1 FROM runs_policy hq WHERE hq.halted_at IS NOT NULL AND hq.scope = up.workflow))))
                ORDER BY wake_at
                LIMIT %(limit)s
                FOR UPDATE SKIP LOCKED
            ), due AS (
                SELECT id, status AS was, 1 AS grp, -priority AS prio, wake_at AS at
                FROM "runs_run"
                WHERE status = ANY(%(wakeable)s) AND wake_at <= %(now)s
                  AND wake_at >= %(aged_before)s AND ((workflow = %(mine_workflow_0)s AND version = %(mine_version_0)s) OR (workflow = %(mine_workflow_1)s AND version = %(mine_version_1)s))
                  AND NOT (workflow = ANY(%(limited)s))
                  AND NOT (runs_run.halted_at IS NOT NULL OR (substr(runs_run.workflow, 1, 10) <> 'stepguard.' AND EXISTS (SELECT 1 FROM runs_policy hp WHERE hp.halted_at IS NOT NULL AND (hp.scope = '*' OR hp.scope = runs_run.workflow))) OR (runs_run.parent_id IS NOT NULL AND EXISTS (WITH RECURSIVE up(id, parent_id, workflow, halted_at) AS (SELECT ha.id, ha.parent_id, ha.workflow, ha.halted_at FROM runs_run ha WHERE ha.id = runs_run.parent_id UNION ALL SELECT ha.id, ha.parent_id, ha.workflow, ha.halted_at FROM runs_run ha JOIN up ON ha.id = up.parent_id) SELECT 1 FROM up WHERE up.halted_at IS NOT NULL OR EXISTS (SELECT 1 FROM runs_policy hq WHERE hq.halted_at IS NOT NULL AND hq.scope = up.workflow))))
                ORDER BY priority DESC, wake_at
                LIMIT %(limit)s
                FOR UPDATE SKIP LOCKED
            ), lost AS (
                SELECT id, status AS was, 0 AS grp, 0 AS prio, lease_until AS at
                FROM "runs_run"
                WHERE status = %(running)s AND lease_until < %(now)s AND ((workflow = %(mine_workflow_0)s AND version = %(mine_version_0)s) OR (workflow = %(mine_workflow_1)s AND version = %(mine_version_1)s))
                  AND recoveries + 1 < %(poison)s
                  AND (%(suspects)s OR recoveries + 1 < %(suspect_after)s)
                  AND NOT (runs_run.halted_at IS NOT NULL OR (substr(runs_run.workflow, 1, 10) <> 'stepguard.' AND EXISTS (SELECT 1 FROM runs_policy hp WHERE hp.halted_at IS NOT NULL AND (hp.scope = '*' OR hp.scope = runs_run.workflow))) OR (runs_run.parent_id IS NOT NULL AND EXISTS (WITH RECURSIVE up(id, parent_id, workflow, halted_at) AS (SELECT ha.id, ha.parent_id, ha.workflow, ha.halted_at FROM runs_run ha WHERE ha.id = runs_run.parent_id UNION ALL SELECT ha.id, ha.parent_id, ha.workflow, ha.halted_at FROM runs_run ha JOIN up ON ha.id = up.parent_id) SELECT 1 FROM up WHERE up.halted_at IS NOT NULL OR EXISTS (SELECT 1 FROM runs_policy hq WHERE hq.halted_at IS NOT NULL AND hq.scope = up.workflow))))
                ORDER BY lease_until
                LIMIT %(limit)s
                FOR UPDATE SKIP LOCKED
            ), c AS (
                SELECT id, was FROM (
                    SELECT * FROM lost UNION ALL SELECT * FROM aged UNION ALL SELECT * FROM due
                ) AS all_
                ORDER BY grp, prio, at LIMIT %(limit)s
            ), u AS (
                UPDATE "runs_run" r SET
                    status = %(running)s, worker_id = %(worker)s, lease_until = %(lease_until)s,
                    lease_epoch = r.lease_epoch + 1, event_seq = r.event_seq + 1,
                    recoveries = r.recoveries + CASE WHEN c.was = %(running)s THEN 1 ELSE 0 END,
                    started_at = CASE WHEN r.lease_epoch = 0 THEN %(now)s ELSE r.started_at END
                FROM c WHERE r.id = c.id
                RETURNING r."id", r."workflow", r."version", r."input", r."status", r."output", r."error", r."key", r."parent_id", r."worker_id", r."lease_until", r."lease_epoch", r."wake_at", r."attempt", r."max_attempts", r."recoveries", r."event_seq", r."priority", r."concurrency_key", r."debounce_key", r."tokens_in", r."tokens_out", r."cost_micros", r."budget_micros", r."budget_tokens", r."reserved_micros", r."reserved_tokens", r."possibly_spent_micros", r."possibly_spent_tokens", r."budget_warned", r."halted_at", r."halted_by", r."halt_reason", r."labels", r."forked_from_id", r."forked_at_seq", r."started_by_id", r."cancel_requested_at", r."cancel_requested_by", r."cancel_reason", r."trace_context", r."created_at", r."started_at", r."finished_at", c.was
            ), e AS (
                INSERT INTO "runs_event"
                    (run_id, run_created_at, seq, step_key, type, actor, payload, created_at)
                SELECT id, created_at, event_seq, '',
                    CASE was WHEN %(running)s THEN %(recovered)s
                        WHEN %(waiting)s THEN %(woken)s ELSE %(claimed)s END,
                    'system', jsonb_build_object('worker', %(worker_text)s::text,
                        'epoch', lease_epoch), %(now)s
                FROM u
            )
            SELECT * FROM u ORDER BY wake_at

-- name: claim_limited
WITH running AS (
                SELECT concurrency_key AS k, count(*) AS n FROM "runs_run"
                WHERE workflow = %(workflow)s AND status = %(running)s GROUP BY concurrency_key
            ), room AS (
                SELECT GREATEST(0, LEAST(%(free)s::int,
                    COALESCE(%(total)s::int - (SELECT COALESCE(sum(n), 0) FROM running),
                        %(free)s::int)
                )) AS n
            ), locked AS (
                SELECT id, status AS was, concurrency_key AS k, priority, wake_at,
                    (status = ANY(%(wakeable)s) AND wake_at < %(aged_before)s) AS aged
                FROM "runs_run"
                WHERE workflow = %(workflow)s AND status = ANY(%(wakeable)s)
                  AND wake_at <= %(now)s AND ((workflow = %(mine_workflow_0)s AND version = %(mine_version_0)s) OR (workflow = %(mine_workflow_1)s AND version = %(mine_version_1)s))
                  AND NOT (runs_run.halted_at IS NOT NULL OR (substr(runs_run.workflow, 1, 10) <> 'stepguard.' AND EXISTS (SELECT 1 FROM runs_policy hp WHERE hp.halted_at IS NOT NULL AND (hp.scope = '*' OR hp.scope = runs_run.workflow))) OR (runs_run.parent_id IS NOT NULL AND EXISTS (WITH RECURSIVE up(id, parent_id, workflow, halted_at) AS (SELECT ha.id, ha.parent_id, ha.workflow, ha.halted_at FROM runs_run ha WHERE ha.id = runs_run.parent_id UNION ALL SELECT ha.id, ha.parent_id, ha.workflow, ha.halted_at FROM runs_run ha JOIN up ON ha.id = up.parent_id) SELECT 1 FROM up WHERE up.halted_at IS NOT NULL OR EXISTS (SELECT 1 FROM runs_policy hq WHERE hq.halted_at IS NOT NULL AND hq.scope = up.workflow))))
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
                    row_number() OVER (PARTITION BY l.k ORDER BY aged DESC, CASE WHEN aged THEN 0 ELSE priority END DESC, wake_at)
                        + COALESCE(r.n, 0) AS load
                FROM locked l LEFT JOIN running r ON r.k = l.k
            ), c AS (
                SELECT id, was FROM ranked
                WHERE %(per_key)s::int IS NULL OR load <= %(per_key)s::int
                ORDER BY aged DESC, CASE WHEN aged THEN 0 ELSE priority END DESC, wake_at
                LIMIT (SELECT n FROM room)
            ), u AS (
                UPDATE "runs_run" r SET
                    status = %(running)s, worker_id = %(worker)s, lease_until = %(lease_until)s,
                    lease_epoch = r.lease_epoch + 1, event_seq = r.event_seq + 1,
                    recoveries = r.recoveries + CASE WHEN c.was = %(running)s THEN 1 ELSE 0 END,
                    started_at = CASE WHEN r.lease_epoch = 0 THEN %(now)s ELSE r.started_at END
                FROM c WHERE r.id = c.id
                RETURNING r."id", r."workflow", r."version", r."input", r."status", r."output", r."error", r."key", r."parent_id", r."worker_id", r."lease_until", r."lease_epoch", r."wake_at", r."attempt", r."max_attempts", r."recoveries", r."event_seq", r."priority", r."concurrency_key", r."debounce_key", r."tokens_in", r."tokens_out", r."cost_micros", r."budget_micros", r."budget_tokens", r."reserved_micros", r."reserved_tokens", r."possibly_spent_micros", r."possibly_spent_tokens", r."budget_warned", r."halted_at", r."halted_by", r."halt_reason", r."labels", r."forked_from_id", r."forked_at_seq", r."started_by_id", r."cancel_requested_at", r."cancel_requested_by", r."cancel_reason", r."trace_context", r."created_at", r."started_at", r."finished_at", c.was
            ), e AS (
                INSERT INTO "runs_event"
                    (run_id, run_created_at, seq, step_key, type, actor, payload, created_at)
                SELECT id, created_at, event_seq, '',
                    CASE was WHEN %(running)s THEN %(recovered)s
                        WHEN %(waiting)s THEN %(woken)s ELSE %(claimed)s END,
                    'system', jsonb_build_object('worker', %(worker_text)s::text,
                        'epoch', lease_epoch), %(now)s
                FROM u
            )
            SELECT * FROM u ORDER BY wake_at

-- name: event_appended
, e AS (INSERT INTO "runs_event" (run_id, run_created_at, seq, {columns}) SELECT %(run)s::uuid, f.created_at, f.event_seq, {values} FROM f)

-- name: fence
UPDATE runs_run SET event_seq = event_seq + %(events)s WHERE id = %(run)s AND lease_epoch = %(epoch)s AND status = %(running)s RETURNING event_seq, created_at

-- name: fence_compensation_start
UPDATE runs_run SET event_seq = event_seq + %(events)s, reserved_micros = reserved_micros + %(reserve_micros)s, reserved_tokens = reserved_tokens + %(reserve_tokens)s WHERE id = %(run)s AND lease_epoch = %(epoch)s AND status = %(running)s AND NOT (runs_run.halted_at IS NOT NULL OR (substr(runs_run.workflow, 1, 10) <> 'stepguard.' AND EXISTS (SELECT 1 FROM runs_policy hp WHERE hp.halted_at IS NOT NULL AND (hp.scope = '*' OR hp.scope = runs_run.workflow))) OR (runs_run.parent_id IS NOT NULL AND EXISTS (WITH RECURSIVE up(id, parent_id, workflow, halted_at) AS (SELECT ha.id, ha.parent_id, ha.workflow, ha.halted_at FROM runs_run ha WHERE ha.id = runs_run.parent_id UNION ALL SELECT ha.id, ha.parent_id, ha.workflow, ha.halted_at FROM runs_run ha JOIN up ON ha.id = up.parent_id) SELECT 1 FROM up WHERE up.halted_at IS NOT NULL OR EXISTS (SELECT 1 FROM runs_policy hq WHERE hq.halted_at IS NOT NULL AND hq.scope = up.workflow)))) RETURNING event_seq, created_at

-- name: fence_events
event_seq = event_seq + %(events)s

-- name: fence_finish
UPDATE runs_run SET event_seq = event_seq + %(events)s, cost_micros = cost_micros + %(spent_micros)s, tokens_in = tokens_in + %(tokens_in)s, tokens_out = tokens_out + %(tokens_out)s, reserved_micros = CASE WHEN reserved_micros > %(given_micros)s THEN reserved_micros - %(given_micros)s ELSE 0 END, reserved_tokens = CASE WHEN reserved_tokens > %(given_tokens)s THEN reserved_tokens - %(given_tokens)s ELSE 0 END, recoveries = 0 WHERE id = %(run)s AND lease_epoch = %(epoch)s AND status = %(running)s RETURNING event_seq, created_at

-- name: fence_in_budget
AND (budget_micros IS NULL OR (cost_micros + reserved_micros + possibly_spent_micros + %(want_micros)s <= budget_micros AND cost_micros + reserved_micros + possibly_spent_micros - %(held_micros)s < budget_micros)) AND (budget_tokens IS NULL OR (tokens_in + tokens_out + reserved_tokens + possibly_spent_tokens + %(want_tokens)s <= budget_tokens AND tokens_in + tokens_out + reserved_tokens + possibly_spent_tokens - %(held_tokens)s < budget_tokens))

-- name: fence_interrupted
UPDATE runs_run SET event_seq = event_seq + %(events)s, possibly_spent_micros = possibly_spent_micros + %(possibly_micros)s, possibly_spent_tokens = possibly_spent_tokens + %(possibly_tokens)s WHERE id = %(run)s AND lease_epoch = %(epoch)s AND status = %(running)s RETURNING event_seq, created_at

-- name: fence_not_cancelled
AND cancel_requested_at IS NULL

-- name: fence_not_held
AND NOT (runs_run.halted_at IS NOT NULL OR (substr(runs_run.workflow, 1, 10) <> 'stepguard.' AND EXISTS (SELECT 1 FROM runs_policy hp WHERE hp.halted_at IS NOT NULL AND (hp.scope = '*' OR hp.scope = runs_run.workflow))) OR (runs_run.parent_id IS NOT NULL AND EXISTS (WITH RECURSIVE up(id, parent_id, workflow, halted_at) AS (SELECT ha.id, ha.parent_id, ha.workflow, ha.halted_at FROM runs_run ha WHERE ha.id = runs_run.parent_id UNION ALL SELECT ha.id, ha.parent_id, ha.workflow, ha.halted_at FROM runs_run ha JOIN up ON ha.id = up.parent_id) SELECT 1 FROM up WHERE up.halted_at IS NOT NULL OR EXISTS (SELECT 1 FROM runs_policy hq WHERE hq.halted_at IS NOT NULL AND hq.scope = up.workflow))))

-- name: fence_possibly
, possibly_spent_micros = possibly_spent_micros + %(possibly_micros)s, possibly_spent_tokens = possibly_spent_tokens + %(possibly_tokens)s

-- name: fence_progress
, recoveries = 0

-- name: fence_reserve
, reserved_micros = reserved_micros + %(reserve_micros)s, reserved_tokens = reserved_tokens + %(reserve_tokens)s

-- name: fence_returning
RETURNING event_seq, created_at

-- name: fence_settle
, cost_micros = cost_micros + %(spent_micros)s, tokens_in = tokens_in + %(tokens_in)s, tokens_out = tokens_out + %(tokens_out)s, reserved_micros = CASE WHEN reserved_micros > %(given_micros)s THEN reserved_micros - %(given_micros)s ELSE 0 END, reserved_tokens = CASE WHEN reserved_tokens > %(given_tokens)s THEN reserved_tokens - %(given_tokens)s ELSE 0 END

-- name: fence_start
UPDATE runs_run SET event_seq = event_seq + %(events)s, reserved_micros = reserved_micros + %(reserve_micros)s, reserved_tokens = reserved_tokens + %(reserve_tokens)s WHERE id = %(run)s AND lease_epoch = %(epoch)s AND status = %(running)s AND cancel_requested_at IS NULL AND NOT (runs_run.halted_at IS NOT NULL OR (substr(runs_run.workflow, 1, 10) <> 'stepguard.' AND EXISTS (SELECT 1 FROM runs_policy hp WHERE hp.halted_at IS NOT NULL AND (hp.scope = '*' OR hp.scope = runs_run.workflow))) OR (runs_run.parent_id IS NOT NULL AND EXISTS (WITH RECURSIVE up(id, parent_id, workflow, halted_at) AS (SELECT ha.id, ha.parent_id, ha.workflow, ha.halted_at FROM runs_run ha WHERE ha.id = runs_run.parent_id UNION ALL SELECT ha.id, ha.parent_id, ha.workflow, ha.halted_at FROM runs_run ha JOIN up ON ha.id = up.parent_id) SELECT 1 FROM up WHERE up.halted_at IS NOT NULL OR EXISTS (SELECT 1 FROM runs_policy hq WHERE hq.halted_at IS NOT NULL AND hq.scope = up.workflow)))) AND (budget_micros IS NULL OR (cost_micros + reserved_micros + possibly_spent_micros + %(want_micros)s <= budget_micros AND cost_micros + reserved_micros + possibly_spent_micros - %(held_micros)s < budget_micros)) AND (budget_tokens IS NULL OR (tokens_in + tokens_out + reserved_tokens + possibly_spent_tokens + %(want_tokens)s <= budget_tokens AND tokens_in + tokens_out + reserved_tokens + possibly_spent_tokens - %(held_tokens)s < budget_tokens)) RETURNING event_seq, created_at

-- name: fence_where
WHERE id = %(run)s AND lease_epoch = %(epoch)s AND status = %(running)s

-- name: mine
{mine}

-- name: no_step
, s AS (SELECT NULL::bigint AS id)

-- name: not_carried
WITH f AS ({fence})

-- name: run_event
UPDATE runs_run SET event_seq = event_seq + 1 WHERE id = %(run)s RETURNING event_seq, status

-- name: run_event_waking
UPDATE runs_run SET event_seq = event_seq + 1, wake_at = CASE WHEN status = %(waiting)s THEN %(now)s ELSE wake_at END, status = CASE WHEN status = %(waiting)s THEN %(pending)s ELSE status END WHERE id = %(run)s RETURNING event_seq, status

-- name: step_inserted
, s AS (INSERT INTO "runs_step" (run_id, {columns}) SELECT %(run)s::uuid, {values} FROM f RETURNING id)

-- name: step_updated
, s AS (UPDATE "runs_step" SET {sets} WHERE id = %(step)s AND EXISTS (SELECT 1 FROM f) RETURNING id)

-- name: take_claimed
, u AS (
                UPDATE "runs_run" r SET
                    status = %(running)s, worker_id = %(worker)s, lease_until = %(lease_until)s,
                    lease_epoch = r.lease_epoch + 1, event_seq = r.event_seq + 1,
                    recoveries = r.recoveries + CASE WHEN c.was = %(running)s THEN 1 ELSE 0 END,
                    started_at = CASE WHEN r.lease_epoch = 0 THEN %(now)s ELSE r.started_at END
                FROM c WHERE r.id = c.id
                RETURNING r."id", r."workflow", r."version", r."input", r."status", r."output", r."error", r."key", r."parent_id", r."worker_id", r."lease_until", r."lease_epoch", r."wake_at", r."attempt", r."max_attempts", r."recoveries", r."event_seq", r."priority", r."concurrency_key", r."debounce_key", r."tokens_in", r."tokens_out", r."cost_micros", r."budget_micros", r."budget_tokens", r."reserved_micros", r."reserved_tokens", r."possibly_spent_micros", r."possibly_spent_tokens", r."budget_warned", r."halted_at", r."halted_by", r."halt_reason", r."labels", r."forked_from_id", r."forked_at_seq", r."started_by_id", r."cancel_requested_at", r."cancel_requested_by", r."cancel_reason", r."trace_context", r."created_at", r."started_at", r."finished_at", c.was
            ), e AS (
                INSERT INTO "runs_event"
                    (run_id, run_created_at, seq, step_key, type, actor, payload, created_at)
                SELECT id, created_at, event_seq, '',
                    CASE was WHEN %(running)s THEN %(recovered)s
                        WHEN %(waiting)s THEN %(woken)s ELSE %(claimed)s END,
                    'system', jsonb_build_object('worker', %(worker_text)s::text,
                        'epoch', lease_epoch), %(now)s
                FROM u
            )
            SELECT * FROM u ORDER BY wake_at

