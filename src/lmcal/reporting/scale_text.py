"""The scale sweep's results.json and REPORT.md (lmcal.reporting.scale_report), written from the fits and the runs'
records. Every claim comes from lmcal.reporting.scale_claims: results.json keeps its sentence and verdict, REPORT.md
shows each fit and trend as a table row with its verdict, beneath a setup table."""

from __future__ import annotations

import math
import time

from lmcal import paper
from lmcal.core.scaling import MIN_DF
from lmcal.reporting.claim import Claim, Z, finite, shown
from lmcal.reporting.provenance import provenance, provenance_line
from lmcal.reporting.scale_claims import ExponentFit, effect_trend, scale_exponent, signed_gap_trend
from lmcal.reporting.setup_text import generations

AXES = {"params": "parameters", "train_tokens": "training tokens", "data_tokens": "distinct training tokens",
        "test_ce_nats": "test CE"}
METHODS = {"fitted_temperature": "the fitted temperature", "calibration": "lookahead calibration"}

BIG = ("tail_nats_per_prefix", "curve_nats", "stderr_nats")  # kept in each run's scale.json, not in results.json


def current(f: dict) -> dict:
    """A fit as this code writes it. A fit of an earlier report (no 'interval': a bootstrap over the runs of positive
    gap) is read with its df from its runs and coefficients, as not fitted where it left runs out (a selection on the
    outcome) or had df < MIN_DF, and otherwise with its bootstrap interval as the only one it has."""
    if "interval" in f or "error" in f:
        return f
    k, n = len(f["axes"]), f["n_runs"]
    df = n - k - 1
    if f.get("excluded"):
        return {**f, "df": df, "nonpositive": f["excluded"],
                "error": f"{len(f['excluded'])} run(s) with {_y(f)} <= 0 were left out by an earlier report: "
                         f"{'; '.join(f['excluded'])}"}
    if df < MIN_DF:
        return {**f, "df": df, "error": f"df < {MIN_DF}: {n} runs and {k + 1} coefficients leave {df}"}
    return {**f, "df": df, "interval": "bootstrap", "bootstrap_ci": f["ci"]}


def fit_claim(label: str, f: dict) -> Claim | None:
    """The claim of one single-axis power law, beside its reference (not fitted: undecided); None for a joint fit."""
    f = current(f)
    if len(f["axes"]) > 1:
        return None
    axis = f["axes"][0]
    b, ci = (math.nan, (math.nan, math.nan)) if "error" in f else (f["exponents"][axis], tuple(f["ci"][axis]))
    fit = ExponentFit(b, ci, f.get("level", 0.95), f.get("n_runs"), f.get("df"), f.get("interval", "t"),
                      f.get("error", ""))
    return scale_exponent(label, AXES[axis], fit, f.get("reference"), f.get("reference_text", ""),
                          key=f"scale_exponent_{axis}", quantity=_quantity(f))


def signed_claim(label: str, f: dict) -> Claim | None:
    """The claim of one single-axis signed trend (every run, whatever its gap's sign); None for a joint fit or a
    fit of an earlier report, which had none."""
    s = f.get("signed")
    if s is None or len(f["axes"]) > 1:
        return None
    axis = f["axes"][0]
    b, ci = (math.nan, (math.nan, math.nan)) if "error" in s else (s["slopes"][axis], tuple(s["ci"][axis]))
    return signed_gap_trend(label, AXES[axis], b, ci, s.get("level", 0.95), s.get("df"), s["n_runs"],
                            key=f"scale_trend_{axis}", quantity=_quantity(f), why_not=s.get("error", ""))


def trend_claim(label: str, m: str, t: dict) -> Claim:
    """The claim of one method's trend with the models' strength."""
    return effect_trend(f"{METHODS[m][0].upper()}{METHODS[m][1:]} ({label})", t["slope"], t["stderr"], t["runs"],
                        key=f"trend_{m}", df=t.get("df"))


