"""The scale sweep's results.json and REPORT.md (lmcal.reporting.scale_report), written from the fits and the runs'
records; every sentence that states an effect comes from lmcal.reporting.claims."""

from __future__ import annotations

import math
import time

from lmcal import paper
from lmcal.reporting.provenance import provenance, provenance_line
from lmcal.reporting.scale_claims import effect_trend, scale_exponent

AXES = {"params": "parameters", "train_tokens": "training tokens", "data_tokens": "distinct training tokens",
        "test_ce_nats": "test CE"}
METHODS = {"fitted_temperature": "the fitted temperature", "calibration": "lookahead calibration"}

BIG = ("tail_nats_per_prefix", "curve_nats", "stderr_nats")  # kept in each run's scale.json, not in results.json


def group_claims(g: dict) -> list:
    """The sentences of a group's fits (each single-axis fit, beside its reference) and trends."""
    out = []
    for f in g["fits"].values():
        if "error" in f or len(f["axes"]) > 1:
            continue
        axis = f["axes"][0]
        out.append(scale_exponent(g["label"], AXES[axis], f["exponents"][axis], tuple(f["ci"][axis]), f["level"],
                                  f["n_runs"], f.get("reference"), f.get("reference_text", ""),
                                  key=f"scale_exponent_{axis}", quantity=_quantity(f)))
    for m, t in g["trends"].items():
        out.append(effect_trend(f"{METHODS[m][0].upper()}{METHODS[m][1:]} ({g['label']})", t["slope"], t["stderr"],
                                t["runs"], key=f"trend_{m}"))
    return out


def _pm(x, se, digits=3) -> str:
    if not isinstance(x, (int, float)):
        return "–"
    return f"{x:.{digits}f}" + (f" ± {se:.{digits}f}" if isinstance(se, (int, float)) and math.isfinite(se) else "")


def _count(n) -> str:
    return f"{n / 1e6:.2f}M" if isinstance(n, (int, float)) and n >= 1e5 else f"{n:,}" if isinstance(n, int) else "–"


def scale_table(rows: list[dict]) -> str:
    """One line per run: size, tokens, test CE, the last tenth, the gap, and each fitted method's paired change of the
    last tenth with its test CE (on the stages' scored test tokens, beside the plain model's there)."""
    lines = ["| model | parameters | training tokens (distinct) | test CE | last tenth | gap | T* (test CE) | "
             "calibration (test CE) | plain (test CE) | wall |", "|---|---|---|---|---|---|---|---|---|---|"]
    def effect(r, m):
        e = r["effects"].get(m)
        return f"{_pm(e['tail_diff_nats'], e['tail_diff_stderr_nats'])} ({e['test_ce_nats']:.4f})" if e else "–"

    for r in rows:
        eff = r["effects"]

        wall = f"{r['wall_seconds'] / 60:.1f} min" if r.get("wall_seconds") else "–"
        distinct = f" ({_count(r['data_tokens'])})" if r.get("data_tokens") else ""
        lines.append(f"| {r['model']} | {_count(r['params'])} | {_count(r['train_tokens'])}{distinct} | "
                     f"{_pm(r['test_ce_nats'], r.get('test_ce_stderr_nats'), 4)} | "
                     f"{_pm(r['tail_nats'], r['tail_stderr_nats'])} | {_pm(r['gap_nats'], r['gap_stderr_nats'])} | "
                     f"{effect(r, 'fitted_temperature')} | {effect(r, 'calibration')} | "
                     f"{_pm((eff.get('model') or {}).get('test_ce_nats'), None, 4)} | {wall} |")
    return "\n".join(lines) + "\n"




def results_json(groups: list[tuple[dict, list[dict]]], rows: list[dict], commands: list[str], n_boot: int,
                 profile: str = "scale", own: bool = True) -> dict:
    """results.json of the sweep (`profile`: `make docs RUNS=...` snapshots it into docs/runs/<profile>): the groups
    with their fits, trends and claims, the runs without their per-prefix lists, the commands that ran the sweep (and,
    `own`, this report's), and the sweep's wall time (the sum of its runs')."""
    walls = [r["wall_seconds"] for r in rows if r.get("wall_seconds")]
    prov = provenance()
    return {
        "profile": profile,
        "provenance": {**prov, "command": "; ".join([*commands, *([prov["command"]] if own else [])])},
        "commands": commands, "report_command": prov["command"],
        "groups": [{**g, "claims": [c.sentence for c in group_claims(g)],
                    "verdicts": {c.key: c.verdict for c in group_claims(g)}} for g, _ in groups],
        "runs": [{k: v for k, v in r.items() if k not in BIG} for r in rows],
        "wall_seconds": sum(walls) if walls else None, "runs_timed": len(walls),
        "bootstrap_replicates": n_boot, "reference": {"paper": paper.CVL, "text_exponent": paper.CVL_TEXT_EXPONENT},
        "written_at": time.strftime("%Y-%m-%d %H:%M %Z"),
    }


