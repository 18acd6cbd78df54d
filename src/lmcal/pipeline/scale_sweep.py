"""`make reproduce PROFILE=scale` (2 CPU cores) and `PROFILE=scale_gpu` (one GPU): the scale sweeps of a profile's
`sweeps` (name -> overrides of `python -m lmcal.train -m`, e.g. [experiment=scale]) as one resumable pipeline, then
their table and fit (lmcal.reporting.scale_report).

Each job of each sweep's Hydra grid (its preset's hydra.sweeper.params, and any comma list in its overrides) is one
stage: `python -m lmcal.train <the job's overrides>` in <out>/<sweep>/<job>, run by lmcal.pipeline.schedule as every
stage of `make reproduce` is (its log in <out>/logs/, its completion in <out>/stages/, skipped on a rerun once its
scale.json is there, a killed training resumed from its last.ckpt; `jobs=N` side by side). Every run joins one W&B
group, reproduce-<folder>. `check=true` composes every job, checks its settings' ranges and every stream it feeds its
model against the model's context, and prints the plan with a labelled wall-time estimate, running nothing.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import shlex
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lmcal.errors import LmcalError
from lmcal.pipeline import check as plan_check
from lmcal.pipeline.plan import logger_overrides, stage_settings, told_force_size
from lmcal.pipeline.plan_text import wrap
from lmcal.pipeline.sizes import model_of, stream_sizes
from lmcal.pipeline.timing import BATCHED_TFLOPS, MEASURED_ON, lstm_epoch_seconds
from lmcal.stages.scale_record import RECORD
from lmcal.stages.wandb_run import reproduction_group, sweep_suffix
from lmcal.utils.safe_paths import check_name
from lmcal.utils.settings import CONF_DIR, composed
from lmcal.utils.validate import check_config


def is_sweep_profile(cfg: DictConfig) -> bool:
    return "sweeps" in cfg


def grid(overrides: list[str]) -> list[tuple[list[str], dict[str, str]]]:
    """The jobs `python -m lmcal.train -m <overrides>` would run: (the overrides every job shares, {swept key: this
    job's value}) each, in Hydra's order: the preset's hydra.sweeper.params, a comma list or a single value on the
    command line replacing the preset's list for its key (seed=141: one seed), as Hydra's basic sweeper does."""
    from hydra import compose, initialize_config_dir
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    fixed, swept = [], {}
    for o in parser.parse_overrides(list(overrides)):
        if o.is_sweep_override():
            swept[o.get_key_element()] = list(o.sweep_string_iterator())
        else:
            fixed.append(o.input_line)
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            hc = compose("train", overrides=fixed, return_hydra_config=True).hydra
    except Exception as e:
        raise LmcalError(f"python -m lmcal.train -m {' '.join(overrides)} does not compose: "
                         f"{str(e).strip().splitlines()[0]}") from None
    params = {}
    for k, v in (OmegaConf.to_container(hc.sweeper.params) or {}).items():
        (o,) = parser.parse_overrides([f"{k}={v}"])
        params[k] = list(o.sweep_string_iterator()) if o.is_sweep_override() else [o.get_value_element_as_str()]
    params.update(swept)
    for o in parser.parse_overrides(fixed):  # a value for a swept key: that key's one value
        if o.get_key_element() in params:
            params[o.get_key_element()] = [o.get_value_element_as_str()]
    fixed = [line for line, o in zip(fixed, parser.parse_overrides(fixed), strict=True)
             if o.get_key_element() not in params]
    keys = list(params)
    return [(fixed, dict(zip(keys, values, strict=True))) for values in itertools.product(*params.values())]


def job_folder(values: dict[str, str]) -> str:
    """A job's folder name from its swept values ('awd_lstm_xs-116199'); nothing Hydra's override grammar or a
    file system reads specially."""
    return "-".join(re.sub(r"[^A-Za-z0-9._]+", "_", v) for v in values.values()) or "run"


def plan_sweeps(cfg: DictConfig) -> list[dict]:
    """The stages: one per job of each sweep (None: a sweep left out), then the report (in this process)."""
    out = Path(cfg.out).resolve()
    lg = logger_overrides(cfg)
    stages = []
    for name, overrides in cfg.sweeps.items():
        if overrides is None:
            continue
        check_name(name, f"sweeps.{name} (a sweep's name)")
        for fixed, values in grid(list(overrides)):
            check_name(job_folder(values), f"the job folder of sweep {name} ({values})")
            d = out / name / job_folder(values)
            stages.append({"name": f"{name}_{job_folder(values)}", "dir": d, "done": [d / "metrics.json", d / RECORD],
                           "deps": [], "sweep": name, "values": dict(values),
                           "cmd": [sys.executable, "-m", "lmcal.train", *fixed,
                                   *[f"{k}={v}" for k, v in values.items()], *lg, *suffix(cfg, values),
                                   f"hydra.run.dir={d}"]})
    names = [st["name"] for st in stages]
    stages.append({"name": "report", "dir": out, "done": [out / "results.json", out / "REPORT.md"], "deps": names,
                   "fn": functools.partial(report_stage, names=names)})
    return told_force_size(stages, cfg)


def suffix(cfg: DictConfig, values: dict[str, str]) -> list[str]:
    """A job's W&B name ends with its swept values (train-awd-lstm-64-256-1-powerlaw-1.1-20000), as a multirun's do."""
    part = sweep_suffix(values) if cfg.logger == "wandb" else None
    return [f"logger.name_suffix={part}"] if part else []


def report_stage(cfg: DictConfig, out: Path, names: list[str]) -> None:
    """The report of a sweep profile: scale_report over its sweeps' folders, with each stage's record (the ETAs of
    the next run read them from docs/runs/<profile>/results.json) and the command that ran the pipeline."""
    from lmcal.reporting.scale_report import log_scale_wandb, scale_report

    stages = {}
    for n in names:
        try:
            stages[n] = json.loads((out / "stages" / f"{n}.json").read_text())
        except (OSError, ValueError):
            continue
    dirs = [out / n for n, o in cfg.sweeps.items() if o is not None and (out / n).is_dir()]
    starts = [r["started_at"] for r in stages.values() if "started_at" in r]
    ends = [r["finished_at"] for r in stages.values() if "finished_at" in r]
    report = scale_report(dirs, out, n_boot=int(cfg.get("bootstrap", 2000)), profile=cfg.profile,
                          command="python -m lmcal.reproduce " + shlex.join(sys.argv[1:]),
                          extra={"stages": {**stages, "report": {"seconds": 0.0, "status": "done"}},
                                 "pipeline_wall_seconds": max(ends) - min(starts) if starts and ends else None})
    if report and cfg.logger == "wandb":
        log_scale_wandb(report, out, "offline" if cfg.wandb_offline else "online", cfg.wandb_project,
                        reproduction_group(out))


def check_sweeps(cfg: DictConfig) -> str:
    """The plan of a sweep profile as text: every job composed, range-checked and sized (lmcal.pipeline.check's
    model, streams, model steps and peaks), every stream within its model's context; raises LmcalError naming the job,
    the keys and the limit otherwise."""
    lines, total = [], {"train": 0.0, "analysis": 0.0}
    stages = plan_sweeps(cfg)
    for st in stages[:-1]:
        overrides = [o for o in st["cmd"][3:] if not o.startswith(("hydra.", "logger"))]
        c = composed("lmcal.train", overrides)
        check_config(c, where=f"Stage '{st['name']}' (python -m lmcal.train): ")
        m = model_of(c)
        bptt = int(c.data.bptt)
        if m.context and bptt > m.context:
            raise LmcalError(f"Stage '{st['name']}': data.bptt = {bptt} exceeds its transformer's context of "
                             f"{m.context} (model.n_positions); nothing was run. Set data.bptt <= {m.context}.")
        epochs = max(int(c.trainer.max_epochs), 0)
        tokens = m.corpus.get("train", 0) * epochs
        t_flops = 3 * m.step_flops * tokens
        if m.kind == "awd_lstm":  # latency-bound: the step measured on a GPU (lmcal.pipeline.timing)
            epoch, _ = lstm_epoch_seconds(m.corpus.get("train", 0), m.corpus.get("valid", 0), int(c.data.batch_size),
                                          bptt, None, int(c.data.eval_batch_size))
            total["train"] += epochs * epoch
        else:
            total["train"] += t_flops / (BATCHED_TFLOPS * 1e12)
        parts = []
        for name in c.analysis.stages:
            a = OmegaConf.to_container(c.analysis[name], resolve=True)
            sizes = stream_sizes(name, a, m, None)
            bad = [(w, s) for w, s in sizes if m.context and s > m.context]
            if bad:
                raise LmcalError(f"Stage '{st['name']}' would feed its {m.kind} more tokens than its context of "
                                 f"{m.context} (model.n_positions) in analysis.{name}: "
                                 + "; ".join(f"{w} = {s:,} tokens" for w, s in bad) + ". Nothing was run. Lower "
                                 "prefix_len or horizon, or raise fit_streams or score_streams, until each fits.")
            steps = plan_check.model_steps(name, a, m)
            total["analysis"] += steps * m.step_flops / (BATCHED_TFLOPS * 1e12)
            peak = max((b for _, b in plan_check.peak_tensors(name, a, m, c.analysis.get("memory_budget_gb"))),
                       default=0.0)
            parts.append(f"{name} {steps:.3g} steps (peak {peak / 1e9:.2f} GB)")
        label = f"{st['sweep']}: " + ", ".join(f"{k.rsplit('.', 1)[-1]} {v}" for k, v in st["values"].items())
        lines += wrap(f"{label}: {m.kind}, {m.params:,} parameters, context {m.context or 'unbounded'}; "
                      f"{int(c.trainer.max_epochs)} epochs x {m.corpus.get('train', 0):,} tokens = "
                      f"{t_flops:.3g} training FLOP; " + "; ".join(parts) + f" (folder {st['name']})")
    seconds = sum(total.values())
    if cfg.get("estimate_for", "gpu") == "gpu":
        when = (f"Wall time on one GPU: an ESTIMATE, runs one after another (AWD-LSTM trainings at the step "
                f"measured on {MEASURED_ON}, the rest's FLOPs at an assumed {BATCHED_TFLOPS:g} TFLOP/s; "
                f"launch overheads not counted): training {total['train'] / 3600:.2f} h + analysis "
                f"{total['analysis'] / 3600:.2f} h = {seconds / 3600:.2f} h.")
    else:  # small models on a CPU run far from its peak rate: FLOPs say little of the time
        when = (f"Wall time on this machine's CPU: `python bench/scale_sweep.py --profile {cfg.profile}` estimates it "
                "from short timed pieces of every model in a few minutes.")
    return "\n".join([*wrap(f"Plan of the {cfg.profile} profile: {len(stages) - 1} runs in "
                            f"{sum(o is not None for o in cfg.sweeps.values())} sweep(s) and the report; every run "
                            "composed and within its ranges, every stream within its model's context."), "", *lines,
                      "", *wrap(when + reference_note(cfg.profile, [st["name"] for st in stages[:-1]]))])


def reference_note(profile: str, names: list[str]) -> str:
    """The snapshotted reproduction's time, and these runs' at its times where it had every one of them."""
    from lmcal.pipeline.schedule import clock, reference_seconds

    ref, machine = reference_seconds(profile)
    if not ref:
        return ""
    runs = sum(n != "report" for n in ref)
    cells = {n: ref[n] for n in names if n in ref}
    return (f" The {profile} reproduction snapshotted in docs/runs/{profile} took {clock(sum(ref.values()))} for its "
            f"{runs} runs on {machine}." + (f" At its times, these {len(names)} runs would take "
                                            f"{clock(sum(cells.values()))}: an estimate until measured."
                                            if names and len(cells) == len(names)
                                            and set(names) != set(ref) - {"report"} else ""))


def reproduce_sweeps(cfg: DictConfig) -> dict:
    """`make reproduce` for a sweep profile: checked, then run under the output folder's lock, resumably."""
    from lmcal.pipeline.reproduce import check_quotable, clear_stages, exit_when_stages_fail, stale_stages
    from lmcal.pipeline.schedule import reference_seconds, schedule
    from lmcal.utils.io import write_text_atomic
    from lmcal.utils.lock import check_output_folder, run_lock, sweep_temp_files
    from lmcal.utils.safe_paths import check_no_links

    if cfg.get("launcher", "local") != "local":
        raise LmcalError(f"launcher={cfg.launcher}: the {cfg.profile} profile runs its jobs on this machine (jobs=N "
                         "side by side); for a cluster, run each sweep as a Hydra multirun with a Slurm launcher: "
                         "python -m lmcal.train -m experiment=scale hydra/launcher=slurm_gpu.")
    out = Path(cfg.out).resolve()
    check_quotable(out)
    check_output_folder(out)
    check_no_links(out, "output folder")
    print(check_sweeps(cfg).splitlines()[0], flush=True)  # every job composed and sized before the folder is touched
    with run_lock(out, "reproduction"):
        sweep_temp_files(out)
        stages = plan_sweeps(cfg)
        current = {st["name"]: stage_settings(st, cfg) if "cmd" in st else
                   {"sweeps": OmegaConf.to_container(cfg.sweeps), "bootstrap": cfg.get("bootstrap", 2000)}
                   for st in stages}
        clear_stages(stages, stale_stages(stages, current, out, bool(cfg.get("force"))), out)
        write_text_atomic(out / "profile.yaml", OmegaConf.to_yaml(OmegaConf.masked_copy(cfg, [k for k in cfg
                                                                                              if k != "force"])))
        ref, machine = reference_seconds(cfg.profile)
        if ref:
            print(f"ETAs from the {cfg.profile} reproduction in docs/runs/{cfg.profile} ({machine}).", flush=True)
        t0 = time.perf_counter()
        with exit_when_stages_fail():  # a failed run: the table, exit 1; the other runs kept
            schedule(stages, cfg, out, current, max(1, int(cfg.get("jobs", 1))), ref)
        print(f"Finished in {time.perf_counter() - t0:.0f} s: {out / 'REPORT.md'}", flush=True)
    return json.loads((out / "results.json").read_text())
