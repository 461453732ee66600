#!/usr/bin/env bash
# start_local_slurm.sh -- install (if missing), configure and start a throwaway
# (the project's copy of ../shared/tools/local-slurm/, plus SLURM_LOCAL_CRED_EXPIRE)
# Slurm cluster on localhost for CI (Debian 12 "bookworm", Slurm 22.05, as root,
# works without systemd). Safe to run again: daemons that are already running
# (found through their pid files) are left alone, unless the generated config
# changed, in which case the Slurm daemons started by this script are restarted.
#
# Settings (environment variables):
#   SLURM_LOCAL_NODES    number of compute nodes to emulate (default 1).
#                        1  -> one node named after `hostname -s`
#                        N>1 -> node1..nodeN, one slurmd each, all on 127.0.0.1
#                              (Slurm's multiple-slurmd mode, ports 6818..)
#   SLURM_LOCAL_CPUS     CPUs advertised per node (default: from `slurmd -C`)
#   SLURM_LOCAL_MEM      RealMemory in MB per node (default: from `slurmd -C`)
#   SLURM_LOCAL_DIR      state/spool/log/pid directory (default /var/spool/slurm-local)
#   SLURM_LOCAL_TIMEOUT  seconds to wait for the cluster to come up (default 60)
#   SLURM_LOCAL_SMOKE    1 (default) = run `srun -N<nodes> true` after starting daemons
#   SLURM_LOCAL_CRED_EXPIRE  job credential lifetime in s (default 15; Slurm's is 120); a
#                        requeued job waits this long before it starts again
# Stop with stop_local_slurm.sh (same SLURM_LOCAL_DIR).
set -euo pipefail

NODES=${SLURM_LOCAL_NODES:-1}
DIR=${SLURM_LOCAL_DIR:-/var/spool/slurm-local}
TIMEOUT=${SLURM_LOCAL_TIMEOUT:-60}
SMOKE=${SLURM_LOCAL_SMOKE:-1}
CRED_EXPIRE=${SLURM_LOCAL_CRED_EXPIRE:-15}
RUN=$DIR/run
CONF=/etc/slurm/slurm.conf
CGCONF=/etc/slurm/cgroup.conf
CTLD_PORT=6817
SLURMD_PORT0=6818

log() { echo "[start_local_slurm] $*" >&2; }
dump_logs() {
  local f
  for f in "$DIR"/log/*.log /var/log/munge/munged.log; do
    [ -f "$f" ] && { echo "----- tail of $f"; tail -n 40 "$f"; }
  done >&2
  return 0
}
die() { log "ERROR: $*"; dump_logs; exit 1; }

# running PID: the process exists and is not a zombie (a container whose PID 1
# does not reap orphans keeps exited daemons around as zombies)
running() {
  local s
  s=$(sed -n 's/.*) \(.\).*/\1/p' "/proc/$1/stat" 2>/dev/null || true)
  [ -n "$s" ] && [ "$s" != Z ]
}
# pid_alive FILE COMM: FILE holds the pid of a live process whose name is COMM
pid_alive() {
  local p
  [ -s "$1" ] || return 1
  p=$(cat "$1" 2>/dev/null) || return 1
  [[ $p =~ ^[0-9]+$ ]] || return 1
  [ "$(cat "/proc/$p/comm" 2>/dev/null)" = "$2" ] && running "$p"
}
# stop_pidfiles COMM FILE...: SIGTERM every live COMM process named by the pid
# files, wait up to 20 s for all of them, SIGKILL survivors, remove the files
stop_pidfiles() {
  local comm=$1 f p pids=() i alive
  shift
  for f in "$@"; do
    if pid_alive "$f" "$comm"; then
      p=$(cat "$f"); pids+=("$p")
      log "stopping $comm (pid $p)"
      kill -TERM "$p" 2>/dev/null || true
    fi
  done
  for i in $(seq 100); do
    alive=0
    for p in "${pids[@]}"; do running "$p" && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.2
  done
  for p in "${pids[@]}"; do
    running "$p" && { log "$comm ($p) ignored SIGTERM, sending SIGKILL"; kill -KILL "$p" 2>/dev/null || true; }
  done
  rm -f "$@"
}

