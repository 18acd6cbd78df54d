"""REPORT.md of a reproduction, its figures, and the W&B report run: every table beside the paper's values
(lmcal.paper), each stage's wall time, and where each analysis stage's time went.
"""

from __future__ import annotations

import math
import os
import shlex
import sys
from pathlib import Path

from omegaconf import DictConfig

from lmcal import paper
from lmcal.reporting.claims import (
    best_head_claims,
    calibration_claims,
    claims_markdown,
    heads_claims,
    memory_flags,
    sequence_goal_claims,
)
from lmcal.reporting.docs import provenance
from lmcal.reporting.results import OPERATIONS, PAPER_STAGES, collect_results
from lmcal.reporting.samples_md import calibration_samples_markdown
from lmcal.reporting.setup_text import (
    calibration_lines,
    decoders_lines,
    entropy_rate_lines,
    future_entropy_lines,
    memory_lines,
)
from lmcal.utils.device import precision_policy
from lmcal.utils.io import copy_atomic, read_json, write_json_atomic, write_text_atomic
from lmcal.utils.numbers import exp_or_inf, format_ce, format_params


def profile_markdown(stages: dict, peak_flops: float) -> list[str]:
    """Where each analysis stage's time went, by operation, and the model forward's FLOP rate as a share of this
    machine's float32 matmul rate measured in the same run (MFU). Start-up: the process's time before and after the
    stage itself (imports, loading the model and the text, scoring its test CE)."""
    lines = ["| stage | seconds | start-up | " + " | ".join(OPERATIONS) + " | other | forward GFLOP/s | MFU |",
             "|---|---|---|" + "---|" * (len(OPERATIONS) + 3)]
    for name, s in stages.items():
        if "profile" not in s:
            continue
        p, total = s["profile"], max(s["seconds"], 1e-9)
        rate = s["forward_gflop"] / p["forward"] if p["forward"] > 0 and s["forward_gflop"] > 0 else None
        lines.append(f"| {name} | {s['seconds']:.0f} | {100 * (1 - s['analysis_seconds'] / total):.0f}% | "
                     + " | ".join(f"{100 * p[k] / total:.0f}%" for k in
                                                                       (*OPERATIONS, "other")) +
                     (f" | {rate:.1f} | {100 * rate * 1e9 / peak_flops:.0f}% |" if rate else " | – | – |"))
    return lines


