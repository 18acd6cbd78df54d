"""Decoders as StepLM wrappers: each rule against its definition (hand-made rows, ties, one-hot rows, and a plain
reference implementation on random rows), the neutral settings, Mirostat's control loop, the fitted temperature and
the held-out cost."""

import math

import numpy as np
import pytest
import torch

from lmcal.core.calibration import fit_temperature, score
from lmcal.core.decoders import (
    DECODERS,
    eta,
    heldout_cost,
    make_decoder,
    min_p,
    mirostat_cut,
    temperature,
    top_k,
    top_p,
    typical,
)
from lmcal.core.entropy_rate import generation_entropy_curve
from lmcal.core.sampling import random_prefixes
from lmcal.data.batching import batchify
from lmcal.data.markov import make_markov_chain, markov_entropy_rate, sample_markov
from lmcal.errors import LmcalError
from lmcal.models.oracles import MarkovOracle

from .test_calibration import TinyLSTM


def rows(*probs):
    """float64 log-probs [B, V] of the given probability rows."""
    return torch.tensor(probs, dtype=torch.float64).log()


def probs(logp):
    return logp.exp()


def close(a, b):
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=torch.float64).expand_as(a), atol=1e-12, rtol=0)


DYADIC = (0.5, 0.25, 0.125, 0.125)  # entropy 1.75 bits; surprisals 1, 2, 3, 3 bits


def test_temperature_on_a_hand_made_row():
    out = probs(temperature(rows((0.5, 0.3, 0.2)), 2.0))
    s = [math.sqrt(x) for x in (0.5, 0.3, 0.2)]
    close(out, [[x / sum(s) for x in s]])
    close(probs(temperature(rows((0.5, 0.3, 0.2)), 1e-3)), [[1.0, 0.0, 0.0]])  # T -> 0: greedy


def test_top_k_with_ties():
    close(probs(top_k(rows((0.4, 0.3, 0.2, 0.1)), 2)), [[4 / 7, 3 / 7, 0, 0]])
    close(probs(top_k(rows((0.4, 0.3, 0.15, 0.15)), 3)), [[0.4, 0.3, 0.15, 0.15]])  # tied with the 3rd: kept
    close(probs(top_k(rows((0.4, 0.3, 0.15, 0.15)), 2)), [[4 / 7, 3 / 7, 0, 0]])


def test_top_p_smallest_set_and_ties():
    r = rows((0.5, 0.3, 0.15, 0.05))
    close(probs(top_p(r, 0.7)), [[0.625, 0.375, 0, 0]])
    close(probs(top_p(r, 0.9)), [[0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0]])
    close(probs(top_p(r, 0.4)), [[1, 0, 0, 0]])  # the most likely word alone has mass >= p
    close(probs(top_p(rows((0.4, 0.2, 0.2, 0.2)), 0.5)), [[0.4, 0.2, 0.2, 0.2]])  # the cut falls in a tie: all kept
    close(probs(top_p(rows((0.2, 0.4, 0.2, 0.2)), 0.3)), [[0, 1, 0, 0]])


def test_typical_sets_closest_to_the_entropy():
    r = rows(DYADIC)  # |surprisal - H| in bits: 0.75, 0.25, 1.25, 1.25
    close(probs(typical(r, 0.2)), [[0, 1, 0, 0]])
    close(probs(typical(r, 0.7)), [[2 / 3, 1 / 3, 0, 0]])
    close(probs(typical(r, 0.8)), [DYADIC])  # the third word is needed and ties with the fourth
    close(probs(typical(rows((0.25,) * 4), 0.3)), [[0.25] * 4])  # uniform: every word is equally typical


def test_eta_and_min_p_thresholds():
    r = rows(DYADIC)  # exp(-H) = 2 ** -1.75 = 0.297
    close(probs(eta(r, 0.1)), [DYADIC])  # eta = min(0.1, 0.316 * 0.297 = 0.094) < 0.125: nothing cut
    close(probs(eta(r, 0.2)), [[2 / 3, 1 / 3, 0, 0]])  # eta = min(0.2, 0.133) > 0.125
    close(probs(eta(r, 0.9)), [[1, 0, 0, 0]])
    close(probs(min_p(r, 0.26)), [[2 / 3, 1 / 3, 0, 0]])  # cut at 0.13
    close(probs(min_p(r, 0.6)), [[1, 0, 0, 0]])
    close(probs(min_p(r, 0.2)), [DYADIC])


