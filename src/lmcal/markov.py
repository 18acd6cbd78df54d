"""The synthetic source: a random order-k Markov chain whose entropy rate and limited-memory conditionals are known
exactly, its corpus, and exact StepLM oracles on it (the truth, and a deliberately drifting model).

Tables are numpy float64; a corpus is an lmcal.data.Corpus, so the training and analysis code treat it like PTB.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np
import torch

from lmcal.data import Corpus, DataError

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


def _entropy_np(p: np.ndarray) -> np.ndarray:
    """Entropy in nats of each row of p [..., V] (0 log 0 = 0)."""
    return -(p * np.log(p, where=p > 0, out=np.zeros_like(p))).sum(axis=-1)


def markov_entropy_rate(probs: np.ndarray, vocab_size: int, order: int, pi: np.ndarray | None = None) -> float:
    """sum_ctx pi(ctx) H(P(. | ctx)) in nats: the entropy rate of the stationary chain."""
    pi = markov_stationary(probs, vocab_size, order) if pi is None else pi
    return float(pi @ _entropy_np(probs))


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
    return float(_entropy_np(joint).sum() - _entropy_np(marg))  # H(C, W) - H(C)


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


# ---------------------------------------------------------------------------------------------------------------------
# Exact oracles (StepLMs, see lmcal.lm)
# ---------------------------------------------------------------------------------------------------------------------


class MarkovOracle:
    """The exact conditionals of an order-k Markov source, float64 log-probabilities.

    State = (ctx [B] long, n): ctx encodes the last min(n, order) tokens base V, most recent last, exactly like the
    row index of `probs`; n = tokens fed so far (the same for every row). With fewer than `order` tokens seen the
    prediction is the stationary chain's lower-order conditional P(w | last n tokens), so the oracle is the true
    law of a stationary sample from its very first token.
    """

    def __init__(self, probs: np.ndarray, vocab_size: int, order: int, device="cpu"):
        self.vocab_size, self.order, self.device = vocab_size, order, torch.device(device)
        pi = markov_stationary(probs, vocab_size, order)
        with np.errstate(divide="ignore"):  # log 0 = -inf is what we want
            # tables[m] [V**m, V]: log P(w | last m tokens), m = 0..order (tables[order] is log probs itself)
            self.tables = [torch.from_numpy(np.log(markov_conditional(probs, vocab_size, order, m, pi))).to(device)
                           for m in range(order + 1)]

    @classmethod
    def from_chain(cls, chain: MarkovChain, device="cpu") -> MarkovOracle:
        return cls(chain.probs, chain.vocab_size, chain.order, device)

    def init_state(self, batch_size: int):
        return torch.zeros(batch_size, dtype=torch.long, device=self.device), 0

    def step(self, tokens, state):
        ctx, n = state
        m = min(n + 1, self.order)  # context length after this token
        # keep the newest m-1 tokens and append this one (for n < order, ctx < V**n already: nothing is dropped)
        ctx = (ctx % self.vocab_size ** (m - 1)) * self.vocab_size + tokens.to(self.device)
        return self.tables[m][ctx], (ctx, n + 1)  # [B, V]

    def select(self, state, index):
        ctx, n = state
        return ctx[index.to(self.device)], n

    def state_features(self, state) -> torch.Tensor:
        """The state as a one-hot vector [B, 1 + V + ... + V**order] (one block per context length): what a
        future-entropy head (lmcal.future_entropy) reads, in place of a network's hidden state."""
        ctx, n = state
        m = min(n, self.order)
        offset = sum(self.vocab_size ** i for i in range(m))
        size = sum(self.vocab_size ** i for i in range(self.order + 1))
        return torch.nn.functional.one_hot(ctx + offset, size).double()


