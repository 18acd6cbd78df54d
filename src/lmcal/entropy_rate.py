"""Entropy of a model's free-running generations, word by word (the paper's Figure 1 measurement).

Start from a prefix of true text, let the model generate, and record the entropy of its next-word distribution
before each generated word. A calibrated model keeps it flat at the entropy rate of the text; real LMs drift up.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from lmcal.lm import StepLM
from lmcal.profiling import span, timed
from lmcal.utils import exp_or_inf


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


def random_prefixes(tokens: torch.Tensor, num_prefixes: int, prefix_len: int, seed: int = 0) -> torch.Tensor:
    """[N, L] windows of a 1-D token stream [S] at uniformly random start points (distinct when there are enough)."""
    num_starts = tokens.numel() - prefix_len + 1
    if prefix_len < 1 or num_starts < 1:
        raise ValueError(f"cannot cut prefixes of length {prefix_len} from {tokens.numel()} tokens")
    g = torch.Generator().manual_seed(seed)
    if num_prefixes <= num_starts:
        starts = torch.randperm(num_starts, generator=g)[:num_prefixes]  # without replacement
    else:
        starts = torch.randint(num_starts, (num_prefixes,), generator=g)
    return tokens.cpu()[starts[:, None] + torch.arange(prefix_len)]  # [N, L]


# Sampling uses uniforms hashed from (seed, generation index, step), not a stateful generator: each generation's
# draws are then the same however the generations are chunked into batches, and on any device.

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for int64 x in [0, 2**32), in 16-bit halves of c so no product overflows int64."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's finaliser: a bijection of 32-bit integers in which every input bit flips half the output bits."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def _absorb(h: torch.Tensor, k) -> torch.Tensor:
    return _mix32(((h ^ (k & _M32)) + 0x9E3779B9) & _M32)  # + golden-ratio constant: no all-zero fixed point


def _uniforms(seed: int, gen_ids: torch.Tensor, t: int) -> torch.Tensor:
    """[B] float64 uniforms in [0, 1) with 53 random bits, a pure function of (seed, gen_ids [B], t)."""
    h = _absorb(_absorb(torch.full_like(gen_ids, seed & _M32), 0), gen_ids)
    hi, lo = _absorb(h, 2 * t), _absorb(h, 2 * t + 1)
    return ((hi >> 5) * 2**26 + (lo >> 6)).double() * 2.0**-53  # like numpy's random doubles: 27 + 26 bits


BLOCK = 128  # words per block of the two-level inverse CDF


def draw(p: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF sampling of rows p [B, V] (probabilities, unnormalised is fine) at uniforms u [B] in [0, 1):
    returns (words [B], each row's total mass [B] float64). Zero-probability words are never drawn.

    Two levels, so the [B, V] rows are read once (block sums, in p's dtype: 128 terms each) and only [B, 128] is
    summed in float64: the cumulative block masses pick a block, then the uniform's position inside that block's
    mass picks the word from the block's own float64 cumulative sum. Each word is drawn with its probability up to
    the block sum's rounding (about 1e-7 relative in float32), against a full float64 cumsum's 8 passes over [B, V]."""
    B, V = p.shape
    blk = min(BLOCK, V)
    full = V // blk
    mass = p[:, :full * blk].view(B, full, blk).sum(-1)  # [B, full]
    if full * blk < V:
        mass = torch.cat([mass, p[:, full * blk:].sum(-1, keepdim=True)], 1)  # [B, nb]: the short last block
    cum = mass.double().cumsum(-1)  # [B, nb]
    total = cum[:, -1]
    below = lambda x: torch.nextafter(x, torch.zeros_like(x))
    r = u * total
    r = torch.where(r < total, r, below(total))  # strictly inside the mass: a block with mass is always found
    b = torch.searchsorted(cum, r[:, None], right=True)[:, 0].clamp_(max=cum.size(1) - 1)  # first cum > r
    before = torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0)[:, None])[:, 0], 0.0)
    frac = ((r - before) / mass.gather(1, b[:, None])[:, 0].double()).clamp_(0.0, 1.0)  # position in the block
    cols = b[:, None] * blk + torch.arange(blk, device=p.device)  # [B, blk]
    inside = cols < V
    within = torch.where(inside, p.gather(1, cols.clamp(max=V - 1)), 0).double().cumsum(-1)  # [B, blk]
    r2 = frac * within[:, -1]
    r2 = torch.where(r2 < within[:, -1], r2, below(within[:, -1]))
    j = torch.searchsorted(within, r2[:, None], right=True)[:, 0].clamp_(max=blk - 1)
    return b * blk + j, total


