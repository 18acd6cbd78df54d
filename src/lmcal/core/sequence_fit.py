"""α* of the sequence-level calibrated family P̂_α ∝ P̂^(1+α), fitted on held-out text with sequential Monte Carlo.

On B held-out (prefix, continuation of T words) pairs, CE(α) per word is

    CE(α) = mean_b [-(1+α) log P̂(x_b | prefix_b) + log Z_α(prefix_b)] / T,

convex, and α* solves the moment condition mean_b E_P̂α[log P̂(W) | prefix_b] = mean_b log P̂(x_b | prefix_b)
(lmcal.core.sequence_exact derives both). The left side is increasing in α; each evaluation is one smc_generate with
the same seed (common random numbers), whose final weighted particles estimate E_P̂α[log P̂(W)] per prefix, and a
bracketed root finder solves it. The entropy rate of P̂_α* is estimated from the same run,

    EntRate(α) = mean_b [-(1+α) E_P̂α[log P̂(W) | prefix_b] + log Ẑ_b] / T,

so CE(α*) - EntRate(α*) = (1+α*) (moment gap) / T, zero at the root: a reader checks the paper's CE = EntRate from
the two numbers. Standard errors take the prefixes as the independent units: α* by the delta method, (standard
error of the mean moment gap) / (its slope, the mean over prefixes of Var_P̂α[log P̂(W)]); CE and EntRate by their
per-prefix terms at α* (CE is flat in α there, so α*'s own error enters at second order only). log Ẑ is biased low by
about half its variance: small with enough particles, and reported as the mean log Ẑ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lmcal.core.sequence_exact import bracketed_root
from lmcal.core.smc import SMCResult, smc_generate


@dataclass
class SequenceFit:
    alpha: float
    alpha_stderr: float
    ce: float  # CE(α*) per word, nats
    ce_stderr: float
    entropy_rate: float  # EntRate(P̂_α*) per word, nats
    entropy_rate_stderr: float
    ce_base: float  # CE(0): the plain model on the same continuations, per word
    ce_base_stderr: float
    ce_gain_stderr: float  # standard error of the paired CE(α*) - CE(0)
    slope: float  # d/dα of the mean moment at α*: mean_b Var_P̂α[log P̂(W)], nats² per sequence
    moment_gap: float  # mean_b (E_P̂α[log P̂(W)] - log P̂(x_b)) at α*: 0 up to the root finder's steps
    mean_log_z: float  # mean_b log Ẑ_b at α*
    horizon: int
    num_prefixes: int
    particles: int
    evaluations: int  # smc_generate runs
    result: SMCResult | None = None  # the run at α*


@torch.no_grad()
def sequence_log_probs(lm, prefixes: torch.Tensor, continuations: torch.Tensor, max_batch: int = 4096
                       ) -> torch.Tensor:
    """log P̂(continuation_b | prefix_b) [B] float64 for prefixes [B, P] and continuations [B, T]."""
    out = []
    for lo in range(0, prefixes.size(0), max_batch):
        text = torch.cat([prefixes[lo:lo + max_batch], continuations[lo:lo + max_batch]], 1)  # [n, P + T]
        state = lm.init_state(text.size(0))
        total = torch.zeros(text.size(0), dtype=torch.float64)
        for i in range(text.size(1) - 1):
            logp, state = lm.step(text[:, i], state)
            if i + 1 >= prefixes.size(1):
                total += logp.gather(1, text[:, i + 1].to(logp.device)[:, None])[:, 0].double().cpu()
        out.append(total)
    return torch.cat(out)


def fit_sequence_alpha(lm, prefixes: torch.Tensor, continuations: torch.Tensor, *, particles: int = 64,
                       seed: int = 0, bracket=(-0.5, 1.0), xtol: float = 1e-3, max_batch: int = 4096) -> SequenceFit:
    """α* on held-out prefixes [B, P] and their true continuations [B, T] (module docstring): every evaluation runs
    smc_generate(lm, prefixes, α, T, particles=particles, seed=seed)."""
    B, T = continuations.shape
    if B < 2 or prefixes.size(0) != B:
        raise ValueError(f"need at least 2 prefixes, one per continuation; got {prefixes.size(0)} and {B}")
    y = sequence_log_probs(lm, prefixes, continuations, max_batch)  # [B]
    runs: dict[float, SMCResult] = {}

    def run(a: float) -> SMCResult:
        if a not in runs:
            runs[a] = smc_generate(lm, prefixes, a, T, particles=particles, seed=seed, max_batch=max_batch)
        return runs[a]

    alpha = bracketed_root(lambda a: float((run(a).path_logp - y).mean()), bracket, xtol)
    r = run(alpha)
    gap = r.path_logp - y  # [B]
    slope = float(r.path_logp_var.mean())
    a1 = 1.0 + alpha
    ce_b = (-a1 * y + r.log_z) / T  # [B]: each prefix's CE term
    ent_b = (-a1 * r.path_logp + r.log_z) / T
    base_b = -y / T

    def se(x: torch.Tensor) -> float:
        return float(x.std() / math.sqrt(B))

    return SequenceFit(alpha, se(gap) / slope if slope > 0 else math.inf, float(ce_b.mean()), se(ce_b),
                       float(ent_b.mean()), se(ent_b), float(base_b.mean()), se(base_b), se(ce_b - base_b), slope,
                       float(gap.mean()), float(r.log_z.mean()), T, B, int(particles), len(runs), r)
