"""Future-entropy heads: calibrating against the entropy of the whole future at the cost of ordinary sampling.

One-step lookahead calibration (lmcal.core.calibration) tilts each candidate next word w by the entropy H_next(w) of the
distribution after it, which costs a model step per candidate. A future-entropy head amortises it, and looks further:
a small network on the frozen model's state outputs g in R^V, g_w predicting the discounted future entropy

    G_K(w) = E_model[ sum_{j=1..K} discount**(j-1) H(W_{t+j} | past, w, W_{t+1..t+j-1}) ]

along the model's own continuation after w (K = 1, discount 1 is H_next itself). The calibrated family

    P_a(w | past) ∝ P(w | past) exp(a g_w)            (and, with a temperature, P^b exp(a g_w))

has an exact normaliser over the whole vocabulary for one extra product per step, and a* is fitted by held-out
cross-entropy with lmcal.core.expfit's exponential-family fit (convex; CE on the fit text never rises).

The head (FutureEntropyHead): g = level(z) + c + U u(z), z = gelu(A f + a) from the model's state f [F]; U [V, r] is
the model's output embedding times a learned [E, r] map (a network with a linear last layer: its StepLM's `head`) or a
learned [V, r] matrix (the oracles); `level` is constant over the words, so it cancels in P_a: it is there for the
regression only. At use U is formed once, so a step costs one [r, V] product more than the model's.

Training data (rollout_examples): rows start at random points of the training text; each row reads a prefix, then
its first candidate is the true next word (half the rows) or a draw from the model (the other half), and the row then
runs free for `steps + K_max - 1` words. Every `stride`-th of its first `steps` words w_i gives an example (state
before w_i, w_i, sum_j discount**(j-1) H_{i+j}), with every horizon's target from the same run: one rollout per
example, unbiased for G_K (the entropies are exact; only the continuation is sampled), and exact for K = 1. With
`steps` the generation horizon, the examples cover every stage of a free run, the late ones where the drift is too.

Everything here runs on the StepLM interface; the state features come from `features` (networks) or
`state_features(state)` (the oracles).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from lmcal.core.expfit import blocks, fit_theta, objective_k, row_terms_k, stream_block_sums, with_targets_k
from lmcal.core.lookahead import entropy
from lmcal.core.sampling import draw, random_prefixes, uniforms
from lmcal.errors import LmcalError

# ---------------------------------------------------------------------------------------------------------------------
# The model's state
# ---------------------------------------------------------------------------------------------------------------------


def _linear_head(lm):
    """(weight [V, E], bias [V] or None) of a model whose step is log_softmax(features @ weight.T + bias) (the StepLM's
    `features` and `head`), else None."""
    head = getattr(lm, "head", None)
    return head if head is not None and hasattr(lm, "features") else None


def step_features(lm, tokens: torch.Tensor, state):
    """Feed tokens [B]: (log-probs [B, V] float32+, state features f [B, F], new state). A network with a linear
    last layer gives its last layer's input (lmcal.models.step_lm's `features`); an oracle its `state_features`."""
    head = _linear_head(lm)
    if head is not None:
        f, state = lm.features(tokens, state)  # [B, E]
        w, b = head
        z = f.float() @ w.float().T if b is None else torch.addmm(b.float(), f.float(), w.float().T)
        return z.log_softmax(-1), f, state
    if not hasattr(lm, "state_features"):
        raise LmcalError(f"A future-entropy head reads the model's state, but {type(lm).__name__} has neither "
                         "`features` with a linear `head` nor `state_features(state)`.")
    logp, state = lm.step(tokens, state)
    return logp, lm.state_features(state), state


def word_vectors(lm) -> torch.Tensor | None:
    """The model's output embedding [V, E] (None for a model without a linear last layer)."""
    head = _linear_head(lm)
    return None if head is None else head[0].detach()


# ---------------------------------------------------------------------------------------------------------------------
# The head
# ---------------------------------------------------------------------------------------------------------------------


