"""WikiText-2 (from small fixtures: the real files are not needed) and the Markov source with a known truth."""

import json
import math
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from lmcal.data import corpora as D
from lmcal.data import markov as MK
from lmcal.data.batching import load_corpus

# ---------------------------------------------------------------------------------------------------------------------
# WikiText-2
# ---------------------------------------------------------------------------------------------------------------------

# The release's layout: every line starts with a space, headings are " = Title = ", paragraphs are separated by
# blank (" ") lines, rare words are already <unk>, and hyphens are split as @-@.
WT2_TEXT = {
    "wiki.train.tokens": " \n = Title = \n \n the cat @-@ sat <unk> . \n",
    "wiki.valid.tokens": " \n = = Section = = \n the dog sat . \n",
    "wiki.test.tokens": "\n the cat sat \n",
}


def _fake_wikitext2(folder: Path) -> None:
    folder.mkdir(parents=True)
    for name, text in WT2_TEXT.items():
        (folder / name).write_text(text, encoding="utf-8")


def _zip_of(files: dict[str, str], path: Path) -> str:
    with zipfile.ZipFile(path, "w") as zf:
        for name, text in files.items():
            zf.writestr(f"wikitext-2/{name}", text)
    return D.md5(path)


def test_wikitext2_tokenised_like_ptb_with_an_eos_per_line(tmp_path):
    _fake_wikitext2(tmp_path / "wikitext-2")
    c = D.load_wikitext2(tmp_path, check_counts=False)
    assert c.name == "wikitext2"
    # the vocabulary is the training split's types in order of first appearance; the blank first line gives <eos>
    assert c.itos == ["<eos>", "=", "Title", "the", "cat", "@-@", "sat", "<unk>", "."]

    def words(t):
        return [c.itos[i] for i in t]

    # blank lines count: each is a lone <eos>
    assert words(c.train) == ["<eos>", "=", "Title", "=", "<eos>", "<eos>",
                              "the", "cat", "@-@", "sat", "<unk>", ".", "<eos>"]
    # words outside the training vocabulary ("Section", "dog") map to <unk>
    assert words(c.valid) == ["<eos>", "=", "=", "<unk>", "=", "=", "<eos>", "the", "<unk>", "sat", ".", "<eos>"]
    assert words(c.test) == ["<eos>", "the", "cat", "sat", "<eos>"]
    assert c.train.dtype == torch.long


def test_wikitext2_counts_are_checked(tmp_path):
    _fake_wikitext2(tmp_path / "wikitext-2")
    with pytest.raises(D.DataError) as e:
        D.load_wikitext2(tmp_path)
    msg = str(e.value)
    assert str(tmp_path / "wikitext-2") in msg
    assert "{'train': 13, 'valid': 12, 'test': 5}" in msg and "9 types" in msg  # found
    assert str(D.WIKITEXT2_TOKENS) in msg and str(D.WIKITEXT2_VOCAB) in msg  # expected


def test_wikitext2_missing_file_names_path_and_remedy(tmp_path):
    with pytest.raises(D.DataError) as e:
        D.load_wikitext2(tmp_path)
    msg = str(e.value)
    assert str(tmp_path / "wikitext-2" / "wiki.train.tokens") in msg
    assert "data.root=" in msg and "LMCAL_DATA_ROOT" in msg and "data.download=true" in msg


def test_wikitext2_download_checks_md5_and_leaves_nothing_on_failure(tmp_path, monkeypatch):
    archive = tmp_path / "wikitext-2-v1.zip"
    monkeypatch.setattr(D, "WIKITEXT2_ZIP_MD5", _zip_of(WT2_TEXT, archive))
    dest = tmp_path / "root" / "wikitext-2"
    D.download_wikitext2(dest, url=archive.as_uri())
    assert sorted(p.name for p in dest.iterdir()) == sorted(WT2_TEXT)  # no temp folder left behind
    assert all((dest / n).read_text(encoding="utf-8") == t for n, t in WT2_TEXT.items())

    # an archive with another MD5 (here: the real one's): refused before extracting, nothing written
    monkeypatch.setattr(D, "WIKITEXT2_ZIP_MD5", "542ccefacc6c27f945fb54453812b3cd")
    dest2 = tmp_path / "root2" / "wikitext-2"
    with pytest.raises(D.DataError, match="nothing was written") as e:
        D.download_wikitext2(dest2, url=archive.as_uri())
    assert D.md5(archive) in str(e.value)
    assert not (tmp_path / "root2").exists()  # not even the folders it made for the files

    # the right MD5 but a member missing: refused, nothing written
    partial = tmp_path / "partial.zip"
    monkeypatch.setattr(D, "WIKITEXT2_ZIP_MD5", _zip_of({n: t for n, t in WT2_TEXT.items()
                                                         if n != "wiki.test.tokens"}, partial))
    dest3 = tmp_path / "root3" / "wikitext-2"
    with pytest.raises(D.DataError, match="lacks wikitext-2/wiki.test.tokens"):
        D.download_wikitext2(dest3, url=partial.as_uri())
    assert not (tmp_path / "root3").exists()

    # an unreachable address: a clear error, not a traceback; a folder that was there stays, empty
    (tmp_path / "root4").mkdir()
    with pytest.raises(D.DataError, match="Could not download"):
        D.download_wikitext2(tmp_path / "root4" / "wikitext-2", url=(tmp_path / "nope.zip").as_uri())
    assert list((tmp_path / "root4").iterdir()) == []


