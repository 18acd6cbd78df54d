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
    r = multirun(tmp_path, "data=markov", "model.memory_tau=0,3", "analysis.stages=[]")  # tau=0 is invalid
    assert r.returncode == 0, r.stderr[-3000:]
    bad, good = (tmp_path / "sweep" / f"data=markov,experiment=smoke,model.memory_tau={t}" for t in (0, 3))
    assert "memory_tau" in json.loads((bad / "failed.json").read_text())["error"]
    assert not (bad / "metrics.json").exists()
    assert json.loads((good / "metrics.json").read_text())["memory_tau"] == 3


def test_launcher_and_sweep_presets_compose():
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=paper_tau", "hydra/launcher=slurm_gpu"], return_hydra_config=True)
        assert cfg.hydra.sweeper.params["model.memory_tau"] == "5,10,15,20,25,30"
        assert cfg.hydra.launcher.gpus_per_node == 1 and "Slurm" in cfg.hydra.launcher._target_
        assert (cfg.model.emb_size, cfg.model.hidden_size, cfg.trainer.max_epochs) == (400, 1150, 500)
        cfg = compose("train", overrides=["hydra/launcher=local_parallel"], return_hydra_config=True)
        assert "Joblib" in cfg.hydra.launcher._target_
