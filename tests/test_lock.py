"""The run lock on a filesystem shared by several hosts: a live holder elsewhere keeps it, a dead one (silent for
STALE_S, an earlier run of the same Slurm job, or a job Slurm says has ended) gives it up."""

import json
import os
import socket
import time

import pytest

import lmcal.utils.lock as L
from lmcal.errors import LmcalError


def plant(folder, age=0.0, **holder):
    """A lock as another host's process would leave it, last refreshed `age` seconds ago."""
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / L.LOCK_NAME
    lock.write_text(json.dumps({"pid": 4242, "host": "node-elsewhere", "command": "python -m lmcal.train",
                                "what": "training", **holder}))
    t = time.time() - age
    os.utime(lock, (t, t))
    return lock


@pytest.fixture(autouse=True)
def no_slurm(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")  # no squeue unless a test puts one


def test_a_fresh_lock_of_another_host_is_respected(tmp_path):
    lock = plant(tmp_path, age=5)
    with pytest.raises(LmcalError, match="node-elsewhere"):
        with L.run_lock(tmp_path):
            pass
    assert json.loads(lock.read_text())["host"] == "node-elsewhere"


def test_a_silent_lock_of_another_host_is_taken_over(tmp_path):
    plant(tmp_path, age=L.STALE_S + 1)
    with L.run_lock(tmp_path) as lock:
        mine = json.loads(lock.read_text())
        assert mine["pid"] == os.getpid() and mine["host"] == socket.gethostname()
    assert not lock.exists()


def test_the_holder_refreshes_its_lock(tmp_path, monkeypatch):
    monkeypatch.setattr(L, "HEARTBEAT_S", 0.05)
    with L.run_lock(tmp_path) as lock:
        os.utime(lock, (time.time() - 1000, time.time() - 1000))
        time.sleep(0.5)
        assert time.time() - lock.stat().st_mtime < 5  # touched again: other hosts see it alive


def test_an_earlier_run_of_the_same_slurm_job_is_stale_at_once(tmp_path, monkeypatch):
    """A requeued job runs again under its own id, on any node: the lock its killed first run left is its own."""
    plant(tmp_path, age=1, slurm_job_id="77")
    monkeypatch.setenv("SLURM_JOB_ID", "78")
    with pytest.raises(LmcalError):
        with L.run_lock(tmp_path):
            pass
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    with L.run_lock(tmp_path) as lock:
        assert json.loads(lock.read_text())["slurm_job_id"] == "77"


@pytest.mark.parametrize("squeue, taken", [("echo RUNNING", False), ("true", True),
                                           ("echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1", True),
                                           ("echo 'Unable to contact slurm controller' >&2; exit 1", False)])
def test_squeue_decides_for_a_job_of_another_host(tmp_path, monkeypatch, squeue, taken):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "squeue").write_text(f"#!/bin/sh\n{squeue}\n")
    (bin_ / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}:/usr/bin:/bin")
    run = tmp_path / "run"
    plant(run, age=1, slurm_job_id="12")
    if taken:
        with L.run_lock(run):
            pass
    else:
        with pytest.raises(LmcalError, match="node-elsewhere"):
            with L.run_lock(run):
                pass


def test_a_live_process_on_this_host_keeps_its_lock_however_old(tmp_path):
    plant(tmp_path, age=10 * L.STALE_S, host=socket.gethostname(), pid=os.getppid())
    with pytest.raises(LmcalError):
        with L.run_lock(tmp_path):
            pass
