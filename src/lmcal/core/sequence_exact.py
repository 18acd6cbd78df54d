"""The paper's Algorithm 1 solved exactly, for language models with a finite state: the reference for the samplers.

The sequence-level calibrated family over a horizon of T words after a prefix that leaves the model in state s_0,

    P̂_α(w_1..T | s_0) = P̂(w_1..T | s_0)^(1+α) / Z_α(s_0),

is again a Markov chain, with conditionals that depend on the words still to come. With a finite state space (law
P̂(w | s), next state s' = next(s, w)), the backward recursion over r, the number of words still to come,

    b_0(s) = 1,    b_r(s) = sum_w P̂(w | s)^(1+α) b_{r-1}(next(s, w)),

gives Z_α(s_0) = b_T(s_0) and the conditional of word t (r = T - t + 1 words to go, w_t included)

    P_α(w | s, t) = P̂(w | s)^(1+α) b_{r-1}(next(s, w)) / b_r(s):

the model's law to the power 1 + α times exp(V), with the soft value V = log b (lmcal.core.soft_value learns it).
Everything is in log space, float64.

Cross-entropy and the fit. On true text W of T words after the prefix (E_P: the truth's law of prefix and text),

    T CE(α) = -E_P[log P̂_α(W | s_0)] = -(1+α) E_P[log P̂(W)] + E_P[log Z_α(s_0)],

convex in α, with T CE'(α) = m(α) - E_P[log P̂(W)] where m(α) = E_s0 E_P̂α[log P̂(W)] (increasing: m' is the
expected variance of log P̂(W) under P̂_α). So α* solves the moment condition m(α) = E_P[log P̂(W)]. The calibrated
law's entropy per word is

    T EntRate(α) = E_s0 H(P̂_α(. | s_0)) = -(1+α) m(α) + E_s0[log Z_α(s_0)],

so CE(α*) = EntRate(α*), the paper's theorem. Here EntRate is computed apart, as the sum over t of the expected
entropy of the conditionals (the generation curve), so the identity is a check and not a definition.

The infinite horizon: b_r(s) ~ λ^r ρ(s), with λ and ρ the Perron root and right eigenvector of

    M_α(s, s') = sum_w P̂(w | s)^(1+α) [s' = next(s, w)],

so far from both ends the conditionals are P_∞(w | s) = P̂(w | s)^(1+α) ρ(next(s, w)) / (λ ρ(s)): a stationary chain,
the fixed point of the soft-value heads' average-reward Bellman equation, with log λ the reward rate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import brentq

from lmcal.data.markov import MarkovChain, markov_stationary
from lmcal.models.oracles import DriftingOracle, MarkovOracle

F64 = torch.float64


# ---------------------------------------------------------------------------------------------------------------------
# Finite-state models as tables
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class FiniteStateLM:
    log_law: torch.Tensor  # [S, V] float64: log P̂(w | s)
    next_state: torch.Tensor  # [S, V] long: the state after reading w in s

    @property
    def num_states(self) -> int:
        return self.log_law.size(0)


def all_states(lm):
    """Every state of a finite-state oracle as a batch of S rows (full contexts), row i in state i (state_index).
    A StepLM exposing its own `augmented_states()` and `state_index(state)` is used as it is."""
    if hasattr(lm, "augmented_states"):
        return lm.augmented_states()
    if isinstance(lm, MarkovOracle):
        return torch.arange(lm.vocab_size ** lm.order, device=lm.device), lm.order
    if isinstance(lm, DriftingOracle):
        C = lm.markov_vocab ** lm.markov.order
        idx = torch.arange(2 * C, device=lm.device)
        return (idx % C, lm.markov.order), idx >= C
    raise TypeError(f"{type(lm).__name__} exposes no finite state (augmented_states and state_index)")


def state_index(lm, state) -> torch.Tensor:
    """[B] the finite-state index of each row of `state` (full contexts: at least `order` Markov words read)."""
    if hasattr(lm, "state_index"):
        return lm.state_index(state)
    if isinstance(lm, DriftingOracle):
        (ctx, n), switched = state
        if n < lm.markov.order:
            raise ValueError(f"state_index needs full contexts: {n} tokens read, order {lm.markov.order}")
        return switched.long() * lm.markov_vocab ** lm.markov.order + ctx
    if isinstance(lm, MarkovOracle):
        ctx, n = state
        if n < lm.order:
            raise ValueError(f"state_index needs full contexts: {n} tokens read, order {lm.order}")
        return ctx
    raise TypeError(f"{type(lm).__name__} exposes no finite state (augmented_states and state_index)")


@torch.no_grad()
def finite_state_lm(lm) -> FiniteStateLM:
    """The tables of a finite-state StepLM, read off the StepLM itself: every word is fed in every state (S * V rows
    in one step); each state's law is the step's output in whichever (s, w) leads to it. Refuses a model whose law is
    not a function of the index (two paths to one index with different laws) or with a state nothing leads to."""
    states = all_states(lm)
    S, V = state_index(lm, states).numel(), lm.vocab_size
    rows = torch.arange(S).repeat_interleave(V)  # [S*V]: state s, V times
    words = torch.arange(V).repeat(S)  # [S*V]
    logp, after = lm.step(words, lm.select(states, rows))  # [S*V, V]
    nxt = state_index(lm, after).cpu().view(S, V)
    logp = logp.double().cpu()
    law = torch.full((S, V), torch.nan, dtype=F64)
    law[nxt.reshape(-1)] = logp
    if torch.isnan(law).any():
        raise ValueError(f"{(torch.isnan(law).any(1)).sum().item()} states of {type(lm).__name__} are never reached "
                         "from another: their law cannot be read off a step")
    if not torch.allclose(law[nxt.reshape(-1)], logp, rtol=0, atol=1e-12):
        raise ValueError(f"the law of {type(lm).__name__} is not a function of its state index")
    return FiniteStateLM(law, nxt)


def stationary_prefixes(chain: MarkovChain) -> tuple[torch.Tensor, torch.Tensor]:
    """Every context of the chain as a prefix [C, order] (most recent last) with its stationary probability [C]: a
    prefix of true text, in distribution, as far as an order-k model can tell."""
    V, k = chain.vocab_size, chain.order
    ctx = torch.arange(V ** k)
    digits = torch.stack([(ctx // V ** (k - 1 - j)) % V for j in range(k)], 1)  # [C, k]
    return digits, torch.from_numpy(markov_stationary(chain.probs, V, k))


@dataclass
class TrueText:
    """True text as the model reads it: the truth's own tables (its words are the first V_T of the model's) and the
    joint law [S_T, S_M] of the truth's and the model's states after the prefix."""

    truth: FiniteStateLM
    start: torch.Tensor  # [S_T, S_M] float64

    @property
    def model_start(self) -> torch.Tensor:
        """[S_M] the law of the model's state after the prefix."""
        return self.start.sum(0)


