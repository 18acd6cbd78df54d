"""The one fit of a one-parameter exponential family (lmcal.core.expfit): derivatives against finite differences, zeros
and the domain they cut, the bound (raise or clamp), chunking, and the sandwich standard error."""

import logging
import math

import pytest
import torch

from lmcal.core.expfit import (
    NoFiniteMinimum,
    calibration_objective,
    domain,
    fit_alpha,
    newton_minimize,
    objective,
    row_terms,
    sandwich_stderr,
    tilted,
    with_targets,
)

N, K = 200, 7


def atoms(seed=0, n=N, k=K):
    """Rows of log-weights [n, k] (a few zeros), a statistic [n, k] and targets drawn from the base law."""
    g = torch.Generator().manual_seed(seed)
    logw = torch.randn(n, k, generator=g, dtype=torch.float64) * 2
    logw[::5, 0] = -math.inf  # P(w) = 0 stays 0 for every a
    logw = logw.log_softmax(-1)
    s = torch.randn(n, k, generator=g, dtype=torch.float64) + 0.3 * logw.clamp(min=-20)
    y = torch.multinomial(logw.exp(), 1, generator=g)[:, 0]
    return logw, s, y


def direct(logw, s, y, a):
    """CE(a) straight from the definition: -log P_a(y) averaged."""
    return -tilted(logw, s, a).gather(1, y[:, None]).mean().item()


@pytest.mark.parametrize("a", [-1.3, 0.0, 0.4, 2.0])
def test_derivatives_match_finite_differences(a):
    logw, s, y = atoms(1)
    ce, d1, d2 = calibration_objective(logw, s, y, a)
    assert ce == pytest.approx(direct(logw, s, y, a), abs=1e-12)
    h = 1e-5
    fd1 = (calibration_objective(logw, s, y, a + h)[0] - calibration_objective(logw, s, y, a - h)[0]) / (2 * h)
    fd2 = (calibration_objective(logw, s, y, a + h)[1] - calibration_objective(logw, s, y, a - h)[1]) / (2 * h)
    assert d1 == pytest.approx(fd1, rel=1e-6, abs=1e-8)
    assert d2 == pytest.approx(fd2, rel=1e-6, abs=1e-8) and d2 > 0


def test_fit_is_the_minimum_with_moment_matching_and_blocks_do_not_matter():
    logw, s, y = atoms(2)
    rows = [with_targets(logw, s, y)]
    a = fit_alpha(rows)
    ce, d1, d2, mean = objective(rows, a)
    assert abs(d1) < 1e-12 and d2 > 0
    assert all(direct(logw, s, y, a + e) > ce for e in (-1e-4, 1e-4))
    assert mean == pytest.approx(s.gather(1, y[:, None]).mean().item(), rel=1e-9)  # E_{P_a*}[s] = mean s(y)
    halves = [with_targets(logw[:77], s[:77], y[:77]), with_targets(logw[77:], s[77:], y[77:])]
    assert objective(halves, a, elements=3 * K) == pytest.approx(objective(rows, a), rel=1e-12)
    assert fit_alpha(halves, elements=K) == pytest.approx(a, rel=1e-10)


def test_a_constant_statistic_is_flat_exactly():
    logw, _, y = atoms(3)
    s = torch.full_like(logw, -2.5)
    _, d1, d2 = calibration_objective(logw, s, y, 0.9)
    assert d1 == 0.0 and d2 == 0.0
    rows = [with_targets(logw, s, y)]
    assert fit_alpha(rows) == 0.0
    _, g = objective(rows, 0.0, per_row=True)
    assert sandwich_stderr(g, 0.0) == math.inf


