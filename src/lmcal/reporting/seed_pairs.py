"""Algorithm 1's study on two training seeds of one model recipe: each row's run-to-run spread, and the goal rows'
verdicts with that spread counted beside the generations' noise and α*'s (lmcal.reporting.claims)."""

from __future__ import annotations

import copy
import math

from lmcal.reporting.claim import finite
from lmcal.stages.convergence import study_row_of

Z = 2.0


def _key(r: dict) -> tuple:
    """A row across runs: its method, SMC variant and particle count."""
    return r["method"], r.get("variant"), (r.get("params") or {}).get("particles")


def _noise(r: dict) -> float:
    """A row's level's standard error within one run: its generations' noise and α*'s, where fitted."""
    spread = r.get("tail_alpha_stderr_nats")
    return math.hypot(r["tail_stderr_nats"], spread if finite(spread) else 0.0)


def seed_spread(a: dict, b: dict) -> list[dict]:
    """The rows two results of the sequence_calibration stage both have (same method, variant and particle count):
    each run's last tenth and its within-run standard error, their difference with its standard error, whether the
    difference is beyond that noise at Z standard errors, and the run-to-run spread |d| / √2: the standard deviation
    of one run estimated from the pair, one degree of freedom. It holds each run's own noise too, so it overstates
    the spread between seeds rather than understating it."""
    other = {_key(r): r for r in b["rows"]}
    out = []
    for r in a["rows"]:
        o = other.get(_key(r))
        if o is None or not all(finite(x.get(k)) for x in (r, o) for k in ("tail_nats", "tail_stderr_nats")):
            continue
        d, d_se = r["tail_nats"] - o["tail_nats"], math.hypot(_noise(r), _noise(o))
        out.append({"key": list(_key(r)), "label": r.get("label") or r["method"],
                    "tail_nats": [r["tail_nats"], o["tail_nats"]], "stderr_nats": [_noise(r), _noise(o)],
                    "alpha": [(x.get("params") or {}).get("alpha") for x in (r, o)],
                    "difference_nats": d, "difference_stderr_nats": d_se, "beyond_noise": abs(d) > Z * d_se,
                    "run_to_run_stderr_nats": abs(d) / math.sqrt(2)})
    return out


def with_spread(result: dict, spread: list[dict]) -> dict:
    """A copy of one run's result whose goal rows carry the run-to-run spread of the row they measured again."""
    by_key = {tuple(s["key"]): s for s in spread}
    out = copy.deepcopy(result)
    for name in ("goal", "twisted_check"):
        g = out.get(name)
        if not g:
            continue
        row = (study_row_of(g, result["rows"]) if g["method"] == "smc" else
               next((r for r in result["rows"] if r["method"] == g["method"]), None))
        s = row and by_key.get(_key(row))
        if s:
            g["run_to_run_stderr_nats"] = s["run_to_run_stderr_nats"]
    return out


def spread_table(spread: list[dict], seeds: tuple) -> list[str]:
    """The rows at both seeds: levels (exp of the last tenth) with their within-run standard errors, and the
    difference against that noise."""
    lines = [f"| row | exp H, last tenth, seed {seeds[0]} | seed {seeds[1]} | α* at each | difference (nats) | "
             "beyond the runs' own noise at 2 se | run-to-run sd (nats) |", "|---|---|---|---|---|---|---|"]
    for s in spread:
        lv = [f"{math.exp(x):.1f} ± {math.exp(x) * se:.1f}" for x, se in zip(s["tail_nats"], s["stderr_nats"],
                                                                               strict=True)]
        alphas = " / ".join("–" if a is None else f"{a:.4f}" for a in s["alpha"])
        lines.append(f"| {s['label']} | {lv[0]} | {lv[1]} | {alphas} | {s['difference_nats']:+.3f} ± "
                     f"{s['difference_stderr_nats']:.3f} | {'yes' if s['beyond_noise'] else 'no'} | "
                     f"{s['run_to_run_stderr_nats']:.3f} |")
    return lines
