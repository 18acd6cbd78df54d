"""A fit without a finite minimum is a result, not a crash: on rows where the statistic is a little larger at every true
next word, CE(a) = log(1 + 2 exp(-a eps)) falls for ever, and every number is known. The fits raise the typed
NoFiniteMinimum with the edge they stopped on; the memory bound and the future-entropy heads record it, the memory stage
runs to its end on such a model, and the report shows words in place of the numbers that need a fitted alpha*."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from lmcal.core.expfit import NoFiniteMinimum, fit_alpha, fit_theta, no_minimum_label, with_targets, with_targets_k
from lmcal.core.memory_summary import memory_summary

EPS, N = 0.01, 600


def tilt_rows(sign=1.0, n=N):
    """Uniform P over 3 atoms, statistic s = sign * eps at atom 0 (0 elsewhere), every true next word atom 0."""
    logp = torch.zeros(n, 3, dtype=torch.float64).log_softmax(-1)
    s = torch.zeros(n, 3, dtype=torch.float64)
    s[:, 0] = sign * EPS
    return logp, s, torch.zeros(n, dtype=torch.long)


def ce(x):
    """-log softmax([x, 0, 0])[0] = log(1 + 2 e^-x): CE at a tilt x of the true word's logit."""
    return math.log1p(2 * math.exp(-x))


def softmax3(x):
    return torch.tensor([x, 0.0, 0.0], dtype=torch.float64).softmax(0)


def kl(p, q):
    return (p * (p / q).log()).sum().item()


def entropy(p):
    return -(p * p.log()).sum().item()


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_fit_alpha_and_fit_theta_raise_the_typed_outcome_at_the_edge(sign):
    logp, s, y = tilt_rows(sign)
    slope = -2 * EPS * math.exp(-1) / (1 + 2 * math.exp(-1))  # dCE/d|a| at |a| eps = 1
    for fit in (lambda: fit_alpha([with_targets(logp, s, y)], what="test"),
                lambda: fit_theta([with_targets_k(logp, (s,), y)], 1, what="test")):
        with pytest.raises(NoFiniteMinimum, match="minimum at or beyond") as info:
            fit()
        e = info.value
        assert isinstance(e, RuntimeError) and e.bound == 100.0 and e.sign == sign
        assert e.direction == [sign] and e.at_bound == [sign * 100.0]
        assert e.ce_at_bound == pytest.approx(ce(1.0), abs=1e-12) and e.slope == pytest.approx(slope, rel=1e-9)
        r = e.record()
        assert r["no_finite_minimum"] is True and r["alpha_bound"] == 100.0 and r["fit_at_bound"] == [sign * 100.0]
        json.dumps(r, allow_nan=False)
        assert no_minimum_label(r) == "no finite minimum (CE still falls at |α| = 100)"


def test_fit_theta_on_two_proportional_statistics_runs_along_their_common_direction():
    logp, s, y = tilt_rows()
    with pytest.raises(NoFiniteMinimum) as info:
        fit_theta([with_targets_k(logp, (s, s), y)], 2, bound=50.0)
    e = info.value
    assert e.direction == pytest.approx([1.0, 1.0], abs=1e-12) and e.at_bound == pytest.approx([50.0, 50.0])
    assert e.ce_at_bound == pytest.approx(ce(100 * EPS), abs=1e-12)  # the tilt is (50 + 50) eps


def test_memory_summary_records_the_outcome_and_the_bound_at_the_edge():
    full, lim, y = tilt_rows()
    lim = lim.log_softmax(-1)  # log P~ = log softmax([eps, 0, 0]); P^ uniform
    r = memory_summary([(full, lim, y)], cluster_size=100)
    q, p = softmax3(EPS), softmax3(100 * EPS)  # P~, and P^ P~^100 / Z at the edge
    assert r["no_finite_minimum"] is True and r["alpha_bound"] == 100.0 and r["fit_direction"] == [1.0]
    for k in ("alpha", "alpha_stderr", "mi_upper_bound_nats", "mi_stderr_nats", "mi_upper_bound_crossfit_nats",
              "entropy_calibrated_nats", "ce_calibrated_nats"):
        assert r[k] is None, k  # nothing that needs alpha*
    assert r["ce_limited_nats"] == pytest.approx(ce(EPS), abs=1e-12)  # these need no fit
    assert r["ce_full_nats"] == pytest.approx(math.log(3), abs=1e-12)
    assert r["delta_ce_nats"] == pytest.approx(ce(EPS) - math.log(3), abs=1e-12)
    at = r["at_alpha_bound"]
    assert at["alpha"] == 100.0 and at["beta"] == 1.0 and "not a minimum" in at["what"]
    assert at["mi_upper_bound_nats"] == pytest.approx(kl(p, q), abs=1e-12)  # mean KL(P^_100 || P~): a valid bound
    assert at["entropy_nats"] == pytest.approx(entropy(p), abs=1e-12)
    assert at["ce_nats"] == pytest.approx(ce(1.0), abs=1e-12) == r["fit_ce_at_bound_nats"]
    # CE(P||P~) - H(P^_100), the bound's form at a minimum, is below the KL here: CE still falls towards +alpha
    assert r["ce_limited_nats"] - at["entropy_nats"] < at["mi_upper_bound_nats"]
    assert r["two_parameter"] is None  # nothing fitted
    two = r["two_parameter_no_minimum"]  # log P^ is constant: beta stays 1 (a flat direction), alpha runs away
    assert two["no_finite_minimum"] is True and two["at_alpha_bound"]["beta"] == 1.0
    assert two["fit_direction"] == pytest.approx([0.0, 1.0], abs=1e-12)
    assert two["at_alpha_bound"]["mi_upper_bound_nats"] == pytest.approx(kl(p, q), abs=1e-12)
    from lmcal.reporting.results import not_whole
    from lmcal.utils.io import strict_json

    record = {"tau": 5, "limited": "window", "exact_mi_nats": None, **r}
    record = json.loads(json.dumps(strict_json(record), allow_nan=False))
    assert not_whole(Path("memory.json"), record) is None  # a whole record: its stage is done


