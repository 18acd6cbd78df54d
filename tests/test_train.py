"""End to end through Hydra: the smoke experiment via the compose API, resume, and the CLI's errors."""

import json
import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from lmcal.train import train
from lmcal.utils.settings import CONF_DIR
from tests.test_wandb import runs_under


def smoke_cfg(tmp_path, overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["experiment=smoke", *overrides])
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path)
    return cfg


def test_smoke_run_through_hydra_writes_metrics_and_checkpoints(tmp_path, data_overrides):
    cfg = smoke_cfg(tmp_path, data_overrides)  # default logger: W&B, offline
    m = train(cfg)
    on_disk = json.loads((tmp_path / "metrics.json").read_text())
    assert on_disk == m
    for key in ("val_ppl", "test_ppl", "test_ce_nats", "params", "epochs", "tokens_per_s"):
        assert key in m
    assert m["epochs"] == 2 and m["tokens_per_s"] > 0 and m["params"] > 0
    assert 1 < m["test_ppl"] < 1.5 * cfg_vocab(m, tmp_path)  # it learned something: below ~uniform
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file() and (tmp_path / "checkpoints" / "best.ckpt").is_file()
    assert list((tmp_path / "wandb").glob("offline-run-*")), "offline W&B run not written"
    import wandb

    assert wandb.run is None  # the run was finished
    (run,) = runs_under(tmp_path)  # the stages' generation curves are series against t, beside their PNGs
    assert run["job_type"] == "train" and run["summary"]["final/test_ppl"] == pytest.approx(m["test_ppl"])
    horizon = len(json.loads((tmp_path / "entropy_rate.json").read_text())["curve_nats"])
    for key, series in (("entropy_rate/curves", "model"), ("calibration/curves", "model"),
                        ("calibration/curves", "calibration")):  # (the plain model's curve "model" in every stage)
        assert [h[f"{key}/t"] for h in run["history"] if f"{key}/{series}" in h] == list(range(1, horizon + 1))
    assert any("calibration/figure/_type" in h for h in run["history"])  # the PNG


def cfg_vocab(m, tmp_path):
    import torch

    return torch.load(m["best_ckpt"], weights_only=True)["hyper_parameters"]["vocab_size"]


def test_rerun_in_same_directory_resumes_from_last(tmp_path, data_overrides):
    base = [*data_overrides, "logger=csv"]
    first = train(smoke_cfg(tmp_path, [*base, "trainer.max_epochs=1"]))
    assert first["epochs"] == 1 and first["resumed_from"] is None
    second = train(smoke_cfg(tmp_path, [*base, "trainer.max_epochs=2"]))
    assert second["resumed_from"].endswith("last.ckpt")
    assert second["epochs"] == 2
    # the resumed run trained only the second epoch: its token count is twice the first's
    assert second["train_tokens"] == pytest.approx(2 * first["train_tokens"], rel=0.1)


def test_last_checkpoint_follows_every_epoch_even_when_it_is_not_the_best(tmp_path):
    """A rerun resumes from last.ckpt: it must hold the last epoch, not the last epoch that improved (Lightning's
    save_last writes it only with best.ckpt). On this seed the validation loss is best after the first of 3 epochs."""
    import torch

    train(smoke_cfg(tmp_path, ["data=markov", "logger=none", "trainer.max_epochs=3"]))
    last, best = (torch.load(tmp_path / "checkpoints" / f"{n}.ckpt", map_location="cpu", weights_only=True)
                  for n in ("last", "best"))
    assert last["epoch"] == 2 and best["epoch"] < last["epoch"]


def _cli(args, tmp_path, env_extra=None):
    env = {**os.environ, "WANDB_MODE": "offline", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "lmcal.train", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


def test_missing_data_is_one_clear_message(tmp_path):
    r = _cli(["experiment=smoke", f"data.root={tmp_path / 'nowhere'}", "data.download=false", "logger=none",
              f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert str(tmp_path / "nowhere" / "ptb" / "ptb.train.txt") in r.stderr
    assert "fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf" in r.stderr
    assert not (tmp_path / "run" / "metrics.json").exists()


def test_cli_smoke_writes_metrics_json(tmp_path, data_overrides):
    r = _cli(["experiment=smoke", "logger=csv", f"hydra.run.dir={tmp_path / 'run'}", *data_overrides], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert m["epochs"] == 2
    assert (tmp_path / "run" / "checkpoints" / "best.ckpt").is_file()


def test_a_resumed_run_repeats_an_uninterrupted_one_exactly(tmp_path, data_overrides):
    """Killed after epoch 1 and resumed: the same weights and scores as two epochs in one go (batches and dropout
    masks depend on (seed, epoch) only)."""
    base = [*data_overrides, "logger=none", "analysis.stages=[]"]
    straight = train(smoke_cfg(tmp_path / "straight", [*base, "trainer.max_epochs=2"]))
    train(smoke_cfg(tmp_path / "resumed", [*base, "trainer.max_epochs=1"]))
    resumed = train(smoke_cfg(tmp_path / "resumed", [*base, "trainer.max_epochs=2"]))
    assert resumed["resumed_from"] and resumed["epochs"] == straight["epochs"] == 2
    for k in ("val_ce_nats", "test_ce_nats", "train_tokens"):
        assert resumed[k] == straight[k], k


@pytest.mark.parametrize("args", [["trainer.devices=2"], *(pytest.param(a, marks=pytest.mark.slow) for a in (
    ["+trainer.strategy=ddp"], ["+trainer.num_nodes=2"], ["trainer.devices=[0,1]"]))])  # one in the fast tier
def test_several_devices_are_refused_before_any_work(tmp_path, args):
    """DDP would shard the BPTT windows across processes (each carried hidden state skipping the other's tokens):
    refused with one paragraph that says why and what to use, before the run lock, a checkpoint or a logger."""
    run = tmp_path / "run"
    r = _cli(["experiment=smoke", "logger=wandb", f"hydra.run.dir={run}", *args], tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    msg = r.stderr.split("lmcal: error:", 1)[1]
    assert "hidden state" in msg and "DistributedSampler" in msg and "jobs=N" in msg and "launcher=slurm" in msg
    assert len(msg.strip().splitlines()) == 1  # one paragraph
    left = sorted(p.name for p in run.iterdir()) if run.is_dir() else []
    assert set(left) <= {".hydra", "train.log"}, left  # only Hydra's own record of the command: no lock, no wandb


def test_device_count_reads_every_form_lightning_takes():
    from lmcal.train import device_count

    assert device_count({"devices": 1}) == 1
    assert device_count({"devices": 2}) == 2
    assert device_count({"devices": "0,1"}) == 2
    assert device_count({"devices": "3"}) == 3
    assert device_count({"devices": [0, 1, 2]}) == 3
    assert device_count({"devices": 1, "num_nodes": 2}) == 2
    assert device_count({"devices": "auto", "accelerator": "cpu"}) == 1
    assert device_count({"devices": -1, "accelerator": "cpu"}) == 1
