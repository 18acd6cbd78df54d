"""Entropy of a model's free-running generations, word by word (the paper's Figure 1 measurement).

Start from a prefix of true text, let the model generate, and record the entropy of its next-word distribution
before each generated word. A calibrated model keeps it flat at the entropy rate of the text; real LMs drift up.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from lmcal.core.sampling import draw, read_prefix, uniforms
from lmcal.utils.numbers import exp_or_inf
from lmcal.utils.profiling import span, timed
from lmcal.utils.progress import progress_bar

if TYPE_CHECKING:
    from lmcal.models.step_lm import StepLM


@dataclass
class EntropyCurve:
    mean: np.ndarray  # [horizon] float64, nats: mean[t-1] = E[entropy before generated word t]
    stderr: np.ndarray  # [horizon] float64: standard error of `mean`, prefixes as clusters (see below)
    num_generations: int
    num_prefixes: int
    samples_per_prefix: int
    per_prefix: np.ndarray  # [N, horizon] float64: the mean over each prefix's generations
    tail: np.ndarray  # [N, S] float64: each generation's mean entropy over the last tenth of the horizon (tail_steps)
    generation_seconds: float = 0.0  # wall time of the generated words (the prefixes' feeding left out)
    kept: np.ndarray | None = None  # [keep, horizon - 1] int64: the words of generations 0..keep-1 (keep > 0)

    @property
    def tail_mean(self) -> float:
        """The mean entropy over the last tenth of the horizon, all generations (nats)."""
        return float(self.tail.mean())


def tail_steps(horizon: int) -> int:
    """How many last steps 'the last tenth of the horizon' is: max(1, horizon // 10)."""
    return max(1, horizon // 10)


def clustered_mean(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean over generations of x [N, S, ...] (N prefixes, S generations each) and its standard error with prefixes
    as clusters: std over the N per-prefix means / sqrt(N); with N = 1, std over the S generations / sqrt(S); nan
    with one generation."""
    N, S = x.shape[:2]
    per_prefix = x.mean(axis=1)  # [N, ...]
    if N > 1:
        se = per_prefix.std(axis=0, ddof=1) / math.sqrt(N)
    elif S > 1:
        se = x[0].std(axis=0, ddof=1) / math.sqrt(S)
    else:
        se = np.full(x.shape[2:], np.nan)
    return per_prefix.mean(axis=0), se


def paired_tail_difference(curve: EntropyCurve, reference: EntropyCurve) -> tuple[float, float]:
    """(mean over generations of curve's tail entropy minus reference's, its standard error clustered by prefix), in
    nats. Paired: generation i of both must start from the same prefix with the same uniforms (the same prefixes,
    samples_per_prefix and seed of generation_entropy_curve), so most of the noise of the two cancels."""
    if curve.tail.shape != reference.tail.shape:
        raise ValueError(f"unpaired curves: {curve.tail.shape} against {reference.tail.shape} generations")
    diff, se = clustered_mean(curve.tail - reference.tail)  # [N, S] -> scalars
    return float(diff), float(se)


def paired_difference_curve(curve: EntropyCurve, reference: EntropyCurve) -> tuple[np.ndarray, np.ndarray]:
    """The paired difference of two curves at every t: (mean [horizon], standard error [horizon]) over prefixes,
    clustered by prefix (from the per-prefix means; nan with one prefix)."""
    if curve.per_prefix.shape != reference.per_prefix.shape:
        raise ValueError(f"unpaired curves: {curve.per_prefix.shape} against {reference.per_prefix.shape}")
    return clustered_mean((curve.per_prefix - reference.per_prefix)[:, None])  # [N, 1, horizon]: a prefix as one


def entrate_ppl(curve: EntropyCurve) -> float:
    """exp of the entropy at the last generated step: the 'EntRate' perplexity of the paper's tables."""
    return float(exp_or_inf(curve.mean[-1]))


def _chunk_entropies(lm: StepLM, chunk: torch.Tensor, lo: int, horizon: int, S: int, seed: int, bar,
                     kept: list | None, keep: int) -> np.ndarray:
    """The entropies [horizon, n, S] of S generations from each of the n prefixes of `chunk` (prefixes lo.. of the
    whole set, which seeds their uniforms); the first `keep` generations' words appended to `kept` where given."""
    n = chunk.size(0)
    logp, state = read_prefix(lm, chunk, lm.init_state(n))  # [n, V]
    if hasattr(lm, "start_generation"):  # samplers with a running state start it after the prompt (Mirostat)
        logp, state = lm.start_generation(logp, state)
    rows = torch.arange(n, device=logp.device).repeat_interleave(S)  # [n*S]: prefix of each generation
    logp, state = logp[rows], lm.select(state, rows)
    gen_ids = lo * S + torch.arange(n * S, device=logp.device)  # global generation index: seeds its uniforms
    ent = torch.empty(horizon, n * S, dtype=torch.float64, device=logp.device)
    finite = torch.ones(n * S, dtype=torch.bool, device=logp.device)  # checked once, after the loop: no syncs
    for t in range(horizon):
        with span("entropy"):
            p = logp.exp()  # [n*S, V], the model's dtype
            # 0 log 0 = 0: a zero-probability word's 0 * -inf is nan, which nansum drops (one pass, no clamp)
            ent[t] = -(p * logp).nansum(-1).double()
        bar.update()
        if t == horizon - 1:
            break  # the last word's entropy is all we need from it
        with span("sampling"):
            tokens, mass = draw(p, uniforms(seed, gen_ids, t))
            finite &= torch.isfinite(mass)  # a nan log-prob would hide in nansum; it shows in the mass
        if kept is not None:
            kept.append(tokens[:keep])
        logp, state = lm.step(tokens, state)
    if not bool(finite.all()):
        raise ValueError("the model gave non-finite log-probabilities (nan or +inf) during generation")
    return ent.view(horizon, n, S).cpu().numpy()  # (a device sync: the generation time is complete)


@timed("generation")
@torch.no_grad()
def generation_entropy_curve(lm: StepLM, prefixes: torch.Tensor, horizon: int, samples_per_prefix: int,
                             seed: int = 0, max_batch: int = 4096, progress: bool = False,
                             keep: int = 0) -> EntropyCurve:
    """Entropy (nats) of `lm`'s next-word distribution along its own generations from prefixes of true text.

    prefixes [N, L], L >= 1. Every generation starts from lm.init_state, is fed its L prefix tokens, then word t is
    sampled from lm's distribution after word t-1 (after the prefix for t = 1) and fed back. mean[t-1] averages the
    entropy of the distribution word t is sampled from over all N * samples_per_prefix generations.

    A StepLM may define start_generation(logp, state) -> (logp, state), called once after the prefix, before the first
    word is drawn: samplers with a running state (lmcal.core.decoders.MirostatLM) start it there.

    Each prefix is fed once and its state fanned out to its samples with lm.select; all generations advance together,
    in chunks of whole prefixes of at most max_batch rows (one prefix per chunk if samples_per_prefix > max_batch).
    Sampling is inverse-CDF on counter-based uniforms (`draw`), so results depend on `seed` only, not on max_batch
    (up to the model's own batch-size-dependent rounding). Entropies are summed in the model's dtype (float32 for
    the networks: about 1e-6 nats from float64).

    stderr treats the generations of one prefix as a cluster (they share the prefix, so they are correlated): it is
    std over prefixes of the per-prefix means / sqrt(N). With N = 1 it falls back to std over generations / sqrt(S).

    `keep` > 0 also keeps the words of the first `keep` generations (of the first chunk: generation g reads prefix
    g // samples_per_prefix), to be shown as text.

    `tail` keeps each generation's mean entropy over the last tenth of the horizon, so that two models run on the
    same prefixes and seed compare generation by generation (paired_tail_difference): generation i of both reads the
    same prefix and the same uniforms, and a model's own randomness (the calibrated model's tail draws) comes from
    elsewhere, never from these uniforms.
    """
    N, L = prefixes.shape
    S = samples_per_prefix
    if L < 1 or horizon < 1 or S < 1 or N < 1:
        raise ValueError(f"need a non-empty prefix, horizon and samples; got prefixes {tuple(prefixes.shape)}, "
                         f"horizon={horizon}, samples_per_prefix={S}")
    per_chunk = max(1, max_batch // S)  # prefixes per chunk
    per_prefix = np.empty((N, horizon))
    tail = np.empty((N, S))
    bar = progress_bar(total=horizon * math.ceil(N / per_chunk), desc="generating", disable=not progress)
    gen_seconds = 0.0
    kept = []  # [keep] tokens per generated word, first chunk only
    for lo in range(0, N, per_chunk):
        chunk = prefixes[lo:lo + per_chunk]  # [n, L]
        n = chunk.size(0)
        t_gen = time.perf_counter()
        ent = _chunk_entropies(lm, chunk, lo, horizon, S, seed, bar, kept if keep and lo == 0 else None, keep)
        gen_seconds += time.perf_counter() - t_gen
        per_prefix[lo:lo + n] = ent.mean(axis=2).T
        tail[lo:lo + n] = ent[-tail_steps(horizon):].mean(axis=0)  # [n, S]
    bar.close()
    # prefixes as clusters; with one prefix, over the generations of its one chunk
    _, stderr = clustered_mean(per_prefix[:, None] if N > 1 else ent.transpose(1, 2, 0))  # [N, 1, h] or [1, S, h]
    words = torch.stack(kept, 1).cpu().numpy() if kept else None  # [keep, horizon - 1]
    return EntropyCurve(per_prefix.mean(axis=0), stderr, N * S, N, S, per_prefix, tail, gen_seconds, words)