class DriftingOracle:
    """An exact LM that is almost perfect on true text yet whose generations drift: the paper's sharpness remark.

    Vocabulary: the Markov chain's V_M tokens, then `noise_vocab` noise tokens. Generative story: at every step a
    process that has not yet switched switches for good with probability q = 1/T, and from then on emits noise
    tokens uniformly; otherwise it emits the Markov word. Noise never occurs before the switch, so the predictive
    law given the past has two states:
        noise seen:     uniform over the noise tokens;
        none seen yet:  (1 - q) P_Markov(. | ctx) on the Markov tokens, q / noise_vocab on each noise token.
    On Markov text the cross-entropy is h + log(1 / (1 - q)), a tiny cost for large T, but a free-running
    generation switches within ~T words and its entropy climbs from ~h to log(noise_vocab).
    State = (MarkovOracle state, switched [B] bool).
    """

    def __init__(self, chain: MarkovChain, T: float, noise_vocab: int, device="cpu"):
        if not T > 1 or noise_vocab < 1:
            raise ValueError(f"need T > 1 and noise_vocab >= 1, got T={T}, noise_vocab={noise_vocab}")
        self.markov = MarkovOracle.from_chain(chain, device)
        self.q, self.noise_vocab = 1.0 / T, noise_vocab
        self.markov_vocab = chain.vocab_size
        self.vocab_size = chain.vocab_size + noise_vocab
        self.device = self.markov.device
        f64 = dict(dtype=torch.float64, device=self.device)
        # the two fixed parts of the predictive law, [V]
        self.noise_before = torch.full((noise_vocab,), math.log(self.q / noise_vocab), **f64)
        self.after = torch.cat([torch.full((chain.vocab_size,), -math.inf, **f64),
                                torch.full((noise_vocab,), -math.log(noise_vocab), **f64)])

    def init_state(self, batch_size: int):
        return self.markov.init_state(batch_size), torch.zeros(batch_size, dtype=torch.bool, device=self.device)

    def step(self, tokens, state):
        mstate, switched = state
        tokens = tokens.to(self.device)
        noise = tokens >= self.markov_vocab
        switched = switched | noise
        # after the switch the Markov context no longer matters; feed any valid token to keep its state in range
        mlogp, mstate = self.markov.step(torch.where(noise, 0, tokens), mstate)  # [B, V_M]
        before = torch.cat([mlogp + math.log1p(-self.q), self.noise_before.expand(len(tokens), -1)], dim=1)
        return torch.where(switched[:, None], self.after, before), (mstate, switched)  # [B, V_M + noise]

    def select(self, state, index):
        mstate, switched = state
        return self.markov.select(mstate, index), switched[index.to(self.device)]

    def state_features(self, state) -> torch.Tensor:
        """[B, F]: the Markov state's one-hot and the switched flag."""
        mstate, switched = state
        return torch.cat([self.markov.state_features(mstate), switched[:, None].double()], 1)

    def expected_generation_entropy(self, horizon: int, markov_entropy: float) -> np.ndarray:
        """E[entropy before generated word t], t = 1..horizon [horizon], nats, for a prefix of true Markov text
        (so not switched before word 1) whose context is stationary.

        Word t is generated unswitched iff none of words 1..t-1 was noise: probability (1-q)^(t-1); the Markov
        words generated meanwhile follow the chain, so the context stays stationary and E[H(P_Markov(. | ctx))] = h.
        The unswitched law mixes (1-q) P_Markov and q Uniform(noise) on disjoint supports, so its entropy is
        h2(q) + (1-q) H(P_Markov) + q log(noise_vocab); the switched one is log(noise_vocab). With
        s_t = 1 - (1-q)^(t-1):  mean[t-1] = s_t log(noise_vocab) + (1 - s_t) [h2(q) + (1-q) h + q log(noise_vocab)].
        """
        q, log_noise = self.q, math.log(self.noise_vocab)
        h2 = -q * math.log(q) - (1 - q) * math.log1p(-q)
        s = 1 - (1 - q) ** np.arange(horizon, dtype=np.float64)  # [horizon]: s[t-1] = P(switched before word t)
        return s * log_noise + (1 - s) * (h2 + (1 - q) * markov_entropy + q * log_noise)


