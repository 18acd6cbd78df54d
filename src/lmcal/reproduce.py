"""`make reproduce`: every result of the paper this project reproduces, in one resumable pipeline.

    python -m lmcal.reproduce [profile=auto|paper|cpu|smoke] [out=DIR] [key=value ...]

The profile (conf/reproduce/<profile>.yaml; `auto` is `paper` with CUDA, else `cpu`) names the overrides of each
stage; `key=value` pairs override the profile (OmegaConf dot-list, e.g. `taus=[5,10]`). Stages, in order:

    base              train the full model (python -m lmcal.train)
    tau_models        train the tau-limited models (a Hydra multirun: hydra/launcher= spreads it)
    entropy_rate      Table 1 row and Figure 2 (python -m lmcal.evaluate stages=[entropy_rate])
    calibration       alpha*, test ppl before/after, Figure 3
    decoders          temperature, top-k, top-p, typical, eta, min-p, Mirostat beside fitted temperature and calibration
    memory_tau<T>     the I_tau bound for each tau; then the same four on data=markov (markov_*)
    report            results.json, REPORT.md, memory tables and Figure 4

Each stage runs as its own process with its log in <out>/logs/<stage>.log and records completion in
<out>/stages/<stage>.json (written atomically, after its outputs). A rerun skips recorded stages, and a training
that was killed resumes from its last checkpoint; the seeds make the results the same as an uninterrupted run's.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lmcal.errors import LmcalError
from lmcal.settings import composed, differences, settings_of
from lmcal.train import CONF_DIR
from lmcal.utils import (
    copy_atomic,
    exp_or_inf,
    format_ce,
    format_params,
    run_lock,
    write_json_atomic,
    write_text_atomic,
)
from lmcal.validate import check_config

PROFILES = ("paper", "cpu", "smoke")
PAPER = {"test_ppl": 58.3, "entrate_ppl": 93.1}  # Table 1, AWD-LSTM on PTB


# ---------------------------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------------------------


def resolve_profile(name: str) -> tuple[str, str | None]:
    """(profile, note): `auto` becomes paper with CUDA, else cpu, with a line saying so."""
    if name == "auto":
        import torch

        name = "paper" if torch.cuda.is_available() else "cpu"
        return name, (f"PROFILE=auto: running the '{name}' profile ({'CUDA found' if name == 'paper' else 'no CUDA'}"
                      "); choose another with `make reproduce PROFILE=paper|cpu|smoke`.")
    if name not in PROFILES:
        raise LmcalError(f"Unknown profile {name!r}: use auto, paper, cpu or smoke.")
    return name, None


CLI_ONLY = ("profile", "force")  # keys of the command line that are not the profile's settings


def _keys(node, prefix: str = "") -> list[str]:
    return [k for key, v in node.items()
            for k in (_keys(v, f"{prefix}{key}.") if isinstance(v, DictConfig) else [f"{prefix}{key}"])]


def load_profile(argv: list[str]) -> DictConfig:
    """The profile's config with the command line's dot-list overrides merged on top; a key the profile does not
    have is an error listing those it has."""
    try:
        cli = OmegaConf.from_dotlist(argv)
    except Exception as e:
        raise LmcalError(f"Cannot read the settings {' '.join(argv)}: {str(e).splitlines()[0]}. Give them as "
                         "key=value pairs, e.g. taus=[5,10] out=DIR.") from None
    name, note = resolve_profile(str(cli.get("profile", "auto")))
    profile = OmegaConf.load(CONF_DIR / "reproduce" / f"{name}.yaml")
    known = _keys(profile)
    unknown = [k for k in _keys(cli) if k not in known and k not in CLI_ONLY
               and not any(k.startswith(f"{p}.") for p in known)]
    if unknown:
        raise LmcalError(f"Unknown setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} (in ARGS or on the "
                         f"command line). The {name} profile (conf/reproduce/{name}.yaml) has: {', '.join(known)}; "
                         "and the command line also takes profile= and force=true (FORCE=1).")
    cfg = OmegaConf.merge(profile, cli)
    cfg.profile = name
    cfg.force = bool(cfg.get("force", False))
    if cfg.get("out") is None:
        cfg.out = f"outputs/reproduce/{name}"
    if note:
        print(note, flush=True)
    return cfg


# ---------------------------------------------------------------------------------------------------------------------
# Stages
# ---------------------------------------------------------------------------------------------------------------------


def logger_overrides(cfg: DictConfig) -> list[str]:
    """One W&B project and group for every run of a reproduction (offline unless the profile says otherwise)."""
    if cfg.logger == "wandb":
        return ["logger=wandb", f"logger.project={cfg.wandb_project}", f"logger.group=reproduce-{cfg.profile}",
                f"logger.offline={str(cfg.wandb_offline).lower()}"]
    return [f"logger={cfg.logger}"]


def plan(cfg: DictConfig) -> list[dict]:
    """The stages in order: name, command (argv) or in-process function, and the files that show it finished."""
    out = Path(cfg.out).resolve()
    py = [sys.executable, "-m"]
    lg = logger_overrides(cfg)
    stages = []
    for prefix, part, data in (("", cfg, cfg.dataset), ("markov_", cfg.markov, "markov")):
        root = out / (prefix.rstrip("_") or data)
        base_ckpt = root / "base" / "checkpoints" / "best.ckpt"
        stages.append({"name": f"{prefix}base", "dir": root / "base", "done": [root / "base" / "metrics.json"],
                       "deps": [],
                       "cmd": py + ["lmcal.train", f"data={data}", *part.base, "analysis.stages=[]", *lg,
                                    f"task_name={prefix}base", f"hydra.run.dir={root / 'base'}"]})
        taus = list(part.taus)
        tau_dirs = {t: root / "tau" / f"tau_{t}" for t in taus}
        warm = [f"init_ckpt={base_ckpt}"] if part.warm_start else []
        stages.append({"name": f"{prefix}tau_models", "dir": root / "tau", "taus": tau_dirs,
                       "done": [d / "metrics.json" for d in tau_dirs.values()],
                       "deps": [f"{prefix}base"] if part.warm_start else [],
                       "cmd": py + ["lmcal.train", "-m", f"data={data}", *part.tau, *warm, "analysis.stages=[]", *lg,
                                    f"task_name={prefix}tau", f"hydra.sweep.dir={root / 'tau'}",
                                    "hydra.sweep.subdir=tau_${model.memory_tau}"]})
        ev = py + ["lmcal.evaluate", f"ckpt={base_ckpt}", *part.analysis, *lg]
        if not prefix:  # the generation stages on PTB; on the Markov source the memory bound is what is checked
            for stage in ("entropy_rate", "calibration", "decoders"):
                extra = ([f"analysis.decoders.calibration_json={root / 'calibration' / 'calibration.json'}"]
                         if stage == "decoders" else [])  # its calibration row: the calibration stage's
                stages.append({"name": stage, "dir": root / stage, "done": [root / stage / f"{stage}.json"],
                               "deps": ["base", "calibration"] if stage == "decoders" else ["base"],
                               "cmd": ev + [f"stages=[{stage}]", *extra, f"task_name={stage}",
                                            f"hydra.run.dir={root / stage}"]})
        for t, d in tau_dirs.items():
            mdir = root / "memory" / f"tau_{t}"
            stages.append({"name": f"{prefix}memory_tau{t}", "dir": mdir, "done": [mdir / "memory.json"],
                           "deps": [f"{prefix}base", f"{prefix}tau_models"],
                           "cmd": py + ["lmcal.evaluate", f"ckpt={d / 'checkpoints' / 'best.ckpt'}",
                                        f"memory.base_ckpt={base_ckpt}", "stages=[memory]", *part.analysis, *lg,
                                        f"task_name={prefix}memory", f"hydra.run.dir={mdir}"]})
    stages.append({"name": "report", "dir": out, "done": [out / "results.json", out / "REPORT.md"], "fn": report,
                   "deps": [st["name"] for st in stages]})
    return stages


def run_stage(stage: dict, cfg: DictConfig, out: Path, index: int, total: int) -> float:
    """Runs one stage (skipping the tau models already trained), with its output in logs/<name>.log."""
    log_path = out / "logs" / f"{stage['name']}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    cmd = list(stage.get("cmd") or [])
    if "taus" in stage:  # a rerun trains only the tau models without results (a killed one resumes)
        todo = [str(t) for t, d in stage["taus"].items() if not (d / "metrics.json").is_file()]
        cmd = cmd[:cmd.index("-m", 2) + 1] + [f"model.memory_tau={','.join(todo)}"] + cmd[cmd.index("-m", 2) + 1:]
        if not todo:
            cmd = []
    print(f"[{index}/{total}] {stage['name']}: running (log: {log_path})", flush=True)
    t0, rc = time.perf_counter(), 0
    if "fn" in stage:
        stage["fn"](cfg, out)
    elif cmd:
        with open(log_path, "a") as log:
            log.write(f"\n$ {shlex.join(cmd)}\n")
            log.flush()
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "HYDRA_FULL_ERROR": "1"}).returncode
    if "fn" not in stage:
        missing = [str(p) for p in stage["done"] if not p.is_file()]
        if rc or missing:
            failed = sorted(stage["dir"].rglob("failed.json")) if stage["dir"].is_dir() else []
            why = f"exit status {rc}" if rc else f"it did not write {', '.join(missing)}"
            if failed:
                why += f"; see {', '.join(map(str, failed))}"
            raise LmcalError(f"Stage '{stage['name']}' failed ({why}). Its log is {log_path}. Rerun it alone with:\n"
                             f"  {shlex.join(cmd)}\nor rerun the pipeline, which skips the finished stages.")
    return time.perf_counter() - t0


def stage_settings(stage: dict, cfg: DictConfig) -> dict:
    """The resolved settings `stage` runs with, checked against the range rules ({key: value}; for the tau-models
    {tau: {key: value}}; for the report, the profile keys it reads). Paths inside the output folder are recorded
    relative to it ("<out>/..."), so a moved or copied reproduction still resumes."""
    if "fn" in stage:
        return {"dataset": cfg.dataset, "taus": list(cfg.taus), "markov.taus": list(cfg.markov.taus)}
    entry, overrides = stage["cmd"][2], [a for a in stage["cmd"][3:] if a != "-m"]
    out = str(Path(cfg.out).resolve())

    def checked(extra: list[str]) -> dict:
        c = composed(entry, overrides + extra)
        check_config(c, where=f"Stage '{stage['name']}' (python -m {entry}): ")
        return {k: "<out>" + v[len(out):] if isinstance(v, str) and v.startswith(out + os.sep) else v
                for k, v in settings_of(c).items()}

    if "taus" in stage:
        return {str(t): checked([f"model.memory_tau={t}"]) for t in stage["taus"]}
    return checked([])


def stale_stages(stages: list[dict], current: dict, out: Path, force: bool) -> dict[str, list[str] | None]:
    """The stages to redo because their recorded settings differ from `current`, with those downstream of them:
    {name: tau keys to redo, or None for the whole stage}. Without `force`, any such stage is an error listing the
    stages and keys that differ."""
    changed = {}
    for st in stages:
        rec = out / "stages" / f"{st['name']}.json"
        if not rec.is_file():
            continue
        record = _read(rec)
        if "settings" not in record:  # a record of an lmcal that did not keep settings: adopt the current ones
            print(f"{st['name']}: recorded without its settings (an older lmcal); taking it as run with the current "
                  "ones.", flush=True)
            write_json_atomic(rec, {**record, "settings": current[st["name"]]})
            continue
        old, now = record["settings"], current[st["name"]]
        if "taus" in st:
            diffs = {t: differences(old[t], now[t]) for t in sorted(old.keys() & now.keys(), key=int)}
            diffs = {t: d for t, d in diffs.items() if d}
            if diffs:
                changed[st["name"]] = [f"tau={t} {line}" for t, d in diffs.items() for line in d], set(diffs)
        elif differences(old, now):
            changed[st["name"]] = differences(old, now), None
    redo = {name: taus for name, (_, taus) in changed.items()}
    for st in stages:  # in pipeline order: whatever uses a redone stage's results is redone whole
        if any(d in redo for d in st["deps"]):
            redo[st["name"]] = None
    if changed and not force:
        listed = "; ".join(f"{name} ({', '.join(lines[:6])}{', ...' if len(lines) > 6 else ''})"
                           for name, (lines, _) in changed.items())
        downstream = [n for n in redo if n not in changed]
        raise LmcalError(
            f"The settings of {len(changed)} stage{'s' if len(changed) > 1 else ''} in {out} differ from those "
            f"{'they' if len(changed) > 1 else 'it'} ran with: {listed}. Nothing was run, and the results there are "
            "as they were. To redo " + ("them" if len(changed) > 1 else "it") +
            (f" and the stages that use their results ({', '.join(downstream)})" if downstream else "") +
            ", rerun with FORCE=1 (make reproduce ... FORCE=1, or force=true on the command line); or give another "
            "out=DIR for a separate reproduction.")
    return redo


def clear_stage(stage: dict, taus: set[str] | None, out: Path) -> None:
    """Removes what a stage wrote (for the tau-models, only the given taus), so that it runs again from scratch."""
    (out / "stages" / f"{stage['name']}.json").unlink(missing_ok=True)
    dirs = [stage["taus"][int(t)] for t in taus] if taus else [] if "fn" in stage else [stage["dir"]]
    for d in dirs:
        if d.is_dir() and d.resolve() != out:
            print(f"{stage['name']}: removing {d} to redo it (FORCE)", flush=True)
            shutil.rmtree(d)


def reproduce(cfg: DictConfig) -> dict:
    check_config(cfg)  # the profile's own values (taus), before the folder is touched
    out = Path(cfg.out).resolve()
    with run_lock(out, "reproduction"):
        stages = plan(cfg)
        current = {st["name"]: stage_settings(st, cfg) for st in stages}  # every stage checked before any runs
        for name, taus in stale_stages(stages, current, out, bool(cfg.get("force"))).items():
            clear_stage(next(st for st in stages if st["name"] == name), taus, out)
        profile = OmegaConf.masked_copy(cfg, [k for k in cfg if k != "force"])
        write_text_atomic(out / "profile.yaml", OmegaConf.to_yaml(profile))
        t_all = time.perf_counter()
        for i, stage in enumerate(stages, 1):
            record = out / "stages" / f"{stage['name']}.json"
            rec = {"dir": str(stage["dir"]), "cmd": stage.get("cmd"), "settings": current[stage["name"]]}
            if (record.is_file() and _read(record).get("status") == "done"
                    and all(p.is_file() for p in stage["done"])):
                print(f"[{i}/{len(stages)}] {stage['name']}: done before, skipped", flush=True)
                if _read(record).get("settings") != rec["settings"]:  # the tau-models of a longer taus list
                    write_json_atomic(record, {**_read(record), **rec})
                continue
            write_json_atomic(record, {"status": "started", **rec})
            seconds = run_stage(stage, cfg, out, i, len(stages))
            write_json_atomic(record, {"status": "done", "seconds": seconds, **rec})
            print(f"[{i}/{len(stages)}] {stage['name']}: done in {seconds:.0f} s", flush=True)
        print(f"Finished in {time.perf_counter() - t_all:.0f} s: {out / 'REPORT.md'}", flush=True)
    return json.loads((out / "results.json").read_text())


# ---------------------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------------------


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def collect_results(cfg: DictConfig, out: Path) -> dict:
    """results.json: the numbers of every stage, from the files the stages wrote."""
    ptb, mk = out / cfg.dataset, out / "markov"
    base = _read(ptb / "base" / "metrics.json")
    er = _read(ptb / "entropy_rate" / "entropy_rate.json")
    cal = _read(ptb / "calibration" / "calibration.json")
    dec = _read(ptb / "decoders" / "decoders.json")
    mem = [_read(ptb / "memory" / f"tau_{t}" / "memory.json") for t in cfg.taus]
    mbase = _read(mk / "base" / "metrics.json")
    mmem = [_read(mk / "memory" / f"tau_{t}" / "memory.json") for t in cfg.markov.taus]
    names = [st["name"] for st in plan(cfg)]  # pipeline order
    records = {n: _read(out / "stages" / f"{n}.json") for n in names if (out / "stages" / f"{n}.json").is_file()}
    records = {n: r for n, r in records.items() if r.get("status") == "done"}
    def tail_ppl(curve: list[float]) -> float:  # exp of the mean entropy over the last tenth of the horizon
        return exp_or_inf(sum(curve[-max(1, len(curve) // 10):]) / max(1, len(curve) // 10))

    return {
        "profile": cfg.profile, "dataset": cfg.dataset,
        "base": {"val_ppl": base["val_ppl"], "test_ppl": base["test_ppl"], "test_ce_nats": base["test_ce_nats"],
                 "model": base["model"], "epochs": base["epochs"], "params": base["params"]},
        "entropy_rate": {"horizon": er["horizon"], "num_generations": er["num_generations"],
                         "curve_nats": er["curve_nats"], "stderr_nats": er["stderr_nats"],
                         "entrate_ppl": er["entrate_ppl"], "test_ppl": er["test_ppl"],
                         "entrate_tail_ppl": tail_ppl(er["curve_nats"])},
        "calibration": {k: cal[k] for k in ("alpha", "alpha_stderr", "test_ppl_before", "test_ppl_after",
                                            "curve_nats", "stderr_nats", "curve_nats_before",
                                            "entrate_ppl_before", "entrate_ppl_after", "topk", "fit_tokens",
                                            "test_tokens")}
        | {"entrate_tail_ppl_before": tail_ppl(cal["curve_nats_before"]),
           "entrate_tail_ppl_after": tail_ppl(cal["curve_nats"])},
        "decoders": [{k: r[k] for k in ("method", "params", "entrate_ppl", "test_ce_nats", "zero_prob_fraction",
                                        "test_ce_kept_nats", "test_ce_mixed_nats", "entropy_t1_nats",
                                        "entropy_last_nats")} | {"entrate_tail_ppl": tail_ppl(r["curve_nats"])}
                     for r in dec["rows"]],
        "memory": [{k: m[k] for k in ("tau", "ce_limited_nats", "mi_upper_bound_nats", "mi_stderr_nats", "alpha",
                                      "alpha_stderr", "entropy_calibrated_nats")} for m in mem],
        "markov": {"order": mbase["markov_order"],
                   "true_entropy_rate_nats": mbase["true_entropy_rate_nats"],
                   "estimated_entropy_rate_nats": mmem[0]["ce_full_nats"],
                   "estimated_entropy_rate_stderr_nats": mmem[0]["ce_full_stderr_nats"],
                   "test_ce_nats": mbase["test_ce_nats"],
                   "memory": [{"tau": m["tau"], "mi_upper_bound_nats": m["mi_upper_bound_nats"],
                               "mi_stderr_nats": m["mi_stderr_nats"], "exact_mi_nats": m["exact_mi_nats"],
                               "alpha": m["alpha"]} for m in mmem],
                   "oracle": markov_oracle(cfg, mk)},
        "stages": {name: {"seconds": r["seconds"], "status": r["status"]} for name, r in records.items()},
    }


def markov_oracle(cfg: DictConfig, mk: Path) -> dict:
    """The same estimators on the Markov source's exact oracles (same corpus and test text as the trained models)."""
    from lmcal.callbacks import markov_oracle_memory
    from lmcal.module import load_net

    _, ckpt = load_net(mk / "base" / "checkpoints" / "best.ckpt")
    data_cfg = dict(ckpt["hyper_parameters"]["data_cfg"])
    data_cfg.pop("_target_", None)
    from lmcal.module import LMDataModule

    dm = LMDataModule(**data_cfg)
    corpus = dm.prepare()
    return markov_oracle_memory(corpus.info, dm.tokens("valid"), dm.tokens("test"), list(cfg.markov.taus))


