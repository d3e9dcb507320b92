"""Issue 48's failover bench: what each fault of a Patroni cluster costs the workers.

Runs against the bed of up.sh (etcd, three PostgreSQL members under Patroni in
synchronous_mode, HAProxy on Patroni's /primary check with `on-marked-down shutdown-sessions`),
through HAProxy's port like a deployment. For each fault: a starter process starts runs
(`bench.failover`, 10 steps of 0.2 s, each logging its idempotency key to a file before it
returns) and three worker processes run them; the fault strikes the leader; the bed is healed;
every acknowledged run must complete. Printed per fault:

- runs acknowledged by `start_run`, and runs lost (acknowledged, then missing on the leader);
- steps re-run: keys logged twice, marked (the step's row says `resent`) or unmarked;
- seconds from the fault to the first step completed on the new leader, and from the new
  leader taking the lock (seen on Patroni's REST API every 0.1 s) to that step.

    bench/failover/up.sh && python bench/failover/bench.py; bench/failover/down.sh

`--faults switchover,crash` picks some; `--short` is one switchover (a form CI could run).
"""

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import psycopg

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
BED = Path(os.environ.get("FAILOVER_BED", "/var/tmp/stepguard-failover"))
HAPROXY_PORT = int(os.environ.get("FAILOVER_HAPROXY_PORT", "5440"))
MEMBERS = ("pg1", "pg2", "pg3")
PG_PORT = {m: HAPROXY_PORT + i for i, m in enumerate(MEMBERS, 1)}
REST_PORT = {m: 8017 + i for i, m in enumerate(MEMBERS, 1)}
URL = f"postgres://postgres:postgres@127.0.0.1:{HAPROXY_PORT}/stepguard"
HANG_SECONDS = float(os.environ.get("FAILOVER_HANG_SECONDS", "60"))
ENV = {
    **os.environ,
    "DATABASE_URL": URL,
    "DJANGO_SETTINGS_MODULE": "controlplane.settings",
    "DEBUG": "0",
    "SECRET_KEY": "stepguard-bench-throwaway-not-a-secret",
    "LOG_LEVEL": "WARNING",
    "PYTHONPATH": str(ROOT),
}


def rest(member: str, path: str, timeout: float = 0.5) -> dict | None:
    try:
        with urllib.request.urlopen(
            f"http://127.0.0.1:{REST_PORT[member]}{path}", timeout=timeout
        ) as answer:
            return json.loads(answer.read() or b"{}")
    except Exception:  # down, hung, or 503: no answer
        return None


ETCD = f"http://127.0.0.1:{os.environ.get('FAILOVER_ETCD_PORT', '23790')}"


def leader(skip: str | None = None) -> str | None:
    """The leader lock's holder: etcd's key itself (v2 API), else Patroni's /cluster as members
    other than `skip` see it."""
    if os.environ.get("FAILOVER_DCS", "etcd") == "etcd":
        try:
            url = f"{ETCD}/v2/keys/service/stepguard-bed/leader"
            with urllib.request.urlopen(url, timeout=0.5) as answer:
                return json.loads(answer.read())["node"]["value"]
        except Exception:  # no key (expired) or no answer
            return None
    for m in MEMBERS:
        if m == skip:
            continue
        cluster = rest(m, "/cluster")
        if cluster:
            return next((x["name"] for x in cluster["members"] if x["role"] == "leader"), None)
    return None


def query(member: str, sql: str, params=()) -> list[tuple] | None:
    try:
        with psycopg.connect(
            host="127.0.0.1", port=PG_PORT[member], user="postgres", password="postgres",
            dbname="stepguard", connect_timeout=3,
        ) as conn:  # fmt: skip
            return conn.execute(sql, params).fetchall()
    except psycopg.Error:
        return None


def wait(what: str, condition, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")


def pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def postgres_pids(member: str) -> list[int]:
    postmaster = pid(BED / member / "data" / "postmaster.pid")
    if postmaster is None:
        return []
    children = subprocess.run(["pgrep", "-P", str(postmaster)], capture_output=True, text=True)
    return [postmaster, *map(int, children.stdout.split())]


def signal_pids(pids: list[int], sig: int) -> None:
    for p in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, sig)


