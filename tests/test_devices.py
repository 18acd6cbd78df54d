"""`jobs=N` on a machine with several GPUs: each running stage gets its own (CUDA_VISIBLE_DEVICES)."""

import sys

from omegaconf import OmegaConf

import lmcal.pipeline.devices as D
import lmcal.pipeline.schedule as S
from lmcal.utils.settings import CONF_DIR


def test_visible_gpus_follow_cuda_visible_devices_or_the_count():
    assert D.visible_gpus({"CUDA_VISIBLE_DEVICES": "2,5"}, count=8) == ["2", "5"]
    assert D.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, count=8) == []
    assert D.visible_gpus({}, count=3) == ["0", "1", "2"]
    assert D.visible_gpus({}, count=0) == []


def test_each_slot_its_own_gpu_and_nothing_with_one_or_none():
    assert [D.device_env(s, ["0", "1"]) for s in range(3)] == [{"CUDA_VISIBLE_DEVICES": "0"},
                                                               {"CUDA_VISIBLE_DEVICES": "1"},
                                                               {"CUDA_VISIBLE_DEVICES": "0"}]
    assert D.device_env(0, ["3"]) == {} and D.device_env(1, []) == {}
    # stages that share a GPU share its memory budget (half the free memory) instead of each taking half
    assert D.device_env(0, ["3"], jobs=2) == {"LMCAL_GPU_SHARERS": "2"}
    assert D.device_env(1, ["0", "1"], jobs=4) == {"CUDA_VISIBLE_DEVICES": "1", "LMCAL_GPU_SHARERS": "2"}
    assert D.device_env(0, ["0", "1"], jobs=2) == {"CUDA_VISIBLE_DEVICES": "0"} and D.device_env(0, [], jobs=3) == {}
    assert D.free_slot({}) == 0
    assert D.free_slot({"a": {"slot": 0}, "b": {"slot": 2}}) == 1
    assert D.free_slot({"report": {}, "a": {"slot": 0}}) == 1


def _stage(name, folder, deps=(), seconds=0.0):
    done = folder / name / "done.txt"
    code = (f"import os, time, pathlib; time.sleep({seconds}); p = pathlib.Path({str(done)!r}); "
            "p.parent.mkdir(parents=True, exist_ok=True); p.write_text(os.environ.get('CUDA_VISIBLE_DEVICES', '-'))")
    return {"name": name, "dir": folder / name, "done": [done], "deps": list(deps),
            "cmd": [sys.executable, "-c", code]}