def test_minus_inf_statistic_cuts_the_domain():
    logw, s, y = atoms(4)
    s = s.clone()
    hole = torch.zeros_like(s, dtype=torch.bool)
    hole[:, 1] = True
    hole[torch.arange(N), y] = False  # s = -inf on a word with P > 0, never at the true next word
    s[hole] = -math.inf
    rows = [with_targets(logw, s, y)]
    assert domain(rows, 50.0) == (0.0, 50.0)  # a < 0 would give those words infinite weight
    with pytest.raises(ValueError, match="undefined"):
        calibration_objective(logw, s, y, -0.1)
    a = fit_alpha(rows, bound=50.0)
    assert a >= 0
    for b in (0.3, 1.0):  # a > 0: those words get weight 0, the derivatives stay exact
        fd = (calibration_objective(logw, s, y, b + 1e-5)[0] - calibration_objective(logw, s, y, b - 1e-5)[0]) / 2e-5
        assert calibration_objective(logw, s, y, b)[1] == pytest.approx(fd, rel=1e-6, abs=1e-8)
    _, ce, _, _, _ = row_terms(*rows[0], 0.3)
    assert torch.isfinite(ce).all()
    # s = -inf at a true next word: CE(a > 0) = +inf, the domain is cut to a <= 0
    s2 = s.clone()
    s2[0, y[0]] = -math.inf
    rows2 = [with_targets(logw, s2, y)]
    assert domain(rows2, 50.0) == (0.0, 0.0)
    assert fit_alpha(rows2, bound=50.0) == 0.0
    assert calibration_objective(logw, s2, y, 0.5)[0] == math.inf


def test_newton_minimize_stays_in_its_bracket():
    fun = lambda a: (2 * (a - 3.0), 2.0)  # (a - 3)^2
    assert newton_minimize(fun, -10.0, 10.0) == pytest.approx(3.0, abs=1e-12)
    assert newton_minimize(fun, -10.0, 1.0) == pytest.approx(1.0, abs=1e-12)  # the minimum over [lo, hi]
    assert newton_minimize(fun, 0.0, 0.0) == 0.0
    flat = lambda a: (math.tanh(a - 0.7), 0.0)  # f'' = 0 everywhere: bisection only
    assert newton_minimize(flat, -5.0, 5.0) == pytest.approx(0.7, abs=1e-9)


def test_the_bound_raises_or_clamps_with_a_warning(caplog):
    logw = torch.zeros(6, 3, dtype=torch.float64).log_softmax(-1)
    s = torch.zeros(6, 3, dtype=torch.float64)
    s[:, 0] = 1.0  # the statistic is largest at every true next word: CE falls for ever
    rows = [(logw, s, logw[:, 0], s[:, 0])]
    with pytest.raises(NoFiniteMinimum, match="beyond") as info:  # a RuntimeError, with the edge it stopped on
        fit_alpha(rows, bound=20.0)
    e = info.value
    assert e.at_bound == [20.0] and e.sign == 1.0 and e.slope < 0  # CE(a) = log(1 + 2 e^-a) still falls at 20
    assert e.ce_at_bound == pytest.approx(math.log1p(2 * math.exp(-20.0)), rel=1e-12)
    with caplog.at_level(logging.WARNING, logger="lmcal"):
        assert fit_alpha(rows, bound=20.0, clamp=True, what="test fit") == 20.0
    assert "test fit: held-out CE keeps falling up to |alpha| = 20.0" in caplog.text
    assert fit_alpha([(logw, -s, logw[:, 0], -s[:, 0])], bound=20.0, clamp=True) == -20.0


def test_sandwich_stderr_with_clusters():
    g = torch.tensor([0.5, -1.0, 0.25, 2.0, -0.75, 1.5], dtype=torch.float64)
    d2 = 0.8
    assert sandwich_stderr(g, d2) == pytest.approx(math.sqrt((g ** 2).mean().item() / 6) / d2, rel=1e-14)
    blocks = torch.tensor([-0.5, 2.25, 0.75], dtype=torch.float64)  # sums of pairs
    assert sandwich_stderr(g, d2, cluster_size=2) == pytest.approx(math.sqrt((blocks ** 2).sum().item()) / (6 * d2))
    assert sandwich_stderr(g, 0.0) == math.inf
