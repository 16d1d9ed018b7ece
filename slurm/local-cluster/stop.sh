#!/usr/bin/env bash
# Stops the daemons that slurm/local-cluster/start.sh started, by its own pid files (nothing else).
# Order: slurmd nodes (together), slurmctld, slurmdbd, mariadb, munged (~2 s each). State and configs
# are kept, so start.sh brings the same cluster back (jobs and accounting included).
# Usage: bash slurm/local-cluster/stop.sh
set -uo pipefail
STATE=${LOCAL_SLURM_DIR:-/var/tmp/marlaas-local-slurm}

signal_pidfile() {  # signal_pidfile PIDFILE EXPECTED_COMM -> prints the pid when it was signalled
    local file=$1 comm=$2 pid
    [ -s "$file" ] || return 0
    pid=$(cat "$file")
    # the pid may have been reused since: only signal the daemon we expect
    if kill -0 "$pid" 2>/dev/null && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$comm" ]; then
        kill -TERM "$pid" && echo "$pid"
    fi
    rm -f "$file"
}

stop_group() {  # stop_group "PIDFILE:COMM ..." : TERM them all, wait up to 10 s, then KILL
    local pids=() item pid
    for item in $1; do
        pid=$(signal_pidfile "${item%%:*}" "${item##*:}") && [ -n "$pid" ] && pids+=("$pid:${item##*:}")
    done
    for _ in $(seq 100); do
        local alive=0
        for item in "${pids[@]}"; do kill -0 "${item%%:*}" 2>/dev/null && alive=1; done
        [ $alive = 0 ] && break
        sleep 0.1
    done
    for item in "${pids[@]}"; do
        pid=${item%%:*}
        kill -0 "$pid" 2>/dev/null && { echo "[local-slurm] ${item##*:} ($pid) ignored TERM: KILL"; kill -KILL "$pid"; }
        echo "[local-slurm] stopped ${item##*:} ($pid)"
    done
}

shopt -s nullglob
slurmds=""
for f in "$STATE"/pid/slurmd-*.pid; do slurmds+=" $f:slurmd"; done
stop_group "$slurmds"
stop_group "$STATE/pid/slurmctld.pid:slurmctld"
stop_group "$STATE/pid/slurmdbd.pid:slurmdbd"
stop_group "$STATE/mariadb/mariadb.pid:mariadbd"
stop_group "$STATE/pid/munged.pid:munged"
exit 0
