"""The memory stage's numbers for one tau (memory_summary): the one-parameter bound with its jackknife standard
error and cross-fit, ΔCE and the two-parameter variant, as memory.json's keys; where a fit's CE has no finite
minimum inside the bound, what stays valid at the edge of the fit's range; and the same numbers on the Markov
source's exact oracles (markov_oracle_memory). lmcal.core.memory holds the fits."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from lmcal.core.context import context_rows
from lmcal.core.expfit import NoFiniteMinimum
from lmcal.core.memory import (
    PASSES,
    Chunk,
    MemoryBound,
    bound_of,
    chunks_of,
    mean_stderr,
    memory_upper_bound,
    row_groups,
    rows_at,
)
from lmcal.data.markov import markov_chain_from_info, markov_exact_mi
from lmcal.models.oracles import MarkovOracle
from lmcal.utils.profiling import timed


@timed("fit")
def memory_summary(chunks: list[Chunk] | Callable[[], Iterable[Chunk]], *, cluster_size: int,
                   jackknife: str = "onestep", bound: float = 100.0, elements: int | None = None) -> dict:
    """The memory stage's numbers for one tau from kept chunks (log P^ [n, V], log P~ [n, V], targets [n]), or a
    function returning a fresh iterable of them on each call (streamed: see memory_upper_bound): the
    one-parameter bound fitted on these rows with its jackknife standard error and cross-fit, ΔCE, and the
    two-parameter variant (P^^beta P~^alpha), as the JSON keys of memory.json (nats).

    A fit whose CE has no minimum inside |alpha| < bound is a result. The one-parameter fit's: "no_finite_minimum":
    true, the keys of NoFiniteMinimum.record and "at_alpha_bound" (what stays valid there: _edge) beside the row, and
    null for every number that needs a fitted alpha* (CE(P||P~), ΔCE and CE(P||P^) need none and stay). The
    two-parameter fit's: "two_parameter": null and those keys in "two_parameter_no_minimum" (null when fitted)."""
    from lmcal.utils.progress import progress_bar

    # passes over the rows: about 25 with the one-step jackknife (a minute each where they are streamed from a large
    # model); with the exact one, 11 more per block, whose count is not known here
    bar = progress_bar(total=25 if jackknife == "onestep" else None, desc="memory fit", unit="pass")
    PASSES.append(bar)
    fit = {"cluster_size": cluster_size, "jackknife": jackknife, "bound": bound, "elements": elements}
    try:
        one, one_edge = _fit_or_edge(chunks, False, fit)
        two, two_edge = _fit_or_edge(chunks, True, fit, None if one_edge else [0.0, one.alpha])  # from the nearby fit
    finally:
        PASSES.remove(bar)
        bar.close()
    blocks = f"{one.n_blocks} blocks of {cluster_size} positions"
    how = "redone exactly" if jackknife == "exact" else "redone by one Newton step"
    return {
        **_row_keys(one, one_edge),
        "two_parameter": None if two_edge else _two_keys(two), "two_parameter_no_minimum": two_edge,
        "test_tokens": one.n_tokens, "blocks": one.n_blocks, "cluster_size": cluster_size,
        "stderr_method": (f"delete-one-block jackknife over {blocks}, the fit {how} per block" if one_edge is None
                          else f"no fit (no finite minimum); at the edge, batch means over {blocks}"),
    }


def _fit_or_edge(chunks, temperature: bool, fit: dict, start: list[float] | None = None):
    """(the fitted MemoryBound, None), or where CE has no finite minimum inside the bound, (the MemoryBound at the
    edge's parameters, unfitted, and the outcome's JSON keys: _edge)."""
    try:
        b = memory_upper_bound(chunks, temperature=temperature, crossfit=not temperature, start=start, **fit)
        return b, None
    except NoFiniteMinimum as e:
        return _edge(chunks, e, temperature, fit["cluster_size"], fit["elements"])


