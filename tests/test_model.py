import copy

import pytest
import torch
import torch.nn.functional as F

from lmcal.models.awd_lstm import (
    AWDLSTM,
    WeightDropLSTM,
    ar_tar,
    drop_connect,
    embedding_dropout,
    evaluate_ce,
    locked_dropout,
    repackage,
)


def tiny(**kw):
    torch.manual_seed(0)
    return AWDLSTM(vocab_size=30, emb_size=8, hidden_size=12, num_layers=3, **kw)


def test_gradients_reach_raw_hidden_to_hidden_weights():
    net = tiny(wdrop=0.5).train()
    out, raw, _ = net(torch.randint(0, 30, (7, 3)), net.init_hidden(3))
    net.logits(out).sum().backward()
    for rnn in net.rnns:
        g = rnn.lstm.weight_hh_l0.grad
        assert g is not None and g.abs().sum() > 0
        # DropConnect: the dropped entries get no gradient, the kept ones do
        assert 0.2 < (g == 0).float().mean() < 0.8


def test_weight_drop_is_one_mask_per_forward_on_the_matrix():
    torch.manual_seed(1)
    layer = WeightDropLSTM(5, 6, weight_drop=0.5).train()
    x, h = torch.randn(9, 2, 5), (torch.zeros(1, 2, 6), torch.zeros(1, 2, 6))
    torch.manual_seed(7)
    out, _ = layer(x, h)
    # the same RNG draw, applied by hand to a plain LSTM: one mask for all steps and rows
    torch.manual_seed(7)
    mask = drop_connect(torch.ones_like(layer.lstm.weight_hh_l0), 0.5)
    kept = (mask > 0).float().mean().item()
    assert torch.all((mask == 0) | (mask == 2.0)) and 0.3 < kept < 0.7  # 0 or 1 / (1 - p)
    ref = copy.deepcopy(layer.lstm)
    with torch.no_grad():
        ref.weight_hh_l0.mul_(mask)
    ref_out, _ = ref(x, h)
    torch.testing.assert_close(out, ref_out)
    # eval: the full weight, deterministic
    layer.eval()
    torch.testing.assert_close(layer(x, h)[0], layer.lstm(x, h)[0])


def test_drop_connect_keeps_the_mean_and_drops_at_rate_p():
    torch.manual_seed(0)
    w = torch.full((400, 500), 3.0, requires_grad=True)
    for p in (0.1, 0.5, 0.75):
        d = drop_connect(w, p)
        kept = (d > 0).double().mean().item()
        assert abs(kept - (1 - p)) < 4 * (p * (1 - p) / d.numel()) ** 0.5
        assert torch.allclose(d[d > 0], torch.tensor(3.0 / (1 - p)))
    d.sum().backward()  # the gradient is the mask
    assert torch.equal(w.grad, d.detach() / 3.0)


def test_locked_dropout_shares_the_mask_over_time():
    torch.manual_seed(0)
    x = torch.ones(20, 4, 50)
    y = locked_dropout(x, 0.4, True)
    assert torch.equal(y, y[:1].expand_as(y))  # constant along time
    assert torch.all((y == 0) | torch.isclose(y, torch.tensor(1 / 0.6)))
    assert 0.3 < (y[0] == 0).float().mean() < 0.5
    assert torch.equal(locked_dropout(x, 0.4, False), x)


def test_embedding_dropout_drops_whole_words_and_rescales():
    torch.manual_seed(0)
    w = torch.randn(200, 6)
    tokens = torch.arange(200).repeat(5).view(50, 20)  # every word appears 5 times
    e = embedding_dropout(w, tokens, 0.3, True)  # [50, 20, 6]
    flat_e, flat_t = e.view(-1, 6), tokens.view(-1)
    dropped = set()
    for word in range(200):
        rows = flat_e[flat_t == word]
        if rows.abs().sum() == 0:
            dropped.add(word)
        else:  # kept everywhere, rescaled by 1/(1-p)
            torch.testing.assert_close(rows, (w[word] / 0.7).expand_as(rows))
    assert 0.2 < len(dropped) / 200 < 0.4
    torch.testing.assert_close(embedding_dropout(w, tokens, 0.3, False), F.embedding(tokens, w))


def test_ar_tar_closed_forms():
    out = torch.full((4, 2, 3), 2.0)
    raw = torch.arange(4.0).view(4, 1, 1).expand(4, 2, 3)  # steps of 1
    assert ar_tar(out, raw, 2.0, 0.0).item() == pytest.approx(2.0 * 4.0)
    assert ar_tar(out, raw, 0.0, 1.0).item() == pytest.approx(1.0)
    assert ar_tar(out, raw[:1].expand(4, 2, 3), 0.0, 1.0).item() == 0.0  # constant in time: no TAR


def test_weights_are_tied_and_sizes_match():
    net = tiny()
    assert net.decoder.weight is net.encoder.weight
    assert net.rnns[-1].hidden_size == net.emb_size
    assert tiny(tie_weights=False).decoder.weight is not tiny(tie_weights=False).encoder.weight


def test_state_carries_across_windows_exactly():
    """Reading a stream in two windows with the state carried equals one long window."""
    net = tiny().eval()
    x = torch.randint(0, 30, (10, 2))
    full, _, _ = net(x, net.init_hidden(2))
    a, _, h = net(x[:4], net.init_hidden(2))
    b, _, _ = net(x[4:], repackage(h))
    torch.testing.assert_close(torch.cat([a, b]), full)


def test_evaluate_ce_matches_direct_computation():
    net = tiny().eval()
    tokens = torch.randint(0, 30, (101,))
    ce, n = evaluate_ce(net, tokens, batch_size=1, bptt=7)
    out, _, _ = net(tokens[:-1].view(-1, 1), net.init_hidden(1))
    ref = F.cross_entropy(net.logits(out).view(-1, 30), tokens[1:])
    assert n == 100
    assert ce == pytest.approx(ref.item(), rel=1e-5)
