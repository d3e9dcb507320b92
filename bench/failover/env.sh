# The bed's layout, sourced by up.sh, down.sh and member.sh. Every address is 127.0.0.1.
BED=${FAILOVER_BED:-/var/tmp/stepguard-failover}
PG_BIN=${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)}
ETCD_CLIENT=${FAILOVER_ETCD_PORT:-23790}
ETCD_PEER=$((ETCD_CLIENT + 10))
HAPROXY_PORT=${FAILOVER_HAPROXY_PORT:-5440}
HAPROXY_STATS=$((HAPROXY_PORT + 1000))
MEMBERS="pg1 pg2 pg3"
pg_port() { echo $((HAPROXY_PORT + ${1#pg})); }     # pg1 5441, pg2 5442, pg3 5443
rest_port() { echo $((8017 + ${1#pg})); }             # pg1 8018, pg2 8019, pg3 8020
# etcd (v2 API) is the DCS that fences a woken leader with Debian's Patroni 3.0.2; FAILOVER_DCS=etcd3
# selects the v3 API, which did not (docs/deploy.md).
DCS=${FAILOVER_DCS:-etcd}
TTL=${FAILOVER_TTL:-30}
LOOP_WAIT=${FAILOVER_LOOP_WAIT:-10}
RETRY_TIMEOUT=${FAILOVER_RETRY_TIMEOUT:-10}
SHUTDOWN_SESSIONS=${FAILOVER_SHUTDOWN_SESSIONS:-1}
# HAProxy's check of /primary: Patroni's sample haproxy.cfg by default; FAILOVER_CHECK="inter 1s
# fall 2 rise 1" finds a new leader within a second (docs/deploy.md).
CHECK=${FAILOVER_CHECK:-inter 3s fall 3 rise 2}
