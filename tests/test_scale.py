"""Entropy miscalibration against scale: the power-law fit and its bootstrap (lmcal.core.scaling), the source whose
tail exponent is a setting (lmcal.data.powerlaw), the per-run record (lmcal.stages.scale_record), the sentences
(lmcal.reporting.claims), the table, figure, fit and W&B run of `python -m lmcal.report` (lmcal.reporting.scale_report),
the sweep presets and `make reproduce PROFILE=scale|scale_gpu` (lmcal.pipeline.scale_sweep); the slow tier runs
tiny multiruns of our models and of Hugging Face models built here, end to end."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from lmcal import paper
from lmcal.core.scaling import fit_power_law, gap, stream_ce, weighted_trend
from lmcal.data.batching import load_corpus
from lmcal.data.markov import markov_stationary, sample_markov
from lmcal.data.powerlaw import make_powerlaw_chain, zipf_law
from lmcal.errors import LmcalError
from lmcal.models.oracles import MarkovOracle
from lmcal.pipeline.plan import load_profile
from lmcal.pipeline.scale_sweep import check_sweeps, grid, plan_sweeps
from lmcal.reporting.docs import render, snapshot
from lmcal.reporting.scale_claims import ExponentFit, effect_trend, scale_exponent
from lmcal.reporting.scale_report import collect_scale, log_scale_wandb, scale_report
from lmcal.reporting.scale_text import FIT_HEADER, fit_row, group_markdown, trend_row
from lmcal.stages.scale_record import RECORD, scale_record, write_scale_record
from tests.conftest import DATA_ROOT, HAVE_PTB
from tests.test_wandb import runs_under

# ---------------------------------------------------------------------------------------------------------------------
# The fit
# ---------------------------------------------------------------------------------------------------------------------


def runs_on_a_law(n, d, b_n, b_d, a=2.0, ce=4.0, noise=0.002, prefixes=200, seed=1):
    """Runs whose gap is exactly a n^b_n d^b_d, each with `prefixes` last-tenth levels around it (sd `noise`)."""
    rng = np.random.default_rng(seed)
    g = a * np.asarray(n, float) ** b_n * np.asarray(d, float) ** b_d
    tails = [ce + gi + noise * rng.standard_normal(prefixes) for gi in g]
    return tails, [ce] * len(g), g


def test_the_fit_recovers_a_known_exponent_and_its_interval_covers_it():
    n = [1e5, 3e5, 1e6, 3e6, 1e7]
    tails, ce, _ = runs_on_a_law(n, [1] * 5, -0.3, 0.0)
    f = fit_power_law({"params": n}, tails, ce, [0.0005] * 5, n_boot=400)
    assert f.exponents["params"] == pytest.approx(-0.3, abs=0.02)
    lo, hi = f.ci["params"]
    assert lo < -0.3 < hi and hi - lo < 0.2 and f.n_runs == 5 and f.df == 3
    assert f.replicates + f.failed_replicates == 400 and f.stderr["params"] > 0 and f.bootstrap_stderr["params"] > 0
    blo, bhi = f.bootstrap_ci["params"]
    assert blo < -0.3 < bhi


def test_the_t_interval_is_the_closed_form_and_scipys():
    """Four runs, log gap = [0, 1, 0, 1] against log x = [0, 1, 2, 3]: b = Sxy / Sxx = 1 / 5, residuals
    (-0.2, 0.6, -0.6, 0.2), s^2 = RSS / (n - 2) = 0.8 / 2, se(b) = sqrt(s^2 / Sxx) = sqrt(0.08), and the 95%
    interval b -/+ t(0.975, 2) se, t(0.975, 2) = 4.302652729749464 (scipy.stats.linregress and t.ppf agree)."""
    from scipy import stats

    from lmcal.core.scaling import ols_t, signed_trend

    logx, logg = np.array([0.0, 1.0, 2.0, 3.0]), np.array([0.0, 1.0, 0.0, 1.0])
    tails = [np.full(8, 4.0 + math.exp(v)) for v in logg]  # gap = exp(log gap) exactly, every prefix alike
    f = fit_power_law({"params": np.exp(logx).tolist()}, tails, [4.0] * 4, [0.0] * 4, n_boot=20)
    se, t = math.sqrt(0.08), 4.302652729749464
    assert f.exponents["params"] == pytest.approx(0.2) and f.intercept == pytest.approx(0.2)
    assert f.stderr["params"] == pytest.approx(se) and f.df == 2 and f.t_crit == pytest.approx(t)
    assert f.ci["params"] == pytest.approx((0.2 - t * se, 0.2 + t * se))
    ref = stats.linregress(logx, logg)
    assert f.stderr["params"] == pytest.approx(ref.stderr) and t == pytest.approx(stats.t.ppf(0.975, 2))
    # the signed trend is the same least squares on the gap itself; a joint fit's df is n - K - 1
    names, s = signed_trend({"params": np.exp(logx).tolist()}, logg)
    assert names == ["params"] and s.coef == pytest.approx([0.2, 0.2]) and s.ci[1] == pytest.approx(f.ci["params"])
    A = np.column_stack([np.ones(6), [0, 1, 2, 3, 4, 5], [0, 1, 0, 1, 0, 2]])
    y = np.array([0.1, 0.9, 0.2, 1.4, 1.6, 2.9])
    j = ols_t(A, y, level=0.9)
    cov = j.sigma ** 2 * np.linalg.inv(A.T @ A)
    assert j.df == 3 and j.stderr == pytest.approx(np.sqrt(np.diag(cov)))
    assert j.ci[:, 1] - j.coef == pytest.approx(stats.t.ppf(0.95, 3) * j.stderr)


def test_a_fit_with_fewer_than_two_residual_degrees_of_freedom_is_refused():
    """The transformer's joint fit had 4 runs and 3 coefficients: 1 df, where t's 97.5% quantile is 12.7. No fit is
    stated on fewer than 2."""
    from lmcal.core.scaling import ols_t, signed_trend

    tails, ce, _ = runs_on_a_law([1e5, 1e6, 1e7], [1] * 3, -0.3, 0.0)
    with pytest.raises(ValueError, match=r"df < 2: 3 runs and 2 coefficients leave 1 .*at least 4 runs"):
        fit_power_law({"params": [1e5, 1e6, 1e7]}, tails, ce, [0.0] * 3)
    with pytest.raises(ValueError, match=r"df < 2: 4 runs and 3 coefficients leave 1"):
        fit_power_law({"params": [1e5, 1e6, 1e7, 1e5], "train_tokens": [1e6, 1e7, 3e6, 1e7]}, [*tails, tails[0]],
                      [*ce, ce[0]], [0.0] * 4)
    with pytest.raises(ValueError, match="df < 2"):
        signed_trend({"params": [1e5, 1e6, 1e7]}, [0.1, -0.2, 0.3])
    assert ols_t(np.column_stack([np.ones(4), [0, 1, 2, 3]]), [0, 1, 0, 1]).df == 2  # two: stated


def test_a_run_with_a_negative_gap_is_not_dropped():
    """A run whose last tenth is below its test CE has a negative gap and no logarithm. Leaving it out selects the
    runs on the outcome: the power law refuses, naming it, and the signed trend takes every run."""
    from lmcal.core.scaling import signed_trend

    n = [1e5, 1e6, 1e7]
    tails, ce, g = runs_on_a_law(n, [1] * 3, -0.3, 0.0)
    tails.append(np.full(50, 3.9))  # its last tenth below its test CE of 4: a gap of -0.1
    with pytest.raises(ValueError, match=r"runs \[3\] have gap <= 0 .*select on the outcome"):
        fit_power_law({"params": [*n, 1e8]}, tails, [*ce, 4.0], [0.0] * 4, n_boot=100)
    gaps = [t.mean() - 4.0 for t in tails]
    names, f = signed_trend({"params": [*n, 1e8]}, gaps)
    A = np.column_stack([np.ones(4), np.log([*n, 1e8])])
    assert f.df == 2 and f.coef == pytest.approx(np.linalg.lstsq(A, gaps, rcond=None)[0])  # all four runs


def test_runs_too_alike_in_x_are_not_fitted():
    """The scale profile's power-law groups trained every amount on one budget: 640,000 and 639,980 tokens seen
    fitted an 'exponent' of +2,814 on two runs. An x must span a factor of 1.1."""
    tails, ce, _ = runs_on_a_law([1e5, 1e6, 1e7, 1e8], [1] * 4, -0.3, 0.0)
    with pytest.raises(ValueError, match="too alike in train_tokens"):
        fit_power_law({"train_tokens": [640_000, 639_980, 640_010, 640_005]}, tails, ce, [0.0] * 4)


def test_weighted_trend_widens_its_error_by_the_scatter_and_floors_a_zero_error():
    """A run whose generations collapsed has se ~ 0; unfloored it carried the slope alone (± 0.000). Runs that
    scatter about the line more than their errors allow widen the slope's error by sqrt(reduced chi-square)."""
    x = np.array([0.0, 1.0, 2.0, 3.0])
    y = np.array([0.0, 1.0, 0.0, 1.0])
    se = np.array([0.1, 0.1, 0.1, 0.1])
    slope, s = weighted_trend(x, y, se)
    resid = y - (y.mean() + slope * (x - x.mean()))
    chi2 = ((resid / 0.1) ** 2).sum() / 2
    assert slope == pytest.approx(0.2) and s == pytest.approx(0.1 / math.sqrt(5.0) * math.sqrt(chi2))
    slope0, s0 = weighted_trend(x, y, np.array([1e-9, 0.1, 0.1, 0.1]))  # floored at the median: as all at 0.1
    assert slope0 == pytest.approx(slope) and s0 == pytest.approx(s)


