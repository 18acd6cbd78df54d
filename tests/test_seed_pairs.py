"""Two training seeds of Algorithm 1's study (lmcal.reporting.seed_pairs): each row's run-to-run spread, and the goal
rows' verdicts with it counted."""

import math

import pytest

from lmcal.reporting.claims import sequence_goal_claims
from lmcal.reporting.seed_pairs import seed_spread, spread_table, with_spread


def _result(level: float, alpha: float) -> dict:
    smc = {"method": "smc", "variant": "twisted", "label": "Algorithm 1 (twisted SMC, 16 particles)",
           "params": {"particles": 16, "alpha": alpha, "alpha_stderr": 0.001}, "tail_nats": level,
           "tail_stderr_nats": 0.01, "tail_alpha_stderr_nats": 0.02}
    model = {"method": "model", "params": {}, "tail_nats": 5.0, "tail_stderr_nats": 0.01}
    goal = {"method": "smc", "label": smc["label"], "params": smc["params"], "chosen_on_seed": 0,
            "reported_on_seed": 1, "prefixes": 100, "candidates": [smc["label"]], "tail_nats": level,
            "tail_stderr_nats": 0.01, "tail_alpha_stderr_nats": 0.02, "test_ppl": math.exp(level)}
    return {"rows": [model, smc], "goal": goal}


def test_the_spread_between_seeds_is_counted_in_the_goal_rows_verdict():
    a, b = _result(4.75, 0.010), _result(4.85, 0.012)
    spread = seed_spread(a, b)
    assert [s["key"] for s in spread] == [["model", None, None], ["smc", "twisted", 16]]
    s = spread[1]
    assert s["difference_nats"] == pytest.approx(-0.1)
    assert s["difference_stderr_nats"] == pytest.approx(math.sqrt(2) * math.hypot(0.01, 0.02))
    assert s["beyond_noise"] and s["run_to_run_stderr_nats"] == pytest.approx(0.1 / math.sqrt(2))
    # on its own noise and α*'s, seed a's goal is within 10% of the test perplexity; the spread makes it undecided
    (alone,) = sequence_goal_claims(a)
    (counted,) = sequence_goal_claims(with_spread(a, spread))
    assert alone.verdict == "within" and counted.verdict == "undecided"
    assert counted.numbers["se"] == pytest.approx(math.sqrt(0.01 ** 2 + 0.02 ** 2 + 0.005))
    assert "the run-to-run spread (±0.071 nats)" in counted.sentence and "Not counted" not in counted.sentence
    assert "goal" in a and "run_to_run_stderr_nats" not in a["goal"]  # the result itself is left as it was
    table = spread_table(spread, (141, 142))
    assert table[0].startswith("| row | exp H, last tenth, seed 141 | seed 142 |") and "| yes |" in table[3]
