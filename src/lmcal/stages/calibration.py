"""The calibration stage: lookahead calibration (Algorithm 2, Figure 3): alpha*, test CE before and after, and both
generation curves from the same prefixes and seeds, compared generation by generation over the last tenth; with the
approximation table and the dose-response (lmcal.stages.dose_response) that say whether the candidate rule or the
model limits the effect.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from lmcal.core.calibration import calibrated, fit_lookahead_calibration, topk_coverage
from lmcal.core.decoders import heldout_cost
from lmcal.core.entropy_rate import (
    clustered_mean,
    generation_entropy_curve,
    paired_difference_curve,
    paired_tail_difference,
    tail_steps,
)
from lmcal.core.lookahead_law import Rule, make_rule
from lmcal.core.sampling import random_prefixes
from lmcal.data.batching import batchify
from lmcal.stages.configs import CalibrationConfig
from lmcal.stages.dose_response import (
    approximation_markdown,
    approximation_note,
    approximation_table,
    dose_figure,
    dose_markdown,
    dose_note,
    dose_response,
    rules_of,
)
from lmcal.stages.plots import entropy_curve_figure
from lmcal.stages.stage import Result, Stage, pick
from lmcal.stages.wandb_run import log_config, log_curves, wandb_log
from lmcal.utils.io import write_text_atomic
from lmcal.utils.numbers import exp_or_inf

log = logging.getLogger("lmcal")

SCALARS = ("alpha", "test_ppl_before", "test_ppl_after", "entrate_ppl_before", "entrate_ppl_after", "tail_ppl_before",
           "tail_ppl_after", "tail_diff_nats", "tail_diff_stderr_nats")


class CalibrationResult(Result):
    """alpha*, the test CE and the generation curves before and after, with the approximation table and the
    dose-response beside them (`<name>_dose_response.md` and `.png`)."""

    def figure(self, path: Path) -> Path:
        r = self.record
        scored = r["test_tokens"] + r["score_streams"]  # every score token, the first of each stream read as context
        return entropy_curve_figure(
            {f"{r['model']}": (r["curve_nats_before"], r["stderr_nats_before"]),
             f"calibrated, alpha={r['alpha']:.3g}": (r["curve_nats"], r["stderr_nats"])},
            path,  # (Figure 2's line is the whole test set's)
            reference_nats={f"test cross-entropy ({scored:,} test {r['unit']}s scored)": r["test_ce_before_nats"]},
            title=f"{r['model']} on {r['corpus']}: EntRate {r['entrate_ppl_before']:.1f} -> "
                  f"{r['entrate_ppl_after']:.1f}, test ppl {r['test_ppl_before']:.1f} -> {r['test_ppl_after']:.1f}",
            difference={"label": "calibrated minus plain, paired", "mean": r["diff_curve_nats"],
                        "stderr": r["diff_stderr_nats"], "tail": r["tail_diff_nats"],
                        "tail_stderr": r["tail_diff_stderr_nats"], "tail_steps": r["tail_steps"]})

    def extras(self, out: Path, name: str) -> dict[str, Path]:
        r, images = self.record, {}
        if "dose_response" in r:
            images["dose_response"] = dose_figure(r["dose_response"], out / f"{name}_dose_response.png")
        if "approximation" in r or "dose_response" in r:
            write_text_atomic(out / f"{name}_dose_response.md", dose_response_markdown(r))
        return images

    def log_wandb(self, logger, name: str, images: dict[str, Path]) -> None:
        r = self.record
        scalars = {f"{name}/{k}": r[k] for k in SCALARS}
        if "dose_response" in r:
            scalars.update({f"{name}/dose/{x['rule']}/x{x['multiple']:g}/{k}": x[k] for x in r["dose_response"]["rows"]
                            for k in ("tail_diff_nats", "tail_diff_stderr_nats", "test_ce_diff_nats")})
        wandb_log(logger, scalars=scalars, images=images)
        log_curves(logger, f"{name}/curves", "t", range(1, r["horizon"] + 1),
                   {"model": r["curve_nats_before"], "calibration": r["curve_nats"],  # (the names decoders use)
                    "calibration_minus_model": r["diff_curve_nats"]})
        log_config(logger, {f"{name}/alpha": r["alpha"], f"{name}/alpha_stderr": r["alpha_stderr"]})

    def line(self, name: str) -> str:
        r = self.record
        bound = (f" (the bound: CE still falls at |alpha| = {r.get('alpha_bound', 100.0):g}, no finite minimum)"
                 if r.get("alpha_at_bound") else "")
        return (f"{name}: alpha* {r['alpha']:.4f} +- {r['alpha_stderr']:.4f}{bound}; test ppl "
                f"{r['test_ppl_before']:.2f} -> "
                f"{r['test_ppl_after']:.2f}; EntRate {r['entrate_ppl_before']:.1f} -> {r['entrate_ppl_after']:.1f}; "
                f"last tenth {r['tail_ppl_before']:.1f} -> {r['tail_ppl_after']:.1f} (paired difference "
                f"{r['tail_diff_nats']:+.4f} +- {r['tail_diff_stderr_nats']:.4f} nats; {r['seconds']:.0f} s)")


def compute(target: dict, settings: CalibrationConfig) -> CalibrationResult:
    """Lookahead calibration (Algorithm 2, Figure 3): fit alpha* on the first `fit_tokens` validation tokens
    (as `fit_streams` parallel streams, each reading `min_context` tokens before its positions count), score test CE
    before and after on the first `score_tokens` test tokens (all when null), and the generation entropy curves of
    both models from the same prefixes and seeds, compared generation by generation over the last tenth of the
    horizon. The law fitted, scored and sampled is one (lmcal.core.lookahead_law): its candidates by the rule topk /
    cover (cover_max) / exact (both null), the rest sharing one tilt from `tail_samples` draws seeded by `seed`.

    approximation and dose_response (null: skipped; also skipped without dose_response.rules): see
    lmcal.stages.dose_response.

    "Before" is the eps-mixture (1 - w) P + w uniform, w = uniform_weight, for the cross-entropy and the curve alike
    (with w = 0, the model itself)."""
    s, lm = settings, target["lm"]
    rule = make_rule(s.topk, s.cover, s.cover_max, s.tail_samples)
    dose_rules = rules_of(s.dose_response.rules if s.dose_response is not None else None,
                          "analysis.calibration.dose_response.rules", s.tail_samples or 16)
    t0 = time.perf_counter()
    fit = fit_lookahead_calibration(lm, batchify(target["valid"][:s.fit_tokens], s.fit_streams), rule,
                                    epsilon=s.uniform_weight, min_context=s.min_context, seed=s.seed, progress=True)
    t_fit = time.perf_counter() - t0
    plain = calibrated(lm, 0.0, epsilon=s.uniform_weight)  # the eps-mixed base model, bit for bit lm itself at w = 0
    cal = calibrated(lm, fit.alpha, topk=s.topk, epsilon=s.uniform_weight, tail_samples=s.tail_samples, seed=s.seed,
                     cover=s.cover, cover_max=s.cover_max)
    test_tokens = target["test"]
    test = batchify(test_tokens[:s.score_tokens] if s.score_tokens else test_tokens, s.score_streams)
    scored = {"before": heldout_cost(plain, test, progress=True),
              "after": heldout_cost(cal, test, progress=True),  # a lookahead a position: minutes on a large model
              "coverage": topk_coverage(cal, test[:201])}  # the first 200 steps of the score streams
    prefixes = random_prefixes(target["valid"], s.num_prefixes, s.prefix_len, seed=s.seed)
    curves = {}
    for label, model in (("before", plain), ("after", cal)):  # the same prefixes and uniforms: paired generations
        curves[label] = generation_entropy_curve(model, prefixes, s.horizon, s.samples_per_prefix, seed=s.seed,
                                                 max_batch=s.max_batch, progress=True, keep=3 * s.samples_per_prefix)
    record = _record(target, s, rule, fit, scored, prefixes, curves)
    record |= {"fit_seconds": t_fit, "seconds": time.perf_counter() - t0, "unit": target["unit"]}
    if s.approximation is not None and dose_rules:
        ap = s.approximation
        record["approximation"] = approximation_table(lm, prefixes[:ap.generations], s.horizon, ap.steps, dose_rules,
                                                      fit.alpha, s.dose_response.multiples, s.seed, s.uniform_weight)
        log.info("calibration: what each candidate rule keeps of exact lookahead's shift of E[H_next]\n"
                 + approximation_markdown(record["approximation"]))
    if s.dose_response is not None and dose_rules:
        record["dose_response"] = _dose(lm, fit.alpha, dose_rules, s, prefixes, rule, curves, test_tokens, test)
    record["seconds"] = time.perf_counter() - t0
    return CalibrationResult(record)


def _record(target: dict, s: CalibrationConfig, rule: Rule, fit, scored: dict, prefixes: torch.Tensor,
            curves: dict) -> dict:
    """The stage's record from its fit, its scores ({before, after: heldout_cost; coverage: topk_coverage}) and its
    paired curves ({before, after}), in the order calibration.json has its keys."""
    before, after, coverage = scored["before"], scored["after"], scored["coverage"]
    ce_before, ce_after = before["test_ce_nats"], after["test_ce_nats"]
    tail_diff, tail_se = paired_tail_difference(curves["after"], curves["before"])
    levels = {k: clustered_mean(c.tail) for k, c in curves.items()}  # the last tenth's levels, se clustered by prefix
    diff_curve, diff_se = paired_difference_curve(curves["after"], curves["before"])
    return {
        "model": target["name"], "corpus": target["corpus"], "alpha": fit.alpha, "alpha_stderr": fit.alpha_stderr,
        "alpha_at_bound": fit.at_bound, "alpha_bound": fit.bound,
        "fit_ce_before_nats": fit.ce_before, "fit_ce_after_nats": fit.ce_after, "fit_tokens": fit.n_tokens,
        "fit_streams": s.fit_streams, "min_context": s.min_context, "cluster_size": fit.cluster_size,
        "test_ce_before_nats": ce_before, "test_ce_after_nats": ce_after,
        "test_ppl_before": exp_or_inf(ce_before), "test_ppl_after": exp_or_inf(ce_after),
        "test_tokens": after["test_tokens"],
        "test_ce_mixed_nats_before": before["test_ce_mixed_nats"],
        "test_ce_mixed_nats_after": after["test_ce_mixed_nats"], "mix_epsilon": after["mix_epsilon"],
        "score_streams": s.score_streams, "mass_outside_topk": coverage["mass_outside_topk"],
        "true_word_outside_topk": coverage["true_word_outside_topk"], "coverage_positions": coverage["positions"],
        "curve_nats_before": curves["before"].mean.tolist(), "stderr_nats_before": curves["before"].stderr.tolist(),
        "curve_nats": curves["after"].mean.tolist(), "stderr_nats": curves["after"].stderr.tolist(),
        "entrate_ppl_before": exp_or_inf(curves["before"].mean[-1]),
        "entrate_ppl_after": exp_or_inf(curves["after"].mean[-1]),
        "tail_steps": tail_steps(s.horizon),
        "tail_ppl_before": exp_or_inf(curves["before"].tail_mean),
        "tail_ppl_after": exp_or_inf(curves["after"].tail_mean),
        "tail_diff_nats": tail_diff, "tail_diff_stderr_nats": tail_se,
        "tail_nats_before": float(levels["before"][0]), "tail_stderr_nats_before": float(levels["before"][1]),
        "tail_nats": float(levels["after"][0]), "tail_stderr_nats": float(levels["after"][1]),
        "diff_curve_nats": diff_curve.tolist(), "diff_stderr_nats": diff_se.tolist(),
        "tail_nats_per_generation_before": curves["before"].tail.tolist(),
        "tail_nats_per_generation": curves["after"].tail.tolist(),
        "topk": rule.topk, "tail_samples": rule.tail_samples if not rule.exact else None, "cover": rule.cover,
        "cover_max": rule.cover_max, "rule": rule.label, "candidates_mean": fit.candidates_mean,
        "candidates_mean_test": coverage["candidates_mean"], "epsilon": s.uniform_weight,
        "uniform_weight": s.uniform_weight, "horizon": s.horizon, "num_prefixes": prefixes.size(0),
        "samples_per_prefix": s.samples_per_prefix, "prefix_len": s.prefix_len, "seed": s.seed,
        "samples": shown_generations(prefixes, curves["before"], curves["after"], s.samples_per_prefix),
    }


def _dose(lm, alpha: float, rules: list[Rule], s: CalibrationConfig, prefixes: torch.Tensor, rule: Rule, curves: dict,
          test_tokens: torch.Tensor, test: torch.Tensor) -> dict:
    """The dose-response on its own generations and test tokens (s.dose_response's, the stage's where null), reusing
    the stage's plain and calibrated curves where they are the same generations."""
    d = s.dose_response
    n = d.num_prefixes or prefixes.size(0)
    per = d.samples_per_prefix or s.samples_per_prefix
    tokens = d.score_tokens or s.score_tokens
    same = n == prefixes.size(0) and per == s.samples_per_prefix
    # the stage's curve serves the rule that is its law (the same candidates and tail draws), at a = alpha*
    reuse = {(rule.label, 1): curves["after"]} if same and rule.settings() in [r.settings() for r in rules] else {}
    dose_test, streams = test, s.score_streams
    if tokens != s.score_tokens:  # its own test streams, each within a bounded context (S tokens take S positions)
        n_tok = min(tokens, len(test_tokens)) if tokens else len(test_tokens)
        context = getattr(lm, "max_positions", None)
        streams = max(s.score_streams, -(-n_tok // context)) if context else s.score_streams
        dose_test = batchify(test_tokens[:n_tok], streams)
    gen = dataclasses.replace(s, num_prefixes=n, samples_per_prefix=per)
    dr = dose_response(lm, alpha, rules, d.multiples, prefixes[:n], dose_test, gen, epsilon=s.uniform_weight,
                       plain=curves["before"] if same else None, reuse=reuse)
    return dr | {"score_tokens": tokens, "score_streams": streams}


def dose_response_markdown(result: dict) -> str:
    """The stage's approximation table and dose-response as Markdown (calibration_dose_response.md)."""
    parts = []
    if "approximation" in result:
        ap = result["approximation"]
        parts += ["## What each candidate rule keeps of exact lookahead", "", approximation_markdown(ap),
                  approximation_note(ap), ""]
    if "dose_response" in result:
        dr = result["dose_response"]
        parts += ["## Dose-response", "", dose_markdown(dr), dose_note(dr, result["num_prefixes"] *
                                                                         result["samples_per_prefix"]), ""]
    return "\n".join(parts)


def shown_generations(prefixes: torch.Tensor, before, after, samples_per_prefix: int, shown: int = 3) -> list[dict]:
    """The first generation from each of the first `shown` prefixes, plain and calibrated (the same prefix and
    uniforms), as token ids with each one's mean entropy over the last tenth: for REPORT.md to show as words."""
    out = []
    for i in range(min(shown, prefixes.size(0))):
        g = i * samples_per_prefix  # generation g reads prefix g // samples_per_prefix
        if before.kept is None or g >= len(before.kept):
            break
        out.append({"prefix": prefixes[i].tolist(), "before": before.kept[g].tolist(), "after": after.kept[g].tolist(),
                    "tail_nats_before": float(before.tail[i, 0]), "tail_nats": float(after.tail[i, 0])})
    return out


STAGE = Stage("calibration", CalibrationConfig, compute, frozenset({"full", "hf"}), pick(*SCALARS))