def test_load_wikitext2_through_load_corpus_with_download(tmp_path, monkeypatch):
    archive = tmp_path / "a.zip"
    monkeypatch.setattr(D, "WIKITEXT2_ZIP_MD5", _zip_of(WT2_TEXT, archive))
    monkeypatch.setattr(D, "WIKITEXT2_URL", archive.as_uri())  # read at call time
    with pytest.raises(D.DataError, match="token counts"):  # load_corpus checks the real counts
        load_corpus("wikitext2", str(tmp_path / "root"), download=True)
    c = D.load_wikitext2(tmp_path / "root", download=False, check_counts=False)  # fetched by the call above
    assert c.train.numel() == 13


def test_unknown_corpus_lists_the_choices():
    with pytest.raises(D.DataError) as e:
        load_corpus("wikitext103")
    assert all(n in str(e.value) for n in ("ptb", "wikitext2", "markov"))


# ---------------------------------------------------------------------------------------------------------------------
# Markov source
# ---------------------------------------------------------------------------------------------------------------------


def _binary_entropy(p):
    return -p * math.log(p) - (1 - p) * math.log(1 - p)


def _kgram_transition(probs, V, k):
    """Dense [V**k, V**k] k-gram transition matrix, built with explicit digits (independent of the reshape trick)."""
    T = np.zeros((V ** k, V ** k))
    for ctx in range(V ** k):
        digits = [(ctx // V ** (k - 1 - j)) % V for j in range(k)]  # oldest first
        for w in range(V):
            new = digits[1:] + [w]
            T[ctx, sum(d * V ** (k - 1 - j) for j, d in enumerate(new))] += probs[ctx, w]
    return T


def test_two_state_chain_entropy_rate_by_hand():
    a, b = 0.1, 0.3
    probs = np.array([[1 - a, a], [b, 1 - b]])
    pi = MK.markov_stationary(probs, 2, 1)
    np.testing.assert_allclose(pi, [b / (a + b), a / (a + b)], rtol=0, atol=1e-13)
    h = (b * _binary_entropy(a) + a * _binary_entropy(b)) / (a + b)
    assert MK.markov_entropy_rate(probs, 2, 1) == pytest.approx(h, abs=1e-13)
    # order 1: the "order - 1" conditional is the stationary unigram law
    h0 = _binary_entropy(a / (a + b))
    assert MK.markov_conditional_entropy(probs, 2, 1, 0) == pytest.approx(h0, abs=1e-13)


def test_make_markov_chain_rows_are_sparse_peaked_and_smoothed():
    ch = MK.make_markov_chain(vocab_size=10, order=2, support=3, smoothing=0.05, seed=4)
    p = ch.probs
    assert p.shape == (100, 10) and p.dtype == np.float64
    np.testing.assert_allclose(p.sum(axis=1), 1.0, rtol=0, atol=1e-14)
    floor = 0.05 / 10
    assert p.min() == pytest.approx(floor)
    assert ((p > floor + 1e-12).sum(axis=1) == 3).all()  # exactly `support` tokens above the floor
    assert np.array_equal(p, MK.make_markov_chain(10, 2, 3, 0.05, seed=4).probs)
    assert not np.array_equal(p, MK.make_markov_chain(10, 2, 3, 0.05, seed=5).probs)


def test_order2_stationary_is_invariant_under_the_kgram_chain():
    V, k = 3, 2
    probs = MK.make_markov_chain(vocab_size=V, order=k, support=2, smoothing=0.1, seed=1).probs
    pi = MK.markov_stationary(probs, V, k)
    T = _kgram_transition(probs, V, k)
    assert pi.min() > 0 and pi.sum() == pytest.approx(1.0, abs=1e-14)
    np.testing.assert_allclose(pi @ T, pi, rtol=0, atol=1e-13)


def test_conditional_of_lower_order_matches_a_direct_computation():
    V, k = 3, 2
    probs = MK.make_markov_chain(vocab_size=V, order=k, support=2, smoothing=0.1, seed=2).probs
    pi = MK.markov_stationary(probs, V, k)
    joint = np.zeros((V, V))  # P(last token a2, next w)
    for a1 in range(V):
        for a2 in range(V):
            for w in range(V):
                joint[a2, w] += pi[a1 * V + a2] * probs[a1 * V + a2, w]
    expected = joint / joint.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(MK.markov_conditional(probs, V, k, 1), expected, rtol=0, atol=1e-14)
    # its entropy under the stationary law is the order-(k-1) conditional entropy
    marg = joint.sum(axis=1)
    h1 = -(joint * np.log(expected)).sum()
    assert MK.markov_conditional_entropy(probs, V, k, 1) == pytest.approx(h1, abs=1e-13)
    assert marg @ -(expected * np.log(expected)).sum(axis=1) == pytest.approx(h1, abs=1e-13)
    # tau = 0 is the stationary unigram law
    np.testing.assert_allclose(MK.markov_conditional(probs, V, k, 0)[0], pi.reshape(V, V).sum(axis=0), atol=1e-14)
    # tau = k is the table itself; tau > k ignores the older tokens
    assert np.array_equal(MK.markov_conditional(probs, V, k, k), probs)
    c3 = MK.markov_conditional(probs, V, k, 3)
    for a0 in range(V):
        assert np.array_equal(c3[a0 * V * V:(a0 + 1) * V * V], probs)


def test_conditional_entropy_decreases_with_memory_down_to_the_entropy_rate():
    ch = MK.make_markov_chain(vocab_size=6, order=3, support=2, smoothing=0.02, seed=3)
    hs = [MK.markov_conditional_entropy(ch.probs, 6, 3, tau) for tau in range(5)]
    assert all(hs[tau] > hs[tau + 1] for tau in range(3))  # each extra token of memory up to the order helps
    assert hs[3] == pytest.approx(MK.markov_entropy_rate(ch.probs, 6, 3), abs=1e-13)
    assert hs[4] == pytest.approx(hs[3], abs=1e-13)


def test_markov_corpus_is_a_function_of_its_seed():
    kw = dict(vocab_size=8, order=2, n_train=5000, n_valid=1000, n_test=1000)
    a, b, c = MK.markov_corpus(**kw, seed=0), MK.markov_corpus(**kw, seed=0), MK.markov_corpus(**kw, seed=1)
    for split in ("train", "valid", "test"):
        assert torch.equal(a.split(split), b.split(split))
        assert not torch.equal(a.split(split), c.split(split))
        assert a.split(split).dtype == torch.long
    assert (a.train.numel(), a.valid.numel(), a.test.numel()) == (5000, 1000, 1000)
    assert not torch.equal(a.valid, a.test)  # splits are independent samples
    assert a.name == "markov" and a.itos == [f"s{i}" for i in range(8)]
    assert a.info == b.info and a.info["entropy_rate_nats"] != c.info["entropy_rate_nats"]


def test_markov_corpus_info_is_exact_small_and_rebuilds_the_chain():
    c = MK.markov_corpus(n_train=1000, n_valid=100, n_test=100)
    info = c.info
    json.dumps(info)  # plain numbers only: it goes into metrics.json
    assert "probs" not in info
    assert {"order", "vocab_size", "support", "smoothing", "seed", "entropy_rate_nats",
            "entropy_rate_order_minus_1_nats", "depends_on_last"} <= set(info)
    assert info["depends_on_last"] == info["order"] == 2
    ch = MK.markov_chain_from_info(info)
    assert np.array_equal(ch.probs, MK.make_markov_chain().probs)
    assert info["entropy_rate_nats"] == pytest.approx(MK.markov_entropy_rate(ch.probs, 16, 2), abs=1e-13)
    # the oldest context token matters: the best order-(k-1) predictor is strictly worse
    assert info["entropy_rate_order_minus_1_nats"] > info["entropy_rate_nats"] + 0.1


def test_markov_exact_mi_is_the_entropy_drop_from_tau_to_k_tokens():
    info = MK.markov_corpus(n_train=10, n_valid=10, n_test=10).info
    mi = [MK.markov_exact_mi(info, tau) for tau in range(4)]
    assert mi[1] == pytest.approx(info["entropy_rate_order_minus_1_nats"] - info["entropy_rate_nats"], abs=1e-13)
    assert mi[0] > mi[1] > 0 and mi[2] == mi[3] == 0.0  # tau >= order: the distant past carries nothing


def _check_conditional_frequencies(probs, V, k, seq, n_contexts):
    """Empirical P(w | ctx) for the n most visited contexts within 5 standard errors of probs[ctx]."""
    ctx = np.zeros(seq.size - k, dtype=np.int64)
    for j in range(k):  # the context of token t: digits seq[t-k], ..., seq[t-1]
        ctx = ctx * V + seq[j:seq.size - k + j]
    counts = np.zeros((V ** k, V))
    np.add.at(counts, (ctx, seq[k:]), 1)
    visits = counts.sum(axis=1)
    for c in np.argsort(visits)[::-1][:n_contexts]:
        # given the visits, the next tokens are i.i.d. draws from probs[c] (strong Markov property)
        p, n = probs[c], visits[c]
        se = np.sqrt(p * (1 - p) / n)
        assert (np.abs(counts[c] / n - p) < 5 * se + 1e-12).all(), (c, counts[c] / n, p)
    return ctx


def test_sample_frequencies_match_the_table():
    # bigrams of an order-1 chain
    V = 5
    ch = MK.make_markov_chain(vocab_size=V, order=1, support=2, smoothing=0.05, seed=0)
    seq = MK.sample_markov(ch.probs, V, 1, 100_000, 0)
    _check_conditional_frequencies(ch.probs, V, 1, seq, n_contexts=V)
    # trigrams of an order-2 chain, and its context frequencies against the stationary law
    V, k = 4, 2
    ch = MK.make_markov_chain(vocab_size=V, order=k, support=2, smoothing=0.05, seed=1)
    seq = MK.sample_markov(ch.probs, V, k, 200_000, 1)
    ctx = _check_conditional_frequencies(ch.probs, V, k, seq, n_contexts=6)
    pi = MK.markov_stationary(ch.probs, V, k)
    np.testing.assert_allclose(np.bincount(ctx, minlength=V ** k) / ctx.size, pi, atol=0.01)


def test_sample_mean_log_loss_matches_the_entropy_rate():
    ch = MK.make_markov_chain()  # the default corpus's chain: V=16, order 2
    V, k = 16, 2
    seq = MK.sample_markov(ch.probs, V, k, 200_000, 7)
    ctx = seq[:-2] * V + seq[1:-1]
    nll = -np.log(ch.probs[ctx, seq[2:]])
    # the losses are autocorrelated through the context: standard error from 50 batch means
    means = nll[: nll.size // 50 * 50].reshape(50, -1).mean(axis=1)
    se = means.std(ddof=1) / math.sqrt(50)
    h = MK.markov_entropy_rate(ch.probs, V, k)
    assert abs(nll.mean() - h) < 4 * se, (nll.mean(), h, se)


def test_sample_lengths_and_determinism():
    ch = MK.make_markov_chain(vocab_size=4, order=3, support=2, seed=0)
    assert MK.sample_markov(ch.probs, 4, 3, 0, 0).shape == (0,)
    assert MK.sample_markov(ch.probs, 4, 3, 2, 0).shape == (2,)
    s = MK.sample_markov(ch.probs, 4, 3, 1000, 5)
    assert s.shape == (1000,) and s.dtype == np.int64 and 0 <= s.min() and s.max() < 4
    assert np.array_equal(s, MK.sample_markov(ch.probs, 4, 3, 1000, np.random.default_rng(5)))


def test_data_configs_select_the_corpora(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from lmcal.utils.settings import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        markov = compose(config_name="train", overrides=["data=markov", "data.corpus_kwargs.n_train=3000"])
        wt2 = compose(config_name="train", overrides=["data=wikitext2", f"data.root={tmp_path}"])
    assert (wt2.data.name, wt2.data.batch_size, wt2.data.bptt, wt2.data.download) == ("wikitext2", 80, 70, True)
    assert (markov.data.name, markov.data.batch_size, markov.data.bptt) == ("markov", 32, 35)
    dm = instantiate(markov.data)
    c = dm.prepare()
    assert c.name == "markov" and c.train.numel() == 3000 and c.valid.numel() == 20_000
    assert c.info["entropy_rate_nats"] == pytest.approx(MK.markov_corpus(n_train=10, n_valid=10, n_test=10)
                                                        .info["entropy_rate_nats"])