def transformer_table1(r: dict) -> list[str]:
    """Table 1's transformer row, where the reproduction trained one."""
    t = r.get("transformer", {})
    if "entropy_rate" not in t:
        return []
    er = t["entropy_rate"]
    tail = exp_or_inf(sum(er["curve_nats"][-max(1, len(er["curve_nats"]) // 10):])
                      / max(1, len(er["curve_nats"]) // 10))
    return [f"| Transformer (ours, PTB): {t['base']['model']} | ptb | {er['test_ppl']:.1f} | {er['entrate_ppl']:.1f} | "
            f"{tail:.1f} |"]


def transformer_memory_markdown(r: dict) -> list[str]:
    """The bound at each tau for the AWD-LSTM (trained tau-models and windows) beside the transformer on windows, and
    the transformer's own full memory table."""
    rows = [m for m in r["memory"] if m.get("model") == "transformer"]
    if not rows:
        return []
    from lmcal.stages.tables import memory_table

    lstm = [m for m in r["memory"] if m.get("model") != "transformer"]
    taus = sorted({m["tau"] for m in r["memory"]})
    lines = ["### The AWD-LSTM beside the transformer", "",
             "| tau | AWD-LSTM, trained P̃ | AWD-LSTM, window P̃ | transformer, window P̃ | paper (AWD-LSTM) |",
             "|---|---|---|---|---|"]
    for t in taus:
        p = paper.MEMORY_PTB.get(int(t))
        lines.append(f"| {t} | {_bound(lstm, t, 'trained')} | {_bound(lstm, t, 'window')} | "
                     f"{_bound(rows, t, 'window')} | {f'{p[1]:.4f}' if p else '–'} |")
    full = r["transformer"]["base"]["model"]
    lines += ["", f"I_τ upper bounds in nats (± one standard error). The transformer ({full}) sees at most its "
              "context: its P̂ conditions on the tokens within it (see full_context in its memory.json), so its "
              "bound is the information it draws from between τ and its context back.", "",
              "### The transformer's memory table", "",
              memory_table([{**m, "corpus": "transformer"} for m in rows]), "",
              *claims_markdown(memory_flags(rows))]
    return lines


def report(cfg: DictConfig, out: Path, names: list[str]) -> None:
    """results.json, REPORT.md and the figures; `names`: the pipeline's stages, in order."""
    from lmcal.reporting.tabulate import memory_report
    from lmcal.stages.plots import entropy_curve_figure

    results = collect_results(cfg, out, names)
    results["stages"]["report"] = {"seconds": 0.0, "status": "done"}
    results["provenance"] = provenance("python -m lmcal.reproduce " + shlex.join(sys.argv[1:]))
    from lmcal.utils.profiling import matmul_flops

    results["provenance"]["matmul_gflop_per_s"] = matmul_flops(seconds=2.0) / 1e9  # the MFU's denominator
    results["provenance"]["precision"] = precision_policy()  # TF32 flags every stage ran with (lmcal.utils.device)
    import numpy as np

    er, cal, tr = results["entropy_rate"], results["calibration"], results.get("transformer", {})
    lstm = results["base"]["model"]
    curves = {f"{lstm}: generations": (np.array(er["curve_nats"]), np.array(er["stderr_nats"]))}
    refs = {f"{lstm}: test cross-entropy": math.log(results["base"]["test_ppl"])}
    if "entropy_rate" in tr:  # Table 1's second row, as Figure 2 shows it
        curves[f"{tr['base']['model']}: generations"] = (np.array(tr["entropy_rate"]["curve_nats"]),
                                                         np.array(tr["entropy_rate"]["stderr_nats"]))
        refs[f"{tr['base']['model']}: test cross-entropy"] = math.log(tr["entropy_rate"]["test_ppl"])
    p = paper.AWD_LSTM_PTB
    refs[f"paper, AWD-LSTM (500 epochs): EntRate {p['entrate_ppl']} at t = {paper.HORIZON}"] = math.log(
        p["entrate_ppl"])
    refs[f"paper, AWD-LSTM: test ppl {p['test_ppl']}"] = math.log(p["test_ppl"])
    entropy_curve_figure(curves, out / "figure2_entropy_rate.png", reference_nats=refs, legend_outside=True,
                         title=f"Entropy of generated words on {cfg.dataset} (Figure 2), beside the paper's AWD-LSTM")
    entropy_curve_figure({"uncalibrated": (np.array(cal["curve_nats_before"]), np.array(cal["stderr_nats_before"])),
                          f"calibrated (alpha* = {cal['alpha']:.3g})": (np.array(cal["curve_nats"]),
                                                                        np.array(cal["stderr_nats"]))},
                         out / "figure3_calibration.png",
                         reference_nats={"test cross-entropy": math.log(cal["test_ppl_before"])},
                         title="Lookahead calibration (Algorithm 2)",
                         difference={"label": "calibrated minus uncalibrated, paired",
                                     "mean": np.array(cal["diff_curve_nats"]),
                                     "stderr": np.array(cal["diff_stderr_nats"]), "tail": cal["tail_diff_nats"],
                                     "tail_stderr": cal["tail_diff_stderr_nats"], "tail_steps": cal["tail_steps"]})
    if cal.get("dose_response"):  # with the rows other runs added (results.calibration_dose)
        from lmcal.stages.dose_response import dose_figure

        dose_figure(cal["dose_response"], out / "figure_dose_response.png", cal["dose_response"].get("extra_rows"))
    copy_atomic(out / cfg.dataset / "decoders" / "decoders.png", out / "figure_decoders.png")
    if "future_entropy" in cfg.stages:
        copy_atomic(out / cfg.dataset / "future_entropy" / "future_entropy.png", out / "figure_future_entropy.png")
    if "sequence_calibration" in cfg.stages:
        copy_atomic(out / cfg.dataset / "sequence_calibration" / "sequence_calibration.png",
                    out / "figure_sequence_calibration.png")
    memory_report([out / cfg.dataset / "memory", out / "markov" / "memory"], out, wandb_mode="disabled",
                  oracles={"markov": results["markov"]["oracle"]["memory"]})
    write_json_atomic(out / "results.json", results)
    write_text_atomic(out / "REPORT.md", report_markdown(cfg, results, out))
    if cfg.logger == "wandb":
        from lmcal.reporting.report_wandb import log_report  # (W&B is imported only when it logs)

        log_report(cfg, results, out)


def _lookahead_words(cal: dict) -> str:
    """How the calibration's law tilts, in the alpha* sentence."""
    if "rule" not in cal:  # a result from before issue 40
        return (f"top-{cal['topk']} lookahead (the true word exact, {cal['tail_samples']} sampled words for the "
                "rest); " if cal["topk"] else "exact lookahead; ")
    if cal["rule"] == "exact":
        return "exact lookahead (the law that generates); "
    return (f"the {cal['rule']} law that generates ({cal.get('candidates_mean', 0):,.1f} candidates per position on "
            f"average, {cal['tail_samples']} sampled words for the rest's shared tilt); ")


def calibration_limit_markdown(cal: dict) -> list[str]:
    """The approximation table and the dose-response behind the calibration's verdict (lmcal.stages.dose_response),
    where the stage made them."""
    from lmcal.stages.dose_response import approximation_markdown, approximation_note, dose_markdown, dose_note

    lines = []
    if cal.get("approximation"):
        ap = cal["approximation"]
        lines += ["### What each candidate rule keeps of exact lookahead", "", approximation_markdown(ap).rstrip("\n"),
                  "", approximation_note(ap), ""]
    if cal.get("dose_response"):
        dr = cal["dose_response"]
        main = cal["num_prefixes"] * cal["samples_per_prefix"] if cal.get("num_prefixes") else None
        extra = dr.get("extra_rows") or []
        lines += ["### Dose-response", "", dose_markdown(dr, extra).rstrip("\n"), "", dose_note(dr, main)
                  + (" Rows marked with a device come from a separate run on it, paired with its own plain "
                     "generations of the same prefixes and seeds (bench/calibration_dose_row.py)." if extra else ""),
                  "", "![dose-response](figure_dose_response.png)", ""]
    return lines


def decoders_markdown(rows: list[dict]) -> list[str]:
    lines = ["| method | parameters | exp(entropy) t=1 | EntRate (last step) | exp(mean entropy, last tenth) | "
             "Δ entropy, last tenth, vs model (nats, paired) | test CE (nats) | zero-prob. fraction | CE, ε-mixed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for d in rows:
        lines.append(f"| {d['method']} | {format_params(d['params'], drop=('stderr',))} | "
                     f"{exp_or_inf(d['entropy_t1_nats']):.1f} | "
                     f"{d['entrate_ppl']:.1f} | {d['entrate_tail_ppl']:.1f} | "
                     f"{d['tail_diff_nats']:+.3f} ± {d['tail_diff_stderr_nats']:.3f} | "
                     f"{format_ce(d['test_ce_nats'])} | "
                     f"{d['zero_prob_fraction']:.4f} | {format_ce(d['test_ce_mixed_nats'])} |")
    return lines


def future_entropy_markdown(cfg: DictConfig, out: Path) -> list[str]:
    """REPORT.md's section of the future_entropy stage (none where the profile does not run it)."""
    if "future_entropy" not in cfg.stages:
        return []
    from lmcal.stages.future_entropy import future_entropy_table, heads_fit_table

    fe = read_json(out / cfg.dataset / "future_entropy" / "future_entropy.json")
    fit_table = heads_fit_table(fe["rows"], fe.get("unit", "word"))
    return [
        "## Calibrating against future entropy (beyond one-step lookahead)", "",
        *future_entropy_lines(fe),
        f"Heads on the frozen model's state predict each next word's discounted future entropy G_K (K words, "
        f"discount γ), trained on {fe['rollouts']} rollouts from the training text ({fe['rollout_examples']:,} "
        f"examples, one rollout each"
        + (f"; {fe['examples_per_rollout']} per rollout, spread over its {fe['rollout_steps']} free words, so the "
           "late words where the drift is are learnt too" if fe.get("rollout_steps") else "") +
        f"); P ∝ P̂ exp(α g) and P̂^β exp(α g) fitted by the cross-entropy of "
        f"{fe['fit_tokens']:,} validation positions. Rows from the decoders stage are on the same prefixes, seeds "
        "and test words. Δ test CE is paired with the model word by word (± one standard error, blocks of "
        f"{fe['cluster_size']} positions); ms / word: one generated word in {fe['timing_prefixes']} x "
        f"{fe['samples_per_prefix']} generations of {fe['timing_horizon']} words, the same run for every method, the "
        f"best of {fe.get('timing_repeats', 1)}; × model: that time over the plain model row's (the ratio timed "
        "alternately with the plain model is cost_ratio in future_entropy.json). Entropies and cross-entropies in "
        "nats.", "",
        future_entropy_table(fe["rows"], fe["reference_test_ce_nats"]).rstrip("\n"), "",
        *claims_markdown([*best_head_claims(fe), *heads_claims(fe["rows"])]),
        *(["The heads' held-out R² on rollouts they did not learn from, overall and by generated word:", "",
           fit_table.rstrip("\n"), ""] if fit_table else []),
        "![future entropy](figure_future_entropy.png)", "",
    ]


def sequence_calibration_markdown(cfg: DictConfig, out: Path) -> list[str]:
    """REPORT.md's section of the sequence_calibration stage (none where the profile does not run it): its table,
    the fit's CE beside the entropy rate, and the goal row, as the stage wrote them."""
    if "sequence_calibration" not in cfg.stages:
        return []
    from lmcal.stages.sequence_report import sequence_table

    sc = read_json(out / cfg.dataset / "sequence_calibration" / "sequence_calibration.json")
    return [
        "## Algorithm 1: sequence-level calibration (SMC and soft-value heads)", "",
        "P̂_α(w_1..L) ∝ P̂(w_1..L)^(1+α), by sequential Monte Carlo at each particle count, untwisted and twisted by "
        f"the soft-value heads (on {sc['smc_prefixes']} of the {sc['num_prefixes']} prefixes, "
        f"{sc['samples_per_prefix']} generations each), and amortised by the soft-value heads, beside the plain "
        "model and the other stages' best per-word rows, on the same prefixes and seeds. exp H, last tenth: the "
        f"entropy per word of each row's law over words {sc['horizon'] - sc['tail_steps'] + 1}–{sc['horizon']} "
        "(SMC: the sequence law's, by nested SMC runs at the row's own count), ± one standard error clustered by "
        "prefix; Δ: paired with the model's generations.", "",
        sequence_table(sc).rstrip("\n"), "",
        *claims_markdown(sequence_goal_claims(sc)),
        "![sequence calibration](figure_sequence_calibration.png)", "",
    ]


def _bound(rows: list[dict], tau: int, limited: str) -> str:
    """'bound ± se' of the memory row for (tau, limited), or – where the reproduction has none."""
    m = next((m for m in rows if m["tau"] == tau and m.get("limited", "trained") == limited), None)
    return f"{m['mi_upper_bound_nats']:.4f} ± {m['mi_stderr_nats']:.4f}" if m else "–"


def markov_memory_markdown(mk: dict) -> list[str]:
    """The Markov source's memory table, each bound beside its P̃'s cross-entropy (the exact order-τ conditional's in
    the oracle column), and where the LSTM rows' slack comes from (lmcal.reporting.setup_text.SLACK)."""
    def cell(rows: list[dict], tau: int, limited: str) -> str:
        m = next((m for m in rows if m["tau"] == tau and m.get("limited", "trained") == limited), None)
        ce = f" (CE {m['ce_limited_nats']:.3f})" if m and m.get("ce_limited_nats") is not None else ""
        return _bound(rows, tau, limited) + ce

    excess = mk["estimated_entropy_rate_nats"] - mk["true_entropy_rate_nats"]
    return ["| tau | I_tau bound (CE of P̃), trained τ-LSTMs | the LSTM on τ-token windows | exact oracles | exact "
            "I_tau of the source |", "|---|---|---|---|---|",
            *[f"| {o['tau']} | {cell(mk['memory'], o['tau'], 'trained')} | {cell(mk['memory'], o['tau'], 'window')} | "
              f"{cell(mk['oracle']['memory'], o['tau'], 'window')} | {o['exact_mi_nats']:.4f} |"
              for o in mk["oracle"]["memory"]], "",
            "± is one standard error; CE: P̃'s test cross-entropy in nats, the exact oracles' that of the exact "
            "order-τ conditional. The oracle rows check the estimators. The LSTM rows bound the information the "
            "LSTM itself draws from beyond τ plus the slack E KL(D_τ ‖ P̃) of the memory section: they are loose "
            "where their P̃ predicts worse than the exact order-τ conditional (the CEs side by side). The LSTM's own "
            f"excess cross-entropy over the source is {excess:+.4f} nats.", ""]


def report_markdown(cfg: DictConfig, r: dict, out: Path) -> str:
    b, er, cal, mk = r["base"], r["entropy_rate"], r["calibration"], r["markov"]
    orc = mk["oracle"]
    entrate_row = f"| {b['model']} ({cfg.profile}) | {cfg.dataset} | {er['test_ppl']:.1f} | {er['entrate_ppl']:.1f} |"
    lines = [
        f"# lmcal reproduction: profile `{cfg.profile}`", "",
        f"Base model: {b['model']}, {b['params']:,} parameters, {b['epochs']} epochs; validation perplexity "
        f"{b['val_ppl']:.1f}, test {b['test_ppl']:.1f} (the paper: {paper.AWD_LSTM_PTB_VAL_TEST[0]} / "
        f"{paper.AWD_LSTM_PTB_VAL_TEST[1]} after 500 epochs).", "",
        "## Entropy rate of generations (Table 1, Figure 2)", "",
        *entropy_rate_lines(r),
        "| model | corpus | test ppl | EntRate = exp(entropy at the last step) | exp(mean entropy, last tenth) |",
        "|---|---|---|---|---|",
        entrate_row + f" {er['entrate_tail_ppl']:.1f} |",
        *transformer_table1(r),
        f"| AWD-LSTM (paper) | ptb | {paper.AWD_LSTM_PTB['test_ppl']} | {paper.AWD_LSTM_PTB['entrate_ppl']} | |",
        f"| GPT-2 (paper) | WebText | {paper.GPT2['test_ppl']} | {paper.GPT2['entrate_ppl']} | |", "",
        f"{er['num_generations']} generations of {er['horizon']} words"
        + (f" (the transformer: {r['transformer']['entropy_rate']['num_generations']} of "
           f"{r['transformer']['entropy_rate']['horizon']}, within its context)"
           if "entropy_rate" in r.get("transformer", {}) else "")
        + ". ![Figure 2](figure2_entropy_rate.png)", "",
        "## Lookahead calibration (Algorithm 2, Figure 3)", "",
        *calibration_lines(r),
        "| | alpha* | test ppl | EntRate (last step) | exp(mean entropy, last tenth) |", "|---|---|---|---|---|",
        f"| uncalibrated | 0 | {cal['test_ppl_before']:.2f} | {cal['entrate_ppl_before']:.1f} | "
        f"{cal['entrate_tail_ppl_before']:.1f} |",
        f"| calibrated | {cal['alpha']:.4f} ± {cal['alpha_stderr']:.4f} | {cal['test_ppl_after']:.2f} | "
        f"{cal['entrate_ppl_after']:.1f} | {cal['entrate_tail_ppl_after']:.1f} |", "",
        f"Standard error of the last step's entropy: {cal['stderr_nats'][-1]:.3f} nats (calibrated): EntRate is one "
        "step's entropy, a level to read beside Table 1's, not an effect. Over the last "
        f"tenth of the horizon ({cal['tail_steps']} words), paired generation by generation (same prefixes and "
        f"seeds), calibration changes the mean entropy by {cal['tail_diff_nats']:+.4f} ± "
        f"{cal['tail_diff_stderr_nats']:.4f} nats (± one standard error, clustered by prefix): exp of the mean "
        f"{cal['tail_ppl_before']:.1f} → {cal['tail_ppl_after']:.1f}.", "",
        f"alpha* fitted on {cal['fit_tokens']:,} validation positions, each after at least "
        f"{max(1, cal['min_context'])} tokens of context, with " + _lookahead_words(cal) +
        f"test perplexity on {cal['test_tokens']:,} test tokens. ![Figure 3](figure3_calibration.png)", "",
        *claims_markdown(calibration_claims(r)),
        *calibration_limit_markdown(cal),
        *(calibration_samples_markdown(out, cfg.dataset)
          if (out / cfg.dataset / "calibration" / "calibration.json").is_file() else []),
        "## Decoders beside calibration", "",
        *decoders_lines(r),
        "The decoding rules practitioners use, on the same model, prefixes and seeds as calibration. Test CE is ∞ "
        "where a rule gives a test word probability 0; the ε-mixed CE mixes in ε = 1e-6 of the uniform "
        "distribution, so it is finite for all. The fitted rows (temperature, calibration) are the only ones "
        "chosen by held-out cross-entropy.", "",
        *decoders_markdown(r["decoders"]), "",
        "![decoders](figure_decoders.png)", "",
        *future_entropy_markdown(cfg, out),
        *sequence_calibration_markdown(cfg, out),
        "## Memory (Section 5, Figure 4)", "",
        *memory_lines(bool(cfg.get("warm_start", False)), list(cfg.get("tau") or []),
                      [m for m in r["memory"] if m.get("model") != "transformer"]),
        (out / f"memory_{cfg.dataset}.md").read_text().split("\n", 2)[2],
        *claims_markdown(memory_flags([m for m in r["memory"] if m.get("model") != "transformer"])),
        *transformer_memory_markdown(r),
        "## The exact check: an order-k Markov source", "",
        f"Order {mk['order']}. Entropy rate: exact {mk['true_entropy_rate_nats']:.4f} nats, estimated (the trained "
        f"LSTM's test cross-entropy) {mk['estimated_entropy_rate_nats']:.4f} ± "
        f"{mk['estimated_entropy_rate_stderr_nats']:.4f}.", "",
        f"The same estimators on the exact oracles (P̂ = the true conditional, P̃_τ = the exact order-τ "
        f"conditional), on the same test text: entropy rate {orc['estimated_entropy_rate_nats']:.4f} ± "
        f"{orc['estimated_entropy_rate_stderr_nats']:.4f}.", "",
        *markov_memory_markdown(mk),
        "![Figure 4 on the Markov source](memory_markov.png)", "",
        *[line for n in cfg.stages if n not in (*PAPER_STAGES, "future_entropy", "sequence_calibration") for line in
          (f"## Stage {n}", "", *(f"- {k}: {v}" for k, v in r[n].items()), "")],
        "## Where the time goes", "",
        "Each analysis stage's wall time by operation (utils.profiling; a share of the stage's seconds): forward = "
        "the model's steps, lookahead = the candidate entropies of calibration beyond their forwards, scoring = "
        "held-out cost beyond its forwards, fit = the exponential-family fits, io = files and figures. MFU: the "
        "forward's FLOP rate (2 x parameters per token) against this machine's float32 matmul rate, "
        f"{r['provenance'].get('matmul_gflop_per_s', float('nan')):.0f} GFLOP/s, measured in the report stage.", "",
        *profile_markdown(r["stages"], r["provenance"].get("matmul_gflop_per_s", float("nan")) * 1e9), "",
        "## Stages", "", "Training stages add their training speed (tokens per second of optimiser steps); machine: "
        "the float32 matmul rate measured as the stage started (shared machines vary by a third from day to day).", "",
        "| stage | seconds | training tokens/s | machine GFLOP/s | run folder |", "|---|---|---|---|---|",
    ]
    for name, s in r["stages"].items():
        rec = out / "stages" / f"{name}.json"
        folder = read_json(rec)["dir"] if rec.is_file() else str(out)
        rel = os.path.relpath(folder, out)
        tps = f"{s['tokens_per_s']:.0f}" if s.get("tokens_per_s") else "–"
        rate = f"{s['matmul_gflop_per_s']:.0f}" if s.get("matmul_gflop_per_s") else "–"
        lines.append(f"| {name} | {s['seconds']:.0f} | {tps} | {rate} | [{rel}]({rel}) |")
    total = wall_seconds(r["stages"])
    rates = [s["matmul_gflop_per_s"] for s in r["stages"].values() if s.get("matmul_gflop_per_s")]
    speed = (f" The machine's matmul rate ranged {min(rates):.0f}-{max(rates):.0f} GFLOP/s over the {len(rates)} "
             f"stage{'s' if len(rates) > 1 else ''} that recorded it." if rates else "")
    summed = sum(s["seconds"] for s in r["stages"].values())
    lines += ["", f"Total: {total / 60:.1f} minutes of wall time while stages ran (the stage times above, some run "
              f"side by side, add up to {summed / 60:.1f}).{speed} Settings: [profile.yaml](profile.yaml); logs in "
              "[logs/](logs)."]
    return "\n".join(lines) + "\n"


def wall_seconds(stages: dict[str, dict]) -> float:
    """The wall time the stages covered: the union of their [started_at, finished_at] spans (stages run side by side
    count once; the gaps between a pipeline's interrupted and resumed runs not at all). Records without the times
    (older ones) add their seconds."""
    spans = sorted((s["started_at"], s["finished_at"]) for s in stages.values() if "finished_at" in s
                   and "started_at" in s)
    total, end = 0.0, float("-inf")
    for a, b in spans:
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total + sum(s["seconds"] for s in stages.values() if "finished_at" not in s or "started_at" not in s)
