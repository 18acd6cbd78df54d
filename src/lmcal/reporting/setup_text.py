"""What each REPORT.md section ran on, as a setup table from the stage's own settings (its json), and how that departs
from the paper, in short notes: model, prefixes, generations, horizon, law, fit and score tokens, seed; the τ-models'
training; and why the same model shows two EntRates. Pure functions: settings in, lines out; a setting a result does
not record is a dash, never guessed.
"""

from __future__ import annotations

import math

from lmcal import paper

SETUP_HEADER = ["| stage | model | prefixes | generations | horizon | law | fit / test tokens | seed |",
                "|---|---|---|---|---|---|---|---|"]


def prefixes(s: dict) -> str:
    """'100 × 100 words' (validation prefixes and their length), or a dash."""
    n = s.get("num_prefixes")
    return f"{n} × {s['prefix_len']} words" if n and s.get("prefix_len") else str(n) if n else "–"


def generations(s: dict) -> str:
    """'300 (3 each)', or from num_generations alone, or a dash."""
    n, k = s.get("num_prefixes"), s.get("samples_per_prefix")
    if n and k:
        return f"{n * k} ({k} each)"
    return str(s["num_generations"]) if s.get("num_generations") else "–"


def law(s: dict, default: str = "the model") -> str:
    """The generating law: its candidate rule (lmcal.core.lookahead_law) and ε where the stage records them."""
    rule = s.get("rule")
    parts = [default if not rule else "exact lookahead" if rule == "exact" else
             f"{rule}, shared tail tilt ({s.get('tail_samples')} draws)"]
    eps = s.get("epsilon", s.get("uniform_weight"))
    if eps is not None:
        parts.append(f"ε = {eps:g}")
    return ", ".join(parts)


def setup_row(stage: str, model: str, s: dict, how: str = "the model") -> str:
    """One stage's row of the setup table."""
    tokens = " / ".join(f"{s[k]:,}" if s.get(k) else "–" for k in ("fit_tokens", "test_tokens"))
    seed = s.get("seed")
    return (f"| {stage} | {model} | {prefixes(s)} | {generations(s)} | {s.get('horizon') or '–'} | {law(s, how)} | "
            f"{tokens} | {'–' if seed is None else seed} |")


def departures(s: dict) -> list[str]:
    """Short notes on how a stage's settings depart from the paper's (horizon, ε, candidate rule)."""
    notes = []
    h = s.get("horizon")
    if h and h < paper.HORIZON:
        notes.append(f"Horizon {h}, not the paper's {paper.HORIZON}: each method generates the whole horizon, so the "
                     "stage's time grows with it.")
    if s.get("epsilon", s.get("uniform_weight")) == 0:
        notes.append("ε = 0: no uniform mixture, where the paper mixes ε of the uniform distribution into P̂.")
    if s.get("rule") and s["rule"] != "exact":
        own = (f"the top {s['topk']} words" if s.get("topk") else
               f"the fewest words holding {s.get('cover'):g} of the mass" if s.get("cover") else s["rule"])
        notes.append(f"One {s['rule']} law fits, scores and generates: {own} get their own tilt, the rest share one. "
                     "The paper tilts every word exactly.")
    return notes


def paired_conditional(what: str) -> str:
    """The paired differences' standard errors leave the fit's own variance out: say so."""
    return (f"Paired differences are conditional on the fitted {what}: their standard errors count the generations' "
            "noise, not a refit's.")


def tau_models_sentence(warm_start: bool, overrides: list[str] | None) -> str:
    """How the trained τ-models were made beside the paper's (trained from scratch)."""
    how = f" with `{' '.join(overrides)}`" if overrides else ""
    if warm_start:
        return f"The τ-models are warm-started from the base model and trained{how}; the paper's start from scratch."
    return f"The trained τ-models are trained from scratch{how}, as in the paper."


def entrate_note(er: dict, cal: dict) -> str | None:
    """Why the same model's EntRate differs between Table 1 (the entropy_rate stage) and the calibration section's
    uncalibrated row, where their horizons or generations differ; None where they agree in both."""
    h0, h1 = er.get("horizon"), cal.get("horizon") or len(cal.get("curve_nats_before", [])) or None
    g0 = er.get("num_generations")
    g1 = (cal["num_prefixes"] * cal["samples_per_prefix"] if cal.get("num_prefixes") and cal.get("samples_per_prefix")
          else None)
    if h0 == h1 and g0 == g1:
        return None
    se0, se1 = er["stderr_nats"][-1], cal["stderr_nats_before"][-1]
    e0, e1 = er["entrate_ppl"], cal["entrate_ppl_before"]
    return (f"EntRate is the last step's entropy, which rises with the horizon: {e1:.1f} ± {e1 * se1:.1f} here "
            f"(horizon {h1}), {e0:.1f} ± {e0 * se0:.1f} in Table 1 (horizon {h0}).")


def tail_level(level_nats: float, se_nats: float) -> str:
    """An absolute tail level with its standard error, in nats and as exp of it."""
    ppl = math.exp(level_nats)
    return f"{level_nats:.3f} ± {se_nats:.3f} (exp {ppl:.1f} ± {ppl * se_nats:.1f})"


# ---------------------------------------------------------------------------------------------------------------------
# The report's setup table, from results.json and the stages' own json
# ---------------------------------------------------------------------------------------------------------------------


def setup_lines(r: dict, fe: dict | None = None) -> list[str]:
    """REPORT.md's setup table (Table 1, calibration, decoders, future entropy where `fe` has its settings) and the
    departures from the paper beneath it."""
    model = r["base"]["model"]
    cal = r["calibration"]
    rows = [setup_row("Table 1", model, r["entropy_rate"]), setup_row("calibration", model, cal)]
    dec = r.get("decoders_setup")
    if dec:
        rows.append(setup_row("decoders", model, dec, "each decoder" + (", calibration's reused" if
                                                                        dec.get("calibration_reused") else "")))
    if fe and fe.get("num_prefixes"):
        rows.append(setup_row("future entropy", fe.get("model", model), fe, "P̂ exp(α g), heads g"))
    notes = [*departures(cal), entrate_note(r["entropy_rate"], cal), paired_conditional("α*, T and heads")]
    return [*SETUP_HEADER, *rows, "", *(line for n in notes if n for line in (n, ""))]


def memory_lines(warm_start: bool, overrides: list[str] | None, rows: list[dict]) -> list[str]:
    """The memory section's setup: the rows P̂ and P̃ are scored on, the τ-models' training, and where a bound's
    slack comes from."""
    n = {m.get("test_tokens") for m in rows} - {None}
    where = f"the first {n.pop():,} test tokens" if len(n) == 1 else "–"
    return ["| setting | value |", "|---|---|", f"| α* fitted and bound reported on | {where} |",
            f"| standard error units | blocks of {rows[0].get('cluster_size', '?'):,} positions (jackknife) |", "",
            tau_models_sentence(warm_start, overrides), "", *SLACK, ""]


SLACK = ["The bound is I_τ plus a slack, E KL(D_τ ‖ P̃), with D_τ the model's own τ-marginal.",
         "A P̃ that predicts worse than D_τ loosens the bound by that much; CE(P‖P̃) shows how well P̃ predicts."]
