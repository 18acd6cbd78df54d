"""The synthetic source: a random order-k Markov chain whose entropy rate and limited-memory conditionals are known
exactly, and its corpus. The exact StepLM oracles on it (the truth, and drifting models) are lmcal.models.oracles.

Tables are numpy float64; a corpus is an lmcal.data.corpora.Corpus, so the training and analysis code treat it like PTB.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from lmcal.data.corpora import Corpus
from lmcal.errors import DataError

# ---------------------------------------------------------------------------------------------------------------------
# The chain
# ---------------------------------------------------------------------------------------------------------------------
# A context is the last k tokens encoded base V with the most recent token last (least significant):
#     ctx = sum_j w[t-k+j] * V**(k-1-j),  j = 0..k-1.
# Emitting w moves the context to (ctx mod V**(k-1)) * V + w, so the k-gram process is a first-order chain on
# V**k states, and reshaping a [V**k, V] table to [V**(k-tau), V**tau, V] splits each context into its older
# k-tau tokens (axis 0) and its most recent tau tokens (axis 1).


@dataclass(eq=False)
class MarkovChain:
    probs: np.ndarray  # [V**order, V] float64: P(w | ctx)
    vocab_size: int
    order: int
    support: int
    smoothing: float
    seed: int


def make_markov_chain(vocab_size: int = 16, order: int = 2, support: int = 3, smoothing: float = 0.01,
                      seed: int = 0) -> MarkovChain:
    """A random sparse, peaked order-`order` chain, a function of its arguments only.

    Each row puts 1 - smoothing of its mass on `support` distinct random tokens with Dirichlet(1, ..., 1) weights
    and spreads `smoothing` uniformly over all tokens, so every transition has positive probability: the k-gram
    chain is irreducible and aperiodic, its stationary law is unique and positive.
    """
    if order < 1 or not 1 <= support <= vocab_size or not 0 < smoothing <= 1:
        raise ValueError(f"need order >= 1, 1 <= support <= vocab_size and 0 < smoothing <= 1; got order={order}, "
                         f"support={support}, vocab_size={vocab_size}, smoothing={smoothing}")
    rng = np.random.default_rng(seed)
    n_ctx = vocab_size ** order
    # `support` distinct tokens per row: the first columns of a random permutation of each row
    tokens = np.argsort(rng.random((n_ctx, vocab_size)), axis=1)[:, :support]  # [n_ctx, support]
    weights = rng.exponential(size=(n_ctx, support))  # normalised i.i.d. exponentials are Dirichlet(1, ..., 1)
    weights /= weights.sum(axis=1, keepdims=True)
    probs = np.full((n_ctx, vocab_size), smoothing / vocab_size)
    probs[np.arange(n_ctx)[:, None], tokens] += (1 - smoothing) * weights
    return MarkovChain(probs, vocab_size, order, support, smoothing, seed)


def markov_stationary(probs: np.ndarray, vocab_size: int, order: int, tol: float = 1e-13,
                      max_iter: int = 1_000_000) -> np.ndarray:
    """The stationary law over contexts [V**order], by power iteration on the k-gram chain (float64).

    Stops when one step changes pi by less than `tol` in L1. The chain must be irreducible and aperiodic
    (any positive smoothing makes it so), else the iteration need not converge.
    """
    n_ctx = vocab_size ** order
    pi = np.full(n_ctx, 1.0 / n_ctx)
    for _ in range(max_iter):
        # mass pi[ctx] * P(w | ctx) flows to (ctx mod V**(k-1)) * V + w: sum out the oldest token (axis 0);
        # (newer k-1 tokens, w) flattened is exactly the new context's index
        new = (pi[:, None] * probs).reshape(vocab_size, n_ctx // vocab_size, vocab_size).sum(axis=0).reshape(-1)
        new /= new.sum()  # no drift of the total mass from rounding
        if np.abs(new - pi).sum() < tol:
            return new
        pi = new
    raise DataError(f"The stationary distribution did not converge in {max_iter} power-iteration steps "
                    f"(L1 step {np.abs(new - pi).sum():.3g} > {tol:g}); is the chain irreducible and aperiodic?")


def entropy_np(p: np.ndarray) -> np.ndarray:
    """Entropy in nats of each row of p [..., V] (0 log 0 = 0)."""
    return -(p * np.log(p, where=p > 0, out=np.zeros_like(p))).sum(axis=-1)


def markov_entropy_rate(probs: np.ndarray, vocab_size: int, order: int, pi: np.ndarray | None = None) -> float:
    """sum_ctx pi(ctx) H(P(. | ctx)) in nats: the entropy rate of the stationary chain."""
    pi = markov_stationary(probs, vocab_size, order) if pi is None else pi
    return float(pi @ entropy_np(probs))


def _markov_joint(probs: np.ndarray, vocab_size: int, order: int, tau: int, pi: np.ndarray | None) -> np.ndarray:
    """P(last tau tokens = c, next token = w) under the stationary law: [V**tau, V], for 0 <= tau <= order."""
    if not 0 <= tau <= order:
        raise ValueError(f"tau must be in 0..order={order}, got {tau}")
    pi = markov_stationary(probs, vocab_size, order) if pi is None else pi
    # sum out the k - tau oldest tokens of each context
    return (pi[:, None] * probs).reshape(vocab_size ** (order - tau), vocab_size ** tau, vocab_size).sum(axis=0)


def markov_conditional(probs: np.ndarray, vocab_size: int, order: int, tau: int,
                       pi: np.ndarray | None = None) -> np.ndarray:
    """The exact order-tau conditional P(w | last tau tokens) of the stationary chain, [V**tau, V].

    For tau < order this is the best predictor that sees only the last tau tokens (the oracle for limited-memory
    models); contexts are encoded as above with tau digits. For tau >= order it is `probs` re-indexed: the older
    tau - order tokens do not matter.
    """
    if tau >= order:
        return probs[np.arange(vocab_size ** tau) % vocab_size ** order]
    joint = _markov_joint(probs, vocab_size, order, tau, pi)
    marg = joint.sum(axis=1, keepdims=True)  # P(last tau tokens), positive when the chain is smoothed
    uniform = np.full_like(joint, 1.0 / vocab_size)  # for contexts the stationary chain never visits
    return np.divide(joint, marg, out=uniform, where=marg > 0)


def markov_conditional_entropy(probs: np.ndarray, vocab_size: int, order: int, tau: int,
                               pi: np.ndarray | None = None) -> float:
    """H(W_t | last tau tokens) in nats under the stationary law; equals the entropy rate for tau >= order."""
    tau = min(tau, order)
    joint = _markov_joint(probs, vocab_size, order, tau, pi)
    marg = joint.sum(axis=1)
    return float(entropy_np(joint).sum() - entropy_np(marg))  # H(C, W) - H(C)


def sample_markov(probs: np.ndarray, vocab_size: int, order: int, n: int, generator_or_seed,
                  pi: np.ndarray | None = None) -> np.ndarray:
    """n tokens [n] int64 of the stationary chain: the first `order` are a context drawn from pi.

    Deterministic from the seed (or a numpy Generator, which it advances). Inverse-CDF draws with pre-drawn
    uniforms; a Python loop over plain lists with bisect is ~0.5 us a token.
    """
    rng = np.random.default_rng(generator_or_seed)  # a Generator is used as is
    pi = markov_stationary(probs, vocab_size, order) if pi is None else pi
    # each CDF rescaled to end at exactly 1.0, so a uniform in [0, 1) never falls past the last token
    start_cdf = np.cumsum(pi)
    start_cdf /= start_cdf[-1]
    ctx = int(np.searchsorted(start_cdf, rng.random(), side="right"))
    out = [(ctx // vocab_size ** (order - 1 - j)) % vocab_size for j in range(order)][:n]
    cdf = np.cumsum(probs, axis=1)
    cdf /= cdf[:, -1:]
    cdf_rows = cdf.tolist()
    keep = vocab_size ** (order - 1)
    for u in rng.random(max(n - order, 0)).tolist():
        w = bisect.bisect_right(cdf_rows[ctx], u)  # first token whose cumulative mass exceeds u
        out.append(w)
        ctx = (ctx % keep) * vocab_size + w
    return np.array(out, dtype=np.int64)


def markov_chain_from_info(info: dict) -> MarkovChain:
    """Rebuild a Markov corpus's chain from its `info` (the table is too big to store there)."""
    return make_markov_chain(info["vocab_size"], info["order"], info["support"], info["smoothing"], info["seed"])


