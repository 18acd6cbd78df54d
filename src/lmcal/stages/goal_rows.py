"""The goal rows of the sequence_calibration stage: the row closest to the test perplexity, chosen on one seed's
generations among Algorithm 1's rows and the per-word samplers, measured again on fresh prefixes and the next seed;
and the twisted row with the fewest particles, measured there too.
"""

from __future__ import annotations

import logging

import torch

from lmcal.core.entropy_rate import clustered_mean, generation_entropy_curve
from lmcal.core.sampling import random_prefixes
from lmcal.stages.configs import SequenceCalibrationConfig
from lmcal.stages.convergence import same_value, study_row_of
from lmcal.stages.per_word import Bench
from lmcal.stages.sequence_table import row_label
from lmcal.stages.smc_rows import StudySetup, mixture, remeasure
from lmcal.utils.numbers import exp_or_inf

log = logging.getLogger("lmcal")
NAME = "sequence_calibration"


def _fewest(r: dict, rows: list[dict]) -> bool:
    """Whether r is not an SMC row with a converged count of fewer particles in its sampler."""
    return r["method"] != "smc" or not any(
        o["method"] == "smc" and o.get("variant") == r.get("variant") and o.get("converged")
        and o["params"]["particles"] < r["params"]["particles"] for o in rows)


def goal_candidates(rows: list[dict], per_word) -> list[dict]:
    """The rows the goal is chosen among: per-word samplers (methods in `per_word`) and Algorithm 1's rows, each
    without a higher test CE than the model's. A converged count agrees with twice (half) its particles, so the two
    estimate one law: a sampler (SMC, twisted or not) stands there by its fewest converged count alone, the one that
    costs least, and its goal measurement on fresh prefixes costs no more than its twisted check."""
    return [r for r in rows if (r.get("converged") or r["method"] in per_word) and _fewest(r, rows)
            and r.get("test_ce_diff_nats") is not None and r["test_ce_diff_nats"] <= 0]


def _fresh_count(r: dict, s: SequenceCalibrationConfig, n_smc: int) -> int:
    """The fresh prefixes a row is measured again on."""
    return int(s.goal_prefixes or (n_smc if r["method"] == "smc" else s.num_prefixes))


def _measure_again(b: Bench, setup: StudySetup, samplers: dict, r: dict, fresh: torch.Tensor, n: int) -> dict:
    """A row's last tenth on the first n fresh prefixes at the next seed."""
    s = b.s
    log.info(f"{NAME}: {row_label(r)} measured again on {n} fresh prefixes ({n * s.samples_per_prefix} "
             f"generations, seed {s.seed + 1})")
    if r["method"] == "smc":
        k = r["params"]["particles"]
        tw = samplers["twists"][k](r["params"]["alpha"]) if r["variant"] == "twisted" else None
        tail = remeasure(setup, fresh[:n], k, tw, r["params"]["alpha"], s.seed + 1)  # [n, S]
    else:
        tail = generation_entropy_curve(samplers[r["method"]], fresh[:n], s.horizon, s.samples_per_prefix,
                                        seed=s.seed + 1, max_batch=s.max_batch, progress=True).tail  # [n, S]
    level, se = clustered_mean(tail)  # prefixes as clusters, as every row's level
    return {"tail_nats": float(level), "tail_stderr_nats": float(se), **mixture(tail)}


def _verdict(r: dict, measured: dict, s: SequenceCalibrationConfig, n: int, test_nats: float) -> dict:
    """A goal row: the row measured again on n fresh prefixes, against the test perplexity."""
    level, se = measured["tail_nats"], measured["tail_stderr_nats"]
    return {"method": r["method"], "label": row_label(r), "params": r["params"], "chosen_on_seed": s.seed,
            "reported_on_seed": s.seed + 1, "prefixes": n, "generations": n * s.samples_per_prefix,
            "reported_on": f"{n} fresh prefixes (another draw of validation points)",
            "tail_nats": level, "tail_stderr_nats": se, "tail_ppl": exp_or_inf(level),
            "tail_ppl_stderr": exp_or_inf(level) * se, "test_ppl": exp_or_inf(test_nats),
            "test_ce_diff_nats": r.get("test_ce_diff_nats"),
            "test_ce_diff_stderr_nats": r.get("test_ce_diff_stderr_nats"),
            "tail_alpha_stderr_nats": r.get("tail_alpha_stderr_nats"),  # SMC rows: what α*'s noise moves it by
            "within_10_percent": abs(exp_or_inf(level) / exp_or_inf(test_nats) - 1) <= 0.10,
            "compared_with": "the test CE (the last tenth of the horizon against the test stream)",
            **{k: measured.get(k) for k in ("tail_median_nats", "tail_below_2_nats_share")}, **_identity(r)}


