"""Next-word log-probabilities of any StepLM along a stream, with the whole past or only the last tau tokens: the rows
of the memory bound (lmcal.core.memory), chunked so that two calls on the same text line up.

    for log_probs, targets in context_rows(lm, tokens, tau=5):   # [n, V], [n]
        ...
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


def _rechunk(chunks: Iterable[tuple[torch.Tensor, torch.Tensor]], size: int):
    """(rows [n, V], targets [n]) chunks of any lengths, re-cut to exactly `size` rows each (the last may be short)."""
    buf: list[tuple[torch.Tensor, torch.Tensor]] = []
    have = 0
    for lp, y in chunks:
        while lp.size(0):
            take = min(size - have, lp.size(0))
            buf.append((lp[:take], y[:take]))
            lp, y, have = lp[take:], y[take:], have + take
            if have == size:
                yield torch.cat([b[0] for b in buf]), torch.cat([b[1] for b in buf])
                buf, have = [], 0
    if have:
        yield torch.cat([b[0] for b in buf]), torch.cat([b[1] for b in buf])


@torch.no_grad()
def _stream_rows(lm, tokens: torch.Tensor):
    """log P(. | tokens[:t]) for t = 1..N-1: one stream of batch 1, each token fed once."""
    state = lm.init_state(1)
    for t in range(tokens.numel() - 1):
        logp, state = lm.step(tokens[t:t + 1], state)  # [1, V]
        yield logp, tokens[t + 1:t + 2]


@torch.no_grad()
def _window_rows(lm, tokens: torch.Tensor, tau: int, batch_size: int):
    """log P(. | tokens[max(0, t-tau):t]) for t = 1..N-1, every context fed from lm.init_state."""
    n = tokens.numel()
    # t <= tau: the windows are the prefixes tokens[:t], so one stream of the first min(tau, n-1) tokens gives them all
    yield from _stream_rows(lm, tokens[:min(tau, n - 1) + 1])
    # t > tau: window tokens[s:s+tau] predicts t = s+tau, s = 1..n-1-tau; batch_size windows fed side by side
    starts = torch.arange(1, max(1, n - tau))
    offsets = torch.arange(tau)
    for i in range(0, starts.numel(), batch_size):
        s = starts[i:i + batch_size]
        window = tokens[s[:, None] + offsets]  # [b, tau]
        state = lm.init_state(s.numel())
        for j in range(tau):
            logp, state = lm.step(window[:, j], state)  # [b, V]
        yield logp, tokens[s + tau]


def context_rows(lm, tokens: torch.Tensor, tau: int | None = None,
                 batch_size: int = 512) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Next-word log-probabilities of a StepLM along a 1-D stream tokens [N]: (log_probs [n, V], targets [n]) chunks
    in order for t = 1..N-1, each exactly `batch_size` rows (the last may be shorter), so the chunks of two calls on
    the same tokens line up (zip them into memory_upper_bound's chunk triples).

    tau=None: log P(. | tokens[:t]), the stream read once with its whole past (batch 1). An int tau: log P(. |
    tokens[max(0, t-tau):t]), every window fed from lm.init_state: the model itself as a tau-limited model, with no
    training (tau steps of batch_size windows at a time). A trained LSTM (LSTMStepLM) takes the fused paths of
    lmcal.models.awd_lstm instead (the same rows, one forward per window batch, the decoder only where read).

    A model with `window_log_probs` (HFCausalLM) reads each window in one uncached forward instead of tau
    cached steps. With tau=None and a stream longer than its context L (lm.max_positions), it cannot hold the whole
    past: the stream is read in windows of L tokens overlapping by half, so each position t > L is predicted from
    between L/2 + 1 and L of the tokens before it (`full_context_span` says which).
    """
    from lmcal.models.awd_lstm import full_context_log_probs, limited_context_log_probs
    from lmcal.models.step_lm import LSTMStepLM

    if tau is not None and int(tau) < 1:
        raise ValueError(f"tau must be a positive integer or None, got {tau}")
    tokens = tokens.reshape(-1).long()
    if isinstance(lm, LSTMStepLM):
        rows = (full_context_log_probs(lm.net, tokens, bptt=batch_size) if tau is None
                else limited_context_log_probs(lm.net, tokens, int(tau), batch_size))
        rows = ((lp.float(), y) for lp, y in rows)
    elif hasattr(lm, "window_log_probs"):
        rows = (_long_stream_rows(lm, tokens, batch_size) if tau is None
                else _forward_window_rows(lm, tokens, int(tau), batch_size))
    else:
        rows = _stream_rows(lm, tokens) if tau is None else _window_rows(lm, tokens, int(tau), batch_size)
    return _rechunk(rows, batch_size)


