"""Reliability: safe checkpoint loading, caught divergence, strict JSON, range rules checked before any work, one
writer per run folder, and files readable as the user's umask says. Through the real entry points, in a
subprocess where the exit code and the message matter."""

import json
import math
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import open_dict

from lmcal.errors import LmcalError
from lmcal.evaluate import evaluate
from lmcal.models.checkpoint import read_checkpoint
from lmcal.pipeline.plan import load_profile
from lmcal.pipeline.reproduce import reproduce
from lmcal.stages import STAGES
from lmcal.stages.registry import settings_of
from lmcal.train import train
from lmcal.utils.io import temp_path, write_json_atomic
from lmcal.utils.lock import LOCK_NAME, run_lock
from lmcal.utils.numbers import exp_or_inf
from lmcal.utils.rules import DECODER_RULES, RULES
from lmcal.utils.settings import CONF_DIR
from tests.conftest import DATA_ROOT


def _cfg(name, out, overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name=name, overrides=overrides)
    with open_dict(cfg):
        cfg.paths.output_dir = str(out)
    return cfg


def _run(module, args, cwd):
    env = {**os.environ, "WANDB_MODE": "offline"}
    if DATA_ROOT:
        env["LMCAL_DATA_ROOT"] = DATA_ROOT
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def smoke_ckpt(tmp_path_factory):
    """A tiny trained model: its best.ckpt."""
    out = tmp_path_factory.mktemp("smoke")
    data = [f"data.root={DATA_ROOT}"] if DATA_ROOT else [
        "data.name=synthetic", "+data.corpus_kwargs={vocab_size: 60, n_train: 20000, n_valid: 3000, n_test: 3000}"]
    train(_cfg("train", out, ["experiment=smoke", "logger=none", "analysis.stages=[]", "trainer.max_epochs=1",
                              *data]))
    return out / "checkpoints" / "best.ckpt"