def _identity(r: dict) -> dict:
    """The theorem's identity for an SMC row, as its fit set it: the law's entropy rate over all L words of its
    generations against the validation CE that α* equates it with (the goal's comparison is with the test CE)."""
    if r["method"] != "smc":
        return {}
    f = r["fit"]
    return {"identity": {"entropy_rate_nats": r.get("law_entropy_rate_nats"),
                         "entropy_rate_stderr_nats": r.get("law_entropy_rate_stderr_nats"),
                         "validation_ce_nats": f["ce_nats"], "validation_ce_stderr_nats": f.get("ce_stderr_nats")}}


def _kept(extend: dict | None, rows: list[dict], study: list[dict]) -> dict[int, dict]:
    """id(row) -> its measurement on fresh prefixes, as an extended run's goal rows measured it."""
    kept = {}
    for g in (extend or {}).get("goal"), (extend or {}).get("twisted_check"):
        match = g and (study_row_of(g, study) if g["method"] == "smc" else next(
            (r for r in rows if r["method"] == g["method"] and same_value(r["params"], g["params"])), None))
        if match:
            kept[id(match)] = {"tail_nats": g["tail_nats"], "tail_stderr_nats": g["tail_stderr_nats"]}
    return kept


def _again(b: Bench, setup: StudySetup, samplers: dict, r: dict, fresh: torch.Tensor, cache: dict[int, dict]) -> dict:
    """A goal row of r: measured again on fresh prefixes (once a row: `cache`, id(row) -> its measurement)."""
    n = _fresh_count(r, b.s, setup.prefixes.size(0) // b.s.samples_per_prefix)
    if id(r) not in cache:
        cache[id(r)] = _measure_again(b, setup, samplers, r, fresh, n)
    return _verdict(r, cache[id(r)], b.s, n, -b.plain_logq.mean().item())


def goal_rows(b: Bench, setup: StudySetup, rows: list[dict], study: list[dict], samplers: dict,
               extend: dict | None) -> tuple[dict | None, dict | None]:
    """The goal: among the rows that are Algorithm 1 (a sampler's fewest converged count) or per-word samplers,
    without a higher test CE, the one closest to the test perplexity over the last tenth on this seed's generations,
    measured again on fresh prefixes and the next seed; and the twisted row with the fewest particles, measured
    there too (a row that is both, once)."""
    s = b.s
    test_nats = rows[0]["test_ce_nats"]
    # [max(N, goal), P]: its first N the same whatever goal_prefixes (randperm's order does not depend on the count)
    fresh = random_prefixes(b.valid, max(s.num_prefixes, s.goal_prefixes or 0), s.prefix_len, seed=s.seed + 11)
    cache = _kept(extend, rows, study)
    fair = goal_candidates(rows[1:], samplers)
    goal = None
    if fair:
        chosen = min(fair, key=lambda r: abs(r["tail_nats"] - test_nats))
        goal = {**_again(b, setup, samplers, chosen, fresh, cache), "candidates": [row_label(r) for r in fair]}
        log.info(f"{NAME}: goal row {goal['label']}: last tenth {goal['tail_ppl']:.1f} +- {goal['tail_ppl_stderr']:.1f}"
                 f" on fresh prefixes against test perplexity {goal['test_ppl']:.1f}")
    twisted = [r for r in study if r["variant"] == "twisted"]
    return goal, (_again(b, setup, samplers, twisted[0], fresh, cache) if twisted else None)