def report(cfg: DictConfig, out: Path) -> None:
    from lmcal.plots import entropy_curve_figure
    from lmcal.report import memory_report

    results = collect_results(cfg, out)
    results["stages"]["report"] = {"seconds": 0.0, "status": "done"}
    import numpy as np

    er, cal = results["entropy_rate"], results["calibration"]
    entropy_curve_figure({"generations": (np.array(er["curve_nats"]), np.array(er["stderr_nats"]))},
                         out / "figure2_entropy_rate.png",
                         reference_nats={"test cross-entropy": math.log(results["base"]["test_ppl"])},
                         title=f"{results['base']['model']} on {cfg.dataset}: entropy of generated words")
    before = np.array(cal["curve_nats_before"])
    entropy_curve_figure({"uncalibrated": (before, np.zeros_like(before)),
                          f"calibrated (alpha* = {cal['alpha']:.3g})": (np.array(cal["curve_nats"]),
                                                                        np.array(cal["stderr_nats"]))},
                         out / "figure3_calibration.png",
                         reference_nats={"test cross-entropy": math.log(cal["test_ppl_before"])},
                         title="Lookahead calibration (Algorithm 2)")
    copy_atomic(out / cfg.dataset / "decoders" / "decoders.png", out / "figure_decoders.png")
    memory_report([out / cfg.dataset / "memory", out / "markov" / "memory"], out, wandb_mode="disabled")
    write_json_atomic(out / "results.json", results)
    write_text_atomic(out / "REPORT.md", report_markdown(cfg, results, out))
    if cfg.logger == "wandb":
        _log_report(cfg, results, out)


