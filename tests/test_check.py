"""The plan check (`make reproduce PROFILE=<p> ARGS='check=true'`, lmcal.pipeline.check): every profile passes it,
sizes that do not fit a transformer's context are refused before anything runs, and the model arithmetic is exact."""

import os
import re
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lmcal.errors import LmcalError
from lmcal.models.awd_lstm import AWDLSTM
from lmcal.models.transformer import GPTLM
from lmcal.pipeline.check import check, side_by_side, stream_passes
from lmcal.pipeline.plan import load_profile, plan
from lmcal.pipeline.plan_text import WIDTH, paragraph_of
from lmcal.pipeline.sizes import model_of, stream_sizes
from lmcal.pipeline.timing import Job, lstm_epoch_seconds, schedule, side_by_side_group
from lmcal.utils.settings import CONF_DIR

# the pipeline profiles (the scale profiles run Hydra grids instead: lmcal.pipeline.scale_sweep, tests/test_scale.py)
PROFILES = sorted(p.stem for p in (CONF_DIR / "reproduce").glob("*.yaml") if "sweeps" not in OmegaConf.load(p))


def _train_cfg(overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


@pytest.mark.parametrize("profile", [pytest.param(p, marks=pytest.mark.slow) if p == "paper_full" else p
                                     for p in PROFILES])  # paper_full extends paper: the slow tier
def test_every_profile_passes_the_plan_check(profile, tmp_path):
    cfg = load_profile([f"profile={profile}", f"out={tmp_path / 'out'}", "check=true"])
    text = check(cfg)
    assert text.startswith(f"Plan of the {profile} profile")
    assert max(len(ln) for ln in text.splitlines()) <= WIDTH  # a terminal shows each line whole
    table = text.split("\n\n")[1].splitlines()  # one stage a line, with its estimate
    assert table[0].split() == ["stage", "alone", "start-end", "what"] and len(table) == 1 + len(plan(cfg))
    for name in ("base", "tau_models", "entropy_rate", "report"):
        assert f"\n{name}" in text
    wall = paragraph_of(text, "Wall time")
    assert "ESTIMATE" in wall and "TFLOP/s" in wall and "measured on" in wall and "not assumed." in wall
    assert _estimate_hours(text) <= _estimate_hours(wall.replace("stages one after another: ", "an ESTIMATE, ", 1)
                                                    .split("(", 1)[1])
    assert not (tmp_path / "out").exists()  # the check writes nothing
    if profile == "paper":  # its transformer's streams fit its context of 512 (they did not: 1,000 and 8,243)
        line = paragraph_of(text, "transformer_calibration:")
        assert "fit_tokens / fit_streams = 20,000 / 40 -> 500" in line
        assert "score_tokens / score_streams = 82,430 / 200 -> 412" in line
        assert "prefix_len + horizon = 100 + 400 -> 500" in line


@pytest.mark.slow
def test_the_old_paper_transformer_settings_are_refused():
    """Before the fix the transformer inherited the AWD-LSTM's 20 fit streams of 1,000 tokens and 10 score streams."""
    cfg = load_profile(["profile=paper", "out=/nonexistent/lmcal-check",
                        "transformer.analysis=[analysis=default,analysis.calibration.topk=1024,"
                        "analysis.entropy_rate.horizon=400]"])
    with pytest.raises(LmcalError, match=r"Stage 'transformer_calibration' .* context of 512 .*"
                                         r"fit_tokens / fit_streams = 20,000 / 20 = 1,000 tokens; "
                                         r"score_tokens / score_streams = 82,430 / 10 = 8,243 tokens"):
        check(cfg)


def test_a_too_long_transformer_horizon_is_refused_before_anything_runs(tmp_path):
    """make reproduce itself (no check=true) runs the check first: exit 2, one paragraph, no folder written."""
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("LMCAL_DATA_ROOT", "WANDB_MODE")}
    r = subprocess.run([sys.executable, "-m", "lmcal.reproduce", "profile=cpu", f"out={out}", "logger=none",
                        "transformer.analysis=[analysis=cpu,analysis.entropy_rate.prefix_len=50,"
                        "analysis.entropy_rate.horizon=250]"], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    err = r.stderr.strip().splitlines()[-1]
    assert "Stage 'transformer_entropy_rate'" in err and "context of 256 (model.n_positions)" in err
    assert "prefix_len + horizon = 50 + 250 = 300 tokens" in err and "nothing was run" in err
    assert not out.exists()


def test_model_parameter_counts_are_exact():
    gpt = _train_cfg(["experiment=ptb_transformer_small"])
    m = model_of(gpt)
    net = GPTLM(vocab_size=m.vocab, **{k: v for k, v in gpt.model.items() if k != "_target_"})
    assert m.params == sum(p.numel() for p in net.parameters())  # tied embeddings counted once
    assert m.context == 256 and m.vocab == 10_000
    lstm = _train_cfg(["experiment=cpu"])
    m = model_of(lstm)
    kw = {k: v for k, v in OmegaConf.to_container(lstm.model).items() if k not in ("_target_", "vocab_size")}
    assert m.params == sum(p.numel() for p in AWDLSTM(vocab_size=m.vocab, **kw).parameters())
    assert m.context is None


def test_stream_sizes_of_each_stage():
    m = model_of(_train_cfg(["experiment=ptb_transformer_small"]))
    a = {"prefix_len": 50, "horizon": 200, "fit_tokens": 20_000, "fit_streams": 40, "score_tokens": None,
         "score_streams": 200, "timing_horizon": 30, "rollout_prefix": 50, "rollout_steps": 50,
         "horizon_k": [1, 5, 100]}
    assert [s for _, s in stream_sizes("future_entropy", a, m, None)] == [250, 80, 500, 412, 200]
    assert [s for _, s in stream_sizes("memory", {"tau": None}, m, 30)] == [30]
    # the fit never reads more than the split holds: 73,760 validation tokens
    assert stream_sizes("calibration", {"fit_tokens": 10**9, "fit_streams": 1}, m, None)[0][1] == 73_760


def _estimate_hours(text: str) -> float:
    value, unit = re.search(r"an ESTIMATE, ([\d.]+) (h|min)", text).groups()
    return float(value) / (1 if unit == "h" else 60)


def test_the_paper_profile_is_timed_at_the_measured_step_and_scheduled_as_it_runs(tmp_path):
    """The AWD-LSTM trainings at the step measured on an H200 (tools/gpu_check.py), a tau-model's step counting its
    tau sequential steps (forward_chunked), not the base model's 70; the tau-models beside the base model (jobs=2, not
    warm-started) and side by side under their launcher, sharing the GPU by time-slicing only; paper_full keeps the
    paper's 500 epochs; about 2 h for the calibration's exact lookahead (the paper's: V model steps a word) and its
    dose-response."""
    text = check(load_profile(["profile=paper", f"out={tmp_path / 'p'}", "check=true"]))
    full = check(load_profile(["profile=paper_full", f"out={tmp_path / 'f'}", "check=true"]))
    assert 4.5 <= _estimate_hours(text) <= 5.6 < 10 <= _estimate_hours(full)
    base = paragraph_of(text, "base:")
    epoch, _ = lstm_epoch_seconds(929_589, 73_760, 20, 70, None)
    assert "300 epochs" in base and "batch 20" in base and f"= {300 * epoch / 3600:.2f} h" in base
    assert 12 < epoch < 15  # the measured 13 s, against the anchor's 65 s on a GP100
    tau5 = paragraph_of(text, "tau_models tau=5:")
    assert "x 5 sequential steps" in tau5 and "x 30 sequential steps" in paragraph_of(text, "tau_models tau=30:")
    assert "tau_models: the 6 trainings side by side on the one GPU, 6 at once" in text and "time-sliced" in text
    serial = _estimate_hours("an ESTIMATE, " + text.split("stages one after another: ", 1)[1])
    assert _estimate_hours(text) < serial  # the tau-models beside the base model
    cal = paragraph_of(text, "calibration:")
    assert "fit statistics 2 x [fit positions, candidates] = 2 x [20,000, 10,000] (CPU memory) 1.60 GB" in cal
    assert "500 epochs" in paragraph_of(full, "base:")
    assert "MPS" in text and "is not assumed" in text


def test_the_schedule_shares_one_gpu_by_time_slicing():
    """Two stages of 10 s each: busy all the time, side by side they take as long as one after another; busy half
    the time, they overlap; a stage waits for its deps; a sweep's runs one at a time add up."""
    both = [Job("a", 10, 1.0), Job("b", 10, 1.0)]
    assert schedule(both, 2)[0] == pytest.approx(20) and schedule(both, 1)[0] == pytest.approx(20)
    half = [Job("a", 10, 0.5), Job("b", 10, 0.5)]
    assert schedule(half, 2)[0] == pytest.approx(10) and schedule(half, 1)[0] == pytest.approx(20)
    total, spans = schedule([Job("a", 10, 0.5), Job("b", 5, 0.5, ("a",)), Job("c", 4, 0.5)], 3)
    assert spans["b"][0] == pytest.approx(10) and total == pytest.approx(15)
    assert side_by_side_group([3, 4], [1.0, 1.0], 1) == (pytest.approx(7), pytest.approx(1.0))
    assert side_by_side_group([3, 3], [0.5, 0.5], 2)[0] == pytest.approx(3)


def test_side_by_side_reads_the_launcher_and_its_jobs():
    assert side_by_side(["lmcal.train", "-m", "experiment=paper"], 6) == 1  # the basic launcher: one after another
    assert side_by_side(["hydra/launcher=slurm_gpu"], 6) == 1  # separate GPUs, not the one of the estimate
    assert side_by_side(["hydra/launcher=local_parallel"], 6) == 2  # the preset's n_jobs
    assert side_by_side(["hydra/launcher=local_parallel", "hydra.launcher.n_jobs=6"], 3) == 3  # no more than jobs


@pytest.mark.slow
def test_streamed_memory_rows_cost_a_forward_of_both_models_per_pass_of_the_fit(tmp_path):
    """analysis.memory.rows=stream keeps one chunk but recomputes the rows on every pass: the plan's model steps of a
    memory stage are 25 times those of kept rows (the one-step jackknife), and 25 + 11 per block with the exact one."""
    def line(rows):
        cfg = load_profile(["profile=smoke", f"out={tmp_path / rows}", "check=true",
                            f"analysis=[analysis=smoke,analysis.memory.rows={rows}]"])
        return paragraph_of(check(cfg), "memory_tau2:")

    kept, streamed = line("cpu"), line("stream")
    steps = float(re.search(r"; ~([\d.e+]+) model steps", kept).group(1))
    m = re.search(r"; ~25 passes x ([\d.e+]+) = ([\d.e+]+) model steps", streamed)
    assert m and float(m.group(1)) == steps and float(m.group(2)) == pytest.approx(25 * steps, rel=1e-2)
    assert "streamed rows, one chunk" in streamed and "kept rows" in kept
    model = model_of(_train_cfg(["experiment=smoke"]))
    assert stream_passes({"jackknife": "onestep"}, model) == 25
    assert stream_passes({"jackknife": "exact", "score_tokens": 2000, "cluster_size": 200}, model) == 25 + 11 * 10


def test_paper_full_is_the_paper_profile_with_the_papers_epochs(tmp_path):
    """paper_full names paper (`extends: paper`) and sets only its trainings: every other key is paper's."""
    full, paper = (OmegaConf.to_container(load_profile([f"profile={p}", f"out={tmp_path}"])) for p in
                   ("paper_full", "paper"))
    assert "extends" not in full and full.keys() == paper.keys()
    assert {k for k in full if full[k] != paper[k]} == {"profile", "base", "tau"}
    assert full["base"] == ["experiment=paper"] and "trainer.max_epochs=120" not in full["tau"]


def test_tau_models_side_by_side_that_overflow_their_gpu_are_refused_with_settings_that_fit(tmp_path):
    """Six tau-models on one GPU are sized together (lmcal.pipeline.preflight.check_shared_gpu), not one by one."""
    cfg = load_profile(["profile=paper", f"out={tmp_path / 'out'}", "check=true",
                        "tau=[experiment=paper,trainer.max_epochs=120,hydra/launcher=local_parallel,"
                        "hydra.launcher.n_jobs=6,data.batch_size=4000]"])
    with pytest.raises(LmcalError, match=r"tau_models tau=\d+.*side by side on one GPU \(6 at once over 1 GPU: 6 on "
                                         r"one\).*hydra.launcher.n_jobs=3.*data.batch_size=\d+.*profile's tau"):
        check(cfg)
    assert not (tmp_path / "out").exists()
