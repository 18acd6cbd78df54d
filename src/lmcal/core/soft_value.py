"""Soft-value heads: the paper's Algorithm 1 amortised, at about the cost of ordinary sampling.

Written per word, the sequence-level calibrated law is P̂_α(w | h) ∝ P̂(w | h)^(1+α) exp(V(hw)), with the soft value
V(hw) = log E_P̂[P̂(rest | hw)^α] of the words still to come (lmcal.core.sequence_exact: V = log b). Over a long
horizon V grows by a constant ρ per word (log of the Perron root); the average-reward form drops that growth. The
relative value Q(h, w) ≈ V(hw) - const solves the soft Bellman equation

    Q(h, w) + ρ = log sum_w' P̂(w' | hw)^(1+α) exp(Q(hw, w')),

whose solution on a finite-state model is Q(h, w) = log(Perron vector at next(h, w)) + const, so that the sampler

    P(w | h) ∝ P̂(w | h)^(1+α) exp(Q(h, w))        (coefficient of Q tied to 1)

is the infinite-horizon limit P_∞ of Algorithm 1 exactly. A future-entropy head (core.future_entropy: the model's state
features -> Q [V], one [r, V] product a step, fused into the output layer for networks) learns Q by relative value
iteration on the states the current sampler visits:

  1. rollouts: rows read a prefix and run the sampler; a fraction `explore` of them take their first word uniformly
     at random (so words the sampler avoids, and what follows them, are still seen). Word w_i drawn in state h gives
     an example (h, w_i), with the backup b_i = log sum_w' P̂(w' | hw_i)^(1+α) exp(Q(hw_i, w')): the head at the next
     state, which the sampler computes anyway;
  2. ρ = mean of b_i - Q(h, w_i) over the rows that explored nothing (the sampler's own states), and residuals
     r_i = b_i - ρ - Q(h, w_i); the target of example i is Q(h, w_i) + r_i + ... + r_{i+n-1}, n = backup_steps
     along the sampled path. n = 1 is the one-step soft Bellman target; every residual vanishes at the fixed point,
     so a larger n only speeds the iteration up (n words of lookahead an iteration, not one), at the price of a
     Jensen bias off the fixed point;
  3. the head regresses on the targets (warm start), and the rollouts run again with it.
Iterating entropy heads with a free coefficient does not converge to this; the target must be the soft value.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcal.core.calibration import stream_block_stderr
from lmcal.core.expfit import fit_alpha, objective, with_targets
from lmcal.core.future_entropy import FutureCalibratedLM, FutureEntropyHead, regress, step_features, word_vectors
from lmcal.core.sampling import draw, uniforms


class FeatureStateLM:
    """A StepLM whose state carries the features of its last step beside the model's own state, (state, f [B, F]), so
    that a head on the features can be read from the state alone (`state_features`): for models whose state does not
    hold them (a Hugging Face cache). Same log-probs as `lm`, one step each."""

    def __init__(self, lm):
        self.lm, self.vocab_size, self.device = lm, lm.vocab_size, getattr(lm, "device", None)

    def init_state(self, batch_size: int):
        return self.lm.init_state(batch_size), None

    @torch.no_grad()
    def step(self, tokens, state):
        logp, f, inner = step_features(self.lm, tokens, state[0])
        return logp, (inner, f)

    def select(self, state, index):
        inner, f = state
        return self.lm.select(inner, index), None if f is None else f[index.to(f.device)]

    def state_features(self, state) -> torch.Tensor:
        return state[1]


class SoftValueTwist:
    """A soft-value head as the twist of twisted SMC (lmcal.core.smc.smc_generate): ψ_t(h, w) = Q(h, w), the head's
    relative value of each next word, the same at every step (the infinite-horizon value; the sampler drops it at the
    last word and its weights correct the rest). `lm`: the StepLM to run SMC on, the model itself where its state
    holds its features (the oracles, LSTMStepLM), else the model wrapped in FeatureStateLM.

        twist = soft_value_twist(model, head)
        smc_generate(twist.lm, prefixes, alpha, horizon, particles=4, twist=twist)
    """

    def __init__(self, lm, head: FutureEntropyHead):
        self.lm = lm if hasattr(lm, "state_features") else FeatureStateLM(lm)
        self.head = head.eval()

    @torch.no_grad()
    def __call__(self, state, t: int) -> torch.Tensor:
        f = self.lm.state_features(state)
        return self.head(f.to(next(self.head.parameters()).device)).to(f.device)  # [n, V] where the model runs


def soft_value_twist(lm, head: FutureEntropyHead) -> SoftValueTwist:
    """A soft-value head (train_soft_value) as a twist for smc_generate; run SMC on the returned twist's `.lm`."""
    return SoftValueTwist(lm, head)


def soft_value_lm(lm, head: FutureEntropyHead, alpha: float) -> FutureCalibratedLM:
    """The sampler P ∝ P̂^(1+α) e^Q as a StepLM (lmcal.core.future_entropy.FutureCalibratedLM with the head's coefficient
    1 and the power 1 + α: one product more than the model's a step)."""
    return FutureCalibratedLM(lm, head, 1.0, 1.0 + float(alpha))


