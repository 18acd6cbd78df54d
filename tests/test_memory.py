"""The calibration bound on I_tau (lmcal.core.memory): the exact objective, its fit, chunked input, and exact Markov
oracles where the true conditional mutual information is known."""

import math

import numpy as np
import pytest
import torch

from lmcal.core.expfit import calibration_objective
from lmcal.core.memory import calibrate_to_limited, memory_upper_bound
from lmcal.data.markov import (
    make_markov_chain,
    markov_conditional,
    markov_conditional_entropy,
    markov_stationary,
    sample_markov,
)

N, V = 300, 9


def rows(seed=0, n=N, v=V):
    """Random full rows, limited rows correlated with them, and targets drawn from the full model (float64)."""
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(n, v, generator=g, dtype=torch.float64) * 2).log_softmax(-1)  # [n, v]
    limited = (0.5 * full + torch.randn(n, v, generator=g, dtype=torch.float64)).log_softmax(-1)  # [n, v]
    y = torch.multinomial(full.exp(), 1, generator=g)[:, 0]  # [n]
    return full, limited, y


def entropy(lp):
    return -(lp.exp() * lp).sum(-1)


def direct_ce(full, limited, y, alpha):
    return -calibrate_to_limited(full, limited, alpha).gather(1, y[:, None]).mean().item()


def test_uniform_limited_gives_alpha_zero():
    full, _, y = rows()
    uniform = torch.full_like(full, -math.log(V))
    ce, d1, d2 = calibration_objective(full, uniform, y, 0.7)
    assert d1 == 0.0 and d2 == 0.0  # every alpha gives the same model
    assert ce == pytest.approx(-full.gather(1, y[:, None]).mean().item(), abs=1e-12)
    r = memory_upper_bound(full, uniform, y)
    assert r.alpha == 0.0 and r.fitted and r.alpha_stderr == math.inf
    assert r.ce_limited == pytest.approx(math.log(V), abs=1e-12)
    assert r.mi_upper_bound == pytest.approx(math.log(V) - entropy(full).mean().item(), abs=1e-12)
    assert r.ce_calibrated == pytest.approx(r.ce_full, abs=1e-12)


def test_objective_matches_direct_computation_and_finite_differences():
    full, limited, y = rows(1)
    h = 1e-5
    for alpha in (-0.8, 0.0, 0.3, 1.7):
        ce, d1, d2 = calibration_objective(full, limited, y, alpha)
        assert ce == pytest.approx(direct_ce(full, limited, y, alpha), abs=1e-12)
        fd1 = (calibration_objective(full, limited, y, alpha + h)[0]
               - calibration_objective(full, limited, y, alpha - h)[0]) / (2 * h)
        fd2 = (calibration_objective(full, limited, y, alpha + h)[1]
               - calibration_objective(full, limited, y, alpha - h)[1]) / (2 * h)
        assert d1 == pytest.approx(fd1, rel=1e-6, abs=1e-8)
        assert d2 == pytest.approx(fd2, rel=1e-6, abs=1e-8)
        assert d2 > 0


