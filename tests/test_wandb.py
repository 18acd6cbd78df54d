"""One W&B setup for every run (lmcal.stages.wandb_run): training's Lightning WandbLogger and the analysis runs open
offline in one process in either order without $WANDB_MODE (the README's `make test` sets none), and their offline
run files hold the names, job types, groups, tags, series and summaries the dashboard is read by."""

import json
import re
import struct
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from lmcal.stages.wandb_run import finish_run, init_args, log_curves, wandb_log, wandb_run
from lmcal.train import train
from lmcal.utils.settings import CONF_DIR


def records(path: Path):
    """The records of an offline run's .wandb file (wandb.proto Record messages): a 7-byte header (':W&B', 0xBEE1,
    version), then a LevelDB log: 32 KiB blocks of chunks, each a 4-byte checksum, 2-byte length and 1-byte type
    (1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding to the block's end
            pos += left
            continue
        if pos + 7 + length > len(data):  # a chunk still being written
            return
        buf = (b"" if kind in (1, 2) else buf) + data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(buf)
            yield rec


def offline_run(folder: Path, wait_s: float = 60.0) -> dict:
    """What one offline run folder holds: its run record's id, name, job type, group, tags and config keys, the
    keys of its history rows and its final summary. wandb's service process writes the file and can still be
    flushing it when `finish()` has returned: read it once it ends with its exit record (up to `wait_s`)."""
    (f,) = folder.glob("run-*.wandb")
    deadline = time.monotonic() + wait_s
    while not any(r.WhichOneof("record_type") == "exit" for r in records(f)) and time.monotonic() < deadline:
        time.sleep(0.5)
    out = {"history": [], "summary": {}, "values": {}, "artifacts": []}
    for r in records(f):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out.update(id=r.run.run_id, name=r.run.display_name, job_type=r.run.job_type, group=r.run.run_group,
                       tags=list(r.run.tags))
            out["values"].update({u.key: json.loads(u.value_json) for u in r.run.config.update})
        elif kind == "config":  # run.config.update during the run (fitted values)
            out["values"].update({u.key: json.loads(u.value_json) for u in r.config.update})
        elif kind == "history":
            out["history"].append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item})
        elif kind == "summary":
            out["summary"].update({"/".join(u.nested_key) or u.key: json.loads(u.value_json) for u in r.summary.update})
        elif kind == "artifact":  # logged (an output) or, use_after_commit, used (an input)
            a = r.artifact
            out["artifacts"].append({"name": a.name, "type": a.type, "digest": a.digest, "used": a.use_after_commit,
                                     "files": {e.path: e.ref for e in a.manifest.contents}})
    out["config"], out["folder"] = set(out["values"]), folder
    log = folder / "files" / "output.log"  # the console (the Logs tab)
    out["output"] = log.read_text() if log.is_file() else ""
    return out


def runs_under(root: Path) -> list[dict]:
    return [offline_run(d) for d in sorted(root.rglob("offline-run-*")) if d.is_dir()]


def _train_cfg(out, overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=["experiment=smoke", "analysis.stages=[]", "trainer.max_epochs=1",
                                          *overrides])
    with open_dict(cfg):
        cfg.paths.output_dir = str(out)
    return cfg


def _analysis_run(out):
    node = {"_target_": "pytorch_lightning.loggers.WandbLogger", "project": "lmcal", "offline": True}
    run = wandb_run(node, {"stages": ["entropy_rate"]}, out, job_type="entropy_rate", model="AWD-LSTM 8/8/1",
                    dataset="ptb")
    try:
        wandb_log(run, scalars={"entropy_rate/entrate_ppl": 1.5}, summary={"entropy_rate/final": 2.0})
        log_curves(run, "entropy_rate/curves", "t", [1, 2, 3], {"model": [1.0, 1.5, 2.0], "true": [1.0, 1.0, 1.0]})
    finally:
        finish_run(run)


@pytest.mark.parametrize("order", ["training_first", "analysis_first"])
def test_training_logger_and_analysis_run_in_one_process_without_wandb_mode(order, tmp_path, monkeypatch,
                                                                            data_overrides):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc key to fall back on
    cfg = _train_cfg(tmp_path / "train", data_overrides)
    steps = [lambda: _analysis_run(tmp_path / "analysis"), lambda: train(cfg)]
    for step in steps if order == "analysis_first" else steps[::-1]:
        step()
    import os

    assert "WANDB_MODE" not in os.environ  # nothing set it behind the next run's back

    (tr,) = runs_under(tmp_path / "train")
    assert tr["job_type"] == "train" and tr["name"].startswith("train-awd-lstm-")
    assert tr["name"].endswith("-" + cfg.data.name)
    assert tr["group"] == tr["name"].removeprefix("train-") and cfg.data.name in tr["tags"] and "train" in tr["tags"]
    assert {"data", "model", "optim"} <= tr["config"]
    steps_logged = [h for h in tr["history"] if "train/loss" in h]
    assert steps_logged and all({"train/lr", "train/grad_norm"} <= set(h) for h in steps_logged)
    assert any("train/tokens_per_s" in h for h in tr["history"])
    assert tr["summary"]["final/test_ppl"] > 1 and not any("final/test_ppl" in h for h in tr["history"])

    (an,) = runs_under(tmp_path / "analysis")
    assert (an["name"], an["job_type"], an["group"]) == ("entropy_rate-awd-lstm-8-8-1-ptb", "entropy_rate",
                                                         "awd-lstm-8-8-1-ptb")
    assert {"data", "model"} <= an["config"] and an["summary"]["entropy_rate/final"] == 2.0
    curve = [h for h in an["history"] if "entropy_rate/curves/t" in h]
    assert [(h["entropy_rate/curves/t"], h["entropy_rate/curves/model"]) for h in curve] == [(1, 1.0), (2, 1.5),
                                                                                            (3, 2.0)]


def test_a_resumed_training_continues_its_wandb_run(tmp_path, monkeypatch, data_overrides):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    train(_train_cfg(tmp_path, data_overrides))
    train(_train_cfg(tmp_path, [*data_overrides, "trainer.max_epochs=2"]))  # resumes from last.ckpt
    first, second = runs_under(tmp_path)
    assert first["id"] == second["id"] == (tmp_path / "wandb_run_id").read_text().strip()


def test_init_args_explicit_mode_and_a_checked_run_id(tmp_path):
    assert init_args({"_target_": "pytorch_lightning.loggers.CSVLogger"}, tmp_path, "train") is None
    node = {"_target_": "pytorch_lightning.loggers.WandbLogger", "offline": False, "group": "mine"}
    (tmp_path / "wandb_run_id").write_text("../../etc\n")  # not an id: a new one replaces it
    a = init_args(node, tmp_path, "memory", model="AWD-LSTM 8/8/1, tau=5", dataset="markov")
    assert a["mode"] == "online" and a["group"] == "mine" and a["name"] == "memory-awd-lstm-8-8-1-tau5-markov"
    assert a["id"] != "../../etc" and (tmp_path / "wandb_run_id").read_text().strip() == a["id"]
    assert init_args(node, tmp_path, "memory")["id"] == a["id"]


def test_a_training_and_the_analyses_of_its_checkpoint_as_a_dashboard_reads_them(tmp_path, monkeypatch,
                                                                                  data_overrides):
    """Issue 42: one naming rule and group for a training and the analysis of its checkpoint; clean configs (no
    '???', no optimiser keys at two levels, tau a field); the best validation value in the summary; the console as
    the Logs tab; the checkpoint as the training's output artifact and the analysis's input, the same version (same
    name and digest); curves keyed by method, the same in every run, fitted values in the config; each stage's
    curves once; the results table, summary and file of the analysis."""
    import logging
    import sys

    from lmcal.evaluate import evaluate

    monkeypatch.delenv("WANDB_MODE", raising=False)
    lmcal_log, console = logging.getLogger("lmcal"), logging.StreamHandler(sys.stderr)
    level = lmcal_log.level
    lmcal_log.addHandler(console)  # the console handler Hydra gives a real run's "lmcal" logger
    lmcal_log.setLevel(logging.INFO)
    try:
        metrics = train(_train_cfg(tmp_path / "train", data_overrides))
    finally:
        lmcal_log.removeHandler(console)
        lmcal_log.setLevel(level)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        ev = compose("evaluate", overrides=[f"ckpt={metrics['best_ckpt']}", "analysis=smoke", "logger=wandb",
                                            "stages=[entropy_rate,calibration,decoders]",
                                            "analysis.decoders.methods=[{name: top_p, p: 0.9}]",
                                            *[f"data_root={o.split('=', 1)[1]}" for o in data_overrides
                                              if o.startswith("data.root=")]])
    with open_dict(ev):
        ev.paths.output_dir = str(tmp_path / "eval")
    evaluate(ev)
    (tr,) = runs_under(tmp_path / "train")
    (an,) = runs_under(tmp_path / "eval")
    ds = metrics["dataset"]
    assert tr["name"] == f"train-awd-lstm-32-64-3-{ds}" and tr["group"] == f"awd-lstm-32-64-3-{ds}"
    assert an["name"] == f"entropy_rate-calibration-decoders-awd-lstm-32-64-3-{ds}" and an["group"] == tr["group"]
    v = tr["values"]
    assert "???" not in json.dumps(v) and v["model"]["vocab_size"] > 0 and "tau" in v and v["tau"] is None
    assert not {"lr", "weight_decay", "clip", "net", "data_cfg", "vocab_size"} & set(v)  # the optimiser once: optim.*
    assert tr["summary"]["val/ppl"] == pytest.approx(metrics["val_ppl"])  # the best (kept) checkpoint's
    assert "val ppl" in tr["output"] and "test ppl" in tr["output"]  # the console, as the Logs tab shows it
    (out_art,) = [a for a in tr["artifacts"] if not a["used"]]
    assert (out_art["name"], out_art["type"]) == (f"checkpoint-awd-lstm-32-64-3-{ds}", "model")
    assert out_art["files"]["best.ckpt"].startswith("file://")  # a reference: nothing uploaded (log_model=false)
    (used,) = [a for a in an["artifacts"] if a["used"]]
    assert (used["name"], used["digest"]) == (out_art["name"], out_art["digest"])  # the lineage: one version
    assert any(a["type"] == "evaluation" and "evaluation.json" in a["files"] for a in an["artifacts"])
    keys = set().union(*an["history"])
    curves = sorted(k.removeprefix("decoders/curves/") for k in keys if k.startswith("decoders/curves/")
                    and not k.startswith("decoders/curves/chart") and k != "decoders/curves/t")
    assert curves == ["calibration", "fitted_temperature", "model", "top_p_p0.9"]  # no fitted value in a key
    assert all(re.fullmatch(r"[A-Za-z0-9_./-]+", k) for k in keys | set(an["summary"])), keys  # no space, no ()
    assert an["values"]["decoders/fitted_temperature/temperature"] > 0 and "calibration/alpha" in an["values"]
    assert not any(k.startswith("entropy_rate/curve/") for k in keys)  # the curve once: as series only
    assert [h["entropy_rate/curves/t"] for h in an["history"] if "entropy_rate/curves/model" in h] == \
        list(range(1, 21))
    assert an["summary"]["calibration/alpha"] == pytest.approx(json.loads(
        (tmp_path / "eval" / "evaluation.json").read_text())["calibration"]["alpha"])
    assert an["summary"]["decoders/calibration/entrate_ppl"] > 0  # the stage's number and the table's: one key
    assert not any(":" in k for k in an["summary"])
    assert "| stage | metric | value | ± se |" in an["output"]  # the table evaluate ends with, in the Logs tab


def test_a_tau_model_uses_its_base_checkpoints_artifact(tmp_path, monkeypatch, data_overrides):
    """The lineage from a base model to the tau-model warm-started from it and compared with it (memory stage): the
    tau run's inputs are the base run's output artifact, the same name and version (digest)."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    base = train(_train_cfg(tmp_path / "base", ["logger=wandb", *data_overrides]))
    train(_train_cfg(tmp_path / "tau", ["logger=wandb", "model.memory_tau=2", f"init_ckpt={base['best_ckpt']}",
                                        f"memory.base_ckpt={base['best_ckpt']}", "analysis.stages=[memory]",
                                        *data_overrides]))
    (b,) = runs_under(tmp_path / "base")
    (t,) = runs_under(tmp_path / "tau")
    (made,) = [a for a in b["artifacts"] if not a["used"]]
    (used,) = [a for a in t["artifacts"] if a["used"]]  # one input: the warm start and the base are one file
    assert (used["name"], used["digest"]) == (made["name"], made["digest"])
    (own,) = [a for a in t["artifacts"] if not a["used"] and a["name"].startswith("checkpoint-")]
    assert own["name"] != made["name"] and own["name"].startswith("checkpoint-awd-lstm-32-64-3-tau2-")
    # the memory report over the tau run joins its group (not the report's own default by model and dataset)
    from lmcal.reporting.tabulate import memory_report

    (mem,) = (tmp_path / "tau").rglob("memory.json")
    assert json.loads(mem.read_text())["wandb_group"] == t["group"]
    memory_report([tmp_path / "tau"], tmp_path / "report", wandb_mode="offline")
    (rep,) = runs_under(tmp_path / "report")
    assert (rep["job_type"], rep["group"]) == ("report", t["group"])


