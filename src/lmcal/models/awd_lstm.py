"""The AWD-LSTM (Merity et al., 2018) on the fused LSTM kernel.

Shapes are time-major throughout: tokens [T, B], activations [T, B, H].
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

# cuDNN wants one contiguous weight buffer; a freshly dropped weight_hh never is, so
# it compacts per call (the copy is cheap next to the LSTM) and says so each time.
warnings.filterwarnings("ignore", message=".*RNN module weights are not part of single contiguous.*")


def locked_dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Variational dropout: one mask per sequence, shared over time. x [T, B, H]."""
    if not training or p == 0.0:
        return x
    mask = x.new_empty(1, x.size(1), x.size(2)).bernoulli_(1 - p) / (1 - p)  # [1, B, H]
    return x * mask


def embedding_dropout(weight: torch.Tensor, tokens: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    """Drop whole vocabulary rows (the same word is dropped everywhere in the batch), rescaled.

    Equivalent to F.embedding(tokens, weight * row_mask) but only gathers the rows used.
    """
    emb = F.embedding(tokens, weight)  # [T, B, E]
    if not training or p == 0.0:
        return emb
    row_mask = weight.new_empty(weight.size(0), 1).bernoulli_(1 - p) / (1 - p)  # [V, 1]
    return emb * F.embedding(tokens, row_mask)


def drop_connect(weight: torch.Tensor, p: float) -> torch.Tensor:
    """weight with each entry zeroed with probability p, the rest scaled by 1 / (1 - p) (training only).

    The mask comes from torch.rand, not F.dropout: on the CPU dropout draws its Bernoulli mask one element at a
    time on one thread, which cost 9% of a paper-size training step (a [4H, H] mask per layer per step); rand fills
    the same mask about four times faster. The mask is a plain tensor, so backward multiplies by it once."""
    mask = torch.rand_like(weight).ge_(p).div_(1.0 - p)  # [out, in]: 0 or 1 / (1 - p)
    return weight * mask


class WeightDropLSTM(nn.Module):
    """One LSTM layer with DropConnect on its hidden-to-hidden matrix.

    The raw matrix is the trained parameter; each forward draws one mask, and the
    dropped copy is passed to the fused kernel (cuDNN on GPU, the native kernel on
    CPU) with torch.func.functional_call, so autograd carries gradients back to the
    raw weight and no Python loop over time steps runs.
    """

    def __init__(self, input_size: int, hidden_size: int, weight_drop: float):
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size)
        self.weight_drop = weight_drop
        self.hidden_size = hidden_size

    def forward(self, x, state):
        if not self.training or self.weight_drop == 0.0:
            return self.lstm(x, state)
        params = dict(self.lstm.named_parameters())
        params["weight_hh_l0"] = drop_connect(params["weight_hh_l0"], self.weight_drop)
        return functional_call(self.lstm, params, (x, state))


