"""The StepLM implementations: trained-net wrappers agree with whole-sequence forwards, oracles are exact."""

import math

import numpy as np
import pytest
import torch

from lmcal.core.lookahead import entropy, lookahead_entropies
from lmcal.data import markov as MK
from lmcal.models.awd_lstm import AWDLSTM, limited_context_log_probs
from lmcal.models.checkpoint import lstm_from_checkpoint
from lmcal.models.oracles import DriftingOracle, MarkovOracle
from lmcal.models.step_lm import LimitedContextStepLM, LSTMStepLM


def tiny():
    torch.manual_seed(0)
    return AWDLSTM(vocab_size=30, emb_size=8, hidden_size=12, num_layers=3)


def feed(lm, tokens):
    """tokens [B, T] -> log-probs [T, B, V] after each token, and the final state."""
    state = lm.init_state(tokens.size(0))
    out = []
    for i in range(tokens.size(1)):
        lp, state = lm.step(tokens[:, i], state)
        out.append(lp)
    return torch.stack(out), state


def test_lstm_steps_equal_one_full_forward():
    net = tiny().train()  # the wrapper must switch dropout off itself
    lm = LSTMStepLM(net)
    assert lm.vocab_size == 30 and not net.training
    x = torch.randint(0, 30, (4, 11))  # [B, T]
    lp, _ = feed(lm, x)
    with torch.no_grad():
        out, _, _ = net(x.t(), net.init_hidden(4))
        ref = net.logits(out).log_softmax(-1)  # [T, B, V]
    torch.testing.assert_close(lp, ref)
    assert lp.dtype == torch.float32 and not lp.requires_grad


def test_lstm_select_with_repeats_continues_each_row():
    lm = LSTMStepLM(tiny())
    x = torch.randint(0, 30, (3, 6))
    _, state = feed(lm, x)
    index = torch.tensor([2, 0, 2, 1])
    nxt = torch.randint(0, 30, (4,))
    lp, _ = lm.step(nxt, lm.select(state, index))
    for j, r in enumerate(index.tolist()):  # row r run on its own, then fed the same next token
        _, s = feed(lm, x[r:r + 1])
        ref, _ = lm.step(nxt[j:j + 1], s)
        torch.testing.assert_close(lp[j], ref[0])


def test_lstm_candidate_features_equal_stepping_each_candidate():
    """The lookahead's shared path (h W_hh^T once per row) gives each candidate's features and H_next as a step."""
    lm = LSTMStepLM(tiny())
    _, state = feed(lm, torch.randint(0, 30, (3, 5)))  # trained-looking, non-zero states
    rows = torch.tensor([0, 0, 2, 1, 2, 2, 0])
    toks = torch.randint(0, 30, (7,))
    f = lm.candidate_features(toks, state, rows, lm.recurrent_terms(state))  # [7, E]
    ref, _ = lm.features(toks, lm.select(state, rows))
    torch.testing.assert_close(f, ref, rtol=0, atol=1e-6)
    assert f.shape == (7, 8) and not f.requires_grad
    logp, state3 = lm.step(torch.tensor([4, 9, 17]), state)
    h = lookahead_entropies(lm, state3, logp, chunk=11)  # [3, V]; chunks cut across rows
    for b in range(3):
        lp, _ = lm.step(torch.arange(30), lm.select(state3, torch.full((30,), b)))
        torch.testing.assert_close(h[b], entropy(lp), rtol=0, atol=1e-5)


def test_lstm_from_checkpoint(tmp_path):
    net = tiny()
    hp = {"vocab_size": 30, "net": {"_target_": "lmcal.models.awd_lstm.AWDLSTM", "emb_size": 8, "hidden_size": 12,
                                    "num_layers": 3}}
    ckpt = {"hyper_parameters": hp, "state_dict": {f"net.{k}": v for k, v in net.state_dict().items()}}
    torch.save(ckpt, tmp_path / "c.ckpt")
    lm = lstm_from_checkpoint(tmp_path / "c.ckpt")
    x = torch.randint(0, 30, (2, 5))
    torch.testing.assert_close(feed(lm, x)[0], feed(LSTMStepLM(net), x)[0])


def test_limited_context_steps_equal_limited_context_log_probs():
    tau, net = 4, tiny()
    lm = LimitedContextStepLM(net, tau)
    tokens = torch.randint(0, 30, (15,))
    lp, _ = feed(lm, tokens[None, :-1])  # [14, 1, V]: predictions of tokens 1..14
    ref = torch.cat([r[0] for r in limited_context_log_probs(net, tokens, tau, windows_per_batch=3)])
    torch.testing.assert_close(lp[:, 0], ref)
    # select: a repeated row continues exactly like the original
    x = torch.randint(0, 30, (2, 7))
    _, state = feed(lm, x)
    a, _ = lm.step(torch.tensor([5, 5, 5]), lm.select(state, torch.tensor([1, 0, 1])))
    b, _ = lm.step(torch.tensor([5, 5]), state)
    torch.testing.assert_close(a, b[[1, 0, 1]])


