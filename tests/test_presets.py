"""Profiles that cannot rot: every preset in conf/experiment/, conf/analysis/ and conf/reproduce/ composes, passes the
range rules and the stages' settings checks, and (slow tier) runs a few batches."""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf, open_dict

from lmcal.pipeline.plan import load_profile, plan, stage_settings
from lmcal.pipeline.scale_sweep import is_sweep_profile, plan_sweeps
from lmcal.stages.registry import STAGES, check_settings
from lmcal.train import train
from lmcal.utils.settings import CONF_DIR
from lmcal.utils.validate import check_config
from tests.conftest import DATA_ROOT

EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
ANALYSES = sorted(p.stem for p in (CONF_DIR / "analysis").glob("*.yaml"))
PROFILES = sorted(p.stem for p in (CONF_DIR / "reproduce").glob("*.yaml"))


def _compose(name, overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name=name, overrides=overrides)


def _check_analysis(cfg):
    for n in STAGES:
        if n in cfg.analysis:
            check_settings(n, OmegaConf.to_container(cfg.analysis[n], resolve=True))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_preset_composes_and_is_valid(experiment):
    cfg = _compose("train", [f"experiment={experiment}"])
    check_config(cfg)
    _check_analysis(cfg)
    assert (cfg.model.get("emb_size") or cfg.model.get("n_embd")) > 0 and cfg.trainer.max_epochs


@pytest.mark.parametrize("analysis", ANALYSES)
def test_every_analysis_preset_composes_and_is_valid(analysis):
    for name, extra in (("train", []), ("evaluate", ["ckpt=unused.ckpt"])):
        cfg = _compose(name, [f"analysis={analysis}", *extra])
        check_config(cfg)
        _check_analysis(cfg)


@pytest.mark.parametrize("profile", [pytest.param(p, marks=pytest.mark.slow) if p == "paper_full" else p
                                     for p in PROFILES])  # paper_full extends paper: the slow tier
def test_every_reproduce_profile_plans_valid_stages(profile, tmp_path):
    """Each stage of the profile's pipeline composes and passes the checks, as `make reproduce` does before running."""
    cfg = load_profile([f"profile={profile}", f"out={tmp_path}"])
    check_config(cfg)
    if is_sweep_profile(cfg):  # scale, scale_gpu: a job per stage, then the report (tests/test_scale.py checks them)
        assert plan_sweeps(cfg)[-1]["name"] == "report"
        return
    stages = plan(cfg)
    assert [s["name"] for s in stages][:2] == ["base", "tau_models"] and stages[-1]["name"] == "report"
    cal = [s["dir"] for s in stages if s["name"] == "calibration"]
    if cal:  # the rows other runs add beside calibration.json, which the report reads (results.dose_row_files)
        assert stages[-1]["inputs"] == [cal[0] / "dose_rows_*.json"]
    for st in stages:
        assert stage_settings(st, cfg)


@pytest.mark.slow
@pytest.mark.parametrize("experiment", [e for e in EXPERIMENTS if not e.endswith("_tau")])
def test_every_experiment_preset_trains_a_few_batches(experiment, tmp_path):
    """The preset's own model, optimiser and data, for 2 training and 2 validation batches (the paper's model too)."""
    data = [f"data.root={DATA_ROOT}"] if DATA_ROOT else []
    cfg = _compose("train", [f"experiment={experiment}", "logger=none", "analysis.stages=[]", "trainer.max_epochs=1",
                             "+trainer.limit_train_batches=2", "+trainer.limit_val_batches=2",
                             "data.max_eval_tokens=2000", "trainer.max_time=null", "trainer.enable_progress_bar=false",
                             *data])
    if cfg.data.name == "ptb" and not DATA_ROOT:
        pytest.skip("real PTB not found: set LMCAL_DATA_ROOT")
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path)
        if cfg.data.name == "markov":
            cfg.data.corpus_kwargs.n_train = 20000
        if cfg.model.get("n_embd", 0) >= 512:  # the 512-wide transformer: its own model on 2 streams (32: 95 s)
            cfg.data.batch_size = 2
    m = train(cfg)
    assert m["epochs"] == 1 and Path(m["best_ckpt"]).is_file()


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A smoke-sized model on real PTB when found, else on the synthetic corpus (one short epoch)."""
    out = tmp_path_factory.mktemp("tiny")
    data = [f"data.root={DATA_ROOT}"] if DATA_ROOT else [
        "data.name=synthetic", "+data.corpus_kwargs={vocab_size: 60, n_train: 20000, n_valid: 3000, n_test: 3000}"]
    cfg = _compose("train", ["experiment=smoke", "logger=none", "analysis.stages=[]", "trainer.max_epochs=1",
                             "data.max_train_tokens=4000", "trainer.enable_progress_bar=false", *data])
    with open_dict(cfg):
        cfg.paths.output_dir = str(out)
    return train(cfg)["best_ckpt"]


def _shrunk(analysis: str) -> list[str]:
    """Overrides that keep the preset's choices (lookahead k and tail draws, context, decoders, blocks' role) and
    cut only how much is done: a few generations, positions and test tokens."""
    node = _compose("evaluate", [f"analysis={analysis}", "ckpt=unused.ckpt"]).analysis
    out = []
    for stage in ("entropy_rate", "calibration", "decoders"):
        out += [f"analysis.{stage}.{k}={v}" for k, v in (("num_prefixes", 2), ("samples_per_prefix", 2),
                                                          ("prefix_len", 5), ("horizon", 4))]
    for stage in ("calibration", "decoders"):
        streams, ctx = 2, node[stage].min_context
        out += [f"analysis.{stage}.fit_streams={streams}", f"analysis.{stage}.fit_tokens={streams * (ctx + 6)}",
                f"analysis.{stage}.score_streams={streams}", f"analysis.{stage}.score_tokens=40"]
    cal = node.calibration  # the approximation table and the dose-response: their rules kept, a few positions
    if cal.get("approximation") is not None:
        out += ["analysis.calibration.approximation.generations=1", "analysis.calibration.approximation.steps=2"]
    if cal.get("dose_response") is not None:
        out += [f"analysis.calibration.dose_response.{k}={v}" for k, v in (("num_prefixes", 1), ("score_tokens", 20),
                                                                           ("samples_per_prefix", 1))]
    return out + ["analysis.memory.limited=window", "analysis.memory.tau=2", "analysis.memory.score_tokens=400",
                  "analysis.memory.cluster_size=100"]


@pytest.mark.slow
@pytest.mark.parametrize("analysis", ANALYSES)
def test_every_analysis_preset_runs_every_stage_on_a_few_positions(analysis, tiny_ckpt, tmp_path):
    """Each preset's own settings (top-k, tail draws, min_context, the decoders list, jackknife) through every stage
    of `python -m lmcal.evaluate`, on a tiny model: a preset whose settings no longer fit its stages fails here."""
    from lmcal.evaluate import evaluate

    cfg = _compose("evaluate", [f"ckpt={tiny_ckpt}", f"analysis={analysis}", "logger=none",
                                "stages=[entropy_rate,calibration,decoders,memory]", *_shrunk(analysis),
                                *([f"data_root={DATA_ROOT}"] if DATA_ROOT else [])])
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path)
    res = evaluate(cfg)
    assert len(res["entropy_rate"]["curve_nats"]) == 4
    assert res["calibration"]["topk"] == cfg.analysis.calibration.topk
    assert {r["method"] for r in res["decoders"]["rows"]} >= {m.name for m in cfg.analysis.decoders.methods}
    assert res["memory"]["limited"] == "window" and res["memory"]["mi_upper_bound_nats"] >= 0