def decoders_markdown(rows: list[dict]) -> list[str]:
    lines = ["| method | parameters | exp(entropy) t=1 | EntRate (last step) | exp(mean entropy, last tenth) | "
             "test CE (nats) | zero-prob. fraction | CE, ε-mixed |", "|---|---|---|---|---|---|---|---|"]
    for d in rows:
        lines.append(f"| {d['method']} | {format_params(d['params'], drop=('stderr',))} | "
                     f"{exp_or_inf(d['entropy_t1_nats']):.1f} | "
                     f"{d['entrate_ppl']:.1f} | {d['entrate_tail_ppl']:.1f} | {format_ce(d['test_ce_nats'])} | "
                     f"{d['zero_prob_fraction']:.4f} | {format_ce(d['test_ce_mixed_nats'])} |")
    return lines


def report_markdown(cfg: DictConfig, r: dict, out: Path) -> str:
    b, er, cal, mk = r["base"], r["entropy_rate"], r["calibration"], r["markov"]
    orc = mk["oracle"]
    entrate_row = f"| {b['model']} ({cfg.profile}) | {cfg.dataset} | {er['test_ppl']:.1f} | {er['entrate_ppl']:.1f} |"
    lines = [
        f"# lmcal reproduction: profile `{cfg.profile}`", "",
        f"Base model: {b['model']}, {b['params']:,} parameters, {b['epochs']} epochs; validation perplexity "
        f"{b['val_ppl']:.1f}, test {b['test_ppl']:.1f} (the paper: 64.3 / 58.3 after 500 epochs).", "",
        "## Entropy rate of generations (Table 1, Figure 2)", "",
        "| model | corpus | test ppl | EntRate = exp(entropy at the last step) | exp(mean entropy, last tenth) |",
        "|---|---|---|---|---|",
        entrate_row + f" {er['entrate_tail_ppl']:.1f} |",
        f"| AWD-LSTM (paper) | ptb | {PAPER['test_ppl']} | {PAPER['entrate_ppl']} | |", "",
        f"{er['num_generations']} generations of {er['horizon']} words. ![Figure 2](figure2_entropy_rate.png)", "",
        "## Lookahead calibration (Algorithm 2, Figure 3)", "",
        "| | alpha* | test ppl | EntRate (last step) | exp(mean entropy, last tenth) |", "|---|---|---|---|---|",
        f"| uncalibrated | 0 | {cal['test_ppl_before']:.2f} | {cal['entrate_ppl_before']:.1f} | "
        f"{cal['entrate_tail_ppl_before']:.1f} |",
        f"| calibrated | {cal['alpha']:.4f} ± {cal['alpha_stderr']:.4f} | {cal['test_ppl_after']:.2f} | "
        f"{cal['entrate_ppl_after']:.1f} | {cal['entrate_tail_ppl_after']:.1f} |", "",
        f"Standard error of the last step's entropy: {cal['stderr_nats'][-1]:.3f} nats (calibrated).", "",
        f"alpha* fitted on {cal['fit_tokens']:,} validation tokens with top-{cal['topk'] or 'V (exact)'} lookahead; "
        f"test perplexity on {cal['test_tokens']:,} test tokens. The paper: generations' perplexity falls by almost "
        "20 points, test perplexity unchanged. ![Figure 3](figure3_calibration.png)", "",
        "## Decoders beside calibration", "",
        "The decoding rules practitioners use, on the same model, prefixes and seeds as calibration. Test CE is ∞ "
        "where a rule gives a test word probability 0; the ε-mixed CE mixes in ε = 1e-6 of the uniform "
        "distribution, so it is finite for all. The fitted rows (temperature, calibration) are the only ones "
        "chosen by held-out cross-entropy.", "",
        *decoders_markdown(r["decoders"]), "",
        "![decoders](figure_decoders.png)", "",
        "## Memory (Section 5, Figure 4)", "",
        (out / f"memory_{cfg.dataset}.md").read_text().split("\n", 2)[2],
        "## The exact check: an order-k Markov source", "",
        f"Order {mk['order']}. Entropy rate: exact {mk['true_entropy_rate_nats']:.4f} nats, estimated (the trained "
        f"LSTM's test cross-entropy) {mk['estimated_entropy_rate_nats']:.4f} ± "
        f"{mk['estimated_entropy_rate_stderr_nats']:.4f}.", "",
        f"The same estimators on the exact oracles (P̂ = the true conditional, P̃_τ = the exact order-τ "
        f"conditional), on the same test text: entropy rate {orc['estimated_entropy_rate_nats']:.4f} ± "
        f"{orc['estimated_entropy_rate_stderr_nats']:.4f}.", "",
        "| tau | I_tau bound, trained LSTMs | I_tau bound, exact oracles | exact I_tau of the source |",
        "|---|---|---|---|",
        *[f"| {m['tau']} | {m['mi_upper_bound_nats']:.4f} ± {m['mi_stderr_nats']:.4f} | "
          f"{o['mi_upper_bound_nats']:.4f} ± {o['mi_stderr_nats']:.4f} | {m['exact_mi_nats']:.4f} |"
          for m, o in zip(mk["memory"], orc["memory"], strict=True)], "",
        "± is one standard error. The oracle rows check the estimators; the LSTM rows add the trained models' own "
        "error (their bound is on the information *they* draw from beyond tau, and their excess cross-entropy "
        "over the source enters it).", "",
        "![Figure 4 on the Markov source](memory_markov.png)", "",
        "## Stages", "", "| stage | seconds | run folder |", "|---|---|---|",
    ]
    for name, s in r["stages"].items():
        rec = out / "stages" / f"{name}.json"
        folder = _read(rec)["dir"] if rec.is_file() else str(out)
        rel = os.path.relpath(folder, out)
        lines.append(f"| {name} | {s['seconds']:.0f} | [{rel}]({rel}) |")
    total = sum(s["seconds"] for s in r["stages"].values())
    lines += ["", f"Total: {total / 60:.1f} minutes. Settings: [profile.yaml](profile.yaml); logs in [logs/](logs)."]
    return "\n".join(lines) + "\n"


