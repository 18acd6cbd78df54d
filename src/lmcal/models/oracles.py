"""Exact StepLM oracles on the synthetic Markov source (lmcal.markov), where every answer is known: the truth
(`MarkovOracle`), a model that drifts analytically (`DriftingOracle`), one whose drift starts d words after a trigger
(`DelayedDriftOracle`, with its exact future entropies and generation curves), and the memory estimators run on the
truth (`markov_oracle_memory`). See lmcal.lm for the StepLM interface.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from lmcal.data.markov import (
    MarkovChain,
    entropy_np,
    markov_conditional,
    markov_stationary,
)


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
        future-entropy head (lmcal.core.future_entropy) reads, in place of a network's hidden state."""
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
        ent = entropy_np(law)
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
            ent = entropy_np(law)
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
