"""The claims table: each claim of the paper one row, claim | paper | lmcal | ± se | shown at 2 se | figure, from the
Claims of lmcal.reporting.claims (their verdicts decide the 'shown' column). REPORT.md opens with it and
docs/RESULTS.md gathers every run's rows into one."""

from __future__ import annotations

import math

from lmcal import paper
from lmcal.reporting.claim import Claim, finite, paper_calibration_nats, shown
from lmcal.reporting.claims import results_claims, within

HEADER = ["| claim | paper | lmcal | ± se | shown at 2 se | figure |", "|---|---|---|---|---|---|"]
FIGURES = {"calibration": "figure3_calibration.png", "limit": "figure_dose_response.png",
           "temperature": "figure_decoders.png", "head": "figure_future_entropy.png",
           "sequence": "figure_sequence_calibration.png", "memory": "memory_ptb.png",
           "table1": "figure2_entropy_rate.png"}


def _f(x, spec: str, scale: float = 1.0) -> str:
    """x (times scale) in format spec, or a dash for a number not recorded."""
    return format(x * scale, spec) if finite(x) else "–"


def _fig(name: str, rel: str) -> str:
    f = FIGURES[name]
    return f"[{f.removesuffix('.png')}]({rel}{f})"


def claim_row(c: Claim, rel: str = "", test_tokens: int | None = None) -> tuple[str, ...] | None:
    """(claim, paper, lmcal, ± se, shown, figure) of one of a reproduction's claims, or None for a claim that is a flag
    rather than a claim of the paper (the memory flags: lmcal.reporting.claims_table.flags_table)."""
    n, p = c.numbers, f"{paper_calibration_nats():+.2f}"
    law = f" ({n['law']})" if n.get("law") else ""  # the law a calibration row's numbers come from
    if c.key in ("calibration_tail", "calibration_vs_paper"):
        what = "lowers the last tenth's entropy" if c.key == "calibration_tail" else "moves it by the paper's amount"
        row = f"Calibration {what} (nats)", p, _f(n["d"], "+.3f") + law, _f(n["se"], ".3f"), "calibration"
    elif c.key == "calibration_drift":
        row = ("Calibration flattens the drift (change of the rise, nats)", "flattens",
               _f(n["reduction"], "+.3f") + law, _f(n["reduction_se"], ".3f"), "calibration")
    elif c.key == "calibration_limit" and n["rule"] == "exact":  # the stage's law is exact: the model test alone
        row = ("The candidate rule, not the model, limits calibration (exact lookahead at its own α* against the "
               "model, last tenth, nats)", "exact", _f(n["exact_d"], "+.3f"), _f(n["exact_se"], ".3f"), "limit")
    elif c.key == "calibration_limit":
        row = (f"The candidate rule, not the model, limits calibration (exact minus {n['rule']} on the last tenth at "
               "exact's own α*, paired, nats)", "exact", _f(n["d"], "+.3f"), _f(n["se"], ".3f"), "limit")
    elif c.key == "calibration_vs_temperature":
        row = ("Calibration beats the fitted temperature (difference, nats)", "–",
               _f(n["d"] - n["d_t"], "+.3f") + law, _f(n["se"] + n["se_t"], ".3f") + " (se + se)", "temperature")
    elif c.key == "heads_vs_temperature":
        row = ("A future-entropy head beats the fitted temperature (heads that do)", "–",
               f"{n['more']} of {n['heads']}", "–", "head")
    elif c.key.endswith("_within"):
        who = {"best_head_within": "The best future-entropy head", "sequence_goal_within": "Algorithm 1's goal row",
               "sequence_twisted_within": "Algorithm 1, fewest twisted particles"}[c.key]
        level = math.exp(n["level_nats"])
        on = f" (on {test_tokens:,} test tokens)" if test_tokens else ""  # the stages' test stream, not the whole set
        row = (f"{who}: last tenth within 10% of the test perplexity {_f(n['ref_ppl'], '.1f')}{on}",
               "equal (Algorithm 1)" if c.key.startswith("sequence") else "–", _f(level, ".1f"),
               _f(n["se"], ".1f", level), "sequence" if c.key.startswith("sequence") else "head")
    else:
        return None
    return (*row[:4], shown(c.verdict), _fig(row[4], rel))


