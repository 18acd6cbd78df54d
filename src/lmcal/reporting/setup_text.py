"""What each REPORT.md section ran on, in one sentence from the stage's own settings (its json), and how that departs
from the paper: model, generations and prefixes, horizon, ε, fit and score tokens; the τ-models' training; and why
the same model shows two EntRates. Pure functions: settings in, sentences out; a setting a result does not record
is left out of the sentence, never guessed.
"""

from __future__ import annotations

import math

from lmcal import paper


def generations(s: dict) -> str | None:
    """'300 generations (100 validation prefixes of 100 words, 3 each)', or from num_generations alone; None."""
    n, k = s.get("num_prefixes"), s.get("samples_per_prefix")
    if n and k:
        length = f" of {s['prefix_len']} words" if s.get("prefix_len") else ""
        return f"{n * k} generations ({n} validation prefixes{length}, {k} each)"
    return f"{s['num_generations']} generations" if s.get("num_generations") else None


def horizon(s: dict) -> str | None:
    """'horizon 200 words (the paper: 700; ...why)', or None where the setting is not recorded."""
    h = s.get("horizon")
    if not h:
        return None
    if h == paper.HORIZON:
        return f"horizon {h} words"
    return f"horizon {h} words (the paper: {paper.HORIZON}" + (
        "; shorter here because every method generates the whole horizon for each generation, so this stage's time "
        "grows with it, and the profile keeps to its time budget)" if h < paper.HORIZON else ")")


def setup_sentence(what: str, model: str, s: dict, extra: list[str] | None = None) -> str:
    """'Setup (what): model; generations; horizon; ε; fit and score tokens; seed; extra.' from a stage's settings."""
    parts = [model, generations(s), horizon(s)]
    eps = s.get("epsilon", s.get("uniform_weight"))
    if eps is not None:
        parts.append(f"ε = {eps:g}" + (" (no uniform mixture: the paper mixes ε of the uniform distribution into P̂)"
                                       if eps == 0 else " (the uniform weight mixed into P̂ before calibrating)"))
    if s.get("fit_tokens"):
        parts.append(f"fitted on {s['fit_tokens']:,} validation positions")
    if s.get("test_tokens"):
        parts.append(f"scored on {s['test_tokens']:,} test tokens")
    if s.get("seed") is not None:
        parts.append(f"seed {s['seed']}")
    return f"Setup ({what}): " + "; ".join(p for p in [*parts, *(extra or [])] if p) + "."


def topk_departure(s: dict) -> str | None:
    """The law's candidate rule, where it is not exact lookahead (lmcal.core.lookahead_law), and that the law is one
    for the fit, the test CE and generation."""
    rule = s.get("rule") or (f"top-{s['topk']}" if s.get("topk") else None)
    if not rule or rule == "exact":
        return ("exact lookahead (every word its own tilt, as the paper's), one law for the fit, the test CE and "
                "generation") if rule == "exact" else None
    own = (f"the top {s['topk']} words" if s.get("topk") else
           f"the fewest most likely words holding {s.get('cover'):g} of the mass" if s.get("cover") else rule)
    if "rule" not in s:  # a result from before issue 40: its fit gave the true word its own tilt
        return (f"per-token top-{s['topk']} mixture: in generation only the top {s['topk']} words get their own tilt "
                f"and the rest share one estimated from {s.get('tail_samples')} drawn words, while in the fit the true "
                "word has its own too; the paper tilts every word exactly")
    return (f"one {rule} law for the fit, the test CE and generation: {own} get their own tilt and the rest share "
            f"one estimated from {s.get('tail_samples')} drawn words (a true word among the rest shares it in the fit "
            "too); the paper tilts every word exactly")


def paired_conditional(what: str) -> str:
    """The paired differences' standard errors leave the fit's own variance out: say so."""
    return (f"Paired differences are conditional on the fitted {what}: their standard errors (clustered by prefix) "
            "count the generations' noise, not that of refitting on other fit text.")


def tau_models_sentence(warm_start: bool, overrides: list[str] | None) -> str:
    """How the trained τ-models were made beside the paper's (trained from scratch)."""
    how = f" with `{' '.join(overrides)}`" if overrides else ""
    if warm_start:
        return (f"The trained τ-models are warm-started from the base model and trained{how}; the paper trains them "
                "from scratch. Where a τ-model predicts worse than the base model on windows (its CE(P‖P̃) above the "
                "window row's), its bound is the looser one.")
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
    gens = lambda g: f"{g} generations, " if g else ""
    return (f"The uncalibrated model's EntRate here ({e1:.1f} ± {e1 * se1:.1f}: {gens(g1)}horizon {h1}) is not Table "
            f"1's ({e0:.1f} ± {e0 * se0:.1f}: {gens(g0)}horizon {h0}): EntRate is the entropy at the last step, which "
            "rises with the horizon, from other generations; each is one step's entropy, with the standard error "
            "beside it (± exp(level) × se).")