@torch.no_grad()
def true_text(truth_lm, model_lm, prefixes: torch.Tensor, weights: torch.Tensor) -> TrueText:
    """TrueText for prefixes [N, L] with probabilities weights [N] (e.g. stationary_prefixes), both models fed them."""
    truth = finite_state_lm(truth_lm)
    S_M = state_index(model_lm, all_states(model_lm)).numel()

    def fed(lm):
        state = lm.init_state(prefixes.size(0))
        for i in range(prefixes.size(1)):
            _, state = lm.step(prefixes[:, i], state)
        return state_index(lm, state).cpu()

    start = torch.zeros(truth.num_states, S_M, dtype=F64)
    start.index_put_((fed(truth_lm), fed(model_lm)), weights.double(), accumulate=True)
    return TrueText(truth, start / start.sum())


def true_log_probs(model: FiniteStateLM, text: TrueText, horizon: int) -> torch.Tensor:
    """E_P[log P̂(w_t | past)] for the true words t = 1..horizon after the prefix: [horizon] float64, on the chain of
    (truth's state, model's state) pairs."""
    law_t = text.truth.log_law.exp()  # [S_T, V_T]
    S_T, V_T = law_t.shape
    S_M = model.num_states
    L = model.log_law[:, :V_T]  # [S_M, V_T]: the model's log-probs of the true words
    pair_next = (text.truth.next_state[:, None, :] * S_M + model.next_state[None, :, :V_T]).reshape(-1)  # [S_T*S_M*V_T]
    mu, out = text.start, []
    for _ in range(horizon):
        flow = mu[:, :, None] * law_t[:, None, :]  # [S_T, S_M, V_T]: mass moving along each true word
        out.append(torch.where(flow > 0, flow * L[None], 0.0).sum())
        mu = torch.zeros(S_T * S_M, dtype=F64).index_add_(0, pair_next, flow.reshape(-1)).view(S_T, S_M)
    return torch.stack(out)


# ---------------------------------------------------------------------------------------------------------------------
# The calibrated law over a horizon
# ---------------------------------------------------------------------------------------------------------------------


