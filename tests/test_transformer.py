"""The transformer trained here (lmcal.models.transformer.GPTLM): its network interface, its Hugging Face folder, window
rows equal to fresh forwards, and every stage on a tiny trained one."""

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import open_dict  # noqa: E402

from lmcal.core.context import context_rows  # noqa: E402
from lmcal.data.corpora import hf_text_tokens, ptb_text_file  # noqa: E402
from lmcal.models.awd_lstm import evaluate_ce  # noqa: E402
from lmcal.models.hf import HFCausalLM, hf_cross_entropy, load_hf_model
from lmcal.models.step_lm import as_step_lm  # noqa: E402
from lmcal.models.transformer import GPTLM, word_tokenizer  # noqa: E402
from lmcal.train import train  # noqa: E402
from lmcal.utils.settings import CONF_DIR
from tests.conftest import DATA_ROOT, HAVE_PTB, needs_ptb  # noqa: E402

TINY = ["model.n_embd=32", "model.n_layer=2", "model.n_head=2", "model.n_positions=64", "data.bptt=63"]


def test_the_network_reads_each_window_from_scratch_with_the_lstm_interface():
    torch.manual_seed(0)
    net = GPTLM(vocab_size=40, n_positions=16, n_embd=16, n_layer=1, n_head=2).eval()
    x = torch.randint(0, 40, (10, 3))  # [T, B]
    out, raw, hidden = net(x, net.init_hidden(3))
    assert out.shape == (10, 3, 16) and raw is out and hidden == [] and net.memory_tau is None
    ref = net.model(input_ids=x.t()).logits.transpose(0, 1)  # [T, B, V]
    torch.testing.assert_close(net.logits(out), ref)
    assert net.decoder.weight is net.model.transformer.wte.weight  # tied
    lm = as_step_lm(net)
    assert isinstance(lm, HFCausalLM) and lm.max_positions == 16
    with pytest.raises(Exception, match="longer than the transformer's context"):
        net(torch.randint(0, 40, (17, 1)))


