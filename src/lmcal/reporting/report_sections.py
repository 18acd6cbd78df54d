"""REPORT.md's sections after its claims and setup tables, each from results.json (and, where the run's folder holds
them, the stages' own json): tables first, a few short notes under each."""

from __future__ import annotations

import math
from pathlib import Path

from lmcal import paper
from lmcal.core.expfit import no_minimum_label
from lmcal.reporting.calibration_limit import calibration_limit, law_name, law_rows, stage_rule
from lmcal.reporting.claim import shown
from lmcal.reporting.claims import effect_verdict, memory_flags
from lmcal.reporting.claims_table import flags_table
from lmcal.reporting.results import read_json, stage_record, tail_ppl
from lmcal.reporting.setup_text import tail_level
from lmcal.utils.numbers import exp_or_inf, format_ce, format_params


def table1_markdown(r: dict, profile: str) -> list[str]:
    """Table 1 beside the paper's rows, and Figure 2."""
    b, er, t = r["base"], r["entropy_rate"], r.get("transformer", {})
    lines = ["## Entropy rate of generations (Table 1, Figure 2)", "",
             "| model | corpus | test ppl | EntRate = exp(entropy at the last step) | exp(mean entropy, last tenth) |",
             "|---|---|---|---|---|",
             f"| {b['model']} ({profile}) | {r['dataset']} | {er['test_ppl']:.1f} | {er['entrate_ppl']:.1f} | "
             f"{er['entrate_tail_ppl']:.1f} |"]
    if "entropy_rate" in t:
        te = t["entropy_rate"]
        lines.append(f"| Transformer (ours, PTB): {t['base']['model']} | ptb | {te['test_ppl']:.1f} | "
                     f"{te['entrate_ppl']:.1f} | {tail_ppl(te['curve_nats']):.1f} |")
    lines += [f"| AWD-LSTM (paper) | ptb | {paper.AWD_LSTM_PTB['test_ppl']} | {paper.AWD_LSTM_PTB['entrate_ppl']} | |",
              f"| GPT-2 (paper) | WebText | {paper.GPT2['test_ppl']} | {paper.GPT2['entrate_ppl']} | |", ""]
    if "tail_nats" in er:
        lines += [f"Mean entropy over the last tenth: {tail_level(er['tail_nats'], er['tail_stderr_nats'])} nats.",
                  "± is one standard error, clustered by prefix, here and below.", ""]
    if "entropy_rate" in t:
        lines += [f"The transformer makes {t['entropy_rate']['num_generations']} generations of "
                  f"{t['entropy_rate']['horizon']} words, within its context.", ""]
    return [*lines, "![Figure 2](figure2_entropy_rate.png)", ""]


def calibration_markdown(r: dict) -> list[str]:
    """The calibration table (α*, test ppl, EntRate, the last tenth's level and paired change) and Figure 3."""
    cal = r["calibration"]
    before = tail_level(cal["tail_nats_before"], cal["tail_stderr_nats_before"]) if "tail_nats" in cal else "–"
    after = tail_level(cal["tail_nats"], cal["tail_stderr_nats"]) if "tail_nats" in cal else "–"
    lines = ["## Lookahead calibration (Algorithm 2, Figure 3)", "",
             "| | alpha* | test ppl | EntRate (last step) | last tenth, nats | Δ last tenth (nats, paired) |",
             "|---|---|---|---|---|---|",
             f"| uncalibrated | 0 | {cal['test_ppl_before']:.2f} | {cal['entrate_ppl_before']:.1f} | {before} | – |",
             f"| calibrated | {cal['alpha']:.4f} ± {cal['alpha_stderr']:.4f} | {cal['test_ppl_after']:.2f} | "
             f"{cal['entrate_ppl_after']:.1f} | {after} | {cal['tail_diff_nats']:+.4f} ± "
             f"{cal['tail_diff_stderr_nats']:.4f} |", "",
             f"The last tenth is the last {cal['tail_steps']} words, paired generation by generation.",
             f"α* is fitted on {cal['fit_tokens']:,} validation positions; test ppl is on {cal['test_tokens']:,} test "
             "tokens.", ""]
    if (cal.get("topk") or cal.get("cover")) and "mass_outside_topk" in cal:
        lines += [f"Outside the candidates (over {cal['coverage_positions']:,} test positions), the calibrated model "
                  f"puts {cal['mass_outside_topk']:.3f} of its mass, and {100 * cal['true_word_outside_topk']:.1f}% "
                  "of the true next words fall there.", ""]
    return [*lines, "![Figure 3](figure3_calibration.png)", "", *law_rows_markdown(cal),
            *calibration_limit_markdown(cal)]


