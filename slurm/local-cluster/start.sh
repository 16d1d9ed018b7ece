#!/usr/bin/env bash
# A real single-machine Slurm cluster for tests and CI (Debian 12, root, no systemd needed).
#
#   bash slurm/local-cluster/start.sh        # install if missing, configure, start; idempotent
#   bash slurm/local-cluster/stop.sh         # stop what this script started (its own pid files)
#
# Daemons: munged, mariadb (+ slurmdbd, so sacct/submitit see real job states), slurmctld and
# emulated slurmd nodes on 127.0.0.1: partition `cpu` = c[1-N], partition `gpu` = g[1-M] with fake
# `gpu` gres (device files are symlinks to /dev/null, /dev/zero, ...; Slurm still sets
# CUDA_VISIBLE_DEVICES). Heterogeneous-job components never share a node, so a 4-component job needs
# at least 2 cpu + 2 gpu nodes.
#
# Environment knobs (defaults in brackets):
#   LOCAL_SLURM_DIR [/var/tmp/marlaas-local-slurm]  state: pid/, log/, spool/, tmp/, dev/
#   LOCAL_SLURM_CPU_NODES [3]  LOCAL_SLURM_GPU_NODES [3]  LOCAL_SLURM_CPUS [this machine's, nproc]
#   LOCAL_SLURM_GPUS [4]
#   LOCAL_SLURM_NO_INSTALL=1   fail instead of running apt-get when packages are missing
#
# Writes /etc/slurm/{slurm,gres,slurmdbd}.conf (only when absent or written by this script before:
# a real site configuration is never overwritten) and adds the node names to /etc/hosts.
set -euo pipefail

STATE=${LOCAL_SLURM_DIR:-/var/tmp/marlaas-local-slurm}
NCPU_NODES=${LOCAL_SLURM_CPU_NODES:-3}
NGPU_NODES=${LOCAL_SLURM_GPU_NODES:-3}
# nproc alone honours OMP_NUM_THREADS, which tools/test.sh sets to 1 before starting the cluster: every
# node then offered one CPU and the tests asking for two per task were refused at submission
NODE_CPUS=${LOCAL_SLURM_CPUS:-$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)}
NODE_GPUS=${LOCAL_SLURM_GPUS:-4}
CLUSTER=marlaas
MARKER="# written by marlaas_hpc slurm/local-cluster/start.sh"
DB_PASS=marlaas-local
T0=$EPOCHREALTIME

elapsed() { awk -v a="$T0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
log() { echo "[local-slurm $(elapsed)s] $*"; }
die() { echo "[local-slurm] ERROR: $*" >&2; exit 1; }
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }   # pid file -> process alive?
wait_for() {  # wait_for SECONDS DESCRIPTION CMD...
    local limit=$1 what=$2; shift 2
    local end=$((SECONDS + limit))
    until "$@" >/dev/null 2>&1; do
        [ $SECONDS -lt $end ] || die "$what not ready after ${limit}s (logs: $STATE/log)"
        sleep 0.2
    done
}

[ "$(id -u)" = 0 ] || die "run as root (installs packages, writes /etc/slurm, starts daemons)"

# ---------------------------------------------------------------- packages
PKGS=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server)
missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    [ "${LOCAL_SLURM_NO_INSTALL:-0}" = 1 ] && die "missing packages: ${missing[*]}"
    echo "[local-slurm] installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    T_INSTALL=$(elapsed)
    log "packages installed"
fi

HOST=$(hostname -s)
mkdir -p "$STATE"/{pid,log,spool,tmp,ctld,dev}
CPU_NODES=$(seq -f "c%g" 1 "$NCPU_NODES" | paste -sd' ')
GPU_NODES=$(seq -f "g%g" 1 "$NGPU_NODES" | paste -sd' ')
ALL_NODES="$CPU_NODES $GPU_NODES"

# ---------------------------------------------------------------- /etc/hosts: node names must resolve
for n in $ALL_NODES; do
    grep -qE "^[^#]*[[:space:]]$n([[:space:]]|\$)" /etc/hosts || echo "127.0.0.1 $n  $MARKER" >> /etc/hosts
done
for n in $ALL_NODES; do mkdir -p "$STATE/tmp/$n" "$STATE/spool/$n"; done

# ---------------------------------------------------------------- config files
CONF_CHANGED=0
write_conf() {  # write_conf PATH MODE < content; never clobbers a config we did not write
    local path=$1 mode=$2 tmp
    tmp=$(mktemp)
    cat > "$tmp"
    if [ -e "$path" ] && ! grep -qF "$MARKER" "$path"; then
        rm -f "$tmp"; die "$path exists and was not written by this script; refusing to overwrite it"
    fi
    cmp -s "$tmp" "$path" || CONF_CHANGED=1
    install -D -m "$mode" "$tmp" "$path"; rm -f "$tmp"
}

