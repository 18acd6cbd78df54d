"""The `slurm` tier (make test-slurm): a single-node Slurm cluster on loopback, started for the session by
tests/slurm/cluster.sh and stopped after it (nothing left running). Skipped where it cannot start: no slurm-wlm and
munge installed (apt-get install -y slurm-wlm munge), or not root (slurmd)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CLUSTER = Path(__file__).with_name("cluster.sh")
DIR = Path(os.environ.get("LMCAL_SLURM_DIR", "/tmp/lmcal-slurm"))


@pytest.fixture(scope="session")
def slurm_cluster():
    """{"env": the environment for Slurm's clients (SLURM_CONF), "dir": the cluster's folder (jobcomp.log, logs)}."""
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"  # the daemons live in sbin (cluster.sh adds it too)
    if not all(shutil.which(d, path=path) for d in ("slurmctld", "slurmd", "munged")):
        pytest.skip("Slurm is not installed: apt-get install -y slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("the test cluster's slurmd runs as root")
    env = {**os.environ, "LMCAL_SLURM_DIR": str(DIR)}
    r = subprocess.run([str(CLUSTER), "start"], env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    try:
        yield {"env": {**env, "SLURM_CONF": str(DIR / "slurm.conf")}, "dir": DIR}
    finally:
        subprocess.run([str(CLUSTER), "stop"], env=env, capture_output=True, timeout=120)