def law_rows_markdown(cal: dict) -> list[str]:
    """Algorithm 2's law at its own α*, the headline first and each other rule beside it, with the sentence of the
    comparison fixed in advance that says why the effect is small (lmcal.reporting.calibration_limit): where the
    stage made a dose-response or an approximation table."""
    if not (cal.get("dose_response") or cal.get("approximation")):
        return []
    stage = stage_rule(cal)
    lines = ["### Algorithm 2's law at its own α*", "",
             "| rule | α | whose α* | generations | Δ last tenth vs model (nats, paired) | Δ test CE vs model (nats) | "
             "shown at 2 se |", "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(law_rows(cal)):
        ce, ce_se = r["test_ce_diff_nats"], r["test_ce_diff_stderr_nats"]
        ce_text = "–" if ce is None else f"{ce:+.4f}" + (f" ± {ce_se:.4f}" if ce_se is not None else " (no se)")
        who = law_name(r) + (", the headline" if i == 0 else "") + (", the stage's law" if r["stage"] else "")
        whose = "its own" if r["own"] else f"{stage}'s"
        lines.append(f"| {who} | {r['alpha']:.4f} | {whose} | "
                     f"{r['generations'] or '–'} | {r['tail_diff_nats']:+.3f} ± {r['tail_diff_stderr_nats']:.3f} | "
                     f"{ce_text} | {shown(effect_verdict(r['tail_diff_nats'], r['tail_diff_stderr_nats']))} |")
    return [*lines, "", "The headline is exact lookahead at its own α* where a run measured it, else the stage's law.",
            "Each other rule stands at its own α* where one was fitted, else at the stage's.",
            "Each Δ is paired with its own run's plain generations.", "", calibration_limit(cal).sentence, ""]


def calibration_limit_markdown(cal: dict) -> list[str]:
    """The approximation table and the dose-response beside Algorithm 2's law (lmcal.stages.dose_response)."""
    lines = []
    if cal.get("approximation") or cal.get("dose_response"):
        from lmcal.stages.dose_response import approximation_markdown, dose_markdown
    if cal.get("approximation"):
        ap = cal["approximation"]
        lines += ["### What each candidate rule keeps of exact lookahead", "", approximation_markdown(ap).rstrip("\n"),
                  "", f"Each shift is E_{{P_α}}[H_next] − E_P[H_next] in nats, at {ap['positions']} positions of the "
                  f"model's own generations, every H_next exact.",
                  "Kept: a rule's mean shift over exact's; lost: its shift minus exact's, paired by position.", ""]
    if cal.get("dose_response"):
        dr = cal["dose_response"]
        extra = dr.get("extra_rows") or []
        lines += ["### Dose-response", "", dose_markdown(dr, extra).rstrip("\n"), "",
                  "A dose-response: each law at multiples of α*, to see how its effect grows with α.",
                  "No verdict above is drawn from it: those are at α* alone.",
                  f"Each row is its own generating law at α = k α* (α* = {dr['alpha']:.4g}).",
                  f"Each has {dr['generations']} generations of {dr['horizon']} words, on the same prefixes and seeds.",
                  f"Δ is paired with the plain model's generations; the vs column with {dr['rules'][0]}'s at the same "
                  "α.", f"Test CE is the law's own on {dr['test_tokens']:,} test tokens; ms / word is a rough "
                  "wall-clock figure.",
                  *(["Rows marked with a device come from a separate run there, paired with its own plain "
                     "generations."] if extra else []),
                  *(f"{f['rule']}'s own α* ({f['device']}): {f['alpha']:.4g} ± {f['alpha_stderr']:.2g}."
                    for f in dr.get("extra_fits") or []),
                  "", "![dose-response](figure_dose_response.png)", ""]
    return lines


def decoders_markdown(rows: list[dict]) -> list[str]:
    """The decoders beside calibration, on the same model, prefixes and seeds."""
    lines = ["## Decoders beside calibration", "",
             "| method | parameters | exp(entropy) t=1 | EntRate (last step) | exp(mean entropy, last tenth) | "
             "Δ entropy, last tenth, vs model (nats, paired) | test CE (nats) | zero-prob. fraction | CE, ε-mixed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for d in rows:
        lines.append(f"| {d['method']} | {format_params(d['params'], drop=('stderr',))} | "
                     f"{exp_or_inf(d['entropy_t1_nats']):.1f} | {d['entrate_ppl']:.1f} | {d['entrate_tail_ppl']:.1f} | "
                     f"{d['tail_diff_nats']:+.3f} ± {d['tail_diff_stderr_nats']:.3f} | "
                     f"{format_ce(d['test_ce_nats'])} | {d['zero_prob_fraction']:.4f} | "
                     f"{format_ce(d['test_ce_mixed_nats'])} |")
    return [*lines, "", "Test CE is ∞ where a rule gives a test word probability 0.",
            "The ε-mixed CE mixes in ε = 1e-6 of the uniform distribution, so it is finite for all.",
            "Only the fitted rows (temperature, calibration) are chosen by held-out cross-entropy.", "",
            "![decoders](figure_decoders.png)", ""]


def goal_rows_markdown(rows: list[tuple[str, dict | None]]) -> list[str]:
    """The goal rows: each chosen on one seed's generations, then measured again on other prefixes and seeds (the
    number its claim reports), with what α*'s own standard error would move it by, where fitted."""
    rows = [(what, g) for what, g in rows if g and "tail_nats" in g]
    if not rows:
        return []
    lines = ["| goal row | chosen among | chosen on seed | measured on | exp H, last tenth | ± from α* (nats) | "
             "median exp H (share < 2 nats) | test ppl |", "|---|---|---|---|---|---|---|---|"]
    for what, g in rows:
        where = g.get("reported_on") or (f"{g['prefixes']} fresh prefixes" if g.get("prefixes") else "")
        spread = g.get("tail_alpha_stderr_nats")
        se = g.get("tail_ppl_stderr", g["tail_ppl"] * g["tail_stderr_nats"])
        label = g.get("label") or f"{g['method']} ({format_params(g.get('params') or {}, drop=('stderr',))})"
        lines.append(f"| {what}: {label} | {len(g.get('candidates') or []) or '–'} | {g['chosen_on_seed']} | "
                     f"{where}{', ' if where else ''}seed {g['reported_on_seed']} | "
                     f"{g['tail_ppl']:.1f} ± {se:.1f} | {'–' if spread is None else f'±{spread:.3f}'} | "
                     f"{_median_cell(g)} | " + (f"{g['test_ppl']:.1f} |" if g.get("test_ppl") else "– |"))
    return [*lines, "", "A goal row is chosen on one seed's generations, then measured again where it was not chosen.",
            ""]


def _median_cell(g: dict) -> str:
    """The median generation's last tenth as exp, and the share of generations below 2 nats: what the mean hides."""
    if g.get("tail_median_nats") is None:
        return "–"
    return f"{math.exp(g['tail_median_nats']):.1f} ({100 * g['tail_below_2_nats_share']:.1f}%)"


def future_entropy_markdown(r: dict, fe: dict | None) -> list[str]:
    """The future-entropy heads' table (from future_entropy.json `fe`, else results.json's rows) and their R²."""
    rows = (fe or {}).get("rows") or r.get("future_entropy")
    if not rows:
        return []
    from lmcal.stages.future_entropy import future_entropy_table, heads_fit_table

    ref = (fe or {}).get("reference_test_ce_nats", next((d["test_ce_nats"] for d in rows if d["method"] == "model"),
                                                        None))
    unfitted = (fe or {}).get("no_minimum_rows") or []
    fit = heads_fit_table(rows + unfitted, fe.get("unit", "word")) if fe else ""
    lines = ["## Calibrating against future entropy (beyond one-step lookahead)", "",
             future_entropy_table(rows, ref, unfitted).rstrip("\n"), "",
             *(["A head whose fit has no finite minimum has no calibrated model: nothing is generated from it, and "
                "no verdict is drawn."] if unfitted else []),
             "Heads on the frozen model's state predict each next word's discounted future entropy G_K.",
             "P ∝ P̂ exp(α g) and P̂^β exp(α g) are fitted by validation cross-entropy.",
             "Δ test CE is paired with the model word by word; × model is a row's time over the plain model's.", ""]
    if fe and fe.get("rollouts"):
        lines += [f"The heads learn from {fe['rollouts']} rollouts of the training text "
                  f"({fe['rollout_examples']:,} examples).", ""]
    if fit:
        lines += ["The heads' held-out R² on rollouts they did not learn from:", "", fit.rstrip("\n"), ""]
    best = (fe or {}).get("best_head") or r.get("future_entropy_best_head")
    ref_ppl = (fe or {}).get("reference_test_ppl") or (math.exp(ref) if ref is not None else None)
    lines += goal_rows_markdown([("closest head", best and {"test_ppl": ref_ppl, **best})])
    return [*lines, "![future entropy](figure_future_entropy.png)", ""]


def sequence_markdown(r: dict, sc: dict | None) -> list[str]:
    """Algorithm 1's rows (results.json's), and the stage's own tables where its json is at hand."""
    rows = r.get("sequence_calibration")
    if not rows:
        return []
    lines = ["## Algorithm 1: sequence-level calibration (SMC and soft-value heads)", "",
             "| method | params | exp H, last tenth | Δ last tenth vs model (nats) | test CE | Δ test CE vs model | "
             "ms / word | × model |", "|---|---|---|---|---|---|---|---|"]
    for d in rows:
        model = d["method"] == "model"
        se = f" ± {d['tail_ppl_stderr']:.1f}" if d.get("tail_ppl_stderr") is not None else ""
        tail = "–" if model else f"{d['tail_diff_nats']:+.3f} ± {d['tail_diff_stderr_nats']:.3f}"
        ce = ("–" if model or d.get("test_ce_diff_nats") is None else
              f"{d['test_ce_diff_nats']:+.4f} ± {d['test_ce_diff_stderr_nats']:.4f}")
        cells = [d.get("label") or d["method"], format_params(d["params"], drop=("stderr", "horizon_k", "discount")),
                 f"{d['tail_ppl']:.1f}{se}", tail, format_ce(d["test_ce_nats"]), ce,
                 "–" if d.get("ms_per_token") is None else f"{d['ms_per_token']:.3f}",
                 "–" if d.get("cost_ratio") is None else f"{d['cost_ratio']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "P̂_α(w_1..L) ∝ P̂(w_1..L)^(1+α), by SMC at each particle count, twisted or not, or soft-value heads.",
              "exp H, last tenth: each row's law's entropy per word there; Δ is paired with the model's generations.",
              "A row is Algorithm 1 only where its sampler is shown to converge.", ""]
    lines += goal_rows_markdown([("closest row", (sc or {}).get("goal") or r.get("sequence_calibration_goal")),
                                 ("fewest twisted particles", (sc or {}).get("twisted_check")
                                  or r.get("sequence_calibration_twisted_check"))])
    if sc:
        from lmcal.stages.sequence_table import sequence_table

        tables = [p for p in sequence_table(sc).split("\n\n") if p.startswith("|")][1:]
        lines += [t for p in tables for t in ("The convergence study (lmcal.stages.sequence_table):", "", p, "")]
    smc = any(d["method"] == "smc" for d in rows)
    return [*lines, "![sequence calibration: the entropy of the next word](figure_sequence_calibration.png)", "",
            *(["![Algorithm 1 by SMC: the surprisal of the words drawn](figure_sequence_calibration_surprisal.png)",
               ""] if smc else [])]


def memory_markdown(r: dict) -> list[str]:
    """The memory table of the AWD-LSTM (beside the paper's), its flags, and the transformer beside it."""
    from lmcal.stages.tables import memory_table

    lstm = [m | {"corpus": r["dataset"]} for m in r["memory"] if m.get("model") != "transformer"]
    lines = [mark_no_minimum(memory_table(lstm).split("\n\n")[0], lstm), "", *MEMORY_NOTES, *no_minimum_notes(lstm),
             "",
             f"![I_tau bound against tau](memory_{r['dataset']}.png)", "", *flags_table(memory_flags(lstm))]
    trans = [m for m in r["memory"] if m.get("model") == "transformer"]
    if not trans:
        return lines
    taus = sorted({m["tau"] for m in r["memory"]})
    lines += ["### The AWD-LSTM beside the transformer", "",
              "| tau | AWD-LSTM, trained P̃ | AWD-LSTM, window P̃ | transformer, window P̃ | paper (AWD-LSTM) |",
              "|---|---|---|---|---|"]
    for t in taus:
        p = paper.MEMORY_PTB.get(int(t))
        lines.append(f"| {t} | {_bound(lstm, t, 'trained')} | {_bound(lstm, t, 'window')} | "
                     f"{_bound(trans, t, 'window')} | {f'{p[1]:.4f}' if p else '–'} |")
    lines += ["", f"The transformer ({r['transformer']['base']['model']}) sees at most its context.",
              "Its bound is the information it draws from between τ and its context back.", "",
              "### The transformer's memory table", "",
              mark_no_minimum(memory_table([{**m, "corpus": "transformer"} for m in trans]).split("\n\n")[0], trans),
              *no_minimum_notes(trans), "",
              *flags_table(memory_flags(trans))]
    return lines


MEMORY_NOTES = ["Nats per token. P̃: trained = the τ-model; window = the base model fed only the last τ tokens.",
                "α* of P̂·P̃^α is fitted on the rows the bound is reported on, so the bound is KL(P̂_α*‖P̃) ≥ 0.",
                "± is a delete-one-block jackknife with α refitted; cross-fitted: α* fitted on half the blocks.",
                "ΔCE = CE(P‖P̃) − CE(P‖P̂). With temperature: P̂^β·P̃^α fitted jointly, beside β*."]


# The memory table's columns that need a fitted alpha*: the one-parameter fit's, then the two-parameter fit's; where a
# row's fit had no finite minimum the first says so and the others show dashes.
FITTED_COLUMNS = (("I_tau upper bound", "cross-fitted", "alpha*"), ("with temperature", "beta*, alpha*"))


def mark_no_minimum(table: str, rows: list[dict]) -> str:
    """The memory table (lmcal.stages.tables.memory_table of `rows`, its lines in their order) with the cells that need
    alpha* replaced, in each row whose fit had no finite minimum, by words that say so: no number, so no verdict."""
    lines = table.split("\n")
    head = [c.strip() for c in lines[0].strip().strip("|").split("|")]
    for i, m in enumerate(rows):
        parts = [(m, FITTED_COLUMNS[0]), (m.get("two_parameter_no_minimum"), FITTED_COLUMNS[1])]
        if not any((part or {}).get("no_finite_minimum") for part, _ in parts):
            continue
        cells = [c.strip() for c in lines[2 + i].strip().strip("|").split("|")]
        for part, cols in parts:
            if (part or {}).get("no_finite_minimum"):
                cells[head.index(cols[0])] = no_minimum_label(part, table=True)
                for c in cols[1:]:
                    cells[head.index(c)] = "–"
        lines[2 + i] = "| " + " | ".join(cells) + " |"
    return "\n".join(lines)


def no_minimum_notes(rows: list[dict]) -> list[str]:
    """A line per memory row whose one-parameter fit had no finite minimum: what stays valid at the edge it stopped
    on, labelled as such (mean KL(P̂_α‖P̃) there bounds the I_τ of that tilted model only; see
    lmcal.core.memory_summary._edge)."""
    out = []
    for m in rows:
        at = m.get("at_alpha_bound") if m.get("no_finite_minimum") else None
        if not at:
            continue
        se = f" ± {at['mi_stderr_nats']:.4f}" if at.get("mi_stderr_nats") is not None else ""
        out.append(f"τ = {m['tau']}, {m.get('limited', 'trained')} P̃: {no_minimum_label(m)}. At the edge α = "
                   f"{at['alpha']:+g}, not a minimum: mean KL(P̂_α‖P̃) = {at['mi_upper_bound_nats']:.4f}{se} nats, "
                   "an upper bound on I_τ of that tilted model only; no verdict is drawn from it.")
    return out


def _bound(rows: list[dict], tau: int, limited: str) -> str:
    """'bound ± se' of the memory row for (tau, limited), words where its fit had no finite minimum, or – where the
    reproduction has none."""
    m = next((m for m in rows if m["tau"] == tau and m.get("limited", "trained") == limited), None)
    if m and m.get("no_finite_minimum"):
        return no_minimum_label(m, table=True)
    return f"{m['mi_upper_bound_nats']:.4f} ± {m['mi_stderr_nats']:.4f}" if m else "–"


def _markov_cell(rows: list[dict], tau: int, limited: str) -> str:
    m = next((m for m in rows if m["tau"] == tau and m.get("limited", "trained") == limited), None)
    ce = f" (CE {m['ce_limited_nats']:.3f})" if m and m.get("ce_limited_nats") is not None else ""
    return _bound(rows, tau, limited) + ce


def markov_memory_markdown(mk: dict) -> list[str]:
    """The Markov source's entropy rates and memory table, each bound beside its P̃'s cross-entropy."""
    orc = mk["oracle"]
    return ["## The exact check: an order-k Markov source", "",
            "| entropy rate of the order-" + f"{mk['order']} source | nats |", "|---|---|",
            f"| exact | {mk['true_entropy_rate_nats']:.4f} |",
            f"| the trained LSTM's test CE | {mk['estimated_entropy_rate_nats']:.4f} ± "
            f"{mk['estimated_entropy_rate_stderr_nats']:.4f} |",
            f"| the exact oracles' | {orc['estimated_entropy_rate_nats']:.4f} ± "
            f"{orc['estimated_entropy_rate_stderr_nats']:.4f} |", "",
            "| tau | I_tau bound (CE of P̃), trained τ-LSTMs | the LSTM on τ-token windows | exact oracles | exact "
            "I_tau of the source |", "|---|---|---|---|---|",
            *[f"| {o['tau']} | {_markov_cell(mk['memory'], o['tau'], 'trained')} | "
              f"{_markov_cell(mk['memory'], o['tau'], 'window')} | {_markov_cell(orc['memory'], o['tau'], 'window')} | "
              f"{o['exact_mi_nats']:.4f} |" for o in orc["memory"]], "",
            "The oracles (P̂ the true conditional, P̃_τ the exact order-τ one) check the estimators.",
            "The LSTM rows add the slack E KL(D_τ ‖ P̃): loose where P̃ predicts worse than the exact conditional.",
            f"The LSTM's own excess cross-entropy over the source is "
            f"{mk['estimated_entropy_rate_nats'] - mk['true_entropy_rate_nats']:+.4f} nats.",
            "", "![Figure 4 on the Markov source](memory_markov.png)", ""]


def stage_folder(out: Path, name: str) -> str:
    """A link to a stage's run folder, from its record, or a dash where the snapshot keeps no records."""
    record = stage_record(out / "stages" / f"{name}.json", warn=False)
    if not record or "dir" not in record:  # (none, or one that is not whole)
        return "–"
    import os

    rel = os.path.relpath(record["dir"], out)
    return f"[{rel}]({rel})"


def future_and_sequence(r: dict, out: Path, dataset: str) -> list[str]:
    """The future-entropy and Algorithm 1 sections, with the stages' json where the run's folder holds them."""
    fe_path = out / dataset / "future_entropy" / "future_entropy.json"
    sc_path = out / dataset / "sequence_calibration" / "sequence_calibration.json"
    fe = read_json(fe_path) if fe_path.is_file() else None
    sc = read_json(sc_path) if sc_path.is_file() else None
    return [*future_entropy_markdown(r, fe), *sequence_markdown(r, sc)]