def test_a_family_whose_every_gap_is_negative_has_its_deficit_fitted():
    """The scale profile's power-law source at s = 1.1: every run's generations were less entropic than its test CE
    (gaps -0.37 ... -0.005), so no gap could be fitted. sign = -1 fits -gap = A x^b as the gap is fitted."""
    n = [1e5, 3e5, 1e6, 3e6, 1e7]
    tails, ce, g = runs_on_a_law(n, [1] * 5, -0.5, 0.0)
    low = [2 * c - t for t, c in zip(tails, ce, strict=True)]  # the same law below the test CE: gap = -A n^b
    f = fit_power_law({"params": n}, low, ce, [0.0] * 5, n_boot=200, sign=-1.0)
    assert f.exponents["params"] == pytest.approx(-0.5, abs=0.02) and f.ci["params"][0] < -0.5 < f.ci["params"][1]
    with pytest.raises(ValueError, match="have -gap <= 0"):
        fit_power_law({"params": n}, tails, ce, [0.0] * 5, sign=-1.0)


def test_runs_on_one_budget_are_read_against_their_distinct_tokens():
    """Every amount of the power-law source trained on one budget: 640,000 tokens seen, give or take the windows'
    few (639,980). That is no axis; the distinct tokens are, and the figure's token panel draws them."""
    from lmcal.reporting.scale_report import fit_group

    d = [20_000, 40_000, 80_000, 160_000, 320_000]
    tails, ce, _ = runs_on_a_law(d, [1] * 5, -0.4, 0.0)
    rows = [{"tail_nats_per_prefix": t, "test_ce_nats": c, "test_ce_stderr_nats": 0.0, "params": 411_904,
             "train_tokens": 640_000 - 5 * i, "data_tokens": n, "effects": {}, "model": "m"}
            for i, (t, c, n) in enumerate(zip(tails, ce, d, strict=True))]
    g = fit_group(("powerlaw", 1.1, "AWD-LSTM", "word"), rows, n_boot=50)
    assert g["token_axis"] == "data_tokens" and "train_tokens" not in g["fits"]
    assert g["fits"]["data_tokens"]["exponents"]["data_tokens"] == pytest.approx(-0.4, abs=0.02)


def test_gap_and_its_standard_error():
    g = gap(np.array([5.0, 5.2, 5.4, 5.6]), 4.8, 0.03)
    se_tail = np.std([5.0, 5.2, 5.4, 5.6], ddof=1) / 2
    assert g["gap_nats"] == pytest.approx(0.5) and g["tail_stderr_nats"] == pytest.approx(se_tail)
    assert g["gap_stderr_nats"] == pytest.approx(math.hypot(se_tail, 0.03))


def test_weighted_trend_is_weighted_least_squares():
    x, y, se = np.array([0.0, 1.0, 2.0]), np.array([1.0, 3.0, 5.0]), np.array([0.1, 0.1, 0.1])
    slope, s = weighted_trend(x, y, se)
    assert slope == pytest.approx(2.0) and s == pytest.approx(0.1 / math.sqrt(2.0))


class Uniform:
    """A StepLM that gives every word 1/V."""

    vocab_size = 7

    def init_state(self, b):
        return None

    def step(self, tokens, state):
        return torch.full((tokens.numel(), self.vocab_size), -math.log(self.vocab_size)), state

    def select(self, state, index):
        return state


def test_stream_ce_is_exact_for_the_uniform_model_and_calibrated_for_the_true_source():
    ce, se, n = stream_ce(Uniform(), torch.randint(0, 7, (1000,)), max_len=64)
    assert ce == pytest.approx(math.log(7)) and se == pytest.approx(0.0, abs=1e-12) and n == 15 * 63
    probs = make_powerlaw_chain(16, 1, 1.3, seed=2)  # order 1: the oracle is exact from each stream's first token
    h = float(markov_stationary(probs, 16, 1) @ -(probs * np.log(probs)).sum(1))
    tokens = torch.from_numpy(sample_markov(probs, 16, 1, 40_000, 5))
    ce, se, n = stream_ce(MarkovOracle(probs, 16, 1), tokens, max_len=500)
    assert abs(ce - h) < 4 * se and 0.002 < se < 0.02 and n == 80 * 499


