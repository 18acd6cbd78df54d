"""A synthetic source whose tail exponent is a setting: an order-k Markov chain whose every next-token distribution
is a power law, p(r-th most likely word) = r^-s / H_V(s), over its own random ordering of the V words
(`data=powerlaw`, `data.corpus_kwargs.tail_exponent=s`).

Each row is a permutation of the same law, so every context has the same entropy and the entropy rate is exactly
that law's entropy, whatever the stationary distribution; the corpus computes it the general way (the stationary
law of the chain, by lmcal.data.markov), and the tests check the two agree. The chain's (context, next word) pairs
have frequencies pi(context) r^-s / H_V(s): a power law of exponent s over the items a model must learn, the data
distribution of Cao, Valiant & Liang's simplified setting (NeurIPS 2025): after m training tokens a model has seen
few or none of the tail's pairs, whose mass falls with m the more slowly the heavier the tail (s near 1). The
contexts themselves are close to uniform (info: context_entropy_nats against log V**order): the heavy tail is in
what follows each context, not in which contexts occur.
"""

from __future__ import annotations

import numpy as np
import torch

from lmcal.data.corpora import Corpus
from lmcal.data.markov import entropy_np, markov_entropy_rate, markov_stationary, sample_markov
from lmcal.errors import DataError

MAX_TAIL_EXPONENT = 8.0  # past it nearly all of a row's mass is on one word: the chain hardly mixes, and the power
# iteration for its stationary law takes minutes, then fails (the range of data.corpus_kwargs.tail_exponent in
# lmcal.utils.rules, checked before any work)


def zipf_law(vocab_size: int, tail_exponent: float) -> np.ndarray:
    """p_r = r^-s / sum_{j<=V} j^-s for ranks r = 1..V [V], float64."""
    p = np.arange(1, vocab_size + 1, dtype=np.float64) ** -float(tail_exponent)
    return p / p.sum()


def make_powerlaw_chain(vocab_size: int = 256, order: int = 1, tail_exponent: float = 1.1, seed: int = 0) -> np.ndarray:
    """The table [V**order, V] float64 of P(w | context) (contexts encoded as lmcal.data.markov encodes them): row c
    is zipf_law(V, s) over a random permutation of the words, a function of the arguments only."""
    if order < 1 or vocab_size < 2 or not 0 < tail_exponent <= MAX_TAIL_EXPONENT:
        raise DataError(f"The power-law source needs data.corpus_kwargs.order >= 1, vocab_size >= 2 and tail_exponent "
                        f"> 0, at most {MAX_TAIL_EXPONENT:g}; got order={order}, vocab_size={vocab_size}, "
                        f"tail_exponent={tail_exponent}. Nothing was run. Set data.corpus_kwargs.tail_exponent=2 for a "
                        "light tail (1.1: a heavy one).")
    rng = np.random.default_rng(seed)
    n_ctx = vocab_size ** order
    ranks = np.argsort(rng.random((n_ctx, vocab_size)), axis=1)  # [n_ctx, V]: the word of rank r, r = 0..V-1
    probs = np.empty((n_ctx, vocab_size))
    probs[np.arange(n_ctx)[:, None], ranks] = zipf_law(vocab_size, tail_exponent)[None, :]
    return probs


def powerlaw_corpus(vocab_size: int = 256, order: int = 1, tail_exponent: float = 1.1, n_train: int = 200_000,
                    n_valid: int = 20_000, n_test: int = 20_000, seed: int = 0) -> Corpus:
    """Three independent stationary samples (seeds [seed, 1..3]) of `make_powerlaw_chain(...)`, with the exact
    entropy rate (the stationary chain's) in `info`."""
    probs = make_powerlaw_chain(vocab_size, order, tail_exponent, seed)
    try:
        pi = markov_stationary(probs, vocab_size, order)
    except DataError as e:
        raise DataError(f"The power-law source with data.corpus_kwargs.tail_exponent={tail_exponent:g} and order="
                        f"{order} has no stationary law that power iteration finds ({e}). Lower the tail exponent "
                        "(2: a light tail) or the order.") from None
    h = markov_entropy_rate(probs, vocab_size, order, pi)
    splits = [torch.from_numpy(sample_markov(probs, vocab_size, order, n, np.random.default_rng([seed, i]), pi))
              for i, n in enumerate((n_train, n_valid, n_test), 1)]
    info = {"order": order, "vocab_size": vocab_size, "tail_exponent": float(tail_exponent), "seed": seed,
            "entropy_rate_nats": h, "row_entropy_nats": float(entropy_np(zipf_law(vocab_size, tail_exponent))),
            "context_entropy_nats": float(entropy_np(pi))}
    return Corpus("powerlaw", [f"w{i}" for i in range(vocab_size)], *splits, info=info)
