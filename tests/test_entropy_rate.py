"""Generation entropy curves against exact truths: flat for the Markov oracle, the closed form for the drifting one."""

import math

import numpy as np
import pytest
import torch

from lmcal import markov as MK
from lmcal.entropy_rate import _uniforms, entrate_ppl, generation_entropy_curve, random_prefixes
from lmcal.lm import LSTMStepLM
from lmcal.markov import DriftingOracle, MarkovOracle
from lmcal.model import AWDLSTM


@pytest.fixture(scope="module")
def corpus():
    return MK.markov_corpus(n_train=10, n_valid=20_000, n_test=10)  # the default order-2 chain over 16 tokens


@pytest.fixture(scope="module")
def chain(corpus):
    return MK.markov_chain_from_info(corpus.info)


@pytest.fixture(scope="module")
def prefixes(corpus):
    return random_prefixes(corpus.valid, num_prefixes=200, prefix_len=10, seed=0)  # [200, 10]


def test_random_prefixes_are_seeded_distinct_windows():
    stream = torch.arange(100)
    p = random_prefixes(stream, 30, 8, seed=3)
    assert p.shape == (30, 8) and torch.equal(p, p[:, :1] + torch.arange(8))  # contiguous windows
    assert p[:, 0].unique().numel() == 30 and p[:, 0].max() <= 92  # distinct starts, all windows inside
    assert torch.equal(p, random_prefixes(stream, 30, 8, seed=3))
    assert not torch.equal(p, random_prefixes(stream, 30, 8, seed=4))
    assert random_prefixes(stream, 500, 8).shape == (500, 8)  # more than there are: with replacement


def test_uniforms_look_uniform_and_independent():
    u = _uniforms(0, torch.arange(100_000), 0)
    assert u.dtype == torch.float64 and 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    v = _uniforms(0, torch.arange(100_000), 1)
    assert abs(np.corrcoef(u.numpy(), v.numpy())[0, 1]) < 0.02  # next step
    assert abs(np.corrcoef(u[:-1].numpy(), u[1:].numpy())[0, 1]) < 0.02  # next generation
    assert not torch.equal(u, _uniforms(1, torch.arange(100_000), 0))  # next seed


def test_markov_oracle_curve_is_flat_at_the_entropy_rate(corpus, chain, prefixes):
    curve = generation_entropy_curve(MarkovOracle.from_chain(chain), prefixes, horizon=30, samples_per_prefix=5)
    h = corpus.info["entropy_rate_nats"]
    assert curve.mean.shape == curve.stderr.shape == (30,) and curve.num_generations == 1000
    assert np.all(np.abs(curve.mean - h) < 3 * curve.stderr)
    assert np.all(curve.stderr < 0.05)
    assert entrate_ppl(curve) == pytest.approx(math.exp(curve.mean[-1]))


def test_drifting_oracle_curve_follows_the_closed_form(corpus, chain, prefixes):
    lm = DriftingOracle(chain, T=10, noise_vocab=64)
    curve = generation_entropy_curve(lm, prefixes, horizon=40, samples_per_prefix=5)
    expected = lm.expected_generation_entropy(40, corpus.info["entropy_rate_nats"])
    assert np.all(np.abs(curve.mean - expected) < 3 * curve.stderr)
    assert curve.mean[-1] - curve.mean[0] > 2.0  # the drift is large: from ~h up towards log 64


def test_same_seed_same_curve_other_seed_other_curve(chain, prefixes):
    lm = MarkovOracle.from_chain(chain)
    a = generation_entropy_curve(lm, prefixes[:50], horizon=10, samples_per_prefix=3, seed=1)
    b = generation_entropy_curve(lm, prefixes[:50], horizon=10, samples_per_prefix=3, seed=1)
    c = generation_entropy_curve(lm, prefixes[:50], horizon=10, samples_per_prefix=3, seed=2)
    assert np.array_equal(a.mean, b.mean) and np.array_equal(a.stderr, b.stderr)
    assert a.mean[0] == c.mean[0]  # before any generated word: the prefixes alone
    assert not np.array_equal(a.mean, c.mean)


def test_chunking_does_not_change_the_generations(chain, prefixes):
    # Each generation's uniforms are a function of (seed, generation index, step) only, so any chunking gives the
    # same generations: equal exactly for the oracle, within float tolerance for a net (batch-size rounding).
    lm = DriftingOracle(chain, T=5, noise_vocab=8)
    whole = generation_entropy_curve(lm, prefixes[:40], horizon=12, samples_per_prefix=4)
    for max_batch in (1, 7, 8, 50):  # below, at and across prefix groups of 4
        chunked = generation_entropy_curve(lm, prefixes[:40], horizon=12, samples_per_prefix=4, max_batch=max_batch)
        assert np.array_equal(chunked.per_prefix, whole.per_prefix)
    torch.manual_seed(0)
    net_lm = LSTMStepLM(AWDLSTM(vocab_size=16, emb_size=8, hidden_size=12, num_layers=3))
    whole = generation_entropy_curve(net_lm, prefixes[:20], horizon=8, samples_per_prefix=3)
    chunked = generation_entropy_curve(net_lm, prefixes[:20], horizon=8, samples_per_prefix=3, max_batch=9)
    np.testing.assert_allclose(chunked.per_prefix, whole.per_prefix, rtol=1e-6)


def test_one_prefix_falls_back_to_generation_level_stderr(chain, prefixes):
    lm = MarkovOracle.from_chain(chain)
    curve = generation_entropy_curve(lm, prefixes[:1], horizon=6, samples_per_prefix=200)
    assert np.all(curve.stderr[1:] > 0) and curve.stderr[0] < 1e-12  # word 1: every generation shares the prefix
    assert np.all(np.isnan(generation_entropy_curve(lm, prefixes[:1], horizon=3, samples_per_prefix=1).stderr))
