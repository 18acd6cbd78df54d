"""The sequence_calibration stage's soft-value heads (lmcal.core.soft_value), trained from the stage's settings: a pure
function of them on one device, so that a later run can train the same heads again."""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from lmcal.core.sampling import random_prefixes
from lmcal.core.soft_value import SoftValueTraining, TwistAtAlpha, fit_soft_value_alpha, train_soft_value
from lmcal.data.batching import batchify

log = logging.getLogger("lmcal")


def train_heads(lm, train_tokens: torch.Tensor, valid_tokens: torch.Tensor, alpha: float, s):
    """The stage's soft-value heads: trained at `alpha` on rollouts from the training text, their α refitted on their
    own per-word validation CE and the head retrained there `s.sv_refits` times (s: the stage's settings, a
    SequenceCalibrationConfig). Returns (head on the model's device, its SoftValueAlpha, the iterations' history,
    the refits)."""
    starts = random_prefixes(train_tokens, s.sv_rollouts, s.sv_prefix, seed=s.seed + 3)
    head, history, refits, sv = None, [], [], None
    first, again = training(s)
    for r in range(s.sv_refits + 1):
        head, hist = train_soft_value(lm, alpha, starts, first if r == 0 else again, head=head, seed=s.seed + 100 * r)
        history += [{**h, "trained_at_alpha": alpha} for h in hist]
        sv = refit_alpha(lm, head, valid_tokens, s.fit_tokens, s.fit_streams, s.prefix_len)
        refits.append({"trained_at_alpha": alpha, "alpha": sv.alpha, "alpha_stderr": sv.alpha_stderr,
                       "valid_ce_before_nats": sv.ce_before, "valid_ce_after_nats": sv.ce_after})
        log.info(f"sequence_calibration: soft-value heads trained at alpha {alpha:.4f}: their own alpha "
                 f"{sv.alpha:.4f} +- {sv.alpha_stderr:.4f} (validation CE {sv.ce_before:.4f} -> {sv.ce_after:.4f})")
        alpha = sv.alpha
    return head.to(getattr(lm, "device", None) or "cpu"), sv, history, refits


def refit_alpha(lm, head, valid_tokens: torch.Tensor, fit_tokens: int, fit_streams: int, prefix_len: int):
    """The heads' own α on the first fit_tokens validation tokens (their exact per-word CE), as the stage fits it."""
    return fit_soft_value_alpha(lm, head, batchify(valid_tokens[:fit_tokens], fit_streams),
                                min_context=min(prefix_len, max(0, fit_tokens // fit_streams - 2)))


def training(s) -> tuple[SoftValueTraining, SoftValueTraining]:
    """The heads' first training and their retraining from a trained head (half the rounds), from the settings."""
    first = SoftValueTraining(iterations=s.sv_iterations, steps=s.sv_steps, explore=s.sv_explore,
                              backup_steps=s.sv_backup_steps, hidden=s.hidden, rank=s.rank, epochs=s.epochs,
                              batch_size=s.batch_size, lr=s.lr, max_batch=s.max_batch)
    return first, replace(first, iterations=max(1, s.sv_iterations // 2))


def horizon_twists(lm, train_tokens: torch.Tensor, s, horizon: int, alpha: float) -> TwistAtAlpha:
    """The twist of the SMC rows: a finite-horizon head over the law's `horizon` words, trained at `alpha` on
    rollouts from the training text (the per-word heads' starting points), and retrained at each α a row samples at
    beyond the fit's tolerance (s.xtol), so that every row samples with a twist made for its own α."""
    starts = random_prefixes(train_tokens, s.sv_rollouts, s.sv_prefix, seed=s.seed + 3)
    first, again = training(s)
    log.info(f"sequence_calibration: the twist's finite-horizon head, {horizon} words, trained at alpha {alpha:.4f}")
    return TwistAtAlpha(lm, starts, horizon, alpha, training=first, retrain=again, tol=s.xtol, seed=s.seed + 50)
