"""The decoding rules practitioners use against drifting generations, as StepLM wrappers.

Each rule turns the model's next-word log-probabilities into the distribution actually sampled from: a rescaling
(temperature) or a truncation (top-k, top-p, typical, eta, min-p, Mirostat) followed by renormalisation, with -inf
where a word is cut. Wrapped as a `StepLM`, a decoder runs through `generation_entropy_curve` and `score` unchanged,
so the entropy on its curve is that of the distribution it samples from, and its held-out cost is measured on the
very same distribution.

    make_decoder("top_p", lm, p=0.95)

Truncations work on log-probs [B, V]; the kept set is decided in float64 on the normalised probabilities. Ties are
kept together: where a rule needs "the smallest set" and the cut falls inside a group of words with the same score,
the whole group is kept, so the result never depends on an arbitrary order of equal words (top-k does the same as
the transformers library's warper). Every rule keeps at least one word, and every rule except locally typical
sampling keeps the most likely one (typical keeps the words whose surprisal is closest to the entropy, which can
exclude the mode). Each rule's neutral setting (T = 1, k >= V, p = 1, mass = 1, eta_cutoff = 0, min_p = 0,
Mirostat target_surprise = inf) returns the model's own log-probs, bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from lmcal.core.calibration import target_log_probs
from lmcal.core.lookahead import entropy, mix_uniform
from lmcal.errors import LmcalError
from lmcal.utils.profiling import timed
from lmcal.utils.rules import decoder_problems, renamed_note

LOG2 = math.log(2.0)


# ---------------------------------------------------------------------------------------------------------------------
# The rules, on log-probability rows [B, V]
# ---------------------------------------------------------------------------------------------------------------------


def _normalised(logp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log q, q) in float64 [B, V]: logp renormalised in float64, so that rules with absolute thresholds (eta,
    Mirostat, the entropy of typical) see a distribution that sums to one to float64 precision."""
    lq = logp.double()
    lq = lq - lq.logsumexp(-1, keepdim=True)
    return lq, lq.exp()


