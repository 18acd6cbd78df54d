"""Lookahead entropy-rate calibration: the lookahead, the exact objective and its fit, the calibrated StepLM."""

import math

import pytest
import torch

from lmcal.core.calibration import calibrated, fit_lookahead_calibration, score, stream_block_stderr, topk_coverage
from lmcal.core.entropy_rate import clustered_mean, generation_entropy_curve, paired_tail_difference
from lmcal.core.expfit import calibration_objective, fit_alpha, newton_minimize, objective, sandwich_stderr
from lmcal.core.lookahead import entropy, lookahead_entropies, mix_uniform
from lmcal.core.lookahead_law import Rule, make_rule
from lmcal.core.sampling import random_prefixes
from lmcal.data.batching import batchify
from lmcal.data.markov import make_markov_chain, markov_entropy_rate, sample_markov
from lmcal.errors import LmcalError
from lmcal.models.awd_lstm import AWDLSTM
from lmcal.models.oracles import DriftingOracle, MarkovOracle

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
def test_lookahead_is_exact(lm, text, epsilon):
    logp, state = advanced(lm, text[:4])  # [5, V]
    exact = lookahead_entropies(lm, state, logp, epsilon=epsilon, chunk=7)  # chunks cut across rows
    for b, w in [(0, 0), (2, 5), (4, V - 1)]:  # brute force: step candidate w from row b alone
        lp, _ = lm.step(torch.tensor([w]), lm.select(state, torch.tensor([b])))
        torch.testing.assert_close(exact[b, w], entropy(mix_uniform(lp, epsilon))[0])


@pytest.mark.parametrize("epsilon", [0.0, 0.2])
def test_topk_atoms_are_the_tail_draws_then_the_top_words(lm, text, epsilon):
    """The law's atoms (lmcal.core.lookahead_law): m tail atoms sharing the mass of the rest (every word outside the
    top k, the true one too), each with the H_next of a word drawn from it, then the top k with their own; the true
    word is the atom of its column when among the top k, else in the rest (slot -1), as generation treats it."""
    k, m = 2, 3
    ex = fit_lookahead_calibration(lm, text, epsilon=epsilon)  # exact: atoms are the rows in vocabulary order
    fit = fit_lookahead_calibration(lm, text, make_rule(topk=k, tail_samples=m), epsilon=epsilon, seed=5)
    assert fit.logw.shape == fit.h.shape == (ex.n_tokens, m + k) and fit.tail_samples == m
    assert fit.candidates_mean == k and ex.candidates_mean == V
    top = ex.logw.topk(k, -1).indices  # [n, k]
    y = text[1:].reshape(-1)
    hit = top == y[:, None]
    assert (~hit.any(1)).sum() > 20  # most true words lie outside the top 2: they share the tail's tilt
    assert torch.equal(fit.slot, torch.where(hit.any(1), m + hit.long().argmax(1), -1))
    assert torch.equal(ex.slot, y)
    torch.testing.assert_close(fit.logq_y, ex.logq_y)
    torch.testing.assert_close(fit.logw[:, m:], ex.logw.gather(1, top))
    torch.testing.assert_close(fit.h[:, m:], ex.h.gather(1, top), rtol=0, atol=1e-5)
    rest = torch.ones_like(ex.logw, dtype=torch.bool).scatter_(1, top, False)
    log_rest = ex.logw.masked_fill(~rest, -math.inf).logsumexp(-1)  # [n]
    torch.testing.assert_close(fit.logw[:, :m], (log_rest - math.log(m))[:, None].expand(-1, m))
    gap = (fit.h[:, :m, None] - ex.h[:, None, :]).abs().masked_fill(~rest[:, None, :], math.inf)  # [n, m, V]
    assert gap.amin(-1).max() < 1e-5
    assert fit.logw.double().logsumexp(-1).sub(0).abs().max() < 1e-5  # Z(0) = 1: the atoms carry all the mass


def test_topk_at_the_edge_of_the_vocabulary_is_exact(lm, text):
    """k = V - 1 leaves at most one word over (the draws all pick it), k = V none: both are exact mode."""
    exact = fit_lookahead_calibration(lm, text)
    for k in (V - 1, V):
        fit = fit_lookahead_calibration(lm, text, make_rule(topk=k, tail_samples=3))
        assert fit.logw.double().logsumexp(-1).abs().max() < 1e-5  # the atoms carry all the mass
        for a in (-0.5, 0.7):
            assert fit.ce_derivatives(a) == pytest.approx(exact.ce_derivatives(a), rel=1e-5, abs=1e-6)