def cycle_oracle(v=3):
    """An order-1 source whose next word is ctx + 1 (mod v) with a little more probability than the others (logit
    eps), and the cyclic text 0, 1, 2, ... that always takes it: P~ (the model on 1-token windows) is P^ itself, and
    the calibrated P^ P~^a = P^(1 + a) sharpens for ever."""
    from lmcal.models.oracles import MarkovOracle

    logits = np.zeros((v, v))
    logits[np.arange(v), (np.arange(v) + 1) % v] = EPS
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    return MarkovOracle(probs, v, 1), torch.arange(3000) % v


def test_memory_stage_finishes_and_the_report_shows_the_outcome(tmp_path):
    from lmcal.reporting.report_sections import memory_markdown
    from lmcal.reporting.results import memory_row
    from lmcal.stages import run_stage, target

    oracle, text = cycle_oracle()
    t = target(oracle, valid=text, test=text, corpus="markov", exact_mi=0.0)
    r = run_stage("memory", t, {"limited": "window", "tau": 1, "cluster_size": 500}, tmp_path)
    assert (tmp_path / "memory.json").is_file() and (tmp_path / "memory.png").is_file()
    assert r["no_finite_minimum"] and r["mi_upper_bound_nats"] is None and r["alpha"] is None
    q, p = softmax3(EPS), softmax3(101 * EPS)  # P~ = P^, and P^^(1 + 100) at the edge
    assert r["delta_ce_nats"] == pytest.approx(0.0, abs=1e-6) and r["ce_limited_nats"] == pytest.approx(ce(EPS))
    assert r["at_alpha_bound"]["mi_upper_bound_nats"] == pytest.approx(kl(p, q), abs=1e-6)
    two = r["two_parameter_no_minimum"]  # log P^ and log P~ are the same statistic: theta runs along (1, 1)
    assert r["two_parameter"] is None and two["no_finite_minimum"]
    assert two["fit_direction"] == pytest.approx([1.0, 1.0], abs=1e-6)
    assert two["at_alpha_bound"]["beta"] == pytest.approx(101.0) and two["at_alpha_bound"]["alpha"] == 100.0
    assert two["at_alpha_bound"]["mi_upper_bound_nats"] == pytest.approx(kl(softmax3(201 * EPS), q), abs=1e-6)
    from lmcal.reporting.results import not_whole

    record = json.loads((tmp_path / "memory.json").read_text())
    assert not_whole(tmp_path / "memory.json", record) is None  # the stage is done, not to be run again
    row = memory_row(record | {"model": "awd_lstm"})
    text = "\n".join(memory_markdown({"dataset": "markov", "memory": [row]}))
    line = next(s for s in text.split("\n") if s.startswith("| 1 | window |"))
    words = r"no finite minimum (CE still falls at \|α\| = 100)"  # a table cell: its pipes escaped
    assert line.count(words) == 2  # the bound and the two-parameter bound; alpha* and the rest are dashes
    cells = [c.strip() for c in line.replace(words, "WORDS").strip("|").split("|")]
    assert cells[4] == cells[7] == "WORDS" and cells[5] == cells[6] == cells[8] == "–"
    note = "τ = 1, window P̃: no finite minimum (CE still falls at |α| = 100). At the edge α = +100, not a minimum: "
    assert note + "mean KL(P̂_α‖P̃) = " in text  # the note under the table, labelled


def test_future_entropy_heads_without_a_minimum_are_rows_that_say_so():
    from lmcal.reporting.report_sections import future_entropy_markdown
    from lmcal.stages.configs import FutureEntropyConfig
    from lmcal.stages.future_entropy import calibrate_head, future_entropy_table

    logp, g, y = tilt_rows()
    stats = {"horizon_k": 1, "discount": 1.0, "r2": 0.5, "rmse_nats": 0.1}
    fitted, unfitted = calibrate_head(logp.float(), g.float(), y, None, stats, FutureEntropyConfig(cluster_size=50))
    assert fitted == [] and [u["method"] for u in unfitted] == ["future_entropy", "future_entropy_temperature"]
    one, two = unfitted
    assert one["no_finite_minimum"] and one["params"] == {"horizon_k": 1, "discount": 1.0} and one["fit_tokens"] == N
    assert one["fit_at_bound"] == [100.0] and one["fit_ce_at_bound_nats"] == pytest.approx(ce(1.0), abs=1e-6)
    assert two["fit_direction"] == pytest.approx([0.0, 1.0], abs=1e-12)  # log P is constant: beta stays 1
    json.dumps(unfitted, allow_nan=False)
    model = {"method": "model", "params": {}, "entropy_t1_nats": 1.0, "tail_ppl": 3.0, "entrate_ppl": 3.0,
             "test_ce_nats": 1.1, "zero_prob_fraction": 0.0, "ms_per_token": 0.5}
    words = r"no finite minimum (CE still falls at \|α\| = 100)"
    table = future_entropy_table([model], 1.1, unfitted)
    assert f"| future_entropy | horizon_k=1, discount=1 | {words} |" + " – |" * 8 in table
    assert f"| future_entropy_temperature | horizon_k=1, discount=1 | {words} |" in table
    fe = {"rows": [model], "no_minimum_rows": unfitted, "reference_test_ce_nats": 1.1, "unit": "word"}
    text = "\n".join(future_entropy_markdown({}, fe))
    assert text.count(words) == 2 and "no verdict is drawn" in text