class DelayedDriftOracle:
    """A drifting LM whose drift one-step lookahead cannot see: a word starts a countdown, and the noise comes later.

    Vocabulary: the chain's V_M words, then `triggers` trigger words, then `noise_vocab` noise words. Phases: 0 normal;
    c = 1..delay, a countdown with c Markov words still to come; delay + 1, noise for good. The predictive law:
        normal:     (1 - q) P_Markov(. | ctx) on the Markov words, q / triggers on each trigger word;
        countdown:  P_Markov(. | ctx) (no trigger);
        noise:      uniform over the noise words.
    A trigger moves normal to countdown `delay` (to noise at once when delay = 0); a Markov word moves countdown c to
    c - 1, and countdown 1 to noise. Trigger and noise words leave the Markov context as it was.

    True Markov text has no trigger, so it costs log 1/(1 - q) nats per word over the chain's own entropy. A free
    generation draws a trigger at rate q, and `delay` words later its entropy jumps to log(noise_vocab) for good. The
    entropy after a trigger is that of the countdown's Markov law, a little below the normal one: one-step lookahead
    (H_next) sees nothing wrong with a trigger, while the discounted future entropy G_K(trigger) of a horizon
    K > delay includes the noise (`future_entropies` gives every G_K exactly).

    State = (MarkovOracle state, phase [B] long). The Markov state's token count n is shared by the rows; it only
    matters (lower-order tables) while n < order, at the start of a stream, where a row that read a trigger or noise
    word is then one step off.
    """

    def __init__(self, chain: MarkovChain, trigger_rate: float, delay: int, noise_vocab: int, triggers: int = 1,
                 device="cpu"):
        if not 0 < trigger_rate < 1 or delay < 0 or noise_vocab < 1 or triggers < 1:
            raise ValueError(f"need 0 < trigger_rate < 1, delay >= 0, noise_vocab >= 1 and triggers >= 1; got "
                             f"{trigger_rate}, {delay}, {noise_vocab}, {triggers}")
        self.markov = MarkovOracle.from_chain(chain, device)
        self.chain, self.q, self.delay = chain, float(trigger_rate), int(delay)
        self.triggers, self.noise_vocab = int(triggers), int(noise_vocab)
        self.markov_vocab = chain.vocab_size
        self.vocab_size = chain.vocab_size + triggers + noise_vocab
        self.noise_phase = self.delay + 1
        self.device = self.markov.device

    def init_state(self, batch_size: int):
        return self.markov.init_state(batch_size), torch.zeros(batch_size, dtype=torch.long, device=self.device)

    def _law(self, mlogp: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
        """log-probs [B, V] from the Markov log-probs [B, V_M] and the phases [B]."""
        B, f64 = mlogp.size(0), dict(dtype=torch.float64, device=self.device)
        ninf = lambda n: torch.full((B, n), -math.inf, **f64)  # noqa: E731
        trig = torch.full((B, self.triggers), math.log(self.q / self.triggers), **f64)
        normal = torch.cat([mlogp + math.log1p(-self.q), trig, ninf(self.noise_vocab)], 1)
        countdown = torch.cat([mlogp, ninf(self.triggers + self.noise_vocab)], 1)
        noise = torch.cat([ninf(self.markov_vocab + self.triggers),
                           torch.full((B, self.noise_vocab), -math.log(self.noise_vocab), **f64)], 1)
        p = phase[:, None]
        return torch.where(p == 0, normal, torch.where(p == self.noise_phase, noise, countdown))

    def step(self, tokens, state):
        (ctx, n), phase = state
        tokens = tokens.to(self.device)
        markov = tokens < self.markov_vocab
        trigger = ~markov & (tokens < self.markov_vocab + self.triggers)
        mlogp, (new_ctx, n) = self.markov.step(torch.where(markov, tokens, 0), (ctx, n))
        ctx = torch.where(markov, new_ctx, ctx)  # trigger and noise words leave the Markov context alone
        if not markov.all():
            mlogp = self.markov.tables[min(n, self.markov.order)][ctx]
        counted = torch.where(phase == 1, self.noise_phase, phase - 1)  # a Markov word read in the countdown
        phase = torch.where(trigger & (phase == 0), self.delay if self.delay else self.noise_phase,
                            torch.where(markov & (phase >= 1) & (phase <= self.delay), counted, phase))
        phase = torch.where(~markov & ~trigger, self.noise_phase, phase)  # a noise word: noise for good
        return self._law(mlogp, phase), ((ctx, n), phase)

    def select(self, state, index):
        mstate, phase = state
        return self.markov.select(mstate, index), phase[index.to(self.device)]

    def state_features(self, state) -> torch.Tensor:
        """[B, F]: the Markov state's one-hot and the phase's."""
        mstate, phase = state
        return torch.cat([self.markov.state_features(mstate),
                          torch.nn.functional.one_hot(phase, self.delay + 2).double()], 1)

    # The exact answers, on the augmented chain of (full Markov context, phase) states

    def _augmented(self):
        """(entropy [S], transition probabilities [S, S], next state [S, V]) of the S = V_M**order * (delay + 2)
        states s = phase * V_M**order + ctx (full contexts): the law in s, where each word leads, and their product."""
        VM, k, P = self.markov_vocab, self.chain.order, self.chain.probs  # P [C, V_M]
        C, D = VM ** k, self.delay + 2
        S, V = C * D, self.vocab_size
        ctx = np.arange(S) % C
        phase = np.arange(S) // C
        nxt = np.empty((S, V), dtype=np.int64)
        law = np.zeros((S, V))
        shifted = (ctx[:, None] % VM ** (k - 1)) * VM + np.arange(VM)  # [S, V_M]: the context after a Markov word
        after_markov = np.where(phase == 0, 0, np.where(phase == 1, self.noise_phase,
                                                          np.where(phase == self.noise_phase, phase, phase - 1)))
        nxt[:, :VM] = after_markov[:, None] * C + shifted
        trig_phase = np.where(phase == 0, self.delay if self.delay else self.noise_phase, phase)
        nxt[:, VM:VM + self.triggers] = (trig_phase * C + ctx)[:, None]
        nxt[:, VM + self.triggers:] = (self.noise_phase * C + ctx)[:, None]
        normal, noise = phase == 0, phase == self.noise_phase
        law[:, :VM] = P[ctx] * np.where(normal, 1 - self.q, np.where(noise, 0.0, 1.0))[:, None]
        law[normal, VM:VM + self.triggers] = self.q / self.triggers
        law[noise, VM + self.triggers:] = 1.0 / self.noise_vocab
        ent = _entropy_np(law)
        trans = np.zeros((S, S))
        np.add.at(trans, (np.repeat(np.arange(S), V), nxt.ravel()), law.ravel())
        return ent, trans, nxt

    def future_entropies(self, horizon: int, discount: float = 1.0) -> np.ndarray:
        """G_K(w | s) = E[sum_{j=1..K} discount**(j-1) H(law after word j of the continuation that starts with w)]
        for every state s (see `state_index`) and word w: [S, V] float64, exact (K = horizon)."""
        ent, trans, nxt = self._augmented()
        v = ent.copy()  # v_1 = H
        for _ in range(horizon - 1):
            v = ent + discount * trans @ v  # v_j(s) = H(s) + discount * E[v_{j-1}(next state)]
        return v[nxt]

    def state_index(self, state) -> torch.Tensor:
        """[B] the augmented-chain index of each row's state (full contexts: at least `order` Markov words read)."""
        (ctx, n), phase = state
        if n < self.chain.order:
            raise ValueError(f"state_index needs full contexts: {n} tokens read, order {self.chain.order}")
        return phase * self.markov_vocab ** self.chain.order + ctx

    def augmented_states(self):
        """The state of every augmented-chain index as a batch of S rows (full contexts), for `state_features` or a
        model of the state (e.g. a future-entropy head's g in every state)."""
        C = self.markov_vocab ** self.chain.order
        idx = torch.arange(C * (self.delay + 2), device=self.device)
        return (idx % C, self.chain.order), idx // C

    def expected_generation_entropy(self, horizon: int, log_law: torch.Tensor | None = None) -> np.ndarray:
        """E[entropy before generated word t], t = 1..horizon, for generations from a stationary context in the
        normal phase (a prefix of true text): [horizon] float64, nats, exactly. log_law [S, V]: the generations
        draw from this law in each augmented state instead (any reweighting of the oracle's, e.g. a calibrated one:
        its support must be the oracle's, so the states move as they do), its entropy the one averaged."""
        ent, trans, nxt = self._augmented()
        if log_law is not None:
            law = torch.as_tensor(log_law).detach().double().exp().cpu().numpy()  # [S, V]
            ent = _entropy_np(law)
            trans = np.zeros_like(trans)
            np.add.at(trans, (np.repeat(np.arange(law.shape[0]), law.shape[1]), nxt.ravel()), law.ravel())
        pi = markov_stationary(self.chain.probs, self.markov_vocab, self.chain.order)
        mu = np.zeros(ent.size)
        mu[:pi.size] = pi  # phase 0
        out = np.empty(horizon)
        for t in range(horizon):
            out[t] = mu @ ent
            mu = mu @ trans
        return out


@torch.no_grad()
def markov_oracle_memory(info: dict, valid_tokens: torch.Tensor, test_tokens: torch.Tensor, taus: list[int],
                         cluster_size: int = 2000) -> dict:
    """The estimators run on the Markov source's exact oracles, where every answer is known: P^ = the oracle reading
    the test text with its whole past (the true order-k conditional), P~_tau = the same oracle fed only the last tau
    tokens (lmcal.memory.context_rows: a window model, exactly the stationary chain's order-tau conditional). Returns
    the entropy-rate estimate (the oracle's test CE ± se) and, per tau, the memory stage's numbers (alpha fitted on
    the rows the bound is reported on, jackknife standard errors over blocks of cluster_size positions, cross-fit,
    ΔCE, the two-parameter variant) beside the exact I_tau. Positions t >= max(taus, k), so every context is complete.
    valid_tokens is not read: as in the memory stage, the fit is on the test rows."""
    from lmcal.memory import context_rows, memory_summary, memory_upper_bound  # here: memory imports this module

    oracle = MarkovOracle.from_chain(markov_chain_from_info(info))
    k = info["order"]
    start = max([*taus, k])
    tokens = test_tokens.long()

    def rows(tau: int | None) -> torch.Tensor:  # log P(. | context) at t = start..N-1: [n, V] float64
        return torch.cat([lp for lp, _ in context_rows(oracle, tokens, tau, batch_size=4096)])[start - 1:]

    full, yt = rows(None), tokens[start:]
    est = memory_upper_bound(full, full, yt, alpha=0.0, cluster_size=cluster_size)  # just its CE and se
    result = {"estimated_entropy_rate_nats": est.ce_full, "estimated_entropy_rate_stderr_nats": est.ce_full_stderr,
              "test_tokens": int(yt.numel()), "memory": []}
    for tau in taus:
        result["memory"].append({"tau": tau, "limited": "window", "exact_mi_nats": markov_exact_mi(info, tau),
                                 **memory_summary([(full, rows(tau), yt)], cluster_size=cluster_size)})
    return result
