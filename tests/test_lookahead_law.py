"""One law, fitted and generated (lmcal.core.lookahead_law): the candidate rules, the fit's CE against the scored CE of
the law that generates, the covering rule's limit, and the noise-free shift of E[H_next]."""

import math

import numpy as np
import pytest
import torch

from lmcal.core.calibration import (
    calibrated,
    fit_lookahead_calibration,
    score,
    target_log_probs,
    topk_coverage,
)
from lmcal.core.entropy_rate import generation_entropy_curve
from lmcal.core.lookahead import advance_keys, candidate_entropies, entropy, lookahead_entropies, start_keys
from lmcal.core.lookahead_law import (
    Rule,
    candidate_set,
    hnext_shifts,
    law_atoms,
    law_log_probs,
    make_rule,
    rule_shift,
)
from lmcal.core.sampling import draw, uniforms
from lmcal.data.batching import batchify
from lmcal.data.markov import make_markov_chain, sample_markov
from lmcal.errors import LmcalError
from lmcal.models.oracles import MarkovOracle

RULES = [dict(), dict(topk=3, tail_samples=4), dict(cover=0.7, tail_samples=3), dict(cover=0.9, cover_max=4,
                                                                                      tail_samples=2)]


@pytest.fixture(scope="module")
def oracle():
    chain = make_markov_chain(vocab_size=16, order=1, support=5, smoothing=0.3, seed=1)
    return MarkovOracle.from_chain(chain), chain


@pytest.fixture(scope="module")
def text(oracle):
    _, chain = oracle
    tokens = torch.from_numpy(sample_markov(chain.probs, chain.vocab_size, chain.order, 24 * 6, 4))
    return batchify(tokens, 6)  # [24, 6]


def after(lm, tokens):
    state = lm.init_state(tokens.size(1))
    keys = start_keys(tokens.size(1))
    for t in range(tokens.size(0)):
        logp, state = lm.step(tokens[t], state)
        keys = advance_keys(keys, tokens[t])
    return logp, state, keys


@pytest.mark.parametrize("rule", RULES)
def test_the_fitted_ce_is_the_ce_of_the_law_that_generates(oracle, text, rule):
    """Position by position, the fit's CE_t(a) is -log of what the calibrated StepLM (same rule, seed) gives the true
    word: the law fitted is the law scored and sampled. With the true word's own tilt in the fit (the law before
    issue 40) the two differ wherever it falls outside the candidates, and this test fails."""
    lm, _ = oracle
    fit = fit_lookahead_calibration(lm, text, make_rule(**rule), seed=3)
    for a in (-0.7, 0.0, 0.4, fit.alpha):
        cal = calibrated(lm, a, seed=3, **rule)
        torch.testing.assert_close(fit.per_position_ce(a), -target_log_probs(cal, text), rtol=0, atol=2e-6)
        assert fit.ce_at(a) == pytest.approx(score(cal, text)[0], abs=1e-6)
    if rule:  # some true words share the rest's tilt: the case that used to differ
        assert (fit.slot < 0).any() and (fit.slot >= 0).any()


def test_the_old_fit_differs_from_the_generating_law(oracle, text):
    """The check above can fail: the objective before issue 40 gave a true word outside the candidates its own tilt
    e^{a H(y)} where generation gives it the shared T(a); that CE is not the CE of the law that generates."""
    lm, _ = oracle
    fit = fit_lookahead_calibration(lm, text, make_rule(topk=3, tail_samples=4), seed=3)
    h_y = fit_lookahead_calibration(lm, text).h.gather(1, text[1:].reshape(-1, 1))[:, 0]  # y's own H_next
    a, rest = -0.7, fit.slot < 0
    log_t = (a * fit.h[:, :4].double()).logsumexp(1) - math.log(4)
    own_tilt = fit.per_position_ce(a) + torch.where(rest, log_t - a * h_y.double(), 0.0)
    scored = -target_log_probs(calibrated(lm, a, topk=3, tail_samples=4, seed=3), text)
    assert (own_tilt - scored).abs().max() > 1e-2
    torch.testing.assert_close(fit.per_position_ce(a), scored, rtol=0, atol=2e-6)