class AWDLSTM(nn.Module):
    """3-layer AWD-LSTM language model with tied embeddings.

    memory_tau: when set, training resets the state to zero every tau tokens of the
    stream (the limited-memory model of the paper's Section 5).
    """

    def __init__(
        self,
        vocab_size: int,
        emb_size: int = 400,
        hidden_size: int = 1150,
        num_layers: int = 3,
        dropout: float = 0.4,
        dropouth: float = 0.25,
        dropouti: float = 0.4,
        dropoute: float = 0.1,
        wdrop: float = 0.5,
        tie_weights: bool = True,
        memory_tau: int | None = None,
    ):
        super().__init__()
        if memory_tau is not None and int(memory_tau) < 1:
            raise ValueError(f"memory_tau must be a positive integer or null, got {memory_tau}")
        self.vocab_size, self.emb_size, self.hidden_size = vocab_size, emb_size, hidden_size
        self.num_layers = num_layers
        self.dropout, self.dropouth, self.dropouti, self.dropoute = dropout, dropouth, dropouti, dropoute
        self.memory_tau = None if memory_tau is None else int(memory_tau)
        self.encoder = nn.Embedding(vocab_size, emb_size)
        sizes = [emb_size] + [hidden_size] * (num_layers - 1) + [emb_size if tie_weights else hidden_size]
        self.rnns = nn.ModuleList(WeightDropLSTM(sizes[i], sizes[i + 1], wdrop) for i in range(num_layers))
        self.decoder = nn.Linear(sizes[-1], vocab_size)
        if tie_weights:
            self.decoder.weight = self.encoder.weight
        self.init_weights()

    def init_weights(self):
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1)
        nn.init.zeros_(self.decoder.bias)

    def init_hidden(self, batch_size: int):
        w = self.encoder.weight
        return [
            (w.new_zeros(1, batch_size, r.hidden_size), w.new_zeros(1, batch_size, r.hidden_size)) for r in self.rnns
        ]

    def forward(self, tokens: torch.Tensor, hidden):
        """tokens [T, B] -> (output [T, B, E] after the last dropout, raw last-layer output, new hidden).

        The decoder is applied by the caller (`logits`) so that losses can be chunked.
        """
        emb = embedding_dropout(self.encoder.weight, tokens, self.dropoute, self.training)
        x = locked_dropout(emb, self.dropouti, self.training)
        new_hidden = []
        for i, rnn in enumerate(self.rnns):
            x, h = rnn(x, hidden[i])
            new_hidden.append(h)
            raw = x
            x = locked_dropout(x, self.dropouth if i < self.num_layers - 1 else self.dropout, self.training)
        return x, raw, new_hidden

    def logits(self, output: torch.Tensor) -> torch.Tensor:
        return self.decoder(output)  # [..., V]


def ar_tar(output: torch.Tensor, raw: torch.Tensor, ar_weight: float, tar_weight: float) -> torch.Tensor:
    """AWD activation regularisers on the last layer, both [T, B, H]:
    AR = ar_weight * mean(output^2) on the dropped output (keeps activations small),
    TAR = tar_weight * mean((raw[t+1] - raw[t])^2) on the raw output (keeps them slow-moving)."""
    reg = output.new_zeros(())
    if ar_weight:
        reg = reg + ar_weight * output.pow(2).mean()
    if tar_weight and raw.size(0) > 1:
        reg = reg + tar_weight * (raw[1:] - raw[:-1]).pow(2).mean()
    return reg


def repackage(hidden):
    """Detach the state from the graph of the previous batch (truncated BPTT)."""
    return [tuple(t.detach() for t in h) for h in hidden]


def matmul_params(net: AWDLSTM) -> int:
    """Parameters that take part in a matrix multiply per token (embedding lookup excluded,
    decoder counted once even when tied): the N in the 6·N FLOPs-per-token estimate."""
    n = sum(p.numel() for name, p in net.rnns.named_parameters() if "weight" in name)
    return n + net.decoder.weight.numel()