def markov_exact_mi(info: dict, tau: int) -> float:
    """The source's own I_tau = H(W_t | last tau tokens) - H(W_t | last k tokens) in nats (0 for tau >= k), for the
    chain of a Markov corpus's `info`."""
    chain = markov_chain_from_info(info)
    v, k = info["vocab_size"], info["order"]
    pi = markov_stationary(chain.probs, v, k)
    return markov_conditional_entropy(chain.probs, v, k, tau, pi) - markov_conditional_entropy(chain.probs, v, k, k, pi)


def markov_corpus(vocab_size: int = 16, order: int = 2, support: int = 3, smoothing: float = 0.01,
                  n_train: int = 200_000, n_valid: int = 20_000, n_test: int = 20_000, seed: int = 0) -> Corpus:
    """Three independent stationary samples of `make_markov_chain(...)`, with the exact entropy rate in `info`.

    The splits use seeds [seed, 1], [seed, 2], [seed, 3]; the chain uses `seed`. Refuses a chain whose conditional
    does not really depend on the token `order` steps back (then it would be a chain of lower order).
    """
    chain = make_markov_chain(vocab_size, order, support, smoothing, seed)
    probs = chain.probs
    pi = markov_stationary(probs, vocab_size, order)
    h = markov_entropy_rate(probs, vocab_size, order, pi)
    h_short = markov_conditional_entropy(probs, vocab_size, order, order - 1, pi)
    if not h_short > h + 1e-9:
        raise DataError(f"The Markov chain from seed {seed} hardly depends on its oldest context token "
                        f"(H(W | last {order - 1}) = {h_short:.12f} vs entropy rate {h:.12f} nats); use another seed.")
    splits = [torch.from_numpy(sample_markov(probs, vocab_size, order, n, np.random.default_rng([seed, i]), pi))
              for i, n in enumerate((n_train, n_valid, n_test), 1)]
    info = {"order": order, "vocab_size": vocab_size, "support": support, "smoothing": smoothing, "seed": seed,
            "entropy_rate_nats": h, "entropy_rate_order_minus_1_nats": h_short, "depends_on_last": order}
    return Corpus("markov", [f"s{i}" for i in range(vocab_size)], *splits, info=info)
