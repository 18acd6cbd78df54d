"""Lookahead entropy-rate calibration: the lookahead, the exact objective and its fit, the calibrated StepLM."""

import math

import pytest
import torch

from lmcal.calibration import (
    calibrated,
    entropy,
    fit_lookahead_calibration,
    lookahead_entropies,
    mix_uniform,
    score,
)
from lmcal.data import batchify
from lmcal.entropy_rate import generation_entropy_curve, random_prefixes
from lmcal.expfit import calibration_objective, fit_alpha, newton_minimize, objective
from lmcal.markov import DriftingOracle, MarkovOracle, make_markov_chain, markov_entropy_rate, sample_markov
from lmcal.model import AWDLSTM

V = 13


class TinyLSTM:
    """A minimal StepLM over a tiny AWD-LSTM (eval mode), peaked enough that entropies vary between candidates."""

    def __init__(self, seed=0):
        torch.manual_seed(seed)
        self.net = AWDLSTM(vocab_size=V, emb_size=6, hidden_size=10, num_layers=2).eval()
        with torch.no_grad():
            self.net.encoder.weight.normal_(0, 1.5)  # tied with the decoder: sharper next-token distributions
        self.vocab_size = V

    def init_state(self, batch_size):
        return self.net.init_hidden(batch_size)

    @torch.no_grad()
    def step(self, tokens, state):
        out, _, state = self.net(tokens[None], state)  # [1, B, E]
        return self.net.logits(out[0]).log_softmax(-1), state

    def select(self, state, index):
        return [(h[:, index], c[:, index]) for h, c in state]


@pytest.fixture(scope="module")
def lm():
    return TinyLSTM()


@pytest.fixture(scope="module")
def text():
    return torch.randint(0, V, (14, 5), generator=torch.Generator().manual_seed(1))  # [S, B]


def advanced(lm, tokens):
    """State and next log-probs of B rows after reading tokens [T, B]."""
    state = lm.init_state(tokens.size(1))
    for t in range(tokens.size(0)):
        logp, state = lm.step(tokens[t], state)
    return logp, state


@pytest.mark.parametrize("epsilon", [0.0, 0.2])
def test_lookahead_exact_and_topk(lm, text, epsilon):
    logp, state = advanced(lm, text[:4])  # [5, V]
    exact = lookahead_entropies(lm, state, logp, epsilon=epsilon, chunk=7)  # chunks cut across rows
    for b, w in [(0, 0), (2, 5), (4, V - 1)]:  # brute force: step candidate w from row b alone
        lp, _ = lm.step(torch.tensor([w]), lm.select(state, torch.tensor([b])))
        torch.testing.assert_close(exact[b, w], entropy(mix_uniform(lp, epsilon))[0])
    torch.testing.assert_close(lookahead_entropies(lm, state, logp, topk=V, epsilon=epsilon, chunk=11), exact)
    k = 4
    top = lookahead_entropies(lm, state, logp, topk=k, epsilon=epsilon)
    idx = logp.topk(k, -1).indices  # [5, k]
    torch.testing.assert_close(top.gather(1, idx), exact.gather(1, idx))
    w = mix_uniform(logp, epsilon).gather(1, idx).softmax(-1)
    rest = torch.ones_like(top, dtype=torch.bool).scatter_(1, idx, False)
    fill = (w * exact.gather(1, idx)).sum(-1, keepdim=True).expand_as(top)
    torch.testing.assert_close(top[rest], fill[rest])


def test_alpha_zero_is_the_base_model_and_epsilon_the_mixture(lm, text):
    eps = 0.1
    state0, state1, state2 = lm.init_state(5), lm.init_state(5), lm.init_state(5)
    cal0, calm = calibrated(lm, 0.0), calibrated(lm, 0.0, epsilon=eps)
    for t in range(4):
        ref, state0 = lm.step(text[t], state0)
        out0, state1 = cal0.step(text[t], state1)
        outm, state2 = calm.step(text[t], state2)
        assert torch.equal(out0, ref)
        torch.testing.assert_close(outm.exp(), (1 - eps) * ref.exp() + eps / V)
    assert score(cal0, text) == score(lm, text)


def test_calibrated_rows_are_normalised_and_reweighted(lm, text):
    alpha = -0.6
    _, state = advanced(lm, text[:3])
    out, _ = calibrated(lm, alpha).step(text[3], state)  # [5, V]
    logp, state = lm.step(text[3], state)
    h = lookahead_entropies(lm, state, logp)  # [5, V]
    torch.testing.assert_close(out, (logp + alpha * h).log_softmax(-1))
    torch.testing.assert_close(out.logsumexp(-1), torch.zeros(5))


