"""The scale sweep's table and fit (the logic of `python -m lmcal.report` on folders holding scale.json records):
one table of the runs, a log-log figure of the gap against parameters, training tokens and test cross-entropy, and
the fitted exponents with t-intervals on their residual degrees of freedom (every seed a run, no run dropped by its
gap's sign; the signed gap's trend beside each power law) beside Cao, Valiant & Liang's, with the sentences about
them written by lmcal.reporting.claims. Written into the output folder as scale.md, scale.png and scale_report.json,
and as results.json and REPORT.md (profile `scale`), so that `make docs RUNS=<that folder>` snapshots it into
docs/runs/scale; logged to W&B as one report run per group, with the table and the scatter as W&B plots.
"""

from __future__ import annotations

import logging
import shlex
from collections import Counter
from pathlib import Path

import numpy as np

from lmcal import paper
from lmcal.core.scaling import MIN_SPREAD, check_spread, fit_power_law, signed_trend, weighted_trend
from lmcal.errors import LmcalError
from lmcal.reporting.scale_text import AXES, METHODS, report_markdown, results_json, run_label, scale_table
from lmcal.stages.scale_record import RECORD
from lmcal.utils import records
from lmcal.utils.io import inside, write_json_atomic, write_text_atomic
from lmcal.utils.records import POSITIVE, Maybe, Of, Range

log = logging.getLogger("lmcal")

# what the table, the fits and the figure read from a scale.json, of its type (lmcal.utils.records): sizes above 0
# (their logarithms are taken), a last tenth per prefix to fit (at least one), null where an error is not known
NUM = Maybe(float)
EFFECT = Maybe({"tail_diff_nats": float, "tail_diff_stderr_nats": NUM, "test_ce_nats": float})
COUNT = Range(1, integer=True)
SCALE = {"model": str, "family": str, "corpus": str, "unit": str, "params": Maybe(POSITIVE),
         "train_tokens": Maybe(POSITIVE), "data_tokens?": Maybe(POSITIVE), "tail_exponent?": NUM,
         "test_ce_nats": POSITIVE, "test_ce_stderr_nats?": NUM, "tail_nats": float, "tail_stderr_nats": NUM,
         "gap_nats": float, "gap_stderr_nats": NUM, "tail_nats_per_prefix": Of(float, 1),
         "effects": {"model?": Maybe({"test_ce_nats": NUM}), "fitted_temperature?": EFFECT, "calibration?": EFFECT},
         "num_prefixes": COUNT, "samples_per_prefix": COUNT, "prefix_len": Range(0, integer=True),
         "horizon": COUNT, "wandb_group?": Maybe(str)}
FIX = "Delete it or rerun that run's analysis (stages=[entropy_rate,...]); nothing was written."


def collect_scale(dirs: list[str | Path]) -> list[dict]:
    """Every scale.json under `dirs`, with its path, its run's wall time (metrics.json's, or the stages' of
    evaluation.json) and training seed; a file that is not a whole record is one paragraph naming it and the key."""
    rows = []
    for d in map(Path, dirs):
        for path in sorted(d.rglob(RECORD)):
            r = records.read(path, SCALE, "a scale record", FIX)
            r["path"] = str(path)
            r["wall_seconds"] = run_seconds(path.parent)
            r["train_seed"] = run_seed(path.parent)
            rows.append(r)
    return rows


def run_seconds(run: Path) -> float | None:
    """A run folder's wall time: metrics.json's wall_seconds (training and stages), else the sum of its stages'
    times in evaluation.json."""
    for name in ("metrics.json", "evaluation.json"):
        if not (run / name).is_file():
            continue
        m = records.read(run / name, {"wall_seconds?": NUM} if name == "metrics.json" else dict,
                         "a run's record", FIX)
        if name == "metrics.json" and m.get("wall_seconds") is not None:
            return float(m["wall_seconds"])
        if name == "evaluation.json":
            profiled = {k: v for k, v in m.items() if isinstance(v, dict) and "profile" in v}
            records.check(profiled, records.Each({"profile": {"seconds": float}}), run / name, "a run's record", FIX)
            s = [v["profile"]["seconds"] for v in profiled.values()]
            return float(sum(s)) if s else None
    return None


