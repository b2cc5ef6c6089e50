#!/usr/bin/env bash
# A throwaway one-node Ceph cluster serving S3 (radosgw) on 127.0.0.1, for the S3 tests.
#
#   scripts/setup/radosgw.sh start DIR [OWNER_PID]   -> last stdout line: http://127.0.0.1:PORT
#   scripts/setup/radosgw.sh stop DIR
#
# start: one monitor, one memstore OSD (data in RAM) and radosgw, no authentication (auth none),
# everything bound to 127.0.0.1 on free ports; every file (ceph.conf, mon store, logs, pid files,
# admin sockets) lives under DIR, nothing under /etc/ceph or /var/lib/ceph. Creates the S3 user
# access key "testing", secret "testing"; waits until the endpoint answers HTTP. On failure it
# prints a one-line reason and the tail of the relevant log on stderr, stops what it started and
# exits non-zero. With OWNER_PID (or $RADOSGW_OWNER_PID), a watchdog stops the cluster once that
# process is gone, so a test run killed hard leaves no daemons behind.
#
# stop: kills (SIGKILL) every process start recorded under DIR, waits until they are gone, and
# removes what start created under DIR (DIR itself too if that leaves it empty).
#
# Needs radosgw, ceph-mon, ceph-osd, radosgw-admin, ceph, monmaptool (scripts/setup/install_radosgw.sh).
# Environment: RADOSGW_START_TIMEOUT (seconds for the whole start, default 120); RADOSGW_KEEP=1
# (stop, and start on failure, kill the daemons but keep DIR, logs included, for a post-mortem);
# RADOSGW_MEMSTORE_GIB (the OSD's RAM device, default 4: the benchmarks keep several checkpoints).
set -euo pipefail

