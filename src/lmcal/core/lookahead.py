"""The lookahead: H_next(w), the entropy of the next distribution after each candidate word w, for lookahead
calibration (lmcal.core.calibration) and the calibrated model's steps. Exact (every word: V model steps per position) or
top-k + tail candidates, with the tail drawn from counter-based uniforms keyed by each row's history; a StepLM with a
linear last layer gets its entropies fused with that layer (linear_entropy). Also the one `entropy` and the one
eps-mixing of the package."""

from __future__ import annotations

import math
import os

import torch

from lmcal.errors import LmcalError
from lmcal.utils.profiling import span, timed

# The memory one lookahead chunk may hold (analysis.memory_budget_gb; the entry points set it once per process with
# set_memory_budget). None: half the device's free memory on CUDA, CPU_BUDGET_GB on the CPU. A chunk holds, per
# candidate, what it keeps of its row's state (a copy of a transformer's key/value cache, lm.row_bytes, or its share
# of a past its row's candidates read together, lm.candidate_bytes) and its logits' floats.
CPU_BUDGET_GB = 2.0
# On the CPU the chunk and the vocabulary block also keep their cache-sized caps (the sizes every CPU figure in docs/
# was measured with); on CUDA the budget alone sets the chunk, and a chunk's logits are one [c, V] product.
CPU_MAX_CHUNK, CPU_BLOCK = 512, 1024
# On CUDA a chunk of 65,536 candidates already amortises the ~250 kernel launches of one chunk many times over; larger
# ones only hold more memory.
CUDA_MAX_CHUNK = 1 << 16
_budget_gb: float | None = None


def set_memory_budget(gb: float | None) -> None:
    """The lookahead's memory budget in GB for this process (None: from the device, see above)."""
    global _budget_gb
    if gb is not None and not gb > 0:
        raise LmcalError(f"analysis.memory_budget_gb={gb!r}: the lookahead's memory budget must be a positive number "
                         "of GB, or null to take half the device's free memory (CUDA) or 2 GB (CPU).")
    _budget_gb = None if gb is None else float(gb)


def memory_budget(device: torch.device) -> float:
    """Bytes one lookahead chunk (or the memory stage's rows) may hold on `device`: analysis.memory_budget_gb, else on
    CUDA half the free memory, shared among the stages that may run on the GPU at once ($LMCAL_GPU_SHARERS, which
    make reproduce sets for jobs > 1: two stages would otherwise each claim half), else CPU_BUDGET_GB."""
    if _budget_gb is not None:
        return _budget_gb * 1e9
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        try:
            sharers = max(1, int(os.environ.get("LMCAL_GPU_SHARERS", "1")))
        except ValueError:
            sharers = 1
        return 0.5 * free / sharers
    return CPU_BUDGET_GB * 1e9


def candidate_bytes(lm, state, V: int, device: torch.device, fused: bool, per_row: int = 1) -> tuple[float, int]:
    """(bytes one lookahead candidate holds, vocabulary words per block of linear_entropy): its row's state for one
    step (where the model says: lm.candidate_bytes(state, per_row) with `per_row` candidates a row, or
    lm.row_bytes(state), its forked copy) and its float32 rows of logits:
    LOGIT_ROWS rows of [block] fused (linear_entropy), three of [V] otherwise (log-probs, their exp and the product)."""
    block = CPU_BLOCK if device.type == "cpu" else V
    if hasattr(lm, "candidate_bytes"):
        row = lm.candidate_bytes(state, per_row)
    else:
        row = lm.row_bytes(state) if hasattr(lm, "row_bytes") else 0
    return row + 4.0 * (LOGIT_ROWS * min(block, V) if fused else 3 * V), block