def run_seed(run: Path) -> int | None:
    """A run's training seed, from the config Hydra saved in its folder; None where there is none (a record written
    outside Hydra, or an evaluation, which trains nothing)."""
    import yaml

    try:
        seed = (yaml.safe_load((run / ".hydra" / "config.yaml").read_text()) or {}).get("seed")
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def group_label(key: tuple) -> str:
    corpus, s, family, unit = key
    return f"{family} on {corpus}" + (f", tail exponent s = {s:g}" if s is not None else "") + \
        (f" (per {unit})" if unit != "word" else "")


def reference(key: tuple, axis: str) -> tuple[float | None, str]:
    """The exponent the fit is set beside: CVL's prediction for the power-law source against training tokens, their
    fitted exponent for text against parameters."""
    corpus, s, _, _ = key
    if s is not None and axis in ("train_tokens", "data_tokens"):
        return (paper.cvl_predicted_exponent(s), f"The exponent {paper.CVL}'s simplified setting predicts for s = "
                f"{s:g}, -(1 - 1/s) (our reading: the missing mass of the law)")
    if s is None and axis == "params":
        return paper.CVL_TEXT_EXPONENT, f"The exponent {paper.CVL} fit for text ({paper.CVL_SIZES})"
    return None, ""


def fit_group(key: tuple, rows: list[dict], n_boot: int = 2000, seed: int = 0, level: float = 0.95) -> dict:
    """The fits of one group of runs: the gap against each of parameters and training tokens that varies (each
    alone, as CVL fit it, and both at once when both vary), and against test CE, each as a power law and as the
    signed gap's trend; the paired effects' trends; the group's cells (design points) and seeds per cell."""
    varying = [k for k in ("params", "train_tokens", "data_tokens")  # spanning a factor of MIN_SPREAD: one budget
               if all(isinstance(r.get(k), (int, float)) and r[k] > 0 for r in rows)  # seen (640,000 and 639,980
               and max(r[k] for r in rows) >= MIN_SPREAD * min(r[k] for r in rows)]  # tokens) is not an axis
    ratio = [r["train_tokens"] / r["data_tokens"] for r in rows] if {"train_tokens", "data_tokens"} <= set(varying) \
        else []
    if ratio and max(ratio) < 1.05 * min(ratio):  # as many epochs each (windows drop a few tokens): the same axis
        varying.remove("data_tokens")
    tokens = [k for k in varying if k != "params"][:1]  # the distinct tokens where the runs saw as many in all
    joint = ["params", *tokens] if "params" in varying and tokens else []
    # a family whose every gap is negative (generations less entropic than its test CE) has its deficit fitted
    tails = [np.asarray(r["tail_nats_per_prefix"]) for r in rows]
    sign = -1.0 if all(t.mean() <= r["test_ce_nats"] for t, r in zip(tails, rows, strict=True)) else 1.0
    fits = {"+".join(axes): fit_axes(key, axes, rows, sign, n_boot, seed, level)
            for axes in [[k] for k in varying + ["test_ce_nats"]] + ([joint] if joint else [])}
    cells = Counter(cell_of(r, i, ["params", "train_tokens"]) for i, r in enumerate(rows))
    return {"label": group_label(key), "corpus": key[0], "tail_exponent": key[1], "family": key[2], "unit": key[3],
            "runs": len(rows), "fits": fits, "trends": effect_trends(rows),
            "token_axis": (tokens or ["train_tokens"])[0],
            "cells": len(cells), "seeds_per_cell": [min(cells.values()), max(cells.values())]}


def cell_of(r: dict, i: int, axes: list[str]) -> tuple:
    """Run i's design point on `axes`, which its seeds share: the training tokens seen vary a little with a seed's
    BPTT windows, so the distinct ones (data_tokens) stand for them; a test CE is each run's own."""
    return tuple(i if a == "test_ce_nats" else (r.get("data_tokens") or r[a]) if a == "train_tokens" else r[a]
                 for a in axes)