class FutureEntropyHead(nn.Module):
    """f [B, F] -> g [B, V] in nats (see the module docstring); `horizon` K and `discount` say what g predicts."""

    def __init__(self, in_dim: int, vocab_size: int, *, hidden: int = 256, rank: int = 64,
                 words: torch.Tensor | None = None, horizon: int = 1, discount: float = 1.0):
        super().__init__()
        self.horizon, self.discount = int(horizon), float(discount)
        self.trunk = nn.Sequential(nn.Linear(in_dim, hidden), nn.GELU())
        self.coef = nn.Linear(hidden, rank)
        self.level = nn.Linear(hidden, 1)
        self.bias = nn.Parameter(torch.zeros(vocab_size))
        if words is not None:  # the model's output embedding, frozen; the head learns a map of it
            self.register_buffer("basis", words.float().clone())
            self.proj = nn.Linear(words.size(1), rank, bias=False)
        else:
            self.basis = None
            self.words = nn.Parameter(torch.randn(vocab_size, rank) * 0.01)
        self.register_buffer("shift", torch.zeros(()))  # targets are standardised for training: g = shift + scale * .
        self.register_buffer("scale", torch.ones(()))

    def word_matrix(self) -> torch.Tensor:
        """U [V, r] (FutureCalibratedLM forms it once; a full g [B, V] forms it per call)."""
        return self.proj(self.basis) if self.basis is not None else self.words

    def forward(self, f: torch.Tensor, words: torch.Tensor | None = None) -> torch.Tensor:
        """g [B, V] (words None), or g at the given words [B] -> [B]."""
        z = self.trunk(f.float())  # [B, hidden]
        u, level = self.coef(z), self.level(z)[:, 0]  # [B, r], [B]
        if words is None:
            g = torch.addmm(self.bias, u, self.word_matrix().T) + level[:, None]  # [B, V]
        else:  # only the words' rows of U (training: never the whole [V, r] map)
            U = self.proj(self.basis[words]) if self.basis is not None else self.words[words]  # [B, r]
            g = (u * U).sum(-1) + self.bias[words] + level  # [B]
        return self.shift + self.scale * g


@dataclass
class Examples:
    """Regression data of rollout_examples: f [n, F], words [n], targets [n, H] (one column per horizon), group [n]
    (the rollout row each example came from: the unit of the train/validation split), step [n] (the generated word
    it chooses, 1 = the first after the prefix)."""

    features: torch.Tensor
    words: torch.Tensor
    targets: torch.Tensor
    group: torch.Tensor
    horizons: list[tuple[int, float]]
    model_steps: int = 0
    seconds: float = 0.0
    step: torch.Tensor | None = None


def check_horizons(horizons) -> list[tuple[int, float]]:
    out = []
    for h in horizons:
        k, d = (h["horizon_k"], h.get("discount", 1.0)) if isinstance(h, dict) else h
        numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (k, d))
        if not numbers or int(k) != k or k < 1 or not 0 < d <= 1:
            raise LmcalError(f"A future-entropy horizon needs horizon_k a positive integer and 0 < discount <= 1; "
                             f"got {h}.")
        out.append((int(k), float(d)))
    return out


