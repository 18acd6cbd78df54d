"""Generation entropy curves against exact truths: flat for the Markov oracle, the closed form for the drifting one."""

import math

import numpy as np
import pytest
import torch

from lmcal.core.entropy_rate import (
    EntropyCurve,
    clustered_mean,
    entrate_ppl,
    generation_entropy_curve,
    paired_difference_curve,
    paired_tail_difference,
    tail_steps,
)
from lmcal.core.sampling import draw, random_prefixes, spread_windows, uniforms
from lmcal.data import markov as MK
from lmcal.models.awd_lstm import AWDLSTM
from lmcal.models.oracles import DriftingOracle, MarkovOracle
from lmcal.models.step_lm import LSTMStepLM


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


def test_spread_windows_tile_the_stream_with_disjoint_continuations_while_it_holds_them():
    stream = torch.arange(1000)
    p, c, disjoint = spread_windows(stream, 9, 100, 100)  # (1000 - 100) // 100 = 9 disjoint continuations
    assert disjoint and p.shape == (9, 100) and c.shape == (9, 100)
    assert torch.equal(torch.cat([p, c], 1), p[:, :1] + torch.arange(200))  # contiguous windows
    assert p[0, 0] == 0 and c[-1, -1] == 999  # from the stream's first token to its last
    assert (c[1:, 0] > c[:-1, -1]).all()  # no word in two continuations
    p, c, disjoint = spread_windows(stream, 10, 100, 100)  # one more than the stream holds
    assert not disjoint and (c[1:, 0] <= c[:-1, -1]).any() and c[-1, -1] == 999
    assert spread_windows(stream, 1, 100, 100)[2] and spread_windows(stream, 1, 100, 100)[0][0, 0] == 0
    with pytest.raises(ValueError, match="cannot cut"):
        spread_windows(stream, 3, 500, 501)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_two_level_draw_is_the_exact_inverse_cdf(dtype):
    """`draw` maps a fine grid of uniforms onto each word in proportion to its probability (three full blocks and a
    short one), never onto a zero-probability word, not even at u just below 1 or in an all-zero block."""
    g = torch.Generator().manual_seed(0)
    V = 3 * 128 + 50
    p = torch.rand(2, V, generator=g, dtype=torch.float64) ** 4
    p[:, ::7] = 0.0  # scattered zeros
    p[1, 128:256] = 0.0  # a whole empty block
    p[:, -1] = 0.0  # the last word, where a clamp would land
    p = (p / p.sum(-1, keepdim=True)).to(dtype)
    n = 200_000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    for row in range(2):
        words, mass = draw(p[row].expand(n, V), u)
        assert mass[0].item() == pytest.approx(1.0, abs=1e-5)
        freq = torch.bincount(words, minlength=V).double() / n
        assert (freq[p[row] == 0] == 0).all()
        assert (freq - p[row].double()).abs().max().item() <= 1.5 / n  # the grid's resolution
        top, _ = draw(p[row][None], torch.tensor([1 - 2**-53], dtype=torch.float64))
        assert p[row, top.item()] > 0
    tiny = torch.tensor([[0.0, 0.3, 0.0, 0.7]], dtype=dtype)  # fewer words than a block
    assert [draw(tiny, torch.tensor([x], dtype=torch.float64))[0].item() for x in (0.0, 0.29, 0.31, 0.999)] == \
        [1, 1, 3, 3]


def test_uniforms_look_uniform_and_independent():
    u = uniforms(0, torch.arange(100_000), 0)
    assert u.dtype == torch.float64 and 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    v = uniforms(0, torch.arange(100_000), 1)
    assert abs(np.corrcoef(u.numpy(), v.numpy())[0, 1]) < 0.02  # next step
    assert abs(np.corrcoef(u[:-1].numpy(), u[1:].numpy())[0, 1]) < 0.02  # next generation
    assert not torch.equal(u, uniforms(1, torch.arange(100_000), 0))  # next seed


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


def test_tail_means_per_generation_and_paired_differences(chain, prefixes):
    lm = DriftingOracle(chain, T=10, noise_vocab=16)
    curve = generation_entropy_curve(lm, prefixes[:30], horizon=25, samples_per_prefix=4, seed=1)
    assert tail_steps(25) == 2 and tail_steps(5) == 1 and curve.tail.shape == (30, 4)
    np.testing.assert_allclose(curve.tail.mean(axis=1), curve.per_prefix[:, -2:].mean(axis=1), rtol=1e-12)
    assert curve.tail_mean == pytest.approx(curve.mean[-2:].mean(), rel=1e-12)
    other = generation_entropy_curve(MarkovOracle.from_chain(chain), prefixes[:30], horizon=25, samples_per_prefix=4,
                                     seed=1)
    diff, se = paired_tail_difference(curve, other)
    d = (curve.tail - other.tail).mean(axis=1)  # [30]: per prefix
    assert diff == pytest.approx(d.mean()) and se == pytest.approx(d.std(ddof=1) / math.sqrt(30))
    assert diff > 5 * se  # the drifting model's tail lies above the oracle's
    assert paired_tail_difference(curve, curve) == (0.0, 0.0)
    mean, se_t = paired_difference_curve(curve, other)
    np.testing.assert_allclose(mean, curve.mean - other.mean, atol=1e-12)
    np.testing.assert_allclose(se_t, (curve.per_prefix - other.per_prefix).std(axis=0, ddof=1) / math.sqrt(30))
    with pytest.raises(ValueError, match="unpaired"):
        paired_tail_difference(curve, generation_entropy_curve(lm, prefixes[:30], horizon=25, samples_per_prefix=2))


def test_clustered_mean_closed_form():
    x = np.array([[1.0, 3.0], [2.0, 6.0], [0.0, 0.0]])  # [N=3 prefixes, S=2]: prefix means 2, 4, 0
    mean, se = clustered_mean(x)
    assert mean == pytest.approx(2.0) and se == pytest.approx(2.0 / math.sqrt(3))  # std(2, 4, 0) = 2
    mean, se = clustered_mean(x[:1])  # one prefix: its generations 1, 3
    assert mean == pytest.approx(2.0) and se == pytest.approx(math.sqrt(2) / math.sqrt(2))
    assert np.isnan(clustered_mean(x[:1, :1])[1])
    one = EntropyCurve(np.zeros(3), np.zeros(3), 1, 1, 1, np.zeros((1, 3)), np.zeros((1, 1)))
    assert np.isnan(paired_tail_difference(one, one)[1])


def test_generation_builds_no_autograd_graph(prefixes):
    """Generation runs under no_grad: a network's steps along 200-word generations would otherwise chain their
    graphs through the state (time and memory growing with the horizon)."""
    torch.manual_seed(0)
    lm = LSTMStepLM(AWDLSTM(vocab_size=16, emb_size=8, hidden_size=12, num_layers=3))
    seen, step = [], lm.step
    lm.step = lambda tokens, state: (seen.append(torch.is_grad_enabled()), step(tokens, state))[1]
    generation_entropy_curve(lm, prefixes[:3], horizon=4, samples_per_prefix=2)
    assert seen and not any(seen)