@timed("generation")
@torch.no_grad()
def generation_entropy_curve(lm: StepLM, prefixes: torch.Tensor, horizon: int, samples_per_prefix: int,
                             seed: int = 0, max_batch: int = 4096, progress: bool = False) -> EntropyCurve:
    """Entropy (nats) of `lm`'s next-word distribution along its own generations from prefixes of true text.

    prefixes [N, L], L >= 1. Every generation starts from lm.init_state, is fed its L prefix tokens, then word t is
    sampled from lm's distribution after word t-1 (after the prefix for t = 1) and fed back. mean[t-1] averages the
    entropy of the distribution word t is sampled from over all N * samples_per_prefix generations.

    A StepLM may define start_generation(logp, state) -> (logp, state), called once after the prefix, before the first
    word is drawn: samplers with a running state (lmcal.decoders.MirostatLM) start it there.

    Each prefix is fed once and its state fanned out to its samples with lm.select; all generations advance together,
    in chunks of whole prefixes of at most max_batch rows (one prefix per chunk if samples_per_prefix > max_batch).
    Sampling is inverse-CDF on counter-based uniforms (`draw`), so results depend on `seed` only, not on max_batch
    (up to the model's own batch-size-dependent rounding). Entropies are summed in the model's dtype (float32 for
    the networks: about 1e-6 nats from float64).

    stderr treats the generations of one prefix as a cluster (they share the prefix, so they are correlated): it is
    std over prefixes of the per-prefix means / sqrt(N). With N = 1 it falls back to std over generations / sqrt(S).

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
    last = tail_steps(horizon)
    bar = tqdm(total=horizon * math.ceil(N / per_chunk), desc="generating", disable=not progress)
    gen_seconds = 0.0
    for lo in range(0, N, per_chunk):
        chunk = prefixes[lo:lo + per_chunk]  # [n, L]
        n = chunk.size(0)
        state = lm.init_state(n)
        if hasattr(lm, "prefill"):  # the prefix in one forward (HFCausalLM: and one row of logits)
            logp, state = lm.prefill(chunk, state)  # [n, V]
        else:
            for i in range(L):
                logp, state = lm.step(chunk[:, i], state)  # [n, V]
        if hasattr(lm, "start_generation"):  # samplers with a running state start it after the prompt (Mirostat)
            logp, state = lm.start_generation(logp, state)
        rows = torch.arange(n, device=logp.device).repeat_interleave(S)  # [n*S]: prefix of each generation
        logp, state = logp[rows], lm.select(state, rows)
        gen_ids = lo * S + torch.arange(n * S, device=logp.device)  # global generation index: seeds its uniforms
        ent = torch.empty(horizon, n * S, dtype=torch.float64, device=logp.device)
        finite = torch.ones(n * S, dtype=torch.bool, device=logp.device)  # checked once, after the loop: no syncs
        t_gen = time.perf_counter()
        for t in range(horizon):
            with span("entropy"):
                p = logp.exp()  # [n*S, V], the model's dtype
                # 0 log 0 = 0: a zero-probability word's 0 * -inf is nan, which nansum drops (one pass, no clamp)
                ent[t] = -(p * logp).nansum(-1).double()
            bar.update()
            if t == horizon - 1:
                break  # the last word's entropy is all we need from it
            with span("sampling"):
                tokens, mass = draw(p, _uniforms(seed, gen_ids, t))
                finite &= torch.isfinite(mass)  # a nan log-prob would hide in nansum; it shows in the mass
            logp, state = lm.step(tokens, state)
        if not bool(finite.all()):
            raise ValueError("the model gave non-finite log-probabilities (nan or +inf) during generation")
        ent = ent.view(horizon, n, S).cpu().numpy()  # (a device sync: the generation time below is complete)
        gen_seconds += time.perf_counter() - t_gen
        per_prefix[lo:lo + n] = ent.mean(axis=2).T
        tail[lo:lo + n] = ent[-last:].mean(axis=0)  # [n, S]
    bar.close()

    if N > 1:
        stderr = per_prefix.std(axis=0, ddof=1) / math.sqrt(N)
    elif S > 1:
        stderr = ent[:, 0, :].std(axis=1, ddof=1) / math.sqrt(S)  # the one chunk's generations
    else:
        stderr = np.full(horizon, np.nan)
    return EntropyCurve(per_prefix.mean(axis=0), stderr, N * S, N, S, per_prefix, tail, gen_seconds)