# -- 1. checkpoints cannot run code -----------------------------------------------------------------------------------


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):  # what a crafted checkpoint does: run a command when unpickled
        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_checkpoint_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.ckpt"
    torch.save({"hyper_parameters": _Payload(marker), "state_dict": {}}, evil)
    r = _run("lmcal.evaluate", [f"ckpt={evil}", "logger=none", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{evil} was not loaded" in r.stderr and "posix.system" in r.stderr
    assert not marker.exists()


@pytest.mark.parametrize("kind", ["empty", "random", "truncated", "foreign", "missing"])
def test_unreadable_checkpoints_are_one_paragraph(kind, tmp_path, smoke_ckpt):
    path = tmp_path / f"{kind}.ckpt"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "random":
        path.write_bytes(os.urandom(4096))
    elif kind == "truncated":
        path.write_bytes(smoke_ckpt.read_bytes()[: smoke_ckpt.stat().st_size // 2])
    elif kind == "foreign":
        torch.save({"weight": torch.zeros(3)}, path)
    with pytest.raises(LmcalError) as e:
        read_checkpoint(path)
    msg = str(e.value)
    assert str(path) in msg and "\n" not in msg
    assert ("not a checkpoint of python -m lmcal.train" if kind == "foreign" else
            "not found" if kind == "missing" else "not a readable checkpoint") in msg


def test_own_checkpoints_load_safely(smoke_ckpt):
    ckpt = read_checkpoint(smoke_ckpt)
    assert ckpt["hyper_parameters"]["vocab_size"] > 0 and ckpt["state_dict"]


# -- 2. divergence ----------------------------------------------------------------------------------------------------


def test_a_diverging_run_stops_saves_no_best_checkpoint_and_says_why(tmp_path):
    """A tiny model with a huge learning rate: the loss is non-finite within a few steps; the run stops at once."""
    run = tmp_path / "run"
    args = ["experiment=smoke", "logger=none", "optim.lr=1e30", "optim.divergence_factor=null",
            "data.max_train_tokens=4000", f"hydra.run.dir={run}", "trainer.enable_progress_bar=false"]
    if not DATA_ROOT:
        args += ["data.name=synthetic", "+data.corpus_kwargs={vocab_size: 60, n_train: 20000, n_valid: 3000, "
                 "n_test: 3000}"]
    r = _run("lmcal.train", args, tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "Training diverged at epoch 0" in r.stderr and "training loss is nan" in r.stderr
    assert "optim.lr=1e+30" in r.stderr and "optim.clip=0.25" in r.stderr
    assert not (run / "checkpoints" / "best.ckpt").exists() and not (run / "metrics.json").exists()


def test_a_loss_far_above_uniform_counts_as_divergence(tmp_path, data_overrides):
    cfg = _cfg("train", tmp_path, ["experiment=smoke", "logger=none", "optim.lr=1e6", *data_overrides])
    with pytest.raises(LmcalError, match=r"cross-entropy is .* nats, beyond 3 x log\(V\)"):
        train(cfg)
    assert not (tmp_path / "checkpoints" / "best.ckpt").exists()


def test_json_is_strict_and_says_why_a_value_is_null(tmp_path):
    path = tmp_path / "r.json"
    write_json_atomic(path, {"ppl": math.inf, "ce": math.nan, "ok": 1.5, "curve": [1.0, -math.inf],
                             "rows": [{"x": math.nan}]})
    text = path.read_text()
    got = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert got["ppl"] is None and got["ppl_nonfinite"] == "inf" and got["ce_nonfinite"] == "nan"
    assert got["ok"] == 1.5 and got["curve"] == [1.0, None] and got["curve_nonfinite"].startswith("1 of 2")
    assert got["rows"] == [{"x": None, "x_nonfinite": "nan"}]
    assert exp_or_inf(800.0) == math.inf and exp_or_inf(1.0) == math.e


# -- 3. resume knows its settings -------------------------------------------------------------------------------------


def test_resuming_with_another_model_shape_is_one_paragraph(tmp_path, data_overrides):
    base = ["experiment=smoke", "logger=none", "analysis.stages=[]", "trainer.max_epochs=1", *data_overrides]
    train(_cfg("train", tmp_path, base))
    with pytest.raises(LmcalError) as e:
        train(_cfg("train", tmp_path, [*base, "trainer.max_epochs=2", "model.hidden_size=48"]))
    assert "Cannot resume from" in str(e.value) and "model.hidden_size is 64 there, 48 now" in str(e.value)


def test_unknown_keys_of_make_reproduce_are_an_error_listing_the_valid_ones():
    with pytest.raises(LmcalError) as e:
        load_profile(["profile=smoke", "tuas=[9]", "outt=elsewhere"])
    assert "Unknown settings tuas, outt" in str(e.value) and "taus" in str(e.value) and "markov.taus" in str(e.value)
    load_profile(["profile=smoke", "taus=[3]", "markov.taus=[1]", "force=true"])  # known keys pass


# -- 4. range rules, before any work ----------------------------------------------------------------------------------


def _bad(rule):
    if rule is None:
        return [0]
    if rule.choices is not None:
        return "bogus"
    cands = [v for v in (rule.lo - 1 if rule.lo is not None else None, rule.lo, rule.hi + 1 if rule.hi is not None
                         else None, rule.hi, (rule.lo or 0) + 1.5 if rule.integer else None) if v is not None]
    return next(v for v in [*cands, None] if not rule.ok(v))


def _hydra(v):
    return "null" if v is None else f"[{','.join(map(str, v))}]" if isinstance(v, list) else str(v)


def _fits_schema(key: str, value) -> bool:
    """Whether `value` has the type the stage's settings dataclass gives `key` (analysis.<stage>.<field>)."""
    parts = key.split(".", 2)
    if len(parts) < 3 or parts[1] not in STAGES:
        return True
    _, stage, field = parts
    try:
        settings_of(stage, {field: value})
    except LmcalError as e:
        return "Value" not in str(e)
    return True


@pytest.mark.parametrize("pattern", list(RULES))
def test_each_range_rule_rejects_a_bad_value_before_a_wandb_folder_exists(pattern, tmp_path, data_overrides):
    value = _bad(RULES[pattern][0])
    analysis = _cfg("train", tmp_path, []).analysis  # a wildcard: the first stage that has the setting
    key = pattern.replace("*", next((n for n, node in analysis.items() if hasattr(node, "keys")
                                     and pattern.split(".")[-1] in node), "*"))
    if pattern in ("taus", "markov.taus", "jobs"):  # make reproduce's own settings
        with pytest.raises(LmcalError, match=f"{pattern}="):
            reproduce(load_profile(["profile=smoke", f"out={tmp_path / 'out'}", f"{pattern}={_hydra(value)}"]))
        assert not (tmp_path / "out").exists()
        return
    hf = pattern in ("model.score_tokens", "model.context", "model.max_tokens", "model.dtype", "model.train_tokens")
    if pattern.startswith("data.corpus_kwargs."):  # the generated sources' settings
        data_overrides = ["data=powerlaw" if pattern.endswith("tail_exponent") else "data=markov"]
    transformer = pattern in ("model.n_positions", "model.n_embd", "model.n_layer", "model.n_head",
                              "model.attn_dropout", "model.embd_dropout")
    overrides = ["experiment=ptb_transformer_small" if transformer else "experiment=smoke", "logger=wandb",
                 *(["model=hf"] if hf else []), f"{key}={_hydra(value)}", *data_overrides]
    if key.startswith("analysis.") and not _fits_schema(key, value):  # the stage's schema refuses it at compose
        with pytest.raises(ConfigCompositionException, match=rf"{key.replace('.', '[.]')}="):
            _cfg("train", tmp_path, overrides)
        return
    cfg = _cfg("train", tmp_path, overrides)
    with pytest.raises(LmcalError, match=rf"{key.replace('.', '[.]')}={'null' if value is None else ''}"):
        train(cfg)
    assert not list(tmp_path.rglob("wandb")) and not list(tmp_path.rglob("*.ckpt"))


@pytest.mark.parametrize("name", list(DECODER_RULES))
def test_decoder_settings_are_checked_before_the_model_is_loaded(name, tmp_path):
    param, rule = next(iter(DECODER_RULES[name].items()))
    cfg = _cfg("evaluate", tmp_path, [f"ckpt={tmp_path / 'not-read.ckpt'}", "stages=[decoders]", f"decoder={name}",
                                      f"decoder.{param}={_hydra(_bad(rule))}"])
    with pytest.raises(LmcalError, match=f"decoder.{param}="):
        evaluate(cfg)
    assert not list(tmp_path.rglob("wandb"))


def test_a_bad_value_on_the_command_line_exits_2_with_one_paragraph(tmp_path):
    r = _run("lmcal.train", ["experiment=smoke", "data.batch_size=0", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("lmcal: error: Setting out of range: data.batch_size=0 ")
    assert not (tmp_path / "run" / "wandb").exists()


# -- 5. one writer per run folder -------------------------------------------------------------------------------------


def test_a_second_run_into_a_busy_folder_is_refused(tmp_path):
    run = tmp_path / "run"
    with run_lock(run):  # this test process holds it, as a running training would
        r = _run("lmcal.train", ["experiment=smoke", "logger=none", f"hydra.run.dir={run}"], tmp_path)
        assert (run / LOCK_NAME).is_file()
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{run} is in use by another lmcal run: process {os.getpid()}" in r.stderr
    assert not (run / LOCK_NAME).exists() and not (run / "checkpoints").exists()


def test_a_stale_lock_is_taken_over_with_a_note(tmp_path, caplog):
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename, "command": "x"}))
    import socket

    assert socket.gethostname() == os.uname().nodename
    with caplog.at_level("WARNING", logger="lmcal"), run_lock(tmp_path) as lock:
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert "stale lock" in caplog.text and not (tmp_path / LOCK_NAME).exists()
    assert temp_path(tmp_path / "a.json") != temp_path(tmp_path / "a.json")  # per-process, per-call names
    assert str(os.getpid()) in temp_path(tmp_path / "a.json").name


# -- 6. readable outputs ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600)])
def test_written_files_get_the_umasks_permissions(umask, mode, tmp_path):
    old = os.umask(umask)
    try:
        write_json_atomic(tmp_path / "results.json", {"a": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "results.json").stat().st_mode) == mode


def test_progress_line_gives_elapsed_time_and_etas_from_the_reference_run():
    from lmcal.pipeline.schedule import clock, progress_line

    assert (clock(12.4), clock(245), clock(3725)) == ("12s", "4m05s", "1h02m")
    ref = {"base": 600.0, "tau_models": 300.0}
    assert progress_line("base", 1, 22, 250, ref, 300.0) == \
        "[1/22] base: 4m10s, about 5m50s left; the pipeline about 10m50s left"
    assert progress_line("base", 1, 22, 700, ref, None) == "[1/22] base: 11m40s (the reference run took 10m00s)"
    assert progress_line("new_stage", 3, 22, 5, ref, None) == "[3/22] new_stage: 5s"  # no reference: elapsed only