@pytest.mark.parametrize("topk,epsilon", [(None, 0.0), (4, 0.0), (None, 0.15), (5, 0.05)])
def test_fit_statistics_match_direct_scoring(lm, text, topk, epsilon):
    fit = fit_lookahead_calibration(lm, text, topk=topk, epsilon=epsilon)
    assert fit.n_tokens == (text.size(0) - 1) * text.size(1)
    for alpha in (-0.8, 0.0, 0.5, fit.alpha):
        direct, n = score(calibrated(lm, alpha, topk=topk, epsilon=epsilon, chunk=17), text)
        assert n == fit.n_tokens
        assert fit.ce_at(alpha) == pytest.approx(direct, abs=2e-6)
    assert fit.ce_before == pytest.approx(fit.ce_at(0.0), abs=1e-12)
    assert fit.ce_after <= fit.ce_before
    assert 0 < fit.alpha_stderr < math.inf


def test_derivatives_convexity_and_moment_matching(lm, text):
    fit = fit_lookahead_calibration(lm, text, topk=6)
    d = 1e-4
    for alpha in (-1.0, -0.2, 0.3):
        _, d1, d2 = fit.ce_derivatives(alpha)
        assert d1 == pytest.approx((fit.ce_at(alpha + d) - fit.ce_at(alpha - d)) / (2 * d), abs=1e-8)
        fd2 = (fit.ce_derivatives(alpha + d)[1] - fit.ce_derivatives(alpha - d)[1]) / (2 * d)
        assert d2 == pytest.approx(fd2, abs=1e-8) and d2 > 0
    ce_star, d1_star, _ = fit.ce_derivatives(fit.alpha)
    assert abs(d1_star) < 1e-10 and ce_star == fit.ce_after
    assert all(fit.ce_at(fit.alpha + s) > ce_star for s in (-1e-3, 1e-3))
    under_model, at_targets = fit.hnext_means(fit.alpha)
    assert under_model == pytest.approx(at_targets, rel=1e-6)


def test_calibration_objective_on_full_rows(lm, text):
    fit = fit_lookahead_calibration(lm, text)  # exact mode: the atoms are the full rows in vocabulary order
    targets = text[1:].reshape(-1)
    torch.testing.assert_close(fit.logw.gather(1, targets[:, None])[:, 0], fit.logq_y)
    for alpha in (-0.5, 0.7):
        got = calibration_objective(fit.logw, fit.h, targets, alpha)
        for a, b in zip(got, fit.ce_derivatives(alpha), strict=True):
            assert a == pytest.approx(b, rel=1e-12, abs=1e-14)
    stats = fit.logw, fit.h, fit.logq_y, fit.h_y
    assert objective([stats], 0.3, elements=3 * V) == pytest.approx(objective([stats], 0.3), rel=1e-12)  # 3 rows a time


def test_newton_minimize_converges_and_refuses_an_unbounded_minimum():
    fun = lambda a: (math.cosh(a - 1.3) + 0.1 * a ** 4, math.sinh(a - 1.3) + 0.4 * a ** 3, math.cosh(a - 1.3)
                     + 1.2 * a ** 2)
    a = newton_minimize(lambda a: fun(a)[1:], -50.0, 50.0)
    assert abs(fun(a)[1]) < 1e-12
    # the statistic is largest at every true next word: CE(a) falls for ever, a* = +inf
    logw = torch.zeros(6, 3).log_softmax(-1)  # [6, 3]
    s = torch.zeros(6, 3)
    s[:, 0] = 1.0
    rows = [(logw, s, logw[:, 0], s[:, 0])]
    with pytest.raises(RuntimeError):
        fit_alpha(rows, bound=20.0)


def markov_text(chain, n, seed, streams=64):
    """Held-out stationary text of `chain` as time-major streams [n // streams, streams], and the 1-D stream."""
    tokens = torch.from_numpy(sample_markov(chain.probs, chain.vocab_size, chain.order, n, seed))
    return batchify(tokens, streams), tokens


def test_drifting_oracle_is_calibrated_towards_the_entropy_rate():
    chain = make_markov_chain(vocab_size=8, order=1, seed=0)
    h = markov_entropy_rate(chain.probs, 8, 1)
    drift = DriftingOracle(chain, T=20, noise_vocab=32)
    streams, tokens = markov_text(chain, 100 * 64, seed=1)
    fit = fit_lookahead_calibration(drift, streams)
    # noise words raise H_next and never occur in true text: the fit steers away from them
    assert fit.alpha < -3 * fit.alpha_stderr
    assert fit.ce_after < fit.ce_before
    prefixes = random_prefixes(tokens, 16, 10)
    base, cal = (generation_entropy_curve(m, prefixes, horizon=40, samples_per_prefix=16)
                 for m in (drift, calibrated(drift, fit.alpha)))
    assert cal.mean[-1] < base.mean[-1] - 3 * math.hypot(cal.stderr[-1], base.stderr[-1])
    assert abs(cal.mean[-1] - h) < abs(base.mean[-1] - h)


def test_exact_markov_oracle_needs_no_calibration():
    chain = make_markov_chain(vocab_size=8, order=2, seed=0)
    fit = fit_lookahead_calibration(MarkovOracle.from_chain(chain), markov_text(chain, 100 * 64, seed=2)[0])
    assert abs(fit.alpha) < 3 * fit.alpha_stderr
    assert fit.ce_before - fit.ce_after < 1e-3
