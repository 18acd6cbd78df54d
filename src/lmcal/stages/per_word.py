"""The per-word rows of the sequence_calibration stage: a sampler that draws one word at a time (the plain model, the
soft-value heads, the fitted temperature), its entropy curve from the stage's prefixes, its test CE paired word by
word with the model's, and its cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from lmcal.core.calibration import target_log_probs
from lmcal.core.entropy_rate import clustered_mean, generation_entropy_curve
from lmcal.stages.configs import SequenceCalibrationConfig
from lmcal.stages.rows import timed_generation
from lmcal.utils.numbers import exp_or_inf


@dataclass
class Bench:
    """What every per-word row is measured on and paired with: the stage's prefixes [N, P] and test stream
    [n, score_streams], the plain model's log-probabilities of that stream and its last-tenth entropies [N, S]."""

    lm: object
    s: SequenceCalibrationConfig
    valid: torch.Tensor
    prefixes: torch.Tensor
    test: torch.Tensor
    plain_logq: torch.Tensor | None = None
    plain_tail: np.ndarray | None = None


def word_row(method: str, params: dict, curve: np.ndarray, stderr: np.ndarray, tail: np.ndarray, plain_tail: np.ndarray,
         **columns) -> dict:
    """A per-word row (its own keys, fewer than rows.curve_row's): its curve [T], the last tenth's level (exp of the
    mean, with the standard error of the mean in nats, prefixes as clusters) and its paired difference from the
    model's (tail, plain_tail [N, S])."""
    level, level_se = clustered_mean(tail)
    diff, diff_se = clustered_mean(tail - plain_tail)
    return {"method": method, "params": params, "tail_ppl": exp_or_inf(float(level)),
            "tail_nats": float(level), "tail_ppl_stderr": exp_or_inf(float(level)) * float(level_se),
            "tail_stderr_nats": float(level_se), "tail_diff_nats": float(diff), "tail_diff_stderr_nats": float(diff_se),
            **columns, "curve_nats": [float(x) for x in curve], "stderr_nats": [float(x) for x in stderr]}


def word_test_ce(b: Bench, model) -> dict:
    """A per-word sampler's test CE on the stream, and its difference from the model's, paired word by word."""
    logq = b.plain_logq if model is b.lm else target_log_probs(model, b.test, progress=True)
    d = (logq - b.plain_logq).double().view(-1, b.s.score_streams).mean(0)  # [streams]: a stream is one unit
    return {"test_ce_nats": None if torch.isneginf(logq).any() else -logq.mean().item(),
            "test_ce_diff_nats": -float(d.mean()),
            "test_ce_diff_stderr_nats": float(d.std() / math.sqrt(b.s.score_streams))}


def word_timing(b: Bench, model) -> tuple[float, float]:
    """(ms per generated word, its ratio to the plain model's)."""
    s = b.s
    return timed_generation(model, b.lm, b.prefixes[:s.timing_prefixes], s.timing_horizon, s.samples_per_prefix,
                            s.seed, s.max_batch, s.timing_repeats)


def per_word_row(b: Bench, method: str, params: dict, model, seed: int | None = None, on: torch.Tensor | None = None,
              extra: dict | None = None) -> dict:
    """A per-word sampler's row: its entropy curve from the prefixes `on` (None: the stage's, paired with the model's)
    at `seed` (None: the stage's, and then timed), its test CE on the stream, its cost."""
    s = b.s
    seed = s.seed if seed is None else seed
    curve = generation_entropy_curve(model, b.prefixes if on is None else on, s.horizon, s.samples_per_prefix,
                                     seed=seed, max_batch=s.max_batch, progress=True)
    if b.plain_tail is None:  # the first row is the model's: what every row is paired with
        b.plain_tail = curve.tail
    ms, ratio = word_timing(b, model) if seed == s.seed else (None, None)
    return word_row(method, params, curve.mean, curve.stderr, curve.tail, b.plain_tail if on is None else curve.tail,
                curve_kind="entropy", **word_test_ce(b, model), ms_per_token=ms, cost_ratio=ratio, seed=seed,
                **(extra or {}))