def _check_alpha(alpha: float) -> float:
    if not alpha > -1:
        raise ValueError(f"need alpha > -1 (1 + alpha > 0), got {alpha}")
    return 1.0 + float(alpha)


def log_values(fs: FiniteStateLM, alpha: float, horizon: int) -> torch.Tensor:
    """log b_r(s) for r = 0..horizon words still to come: [horizon + 1, S]; log Z_α(s) = out[horizon, s]."""
    tilted = _check_alpha(alpha) * fs.log_law  # [S, V]; -inf stays -inf
    out = [torch.zeros(fs.num_states, dtype=F64)]
    for _ in range(horizon):
        out.append((tilted + out[-1][fs.next_state]).logsumexp(-1))
    return torch.stack(out)


def exact_twist(lm, alpha: float, horizon: int):
    """The exact twist of twisted SMC (lmcal.core.smc.smc_generate's `twist`) for a finite-state StepLM `lm` and the law
    over `horizon` words: ψ_t(h, w) = log b_{T-t-1}(next(s, w)), the log soft value of the words still to come after
    w at step t (0-based) from state s. Under it the proposal is the exact conditional P_α(w | s, t) and every
    incremental weight is 1: one particle is an exact draw, and Ẑ is Z_α exactly. For tests, to tell the sampler
    from the twist a head learns."""
    fs = finite_state_lm(lm)
    table = log_values(fs, alpha, horizon)[:, fs.next_state]  # [T + 1, S, V]: log b_r(next(s, w))

    def twist(state, t: int) -> torch.Tensor:
        return table[horizon - t - 1][state_index(lm, state).cpu()].to(getattr(lm, "device", None) or "cpu")

    return twist


def calibrated_log_law(fs: FiniteStateLM, alpha: float, horizon: int) -> torch.Tensor:
    """log P_α(w | s, t) for t = 1..horizon: [horizon, S, V] (index t - 1)."""
    tilted = _check_alpha(alpha) * fs.log_law
    b = log_values(fs, alpha, horizon)  # [T + 1, S]
    return torch.stack([tilted + b[r - 1][fs.next_state] - b[r][:, None] for r in range(horizon, 0, -1)])


def _row_entropy(logp: torch.Tensor) -> torch.Tensor:
    p = logp.exp()
    return -torch.where(p > 0, p * logp, 0.0).sum(-1)


@dataclass
class Generation:
    """Expectations along the calibrated law's generations, word t = 1..T (index t - 1)."""

    entropy: torch.Tensor  # [T]: E[entropy of the calibrated conditional word t is drawn from]
    base_logp: torch.Tensor  # [T]: E[log P̂(w_t | past)]
    base_entropy: torch.Tensor  # [T]: E[entropy of P̂(. | past)] before word t
    marginals: torch.Tensor  # [T, V]: P(w_t = w)
    log_z: float  # E_s0[log Z_α(s_0)]

    @property
    def moment(self) -> float:
        """m(α) = E[log P̂(W_1..T)] under the calibrated law."""
        return float(self.base_logp.sum())

    @property
    def entropy_rate(self) -> float:
        """EntRate(α): the calibrated law's entropy per word over the horizon."""
        return float(self.entropy.mean())


def generation(fs: FiniteStateLM, alpha: float, horizon: int, start: torch.Tensor) -> Generation:
    """The calibrated law's generations from the state law start [S] (e.g. TrueText.model_start, or the one-hot mean of
    some prefixes' states), forward through the exact conditionals."""
    log_law = calibrated_log_law(fs, alpha, horizon)  # [T, S, V]
    base_h = _row_entropy(fs.log_law)  # [S]
    mu = start.double()
    ent, logp, base, marg = [], [], [], []
    for t in range(horizon):
        c = log_law[t].exp()  # [S, V]
        flow = mu[:, None] * c  # [S, V]
        ent.append(mu @ _row_entropy(log_law[t]))
        logp.append(torch.where(flow > 0, flow * fs.log_law, 0.0).sum())
        base.append(mu @ base_h)
        marg.append(flow.sum(0))
        mu = torch.zeros_like(mu).index_add_(0, fs.next_state.reshape(-1), flow.reshape(-1))
    log_z = float(start.double() @ log_values(fs, alpha, horizon)[-1])
    return Generation(torch.stack(ent), torch.stack(logp), torch.stack(base), torch.stack(marg), log_z)