def test_alpha_zero_is_the_base_model_and_epsilon_the_mixture(lm, text):
    eps = 0.1
    cal0, calm = calibrated(lm, 0.0), calibrated(lm, 0.0, epsilon=eps)
    state0, state1, state2 = lm.init_state(5), cal0.init_state(5), calm.init_state(5)
    for t in range(4):
        ref, state0 = lm.step(text[t], state0)
        out0, state1 = cal0.step(text[t], state1)
        outm, state2 = calm.step(text[t], state2)
        assert torch.equal(out0, ref)
        torch.testing.assert_close(outm.exp(), (1 - eps) * ref.exp() + eps / V)
    assert score(cal0, text) == score(lm, text)


def test_calibrated_rows_are_normalised_and_reweighted(lm, text):
    alpha = -0.6
    cal = calibrated(lm, alpha)
    state = cal.init_state(5)
    for t in range(4):
        out, state = cal.step(text[t], state)  # [5, V]
    logp, base = advanced(lm, text[:4])
    h = lookahead_entropies(lm, base, logp)  # [5, V]
    torch.testing.assert_close(out, (logp + alpha * h).log_softmax(-1))
    torch.testing.assert_close(out.logsumexp(-1), torch.zeros(5))


def test_topk_calibrated_rows_share_the_tail_tilt_and_estimate_z_without_bias():
    """The calibrated StepLM's top-k rows: the top k at their own tilt, the rest at one shared tilt, and the row's
    normaliser an unbiased estimate of the exact Z(a) over the draws (seeds)."""
    lm = MarkovOracle.from_chain(make_markov_chain(vocab_size=16, order=1, support=4, smoothing=0.3, seed=0))
    k, m, alpha, R = 3, 4, -1.0, 200
    prefix = torch.tensor([[3, 7, 1, 12, 5, 0]])  # [T, B]: 6 rows after one token each
    logp, base = advanced(lm, prefix)
    h = lookahead_entropies(lm, base, logp)  # [6, V]
    z_exact = (logp + alpha * h).exp().sum(-1)  # [6]
    top = logp.topk(k, -1).indices
    z = []
    for seed in range(R):
        cal = calibrated(lm, alpha, topk=k, tail_samples=m, seed=seed)
        out, _ = cal.step(prefix[0], cal.init_state(6))  # [6, V]
        torch.testing.assert_close(out.logsumexp(-1), torch.zeros(6, dtype=out.dtype))
        shift = out - logp  # [6, V]: a H_next - log Z^ on the top k; log mean_j e^{a H(w_j)} - log Z^ on the rest
        rest = torch.ones_like(shift, dtype=torch.bool).scatter_(1, top, False)
        for b in range(6):  # every word of the rest at one shared tilt
            assert shift[b][rest[b]].max() - shift[b][rest[b]].min() < 1e-12
        log_z = alpha * h.gather(1, top) - shift.gather(1, top)  # [6, k]: log Z^, the same from every top word
        assert (log_z - log_z[:, :1]).abs().max() < 1e-12
        z.append(log_z[:, 0].exp())  # [6]
    z = torch.stack(z)  # [R, 6]
    se = z.std(0) / math.sqrt(R)
    assert (se > 0).all()  # the draws do vary
    assert ((z.mean(0) - z_exact).abs() < 4 * se).all()


@pytest.mark.parametrize("epsilon", [0.0, 0.15])
def test_fit_statistics_match_direct_scoring(lm, text, epsilon):
    fit = fit_lookahead_calibration(lm, text, epsilon=epsilon)
    assert fit.n_tokens == (text.size(0) - 1) * text.size(1)
    for alpha in (-0.8, 0.0, 0.5, fit.alpha):
        direct, n = score(calibrated(lm, alpha, epsilon=epsilon, chunk=17), text)
        assert n == fit.n_tokens
        assert fit.ce_at(alpha) == pytest.approx(direct, abs=2e-6)
    assert fit.ce_before == pytest.approx(fit.ce_at(0.0), abs=1e-12)
    assert fit.ce_after <= fit.ce_before
    assert 0 < fit.alpha_stderr < math.inf


