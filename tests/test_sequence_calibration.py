"""Algorithm 1, sequence-level calibration P̂_α ∝ P̂^(1+α), against its exact solution on finite-state oracles
(lmcal.core.sequence_exact): the SMC sampler's paths and Ẑ (lmcal.core.smc), the fitted α* (lmcal.core.sequence_fit),
the soft-value heads (lmcal.core.soft_value), and the delayed drift that one-step lookahead cannot see."""

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from lmcal.core.calibration import fit_lookahead_calibration
from lmcal.core.entropy_rate import generation_entropy_curve
from lmcal.core.lookahead import lookahead_entropies
from lmcal.core.sequence_exact import (
    FiniteStateLM,
    all_states,
    calibrated_log_law,
    exact_alpha,
    exact_twist,
    finite_state_lm,
    generation,
    log_values,
    perron_limit,
    sequence_ce,
    stationary_prefixes,
    true_log_probs,
    true_text,
)
from lmcal.core.sequence_fit import RootSearch, fit_sequence_alpha, paired_alpha_gap, reference_check
from lmcal.core.smc import entropy_rate, reweighted, smc_generate, smc_tail_entropy
from lmcal.core.soft_value import (
    FeatureStateLM,
    SoftValueTraining,
    TwistAtAlpha,
    fit_soft_value,
    new_head,
    soft_value_lm,
    soft_value_rollouts,
    soft_value_twist,
    train_soft_value,
)
from lmcal.data.batching import batchify
from lmcal.data.markov import make_markov_chain, markov_entropy_rate, sample_markov
from lmcal.models.oracles import DelayedDriftOracle, DriftingOracle, MarkovOracle
from tests.test_memory import _Generic  # a StepLM without state_features (as a Hugging Face model's cache)

CHAIN = make_markov_chain(vocab_size=8, order=1, support=3, smoothing=0.05, seed=1)
TRUTH = MarkovOracle.from_chain(CHAIN)
H = markov_entropy_rate(CHAIN.probs, 8, 1)
HEADS = SoftValueTraining(iterations=10, steps=20, backup_steps=10, hidden=64, rank=16)  # the oracles' heads


def _tempered(power=0.7):
    """A model of the chain too flat (power < 1) to be calibrated: α* > 0."""
    probs = CHAIN.probs ** power
    return MarkovOracle(probs / probs.sum(1, keepdims=True), 8, 1)


def _delayed():
    return DelayedDriftOracle(CHAIN, trigger_rate=0.02, delay=3, noise_vocab=32)


def _text(model):
    return true_text(TRUTH, model, *stationary_prefixes(CHAIN))


def _windows(n, length, seed):
    """[n, length] consecutive windows of one stationary sample of the chain."""
    return torch.as_tensor(sample_markov(CHAIN.probs, 8, 1, n * length, seed)).view(n, length)


def _start(fs, first_words):
    """The law of the model's state after one-word prefixes (order 1: the state is the word, in phase 0)."""
    return torch.bincount(first_words, minlength=fs.num_states).double() / first_words.numel()


def test_exact_reference_against_brute_force_and_closed_forms():
    model, T, alpha = _tempered(), 3, 0.8
    fs = finite_state_lm(model)
    # brute force over all 8**3 continuations of each context
    paths = torch.tensor(list(itertools.product(range(8), repeat=T)))  # [512, T]
    for s in (0, 5):
        logp = torch.zeros(len(paths), dtype=torch.float64)
        state = torch.full((len(paths),), s)
        for t in range(T):
            logp += fs.log_law[state, paths[:, t]]
            state = fs.next_state[state, paths[:, t]]
        log_z = ((1 + alpha) * logp).logsumexp(0)
        assert log_values(fs, alpha, T)[T, s] == pytest.approx(log_z.item(), abs=1e-12)
        law = ((1 + alpha) * logp - log_z).exp()  # [512]: P̂_α of each path
        g = generation(fs, alpha, T, torch.nn.functional.one_hot(torch.tensor(s), 8).double())
        for t in range(T):
            marg = torch.zeros(8, dtype=torch.float64).index_add_(0, paths[:, t], law)
            assert torch.allclose(g.marginals[t], marg, atol=1e-12)
        assert g.moment == pytest.approx((law * logp).sum().item(), abs=1e-12)
        assert g.entropy.sum().item() == pytest.approx(-(law * law.log()).sum().item(), abs=1e-12)
    assert torch.allclose(calibrated_log_law(fs, alpha, T).logsumexp(-1), torch.zeros(T, 8, dtype=torch.float64))
    # the tables read off the delayed oracle give its own closed-form generation curve, and α = 0 is the model
    orc = _delayed()
    fd = finite_state_lm(orc)
    start = _text(orc).model_start
    g0 = generation(fd, 0.0, 50, start)
    assert np.allclose(g0.entropy.numpy(), orc.expected_generation_entropy(50), atol=1e-12)
    assert log_values(fd, 0.0, 50).abs().max() < 1e-12
    drift = DriftingOracle(CHAIN, T=30, noise_vocab=16)
    g0 = generation(finite_state_lm(drift), 0.0, 50, _text(drift).model_start)
    assert np.allclose(g0.entropy.numpy(), drift.expected_generation_entropy(50, H), atol=1e-12)
    # the truth itself is calibrated: α* = 0 (an order-2 chain: states are pairs of words)
    chain2 = make_markov_chain(vocab_size=4, order=2, support=2, smoothing=0.05, seed=2)
    truth2 = MarkovOracle.from_chain(chain2)
    text2 = true_text(truth2, truth2, *stationary_prefixes(chain2))
    assert exact_alpha(finite_state_lm(truth2), text2, 10) == pytest.approx(0, abs=1e-10)


