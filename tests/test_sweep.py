"""Hydra multiruns in a subprocess: sweeps over tau and datasets, and failure isolation."""

import json
import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from lmcal.utils.settings import CONF_DIR
from tests.conftest import DATA_ROOT, HAVE_PTB


def multirun(tmp_path, *overrides):
    env = {**os.environ, "WANDB_MODE": "offline"}
    if HAVE_PTB:
        env["LMCAL_DATA_ROOT"] = DATA_ROOT
    args = [sys.executable, "-m", "lmcal.train", "-m", "experiment=smoke", "logger=csv",
            f"hydra.sweep.dir={tmp_path / 'sweep'}", *overrides]
    return subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_sweep_over_tau_and_datasets_leaves_metrics_per_job(tmp_path):
    datasets = ["ptb", "markov"] if HAVE_PTB else ["markov"]
    r = multirun(tmp_path, f"data={','.join(datasets)}", "model.memory_tau=2,4", "analysis.stages=[]")
    assert r.returncode == 0, r.stderr[-3000:]
    for ds in datasets:
        found = sorted((tmp_path / "sweep").glob(f"data={ds},*/metrics.json"))
        assert [p.parent.name for p in found] == [f"data={ds},experiment=smoke,model.memory_tau={t}" for t in (2, 4)]
        for p in found:
            m = json.loads(p.read_text())
            assert m["dataset"] == ds and m["memory_tau"] in (2, 4)
            assert m["ce_limited_nats"]["test"] == m["test_ce_nats"] > 0


@pytest.mark.slow
def test_a_failing_job_does_not_stop_the_sweep(tmp_path):
    r = multirun(tmp_path, "data=markov", "model.memory_tau=3", "optim.lr=1e30,30", "analysis.stages=[]")
    assert r.returncode == 1, r.stderr[-3000:]  # every job ran; the exit status says one failed (lr=1e30 diverged)
    # Hydra names the folder after the value as it prints it (1e+30 or 1e30, by version)
    bad, good = (next((tmp_path / "sweep").glob(f"data=markov,experiment=smoke,model.memory_tau=3,optim.lr={lr}"))
                 for lr in ("1e*30", "30"))
    assert "diverged" in json.loads((bad / "failed.json").read_text())["error"]
    assert not (bad / "metrics.json").exists()
    assert json.loads((good / "metrics.json").read_text())["memory_tau"] == 3


def test_a_job_out_of_range_refuses_the_sweep_before_it_starts(tmp_path):
    r = multirun(tmp_path, "data=markov", "model.memory_tau=0,3", "analysis.stages=[]")  # tau=0 is invalid
    assert r.returncode == 2 and "lmcal: error: Job 0 of the multirun (" in r.stderr, r.stderr[-3000:]
    assert "Setting out of range: model.memory_tau=0" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "sweep").exists()  # no job ran, no folder was made


def test_launcher_and_sweep_presets_compose():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=paper_tau", "hydra/launcher=slurm_gpu"], return_hydra_config=True)
        assert cfg.hydra.sweeper.params["model.memory_tau"] == "5,10,15,20,25,30"
        assert cfg.hydra.launcher.gpus_per_node == 1 and "Slurm" in cfg.hydra.launcher._target_
        assert (cfg.model.emb_size, cfg.model.hidden_size, cfg.trainer.max_epochs) == (400, 1150, 500)
        cfg = compose("train", overrides=["hydra/launcher=local_parallel"], return_hydra_config=True)
        assert "Joblib" in cfg.hydra.launcher._target_


@pytest.mark.slow  # ~40 s on 2 cores
def test_a_tau_sweep_skips_the_presets_full_model_stages_and_ends_with_one_table(tmp_path):
    """experiment=smoke lists entropy_rate and calibration, which do not apply to tau-models: skipped with a note.
    One job fails as it runs (lr=1e30 diverges); the multirun still runs the other, ends with one table of both, and
    exits 1.
    A path value (memory.base_runs) never becomes part of a job's folder name."""
    base = tmp_path / "some where" / "base"
    args = [sys.executable, "-m", "lmcal.train", "-m", "experiment=smoke", "data=markov", "logger=csv",
            "trainer.max_epochs=1", "data.corpus_kwargs.n_train=20000", "data.corpus_kwargs.n_valid=3000",
            "data.corpus_kwargs.n_test=3000", "model.memory_tau=2", "optim.lr=1e30,30",
            f"memory.base_runs={{markov: '{base}'}}",
            f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_MODE", "LMCAL_DATA_ROOT")}
    r = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out[-3000:]
    assert "Skipping stages entropy_rate, calibration: the preset lists them" in out
    jobs = sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert len(jobs) == 2 and all(f"optim.lr={lr}" in j.replace("1e+30", "1e30")  # Hydra prints 1e+30 or 1e30
                                  for j, lr in zip(jobs, ("1e30", "30"), strict=True))
    assert not any("base_runs" in j or "some where" in j for j in jobs)
    rows = json.loads((tmp_path / "sweep" / "runs.json").read_text())
    assert [r["status"].split(":")[0] for r in rows] == ["failed", "ok"]
    assert "optim.lr=30" in rows[1]["overrides"] and rows[1]["test_ppl"] > 1 and rows[1]["val_ppl"] > 1
    table = (tmp_path / "sweep" / "runs.md").read_text()
    assert table.splitlines()[2] == "| run | dataset | τ | val ppl | test ppl | wall time | status | folder |"
    assert len(table.splitlines()) == 6 and "base_runs" not in table and "logger" not in table
    # what the jobs share is said once, above the table; each row names what differs
    assert "| optim.lr=30 |" in table and table.splitlines()[0].startswith("All runs: experiment=smoke")
    assert table in r.stdout and "1 of 2 jobs ok" in r.stdout and "1 of 2 jobs failed" in r.stdout


def test_a_stage_named_on_the_command_line_that_does_not_apply_stays_an_error(tmp_path):
    r = subprocess.run([sys.executable, "-m", "lmcal.train", "experiment=smoke", "data=markov", "logger=none",
                        "model.memory_tau=2", "analysis.stages=[entropy_rate]", f"hydra.run.dir={tmp_path / 'run'}"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "Stage entropy_rate does not apply to a tau-limited model" in r.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_memory_base_runs_finds_each_datasets_base_model(tmp_path):
    from lmcal.models.checkpoint import base_checkpoint

    (tmp_path / "base_ptb" / "checkpoints").mkdir(parents=True)
    runs = {"ptb": str(tmp_path / "base_ptb"), "markov": str(tmp_path / "markov.ckpt")}
    assert base_checkpoint({"base_ckpt": None, "base_runs": runs}, "ptb") == str(
        tmp_path / "base_ptb" / "checkpoints" / "best.ckpt")  # a run folder: its best checkpoint
    assert base_checkpoint({"base_runs": runs}, "markov") == str(tmp_path / "markov.ckpt")  # a checkpoint as given
    assert base_checkpoint({"base_ckpt": "/b.ckpt", "base_runs": runs}, "ptb") == "/b.ckpt"  # base_ckpt wins
    assert base_checkpoint({"base_runs": runs}, "wikitext2") is None and base_checkpoint(None, "ptb") is None
