"""Future-entropy heads (lmcal.core.future_entropy) against exact answers: the delayed drifting oracle's closed forms,
the rollout targets, the K = 1 head against exact one-step lookahead, and calibration that closes a drift one-step
lookahead cannot see."""

import math

import numpy as np
import pytest
import torch

from lmcal.core.calibration import fit_lookahead_calibration, target_log_probs
from lmcal.core.entropy_rate import generation_entropy_curve
from lmcal.core.future_entropy import (
    FutureCalibratedLM,
    FutureEntropyHead,
    HeadTraining,
    fit_future_calibration,
    fit_rows,
    head_rows,
    rollout_examples,
    step_features,
    train_head,
)
from lmcal.core.lookahead import entropy, lookahead_entropies
from lmcal.core.sampling import random_prefixes
from lmcal.data.batching import batchify
from lmcal.data.markov import make_markov_chain, markov_entropy_rate, sample_markov
from lmcal.models.awd_lstm import AWDLSTM
from lmcal.models.oracles import DelayedDriftOracle, DriftingOracle
from lmcal.models.step_lm import LSTMStepLM

CHAIN = make_markov_chain(vocab_size=8, order=1, support=3, smoothing=0.05, seed=1)
H = markov_entropy_rate(CHAIN.probs, 8, 1)  # the true source's entropy rate


def _text(n, seed):
    return torch.as_tensor(sample_markov(CHAIN.probs, 8, 1, n, seed))


def _oracle(**kw):
    return DelayedDriftOracle(CHAIN, **{"trigger_rate": 0.02, "delay": 3, "noise_vocab": 256, **kw})


def _state_index(orc, features):
    """The augmented-chain index of the rollout examples' states, read off their one-hot features (order 1: a slot
    for the empty context, then V_M; then the phase)."""
    ctx = features[:, 1:1 + orc.markov_vocab].argmax(1)
    phase = features[:, 1 + orc.markov_vocab:].argmax(1)
    return phase * orc.markov_vocab + ctx


def _exact_curve(orc, head, fit, horizon):
    """The calibrated model's expected generation entropy, exactly, on the augmented chain."""
    states = orc.augmented_states()
    logp = orc._law(orc.markov.tables[1][states[0][0]], states[1])
    with torch.no_grad():
        g = head(orc.state_features(states)).double()
    return orc.expected_generation_entropy(horizon, (fit.beta * logp + fit.alpha * g).log_softmax(-1))


def test_delayed_oracle_is_a_law_and_its_closed_forms_hold():
    orc = _oracle()
    states = orc.augmented_states()
    logp = orc._law(orc.markov.tables[1][states[0][0]], states[1])
    assert torch.allclose(logp.exp().sum(1), torch.ones(len(logp), dtype=torch.float64))
    # G_1 is H_next, the entropy after each word, exactly
    g1 = torch.as_tensor(orc.future_entropies(1))
    st = orc.augmented_states()
    assert torch.allclose(lookahead_entropies(orc, st, logp), g1, atol=1e-12)
    # a trigger's next entropy is below a Markov word's (one step ahead it looks harmless), its G_20 far above
    # after a trigger the law is the countdown's, a little less uncertain than the normal one in the same context:
    # one step ahead a trigger looks harmless; its G_20 is far above every Markov word's
    VM, trig = orc.markov_vocab, orc.markov_vocab
    assert (g1[:VM, trig] < entropy(logp[:VM])).all()
    g20 = torch.as_tensor(orc.future_entropies(20))
    assert (g20[:VM, trig] > g20[:VM, :VM].amax(1) + 20).all()
    # the generation curve, exact against sampled
    prefixes = random_prefixes(_text(5000, 3), 50, 5, seed=0)
    curve = generation_entropy_curve(orc, prefixes, 60, 20, seed=0)
    exact = orc.expected_generation_entropy(60)
    z = (curve.mean - exact) / curve.stderr
    assert np.abs(z).max() < 4.5 and abs(z.mean()) < 1.0, z
    assert exact[-1] > H + 1.0  # it drifts


def test_rollout_targets_match_the_closed_form_within_their_monte_carlo_error():
    orc = _oracle(trigger_rate=0.05)  # more triggers among the draws
    horizons = [(1, 1.0), (5, 1.0), (20, 1.0), (20, 0.95)]
    ex = rollout_examples(orc, _text(20000, 0), horizons, contexts=600, prefix_len=5, steps=20, seed=0)
    s = _state_index(orc, ex.features)
    for j, (k, d) in enumerate(horizons):
        exact = torch.as_tensor(orc.future_entropies(k, d))[s, ex.words]
        err = ex.targets[:, j] - exact
        if k == 1:  # the entropy after the candidate is computed, not sampled
            assert err.abs().max() < 1e-10
            continue
        per_row = torch.zeros(int(ex.group.max()) + 1, dtype=torch.float64).index_add_(0, ex.group, err) / 20
        se = per_row.std() / math.sqrt(per_row.numel())  # rollouts are the independent units
        assert abs(per_row.mean()) < 4 * se, (k, d, per_row.mean().item(), se.item())
        trig = ex.words == orc.markov_vocab
        assert trig.sum() > 50  # and the triggers, where the noise is, on their own
        assert abs(err[trig].mean()) < 4 * err[trig].std() / math.sqrt(trig.sum()) + 1e-9