def setup_markdown(rows: list[dict]) -> list[str]:
    """How every run was measured, from its records: generations, prefixes, horizon, and what the gap is."""
    r0 = rows[0]
    gens = sorted({(r["num_prefixes"], r["samples_per_prefix"], r["prefix_len"], r["horizon"]) for r in rows})
    how = "; ".join(f"{n} validation points x {s} generations, {p} tokens of prefix, {h} generated"
                    for n, s, p, h in gens)
    return [
        f"Each run's generations are sampled from the model itself, and its test cross-entropy is that same model's "
        f"on the test text: the law that generates is the law that is scored. The gap is the mean entropy of the "
        f"next-token distribution over the last tenth of each generation's horizon minus the test cross-entropy "
        f"(nats per {r0['unit']}), as {paper.CVL} define entropy miscalibration (they average the whole generation, "
        f"here its last tenth, where the drift has happened). Generations: {how}. Its standard error combines the "
        "last tenth's, clustered by validation point, and the test cross-entropy's, from blocks of 100 consecutive "
        "test tokens. The fitted temperature's and lookahead calibration's changes of the last tenth are paired with "
        "the plain model's (the same points and uniforms); each is sampled from, and scored as, the fitted model. "
        "Exponents are least squares of log gap on log x (CVL's fit), with percentile intervals from a bootstrap "
        "that resamples the runs and, within each, its validation points (and redraws its test CE within its "
        "standard error); runs whose gap is not positive have no logarithm and are left out, and named.", ""]


def _quantity(f: dict) -> str:
    """What a fit is of: the gap, or (every gap of the group negative) the entropy deficit -gap."""
    return "the gap" if f.get("sign", 1.0) > 0 else "the entropy deficit (-gap; every run's gap is negative)"


def _fit_line(name: str, f: dict) -> str:
    if "error" in f:
        return f"- against {name.replace('+', ' and ')}: not fitted ({f['error']})"
    one = len(f["axes"]) == 1
    parts = [f"b{'' if one else '_' + a} = {f['exponents'][a]:+.3f} [{f['ci'][a][0]:+.3f}, {f['ci'][a][1]:+.3f}]"
             for a in f["axes"]]
    y = "gap" if f.get("sign", 1.0) > 0 else "-gap"
    note = f"; left out ({y} <= 0): {', '.join(f['excluded'])}" if f["excluded"] else ""
    ref = f"; {f['reference_text']}: {f['reference']:+.3f}" if f.get("reference") is not None else ""
    law = " x ".join(f"{AXES[a]}^b{'' if one else '_' + a}" for a in f["axes"])
    return (f"- {y} ~ {law}: {', '.join(parts)} ({100 * f['level']:g}% intervals; {f['n_runs']} runs; "
            f"{f['replicates']} bootstrap replicates, {f['failed_replicates']} that could not fit{note}){ref}")


def report_markdown(report: dict, groups: list[tuple[dict, list[dict]]], figure: str) -> str:
    rows = [r for _, v in groups for r in v]
    wall = report["wall_seconds"]
    lines = ["# Entropy miscalibration against scale", "", provenance_line(report["provenance"]), "",
             *setup_markdown(rows),
             f"{len(rows)} runs in {len(groups)} group(s); the sweep's wall time, the sum of its runs' "
             f"({report['runs_timed']} timed: training and analysis), is "
             + (f"{wall / 3600:.2f} h." if wall else "not recorded.")
             + (f" The pipeline ran for {report['pipeline_wall_seconds'] / 3600:.2f} h, from its first run's start to "
                "its last run's end (runs that were done before and skipped count as they ran then)."
                if report.get("pipeline_wall_seconds") else ""), "",
             f"![gap against parameters, training tokens and test CE]({figure})", ""]
    for (g, v), gj in zip(groups, report["groups"], strict=True):
        lines += [f"## {g['label']}", "", scale_table(v),
                  "Entropies and cross-entropies in nats; ± one standard error. T* and calibration: the paired change "
                  "of the last tenth against the plain model, with the test CE of each on the stages' scored test "
                  "tokens (plain: the model's own there).", ""]
        lines += [_fit_line(n, f) for n, f in g["fits"].items()] + [""]
        lines += [x for s in gj["claims"] for x in (s, "")]
        if g["runs"] < 2:
            lines += ["One run: nothing to fit.", ""]
    return "\n".join(lines).rstrip() + "\n"