def fit_axes(key: tuple, axes: list[str], rows: list[dict], sign: float, n_boot: int, seed: int,
             level: float) -> dict:
    """One fit of a group against `axes`: the power law of sign * gap with its t-interval and bootstrap, or why not,
    and the signed trend ('signed'), each over every run.

    Every run enters, the seeds of a cell each as a run, not the cells' means: the seeds are independent trainings,
    OLS over them has the point estimate of the cell means weighted by their seed counts, and its residuals hold
    both the seeds' scatter within a cell and the cells' scatter about the law, so the interval is learned from every
    training (cell means would drop the scatter within cells and leave cells - coefficients df: 0 or 1 with 2 or 3
    cells). It assumes the law holds at the cells beyond seed noise; with as few cells as coefficients nothing tests
    that, so the table gives the cells beside the runs."""
    x = {k: [r[k] for r in rows] for k in axes}
    g = sign * np.array([np.mean(r["tail_nats_per_prefix"]) - r["test_ce_nats"] for r in rows])  # [R]
    out = {"axes": axes, "sign": sign, "level": level, "interval": "t", "n_runs": len(rows), "excluded": [],
           "cells": len({cell_of(r, i, axes) for i, r in enumerate(rows)}), "signed": signed_fit(x, g, level)}
    if len(axes) == 1:
        out["reference"], out["reference_text"] = reference(key, axes[0])
    bad = [run_label(r) for r, gi in zip(rows, g, strict=True) if gi <= 0]
    y = "gap" if sign > 0 else "-gap"
    if bad:
        return {**out, "df": len(rows) - len(axes) - 1, "nonpositive": bad,
                "error": f"{len(bad)} of {len(rows)} runs have {y} <= 0: {'; '.join(bad)}; a power law cannot take "
                         "them, and leaving them out would select on the outcome: the signed trend takes every run"}
    try:
        f = fit_power_law(x, [np.asarray(r["tail_nats_per_prefix"]) for r in rows], [r["test_ce_nats"] for r in rows],
                          [r.get("test_ce_stderr_nats") for r in rows], n_boot=n_boot, level=level, seed=seed,
                          sign=sign)
    except ValueError as e:
        return {**out, "df": len(rows) - len(axes) - 1, "error": str(e)}
    return {**out, "exponents": f.exponents, "ci": {k: list(v) for k, v in f.ci.items()}, "stderr": f.stderr,
            "intercept": f.intercept, "df": f.df, "t_crit": f.t_crit,
            "bootstrap_ci": {k: list(v) for k, v in f.bootstrap_ci.items()}, "bootstrap_stderr": f.bootstrap_stderr,
            "replicates": f.replicates, "failed_replicates": f.failed_replicates}


def signed_fit(x: dict[str, list[float]], g: np.ndarray, level: float) -> dict:
    """The signed trend g = a + sum_k b_k log x_k over every run (whatever its sign), with t-intervals; or why not."""
    try:
        names, f = signed_trend(x, g, level)
    except ValueError as e:
        return {"error": str(e), "df": len(g) - len(x) - 1, "n_runs": len(g)}
    return {"slopes": {k: float(f.coef[j + 1]) for j, k in enumerate(names)}, "intercept": float(f.coef[0]),
            "stderr": {k: float(f.stderr[j + 1]) for j, k in enumerate(names)},
            "ci": {k: [float(v) for v in f.ci[j + 1]] for j, k in enumerate(names)}, "df": f.df,
            "t_crit": f.t_crit, "level": level, "n_runs": len(g)}


def effect_trends(rows: list[dict]) -> dict:
    """Each fitted method's paired effect against log test CE, where every run has it and the test CEs differ; not
    fitted (slope None, with the reason) where they span too little to read a trend off, as the fits' rule."""
    ce = [r["test_ce_nats"] for r in rows]
    fitted = [m for m in METHODS if all(r["effects"].get(m) for r in rows)]
    try:
        check_spread(np.array(ce)[:, None], ["test_ce_nats"])
    except ValueError as e:
        return {m: {"slope": None, "stderr": None, "runs": len(rows), "df": len(rows) - 2, "error": str(e)}
                for m in fitted}
    trends = {}
    for m in fitted:
        eff = [r["effects"][m] for r in rows]
        slope, se = weighted_trend(np.log(ce), [e["tail_diff_nats"] for e in eff],
                                   [e["tail_diff_stderr_nats"] for e in eff])
        trends[m] = {"slope": slope, "stderr": se, "runs": len(rows), "df": len(rows) - 2}
    return trends