@torch.no_grad()
def rollout_examples(lm, text: torch.Tensor, horizons, *, contexts: int = 400, prefix_len: int = 50,
                     steps: int = 50, stride: int = 1, seed: int = 0, max_batch: int = 1024,
                     progress: bool = False) -> Examples:
    """Regression examples for every horizon at once, from 2 x `contexts` rollouts (see the module docstring): text
    [N] (training text); rows read `prefix_len` tokens, then half take the true next word and half a draw, and all
    run free. Each row gives ceil(steps / stride) examples, at words 1, 1 + stride, ... of its free run. Model steps:
    2 x contexts x (prefix_len + steps + K_max - 1)."""
    import time

    from lmcal.utils.progress import progress_bar

    horizons = check_horizons(horizons)
    kmax = max(k for k, _ in horizons)
    if stride < 1 or steps < 1:
        raise ValueError(f"rollout_examples: steps={steps} and stride={stride} must be positive")
    kept = torch.arange(0, steps, stride)  # [E]: the words of each run that give examples
    t0 = time.perf_counter()
    windows = random_prefixes(text, contexts, prefix_len + 1, seed=seed)  # [C, L + 1]: the last is the true next word
    rows = torch.cat([windows, windows])  # [2C, L + 1]: the first half keeps the true word, the second draws
    n_rows = rows.size(0)
    feats, words, ents = [], [], []
    length = steps + kmax - 1  # free words after the first candidate
    bar = progress_bar(total=n_rows * (prefix_len + length + 1), desc="rollouts", unit="step", disable=not progress,
               leave=False)
    for lo in range(0, n_rows, max_batch):
        chunk = rows[lo:lo + max_batch]
        B = chunk.size(0)
        state = lm.init_state(B)
        for i in range(prefix_len):
            logp, f, state = step_features(lm, chunk[:, i], state)
        bar.update(B * prefix_len)
        gen = (lo + torch.arange(B)).to(logp.device)  # row ids: seed their uniforms (counter-based, like generation)
        true_word = gen < contexts  # [B]: the first half of the rows take the true next word
        f_buf, w_buf, h_buf = [], [], []
        for i in range(length + 1):
            w, _ = draw(logp.exp(), uniforms(seed + 1, gen, i))  # [B]
            if i == 0:
                w = torch.where(true_word, chunk[:, -1].to(w.device), w)
            if i < steps and i % stride == 0:
                f_buf.append(f.float().cpu())
                w_buf.append(w.cpu())
            logp, f, state = step_features(lm, w, state)
            h_buf.append(entropy(logp).double().cpu())  # H_{i+1}: the law after word i
            bar.update(B)
        feats.append(torch.stack(f_buf, 1))  # [B, E, F]
        words.append(torch.stack(w_buf, 1))  # [B, E]
        ents.append(torch.stack(h_buf, 1))  # [B, length + 1]
    bar.close()
    feats, words, ents = torch.cat(feats), torch.cat(words), torch.cat(ents)
    targets = []
    for k, d in horizons:  # G at example i = sum_{j<k} d**j H[:, i + j]
        weights = d ** torch.arange(k, dtype=torch.float64)
        targets.append(ents.unfold(1, k, 1)[:, kept] @ weights)  # [rows, E]
    group = torch.arange(n_rows)[:, None].expand(n_rows, kept.numel())
    step = (kept + 1)[None, :].expand(n_rows, kept.numel())
    F = feats.size(-1)
    return Examples(feats.reshape(-1, F), words.reshape(-1), torch.stack(targets, -1).reshape(-1, len(horizons)),
                    group.reshape(-1), horizons, n_rows * (prefix_len + length + 1), time.perf_counter() - t0,
                    step.reshape(-1))


def regress(head: nn.Module, features: torch.Tensor, words: torch.Tensor, y: torch.Tensor, rows: torch.Tensor, *,
            epochs: int, batch_size: int, lr: float, weight_decay: float, generator: torch.Generator,
            scale: float | torch.Tensor = 1.0) -> None:
    """Fits head(features, words) to y on `rows` by the squared error in units of `scale` (AdamW with a one-cycle
    schedule; minibatches of rows in the order `generator` draws), and leaves the head in eval mode."""
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    total = max(1, epochs * math.ceil(rows.numel() / batch_size))
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=total, pct_start=0.1)
    head.train()
    for _ in range(epochs):
        for idx in rows[torch.randperm(rows.numel(), generator=generator)].split(batch_size):
            loss = ((head(features[idx], words[idx]) - y[idx]) / scale).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
    head.eval()


@dataclass(frozen=True)
class HeadTraining:
    """A head's size and its regression (train_head): the width of gelu(A f + a) and the rank of its word map; AdamW
    with a one-cycle rate over `epochs` passes; the share of rollout rows held out, and the ranges of the generated
    word's index its held-out R² is reported over."""

    hidden: int = 256
    rank: int = 64
    epochs: int = 8
    batch_size: int = 512
    lr: float = 3e-3
    weight_decay: float = 1e-4
    valid_fraction: float = 0.1
    seed: int = 0  # the held-out rows, the head's initial weights and the minibatches' order
    step_bins: int = 5


