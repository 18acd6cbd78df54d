"""HFCausalLM: a Hugging Face causal LM as a StepLM (tiny random GPT-2, built locally: no download)."""

import math

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmcal.core.calibration import fit_lookahead_calibration  # noqa: E402
from lmcal.core.entropy_rate import generation_entropy_curve  # noqa: E402
from lmcal.core.lookahead import entropy, lookahead_entropies  # noqa: E402
from lmcal.core.lookahead_law import make_rule  # noqa: E402
from lmcal.core.sampling import random_prefixes  # noqa: E402
from lmcal.data.corpora import hf_text_tokens, ptb_text_file  # noqa: E402
from lmcal.errors import DataError, LmcalError  # noqa: E402
from lmcal.models.hf import HFCausalLM, load_hf_model  # noqa: E402
from lmcal.models.hf_cache import fork_cache  # noqa: E402

V = 50
WORDS = ["<unk>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far", "away", "and"]


def tiny_gpt2(vocab_size=V, seed=0, init=0.3):
    """init: the weights' std; much larger than GPT-2's 0.02 so that next-token distributions are peaked and vary
    with the context, as a trained model's do (near-uniform ones leave the lookahead fit degenerate)."""
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=vocab_size, n_positions=128,
                                  bos_token_id=0, eos_token_id=0, initializer_range=init)
    return transformers.GPT2LMHeadModel(cfg)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Models this small run fastest on one thread; on a busy machine extra threads cost seconds of spinning."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def lm():
    return HFCausalLM(tiny_gpt2())


@torch.no_grad()
def full_log_probs(model, x):
    """Uncached forward of whole sequences x [B, T] -> log-probs [B, T, V]."""
    return model(x).logits.float().log_softmax(-1)


def feed(lm, x):
    """Step x [B, T] token by token -> log-probs [B, T, V] and the final state."""
    state, out = lm.init_state(x.size(0)), []
    for t in range(x.size(1)):
        lp, state = lm.step(x[:, t], state)
        out.append(lp)
    return torch.stack(out, 1), state


def test_steps_equal_one_uncached_forward(lm):
    model = tiny_gpt2().train()  # the wrapper must switch dropout off itself
    lm = HFCausalLM(model)
    assert lm.vocab_size == V and not model.training
    x = torch.randint(0, V, (3, 17))
    lp, (past, n) = feed(lm, x)
    assert n == 17 and past.get_seq_length() == 17
    assert lp.dtype == torch.float32 and not lp.requires_grad
    torch.testing.assert_close(lp, full_log_probs(model, x), atol=1e-5, rtol=1e-5)


def test_prefill_equals_steps_and_leaves_its_state_usable(lm):
    x = torch.randint(0, V, (3, 12))
    lp_steps, st_steps = feed(lm, x)
    lp, st = lm.prefill(x[:, :5], lm.init_state(3))  # a prompt in one forward, then more of it, then steps
    lp, st = lm.prefill(x[:, 5:9], st)
    torch.testing.assert_close(lp, lp_steps[:, 8], atol=1e-5, rtol=1e-5)
    for t in range(9, 12):
        lp, st = lm.step(x[:, t], st)
        torch.testing.assert_close(lp, lp_steps[:, t], atol=1e-5, rtol=1e-5)
    assert st[1] == st_steps[1] == 12 and st[0].get_seq_length() == 12
    from lmcal.utils import profiling  # a profiled model times its prefill as a forward: the body for every token, the
    profiling.reset()  # output layer for the one decoded row per sequence
    with profiling.span("generation"):
        lp_prof, _ = profiling.profiled(lm).prefill(x[:, :9], lm.init_state(3))
    torch.testing.assert_close(lp_prof, lp_steps[:, 8], atol=1e-5, rtol=1e-5)
    params, out = sum(p.numel() for p in lm.model.parameters()), lm.head[0].numel()
    assert profiling.snapshot()["generation/forward"]["gflop"] * 1e9 == pytest.approx(2 * (params - out) * 27
                                                                                       + 2 * out * 3)
    with pytest.raises(LmcalError, match="at most 128 tokens"):
        lm.prefill(torch.zeros(1, 129, dtype=torch.long), lm.init_state(1))