def test_rollouts_with_a_stride_keep_the_same_examples_at_every_stride_th_word():
    """issue 33: rollouts run the whole horizon and keep every stride-th word's example; the draws are counter-based,
    so those examples are the very ones a stride-1 run gives at the same words, and each knows its word's index."""
    orc, horizons = _oracle(trigger_rate=0.05), [(1, 1.0), (5, 0.95)]
    every = rollout_examples(orc, _text(5000, 0), horizons, contexts=50, prefix_len=5, steps=20, seed=0)
    some = rollout_examples(orc, _text(5000, 0), horizons, contexts=50, prefix_len=5, steps=20, stride=4, seed=0)
    assert every.step.tolist()[:20] == list(range(1, 21)) and some.step.tolist()[:5] == [1, 5, 9, 13, 17]
    keep = (every.step - 1) % 4 == 0
    for a, b in ((every.features[keep], some.features), (every.words[keep], some.words),
                 (every.targets[keep], some.targets), (every.group[keep], some.group)):
        assert torch.equal(a, b)
    assert some.model_steps == every.model_steps  # the runs are as long; fewer of their words are kept


@pytest.mark.parametrize("oracle", ["delayed", "drifting"])
def test_k1_head_gives_the_alpha_of_exact_one_step_lookahead(oracle):
    orc = _oracle() if oracle == "delayed" else DriftingOracle(CHAIN, T=50, noise_vocab=32)
    ex = rollout_examples(orc, _text(20000, 0), [(1, 1.0)], contexts=1000, prefix_len=5, steps=30, seed=0)
    head, stats = train_head(ex, 0, orc.vocab_size, settings=HeadTraining(hidden=128, rank=orc.vocab_size, epochs=6))
    assert stats["r2"] > 0.999  # exact targets: the head learns H_next itself
    by = stats["r2_by_step"]  # ... at every stage of the free run, words 1-30 in five ranges
    assert [b["steps"] for b in by] == [[1, 6], [7, 12], [13, 18], [19, 24], [25, 30]]
    assert sum(b["examples"] for b in by) == stats["valid_examples"] and all(b["r2"] > 0.99 for b in by)
    fit_text = batchify(_text(20000, 1), 20)
    logp, f, y = fit_rows(orc, fit_text, min_context=5)
    fit = fit_future_calibration(logp, head_rows(head, f), y, streams=20, cluster_size=100)
    exact = fit_lookahead_calibration(orc, fit_text, min_context=5, cluster_size=100)
    assert abs(fit.alpha - exact.alpha) < exact.alpha_stderr, (fit.alpha, exact.alpha, exact.alpha_stderr)
    assert fit.alpha_stderr == pytest.approx(exact.alpha_stderr, rel=0.1)
    assert fit.ce_after <= fit.ce_before


@pytest.mark.slow
def test_a_long_horizon_head_closes_the_drift_one_step_lookahead_cannot():
    orc, horizon = _oracle(), 100
    ex = rollout_examples(orc, _text(50000, 0), [(20, 1.0), (1, 1.0)], contexts=2000, prefix_len=5, steps=30,
                          seed=0)
    fit_text, test = batchify(_text(20000, 1), 20), batchify(_text(20000, 2), 20)
    logp, f, y = fit_rows(orc, fit_text, min_context=5)
    plain_ce = -target_log_probs(orc, test).mean().item()
    curves, ces = {}, {}
    for j, name in enumerate(["K=20", "K=1"]):
        head, _ = train_head(ex, j, orc.vocab_size, settings=HeadTraining(hidden=128, rank=32, epochs=6))
        fit = fit_future_calibration(logp, head_rows(head, f), y, streams=20, cluster_size=100)
        assert fit.ce_after <= fit.ce_before
        curves[name] = _exact_curve(orc, head, fit, horizon)
        model = FutureCalibratedLM(orc, head, fit.alpha)
        ces[name] = -target_log_probs(model, test).mean().item()
        if name == "K=20":  # the StepLM generates what the exact curve says
            mc = generation_entropy_curve(model, random_prefixes(_text(5000, 3), 40, 5, seed=0), 40, 10, seed=0)
            assert np.abs((mc.mean - curves[name][:40]) / mc.stderr).max() < 4.5
    exact_one = fit_lookahead_calibration(orc, fit_text, min_context=5)
    states = orc.augmented_states()
    law = orc._law(orc.markov.tables[1][states[0][0]], states[1])
    hnext = torch.as_tensor(orc.future_entropies(1))
    one_step = orc.expected_generation_entropy(horizon, (law + exact_one.alpha * hnext).log_softmax(-1))
    assert np.abs(curves["K=20"] - H).max() < 0.05, np.abs(curves["K=20"] - H).max()
    assert ces["K=20"] <= plain_ce  # held-out text: no higher cross-entropy
    assert np.abs(one_step - H).max() > 1.0 and np.abs(curves["K=1"] - H).max() > 1.0
    assert np.abs(orc.expected_generation_entropy(horizon) - H).max() > 1.0


