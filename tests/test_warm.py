"""The pipeline's warm worker (lmcal.pipeline.warm): a stage forked from it behaves as the fresh process it replaces:
exit status, log, environment and threads, stopped whole with its own children, and gone when the worker dies.
(tests/test_reproduce.py checks that a smoke reproduction forked from it writes the same results as fresh
processes.)"""

import os
import subprocess
import sys
import time

import pytest

from lmcal.pipeline.signals import end_groups, gone
from lmcal.pipeline.warm import Worker, takes

STAGE = '''
import os, subprocess, sys, time
import torch
print("threads", torch.get_num_threads(), "marker", os.environ.get("LMCAL_TEST_MARKER"), "argv", sys.argv[1:],
      "main", __name__, flush=True)
if "sleep" in sys.argv:
    child = subprocess.Popen(["sleep", "600"])
    print("child", child.pid, flush=True)
    time.sleep(600)
sys.exit(int(sys.argv[1]))
'''

LOKY_STAGE = '''
import os
from joblib import Parallel, delayed
print("jobs", len(Parallel(n_jobs=2, backend="loky")(delayed(os.getpid)() for _ in range(4))), flush=True)
'''  # a local_parallel sweep's launcher (hydra-joblib-launcher) in small: loky worker processes, idle 300 s


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    mods = tmp_path_factory.mktemp("mods")
    (mods / "lmcal_fake_stage.py").write_text(STAGE)
    (mods / "lmcal_loky_stage.py").write_text(LOKY_STAGE)
    env = {**os.environ, "PYTHONPATH": str(mods), "OMP_NUM_THREADS": "1"}
    w = Worker.start(env)
    yield w, env
    w.close()


def _wait_for(path, text, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.is_file() and text in path.read_text():
            return path.read_text()
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in {path}")


def test_takes_only_this_pythons_lmcal_entry_points():
    assert takes([sys.executable, "-m", "lmcal.train", "x=1"]) and takes([sys.executable, "-m", "lmcal.evaluate"])
    assert not takes(["python3.9", "-m", "lmcal.train"]) and not takes([sys.executable, "-m", "lmcal.reproduce"])
    assert not takes([sys.executable, "script.py"]) and not takes([])


def test_a_warm_stage_has_its_exit_status_environment_threads_and_log(worker, tmp_path):
    w, env = worker
    log = tmp_path / "stage.log"
    log.write_text("$ the command\n")
    p = w.launch([sys.executable, "-m", "lmcal_fake_stage", "3", "a b"],
                 {**env, "LMCAL_TEST_MARKER": "mine", "OMP_NUM_THREADS": "2"}, log)
    assert p.wait(timeout=60) == 3 and p.poll() == 3 and p.returncode == 3
    # appended to the log, run as __main__ with its own arguments, its environment, its threads (not the worker's)
    assert log.read_text() == "$ the command\nthreads 2 marker mine argv ['3', 'a b'] main __main__\n"


def test_the_same_failure_as_a_fresh_process(worker, tmp_path):
    w, env = worker
    cmd = [sys.executable, "-m", "lmcal.evaluate", f"ckpt={tmp_path / 'none.ckpt'}", "logger=none",
           f"hydra.run.dir={tmp_path / 'run'}"]
    fresh = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    log = tmp_path / "warm.log"
    assert w.launch(cmd, env, log).wait(timeout=120) == fresh.returncode == 2
    assert log.read_text() == fresh.stdout + fresh.stderr
    assert log.read_text().startswith("lmcal: error: Checkpoint not found")


def test_end_groups_stops_a_warm_stage_and_its_children(worker, tmp_path):
    w, env = worker
    log = tmp_path / "stage.log"
    p = w.launch([sys.executable, "-m", "lmcal_fake_stage", "0", "sleep"], env, log)
    child = int(_wait_for(log, "child ").split("child ")[1].split()[0])
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(timeout=0.2)
    end_groups([p], grace=10)
    assert p.returncode == -15  # SIGTERM, as Popen reports it
    deadline = time.time() + 10
    while not gone(child) and time.time() < deadline:
        time.sleep(0.05)
    assert gone(p.pid) and gone(child)


def test_a_stage_ends_with_its_worker_and_reads_as_failed(tmp_path_factory, tmp_path):
    mods = tmp_path_factory.mktemp("mods2")
    (mods / "lmcal_fake_stage.py").write_text(STAGE)
    env = {**os.environ, "PYTHONPATH": str(mods), "OMP_NUM_THREADS": "1"}
    w = Worker.start(env)
    log = tmp_path / "stage.log"
    p = w.launch([sys.executable, "-m", "lmcal_fake_stage", "0", "sleep"], env, log)
    child = int(_wait_for(log, "child ").split("child ")[1].split()[0])
    w.proc.kill()  # as a kill -9 of the worker: its child dies with it (PR_SET_PDEATHSIG)
    assert p.wait(timeout=30) == -9
    deadline = time.time() + 10
    while not gone(p.pid) and time.time() < deadline:
        time.sleep(0.05)
    assert gone(p.pid)
    w.close()
    os.kill(child, 9)  # the stage's own child is the stage's to end; here nothing did


def test_the_scheduler_forks_lmcal_stages_from_one_warm_worker(tmp_path, monkeypatch):
    """Through the scheduler with warm_worker on: the lmcal entry points are forked by the worker, anything else
    is started as before; without the setting (a plan of its own; profiles set it, warm_worker=false unsets it), nothing
    is forked."""
    from omegaconf import OmegaConf

    from lmcal.pipeline import schedule as S

    monkeypatch.setattr(S, "machine_gflops", lambda: 0.0)
    launched = []
    launch = Worker.launch
    monkeypatch.setattr(Worker, "launch", lambda self, cmd, env, log: launched.append(cmd[2]) or launch(
        self, cmd, env, log))

    def stages(out):
        def stage(name, cmd, deps=()):
            return {"name": name, "dir": out / name, "done": [out / "logs" / f"{name}.log"], "deps": list(deps),
                    "cmd": [sys.executable, *cmd]}
        return [stage("a", ["-m", "lmcal.evaluate", "--help"]), stage("b", ["-c", "print('plain')"], ["a"]),
                stage("c", ["-m", "lmcal.train", "--help"], ["b"])]

    for setting, forked in (({"warm_worker": True}, ["lmcal.evaluate", "lmcal.train"]), ({}, [])):
        launched.clear()
        out = tmp_path / str(bool(setting))
        S.schedule(stages(out), OmegaConf.create(setting), out, {n: {} for n in "abc"}, jobs=1, ref={})
        assert launched == forked
        logs = {n: (out / "logs" / f"{n}.log").read_text() for n in "abc"}
        assert "plain" in logs["b"] and "evaluate" in logs["a"] and "train" in logs["c"]
        assert all(log.startswith(f"\n$ {sys.executable} -") for log in logs.values())


def test_a_warm_stage_with_loky_workers_ends_with_its_jobs(worker, tmp_path):
    """A forked stage whose jobs ran in loky's processes (hydra/launcher=local_parallel) ends once they are done, as a
    fresh process does (in seconds): its exit runs threading's exit hooks, loky's among them, which stop the workers
    that multiprocessing's exit hook would otherwise join until their idle timeout (300 s)."""
    w, env = worker
    log = tmp_path / "stage.log"
    t0 = time.monotonic()
    p = w.launch([sys.executable, "-m", "lmcal_loky_stage"], env, log)
    assert p.wait(timeout=20) == 0, log.read_text()
    assert "jobs 4" in log.read_text() and time.monotonic() - t0 < 20