def test_cover_one_is_exact_lookahead(oracle, text):
    """The covering rule at cover = 1 takes every word of positive mass: the law, its fit and its rows are exact
    lookahead's; as cover grows to 1 the fitted CE(a) comes to exact mode's."""
    lm, _ = oracle
    exact = fit_lookahead_calibration(lm, text)
    full = fit_lookahead_calibration(lm, text, make_rule(cover=1.0, tail_samples=3), seed=1)
    assert full.candidates_mean == 16 and (full.slot >= 0).all()
    for a in (-0.8, 0.3):
        assert full.ce_derivatives(a) == pytest.approx(exact.ce_derivatives(a), rel=1e-9, abs=1e-12)
    assert full.alpha == pytest.approx(exact.alpha, abs=1e-9)
    logp, state, keys = after(lm, text[:5])
    torch.testing.assert_close(calibrated(lm, -0.8, cover=1.0).step(text[5], (state, keys))[0],
                               calibrated(lm, -0.8).step(text[5], (state, keys))[0], rtol=0, atol=1e-12)
    gaps = [abs(fit_lookahead_calibration(lm, text, make_rule(cover=c, tail_samples=3), seed=1).ce_at(-0.8)
                - exact.ce_at(-0.8)) for c in (0.5, 0.9, 0.999)]
    assert gaps[-1] < gaps[0] and gaps[-1] < 1e-3


def test_candidate_rules(oracle, text):
    """top-k: the k most likely; cover: the smallest most-likely-first set holding the share, capped; exact: all."""
    lm, _ = oracle
    logq, _, _ = after(lm, text[:3])  # [6, 16]
    words, mask = candidate_set(logq, Rule(cover=0.8))
    cum = logq.exp().sort(-1, descending=True).values.cumsum(-1)
    n = (cum < 0.8).sum(-1) + 1
    assert torch.equal(mask.sum(1), n)
    for b in range(6):  # the most likely words (ties in any order), the fewest that hold 0.8 of the mass
        own = words[b, mask[b]]
        outside = torch.ones(16, dtype=torch.bool).scatter_(0, own, False)
        assert logq[b, own].min() >= logq[b, outside].max()
        assert logq[b, own].exp().sum() >= 0.8 > logq[b, own[:-1]].exp().sum()
    capped = candidate_set(logq, Rule(cover=0.99), cap=3)[1].sum(1)
    assert capped.max() == 3 and torch.equal(candidate_set(logq, Rule(cover=0.99, cover_max=2))[1].sum(1),
                                             torch.full((6,), 2))
    assert torch.equal(candidate_set(logq, Rule(topk=4))[0], logq.topk(4, -1).indices)
    assert candidate_set(logq, Rule())[1].all() and candidate_set(logq, Rule())[0].shape == (6, 16)


def test_bad_rules_are_one_paragraph_errors():
    for kw, word in ((dict(topk=3, cover=0.9), "topk=3 and cover=0.9"), (dict(cover=0.0), "cover=0.0"),
                     (dict(cover=1.5), "cover=1.5"), (dict(cover=0.9, cover_max=0), "cover_max=0"),
                     (dict(topk=0), "topk=0"), (dict(cover=0.9, tail_samples=0), "tail_samples=0"),
                     (dict(topk=True), "topk=True")):
        with pytest.raises(LmcalError, match=word.replace("(", r"\(")):
            make_rule(**kw)
    assert make_rule(tail_samples=0).exact  # exact mode draws nothing