def group_claims(g: dict) -> list:
    """The sentences of a group's fits (each single-axis power law, beside its reference, and signed trend) and of
    its methods' trends."""
    fits = [c for f in g["fits"].values() for c in (fit_claim(g["label"], f), signed_claim(g["label"], f)) if c]
    return fits + [trend_claim(g["label"], m, t) for m, t in g["trends"].items()]


def run_label(r: dict) -> str:
    """A run as the fits name it: its model, its distinct training tokens and its training seed where known."""
    seed = r.get("train_seed")
    return f"{r['model']}, {_count(r.get('data_tokens') or r.get('train_tokens'))} tokens" + (
        f", seed {seed}" if seed is not None else "")


def _pm(x, se, digits=3) -> str:
    if not isinstance(x, (int, float)):
        return "–"
    return f"{x:.{digits}f}" + (f" ± {se:.{digits}f}" if isinstance(se, (int, float)) and math.isfinite(se) else "")


def _count(n) -> str:
    return f"{n / 1e6:.2f}M" if isinstance(n, (int, float)) and n >= 1e5 else f"{n:,}" if isinstance(n, int) else "–"


def _effect(r: dict, m: str) -> str:
    """A method's paired change of the last tenth, with its test CE in brackets."""
    e = r["effects"].get(m)
    return f"{_pm(e['tail_diff_nats'], e['tail_diff_stderr_nats'])} ({e['test_ce_nats']:.4f})" if e else "–"