@pytest.mark.parametrize("epsilon", [0.0, 0.05])
def test_topk_fit_before_is_the_exact_ce(lm, text, epsilon):
    """In top-k mode Z^(0) = 1, so CE(0) is the base model's exact cross-entropy; the calibrated StepLM scores."""
    fit = fit_lookahead_calibration(lm, text, make_rule(topk=5, tail_samples=4), epsilon=epsilon)
    assert fit.n_tokens == (text.size(0) - 1) * text.size(1)
    assert fit.ce_before == pytest.approx(score(calibrated(lm, 0.0, epsilon=epsilon), text)[0], abs=2e-6)
    ce, n = score(calibrated(lm, fit.alpha, topk=5, epsilon=epsilon, tail_samples=4), text)
    assert n == fit.n_tokens and math.isfinite(ce)
    assert fit.ce_after <= fit.ce_before and 0 < fit.alpha_stderr < math.inf


def _z_terms(fit, alpha):
    """Per position: the (estimated) Z(a) and Z'(a) = sum_w P(w) H(w) e^{a H(w)} of a fit's atoms, [n] each."""
    w = (fit.logw.double() + alpha * fit.h.double()).exp()  # [n, K]
    return w.sum(1), (w * fit.h.double()).sum(1)


def test_topk_tail_is_unbiased_against_exact_mode():
    """Averaged over the seeds of the draws, the top-k law's normaliser Z(a) and Z'(a) are exact mode's (unbiased at
    every a). (Its CE is another law's: a true word in the rest shares the tail's tilt.)"""
    chain = make_markov_chain(vocab_size=16, order=1, support=4, smoothing=0.3, seed=0)
    lm = MarkovOracle.from_chain(chain)  # H_next varies between words: the rows' entropies
    text = markov_text(chain, 30 * 8, seed=3, streams=8)[0]  # [30, 8]
    exact = fit_lookahead_calibration(lm, text)
    alphas, R = (-1.0, -0.3, 0.0, 0.3, 1.0), 100
    est = torch.tensor([[[t.mean().item() for t in _z_terms(fit, a)] for a in alphas]
                        for fit in (fit_lookahead_calibration(lm, text, make_rule(topk=3, tail_samples=4), seed=s)
                                    for s in range(R))], dtype=torch.float64)  # [R, alphas, (Z, Z')]
    mean, se = est.mean(0), est.std(0) / math.sqrt(R)
    for i, a in enumerate(alphas):
        truth = [t.mean().item() for t in _z_terms(exact, a)]
        for j, what in enumerate(("Z", "Z'")):
            if what == "Z" and a == 0.0:  # Z^(0) = 1 exactly, whatever the draws
                assert se[i, j] < 1e-9 and abs(mean[i, j] - truth[j]) < 1e-6
                continue
            assert se[i, j] > 0, (what, a)  # the draws do vary, so the test can fail
            assert abs(mean[i, j] - truth[j]) < 4 * se[i, j], (what, a, mean[i, j], truth[j], se[i, j])


def test_min_context_skips_positions_and_draws_follow_the_history(lm, text):
    full = fit_lookahead_calibration(lm, text, make_rule(topk=3, tail_samples=2), seed=1)
    ctx = fit_lookahead_calibration(lm, text, make_rule(topk=3, tail_samples=2), seed=1, min_context=5)
    B = text.size(1)
    assert ctx.n_tokens == (text.size(0) - 5) * B and full.n_tokens == (text.size(0) - 1) * B
    for a, b in ((ctx.logw, full.logw), (ctx.h, full.h), (ctx.logq_y, full.logq_y), (ctx.slot, full.slot)):
        assert torch.equal(a, b[4 * B:])  # positions t >= 5, and the same draws: they depend on the history only
    assert fit_lookahead_calibration(lm, text, min_context=1).n_tokens == full.n_tokens
    with pytest.raises(LmcalError, match="min_context=14"):
        fit_lookahead_calibration(lm, text, min_context=14)


def test_fit_is_deterministic_for_a_seed(lm, text):
    rule = make_rule(topk=3, tail_samples=4)
    a = fit_lookahead_calibration(lm, text, rule, seed=7)
    b = fit_lookahead_calibration(lm, text, rule, seed=7, chunk=5)  # other batching of candidates
    c = fit_lookahead_calibration(lm, text, rule, seed=8)
    assert torch.equal(a.logw, b.logw) and a.alpha == pytest.approx(b.alpha, abs=1e-5)
    torch.testing.assert_close(a.h, b.h)
    assert not torch.equal(a.h[:, :4], c.h[:, :4])  # other draws (the 4 tail atoms come first)
    assert torch.equal(a.h[:, 4:], c.h[:, 4:])  # the top k do not depend on the seed


