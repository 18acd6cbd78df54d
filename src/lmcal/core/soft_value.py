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

The twist of SMC over a finite law of L words needs the finite-horizon values instead: near the law's end few words are
left, the value of the future falls to 0, and an infinite-horizon twist kept to the end biases the fitted α* (the
weights correct it only with many particles). A horizon head reads the words left, r, beside the state's features
(words_left_features: exp(-r / τ) at a few scales); its rollouts run from the prefix to the law's end along SMC's own
proposal, with backups that are exact at the last word (whose twist is 0), and the reward rate taken out step by step
(a constant per step cancels from SMC's weights). A twist is also made for one α: TwistAtAlpha retrains it, warm, at
each α a fit runs at.
"""

from __future__ import annotations

import copy
import math
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


HORIZON_SCALES = (1, 2, 4, 8, 16, 32, 64, 128)  # words: the decay lengths of a horizon head's extra inputs


def words_left_features(words_left: int, n: int, device=None) -> torch.Tensor:
    """[n, len(HORIZON_SCALES)]: exp(-r / τ) for each scale τ, r >= 0 the words still to come after the word a twist
    values: near 1 a word before the law's end, 0 at an infinite horizon. A horizon head reads them beside the model's
    features, so that its values fall to the few words left as the end nears (the finite-horizon soft values)."""
    r = max(int(words_left), 0)
    return torch.tensor([math.exp(-r / s) for s in HORIZON_SCALES], device=device).expand(n, -1)


def _head_input(f: torch.Tensor, words_left: int | None) -> torch.Tensor:
    """The head's input [n, F (+ len(HORIZON_SCALES))]: the features, and the words left where the head knows them."""
    if words_left is None:
        return f
    return torch.cat([f.float(), words_left_features(words_left, f.size(0), f.device)], 1)


class SoftValueTwist:
    """A soft-value head as the twist of twisted SMC (lmcal.core.smc.smc_generate). With `horizon` (a head trained by
    train_soft_value at that horizon), ψ_t(h, w) is the head's finite-horizon value of w with horizon - 1 - t words
    still to come, which falls to the few words left as the law's end nears; without, the head's infinite-horizon
    relative value Q(h, w), the same at every step, which overvalues the future near the end (the weights must then
    correct a wrong twist over the last words, and at few particles they do not). `lm`: the StepLM to run SMC on, the
    model itself where its state holds its features (the oracles, LSTMStepLM), else the model in FeatureStateLM.

        twist = soft_value_twist(model, head, horizon=L)
        smc_generate(twist.lm, prefixes, alpha, L, particles=4, twist=twist)
    """

    def __init__(self, lm, head: FutureEntropyHead, horizon: int | None = None):
        self.lm = lm if hasattr(lm, "state_features") else FeatureStateLM(lm)
        self.head, self.horizon = head.eval(), horizon

    @torch.no_grad()
    def __call__(self, state, t: int) -> torch.Tensor:
        f = self.lm.state_features(state)
        left = None if self.horizon is None else self.horizon - 1 - t
        x = _head_input(f, left)
        return self.head(x.to(next(self.head.parameters()).device)).to(f.device)  # [n, V] where the model runs


def soft_value_twist(lm, head: FutureEntropyHead, horizon: int | None = None) -> SoftValueTwist:
    """A soft-value head (train_soft_value) as a twist for smc_generate; run SMC on the returned twist's `.lm`.
    `horizon`: the law's, for a head trained at a finite horizon (its input has the words left)."""
    return SoftValueTwist(lm, head, horizon)


def soft_value_lm(lm, head: FutureEntropyHead, alpha: float) -> FutureCalibratedLM:
    """The sampler P ∝ P̂^(1+α) e^Q as a StepLM (lmcal.core.future_entropy.FutureCalibratedLM with the head's coefficient
    1 and the power 1 + α: one product more than the model's a step)."""
    return FutureCalibratedLM(lm, head, 1.0, 1.0 + float(alpha))


@dataclass(frozen=True)
class SoftValueTraining:
    """How train_soft_value learns a head: rounds of rollouts, then regression on their targets."""

    iterations: int = 20  # rounds
    steps: int = 20  # words each rollout samples (infinite horizon; a finite one rolls out to the law's end)
    explore: float = 0.5  # the share of rollouts whose first word is uniform
    backup_steps: int = 1  # soft Bellman residuals summed along the path into each target
    hidden: int = 128  # a new head's width ...
    rank: int = 64  # ... and the rank of its word map
    epochs: int = 4  # regression passes per round
    batch_size: int = 512
    lr: float = 3e-3
    max_batch: int = 1024  # rollout rows side by side


@dataclass
class SoftValueExamples:
    features: torch.Tensor  # [n, F] float32: the head's input in the state each word was drawn in
    words: torch.Tensor  # [n]
    values: torch.Tensor  # [n] float64: Q(h, w) of the head that ran the rollouts
    backups: torch.Tensor  # [n] float64: log sum_w' P̂(w' | hw)^(1+α) e^{Q(hw, w')}
    targets: torch.Tensor  # [n] float64: the n-step targets (module docstring)
    sampler_row: torch.Tensor  # [n] bool: the example's row ran the sampler from its first word
    group: torch.Tensor  # [n]: the rollout row
    rho: float  # the reward rate of these rollouts (a finite horizon: its mean over the steps)


def _explorers(gen: torch.Tensor, explore: float) -> torch.Tensor:
    """[B] bool: a fraction `explore` of consecutive row ids, spread evenly."""
    return torch.floor((gen + 1) * explore) > torch.floor(gen * explore)


def _q(head, f: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Q(h, .) [n, V] like `like`: the head is trained on the CPU (its examples are kept there) while the model may
    run on a GPU, so the features go to the head's device and Q comes back (0 without a head)."""
    if head is None:
        return torch.zeros_like(like)
    return head(f.to(next(head.parameters()).device)).to(like.device, like.dtype)


def _rollout_chunk(lm, head, chunk: torch.Tensor, lo: int, a1: float, steps: int, horizon: int | None,
                   explore: float, seed: int) -> dict[str, torch.Tensor]:
    """One chunk of rows [n, P]: read the prefix, then draw `steps` words from P̂^(1+α) e^ψ. Per word i [n, steps]:
    the head's input, the word, ψ of the word, and the backup at the next state (ψ of a finite horizon's last word
    is 0)."""
    def inputs(f, i):  # the head's input for word i
        return _head_input(f.float(), None if horizon is None else horizon - 1 - i)

    def psi(f, logp, i):  # ψ of word i's candidates [n, V]
        return torch.zeros_like(logp) if horizon is not None and i >= horizon - 1 else _q(head, inputs(f, i), logp)

    state = lm.init_state(chunk.size(0))
    for i in range(chunk.size(1)):
        logp, f, state = step_features(lm, chunk[:, i], state)
    gen = lo + torch.arange(chunk.size(0), device=logp.device)
    explorer = _explorers(gen, explore)
    q = psi(f, logp, 0)  # [n, V]
    rows = {k: [] for k in ("f", "w", "q", "b")}
    for i in range(steps):
        z = a1 * logp + q  # [n, V]
        p = (z - z.logsumexp(-1, keepdim=True)).exp()
        if i == 0:
            p = torch.where(explorer[:, None], torch.ones_like(p), p)  # uniform for the explorers
        w, _ = draw(p, uniforms(seed, gen, i))
        rows["f"].append(inputs(f, i).float().cpu())
        rows["w"].append(w.cpu())
        rows["q"].append(q.gather(1, w[:, None])[:, 0].double().cpu())
        logp, f, state = step_features(lm, w, state)
        q = psi(f, logp, i + 1)
        rows["b"].append((a1 * logp + q).logsumexp(-1).double().cpu())
    out = {k: torch.stack(v, 1) for k, v in rows.items()}  # [n, steps, F] and [n, steps]
    out["own"] = (~explorer.cpu())[:, None].expand(-1, steps)
    return out


@torch.no_grad()
def soft_value_rollouts(lm, head: FutureEntropyHead | None, alpha: float, prefixes: torch.Tensor, steps: int, *,
                        horizon: int | None = None, explore: float = 0.5, backup_steps: int = 1, seed: int = 0,
                        max_batch: int = 1024) -> SoftValueExamples:
    """Examples of step 1 of the module docstring from rows reading prefixes [R, P] and generating `steps` words with
    the sampler of `head` (None: Q = 0, the model's law to the power 1 + α). Model steps: R (P + steps).

    horizon L (then steps = L - 1): the finite-horizon values that twisted SMC over L words needs. The rows draw from
    SMC's proposal P̂^(1+α) e^{ψ_t}, ψ_t the head's value with L - 1 - t words left; the backups run to the law's end,
    where they are exact (ψ of the last word is 0). The reward rate is taken out step by step (ρ_t: a constant per
    step cancels from SMC's normalised weights, so the head need only learn the values within a step)."""
    if horizon is not None and steps != horizon - 1:
        raise ValueError(f"a finite horizon of {horizon} words rolls out {horizon - 1} examples, not {steps}")
    parts = [_rollout_chunk(lm, head, prefixes[lo:lo + max_batch], lo, 1.0 + float(alpha), steps, horizon, explore,
                            seed) for lo in range(0, prefixes.size(0), max_batch)]
    feats, words, values, backups, own = (torch.cat([p[k] for p in parts]) for k in ("f", "w", "q", "b", "own"))
    R = words.size(0)
    # the reward rate on the sampler's own states: an explorer may sit in a closed class of another rate (noise)
    own = own if bool(own.any()) else torch.ones_like(own)  # explore = 1: every row
    gain = (backups - values).masked_fill(~own, 0.0)  # [R, steps]
    rho = gain.sum(0) / own.sum(0) if horizon is not None else (backups - values)[own].mean().expand(steps)  # [steps]
    resid = backups - rho - values  # [R, steps]
    cum = torch.cat([torch.zeros(R, 1, dtype=torch.float64), resid.cumsum(1)], 1)  # [R, steps + 1]
    end = (torch.arange(steps) + backup_steps).clamp(max=steps)  # sum of residuals i .. i + n - 1, cut at the end
    targets = values + cum[:, end] - cum[:, :steps]
    group = torch.arange(R)[:, None].expand(R, steps)
    return SoftValueExamples(feats.flatten(0, 1), words.reshape(-1), values.reshape(-1), backups.reshape(-1),
                             targets.reshape(-1), own.reshape(-1), group.reshape(-1), float(rho.mean()))


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


def head_inputs(head: FutureEntropyHead) -> int:
    """The width of the head's input."""
    return head.trunk[0].in_features


def train_soft_value(lm, alpha: float, prefixes: torch.Tensor, training: SoftValueTraining = SoftValueTraining(), *,
                     horizon: int | None = None, head: FutureEntropyHead | None = None, seed: int = 0
                     ) -> tuple[FutureEntropyHead, list[dict]]:
    """Relative value iteration (module docstring) from `head`, or from Q = 0: each iteration rolls out from prefixes
    [R, P] with new draws, then regresses. horizon None: the infinite-horizon values (the per-word sampler P ∝
    P̂^(1+α) e^Q, and a twist that is the same at every step); horizon L: the finite-horizon values of the law over L
    words, the twist of SMC over L words (soft_value_twist(..., horizon=L)), each rollout running to the law's end.
    Returns the head and, per iteration, {"rho", "rmse_nats", "r2"}."""
    c = training
    with torch.no_grad():
        _, f, _ = step_features(lm, prefixes[:1, 0], lm.init_state(1))
    width = _head_input(f, None if horizon is None else horizon).size(1)
    if head is None:
        head = new_head(lm, width, hidden=c.hidden, rank=c.rank, seed=seed)
    elif head_inputs(head) != width:
        raise ValueError(f"the head reads {head_inputs(head)} inputs; this horizon ({horizon}) needs {width}")
    steps = c.steps if horizon is None else horizon - 1
    history = []
    for k in range(c.iterations):
        ex = soft_value_rollouts(lm, head, alpha, prefixes, steps, horizon=horizon, explore=c.explore,
                                 backup_steps=c.backup_steps, seed=seed + 1000 * k, max_batch=c.max_batch)
        stats = fit_soft_value(head, ex.features, ex.words, ex.targets, epochs=c.epochs, batch_size=c.batch_size,
                               lr=c.lr, seed=seed + k)
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


class TwistAtAlpha:
    """The twist made for the α SMC samples at: a horizon head (train_soft_value at `horizon`) trained at `alpha`, and
    retrained from its weights with `retrain` at any α asked for beyond `tol` of the α it was last trained at. Give it
    to fit_sequence_alpha as twist_at, so that every run of the fit, and the rows after it, sample with a twist
    trained within `tol` of their own α. `trainings`: per training, its α and last iteration's fit."""

    def __init__(self, lm, prefixes: torch.Tensor, horizon: int, alpha: float, *, training: SoftValueTraining,
                 retrain: SoftValueTraining | None = None, tol: float = 1e-3, seed: int = 0):
        self.lm, self.prefixes, self.horizon, self.tol, self.seed = lm, prefixes, int(horizon), float(tol), seed
        self.retrain = retrain or training
        self.head, self.alpha, self.trainings = None, None, []
        self._train(alpha, training)

    def _train(self, alpha: float, training: SoftValueTraining) -> None:
        self.head, history = train_soft_value(self.lm, alpha, self.prefixes, training, horizon=self.horizon,
                                              head=self.head, seed=self.seed + 100 * len(self.trainings))
        self.alpha = float(alpha)
        self.trainings.append({"alpha": self.alpha, "iterations": training.iterations, **history[-1]})

    def fork(self) -> TwistAtAlpha:
        """A copy that retrains apart (its own head): each SMC row's twist a function of its own fit's path alone."""
        other = copy.copy(self)
        other.head, other.trainings = copy.deepcopy(self.head), list(self.trainings)
        return other

    def replay(self, trainings: list[dict]) -> TwistAtAlpha:
        """Trains again at the α of each of another fork's retrainings (its `trainings` after the first), in order:
        the same head, for a row that gets more generations from the twist it was built with."""
        for t in trainings[1:]:
            self._train(t["alpha"], self.retrain)
        return self

    def __call__(self, alpha: float) -> SoftValueTwist:
        if abs(float(alpha) - self.alpha) > self.tol:
            self._train(alpha, self.retrain)
        return soft_value_twist(self.lm, self.head, horizon=self.horizon)