@dataclass
class SoftValueExamples:
    features: torch.Tensor  # [n, F] float32: the state each word was drawn in
    words: torch.Tensor  # [n]
    values: torch.Tensor  # [n] float64: Q(h, w) of the head that ran the rollouts
    backups: torch.Tensor  # [n] float64: log sum_w' P̂(w' | hw)^(1+α) e^{Q(hw, w')}
    targets: torch.Tensor  # [n] float64: the n-step targets (module docstring)
    sampler_row: torch.Tensor  # [n] bool: the example's row ran the sampler from its first word
    group: torch.Tensor  # [n]: the rollout row
    rho: float  # the reward rate of these rollouts


def _explorers(gen: torch.Tensor, explore: float) -> torch.Tensor:
    """[B] bool: a fraction `explore` of consecutive row ids, spread evenly."""
    return torch.floor((gen + 1) * explore) > torch.floor(gen * explore)


def _q(head, f: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Q(h, .) [n, V] like `like`: the head is trained on the CPU (its examples are kept there) while the model may
    run on a GPU, so the features go to the head's device and Q comes back (0 without a head)."""
    if head is None:
        return torch.zeros_like(like)
    return head(f.to(next(head.parameters()).device)).to(like.device, like.dtype)


@torch.no_grad()
def soft_value_rollouts(lm, head: FutureEntropyHead | None, alpha: float, prefixes: torch.Tensor, steps: int, *,
                        explore: float = 0.5, backup_steps: int = 1, seed: int = 0, max_batch: int = 1024
                        ) -> SoftValueExamples:
    """Examples of step 1 of the module docstring from rows reading prefixes [R, P] and generating `steps` words with
    the sampler of `head` (None: Q = 0, the model's law to the power 1 + α). Model steps: R (P + steps)."""
    a1 = 1.0 + float(alpha)
    feats, words, values, backups, sampler_row = [], [], [], [], []
    for lo in range(0, prefixes.size(0), max_batch):
        chunk = prefixes[lo:lo + max_batch]
        state = lm.init_state(chunk.size(0))
        for i in range(chunk.size(1)):
            logp, f, state = step_features(lm, chunk[:, i], state)
        gen = lo + torch.arange(chunk.size(0), device=logp.device)
        explorer = _explorers(gen, explore)
        q = _q(head, f, logp)  # [n, V]
        rows = {k: [] for k in ("f", "w", "q", "b")}
        for i in range(steps):
            z = a1 * logp + q  # [n, V]
            p = (z - z.logsumexp(-1, keepdim=True)).exp()
            if i == 0:
                p = torch.where(explorer[:, None], torch.ones_like(p), p)  # uniform for the explorers
            w, _ = draw(p, uniforms(seed, gen, i))
            rows["f"].append(f.float().cpu())
            rows["w"].append(w.cpu())
            rows["q"].append(q.gather(1, w[:, None])[:, 0].double().cpu())
            logp, f, state = step_features(lm, w, state)
            q = _q(head, f, logp)
            rows["b"].append((a1 * logp + q).logsumexp(-1).double().cpu())
        feats.append(torch.stack(rows["f"], 1))  # [n, steps, F]
        words.append(torch.stack(rows["w"], 1))  # [n, steps]
        values.append(torch.stack(rows["q"], 1))
        backups.append(torch.stack(rows["b"], 1))
        sampler_row.append((~explorer.cpu())[:, None].expand(-1, steps))
    feats, words, values, backups, sampler_row = map(torch.cat, (feats, words, values, backups, sampler_row))
    R = words.size(0)
    # the reward rate on the sampler's own states: an explorer may sit in a closed class of another rate (noise)
    own = sampler_row if bool(sampler_row.any()) else torch.ones_like(sampler_row)  # explore = 1: every row
    rho = float((backups - values)[own].mean())
    resid = backups - rho - values  # [R, steps]
    cum = torch.cat([torch.zeros(R, 1, dtype=torch.float64), resid.cumsum(1)], 1)  # [R, steps + 1]
    end = (torch.arange(steps) + backup_steps).clamp(max=steps)  # sum of residuals i .. i + n - 1, cut at the end
    targets = values + cum[:, end] - cum[:, :steps]
    group = torch.arange(R)[:, None].expand(R, steps)
    return SoftValueExamples(feats.flatten(0, 1), words.reshape(-1), values.reshape(-1), backups.reshape(-1),
                             targets.reshape(-1), sampler_row.reshape(-1), group.reshape(-1), rho)


def new_head(lm, in_dim: int, *, hidden: int = 128, rank: int = 64, seed: int = 0) -> FutureEntropyHead:
    """A head with Q = 0 everywhere (its word matrix, word bias and level zero, the trunk random): its sampler starts as
    the model's law to the power 1 + α."""
    torch.manual_seed(seed)
    words = word_vectors(lm)  # on the model's device; the head lives on the CPU with its examples (_q)
    head = FutureEntropyHead(in_dim, lm.vocab_size, hidden=hidden, rank=rank,
                             words=None if words is None else words.cpu())
    with torch.no_grad():
        last = head.words if head.basis is None else head.proj.weight
        for p in (last, head.level.weight, head.level.bias, head.bias):
            p.zero_()
    return head.eval()


def fit_soft_value(head: FutureEntropyHead, features: torch.Tensor, words: torch.Tensor, targets: torch.Tensor, *,
                   epochs: int = 4, batch_size: int = 512, lr: float = 3e-3, seed: int = 0) -> dict:
    """Regress head(features, words) on targets (squared error, AdamW with a one-cycle schedule), warm from the head's
    weights. Returns {"rmse_nats", "r2"} on the examples themselves."""
    y = targets.float()
    regress(head, features, words, y, torch.arange(y.numel()), epochs=epochs, batch_size=batch_size, lr=lr,
            weight_decay=0.0, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        err = torch.cat([head(features[i], words[i]) for i in torch.arange(y.numel()).split(4096)]).double() - targets
    var = float(targets.var())
    return {"rmse_nats": float(err.pow(2).mean().sqrt()), "r2": 1 - float(err.pow(2).mean()) / var if var > 0 else None}


def train_soft_value(lm, alpha: float, prefixes: torch.Tensor, *, iterations: int = 20, steps: int = 20,
                     explore: float = 0.5, backup_steps: int = 1, head: FutureEntropyHead | None = None,
                     hidden: int = 128, rank: int = 64, epochs: int = 4, batch_size: int = 512, lr: float = 3e-3,
                     seed: int = 0, max_batch: int = 1024) -> tuple[FutureEntropyHead, list[dict]]:
    """Relative value iteration (module docstring) from `head`, or from Q = 0: each iteration rolls out from prefixes
    [R, P] with new draws, then regresses. Returns the head and, per iteration, {"rho", "rmse_nats", "r2"}."""
    if head is None:
        with torch.no_grad():
            _, f, _ = step_features(lm, prefixes[:1, 0], lm.init_state(1))
        head = new_head(lm, f.size(1), hidden=hidden, rank=rank, seed=seed)
    history = []
    for k in range(iterations):
        ex = soft_value_rollouts(lm, head, alpha, prefixes, steps, explore=explore, backup_steps=backup_steps,
                                 seed=seed + 1000 * k, max_batch=max_batch)
        stats = fit_soft_value(head, ex.features, ex.words, ex.targets, epochs=epochs, batch_size=batch_size, lr=lr,
                               seed=seed + k)
        history.append({"rho": ex.rho, **stats})
    return head, history


@dataclass
class SoftValueAlpha:
    alpha: float
    alpha_stderr: float  # sandwich, blocks of cluster_size positions of a stream as the units
    ce_before: float  # CE of P̂ e^Q (α = 0) on the rows, nats
    ce_after: float  # CE of P̂^(1+α*) e^Q
    positions: int


@torch.no_grad()
def fit_soft_value_alpha(lm, head: FutureEntropyHead, tokens: torch.Tensor, *, min_context: int = 0,
                         cluster_size: int = 100, bound: float = 10.0) -> SoftValueAlpha:
    """α of the amortised sampler P ∝ P̂^(1+α) e^Q fitted on its own exact per-word cross-entropy: time-major held-out
    streams tokens [S, B], the positions after the first `min_context` of each stream. With the head's Q fixed the
    family is exponential in α (base P̂ e^Q, statistic log P̂: lmcal.core.expfit), so the fit is Newton's method on the
    exact objective. The head was trained at some α; refit and retrain alternate until they agree (the stage does).
    Memory: 2 rows of [B, V] float32 per position."""
    S, B = tokens.shape
    state = lm.init_state(B)
    base, stat, ys = [], [], []
    for t in range(S - 1):
        logp, f, state = step_features(lm, tokens[t], state)  # [B, V], [B, F]
        if t < min_context:
            continue
        q = _q(head, f.float(), logp)  # [B, V]
        base.append((logp + q).log_softmax(-1).float().cpu())
        stat.append(logp.float().clamp(min=-1e4).cpu())  # a word of probability 0: e^-1e4 is 0 too, and finite
        ys.append(tokens[t + 1].cpu())
    if not ys:
        raise ValueError(f"no positions after min_context={min_context} in streams of {S} tokens")
    rows = with_targets(torch.cat(base), torch.cat(stat), torch.cat(ys))
    alpha = fit_alpha([rows], bound, clamp=True, what="soft-value alpha fit")
    ce_before = objective([rows], 0.0)[0]
    (ce_after, _, d2, _), g = objective([rows], alpha, per_row=True)
    return SoftValueAlpha(alpha, stream_block_stderr(g, d2, B, cluster_size), ce_before, ce_after, g.numel())