def test_mirostat_truncation_in_bits():
    r = rows(DYADIC, DYADIC, DYADIC)
    out = probs(mirostat_cut(r, torch.tensor([2.5, 1.5, 0.2])))
    close(out[0:1], [[2 / 3, 1 / 3, 0, 0]])
    close(out[1:3], [[1, 0, 0, 0], [1, 0, 0, 0]])  # below the top word's surprisal: it alone is kept


@pytest.mark.parametrize("rule,param", [(top_k, 2), (top_p, 0.5), (typical, 0.5), (eta, 0.3), (min_p, 0.5),
                                        (temperature, 0.7)])
def test_all_mass_on_one_word(rule, param):
    r = rows((0.0, 1.0, 0.0), (1e-30, 1 - 2e-30, 1e-30))
    out = probs(rule(r, param))
    close(out, [[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]] if rule is not temperature else out)
    assert out[:, 1].min() > 1 - 1e-12 and torch.isfinite(rule(r, param)[:, 1]).all()


# A plain reference of each definition: sort, walk, cut; word by word in Python.

def ref_smallest_set(p, key, mass):
    order = sorted(range(len(p)), key=key)
    kept, total = [], 0.0
    for i in order:
        if total >= mass:
            break
        kept.append(i)
        total += p[i]
    last = key(kept[-1])
    return {i for i in range(len(p)) if key(i) <= last}  # ties with the last word taken


def reference(name, p, param):
    V = len(p)
    H = -sum(x * math.log(x) for x in p if x > 0)
    if name == "top_k":
        kth = sorted(p, reverse=True)[param - 1]
        keep = {i for i in range(V) if p[i] >= kth}
    elif name == "top_p":
        keep = ref_smallest_set(p, lambda i: -p[i], param)
    elif name == "typical":
        keep = ref_smallest_set(p, lambda i: abs(-math.log(p[i]) - H) if p[i] > 0 else math.inf, param)
    elif name == "eta":
        keep = {i for i in range(V) if p[i] >= min(param, math.sqrt(param) * math.exp(-H))}
    elif name == "min_p":
        keep = {i for i in range(V) if p[i] >= param * max(p)}
    z = sum(p[i] for i in keep)
    return [p[i] / z if i in keep else 0.0 for i in range(V)]


# (masses with many digits: a mass that equals a partial sum exactly would test the rounding of the sums)
@pytest.mark.parametrize("name,params", [("top_k", [1, 3, 7]), ("top_p", [0.3137, 0.8071, 0.9453]),
                                         ("typical", [0.2137, 0.6071, 0.9453]), ("eta", [0.01, 0.05, 0.2]),
                                         ("min_p", [0.05, 0.3, 0.7])])
def test_rules_match_a_plain_reference_on_random_rows(name, params):
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 6, (40, 12), generator=g).double()  # small integers: plenty of ties
    counts[:, 0] += 1
    counts[:20] = counts[:20] ** 3  # and some peaked rows
    p = counts / counts.sum(-1, keepdim=True)
    logp = p.log()
    rule = DECODERS[name][0]
    for param in params:
        got = probs(rule(logp, param))
        want = torch.tensor([reference(name, row.tolist(), param) for row in p], dtype=torch.float64)
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


NEUTRAL = {"temperature": {"temperature": 1.0}, "top_k": {"k": 13}, "top_p": {"p": 1.0}, "typical": {"mass": 1.0},
           "eta": {"eta_cutoff": 0.0}, "min_p": {"min_p": 0.0},
           "mirostat": {"target_surprise": math.inf, "learning_rate": 0.1}}