def test_bad_tail_settings_are_one_paragraph_errors(lm, text):
    with pytest.raises(LmcalError, match="tail_samples=0"):
        fit_lookahead_calibration(lm, text, Rule(topk=3, tail_samples=0))  # a Rule built directly is checked too
    with pytest.raises(LmcalError, match="rule=3"):
        fit_lookahead_calibration(lm, text, 3)  # the candidate rule is a Rule, not a bare topk
    with pytest.raises(LmcalError, match="topk=0"):
        calibrated(lm, 0.1, topk=0)
    fit_lookahead_calibration(lm, text, make_rule(tail_samples=0))  # exact mode draws nothing


def test_block_stderr_clusters_consecutive_positions_of_each_stream():
    g = torch.tensor([1.0, 2.0, 1.0, -2.0, -1.0, 3.0, -1.0, -3.0], dtype=torch.float64)  # t-major, 2 streams
    # stream 0: 1, 1, -1, -1; stream 1: 2, -2, 3, -3
    assert stream_block_stderr(g, 0.5, 2, 1) == pytest.approx(sandwich_stderr(g, 0.5))  # positions independent
    assert stream_block_stderr(g, 0.5, 2, 2) == pytest.approx(math.sqrt(2**2 + 2**2 + 0 + 0) / (8 * 0.5))
    assert stream_block_stderr(g, 0.5, 2, 3) == pytest.approx(math.sqrt(1 + 1 + 3**2 + 3**2) / (8 * 0.5))
    assert stream_block_stderr(g, 0.0, 2, 3) == math.inf


def test_paired_tail_difference_of_a_model_with_itself_is_zero(lm, text):
    prefixes = text.T[:, :4]  # [5, 4]
    base = generation_entropy_curve(lm, prefixes, horizon=10, samples_per_prefix=3, seed=2)
    same = generation_entropy_curve(calibrated(lm, 0.0), prefixes, horizon=10, samples_per_prefix=3, seed=2)
    assert paired_tail_difference(same, base) == (0.0, 0.0)
    cal = generation_entropy_curve(calibrated(lm, -2.0, topk=3, tail_samples=2), prefixes, horizon=10,
                                   samples_per_prefix=3, seed=2)
    diff, se = paired_tail_difference(cal, base)
    assert diff == pytest.approx(cal.tail_mean - base.tail_mean) and 0 < se < math.inf


@pytest.mark.parametrize("rule", [dict(), dict(topk=6, tail_samples=3), dict(cover=0.6, tail_samples=2)])
def test_derivatives_and_moment_matching(lm, text, rule):
    """CE' and CE'' of the law's objective are the derivatives of its CE (finite differences), CE'(a*) = 0 at a
    minimum, and the moments match there; exact mode is convex (CE'' > 0)."""
    fit = fit_lookahead_calibration(lm, text, make_rule(**rule))
    d = 1e-4
    for alpha in (-1.0, -0.2, 0.3):
        _, d1, d2 = fit.ce_derivatives(alpha)
        assert d1 == pytest.approx((fit.ce_at(alpha + d) - fit.ce_at(alpha - d)) / (2 * d), abs=1e-8)
        fd2 = (fit.ce_derivatives(alpha + d)[1] - fit.ce_derivatives(alpha - d)[1]) / (2 * d)
        assert d2 == pytest.approx(fd2, abs=1e-8) and (d2 > 0 or rule)
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
    stats = fit.logw, fit.h, fit.logq_y, fit.h.gather(1, fit.slot[:, None])[:, 0]
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


