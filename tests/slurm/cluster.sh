#!/usr/bin/env bash
# A single-node Slurm cluster on loopback for the `slurm` test tier (make test-slurm), from Debian's slurm-wlm and munge:
#   tests/slurm/cluster.sh start   # writes $DIR/slurm.conf, starts munged, slurmctld and slurmd afresh (an earlier
#                                  # cluster's jobs, state and job-completion log gone); prints SLURM_CONF=...
#   tests/slurm/cluster.sh stop    # cancels every job, stops the three daemons (nothing is left running)
#   tests/slurm/cluster.sh status
# DIR (default /tmp/lmcal-slurm) holds the config, the daemons' state, logs and the job-completion log (jobcomp.log).
# Clients (sbatch, squeue, submitit) find this cluster through SLURM_CONF=$DIR/slurm.conf. Needs root (slurmd).
set -euo pipefail
DIR=${LMCAL_SLURM_DIR:-/tmp/lmcal-slurm}
CPUS=${LMCAL_SLURM_CPUS:-2}
export SLURM_CONF=$DIR/slurm.conf
export PATH="$PATH:/usr/sbin:/sbin"  # the daemons live in sbin, which a user's (or env -i's) PATH may leave out

# A zombie counts as gone: a container's init may never reap what a killed daemon leaves behind.
running() { [[ -r /proc/$1/status ]] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null; }
pid_of() { [[ -s $DIR/$1.pid ]] && running "$(cat "$DIR/$1.pid")" && cat "$DIR/$1.pid"; }

start() {
  command -v slurmctld >/dev/null || { echo "slurmctld not found: apt-get install -y slurm-wlm munge" >&2; exit 3; }
  [[ $(id -u) == 0 ]] || { echo "the test cluster's slurmd needs root" >&2; exit 3; }
  stop >/dev/null 2>&1 || true
  # A fresh cluster every time. One killed mid-run (daemons and all) leaves its jobs in the state, where slurmctld
  # recovers them as running, the node never turns idle, and the new cluster never comes up; job ids restart at 1
  # with the state, so the old job-completion log goes too; the killed jobs' processes (each job script leads its
  # process group) still hold the cores.
  for p in $(pgrep -f "$DIR/spool/job" || true); do
    g=$(ps -o pgid= -p "$p" | tr -d ' ') && [[ -n $g ]] && kill -9 -- "-$g" 2>/dev/null || true
  done
  rm -rf "$DIR/state" "$DIR/spool" "$DIR/jobcomp.log"
  mkdir -p "$DIR"/{state,spool,munge}
  chmod 0755 "$DIR" "$DIR/munge"
  [[ -s $DIR/munge/munge.key ]] || dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
  chmod 0400 "$DIR/munge/munge.key"
  munged --force --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/munged.pid" --log-file="$DIR/munged.log" --seed-file="$DIR/munge/munged.seed"
  cat > "$SLURM_CONF" <<CONF
ClusterName=lmcal-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
JobCompType=jobcomp/filetxt
JobCompLoc=$DIR/jobcomp.log
JobAcctGatherType=jobacct_gather/none
MinJobAge=3600
ReturnToService=2
JobRequeue=1
SchedulerParameters=sched_interval=2
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
CONF
  slurmctld -i -f "$SLURM_CONF"
  slurmd -N localhost -f "$SLURM_CONF"
  for _ in $(seq 60); do
    sinfo -h -o %t 2>/dev/null | grep -qx idle && { echo "SLURM_CONF=$SLURM_CONF"; return 0; }
    sleep 1
  done
  echo "the test cluster did not come up; see $DIR/slurmctld.log and $DIR/slurmd.log" >&2
  stop; exit 1
}

stop() {
  if pid_of slurmctld >/dev/null; then  # every job ended (its slurmstepd with it) before the daemons go
    scancel --quiet --full --user="$(id -un)" 2>/dev/null || true
    for _ in $(seq 60); do [[ -z $(squeue -h -t running,completing,configuring 2>/dev/null) ]] && break; sleep 1; done
  fi
  for d in slurmd slurmctld munged; do
    if p=$(pid_of $d); then
      kill "$p"
      for _ in $(seq 50); do running "$p" || break; sleep 0.2; done
      kill -9 "$p" 2>/dev/null || true
    fi
    rm -f "$DIR/$d.pid"
  done
  echo stopped
}

status() { for d in munged slurmctld slurmd; do echo "$d: $(pid_of $d || echo not running)"; done; }

case "${1:-}" in start) start ;; stop) stop ;; status) status ;; *) echo "usage: $0 start|stop|status" >&2; exit 2 ;; esac
