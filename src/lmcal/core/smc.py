"""The paper's Algorithm 1 for any StepLM, by sequential Monte Carlo: continuations drawn from the sequence-level
calibrated law P̂_α(w_1..T | prefix) ∝ P̂(w_1..T | prefix)^(1+α), untwisted or twisted.

Twisted SMC (Naesseth, Lindsten & Schön; Zhao et al. 2024). A twist ψ_t(h, w), a guess of the log soft value of the
words still to come after w at step t (0-based), shapes the intermediate targets

    γ_t(w_1..t+1) = prod_{j<=t} P̂(w_j | past)^(1+α) · exp(ψ_t(h, w_t+1)),     ψ_{T-1} = 0 (dropped at the last word),

so the final target is the untwisted law whatever the twist. Each particle proposes from

    q_t(w | h) = P̂(w | h)^(1+α) e^{ψ_t(h, w)} / G_t(h),     G_t(h) = sum_w P̂(w | h)^(1+α) e^{ψ_t(h, w)},

and its incremental weight γ_t / (γ_{t-1} q_t) = G_t(h) / e^{ψ_{t-1}(h', w')} (w' the word it drew before, from h')
depends only on the past: the particles are weighted before they propose (fully adapted), resampled (systematic) when
the effective sample size falls below half, and only then extended. No twist (ψ = 0) is the plain fully adapted
filter, G = sum_w P̂(w | h)^(1+α). The exact twist (the time-to-go values log b_{T-t-1}(next(s, w)) of a finite-state
model: lmcal.core.sequence_exact.exact_twist) makes every weight 1: one particle is an exact draw. A soft-value head
of the law's finite horizon, trained at the α sampled at (lmcal.core.soft_value.TwistAtAlpha), is the amortised guess;
the weights correct what it gets wrong, but at few particles their effective sample size can stay near 1 while the
law drawn is biased (lmcal.core.sequence_fit.reference_check tells). After the last word the
answer is one particle drawn from the final weights, with its ancestral path: a draw from P̂_α as the number of
particles grows, with a bias of order 1 / particles that a good twist makes small.

    Ẑ = prod over resampling epochs of (mean of the particles' weights accumulated since the last resampling)

is an unbiased estimate of Z_α(prefix) = E_P̂[P̂(W)^α], twisted or not (its log is biased low, by about half its
variance). The final weighted particles also give the law at nearby α by reweighting (`reweighted`): each particle's
weight times P̂(W)^(α' - α), smooth in α', which is what the fit of α* (lmcal.core.sequence_fit) solves on.

Every draw is inverse-CDF on counter-based uniforms (lmcal.core.sampling.uniforms): word draws keyed by the particle
(prefix index * particles + particle), resampling and the final pick by the prefix, with step-dependent counters, so
the result is a function of the seed only, however the prefixes are batched.

Cost per returned word: `particles` model steps, the twist's (a head: one small product a particle), plus a gather of
the state at each resampling (lm.select).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lmcal.core.lookahead import entropy
from lmcal.core.sampling import draw, read_prefix, uniforms
from lmcal.utils.progress import progress_bar


@dataclass
class SMCResult:
    tokens: torch.Tensor  # [B, T] long: the returned continuation of each prefix
    log_z: torch.Tensor  # [B] float64: log Ẑ, Ẑ unbiased for Z_α(prefix)
    ess: torch.Tensor  # [B, T] float64: effective sample size after step t's weights, before any resampling
    base_logp: torch.Tensor  # [B, T] float64: log P̂(w_t | past) along the returned path
    base_entropy: torch.Tensor  # [B, T] float64: entropy of P̂(. | past) before w_t, along the returned path
    path_logp: torch.Tensor  # [B] float64: E_P̂α[log P̂(W)] by the final weighted particles (E of base_logp.sum(1))
    path_logp_var: torch.Tensor  # [B] float64: Var_P̂α[log P̂(W)] by the final weighted particles (dm/dα per prefix)
    resamplings: torch.Tensor  # [B] long: how many times each prefix's particles were resampled
    final_log_weights: torch.Tensor  # [B, K] float64: the final particles' normalised log weights
    final_path_logp: torch.Tensor  # [B, K] float64: log P̂ of each final particle's whole path
    particles: int
    alpha: float = 0.0
    seconds: float = 0.0  # wall time of the generated words (the prefixes' feeding left out)


Twist = Callable[[object, int], torch.Tensor]  # twist(state, t) -> ψ_t [n, V] for the n rows in `state`


def reweighted(result: SMCResult, alpha: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The final weighted particles of a run at result.alpha, reweighted to the law at `alpha`: each weight times
    P̂(W)^(alpha - result.alpha). Returns per prefix (E_P̂α[log P̂(W)] [B], log Ẑ_α [B], Var_P̂α[log P̂(W)] [B]), all
    smooth in alpha (log Ẑ_α = log Ẑ + log sum_i w_i P̂(W_i)^(alpha - result.alpha), since Z_α / Z_α0 =
    E_P̂α0[P̂(W)^(α - α0)]). Exact at alpha = result.alpha; the further away, the fewer particles carry the weight."""
    lw = result.final_log_weights + (float(alpha) - result.alpha) * result.final_path_logp  # [B, K]
    w = lw.softmax(-1)
    path = result.final_path_logp
    mean = (w * path).sum(-1)
    return mean, result.log_z + lw.logsumexp(-1), (w * (path - mean[:, None]).pow(2)).sum(-1)


