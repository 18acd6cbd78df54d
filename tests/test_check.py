"""The plan check (`make reproduce PROFILE=<p> ARGS='check=true'`, lmcal.pipeline.check): every profile passes it,
sizes that do not fit a transformer's context are refused before anything runs, and the model arithmetic is exact."""

import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from lmcal.errors import LmcalError
from lmcal.models.awd_lstm import AWDLSTM
from lmcal.models.transformer import GPTLM
from lmcal.pipeline.check import check, model_of, stream_sizes
from lmcal.pipeline.plan import load_profile
from lmcal.utils.settings import CONF_DIR

PROFILES = sorted(p.stem for p in (CONF_DIR / "reproduce").glob("*.yaml"))


def _train_cfg(overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


@pytest.mark.parametrize("profile", PROFILES)
def test_every_profile_passes_the_plan_check(profile, tmp_path):
    cfg = load_profile([f"profile={profile}", f"out={tmp_path / 'out'}", "check=true"])
    text = check(cfg)
    assert text.startswith(f"Plan of the {profile} profile")
    for name in ("base", "tau_models", "entropy_rate", "report"):
        assert f"\n{name}" in text
    assert "ESTIMATE" in text and "TFLOP/s" in text and text.rstrip().splitlines()[-2].endswith(" h.")
    assert not (tmp_path / "out").exists()  # the check writes nothing
    if profile == "paper":  # its transformer's streams fit its context of 512 (they did not: 1,000 and 8,243)
        line = next(ln for ln in text.splitlines() if ln.startswith("transformer_calibration:"))
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