@torch.no_grad()
def _edge(chunks, e: NoFiniteMinimum, temperature: bool, cluster_size: int,
          elements: int | None) -> tuple[MemoryBound, dict]:
    """What stays valid where CE has no finite minimum inside the bound (e): at e.at_bound, the parameters on the edge
    of the fit's range (not a minimum), the mean KL(P^_theta || P~) over the rows.

    For any P~ that reads only the last tau tokens, E KL(P^_theta || P~) = I_tau(P^_theta) + E KL(D_tau || P~) >=
    I_tau of that tilted model P^_theta (D_tau its own tau-marginal): an upper bound on the memory of P^_theta at the
    edge, not of a calibrated model (none has a finite alpha*). Per row E_{P^_theta}[-log P~] = -log P~(y) - CE'_t
    (CE'_t's alpha component), so KL = CE(P||P~) - H(P^_theta) - CE'_alpha. At a minimum CE'_alpha = 0 and this is
    the usual bound; here CE(P||P~) - H alone is no bound (it is below the KL wherever CE still falls towards
    +alpha). Its standard error is by batch means, theta held fixed (the range's edge, not fitted)."""
    rows = rows_at(row_groups(chunks_of(chunks, None, None), temperature), e.at_bound, elements)
    kl = rows["ce_limited"] - rows["entropy"] - rows["grad"][:, -1]  # [N]
    b = bound_of(rows, e.at_bound, [math.nan] * len(e.at_bound), math.nan, math.nan, cluster_size, False,
                  temperature)
    beta = f", β = {b.beta:g}" if temperature else ""
    at = {"alpha": b.alpha, "beta": b.beta, "mi_upper_bound_nats": kl.mean().item(),
          "mi_stderr_nats": mean_stderr(kl, cluster_size), "entropy_nats": b.entropy_calibrated,
          "ce_nats": b.ce_calibrated,
          "what": f"mean KL(P̂_θ‖P̃) at α = {b.alpha:+g}{beta}, on the edge |θ| = {e.bound:g} of the fit's range, "
                  "not a minimum (CE still falls there): an upper bound on I_τ of that tilted model, not of a "
                  "calibrated one"}
    return b, {**e.record(), "at_alpha_bound": at, "no_finite_minimum_reason": str(e)}


def _row_keys(one: MemoryBound, edge: dict | None) -> dict:
    """memory.json's one-parameter keys: every number, or where its fit had no finite minimum (edge), null for those
    that need alpha* and the outcome's keys beside."""
    fitted = lambda x: x if edge is None else None
    return {"alpha": fitted(one.alpha), "alpha_stderr": fitted(one.alpha_stderr), "ce_limited_nats": one.ce_limited,
            "mi_upper_bound_nats": fitted(one.mi_upper_bound), "mi_stderr_nats": fitted(one.mi_stderr),
            "mi_upper_bound_crossfit_nats": fitted(one.mi_upper_bound_crossfit),
            "delta_ce_nats": one.delta_ce, "delta_ce_stderr_nats": one.delta_ce_stderr,
            "entropy_calibrated_nats": fitted(one.entropy_calibrated), "ce_full_nats": one.ce_full,
            "ce_calibrated_nats": fitted(one.ce_calibrated), "ce_full_stderr_nats": one.ce_full_stderr,
            "no_finite_minimum": edge is not None, **(edge or {})}


def _two_keys(two: MemoryBound) -> dict:
    """memory.json's "two_parameter" of a fitted P^^beta P~^alpha."""
    return {"alpha": two.alpha, "beta": two.beta, "mi_upper_bound_nats": two.mi_upper_bound,
            "mi_stderr_nats": two.mi_stderr, "alpha_stderr": two.alpha_stderr, "beta_stderr": two.beta_stderr,
            "entropy_calibrated_nats": two.entropy_calibrated, "ce_calibrated_nats": two.ce_calibrated}


@torch.no_grad()
def markov_oracle_memory(info: dict, valid_tokens: torch.Tensor, test_tokens: torch.Tensor, taus: list[int],
                         cluster_size: int = 2000) -> dict:
    """The estimators run on the Markov source's exact oracles, where every answer is known: P^ = the oracle reading
    the test text with its whole past (the true order-k conditional), P~_tau = the same oracle fed only the last tau
    tokens (context_rows: a window model, exactly the stationary chain's order-tau conditional). Returns
    the entropy-rate estimate (the oracle's test CE ± se) and, per tau, the memory stage's numbers (alpha fitted on
    the rows the bound is reported on, jackknife standard errors over blocks of cluster_size positions, cross-fit,
    ΔCE, the two-parameter variant) beside the exact I_tau. Positions t >= max(taus, k), so every context is complete.
    valid_tokens is not read: as in the memory stage, the fit is on the test rows."""
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
