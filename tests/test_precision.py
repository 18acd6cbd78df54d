"""The precision settings (issue 76): the `tf32` key of the train and evaluate configs sets torch's TF32 flags and is
recorded with the results, and trainer.precision=bf16-mixed trains through `python -m lmcal.train` on the CPU with
float32 weights, checkpoints and final scores."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate
from omegaconf import open_dict

import lmcal.evaluate
from lmcal.errors import LmcalError
from lmcal.models.awd_lstm import AWDLSTM, ar_tar, evaluate_ce
from lmcal.models.checkpoint import load_net
from lmcal.utils.device import apply_precision_policy, cpu_bf16_lstm, precision_policy
from lmcal.utils.settings import CONF_DIR


@pytest.fixture
def flags():
    """Puts torch's TF32 flags back as they were, whatever the test set."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    precision = torch.get_float32_matmul_precision()
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    torch.set_float32_matmul_precision(precision)


def test_tf32_true_sets_the_flags_and_false_clears_them(flags):
    """The flags exist on a CPU build too: set there all the same, they change nothing."""
    on = apply_precision_policy(tf32=True)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert on == {"tf32_matmul": True, "tf32_cudnn": True, "float32_matmul_precision": "high"} == precision_policy()
    assert apply_precision_policy() == {"tf32_matmul": False, "tf32_cudnn": False,
                                        "float32_matmul_precision": "highest"}  # the default: full float32


@pytest.mark.parametrize("value", ["true", "false", 1, None])
def test_tf32_must_be_a_bool(flags, value):
    with pytest.raises(LmcalError, match=r"tf32=.*: choose tf32=false .* or tf32=true"):
        apply_precision_policy(tf32=value)


@pytest.mark.parametrize("name", ["train", "evaluate"])
def test_both_configs_default_to_tf32_off(name):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name=name, overrides=["tf32=true"])
        assert cfg.tf32 is True
        assert compose(config_name=name).tf32 is False


class _Stop(Exception):
    pass


def test_evaluate_applies_the_tf32_key(tmp_path, flags, monkeypatch):
    """evaluate() sets the flags from cfg.tf32 before any model is read (stopped at the run lock here)."""
    def stop(*a, **k):
        raise _Stop

    monkeypatch.setattr(lmcal.evaluate, "run_lock", stop)
    apply_precision_policy(tf32=False)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="evaluate", overrides=["ckpt=/nonexistent.ckpt", "logger=none", "tf32=true"])
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path)
    with pytest.raises(_Stop):
        lmcal.evaluate.evaluate(cfg)
    assert precision_policy()["tf32_matmul"] and precision_policy()["tf32_cudnn"]


def _tiny_nets():
    from lmcal.models.transformer import GPTLM

    torch.manual_seed(0)
    return [AWDLSTM(50, emb_size=16, hidden_size=32), GPTLM(50, n_positions=16, n_embd=16, n_layer=1, n_head=2)]


BF16_LSTM = pytest.mark.skipif(not cpu_bf16_lstm(), reason="this CPU has no bfloat16 LSTM (oneDNN needs AVX-512 BF16)")


