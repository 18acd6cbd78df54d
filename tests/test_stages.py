"""Analysis stages end to end: after training (callbacks) and on a checkpoint (`lmcal.evaluate`)."""

import json

import numpy as np
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from lmcal.callbacks import table1_markdown
from lmcal.evaluate import evaluate
from lmcal.train import CONF_DIR, train


def test_entropy_rate_after_training_and_on_the_checkpoint_agree(tmp_path, data_overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=smoke", "logger=csv", *data_overrides])
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "run")
    m = train(cfg)
    er = json.loads((tmp_path / "run" / "entropy_rate.json").read_text())
    assert (tmp_path / "run" / "entropy_rate.png").stat().st_size > 1000
    assert "| model | corpus | test ppl | EntRate |" in (tmp_path / "run" / "entropy_rate.md").read_text()
    assert len(er["curve_nats"]) == len(er["stderr_nats"]) == 20 and er["num_generations"] == 16
    assert er["entrate_ppl"] == np.exp(er["curve_nats"][-1]) == m["entrate_ppl"]
    assert er["test_ppl"] == m["test_ppl"]
    # metrics.json was written with the stage's summary
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["entrate_ppl"] == m["entrate_ppl"]

    # the same stage on the saved checkpoint, without training: the same numbers (same seed and settings)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        ecfg = compose("evaluate", overrides=[f"ckpt={m['best_ckpt']}", "stages=[entropy_rate]", "logger=none",
                                              "analysis.entropy_rate.num_prefixes=8",
                                              "analysis.entropy_rate.samples_per_prefix=2",
                                              "analysis.entropy_rate.prefix_len=10",
                                              "analysis.entropy_rate.horizon=20"])
    with open_dict(ecfg):
        ecfg.paths.output_dir = str(tmp_path / "eval")
    res = evaluate(ecfg)
    np.testing.assert_allclose(res["entropy_rate"]["curve_nats"], er["curve_nats"], rtol=1e-5)
    assert json.loads((tmp_path / "eval" / "evaluation.json").read_text())["test_ppl"] == res["test_ppl"]


def test_table1_row_format():
    md = table1_markdown([{"model": "AWD-LSTM", "corpus": "ptb", "test_ppl": 58.3, "entrate_ppl": 93.1}])
    assert md.splitlines()[2] == "| AWD-LSTM | ptb | 58.3 | 93.1 |"


def test_entropy_rate_every_n_epochs_during_training(tmp_path, data_overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=smoke", "logger=csv", "analysis.stages=[]",
                                          "analysis.entropy_rate.every_n_epochs=1", *data_overrides])
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path)
    m = train(cfg)
    per_epoch = sorted(p.name for p in (tmp_path / "entropy_rate_epochs").glob("*.json"))
    assert per_epoch == ["entropy_rate_epoch0.json", "entropy_rate_epoch1.json"]
    assert not (tmp_path / "entropy_rate.json").exists() and "entrate_ppl" not in m  # not asked for at the end
