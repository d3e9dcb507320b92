#!/bin/bash
# The failover bed: one etcd, three PostgreSQL members each run by Patroni (synchronous_mode),
# HAProxy routing to the member whose Patroni answers 200 on /primary. All on 127.0.0.1.
# Prints the DATABASE_URL to use. down.sh undoes it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
. "$here/env.sh"
for cmd in etcd patroni haproxy; do
  command -v $cmd >/dev/null || { echo "missing $cmd: apt-get install -y patroni etcd-server etcd-client haproxy" >&2; exit 2; }
done
[ -e "$BED" ] && { echo "$BED exists: run down.sh first" >&2; exit 2; }
mkdir -p "$BED/etcd"
chmod 755 "$BED"

setsid etcd --name bed --data-dir "$BED/etcd/data" \
  --listen-client-urls http://127.0.0.1:$ETCD_CLIENT --advertise-client-urls http://127.0.0.1:$ETCD_CLIENT \
  --listen-peer-urls http://127.0.0.1:$ETCD_PEER --initial-advertise-peer-urls http://127.0.0.1:$ETCD_PEER \
  --initial-cluster bed=http://127.0.0.1:$ETCD_PEER --enable-v2=true \
  >"$BED/etcd/log" 2>&1 &
echo $! >"$BED/etcd/pid"
for _ in $(seq 100); do curl -sf http://127.0.0.1:$ETCD_CLIENT/health >/dev/null && break; sleep 0.1; done
curl -sf http://127.0.0.1:$ETCD_CLIENT/health >/dev/null || { echo "etcd did not start: $BED/etcd/log" >&2; exit 1; }

for m in $MEMBERS; do
  mkdir -p "$BED/$m"
  cat >"$BED/$m/patroni.yml" <<YAML
scope: stepguard-bed
name: $m
restapi:
  listen: 127.0.0.1:$(rest_port $m)
  connect_address: 127.0.0.1:$(rest_port $m)
$DCS:
  host: 127.0.0.1:$ETCD_CLIENT
bootstrap:
  dcs:
    ttl: $TTL
    loop_wait: $LOOP_WAIT
    retry_timeout: $RETRY_TIMEOUT
    maximum_lag_on_failover: 1048576
    synchronous_mode: true
    postgresql:
      use_pg_rewind: true
      parameters:
        wal_level: replica
        hot_standby: "on"
        wal_log_hints: "on"
        max_wal_senders: 10
        max_replication_slots: 10
        max_connections: 100
        shared_buffers: 32MB
  initdb:
  - encoding: UTF8
  - auth: trust
  pg_hba:
  - host replication replicator 127.0.0.1/32 trust
  - host all all 127.0.0.1/32 trust
postgresql:
  listen: 127.0.0.1:$(pg_port $m)
  connect_address: 127.0.0.1:$(pg_port $m)
  data_dir: $BED/$m/data
  bin_dir: $PG_BIN
  pgpass: $BED/$m/pgpass
  authentication:
    replication: {username: replicator, password: replicator}
    superuser: {username: postgres, password: postgres}
    rewind: {username: postgres, password: postgres}
  parameters:
    unix_socket_directories: '$BED/$m'
watchdog:
  mode: "off"
tags: {nofailover: false, noloadbalance: false, clonefrom: false, nosync: false}
YAML
  chown -R postgres: "$BED/$m"
done
"$here/member.sh" pg1
# pg1 bootstraps alone first, so it is the leader the bench starts from.
for _ in $(seq 300); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' http://127.0.0.1:$(rest_port pg1)/primary)" = 200 ] && break
  sleep 0.2
done
"$here/member.sh" pg2
"$here/member.sh" pg3

ssopt=""
[ "$SHUTDOWN_SESSIONS" = 1 ] && ssopt="on-marked-down shutdown-sessions"
mkdir -p "$BED/haproxy"
{
  cat <<CFG
global
    maxconn 300
defaults
    mode tcp
    retries 2
    timeout client 30m
    timeout connect 4s
    timeout server 30m
    timeout check 5s
listen stats
    mode http
    bind 127.0.0.1:$HAPROXY_STATS
    stats enable
    stats uri /
listen primary
    bind 127.0.0.1:$HAPROXY_PORT
    option httpchk OPTIONS /primary
    http-check expect status 200
    default-server $CHECK $ssopt
CFG
  for m in $MEMBERS; do
    echo "    server $m 127.0.0.1:$(pg_port $m) maxconn 100 check port $(rest_port $m)"
  done
} >"$BED/haproxy/haproxy.cfg"
haproxy -f "$BED/haproxy/haproxy.cfg" -D -p "$BED/haproxy/pid"

url="postgres://postgres:postgres@127.0.0.1:$HAPROXY_PORT/stepguard"
# HAProxy starts every server as up; wait until its checks leave exactly the leader.
for _ in $(seq 150); do
  [ "$(curl -s "127.0.0.1:$HAPROXY_STATS/;csv" | grep -c '^primary,pg[0-9],UP')" = 1 ] && break
  sleep 0.2
done
for _ in $(seq 50); do
  psql "postgres://postgres:postgres@127.0.0.1:$HAPROXY_PORT/postgres" -qc 'CREATE DATABASE stepguard' >/dev/null 2>&1 && break
  sleep 0.2
done
psql "$url" -Atc 'select 1' >/dev/null || { echo "no database through HAProxy" >&2; exit 1; }
echo "DATABASE_URL=$url"