@pytest.mark.parametrize("i", [pytest.param(0, marks=BF16_LSTM), 1], ids=["awd_lstm", "transformer"])
def test_the_networks_and_the_training_loss_run_under_bf16_autocast(i):
    """What LMModule.training_step computes, under the autocast Lightning's bf16-mixed opens on the CPU: the loss is
    float32 and finite, the gradients float32 (the weights stay float32), a carried LSTM state feeds the next window."""
    net = _tiny_nets()[i]
    x, y = torch.randint(0, 50, (2, 10, 4)), torch.randint(0, 50, (10, 4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, raw, hidden = net(x[0], net.init_hidden(4))
        out, raw, _ = net(x[1], hidden)
        ce = F.cross_entropy(net.logits(out).flatten(0, 1), y.flatten())
        loss = ce + ar_tar(out, raw, 2.0, 1.0)
    assert ce.dtype == loss.dtype == torch.float32 and math.isfinite(loss.item())
    loss.backward()
    assert all(p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
               for p in net.parameters() if p.requires_grad)


def test_bf16_mixed_training_through_the_cli(tmp_path, data_overrides, flags):
    """trainer.precision=bf16-mixed (and tf32=true) through python -m lmcal.train: metrics.json with a finite test
    perplexity and the precision recorded, float32 checkpoints, and a test score that is the float32 one (the same as
    scoring best.ckpt here outside any autocast; bfloat16 scoring is off by about 1e-4)."""
    run = tmp_path / "run"
    args = ["experiment=smoke", "trainer.precision=bf16-mixed", "tf32=true", "logger=none", "analysis.stages=[]",
            "trainer.max_epochs=1", *data_overrides]
    r = subprocess.run([sys.executable, "-m", "lmcal.train", *args, f"hydra.run.dir={run}"], cwd=tmp_path,
                       env={**os.environ, "WANDB_MODE": "offline"}, capture_output=True, text=True, timeout=600)
    if not cpu_bf16_lstm():  # an AVX2-only CPU: one paragraph before anything is written, not oneDNN's traceback
        assert r.returncode == 2 and "Traceback" not in r.stderr and not run.exists(), r.stderr[-3000:]
        assert "trainer.precision=bf16-mixed" in r.stderr and "AVX-512 BF16" in r.stderr
        return
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((run / "metrics.json").read_text())
    assert m["epochs"] == 1 and math.isfinite(m["test_ppl"]) and 1 < m["test_ppl"]
    assert m["precision"] == {"trainer": "bf16-mixed", "tf32_matmul": True, "tf32_cudnn": True,
                              "float32_matmul_precision": "high"}
    for name in ("best", "last"):
        state = torch.load(run / "checkpoints" / f"{name}.ckpt", map_location="cpu", weights_only=True)["state_dict"]
        assert {v.dtype for v in state.values() if v.is_floating_point()} == {torch.float32}, name
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        data = compose(config_name="train", overrides=args[:1] + list(data_overrides)).data
    dm = instantiate(data)
    dm.prepare()
    apply_precision_policy(tf32=False)
    net, _ = load_net(m["best_ckpt"])
    ce, n = evaluate_ce(net, dm.tokens("test"), dm.test_batch_size, dm.bptt)
    assert n == m["test_tokens"] and ce == pytest.approx(m["test_ce_nats"], rel=1e-6, abs=0)


@pytest.mark.parametrize("value", ["16-mixed", "bf16-true", "16-true", "64-true"])
def test_an_untested_precision_is_refused_naming_the_ones_that_train(value):
    from lmcal.training.run_checks import check_settings

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=smoke", "logger=none", f"trainer.precision={value}"])
    with pytest.raises(LmcalError, match=rf"trainer.precision={value} is not a precision .*=32-true or bf16-mixed"):
        check_settings(cfg)


def test_the_report_records_the_precision_the_stages_ran_with(tmp_path):
    """results.json's provenance: the TF32 flags each stage recorded (the report's own process runs none)."""
    import json

    from lmcal.reporting.provenance import stage_precision

    off = {"tf32_matmul": False, "tf32_cudnn": False, "float32_matmul_precision": "highest"}
    (tmp_path / "ptb" / "base").mkdir(parents=True)
    (tmp_path / "ptb" / "base" / "metrics.json").write_text(json.dumps({"precision": {"trainer": "32-true", **off}}))
    (tmp_path / "ptb" / "calibration").mkdir()
    ev = tmp_path / "ptb" / "calibration" / "evaluation.json"
    ev.write_text(json.dumps({"provenance": {"precision": off}}))
    got = stage_precision(tmp_path)
    assert {k: got[k] for k in off} == off and set(got["by_folder"]) == {"ptb/base", "ptb/calibration"}
    ev.write_text(json.dumps({"provenance": {"precision": {**off, "tf32_matmul": True}}}))  # one stage with TF32
    got = stage_precision(tmp_path)
    assert "tf32_matmul" not in got and got["by_folder"]["ptb/calibration"]["tf32_matmul"] is True