def test_the_report_run_uses_the_stage_runs_artifacts(tmp_path, monkeypatch, data_overrides):
    """The lineage's last step: the report's run (lmcal.reporting.report_wandb) takes each training's checkpoint and
    each analysis's evaluation.json as inputs, the versions the stage runs logged."""
    from lmcal.reporting.report_wandb import use_inputs
    from lmcal.stages.wandb_run import log_files, open_run

    monkeypatch.delenv("WANDB_MODE", raising=False)
    out = tmp_path / "out"
    train(_train_cfg(out / "ptb" / "base", ["logger=wandb", *data_overrides]))
    ev = out / "ptb" / "entropy_rate"
    ev.mkdir(parents=True)
    (ev / "evaluation.json").write_text(json.dumps({"artifact": "evaluation-awd-lstm-32-64-3-ptb", "x": 1.0}))
    node = {"_target_": "pytorch_lightning.loggers.WandbLogger", "project": "lmcal", "offline": True}
    stage = open_run(init_args(node, ev, job_type="entropy_rate"))
    log_files(stage, "evaluation-awd-lstm-32-64-3-ptb", "evaluation", [ev / "evaluation.json"])
    stage.finish()
    report = open_run(init_args(node, tmp_path / "report", job_type="report"))
    use_inputs(report, out)
    report.finish()
    made = {a["name"]: a["digest"] for r in runs_under(out) for a in r["artifacts"] if not a["used"]}
    (rep,) = runs_under(tmp_path / "report")
    used = {a["name"]: a["digest"] for a in rep["artifacts"] if a["used"]}
    assert len(made) == 2 and used == made  # both stage outputs, the same versions


def test_metric_keys_are_plain_and_readable():
    from lmcal.stages.wandb_run import metric_key

    assert metric_key("decoders/curves/top_p (p=0.9)") == "decoders/curves/top_p_p0.9"
    assert metric_key("future_entropy (horizon_k=5, discount=0.95)") == "future_entropy_horizon_k5_discount0.95"
    assert metric_key("decoders/calibration: entrate_ppl") == "decoders/calibration/entrate_ppl"
    assert metric_key("calibration/dose/cover 0.95/x10/t") == "calibration/dose/cover_0.95/x10/t"
    assert metric_key("final/test_ppl") == "final/test_ppl"