def test_select_with_repeats_and_no_mutation(lm):
    x = torch.randint(0, V, (3, 9))
    _, state = feed(lm, x)
    index = torch.tensor([2, 0, 0, 1])
    nxt = torch.tensor([5, 6, 7, 8])
    got, sel = lm.step(nxt, lm.select(state, index))
    ref = full_log_probs(lm.model, torch.cat([x[index], nxt[:, None]], 1))[:, -1]
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    # a second step from the selected state, and the original state untouched by select and by stepping its fork
    got2, _ = lm.step(nxt.flip(0), sel)
    ref2 = full_log_probs(lm.model, torch.cat([x[index], nxt[:, None], nxt.flip(0)[:, None]], 1))[:, -1]
    torch.testing.assert_close(got2, ref2, atol=1e-5, rtol=1e-5)
    assert state[0].get_seq_length() == 9 and state[1] == 9
    y = torch.tensor([1, 2, 3])
    for _ in range(2):  # stepping the same state twice gives the same answer: step does not extend it
        again, _ = lm.step(y, state)
        torch.testing.assert_close(again, full_log_probs(lm.model, torch.cat([x, y[:, None]], 1))[:, -1],
                                   atol=1e-5, rtol=1e-5)


def test_two_children_of_one_state_both_stay_valid(lm):
    """A step writes into the buffer it shares with its parent only while nobody else has: the first child's keys
    survive a second child stepped from the same parent, and each grandchild sees its own line."""
    x = torch.randint(0, V, (2, 70))  # past the first buffer's capacity: the cache grows while stepping
    _, state = feed(lm, x)
    a, b = torch.tensor([1, 2]), torch.tensor([3, 4])
    _, child_a = lm.step(a, state)
    _, child_b = lm.step(b, state)
    z = torch.tensor([5, 6])
    for child, w in ((child_a, a), (child_b, b), (child_a, a)):
        got, _ = lm.step(z, child)
        ref = full_log_probs(lm.model, torch.cat([x, w[:, None], z[:, None]], 1))[:, -1]
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_select_of_the_empty_state(lm):
    state = lm.select(lm.init_state(2), torch.tensor([1, 1, 0]))
    lp, _ = lm.step(torch.tensor([4, 4, 9]), state)
    torch.testing.assert_close(lp, full_log_probs(lm.model, torch.tensor([[4], [4], [9]]))[:, -1])


def test_legacy_tuple_cache_is_indexed_without_mutation():
    k, v = torch.randn(3, 2, 4, 5), torch.randn(3, 2, 4, 5)  # [B, heads, T, head_dim]
    past = ((k, v), (k + 1, v + 1))
    assert fork_cache(past) is past  # tuples are immutable: nothing to copy
    new = fork_cache(past, torch.tensor([2, 0, 2]))
    torch.testing.assert_close(new[1][0], (k + 1)[[2, 0, 2]])
    assert past[0][0] is k and new[0][0].shape == (3, 2, 4, 5)


def test_context_longer_than_the_model_is_a_clear_error(lm):
    with pytest.raises(LmcalError, match="at most 128 tokens") as e:
        lm.step(torch.tensor([1]), (None, 128))
    assert "fit_tokens / fit_streams" in str(e.value) and "check=true" in str(e.value)  # not only prefix + horizon


def test_lookahead_entropies_match_full_forwards(lm):
    x = torch.randint(0, V, (2, 6))
    lp, state = feed(lm, x)
    h = lookahead_entropies(lm, state, lp[:, -1], chunk=37)  # [2, V], chunks that split rows
    for b in range(2):
        seqs = torch.cat([x[b].expand(V, -1), torch.arange(V)[:, None]], 1)  # [V, 7]: every candidate
        torch.testing.assert_close(h[b], entropy(full_log_probs(lm.model, seqs)[:, -1]), atol=1e-4, rtol=1e-4)


