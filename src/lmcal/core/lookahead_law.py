"""The law lookahead calibration fits, scores and generates from: one law, built by one function for all three.

At each position the base distribution q (the eps-mixed P) and the state give a candidate set C (the rule):

- exact (topk and cover null): every word, V model steps per position;
- top-k: the k most likely words;
- cover c: the smallest set of most likely words holding at least c of q's mass, at most cover_max words and at
  most what the memory budget holds for one row's lookahead (lmcal.core.lookahead.row_capacity).

Each word w of C gets its own tilt e^{a H_next(w)}; the rest R = V \\ C share one tilt T(a) = mean_j e^{a H_next(w_j)},
w_1..w_m drawn with replacement from q restricted to R by counter-based uniforms keyed by (seed, the row's history):

    P_a(w) = q(w) e^{a H(w)} / Z   (w in C),     P_a(w) = q(w) T(a) / Z   (w in R),
    Z(a) = sum_C q e^{a H} + q(R) T(a)   (an unbiased estimate of the exact Z(a) for every a).

The same atoms (`law_atoms`: the m tail atoms first, of weight q(R) / m each, then C) give the generating row
(`law_log_probs`) and the held-out cross-entropy (`law_objective`) at a true next word y:

    CE_t(a) = log Z(a) - log q(y) - a H(y)    (y in C),      log Z(a) - log q(y) - log T(a)    (y in R),

so the a* fitted is that of the law that generates, and its test CE is the law's own: a word of R shares the tilt in
the fit as it does in generation. CE is not convex in general (-log T is concave); CE' = E_{P_a}[H] - (H(y), or
E_{tail, a}[H] for y in R) and CE'' = Var_{P_a}[H] - (0, or Var_{tail, a}[H]); the fit is Newton's method with a
bisection bracket (expfit.newton_minimize).

`hnext_shifts` measures, without generation noise, what each rule keeps of the exact tilt: at states of the model's
own generations, E_{P_a}[H_next] - E_q[H_next] of the exact law against that of each rule's law, every H exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lmcal.core.expfit import blocks, row_terms
from lmcal.core.lookahead import (
    candidate_entropies,
    draw_tail,
    lookahead_entropies,
    row_capacity,
    tail_uniforms,
)
from lmcal.errors import LmcalError


@dataclass(frozen=True)
class Rule:
    """Which words of a position get their own lookahead tilt (see the module docstring)."""

    topk: int | None = None
    cover: float | None = None
    cover_max: int | None = None
    tail_samples: int = 16

    @property
    def exact(self) -> bool:
        return self.topk is None and self.cover is None

    @property
    def draws(self) -> int:
        """m: the tail draws per position (0 in exact mode)."""
        return 0 if self.exact else self.tail_samples

    @property
    def label(self) -> str:
        if self.exact:
            return "exact"
        if self.topk is not None:
            return f"top-{self.topk}"
        return f"cover {self.cover:g}" + (f" (at most {self.cover_max})" if self.cover_max else "")

    def settings(self) -> dict:
        """The rule as settings (the calibration stage's keys)."""
        return {"topk": self.topk, "cover": self.cover, "cover_max": self.cover_max,
                "tail_samples": None if self.exact else self.tail_samples}


def _count(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and float(v).is_integer() and v >= 1


def make_rule(topk: int | None = None, cover: float | None = None, cover_max: int | None = None,
              tail_samples: int | None = 16) -> Rule:
    """The candidate rule of these settings, checked (one paragraph for a bad one)."""
    if topk is not None and not _count(topk):
        raise LmcalError(f"topk={topk!r}: the lookahead's own-tilt candidates per position must be a positive "
                         "integer, or null (with cover null: exact lookahead over the whole vocabulary).")
    if cover is not None and (isinstance(cover, bool) or not isinstance(cover, (int, float))
                              or not 0 < cover <= 1):
        raise LmcalError(f"cover={cover!r}: the covering rule's share of the model's mass must be in (0, 1], or null.")
    if topk is not None and cover is not None:
        raise LmcalError(f"topk={topk} and cover={cover}: a position's candidates are either the top k words or the "
                         "smallest set covering a share of the mass; set the other to null (e.g. topk=null "
                         "cover=0.95).")
    if cover_max is not None and not _count(cover_max):
        raise LmcalError(f"cover_max={cover_max!r}: the covering rule's most candidates per position must be a "
                         "positive integer, or null (as many as the memory budget holds).")
    exact = topk is None and cover is None
    if not exact and not _count(tail_samples):
        raise LmcalError(f"tail_samples={tail_samples!r}: the words outside a position's candidates share one tilt "
                         "estimated from this many drawn words; it must be a positive integer.")
    return Rule(None if topk is None else int(topk), None if cover is None else float(cover),
                None if cover_max is None else int(cover_max), int(tail_samples) if not exact else 16)


def candidate_set(logq: torch.Tensor, rule: Rule, cap: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The own-tilt candidates of rows logq [B, V]: (words [B, c], mask [B, c]), each row's most likely words first
    and its mask True on its own candidates (the rest of the c columns are words of R, unused). cap: the covering
    rule's most candidates (with rule.cover_max; None: V)."""
    B, V = logq.shape
    if rule.exact:
        return torch.arange(V, device=logq.device).expand(B, V), torch.ones(B, V, dtype=torch.bool,
                                                                             device=logq.device)
    if rule.topk is not None:
        k = min(rule.topk, V)
        return logq.topk(k, dim=-1).indices, torch.ones(B, k, dtype=torch.bool, device=logq.device)
    top = min(V, cap or V, rule.cover_max or V)
    vals, words = logq.topk(top, dim=-1)  # [B, top], most likely first
    p = vals.double().exp()
    cum = p.cumsum(-1)  # [B, top]
    total = logq.double().exp().sum(-1, keepdim=True)  # [B, 1]: 1 up to rounding
    n = ((cum < rule.cover * total).sum(-1) + 1).clamp_(max=top)  # [B]: the first prefix reaching the share
    c = int(n.max())
    return words[:, :c], torch.arange(c, device=logq.device) < n[:, None]


def law_atoms(lm, state, logq: torch.Tensor, keys: torch.Tensor, rule: Rule, seed: int, epsilon: float = 0.0,
              chunk: int | None = None, cap: int | None = None, entropies: torch.Tensor | None = None):
    """The law's atoms at B rows in `state`: (words [B, c], mask [B, c], logw [B, m + c], h [B, m + c]): the m tail
    atoms first (weight q(R) / m each, H of the drawn word), then the candidates (q(w), H(w); weight 0 where the mask
    is False). logq [B, V]: the (eps-mixed) base log-probs in `state`; keys [B]: the rows' history hashes; cap: the
    covering rule's most candidates (None: what the memory budget holds for a row, row_capacity). With `entropies`
    [B, V] (every word's H_next, known) the atoms take theirs and the model is not stepped."""
    B, V = logq.shape
    if rule.cover is not None and cap is None and entropies is None:
        fused = epsilon == 0.0 and getattr(lm, "head", None) is not None
        cap = row_capacity(lm, state, V, lm.head[0].device if fused else logq.device, fused)
    words, mask = candidate_set(logq, rule, cap)  # [B, c]
    if rule.exact:
        h = entropies if entropies is not None else lookahead_entropies(lm, state, logq, epsilon, chunk)
        return words, mask, logq, h
    m = rule.tail_samples
    own = torch.where(mask, words, words[:, :1])  # [B, c]: unused columns repeat the first word, which is in C
    tail, log_rest = draw_tail(logq, own, tail_uniforms(seed, keys, m))  # [B, m], [B]
    both = torch.cat([tail, words], 1)  # [B, m + c]
    if entropies is not None:
        h = entropies.gather(1, both)
    else:
        used = torch.cat([torch.isfinite(log_rest)[:, None].expand(B, m), mask], 1)  # no draws where R is empty
        h = candidate_entropies(lm, state, both, epsilon, chunk, mask=used).to(logq.device)
    logw = torch.cat([(log_rest - math.log(m))[:, None].expand(B, m),
                      logq.gather(1, words).masked_fill(~mask, -math.inf)], 1)  # [B, m + c]
    return words, mask, logw, h


def law_log_probs(logq: torch.Tensor, atoms, alpha: float, m: int) -> torch.Tensor:
    """The law's next-word log-probs [B, V] from its atoms (law_atoms) at tilt alpha, m tail atoms."""
    words, mask, _, h = atoms
    h = h.to(logq.dtype)
    if m:
        log_tilt = (alpha * h[:, :m]).logsumexp(-1) - math.log(m)  # [B]: log T(a) = log mean_j e^{a H(w_j)}
        row = logq + log_tilt[:, None]  # [B, V]: every word at the shared tilt ...
    else:
        row = logq
    own = logq.gather(1, words) + alpha * h[:, m:]  # [B, c]
    # ... the candidates at their own (the unused columns are words of R: written back unchanged)
    row = row.scatter(1, words, torch.where(mask, own, row.gather(1, words)))
    return row.log_softmax(-1)


def target_slots(words: torch.Tensor, mask: torch.Tensor, y: torch.Tensor, m: int) -> torch.Tensor:
    """Each row's true next word y [B] as its atom index (m + its column among the candidates), or -1 where it is
    in R and shares the tail's tilt. [B] long."""
    hit = (words == y[:, None]) & mask  # [B, c]
    return torch.where(hit.any(1), m + hit.long().argmax(1), -1)


# ---------------------------------------------------------------------------------------------------------------------
# The held-out objective of the law
# ---------------------------------------------------------------------------------------------------------------------
# Statistics of n positions: (logw [n, K], h [n, K], log q(y) [n], y's atom [n]), K = m + the largest candidate set
# (columns past a row's own: weight 0). Per row, two tilted families of expfit.row_terms: all the atoms, with y's
# own H as its statistic (0 for y in R), and for y in R the tail alone (m atoms of weight 1 / m: its log Z is log T).


def law_row_terms(logw, h, logq_y, slot, m: int, a: float):
    """Per-row float64 (CE_t, CE'_t, CE''_t, E_{P_a}[H]) [n] each, at a."""
    own = slot >= 0
    h_y = torch.where(own, h.gather(1, slot.clamp(min=0)[:, None])[:, 0], 0.0)
    _, ce, d1, d2, mean = row_terms(logw, h, logq_y, h_y, a)
    rest = (~own).nonzero()[:, 0]
    if m and rest.numel():
        t = h[rest, :m]  # [r, m]
        zeros = torch.zeros(rest.numel(), dtype=t.dtype, device=t.device)
        _, log_t, e_t, var_t, _ = row_terms(torch.full_like(t, -math.log(m)), t, zeros, zeros, a)
        ce, d1, d2 = ce.index_add(0, rest, -log_t), d1.index_add(0, rest, -e_t), d2.index_add(0, rest, -var_t)
    return ce, d1, d2, mean


@torch.no_grad()
def law_objective(stats: tuple, m: int, a: float, per_row: bool = False, elements: int | None = None):
    """Means over the positions of (CE, CE', CE'', E_{P_a}[H], the target's statistic: H(y), or E_{tail,a}[H] for y
    in R) at a; with per_row, also CE'_t [n] and CE_t [n] float64 on CPU."""
    sums, n, d1s, ces = torch.zeros(5, dtype=torch.float64), 0, [], []
    for logw, h, logq_y, slot in blocks([stats], elements):
        ce, d1, d2, mean = law_row_terms(logw, h, logq_y, slot, m, a)
        sums += torch.stack([ce.sum(), d1.sum(), d2.sum(), mean.sum(), (mean - d1).sum()]).cpu()
        n += ce.numel()
        if per_row:
            d1s.append(d1.cpu())
            ces.append(ce.cpu())
    means = (sums / n).tolist()
    return (means, torch.cat(d1s), torch.cat(ces)) if per_row else means


# ---------------------------------------------------------------------------------------------------------------------
# What each rule keeps of the exact tilt, without generation noise
# ---------------------------------------------------------------------------------------------------------------------


def rule_shift(logq: torch.Tensor, h: torch.Tensor, keys: torch.Tensor, rule: Rule, alpha: float, seed: int,
               cap: int | None = None) -> torch.Tensor:
    """E_{P_a}[H_next] - E_q[H_next] [B] of the rule's law at rows logq [B, V] whose exact H_next are h [B, V] (every
    word's): the rule's candidates and tail draws as in generation, every expectation over the exact H."""
    atoms = law_atoms(None, None, logq, keys, rule, seed, cap=cap, entropies=h)
    law = law_log_probs(logq, atoms, alpha, rule.draws).double().exp()  # [B, V]
    h = h.double()
    return (law * h).sum(-1) - (logq.double().exp() * h).sum(-1)


@torch.no_grad()
def hnext_shifts(lm, prefixes: torch.Tensor, horizon: int, steps: list[int], rules: list[Rule], alphas: list[float],
                 seed: int = 0, epsilon: float = 0.0, chunk: int | None = None, progress: bool = False) -> dict:
    """At the given steps (1-based: step t is the t-th generated word) of one plain generation from each of
    prefixes [N, L] (the base model, eps-mixed, sampled with the uniforms of generation_entropy_curve's generation
    g = prefix g), every word's H_next exactly (V model steps a row), and there each law's E_{P_a}[H_next] -
    E_q[H_next] for every a in `alphas`: {"exact": [A, P], rule.label: [A, P], ...} float64 with P = N * len(steps)
    positions in step-major order (position i is generation i % N), plus "cap" (the covering rule's, from the memory
    budget), "candidates" and "mass": each rule's mean candidates per position and the mean mass of q they hold."""
    from lmcal.core.lookahead import advance_keys, mix_uniform, start_keys
    from lmcal.core.sampling import draw, uniforms

    N, L = prefixes.shape
    state = lm.init_state(N)
    keys = start_keys(N)
    for i in range(L):
        logp, state = lm.step(prefixes[:, i], state)
        keys = advance_keys(keys.to(logp.device), prefixes[:, i])
    gen_ids = torch.arange(N, device=logp.device)
    laws = list({r.label: r for r in [Rule(), *rules]}.values())  # exact first, each law once
    out = {r.label: [[] for _ in alphas] for r in laws}
    sizes = {r.label: [] for r in rules if not r.exact}
    masses = {r.label: [] for r in rules if not r.exact}
    cap = None
    todo = sorted(set(steps))
    bar = range(1, max(todo) + 1)
    if progress:
        from lmcal.utils.progress import progress_bar
        bar = progress_bar(bar, desc="exact lookahead shifts")
    for t in bar:
        logq = mix_uniform(logp, epsilon)  # [N, V]
        if t in todo:
            h = lookahead_entropies(lm, state, logq, epsilon, chunk)  # [N, V]
            if cap is None:
                fused = epsilon == 0.0 and getattr(lm, "head", None) is not None
                cap = row_capacity(lm, state, logq.size(1), lm.head[0].device if fused else logq.device, fused)
            for r in laws:
                for j, a in enumerate(alphas):
                    out[r.label][j].append(rule_shift(logq, h, keys, r, a, seed, cap).cpu())
                if not r.exact:
                    words, mask = candidate_set(logq, r, cap)
                    sizes[r.label].append(mask.sum(1).double().cpu())
                    masses[r.label].append((logq.gather(1, words).double().exp() * mask).sum(1).cpu())
        if t == max(todo):
            break
        tokens, _ = draw(logq.exp(), uniforms(seed, gen_ids, t - 1))
        logp, state = lm.step(tokens, state)
        keys = advance_keys(keys, tokens)
    return {**{k: torch.stack([torch.cat(x) for x in v]) for k, v in out.items()}, "cap": cap,
            "candidates": {"exact": float(logq.size(1)), **{k: torch.cat(v).mean().item() for k, v in sizes.items()}},
            "mass": {"exact": 1.0, **{k: torch.cat(v).mean().item() for k, v in masses.items()}}}