def test_masked_candidates_are_the_unmasked_ones(oracle, text):
    lm, _ = oracle
    logp, state, _ = after(lm, text[:4])
    cand = torch.randint(0, 16, (6, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.rand(6, 5, generator=torch.Generator().manual_seed(1)) < 0.6
    full = candidate_entropies(lm, state, cand, 0.0, chunk=4)
    got = candidate_entropies(lm, state, cand, 0.0, chunk=4, mask=mask)
    torch.testing.assert_close(got[mask], full[mask].to(got.dtype))
    assert (got[~mask] == 0).all()


@pytest.mark.parametrize("rule", RULES[1:])
def test_generation_rows_are_the_law_and_prefill_is_the_steps(oracle, text, rule):
    """CalibratedLM's rows: the rule's candidates at their own tilt, the rest at T(a) = mean_j e^{a H(w_j)} of drawn
    words, normalised; its prefill gives what feeding the prompt step by step gives."""
    lm, _ = oracle
    cal = calibrated(lm, -0.9, seed=2, **rule)
    prompt = text[:6].T  # [6, 6]
    state = cal.init_state(6)
    for i in range(6):
        stepped, state = cal.step(prompt[:, i], state)
    filled, fstate = cal.prefill(prompt, cal.init_state(6))
    torch.testing.assert_close(filled, stepped, rtol=0, atol=0)
    assert torch.equal(fstate[1], state[1]) and torch.equal(fstate[0][0], state[0][0])
    logq, base, keys = after(lm, text[:6])
    h = lookahead_entropies(lm, base, logq)  # [6, V]
    words, mask, logw, hh = law_atoms(lm, base, logq, keys, cal.rule, 2)
    m = cal.rule.draws
    tilt = (-0.9 * hh[:, :m]).exp().mean(1)  # [6]
    want = logq.exp() * tilt[:, None]
    for b in range(6):
        w = words[b, mask[b]]
        want[b, w] = logq[b, w].exp() * (-0.9 * h[b, w]).exp()
    torch.testing.assert_close(stepped.exp(), want / want.sum(1, keepdim=True), rtol=0, atol=1e-12)
    # the tail draws are words of the rest, with their own exact H_next
    for b in range(6):
        own = set(words[b, mask[b]].tolist())
        tail_words = [w for w in range(16) if w not in own]
        for j in range(m):
            assert any(abs(hh[b, j] - h[b, w]) < 1e-12 for w in tail_words)


def test_generation_with_prefill_is_unchanged(oracle, text):
    """generation_entropy_curve feeds the prompt through prefill when a model has one: the same curve as step by
    step (the base model's words are the same; the calibrated law is computed at the prompt's end only)."""
    lm, _ = oracle
    cal = calibrated(lm, -0.6, topk=3, tail_samples=2, seed=1)

    class Stepped:  # the same model without prefill
        vocab_size, init_state, step, select = cal.vocab_size, cal.init_state, cal.step, cal.select

    prefixes = text[:5].T
    a = generation_entropy_curve(cal, prefixes, 8, 2, seed=4)
    b = generation_entropy_curve(Stepped(), prefixes, 8, 2, seed=4)
    assert (a.mean == b.mean).all() and (a.tail == b.tail).all()


def test_coverage_counts_the_rest_of_the_law(oracle, text):
    lm, _ = oracle
    cov = topk_coverage(calibrated(lm, -0.5, cover=0.8, tail_samples=2), text)
    assert 0 < cov["mass_outside_topk"] < 0.5 and 0 < cov["true_word_outside_topk"] < 0.5
    assert 1 < cov["candidates_mean"] < 16
    exact = topk_coverage(calibrated(lm, -0.5), text)
    assert (exact["mass_outside_topk"], exact["true_word_outside_topk"], exact["candidates_mean"]) == (0.0, 0.0, 16)


def test_rule_shift_is_the_laws_expected_entropy(oracle, text):
    """rule_shift: E_{P_a}[H_next] - E_q[H_next] of each rule's law over the exact H_next, brute force; a top-k that
    holds every word and cover 1 give the exact shift."""
    lm, _ = oracle
    logq, base, keys = after(lm, text[:7])
    h = lookahead_entropies(lm, base, logq)  # [6, 16]
    a = -0.7
    exact = ((logq + a * h).softmax(-1) * h).sum(-1) - (logq.exp() * h).sum(-1)
    torch.testing.assert_close(rule_shift(logq, h, keys, Rule(), a, 0), exact, rtol=0, atol=1e-12)
    torch.testing.assert_close(rule_shift(logq, h, keys, Rule(topk=16), a, 0), exact, rtol=0, atol=1e-12)
    torch.testing.assert_close(rule_shift(logq, h, keys, Rule(cover=1.0), a, 0), exact, rtol=0, atol=1e-12)
    r = Rule(topk=2, tail_samples=3)
    law = law_log_probs(logq, law_atoms(lm, base, logq, keys, r, 5), a, 3).exp()
    torch.testing.assert_close(rule_shift(logq, h, keys, r, a, 5), (law * h).sum(-1) - (logq.exp() * h).sum(-1),
                               rtol=0, atol=1e-12)
    assert (rule_shift(logq, h, keys, Rule(), 0.0, 0).abs() < 1e-12).all()


def test_hnext_shifts_along_the_models_own_generations(oracle, text):
    """hnext_shifts generates with the base model as generation_entropy_curve does (the same words) and measures the
    shifts at the chosen steps: exact against each rule, every H_next exact."""
    lm, _ = oracle
    prefixes = text[:4].T  # [6, 4]
    rules = [Rule(topk=2, tail_samples=3), Rule(cover=1.0)]
    out = hnext_shifts(lm, prefixes, 6, [2, 5], rules, [-0.5, -1.5], seed=7)
    assert out["exact"].shape == out["top-2"].shape == (2, 12)
    torch.testing.assert_close(out["cover 1"], out["exact"], rtol=0, atol=1e-12)
    assert out["candidates"]["top-2"] == 2 and out["candidates"]["cover 1"] == 16
    # brute force at step 5 of generation 3: replay its words with the same uniforms
    curve = generation_entropy_curve(lm, prefixes, 6, 1, seed=7, keep=6)
    words = torch.as_tensor(curve.kept)  # [6, 5]
    logq, base, _ = after(lm, torch.cat([prefixes.T, words[:, :4].T]))
    h = lookahead_entropies(lm, base, logq)
    want = ((logq - 1.5 * h).softmax(-1) * h).sum(-1) - (logq.exp() * h).sum(-1)
    torch.testing.assert_close(out["exact"][1, 6:], want, rtol=0, atol=1e-12)
    assert (out["exact"][1] < 0).all() and (out["exact"][1] < out["exact"][0]).all()  # a < 0 lowers E[H_next]
    tok, _ = draw(logq.exp(), uniforms(7, torch.arange(6), 4))
    assert torch.equal(tok, words[:, 4]) and entropy(logq).shape == (6,)


DOSE_KEYS = {"rule", "settings", "multiple", "alpha", "tail_nats", "tail_stderr_nats", "tail_diff_nats",
             "tail_diff_stderr_nats", "vs_first_nats", "vs_first_stderr_nats", "test_ce_nats", "test_ce_diff_nats",
             "test_ce_diff_stderr_nats", "candidates_mean", "generation_seconds", "seconds",
             "tail_nats_per_generation"}


def test_calibration_stage_dose_response_and_approximation(oracle, tmp_path):
    """The stage's dose-response: a row per (multiple, rule) with its keys, each the generating law's (its test CE
    is what the calibrated StepLM scores), the main law's row at a* the stage's own generations; the approximation
    table: exact lookahead keeps all of its own shift."""
    from lmcal.core.entropy_rate import clustered_mean
    from lmcal.core.sampling import random_prefixes
    from lmcal.stages import run_stage, target

    lm, chain = oracle
    valid = torch.from_numpy(sample_markov(chain.probs, 16, 1, 900, 5))
    test = torch.from_numpy(sample_markov(chain.probs, 16, 1, 300, 6))
    rules = [{"topk": 3, "tail_samples": 2}, {"cover": 0.8, "tail_samples": 2}, {"topk": None}]
    r = run_stage("calibration", target(lm, valid=valid, test=test),
                  dict(fit_tokens=600, fit_streams=4, min_context=5, topk=3, tail_samples=2, score_streams=3,
                       num_prefixes=6, samples_per_prefix=2, prefix_len=4, horizon=10, seed=1,
                       approximation={"generations": 4, "steps": 3},
                       dose_response={"multiples": [1, 3], "rules": rules, "num_prefixes": 6,
                                      "samples_per_prefix": 2, "score_tokens": 150}), tmp_path)
    dr, ap = r["dose_response"], r["approximation"]
    assert [(x["multiple"], x["rule"]) for x in dr["rows"]] == [(k, lab) for lab in ("top-3", "cover 0.8", "exact")
                                                                for k in (1, 3)]
    assert all(set(x) >= DOSE_KEYS for x in dr["rows"]) and dr["generations"] == 12 and dr["test_tokens"] == 49 * 3
    main = dr["rows"][0]
    assert main["alpha"] == r["alpha"] and main["tail_diff_nats"] == r["tail_diff_nats"]  # the stage's generations
    assert dr["rows"][0]["vs_first_nats"] == 0.0 and dr["rows"][4]["candidates_mean"] == 16
    dose_test = batchify(test[:150], 3)
    for x in dr["rows"]:
        rule = {k: v for k, v in x["settings"].items() if v is not None}
        cal = calibrated(lm, x["alpha"], seed=1, **rule)
        assert x["test_ce_nats"] == pytest.approx(score(cal, dose_test)[0], abs=1e-9)
        assert x["test_ce_diff_nats"] == pytest.approx(x["test_ce_nats"] - score(lm, dose_test)[0], abs=1e-9)
        assert x["test_ce_diff_stderr_nats"] > 0
    # a row from its own generations: the cover rule at 3 alpha*, paired with the plain ones
    prefixes = random_prefixes(valid, 6, 4, seed=1)
    x = dr["rows"][3]
    curve = generation_entropy_curve(calibrated(lm, x["alpha"], cover=0.8, tail_samples=2, seed=1), prefixes, 10, 2,
                                     seed=1)
    plain = generation_entropy_curve(lm, prefixes, 10, 2, seed=1)
    assert x["tail_diff_nats"] == pytest.approx(float(clustered_mean(curve.tail - plain.tail)[0]), abs=1e-12)
    first = np.asarray(dr["rows"][1]["tail_nats_per_generation"])  # top-3 at 3 alpha*
    assert x["vs_first_nats"] == pytest.approx(float(clustered_mean(curve.tail - first)[0]), abs=1e-12)
    assert [row["rule"] for row in ap["rows"]] == ["exact", "top-3", "cover 0.8"]
    assert ap["positions"] == 4 * 3 and ap["steps"] == [3, 7, 10] and ap["rows"][0]["kept"] == pytest.approx([1, 1])
    assert ap["rows"][0]["lost_nats"] == [0.0, 0.0] and ap["rows"][1]["candidates_mean"] == 3
    assert ap["rows"][0]["mass_mean"] == 1.0 and 0 < ap["rows"][1]["mass_mean"] < ap["rows"][2]["mass_mean"] < 1
    assert ap["rows"][2]["mass_mean"] >= 0.8 - 1e-9  # the covering rule holds its share at every position
    assert ap["rows"][0]["shift_nats"][1] < ap["rows"][0]["shift_nats"][0] < 0 or r["alpha"] > 0
    assert (tmp_path / "calibration_dose_response.png").stat().st_size > 1000
    md = (tmp_path / "calibration_dose_response.md").read_text()
    assert "| 3α* = " in md and "kept at α*" in md


@pytest.mark.gpu
def test_the_law_on_cuda_is_the_cpus():
    """The calibrated law's rows, its fitted CE and the noise-free shifts on CUDA against the CPU: the same candidates
    and draws, entropies to float rounding."""
    from lmcal.models.awd_lstm import AWDLSTM
    from lmcal.models.step_lm import LSTMStepLM

    torch.manual_seed(0)
    net = AWDLSTM(vocab_size=1000, emb_size=64, hidden_size=128, num_layers=3).eval()
    with torch.no_grad():
        net.encoder.weight.mul_(8.0)  # peaked rows: candidate sets of varied sizes
    text = torch.randint(0, 1000, (12, 4), generator=torch.Generator().manual_seed(1))
    out = {}
    for device in ("cpu", "cuda"):
        lm = LSTMStepLM(net.to(device))
        rows = []
        for rule in (dict(topk=16), dict(cover=0.9, cover_max=300), dict()):
            cal = calibrated(lm, -0.4, seed=3, **rule)
            state = cal.init_state(4)
            for t in range(5):
                logp, state = cal.step(text[t], state)
            rows.append(logp.cpu())
            rows.append(torch.tensor([fit_lookahead_calibration(lm, text, make_rule(**rule), seed=3).ce_at(-0.4)]))
        shifts = hnext_shifts(lm, text[:3].T, 4, [2, 4], [Rule(topk=8, tail_samples=4)], [-0.4], seed=2)
        out[device] = rows + [shifts["exact"], shifts["top-8"]]
    for a, b in zip(out["cpu"], out["cuda"], strict=True):
        torch.testing.assert_close(a.double(), b.double(), atol=2e-4, rtol=1e-4)


def test_the_dose_figure_reads_multiples_of_a_negative_alpha_left_to_right(tmp_path):
    """α* < 0 (the cpu profile's PTB model: -0.0326): the figure's axis is α / α*, so 1α*, 3α*, 10α* run left to
    right; a row from another run, without its multiple, is placed by its α over this α*."""
    from lmcal.stages.dose_response import _multiple, dose_figure

    dr = {"alpha": -0.03, "rows": []}
    for rule in ("top-16", "top-256"):
        for m in (1, 3, 10):
            dr["rows"].append({"rule": rule, "multiple": m, "alpha": -0.03 * m, "tail_diff_nats": -0.1 * m,
                               "tail_diff_stderr_nats": 0.05, "test_ce_diff_nats": 0.001 * m,
                               "test_ce_diff_stderr_nats": 0.001})
    assert [_multiple(r, dr) for r in dr["rows"][:3]] == [1.0, 3.0, 10.0]
    assert _multiple({"alpha": -0.09}, dr) == pytest.approx(3.0)
    assert dose_figure(dr, tmp_path / "dose.png").read_bytes()[:4] == b"\x89PNG"