# Fake GPUs: gres needs real device files; a count-only gres leaves the node INVAL.
DEVS=(/dev/null /dev/zero /dev/full /dev/urandom /dev/random /dev/tty /dev/ptmx /dev/console)
[ "$NODE_GPUS" -le ${#DEVS[@]} ] || die "LOCAL_SLURM_GPUS must be <= ${#DEVS[@]}"
for ((i = 0; i < NODE_GPUS; i++)); do ln -sfn "${DEVS[$i]}" "$STATE/dev/gpu$i"; done

port=17001
NODE_LINES=""
for n in $ALL_NODES; do
    gres=""; [[ $n == g* ]] && gres=" Gres=gpu:$NODE_GPUS"
    NODE_LINES+="NodeName=$n NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$port CPUs=$NODE_CPUS RealMemory=4000$gres State=UNKNOWN"$'\n'
    port=$((port + 1))
done
CPU_RANGE="c[1-$NCPU_NODES]"; GPU_RANGE="g[1-$NGPU_NODES]"

write_conf /etc/slurm/slurm.conf 644 <<EOF
$MARKER
ClusterName=$CLUSTER
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# requeued jobs restart once their old credential expired (default 120 s)
AuthInfo=cred_expire=20
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/pid/slurmctld.pid
SlurmdPidFile=$STATE/pid/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
# pmix needs a per-node tmp when several slurmd share one machine
TmpFS=$STATE/tmp/%n
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
# task/affinity pins each task to the CPUs Slurm gave it (srun --cpus-per-task), so a test can check
# them with sched_getaffinity; every emulated node offers the machine's real CPUs (the same ones)
TaskPlugin=task/affinity
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# only the backfill scheduler starts het jobs; run it every second
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,bf_hetjob_immediate,sched_min_interval=0
GresTypes=gpu
ReturnToService=2
JobRequeue=1
KillWait=5
MinJobAge=300
InactiveLimit=0
SlurmdTimeout=60
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
$NODE_LINES
PartitionName=cpu Nodes=$CPU_RANGE Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=$GPU_RANGE MaxTime=INFINITE State=UP
EOF

write_conf /etc/slurm/gres.conf 644 <<EOF
$MARKER
NodeName=$GPU_RANGE Name=gpu File=$STATE/dev/gpu[0-$((NODE_GPUS - 1))]
EOF

write_conf /etc/slurm/slurmdbd.conf 600 <<EOF
$MARKER
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
PidFile=$STATE/pid/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF

# daemons started with another configuration (an older start.sh, other knobs) do not all reread it on
# `scontrol reconfigure` (slurmd keeps its TaskPlugin, node CPUs): restart the cluster (state is kept)
running() { alive "$STATE/pid/slurmctld.pid" || ls "$STATE"/pid/slurmd-*.pid >/dev/null 2>&1; }
if [ "$CONF_CHANGED" = 1 ] && running; then
    log "configuration changed: restarting the running cluster"
    bash "$(dirname "$0")/stop.sh" >/dev/null
fi

# ---------------------------------------------------------------- munge
if ! pgrep -x munged >/dev/null; then
    [ -s /etc/munge/munge.key ] || { dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
                                     chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
    install -d -o munge -g munge -m 755 /run/munge
    runuser -u munge -- /usr/sbin/munged
    wait_for 10 munged test -s /run/munge/munged.pid
    cp /run/munge/munged.pid "$STATE/pid/munged.pid"
    log "munged started"
fi

# ---------------------------------------------------------------- mariadb (for slurmdbd)
if ! mariadb-admin ping >/dev/null 2>&1; then
    [ -d /var/lib/mysql/mysql ] || mariadb-install-db --user=mysql --datadir=/var/lib/mysql >"$STATE/log/mariadb-install.log" 2>&1
    install -d -o mysql -g mysql /run/mysqld "$STATE/mariadb"   # mariadbd (user mysql) writes pid+log there
    setsid nohup /usr/sbin/mariadbd --user=mysql --datadir=/var/lib/mysql --bind-address=127.0.0.1 \
        --socket=/run/mysqld/mysqld.sock --pid-file="$STATE/mariadb/mariadb.pid" \
        --log-error="$STATE/mariadb/mariadb.log" </dev/null >/dev/null 2>&1 &
    wait_for 60 mariadb mariadb-admin ping
    log "mariadb started"
fi
mariadb -u root <<EOF
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
EOF

# ---------------------------------------------------------------- slurmdbd, cluster registration
if ! alive "$STATE/pid/slurmdbd.pid"; then
    slurmdbd
    wait_for 30 slurmdbd sacctmgr -n list cluster
    log "slurmdbd started"
fi
sacctmgr -n -P list cluster format=cluster | grep -qx "$CLUSTER" || sacctmgr -i add cluster "$CLUSTER" >/dev/null

# ---------------------------------------------------------------- slurmctld, slurmd per emulated node
if ! alive "$STATE/pid/slurmctld.pid"; then
    slurmctld
    wait_for 30 slurmctld scontrol ping
    log "slurmctld started"
else
    scontrol reconfigure >/dev/null || true
fi
started=0
for n in $ALL_NODES; do
    alive "$STATE/pid/slurmd-$n.pid" && continue
    slurmd -N "$n"
    started=$((started + 1))
done
[ $started = 0 ] || log "started $started slurmd"

# nodes left DOWN/DRAIN by an earlier run come back
nodes_ready() { [ "$(sinfo -h -N -t idle,mix,alloc -o %N | sort -u | wc -l)" -ge "$(echo $ALL_NODES | wc -w)" ]; }
if ! nodes_ready; then
    sleep 1
    scontrol update NodeName="$CPU_RANGE,$GPU_RANGE" State=RESUME >/dev/null 2>&1 || true
fi
wait_for 60 "all nodes idle" nodes_ready
log "cluster up${T_INSTALL:+ (install took ${T_INSTALL}s)}"
sinfo -o "%P %D %t %N %G"