@pytest.mark.parametrize("name", list(DECODERS))
def test_neutral_setting_is_the_model_exactly(name):
    lm = TinyLSTM()
    dec = make_decoder(name, lm, **NEUTRAL[name])
    text = torch.randint(0, lm.vocab_size, (6, 4), generator=torch.Generator().manual_seed(3))
    s0, s1 = lm.init_state(4), dec.init_state(4)
    for t in range(6):
        ref, s0 = lm.step(text[t], s0)
        out, s1 = dec.step(text[t], s1)
        assert torch.equal(out, ref)
    assert score(dec, text) == score(lm, text)


def test_decoders_are_normalised_step_lms_that_generate():
    lm = TinyLSTM()
    prefixes = torch.randint(0, lm.vocab_size, (3, 4), generator=torch.Generator().manual_seed(4))
    for name in DECODERS:
        dec = make_decoder(name, lm, **({"target_surprise": 2.0} if name == "mirostat" else {}))
        a = generation_entropy_curve(dec, prefixes, horizon=5, samples_per_prefix=4, seed=1)
        b = generation_entropy_curve(dec, prefixes, horizon=5, samples_per_prefix=4, seed=1, max_batch=4)
        assert a.mean.shape == (5,) and (a.mean >= 0).all()
        torch.testing.assert_close(torch.from_numpy(a.mean), torch.from_numpy(b.mean))  # select() keeps mu per row
        logp, _ = dec.step(prefixes[:, 0], dec.init_state(3))
        torch.testing.assert_close(logp.logsumexp(-1), torch.zeros(3))


def test_bad_names_and_parameters_are_clear_errors():
    lm = TinyLSTM()
    with pytest.raises(LmcalError, match="Unknown decoder"):
        make_decoder("nucleus", lm)
    with pytest.raises(LmcalError, match="takes p= only"):
        make_decoder("top_p", lm, k=3)
    for name, params in [("top_p", {"p": 0}), ("top_k", {"k": 2.5}), ("temperature", {"temperature": -1}),
                         ("typical", {"mass": 1.5}), ("min_p", {"min_p": 2}), ("mirostat", {"target_surprise": 0})]:
        with pytest.raises(LmcalError, match="out of range"):
            make_decoder(name, lm, **params)