def test_calibration_stage_before_is_the_mixture_and_tails_are_paired(lm, tmp_path):
    """With uniform_weight > 0 the "before" curve and cross-entropy are both the eps-mixture's; the tail keys are the
    paired difference of the two models' generations."""
    from lmcal.stages import run_stage, target
    from lmcal.stages.configs import CalibrationConfig

    valid = torch.randint(0, V, (300,), generator=torch.Generator().manual_seed(3))
    test = torch.randint(0, V, (60,), generator=torch.Generator().manual_seed(4))
    eps, kw = 0.3, dict(num_prefixes=4, samples_per_prefix=2, prefix_len=5, horizon=10, seed=1)
    r = run_stage("calibration", target(lm, valid=valid, test=test),
                  CalibrationConfig(fit_tokens=120, fit_streams=3, min_context=10, topk=3, tail_samples=2,
                                    score_streams=2, uniform_weight=eps, approximation=None, dose_response=None, **kw),
                  tmp_path)
    assert r["fit_tokens"] == (40 - 10) * 3 and r["min_context"] == 10 and r["tail_samples"] == 2
    mixed = calibrated(lm, 0.0, epsilon=eps)
    prefixes = random_prefixes(valid, 4, 5, seed=1)
    curve = generation_entropy_curve(mixed, prefixes, 10, 2, seed=1)
    assert r["curve_nats_before"] == curve.mean.tolist()
    assert r["curve_nats_before"] != generation_entropy_curve(lm, prefixes, 10, 2, seed=1).mean.tolist()
    assert r["test_ce_before_nats"] == pytest.approx(score(mixed, batchify(test, 2))[0], abs=1e-12)
    after = generation_entropy_curve(calibrated(lm, r["alpha"], topk=3, epsilon=eps, tail_samples=2, seed=1),
                                     prefixes, 10, 2, seed=1)
    assert r["curve_nats"] == after.mean.tolist()  # the calibrated model is a pure function of the seed
    assert (r["tail_diff_nats"], r["tail_diff_stderr_nats"]) == paired_tail_difference(after, curve)
    assert r["tail_ppl_after"] == pytest.approx(math.exp(after.tail_mean))
    assert (tmp_path / "calibration.png").stat().st_size > 1000
    # issue 33: the absolute tail levels with standard errors clustered by prefix, and the top-k coverage
    assert (r["tail_nats"], r["tail_stderr_nats"]) == tuple(float(x) for x in clustered_mean(after.tail))
    assert r["tail_nats_before"] == pytest.approx(math.log(r["tail_ppl_before"]), abs=1e-12)
    assert 0 < r["mass_outside_topk"] < 1 and r["coverage_positions"] == 29 * 2 and r["epsilon"] == eps
    # the first generation of each of the first 3 prefixes, kept as token ids for REPORT.md to show as words
    assert [len(x["before"]) for x in r["samples"]] == [9, 9, 9] and r["samples"][1]["prefix"] == prefixes[1].tolist()
    assert [x["tail_nats"] for x in r["samples"]] == after.tail[:3, 0].tolist()
    assert [x["tail_nats_before"] for x in r["samples"]] == curve.tail[:3, 0].tolist()


def test_topk_coverage_is_the_calibrated_models_own_mass_and_a_count_of_true_words(lm, text):
    """The mass the top-k calibrated model gives outside its top k, step by step as CalibratedLM.step gives it, and
    the fraction of true next words outside the top k of the (mixed) base model; exact mode: 0 and 0."""
    cal = calibrated(lm, -0.3, topk=3, epsilon=0.1, tail_samples=2, seed=5)
    cov = topk_coverage(cal, text)
    state, base = cal.init_state(text.size(1)), lm.init_state(text.size(1))
    mass, outside = [], []
    for t in range(text.size(0) - 1):
        logc, state = cal.step(text[t], state)  # [B, V]
        logp, base = lm.step(text[t], base)
        top = mix_uniform(logp, 0.1).topk(3, dim=-1).indices  # [B, 3]
        mass.append(1 - logc.gather(1, top).exp().sum(-1).double())
        outside.append(~(top == text[t + 1][:, None]).any(-1))
    assert cov["positions"] == 13 * 5
    assert cov["mass_outside_topk"] == pytest.approx(torch.cat(mass).mean().item(), abs=1e-6)
    assert cov["true_word_outside_topk"] == torch.cat(outside).double().mean().item()
    assert 0 < cov["mass_outside_topk"] < 1
    exact = topk_coverage(calibrated(lm, -0.3), text)
    assert (exact["mass_outside_topk"], exact["true_word_outside_topk"]) == (0.0, 0.0)


def test_an_alpha_at_the_search_bound_is_labelled_so_not_a_minimum():
    from lmcal.core.calibration import CalibrationFit

    z = torch.zeros(1, 1)
    fit = CalibrationFit(100.0, 1.0, 0.5, 1, 0.1, None, 0.0, z, z, z[:, 0], z[:, 0].long(), bound=100.0)
    assert fit.at_bound and not CalibrationFit(3.0, 1.0, 0.5, 1, 0.1, None, 0.0, z, z, z[:, 0], z[:, 0].long()).at_bound
