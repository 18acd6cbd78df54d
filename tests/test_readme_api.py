"""The public API on a researcher's own model: the README's Python block runs as printed, LogitsStepLM is the model's
own log_softmax, and memory_bound gives the exact answers of Markov oracles."""

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from lmcal import LogitsStepLM, memory_bound
from lmcal.data.markov import make_markov_chain, markov_conditional_entropy, markov_stationary, sample_markov
from lmcal.models.oracles import MarkovOracle

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_readme_block_on_your_own_model_runs_as_printed():
    """The README's block with LogitsStepLM: an entropy curve, a calibration and a memory bound, each well formed."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    code = [b for b in blocks if "LogitsStepLM(" in b and "memory_bound(" in b]
    assert len(code) == 1
    scope: dict = {}
    exec(compile(code[0], "README.md", "exec"), scope)  # noqa: S102  (the README's own code)
    curve, fit, bound = scope["curve"], scope["fit"], scope["bound"]
    assert len(curve.mean) > 0 and np.isfinite(curve.mean).all()
    assert math.isfinite(fit.alpha) and math.isfinite(fit.alpha_stderr)
    assert bound.mi_upper_bound >= -1e-9 and math.isfinite(bound.mi_stderr) and bound.n_blocks >= 2


class Causal(torch.nn.Module):
    """A causal toy with memory: position t's logits read the running mean of the embeddings of tokens 0..t."""

    def __init__(self, vocab: int = 11, dim: int = 6):
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, vocab)

    def forward(self, tokens):  # [B, T] -> [B, T, V]
        x = self.emb(tokens).cumsum(1) / torch.arange(1, tokens.size(1) + 1)[:, None]
        return self.out(torch.tanh(x))


def test_step_log_probs_are_log_softmax_of_the_logits_on_the_whole_prefix():
    torch.manual_seed(0)
    net = Causal()
    lm = LogitsStepLM(net)
    assert lm.vocab_size == 11 and not net.training
    tokens = torch.randint(0, 11, (3, 9))
    state = lm.init_state(3)
    for t in range(9):
        logp, state = lm.step(tokens[:, t], state)
        with torch.no_grad():
            assert torch.equal(logp, net(tokens[:, :t + 1])[:, -1].log_softmax(-1))  # exact
    with torch.no_grad():
        whole = net(tokens).log_softmax(-1)  # one forward of the whole stream: the same up to rounding
    torch.testing.assert_close(logp, whole[:, -1], rtol=0, atol=1e-6)
    torch.testing.assert_close(lm.window_log_probs(tokens, keep=9), whole, rtol=0, atol=1e-6)
    # select fans rows out (repeats allowed), and a forked row goes on as its source would
    index = torch.tensor([2, 2, 0])
    forked = lm.select(state, index)
    a, _ = lm.step(torch.tensor([4, 4, 4]), forked)
    b, _ = lm.step(torch.tensor([4, 4, 4]), state)
    assert torch.equal(a, b[index])


def test_a_plain_function_a_logits_attribute_and_a_bounded_context():
    table = torch.randn(5, 5).log_softmax(-1)
    lm = LogitsStepLM(lambda x: table[x])  # a bigram model as a function
    logp, state = lm.step(torch.tensor([3, 1]), lm.init_state(2))
    assert lm.vocab_size == 5 and torch.equal(logp, table[[3, 1]].log_softmax(-1))

    class Out:
        def __init__(self, logits):
            self.logits = logits

    lm = LogitsStepLM(lambda x: Out(Causal()(x)), vocab_size=11, max_positions=4)
    state = lm.init_state(1)
    for t in range(7):
        _, state = lm.step(torch.tensor([t]), state)
    assert state.tolist() == [[3, 4, 5, 6]]  # only what the model can read
    with pytest.raises(ValueError, match=r"logits \[B, T, V\]"):
        LogitsStepLM(lambda x: table[x][:, -1])


@pytest.fixture(scope="module")
def order1():
    chain = make_markov_chain(vocab_size=6, order=1, support=3, smoothing=0.02, seed=3)
    w = torch.from_numpy(sample_markov(chain.probs, 6, 1, 20_000, 5))
    return chain, w


@pytest.mark.parametrize("tau", [1, 3])
def test_memory_bound_of_an_order_1_model_is_zero(order1, tau):
    """An order-1 chain's oracle, and the same conditionals as a module of logits: the past beyond the last token
    carries nothing, so the bound is 0 within its standard error, and both models give it alike."""
    chain, w = order1
    oracle = memory_bound(MarkovOracle.from_chain(chain), w, tau)
    assert oracle.n_tokens == 19_999 and oracle.n_blocks == 10
    assert 0 <= oracle.mi_upper_bound < 3 * oracle.mi_stderr and abs(oracle.alpha) < 3 * oracle.alpha_stderr
    net = torch.nn.Embedding.from_pretrained(torch.from_numpy(np.log(chain.probs)).float())  # logits = log P(. | x_t)
    mine = memory_bound(LogitsStepLM(net), w, tau)
    assert mine.mi_upper_bound == pytest.approx(oracle.mi_upper_bound, abs=1e-5)
    assert mine.ce_full == pytest.approx(oracle.ce_full, abs=1e-5)


def test_memory_bound_of_an_order_2_oracle_is_its_exact_mutual_information():
    chain = make_markov_chain(vocab_size=8, order=2, support=3, smoothing=0.02, seed=0)
    pi = markov_stationary(chain.probs, 8, 2)
    w = torch.from_numpy(sample_markov(chain.probs, 8, 2, 20_000, 12, pi))
    h = [markov_conditional_entropy(chain.probs, 8, 2, m, pi) for m in range(3)]
    r = memory_bound(MarkovOracle.from_chain(chain), w, tau=1)
    assert r.mi_upper_bound > 10 * r.mi_stderr and abs(r.mi_upper_bound - (h[1] - h[2])) < 3 * r.mi_stderr
    with pytest.raises(ValueError, match="tau"):
        memory_bound(MarkovOracle.from_chain(chain), w[:5], tau=5)