def _log_report(cfg: DictConfig, results: dict, out: Path) -> None:
    import wandb

    run = wandb.init(project=cfg.wandb_project, group=f"reproduce-{cfg.profile}", job_type="report",
                     name=f"report-{cfg.profile}", mode="offline" if cfg.wandb_offline else "online", dir=str(out),
                     reinit="finish_previous")
    try:
        run.summary.update({"test_ppl": results["base"]["test_ppl"],
                            "entrate_ppl": results["entropy_rate"]["entrate_ppl"],
                            "calibration/alpha": results["calibration"]["alpha"]})
        run.log({p.stem: wandb.Image(str(p)) for p in sorted([*out.glob("figure*.png"), *out.glob("memory_*.png")])})
        cols = ["tau", "ce_limited_nats", "mi_upper_bound_nats", "mi_stderr_nats", "alpha"]
        run.log({"memory": wandb.Table(columns=cols, data=[[m[c] for c in cols] for m in results["memory"]])})
        cols = ["method", "params", "entrate_ppl", "test_ce_nats", "zero_prob_fraction", "test_ce_mixed_nats"]
        run.log({"decoders": wandb.Table(columns=cols, data=[[json.dumps(d[c]) if c == "params" else d[c]
                                                              for c in cols] for d in results["decoders"]])})
    finally:
        run.finish()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return
    try:
        reproduce(load_profile(argv))
    except LmcalError as e:
        print(f"\nlmcal: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("\nInterrupted: rerun the same command to resume; finished stages are kept.", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
