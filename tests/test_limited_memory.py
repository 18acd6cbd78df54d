"""tau-truncated (limited-memory) models: training chunks and exact limited-context evaluation."""

import torch

from lmcal.data import batching as D
from lmcal.models.awd_lstm import AWDLSTM, forward_chunked, limited_context_ce, limited_context_log_probs


def tiny(tau=None):
    torch.manual_seed(0)
    return AWDLSTM(vocab_size=25, emb_size=8, hidden_size=12, num_layers=3, memory_tau=tau).eval()


def test_state_is_zero_at_every_tau_boundary_and_carried_elsewhere():
    tau, net = 4, tiny(4)
    x = torch.randint(0, 25, (12, 3))  # three chunks per stream
    out, _ = forward_chunked(net, x, tau)
    for t in range(12):
        start = (t // tau) * tau  # the last boundary at or before t
        ref, _, _ = net(x[start:t + 1], net.init_hidden(3))  # zero state at the boundary, carried up to t
        torch.testing.assert_close(out[t], ref[-1])
    # and not zero anywhere else: a position inside a chunk differs from a fresh start there
    fresh, _, _ = net(x[5:6], net.init_hidden(3))
    assert not torch.allclose(out[5], fresh[0])


def test_chunked_windows_start_on_tau_boundaries():
    g = D.epoch_generator(0, 0)
    spans = list(D.bptt_spans(2000, 70, g, multiple_of=15))
    assert all(s % 15 == 0 and n % 15 == 0 and n >= 15 for s, n in spans)
    assert {n for _, n in spans} >= {60, 75}  # still variable
    assert spans[-1][0] + spans[-1][1] > 2000 - 1 - 15  # only a remainder shorter than tau is dropped


def test_limited_context_log_probs_match_one_window_each():
    tau, net = 5, tiny()
    tokens = torch.randint(0, 25, (40,))
    rows = list(limited_context_log_probs(net, tokens, tau, windows_per_batch=7))
    lp = torch.cat([r[0] for r in rows])
    y = torch.cat([r[1] for r in rows])
    assert torch.equal(y, tokens[1:])
    for t in (1, 3, 5, 6, 17, 39):
        ctx = tokens[max(0, t - tau):t].view(-1, 1)
        out, _, _ = net(ctx, net.init_hidden(1))
        torch.testing.assert_close(lp[t - 1], net.logits(out[-1, 0]).log_softmax(-1))
    ce, n = limited_context_ce(net, tokens, tau, windows_per_batch=7)
    assert n == 39
    torch.testing.assert_close(torch.tensor(ce), -lp.gather(1, y[:, None]).mean())


def test_limited_context_with_tau_beyond_the_text_is_the_full_prefix():
    net = tiny()
    tokens = torch.randint(0, 25, (9,))
    lp = torch.cat([r[0] for r in limited_context_log_probs(net, tokens, tau=50)])
    out, _, _ = net(tokens[:-1].view(-1, 1), net.init_hidden(1))
    torch.testing.assert_close(lp, net.logits(out[:, 0]).log_softmax(-1))