def test_fused_step_is_the_tilted_law_and_the_fits_are_minima():
    torch.manual_seed(0)
    net = AWDLSTM(50, emb_size=16, hidden_size=24, num_layers=2).eval()
    lm = LSTMStepLM(net)
    head = FutureEntropyHead(16, 50, hidden=8, rank=4, words=net.decoder.weight.detach()).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    head.scale.fill_(2.0)
    tok = torch.randint(0, 50, (6,))
    logp, f, _ = step_features(lm, tok, lm.init_state(6))
    want = (1.2 * logp - 0.3 * head(f).detach()).log_softmax(-1)
    got, _ = FutureCalibratedLM(lm, head, -0.3, 1.2).step(tok, lm.init_state(6))
    assert torch.allclose(got, want, atol=1e-5)
    # the fits: CE'(a*) = 0 by finite differences, and the temperature never fits worse
    text = torch.randint(0, 50, (40, 4))
    logp, f, y = fit_rows(lm, text)
    g = head_rows(head, f)
    one = fit_future_calibration(logp, g, y, streams=4, cluster_size=5)
    two = fit_future_calibration(logp, g, y, temperature=True, streams=4, cluster_size=5)

    def ce(a, b=1.0):
        return -(b * logp.double() + a * g.double()).log_softmax(-1).gather(1, y[:, None]).mean().item()

    eps = 1e-4
    assert (ce(one.alpha + eps) - ce(one.alpha - eps)) / (2 * eps) == pytest.approx(0, abs=1e-6)
    assert ce(one.alpha) == pytest.approx(one.ce_after, abs=1e-6)  # float32 rows: ~1e-7 relative
    assert ce(two.alpha, two.beta) == pytest.approx(two.ce_after, abs=1e-6)  # float32 rows: ~1e-7 relative
    assert two.ce_after <= one.ce_after + 1e-12 and one.ce_after <= one.ce_before


def test_bad_settings_and_missing_inputs_are_one_paragraph(tmp_path):
    from lmcal.errors import LmcalError
    from lmcal.stages import run_stage, target
    from lmcal.stages.future_entropy import heads_of

    assert heads_of([1, 5], [1.0, 0.95]) == [(1, 1.0), (5, 1.0), (5, 0.95)]  # K = 1 once: it has no discount
    for k, d in ((0, 1.0), (2.5, 1.0), (5, 0.0), (5, 1.5), ("5", 1.0), (5, "x"), (True, 1.0)):
        with pytest.raises(LmcalError, match="horizon_k a positive integer and 0 < discount <= 1"):
            heads_of([k], [d])
    t = target(None, name="m", corpus="c")
    with pytest.raises(LmcalError, match=r"analysis\.future_entropy\.decoders_json=.*no\.json does not exist"):
        run_stage("future_entropy", t, {"decoders_json": str(tmp_path / "no.json")}, tmp_path)
    with pytest.raises(LmcalError, match="rollouts from the training text"):
        run_stage("future_entropy", t, {}, tmp_path)
    assert not any(tmp_path.iterdir())  # nothing written


def test_the_table_is_in_nats_and_its_ratio_is_its_own_ms_column():
    import math

    from lmcal.stages.future_entropy import future_entropy_table

    row = {"params": {}, "entropy_t1_nats": 1.0, "tail_ppl": math.e ** 2, "entrate_ppl": math.e ** 3,
           "test_ce_nats": 4.0, "zero_prob_fraction": 0.0, "tail_diff_nats": 0.1, "tail_diff_stderr_nats": 0.01}
    rows = [{**row, "method": "model", "ms_per_token": 1.838, "cost_ratio": 1.0},
            {**row, "method": "future_entropy", "ms_per_token": 2.979, "cost_ratio": 2.73}]  # paired ratio differs
    lines = future_entropy_table(rows, None).splitlines()
    assert "H, last tenth (nats)" in lines[0] and "H(t=T) (nats)" in lines[0]
    assert lines[3].endswith("| 2.000 | +0.100 ± 0.010 | 3.000 | 4.0000 | – | 0.0000 | 2.979 | 1.62 |")