def test_stages_side_by_side_get_different_gpus(tmp_path, monkeypatch):
    """Two GPUs (a fake count), jobs=2: the two independent stages run at once on GPUs 0 and 1; the stage after
    them takes the first free slot's GPU again. With jobs=1 no stage is given a GPU."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(D, "cuda_count", lambda: 2)
    monkeypatch.setattr(S, "machine_gflops", lambda: 0.0)
    stages = [_stage("a", tmp_path, seconds=2), _stage("b", tmp_path, seconds=2), _stage("c", tmp_path, ["a", "b"])]
    current = {st["name"]: {} for st in stages}
    S.schedule(stages, OmegaConf.create({}), tmp_path, current, jobs=2, ref={})
    got = {st["name"]: st["done"][0].read_text() for st in stages}
    assert sorted([got["a"], got["b"]]) == ["0", "1"] and got["c"] == "0"

    one = tmp_path / "one"
    stages = [_stage("a", one), _stage("b", one)]
    S.schedule(stages, OmegaConf.create({}), one, {"a": {}, "b": {}}, jobs=1, ref={})
    assert [st["done"][0].read_text() for st in stages] == ["-", "-"]


def test_each_stage_gets_its_share_of_the_cores_unless_the_user_set_threads():
    thread_env = D.thread_env
    assert thread_env(1, env={}, cores=2) == {"OMP_NUM_THREADS": "2"}
    assert thread_env(2, env={}, cores=2) == {"OMP_NUM_THREADS": "1"}
    assert thread_env(3, env={}, cores=2) == {"OMP_NUM_THREADS": "1"}  # never 0
    assert thread_env(4, env={}, cores=16) == {"OMP_NUM_THREADS": "4"}
    assert thread_env(2, env={"OMP_NUM_THREADS": "3"}, cores=16) == {}  # theirs holds


def test_stage_processes_side_by_side_start_with_their_share(tmp_path, monkeypatch):
    """Through the scheduler: two stages at once on this machine each see cores // 2 threads in their torch."""
    import os

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    stages = []
    for name in ("a", "b"):
        d = tmp_path / name
        stages.append({"name": name, "dir": d, "done": [d / "threads.txt"], "deps": [],
                       "cmd": [sys.executable, "-c", f"import pathlib, torch; p = pathlib.Path({str(d)!r}); "
                               "p.mkdir(exist_ok=True); (p / 'threads.txt').write_text(str(torch.get_num_threads()))"]})
    S.schedule(stages, OmegaConf.create({}), tmp_path, {"a": {}, "b": {}}, jobs=2, ref={})
    assert [(tmp_path / n / "threads.txt").read_text() for n in ("a", "b")] == [str(max(1, cores // 2))] * 2


TAU = [sys.executable, "-m", "lmcal.train", "-m", "data=ptb", "hydra/launcher=local_parallel",
       "hydra.launcher.n_jobs=6", "model.memory_tau=5,10,20,50,100,200", "analysis.stages=[]",
       "hydra.sweep.subdir=tau_${model.memory_tau}"]


def test_a_local_parallel_sweep_counts_its_jobs_at_once():
    assert D.sweep_jobs(TAU) == 6
    assert D.sweep_jobs([o.replace("n_jobs=6", "n_jobs=4") for o in TAU]) == 4
    assert D.sweep_jobs([o for o in TAU if o != "model.memory_tau=5,10,20,50,100,200"] + ["model.memory_tau=5,10"]) \
        == 2  # the taus left to train (a resumed stage), not n_jobs
    default = int(OmegaConf.load(CONF_DIR / "hydra" / "launcher" / "local_parallel.yaml").n_jobs)
    assert D.sweep_jobs([o for o in TAU if not o.startswith("hydra.launcher.n_jobs")]) == default
    assert D.sweep_jobs([o for o in TAU if o != "hydra/launcher=local_parallel"]) == 1  # one after another
    assert D.sweep_jobs([sys.executable, "-m", "lmcal.train", "model.memory_tau=5"]) == 1
    assert D.sweep_points(["a=1,2,3", "b=x,y", "c=[1,2]", "d=range(0,4)"]) == 24


def test_each_sweep_job_its_own_gpu_round_robin_and_its_share_of_the_cores():
    assert [D.job_gpu(k, ["0", "1", "2", "3"]) for k in range(6)] == ["0", "1", "2", "3", "0", "1"]
    assert [D.job_gpu(k, ["5"]) for k in range(3)] == ["5"] * 3 and D.job_gpu(2, []) == ""
    assert [D.job_gpu(k, ["GPU-a", "GPU-b"]) for k in range(3)] == ["GPU-a", "GPU-b", "GPU-a"]  # UUIDs as given
    assert D.job_threads(6, cores=16) == 2 and D.job_threads(6, cores=4) == 1 and D.job_threads(1, cores=8) == 8


def test_the_tau_stage_gets_every_gpu_its_slots_first_and_its_jobs_thread_share():
    gpus = ["0", "1", "2", "3"]
    assert D.device_env(0, gpus, jobs=1, sweep=6) == {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "LMCAL_GPUS": "0,1,2,3",
                                                      "LMCAL_GPU_SHARERS": "2"}  # 6 jobs on 4 GPUs: 2 share one
    assert D.device_env(2, gpus, jobs=2, sweep=4) == {"CUDA_VISIBLE_DEVICES": "2,3,0,1", "LMCAL_GPUS": "2,3,0,1",
                                                      "LMCAL_GPU_SHARERS": "2"}  # with another stage beside it
    assert D.device_env(0, gpus, jobs=1, sweep=4) == {"CUDA_VISIBLE_DEVICES": "0,1,2,3", "LMCAL_GPUS": "0,1,2,3"}
    assert D.device_env(0, ["0"], jobs=1, sweep=6) == {"LMCAL_GPU_SHARERS": "6"}  # one GPU: all six on it
    assert D.device_env(0, [], jobs=1, sweep=6) == {}
    assert D.device_env(1, ["0", "1"], jobs=4) == {"CUDA_VISIBLE_DEVICES": "1", "LMCAL_GPU_SHARERS": "2"}  # as before
    assert D.thread_env(1, env={}, cores=16, sweep=6) == {"OMP_NUM_THREADS": "16", "LMCAL_HOST_JOBS": "6"}
    assert D.thread_env(2, env={}, cores=16, sweep=6) == {"OMP_NUM_THREADS": "8", "LMCAL_HOST_JOBS": "12"}
    assert D.thread_env(2, env={"OMP_NUM_THREADS": "3"}, cores=16, sweep=6) == {}  # theirs holds, in every job


def test_a_job_takes_its_gpu_and_threads_from_the_stage_env(monkeypatch):
    import torch

    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    env = {"LMCAL_GPUS": "2,3,0,1", "LMCAL_HOST_JOBS": "6", "CUDA_VISIBLE_DEVICES": "2,3,0,1"}
    monkeypatch.setattr(D, "cores_here", lambda: 16)
    assert D.apply_job_devices(5, env) == {"CUDA_VISIBLE_DEVICES": "3", "OMP_NUM_THREADS": "2"}
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and threads == [2]
    monkeypatch.setattr(D, "_cuda_started", lambda: True)  # a reused worker keeps the GPU CUDA started on
    env = {"LMCAL_GPUS": "0,1", "CUDA_VISIBLE_DEVICES": "1"}
    assert D.apply_job_devices(2, env) == {} and env["CUDA_VISIBLE_DEVICES"] == "1"
    assert D.apply_job_devices(0, {}) == {} and threads == [2]  # a run of its own: nothing changes


APP = '''
import os, pathlib, sys
import hydra, torch
from hydra.core.hydra_config import HydraConfig
from lmcal.pipeline.devices import apply_job_devices


@hydra.main(version_base="1.3", config_path=None, config_name=None)
def main(cfg):
    hc = HydraConfig.get()
    apply_job_devices(hc.job.num)
    pathlib.Path(hc.runtime.output_dir, "devices.txt").write_text(
        f"{os.environ.get('CUDA_VISIBLE_DEVICES')} {torch.get_num_threads()}")


main()
'''


def test_a_joblib_sweeps_jobs_spread_over_the_stages_gpus(tmp_path, monkeypatch):
    """Through Hydra's joblib launcher (local_parallel's), as the tau stage runs: three jobs, two at once, on two
    (fake) GPUs: jobs 0 and 2 on the first, job 1 on the second, each with cores // 2 threads, not the stage's
    cores // 1 (OMP_NUM_THREADS in the stage's env, which joblib passes on)."""
    import os
    import subprocess

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    (tmp_path / "app.py").write_text(APP)
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, str(tmp_path / "app.py"), "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
           "+x=1,2,3", f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=${hydra.job.num}"]
    jobs = D.sweep_jobs([o.replace("hydra/launcher=joblib", D.SIDE_BY_SIDE) for o in cmd])
    assert jobs == 2
    env = {**os.environ, **D.thread_env(1, env={}, sweep=jobs), **D.device_env(1, ["4", "7"], 1, sweep=jobs)}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    share = max(1, D.cores_here() // 2)
    assert [(sweep / str(k) / "devices.txt").read_text() for k in range(3)] == [f"7 {share}", f"4 {share}",
                                                                              f"7 {share}"]