[ "$(id -u)" = 0 ] || { echo "start_local_slurm.sh must run as root" >&2; exit 1; }
[[ $NODES =~ ^[1-9][0-9]*$ ]] || { echo "SLURM_LOCAL_NODES must be >= 1" >&2; exit 1; }

# ---------------------------------------------------------------- 1. install
missing=0
for b in slurmctld slurmd sinfo srun sbatch scontrol squeue scancel munged munge unmunge; do
  command -v "$b" >/dev/null 2>&1 || missing=1
done
if [ "$missing" = 1 ]; then
  log "installing slurmctld slurmd slurm-client munge (apt)"
  # Keep the packages' maintainer scripts from starting daemons of their own
  # (only matters where no policy-rc.d exists yet, e.g. a VM with sysvinit).
  policy_tmp=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
    chmod 755 /usr/sbin/policy-rc.d
    policy_tmp=1
  fi
  pkgs="slurmctld slurmd slurm-client munge"
  rc=0
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $pkgs || {
    DEBIAN_FRONTEND=noninteractive apt-get update -q &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $pkgs; } || rc=$?
  [ "$policy_tmp" = 1 ] && rm -f /usr/sbin/policy-rc.d
  [ "$rc" = 0 ] || die "apt-get install failed"
fi

mkdir -p "$DIR/ctld" "$DIR/d" "$DIR/log" "$RUN"
chmod 755 "$DIR" "$RUN"

# ---------------------------------------------------------------- 2. munge
if [ ! -s /etc/munge/munge.key ]; then
  log "creating /etc/munge/munge.key"
  install -d -o munge -g munge -m 0700 /etc/munge
  mungekey --create --keyfile=/etc/munge/munge.key
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key

munge_ok() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
if pid_alive "$RUN/munged.pid" munged; then
  log "munged already running (pid $(cat "$RUN/munged.pid"))"
elif munge_ok; then
  log "a munged not started by this script is already answering; using it"
else
  rm -f "$RUN/munged.pid"
  install -d -o munge -g munge -m 0755 /run/munge
  # munged forks into the background once it is ready and writes its pid file
  runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid \
    || die "munged failed to start"
  for _ in $(seq 50); do [ -s /run/munge/munged.pid ] && break; sleep 0.1; done
  cp /run/munge/munged.pid "$RUN/munged.pid"   # marks it as ours for stop_local_slurm.sh
  for _ in $(seq 50); do munge_ok && break; sleep 0.1; done
  munge_ok || die "munge does not work"
  log "munged started (pid $(cat "$RUN/munged.pid"))"
fi

# ---------------------------------------------------------------- 3. config
hw=$(slurmd -C 2>/dev/null | head -n 1 || true)
hwval() { tr ' ' '\n' <<<"$hw" | sed -n "s/^$1=//p"; }
CPUS=${SLURM_LOCAL_CPUS:-$(hwval CPUs)}
MEM=${SLURM_LOCAL_MEM:-$(hwval RealMemory)}
[ -n "$CPUS" ] || CPUS=$(nproc)
[ -n "$MEM" ] || MEM=$(( $(sed -n 's/^MemTotal: *\([0-9]*\).*/\1/p' /proc/meminfo) / 1024 ))

if [ "$NODES" = 1 ]; then
  NODE_NAMES=$(hostname -s)
  NODE_LINE="NodeName=$NODE_NAMES NodeAddr=127.0.0.1 Port=$SLURMD_PORT0"
else
  NODE_NAMES=$(seq -f 'node%g' 1 "$NODES" | tr '\n' ' ')
  NODE_LINE="NodeName=node[1-$NODES] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[$SLURMD_PORT0-$((SLURMD_PORT0 + NODES - 1))]"
fi
NODE_LINE="$NODE_LINE CPUs=$CPUS Boards=1 SocketsPerBoard=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$MEM State=UNKNOWN"

# Job code (and launchers reading SLURM_JOB_NODELIST) may look node names up.
for n in $NODE_NAMES; do
  if ! getent hosts "$n" >/dev/null 2>&1; then
    if echo "127.0.0.1 $n  # added by start_local_slurm.sh" >> /etc/hosts 2>/dev/null; then
      log "added $n to /etc/hosts"
    else
      log "WARNING: $n does not resolve and /etc/hosts is not writable"
    fi
  fi