def scale_figure(groups: list[tuple[dict, list[dict]]], path: Path) -> Path:
    """The gap against parameters, training tokens and test CE, log-log, one colour per group, ±1 se bars (clipped
    above 0), and each single-axis fit's line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lmcal.utils.io import atomic_path

    fig, axes = plt.subplots(1, 3, figsize=(13.5, 4.2), dpi=120)
    for i, (g, rows) in enumerate(groups):
        color = f"C{i}"
        sign = next((f.get("sign", 1.0) for f in g["fits"].values()), 1.0)  # -1: the deficit, open markers
        for ax, axis in zip(axes, ("params", g.get("token_axis", "train_tokens"), "test_ce_nats"), strict=True):
            on_axis = [r for r in rows if isinstance(r.get(axis), (int, float)) and r[axis] > 0]
            pts = [(r[axis], sign * r["gap_nats"], r["gap_stderr_nats"]) for r in on_axis if sign * r["gap_nats"] > 0]
            if len(pts) < len(on_axis):  # a log axis cannot show them: say so where they are missing
                ax.annotate(f"{g['label']}: {len(on_axis) - len(pts)} run(s) with {'gap' if sign > 0 else '-gap'}"
                            " <= 0 not drawn", (0.02, 0.02 + 0.05 * i), xycoords="axes fraction", fontsize=6,
                            color=color)
            if not pts:
                continue
            x, y, se = (np.asarray(v, dtype=float) for v in zip(*pts, strict=True))
            se = np.nan_to_num(se)
            ax.errorbar(x, y, yerr=[np.minimum(se, 0.9 * y), se], fmt="o", color=color, ms=4, capsize=2,
                        mfc="none" if sign < 0 else color, label=g["label"] + (" (-gap)" if sign < 0 else ""))
            f = g["fits"].get(axis)
            if f and "exponents" in f and len(x) > 1:
                xs = np.geomspace(x.min(), x.max(), 20)
                ax.plot(xs, np.exp(f["intercept"]) * xs ** f["exponents"][axis], color=color, lw=1,
                        label=f"b = {f['exponents'][axis]:+.3f} [{f['ci'][axis][0]:+.2f}, {f['ci'][axis][1]:+.2f}], "
                              f"{f['df']} df")
    from matplotlib import ticker

    for ax, axis in zip(axes, ("params", "train_tokens", "test_ce_nats"), strict=True):
        ax.set_xscale("log")
        ax.set_yscale("log")
        for a in (ax.xaxis, ax.yaxis):  # narrow ranges: plain labels at 1, 2, 5 x 10^k (no overlapping minor ones)
            a.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            a.set_minor_formatter(ticker.NullFormatter())
        ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
        if axis == "test_ce_nats":  # a few tenths of a nat: linear ticks read better
            ax.xaxis.set_major_locator(ticker.MaxNLocator(5))
            ax.xaxis.set_major_formatter(ticker.FormatStrFormatter("%.2f"))
        else:
            ax.xaxis.set_major_formatter(ticker.EngFormatter(sep=""))
        ax.set_xlabel({"train_tokens": "training tokens (distinct, for runs trained on one budget)"}.get(
            axis, AXES[axis]) + (" (nats)" if axis == "test_ce_nats" else ""))
        ax.grid(alpha=0.3, which="both")
        if ax.has_data():
            ax.legend(fontsize=6)
    axes[0].set_ylabel("gap = last tenth's entropy - test CE (nats)\nopen: -gap, where every gap of a group is < 0")
    fig.suptitle("Entropy miscalibration against scale (bars ±1 se; lines: log-log least squares over every run, "
                 "with t-intervals)", fontsize=10)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)
    return path


def sweep_commands(rows: list[dict]) -> list[str]:
    """The multirun commands that made the runs, rebuilt from each job's .hydra/overrides.yaml: per entry point and
    experiment, each key with the values its jobs took (a run outside a sweep: its own overrides)."""
    import yaml

    cmds: dict[tuple, dict[str, list]] = {}
    for r in rows:
        run = Path(r["path"]).parent
        try:
            ov = yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text())
            job = yaml.safe_load((run / ".hydra" / "hydra.yaml").read_text())["hydra"]["job"]["name"]
        except (OSError, yaml.YAMLError, KeyError, TypeError):
            continue
        ov = [str(o) for o in ov or []]
        entry = "evaluate" if "evaluate" in str(job) else "train"
        exp = next((o for o in ov if o.startswith("experiment=")), "")
        keys = cmds.setdefault((entry, exp), {})
        for o in ov:
            k, _, v = o.partition("=")
            if v not in keys.setdefault(k, []):
                keys[k].append(v)
    return [f"python -m lmcal.{entry} -m " + " ".join(shlex.quote(f"{k}={','.join(v)}") for k, v in keys.items())
            for (entry, _), keys in cmds.items()]


def scale_report(dirs: list[str | Path], out: str | Path, n_boot: int = 2000, seed: int = 0, profile: str = "scale",
                 command: str | None = None, extra: dict | None = None, rows: list[dict] | None = None) -> dict:
    """Collects the records under `dirs` (`rows`: collect_scale's, read and checked before anything was written),
    fits each group (corpus, tail exponent, family, unit) and writes scale.md, scale.png, scale_report.json,
    results.json and REPORT.md into `out`; returns the report ({} without records). `profile` names the snapshot
    (docs/runs/<profile>), `command` what ran the sweep (None: rebuilt from its jobs' overrides, then this process's
    own), `extra` more keys of results.json. `n_boot`: the bootstrap's replicates, at least 1."""
    if isinstance(n_boot, bool) or not isinstance(n_boot, int) or n_boot < 1:
        raise LmcalError(f"The bootstrap takes a whole number of replicates, at least 1 (it was given {n_boot!r}): "
                         "pass --bootstrap N with N >= 1 (the default, 2000, is the report's own). Nothing was "
                         "written.")
    rows = collect_scale(dirs) if rows is None else rows
    if not rows:
        return {}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    by_key: dict[tuple, list[dict]] = {}
    for r in sorted(rows, key=lambda r: (r["params"] or 0, r["train_tokens"] or 0)):
        by_key.setdefault((r["corpus"], r.get("tail_exponent"), r["family"], r["unit"]), []).append(r)
    groups = [(fit_group(k, v, n_boot, seed) if len(v) > 1 else
               {"label": group_label(k), "runs": 1, "fits": {}, "trends": {}}, v) for k, v in by_key.items()]
    png = scale_figure(groups, inside(out, out / "scale.png"))
    report = {**results_json(groups, rows, [command] if command else sweep_commands(rows), n_boot, profile,
                             own=command is None), **(extra or {})}
    write_text_atomic(inside(out, out / "scale.md"), "\n".join(f"## {g['label']}\n\n{scale_table(v)}"
                                                              for g, v in groups))
    write_json_atomic(inside(out, out / "scale_report.json"), report)
    write_json_atomic(inside(out, out / "results.json"), report)
    write_text_atomic(inside(out, out / "REPORT.md"), report_markdown(report, groups, png.name))
    for g, v in groups:
        print(f"{g['label']}:\n{scale_table(v)}", flush=True)
    return report


def log_scale_wandb(report: dict, out: str | Path, mode: str = "offline", project: str = "lmcal",
                    group: str | None = None) -> list[str]:
    """One W&B report run per W&B group of the records (`group`: one run, in that group): the runs' table, the gap
    against parameters, training tokens and test CE as W&B scatter plots, the figure, and the fitted exponents in its
    summary. Returns the groups logged to."""
    import wandb

    from lmcal.stages.wandb_run import init_args, open_run, slug

    out = Path(out)
    by_group: dict[str, list[dict]] = {}
    for r in report["runs"]:
        by_group.setdefault(group or r.get("wandb_group") or f"scale-{out.resolve().name}", []).append(r)
    cols = ["model", "family", "corpus", "tail_exponent", "params", "train_tokens", "data_tokens", "test_ce_nats",
            "tail_nats", "gap_nats", "gap_stderr_nats", "temperature_effect_nats", "calibration_effect_nats"]
    for name, runs in by_group.items():
        data = [[r.get(c) for c in cols[:11]] + [(r["effects"].get(m) or {}).get("tail_diff_nats")
                                                  for m in ("fitted_temperature", "calibration")] for r in runs]
        node = {"_target_": "WandbLogger", "project": project, "offline": mode != "online"}
        run = open_run(init_args(node, out / f"wandb-{slug(name)}", job_type="report", name="scale_report",
                                 group=name, dataset="+".join(sorted({r["corpus"] for r in runs}))))
        try:
            table = wandb.Table(columns=cols, data=data)
            run.log({"scale/table": table, "scale/figure": wandb.Image(str(out / "scale.png")),
                     **{f"scale/gap_vs_{x}": wandb.plot.scatter(table, x, "gap_nats", title=f"gap against {x}")
                        for x in ("params", "train_tokens", "data_tokens", "test_ce_nats")
                        if any(isinstance(r.get(x), (int, float)) for r in runs)}})
            run.summary.update({f"scale/{slug(g['label'])}/{n}": f["exponents"][n] for g in report["groups"]
                                for n, f in g["fits"].items() if "exponents" in f and n in f["exponents"]})
        finally:
            run.finish()
    return list(by_group)
