"""Analysis stages end to end: after training (callbacks) and on a checkpoint (`lmcal.evaluate`)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from lmcal.errors import LmcalError
from lmcal.evaluate import evaluate
from lmcal.models.awd_lstm import limited_context_ce
from lmcal.models.checkpoint import load_net
from lmcal.reporting.tabulate import memory_report
from lmcal.stages.tables import table1_markdown
from lmcal.train import train
from lmcal.utils.settings import CONF_DIR
from tests.conftest import HAVE_PTB

ROOT = Path(__file__).resolve().parents[1]


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
    # metrics.json was written with the stages' summaries
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["entrate_ppl"] == m["entrate_ppl"]
    cal = json.loads((tmp_path / "run" / "calibration.json").read_text())
    assert (tmp_path / "run" / "calibration.png").stat().st_size > 1000
    assert cal["alpha"] == m["alpha"] and cal["topk"] == 8 and cal["fit_tokens"] == (400 // 4 - 10) * 4
    assert cal["fit_ce_after_nats"] <= cal["fit_ce_before_nats"] + 1e-9  # the fit never raises held-out CE
    assert len(cal["curve_nats"]) == len(cal["curve_nats_before"]) == 20
    assert cal["curve_nats_before"] == er["curve_nats"]  # same prefixes and seeds as the entropy-rate stage
    before, after = (np.array(cal[k]) for k in ("tail_nats_per_generation_before", "tail_nats_per_generation"))
    assert before.shape == after.shape == (8, 2) and cal["tail_steps"] == 2  # 8 prefixes x 2, last tenth of 20
    assert cal["tail_ppl_before"] == pytest.approx(np.exp(np.mean(cal["curve_nats_before"][-2:])))
    assert cal["tail_diff_nats"] == pytest.approx((after - before).mean())
    assert cal["tail_diff_stderr_nats"] == pytest.approx((after - before).mean(1).std(ddof=1) / np.sqrt(8))

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


MEMORY_DATA, TAU = ["data=markov", "data.corpus_kwargs.n_train=20000", "data.corpus_kwargs.n_valid=3000",
                   "data.corpus_kwargs.n_test=3000"], 1  # an order-2 source: information from beyond 1 token back


def test_memory_stage_after_training_on_the_checkpoint_and_in_the_report(tmp_path):
    """Base model, then a tau-model whose memory stage runs after training; the same stage through
    `lmcal.evaluate` gives the same numbers, and `lmcal.report` collects them into the table and figure.

    The data must carry information from beyond tau tokens back, or the fit of P^ towards P~ has no minimum (it runs
    to its bound): the synthetic fallback corpus is a bigram source, which has none beyond tau = 1. So this test uses
    the order-2 Markov source (data=markov, no files needed) with tau = 1, whose exact I_1 is positive."""
    def compose_train(*overrides):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose("train", overrides=["experiment=smoke", "logger=none", *MEMORY_DATA, *overrides])

    base_cfg = compose_train("analysis.stages=[]")
    with open_dict(base_cfg):
        base_cfg.paths.output_dir = str(tmp_path / "base")
    base = train(base_cfg)

    with pytest.raises(LmcalError, match="memory.base_ckpt"):  # refused before training, not after
        cfg = compose_train(f"model.memory_tau={TAU}", "analysis.stages=[memory]", "memory.base_ckpt=/nonexistent.ckpt")
        with open_dict(cfg):
            cfg.paths.output_dir = str(tmp_path / "bad")
        train(cfg)
    assert not (tmp_path / "bad" / "checkpoints").exists()

    cfg = compose_train(f"model.memory_tau={TAU}", "analysis.stages=[memory]", f"memory.base_ckpt={base['best_ckpt']}",
                        f"init_ckpt={base['best_ckpt']}")
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "sweep" / "tau5")
    m = train(cfg)
    mem = json.loads((tmp_path / "sweep" / "tau5" / "memory.json").read_text())
    assert mem["tau"] == TAU and mem["limited"] == "trained" and mem["test_tokens"] == 999 and mem["blocks"] == 10
    assert m["mi_upper_bound_nats"] == mem["mi_upper_bound_nats"]
    assert mem["mi_upper_bound_nats"] == pytest.approx(mem["ce_limited_nats"] - mem["entropy_calibrated_nats"])
    # P~ on the first 999 test positions is the tau-model's exact limited-context CE there
    net, _ = load_net(m["best_ckpt"])
    dm_tokens = _tokens(base_cfg, "test")[:1000]
    assert mem["ce_limited_nats"] == pytest.approx(limited_context_ce(net, dm_tokens, TAU)[0], rel=1e-6)
    assert mem["ce_calibrated_nats"] <= mem["ce_full_nats"] + 1e-9  # fitted on these rows: it never raises CE
    assert mem["mi_upper_bound_nats"] >= -1e-9  # ... and the bound is a mean KL divergence
    assert mem["delta_ce_nats"] == pytest.approx(mem["ce_limited_nats"] - mem["ce_full_nats"])
    two = mem["two_parameter"]
    assert set(two) >= {"alpha", "beta", "mi_upper_bound_nats", "mi_stderr_nats"} and two["mi_stderr_nats"] > 0
    assert two["ce_calibrated_nats"] <= mem["ce_calibrated_nats"] + 1e-9  # one more parameter: never worse

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        ecfg = compose("evaluate", overrides=[f"ckpt={m['best_ckpt']}", "stages=[memory]", "logger=none",
                                              f"memory.base_ckpt={base['best_ckpt']}",
                                              "analysis.memory.score_tokens=1000",
                                              "analysis.memory.cluster_size=100"])
    with open_dict(ecfg):
        ecfg.paths.output_dir = str(tmp_path / "sweep" / "eval_tau5")
    res = evaluate(ecfg)["memory"]
    for k in ("alpha", "ce_limited_nats", "mi_upper_bound_nats"):
        assert res[k] == pytest.approx(mem[k], rel=1e-6, abs=1e-9)
    with open_dict(ecfg):  # the rows recomputed on each pass of the fit, none kept: the very same numbers
        ecfg.analysis.memory.rows, ecfg.paths.output_dir = "stream", str(tmp_path / "sweep" / "eval_tau5_stream")
    evaluate(ecfg)
    kept, streamed = (json.loads((tmp_path / "sweep" / d / "memory.json").read_text())
                      for d in ("eval_tau5", "eval_tau5_stream"))
    assert (kept["rows"], streamed["rows"], kept["rows_passes"]) == ("cpu", "stream", 1) and streamed["rows_passes"] > 3
    for k in ("alpha", "mi_upper_bound_nats", "mi_stderr_nats", "mi_upper_bound_crossfit_nats", "two_parameter"):
        assert streamed[k] == kept[k], k

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        bad = compose("evaluate", overrides=[f"ckpt={base['best_ckpt']}", "stages=[memory]", "logger=none",
                                             f"memory.base_ckpt={base['best_ckpt']}"])
    with open_dict(bad):
        bad.paths.output_dir = str(tmp_path / "bad_eval")
    with pytest.raises(LmcalError, match=r"memory runs on a tau-limited model .*limited=window"):
        evaluate(bad)

    # the base model itself on tau-token windows: no tau-model needed
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        wcfg = compose("evaluate", overrides=[f"ckpt={base['best_ckpt']}", "stages=[memory]", "logger=none",
                                              "analysis.memory.limited=window", f"analysis.memory.tau={TAU}",
                                              "analysis.memory.score_tokens=1000"])
    with open_dict(wcfg):
        wcfg.paths.output_dir = str(tmp_path / "sweep" / "window_tau5")
    win = evaluate(wcfg)["memory"]
    assert win["limited"] == "window" and win["tau"] == TAU and win["test_tokens"] == 999
    assert win["ce_full_nats"] == pytest.approx(mem["ce_full_nats"], rel=1e-6)  # the same P^ on the same rows
    base_net, _ = load_net(base["best_ckpt"])
    assert win["ce_limited_nats"] == pytest.approx(limited_context_ce(base_net, dm_tokens, TAU)[0], rel=1e-6)

    report = memory_report([tmp_path / "sweep"], tmp_path / "report", wandb_mode="disabled")
    corpus = mem["corpus"]
    # two trained results for tau: the newer one is kept; the window one beside it
    assert [(r["tau"], r["limited"]) for r in report[corpus]["rows"]] == [(TAU, "trained"), (TAU, "window")]
    assert (tmp_path / "report" / f"memory_{corpus}.png").stat().st_size > 1000
    table = (tmp_path / "report" / f"memory_{corpus}.md").read_text()
    assert f"| {TAU} | trained | {mem['ce_limited_nats']:.4f}" in table


def _tokens(cfg, split):
    from hydra.utils import instantiate

    dm = instantiate(cfg.data)
    dm.prepare()
    return dm.tokens(split)


def test_report_table_has_the_papers_values_beside_ours(tmp_path):
    for tau, mi in ((5, 0.9), (10, 0.5)):
        (tmp_path / f"t{tau}").mkdir()
        (tmp_path / f"t{tau}" / "memory.json").write_text(json.dumps({
            "tau": tau, "corpus": "ptb", "model": "m", "ce_limited_nats": 5.0, "mi_upper_bound_nats": mi,
            "mi_stderr_nats": 0.01, "alpha": 0.001, "alpha_stderr": 0.002, "entropy_calibrated_nats": 5.0 - mi,
            "test_tokens": 100, "valid": {"tokens": 100}, "cluster_size": 10}))
    report = memory_report([tmp_path], wandb_mode="disabled")
    lines = (tmp_path / "memory_ptb.md").read_text().splitlines()
    assert lines[4] == ("| 5 | trained | 5.0000 | 4.8144 | – | 0.9000 ± 0.0100 | 0.6180 | – | 0.00100 ± 0.00200 | "
                        "0.00351 | – | – |")  # a memory.json from before the new keys: – where they are missing
    assert [r["tau"] for r in report["ptb"]["rows"]] == [5, 10]
    (tmp_path / "empty").mkdir()
    with pytest.raises(LmcalError, match="No memory.json"):
        memory_report([tmp_path / "empty"], wandb_mode="disabled")
    with pytest.raises(LmcalError, match="not a folder"):
        memory_report([tmp_path / "missing"], wandb_mode="disabled")


def test_report_command_line_errors_are_one_paragraph(tmp_path):
    (tmp_path / "empty").mkdir()
    r = subprocess.run([sys.executable, "-m", "lmcal.report", str(tmp_path / "empty"), "--wandb", "disabled"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("lmcal: error: No memory.json") and "Traceback" not in r.stderr


@pytest.mark.slow
def test_decoders_after_training_in_a_sweep_and_in_the_report(tmp_path, data_overrides):
    """The decoders stage as a callback (reusing the calibration stage's row), then a Hydra multirun over one
    decoder's setting on the checkpoint, then `python -m lmcal.report` over the sweep."""
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=smoke", "logger=csv", "analysis.stages=[calibration,decoders]",
                                          "analysis.decoders.methods=[{name: min_p, min_p: 0.1}]", *data_overrides])
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "run")
    m = train(cfg)
    dec = json.loads((tmp_path / "run" / "decoders.json").read_text())
    cal = json.loads((tmp_path / "run" / "calibration.json").read_text())
    assert [r["method"] for r in dec["rows"]] == ["model", "min_p", "fitted_temperature", "calibration"]
    assert dec["calibration_reused"] and dec["rows"][-1]["curve_nats"] == cal["curve_nats"]
    assert dec["rows"][0]["curve_nats"] == cal["curve_nats_before"]  # same prefixes and seeds
    rows = {r["method"]: r for r in dec["rows"]}
    assert rows["min_p"]["test_ce_nats"] is None and rows["min_p"]["zero_prob_fraction"] > 0  # it cuts test words
    assert rows["min_p"]["test_ce_mixed_nats"] > rows["model"]["test_ce_nats"]
    ft = rows["fitted_temperature"]  # fitted on validation text: never worse there, close on test text
    assert ft["fit_ce_after_nats"] <= ft["fit_ce_before_nats"] + 1e-9
    assert abs(ft["test_ce_nats"] - rows["model"]["test_ce_nats"]) < 0.05
    assert m["decoders"]["min_p"]["zero_prob_fraction"] == rows["min_p"]["zero_prob_fraction"]
    assert (tmp_path / "run" / "decoders.png").stat().st_size > 1000
    assert "| min_p | min_p=0.1 |" in (tmp_path / "run" / "decoders.md").read_text()

    # the stage's dose-response rules, each at two multiples of its fitted alpha
    assert [(x["rule"], x["multiple"]) for x in cal["dose_response"]["rows"]] == [
        ("top-8", 1), ("top-8", 3), ("cover 0.9 (at most 64)", 1), ("cover 0.9 (at most 64)", 3)]

    sweep = tmp_path / "sweep"
    r = subprocess.run([sys.executable, "-m", "lmcal.evaluate", "-m", f"ckpt={m['best_ckpt']}", "stages=[decoders]",
                        "decoder=top_p", "decoder.p=0.5,0.9", "analysis=smoke", "analysis.decoders.fitted=[]",
                        "logger=none", f"hydra.sweep.dir={sweep}"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    jobs = sorted(sweep.glob("*/decoders.json"))
    assert len(jobs) == 2 and all("decoder=top_p" in p.parent.name and "ckpt" not in p.parent.name for p in jobs)
    assert "decoder.p=0.5" in jobs[0].parent.name and "decoder.p=0.9" in jobs[1].parent.name  # readable folders
    a, b = (json.loads(p.read_text()) for p in jobs)
    assert [x["method"] for x in a["rows"]] == ["model", "top_p"] and a["rows"][1]["params"] == {"p": 0.5}
    assert a["rows"][0] == {**b["rows"][0], "seconds": a["rows"][0]["seconds"]}  # the same plain-model row
    assert a["rows"][1]["entropy_last_nats"] < b["rows"][1]["entropy_last_nats"]  # a smaller nucleus

    r = subprocess.run([sys.executable, "-m", "lmcal.report", str(sweep), str(tmp_path / "run"), "--out",
                        str(tmp_path / "rep"), "--wandb", "disabled"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    md = (tmp_path / "rep" / "decoders_ptb.md").read_text() if HAVE_PTB else \
        next((tmp_path / "rep").glob("decoders_*.md")).read_text()
    assert md.count("| model |") == 1 and "| top_p | p=0.5 |" in md and "| top_p | p=0.9 |" in md
    assert "| min_p | min_p=0.1 |" in md and "| calibration |" in md


def _compose(name, out, overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(name, overrides=overrides)
    with open_dict(cfg):
        cfg.paths.output_dir = str(out)
    return cfg


def test_a_new_stage_is_one_function_and_one_registry_entry(tmp_path, data_overrides):
    """tests/toy_stage.py registers `toy`; train runs it after training (its summary lands in metrics.json) and
    evaluate runs it on the checkpoint, with its settings node given on the command line."""
    import tests.toy_stage  # noqa: F401  (registers the stage)

    m = train(_compose("train", tmp_path / "run", ["experiment=smoke", "logger=none", "trainer.max_epochs=1",
                                                    "analysis.stages=[toy]", "+analysis.toy={positions: 7}",
                                                    *data_overrides]))
    toy = json.loads((tmp_path / "run" / "toy.json").read_text())
    assert toy["positions"] == 7 and m["toy_mean_entropy"] == toy["toy_mean_entropy"] > 0
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["toy_mean_entropy"] == m["toy_mean_entropy"]
    res = evaluate(_compose("evaluate", tmp_path / "eval", [f"ckpt={m['best_ckpt']}", "stages=[toy]", "logger=none",
                                                             "+analysis.toy={positions: 7}"]))
    assert res["toy"]["toy_mean_entropy"] == pytest.approx(toy["toy_mean_entropy"], rel=1e-6)


def test_a_misspelt_analysis_key_is_an_error_listing_the_valid_ones(tmp_path, data_overrides):
    cfg = _compose("train", tmp_path / "run", ["experiment=smoke", "logger=none", "+analysis.entropy_rate.horizn=5",
                                               *data_overrides])
    with pytest.raises(LmcalError) as e:
        train(cfg)
    msg = str(e.value)
    assert "Unknown setting: analysis.entropy_rate.horizn (did you mean analysis.entropy_rate.horizon?)" in msg
    assert not (tmp_path / "run" / "checkpoints").exists()  # before training
    ecfg = _compose("evaluate", tmp_path / "eval", ["ckpt=/not/read.ckpt", "stages=[calibration]", "logger=none",
                                                    "+analysis.calibration.top_k=4"])
    with pytest.raises(LmcalError, match=r"Unknown setting: analysis.calibration.top_k \(did you mean "
                                         r"analysis.calibration.topk\?\)"):
        evaluate(ecfg)


def test_a_renamed_setting_names_its_new_name():
    """Names that say which quantity they are: the old names of the uniform-mixture weight and of Mirostat's and
    eta-sampling's parameters fail with their new names."""
    from lmcal.core.decoders import decoder_params
    from lmcal.stages.registry import check_settings
    with pytest.raises(LmcalError, match="Renamed: epsilon is now uniform_weight"):
        check_settings("calibration", {"epsilon": 0.1})
    with pytest.raises(LmcalError, match="Renamed: eta is now learning_rate; tau is now target_surprise"):
        decoder_params("mirostat", tau=3.0, eta=0.2)
    with pytest.raises(LmcalError, match="Renamed: epsilon is now eta_cutoff"):
        decoder_params("eta", epsilon=1e-3)
    assert decoder_params("mirostat", target_surprise=3.0)["learning_rate"] == 0.1


def test_one_gating_rule_in_both_entry_points(tmp_path, data_overrides):
    """A stage that does not apply to the model is one paragraph naming those that do, before any work."""
    cfg = _compose("train", tmp_path / "run", ["experiment=smoke", "logger=none", "model.memory_tau=4",
                                               "analysis.stages=[entropy_rate]", *data_overrides])
    with pytest.raises(LmcalError, match=r"Stage entropy_rate does not apply to a tau-limited model .*; the stages "
                                         r"that do: memory\."):
        train(cfg)
    assert not (tmp_path / "run" / "checkpoints").exists()
    with pytest.raises(LmcalError, match="Unknown analysis stage entropy; the stages are entropy_rate"):
        evaluate(_compose("evaluate", tmp_path / "eval", ["ckpt=/not/read.ckpt", "stages=[entropy]", "logger=none"]))


def test_the_analysis_entry_points_never_import_lightning():
    """`python -m lmcal.evaluate` runs once per stage of a reproduction: without Lightning's import it starts ~5 s
    sooner (lmcal.models.checkpoint reads checkpoints, data.CorpusData their corpus, analysis.wandb_run opens W&B)."""
    code = ("import sys, lmcal.evaluate, lmcal.reproduce, lmcal.stages; "
            "print(sorted(m for m in sys.modules if 'lightning' in m))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_an_analysis_wandb_run_is_written_offline_and_finished(tmp_path):
    import wandb

    from lmcal.stages.wandb_run import finish_run, wandb_log, wandb_run

    assert wandb_run({"_target_": "pytorch_lightning.loggers.CSVLogger", "save_dir": str(tmp_path)}) is False
    assert wandb_run(None) is False
    node = {"_target_": "pytorch_lightning.loggers.WandbLogger", "project": "lmcal-test", "group": "g", "name": None,
            "offline": True, "save_dir": str(tmp_path / "run")}
    run = wandb_run(node, {"stages": ["entropy_rate"]})
    try:
        wandb_log(run, scalars={"entropy_rate/entrate_ppl": 1.5})
        assert run.config["stages"] == ["entropy_rate"] and run.group == "g"
    finally:
        finish_run(run)
    assert wandb.run is None
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    wandb_log(False, scalars={"x": 1.0})  # any other logger: nothing


def test_report_tabulates_the_training_runs_of_any_folders(tmp_path):
    """`lmcal.report` on folders of training runs: one table of them (overrides, val/test ppl, status, folder)."""
    for name, metrics in (("a", {"val_ppl": 101.234, "test_ppl": 99.5, "dataset": "ptb"}), ("b", None)):
        (tmp_path / "runs" / name / ".hydra").mkdir(parents=True)
        tau = ord(name) - ord('a') + 5
        (tmp_path / "runs" / name / ".hydra" / "overrides.yaml").write_text(f"- data=ptb\n- model.memory_tau={tau}\n")
        # the job's composed config: a failed run's dataset and tau come from it
        (tmp_path / "runs" / name / ".hydra" / "config.yaml").write_text(
            f"data: {{name: ptb}}\nmodel: {{memory_tau: {tau}}}\n")
        if metrics:
            (tmp_path / "runs" / name / "metrics.json").write_text(json.dumps(metrics))
        else:
            (tmp_path / "runs" / name / "failed.json").write_text(json.dumps({"error": "tau must be > 0\nmore"}))
    r = subprocess.run([sys.executable, "-m", "lmcal.report", str(tmp_path / "runs"), "--out", str(tmp_path / "rep"),
                        "--wandb", "disabled"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    lines = (tmp_path / "rep" / "report_runs.md").read_text().splitlines()
    assert f"lmcal.report wrote report_runs.json, report_runs.md in {tmp_path / 'rep'}" in r.stdout
    assert lines[0] == "All runs: data=ptb"  # the overrides every run shares, once
    assert lines[2] == "| run | dataset | τ | val ppl | test ppl | wall time | status | folder |"
    assert lines[4] == f"| model.memory_tau=5 | ptb | 5 | 101.23 | 99.50 | - | ok | {tmp_path / 'runs' / 'a'} |"
    assert lines[5] == (f"| model.memory_tau=6 | ptb | 6 | - | - | - | failed: tau must be > 0 more "  # the whole error
                        f"| {tmp_path / 'runs' / 'b'} |")
    assert lines[4] in r.stdout
    (tmp_path / "rep" / "notes.txt").write_text("mine")  # a file of the user's, at once: not called written
    r = subprocess.run([sys.executable, "-m", "lmcal.report", str(tmp_path / "runs"), "--out", str(tmp_path / "rep"),
                        "--wandb", "disabled"], capture_output=True, text=True, timeout=300)
    assert f"lmcal.report wrote report_runs.json, report_runs.md in {tmp_path / 'rep'}" in r.stdout, r.stdout


def test_markov_memory_figure_shows_the_exact_value_and_counts_have_integer_ticks(tmp_path, monkeypatch):
    from lmcal.reporting import tabulate
    from lmcal.stages import plots

    for tau, mi, exact in ((1, 0.30, 0.25), (2, 0.02, 0.0)):
        (tmp_path / f"t{tau}").mkdir()
        (tmp_path / f"t{tau}" / "memory.json").write_text(json.dumps({
            "tau": tau, "corpus": "markov", "model": "m", "ce_limited_nats": 1.0, "mi_upper_bound_nats": mi,
            "mi_stderr_nats": 0.01, "alpha": 0.1, "alpha_stderr": 0.01, "entropy_calibrated_nats": 1.0 - mi,
            "exact_mi_nats": exact, "test_tokens": 100, "valid": {"tokens": 100}, "cluster_size": 10}))
    figs = []
    real_save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: (figs.append(fig), real_save(fig, path))[1])
    seen = {}
    real_figure = tabulate.memory_figure
    monkeypatch.setattr(tabulate, "memory_figure", lambda series, *a, **k: (seen.update(series),
                                                                            real_figure(series, *a, **k))[1])
    memory_report([tmp_path], wandb_mode="disabled")
    exact = next(k for k in seen if k.startswith("exact I_tau of the source"))  # and what the bounds bound
    assert seen[exact] == ([1, 2], [0.25, 0.0], None) and "the LSTM's bound is on the LSTM's own I_tau" in exact
    ticks = figs[-1].axes[0].get_xticks()
    assert all(float(t).is_integer() for t in ticks)
    plots.entropy_curve_figure({"m": (np.ones(3), np.zeros(3))}, tmp_path / "e.png")
    assert all(float(t).is_integer() for t in figs[-1].axes[0].get_xticks())


def test_a_line_drawn_over_an_equal_one_says_so_in_the_legend(tmp_path, monkeypatch):
    """issue 30: lines hid others without a word. A curve equal to an earlier one (within a fraction of the y range,
    under a line's width) is dashed and its legend names the curve it covers; a curve that differs is left alone."""
    from lmcal.stages import plots

    figs = []
    real_save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: (figs.append(fig), real_save(fig, path))[1])
    a = np.linspace(4.0, 5.0, 50)
    curves = {"model": (a, 0.01 * np.ones(50)), "calibrated": (a + 1e-4, 0.01 * np.ones(50)),
              "temperature": (a + 0.05, 0.01 * np.ones(50))}
    assert plots.covered_curves({k: m for k, (m, _) in curves.items()}) == {"calibrated": "model"}
    plots.entropy_curve_figure(curves, tmp_path / "e.png")
    lines = {ln.get_label(): ln.get_linestyle() for ln in figs[-1].axes[0].get_lines()}
    assert lines == {"model": "-", "calibrated (the same curve as model, drawn over it)": "--", "temperature": "-"}
    plots.memory_figure({"trained": ([2, 4], [0.3, 0.1], [0.01, 0.01]), "window": ([2, 4], [0.3, 0.1], None),
                         "shifted": ([3, 5], [0.3, 0.1], None)}, tmp_path / "m.png")
    labels = figs[-1].axes[0].get_legend_handles_labels()[1]
    assert labels == ["trained", "window (the same points as trained, drawn over them)", "shifted"]


def test_the_decoders_figure_labels_every_point_apart_and_inside_the_figure(tmp_path, monkeypatch):
    """issue 42: on the cpu run's points the labels of the model and its two fitted rows lay over each other and
    mirostat's, at the right edge, was cut. Every label is now drawn whole inside the figure, none overlaps another,
    and each is in its point's colour."""
    import matplotlib.text

    from lmcal.stages import plots

    figs = []
    real_save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: (figs.append(fig), real_save(fig, path))[1])
    points = [("model", {}, 4.752, 5.234), ("temperature", {"temperature": 0.8}, 4.905, 3.316),
              ("top_k", {"k": 50}, 9.216, 2.634), ("top_p", {"p": 0.95}, 5.058, 4.815),
              ("typical", {"mass": 0.95}, 5.042, 4.676), ("eta", {"eta_cutoff": 0.0003}, 5.573, 4.252),
              ("min_p", {"min_p": 0.05}, 11.246, 1.591),
              ("mirostat", {"target_surprise": 5.0, "learning_rate": 0.1}, 17.26, 3.03),
              ("fitted_temperature", {"temperature": 0.9901, "temperature_stderr": 0.003}, 4.75, 5.174),
              ("calibration", {"alpha": -0.0326, "alpha_stderr": 0.0129, "topk": 16}, 4.752, 5.132)]
    rows = [{"method": m, "params": p, "test_ce_mixed_nats": x, "entropy_last_nats": y, "stderr_nats": [0.03]}
            for m, p, x, y in points]
    plots.decoders_tradeoff_figure(rows, tmp_path / "d.png", title="decoders")
    fig = figs[-1]
    fig.canvas.draw()
    texts = [t for t in fig.axes[0].texts]
    assert sorted(t.get_text().split(" ")[0] for t in texts) == sorted(m for m, *_ in points)
    boxes = [matplotlib.text.Text.get_window_extent(t) for t in texts]  # the words, not the leader line
    whole = fig.bbox
    assert all(whole.x0 <= b.x0 and b.x1 <= whole.x1 and whole.y0 <= b.y0 and b.y1 <= whole.y1 for b in boxes)
    overlaps = [(texts[i].get_text(), texts[j].get_text()) for i in range(len(boxes)) for j in range(i)
                if boxes[i].overlaps(boxes[j])]
    assert overlaps == []
    lines = fig.axes[0].get_lines()
    for t in texts:
        assert t.get_color() in {ln.get_color() for ln in lines}


def test_a_memory_run_draws_its_bound_and_the_parts_it_is_made_of(tmp_path, monkeypatch):
    """issue 30: memory runs log their figure too. Left the CEs and entropy (nats), right the bound by estimator,
    with the exact I_tau where the source is known."""
    from lmcal.stages import plots

    figs = []
    real_save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: (figs.append(fig), real_save(fig, path))[1])
    r = {"ce_full_nats": 4.6, "ce_full_stderr_nats": 0.02, "ce_limited_nats": 4.86, "ce_calibrated_nats": 4.7,
         "entropy_calibrated_nats": 4.67, "mi_upper_bound_nats": 0.19, "mi_stderr_nats": 0.005,
         "mi_upper_bound_crossfit_nats": 0.18, "two_parameter": {"mi_upper_bound_nats": 0.17, "mi_stderr_nats": 0.004},
         "exact_mi_nats": 0.15, "paper": None}
    assert plots.memory_bound_figure(r, tmp_path / "memory.png", title="t").is_file()
    left, right = figs[-1].axes
    assert [t.get_text() for t in left.get_yticklabels()] == [
        "CE of the model", "CE of P~ (tau-limited)", "CE of P~ calibrated (alpha*)", "entropy of P~ calibrated"]
    assert [t.get_text() for t in right.get_yticklabels()] == [
        "alpha*, fit on the test rows", "alpha*, cross-fit", "alpha*, beta* (with temperature)", "exact I_tau"]