@torch.no_grad()
def evaluate_ce(net: AWDLSTM, tokens: torch.Tensor, batch_size: int, bptt: int = 70,
                progress: str | None = None) -> tuple[float, int]:
    """Mean next-token cross-entropy (nats) of `net` on a 1-D token stream, read as
    `batch_size` contiguous streams in windows of `bptt` with the state carried over.
    Returns (ce, number of predicted tokens). progress: a name for progress lines with the time left."""
    from lmcal.data.batching import batchify, bptt_spans, get_batch
    from lmcal.utils.progress import progress_bar

    was_training = net.training
    net.eval()
    source = batchify(tokens, batch_size)  # [S, B]
    hidden = net.init_hidden(batch_size)
    total, count = 0.0, 0
    spans = list(bptt_spans(source.size(0), bptt))
    for start, seq_len in progress_bar(spans, desc=progress or "", disable=progress is None, leave=False):
        x, y = get_batch(source, start, seq_len)
        x, y = x.to(net.decoder.weight.device), y.to(net.decoder.weight.device)
        output, _, hidden = net(x, hidden)
        total += F.cross_entropy(net.logits(output).flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    net.train(was_training)
    return total / count, count


def forward_chunked(net: AWDLSTM, tokens: torch.Tensor, tau: int):
    """Run a window whose length is a multiple of tau as independent tau-chunks, each from a
    zero state: the limited-memory model's training (and chunked validation) forward.

    tokens [T, B] with T = k*tau -> the chunks become k*B parallel streams of length tau, so the
    fused kernel does all of them at once. Returns (output, raw) as [T, B, H] in the original order.
    """
    T, B = tokens.shape
    if T % tau:
        raise ValueError(f"window length {T} is not a multiple of memory_tau={tau}")
    k = T // tau
    chunks = tokens.view(k, tau, B).permute(1, 0, 2).reshape(tau, k * B)  # [tau, k*B]
    output, raw, _ = net(chunks, net.init_hidden(k * B))

    def unchunk(h):  # [tau, k*B, H] -> [T, B, H]
        return h.view(tau, k, B, -1).permute(1, 0, 2, 3).reshape(T, B, -1)

    return unchunk(output), unchunk(raw)


@torch.no_grad()
def limited_context_log_probs(net: AWDLSTM, tokens: torch.Tensor, tau: int, windows_per_batch: int = 512):
    """Exact limited-context predictions along a 1-D stream.

    Yields (log_probs [n, V], targets [n]) chunks, in order, for every position t = 1..N-1:
    log P(. | tokens[max(0, t-tau):t]), each from a zero state fed exactly those (at most tau)
    tokens. Positions t <= tau share one pass over the first tau tokens; every later position is
    a sliding window of exactly tau tokens, many windows per forward, only the last step decoded.
    """
    was_training = net.training
    net.eval()
    device = net.decoder.weight.device
    tokens = tokens.to(device)
    n = tokens.numel()
    head = tokens[: min(tau, n - 1)].view(-1, 1)  # [h, 1]: context lengths 1..h
    output, _, _ = net(head, net.init_hidden(1))
    yield net.logits(output[:, 0]).log_softmax(-1), tokens[1: head.size(0) + 1]
    # windows tokens[s:s+tau] predict t = s+tau, for s = 1..n-1-tau
    starts = torch.arange(1, max(1, n - tau), device=device)
    for i in range(0, starts.numel(), windows_per_batch):
        s = starts[i:i + windows_per_batch]
        x = tokens[s[None, :] + torch.arange(tau, device=device)[:, None]]  # [tau, w]
        output, _, _ = net(x, net.init_hidden(s.numel()))
        yield net.logits(output[-1]).log_softmax(-1), tokens[s + tau]
    net.train(was_training)


def limited_context_ce(net: AWDLSTM, tokens: torch.Tensor, tau: int, windows_per_batch: int = 512,
                       progress: str | None = None):
    """Mean cross-entropy (nats) of the exact tau-context predictions; returns (ce, count). progress: a name for
    progress lines with the time left."""
    from lmcal.utils.progress import progress_bar

    total, count = 0.0, 0
    chunks = limited_context_log_probs(net, tokens, tau, windows_per_batch)
    for lp, y in progress_bar(chunks, total=-(-max(tokens.numel() - 1, 0) // windows_per_batch), desc=progress or "",
                              disable=progress is None, leave=False):
        total -= lp.gather(1, y[:, None]).sum().item()
        count += y.numel()
    return total / count, count


@torch.no_grad()
def full_context_log_probs(net: AWDLSTM, tokens: torch.Tensor, bptt: int = 70):
    """Full-context predictions along a 1-D stream, aligned with `limited_context_log_probs`.

    Yields (log_probs [n, V], targets [n]) chunks, in order, for every position t = 1..N-1:
    log P(. | tokens[:t]), one stream from a zero state with the state carried across windows.
    """
    was_training = net.training
    net.eval()
    device = net.decoder.weight.device
    tokens = tokens.to(device)
    hidden = net.init_hidden(1)
    for i in range(0, tokens.numel() - 1, bptt):
        x = tokens[i:i + bptt + 1]
        output, _, hidden = net(x[:-1, None], hidden)  # [t, 1, E]
        yield net.logits(output[:, 0]).log_softmax(-1), x[1:]
    net.train(was_training)
