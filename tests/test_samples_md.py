"""Generations shown as words (lmcal.reporting.samples_md) and the words the generation curve keeps."""

import math

import numpy as np
import torch

from lmcal.core.entropy_rate import generation_entropy_curve
from lmcal.core.sampling import draw, uniforms
from lmcal.data.markov import make_markov_chain
from lmcal.models.oracles import MarkovOracle
from lmcal.reporting.samples_md import samples_markdown, words


def test_kept_words_are_the_generated_ones_and_change_nothing_else():
    lm = MarkovOracle.from_chain(make_markov_chain(vocab_size=7, order=1, support=3, smoothing=0.1, seed=0))
    prefixes = torch.tensor([[1, 2], [3, 4]])
    plain = generation_entropy_curve(lm, prefixes, 6, 2, seed=3)
    kept = generation_entropy_curve(lm, prefixes, 6, 2, seed=3, keep=3)
    assert plain.kept is None and kept.kept.shape == (3, 5)  # horizon 6: five words drawn, the sixth's entropy only
    np.testing.assert_array_equal(plain.mean, kept.mean)
    np.testing.assert_array_equal(plain.tail, kept.tail)
    # generation 2 reads prefix 1 and draws with the uniforms of generation index 2
    state = lm.init_state(1)
    for w in prefixes[1]:
        logp, state = lm.step(w[None], state)
    out = []
    for t in range(5):
        tok, _ = draw(logp.exp(), uniforms(3, torch.tensor([2]), t))
        out.append(int(tok[0]))
        logp, state = lm.step(tok, state)
    assert kept.kept[2].tolist() == out


def test_samples_markdown_shows_prefix_head_and_tail_with_each_tail_entropy():
    itos = ["<eos>", "the", "cat", "sat", "`q", "on"]
    s = {"prefix": [1, 2, 3], "before": [1, 2, 3, 5, 1, 2], "after": [5, 5, 5, 5, 5, 5],
         "tail_nats_before": math.log(120.0), "tail_nats": math.log(90.0)}
    lines = samples_markdown([s], itos, tail_steps=2, prefix_words=2, head_words=3)
    assert lines[0] == "## Generations, as words"
    assert "**Prefix 1:** `… cat sat`" in lines
    assert "- plain (exp H, last tenth 120.0): `the cat sat … the cat`" in lines
    assert "- calibrated (exp H, last tenth 90.0): `on on on … on on`" in lines
    assert words([4, 9], itos) == "'q ?" and samples_markdown([], itos, 2) == []