def scale_table(rows: list[dict]) -> str:
    """One line per run: its training seed, size, tokens, test CE, the last tenth, the gap, and each fitted method's
    paired change of the last tenth with its test CE (on the stages' scored test tokens, beside the plain model's
    there)."""
    lines = ["| model | seed | parameters | training tokens (distinct) | test CE | last tenth | gap | T* (test CE) | "
             "calibration (test CE) | plain (test CE) | wall |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        eff = r["effects"]
        wall = f"{r['wall_seconds'] / 60:.1f} min" if r.get("wall_seconds") else "–"
        distinct = f" ({_count(r['data_tokens'])})" if r.get("data_tokens") else ""
        seed = r.get("train_seed")
        lines.append(f"| {r['model']} | {'–' if seed is None else seed} | {_count(r['params'])} | "
                     f"{_count(r['train_tokens'])}{distinct} | "
                     f"{_pm(r['test_ce_nats'], r.get('test_ce_stderr_nats'), 4)} | "
                     f"{_pm(r['tail_nats'], r['tail_stderr_nats'])} | {_pm(r['gap_nats'], r['gap_stderr_nats'])} | "
                     f"{_effect(r, 'fitted_temperature')} | {_effect(r, 'calibration')} | "
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
        "bootstrap_replicates": n_boot, "min_df": MIN_DF,
        "reference": {"paper": paper.CVL, "text_exponent": paper.CVL_TEXT_EXPONENT},
        "written_at": time.strftime("%Y-%m-%d %H:%M %Z"),
    }


def _y(f: dict) -> str:
    return "gap" if f.get("sign", 1.0) > 0 else "-gap"


def _quantity(f: dict) -> str:
    """What a fit is of: the gap, or (every gap of the group negative) the entropy deficit -gap."""
    return "the gap" if f.get("sign", 1.0) > 0 else "the entropy deficit (-gap; every run's gap is negative)"




# ---------------------------------------------------------------------------------------------------------------------
# REPORT.md: a setup table, then each group's runs, fits and trends as tables
# ---------------------------------------------------------------------------------------------------------------------

FIT_HEADER = ["| fit | b | t-interval | df | runs (cells) | bootstrap cross-check (failed of replicates) | "
              "CVL's exponent | trend shown by the t-interval | against CVL's |",
              "|---|---|---|---|---|---|---|---|---|"]
TREND_HEADER = [f"| method | slope (nats per unit of log test CE) | ± se | runs | df | trend shown at {Z:g} se |",
                "|---|---|---|---|---|---|"]
AGAINST = {"consistent": "consistent (inside the interval)", "faster": "falls faster (CVL's above the interval)",
           "slower": "falls more slowly (CVL's below the interval)"}


def _hours(seconds) -> str:
    return f"{seconds / 3600:.2f} h" if seconds else "not recorded"


def setup_markdown(report: dict, groups: list[tuple[dict, list[dict]]]) -> list[str]:
    """How every run was measured, from its records, as a setting | value table, and the notes beneath it."""
    rows = [r for _, v in groups for r in v]
    gens = sorted({(r["num_prefixes"], r["samples_per_prefix"], r["prefix_len"], r["horizon"]) for r in rows})
    levels = sorted({f["level"] for g, _ in groups for f in g["fits"].values() if "level" in f})
    pct = ", ".join(f"{100 * x:g}%" for x in levels) or "–"
    earlier = any("interval" not in f for g, _ in groups for f in g["fits"].values())  # an earlier report's fits
    table = [
        ("runs", f"{len(rows)} in {len(groups)} group(s)" + _cells(groups)),
        ("prefixes", "; ".join(f"{n} validation points × {p} tokens" for n, _, p, _ in gens)),
        ("generations", "; ".join(f"{generations({'num_prefixes': n, 'samples_per_prefix': s})}, {h} tokens each"
                                  for n, s, _, h in gens)),
        ("gap", f"mean next-token entropy over the last tenth of the horizon − test CE (nats per {rows[0]['unit']})"),
        ("gap's standard error", "the last tenth's, clustered by validation point, with the test CE's, from blocks "
                                 "of 100 consecutive test tokens"),
        ("T* and calibration", "paired with the plain model (the same points and uniforms); each sampled from, and "
                               "scored as, the fitted model"),
        ("exponents", "least squares of log gap on log x over every run, each seed a run (CVL's fit); and the signed "
                      "gap's trend, gap = a + b log x, over every run whatever its sign"),
        ("intervals", f"{pct} percentile bootstrap over the runs of positive gap and their validation points, by an "
                      "earlier report that recorded no t-intervals; df = runs − coefficients" if earlier else
                      f"{pct} t-intervals on df = runs − coefficients; a percentile bootstrap over the runs and "
                      "their validation points (its test CE redrawn within its standard error) as a cross-check"),
        ("fewest df", f"{MIN_DF}: a fit with fewer is not fitted, and its verdict undecided"),
        ("trend slopes", "weighted by each run's standard error; the error widened by the runs' scatter where larger"),
        ("the sweep's wall time", f"{_hours(report['wall_seconds'])}, the sum of its runs' ({report['runs_timed']} "
                                  "timed: training and analysis)"),
    ]
    if report.get("pipeline_wall_seconds"):
        table.append(("the pipeline's wall time", f"{_hours(report['pipeline_wall_seconds'])}, from its first run's "
                                                  "start to its last run's end"))
    notes = ["Each run samples its generations from the model itself and scores that model on the test text.",
             "So the law that generates is the law that is scored.",
             f"{paper.CVL} average the whole generation; the gap here takes its last tenth, where the drift has "
             "happened.", *SIGN_NOTES[earlier], *_reference_notes(groups)]
    if report.get("pipeline_wall_seconds"):
        notes.append("Runs that were done before and skipped count in the pipeline's time as they ran then.")
    return ["## Setup", "", "| setting | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in table), "",
            *notes, "", *TABLE_NOTES, ""]


SIGN_NOTES = {
    False: ["No run is left out for the sign of its gap: a run with gap <= 0 has no logarithm, and leaving it out "
            "would select the runs on the outcome.",
            "So a power law is fitted only where every run's gap is positive; otherwise its row says which runs it "
            "cannot take.",
            "The signed trend, gap = a + b log x, takes every run; b is in nats per unit of log x."],
    True: ["The fits here are an earlier report's: they left out runs whose gap was <= 0, and had no t-intervals.",
           "A fit that left runs out, or had df < 2, is shown as not fitted; rerun the report on its runs for "
           "t-intervals and the signed trends."],
}


def _cells(groups: list[tuple[dict, list[dict]]]) -> str:
    """'; 9 cells, 3 seeds each' where the groups know their cells (an earlier report's do not)."""
    gs = [g for g, _ in groups if "cells" in g]
    if not gs:
        return ""
    lo, hi = min(g["seeds_per_cell"][0] for g in gs), max(g["seeds_per_cell"][1] for g in gs)
    return f"; {sum(g['cells'] for g in gs)} cells, {lo if lo == hi else f'{lo}-{hi}'} seed(s) each"


TABLE_NOTES = ["In the runs tables, entropies and cross-entropies are in nats; ± is one standard error.",
               "T* and calibration give the paired change of the last tenth against the plain model.",
               "Beside it, in brackets: its test CE on the stages' scored test tokens (plain: the model's own there).",
               "A trend grows when the change becomes more negative as the models strengthen (lower test CE).",
               "It shrinks when the change becomes less negative."]


def _reference_notes(groups: list[tuple[dict, list[dict]]]) -> list[str]:
    """What each kind of reference exponent in the fits tables is."""
    kinds = {g.get("tail_exponent") is None for g, _ in groups
             if any(f.get("reference") is not None for f in g["fits"].values())}  # True: text, False: the power law
    text = [f"CVL's exponent for text is their fit ({paper.CVL_SIZES})."]
    power = ["For the power-law source it is the exponent their simplified setting predicts for s: -(1 - 1/s).",
             "That is our reading of it: the missing mass of the law."]
    return [*(text if True in kinds else []), *(power if False in kinds else [])]


def _reference(g: dict, f: dict) -> str:
    if f.get("reference") is None:
        return "–"
    s = g.get("tail_exponent")
    return f"{f['reference']:+.3f} " + (f"(predicted for s = {s:g})" if s is not None else "(fit for text)")


def _law(f: dict, signed: bool = False) -> str:
    """'gap ~ parameters^b' or 'gap = a + b log parameters' (joint fits: b_<axis> each)."""
    one = len(f["axes"]) == 1
    name = {a: "b" if one else f"b_{a}" for a in f["axes"]}
    if signed:
        return f"{_y(f)} = a + " + " + ".join(f"{name[a]} log {AXES[a]}" for a in f["axes"])
    return f"{_y(f)} ~ " + " x ".join(f"{AXES[a]}^{name[a]}" for a in f["axes"])


def _values(f: dict, coef: dict, ci: dict | None, digits: int = 3) -> tuple[str, str]:
    """The coefficient(s) and their interval(s) as cells; '–' for no interval."""
    one, d = len(f["axes"]) == 1, f"+.{digits}f"
    b = "; ".join(f"{'' if one else f'b_{a} = '}{coef[a]:{d}}" for a in f["axes"])
    return b, "; ".join(f"[{ci[a][0]:{d}}, {ci[a][1]:{d}}]" for a in f["axes"]) if ci else "–"


def _runs(f: dict) -> str:
    return f"{f.get('n_runs', '–')}" + (f" ({f['cells']})" if "cells" in f else "")


def fit_row(g: dict, f: dict) -> str:
    """One power law of a group as a row: law, exponent(s), t-interval(s), df, runs (cells), the bootstrap's
    interval(s), CVL's exponent, and the claim's verdicts (a joint fit states none; one not fitted: undecided)."""
    f = current(f)
    c = fit_claim(g["label"], f)
    verdict = shown(c.verdict, {"falls", "rises"}) if c else "–"
    df = f.get("df", "–")
    if "error" in f:
        return (f"| {_law(f)} | not fitted ({f['error']}) | – | {df} | {_runs(f)} | – | {_reference(g, f)} | "
                f"{verdict} | – |")
    t = f.get("interval", "t") == "t"
    b, ci = _values(f, f["exponents"], f["ci"] if t else None)
    boot = f.get("bootstrap_ci") or {}
    cross = (f"{_values(f, f['exponents'], boot)[1]} ({f['failed_replicates']} of "
             f"{f['replicates'] + f['failed_replicates']})" if boot and "replicates" in f else "–")
    against = AGAINST.get(c.numbers.get("against_ref"), "–") if c else "–"
    return (f"| {_law(f)} | {b} | {ci} | {df} | {_runs(f)} | {cross} | {_reference(g, f)} | {verdict} | "
            f"{against} |")


def signed_row(g: dict, f: dict) -> str | None:
    """The signed trend beside a power law as a row (every run, whatever its sign); None for an earlier report's."""
    s = f.get("signed")
    if s is None:
        return None
    c = signed_claim(g["label"], f)
    verdict = shown(c.verdict, {"falls", "rises"}) if c else "–"
    runs = _runs({**f, "n_runs": s["n_runs"]})
    if "error" in s:
        return f"| {_law(f, True)} | not fitted ({s['error']}) | – | {s['df']} | {runs} | – | – | {verdict} | – |"
    b, ci = _values(f, s["slopes"], s["ci"], 4)  # nats per unit of log x: a few hundredths
    return f"| {_law(f, True)} | {b} | {ci} | {s['df']} | {runs} | – | – | {verdict} | – |"


def trend_row(g: dict, m: str, t: dict) -> str:
    """One method's trend with the models' strength as a row, with the claim's verdict."""
    if t.get("error"):  # the runs' test CEs span too little (the fits' rule)
        return f"| {METHODS[m]} | not fitted ({t['error']}) | – | {t['runs']} | {t.get('df', t['runs'] - 2)} | " \
               "undecided (untested) |"
    slope = format(t["slope"], "+.3f") if finite(t["slope"]) else "–"
    se = format(t["stderr"], ".3f") if finite(t["stderr"]) else "–"
    return (f"| {METHODS[m]} | {slope} | {se} | {t['runs']} | {t.get('df', t['runs'] - 2)} | "
            f"{shown(trend_claim(g['label'], m, t).verdict, {'grows', 'shrinks'})} |")


def group_markdown(g: dict, runs: list[dict]) -> list[str]:
    """A group's section: its runs table, its fits table and its trends table."""
    lines = [f"## {g['label']}", "", scale_table(runs)]
    if g["runs"] < 2:
        return [*lines, "One run: nothing to fit.", ""]
    if g["fits"]:
        rows = [r for f in g["fits"].values() for r in (fit_row(g, f), signed_row(g, f)) if r]
        earlier = any("interval" not in f for f in g["fits"].values())  # its verdicts are its bootstrap's
        head = FIT_HEADER[0].replace("shown by the t-interval", "shown by the bootstrap interval") if earlier \
            else FIT_HEADER[0]
        lines += [head, FIT_HEADER[1], *rows, ""]
        if any(f.get("sign", 1.0) < 0 for f in g["fits"].values()):
            lines += ["Every run's gap here is negative, so the fits are of the entropy deficit, -gap.", ""]
    if g["trends"]:
        lines += [*TREND_HEADER, *(trend_row(g, m, t) for m, t in g["trends"].items()), ""]
    return lines


def report_markdown(report: dict, groups: list[tuple[dict, list[dict]]], figure: str) -> str:
    """REPORT.md of the sweep: its provenance, the setup table, the figure, then each group's tables."""
    lines = ["# Entropy miscalibration against scale", "", provenance_line(report["provenance"]), "",
             *setup_markdown(report, groups),
             f"![gap against parameters, training tokens and test CE]({figure})", ""]
    for g, v in groups:
        lines += group_markdown(g, v)
    return "\n".join(lines).rstrip() + "\n"