def test_exact_alpha_makes_ce_equal_the_entropy_rate_and_the_perron_limit():
    model, T = _tempered(), 10
    fs, text = finite_state_lm(model), _text(model)
    a = exact_alpha(fs, text, T)
    ce = lambda x: sequence_ce(fs, text, x, T)  # noqa: E731
    ent = generation(fs, a, T, text.model_start).entropy_rate  # the sum of the conditionals' entropies, apart
    assert a > 0.2 and ce(a) == pytest.approx(ent, abs=1e-12)
    assert (ce(a + 1e-5) - ce(a - 1e-5)) / 2e-5 == pytest.approx(0, abs=1e-8)  # the minimum of a convex CE
    assert ce(a) < ce(0.0) - 0.05 and ce(0.0) == pytest.approx(-true_log_probs(fs, text, T).mean().item())
    # far from both ends of a long horizon the conditionals are P_∞, and log Z grows by log λ a word
    alpha, T = 0.5, 200
    pl = perron_limit(fs, alpha, text.model_start)
    assert (calibrated_log_law(fs, alpha, T)[T // 2] - pl.log_law).abs().max() < 1e-10
    b = log_values(fs, alpha, T)
    assert (b[T] - b[T - 1] - pl.log_lambda).abs().max() < 1e-10
    g = generation(fs, alpha, T, text.model_start)
    assert g.entropy[T // 2].item() == pytest.approx(pl.entropy_rate, abs=1e-10)
    assert g.base_logp[T // 2].item() == pytest.approx(pl.base_logp, abs=1e-10)


def test_smc_paths_follow_the_exact_calibrated_law_with_a_bias_of_order_one_over_particles():
    model, T, alpha, B = _tempered(), 10, 1.0, 2000
    fs = finite_state_lm(model)
    prefixes = _windows(B, 1, 0)
    g = generation(fs, alpha, T, _start(fs, prefixes[:, 0]))  # exact, given these prefixes
    r = smc_generate(model, prefixes, alpha, T, particles=128, seed=0)
    assert r.tokens.shape == (B, T) and r.ess.shape == (B, T) and r.resamplings.sum() > 0
    for got, want in ((r.base_logp, g.base_logp), (r.base_entropy, g.base_entropy)):
        z = (got.mean(0) - want) / (got.std(0) / math.sqrt(B))
        assert z.abs().max() < 4.5, z
    marg = torch.nn.functional.one_hot(r.tokens, 8).double().mean(0)  # [T, 8]
    z = (marg - g.marginals) / (g.marginals * (1 - g.marginals) / B).sqrt()
    assert z.abs().max() < 4.5, z
    # the returned path's expectation given the particles is their weighted mean (path_logp): its bias against the
    # exact moment falls as 1 / particles
    moment = torch.tensor([generation(fs, alpha, T, torch.eye(8, dtype=torch.float64)[s]).moment for s in range(8)])
    prefixes, bias = _windows(4000, 1, 1), {}
    for k in (4, 16):
        err = smc_generate(model, prefixes, alpha, T, particles=k, seed=1).path_logp - moment[prefixes[:, 0]]
        bias[k] = err.mean().item()
        assert abs(bias[k]) > 5 * err.std().item() / math.sqrt(len(err)), (k, bias[k])  # large enough to measure
    assert 2.0 < bias[4] / bias[16] < 8.0, bias
    # a function of the seed, however the prefixes are batched; alpha = 0 is plain sampling
    one = smc_generate(model, prefixes[:30], alpha, T, particles=16, seed=3, max_batch=40)
    two = smc_generate(model, prefixes[:30], alpha, T, particles=16, seed=3, max_batch=10_000)
    assert torch.equal(one.tokens, two.tokens) and torch.equal(one.log_z, two.log_z)
    plain = smc_generate(model, prefixes[:30], 0.0, T, particles=16)
    assert plain.log_z.abs().max() < 1e-12 and plain.resamplings.sum() == 0


def test_smc_tail_entropy_is_the_calibrated_laws_entropy_over_the_last_words():
    """H(A | h) = -(1+α) E log P̂(A | h) + log Z_AB(h) - E log Z_B(hA) by nested SMC runs, against the exact sum of
    the calibrated conditionals' entropies over A: the last tenth of the horizon (B empty), and a stretch inside it."""
    model, T, alpha, B = _tempered(), 20, 1.0, 1500
    fs = finite_state_lm(model)
    prefixes = _windows(B, 1, 4)
    g = generation(fs, alpha, T, _start(fs, prefixes[:, 0]))
    r = smc_generate(model, prefixes, alpha, T, particles=64, seed=5)
    for start, stop in ((18, 20), (10, 14)):
        got = smc_tail_entropy(model, prefixes, r, alpha, start, stop, particles=64, seed=6)  # [B]
        want = g.entropy[start:stop].mean().item()
        assert got.shape == (B,)
        assert abs(got.mean().item() - want) < 4.5 * got.std().item() / math.sqrt(B) + 0.01, (start, got.mean(), want)
    with pytest.raises(ValueError, match="start"):
        smc_tail_entropy(model, prefixes, r, alpha, 5, 25)


def test_smc_z_is_unbiased_and_its_log_biased_low():
    model, T, alpha, N = _tempered(), 10, 1.0, 4000
    fs = finite_state_lm(model)
    log_z = log_values(fs, alpha, T)[T, 3].item()
    r = smc_generate(model, torch.full((N, 1), 3), alpha, T, particles=4, seed=0)  # N independent runs
    ratio = (r.log_z - log_z).exp()
    assert abs(ratio.mean().item() - 1) < 4 * ratio.std().item() / math.sqrt(N), ratio.mean()
    gap = r.log_z - log_z
    assert gap.mean() < -6 * gap.std() / math.sqrt(N)  # Jensen: E log Ẑ < log Z, visibly, with 4 particles


def test_fitted_alpha_matches_the_exact_root_within_its_standard_error():
    model, T, B = _tempered(), 10, 400
    fs, text = finite_state_lm(model), _text(model)
    a = exact_alpha(fs, text, T)
    data = _windows(B, T + 1, 5)
    fit = fit_sequence_alpha(model, data[:, :1], data[:, 1:], particles=64, seed=0)
    assert fit.alpha_stderr < 0.05 and abs(fit.alpha - a) < 3 * fit.alpha_stderr, (fit.alpha, a, fit.alpha_stderr)
    assert abs(fit.ce - sequence_ce(fs, text, a, T)) < 3 * fit.ce_stderr
    assert abs(fit.ce - fit.entropy_rate) <= (1 + fit.alpha) * abs(fit.moment_gap) / T + 1e-12  # CE = EntRate
    assert fit.ce < fit.ce_base - 2 * fit.ce_gain_stderr  # and calibration lowers the CE
    exact_slope = (generation(fs, a + 1e-4, T, text.model_start).moment
                   - generation(fs, a - 1e-4, T, text.model_start).moment) / 2e-4
    assert fit.slope == pytest.approx(exact_slope, rel=0.15)


# -- the hard regime: horizon 100, few particles, low ESS (issue 39) --------------------------------------------------
HARD_T = 100  # the delayed drift at trigger rate 0.02: exact α* = 0.0392, last-tenth surprisal 1.190 (plain 3.07)


def _hard(B: int, seed: int, horizon: int = HARD_T):
    """The delayed drifting oracle, its tables, the exact α* over `horizon` words, and B one-word prefixes of true
    text with the exact law of the generations from them."""
    orc = _delayed()
    fs = finite_state_lm(orc)
    a = exact_alpha(fs, _text(orc), horizon)
    prefixes = _windows(B, 1, seed)
    return orc, fs, a, prefixes, generation(fs, a, horizon, _start(fs, prefixes[:, 0]))


def _last_tenth_z(r, g) -> float:
    """The returned paths' surprisal over the last tenth of their first HARD_T words against the exact law's, in
    standard errors."""
    last = slice(HARD_T - HARD_T // 10, HARD_T)
    s = -r.base_logp[:, last].mean(1)
    return (s.mean().item() + g.base_logp[last].mean().item()) / (s.std().item() / math.sqrt(len(s)))


def test_the_exact_twist_makes_every_weight_one_so_one_particle_is_an_exact_draw():
    orc, fs, a, prefixes, g = _hard(400, 3)
    assert a == pytest.approx(0.0392, abs=1e-4)
    twist = exact_twist(orc, a, HARD_T)
    log_z = log_values(fs, a, HARD_T)[HARD_T][prefixes[:, 0]]  # one-word prefixes: the state is the word
    for k in (1, 4):
        r = smc_generate(orc, prefixes, a, HARD_T, particles=k, seed=0, twist=twist)
        assert torch.allclose(r.ess, torch.full_like(r.ess, float(k))) and r.resamplings.sum() == 0
        assert torch.allclose(r.log_z, log_z, rtol=0, atol=1e-9)  # Ẑ is Z exactly, not only in expectation
        assert abs(_last_tenth_z(r, g)) < 4.5
        rate = entropy_rate(r)  # [B]: unbiased for the law's entropy rate over the horizon, where Ẑ = Z
        assert abs(rate.mean().item() - g.entropy.mean().item()) < 4 * rate.std().item() / math.sqrt(len(rate))
    # without a twist the same 4 particles are visibly biased (resampling after the triggers came too late), and
    # the bias shrinks as particles grow
    err = {}
    for k in (4, 16):
        r = smc_generate(orc, prefixes, a, HARD_T, particles=k, seed=0)
        assert (r.ess / k).mean() < 0.9  # low ESS: the hard regime
        err[k] = _last_tenth_z(r, g)
    assert err[4] > 4 and abs(err[16]) < err[4] / 2, err


def test_a_twist_leaves_the_target_and_z_unchanged_and_the_run_a_function_of_the_seed():
    """Any twist with full support targets the same law (its weights correct it), Ẑ stays unbiased, and the result
    does not depend on how the prefixes are batched. Wrong twists (the exact values at 2 α* and α* / 2) at 16
    particles against the exact law; ψ is dropped at the last word, so Z is the untwisted one."""
    orc, fs, a, prefixes, g = _hard(400, 4)
    r = smc_generate(orc, prefixes, a, HARD_T, particles=16, seed=1, twist=exact_twist(orc, a / 2, HARD_T))
    assert abs(_last_tenth_z(r, g)) < 4.5
    wrong = exact_twist(orc, 2 * a, HARD_T)
    r = smc_generate(orc, prefixes, a, HARD_T, particles=16, seed=1, twist=wrong)
    assert abs(_last_tenth_z(r, g)) < 4.5
    ratio = (r.log_z - log_values(fs, a, HARD_T)[HARD_T][prefixes[:, 0]]).exp()
    assert abs(ratio.mean().item() - 1) < 4 * ratio.std().item() / math.sqrt(len(ratio))
    one = smc_generate(orc, prefixes[:30], a, 20, particles=4, seed=3, twist=wrong, max_batch=16)
    two = smc_generate(orc, prefixes[:30], a, 20, particles=4, seed=3, twist=wrong, max_batch=10_000)
    assert torch.equal(one.tokens, two.tokens) and torch.equal(one.log_z, two.log_z)
    # split over calls, each told its first row (first_id): the one call's draws, nested runs included
    parts = [smc_generate(orc, prefixes[lo:hi], a, 20, particles=4, seed=3, twist=wrong, first_id=lo)
             for lo, hi in ((0, 7), (7, 30))]
    assert torch.equal(torch.cat([p.tokens for p in parts]), one.tokens)
    assert torch.equal(torch.cat([p.log_z for p in parts]), one.log_z)
    whole = smc_tail_entropy(orc, prefixes[:30], one, a, 16, 20, particles=4, seed=9, twist=wrong)
    split = [smc_tail_entropy(orc, prefixes[lo:hi], p, a, 16, 20, particles=4, seed=9, twist=wrong, first_id=lo)
             for (lo, hi), p in zip(((0, 7), (7, 30)), parts, strict=True)]
    assert torch.equal(torch.cat(split), whole)
    shifted = smc_generate(orc, prefixes[7:30], a, 20, particles=4, seed=3, twist=wrong)  # rows from 0: other draws
    assert not torch.equal(shifted.tokens, parts[1].tokens)


def test_reweighting_a_run_gives_the_law_at_nearby_alpha_smoothly():
    """reweighted(r, α) from one run at α0: exact at α0, close to the exact moment and log Z nearby, and smooth in α
    (what the fit's root finder needs: separate runs jump where resampling decisions flip)."""
    orc, fs, a, prefixes, _ = _hard(300, 5)
    r = smc_generate(orc, prefixes, a, HARD_T, particles=32, seed=2, twist=exact_twist(orc, a, HARD_T))
    m0, lz0, _ = reweighted(r, a)
    assert torch.allclose(m0, r.path_logp) and torch.allclose(lz0, r.log_z)
    grid = [a + d for d in (-0.004, -0.002, 0.0, 0.002, 0.004)]
    means = [reweighted(r, x)[0].mean().item() for x in grid]
    assert all(x < y for x, y in zip(means, means[1:], strict=False))  # increasing
    second = [means[i - 1] - 2 * means[i] + means[i + 1] for i in (1, 2, 3)]
    assert max(abs(d) for d in second) < 0.05 * (means[-1] - means[0])  # no jumps: nearly linear on this scale
    start = _start(fs, prefixes[:, 0])
    for x in (a - 0.004, a + 0.004):
        exact = generation(fs, x, HARD_T, start)
        got_m, got_lz, _ = reweighted(r, x)
        assert got_m.mean().item() == pytest.approx(exact.moment, abs=0.1)
        assert got_lz.mean().item() == pytest.approx(exact.log_z, abs=0.05)


@pytest.mark.slow
def test_alpha_fitted_at_k_and_2k_particles_converges_to_the_exact_root():
    """The fit with the sampler that generates: untwisted at 8, 16 and 32 particles on 200 true continuations of 100
    words, against the exact α* = 0.0392; 16 and 32 agree with it and with each other, 8 is biased. With the exact
    twist, 4 particles suffice. At every root the fit's CE and EntRate agree to the root tolerance."""
    orc = _delayed()
    fs = finite_state_lm(orc)
    a = exact_alpha(fs, _text(orc), HARD_T)
    data = _windows(200, HARD_T + 1, 5)
    xtol = 1e-4
    search = RootSearch(xtol=xtol)
    fits = {k: fit_sequence_alpha(orc, data[:, :1], data[:, 1:], particles=k, seed=0, search=search)
            for k in (8, 16, 32)}
    fits["twisted 4"] = fit_sequence_alpha(orc, data[:, :1], data[:, 1:], particles=4, seed=0, search=search,
                                           twist_at=lambda x: exact_twist(orc, x, HARD_T))
    for f in fits.values():  # CE(α*) - EntRate(α*) = (1+α*) moment gap / T, the gap within the tolerance's reach
        assert abs(f.ce_minus_entropy_rate) <= (1 + f.alpha) * f.slope * xtol / HARD_T + 1e-9, f
    for k in (16, 32, "twisted 4"):
        assert abs(fits[k].alpha - a) < 3 * fits[k].alpha_stderr, (k, fits[k].alpha, fits[k].alpha_stderr)
    assert abs(fits[16].alpha - fits[32].alpha) < 2 * math.hypot(fits[16].alpha_stderr, fits[32].alpha_stderr)
    assert abs(fits[8].alpha - a) > abs(fits[32].alpha - a)  # fewer particles, more bias
    assert fits["twisted 4"].mean_ess == pytest.approx(1.0)


def test_a_soft_value_head_is_a_twist_and_features_travel_with_a_state_that_lacks_them():
    """soft_value_twist: Q from the head on the state's features; FeatureStateLM carries them for a model whose state
    does not (same log-probs, selected with the rows). A trained head as the twist of 4 particles on the hard regime,
    the law over 2 x 100 words read over its first 100 (the head is the infinite-horizon value; the law's own end is
    far): the exact law within its standard error, with a higher ESS than without a twist."""
    orc, fs, a, prefixes, g = _hard(400, 6, 2 * HARD_T)
    wrapped = FeatureStateLM(orc)
    st, st2 = orc.init_state(3), wrapped.init_state(3)
    for w in (1, 2):
        lp, st = orc.step(torch.tensor([w, w, 3]), st)
        lp2, st2 = wrapped.step(torch.tensor([w, w, 3]), st2)
    assert torch.equal(lp, lp2) and torch.equal(wrapped.state_features(st2), orc.state_features(st))
    assert torch.equal(wrapped.state_features(wrapped.select(st2, torch.tensor([2, 0])))[0],
                       orc.state_features(st)[2])
    head, _ = train_soft_value(orc, a, _windows(400, 1, 4), HEADS)
    twist = soft_value_twist(orc, head)
    assert twist.lm is orc  # the oracle's state holds its features
    assert soft_value_twist(wrapped.lm, head).lm is orc and isinstance(soft_value_twist(_Generic(orc), head).lm,
                                                                        FeatureStateLM)
    r = smc_generate(twist.lm, prefixes, a, 2 * HARD_T, particles=4, seed=0, twist=twist)
    plain = smc_generate(orc, prefixes, a, 2 * HARD_T, particles=4, seed=0)
    assert abs(_last_tenth_z(r, g)) < 4.5 and (r.ess.mean() > plain.ess.mean())


LAW_T = 200  # the hard regime: the delayed drift's law over 200 words, exact α* = 0.03161


def _law(B: int, seed: int):
    """The oracle, its tables, the exact α* over LAW_T words, B true windows (prefix [B, 1], continuation [B, LAW_T])
    and heads' rollout prefixes."""
    orc = _delayed()
    fs = finite_state_lm(orc)
    win = _windows(B, LAW_T + 1, seed)
    return orc, fs, exact_alpha(fs, _text(orc), LAW_T), win[:, :1], win[:, 1:], _windows(400, 1, 4)


def _exact_moments(fs, alpha, prefixes):
    """[B] E_P̂α[log P̂(W) | prefix_b] over LAW_T words, exactly."""
    states = torch.nn.functional.one_hot(prefixes[:, 0], fs.num_states).double()
    return torch.tensor([generation(fs, alpha, LAW_T, s).moment for s in states])


@pytest.mark.slow  # about a minute: heads trained over 200-word horizons
def test_a_horizon_head_made_for_its_alpha_fits_the_exact_alpha_and_the_infinite_one_does_not():
    """At 16 particles over 200 words: the head of the infinite horizon, trained at α* itself, keeps its value of the
    future to the last words and biases α̂ low (the weights do not correct it: ESS stays near 1); a finite-horizon
    head trained at 2α* and retrained at each α the fit runs at (TwistAtAlpha) fits α* within 10%, and the paths it
    returns follow the exact law at the α it fitted, to the horizon's end."""
    orc, fs, a, pre, cont, starts = _law(400, 11)
    assert a == pytest.approx(0.03161, abs=1e-5)
    infinite, _ = train_soft_value(orc, a, starts, HEADS)
    fit = fit_sequence_alpha(orc, pre, cont, particles=16, seed=0, twist=soft_value_twist(orc, infinite),
                             search=RootSearch(xtol=1e-4))
    assert fit.alpha < 0.9 * a and fit.mean_ess > 0.95, fit.alpha  # biased, and no diagnostic of its own says so
    twist_at = TwistAtAlpha(orc, starts, LAW_T, 2 * a, training=HEADS, retrain=replace(HEADS, iterations=4),
                            tol=1e-3)
    fit = fit_sequence_alpha(orc, pre, cont, particles=16, seed=0, twist_at=twist_at, search=RootSearch(xtol=1e-4))
    assert fit.settled and abs(fit.alpha - a) < 0.1 * a, (fit.alpha, twist_at.trainings)
    assert abs(twist_at.alpha - fit.alpha) <= 1e-3  # the twist was made for the α it sampled at
    r = smc_generate(orc, pre, fit.alpha, LAW_T, particles=16, seed=3, twist=twist_at(fit.alpha))
    g = generation(fs, fit.alpha, LAW_T, _start(fs, pre[:, 0]))
    for words in (slice(0, 150), slice(150, LAW_T)):  # the middle, and the last quarter where the old twist failed
        s = -r.base_logp[:, words].sum(1)
        assert abs(s.mean() + g.base_logp[words].sum()) < 4 * s.std() / math.sqrt(len(s)), words


@pytest.mark.slow  # about a minute: heads trained over 200-word horizons
def test_the_reference_check_fails_a_mismatched_twist_and_passes_a_matched_one():
    """reference_check against untwisted SMC at 256 particles on the same prefixes (unbiased here: its moment is the
    exact one within its error): the infinite-horizon head, trained at 2α*, is shown biased beyond the fit's own
    standard error; the horizon head at α* is shown within it; and two fits on the same windows differ in α* by less
    than the independent standard errors say, the true text cancelling (paired_alpha_gap)."""
    orc, fs, a, pre, cont, starts = _law(200, 12)
    bad, _ = train_soft_value(orc, 2 * a, starts, HEADS)
    good = TwistAtAlpha(orc, starts, LAW_T, a, training=HEADS)
    fits = {}
    for name, tw in (("bad", soft_value_twist(orc, bad)), ("good", good(a))):
        fits[name] = fit_sequence_alpha(orc, pre, cont, particles=16, seed=0, twist=tw, search=RootSearch(xtol=1e-4))
    ref_check = {name: reference_check(orc, pre, f.result, f.alpha, particles=256, tolerance=f.alpha_stderr, seed=5)
                 for name, f in fits.items()}
    assert ref_check["bad"].verdict == "fail" and ref_check["good"].verdict == "pass", ref_check
    assert ref_check["bad"].alpha_shift < 0  # its fit sits below the reference's root
    ref = smc_generate(orc, pre, a, LAW_T, particles=256, seed=5)
    d = reweighted(ref, a)[0] - _exact_moments(fs, a, pre)
    assert abs(d.mean()) < 3 * d.std() / math.sqrt(len(d))  # the reference itself is unbiased here
    g, b = fits["good"], fits["bad"]
    gap, se = paired_alpha_gap(g.moment_by_prefix, g.slope_by_prefix, g.alpha, b.moment_by_prefix,
                               b.slope_by_prefix, b.alpha)
    assert gap == pytest.approx(g.alpha - b.alpha) and se < math.hypot(g.alpha_stderr, b.alpha_stderr) / 2
    assert abs(gap) > 4 * se  # the bias is plain once the true text's noise cancels


def test_soft_value_heads_reach_the_perron_fixed_point():
    model, alpha = _tempered(), 0.5
    fs = finite_state_lm(model)
    pl = perron_limit(fs, alpha)
    feats = model.state_features(all_states(model))
    prefixes = _windows(400, 1, 0)

    def tv(head):  # the sampler's law against P_∞, worst state
        with torch.no_grad():
            law = ((1 + alpha) * fs.log_law + head(feats).double()).softmax(-1)
        return ((law - pl.log_law.exp()).abs().sum(-1) / 2).max().item()

    # exact targets, Q = log of the Perron vector at the next state, on the states the sampler visits
    head = new_head(model, feats.size(1), hidden=64, rank=8)
    assert tv(head) > 0.05  # the model's law to the power 1 + α alone is far off
    for k in range(2):
        ex = soft_value_rollouts(model, head, alpha, prefixes, 20, seed=k)
        state = ex.features[:, 1:].argmax(1)  # the one-hot context (slot 0 is the empty one)
        fit_soft_value(head, ex.features, ex.words, pl.log_vector[fs.next_state[state, ex.words]], epochs=10)
    assert tv(head) < 2e-3
    # relative value iteration from scratch, one-step soft Bellman targets
    head, history = train_soft_value(model, alpha, prefixes,
                                     SoftValueTraining(iterations=12, steps=20, hidden=64, rank=8))
    assert tv(head) < 2e-3
    assert history[-1]["rho"] == pytest.approx(pl.log_lambda, abs=2e-3)


def test_delayed_drift_closes_under_smc_and_soft_values_but_not_one_step_lookahead():
    orc, T = _delayed(), 40  # the curve's length; its last tenth is the last 4 words
    fs, text = finite_state_lm(orc), _text(orc)
    last = slice(T - T // 10, T)
    ce0 = -true_log_probs(fs, text, T).mean().item()

    def gap(log_law):  # exact: last tenth of the generation entropy curve - CE on true text, for a per-word law
        f = FiniteStateLM(log_law, fs.next_state)
        return (generation(f, 0.0, T, text.model_start).entropy[last].mean().item()
                + true_log_probs(f, text, T).mean().item())

    assert gap(fs.log_law) > 1.0
    fit = fit_lookahead_calibration(orc, batchify(_windows(1, 20000, 1)[0], 20), min_context=5)
    one_step = (fs.log_law + fit.alpha * lookahead_entropies(orc, all_states(orc), fs.log_law)).log_softmax(-1)
    assert gap(one_step) > 1.0  # a trigger looks harmless one word ahead

    # Algorithm 1 over exactly T words drifts at the end (a trigger there costs only the few words left) ...
    a_t = exact_alpha(fs, text, T)
    g_t = generation(fs, a_t, T, text.model_start)
    assert g_t.entropy.mean().item() == pytest.approx(sequence_ce(fs, text, a_t, T), abs=1e-10)
    assert g_t.entropy[last].mean().item() - sequence_ce(fs, text, a_t, T) > 0.15
    # ... so SMC generates 2T words, and the first T are flat at the CE
    horizon = 2 * T
    a = exact_alpha(fs, text, horizon)
    g = generation(fs, a, horizon, text.model_start)
    assert abs(g.entropy[last].mean().item() - sequence_ce(fs, text, a, horizon)) < 0.1
    B = 200
    prefixes = _windows(B, 1, 3)
    r = smc_generate(orc, prefixes, a, horizon, particles=64, seed=0)
    g_b = generation(fs, a, horizon, _start(fs, prefixes[:, 0]))
    z = (r.base_logp.mean(0) - g_b.base_logp) / (r.base_logp.std(0) / math.sqrt(B))
    assert z.abs().max() < 4.5, z
    # the model's own -log P̂ along the calibrated generations, in the last tenth: at the CE, as SMC measures it
    surprisal = -r.base_logp[:, last].mean(1)  # [B]
    assert abs(surprisal.mean() + g_b.base_logp[last].mean()) < 4 * surprisal.std() / math.sqrt(B)
    assert abs(g.base_logp[last].mean().item() + ce0) < 0.1

    # the soft-value heads, average-reward, at the same α: P ∝ P̂^(1+α) e^Q is flat from the first word
    head, history = train_soft_value(orc, a, _windows(400, 1, 4), HEADS)
    assert history[-1]["rho"] == pytest.approx(perron_limit(fs, a).log_lambda, abs=5e-3)
    with torch.no_grad():
        law = ((1 + a) * fs.log_law + head(orc.state_features(all_states(orc))).double()).log_softmax(-1)
    assert abs(gap(law)) < 0.1, gap(law)
    sampler = soft_value_lm(orc, head, a)  # the StepLM generates what the exact curve says
    mc = generation_entropy_curve(sampler, _windows(40, 1, 5), T, 10, seed=0)
    exact = generation(FiniteStateLM(law, fs.next_state), 0.0, T, _start(fs, _windows(40, 1, 5)[:, 0])).entropy
    assert np.abs((mc.mean - exact.numpy()) / mc.stderr).max() < 4.5


def _stage(lm, text, out, **settings) -> dict:
    """The sequence_calibration stage on a model of one's own: training, validation and test text cut from `text`."""
    from lmcal.stages import run_stage, target

    return run_stage("sequence_calibration", target(lm, train=text[:3000], valid=text[3000:4500], test=text[4500:]),
                     settings, out)


def test_the_stage_writes_its_rows_on_an_oracle(tmp_path, monkeypatch):
    """The sequence_calibration stage end to end on the delayed drifting oracle (tiny settings): the plain model, the
    soft-value heads with their own α, SMC at each count untwisted and twisted (each with its own α*, fitted over the
    law's 2 x horizon words, its convergence against the other count, its test CE with log Ẑ's bias), the fitted
    temperature; the goal and the twisted row measured on fresh prefixes; results.json's rows."""
    from lmcal.stages.sequence_calibration import STAGE

    orc = _delayed()
    text = _windows(1, 6000, 9)[0]
    r = _stage(orc, text, tmp_path, particles=[2, 4], fit_prefixes=8, sv_rollouts=16, sv_prefix=4, sv_steps=6,
               sv_iterations=2, sv_backup_steps=3, hidden=8, rank=4, epochs=1, fit_tokens=600, fit_streams=4,
               score_tokens=600, score_streams=4, timing_prefixes=2, timing_horizon=4, timing_repeats=1,
               num_prefixes=6, samples_per_prefix=2, prefix_len=4, horizon=20, max_batch=64, goal_prefixes=9)
    assert [(x["method"], x.get("variant"), x["params"].get("particles")) for x in r["rows"]] == [
        ("model", None, None), ("soft_value", None, None), ("smc", "untwisted", 2), ("smc", "untwisted", 4),
        ("smc", "twisted", 2), ("smc", "twisted", 4), ("fitted_temperature", None, None)]
    assert r["law_horizon"] == 40 and r["particles"] == [2, 4] and r["twist"]
    smc = [x for x in r["rows"] if x["method"] == "smc"]
    for x in r["rows"]:
        assert len(x["curve_nats"]) == 20 and x["tail_ppl"] > 0 and x["tail_ppl_stderr"] >= 0
        assert x["ms_per_token"] > 0 and x["test_ce_nats"] is not None
    for x in smc:
        f = x["fit"]  # at its root CE and EntRate agree to the tolerance: (1+α) slope xtol / L; unsettled, it says so
        assert not f["settled"] or abs(f["ce_minus_entropy_rate_nats"]) <= (1 + x["params"]["alpha"]) * f["slope"] \
            * 2e-3 / 40 + 1e-9
        assert f["settled"] or ("not settled" in (tmp_path / "sequence_calibration.md").read_text()
                                and not x["converged"])
        assert x["converged"] in (True, False) and x["converged_against"] in (2, 4)
        assert x["label"].startswith("Algorithm 1") == x["converged"] and x["test_ce_bias_nats"] <= 0
        assert 0 < x["ess_per_particle"] <= 1 and len(x["ess_by_step"]) == 40
        assert math.isfinite(x["law_entropy_rate_nats"]) and x["law_entropy_rate_stderr_nats"] > 0  # over all L
        assert math.isfinite(x["tail_alpha_slope_nats"]) and x["tail_alpha_stderr_nats"] >= 0  # 2 generations a prefix
    assert len({x["params"]["alpha"] for x in smc}) > 1  # each count fits its own α
    sv = r["soft_value_alpha"]
    assert r["rows"][1]["params"]["alpha"] == sv["alpha"] and sv["valid_ce_after_nats"] <= sv["valid_ce_before_nats"]
    assert r["rows"][1]["refits"][0]["trained_at_alpha"] == smc[1]["params"]["alpha"]  # the largest untwisted count
    for check in (r["goal"], r["twisted_check"]):  # on 9 fresh prefixes (goal_prefixes), more than the rows' own 6
        assert check is None or (check["chosen_on_seed"] != check["reported_on_seed"]
                                 and check["reported_on"].startswith("9 fresh prefixes")
                                 and (check["prefixes"], check["generations"]) == (9, 18))
    assert r["twisted_check"]["params"]["particles"] == 2
    assert "not shown to converge" in r["convergence"] or "converged at" in r["convergence"]
    table = (tmp_path / "sequence_calibration.md").read_text()
    assert "over L = 40 words" in table and "| twisted | 2 |" in table and "| untwisted | 4 |" in table
    rows = STAGE.summary(r)["sequence_calibration"]
    assert {"method", "params", "tail_ppl", "tail_ppl_stderr", "test_ce_nats", "ms_per_token", "label",
            "converged"} <= set(rows[0])
    assert {p.name for p in tmp_path.iterdir()} >= {"sequence_calibration.json", "sequence_calibration.md",
                                                    "sequence_calibration.png", "sequence_calibration_surprisal.png"}
    # one quantity an axis: the entropy of per-word rows in the figure, SMC's surprisals in the extra figure
    from lmcal.stages import sequence_calibration as stage_module

    drawn = []
    monkeypatch.setattr(stage_module, "entropy_curve_figure", lambda curves, path, **kw: drawn.append(list(curves)))
    result = stage_module.SequenceCalibrationResult(r)
    result.figure(tmp_path / "x.png"), result.extras(tmp_path, "x")
    from lmcal.stages.sequence_table import row_label

    smc_labels = {row_label(x) for x in r["rows"] if x["method"] == "smc"}
    assert set(drawn[0]) == {row_label(x) for x in r["rows"] if x["method"] != "smc"}
    assert drawn[1][0].startswith("model: its entropy") and set(drawn[1][1:]) <= smc_labels and drawn[1][1:]
    # REPORT.md's verdicts on the goal rows: each against the test perplexity
    from lmcal.reporting.claims import sequence_goal_claims

    claims = sequence_goal_claims(r)
    assert len(claims) >= 1 and all("of the test perplexity" in c.sentence for c in claims)


def test_the_stage_can_run_the_twisted_rows_only(tmp_path):
    """untwisted=false: the twisted rows alone (a long study's time goes to the twisted law), the heads first trained at
    sv_alpha, whose absence is one clear error before anything runs."""
    from lmcal.errors import LmcalError

    orc = _delayed()
    text = _windows(1, 6000, 9)[0]
    tiny = dict(particles=[2, 4], fit_prefixes=8, sv_rollouts=16, sv_prefix=4, sv_steps=6, sv_iterations=2,
                sv_backup_steps=3, hidden=8, rank=4, epochs=1, fit_tokens=600, fit_streams=4, score_tokens=600,
                score_streams=4, timing_prefixes=2, timing_horizon=4, timing_repeats=1, num_prefixes=6,
                samples_per_prefix=2, prefix_len=4, horizon=20, max_batch=64, untwisted=False)
    for bad, why in (({}, "give analysis.sequence_calibration.sv_alpha"), ({"sv_alpha": 0.04, "twist": False},
                                                                           "need analysis.sequence_calibration.twist")):
        with pytest.raises(LmcalError, match=why):
            _stage(orc, text, tmp_path / "bad", **tiny, **bad)
    assert not (tmp_path / "bad").exists()  # refused before anything was written
    r = _stage(orc, text, tmp_path, sv_alpha=0.04, **tiny)
    assert [(x["method"], x.get("variant"), x["params"].get("particles")) for x in r["rows"]] == [
        ("model", None, None), ("soft_value", None, None), ("smc", "twisted", 2), ("smc", "twisted", 4),
        ("fitted_temperature", None, None)]
    assert r["rows"][1]["refits"][0]["trained_at_alpha"] == 0.04 and not r["untwisted"] and r["sv_alpha"] == 0.04
    assert r["twisted_check"]["params"]["particles"] == 2 and "twisted SMC" in r["alpha_from"]
    assert all(len(x["law_curve_nats"]) == r["law_horizon"] for x in r["rows"] if x["method"] == "smc")
    assert "each count twisted only, the heads first trained at α = 0.04" in (
        tmp_path / "sequence_calibration.md").read_text()
    # a study grown one count at a time: runs at 2 and at 4 particles join into the run at both, row for row
    from lmcal.stages.convergence import join_study

    parts = [_stage(orc, text, tmp_path / f"k{k}", sv_alpha=0.04, **{**tiny, "particles": [k], "max_batch": 8 * k})
             for k in (2, 4)]
    assert parts[0]["rows"][2]["converged"] is None  # alone: nothing to agree with
    import copy

    first = copy.deepcopy(parts[0])
    added = join_study(parts[0], parts[1], "the 4-particle run")
    assert [x["params"]["particles"] for x in added] == [4] and parts[0]["particles"] == [2, 4]
    smc = lambda res: [x for x in res["rows"] if x["method"] == "smc"]  # noqa: E731
    for a, b in zip(smc(parts[0]), smc(r), strict=True):
        assert a["tail_nats_per_generation"] == b["tail_nats_per_generation"] and a["params"] == b["params"]
        assert (a["convergence"], a["label"], a["tail_against_nats"]) == (b["convergence"], b["label"],
                                                                          b["tail_against_nats"])
    assert parts[0]["convergence"] == r["convergence"]
    assert parts[0]["twisted_check"]["label"] == r["twisted_check"]["label"] == smc(r)[0]["label"]
    with pytest.raises(ValueError, match="particle counts this study has already \\(\\[4\\]\\)"):
        join_study(parts[0], parts[1])
    other = {**parts[1], "seed": 5}
    with pytest.raises(ValueError, match="the other run is not the same study.*seed 0 against 5"):
        join_study(r, other)
    # a run on other threads sums in another order: its floats differ in the ninth digit and it is the same study;
    # a float that differs in the third is not
    ce = parts[1]["reference_test_ce_nats"]
    for nudge, joins in ((1 + 1e-12, True), (1 + 1e-3, False)):
        other = copy.deepcopy(parts[1])
        other["reference_test_ce_nats"] = ce * nudge
        other["rows"][0]["tail_nats"] *= nudge
        if joins:
            assert len(join_study(copy.deepcopy(first), other)) == 1
        else:
            with pytest.raises(ValueError, match="reference_test_ce_nats.*the plain model's last tenth"):
                join_study(copy.deepcopy(first), other)


def test_convergence_must_be_shown_not_merely_not_refuted():
    # K and 2K particles agree only where their paired last tenths' 2-se interval lies within +-tol nats: twenty
    # prefixes whose differences scatter by 0.6 nats refute nothing, and that is "not shown", not "converged"
    from lmcal.stages.convergence import converged_summary, label, mark_convergence
    from lmcal.stages.sequence_table import study_table

    rng = np.random.default_rng(0)

    def rows(spread: float, shift: float = 0.0) -> list[dict]:
        base = rng.normal(4.6, 0.3, 20)
        noise = rng.normal(0.0, 1.0, 20)
        noise = (noise - noise.mean()) / noise.std(ddof=1)  # exactly mean 0, sd 1: the paired se is spread / sqrt(20)
        # the fits' per-window moments differ by noise whose paired α* standard error is 0.0028 (slope 100)
        moments = -180.0 + 0.002 * math.sqrt(2) * math.sqrt(20) * 100 * noise
        return [{"variant": "twisted", "params": {"particles": k, "alpha": 0.01, "alpha_stderr": 0.002},
                 "fit": {"settled": True, "ce_minus_entropy_rate_nats": 0.0, "ce_minus_entropy_rate_stderr_nats": 0.1,
                         "moment_by_prefix": (moments if k == 8 else np.full(20, -180.0)).tolist(),
                         "slope_by_prefix": [100.0] * 20},
                 "tail_nats_per_generation": [[x] for x in base + (spread * noise + shift if k == 8 else 0.0)],
                 "tail_ppl": 100.0, "tail_ppl_stderr": 5.0, "ess_per_particle": 0.8, "log_z_mean": -20.0,
                 "test_ce_nats": 4.78, "test_ce_bias_nats": -0.001, "ms_per_token": 0.1, "cost_ratio": 2.0}
                for k in (4, 8)]

    quiet, noisy, apart = rows(0.05), rows(0.6), rows(0.05, shift=0.2)
    for rs, tol in ((quiet, 0.1), (noisy, 0.1), (apart, 0.1), (noisy, None)):
        mark_convergence(rs, tol)
    se = 0.6 / math.sqrt(20)
    assert [r["convergence"] for r in quiet] == ["agrees"] * 2 and all(r["converged"] for r in quiet)
    assert abs(noisy[0]["tail_against_stderr_nats"] - se) < 1e-9 and abs(noisy[0]["tail_against_nats"]) < 1e-9
    assert noisy[0]["converged"] and noisy[0]["convergence"] == "agrees"  # tol None: not refuted is enough
    mark_convergence(noisy, 0.1)  # 2 x 0.134 > 0.1: shown neither way
    assert [r["convergence"] for r in noisy] == ["not shown"] * 2 and not any(r["converged"] for r in noisy)
    assert label(noisy[0]) == "twisted SMC, 4 particles, convergence not shown"
    assert [r["convergence"] for r in apart] == ["disagrees"] * 2 and label(apart[1]) == "twisted SMC, 8 particles, " \
                                                                                        "not converged"
    assert label(quiet[0]) == "Algorithm 1 (twisted SMC, 4 particles)"
    assert "| not shown |" in study_table(noisy) and "| yes |" in study_table(quiet)
    assert converged_summary(quiet).startswith("Twisted SMC converged at 4 particles (agreeing with 8 within ±0.1 nats")
    assert converged_summary(noisy) == (
        "Twisted SMC is not shown to converge at any count run (4, 8): no K agrees with 2K within ±0.1 nats at 2 "
        "standard errors (one pair shows no disagreement, but its paired difference's interval reaches beyond ±0.1 "
        "nats at 2 standard errors with 20 generations a row: 4 and 8 particles differ by -0.000 ± 0.134 nats, and "
        "about 200 generations a row would show agreement, were the difference to stay where it is), so none of its "
        "rows is reported as Algorithm 1.")
    # a difference that is there but small: the count needed grows as (Z se / (tol - |d|))^2; none where |d| >= tol
    near, far = rows(0.6, shift=0.05), rows(0.6, shift=0.12)
    for rs in (near, far):
        mark_convergence(rs, 0.1)
    assert [r["convergence"] for r in near + far] == ["not shown"] * 4
    # 20 x (2 x 0.134 / 0.05)^2 = 575
    assert "about 600 generations a row would show agreement" in converged_summary(near)
    assert "no number of generations would show agreement while the difference stays at 0.120 nats" in (
        converged_summary(far))
    assert "; 4 and 8 particles disagree (-0.200 ± 0.011 nats), so none" in converged_summary(apart)
    # a fit without its root: its α* is not the law's, so K and 2K are not compared, whatever their last tenths say
    unsettled = rows(0.05)
    unsettled[0]["fit"] = {**unsettled[0]["fit"], "settled": False}
    mark_convergence(unsettled, 0.1)
    assert [r["convergence"] for r in unsettled] == ["disagrees"] * 2
    assert ("; 4 and 8 particles are not compared: the 4-particle fit found no root (last tenths +0.000 ± 0.011 "
            "nats), so none") in converged_summary(unsettled)
    unsettled[1]["params"] = {**unsettled[1]["params"], "alpha": 0.02}  # and α*s apart: they disagree
    mark_convergence(unsettled, 0.1)
    assert "4 and 8 particles disagree (α* -0.0100 ± 0.0028; the 4-particle fit found no root)" in (
        converged_summary(unsettled))
    # each pair its own count: a wide but near pair, and a pair already beyond tol, which no count can show
    wide, off = dict(quiet[0]), dict(quiet[1])
    for r, d, se, against in ((wide, 0.02, 0.3, 8), (off, 0.11, 0.1, 16)):
        r.update(convergence="not shown", converged=False, converged_against=against, convergence_tol_nats=0.1,
                 tail_against_nats=d, tail_against_stderr_nats=se)
    both = converged_summary([wide, off])
    assert "(2 pairs show no disagreement, but each paired difference's interval" in both
    # 20 x (2 x 0.3 / 0.08)^2 = 1,125
    assert "4 and 8 particles differ by +0.020 ± 0.300 nats, and about 1,200 generations a row would" in both
    assert "8 and 16 particles differ by +0.110 ± 0.100 nats, and no number of generations would show agreement " \
           "while the difference stays at 0.110 nats" in both


def test_alpha_slope_is_the_exact_derivative_of_the_laws_level():
    # i.i.d. words: P̂_α(W) ∝ P̂(W)^(1+α) draws each word from q_α ∝ p^(1+α), so the mean surprisal s = -log p of
    # any block of words has d/dα E_α = -Var_qα(s) exactly; alpha_slope estimates it from generations alone, by the
    # covariance of the block with log P̂(W) within each prefix
    from lmcal.stages.smc_rows import alpha_slope

    p = np.array([0.5, 0.3, 0.15, 0.05])
    s, alpha, L = -np.log(p), 0.3, 6
    q = p ** (1 + alpha) / (p ** (1 + alpha)).sum()
    exact = -((q * s * s).sum() - (q * s).sum() ** 2)
    rng = np.random.default_rng(0)
    n, S = 3000, 3
    words = rng.choice(len(p), size=(n, S, L), p=q)
    tail = s[words[..., 1:3]].mean(-1)  # [n, S]: a two-word block
    law_logp = -s[words].sum(-1)  # [n, S]
    slope, se = alpha_slope(tail, law_logp)
    assert abs(slope - exact) < 3 * se and 0.02 < se / abs(exact) < 0.1
    assert alpha_slope(tail[:, :1], law_logp[:, :1]) == (None, None)  # one generation a prefix: no covariance


def test_alpha_slope_of_the_nested_smc_last_tenth_is_the_exact_derivative():
    # as the stage takes it: each generation's nested-SMC entropy of a block against its log P̂(W). The estimate's
    # noise is -log P̂_α(A | h) of the drawn block, whose covariance with log P̂(W) is the block entropy's own change
    # with α (the score has mean zero), so the covariance is the whole d/dα of the law's mean block entropy: exact
    from lmcal.stages.smc_rows import alpha_slope

    model, T, alpha, n, S = _tempered(), 20, 1.0, 1500, 2
    fs = finite_state_lm(model)
    prefixes = _windows(n, 1, 9)
    start = _start(fs, prefixes[:, 0])
    p = prefixes.repeat_interleave(S, 0)
    r = smc_generate(model, p, alpha, T, particles=64, seed=9)
    for a, b in ((10, 14), (18, 20)):  # inside the law, and at its end
        exact = (generation(fs, alpha + 1e-3, T, start).entropy[a:b].mean()
                 - generation(fs, alpha - 1e-3, T, start).entropy[a:b].mean()).item() / 2e-3
        tail = smc_tail_entropy(model, p, r, alpha, a, b, particles=64, seed=10)
        slope, se = alpha_slope(tail.numpy().reshape(n, S), r.base_logp.sum(1).numpy().reshape(n, S))
        assert abs(slope - exact) < 4 * se and se < 0.1 * abs(exact), (a, slope, se, exact)


def test_two_runs_settings_are_the_same_up_to_the_ninth_digit_of_a_float():
    from lmcal.stages.convergence import same_value

    assert same_value(4.752113065132741, 4.752113070188918)  # one thread against two, as measured
    assert not same_value(4.75, 4.76) and not same_value(1.0, True) and not same_value(0.0, "0")
    assert same_value(3, 3.0) and not same_value(3, 4) and same_value(None, None) and not same_value(None, 0.0)
    assert same_value({"a": [1.0, 2]}, {"a": [1.0 + 1e-12, 2]}) and not same_value({"a": [1.0]}, {"a": [1.0, 2]})
    assert not same_value({"a": 1}, {"b": 1}) and not same_value([0.0], [1e-9])  # near zero: an absolute 1e-12


def test_a_finished_study_gets_more_generations_at_other_seeds_as_if_drawn_at_once(tmp_path):
    """extend: a run at seeds [0] grown by seeds [50, 80] is the run at [0, 50, 80], column for column (its rows'
    generations side by side along S, every statistic recomputed from the per-generation arrays), without fitting α*
    again; refusals are one clear error before anything is written."""
    import copy
    import json

    from lmcal.errors import LmcalError
    from lmcal.stages.smc_rows import BY_GENERATION, join_generations

    orc = _delayed()
    text = _windows(1, 6000, 9)[0]
    tiny = dict(particles=[2, 4], fit_prefixes=8, sv_rollouts=16, sv_prefix=4, sv_steps=6, sv_iterations=2,
                sv_backup_steps=3, hidden=8, rank=4, epochs=1, fit_tokens=600, fit_streams=4, score_tokens=600,
                score_streams=4, timing_prefixes=2, timing_horizon=4, timing_repeats=1, num_prefixes=6,
                samples_per_prefix=2, prefix_len=4, horizon=20, max_batch=64, untwisted=False, sv_alpha=0.04)

    def run(d, extend=None, **kw):  # extend: an earlier result, given to the stage as its JSON file
        if extend is not None:
            (tmp_path / f"{d}_extend.json").write_text(json.dumps(extend))
            kw["extend_json"] = str(tmp_path / f"{d}_extend.json")
        return _stage(orc, text, tmp_path / d, **{**tiny, **kw})

    whole = run("whole", smc_seeds=[0, 50, 80])
    first = run("first")
    assert first["smc_seeds"] == [0] and whole["smc_seeds"] == [0, 50, 80]
    grown = run("grown", smc_seeds=[50, 80], extend=copy.deepcopy(first))
    smc = lambda res: [x for x in res["rows"] if x["method"] == "smc"]  # noqa: E731
    for a, b, f in zip(smc(grown), smc(whole), smc(first), strict=True):
        assert np.shape(a["tail_nats_per_generation"]) == (6, 6) and a["generations"] == 36
        assert a["params"] == f["params"] and a["fit"] == f["fit"] and a["test_ce_nats"] == f["test_ce_nats"]
        for k in [*BY_GENERATION, "curve_by_prefix_nats", "curve_nats", "stderr_nats", "law_curve_nats",
                  "ess_by_step", "tail_nats", "tail_stderr_nats", "tail_diff_nats", "tail_diff_stderr_nats",
                  "tail_alpha_slope_nats", "tail_alpha_slope_stderr_nats", "law_entropy_rate_nats",
                  "law_entropy_rate_stderr_nats", "ess_per_particle", "log_z_mean", "resamplings_per_generation"]:
            assert np.allclose(a[k], b[k], rtol=1e-12, atol=1e-12), k
        # what α*'s noise moves the level by: the joined slope times the earlier fit's se(α*)
        se_alpha = f["params"]["alpha_stderr"]
        assert a["tail_alpha_stderr_nats"] == pytest.approx(abs(a["tail_alpha_slope_nats"]) * se_alpha)
        assert (a["convergence"], a["tail_against_nats"]) == (b["convergence"], pytest.approx(b["tail_against_nats"]))
    assert grown["twisted_check"]["tail_nats"] == first["twisted_check"]["tail_nats"]  # kept, not measured again
    assert grown["convergence"] == whole["convergence"] and grown["extended"] and not whole["extended"]
    md = (tmp_path / "grown" / "sequence_calibration.md").read_text()
    from lmcal.stages.convergence import join_study

    with pytest.raises(ValueError, match=r"not the same study.*smc_seeds \[0, 50, 80\] against \[0\]"):
        join_study(copy.deepcopy(grown), first)  # counts join only where they drew at the same seeds
    assert "2 a prefix at each of the seeds [0, 50, 80] (36 generations a row, grown from an earlier run at its" in md
    from lmcal.stages.sequence_table import seeds_phrase

    assert (seeds_phrase(grown), seeds_phrase(first)) == ("seeds [0, 50, 80]", "seed 0")  # where the rows drew
    # seeds past the last: 0, 50, 80 and then 90, from the grown run's JSON as a user passes it
    grown_json = json.loads((tmp_path / "grown" / "sequence_calibration.json").read_text())
    again = run("again", smc_seeds=[90], extend=grown_json)
    assert again["smc_seeds"] == [0, 50, 80, 90] and smc(again)[0]["generations"] == 48
    with pytest.raises(ValueError, match="different numbers of prefixes"):
        join_generations(smc(first)[0], {**smc(first)[0], "tail_nats_per_generation": [[1.0]]})
    for bad, why in (({"smc_seeds": [0, 7]}, r"drew at \[0\] already"),
                     ({}, "name them with analysis.sequence_calibration.smc_seeds"),
                     ({"smc_seeds": [7], "particles": [2]}, "the earlier run's rows are particles=\\[2, 4\\]"),
                     ({"smc_seeds": [7], "horizon": 24}, "not this study.*horizon 24 against 20"),
                     ({"smc_seeds": [7], "goal_prefixes": 3}, "goal_prefixes 3 against None"),
                     ({"smc_seeds": [7], "extend": {"rows": []}}, "names no result of this stage")):
        with pytest.raises(LmcalError, match=why):
            run("bad", **{"extend": copy.deepcopy(first), **bad})
    assert not (tmp_path / "bad").exists()


def test_extend_json_is_read_as_data_with_one_clear_error_for_a_bad_file(tmp_path):
    """analysis.sequence_calibration.extend_json: a finished run's JSON, read as data; a missing file, a file that is
    not JSON and JSON that is not an object are each one clear error."""
    from lmcal.errors import LmcalError
    from lmcal.stages.stage import read_result

    assert read_result(None, "sequence_calibration", "extend_json") is None
    good = tmp_path / "sequence_calibration.json"
    good.write_text('{"rows": [], "law_horizon": 40}')
    assert read_result(str(good), "sequence_calibration", "extend_json") == {"rows": [], "law_horizon": 40}
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "bytes.json").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "nan.json").write_text('{"rows": [], "law_horizon": NaN}')
    for path, why in ((tmp_path / "missing.json", "does not exist: name the JSON a finished run"),
                      (tmp_path / "bad.json", "is not a stage's result: it does not parse"),
                      (tmp_path / "bytes.json", "is not a stage's result: it is not UTF-8"),
                      (tmp_path / "list.json", "is not a stage's result: it is a list"),
                      (tmp_path / "nan.json", "law_horizon is nan")):
        with pytest.raises(LmcalError, match=f"analysis.sequence_calibration.extend_json=.*{why}"):
            read_result(str(path), "sequence_calibration", "extend_json")


def test_the_goal_takes_a_converged_sampler_at_its_fewest_count():
    """Converged K and 2K estimate one law, so the goal weighs each sampler by its fewest converged count alone (the
    cheapest to measure again on thousands of fresh prefixes); unconverged rows and higher test CEs never stand."""
    from lmcal.stages.goal_rows import goal_candidates

    def smc(variant, k, converged, diff=-0.01):
        return {"method": "smc", "variant": variant, "params": {"particles": k}, "converged": converged,
                "test_ce_diff_nats": diff}
    heads = {"method": "soft_value", "params": {}, "test_ce_diff_nats": -0.001}
    worse = {"method": "fitted_temperature", "params": {}, "test_ce_diff_nats": 0.002}
    rows = [heads, worse, smc("untwisted", 16, False), smc("untwisted", 32, True), smc("untwisted", 64, True),
            smc("twisted", 16, True), smc("twisted", 32, True)]
    got = goal_candidates(rows, {"soft_value", "fitted_temperature"})
    assert [(r["method"], r.get("variant"), r["params"].get("particles")) for r in got] == [
        ("soft_value", None, None), ("smc", "untwisted", 32), ("smc", "twisted", 16)]
    # the sampler's fewest converged count speaks for its law, a higher test CE included: its doubles do not stand in
    assert goal_candidates([smc("twisted", 8, True, diff=0.01), *rows[5:]], set()) == []
    assert goal_candidates([smc("twisted", 8, False), *rows[5:]], set()) == [rows[5]]
