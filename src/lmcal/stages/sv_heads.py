"""The sequence_calibration stage's soft-value heads (lmcal.core.soft_value), trained from the stage's settings: one
function, so that bench/sequence_fresh.py trains a finished run's heads again exactly (lmcal.stages.smc_fresh)."""

from __future__ import annotations

import logging

import torch

from lmcal.core.sampling import random_prefixes
from lmcal.core.soft_value import fit_soft_value_alpha, train_soft_value
from lmcal.data.batching import batchify

log = logging.getLogger("lmcal")


def train_heads(lm, train_tokens: torch.Tensor, valid_tokens: torch.Tensor, alpha: float, *, sv_rollouts: int,
                sv_prefix: int, sv_steps: int, sv_iterations: int, sv_backup_steps: int, sv_explore: float,
                sv_refits: int, hidden: int, rank: int, epochs: int, batch_size: int, lr: float, fit_tokens: int,
                fit_streams: int, prefix_len: int, seed: int, max_batch: int, name: str = "sequence_calibration"):
    """The stage's soft-value heads: trained at `alpha` on rollouts from the training text, their α refitted on their
    own per-word validation CE and the head retrained there `sv_refits` times (the stage's arguments of these names).
    A pure function of its arguments on one device, so a later run can train the same heads again. Returns (head on
    the model's device, its SoftValueAlpha, the iterations' history, the refits)."""
    starts = random_prefixes(train_tokens, sv_rollouts, sv_prefix, seed=seed + 3)
    head, history, refits, sv = None, [], [], None
    for r in range(sv_refits + 1):
        head, hist = train_soft_value(lm, alpha, starts, iterations=sv_iterations if r == 0 else
                                      max(1, sv_iterations // 2), steps=sv_steps, explore=sv_explore,
                                      backup_steps=sv_backup_steps, head=head, hidden=hidden, rank=rank,
                                      epochs=epochs, batch_size=batch_size, lr=lr, seed=seed + 100 * r,
                                      max_batch=max_batch)
        history += [{**h, "trained_at_alpha": alpha} for h in hist]
        sv = refit_alpha(lm, head, valid_tokens, fit_tokens, fit_streams, prefix_len)
        refits.append({"trained_at_alpha": alpha, "alpha": sv.alpha, "alpha_stderr": sv.alpha_stderr,
                       "valid_ce_before_nats": sv.ce_before, "valid_ce_after_nats": sv.ce_after})
        log.info(f"{name}: soft-value heads trained at alpha {alpha:.4f}: their own alpha {sv.alpha:.4f} +- "
                 f"{sv.alpha_stderr:.4f} (validation CE {sv.ce_before:.4f} -> {sv.ce_after:.4f})")
        alpha = sv.alpha
    return head.to(getattr(lm, "device", None) or "cpu"), sv, history, refits


def refit_alpha(lm, head, valid_tokens: torch.Tensor, fit_tokens: int, fit_streams: int, prefix_len: int):
    """The heads' own α on the first fit_tokens validation tokens (their exact per-word CE), as the stage fits it."""
    return fit_soft_value_alpha(lm, head, batchify(valid_tokens[:fit_tokens], fit_streams),
                                min_context=min(prefix_len, max(0, fit_tokens // fit_streams - 2)))