usage() { echo "usage: $0 start DIR [OWNER_PID] | stop DIR" >&2; exit 2; }
[ $# -ge 2 ] || usage
CMD=$1
DIR=$2

# -- stop -------------------------------------------------------------------------------------

# DIR/run/*.pid: the pids start recorded (daemons, watchdog).
stop_cluster() {
    local dir=$1 f pid pids=() i
    [ -d "$dir" ] || return 0
    if [ -d "$dir/run" ]; then
        for f in "$dir"/run/*.pid; do
            [ -f "$f" ] || continue
            pid=$(tr -dc '0-9' <"$f" || true)
            if [ -z "$pid" ] || [ "$pid" = $$ ]; then continue; fi
            # Only signal a process that still runs one of ours (pids get reused): a daemon's
            # command line holds "-c DIR/ceph.conf", the watchdog's holds DIR as an argument.
            if [ -r "/proc/$pid/cmdline" ] && { tr '\0' ' ' <"/proc/$pid/cmdline"; echo; } \
                | grep -qF -e "$dir/ceph.conf " -e " $dir "; then
                pids+=("$pid")
            fi
        done
    fi
    if [ ${#pids[@]} -gt 0 ]; then
        # SIGKILL straight away: nothing here is worth keeping, and a memstore OSD told to shut
        # down cleanly first writes all its objects out to its data directory.
        kill -KILL "${pids[@]}" 2>/dev/null || true
        for ((i = 0; i < 100; i++)); do  # up to 10 s for them to be gone (zombies count as gone)
            local alive=0
            for pid in "${pids[@]}"; do
                if [ -e "/proc/$pid" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$pid/status" 2>/dev/null; then alive=1; fi
            done
            [ $alive -eq 0 ] && break
            sleep 0.1
        done
    fi
    if [ "${RADOSGW_KEEP:-0}" = 1 ]; then
        echo "radosgw.sh: RADOSGW_KEEP=1: kept $dir (logs in $dir/log)" >&2
        return 0
    fi
    rm -rf "$dir/ceph.conf" "$dir/monmap" "$dir/mon" "$dir/osd" "$dir/run" "$dir/log" "$dir/endpoint" "$dir/tmp"
    rmdir "$dir" 2>/dev/null || true
}

if [ "$CMD" = stop ]; then
    [ -d "$DIR" ] && DIR=$(cd "$DIR" && pwd)
    stop_cluster "$DIR"
    exit 0
fi
[ "$CMD" = start ] || usage

# -- start ------------------------------------------------------------------------------------

OWNER=${3:-${RADOSGW_OWNER_PID:-}}
unset CEPH_ARGS CEPH_CONF  # the caller's Ceph settings must not leak into this cluster
TIMEOUT=${RADOSGW_START_TIMEOUT:-120}
for t in ceph-mon ceph-osd radosgw radosgw-admin ceph monmaptool; do
    command -v "$t" >/dev/null 2>&1 || { echo "radosgw.sh: $t not found (run scripts/setup/install_radosgw.sh)" >&2; exit 3; }
done

mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
if [ -e "$DIR/ceph.conf" ]; then
    echo "radosgw.sh: $DIR already holds a cluster (run: $0 stop $DIR)" >&2
    exit 1
fi
mkdir -p "$DIR/run" "$DIR/log" "$DIR/mon" "$DIR/osd" "$DIR/tmp"
CONF=$DIR/ceph.conf
# A unix socket path holds at most 107 bytes: with a DIR too long for the admin sockets, go
# without them (only `ceph daemon ...` debugging needs them).
ASOK="$DIR/run/\$name.asok"
[ ${#DIR} -le 80 ] || ASOK=""
DEADLINE=$((SECONDS + TIMEOUT))

die() {  # die "reason" [log file]
    echo "radosgw.sh: $1" >&2
    if [ -n "${2:-}" ] && [ -f "$2" ]; then
        echo "---- last lines of $2 ----" >&2
        tail -n 30 "$2" >&2
        echo "----" >&2
    fi
    stop_cluster "$DIR"
    exit 1
}
trap 'die "interrupted"' INT TERM

# A free TCP port on 127.0.0.1 (the kernel picks it; tiny race until the daemon binds it).
free_port() {
    if command -v python3 >/dev/null 2>&1; then
        python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' && return
    fi
    local p
    while :; do
        p=$((20000 + RANDOM % 30000))
        (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || { echo "$p"; return; }
    done
}

alive() {  # alive NAME: the daemon we started as NAME (pid in run/NAME.pid) still runs
    local pid
    pid=$(cat "$DIR/run/$1.pid" 2>/dev/null) && [ -e "/proc/$pid" ] \
        && ! grep -q '^State:[[:space:]]*Z' "/proc/$pid/status" 2>/dev/null
}

# spawn NAME command...: runs a daemon in the foreground (-f) as a background job, so its pid is
# ours to record at once; stdout/stderr go to log/NAME.out (its real log is log/<ceph name>.log).
spawn() {
    local name=$1
    shift
    "$@" </dev/null >>"$DIR/log/$name.out" 2>&1 &
    echo $! >"$DIR/run/$name.pid"
    disown $!  # no "Killed" job notice from bash if die() has to kill it
}

# wait_for "what" DAEMON LOG command...: retries the command until it succeeds; fails with LOG's
# tail when DAEMON exits or at the deadline.
wait_for() {
    local what=$1 daemon=$2 log=$3
    shift 3
    until "$@" >/dev/null 2>&1; do
        alive "$daemon" || die "$daemon exited while waiting for $what" "$log"
        [ $SECONDS -lt $DEADLINE ] || die "timed out (${TIMEOUT}s) waiting for $what" "$log"
        sleep 0.2
    done
}

MON_PORT=$(free_port)
RGW_PORT=$(free_port)
while [ "$RGW_PORT" = "$MON_PORT" ]; do RGW_PORT=$(free_port); done
FSID=$(cat /proc/sys/kernel/random/uuid)
OSD_UUID=$(cat /proc/sys/kernel/random/uuid)

cat >"$CONF" <<EOF
[global]
fsid = $FSID
mon host = v2:127.0.0.1:$MON_PORT
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind ipv4 = true
ms bind ipv6 = false
ms bind port min = 6800
ms bind port max = 7568
auth cluster required = none
auth service required = none
auth client required = none
auth allow insecure global id reclaim = true
ms mon client mode = crc
ms client mode = crc
ms service mode = crc
ms cluster mode = crc
run dir = $DIR/run
admin socket = $ASOK
pid file =
log file = $DIR/log/\$name.log
mon data = $DIR/mon/\$name
osd data = $DIR/osd/\$name
keyring = $DIR/keyring
crash dir = $DIR/tmp
log to stderr = false
err to stderr = false
log to syslog = false
log flush on exit = true
; one OSD: pools of size 1, few placement groups
osd pool default size = 1
osd pool default min size = 1
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
mon warn on pool no redundancy = false
mon warn on insecure global id reclaim allowed = false
mon max pg per osd = 1000
osd objectstore = memstore
memstore device bytes = $((${RADOSGW_MEMSTORE_GIB:-4} * 1024 * 1024 * 1024))
memstore page set = false
osd op num shards = 2
osd op num threads per shard = 1
osd crush update on start = true

[mon]
mon initial members = a
mon cluster log file = $DIR/log/cluster.log
mon data avail warn = 1
mon data avail crit = 0
; commit map changes (pool creations...) at once rather than batching them for 1 s: radosgw's
; first start creates six pools, two map changes each
paxos propose interval = 0.05
paxos min wait = 0.01

[client.rgw]
rgw frontends = beast endpoint=127.0.0.1:$RGW_PORT
rgw thread pool size = 64
; deleted objects' tails go through the garbage collector: free them at once, not in 2 h, so a
; long test session does not fill the RAM-backed OSD
rgw gc obj min wait = 0
rgw gc processor period = 10
rgw gc processor max time = 10
rgw enable usage log = false
rgw enable ops log = false
rgw dynamic resharding = false
EOF

# Monitor.
monmaptool --create --fsid "$FSID" --addv a "[v2:127.0.0.1:$MON_PORT]" "$DIR/monmap" \
    >"$DIR/log/monmaptool.out" 2>&1 || die "monmaptool failed" "$DIR/log/monmaptool.out"
ceph-mon -c "$CONF" -i a --mkfs --monmap "$DIR/monmap" >"$DIR/log/mon-mkfs.out" 2>&1 \
    || die "ceph-mon --mkfs failed" "$DIR/log/mon-mkfs.out"
spawn mon ceph-mon -c "$CONF" -i a -f
ceph_cli() { timeout 30 ceph -c "$CONF" --connect-timeout 10 "$@"; }
# The first command also tells us the monitor forms quorum and answers.
wait_for "the monitor to answer" mon "$DIR/log/mon.a.log" ceph_cli osd new "$OSD_UUID" 0

# OSD (memstore: the data lives in the daemon's memory; DIR/osd/osd.0 only keeps its identity).
mkdir -p "$DIR/osd/osd.0"
ceph-osd -c "$CONF" -i 0 --mkfs --osd-uuid "$OSD_UUID" >"$DIR/log/osd-mkfs.out" 2>&1 \
    || die "ceph-osd --mkfs failed" "$DIR/log/osd-mkfs.out"
spawn osd ceph-osd -c "$CONF" -i 0 -f
osd_up() { ceph_cli osd dump 2>/dev/null | grep -q '^osd\.0 up'; }
wait_for "osd.0 to come up" osd "$DIR/log/osd.0.log" osd_up

# The S3 user, before radosgw starts: radosgw-admin is a rados client of its own, and on this
# fresh cluster it creates the default zone and radosgw's pools (a second at most); radosgw then
# finds them there rather than racing it to create them.
radosgw_admin() {
    timeout 60 radosgw-admin -c "$CONF" -n client.rgw --log-file "$DIR/log/radosgw-admin.log" --admin-socket '' "$@"
}
user_create() {
    radosgw_admin user create --uid testing --display-name testing --access-key testing --secret-key testing \
        >"$DIR/log/radosgw-admin.out" 2>&1 \
    || radosgw_admin user info --uid testing >>"$DIR/log/radosgw-admin.out" 2>&1
}
wait_for "radosgw-admin user create" osd "$DIR/log/radosgw-admin.out" user_create

spawn rgw radosgw -c "$CONF" -n client.rgw -f

# The endpoint answers HTTP (an anonymous GET / lists no buckets: 200).
http_ok() {
    local status
    exec 3<>"/dev/tcp/127.0.0.1/$RGW_PORT" || return 1
    printf 'GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n' >&3
    IFS=' ' read -r -t 5 _ status _ <&3 || { exec 3>&-; return 1; }
    exec 3>&-
    [ "$status" = 200 ]
}
until http_ok 2>/dev/null; do
    alive rgw || die "radosgw exited" "$DIR/log/client.rgw.log"
    [ $SECONDS -lt $DEADLINE ] || die "timed out (${TIMEOUT}s) waiting for http://127.0.0.1:$RGW_PORT" "$DIR/log/client.rgw.log"
    sleep 0.2
done

# Watchdog: stop the cluster once the owner process is gone. Its command line names DIR, which
# is how stop_cluster recognises it (and the daemons) as ours.
if [ -n "$OWNER" ]; then
    SCRIPT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")
    bash -c 'while kill -0 "$1" 2>/dev/null && [ -e "$2/ceph.conf" ]; do sleep 1; done
             [ -e "$2/ceph.conf" ] && exec bash "$3" stop "$2"' \
        radosgw-watchdog "$OWNER" "$DIR" "$SCRIPT" </dev/null >/dev/null 2>&1 &
    echo $! >"$DIR/run/watchdog.pid"
fi

trap - INT TERM
echo "http://127.0.0.1:$RGW_PORT" | tee "$DIR/endpoint"
