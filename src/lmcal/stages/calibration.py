"""The calibration stage: lookahead calibration (Algorithm 2, Figure 3): alpha*, test CE before and after, and both
generation curves from the same prefixes and seeds, compared generation by generation over the last tenth; with the
approximation table and the dose-response (lmcal.stages.dose_response) that say whether the candidate rule or the
model limits the effect.
"""

from __future__ import annotations

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
from lmcal.core.lookahead_law import make_rule
from lmcal.core.sampling import random_prefixes
from lmcal.data.batching import batchify
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
from lmcal.stages.stage import Stage, pick, stage_context
from lmcal.stages.wandb_run import log_config, log_curves, wandb_log
from lmcal.utils.io import write_json_atomic, write_text_atomic
from lmcal.utils.numbers import exp_or_inf

log = logging.getLogger("lmcal")


def calibration_stage(lm, valid_tokens: torch.Tensor, test_tokens: torch.Tensor, out_dir: str | Path, *,
                      fit_tokens: int = 20_000, fit_streams: int = 20, score_tokens: int | None = None,
                      score_streams: int = 10, topk: int | None = 64, tail_samples: int = 16,
                      cover: float | None = None, cover_max: int | None = None, min_context: int = 100,
                      uniform_weight: float = 0.0, num_prefixes: int = 100, samples_per_prefix: int = 5,
                      prefix_len: int = 100, horizon: int = 700, seed: int = 0, max_batch: int = 1024,
                      approximation: dict | None = None, dose_response: dict | None = None,
                      model_name: str = "model", corpus: str = "ptb", logger=None, name: str = "calibration",
                      unit: str = "word") -> dict:
    """Lookahead calibration (Algorithm 2, Figure 3): fit alpha* on the first `fit_tokens` validation tokens
    (as `fit_streams` parallel streams, each reading `min_context` tokens before its positions count), score test CE
    before and after on the first `score_tokens` test tokens (all when null), and the generation entropy curves of
    both models from the same prefixes and seeds, compared generation by generation over the last tenth of the
    horizon. The law fitted, scored and sampled is one (lmcal.core.lookahead_law): its candidates by the rule topk /
    cover (cover_max) / exact (both null), the rest sharing one tilt from `tail_samples` draws seeded by `seed`.

    approximation ({generations, steps}) and dose_response ({multiples, rules, num_prefixes, samples_per_prefix,
    score_tokens}; null: skipped): see lmcal.stages.dose_response.

    "Before" is the eps-mixture (1 - w) P + w uniform, w = uniform_weight, for the cross-entropy and the curve alike
    (with w = 0, the model itself)."""
    rule = make_rule(topk, cover, cover_max, tail_samples)
    dose_rules = rules_of((dose_response or {}).get("rules"), "analysis.calibration.dose_response.rules",
                          tail_samples or 16)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    fit = fit_lookahead_calibration(lm, batchify(valid_tokens[:fit_tokens], fit_streams), topk=topk,
                                    epsilon=uniform_weight, tail_samples=tail_samples, min_context=min_context,
                                    seed=seed, progress=True, cover=cover, cover_max=cover_max)
    t_fit = time.perf_counter() - t0
    plain = calibrated(lm, 0.0, epsilon=uniform_weight)  # the eps-mixed base model, bit for bit lm itself at w = 0
    cal = calibrated(lm, fit.alpha, topk=topk, epsilon=uniform_weight, tail_samples=tail_samples, seed=seed,
                     cover=cover, cover_max=cover_max)
    test = batchify(test_tokens[:score_tokens] if score_tokens else test_tokens, score_streams)
    cost_before = heldout_cost(plain, test, progress=True)
    cost_after = heldout_cost(cal, test, progress=True)  # a lookahead a position: minutes on a large model
    coverage = topk_coverage(cal, test[:201])  # the first 200 steps of the score streams: what the rest shares
    ce_before, ce_after, n_scored = cost_before["test_ce_nats"], cost_after["test_ce_nats"], cost_after["test_tokens"]
    prefixes = random_prefixes(valid_tokens, num_prefixes, prefix_len, seed=seed)
    curves = {}
    for label, model in (("before", plain), ("after", cal)):  # the same prefixes and uniforms: paired generations
        curves[label] = generation_entropy_curve(model, prefixes, horizon, samples_per_prefix, seed=seed,
                                                 max_batch=max_batch, progress=True, keep=3 * samples_per_prefix)
    tail_diff, tail_se = paired_tail_difference(curves["after"], curves["before"])
    levels = {k: clustered_mean(c.tail) for k, c in curves.items()}  # the last tenth's levels, se clustered by prefix
    diff_curve, diff_se = paired_difference_curve(curves["after"], curves["before"])
    result = {
        "model": model_name, "corpus": corpus, "alpha": fit.alpha, "alpha_stderr": fit.alpha_stderr,
        "fit_ce_before_nats": fit.ce_before, "fit_ce_after_nats": fit.ce_after, "fit_tokens": fit.n_tokens,
        "fit_streams": fit_streams, "min_context": min_context, "cluster_size": fit.cluster_size,
        "test_ce_before_nats": ce_before, "test_ce_after_nats": ce_after,
        "test_ppl_before": exp_or_inf(ce_before), "test_ppl_after": exp_or_inf(ce_after), "test_tokens": n_scored,
        "test_ce_mixed_nats_before": cost_before["test_ce_mixed_nats"],
        "test_ce_mixed_nats_after": cost_after["test_ce_mixed_nats"], "mix_epsilon": cost_after["mix_epsilon"],
        "score_streams": score_streams, "mass_outside_topk": coverage["mass_outside_topk"],
        "true_word_outside_topk": coverage["true_word_outside_topk"], "coverage_positions": coverage["positions"],
        "curve_nats_before": curves["before"].mean.tolist(), "stderr_nats_before": curves["before"].stderr.tolist(),
        "curve_nats": curves["after"].mean.tolist(), "stderr_nats": curves["after"].stderr.tolist(),
        "entrate_ppl_before": exp_or_inf(curves["before"].mean[-1]),
        "entrate_ppl_after": exp_or_inf(curves["after"].mean[-1]),
        "tail_steps": tail_steps(horizon),
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
        "candidates_mean_test": coverage["candidates_mean"], "epsilon": uniform_weight,
        "uniform_weight": uniform_weight, "horizon": horizon, "num_prefixes": prefixes.size(0),
        "samples_per_prefix": samples_per_prefix, "prefix_len": prefix_len, "seed": seed,
        "samples": shown_generations(prefixes, curves["before"], curves["after"], samples_per_prefix),
        "fit_seconds": t_fit, "seconds": time.perf_counter() - t0, "unit": unit,
    }
    png = entropy_curve_figure({f"{model_name}": (curves["before"].mean, curves["before"].stderr),
                                f"calibrated, alpha={fit.alpha:.3g}": (curves["after"].mean, curves["after"].stderr)},
                               out / f"{name}.png",  # (Figure 2's line is the whole test set's)
                               reference_nats={f"test cross-entropy ({test.numel():,} test {unit}s scored)": ce_before},
                               title=f"{model_name} on {corpus}: EntRate {result['entrate_ppl_before']:.1f} -> "
                                     f"{result['entrate_ppl_after']:.1f}, test ppl {result['test_ppl_before']:.1f} -> "
                                     f"{result['test_ppl_after']:.1f}",
                               difference={"label": "calibrated minus plain, paired", "mean": diff_curve,
                                           "stderr": diff_se, "tail": tail_diff, "tail_stderr": tail_se,
                                           "tail_steps": tail_steps(horizon)})
    scalars = {f"{name}/{k}": result[k] for k in ("alpha", "test_ppl_before", "test_ppl_after", "entrate_ppl_before",
                                                  "entrate_ppl_after", "tail_ppl_before", "tail_ppl_after",
                                                  "tail_diff_nats", "tail_diff_stderr_nats")}
    images = {f"{name}/figure": png}
    if approximation and dose_rules:
        dr = dose_response or {}
        result["approximation"] = approximation_table(
            lm, prefixes[:approximation.get("generations", 30)], horizon, approximation.get("steps", 10), dose_rules,
            fit.alpha, dr.get("multiples", [1]), seed, uniform_weight)
        log.info(f"{name}: what each candidate rule keeps of exact lookahead's shift of E[H_next]\n"
                 + approximation_markdown(result["approximation"]))
    if dose_response and dose_rules:
        result["dose_response"] = _dose(lm, fit.alpha, dose_rules, dose_response, prefixes, rule, curves, test_tokens,
                                        test, score_tokens, score_streams, samples_per_prefix, horizon, seed,
                                        uniform_weight, max_batch)
        images[f"{name}/dose_response"] = dose_figure(result["dose_response"], out / f"{name}_dose_response.png")
        scalars.update({f"{name}/dose/{r['rule']}/x{r['multiple']:g}/{k}": r[k] for r in result["dose_response"]["rows"]
                        for k in ("tail_diff_nats", "tail_diff_stderr_nats", "test_ce_diff_nats")})
    if "approximation" in result or "dose_response" in result:
        write_text_atomic(out / f"{name}_dose_response.md", dose_response_markdown(result))
    result["seconds"] = time.perf_counter() - t0
    write_json_atomic(out / f"{name}.json", result)
    wandb_log(logger, scalars=scalars, images=images)
    log_curves(logger, f"{name}/curves", "t", range(1, horizon + 1),
               {"before_nats": curves["before"].mean.tolist(), "after_nats": curves["after"].mean.tolist(),
                "after_minus_before_nats": diff_curve.tolist()})
    log_config(logger, {f"{name}/alpha": fit.alpha, f"{name}/alpha_stderr": fit.alpha_stderr})
    log.info(f"{name}: alpha* {fit.alpha:.4f} +- {fit.alpha_stderr:.4f}; test ppl {result['test_ppl_before']:.2f} -> "
             f"{result['test_ppl_after']:.2f}; EntRate {result['entrate_ppl_before']:.1f} -> "
             f"{result['entrate_ppl_after']:.1f}; last tenth {result['tail_ppl_before']:.1f} -> "
             f"{result['tail_ppl_after']:.1f} (paired difference {tail_diff:+.4f} +- {tail_se:.4f} nats; "
             f"{result['seconds']:.0f} s)")
    return result