def full_context_span(lm, n_tokens: int) -> str:
    """What context_rows(tau=None) conditions on for a stream of n_tokens: the whole past, or, for a model whose
    context L is shorter than the stream, between L/2 + 1 and L tokens."""
    L = getattr(lm, "max_positions", None)
    if not L or n_tokens - 1 <= L:
        return "the whole past"
    return f"the last {L // 2 + 1} to {L} tokens (windows of {L} overlapping by half: the model's context)"


@torch.no_grad()
def _forward_window_rows(lm, tokens: torch.Tensor, tau: int, batch_size: int):
    """_window_rows with each window in one uncached forward (lm.window_log_probs)."""
    n = tokens.numel()
    h = min(tau, n - 1)
    yield lm.window_log_probs(tokens[None, :h], keep=h)[0], tokens[1:h + 1]  # t <= tau: the prefixes of one window
    starts = torch.arange(1, max(1, n - tau))
    offsets = torch.arange(tau)
    for i in range(0, starts.numel(), batch_size):
        s = starts[i:i + batch_size]
        yield lm.window_log_probs(tokens[s[:, None] + offsets], keep=1)[:, 0], tokens[s + tau]  # [b, V]


@torch.no_grad()
def _long_stream_rows(lm, tokens: torch.Tensor, batch_size: int):
    """log P(. | past) for t = 1..N-1 by uncached forwards: one window if the stream fits the model's context L, else
    windows tokens[a:a+L], a = 0, L/2, L, ..., the first giving targets 1..L and each later one its last L/2."""
    n = tokens.numel()
    L = getattr(lm, "max_positions", None) or n
    if n - 1 <= L:
        yield lm.window_log_probs(tokens[None, :n - 1], keep=n - 1)[0], tokens[1:]
        return
    S = L // 2
    yield lm.window_log_probs(tokens[None, :L], keep=L)[0], tokens[1:L + 1]
    starts = list(range(S, n - 1 - L + S, S))  # window a predicts targets a+L-S+1 .. a+L (the last may be short)
    per = max(1, batch_size // S)
    for i in range(0, len(starts), per):
        group = starts[i:i + per]
        full = [a for a in group if a + L <= n - 1]
        if full:
            a = torch.tensor(full)
            lp = lm.window_log_probs(tokens[a[:, None] + torch.arange(L)], keep=S)  # [b, S, V]
            yield lp.reshape(-1, lp.size(-1)), tokens[(a[:, None] + torch.arange(L - S + 1, L + 1)).reshape(-1)]
        for a in group[len(full):]:  # the stream's end: a shorter last window
            w = tokens[a:n - 1]
            keep = n - 1 - (a + L - S)
            yield lm.window_log_probs(w[None], keep=keep)[0], tokens[n - keep:]


def zip_rows(*streams):
    """Zips streams of (rows [n, V], targets [n]) chunks whose chunk lengths differ, re-cut to common lengths.

    Yields (rows_1, ..., rows_k, targets); the streams must cover the same targets in the same order.
    """
    its = [iter(s) for s in streams]
    bufs = [None] * len(its)
    while True:
        bufs = [b if b is not None and b[1].numel() else next(it, None) for b, it in zip(bufs, its, strict=True)]
        if any(b is None for b in bufs):
            if not all(b is None for b in bufs):
                raise ValueError("the streams cover different numbers of positions")
            return
        n = min(b[1].numel() for b in bufs)
        y = bufs[0][1][:n]
        if any(not torch.equal(b[1][:n], y) for b in bufs[1:]):
            raise ValueError("the streams' targets differ: they are not aligned on the same text")
        yield (*(b[0][:n] for b in bufs), y)
        bufs = [(b[0][n:], b[1][n:]) for b in bufs]