def train_head(ex: Examples, column: int, vocab_size: int, words: torch.Tensor | None = None,
               settings: HeadTraining | None = None) -> tuple[FutureEntropyHead, dict]:
    """The head for horizon ex.horizons[column], by Adam on the squared error of standardised targets; the rollout
    rows of `settings.valid_fraction` are held out. Returns (head in eval mode, {"r2", "rmse_nats", "valid_examples",
    ..., "r2_by_step": the held-out R² over `settings.step_bins` equal ranges of the generated word's index, when ex
    has steps})."""
    s = settings or HeadTraining()
    k, d = ex.horizons[column]
    g = torch.Generator().manual_seed(s.seed)
    torch.manual_seed(s.seed)  # the head's initial weights
    n_groups = int(ex.group.max()) + 1
    valid_groups = torch.randperm(n_groups, generator=g)[:max(1, int(round(s.valid_fraction * n_groups)))]
    is_valid = torch.isin(ex.group, valid_groups)
    tr, va = (~is_valid).nonzero()[:, 0], is_valid.nonzero()[:, 0]
    y = ex.targets[:, column].float()
    head = FutureEntropyHead(ex.features.size(1), vocab_size, hidden=s.hidden, rank=s.rank, words=words, horizon=k,
                             discount=d)
    head.shift.fill_(y[tr].mean())
    head.scale.fill_(y[tr].std().clamp_min(1e-6))
    regress(head, ex.features, ex.words, y, tr, epochs=s.epochs, batch_size=s.batch_size, lr=s.lr,
            weight_decay=s.weight_decay, generator=g, scale=head.scale)
    with torch.no_grad():
        pred = torch.cat([head(ex.features[i], ex.words[i]) for i in va.split(4096)])
        err = (pred - y[va]).double()
        var = y[va].double().var().item()
    stats = {"horizon_k": k, "discount": d, "train_examples": int(tr.numel()), "valid_examples": int(va.numel()),
             "rmse_nats": err.pow(2).mean().sqrt().item(),
             "r2": 1 - err.pow(2).mean().item() / var if var > 0 else None,
             "target_mean_nats": y.mean().item(), "target_std_nats": y.std().item()}
    if ex.step is not None:
        stats["r2_by_step"] = r2_by_step(err, y[va].double(), ex.step[va], s.step_bins)
    return head, stats


def r2_by_step(err: torch.Tensor, target: torch.Tensor, step: torch.Tensor, bins: int) -> list[dict]:
    """Held-out fit by stage of the free run: err, target, step [n] (prediction error, target, generated word index)
    -> one row per range of steps: {"steps": [first, last], "examples", "r2" (None where the targets do not vary),
    "rmse_nats"}. The ranges split [1, max step] into `bins` equal parts (fewer where there are fewer steps)."""
    top = int(step.max())
    edges = torch.linspace(0, top, min(bins, top) + 1).round().long()
    rows = []
    for lo, hi in zip(edges[:-1].tolist(), edges[1:].tolist(), strict=True):
        m = (step > lo) & (step <= hi)
        if not m.any():
            continue
        e, y = err[m], target[m]
        var = y.var().item() if m.sum() > 1 else 0.0
        rows.append({"steps": [lo + 1, hi], "examples": int(m.sum()), "rmse_nats": e.pow(2).mean().sqrt().item(),
                     "r2": 1 - e.pow(2).mean().item() / var if var > 0 else None})
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# The calibrated family and its fit
# ---------------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def fit_rows(lm, tokens: torch.Tensor, min_context: int = 0, progress: bool = False):
    """One pass over time-major streams tokens [S, B]: (log P [n, V] float32, state features f [n, F], next words
    [n]) on CPU, t-major from t0 = max(1, min_context) (the first t0 tokens of each stream are context only). A head's
    g on these rows is head_rows(head, f)."""
    from lmcal.utils.progress import progress_bar

    S, B = tokens.shape
    t0 = max(1, min_context)
    logps, fs, ys = [], [], []
    state = lm.init_state(B)
    for t in progress_bar(range(S - 1), desc="fit rows", disable=not progress, leave=False):
        logp, f, state = step_features(lm, tokens[t], state)
        if t + 1 >= t0:
            logps.append(logp.float().cpu())
            fs.append(f.float().cpu())
            ys.append(tokens[t + 1].cpu())
    return torch.cat(logps), torch.cat(fs), torch.cat(ys)


@torch.no_grad()
def head_rows(head: FutureEntropyHead, f: torch.Tensor, rows: int = 4096) -> torch.Tensor:
    """g [n, V] float32 of the head on state features f [n, F], `rows` at a time."""
    return torch.cat([head(x) for x in f.split(rows)])


@dataclass
class FutureFit:
    """a* (and b* with the temperature) of P ∝ P^b exp(a g) on held-out rows, with sandwich standard errors (blocks
    of cluster_size positions of a stream as units)."""

    alpha: float
    beta: float
    alpha_stderr: float
    beta_stderr: float | None
    ce_before: float
    ce_after: float
    n_tokens: int
    two_parameter: bool