def test_generation_entropy_curve_and_calibration_run_unchanged(lm):
    stream = torch.randint(0, V, (400,), generator=torch.Generator().manual_seed(0))  # a fit known to be finite
    prefixes = random_prefixes(stream, 3, 8, seed=1)
    c1 = generation_entropy_curve(lm, prefixes, horizon=6, samples_per_prefix=2, seed=3)
    c2 = generation_entropy_curve(lm, prefixes, horizon=6, samples_per_prefix=2, seed=3)
    c3 = generation_entropy_curve(lm, prefixes, horizon=6, samples_per_prefix=2, seed=3, max_batch=2)
    assert c1.mean.shape == (6,) and np.isfinite(c1.mean).all() and np.isfinite(c1.stderr).all()
    assert 0 < c1.mean.min() and c1.mean.max() <= math.log(V) + 1e-9
    np.testing.assert_array_equal(c1.per_prefix, c2.per_prefix)  # deterministic for a seed
    np.testing.assert_allclose(c1.per_prefix, c3.per_prefix, atol=1e-4)  # one prefix per chunk: same generations
    tokens = stream[:24].view(6, 4)  # [S, B] time-major
    for topk in (None, 5):
        fit = fit_lookahead_calibration(lm, tokens, make_rule(topk=topk))
        assert all(math.isfinite(v) for v in (fit.alpha, fit.ce_before, fit.ce_after))
        assert fit.ce_after <= fit.ce_before + 1e-9


def tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def tiny_folder(tmp_path):
    """A tiny GPT-2 and its word-level tokenizer saved as a Hugging Face folder (what model.name_or_path reads)."""
    folder = tmp_path / "tiny-gpt2"
    tiny_gpt2(vocab_size=len(WORDS)).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def test_saved_folder_loads_and_tokenises_text(tmp_path):
    model = tiny_gpt2(vocab_size=len(WORDS))
    folder = tmp_path / "tiny-gpt2"
    model.save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    lm = load_hf_model(folder)
    assert isinstance(lm, HFCausalLM) and lm.vocab_size == len(WORDS) and lm.device == torch.device("cpu")
    text = tmp_path / "text.txt"
    text.write_text(" the cat sat on the mat \n\n   \n a dog ran far away zebra\n", encoding="utf-8")
    ids = hf_text_tokens(text, lm.tokenizer)
    expected = [WORDS.index(w) for w in "the cat sat on the mat a dog ran far away".split()] + [0]  # zebra: <unk>
    assert ids.dtype == torch.long and ids.tolist() == expected
    assert hf_text_tokens(text, lm.tokenizer, max_tokens=4).tolist() == expected[:4]
    x = ids[None]
    torch.testing.assert_close(feed(lm, x)[0], full_log_probs(model.eval(), x), atol=1e-5, rtol=1e-5)
    half = load_hf_model(folder, dtype="bfloat16")
    assert next(half.model.parameters()).dtype == torch.bfloat16
    assert half.step(ids[:2], half.init_state(2))[0].dtype == torch.float32  # log-probs always float32


def test_missing_inputs_are_clear_errors(tmp_path):
    with pytest.raises(LmcalError, match="save_pretrained") as err:
        load_hf_model(tmp_path / "no-such-model")
    assert "HF_HUB_OFFLINE" in str(err.value) and "does not exist" in str(err.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LmcalError, match="Could not load .* local folder"):
        load_hf_model(tmp_path / "empty")
    with pytest.raises(LmcalError, match="Unknown dtype"):
        load_hf_model(tmp_path / "empty", dtype="float33")
    with pytest.raises(DataError, match="Text file not found"):
        hf_text_tokens(tmp_path / "missing.txt", tiny_tokenizer())
    (tmp_path / "blank.txt").write_text("\n  \n")
    with pytest.raises(DataError, match="no tokens"):
        hf_text_tokens(tmp_path / "blank.txt", tiny_tokenizer())
    with pytest.raises(DataError, match="ptb.test.txt"):
        ptb_text_file("test", root=tmp_path)


