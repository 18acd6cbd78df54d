"""`jobs=N` on a machine with several GPUs: each running stage gets its own (CUDA_VISIBLE_DEVICES)."""

import sys

from omegaconf import OmegaConf

import lmcal.pipeline.devices as D
import lmcal.pipeline.schedule as S


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