@pytest.fixture(scope="module")
def chain():
    return MK.make_markov_chain(vocab_size=5, order=2, support=2, smoothing=0.1, seed=1)


def test_markov_oracle_steps_are_the_exact_conditionals(chain):
    V, k, probs = 5, 2, chain.probs
    oracle = MarkovOracle.from_chain(chain)
    x = torch.randint(0, V, (3, 6))
    lp, _ = feed(oracle, x)  # [6, 3, V]
    xn = x.numpy()
    assert lp.dtype == torch.float64
    pi = MK.markov_stationary(probs, V, k)
    p1 = MK.markov_conditional(probs, V, k, 1, pi)  # [V, V]: one token seen
    np.testing.assert_allclose(lp[0].exp().numpy(), p1[xn[:, 0]], rtol=1e-12)
    for t in range(1, 6):  # two or more seen: the full-order row of the last two tokens
        np.testing.assert_allclose(lp[t].exp().numpy(), probs[xn[:, t - 1] * V + xn[:, t]], rtol=1e-12)
    # the table for nothing seen is the stationary marginal of one token
    np.testing.assert_allclose(oracle.tables[0][0].exp().numpy(), pi.reshape(V, V).sum(0), rtol=1e-12)
    # select keeps the context of each chosen row
    _, state = feed(oracle, x)
    a, _ = oracle.step(torch.tensor([2, 2]), oracle.select(state, torch.tensor([2, 2])))
    np.testing.assert_allclose(a.exp().numpy(), probs[[xn[2, -1] * V + 2] * 2], rtol=1e-12)


def test_markov_oracle_cross_entropy_is_the_entropy_rate():
    c = MK.markov_corpus(n_train=10, n_valid=50_000, n_test=10)
    oracle = MarkovOracle.from_chain(MK.markov_chain_from_info(c.info))
    x = c.valid.view(10, -1)  # 10 stationary streams, the oracle is exact from their first token
    lp, _ = feed(oracle, x[:, :-1])  # [T-1, 10, V]
    nll = -lp.gather(2, x[:, 1:].t()[:, :, None])[..., 0]  # [T-1, 10]
    # std over streams of their means: within a stream the losses are dependent, the streams are independent
    per_stream = nll.mean(0)
    se = per_stream.std().item() / math.sqrt(10)
    assert abs(per_stream.mean().item() - c.info["entropy_rate_nats"]) < 4 * se
    assert se < 0.02


def test_drifting_oracle_is_a_proper_lm_with_the_stated_law(chain):
    T, noise = 20, 7
    lm = DriftingOracle(chain, T=T, noise_vocab=noise)
    assert lm.vocab_size == 5 + noise
    markov = MarkovOracle.from_chain(chain)
    x = torch.randint(0, 5, (2, 8))
    x[1, 5] = 5 + 3  # row 1 switches at token 5
    lp, _ = feed(lm, x)
    mlp, _ = feed(markov, x.clamp(max=4))
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(8, 2, dtype=torch.float64))
    q = 1 / T
    torch.testing.assert_close(lp[:, 0, :5], mlp[:, 0] + math.log(1 - q))
    torch.testing.assert_close(lp[:, 0, 5:], torch.full((8, noise), math.log(q / noise), dtype=torch.float64))
    torch.testing.assert_close(lp[:5, 1, :5], mlp[:5, 1] + math.log(1 - q))
    assert torch.all(lp[5:, 1, :5] == -math.inf)  # after noise: uniform noise forever
    torch.testing.assert_close(lp[5:, 1, 5:], torch.full((3, noise), -math.log(noise), dtype=torch.float64))
    # select carries the switch
    _, state = feed(lm, x)
    a, _ = lm.step(torch.tensor([0, 0]), lm.select(state, torch.tensor([1, 0])))
    assert torch.all(a[0, :5] == -math.inf) and torch.all(a[1, :5] > -math.inf)


def test_drifting_oracle_closed_form_limits(chain):
    lm = DriftingOracle(chain, T=10, noise_vocab=64)
    h = 1.3
    e = lm.expected_generation_entropy(500, h)
    q = 0.1
    h2 = -q * math.log(q) - (1 - q) * math.log(1 - q)
    assert e[0] == pytest.approx(h2 + (1 - q) * h + q * math.log(64))  # unswitched before word 1
    assert e[-1] == pytest.approx(math.log(64))  # switched for sure in the long run
    assert np.all(np.diff(e[:100]) > 0) and np.all(np.diff(e) >= 0)  # rises (until float64 saturates)