def tail_level_sentence(label: str, level_nats: float, se_nats: float) -> str:
    """An absolute tail level with its standard error, in nats and perplexity points."""
    ppl = math.exp(level_nats)
    return f"{label}: {level_nats:.3f} ± {se_nats:.3f} nats, exp {ppl:.1f} ± {ppl * se_nats:.1f}"


# ---------------------------------------------------------------------------------------------------------------------
# Each REPORT.md section's setup, from results.json and the stage's own json
# ---------------------------------------------------------------------------------------------------------------------


def entropy_rate_lines(r: dict) -> list[str]:
    """Table 1's setup and the absolute tail level with its standard error (clustered by prefix)."""
    er = r["entropy_rate"]
    lines = [setup_sentence("Table 1", r["base"]["model"], er)]
    if "tail_nats" in er:
        lines[0] += " " + tail_level_sentence("Mean entropy over the last tenth", er["tail_nats"],
                                              er["tail_stderr_nats"]) + " (± one standard error, clustered by prefix)."
    return [*lines, ""]


def calibration_lines(r: dict) -> list[str]:
    """The calibration section's setup, its departures, the absolute tail levels and why its EntRate is not Table
    1's."""
    cal = r["calibration"]
    lines = [setup_sentence("calibration", r["base"]["model"], cal, [topk_departure(cal)])]
    if "tail_nats" in cal:
        lines.append(tail_level_sentence("Mean entropy over the last tenth, uncalibrated", cal["tail_nats_before"],
                                         cal["tail_stderr_nats_before"]) + "; "
                     + tail_level_sentence("calibrated", cal["tail_nats"], cal["tail_stderr_nats"])
                     + " (± one standard error, clustered by prefix).")
    if (cal.get("topk") or cal.get("cover")) and "mass_outside_topk" in cal:
        where = f"the top {cal['topk']}" if cal.get("topk") else f"the {cal.get('rule', 'covering')} candidates"
        size = (f"{cal['candidates_mean']:,.1f} per position on average; " if cal.get("cover")
                and cal.get("candidates_mean") else "")
        lines.append(f"Outside {where} ({size}over {cal['coverage_positions']:,} test positions): the "
                     "calibrated model gives those words, which share one estimated tilt, "
                     f"{cal['mass_outside_topk']:.3f} of its mass on average, and "
                     f"{100 * cal['true_word_outside_topk']:.1f}% of the true next words are among them.")
    note = entrate_note(r["entropy_rate"], cal)
    return [line for x in (*lines, note, paired_conditional("α*")) if x for line in (x, "")]


def decoders_lines(r: dict) -> list[str]:
    """The decoders section's setup (its own settings, where results.json has them)."""
    s = r.get("decoders_setup")
    if not s:
        return []
    same = " (the calibration stage's generations and scores reused)" if s.get("calibration_reused") else ""
    return [setup_sentence("decoders", r["base"]["model"], s, [same.strip(" ()") if same else None]),
            "", paired_conditional("temperature and α*"), ""]


def future_entropy_lines(fe: dict) -> list[str]:
    """The future-entropy section's setup from future_entropy.json."""
    heads = (f"heads trained on {fe['rollouts']} rollouts of the training text" if fe.get("rollouts") else None)
    return [setup_sentence("future entropy", fe.get("model", "model"), fe, [heads]), "",
            paired_conditional("α, β and heads"), ""]


def memory_lines(warm_start: bool, overrides: list[str] | None, rows: list[dict]) -> list[str]:
    """The memory section's setup: the rows P̂ and P̃ are scored on, the τ-models' training, and where a bound's
    slack comes from."""
    n = {m.get("test_tokens") for m in rows} - {None}
    where = f" on the first {n.pop():,} test tokens" if len(n) == 1 else ""
    return [f"Setup (memory): α* fitted and the bound reported{where}, blocks of "
            f"{rows[0].get('cluster_size', '?'):,} positions as the units of every standard error. "
            + tau_models_sentence(warm_start, overrides), "", SLACK, ""]


SLACK = ("Why a bound is loose: at α = 0 the bound is I_τ plus the slack E KL(D_τ(·|Y) ‖ P̃(·|Y)), D_τ the model's "
         "own τ-marginal (its prediction averaged over the past beyond τ, given the last τ tokens Y). A P̃ that "
         "predicts worse than D_τ, as a model fed a short window from a zero state can, loosens the bound by that "
         "much; CE(P‖P̃) beside each row shows how well P̃ predicts.")