def healthy() -> str | None:
    """The leader's name once all three members run, one synchronous standby streams, and
    HAProxy routes to the leader alone."""
    cluster = rest("pg1", "/cluster") or rest("pg2", "/cluster") or rest("pg3", "/cluster")
    if not cluster or len(cluster["members"]) != 3:
        return None
    roles = Counter(x["role"] for x in cluster["members"])
    states = {x["state"] for x in cluster["members"]}
    if roles["leader"] != 1 or roles["sync_standby"] != 1 or not states <= {"running", "streaming"}:
        return None
    name = next(x["name"] for x in cluster["members"] if x["role"] == "leader")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{HAPROXY_PORT + 1000}/;csv") as answer:
            up = [r.split(",")[1] for r in answer.read().decode().splitlines() if ",UP," in r]
    except OSError:
        return None
    return name if [s for s in up if s in MEMBERS] == [name] else None


def heal() -> str:
    for m in MEMBERS:
        subprocess.run([str(HERE / "member.sh"), m], check=True)
    return wait("the cluster to heal (3 members, a sync standby)", healthy, 240)


class LockWatch(threading.Thread):
    """Notes when a member other than `old` holds the leader lock (polled every 0.1 s)."""

    def __init__(self, old: str):
        super().__init__(daemon=True)
        self.old, self.at, self.new, self.stop = old, None, None, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set() and self.at is None:
            now = leader(skip=self.old)
            if now and now != self.old:
                self.at, self.new = time.time(), now
            time.sleep(0.1)