done

new_conf=$(cat <<EOF
# Generated by start_local_slurm.sh: throwaway test cluster on this host only.
ClusterName=localci
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# short credential lifetime: a requeued job starts again after it, not after Slurm's default 120 s
AuthInfo=cred_expire=$CRED_EXPIRE
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SchedulerType=sched/backfill
# start sbatch jobs ~1 s after submission instead of up to 3 s (default batch_sched_delay=3)
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# use the CPUs/RealMemory written below instead of validating them against the hardware
SlurmdParameters=config_overrides
ReturnToService=2
# keep finished jobs visible to 'scontrol show job' for an hour (there is no sacct)
MinJobAge=3600
MailProg=/bin/true
StateSaveLocation=$DIR/ctld
SlurmdSpoolDir=$DIR/d/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
$NODE_LINE
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
)
# Slurm 22.05's slurmd always loads a cgroup plugin, even with proctrack/linuxproc
# and task/none. "autodetect" fails without systemd on cgroup v2 (and where
# /sys/fs/cgroup is missing); the v1 plugin does nothing until used, and this
# config never uses it.
new_cgconf=$(printf '%s\n' '# Generated by start_local_slurm.sh (see comment there)' 'CgroupPlugin=cgroup/v1')

if [ "$new_conf" != "$(cat "$CONF" 2>/dev/null)" ] || [ "$new_cgconf" != "$(cat "$CGCONF" 2>/dev/null)" ]; then
  stop_pidfiles slurmd "$RUN"/slurmd-*.pid
  stop_pidfiles slurmctld "$RUN/slurmctld.pid"
  mkdir -p /etc/slurm
  printf '%s\n' "$new_conf" > "$CONF"
  printf '%s\n' "$new_cgconf" > "$CGCONF"
  log "wrote $CONF and $CGCONF"
fi

# ---------------------------------------------------------------- 4. daemons
started=0
if pid_alive "$RUN/slurmctld.pid" slurmctld; then
  log "slurmctld already running (pid $(cat "$RUN/slurmctld.pid"))"
else
  rm -f "$RUN/slurmctld.pid"
  slurmctld || die "slurmctld failed to start"
  started=1
fi
deadline=$((SECONDS + TIMEOUT))
until scontrol ping 2>/dev/null | grep -q 'is UP'; do
  [ $SECONDS -lt $deadline ] || die "slurmctld did not answer within ${TIMEOUT}s"
  sleep 0.2
done

for n in $NODE_NAMES; do
  if pid_alive "$RUN/slurmd-$n.pid" slurmd; then
    log "slurmd $n already running (pid $(cat "$RUN/slurmd-$n.pid"))"
  else
    rm -f "$RUN/slurmd-$n.pid"
    mkdir -p "$DIR/d/$n"
    slurmd -N "$n" || die "slurmd -N $n failed to start"
    started=1
  fi
done

# ---------------------------------------------------------------- 5. wait
# nodes_in STATES...: every node's sinfo state is one of STATES, with no flag
# suffix (idle* = not responding, idle~ = powered down; down/drain = unusable)
nodes_in() {
  local n st
  for n in $NODE_NAMES; do
    st=$(sinfo -h -n "$n" -o '%t' 2>/dev/null | head -n 1)
    [[ " $* " == *" $st "* ]] || return 1
  done
}
until nodes_in idle mix alloc; do
  if [ $SECONDS -ge $deadline ]; then
    sinfo -N -l >&2 || true
    die "nodes not up within ${TIMEOUT}s"
  fi
  sleep 0.2
done

if [ "$started" = 1 ] && [ "$SMOKE" = 1 ]; then
  timeout "$TIMEOUT" srun -N "$NODES" -n "$NODES" -t 1 -J local-slurm-smoke true \
    || die "smoke test 'srun -N $NODES true' failed"
  # let the nodes leave the COMPLETING state of the smoke job
  until nodes_in idle mix alloc || [ $SECONDS -ge $deadline ]; do sleep 0.2; done
fi
log "cluster ready:"
sinfo >&2