def entropy_rate(result: SMCResult) -> torch.Tensor:
    """The calibrated law's entropy per word over the whole horizon T, one estimate per prefix [B] (nats): log P̂_α(W)
    = (1+α) log P̂(W) - log Z_α, so a draw W gives -log P̂_α(W) / T, whose mean over draws is H(P̂_α(. | prefix)) / T:
    the paper's EntRate, which α* makes equal to the cross-entropy. With log Ẑ for log Z, biased low by about half
    log Ẑ's variance, over T."""
    return (-(1.0 + result.alpha) * result.base_logp.sum(1) + result.log_z) / result.tokens.size(1)


def shifted(twist: Twist | None, offset: int) -> Twist | None:
    """The twist of a run that starts `offset` words into the law's horizon (the nested runs of smc_tail_entropy)."""
    return None if twist is None or offset == 0 else (lambda state, t: twist(state, t + offset))


def systematic_resample(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Systematic resampling: ancestors [n, K] of rows of normalised weights [n, K], one uniform u [n] per row:
    particle i takes the first j with cumulative weight > (u + i) / K, so j has K w_j copies up to rounding."""
    K = weights.size(1)
    cum = weights.cumsum(-1)
    cum = cum / cum[:, -1:]  # ends at 1 exactly
    pos = (u[:, None] + torch.arange(K, dtype=cum.dtype, device=cum.device)) / K  # [n, K], each in [0, 1)
    return torch.searchsorted(cum, pos, right=True).clamp_(max=K - 1)


@torch.no_grad()
def smc_generate(lm, prefixes: torch.Tensor, alpha: float, horizon: int, *, particles: int = 64, seed: int = 0,
                 twist: Twist | None = None, ess_threshold: float = 0.5, max_batch: int = 4096,
                 progress: bool | str = False, first_id: int = 0) -> SMCResult:
    """One continuation of `horizon` words per prefix [B, P] (P >= 1), drawn from P̂_α(. | prefix) ∝ P̂^(1+α) by
    sequential Monte Carlo with `particles` particles per prefix (module docstring). alpha > -1; alpha = 0 without a
    twist is plain sampling (every weight 1, never resampled). twist: None, or twist(state, t) -> ψ_t [n, V] (float),
    the log-twist of each word w drawn at step t = 0..horizon-2 by the n rows whose state (lm's, after their history)
    is `state`; finite wherever P̂ > 0 (full support); not called at the last step, where ψ = 0. Prefixes are run in
    chunks of at most max_batch particles; `progress` (True, or the bar's name) reports them as they finish. Row b's
    draws are a pure function of (seed, first_id + b): rows split over calls, each given its first row's index, draw
    what one call over all of them draws."""
    B, P = prefixes.shape
    K = int(particles)
    if P < 1 or horizon < 1 or B < 1 or K < 1:
        raise ValueError(f"need a non-empty prefix, horizon and particles; got prefixes {tuple(prefixes.shape)}, "
                         f"horizon={horizon}, particles={particles}")
    if not alpha > -1:
        raise ValueError(f"need alpha > -1 (1 + alpha > 0), got {alpha}")
    a1 = 1.0 + float(alpha)
    per_chunk = max(1, max_batch // K)
    parts, seconds = [], 0.0
    bar = progress_bar(total=B * horizon, desc=progress if isinstance(progress, str) else f"SMC, {K} particles",
                       unit="word", disable=not progress)
    for lo in range(0, B, per_chunk):
        chunk = prefixes[lo:lo + per_chunk]
        logp, state = read_prefix(lm, chunk, lm.init_state(chunk.size(0)))  # [n, V]
        t0 = time.perf_counter()
        parts.append(_smc_chunk(lm, logp, state, first_id + lo, a1, horizon, K, seed, ess_threshold, twist))
        seconds += time.perf_counter() - t0
        bar.update(parts[-1]["tokens"].numel())
    bar.close()
    out = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    return SMCResult(**out, particles=K, alpha=float(alpha), seconds=seconds)


def _smc_chunk(lm, logp: torch.Tensor, state, lo: int, a1: float, horizon: int, K: int, seed: int,
               ess_threshold: float, twist: Twist | None) -> dict:
    n = logp.size(0)
    dev = logp.device
    R = n * K
    rows = torch.arange(n, device=dev).repeat_interleave(K)  # [R]: the prefix of each particle
    logp, state = logp[rows], lm.select(state, rows)
    prefix_ids = lo + torch.arange(n, device=dev)  # [n]: global, so the uniforms do not depend on the chunking
    particle_ids = prefix_ids.repeat_interleave(K) * K + torch.arange(K, device=dev).repeat(n)  # [R]
    first = (torch.arange(n, device=dev) * K)[:, None]  # [n, 1]: each prefix's first row
    logw = torch.zeros(n, K, dtype=torch.float64, device=dev)  # log weights accumulated since the last resampling
    log_z = torch.zeros(n, dtype=torch.float64, device=dev)
    path = torch.zeros(R, dtype=torch.float64, device=dev)  # log P̂ of each particle's path so far
    psi_prev = torch.zeros(R, dtype=torch.float64, device=dev)  # ψ_{t-1} of each particle's last word
    ess, resamplings = [], torch.zeros(n, dtype=torch.long, device=dev)
    words, logps, ents, ancestors = [], [], [], []  # per step, [R] each: the path is traced back at the end
    for t in range(horizon):
        psi = twist(state, t) if twist is not None and t < horizon - 1 else None  # [R, V]
        z = a1 * logp if psi is None else a1 * logp + psi.to(logp.device, logp.dtype)  # [R, V]
        log_g = z.logsumexp(-1)  # [R]: the incremental weight (over e^ψ_{t-1}), known before the word is drawn
        logw += (log_g.double() - psi_prev).view(n, K)
        w = logw.softmax(-1)  # [n, K]
        ess.append(1.0 / w.pow(2).sum(-1))
        resample = ess[-1] < ess_threshold * K  # [n]
        anc = torch.arange(R, device=dev)
        if bool(resample.any()):
            log_z += torch.where(resample, logw.logsumexp(-1) - math.log(K), 0.0)
            local = systematic_resample(w, uniforms(seed, prefix_ids, 3 * t + 1))  # [n, K]
            local = torch.where(resample[:, None], local, torch.arange(K, device=dev))
            anc = (first + local).reshape(-1)
            logw = torch.where(resample[:, None], 0.0, logw)
            resamplings += resample.long()
            logp, z, log_g, path, state = logp[anc], z[anc], log_g[anc], path[anc], lm.select(state, anc)
        word, _ = draw((z - log_g[:, None]).exp(), uniforms(seed, particle_ids, 3 * t))  # [R]
        lp = logp.gather(1, word[:, None])[:, 0].double()
        psi_prev = torch.zeros_like(path) if psi is None else z.gather(1, word[:, None])[:, 0].double() - a1 * lp
        path += lp
        words.append(word)
        logps.append(lp)
        ents.append(entropy(logp).double())
        ancestors.append(anc)
        if t < horizon - 1:
            logp, state = lm.step(word, state)
    log_z += logw.logsumexp(-1) - math.log(K)
    final = logw.log_softmax(-1)  # [n, K]
    w = final.exp()
    pick, _ = draw(w, uniforms(seed, prefix_ids, 3 * horizon + 2))  # [n]
    idx = first[:, 0] + pick  # [n]: the returned particle's row at the last step
    tokens, base_logp, base_ent = [], [], []
    for t in range(horizon - 1, -1, -1):  # trace the ancestry back
        tokens.append(words[t][idx])
        base_logp.append(logps[t][idx])
        base_ent.append(ents[t][idx])
        idx = ancestors[t][idx]
    path = path.view(n, K)
    mean = (w * path).sum(-1)
    return {"tokens": torch.stack(tokens[::-1], 1).cpu(), "log_z": log_z.cpu(), "ess": torch.stack(ess, 1).cpu(),
            "base_logp": torch.stack(base_logp[::-1], 1).cpu(), "base_entropy": torch.stack(base_ent[::-1], 1).cpu(),
            "path_logp": mean.cpu(), "path_logp_var": (w * (path - mean[:, None]).pow(2)).sum(-1).cpu(),
            "resamplings": resamplings.cpu(), "final_log_weights": final.cpu(), "final_path_logp": path.cpu()}


@torch.no_grad()
def smc_tail_entropy(lm, prefixes: torch.Tensor, result: SMCResult, alpha: float, start: int, stop: int, *,
                     particles: int = 16, seed: int = 0, max_batch: int = 4096, twist: Twist | None = None,
                     progress: bool = False, first_id: int = 0) -> torch.Tensor:
    """The calibrated law's entropy per word over words start..stop-1 of each returned path [B] (nats), for paths of
    `result` (smc_generate on prefixes [B, P], whose horizon T >= stop).

    Given the words before `start` (h), the words A = start..stop-1 and B = stop..T-1 follow P̂_α(A, B | h) ∝
    P̂(A, B | h)^(1+α), Algorithm 1 again from h. So H(A | h) = H(A, B | h) - H(B | h, A) =
    -(1+α) E log P̂(A | h) + log Z_AB(h) - E log Z_B(hA): the returned path gives log P̂(A | h) (a draw of A given h),
    and two more SMC runs from its own states give log Ẑ_AB and log Ẑ_B (none when stop = T). Averaged over paths it
    estimates the entropy rate of P̂_α over those words, with log Ẑ's downward bias (about half its variance; small
    with a good `twist`, the run's own, shifted to where the nested runs start). Cost: `particles` x (T - start) model
    steps a path, and the re-reading of each path's past."""
    T = result.tokens.size(1)
    if not 0 <= start < stop <= T:
        raise ValueError(f"need 0 <= start < stop <= horizon = {T}; got start={start}, stop={stop}")
    a1 = 1.0 + float(alpha)
    text = torch.cat([prefixes.cpu(), result.tokens], 1)  # [B, P + T]
    P = prefixes.size(1)
    kw = dict(particles=particles, max_batch=max_batch, first_id=first_id)  # path b's runs: row first_id + b
    desc = (lambda w: f"nested SMC from word {w}, {particles} particles") if progress else (lambda w: False)
    log_z_ab = smc_generate(lm, text[:, :P + start], alpha, T - start, seed=seed, twist=shifted(twist, start),
                            progress=desc(start), **kw).log_z
    log_z_b = (smc_generate(lm, text[:, :P + stop], alpha, T - stop, seed=seed + 1, twist=shifted(twist, stop),
                            progress=desc(stop), **kw).log_z if stop < T else torch.zeros_like(log_z_ab))
    log_pa = result.base_logp[:, start:stop].sum(1)  # [B]
    return (-a1 * log_pa + log_z_ab - log_z_b) / (stop - start)