def test_mirostat_running_surprise_converges_to_its_target_on_the_markov_oracle():
    chain = make_markov_chain(vocab_size=16, order=2, seed=0)
    oracle = MarkovOracle.from_chain(chain)
    target, lr, B, T = 1.0, 0.1, 256, 300  # bits; the oracle's own entropy rate is ~1.3 bits
    dec = make_decoder("mirostat", oracle, target_surprise=target, learning_rate=lr)
    state = dec.init_state(B)
    tokens = torch.from_numpy(sample_markov(chain.probs, 16, 2, B, 0))  # stationary starting words
    g = torch.Generator().manual_seed(5)
    surprises, mus = [], []
    for _ in range(T):
        logp, state = dec.step(tokens, state)
        if state[3] is not None:
            surprises.append(state[3])
        mus.append(state[1])
        tokens = torch.multinomial(logp.exp(), 1, generator=g)[:, 0]
    s = torch.stack(surprises)  # [T-1, B] bits: surprise of each sampled word under the model
    late = s[T // 2:].mean().item()
    se = s[T // 2:].mean(0).std().item() / math.sqrt(B)
    assert abs(late - target) < max(0.03, 4 * se)
    assert abs(s[:10].mean().item() - target) > abs(late - target)  # mu starts at 2 tau: it had to converge
    mu = torch.stack(mus)
    assert mu[T // 2:].mean() < 2 * target and torch.isfinite(mu).all()
    # and its generations keep a lower entropy than the source's own
    prefixes = random_prefixes(torch.from_numpy(sample_markov(chain.probs, 16, 2, 2000, 1)), 8, 20)
    curve = generation_entropy_curve(dec, prefixes, horizon=60, samples_per_prefix=8)
    assert curve.mean[30:].mean() < markov_entropy_rate(chain.probs, 16, 2) - 0.1


def markov_streams(chain, n, seed, streams=50):
    return batchify(torch.from_numpy(sample_markov(chain.probs, chain.vocab_size, chain.order, n, seed)), streams)


def test_fitted_temperature_exact_checks():
    chain = make_markov_chain(vocab_size=8, order=2, seed=0)
    oracle = MarkovOracle.from_chain(chain)
    text = markov_streams(chain, 20_000, seed=2)
    fit = fit_temperature(oracle, text)  # the truth needs no temperature
    assert abs(fit.temperature - 1) < 3 * fit.temperature_stderr
    assert fit.ce_before - fit.ce_after < 1e-3
    sharp = make_decoder("temperature", oracle, temperature=0.5)  # the truth squared: T* = 2 undoes it
    fit = fit_temperature(sharp, text)
    assert abs(fit.temperature - 2) < 3 * fit.temperature_stderr and fit.temperature_stderr < 0.1
    assert fit.ce_after < fit.ce_before


def test_fitted_temperature_objective_matches_direct_scoring():
    lm = TinyLSTM()
    text = torch.randint(0, lm.vocab_size, (14, 5), generator=torch.Generator().manual_seed(1))
    fit = fit_temperature(lm, text)
    assert fit.n_tokens == 13 * 5
    assert fit.ce_before == pytest.approx(score(lm, text)[0], abs=1e-6)
    assert fit.ce_after == pytest.approx(score(make_decoder("temperature", lm, temperature=fit.temperature), text)[0],
                                         abs=1e-6)
    for T in (0.5, 0.9, 1.7):  # the fit is the minimum of the directly scored CE(T)
        assert score(make_decoder("temperature", lm, temperature=T), text)[0] > fit.ce_after
    d = 1e-3
    around = [score(make_decoder("temperature", lm, temperature=fit.temperature * (1 + s)), text)[0] for s in (-d, d)]
    assert min(around) >= fit.ce_after - 1e-7


def test_heldout_cost_counts_zero_probability_words():
    lm = TinyLSTM()
    text = torch.randint(0, lm.vocab_size, (30, 4), generator=torch.Generator().manual_seed(2))
    plain = heldout_cost(lm, text)
    assert plain["zero_prob_fraction"] == 0 and plain["test_ce_nats"] == pytest.approx(score(lm, text)[0])
    assert plain["test_ce_mixed_nats"] == pytest.approx(plain["test_ce_nats"], abs=1e-5)
    greedy = make_decoder("top_k", lm, k=1)
    cost = heldout_cost(greedy, text, mix_epsilon=1e-6)
    # the words that are each step's argmax are kept, with probability 1; every other word costs -log(eps / V)
    state, hits = lm.init_state(4), []
    for t in range(29):
        logp, state = lm.step(text[t], state)
        hits.append(logp.argmax(-1) == text[t + 1])
    hit = torch.cat(hits).double().mean().item()
    assert cost["test_ce_nats"] is None and cost["zero_prob_fraction"] == pytest.approx(1 - hit)
    assert cost["test_ce_kept_nats"] == pytest.approx(0.0, abs=1e-6)
    want = hit * -math.log(1 - 1e-6 + 1e-6 / lm.vocab_size) + (1 - hit) * -math.log(1e-6 / lm.vocab_size)
    assert cost["test_ce_mixed_nats"] == pytest.approx(want, rel=1e-6)


def test_mirostat_starts_each_generation_from_two_tau():
    """However far mu drifted along the prompt, the first generated word is cut at mu = 2 tau."""
    from lmcal.core.lookahead import entropy

    lm = TinyLSTM()
    # a low target: mu falls fast along the prompt
    dec = make_decoder("mirostat", lm, target_surprise=0.5, learning_rate=1.0)
    prefixes = torch.randint(0, lm.vocab_size, (4, 12), generator=torch.Generator().manual_seed(6))
    state, base = dec.init_state(4), lm.init_state(4)
    for i in range(12):
        _, state = dec.step(prefixes[:, i], state)
        logp, base = lm.step(prefixes[:, i], base)
    assert (state[1] < 1.0).all()  # drifted below 2 tau along the prompt
    want = entropy(mirostat_cut(logp, torch.full((4,), 1.0))).double()  # [4]
    curve = generation_entropy_curve(dec, prefixes, horizon=3, samples_per_prefix=2)
    assert curve.mean[0] == pytest.approx(want.mean().item(), abs=1e-6)


@pytest.mark.parametrize("name", list(DECODERS))
def test_rules_on_blocks_of_rows_are_the_rules_on_the_whole_batch(name, monkeypatch):
    """The StepLMs apply each rule to blocks of rows on the CPU (lmcal.core.decoders.by_rows): the same bit for bit, and
    the same generations, as on the whole batch at once."""
    import lmcal.core.decoders as D

    lm = TinyLSTM()
    params = {"temperature": {"temperature": 0.7}, "top_k": {"k": 5}, "top_p": {"p": 0.8}, "typical": {"mass": 0.8},
              "eta": {"eta_cutoff": 0.01}, "min_p": {"min_p": 0.1},
              "mirostat": {"target_surprise": 2.0, "learning_rate": 0.5}}[name]
    prefixes = torch.randint(0, lm.vocab_size, (6, 5), generator=torch.Generator().manual_seed(3))
    whole = generation_entropy_curve(make_decoder(name, lm, **params), prefixes, horizon=6, samples_per_prefix=3)
    monkeypatch.setattr(D, "CPU_CHUNK", 2 * lm.vocab_size)  # blocks of 2 rows, a short last one
    blocks = generation_entropy_curve(make_decoder(name, lm, **params), prefixes, horizon=6, samples_per_prefix=3)
    assert np.array_equal(blocks.per_prefix, whole.per_prefix)
    logp = torch.randn(7, 11, dtype=torch.float64).log_softmax(-1)
    rule = DECODERS[name][0] or mirostat_cut
    extra = (torch.full((7,), 1.5, dtype=torch.float64),) if name == "mirostat" else ()
    call = (lambda lp, *a: rule(lp, *a)) if name == "mirostat" else (lambda lp: rule(lp, **params))
    assert torch.equal(D.by_rows(call, logp, *extra), call(logp, *extra))


def test_the_stage_writes_one_row_per_method_paired_with_the_plain_model(tmp_path):
    """run_stage("decoders", ...) on the Markov oracle: the plain model first, each method, the fitted temperature;
    the plain row is paired with itself (a difference of 0), and its record, table and figure are written."""
    import json

    from lmcal.stages import run_stage, target

    chain = make_markov_chain(vocab_size=8, order=1, support=3, smoothing=0.05, seed=1)
    text = torch.from_numpy(sample_markov(chain.probs, 8, 1, 3000, 2))
    settings = {"methods": [{"name": "top_k", "k": 2}], "fitted": ["temperature"], "num_prefixes": 3,
                "samples_per_prefix": 2, "prefix_len": 5, "horizon": 10, "fit_tokens": 1000, "fit_streams": 5,
                "score_tokens": 300, "score_streams": 3}
    t = target(MarkovOracle.from_chain(chain), valid=text[:2000], test=text[2000:], name="oracle", corpus="markov")
    r = run_stage("decoders", t, settings, tmp_path)
    assert [x["method"] for x in r["rows"]] == ["model", "top_k", "fitted_temperature"]
    assert r["rows"][0]["tail_diff_nats"] == 0 and r["reference_test_ce_nats"] == r["rows"][0]["test_ce_nats"]
    assert r["rows"][1]["test_ce_nats"] is None and r["rows"][1]["zero_prob_fraction"] > 0  # top-2 of 3 words
    assert not r["calibration_reused"] and json.loads((tmp_path / "decoders.json").read_text()) == r
    assert "| top_k | k=2 |" in (tmp_path / "decoders.md").read_text()
    assert (tmp_path / "decoders.png").stat().st_size > 1000
    with pytest.raises(LmcalError, match=r"analysis\.decoders\.calibration_json=.*no\.json does not exist"):
        run_stage("decoders", t, {**settings, "calibration_json": str(tmp_path / "no.json")}, tmp_path / "x")
    with pytest.raises(LmcalError, match="A decoder needs a name"):
        run_stage("decoders", t, {**settings, "methods": [{"p": 0.9}]}, tmp_path / "x")
    assert not (tmp_path / "x").exists()