# ---------------------------------------------------------------------------------------------------------------------
# The source whose tail exponent is a setting
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("s,order", [(1.1, 2), (2.0, 2), (0.7, 1)])
def test_the_power_law_source_has_the_entropy_rate_the_code_computes(s, order):
    """Every row is a permutation of r^-s / H_V(s): the entropy rate the corpus computes from the chain's stationary
    law is exactly that law's entropy, -sum_r p_r log p_r, summed here from its closed form."""
    V = 12
    ranks = np.arange(1, V + 1, dtype=np.float64)
    p = ranks ** -s / (ranks ** -s).sum()
    exact = float(-(p * np.log(p)).sum())
    c = load_corpus("powerlaw", vocab_size=V, order=order, tail_exponent=s, n_train=2000, n_valid=200, n_test=200)
    assert c.info["entropy_rate_nats"] == pytest.approx(exact, abs=1e-12)
    assert c.info["tail_exponent"] == s and c.vocab_size == V and c.train.numel() == 2000
    probs = make_powerlaw_chain(V, order, s)
    assert np.allclose(np.sort(probs, axis=1)[:, ::-1], p[None, :], atol=1e-15)  # each row: the law, reordered
    assert np.allclose(zipf_law(V, s), p)


def test_the_power_law_sample_scores_at_its_entropy_rate():
    """The negative log-likelihood of a long sample under the true table averages to the entropy rate (a sample of
    the stationary chain: within 4 standard errors of blocks)."""
    c = load_corpus("powerlaw", vocab_size=16, order=2, tail_exponent=1.5, n_train=60_000, n_valid=10, n_test=10)
    probs = make_powerlaw_chain(16, 2, 1.5)
    x = c.train.numpy()
    nll = -np.log(probs[x[:-2] * 16 + x[1:-1], x[2:]])
    blocks = nll[: len(nll) // 1000 * 1000].reshape(-1, 1000).mean(1)
    assert abs(nll.mean() - c.info["entropy_rate_nats"]) < 4 * blocks.std(ddof=1) / math.sqrt(len(blocks))


def test_a_bad_tail_exponent_is_one_clear_error():
    from lmcal.errors import DataError

    with pytest.raises(DataError, match="tail_exponent > 0"):
        load_corpus("powerlaw", tail_exponent=0.0)


# ---------------------------------------------------------------------------------------------------------------------
# The record and the sentences
# ---------------------------------------------------------------------------------------------------------------------


def stage_results(tail=5.3, spread=0.1, n=20, s=3, ce_t=-0.08, ce_c=0.01, seed=0):
    """Results of entropy_rate and decoders (with the fitted temperature and calibration rows) as the stages write
    them: tail_nats_per_generation [N, S], the rows' paired tail differences and test CEs."""
    g = np.random.default_rng(seed)
    tails = tail + spread * g.standard_normal((n, s))
    er = {"tail_nats_per_generation": tails.tolist(), "curve_nats": [4.0] * 20, "stderr_nats": [0.1] * 20,
          "horizon": 20, "num_prefixes": n, "samples_per_prefix": s, "prefix_len": 10, "seed": 0, "test_ce_nats": 4.7}
    rows = [{"method": "model", "params": {}, "test_ce_nats": 4.75},
            {"method": "fitted_temperature", "params": {"temperature": 0.95, "temperature_stderr": 0.01},
             "tail_diff_nats": ce_t, "tail_diff_stderr_nats": 0.02, "test_ce_nats": 4.74},
            {"method": "calibration", "params": {"alpha": -0.05, "alpha_stderr": 0.01, "topk": 16},
             "tail_diff_nats": ce_c, "tail_diff_stderr_nats": 0.03, "test_ce_nats": 4.75}]
    return {"entropy_rate": er, "decoders": {"rows": rows, "num_prefixes": n, "samples_per_prefix": s,
                                             "horizon": 20, "test_tokens": 1000}}


def test_the_record_reads_the_stages_results():
    res = stage_results()
    rec = scale_record(res, model="AWD-LSTM 50/100/3", family="AWD-LSTM", corpus="ptb", params=682_000,
                       train_tokens=300_000, test_ce=4.7, test_ce_stderr=0.01)
    per_prefix = np.asarray(res["entropy_rate"]["tail_nats_per_generation"]).mean(1)
    assert rec["tail_nats_per_prefix"] == pytest.approx(per_prefix.tolist())
    assert rec["gap_nats"] == pytest.approx(per_prefix.mean() - 4.7)
    assert rec["gap_stderr_nats"] == pytest.approx(math.hypot(per_prefix.std(ddof=1) / math.sqrt(20), 0.01))
    eff = rec["effects"]
    assert eff["fitted_temperature"] == {"tail_diff_nats": -0.08, "tail_diff_stderr_nats": 0.02, "test_ce_nats": 4.74,
                                         "temperature": 0.95, "temperature_stderr": 0.01}
    assert eff["calibration"]["alpha"] == -0.05 and eff["model"]["test_ce_nats"] == 4.75


def test_no_record_without_the_entropy_rate_stage(tmp_path):
    assert write_scale_record(tmp_path, {"calibration": {}}, model="m", family="f", corpus="c", params=1,
                              train_tokens=1, test_ce=1.0) is None
    assert not (tmp_path / RECORD).exists()


def test_the_exponent_and_trend_sentences_follow_the_numbers():
    c = scale_exponent("AWD-LSTM on ptb", "parameters", ExponentFit(-0.3, (-0.5, -0.1), 0.95, 6, 3), -0.05, "CVL's")
    assert c.verdict == "falls" and c.numbers["against_ref"] == "faster" and "falls faster here" in c.sentence
    assert "95% t-interval on 3 df" in c.sentence and c.numbers["df"] == 3 and c.numbers["runs"] == 6
    c = scale_exponent("x", "parameters", ExponentFit(-0.04, (-0.2, 0.1), 0.95, 6), -0.05, "CVL's")
    assert c.verdict == "flat_not_excluded" and c.numbers["against_ref"] == "consistent" and "holds 0" in c.sentence
    assert scale_exponent("x", "tokens", ExponentFit(0.2, (0.1, 0.3), 0.95, 4), -0.5,
                          "r").numbers["against_ref"] == "slower"
    assert scale_exponent("x", "tokens", ExponentFit(0.2, (math.nan, math.nan), 0.95, 4)).verdict == "untested"
    boot = scale_exponent("x", "tokens", ExponentFit(0.2, (0.1, 0.3), 0.9, 4, interval="bootstrap"))
    assert "90% bootstrap interval" in boot.sentence and boot.numbers["interval"] == "bootstrap"
    unfit = scale_exponent("x", "tokens", ExponentFit(0.2, (0.1, 0.3), 0.95, 4, why_not="df < 2"))
    assert unfit.verdict == "untested" and "not fitted (df < 2)" in unfit.sentence
    assert effect_trend("Calibration", 0.5, 0.1, 6).verdict == "grows"
    assert effect_trend("Calibration", -0.5, 0.1, 6).verdict == "shrinks"
    assert effect_trend("Calibration", 0.1, 0.1, 6).verdict == "no_trend"
    assert paper.cvl_predicted_exponent(2.0) == -0.5 and paper.cvl_predicted_exponent(1.0) == 0.0


# ---------------------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------------------


def write_runs(root: Path, family="AWD-LSTM", corpus="ptb", b_n=-0.3, b_d=0.0, a=2.0, tail_exponent=None,
               group="multirun-x"):
    """Six run folders of a 3 x 2 grid whose gaps follow a N^b_n D^b_d, the stronger models with lower test CE, each
    with its scale.json and metrics.json."""
    n = [7e5, 1.7e6, 4.7e6] * 2
    d = [3.5e5] * 3 + [2.8e6] * 3
    tails, _, _ = runs_on_a_law(n, d, b_n, b_d, a=a, ce=0.0, noise=0.01, prefixes=100)
    for i, (ni, di) in enumerate(zip(n, d, strict=True)):
        ce = 5.0 - 0.1 * math.log(ni * di / 1e11)
        res = stage_results(ce_c=-0.02 * (6 - ce), seed=i)
        res["entropy_rate"]["tail_nats_per_generation"] = [[ce + t] * 3 for t in tails[i]]
        one_budget = {"train_tokens": 640_000, "data_tokens": int(di)} if tail_exponent else {"train_tokens": int(di)}
        rec = scale_record(res, model=f"{family} {i}", family=family, corpus=corpus, params=int(ni),
                           test_ce=ce, test_ce_stderr=0.002, wandb_group=group, **one_budget,
                           **({"tail_exponent": tail_exponent} if tail_exponent else {}))
        run = root / f"job{i}"
        run.mkdir(parents=True)
        (run / RECORD).write_text(json.dumps(rec))
        (run / "metrics.json").write_text(json.dumps({"wall_seconds": 60.0 * (i + 1)}))


def test_the_report_writes_the_table_figure_fit_and_sentences(tmp_path):
    write_runs(tmp_path / "sweep")
    write_runs(tmp_path / "synthetic", corpus="powerlaw", b_n=0.0, b_d=-0.5, a=50.0, tail_exponent=2.0)
    rep = scale_report([tmp_path / "sweep", tmp_path / "synthetic"], tmp_path / "out", n_boot=200)
    out = tmp_path / "out"
    for f in ("scale.md", "scale.png", "scale_report.json", "results.json", "REPORT.md"):
        assert (out / f).is_file(), f
    assert rep["profile"] == "scale" and len(rep["runs"]) == 12 and rep["wall_seconds"] == 2 * 60 * 21
    ptb, syn = rep["groups"]
    assert ptb["label"] == "AWD-LSTM on ptb" and syn["label"] == "AWD-LSTM on powerlaw, tail exponent s = 2"
    f = ptb["fits"]["params"]
    assert f["exponents"]["params"] == pytest.approx(-0.3, abs=0.05) and f["reference"] == paper.CVL_TEXT_EXPONENT
    f = syn["fits"]["data_tokens"]  # trained on one budget of tokens: the distinct ones vary
    assert f["reference"] == -0.5 and f["exponents"]["data_tokens"] == pytest.approx(-0.5, abs=0.05)  # CVL's, s = 2
    assert set(syn["fits"]) == {"params", "data_tokens", "test_ce_nats", "params+data_tokens"}
    assert set(ptb["fits"]) == {"params", "train_tokens", "test_ce_nats", "params+train_tokens"}
    assert ptb["verdicts"]["scale_exponent_params"] == "falls" and "trend_calibration" in ptb["verdicts"]
    md = (out / "REPORT.md").read_text()
    assert "the law that generates is the law that is scored" in md and "| setting | value |" in md
    section = md.split("## AWD-LSTM on ptb")[1].split("\n## ")[0]  # its fits and trends as rows with their verdicts
    row = f"| gap ~ parameters^b | {ptb['fits']['params']['exponents']['params']:+.3f} |"
    assert row in section and "| yes (falls) |" in section and "| -0.050 (fit for text) |" in section
    assert all(f"({v.replace('_', ' ')})" in section for v in ptb["verdicts"].values())
    assert md.count("| AWD-LSTM ") == 12 and "![gap against parameters" in md
    assert "tail_nats_per_prefix" not in json.dumps(rep["runs"])  # kept in each scale.json only
    # `make docs RUNS=<out>` snapshots it into docs/runs/scale, and RESULTS.md carries its section
    docs = tmp_path / "docs"
    (docs / "bench").mkdir(parents=True)
    assert snapshot(out, docs) == docs / "runs" / "scale" and (docs / "runs" / "scale" / "scale.png").is_file()
    text = render(docs)
    assert "## Reproduction, profile `scale`" in text and row in text and "runs/scale/scale.png" in text
    assert "`scale`: AWD-LSTM on ptb: gap ~ params^b | -0.050 (CVL)" in text  # the claims table's row


def write_seeded_runs(root: Path, last_gap: float | None = None):
    """3 sizes x 3 training seeds (each folder's .hydra/config.yaml names its seed) whose gaps follow 2 N^-0.3 with a
    seed's scatter; `last_gap` sets the largest size's last seed's gap (a negative one: below its test CE)."""
    n = [7e5, 1.7e6, 4.7e6]
    rng = np.random.default_rng(3)
    for i, (ni, seed) in enumerate((ni, seed) for ni in n for seed in (141, 142, 143)):
        g = 2.0 * ni ** -0.3 * math.exp(0.05 * rng.standard_normal())
        if last_gap is not None and i == 8:
            g = last_gap
        ce = 5.0 - 0.1 * math.log(ni / 1e6) + 0.01 * rng.standard_normal()
        res = stage_results(seed=i)
        res["entropy_rate"]["tail_nats_per_generation"] = (ce + g + 0.01 * rng.standard_normal((20, 3))).tolist()
        rec = scale_record(res, model=f"AWD-LSTM {i // 3}", family="AWD-LSTM", corpus="ptb", params=int(ni),
                           train_tokens=348_480 + 7 * seed, data_tokens=116_199, test_ce=ce, test_ce_stderr=0.002)
        run = root / f"job{i}"
        (run / ".hydra").mkdir(parents=True)
        (run / RECORD).write_text(json.dumps(rec))
        (run / ".hydra" / "config.yaml").write_text(f"seed: {seed}\ntask_name: scale\n")


def test_the_seeds_of_a_cell_are_runs_of_their_own_in_the_fit(tmp_path):
    """9 runs, 3 cells of 3 seeds: the power law is fitted over all 9 (2 coefficients: 7 df), its t-interval covers
    the exponent, and the tables give each run's seed, the fit's cells beside its runs, and its df."""
    write_seeded_runs(tmp_path / "sweep")
    rep = scale_report([tmp_path / "sweep"], tmp_path / "out", n_boot=100)
    (g,) = rep["groups"]
    assert g["runs"] == 9 and g["cells"] == 3 and g["seeds_per_cell"] == [3, 3]
    assert sorted(r["train_seed"] for r in rep["runs"]) == [141] * 3 + [142] * 3 + [143] * 3
    f = g["fits"]["params"]
    assert f["df"] == 7 and f["n_runs"] == 9 and f["cells"] == 3 and f["interval"] == "t" and f["excluded"] == []
    assert f["ci"]["params"][0] < -0.3 < f["ci"]["params"][1] and f["signed"]["df"] == 7
    assert "train_tokens" not in g["fits"]  # one budget: the seeds' BPTT windows differ by a few tokens, no axis
    md = (tmp_path / "out" / "REPORT.md").read_text()
    assert "| 9 in 1 group(s); 3 cells, 3 seed(s) each |" in md and "| AWD-LSTM 0 | 142 | 0.70M |" in md
    lo, hi = f["ci"]["params"]
    assert f"| gap ~ parameters^b | {f['exponents']['params']:+.3f} | [{lo:+.3f}, {hi:+.3f}] | 7 | 9 (3) |" in md


def test_a_run_with_a_negative_gap_is_named_and_its_group_fitted_by_the_signed_trend(tmp_path):
    """The largest model's last seed generates below its test CE. The power law cannot take it and is not fitted,
    naming it; the signed trend is fitted over all 9 runs, with that one in it."""
    write_seeded_runs(tmp_path / "sweep", last_gap=-0.05)
    rep = scale_report([tmp_path / "sweep"], tmp_path / "out", n_boot=50)
    (g,) = rep["groups"]
    f = g["fits"]["params"]
    assert "exponents" not in f and f["nonpositive"] == ["AWD-LSTM 2, 0.12M tokens, seed 143"]
    assert f["error"].startswith("1 of 9 runs have gap <= 0: AWD-LSTM 2, 0.12M tokens, seed 143")
    gaps = [r["gap_nats"] for r in sorted(rep["runs"], key=lambda r: (r["params"], r["train_seed"]))]
    A = np.column_stack([np.ones(9), np.log(np.repeat([7e5, 1.7e6, 4.7e6], 3))])
    assert f["signed"]["n_runs"] == 9 and f["signed"]["slopes"]["params"] == pytest.approx(
        np.linalg.lstsq(A, gaps, rcond=None)[0][1])
    assert g["verdicts"]["scale_exponent_params"] == "untested" and "scale_trend_params" in g["verdicts"]
    md = (tmp_path / "out" / "REPORT.md").read_text()
    assert "| gap ~ parameters^b | not fitted (1 of 9 runs have gap <= 0: AWD-LSTM 2, 0.12M tokens, seed 143;" in md
    assert "| gap = a + b log parameters |" in md and "No run is left out for the sign of its gap" in md
    assert md.count("| AWD-LSTM 2 | 143 |") == 1  # its row in the runs table


def test_a_fit_that_failed_or_an_untested_trend_is_a_row_of_dashes():
    g = {"label": "x", "runs": 1, "fits": {}, "trends": {}}
    assert group_markdown(g, [])[-2] == "One run: nothing to fit."
    row = fit_row(g, {"axes": ["params", "train_tokens"], "error": "too few runs", "sign": -1.0})
    assert row == "| -gap ~ parameters^b_params x training tokens^b_train_tokens | not fitted (too few runs) | " \
                  "– | – | – | – | – | – | – |"
    assert row.count("|") == 10 and FIT_HEADER[0].count("|") == 10  # as many cells as the header's nine
    one = {"axes": ["params"], "error": "df < 2: 3 runs and 2 coefficients leave 1", "sign": 1.0, "n_runs": 3,
           "df": 1, "interval": "t", "reference": -0.05}
    assert fit_row(g, one) == "| gap ~ parameters^b | not fitted (df < 2: 3 runs and 2 coefficients leave 1) | – | " \
                              "1 | 3 | – | -0.050 (fit for text) | undecided (untested) | – |"
    assert trend_row(g, "calibration", {"slope": math.nan, "stderr": math.nan, "runs": 3}) == \
        "| lookahead calibration | – | – | 3 | 1 | undecided (untested) |"
    assert trend_row(g, "calibration", {"slope": 5.0, "stderr": 0.1, "runs": 3, "df": 1}) == \
        "| lookahead calibration | +5.000 | 0.100 | 3 | 1 | undecided (untested) |"  # df < 2: not stated


def test_a_methods_trend_is_not_fitted_where_the_test_ces_span_too_little():
    """The fits' rule for the effects' trends too: test CEs 6.24-6.55 (PTB's AWD-LSTMs on one budget) are less than a
    factor of 1.1 apart, so no slope per unit of log test CE is read off them; wider ones give a slope."""
    from lmcal.reporting.scale_report import effect_trends

    def rows(ces):
        return [{"test_ce_nats": c, "effects": {m: {"tail_diff_nats": -0.1 * i, "tail_diff_stderr_nats": 0.01}
                                                for m in ("fitted_temperature", "calibration")}}
                for i, c in enumerate(ces)]

    flat = effect_trends(rows([6.24, 6.3, 6.4, 6.55]))
    assert flat and all(t["slope"] is None and "too alike in test_ce_nats" in t["error"] for t in flat.values())
    g = {"label": "x", "runs": 4, "fits": {}, "trends": flat}
    assert trend_row(g, "calibration", flat["calibration"]).endswith("| 4 | 2 | undecided (untested) |")
    assert trend_row(g, "calibration", flat["calibration"]).startswith("| lookahead calibration | not fitted (the runs")
    wide = effect_trends(rows([2.0, 3.0, 4.0, 5.0]))
    assert all(math.isfinite(t["slope"]) and "error" not in t for t in wide.values())


def test_an_earlier_reports_fits_are_read_with_their_df_and_without_the_runs_they_left_out():
    """docs/runs/scale was fitted by a bootstrap over the runs of positive gap, one seed a cell, with no df: its
    transformer's joint fit (4 runs, 3 coefficients, 1 df) excluded 0 at -2.35 [-3.79, -1.26], and its single fits
    left out the 2 runs of negative gap. Read again, both are not fitted and undecided; a fit on 6 runs keeps its
    bootstrap interval, labelled as the bootstrap's, on 4 df."""
    from lmcal.reporting.scale_text import current, fit_claim

    joint = {"axes": ["params", "train_tokens"], "sign": 1.0, "exponents": {"params": -2.35, "train_tokens": -1.16},
             "ci": {"params": [-3.79, -1.26], "train_tokens": [-2.06, -0.93]}, "level": 0.95, "n_runs": 4,
             "excluded": [], "replicates": 762, "failed_replicates": 1238}
    assert current(joint)["error"].startswith("df < 2") and current(joint)["df"] == 1
    left_out = {**joint, "axes": ["params"], "excluded": ["Transformer 2x128"], "reference": -0.05}
    c = fit_claim("T", left_out)
    assert c.verdict == "untested" and "left out by an earlier report: Transformer 2x128" in c.sentence
    six = {**left_out, "excluded": [], "n_runs": 6, "exponents": {"params": -0.21}, "ci": {"params": [-0.59, 0.14]}}
    assert current(six)["interval"] == "bootstrap" and current(six)["df"] == 4
    c = fit_claim("A", six)
    assert c.verdict == "flat_not_excluded" and "bootstrap interval" in c.sentence and c.numbers["df"] == 4
    g = {"label": "A", "runs": 6, "fits": {"params": six}, "trends": {}}
    assert "| gap ~ parameters^b | -0.210 | – | 4 | 6 | [-0.590, +0.140] (1238 of 2000) |" in fit_row(g, six)


def test_a_file_that_is_not_a_record_is_one_paragraph(tmp_path):
    (tmp_path / RECORD).write_text("{}")
    with pytest.raises(LmcalError, match="is not a scale record: it lacks the key model"):
        collect_scale([tmp_path])


def test_the_report_logs_one_wandb_run_in_the_sweeps_group(tmp_path):
    write_runs(tmp_path / "sweep", group="multirun-scale-ptb")
    rep = scale_report([tmp_path / "sweep"], tmp_path / "out", n_boot=50)
    assert log_scale_wandb(rep, tmp_path / "out") == ["multirun-scale-ptb"]
    (run,) = runs_under(tmp_path / "out")
    assert (run["group"], run["job_type"], run["name"]) == ("multirun-scale-ptb", "report", "scale_report-ptb")
    (row,) = [h for h in run["history"] if "scale/table/nrows" in h]
    assert row["scale/table/nrows"] == 6 and row["scale/figure/_type"] == "image-file"
    for x in ("params", "train_tokens", "test_ce_nats"):  # each scatter: its table, and its chart (W&B's scatter)
        assert row[f"scale/gap_vs_{x}_table/nrows"] == 6
    assert not any("data_tokens" in k for k in row)  # no run has distinct tokens apart: no scatter of them
    (wandb_file,) = (tmp_path / "out").rglob("run-*.wandb")
    assert wandb_file.read_bytes().count(b"wandb/scatter/v0") == 3
    assert run["summary"]["scale/awd-lstm-on-ptb/params"] == pytest.approx(rep["groups"][0]["fits"]["params"][
        "exponents"]["params"])


# ---------------------------------------------------------------------------------------------------------------------
# The presets and the profiles
# ---------------------------------------------------------------------------------------------------------------------


SEEDS = ("141", "142", "143")


def test_the_sweep_presets_expand_to_their_grids():
    """Every cell of the cpu grids is trained with 3 seeds (train.yaml's `seed`), so that each fit has residual
    degrees of freedom of its own; the budget the cpu profile drops is the GPU grid's."""
    jobs = grid(["experiment=scale"])
    sizes = ("awd_lstm_xs", "awd_lstm_s", "awd_lstm_small")
    assert [v for _, v in jobs] == [{"model": m, "data.max_train_tokens": "116199", "seed": s} for m in sizes
                                    for s in SEEDS]
    assert [v["model"] for _, v in grid(["experiment=scale_transformer"])] == [
        m for m in ("transformer_xs", "transformer_s", "transformer_small") for _ in SEEDS]
    one = grid(["experiment=scale", "model=awd_lstm_xs", "data.max_train_tokens=1000,2000", "seed=7"])
    assert [v for _, v in one] == \
        [{"model": "awd_lstm_xs", "data.max_train_tokens": t, "seed": "7"} for t in ("1000", "2000")]  # as Hydra
    assert one[0][0] == ["experiment=scale"]  # a command line's value or list replaces the preset's
    syn = grid(["experiment=scale_powerlaw"])
    assert len(syn) == 18 and {v["data.corpus_kwargs.tail_exponent"] for _, v in syn} == {"1.1", "2.0"}
    assert {v["data.max_train_tokens"] for _, v in syn} == {"20000", "80000", "320000"}
    for exp in ("scale_gpu", "scale_transformer_gpu"):  # the full grid, with seeds
        jobs = grid([f"experiment={exp}"])
        assert len(jobs) == 18 and {v["seed"] for _, v in jobs} == set(SEEDS)
        assert {v["data.max_train_tokens"] for _, v in jobs} == {"232397", "null"}


def test_every_amount_of_the_power_law_sweep_trains_on_one_budget():
    from lmcal.utils.settings import composed

    epochs = {t: composed("lmcal.train", ["experiment=scale_powerlaw", f"data.max_train_tokens={t}"]).trainer.max_epochs
              for t in (20000, 40000, 320000)}
    assert epochs == {20000: 128, 40000: 64, 320000: 8}  # 2.56M training tokens each
    c = composed("lmcal.train", ["experiment=scale_powerlaw", "data.max_train_tokens=null"])
    with pytest.raises(Exception, match="lmcal_epochs needs the training tokens"):
        OmegaConf.to_container(c, resolve=True)


def test_the_gpu_sweep_is_checked_by_the_plan_check(tmp_path):
    cfg = load_profile(["profile=scale_gpu", f"out={tmp_path}", "sweeps.powerlaw=null"])
    stages = plan_sweeps(cfg)
    assert len(stages) == 37 and stages[-1]["name"] == "report"  # 2 families x 3 sizes x 2 budgets x 3 seeds
    text = check_sweeps(cfg)
    assert max(len(ln) for ln in text.splitlines()) <= 120
    joined = " ".join(ln.strip() for ln in text.splitlines())  # (each run's paragraph wrapped)
    assert "awd_lstm: model awd_lstm, max_train_tokens null, seed 143: awd_lstm, 24,221,600 parameters" in joined
    assert "(folder awd_lstm_awd_lstm-null-143)" in joined  # the paper's size at the top
    assert "transformer: model transformer, max_train_tokens null, seed 141: transformer, 30,602,240 parameters, " \
           "context 512" in joined
    full = plan_sweeps(load_profile(["profile=scale_gpu", f"out={tmp_path}"]))
    assert len(full) == 67 and "powerlaw_2.0-160000-142" in {st["name"] for st in full}  # all 5 amounts
    assert "ESTIMATE" in text and "every stream within its model's context" in joined
    bad = load_profile(["profile=scale_gpu", f"out={tmp_path}", "sweeps.powerlaw=null", "sweeps.awd_lstm=null",
                        "sweeps.transformer=[experiment=scale_transformer_gpu,analysis.entropy_rate.horizon=500]"])
    with pytest.raises(LmcalError, match=r"transformer_transformer_small-232397-141.*context of 512.*prefix_len \+ "
                                         r"horizon = 100 \+ 500"):
        check_sweeps(bad)


def test_the_cpu_sweep_profile_plans_every_job_with_one_wandb_group(tmp_path):
    cfg = load_profile(["profile=scale", f"out={tmp_path / 'scale'}"])
    stages = plan_sweeps(cfg)
    assert len(stages) == 28 and [s["sweep"] for s in stages[:-1]].count("powerlaw") == 18
    assert "transformer" not in {s.get("sweep") for s in stages}  # about 90 minutes here; opt in with ARGS
    cmd = stages[0]["cmd"]
    assert cmd[2:6] == ["lmcal.train", "experiment=scale", "model=awd_lstm_xs", "data.max_train_tokens=116199"]
    assert "seed=141" in cmd and "seed=142" in stages[1]["cmd"] and "logger.group=reproduce-scale" in cmd
    # each seed its own fixed folder (a rerun resumes it) and W&B name (the model is in the name already)
    dirs = [st["dir"] for st in stages[:-1]]
    assert len(set(dirs)) == len(dirs) and dirs[1] == tmp_path / "scale" / "awd_lstm" / "awd_lstm_xs-116199-142"
    assert f"hydra.run.dir={tmp_path / 'scale' / 'awd_lstm' / 'awd_lstm_xs-116199-141'}" in cmd
    assert "logger.name_suffix=116199-141" in cmd and "logger.name_suffix=2.0-320000-143" in stages[-2]["cmd"]
    assert composed_seed(stages[2]["cmd"]) == 143  # the override is train.yaml's own key
    csv = plan_sweeps(load_profile(["profile=scale", f"out={tmp_path / 'scale'}", "logger=csv"]))
    assert not any(o.startswith("logger.name_") for st in csv[:-1] for o in st["cmd"])


def composed_seed(cmd: list[str]) -> int:
    from lmcal.utils.settings import composed

    return composed("lmcal.train", [o for o in cmd[3:] if not o.startswith(("hydra.", "logger"))]).seed


def test_a_sweep_members_run_name_ends_with_its_swept_values(tmp_path):
    from lmcal.stages.wandb_run import init_args, sweep_suffix

    assert sweep_suffix({"model": "awd_lstm_xs", "data.max_train_tokens": "116199"}) == "116199"
    assert sweep_suffix({"data.corpus_kwargs.tail_exponent": "1.1", "data.max_train_tokens": "20000"}) == "1.1-20000"
    assert sweep_suffix({"model.name_or_path": "/models/gpt2-small"}) is None  # its label is in the name
    node = {"_target_": "pytorch_lightning.loggers.WandbLogger", "offline": True, "name_suffix": "1.1-20000"}
    a = init_args(node, tmp_path, "train", model="AWD-LSTM 64/256/1", dataset="powerlaw", suffix="ignored")
    assert a["name"] == "train-awd-lstm-64-256-1-powerlaw-1.1-20000" and "name_suffix" not in a
    a = init_args({**node, "name_suffix": None}, tmp_path, "train", model="AWD-LSTM 64/256/1", dataset="powerlaw")
    assert a["name"] == "train-awd-lstm-64-256-1-powerlaw"


# ---------------------------------------------------------------------------------------------------------------------
# End to end (slow tier): multiruns of tiny models, then the report
# ---------------------------------------------------------------------------------------------------------------------

TINY_ANALYSIS = ["analysis.entropy_rate.num_prefixes=6", "analysis.entropy_rate.samples_per_prefix=2",
                 "analysis.entropy_rate.prefix_len=8", "analysis.entropy_rate.horizon=20",
                 "analysis.calibration.fit_tokens=400", "analysis.calibration.fit_streams=4",
                 "analysis.calibration.min_context=10", "analysis.calibration.score_tokens=400",
                 "analysis.calibration.score_streams=4", "analysis.calibration.topk=4",
                 "analysis.calibration.tail_samples=4"]


def run(args, cwd, timeout=1500):
    env = {**os.environ, **({"LMCAL_DATA_ROOT": DATA_ROOT} if HAVE_PTB else {})}
    env.pop("WANDB_MODE", None)
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_a_multirun_of_tiny_models_ends_with_the_table_and_the_fit(tmp_path):
    """python -m lmcal.train -m experiment=scale_powerlaw on a tiny grid (2 sizes x 2 amounts of the power-law source:
    no data needed), then python -m lmcal.report on its folder."""
    sweep = tmp_path / "sweep"
    r = run(["lmcal.train", "-m", "experiment=scale_powerlaw", "model.hidden_size=16,48",
             "data.max_train_tokens=3000,12000", "data.corpus_kwargs.vocab_size=12",
             "data.corpus_kwargs.n_train=12000", "data.corpus_kwargs.n_valid=2000", "data.corpus_kwargs.n_test=2000",
             "data.corpus_kwargs.tail_exponent=1.5", "seed=141",  # one of the preset's seeds: 4 jobs
             "model.emb_size=16", "trainer.max_epochs=2", "trainer.enable_progress_bar=false",
             f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=job${hydra.job.num}", *TINY_ANALYSIS], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = sorted(sweep.glob(f"*/{RECORD}"))
    assert len(recs) == 4
    for p in recs:
        rec = json.loads(p.read_text())
        m = json.loads((p.parent / "metrics.json").read_text())
        assert rec["params"] == m["params"] and rec["train_tokens"] == m["train_tokens"] > 0
        assert rec["tail_exponent"] == 1.5 and rec["true_entropy_rate_nats"] == m["true_entropy_rate_nats"]
        assert rec["test_ce_nats"] == m["test_ce_nats"] and rec["wandb_group"] == "multirun-sweep"
        assert len(rec["curve_nats"]) == 20 and len(rec["tail_nats_per_prefix"]) == 6
        assert {"fitted_temperature", "calibration", "model"} <= set(rec["effects"])
    # one W&B group, each job named by the values its sweep varies (the preset's tail exponent, fixed here, is not)
    names = sorted(w["name"] for w in runs_under(sweep) if w["job_type"] == "train")
    assert names == sorted(f"train-awd-lstm-16-{h}-1-powerlaw-{n}-{h}" for h in (16, 48) for n in (3000, 12000))
    r = run(["lmcal.report", str(sweep), "--out", str(tmp_path / "report"), "--bootstrap", "100"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((tmp_path / "report" / "scale_report.json").read_text())
    (g,) = rep["groups"]
    assert g["runs"] == 4 and {"params", "train_tokens", "test_ce_nats"} <= set(g["fits"])
    assert "python -m lmcal.train -m" in rep["commands"][0] and "model.hidden_size=16,48" in rep["commands"][0]
    assert (tmp_path / "report" / "scale.png").is_file() and "## AWD-LSTM on powerlaw" in (
        tmp_path / "report" / "REPORT.md").read_text()
    (wb,) = [w for w in runs_under(tmp_path / "report") if w["job_type"] == "report"]
    assert wb["group"] == "multirun-sweep"  # the sweep's own group: its training runs and the report's


def trained_gpt2(folder: Path, width: int, layers: int, ids: torch.Tensor, steps: int = 40):
    """A tiny GPT-2 trained for `steps` Adam steps on windows of `ids`, saved with the word-level tokenizer."""
    import transformers

    from tests.test_hf import WORDS, tiny_tokenizer

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    m = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=2,
                                                             vocab_size=len(WORDS), n_positions=64, bos_token_id=0,
                                                             eos_token_id=0))
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    for _ in range(steps):
        x = torch.stack([ids[a:a + 33] for a in torch.randint(0, len(ids) - 33, (8,), generator=g)])  # [8, 33]
        loss = m(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    m.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_a_hugging_face_family_gives_the_same_record(tmp_path):
    """python -m lmcal.evaluate -m model=hf model.name_or_path=A,B,C stages=[entropy_rate] on three tiny GPT-2 models
    built and briefly trained here on a repeated sentence (no download): each job's scale.json, its parameters read
    from the model; then the table, and no fit (3 runs leave 1 degree of freedom). Trained alike, the larger models
    fit the sentence better and wander less once their generations leave it: the gap falls with size."""
    transformers = pytest.importorskip("transformers")
    from tests.test_hf import WORDS

    sentence = "the cat sat on the mat and the dog ran far away"
    ids = torch.tensor([WORDS.index(w) for w in sentence.split()] * 40)
    folders = [trained_gpt2(tmp_path / f"gpt-{w}", w, n, ids) for w, n in ((16, 1), (32, 2), (64, 2))]
    for split in ("valid", "test"):
        (tmp_path / f"{split}.txt").write_text("\n".join([sentence] * 40) + "\n")
    sweep = tmp_path / "sweep"
    r = run(["lmcal.evaluate", "-m", "model=hf", f"model.name_or_path={','.join(map(str, folders))}",
             "stages=[entropy_rate]", f"model.valid_text={tmp_path / 'valid.txt'}",
             f"model.test_text={tmp_path / 'test.txt'}", "model.train_tokens=10560", *TINY_ANALYSIS[:4],
             "logger.group=scale-hf", f"hydra.sweep.dir={sweep}", "hydra.sweep.subdir=job${hydra.job.num}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = [json.loads(p.read_text()) for p in sorted(sweep.rglob(RECORD))]
    assert len(recs) == 3
    for rec in recs:
        size = transformers.GPT2LMHeadModel.from_pretrained(rec["name_or_path"]).num_parameters()
        assert rec["params"] == size and rec["family"] == "gpt2" and rec["unit"] == "model token"
        assert rec["train_tokens"] == 10560 and rec["effects"] == {} and rec["corpus"] == "valid"
        assert rec["test_ce_stderr_nats"] > 0 and rec["wandb_group"] == "scale-hf" and rec["gap_nats"] > 0
    r = run(["lmcal.report", str(sweep), "--out", str(tmp_path / "report"), "--bootstrap", "100"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads((tmp_path / "report" / "scale_report.json").read_text())
    (grp,) = rep["groups"]
    f = grp["fits"]["params"]
    assert grp["label"] == "gpt2 on valid (per model token)" and f["n_runs"] == 3 and f["reference"] == -0.05
    assert f["df"] == 1 and f["error"].startswith("df < 2")  # three models, two coefficients: no fit is stated
    assert grp["verdicts"]["scale_exponent_params"] == "untested"
    gaps = [r["gap_nats"] for r in sorted(rep["runs"], key=lambda r: r["params"])]
    assert gaps[0] > gaps[-1]  # the gap falls with size
    assert "| gpt-64 | – | 0.10M | 10,560 |" in (tmp_path / "report" / "scale.md").read_text()  # no training seed
    (wb,) = [w for w in runs_under(tmp_path / "report") if w["job_type"] == "report"]
    assert wb["group"] == "scale-hf"


@pytest.mark.slow
def test_make_reproduce_profile_scale_runs_its_sweeps_and_resumes(tmp_path):
    """The scale profile end to end on a tiny grid of the power-law source: every job a stage, the report, the
    records; a rerun skips every finished job."""
    from lmcal.pipeline.scale_sweep import reproduce_sweeps

    cfg = load_profile(["profile=scale", f"out={tmp_path / 'scale'}", "logger=csv", "sweeps.awd_lstm=null",
                        "sweeps.transformer=null", "bootstrap=50"])
    cfg.sweeps.powerlaw = ["experiment=scale_powerlaw", "data.max_train_tokens=3000,12000",
                           "data.corpus_kwargs.tail_exponent=1.1,2.0", "data.corpus_kwargs.vocab_size=12",
                           "data.corpus_kwargs.n_train=12000", "data.corpus_kwargs.n_valid=2000",
                           "data.corpus_kwargs.n_test=2000", "model.hidden_size=32", "model.emb_size=16",
                           "optim.lr=0.01", "trainer.max_epochs=3", "trainer.enable_progress_bar=false",
                           "seed=141", *TINY_ANALYSIS]  # one of the preset's seeds
    res = reproduce_sweeps(OmegaConf.create(OmegaConf.to_container(cfg)))
    assert [g["label"] for g in res["groups"]] == ["AWD-LSTM on powerlaw, tail exponent s = 1.1",
                                                    "AWD-LSTM on powerlaw, tail exponent s = 2"]
    assert len(res["runs"]) == 4 and set(res["stages"]) == {*(f"powerlaw_{s}-{n}-141" for s in ("1.1", "2.0")
                                                              for n in (3000, 12000)), "report"}
    assert res["provenance"]["command"].startswith("python -m lmcal.reproduce")
    t = {p: p.stat().st_mtime for p in (tmp_path / "scale").rglob(RECORD)}
    reproduce_sweeps(OmegaConf.create(OmegaConf.to_container(cfg)))
    assert {p: p.stat().st_mtime for p in (tmp_path / "scale").rglob(RECORD)} == t  # nothing ran again


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_PTB, reason="real PTB not found: set LMCAL_DATA_ROOT")
def test_the_ptb_presets_train_and_record_a_tiny_job(tmp_path):
    """experiment=scale and scale_transformer as they are, on a slice of PTB: each job's record."""
    for exp, model in (("scale", "awd_lstm_xs"), ("scale_transformer", "transformer_xs")):
        out = tmp_path / exp
        r = run(["lmcal.train", f"experiment={exp}", f"model={model}", "data.max_train_tokens=4000",
                 "data.max_eval_tokens=3000", "trainer.max_epochs=1", "logger=none",
                 "trainer.enable_progress_bar=false", f"hydra.run.dir={out}", *TINY_ANALYSIS], tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        rec = json.loads((out / RECORD).read_text())
        assert rec["corpus"] == "ptb" and rec["family"] == ("AWD-LSTM" if exp == "scale" else "Transformer")
        assert rec["data_tokens"] == 4000 and math.isfinite(rec["gap_stderr_nats"])