def test_window_rows_equal_a_fresh_forward_on_each_window():
    torch.manual_seed(1)
    net = GPTLM(vocab_size=30, n_positions=32, n_embd=16, n_layer=2, n_head=2).eval()
    lm = as_step_lm(net)
    tokens = torch.randint(0, 30, (90,))
    for tau in (1, 4, 7):
        rows = list(context_rows(lm, tokens, tau, batch_size=16))
        lp, y = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        assert torch.equal(y, tokens[1:])
        for t in (1, 3, tau, tau + 1, 50, 89):
            window = tokens[max(0, t - tau):t][None]
            ref = net.model(input_ids=window).logits[0, -1].float().log_softmax(-1)
            torch.testing.assert_close(lp[t - 1], ref, atol=2e-5, rtol=1e-5)
    # the whole past where it fits, windows of 32 overlapping by half beyond: every row is a fresh forward's
    rows = list(context_rows(lm, tokens, None, batch_size=16))
    lp = torch.cat([r[0] for r in rows])
    assert lp.size(0) == 89
    for t in (5, 32, 33, 48, 49, 64, 89):
        start = 0 if t <= 32 else ((t - 32 - 1) // 16 + 1) * 16  # the window whose kept half holds target t
        ref = net.model(input_ids=tokens[start:t][None]).logits[0, -1].float().log_softmax(-1)
        torch.testing.assert_close(lp[t - 1], ref, atol=2e-5, rtol=1e-5)
        assert t - start >= 17 or t <= 32


def test_the_word_tokenizer_encodes_text_as_the_corpus_does(tmp_path):
    itos = ["<unk>", "<eos>", "the", "cat", "sat"]
    tok = word_tokenizer(itos)
    path = tmp_path / "t.txt"
    path.write_text(" the cat sat \n the dog sat\n\n cat \n")
    ids = hf_text_tokens(path, tok).tolist()
    assert ids == [2, 3, 4, 1, 2, 0, 4, 1, 3, 1]  # <eos> after each line, <unk> for an unknown word


def _compose(overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny transformer trained for one short epoch through python -m lmcal.train's machinery (real PTB if found)."""
    out = tmp_path_factory.mktemp("transformer")
    data = [f"data.root={DATA_ROOT}"] if HAVE_PTB else [
        "data.name=synthetic", "+data.corpus_kwargs={vocab_size: 60, n_train: 20000, n_valid: 3000, n_test: 3000}"]
    cfg = _compose(["experiment=ptb_transformer_small", *TINY, "logger=none", "analysis.stages=[]",
                    "trainer.max_epochs=1", "data.max_train_tokens=20000", "data.max_eval_tokens=2000",
                    "optim.warmup_steps=5", "trainer.enable_progress_bar=false", *data])
    with open_dict(cfg):
        cfg.paths.output_dir = str(out)
    return train(cfg), out


def test_training_writes_metrics_and_a_complete_hugging_face_folder(trained):
    m, out = trained
    assert m["epochs"] == 1 and m["model"].startswith("Transformer 2x32") and m["test_ppl"] < m["params"]
    folder = Path(m["hf_folder"])
    assert (folder / "config.json").is_file() and (folder / "tokenizer.json").is_file()
    lm = load_hf_model(folder)
    assert lm.vocab_size == len(lm.tokenizer) and lm.max_positions == 64
    assert lm.model.config.lmcal_label == m["model"]  # model=hf names it so (lmcal.stages.targets.hf_label)


@needs_ptb
def test_the_folder_reloads_through_model_hf_with_the_checkpoints_test_cross_entropy(trained, tmp_path):
    """The word-level tokenizer turns PTB's test text into the corpus's own ids, and windows of the context score
    it exactly as the Lightning checkpoint's test evaluation does."""
    from lmcal.evaluate import evaluate
    from lmcal.models.checkpoint import load_net
    from lmcal.training.module import LMDataModule

    m, out = trained
    net, ckpt = load_net(m["best_ckpt"])
    dm = LMDataModule(**{k: v for k, v in ckpt["hyper_parameters"]["data_cfg"].items() if k != "_target_"})
    corpus_test = dm.tokens("test")
    lm = load_hf_model(m["hf_folder"])
    text_test = hf_text_tokens(ptb_text_file("test", DATA_ROOT), lm.tokenizer, corpus_test.numel())
    assert torch.equal(text_test, corpus_test)
    ce_hf, n = hf_cross_entropy(lm, text_test)
    ce_ckpt, n_ckpt = evaluate_ce(net, corpus_test, 1, dm.bptt)
    assert n == n_ckpt and ce_hf == pytest.approx(ce_ckpt, abs=1e-5) and ce_hf == pytest.approx(m["test_ce_nats"],
                                                                                                 abs=1e-5)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="evaluate", overrides=["model=hf", f"model.name_or_path={m['hf_folder']}",
                                                          f"model.max_tokens={corpus_test.numel()}", "stages=[]",
                                                          "logger=none", f"data_root={DATA_ROOT}"])
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path)
    assert evaluate(cfg)["test_ce_nats"] == pytest.approx(m["test_ce_nats"], abs=1e-5)


def test_every_stage_runs_on_the_trained_transformer(trained, tmp_path):
    from lmcal.evaluate import evaluate

    m, _ = trained
    gen = {"num_prefixes": 2, "samples_per_prefix": 2, "prefix_len": 5, "horizon": 4}
    over = [f"analysis.{s}.{k}={v}" for s in ("entropy_rate", "calibration", "decoders") for k, v in gen.items()]
    over += [f"analysis.{s}.{k}={v}" for s in ("calibration", "decoders") for k, v in
             (("fit_streams", 2), ("fit_tokens", 40), ("min_context", 5), ("score_tokens", 100), ("topk", 4))]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="evaluate", overrides=[
            f"ckpt={m['best_ckpt']}", "stages=[entropy_rate,calibration,decoders,memory]", "logger=none",
            "analysis.memory.limited=window", "analysis.memory.tau=3", "analysis.memory.score_tokens=300",
            "analysis.memory.cluster_size=50", *over, *([f"data_root={DATA_ROOT}"] if DATA_ROOT else [])])
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path)
    res = evaluate(cfg)
    assert len(res["entropy_rate"]["curve_nats"]) == 4 and res["calibration"]["topk"] == 4
    assert res["memory"]["limited"] == "window" and res["memory"]["mi_upper_bound_nats"] >= 0
    assert json.loads((tmp_path / "evaluation.json").read_text())["model"].startswith("Transformer")