def test_windowed_cross_entropy_scores_every_token_once(lm):
    from lmcal.models.hf import hf_cross_entropy

    x = torch.randint(0, V, (1, 40), generator=torch.Generator().manual_seed(7))
    whole = full_log_probs(lm.model, x)[0, :-1].gather(1, x[0, 1:, None]).mean().item()
    ce, n = hf_cross_entropy(lm, x[0], context=128)  # one window: exactly the full forward
    assert n == 39 and ce == pytest.approx(-whole, abs=1e-5)
    ce, n = hf_cross_entropy(lm, x[0], context=8, batch_size=2)  # windows of 8 overlapping by one, a short last one
    manual = 0.0
    for a in range(0, 39, 7):
        w = x[:, a:a + 8]
        manual -= full_log_probs(lm.model, w)[0, :-1].gather(1, w[0, 1:, None]).sum().item()
    assert n == 39 and ce == pytest.approx(manual / 39, abs=1e-5)


def test_future_entropy_calibration_steps_the_tilted_law(lm):
    """FutureCalibratedLM on a Hugging Face model: its fused product (the last hidden state against [lm_head, U])
    equals log_softmax(beta log P + alpha g), g the head on the last hidden state."""
    from lmcal.core.future_entropy import FutureCalibratedLM, FutureEntropyHead, step_features, word_vectors

    torch.manual_seed(0)
    head = FutureEntropyHead(32, V, hidden=8, rank=4, words=word_vectors(lm)).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    x = torch.randint(0, V, (3, 5))
    logp, state = feed(lm, x[:, :4])
    want_logp, f, _ = step_features(lm, x[:, 4], state)
    torch.testing.assert_close(want_logp, lm.step(x[:, 4], state)[0], atol=1e-5, rtol=0)
    want = (0.9 * want_logp - 0.4 * head(f).detach()).log_softmax(-1)
    got, _ = FutureCalibratedLM(lm, head, -0.4, 0.9).step(x[:, 4], state)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_hf_target_scores_the_test_text_only_for_stages_that_read_it(tmp_path, monkeypatch):
    """The model's test CE (a whole pass over the test text) is computed for entropy_rate (Table 1), not for a stage
    that scores its own test words."""
    from hydra import compose, initialize_config_dir

    import lmcal.models.hf
    from lmcal.stages.targets import hf_target
    from lmcal.utils.settings import CONF_DIR

    folder = tiny_folder(tmp_path)
    for split in ("valid", "test"):
        (tmp_path / f"{split}.txt").write_text("the cat sat on a mat\na dog ran far away\n" * 5)
    calls = []
    real = lmcal.models.hf.hf_cross_entropy
    monkeypatch.setattr(lmcal.models.hf, "hf_cross_entropy", lambda *a, **k: calls.append(1) or real(*a, **k))
    for stages, scored in (("[calibration]", False), ("[entropy_rate]", True)):
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose("evaluate", overrides=["model=hf", f"model.name_or_path={folder}", "logger=none",
                                                 f"model.valid_text={tmp_path / 'valid.txt'}", "analysis=smoke",
                                                 f"model.test_text={tmp_path / 'test.txt'}", f"stages={stages}"])
        calls.clear()
        t = hf_target(cfg)
        assert bool(calls) == scored and (t["test_ce"] is not None) == scored
        assert ("test_ce_nats" in t["results"]) == scored and t["results"]["unit"] == "model token"