def _keep(logp: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """logp renormalised over the words where keep [B, V] is true; -inf elsewhere."""
    out = logp.masked_fill(~keep, -math.inf)
    return out - out.logsumexp(-1, keepdim=True)


BIN_NATS, BINS = 1 / 32, 1024  # the bins of _smallest_set: 1/32 nat wide, 32 nats in all


def _smallest_set(key: torch.Tensor, dist: torch.Tensor, p: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Mask [B, V] of the smallest set of words, taken in decreasing `key`, whose probability p [B, V] (float64,
    not necessarily normalised) reaches `mass` [B, 1] (in p's units); every word tied in key with the last one taken
    is kept too. dist [B, V] >= 0 is the words' distance in nats from the first one in that order (a non-decreasing
    function of -key: surprisal over the best word's for top-p, distance to the entropy for typical).

    Without a sort of [B, V], which would cost more than the rest of a generation step: the words are binned by
    dist, the mass per bin locates the bin where `mass` is reached, and only that bin's words are ordered (words
    beyond the last bin, at most e^-32 of the best one's probability for top-p, share it). The size of that order
    (n_in) is read on the host: on CUDA, top-p and typical sampling wait for the device once a generated word."""
    b = (dist * (1 / BIN_NATS)).clamp_(max=BINS - 1).long()  # [B, V]; equal keys, equal bins
    per_bin = torch.zeros(b.size(0), BINS, dtype=p.dtype, device=p.device).scatter_add_(1, b, p)  # [B, BINS]
    cum = per_bin.cumsum(-1)
    k = (cum < mass).sum(-1, keepdim=True).clamp_(max=BINS - 1)  # [B, 1]: the bin where the mass is reached
    before = torch.where(k > 0, cum.gather(-1, (k - 1).clamp(min=0)), 0.0)  # [B, 1]: mass of the bins ahead of it
    inside = b == k  # [B, V]
    n_in = int(inside.sum(-1).max())
    k_in, idx = key.masked_fill(~inside, -math.inf).topk(n_in, dim=-1)  # [B, n_in]: the bin's words, in order
    valid = inside.gather(-1, idx)
    p_in = torch.where(valid, p.gather(-1, idx), 0.0)
    ahead = before + p_in.cumsum(-1) - p_in  # [B, n_in]: mass of the words ahead of each
    n = ((ahead < mass) & valid).sum(-1, keepdim=True).clamp_(min=1)  # words of this bin needed (at least one)
    return key >= k_in.gather(-1, n - 1)


def temperature(logp: torch.Tensor, temperature: float) -> torch.Tensor:
    """P^(1/T), renormalised."""
    if temperature == 1.0:
        return logp
    return (logp / temperature).log_softmax(-1)


def top_k(logp: torch.Tensor, k: int) -> torch.Tensor:
    """The k most likely words (and any tied with the k-th)."""
    if k >= logp.size(-1):
        return logp
    kth = logp.topk(k, dim=-1).values[..., -1:]  # [B, 1]
    return _keep(logp, logp >= kth)


def top_p(logp: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus sampling (Holtzman et al. 2020): the smallest set of most likely words with mass >= p."""
    if p >= 1.0:
        return logp
    lp = logp.double()
    best = lp.amax(-1, keepdim=True)  # [B, 1]
    q = (lp - best).exp_()  # [B, V]: probabilities over the best word's; the threshold p scales with their sum
    return _keep(logp, _smallest_set(lp, best - lp, q, p * q.sum(-1, keepdim=True)))


def typical(logp: torch.Tensor, mass: float) -> torch.Tensor:
    """Locally typical sampling (Meister et al. 2022): the smallest set of words whose surprisal is closest to the
    entropy, with mass >= `mass`."""
    if mass >= 1.0:
        return logp
    lq, q = _normalised(logp)
    dist = (lq + entropy(lq, q)[:, None]).abs_()  # [B, V]: |surprisal - H|, inf for p = 0
    return _keep(logp, _smallest_set(-dist, dist, q, torch.full_like(dist[:, :1], mass)))


def eta(logp: torch.Tensor, eta_cutoff: float) -> torch.Tensor:
    """eta-sampling (Hewitt et al. 2022): drop words with p < eta = min(e, sqrt(e) * exp(-H)), e = eta_cutoff (the
    paper's epsilon; the transformers library's name)."""
    if eta_cutoff == 0.0:
        return logp
    lq, q = _normalised(logp)
    cut = torch.clamp(math.sqrt(eta_cutoff) * (-entropy(lq, q)[:, None]).exp(), max=eta_cutoff)  # [B, 1]
    return _keep(logp, (q >= cut) | (q == q.amax(-1, keepdim=True)))


def min_p(logp: torch.Tensor, min_p: float) -> torch.Tensor:
    """min-p sampling (Nguyen et al. 2024): drop words with p < min_p * max p."""
    if min_p == 0.0:
        return logp
    lp = logp.double()  # the rule is scale-free: no need to renormalise
    return _keep(logp, lp >= math.log(min_p) + lp.amax(-1, keepdim=True))


def mirostat_cut(logp: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
    """Mirostat v2's truncation: the words whose surprisal in bits is at most mu [B] (at least the most likely). mu
    is not read on the host (on CUDA that would wait for the device every word): the decoder skips the cut itself
    where its target, hence every mu, is +inf."""
    lq, _ = _normalised(logp)
    return _keep(logp, (lq >= -LOG2 * mu.double()[:, None]) | (lq == lq.amax(-1, keepdim=True)))  # surprisal <= mu


# ---------------------------------------------------------------------------------------------------------------------
# As StepLMs
# ---------------------------------------------------------------------------------------------------------------------


CPU_CHUNK = 1 << 19  # row entries a rule works on at once on the CPU (below)


def by_rows(rule: Callable[..., torch.Tensor], logp: torch.Tensor, *per_row: torch.Tensor) -> torch.Tensor:
    """rule(logp [B, V], *per_row [B, ...]) applied to blocks of rows. Every rule works row by row, so the result is
    the same bit for bit; on the CPU, blocks of about CPU_CHUNK entries keep the rules' float64 [B, V] temporaries
    in cache and in the allocator's reused memory, where whole batches are slower (bench/cpu_blocks.py measures
    both)."""
    rows = max(1, CPU_CHUNK // max(1, logp.size(-1)))
    if logp.is_cuda or logp.size(0) <= rows:
        return rule(logp, *per_row)
    return torch.cat([rule(logp[i:i + rows], *(x[i:i + rows] for x in per_row)) for i in range(0, logp.size(0), rows)])


class DecodedLM:
    """`lm` with a per-step rule `rule(logp [B, V]) -> logp' [B, V]` applied to its next-word distributions."""

    def __init__(self, lm, rule: Callable[[torch.Tensor], torch.Tensor], name: str, params: dict):
        self.lm, self.rule, self.name, self.params = lm, rule, name, params
        self.vocab_size = lm.vocab_size
        self.device = getattr(lm, "device", None)

    def init_state(self, batch_size: int):
        return self.lm.init_state(batch_size)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, state):
        logp, state = self.lm.step(tokens, state)
        return by_rows(self.rule, logp), state

    def select(self, state, index: torch.Tensor):
        return self.lm.select(state, index)


class MirostatLM:
    """Mirostat v2 (Basu et al. 2021) as a StepLM: per generation a running threshold mu (bits), starting at 2 tau
    (tau = target_surprise, the paper's tau, in bits; eta = learning_rate); each step samples among the words with
    surprisal <= mu, then moves mu by -eta * (s - tau), s being the surprisal
    in bits of the word that came next under the model's own distribution (the authors' rule; llama.cpp measures it
    under the truncated one).

    The word that came next is the fed token, so mu follows every fed token. A generation starts from mu = 2 tau
    after its prompt, as in any implementation: generation_entropy_curve calls `start_generation` once the prefix is
    fed, which resets mu and re-cuts the first distribution. Along held-out text (scoring), mu follows the true
    words from the start of each stream, as if Mirostat had produced them.
    State = (base state, mu [B] float64, last base log-probs [B, V] or None, surprise of the last fed token [B] in
    bits or None)."""

    def __init__(self, lm, target_surprise: float, learning_rate: float):
        self.lm, self.tau, self.eta = lm, float(target_surprise), float(learning_rate)
        self.name, self.params = "mirostat", {"target_surprise": self.tau, "learning_rate": self.eta}
        self.vocab_size = lm.vocab_size
        self.device = getattr(lm, "device", None)

    def init_state(self, batch_size: int):
        mu = torch.full((batch_size,), 2 * self.tau, dtype=torch.float64, device=self.device)  # kept on the device:
        return self.lm.init_state(batch_size), mu, None, None  # no copy to the host a step

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, state):
        inner, mu, last, _ = state
        surprise = None
        if last is not None:  # the fed token is what came after the previous distribution
            y = tokens.to(last.device)[:, None]
            surprise = -last.gather(1, y)[:, 0].double() / LOG2  # [B] bits
            if math.isfinite(self.tau):
                mu = mu.to(surprise.device) - self.eta * (surprise - self.tau)
        logp, inner = self.lm.step(tokens, inner)  # [B, V]
        return self._cut(logp, mu), (inner, mu, logp, surprise)

    def _cut(self, logp: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
        # a target of +inf keeps mu at +inf (it is updated only for a finite target): the model itself, exactly
        return logp if self.tau == math.inf else by_rows(mirostat_cut, logp, mu.to(logp.device))

    def start_generation(self, logp: torch.Tensor, state):
        """After a prompt: mu back to 2 tau, and the next distribution cut with it. logp [B, V] is what the last
        step returned (unused: the base log-probs are in the state)."""
        inner, mu, last, surprise = state
        mu = torch.full_like(mu, 2 * self.tau)
        return self._cut(last, mu), (inner, mu, last, surprise)

    def select(self, state, index: torch.Tensor):
        inner, mu, last, surprise = state
        pick = lambda x: None if x is None else x[index.to(x.device)]
        return self.lm.select(inner, index), pick(mu), pick(last), pick(surprise)


# name -> (rule, {parameter: default}); defaults are those of the most used implementation where it has a non-neutral
# one (transformers: top_k 50; llama.cpp: top_p 0.95, min_p 0.05, Mirostat tau 5 and eta 0.1) and otherwise the
# setting the method's paper recommends (typical 0.95, eta 3e-4).
DECODERS: dict[str, tuple[Callable | None, dict]] = {
    "temperature": (temperature, {"temperature": 1.0}),
    "top_k": (top_k, {"k": 50}),
    "top_p": (top_p, {"p": 0.95}),
    "typical": (typical, {"mass": 0.95}),
    "eta": (eta, {"eta_cutoff": 3e-4}),
    "min_p": (min_p, {"min_p": 0.05}),
    "mirostat": (None, {"target_surprise": 5.0, "learning_rate": 0.1}),
}


def decoder_params(name: str, **params) -> dict:
    """The full, checked parameters of decoder `name` (defaults filled in)."""
    if name not in DECODERS:
        raise LmcalError(f"Unknown decoder {name!r}: choose from {', '.join(DECODERS)}.")
    defaults = DECODERS[name][1]
    unknown = set(params) - set(defaults)
    if unknown:
        raise LmcalError(f"Decoder {name} takes {', '.join(f'{k}=' for k in defaults)} only; got "
                         f"{', '.join(sorted(unknown))}." + renamed_note(name, unknown))
    full = {**defaults, **params}
    bad = decoder_problems(name, full, "decoder")
    if bad:
        raise LmcalError(f"Decoder {name}: out of range: {'; '.join(bad)}.")
    if name == "top_k":
        full["k"] = int(full["k"])
    return full


def make_decoder(name: str, lm, **params):
    """A StepLM that samples as decoder `name` would from `lm`: temperature (temperature=), top_k (k=), top_p (p=),
    typical (mass=), eta (eta_cutoff=), min_p (min_p=), mirostat (target_surprise= bits, learning_rate=). Its step
    returns the log-probs of the distribution actually sampled from (-inf where a word is cut)."""
    params = decoder_params(name, **params)
    if name == "mirostat":
        return MirostatLM(lm, **params)
    rule = DECODERS[name][0]
    return DecodedLM(lm, lambda logp: rule(logp, **params), name, params)


# ---------------------------------------------------------------------------------------------------------------------
# Held-out cost
# ---------------------------------------------------------------------------------------------------------------------


@timed("scoring")
def heldout_cost(lm, tokens: torch.Tensor, mix_epsilon: float = 1e-6, progress: bool = False) -> dict:
    """What a (decoded) StepLM costs on held-out time-major streams tokens [S, B] (first token context only):

    test_ce_nats          mean -log q(w) over all words: finite only if no word gets probability 0, else None
    zero_prob_fraction    the fraction of words q gives probability 0
    test_ce_kept_nats     mean -log q(w) over the words q keeps (None if it keeps none)
    test_ce_mixed_nats    mean -log((1 - eps) q(w) + eps / V) over all words, eps = mix_epsilon: always finite
                          (the per-token mixture of lmcal.core.lookahead.mix_uniform)
    """
    logq = target_log_probs(lm, tokens, progress)  # [n] float64 (progress: lines with the time left)
    zero = torch.isneginf(logq)
    kept = logq[~zero]
    mixed = mix_uniform(logq, mix_epsilon, lm.vocab_size)  # [n]
    return {
        "test_ce_nats": None if zero.any() else -logq.mean().item(),
        "zero_prob_fraction": zero.double().mean().item(),
        "test_ce_kept_nats": -kept.mean().item() if kept.numel() else None,
        "test_ce_mixed_nats": -mixed.mean().item(),
        "mix_epsilon": mix_epsilon,
        "test_tokens": logq.numel(),
    }
