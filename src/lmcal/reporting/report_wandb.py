"""The report's W&B run (lmcal.reporting.report_md writes REPORT.md and calls it): every number of results.json in its
summary and a table, the memory and decoders tables, the figures, and the files as its artifact."""

from __future__ import annotations

import json
from pathlib import Path

from omegaconf import DictConfig

from lmcal.models.checkpoint import checkpoint_names
from lmcal.stages.wandb_run import (
    files_artifact,
    init_args,
    log_files,
    open_run,
    reproduction_group,
    slug,
    use_artifact,
    use_checkpoint,
)
from lmcal.utils.io import read_record, strict_json


def numbers(obj, prefix: str = "") -> list[tuple[str, float]]:
    """Every number of a results file as (key path, value): dicts by key, lists by index (a/b/0)."""
    if isinstance(obj, bool) or obj is None:
        return []
    if isinstance(obj, (int, float)):
        return [(prefix, obj)]
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else []
    return [kv for k, v in items for kv in numbers(v, f"{prefix}/{k}" if prefix else str(k))]


def use_inputs(run, out: Path) -> None:
    """The stage runs' outputs the report is made from, as its inputs (the lineage graph's last step): each training's
    checkpoint artifact and each analysis's evaluation artifact (its name as evaluation.json records it), built
    again from the same files, so the same versions."""
    for ckpt in sorted(p for p in out.rglob("best.ckpt") if p.parent.name == "checkpoints"):
        use_checkpoint(run, ckpt, *checkpoint_names(ckpt))
    for ev in sorted(out.rglob("evaluation.json")):
        name = (read_record(ev) or {}).get("artifact")
        if isinstance(name, str) and name == slug(name):  # one W&B name, as evaluate wrote it
            use_artifact(run, files_artifact(name, "evaluation", [ev]))


def log_report(cfg: DictConfig, results: dict, out: Path) -> None:
    """The report's W&B run: its summary holds every number of results.json that is not part of a list (the curves
    are), a table ("results") holds every number, lists too, and results.json, REPORT.md and the figures are its
    artifact."""
    import wandb

    node = {"_target_": "WandbLogger", "project": cfg.wandb_project, "offline": cfg.wandb_offline}
    run = open_run(init_args(node, out, job_type="report", dataset=cfg.dataset, name=f"report-{cfg.profile}",
                             group=reproduction_group(out), config={"profile": cfg.profile}))
    try:
        every = numbers(strict_json(results))  # as results.json holds them: a non-finite value is null there
        print(f"report: {len(every)} numbers of results.json, REPORT.md and the figures logged from {out}",
              flush=True)  # the run's Logs tab (console="wrap"): this process prints nothing else while it is open
        run.summary.update({k: v for k, v in every if not any(p.isdigit() for p in k.split("/"))})
        run.log({"results": wandb.Table(columns=["key", "value"], data=[[k, float(v)] for k, v in every])})
        run.log({p.stem: wandb.Image(str(p)) for p in sorted([*out.glob("figure*.png"), *out.glob("memory_*.png")])})
        cols = ["tau", "limited", "ce_limited_nats", "delta_ce_nats", "mi_upper_bound_nats", "mi_stderr_nats",
                "mi_upper_bound_crossfit_nats", "alpha"]
        run.log({"memory": wandb.Table(columns=cols, data=[[m[c] for c in cols] for m in results["memory"]])})
        cols = ["method", "params", "entrate_ppl", "test_ce_nats", "zero_prob_fraction", "test_ce_mixed_nats"]
        run.log({"decoders": wandb.Table(columns=cols, data=[[json.dumps(d[c]) if c == "params" else d[c]
                                                              for c in cols] for d in results["decoders"]])})
        use_inputs(run, out)
        log_files(run, f"report-{slug(out.name)}", "report", [out / "results.json", out / "REPORT.md",
                                                                *sorted(out.glob("figure*.png")),
                                                                *sorted(out.glob("memory_*.png"))])
    finally:
        run.finish()
