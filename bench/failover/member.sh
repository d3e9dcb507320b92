#!/bin/bash
# Start one member's Patroni (as postgres) if it is not running: `member.sh pg2`.
set -euo pipefail
. "$(dirname "$0")/env.sh"
m=$1
pidfile=$BED/$m/patroni.pid
if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then exit 0; fi
# A killed postgres may leave its postmaster.pid; Patroni starts it anew either way.
runuser -u postgres -- bash -c "exec setsid patroni '$BED/$m/patroni.yml' >>'$BED/$m/patroni.log' 2>&1 & echo \$! >'$pidfile'"