def chunk_sizes(lm, state, pairs: int, V: int, device: torch.device, fused: bool,
                per_row: int = 1) -> tuple[int, int]:
    """(candidates per forward, vocabulary words per block of linear_entropy) that keep one chunk within the memory
    budget (candidate_bytes each)."""
    per, block = candidate_bytes(lm, state, V, device, fused, per_row)
    chunk = max(1, int(memory_budget(device) // per))
    chunk = min(chunk, CPU_MAX_CHUNK if device.type == "cpu" else CUDA_MAX_CHUNK)
    return min(chunk, max(1, pairs)), block


def row_capacity(lm, state, V: int, device: torch.device, fused: bool) -> int:
    """The most candidates of one row whose lookahead the memory budget holds at once (at most V): the cap of the
    covering candidate rule (lmcal.core.lookahead_law). The chunk caps of the CPU and CUDA (CPU_MAX_CHUNK,
    CUDA_MAX_CHUNK) set how candidates are batched, not how many a row may have, so they do not cap it."""
    per, _ = candidate_bytes(lm, state, V, device, fused, V)
    return max(1, min(V, int(memory_budget(device) // per)))


def mix_uniform(logp: torch.Tensor, epsilon: float, vocab_size: int | None = None) -> torch.Tensor:
    """log((1 - eps) P + eps / V) of log-probs [..., V]; eps = 0 returns logp itself (bit for bit). vocab_size: V
    when logp is not a whole row (e.g. the log-probs of the true next words only, [n]).

    The mixture is per token: each next-word distribution is mixed with the uniform one. The paper mixes whole
    sequences, (1 - eps) P(w_1..T) + eps U(w_1..T), whose conditionals are not this per-token mixture; both keep every
    cross-entropy finite."""
    if epsilon == 0.0:
        return logp
    if not 0.0 < epsilon <= 1.0:
        raise ValueError(f"epsilon must be in [0, 1], got {epsilon}")
    V = vocab_size or logp.size(-1)
    return torch.logaddexp(logp + math.log1p(-epsilon), torch.full_like(logp, math.log(epsilon / V)))


def entropy(logp: torch.Tensor, p: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy in nats of each row of log-probs [..., V] -> [...] (0 log 0 = 0); p: logp.exp() if already at hand."""
    p = logp.exp() if p is None else p
    # 0 log 0: p * -inf is nan where p = 0, and nansum drops it (one pass; a clamp first costs ten times as much). A
    # nan or +inf log-prob still shows: it makes the row's mass, added times 0, nan. No branch, so no device sync.
    return -(p * logp).nansum(-1) + 0.0 * p.sum(-1)


LOGIT_ROWS = 2  # [c, block] float32 tensors linear_entropy holds at once (the shifted logits and their exp)


def head_logits(f: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """f [c, E] @ weight.T [E, block] (+ bias) as float32 logits [c, block]. A bf16/fp16 head on CUDA multiplies in its
    own dtype on the tensor cores with float32 accumulation and output (torch.mm's out_dtype), instead of casting both
    to float32 first (with TF32 off, lmcal.utils.device, a float32 product runs off the tensor cores)."""
    if f.is_cuda and weight.dtype in (torch.bfloat16, torch.float16):
        try:
            z = torch.mm(f.to(weight.dtype), weight.T, out_dtype=torch.float32)
        except (TypeError, RuntimeError):  # a torch before mm's out_dtype (2.8): the float32 product below
            z = None
        if z is not None:
            return z if bias is None else z.add_(bias.float())
    f, w = f.float(), weight.float()
    return f @ w.T if bias is None else torch.addmm(bias.float(), f, w.T)


def linear_entropy(f: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   block: int = 1024) -> torch.Tensor:
    """Entropy (nats) of softmax(f @ weight.T + bias) for each row of f [c, E] -> [c] float32, weight [V, E].

    The logits are made `block` words at a time and folded into running sums (the online softmax), relative to the
    running max m: s = sum exp(z - m) and u = sum exp(z - m) (z - m), so H = log s - u / s. Each [c, block] piece is
    reduced while it is in cache, so the [c, V] logits are never written out and read back, as log_softmax and an
    entropy pass over them would do; a piece is shifted in place, and u is a batched dot product, so a block holds
    two [c, block] float32 tensors (LOGIT_ROWS), not the three of z, exp(z - m) and their product."""
    c, V = f.size(0), weight.size(0)
    m = torch.full((c,), -math.inf, device=f.device)
    s, u = torch.zeros(c, device=f.device), torch.zeros(c, device=f.device)
    for j in range(0, V, block):
        z = head_logits(f, weight[j:j + block], None if bias is None else bias[j:j + block])  # [c, block]
        m_new = torch.maximum(m, z.amax(-1))
        z.sub_(m_new[:, None])  # z - m_new, in place
        e = torch.exp(z)  # [c, block]
        # the sums so far, moved from m to m_new: exp(z - m_new) = r exp(z - m), (z - m_new) = (z - m) + (m - m_new)
        r = torch.exp(m - m_new)  # 0 on the first block (m = -inf)
        gap = torch.nan_to_num(m - m_new, nan=0.0, neginf=0.0)  # 0 where m = -inf (s = u = 0 there)
        u = r * (u + gap * s) + torch.bmm(e[:, None, :], z[:, :, None]).view(c)
        s = r * s + e.sum(-1)
        m = m_new
    return s.log() - u / s


@timed("lookahead")
def candidate_entropies(lm, state, cand: torch.Tensor, epsilon: float, chunk: int | None = None,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """H of the (eps-mixed) next distribution after feeding candidate cand[b, k] to state row b. cand [B, K] -> [B, K].

    All B*K (row, candidate) pairs (only those where mask [B, K] is True, when given: the others are 0 and cost
    nothing) are flattened and stepped `chunk` at a time (None: as many as the memory budget holds, chunk_sizes) from
    their row's state: from copies of it, or, where the model shares a row's past among its candidates
    (HFCausalLM.candidate_step), from the state itself. A StepLM with a linear last layer (`features` and `head`, see
    StepLM) gets its entropies from linear_entropy when eps = 0.
    """
    B, K = cand.shape
    rows = torch.arange(B, device=cand.device).repeat_interleave(K)  # [B*K]: row b repeated K times
    toks = cand.reshape(-1)  # [B*K]
    if mask is not None:  # the pairs kept, each row's still together and in order
        keep = mask.to(cand.device).reshape(-1)
        rows, toks = rows[keep], toks[keep]
    pairs = toks.numel()
    fused = epsilon == 0.0 and getattr(lm, "head", None) is not None
    device = lm.head[0].device if fused else cand.device
    auto, block = chunk_sizes(lm, state, pairs, getattr(lm, "vocab_size", None) or 50_000, device, fused,
                              max(1, pairs // max(1, B)))
    chunk = chunk or auto
    # a fork for one step: a model that can (HFCausalLM) gives it room for that step only, not a growing buffer
    fork = getattr(lm, "select_for_step", lm.select)
    # an LSTM's h W_hh^T once per row, not per candidate (lmcal.models.step_lm.LSTMStepLM.candidate_features)
    shared = lm.recurrent_terms(state) if fused and hasattr(lm, "candidate_features") else None
    # a transformer's past read once per row by all its candidates, not copied for each
    share_past = hasattr(lm, "candidate_step") and lm.shares_past(state)
    h = []
    for i in range(0, pairs, chunk):
        c_toks, c_rows = toks[i:i + chunk], rows[i:i + chunk]
        if shared is not None:
            f = lm.candidate_features(c_toks, state, c_rows, shared)  # [c, E]
        elif fused:  # [c, E]; stepped forks are dropped at once, not kept alive (as `f, _ = ...` would) while the
            # next chunk's are made: one chunk's forks at a time
            f = (lm.candidate_step(c_toks, state, c_rows, features=True) if share_past
                 else lm.features(c_toks, fork(state, c_rows))[0])
        else:
            lp = lm.candidate_step(c_toks, state, c_rows) if share_past else lm.step(c_toks, fork(state, c_rows))[0]
            h.append(entropy(mix_uniform(lp, epsilon)))  # [c]; lp [c, V]
            continue
        with span("forward", 2.0 * lm.head[0].numel() * f.size(0)):  # the output layer, fused with its entropy
            h.append(linear_entropy(f, *lm.head, block=block))
    if mask is None:
        return torch.cat(h).view(B, K)
    out = torch.zeros(B * K, device=keep.device, dtype=h[0].dtype if h else torch.float32)
    if h:
        out[keep] = torch.cat(h).to(keep.device)
    return out.view(B, K)


@torch.no_grad()
def lookahead_entropies(lm, state, logp: torch.Tensor, epsilon: float = 0.0, chunk: int | None = None) -> torch.Tensor:
    """H_next(w) of every word w of every row, exactly: [B, V], V forwards per row, at most `chunk` per forward (None:
    from the memory budget).

    state: the lm state of B rows; logp [B, V]: the lm's next-token log-probs in that state (raw, eps is applied here,
    to the lookahead's distributions)."""
    B, V = logp.shape
    return candidate_entropies(lm, state, torch.arange(V, device=logp.device).expand(B, V), epsilon, chunk)


# The tail draws: counter-based, keyed by a hash of each row's history (see the module docstring).
_KEY0 = 0x7A115EED  # the hash of the empty history: apart from generation indices, which start at 0


def start_keys(batch_size: int, device=None) -> torch.Tensor:
    return torch.full((batch_size,), _KEY0, dtype=torch.int64, device=device)


def advance_keys(keys: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The history hashes [B] after reading tokens [B]."""
    from lmcal.core.sampling import absorb  # lazily: entropy_rate imports the calibration (and so this module)

    return absorb(keys, tokens.to(keys.device).long())


def tail_uniforms(seed: int, keys: torch.Tensor, m: int) -> torch.Tensor:
    """[B, m] float64 uniforms in [0, 1), a pure function of (seed, history hash keys [B], draw j)."""
    from lmcal.core.sampling import uniforms

    return torch.stack([uniforms(seed, keys, j) for j in range(m)], 1)


def draw_tail(logq: torch.Tensor, exact: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """m words from logq [B, V] restricted to the words not in exact [B, c] (with replacement, inverse CDF on the
    uniforms u [B, m]): (words [B, m], log of the rest's mass [B]; -inf where it is 0, and the words are then
    meaningless)."""
    rest = logq.scatter(1, exact, -math.inf)  # [B, V]
    cdf = rest.double().exp().cumsum(-1)  # [B, V]
    # first word whose cumulative mass exceeds u * total: words of mass 0 (flat cdf) are never drawn
    words = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=logq.size(1) - 1)
    return words, rest.logsumexp(-1)
