"""The test cluster itself: one killed mid-run (its daemons and job steps gone with SIGKILL, as when a machine or a
session ends) comes back fresh from tests/slurm/cluster.sh start. This module runs before test_slurm.py, whose tests
then use the restarted cluster."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.slurm.conftest import CLUSTER

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def _alive(pid: int) -> bool:
    """Running, and not a zombie (a container's init may never reap what a killed daemon leaves)."""
    status = Path(f"/proc/{pid}/status")
    try:
        return "\nState:\tZ" not in status.read_text()
    except OSError:
        return False


def _run(args, env):
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=180)


def test_a_cluster_killed_mid_job_starts_again_fresh(slurm_cluster, tmp_path):
    env, folder = slurm_cluster["env"], slurm_cluster["dir"]
    r = _run(["sbatch", "--parsable", "--wrap", "sleep 600", f"--chdir={tmp_path}"], env)
    assert r.returncode == 0, r.stderr
    job = r.stdout.strip().split(";")[0]
    # squeue says R once the controller has handed the job to slurmd, which may not yet have forked the batch script:
    # wait for the script's own process, not only the state.
    deadline, script, state = time.time() + 60, [], ""
    while not (state == "R" and script) and time.time() < deadline:
        time.sleep(0.5)
        state = _run(["squeue", "-h", "-j", job, "-o", "%t"], env).stdout.strip()
        script = subprocess.run(["pgrep", "-f", f"{folder}/spool/job"], capture_output=True, text=True).stdout.split()
    assert script, f"the job's script is not running (squeue state {state!r} after 60 s)"
    steps = subprocess.run(["pgrep", "-x", "slurmstepd"], capture_output=True, text=True).stdout.split()
    daemons = [int((folder / f"{d}.pid").read_text()) for d in ("slurmd", "slurmctld", "munged")]
    for pid in [*map(int, steps), *daemons]:
        os.kill(pid, signal.SIGKILL)

    r = _run([str(CLUSTER), "start"], env)  # the fixture's env names the cluster's folder (LMCAL_SLURM_DIR)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not any(_alive(int(p)) for p in script), "the killed cluster's job still runs"
    assert _run(["squeue", "-h"], env).stdout.strip() == "", "the killed cluster's job came back"
    assert not (folder / "jobcomp.log").exists() or (folder / "jobcomp.log").read_text() == ""
    r = _run(["sbatch", "--parsable", "--wait", "--wrap", "true", f"--chdir={tmp_path}"], env)
    assert r.returncode == 0 and r.stdout.strip().split(";")[0] == "1", r.stdout + r.stderr  # job ids restart