def test_calibrate_to_limited():
    full, limited, _ = rows(2)
    assert torch.allclose(calibrate_to_limited(full, limited, 0.0), full, atol=1e-14)
    lp = calibrate_to_limited(full, limited, 0.4)
    assert torch.allclose(lp.logsumexp(-1), torch.zeros(N, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(lp, (full + 0.4 * limited).log_softmax(-1), atol=1e-12)
    assert calibrate_to_limited(full.float(), limited.float(), 0.4).dtype == torch.float32


def test_fit_is_the_minimum_and_matches_moments():
    full, limited, y = rows(3)
    r = memory_upper_bound(full, limited, y)
    assert r.fitted and r.n_tokens == N
    ce, d1, d2 = calibration_objective(full, limited, y, r.alpha)
    assert abs(d1) < 1e-10 and d2 > 0
    assert r.ce_calibrated == pytest.approx(ce, abs=1e-12)
    assert r.ce_calibrated <= min(r.ce_full, direct_ce(full, limited, y, r.alpha + 1e-3),
                                  direct_ce(full, limited, y, r.alpha - 1e-3))
    # moment matching: the mean of log P~ under P^_a* equals its mean at the true next words
    lp = calibrate_to_limited(full, limited, r.alpha)
    model_mean = (lp.exp() * limited).sum(-1).mean().item()
    data_mean = limited.gather(1, y[:, None]).mean().item()
    assert model_mean == pytest.approx(data_mean, rel=1e-6)
    # the reported pieces
    assert r.ce_limited == pytest.approx(-data_mean, abs=1e-12)
    assert r.entropy_calibrated == pytest.approx(entropy(lp).mean().item(), abs=1e-12)
    assert r.mi_upper_bound == pytest.approx(r.ce_limited - r.entropy_calibrated, abs=1e-15)
    per_row = -limited.gather(1, y[:, None])[:, 0] - entropy(lp)
    # a given alpha is held fixed: the batch-means standard error (the fitted one refits a per block, below)
    fixed = memory_upper_bound(full, limited, y, alpha=r.alpha)
    assert fixed.mi_upper_bound == pytest.approx(r.mi_upper_bound, abs=1e-15)
    assert fixed.mi_stderr == pytest.approx(per_row.std().item() / math.sqrt(N), rel=1e-9)
    g = (lp.exp() * limited).sum(-1) - limited.gather(1, y[:, None])[:, 0]  # per-row CE'(a*)
    assert r.alpha_stderr == pytest.approx(g.pow(2).mean().sqrt().item() / (d2 * math.sqrt(N)), rel=1e-9)


def test_given_alpha_only_evaluates():
    full, limited, y = rows(4)
    r = memory_upper_bound(full, limited, y, alpha=0.25)
    assert r.alpha == 0.25 and not r.fitted and math.isnan(r.alpha_stderr)
    assert r.ce_calibrated == pytest.approx(calibration_objective(full, limited, y, 0.25)[0], abs=1e-12)


@pytest.mark.parametrize("alpha", [None, 0.3])
def test_chunks_match_whole_tensors(alpha):
    full, limited, y = rows(5)
    whole = memory_upper_bound(full, limited, y, alpha=alpha, cluster_size=7)
    bounds = [0, 17, 18, 120, N]

    def chunks():  # a generator: consumed once
        for i, j in zip(bounds[:-1], bounds[1:], strict=True):
            yield full[i:j], limited[i:j], y[i:j]

    for source in (chunks(), list(chunks())):
        r = memory_upper_bound(source, alpha=alpha, cluster_size=7)
        for k, v in vars(whole).items():
            assert getattr(r, k) == pytest.approx(v, rel=1e-9, abs=1e-12, nan_ok=True), k
    r32 = memory_upper_bound([(f.float(), q.float(), t) for f, q, t in chunks()], alpha=alpha, cluster_size=7)
    assert r32.mi_upper_bound == pytest.approx(whole.mi_upper_bound, abs=1e-5)
    with pytest.raises(TypeError):
        memory_upper_bound(chunks(), limited)


def test_cluster_size_batch_means():
    full, limited, y = rows(6)
    r1 = memory_upper_bound(full, limited, y)
    assert memory_upper_bound(full, limited, y, cluster_size=1) == r1
    r = memory_upper_bound(full, limited, y, cluster_size=30)  # 10 equal blocks
    assert (r.alpha, r.mi_upper_bound) == (r1.alpha, r1.mi_upper_bound)  # only the standard errors change
    assert r.n_blocks == 10 and r1.n_blocks == N
    r = memory_upper_bound(full, limited, y, alpha=r.alpha, cluster_size=30)  # alpha held fixed: batch means
    lp = calibrate_to_limited(full, limited, r.alpha)
    per_row = -limited.gather(1, y[:, None])[:, 0] - entropy(lp)
    block_means = per_row.view(10, 30).mean(1)
    assert r.mi_stderr == pytest.approx(block_means.std().item() / math.sqrt(10), rel=1e-9)
    delta = (limited - full).gather(1, y[:, None])[:, 0].neg().view(10, 30).mean(1)  # CE(P~) - CE(P^) per block
    assert r.delta_ce == pytest.approx(delta.mean().item(), abs=1e-12)
    assert r.delta_ce_stderr == pytest.approx(delta.std().item() / math.sqrt(10), rel=1e-9)


def test_zero_probabilities():
    full, limited, y = rows(7)
    full = full.clone()
    limited = limited.clone()
    hole = torch.zeros_like(full, dtype=torch.bool)
    hole[:, :3] = True
    hole[torch.arange(N), y] = False  # P~ = 0 on some words, never on the true next word
    limited[hole] = -math.inf
    limited = limited.log_softmax(-1)
    full[torch.arange(N), (y + 1) % V] = -math.inf  # P^ = 0 on a word that is not the next word
    full = full.log_softmax(-1)
    r = memory_upper_bound(full, limited, y)
    assert r.alpha > 0  # a < 0 is undefined here, and P~'s zeros are informative
    assert all(math.isfinite(v) for v in vars(r).values() if isinstance(v, float))
    lp = calibrate_to_limited(full, limited, r.alpha)
    assert not lp.isnan().any() and (lp[hole | full.isneginf()] == -math.inf).all()
    assert torch.allclose(lp.logsumexp(-1), torch.zeros(N, dtype=torch.float64), atol=1e-12)
    assert r.ce_calibrated == pytest.approx(-lp.gather(1, y[:, None]).mean().item(), abs=1e-12)
    for alpha in (-0.5, 1.0):  # P^'s zeros alone do not stop a < 0
        assert math.isfinite(memory_upper_bound(full, torch.log(limited.exp() + 0.1).log_softmax(-1), y, alpha=alpha)
                             .mi_upper_bound)
    with pytest.raises(ValueError, match="undefined"):
        memory_upper_bound(full, limited, y, alpha=-0.1)
    # P~ = 0 at a true next word: CE(P || P~) = inf, every a > 0 too; the fit stays at 0 without failing
    limited[0] = -math.inf
    limited[0, (y[0] + 2) % V] = 0.0
    r = memory_upper_bound(full, limited, y)
    assert r.alpha == 0.0 and r.ce_limited == math.inf and r.mi_upper_bound == math.inf


# ---------------------------------------------------------------------------------------------------------------------
# Exact oracles on an order-2 Markov source
# ---------------------------------------------------------------------------------------------------------------------

MV, ORDER, TAU_MAX = 8, 2, 3


@pytest.fixture(scope="module")
def markov():
    chain = make_markov_chain(vocab_size=MV, order=ORDER, support=3, smoothing=0.02, seed=0)
    pi = markov_stationary(chain.probs, MV, ORDER)
    # exact log P(w | last m tokens), m = 0..TAU_MAX: [MV**m, MV] each
    tables = [torch.from_numpy(np.log(markov_conditional(chain.probs, MV, ORDER, m, pi))) for m in range(TAU_MAX + 1)]

    def stream(seed, n=100_000):
        """Rows at positions t = TAU_MAX..n-1 of a stationary sample: {m: log P(. | last m tokens) [n', MV]}, y."""
        w = sample_markov(chain.probs, MV, ORDER, n, seed, pi)  # [n]
        t = np.arange(TAU_MAX, n)
        ctx = {m: sum(w[t - m + j] * MV ** (m - 1 - j) for j in range(m)) for m in range(1, TAU_MAX + 1)}  # [n']
        return {m: tables[m][torch.from_numpy(ctx[m])] for m in ctx}, torch.from_numpy(w[t])

    h = [markov_conditional_entropy(chain.probs, MV, ORDER, m, pi) for m in range(TAU_MAX + 1)]
    return stream(1), stream(2), h


@pytest.mark.parametrize("tau", [1, 2, 3])
def test_markov_exact_oracles(markov, tau):
    (valid, y_valid), (test, y_test), h = markov
    mi = h[tau] - h[ORDER]  # the true I_tau of the exact model: H(W_t | last tau) - H(W_t | last k)
    # rows along one chain are dependent: batch means over blocks of 100 positions for the standard errors
    fit = memory_upper_bound(valid[ORDER], valid[tau], y_valid, cluster_size=100)
    assert abs(fit.alpha) < 3 * fit.alpha_stderr  # P^ is the truth: nothing to calibrate
    # the pipeline: fit a on validation rows, evaluate the bound on test rows with it
    r = memory_upper_bound(test[ORDER], test[tau], y_test, alpha=fit.alpha, cluster_size=100)
    for b in (fit, r):
        if tau >= ORDER:  # P~ = P^: the distant past carries nothing
            assert mi == 0.0 and abs(b.mi_upper_bound) < 3 * b.mi_stderr
        else:
            assert b.mi_upper_bound > 10 * b.mi_stderr
            assert abs(b.mi_upper_bound - mi) < 3 * b.mi_stderr  # tight: P~ is the exact order-tau conditional


def test_full_context_rows_align_with_limited_rows_and_score_like_evaluate_ce():
    from lmcal.core.context import zip_rows
    from lmcal.models.awd_lstm import AWDLSTM, evaluate_ce, full_context_log_probs, limited_context_log_probs

    torch.manual_seed(0)
    net = AWDLSTM(vocab_size=30, emb_size=8, hidden_size=12, num_layers=2).eval()
    tokens = torch.randint(0, 30, (157,))
    rows = list(zip_rows(full_context_log_probs(net, tokens, bptt=20),
                         limited_context_log_probs(net, tokens, tau=3, windows_per_batch=16)))
    full = torch.cat([r[0] for r in rows])
    y = torch.cat([r[2] for r in rows])
    assert torch.equal(y, tokens[1:])
    ce = -full.gather(1, y[:, None]).mean().item()
    assert ce == pytest.approx(evaluate_ce(net, tokens, batch_size=1, bptt=20)[0], rel=1e-5)
    # tau larger than the text: the limited model is the full one
    lim = torch.cat([r[1] for r in zip_rows(full_context_log_probs(net, tokens[:10]),
                                            limited_context_log_probs(net, tokens[:10], tau=50))])
    torch.testing.assert_close(lim, full[:9], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="aligned"):
        list(zip_rows(full_context_log_probs(net, tokens), full_context_log_probs(net, tokens.flip(0))))


def test_markov_oracle_estimates_match_the_exact_answers():
    """The pipeline's Markov check (`markov_oracle_memory`): entropy rate and I_tau from the exact oracles agree with
    the closed forms within 3 standard errors, on the default corpus (order 2)."""
    from lmcal.core.memory_summary import markov_oracle_memory
    from lmcal.data.markov import markov_corpus

    corpus = markov_corpus(n_train=1000, n_valid=50_000, n_test=50_000)
    r = markov_oracle_memory(corpus.info, corpus.split("valid"), corpus.split("test"), [1, 2, 3])
    h = corpus.info["entropy_rate_nats"]
    assert abs(r["estimated_entropy_rate_nats"] - h) < 3 * r["estimated_entropy_rate_stderr_nats"]
    assert [m["tau"] for m in r["memory"]] == [1, 2, 3]
    for m in r["memory"]:
        assert abs(m["mi_upper_bound_nats"] - m["exact_mi_nats"]) <= 3 * m["mi_stderr_nats"] + 1e-9
    assert r["memory"][0]["exact_mi_nats"] > 1.0 and r["memory"][1]["exact_mi_nats"] == 0.0


# ---------------------------------------------------------------------------------------------------------------------
# context_rows: any StepLM, whole past or tau-token windows
# ---------------------------------------------------------------------------------------------------------------------


def _cat(chunks):
    chunks = list(chunks)
    return torch.cat([c[0] for c in chunks]), torch.cat([c[1] for c in chunks]), [c[1].numel() for c in chunks]


@pytest.mark.parametrize("tau", [None, 1, 2, 3, 5])
def test_context_rows_on_the_markov_oracle_are_the_exact_conditionals(tau):
    """Windows fed from init_state: for tau >= order the chain's own rows, for tau < order the stationary chain's
    order-tau rows; tau=None: the whole past (the first order-1 positions have shorter contexts)."""
    from lmcal.core.context import context_rows
    from lmcal.models.oracles import MarkovOracle

    chain = make_markov_chain(vocab_size=MV, order=ORDER, support=3, smoothing=0.02, seed=0)
    pi = markov_stationary(chain.probs, MV, ORDER)
    w = torch.from_numpy(sample_markov(chain.probs, MV, ORDER, 1000, 5, pi))  # [N]
    lp, y, sizes = _cat(context_rows(MarkovOracle.from_chain(chain), w, tau, batch_size=64))
    assert torch.equal(y, w[1:]) and sizes == [64] * 15 + [999 - 15 * 64]  # aligned chunks of batch_size rows
    for t in range(1, w.numel()):
        m = min(t, ORDER if tau is None else tau)  # context length the prediction of w[t] is made from
        m_eff = min(m, ORDER)  # older tokens than the order do not matter
        ctx = sum(int(w[t - m_eff + j]) * MV ** (m_eff - 1 - j) for j in range(m_eff))
        exact = np.log(markov_conditional(chain.probs, MV, ORDER, m_eff, pi)[ctx])
        np.testing.assert_allclose(lp[t - 1].numpy(), exact, rtol=0, atol=1e-12)


class _Generic:
    """A StepLM wrapper that hides the LSTM's type, so context_rows takes its generic step-by-step path."""

    def __init__(self, lm):
        self.lm, self.vocab_size = lm, lm.vocab_size

    def init_state(self, b):
        return self.lm.init_state(b)

    def step(self, tokens, state):
        return self.lm.step(tokens, state)

    def select(self, state, index):
        return self.lm.select(state, index)


def test_context_rows_generic_path_matches_the_fused_lstm_paths():
    from lmcal.core.context import context_rows
    from lmcal.models.awd_lstm import AWDLSTM, full_context_log_probs, limited_context_log_probs
    from lmcal.models.step_lm import LSTMStepLM

    torch.manual_seed(0)
    net = AWDLSTM(vocab_size=30, emb_size=8, hidden_size=12, num_layers=2).eval()
    tokens = torch.randint(0, 30, (90,))
    for tau in (None, 1, 4, 200):
        fast, y, sizes = _cat(context_rows(LSTMStepLM(net), tokens, tau, batch_size=16))
        slow, y2, sizes2 = _cat(context_rows(_Generic(LSTMStepLM(net)), tokens, tau, batch_size=16))
        ref = torch.cat([r[0] for r in (full_context_log_probs(net, tokens) if tau is None
                                        else limited_context_log_probs(net, tokens, tau, 7))])
        assert torch.equal(y, tokens[1:]) and torch.equal(y2, y) and sizes == sizes2
        torch.testing.assert_close(fast, ref.float(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(slow, ref.float(), rtol=1e-5, atol=1e-5)


def test_context_rows_on_a_hugging_face_model():
    transformers = pytest.importorskip("transformers")
    from lmcal.core.context import context_rows
    from lmcal.models.hf import HFCausalLM

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=40, n_positions=64, bos_token_id=0,
                                  eos_token_id=0, initializer_range=0.3)
    lm = HFCausalLM(transformers.GPT2LMHeadModel(cfg))
    tokens = torch.randint(0, 40, (30,))
    full, y, _ = _cat(context_rows(lm, tokens, None, batch_size=8))
    win, _, _ = _cat(context_rows(lm, tokens, 4, batch_size=8))
    with torch.no_grad():
        ref = lm.model(tokens[None]).logits[0, :-1].float().log_softmax(-1)  # [29, V]: the whole past
        torch.testing.assert_close(full, ref, rtol=1e-4, atol=1e-4)
        for t in (1, 3, 4, 5, 17, 29):
            ctx = tokens[max(0, t - 4):t][None]
            torch.testing.assert_close(win[t - 1], lm.model(ctx).logits[0, -1].float().log_softmax(-1),
                                       rtol=1e-4, atol=1e-4)
    assert torch.equal(y, tokens[1:])


# ---------------------------------------------------------------------------------------------------------------------
# The bound with window P~ on the oracle, the two-parameter fit, the jackknife and the cross-fit
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def oracle_rows():
    """Rows of the oracle along a 40k-token stationary sample: {None: whole past, tau: tau-token windows}."""
    from lmcal.core.context import context_rows
    from lmcal.models.oracles import MarkovOracle

    chain = make_markov_chain(vocab_size=MV, order=ORDER, support=3, smoothing=0.02, seed=0)
    pi = markov_stationary(chain.probs, MV, ORDER)
    w = torch.from_numpy(sample_markov(chain.probs, MV, ORDER, 40_000, 11, pi))
    oracle = MarkovOracle.from_chain(chain)
    rows = {tau: torch.cat([c[0] for c in context_rows(oracle, w, tau, batch_size=4096)]) for tau in (None, 1, 2, 3)}
    h = [markov_conditional_entropy(chain.probs, MV, ORDER, m, pi) for m in range(ORDER + 1)]
    return rows, w[1:], h


@pytest.mark.parametrize("tau", [1, 2, 3])
def test_window_bound_on_the_oracle_covers_the_exact_mi(oracle_rows, tau):
    rows, y, h = oracle_rows
    exact = h[min(tau, ORDER)] - h[ORDER]  # I_tau of the exact model: 0 for tau >= order
    r = memory_upper_bound(rows[None], rows[tau], y, cluster_size=2000)
    assert r.n_blocks == 20 and r.mi_upper_bound >= -1e-12  # fitted on these rows: a mean KL divergence
    assert abs(r.mi_upper_bound - exact) < 3 * r.mi_stderr
    if tau < ORDER:
        assert r.mi_upper_bound > 10 * r.mi_stderr and abs(r.mi_upper_bound_crossfit - exact) < 3 * r.mi_stderr
        assert r.delta_ce == pytest.approx(exact, abs=3 * r.delta_ce_stderr)  # P^ is the truth: ΔCE estimates I_tau
    else:
        assert torch.equal(rows[tau], rows[None])  # windows of >= order tokens: the chain's own rows
        assert r.delta_ce == 0.0
    two = memory_upper_bound(rows[None], rows[tau], y, cluster_size=2000, temperature=True)
    assert abs(two.mi_upper_bound - exact) < 3 * two.mi_stderr and abs(two.beta - 1) < 3 * max(two.beta_stderr, 1e-9)


def _ce(full, limited, y, alpha, beta):
    return -calibrate_to_limited(full, limited, alpha, beta).gather(1, y[:, None]).mean().item()


def test_two_parameter_fit_gradient_is_zero_and_beta_pinned_is_the_one_parameter_fit():
    from lmcal.core.expfit import fit_alpha, fit_theta, row_terms, row_terms_k, with_targets, with_targets_k

    full, limited, y = rows(8)
    full = (0.7 * full).log_softmax(-1)  # a model too flat by a temperature: beta* clearly above 1
    r = memory_upper_bound(full, limited, y, temperature=True)
    assert r.fitted and r.beta > 1.1
    h = 1e-5  # central differences of the directly computed CE(beta, alpha)
    d_beta = (_ce(full, limited, y, r.alpha, r.beta + h) - _ce(full, limited, y, r.alpha, r.beta - h)) / (2 * h)
    d_alpha = (_ce(full, limited, y, r.alpha + h, r.beta) - _ce(full, limited, y, r.alpha - h, r.beta)) / (2 * h)
    assert abs(d_beta) < 1e-8 and abs(d_alpha) < 1e-8
    assert r.ce_calibrated == pytest.approx(_ce(full, limited, y, r.alpha, r.beta), abs=1e-12)
    one = memory_upper_bound(full, limited, y)
    assert r.ce_calibrated < one.ce_calibrated  # the extra parameter helps here
    lp = calibrate_to_limited(full, limited, r.alpha, r.beta)  # the moments of both statistics match
    for s in (full, limited):
        assert (lp.exp() * s).sum(-1).mean().item() == pytest.approx(s.gather(1, y[:, None]).mean().item(), rel=1e-8)
    assert r.mi_upper_bound == pytest.approx(r.ce_limited - r.entropy_calibrated, abs=1e-15)
    # beta pinned to 1: the k-statistic fit with log P~ alone is the one-parameter fit, term by term
    (alpha,) = fit_theta([with_targets_k(full, (limited,), y)], 1)
    assert alpha == pytest.approx(fit_alpha([with_targets(full, limited, y)]), abs=1e-10)
    assert alpha == pytest.approx(one.alpha, abs=1e-10) and one.beta == 1.0 and one.beta_stderr == 0.0
    _, ce, d1, d2, _ = row_terms(*with_targets(full, limited, y), alpha)
    _, ce_k, g, hess, _, _ = row_terms_k(with_targets_k(full, (full, limited), y), [0.0, alpha])
    torch.testing.assert_close(ce_k, ce, rtol=0, atol=1e-12)
    torch.testing.assert_close(g[:, 1], d1, rtol=0, atol=1e-12)
    torch.testing.assert_close(hess[:, 1, 1], d2, rtol=0, atol=1e-12)
    assert memory_upper_bound(full, limited, y, alpha=r.alpha, beta=r.beta, temperature=True).mi_upper_bound == \
        pytest.approx(r.mi_upper_bound, abs=1e-12)


@pytest.mark.parametrize("temperature", [False, True])
def test_one_step_jackknife_matches_the_exact_refit_jackknife(temperature):
    full, limited, y = rows(9, n=2000)
    one = memory_upper_bound(full, limited, y, cluster_size=100, temperature=temperature, crossfit=False)
    exact = memory_upper_bound(full, limited, y, cluster_size=100, temperature=temperature, crossfit=False,
                               jackknife="exact")
    assert one.mi_upper_bound == exact.mi_upper_bound and one.n_blocks == 20
    assert one.mi_stderr == pytest.approx(exact.mi_stderr, rel=0.005)
    # alpha held fixed, the standard error differs: refitting alpha is part of the sampling error
    fixed = memory_upper_bound(full, limited, y, alpha=one.alpha, beta=one.beta, temperature=temperature,
                               cluster_size=100)
    assert abs(fixed.mi_stderr - exact.mi_stderr) > 0.05 * exact.mi_stderr


def test_crossfit():
    full, limited, y = rows(10, n=600)
    r = memory_upper_bound(full, limited, y, cluster_size=100)  # 6 blocks: halves are rows [0, 300) and [300, 600)
    a, b = slice(0, 300), slice(300, 600)
    fa, fb = (memory_upper_bound(full[s], limited[s], y[s]) for s in (a, b))
    on_b = memory_upper_bound(full[b], limited[b], y[b], alpha=fa.alpha).mi_upper_bound
    on_a = memory_upper_bound(full[a], limited[a], y[a], alpha=fb.alpha).mi_upper_bound
    assert r.mi_upper_bound_crossfit == pytest.approx((on_a + on_b) / 2, abs=1e-12)
    # two identical halves: each half's fit is the whole fit, so the cross-fit is the in-sample bound
    twice = [torch.cat([x[a], x[a]]) for x in (full, limited, y)]
    r2 = memory_upper_bound(*twice, cluster_size=100)
    assert r2.mi_upper_bound_crossfit == pytest.approx(r2.mi_upper_bound, abs=1e-10)
    assert math.isnan(memory_upper_bound(full, limited, y, cluster_size=600).mi_upper_bound_crossfit)  # one block


@pytest.mark.parametrize("temperature", [False, True])
def test_crossfit_on_an_odd_number_of_blocks_scores_every_row_once(temperature):
    """5 blocks: the halves are blocks {0, 1} and {2, 3, 4}; brute force fits each half on its own and scores the
    other half's rows at that fit, every row exactly once. (Before the mend, block 4 was scored by neither half but
    still counted in n: 0.404 against 0.506 here.)"""
    full, limited, y = rows(10, n=500)
    r = memory_upper_bound(full, limited, y, cluster_size=100, temperature=temperature)
    a, b = slice(0, 200), slice(200, 500)
    fit = {s.start: memory_upper_bound(full[s], limited[s], y[s], temperature=temperature) for s in (a, b)}

    def score(s, f):  # the bound's summed per-row terms on rows s at the fit f
        given = dict(alpha=f.alpha, beta=f.beta, temperature=temperature)
        return memory_upper_bound(full[s], limited[s], y[s], **given).mi_upper_bound * (s.stop - s.start)

    brute = (score(a, fit[b.start]) + score(b, fit[a.start])) / 500
    assert r.mi_upper_bound_crossfit == pytest.approx(brute, abs=1e-12)
    if not temperature:
        assert r.mi_upper_bound_crossfit == pytest.approx(0.5064, abs=5e-5)  # the in-sample bound: 0.5080


def test_memory_stage_with_window_rows_on_any_step_lm(tmp_path):
    """The stage itself on the oracle StepLM (no network): limited=window gives the oracle's exact answers."""
    from lmcal.models.oracles import MarkovOracle
    from lmcal.stages import run_stage, target

    chain = make_markov_chain(vocab_size=MV, order=ORDER, support=3, smoothing=0.02, seed=0)
    pi = markov_stationary(chain.probs, MV, ORDER)
    w = torch.from_numpy(sample_markov(chain.probs, MV, ORDER, 20_000, 12, pi))
    h = [markov_conditional_entropy(chain.probs, MV, ORDER, m, pi) for m in range(ORDER + 1)]
    oracle = target(MarkovOracle.from_chain(chain), valid=w, test=w, corpus="markov", exact_mi=h[1] - h[2])
    r = run_stage("memory", oracle, {"limited": "window", "tau": 1}, tmp_path)
    assert r["limited"] == "window" and r["tau"] == 1 and r["test_tokens"] == 19_999 and r["blocks"] == 10
    assert abs(r["mi_upper_bound_nats"] - r["exact_mi_nats"]) < 3 * r["mi_stderr_nats"]
    assert set(r["two_parameter"]) >= {"alpha", "beta", "mi_upper_bound_nats", "mi_stderr_nats"}
    assert (tmp_path / "memory.json").is_file() and (tmp_path / "memory.png").is_file()  # the run's own figure
    from lmcal.errors import LmcalError

    with pytest.raises(LmcalError, match="analysis.memory.tau=TAU"):
        run_stage("memory", oracle, {"limited": "window"}, tmp_path)
    with pytest.raises(LmcalError, match="tau-limited model"):
        run_stage("memory", oracle, {}, tmp_path)
