"""launcher=slurm without a cluster: the profile's keys, the sbatch options submitit writes, and the pipeline's
submissions and bookkeeping against a fake executor (the real cluster: tests/slurm, make test-slurm)."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

import lmcal.pipeline.slurm as SL
from lmcal.errors import LmcalError
from lmcal.pipeline.plan import load_profile
from lmcal.pipeline.reproduce import reproduce


def test_every_profile_takes_the_launcher_and_its_slurm_settings(tmp_path):
    cfg = load_profile(["profile=smoke", "launcher=slurm", "slurm.partition=gpu", "slurm.gpus_per_job=1"])
    assert cfg.launcher == "slurm" and cfg.slurm.partition == "gpu" and cfg.slurm.gpus_per_job == 1
    assert load_profile(["profile=cpu"]).launcher == "local"
    with pytest.raises(LmcalError, match="slurm.partiton"):
        load_profile(["profile=smoke", "slurm.partiton=gpu"])
    with pytest.raises(LmcalError, match="launcher=k8s is not a launcher"):
        reproduce(load_profile(["profile=smoke", "launcher=k8s", f"out={tmp_path / 'out'}"]))
    assert not (tmp_path / "out").exists()


def _fake_slurm_bin(folder: Path) -> Path:
    """A folder of Slurm's command names that do nothing: submitit's executor only looks for srun on the PATH."""
    folder.mkdir()
    for tool in ("sbatch", "srun", "squeue", "scancel"):
        (folder / tool).write_text("#!/bin/sh\nexit 0\n")
        (folder / tool).chmod(0o755)
    return folder


def test_the_sbatch_options(tmp_path, monkeypatch):
    from submitit.slurm.slurm import _make_sbatch_string

    monkeypatch.setenv("PATH", f"{_fake_slurm_bin(tmp_path / 'bin')}:/usr/bin:/bin")  # a machine with no Slurm too
    s = OmegaConf.merge(SL.slurm_defaults(), {"partition": "gpu", "gpus_per_job": 1, "cpus_per_job": 8, "mem_gb": 32,
                                              "account": "lab", "additional": {"exclude": "node13"}})
    ex = SL.executor(s, tmp_path)
    ex.update_parameters(job_name="lmcal-decoders", dependency="afterok:11:12")
    script = _make_sbatch_string(command="python -m x", folder=str(tmp_path), **ex.parameters)
    for line in ("--partition=gpu", "--gpus-per-node=1", "--cpus-per-task=8", "--mem=32GB", "--account=lab",
                 "--time=2880", "--dependency=afterok:11:12", "--requeue", "--exclude=node13",
                 "--job-name=lmcal-decoders"):
        assert f"#SBATCH {line}\n" in script, line
    # torch's threads are the job's cores unless the user set theirs (a job of 8 cores: 8; sbatch exports the env)
    assert "\nexport OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}\n" in script


class FakeExecutor:
    """Runs each submitted function at once, in this process; records each job's sbatch dependency."""

    def __init__(self, fail=()):
        self.params, self.submitted, self.fail = {}, [], fail

    def update_parameters(self, **kw):
        self.params.update(kw)

    def submit(self, fn, *args):
        job_id = str(100 + len(self.submitted))
        name = self.params["job_name"].removeprefix("lmcal-")
        self.submitted.append((name, self.params.get("dependency")))
        ok = True
        if name in self.fail:
            ok = False
        else:
            fn(*args)
        return SimpleNamespace(job_id=job_id, ok=ok, paths=SimpleNamespace(stdout=Path(f"/slurm/{job_id}_0_log.out")))


def _stage(name, folder, deps=()):
    done = folder / name / "done.txt"
    return {"name": name, "dir": folder / name, "done": [done], "deps": list(deps),
            "cmd": [sys.executable, "-c", f"import pathlib; p = pathlib.Path({str(done)!r}); "
                                          "p.parent.mkdir(parents=True, exist_ok=True); p.write_text('ok')"]}


