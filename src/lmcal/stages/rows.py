"""What the comparison stages (decoders, future_entropy, sequence_calibration) share: the settings that make two
stages' generations and test scores the same, one method's row of a comparison table, and the timing protocol.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from lmcal.core.entropy_rate import clustered_mean, generation_entropy_curve
from lmcal.utils.numbers import exp_or_inf, format_params

# the keys a result records generation_settings under
GENERATION_KEYS = ("num_prefixes", "samples_per_prefix", "prefix_len", "horizon", "seed", "test_tokens",
                   "score_streams")


def generation_settings(prefixes: torch.Tensor, samples_per_prefix: int, prefix_len: int, horizon: int, seed: int,
                        test: torch.Tensor, score_streams: int) -> dict:
    """What makes two stages' generations and test scores the same (prefixes, seeds, test words), so that one may
    take the other's rows: the keys its result records them under (GENERATION_KEYS)."""
    return dict(zip(GENERATION_KEYS, (prefixes.size(0), samples_per_prefix, prefix_len, horizon, seed,
                                      (test.size(0) - 1) * test.size(1), score_streams), strict=True))


def same_settings(result: dict | None, settings: dict) -> bool:
    """Whether an earlier stage's result was generated and scored as `settings` (generation_settings) say."""
    return bool(result) and all(result.get(k) == v for k, v in settings.items())


def curve_row(method: str, params: dict, curve, stderr, tail, plain_tail: np.ndarray, seconds: float,
              **columns) -> dict:
    """One method's row of a comparison table: its entropy curve (mean and stderr [T]), exp(entropy) at t = T and
    over the last tenth, and that tail's paired difference from the plain model's (tail, plain_tail [N, S]: the
    generations' last-tenth means, same prefixes and uniforms; prefixes as clusters); `columns`: its costs."""
    tail = np.asarray(tail, dtype=np.float64)  # [N, S]
    diff, diff_se = clustered_mean(tail - plain_tail)
    level, level_se = clustered_mean(tail)
    curve, stderr = [float(x) for x in curve], [float(x) for x in stderr]
    return {"method": method, "params": params, "entropy_t1_nats": curve[0], "entropy_last_nats": curve[-1],
            "entrate_ppl": exp_or_inf(curve[-1]), "tail_ppl": exp_or_inf(tail.mean()),
            "tail_nats": float(level), "tail_stderr_nats": float(level_se), "tail_diff_nats": float(diff),
            "tail_nats_per_generation": tail.tolist(),  # [N][S]: what a later stage pairs with (sequence_calibration)
            "tail_diff_stderr_nats": float(diff_se), **columns, "curve_nats": curve, "stderr_nats": stderr,
            "seconds": seconds}


FITTED = ("alpha", "beta", "stderr", "topk")  # params a method's fit chose (or that only qualify it)


def method_label(method: str, params: dict | None) -> str:
    """A method's name that is the same in every run: its name and the settings a user chose (top_p (p=0.95),
    future_entropy (horizon_k=5, discount=0.95)), without what a fit chose (alpha, beta, a fitted temperature),
    which go to the legend and the run's config. W&B's series keys and the results table use it."""
    drop = FITTED + (("temperature",) if method == "fitted_temperature" else ())
    shown = format_params(params or {}, drop=drop, empty="")
    return f"{method} ({shown})" if shown else method


def timed_generation(model, lm, prefixes: torch.Tensor, horizon: int, samples_per_prefix: int, seed: int,
                     max_batch: int, repeats: int) -> tuple[float, float]:
    """(ms per generated word of `model` from `prefixes` [n, P], its ratio to the plain model `lm`'s): each the best
    of `repeats` runs (the machine's own noise only ever adds time), the plain model's runs interleaved with the
    method's so that both see the same machine."""
    def run(m) -> float:
        c = generation_entropy_curve(m, prefixes, horizon, samples_per_prefix, seed=seed, max_batch=max_batch)
        return 1000.0 * c.generation_seconds / (c.num_generations * horizon)

    best, best_plain = math.inf, math.inf
    for _ in range(repeats):
        best = min(best, run(model))
        if model is not lm:
            best_plain = min(best_plain, run(lm))
    return best, (1.0 if model is lm else best / best_plain)