def test_evaluate_model_hf_runs_the_generation_stages(tmp_path):
    """python -m lmcal.evaluate model=hf ... stages=[entropy_rate,calibration,decoders], through Hydra's compose."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from lmcal.evaluate import evaluate
    from lmcal.utils.settings import CONF_DIR

    folder = tiny_folder(tmp_path)
    g = np.random.default_rng(0)
    for split in ("valid", "test", "train"):  # valid and test as before: a fit known to be finite
        lines = [" ".join(g.choice(WORDS[1:], size=8)) for _ in range(60)]
        (tmp_path / f"{split}.txt").write_text("\n".join(lines) + "\n")
    overrides = ["model=hf", f"model.name_or_path={folder}", f"model.valid_text={tmp_path / 'valid.txt'}",
                 f"model.test_text={tmp_path / 'test.txt'}", f"model.train_text={tmp_path / 'train.txt'}",
                 "model.context=64", "analysis=smoke", "logger=none",
                 "stages=[entropy_rate,calibration,decoders,future_entropy]",
                 "analysis.decoders.methods=[{name: top_p, p: 0.9}]"]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("evaluate", overrides=overrides)
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "eval")
    res = evaluate(cfg)
    assert res["unit"] == "model token" and res["test_tokens"] == 60 * 8 - 1  # 8 words a line (no newline token)
    assert res["entropy_rate"]["corpus"] == "valid (tiny-gpt2 tokens)"
    assert res["calibration"]["test_ppl_after"] <= res["calibration"]["test_ppl_before"] * 1.05
    rows = {r["method"]: r for r in res["decoders"]["rows"]}
    assert list(rows) == ["model", "top_p", "fitted_temperature", "calibration"]
    assert res["decoders"]["calibration_reused"]  # same settings: the calibration stage's row, not a refit
    assert rows["calibration"]["entrate_ppl"] == res["calibration"]["entrate_ppl_after"]
    fe = [(r["method"], r["params"].get("horizon_k"), r["source"]) for r in res["future_entropy"]["rows"]]
    # the heads' rollouts run the whole horizon (20 words: 5 examples, one every 4th) and the .md gives R² by word
    assert (res["future_entropy"]["rollout_steps"], res["future_entropy"]["examples_per_rollout"]) == (20, 5)
    by = res["future_entropy"]["rows"][1]["head"]["r2_by_step"]  # words 1, 5, ..., 17: one in each fifth
    assert len(by) == 5 and by[0]["steps"][0] == 1 and by[-1]["steps"][1] == 17
    assert "| K=1, γ=1 |" in (tmp_path / "eval" / "future_entropy.md").read_text()
    assert fe == [("model", None, "future_entropy"), ("future_entropy", 1, "future_entropy"),
                  ("future_entropy_temperature", 1, "future_entropy"), ("future_entropy", 5, "future_entropy"),
                  ("future_entropy_temperature", 5, "future_entropy"), ("lookahead_exact", None, "future_entropy"),
                  ("top_p", None, "decoders"), ("fitted_temperature", None, "decoders"),
                  ("calibration", None, "decoders")]  # smoke: K in {1, 5}; V = 12, so exact lookahead runs too
    assert all(r["ms_per_token"] > 0 and r["test_ce_nats"] is not None for r in res["future_entropy"]["rows"]
               if r["method"] != "top_p")
    # the head closest to the test perplexity is chosen on seed 0's generations and measured again on seed 1's
    fair = [r for r in res["future_entropy"]["rows"][1:5] if r["test_ce_diff_nats"] <= 0]
    best = res["future_entropy"]["best_head"]
    assert (best is None) == (not fair)
    if best:
        assert (best["chosen_on_seed"], best["reported_on_seed"]) == (0, 1) and len(best["candidates"]) == len(fair)
        assert best["tail_stderr_nats"] > 0 and best["tail_ppl"] == pytest.approx(math.exp(best["tail_nats"]))
    for name in ("entropy_rate.json", "calibration.json", "decoders.json", "decoders.md", "decoders.png",
                 "future_entropy.json", "future_entropy.md", "future_entropy.png", "evaluation.json"):
        assert (tmp_path / "eval" / name).is_file()
    for md in ("entropy_rate.md", "decoders.md"):
        assert "per model token" in (tmp_path / "eval" / md).read_text()
    with open_dict(cfg):
        cfg.stages = ["memory"]
    with pytest.raises(LmcalError, match="tau-limited"):
        evaluate(cfg)