def _plan(folder):
    def report(cfg, out):
        (out / "results.json").write_text("{}")

    return [_stage("a", folder), _stage("b", folder), _stage("c", folder, ["a", "b"]), _stage("d", folder, ["c"]),
            {"name": "report", "dir": folder, "done": [folder / "results.json"], "deps": ["a", "b", "c", "d"],
             "fn": report}]


def _run(tmp_path, monkeypatch, fake):
    monkeypatch.setattr(SL, "executor", lambda s, folder: fake)
    monkeypatch.setattr(SL, "job_states", lambda jobs: {n: ("COMPLETED" if j.ok else "CANCELLED", 7.0)
                                                        for n, j in jobs.items()})
    stages = _plan(tmp_path)
    SL.schedule_slurm(stages, OmegaConf.create({"slurm": {"poll_s": 0}}), tmp_path,
                      {st["name"]: {} for st in stages}, ref={})


def test_each_stage_a_job_after_the_jobs_it_needs(tmp_path, monkeypatch, capsys):
    fake = FakeExecutor()
    _run(tmp_path, monkeypatch, fake)
    assert fake.submitted == [("a", None), ("b", None), ("c", "afterok:100:101"), ("d", "afterok:102")]
    rec = json.loads((tmp_path / "stages" / "c.json").read_text())
    assert rec["status"] == "done" and rec["slurm_job_id"] == "102" and rec["seconds"] == 7.0
    assert json.loads((tmp_path / "stages" / "report.json").read_text())["status"] == "done"
    assert "c: Slurm job 102 after 100, 101" in capsys.readouterr().out

    fake = FakeExecutor()  # a rerun with b's result gone: b, and what uses it, run again; a is not submitted
    (tmp_path / "b" / "done.txt").unlink()
    _run(tmp_path, monkeypatch, fake)
    assert fake.submitted == [("b", None), ("c", "afterok:100"), ("d", "afterok:101")]


def test_a_failed_job_names_its_logs_and_command_and_cancels_the_rest(tmp_path, monkeypatch):
    cancelled = []
    monkeypatch.setattr(SL, "cancel", lambda jobs: cancelled.extend(jobs))
    with pytest.raises(LmcalError) as e:
        _run(tmp_path, monkeypatch, FakeExecutor(fail=("b",)))
    msg = str(e.value)
    assert "Stage 'b' failed" in msg and str(tmp_path / "logs" / "b.log") in msg and "/slurm/101_0_log.out" in msg
    assert "Slurm job 101 ended CANCELLED" in msg and "launcher=slurm" in msg and "-c" in msg
    assert sorted(cancelled) == ["b", "c", "d"]  # a had finished; the others are cancelled
    assert not (tmp_path / "results.json").exists()


def test_job_states_from_squeue(tmp_path, monkeypatch):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "squeue").write_text("#!/bin/sh\necho '5|RUNNING|2026-01-01T10:00:00|2026-01-02T10:00:00'\n"
                                 "echo '6|COMPLETED|2026-01-01T10:00:00|2026-01-01T10:01:05'\n")
    (bin_ / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_}:/usr/bin:/bin")
    jobs = {"a": SimpleNamespace(job_id="5"), "b": SimpleNamespace(job_id="6")}
    got = SL.job_states(jobs)
    assert got["a"][0] == "RUNNING" and got["b"] == ("COMPLETED", 65.0)


def test_launcher_slurm_without_slurm_is_refused_before_anything_is_made(tmp_path):
    """The real entry point on a machine whose PATH has no Slurm: one paragraph naming the missing commands, exit 2,
    no output folder."""
    import subprocess

    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "sbatch").symlink_to("/bin/true")  # sbatch alone: srun, squeue and scancel are missing
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "lmcal.reproduce", "profile=smoke", "launcher=slurm", f"out={out}"],
                       capture_output=True, text=True, env={"PATH": str(bin_), "HOME": str(tmp_path)}, timeout=300)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip()
    assert err.startswith("lmcal: error:") and "\n" not in err, err
    assert "srun, squeue, scancel are not on this machine's PATH" in err and "launcher=local" in err
    assert not out.exists()