def claim_rows(r: dict, rel: str = "") -> list[tuple[str, ...]]:
    """The claims table's rows of one reproduction's results.json (figures linked under `rel`): Table 1's level, each
    claim of lmcal.reporting.claims, the memory bounds beside the paper's, and the scale sweep's exponents."""
    rows = []
    e = r.get("entropy_rate") or {}
    if "tail_stderr_nats" in e:
        c = within("", e["tail_nats"], e["tail_stderr_nats"], e["test_ppl"])
        level = math.exp(e["tail_nats"])
        rows.append(("Generations' entropy rate within 10% of the test perplexity (Table 1; the whole test set)",
                     f"{paper.AWD_LSTM_PTB['entrate_ppl']} vs {paper.AWD_LSTM_PTB['test_ppl']}",
                     f"{_f(level, '.1f')} vs {_f(e['test_ppl'], '.1f')}", _f(e["tail_stderr_nats"], ".1f", level),
                     shown(c.verdict), _fig("table1", rel)))
    tokens = (r.get("calibration") or {}).get("test_tokens")  # the stages' test stream (each stage scores the same)
    rows += [row for c in results_claims(r) if (row := claim_row(c, rel, tokens))]
    for m in r.get("memory", []):
        if m.get("model", "awd_lstm") == "awd_lstm" and m.get("limited") == "trained" and m["tau"] in paper.MEMORY_PTB:
            rows.append((f"Memory bound I_τ, τ = {m['tau']} (nats)", f"{paper.MEMORY_PTB[m['tau']][1]:.4f}",
                         _f(m["mi_upper_bound_nats"], ".4f"), _f(m.get("mi_stderr_nats"), ".4f"),
                         "– (no paper se)", _fig("memory", rel)))
    for g in r.get("groups", []):
        rows += [row for f in g["fits"].values() if (row := scale_row(g["label"], f, rel))]
    return rows


def scale_row(label: str, fit: dict, rel: str = "") -> tuple[str, ...] | None:
    """The claims table's row of one scale fit (lmcal.reporting.scale_text.fit_claim) with a reference exponent, or
    None (a joint fit, or none to compare with). A fit that was not fitted shows dashes and its reason."""
    from lmcal.reporting.scale_text import current, fit_claim

    fit = current(fit)  # an earlier report's fit as this code reads it: its df, and why it is not fitted
    c = fit_claim(label, fit)
    if c is None or "ref" not in c.numbers:
        return None
    n, axis = c.numbers, c.key.removeprefix("scale_exponent_")
    y = "gap" if fit.get("sign", 1.0) > 0 else "-gap"
    if finite(n["lo"]) and finite(n["hi"]):
        kind = f"t, {n['df']} df" if n["interval"] == "t" else "bootstrap"
        interval = f"[{n['lo']:+.3f}, {n['hi']:+.3f}] ({100 * fit.get('level', 0.95):g}% {kind})"
    else:
        interval = "–"
    if fit.get("error"):  # a table cell: its reason without the column separator
        verdict = f"undecided (not fitted: {fit['error'].replace('|', '/')})"
    else:
        verdict = f"{shown(c.verdict, {'falls', 'rises'})}; against CVL's: {n.get('against_ref', 'untested')}"
    return (f"{label}: {y} ~ {axis}^b", f"{n['ref']:+.3f} (CVL)", _f(n["b"], "+.3f"), interval, verdict,
            f"[scale]({rel}scale.png)")


def claims_table(rows: list[tuple[str, ...]], where: str = "") -> list[str]:
    """The claims table's Markdown lines; `where` prefixes each claim (RESULTS.md: the run it comes from)."""
    return [*HEADER, *(f"| {where}{' | '.join(row)} |" for row in rows)]


def flags_table(claims: list[Claim]) -> list[str]:
    """The memory flags (lmcal.reporting.claims.memory_flags) as a table: model, τ, P̃, what is flagged, the numbers."""
    if not claims:
        return []
    what = {"negative": "ΔCE < 0 beyond 2 se", "negative_not_shown": "ΔCE < 0, within 2 se",
            "far": "β* more than 0.2 from 1"}
    lines = ["| model | τ | P̃ | flag | numbers |", "|---|---|---|---|---|"]
    for c in claims:
        n = c.numbers
        nums = (f"β* = {n['beta']:.3f}, α* = {n['alpha']:.3f}" if "beta" in n
                else f"ΔCE = {n['d']:+.4f} ± {n['se']:.4f}")
        lines.append(f"| {n['model'] or 'awd_lstm'} | {n['tau']} | {n['limited'] or 'trained'} | {what[c.verdict]} | "
                     f"{nums} |")
    return [*lines, ""]
