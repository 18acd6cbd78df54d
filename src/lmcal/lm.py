"""One step-wise interface for every language model the analysis code looks at.

A `StepLM` is fed one token per row at a time and answers with the log-probabilities of the next token. Trained
LSTMs (full or tau-limited context) and exact oracles (the Markov source, and a deliberately drifting model) all
implement it, so the entropy-rate and calibration code is written once and checked against known truths.
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np
import torch

from lmcal.data import MarkovChain, markov_conditional, markov_stationary
from lmcal.model import AWDLSTM


class StepLM(Protocol):
    vocab_size: int

    def init_state(self, batch_size: int):
        """The state before any token (nothing is predicted from it: feed at least one token first)."""
        ...

    def step(self, tokens: torch.LongTensor, state) -> tuple[torch.Tensor, object]:
        """tokens [B]; returns log-probabilities [B, V] of the next token given everything fed so far, and the new
        state"""
        ...

    def select(self, state, index: torch.LongTensor):
        """The state of batch rows `index` (repeats allowed): how one prefix fans out to many generations."""
        ...


# ---------------------------------------------------------------------------------------------------------------------
# Trained AWD-LSTMs
# ---------------------------------------------------------------------------------------------------------------------


class LSTMStepLM:
    """A trained AWDLSTM carried one token at a time; state = the list of (h, c), each [1, B, H]."""

    def __init__(self, net: AWDLSTM):
        self.net = net.eval()  # no dropout: we want the model's predictive distribution
        self.vocab_size = net.vocab_size
        self.device = net.decoder.weight.device

    def init_state(self, batch_size: int):
        return self.net.init_hidden(batch_size)

    @torch.no_grad()
    def step(self, tokens, state):
        output, _, state = self.net(tokens.to(self.device)[None], state)  # [1, B, E]
        return self.net.logits(output[0]).float().log_softmax(-1), state  # [B, V]

    def select(self, state, index):
        index = index.to(self.device)
        return [(h[:, index], c[:, index]) for h, c in state]


def lstm_from_checkpoint(path, device="cpu") -> LSTMStepLM:
    """The validated network of a training checkpoint (see lmcal.module.load_net) as a StepLM on `device`."""
    from lmcal.module import load_net  # Lightning and Hydra load only when a checkpoint is read

    net, _ = load_net(path, map_location=device)
    return LSTMStepLM(net.to(device))


class LimitedContextStepLM:
    """The exact tau-limited conditional P(. | last tau tokens) of a net, as a StepLM.

    State = (buffer [B, tau] of the last tokens, most recent last; count of tokens fed, the same for all rows). Each
    step re-runs the net from a zero state over the (at most tau) buffered tokens in one batched forward: tau times
    the cost of LSTMStepLM, the price of forgetting exactly. The step-wise twin of model.limited_context_log_probs.
    """

    def __init__(self, net: AWDLSTM, tau: int):
        if int(tau) < 1:
            raise ValueError(f"tau must be a positive integer, got {tau}")
        self.net, self.tau = net.eval(), int(tau)
        self.vocab_size = net.vocab_size
        self.device = net.decoder.weight.device

    def init_state(self, batch_size: int):
        return torch.zeros(batch_size, self.tau, dtype=torch.long, device=self.device), 0

    @torch.no_grad()
    def step(self, tokens, state):
        buf, count = state
        buf = torch.cat([buf[:, 1:], tokens.to(self.device)[:, None]], dim=1)  # [B, tau]: drop the oldest
        count += 1
        ctx = buf[:, -min(count, self.tau):].t()  # [m, B]: only the tokens really seen, m <= tau
        output, _, _ = self.net(ctx, self.net.init_hidden(buf.size(0)))
        return self.net.logits(output[-1]).float().log_softmax(-1), (buf, count)  # [B, V]

    def select(self, state, index):
        buf, count = state
        return buf[index.to(self.device)], count


# ---------------------------------------------------------------------------------------------------------------------
# Exact oracles
# ---------------------------------------------------------------------------------------------------------------------


class MarkovOracle:
    """The exact conditionals of an order-k Markov source (lmcal.data), float64 log-probabilities.

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
