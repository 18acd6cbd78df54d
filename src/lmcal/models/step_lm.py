"""One step-wise interface for every language model the analysis code looks at.

A `StepLM` is fed one token per row at a time and answers with the log-probabilities of the next token. Trained
LSTMs (full or tau-limited context), any Hugging Face causal LM (HFCausalLM, with the optional transformers) and
exact oracles (the Markov source, and a deliberately drifting model) all implement it, so the entropy-rate and
calibration code is written once and checked against known truths. LogitsStepLM makes a researcher's own model, any
module or function from tokens [B, T] to logits [B, T, V], one too. The oracles are lmcal.models.oracles, on the source
of lmcal.data.markov.
"""

from __future__ import annotations

from typing import Protocol

import torch

from lmcal.models.awd_lstm import AWDLSTM


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

    # Optional: start_generation(logp [B, V], state) -> (logp, state), called by generation_entropy_curve once the
    # prefix is fed, before the first generated word; samplers with a running state (Mirostat) reset it there.
    #
    # Optional, for models whose last layer is linear (the networks): features(tokens, state) -> (f [B, E], state)
    # and head = (weight [V, E], bias [V] or None), with step's log-probs = log_softmax(f @ weight.T + bias). The
    # lookahead then computes a candidate's next entropy from f in vocabulary blocks that stay in cache, without
    # the [B, V] log-probs (lmcal.core.lookahead.linear_entropy); the future-entropy heads read f.


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
    def features(self, tokens, state):
        """The last layer's output f [B, E] after feeding tokens [B], and the new state."""
        output, _, state = self.net(tokens.to(self.device)[None], state)  # [1, B, E]
        return output[0], state

    @property
    def head(self):
        return self.net.decoder.weight, self.net.decoder.bias  # [V, E], [V]

    def state_features(self, state) -> torch.Tensor:
        """The features of the last step that led to `state` [B, E]: the top layer's h, which is its output (no dropout
        in eval mode), so a head on the features (a soft-value twist) reads them from the state alone."""
        return state[-1][0][0]

    @torch.no_grad()
    def step(self, tokens, state):
        f, state = self.features(tokens, state)
        return self.net.logits(f).float().log_softmax(-1), state  # [B, V]

    def select(self, state, index):
        index = index.to(self.device)
        return [(h[:, index], c[:, index]) for h, c in state]

    @torch.no_grad()
    def recurrent_terms(self, state) -> list[torch.Tensor]:
        """Each layer's h W_hh^T + b_hh + b_ih [B, 4H] in `state`: the part of the next step's gates that does not
        depend on the word fed, the same for every candidate word stepped from a row (lmcal.core.lookahead)."""
        return [torch.addmm(r.lstm.bias_hh_l0 + r.lstm.bias_ih_l0, h[0], r.lstm.weight_hh_l0.T)
                for r, (h, _) in zip(self.net.rnns, state, strict=True)]

    @torch.no_grad()
    def candidate_features(self, tokens, state, rows, shared) -> torch.Tensor:
        """features(tokens, select(state, rows))[0] for tokens [c] fed to rows `rows` [c], with shared =
        recurrent_terms(state): per candidate only the input products run, since h W_hh^T is a row's, not a
        candidate's. 1.4x fewer FLOPs a candidate for the cpu model, 1.9x for the paper's (bench/lookahead_step.py:
        1.2-1.3x and 1.6x faster). [c, E]; equal to the nn.LSTM step up to float rounding."""
        rows = rows.to(self.device)
        x = self.net.encoder.weight[tokens.to(self.device)]  # [c, E]
        for r, (_, c), hh in zip(self.net.rnns, state, shared, strict=True):
            i, f, g, o = torch.addmm(hh[rows], x, r.lstm.weight_ih_l0.T).chunk(4, 1)  # each [c, H]; nn.LSTM's order
            x = torch.sigmoid(o) * torch.tanh(torch.sigmoid(f) * c[0, rows] + torch.sigmoid(i) * torch.tanh(g))
        return x


def as_step_lm(net):
    """A trained network as a StepLM: an AWDLSTM as LSTMStepLM, a network with its own adapter (GPTLM: an
    HFCausalLM) through its step_lm(); a StepLM is returned as it is."""
    if isinstance(net, AWDLSTM):
        return LSTMStepLM(net)
    if hasattr(net, "step_lm"):
        return net.step_lm()
    return net



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
# Any model that returns logits [B, T, V]
# ---------------------------------------------------------------------------------------------------------------------


class LogitsStepLM:
    """A causal model from tokens [B, T] to next-token logits [B, T, V] (an nn.Module or a plain function; an output
    with `.logits`, as Hugging Face models return, is read too) as a StepLM.

    State = the tokens fed so far [B, t]. Each step runs the model on the whole prefix and reads its last position, so
    it is exact for any architecture, with no cache to get wrong, at t tokens of forward per step. With `max_positions`
    (the model's context) a step reads only the last max_positions tokens. `window_log_probs` reads a window in one
    forward: how lmcal.core.context builds the memory bound's rows. An nn.Module is put in eval mode (no dropout: the
    model's predictive distribution). vocab_size=None: read off one forward of a single token.
    """

    def __init__(self, model, vocab_size: int | None = None, *, max_positions: int | None = None, device=None):
        if isinstance(model, torch.nn.Module):
            model.eval()
            if device is None:
                device = next((p.device for p in model.parameters()), None)
        self.model, self.max_positions = model, max_positions
        self.device = torch.device(device or "cpu")
        self.vocab_size = int(vocab_size or self._logits(torch.zeros(1, 1, dtype=torch.long)).size(-1))

    @torch.no_grad()
    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        out = self.model(tokens.to(self.device))
        logits = getattr(out, "logits", out)
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or logits.shape[:2] != tokens.shape:
            shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise ValueError(f"the model must map tokens [B, T] = {tuple(tokens.shape)} to logits [B, T, V]; "
                             f"got {shape}")
        return logits

    def init_state(self, batch_size: int):
        return torch.zeros(batch_size, 0, dtype=torch.long, device=self.device)

    def step(self, tokens, state):
        state = torch.cat([state, tokens.to(self.device)[:, None]], dim=1)  # [B, t]
        if self.max_positions:
            state = state[:, -self.max_positions:]  # what the model can read
        return self._logits(state)[:, -1].float().log_softmax(-1), state  # [B, V]

    def window_log_probs(self, windows: torch.Tensor, keep: int = 1) -> torch.Tensor:
        """Log-probabilities [b, keep, V] of the token after each of the last `keep` positions of windows [b, T]."""
        return self._logits(windows)[:, -keep:].float().log_softmax(-1)

    def select(self, state, index):
        return state[index.to(self.device)]