def _dose(lm, alpha, rules, settings: dict, prefixes, rule, curves, test_tokens, test, score_tokens, score_streams,
          samples_per_prefix, horizon, seed, epsilon, max_batch) -> dict:
    """The dose-response on its own generations and test tokens (settings: the stage's where null), reusing the
    stage's plain and calibrated curves where they are the same generations."""
    n = settings.get("num_prefixes") or prefixes.size(0)
    s = settings.get("samples_per_prefix") or samples_per_prefix
    tokens = settings.get("score_tokens") or score_tokens
    same = n == prefixes.size(0) and s == samples_per_prefix
    # the stage's curve serves the rule that is its law (the same candidates and tail draws), at a = alpha*
    reuse = {(rule.label, 1): curves["after"]} if same and rule.settings() in [r.settings() for r in rules] else {}
    dose_test, streams = test, score_streams
    if tokens != score_tokens:  # its own test streams, each within a bounded context (S tokens take S positions)
        n_tok = min(tokens, len(test_tokens)) if tokens else len(test_tokens)
        context = getattr(lm, "max_positions", None)
        streams = max(score_streams, -(-n_tok // context)) if context else score_streams
        dose_test = batchify(test_tokens[:n_tok], streams)
    dr = dose_response(lm, alpha, rules, settings.get("multiples", [1, 3, 10]), prefixes[:n], horizon, s, dose_test,
                       seed=seed, epsilon=epsilon, max_batch=max_batch, plain=curves["before"] if same else None,
                       reuse=reuse)
    return dr | {"score_tokens": tokens, "score_streams": streams}  # what bench/calibration_dose_row.py reads


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


STAGE = Stage("calibration", calibration_stage,
              lambda t, out, logger, earlier, **s: calibration_stage(t["lm"], t["valid"], t["test"], out,
                                                                     unit=t["unit"], **stage_context(t, logger), **s),
              frozenset({"full", "hf"}),
              pick("alpha", "test_ppl_before", "test_ppl_after", "entrate_ppl_before", "entrate_ppl_after",
                   "tail_ppl_before", "tail_ppl_after", "tail_diff_nats", "tail_diff_stderr_nats"))