@pytest.mark.parametrize("launcher", ["slurm_cpu", "slurm_gpu"])
def test_hydras_slurm_launcher_presets_compose(launcher):
    from hydra import compose, initialize_config_dir

    from lmcal.utils.settings import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"hydra/launcher={launcher}"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher") and cfg.hydra.launcher.tasks_per_node == 1


@pytest.mark.parametrize("override, gpus", [([], 1), (["hydra.launcher.gpus_per_node=4"], 4)])
def test_the_slurm_gpu_presets_batch_script_asks_for_its_gpus(tmp_path, monkeypatch, override, gpus):
    """hydra/launcher=slurm_gpu through hydra-submitit-launcher's own launch, up to sbatch (a stand-in that keeps the
    script it is given and fails, so nothing waits on a job): the script asks for the preset's GPUs, one node's worth
    per job, with its cores, memory and time, as one array job of the sweep's points."""
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from lmcal.utils.settings import CONF_DIR

    bin_ = _fake_slurm_bin(tmp_path / "bin")
    kept = tmp_path / "kept.sh"
    (bin_ / "sbatch").write_text(f'#!/bin/sh\ncp "$1" {kept}\necho "sbatch: error: no cluster here" >&2\nexit 1\n')
    monkeypatch.setenv("PATH", f"{bin_}:/usr/bin:/bin")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["hydra/launcher=slurm_gpu", "hydra.launcher.partition=gpu",
                                          f"hydra.sweep.dir={tmp_path / 'sweep'}", *override],
                      return_hydra_config=True)
    launcher = instantiate(cfg.hydra.launcher)
    launcher.config = cfg  # what Hydra's setup gives it; launch reads only the sweep folder from it
    with pytest.raises(Exception, match="no cluster here|sbatch"):
        launcher.launch([["model.memory_tau=5"], ["model.memory_tau=10"]], initial_job_idx=0)
    script = kept.read_text()
    for line in (f"--gpus-per-node={gpus}", "--ntasks-per-node=1", "--cpus-per-task=8", "--mem=32GB",
                 "--time=2880", "--partition=gpu", "--array=0-1%2"):  # (its 16 at once, of 2)
        assert f"#SBATCH {line}\n" in script, (line, script)


def test_a_sweep_stage_in_one_slurm_job_spreads_its_jobs_over_the_jobs_gpus(monkeypatch):
    """The tau-models under local_parallel as one Slurm job of 4 GPUs (slurm.gpus_per_job=4): its six jobs take the
    allocation's GPUs in turn (Slurm's CUDA_VISIBLE_DEVICES) and share its cores; a plain stage adds nothing."""
    from lmcal.pipeline import devices as D

    monkeypatch.setattr(SL, "cores_here", lambda: 8)
    monkeypatch.setattr(D, "cores_here", lambda: 8)
    tau = [sys.executable, "-m", "lmcal.train", "-m", "hydra/launcher=local_parallel", "hydra.launcher.n_jobs=6",
           "model.memory_tau=5,10,15,20,25,30"]
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7", "OMP_NUM_THREADS": "8"}  # the executor's default: the job's cores
    assert SL.sweep_env(tau, env) == {"OMP_NUM_THREADS": "8", "LMCAL_HOST_JOBS": "6",
                                      "CUDA_VISIBLE_DEVICES": "4,5,6,7", "LMCAL_GPUS": "4,5,6,7",
                                      "LMCAL_GPU_SHARERS": "2"}
    assert "LMCAL_HOST_JOBS" not in SL.sweep_env(tau, {**env, "OMP_NUM_THREADS": "2"})  # the user's threads hold
    assert SL.sweep_env([sys.executable, "-m", "lmcal.train", "model.memory_tau=5"], env) == {}
