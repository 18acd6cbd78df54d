"""Sampling that repeats exactly: counter-based uniforms (a pure function of seed, generation index and step, so a
generation's draws do not depend on how generations are batched, nor on the device), inverse-CDF draws from
probability rows, random prefixes of true text, and a model's state after reading one.
"""

from __future__ import annotations

import torch


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


def spread_windows(tokens: torch.Tensor, num: int, prefix_len: int, length: int
                   ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(prefixes [num, prefix_len], continuations [num, length], disjoint) cut from a 1-D token stream [S] at evenly
    spaced starts, first and last window at the stream's ends. The continuations are disjoint wherever the stream
    holds `num` of them (a prefix may run into the continuation before it: it is context only), so that each window
    is an independent unit of a standard error, as random starts at that density are not; otherwise they overlap as
    little as the stream allows, and `disjoint` is False."""
    span = prefix_len + length
    if prefix_len < 1 or length < 1 or num < 1 or tokens.numel() < span:
        raise ValueError(f"cannot cut {num} windows of {prefix_len} + {length} tokens from {tokens.numel()} tokens")
    room = tokens.numel() - span  # the last start
    starts = torch.zeros(1, dtype=torch.long) if num == 1 else torch.arange(num) * room // (num - 1)  # [num]
    w = tokens.cpu()[starts[:, None] + torch.arange(span)]  # [num, P + L]
    return w[:, :prefix_len], w[:, prefix_len:], bool(num == 1 or room // (num - 1) >= length)


_M32 = 0xFFFFFFFF


def read_prefix(lm, prefixes: torch.Tensor, state):
    """(log-probs [B, V] after the last token, state) of a StepLM that read prefixes [B, L] from `state`: in one
    forward where the model has one (prefill: a transformer reads a prompt at once), else token by token."""
    if hasattr(lm, "prefill"):
        return lm.prefill(prefixes, state)
    for i in range(prefixes.size(1)):
        logp, state = lm.step(prefixes[:, i], state)
    return logp, state


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


def absorb(h: torch.Tensor, k) -> torch.Tensor:
    return _mix32(((h ^ (k & _M32)) + 0x9E3779B9) & _M32)  # + golden-ratio constant: no all-zero fixed point


def uniforms(seed: int, gen_ids: torch.Tensor, t: int) -> torch.Tensor:
    """[B] float64 uniforms in [0, 1) with 53 random bits, a pure function of (seed, gen_ids [B], t)."""
    h = absorb(absorb(torch.full_like(gen_ids, seed & _M32), 0), gen_ids)
    hi, lo = absorb(h, 2 * t), absorb(h, 2 * t + 1)
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
