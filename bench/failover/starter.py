"""Starts runs until a stop file appears (or `--seconds` pass), one every `--every` s, and
appends each id that `start_run` returned (acknowledged) to `--out`: what a caller was told
exists. Failures (the database down or moving) are counted and retried after a short wait."""

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")

import django  # noqa: E402

django.setup()

from django.db import Error, connection  # noqa: E402

import bench.failover.workflows  # noqa: E402, F401 - registers bench.failover
from runs.sdk import start_run  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    for name in ("--out", "--stop", "--dir"):
        parser.add_argument(name, required=True)
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--every", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sleep", type=float, default=0.2)
    args = parser.parse_args()
    deadline, failures = time.monotonic() + args.seconds, 0
    payload = {"dir": args.dir, "steps": args.steps, "sleep": args.sleep}
    with open(args.out, "a") as out:
        while time.monotonic() < deadline and not os.path.exists(args.stop):
            began = time.monotonic()
            try:
                run = start_run("bench.failover", payload)
            except Error:  # a database that is down or moving: try again
                failures += 1
                connection.close()
                time.sleep(0.2)
                continue
            out.write(f"{run.id}\n")
            out.flush()
            time.sleep(max(0.0, args.every - (time.monotonic() - began)))
    print(f"start failures {failures}")


if __name__ == "__main__":
    main()