def switchover(old: str) -> None:
    """A planned switchover, as `patronictl switchover --force` asks it: to the synchronous
    standby (in synchronous_mode, Patroni refuses any other candidate with a 412)."""
    members = (rest(old, "/cluster") or {"members": []})["members"]
    candidate = next(x["name"] for x in members if x["role"] == "sync_standby")
    body = json.dumps({"leader": old, "candidate": candidate}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{REST_PORT[old]}/switchover", data=body, method="POST"
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        answer.read()


def crash(old: str) -> None:
    """The leader's host dies: its Patroni and every PostgreSQL process, SIGKILL, at once."""
    signal_pids([pid(BED / old / "patroni.pid") or 0, *postgres_pids(old)], signal.SIGKILL)


def dead_patroni(old: str) -> None:
    """Only the leader's Patroni dies (SIGKILL); its PostgreSQL runs on, writable."""
    signal_pids([pid(BED / old / "patroni.pid") or 0], signal.SIGKILL)


def hang(old: str) -> None:
    """The leader's PostgreSQL hangs (every process SIGSTOPped) for HANG_SECONDS, then wakes;
    Patroni itself runs on."""
    pids = postgres_pids(old)
    signal_pids(pids, signal.SIGSTOP)
    timer = threading.Timer(HANG_SECONDS, signal_pids, (pids, signal.SIGCONT))
    timer.daemon = True
    timer.start()
    hang.timer = timer  # type: ignore[attr-defined]


FAULTS = {"switchover": switchover, "crash": crash, "hang": hang, "dead-patroni": dead_patroni}


def start_workers() -> subprocess.Popen:
    argv = [
        sys.executable, "manage.py", "runworker", "--processes", "3", "--concurrency", "4",
        "--import", "bench.failover.workflows", "--verbosity", "0",
    ]  # fmt: skip
    log = open(BED / "workers.log", "a")  # noqa: SIM115 - the workers' lifetime
    return subprocess.Popen(argv, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT)


def effects(directory: Path) -> list[dict]:
    return [
        json.loads(line)
        for path in sorted(directory.glob("effects-*.jsonl"))
        for line in path.read_text().splitlines()
        if line.strip()
    ]


def first_step_after(member: str, at: float) -> float | None:
    rows = query(
        member,
        "SELECT extract(epoch FROM min(finished_at)) FROM runs_step"
        " WHERE status = 'completed' AND finished_at > %s",
        (dt.datetime.fromtimestamp(at, dt.UTC),),
    )
    return float(rows[0][0]) if rows and rows[0][0] is not None else None


def round_(name: str, work: Path, settle: float) -> dict:
    """One fault under load; the bed is healed before it returns."""
    old = heal()
    directory = work / name
    directory.mkdir()
    directory.chmod(0o777)
    acked, stop = directory / "acked.txt", directory / "stop"
    starter = subprocess.Popen(
        [sys.executable, str(HERE / "starter.py"), "--out", str(acked), "--stop", str(stop),
         "--dir", str(directory), "--seconds", "400"],
        cwd=ROOT, env=ENV, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        time.sleep(settle)  # load before the fault: runs in flight when it strikes
        if starter.poll() is not None or not acked.read_text().strip():
            raise RuntimeError(f"the starter acknowledged no run: {starter.communicate()}")
        watch = LockWatch(old)
        watch.start()
        struck = time.time()
        FAULTS[name](old)
        wait("a new leader", lambda: watch.at, 180)
        new = watch.new
        first = wait("a step on the new leader", lambda: first_step_after(new, watch.at), 240)
        if name == "hang":
            hang.timer.join()  # type: ignore[attr-defined]
        time.sleep(settle)  # load after: the woken or restarted old leader rejoins under it
    finally:
        stop.touch()
        out, _ = starter.communicate(timeout=60)
    leader_now = heal()
    ids = [line for line in acked.read_text().split() if line]
    finished = (
        "SELECT count(*) FROM runs_run WHERE id::text = ANY(%s)"
        " AND status IN ('completed', 'failed', 'cancelled')"
    )
    present = "SELECT count(*) FROM runs_run WHERE id::text = ANY(%s)"

    def settled():
        done, there = query(leader_now, finished, (ids,)), query(leader_now, present, (ids,))
        return done and there and done[0][0] == there[0][0] and (there[0][0],)

    (kept,) = wait("every acknowledged run to end", settled, 300)
    return {
        "fault": name, "old": old, "new": new, "acked": len(ids), "lost": len(ids) - kept,
        **reruns(leader_now, directory, ids), "starter": out.strip(),
        "fault_to_step": first - struck, "lock_to_step": first - watch.at,
        "fault_to_lock": watch.at - struck,
    }  # fmt: skip


def reruns(member: str, directory: Path, ids: list[str]) -> dict:
    calls = Counter(e["key"] for e in effects(directory))
    again = [k for k, n in calls.items() if n > 1]
    rows = (
        query(
            member,
            "SELECT idempotency_key, recovered, status FROM runs_step"
            " WHERE idempotency_key = ANY(%s)",
            (again,),
        )
        or []
    )
    marked = {k for k, how, _ in rows if how == "resent"}
    failed = query(
        member,
        "SELECT count(*) FROM runs_run WHERE id::text = ANY(%s) AND status <> 'completed'",
        (ids,),
    )
    return {
        "steps": sum(calls.values()), "marked": len(marked), "unmarked": len(again) - len(marked),
        "not_completed_runs": failed[0][0] if failed else None,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--faults", default="switchover,crash,dead-patroni,hang")
    parser.add_argument("--settle", type=float, default=8.0, help="seconds of load each side")
    parser.add_argument("--short", action="store_true", help="one switchover")
    args = parser.parse_args()
    faults = ["switchover"] if args.short else args.faults.split(",")
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        parser.error(f"unknown fault(s) {unknown}: choose from {sorted(FAULTS)}")
    heal()
    with psycopg.connect(URL.replace("/stepguard", "/postgres"), autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS stepguard WITH (FORCE)")  # a fresh one each time
        conn.execute("CREATE DATABASE stepguard")
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "-v", "0"], cwd=ROOT, env=ENV, check=True
    )
    work = Path(tempfile.mkdtemp(prefix="stepguard-failover-"))
    work.chmod(0o777)
    workers = start_workers()
    results = []
    try:
        live = "SELECT count(*) FROM runs_worker WHERE stopped_at IS NULL"
        wait("3 workers", lambda: (query(heal(), live) or [(0,)])[0][0] == 3, 120)
        # runworker --processes stops every worker when one exits within 10 s of starting,
        # and a worker then exits on a lost connection (reported in bench/README.md): the
        # first fault strikes after that.
        time.sleep(12)
        for name in faults:
            print(f"-- {name}", flush=True)
            results.append(round_(name, work, args.settle))
            print(json.dumps(results[-1]), flush=True)
    finally:
        workers.send_signal(signal.SIGTERM)
        try:
            workers.wait(timeout=60)
        except subprocess.TimeoutExpired:
            workers.kill()
        shutil.rmtree(work, ignore_errors=True)
    report(results)


def report(results: list[dict]) -> None:
    print(
        "\n| fault | runs acknowledged | runs lost | steps | re-run marked | re-run unmarked "
        "| fault to lock (s) | lock to first step (s) | fault to first step (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['fault']} ({r['old']} to {r['new']}) | {r['acked']} | {r['lost']} | {r['steps']}"
            f" | {r['marked']} | {r['unmarked']} | {r['fault_to_lock']:.1f}"
            f" | {r['lock_to_step']:.2f} | {r['fault_to_step']:.1f} |"
        )


if __name__ == "__main__":
    main()