def sequence_ce(fs: FiniteStateLM, text: TrueText, alpha: float, horizon: int) -> float:
    """CE(α) per word of P̂_α on true text of `horizon` words after the prefix (module docstring)."""
    a1 = _check_alpha(alpha)
    log_z = float(text.model_start @ log_values(fs, alpha, horizon)[-1])
    return (-a1 * float(true_log_probs(fs, text, horizon).sum()) + log_z) / horizon


def bracketed_root(fun, bracket=(-0.5, 1.0), xtol: float = 1e-12) -> float:
    """The root of an increasing fun(α) on α > -1: the bracket is widened (upwards, or towards -1) until fun changes
    sign, then brentq."""
    lo, hi = bracket
    for _ in range(60):
        if fun(hi) < 0:
            lo, hi = hi, 2 * hi + 1
        elif fun(lo) > 0:
            hi, lo = lo, (lo - 1) / 2  # towards -1, never past it
        else:
            return brentq(fun, lo, hi, xtol=xtol)
    raise ValueError(f"no root in ({lo}, {hi}): the moment condition has none above alpha = -1 (text less likely "
                     "under the model than its own flattened samples?)")


def exact_alpha(fs: FiniteStateLM, text: TrueText, horizon: int, bracket=(-0.5, 1.0), xtol: float = 1e-12) -> float:
    """α*: the root of m(α) = E_P[log P̂(W)] (module docstring)."""
    target = float(true_log_probs(fs, text, horizon).sum())
    return bracketed_root(lambda a: generation(fs, a, horizon, text.model_start).moment - target, bracket, xtol)


# ---------------------------------------------------------------------------------------------------------------------
# The infinite horizon
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class PerronLimit:
    log_lambda: float  # log of the Perron root of M_α: the reward rate ρ of the average-reward Bellman equation
    log_vector: torch.Tensor  # [S]: log of its right eigenvector (max 0; -inf where it vanishes)
    log_law: torch.Tensor  # [S, V]: log P_∞(w | s); nan in states where the eigenvector vanishes (never visited)
    stationary: torch.Tensor  # [S]: the stationary law of P_∞ reached from `start`
    entropy_rate: float  # sum_s stationary(s) H(P_∞(. | s))
    base_logp: float  # sum_s stationary(s) E_P∞[log P̂(w | s)]: m_∞ per word


def perron_limit(fs: FiniteStateLM, alpha: float, start: torch.Tensor | None = None, rtol: float = 1e-12
                 ) -> PerronLimit:
    """The calibrated conditionals far from both ends of a long horizon (module docstring). A reducible M_α (the
    drifting oracles: the noise states are closed) has an eigenvector that vanishes on the classes of smaller root;
    entries below rtol times its largest are taken as 0 (where the root is not simple, e.g. several closed noise
    classes dominating at small α, the eigenvector is one of several). start [S]: where the stationary law is reached
    from (default uniform over the states where the eigenvector is positive)."""
    a1 = _check_alpha(alpha)
    S = fs.num_states
    rows = torch.arange(S)[:, None].expand_as(fs.next_state)
    M = torch.zeros(S, S, dtype=F64).index_put_((rows, fs.next_state), (a1 * fs.log_law).exp(), accumulate=True)
    vals, vecs = np.linalg.eig(M.numpy())
    i = int(np.argmax(vals.real))
    vec = np.abs(vecs[:, i].real)
    vec = torch.from_numpy(np.where(vec > rtol * vec.max(), vec / vec.max(), 0.0))
    log_vec = vec.log()
    log_lambda = float(np.log(vals[i].real))
    law = a1 * fs.log_law + log_vec[fs.next_state] - log_lambda - log_vec[:, None]  # [S, V]
    live = vec > 0
    law[~live] = torch.nan
    # the stationary law: the lazy chain (same stationary law, aperiodic) squared 60 times is 2**60 steps
    K = torch.zeros(S, S, dtype=F64).index_put_((rows, fs.next_state), torch.where(live[:, None], law.exp(), 0.0),
                                                accumulate=True)  # P_∞'s transitions (0 where it is undefined)
    K = (K + torch.diag(live.double())) / 2
    for _ in range(60):
        K = K @ K
    mu = live.double() if start is None else start.double() * live
    nu = (mu / mu.sum()) @ K
    nu = nu / nu.sum()
    ent = float(nu[live] @ _row_entropy(law[live]))
    p = law[live].exp()
    logp = float(nu[live] @ torch.where(p > 0, p * fs.log_law[live], 0.0).sum(-1))
    return PerronLimit(log_lambda, log_vec, law, nu, ent, logp)