def fit_future_calibration(logp: torch.Tensor, g: torch.Tensor, targets: torch.Tensor, *, temperature: bool = False,
                           streams: int = 1, cluster_size: int = 100, bound: float = 100.0,
                           start: FutureFit | None = None) -> FutureFit:
    """Fit P_a ∝ P exp(a g) (temperature: P^b exp(a g)) by the cross-entropy of the rows log P [n, V], g [n, V] at
    targets [n] (t-major, `streams` streams), with lmcal.core.expfit's k-statistic fit (float32 rows are reduced in
    float32 with float64 sums: ~1e-7 relative). `start`: an earlier fit to start Newton's method from (the one-
    parameter fit, for the two-parameter one). Raises lmcal.core.expfit.NoFiniteMinimum where CE has no minimum
    inside |theta| < bound (the stage records it)."""
    n = targets.numel()
    stats = (logp, g) if temperature else (g,)
    rows = [with_targets_k(logp, stats, targets)]
    what = "future-entropy calibration" + (" with temperature" if temperature else "")
    init = None if start is None else ([start.beta - 1.0, start.alpha] if temperature else [start.alpha])
    theta = fit_theta(rows, len(stats), bound, what=what, start=init)
    ce0 = objective_k(rows, [0.0] * len(stats))[0]
    ce1, _, hess = objective_k(rows, theta)
    grads = torch.cat([row_terms_k(blk, theta, entropy_terms=False)[2].cpu()
                       for blk in blocks(rows)])  # [n, k]: the per-position gradients
    meat = stream_block_sums(grads, streams, cluster_size)  # [blocks, k]
    hinv = torch.linalg.pinv(hess)
    cov = hinv @ (meat.T @ meat) @ hinv / n ** 2  # the sandwich, blocks of a stream as units
    se = cov.diagonal().sqrt().tolist()
    if temperature:
        return FutureFit(theta[1], 1.0 + theta[0], se[1], se[0], ce0, ce1, n, True)
    return FutureFit(theta[0], 1.0, se[0], None, ce0, ce1, n, False)


class FutureCalibratedLM:
    """P ∝ P^beta exp(alpha g) as a StepLM, g from a future-entropy head on the model's state. State = the model's.

    A model with a linear last layer (logits f W^T + b) gets one product per step: log P^beta exp(alpha g) is, up to
    a constant per row (which log_softmax drops, with the head's `level` and `shift`),
        [beta f, alpha s u] @ [W, U]^T + (beta b + alpha s c),    u = the head's coefficients, s its scale,
    so the head costs its small trunk and r more columns of the output product, and no extra pass over [B, V]. Other
    models (the oracles) step, then add alpha g to beta log P. `head` lives where the model runs (the stages move a
    trained head there): its trunk reads the model's features at every step."""

    def __init__(self, lm, head: FutureEntropyHead, alpha: float, beta: float = 1.0):
        self.lm, self.head, self.alpha, self.beta = lm, head.eval(), float(alpha), float(beta)
        self.vocab_size = lm.vocab_size
        self.device = getattr(lm, "device", None)
        out = _linear_head(lm)
        self.fused = out is not None
        if self.fused:
            w, b = out
            with torch.no_grad():
                U = head.word_matrix().to(w.device)  # [V, r]
                self.weight = torch.cat([w.float(), U.float()], 1)  # [V, E + r]
                c = head.bias.to(w.device).float() * (self.alpha * head.scale.item())
                self.bias = c if b is None else self.beta * b.float() + c  # [V]

    def init_state(self, batch_size: int):
        return self.lm.init_state(batch_size)

    @torch.no_grad()
    def step(self, tokens, state):
        if not self.fused:
            logp, f, state = step_features(self.lm, tokens, state)
            z = self.beta * logp + self.alpha * self.head(f).to(logp.device, logp.dtype)  # [B, V]
            return z.log_softmax(-1), state
        f, state = self.lm.features(tokens, state)  # [B, E]
        h = self.head
        u = h.coef(h.trunk(f.float()))  # [B, r]
        x = torch.cat([self.beta * f.float(), (self.alpha * h.scale) * u], 1)  # [B, E + r]
        return torch.addmm(self.bias, x, self.weight.T).log_softmax(-1), state  # [B, V]

    def select(self, state, index):
        return self.lm.select(state, index)
