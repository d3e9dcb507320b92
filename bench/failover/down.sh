#!/bin/bash
# Stop everything up.sh started (by the pids it wrote, resuming stopped ones first) and remove the bed.
set -uo pipefail
. "$(dirname "$0")/env.sh"
[ -d "$BED" ] || exit 0
stop() {  # pid file
  [ -f "$1" ] || return 0
  local pid; pid=$(cat "$1")
  kill -0 "$pid" 2>/dev/null && kill -CONT "$pid" && kill -TERM "$pid"
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
  kill -KILL "$pid" 2>/dev/null
}
stop "$BED/haproxy/pid"
for m in $MEMBERS; do
  stop "$BED/$m/patroni.pid"
  if [ -f "$BED/$m/data/postmaster.pid" ]; then
    pm=$(head -1 "$BED/$m/data/postmaster.pid")
    pkill -CONT -P "$pm" 2>/dev/null; kill -CONT "$pm" 2>/dev/null
    runuser -u postgres -- "$PG_BIN/pg_ctl" -D "$BED/$m/data" -m immediate -w stop >/dev/null 2>&1
  fi
done
stop "$BED/etcd/pid"
rm -rf "$BED"
