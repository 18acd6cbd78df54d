"""Checkpoints from elsewhere (issue 41): checked against their corpus and for sanity before anything runs on them:
the network's vocabulary against the corpus's, sizes in range, weights finite, data settings with known keys only,
and a checkpoint's own `root` and `download` never used (the data come from this run's settings). Small crafted
checkpoints, no training: in-process through the loaders, and once through `python -m lmcal.evaluate`."""

import math

import pytest
import torch

from lmcal.errors import LmcalError
from lmcal.models.awd_lstm import AWDLSTM
from lmcal.models.checkpoint import checkpoint_data, load_net, read_checkpoint
from lmcal.stages.targets import load_checkpoint_and_data
from tests.test_hostile_inputs import assert_one_paragraph, run

NET = {"_target_": "lmcal.models.awd_lstm.AWDLSTM", "emb_size": 8, "hidden_size": 8, "num_layers": 1}
SYNTHETIC = {"name": "synthetic", "corpus_kwargs": {"vocab_size": 60, "n_train": 2000, "n_valid": 300, "n_test": 300},
             "batch_size": 4, "eval_batch_size": 4, "test_batch_size": 1, "bptt": 10}


def _ckpt(path, vocab=60, data=None, net=None, edit=None):
    """A checkpoint as python -m lmcal.train writes one (settings, vocabulary, data settings, weights), then `edit`."""
    sizes = {k: v for k, v in NET.items() if k != "_target_"}
    weights = {f"net.{k}": v for k, v in AWDLSTM(vocab_size=vocab, **sizes).state_dict().items()}
    c = {"hyper_parameters": {"net": {**NET, **(net or {})}, "vocab_size": vocab,
                              "data_cfg": SYNTHETIC if data is None else data}, "state_dict": weights}
    if edit:
        edit(c)
    torch.save(c, path)
    return path


def test_a_whole_checkpoint_loads(tmp_path):
    net, ckpt, dm = load_checkpoint_and_data(str(_ckpt(tmp_path / "ok.ckpt")))
    assert net.vocab_size == dm.vocab_size == 60


@pytest.mark.parametrize("what,data,needle", [
    ("an unknown key", {**SYNTHETIC, "colour": "red"}, "unknown keys colour"),
    ("a nested node", {**SYNTHETIC, "bptt": {"_target_": "builtins.open"}}, "bptt="),
    ("a list", ["ptb"], "data settings are a list"),
])
def test_data_settings_lmcal_does_not_read_are_refused_naming_them(what, data, needle, tmp_path):
    with pytest.raises(LmcalError, match=needle):
        load_checkpoint_and_data(str(_ckpt(tmp_path / "x.ckpt", data=data)))


@pytest.mark.parametrize("net,needle", [({"hidden_size": -5}, "model.hidden_size=-5 (LSTM hidden size"),
                                        ({"dropout": 2.0}, "model.dropout=2.0"),
                                        ({"num_layers": 0}, "model.num_layers=0")])
def test_network_sizes_out_of_range_are_refused(net, needle, tmp_path):
    with pytest.raises(LmcalError, match="out of range") as e:
        load_net(_ckpt(tmp_path / "x.ckpt", net=net))
    assert needle in str(e.value)


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_weights_that_are_not_finite_are_refused(value, tmp_path):
    def spoil(c):
        w = c["state_dict"]["net.encoder.weight"]
        w[3, 2] = value

    with pytest.raises(LmcalError, match="NaN or infinite values") as e:
        load_net(_ckpt(tmp_path / "x.ckpt", edit=spoil))
    assert "encoder.weight" in str(e.value)


def test_a_network_whose_vocabulary_is_not_its_corpuss_is_refused(tmp_path):
    path = _ckpt(tmp_path / "x.ckpt", vocab=10_000)  # (a PTB network whose data settings name another corpus)
    with pytest.raises(LmcalError, match="vocabulary of 10,000 words, but the corpus its data settings name "
                                         r"\(synthetic\) has 60"):
        load_checkpoint_and_data(str(path))


@pytest.mark.parametrize("vocab", ["x", 0, None])
def test_a_vocabulary_that_is_no_count_is_refused(vocab, tmp_path):
    with pytest.raises(LmcalError, match="vocab_size"):
        read_checkpoint(_ckpt(tmp_path / "x.ckpt", edit=lambda c: c["hyper_parameters"].__setitem__("vocab_size",
                                                                                                     vocab)))


def test_a_checkpoints_root_and_download_are_never_used(tmp_path, monkeypatch):
    theirs = {**SYNTHETIC, "name": "ptb", "root": str(tmp_path / "their_machine"), "download": True}
    monkeypatch.setenv("LMCAL_DATA_ROOT", str(tmp_path / "mine"))
    dm = checkpoint_data(read_checkpoint(_ckpt(tmp_path / "x.ckpt", data=theirs)))
    assert dm.root == str(tmp_path / "mine") and dm.download  # this run's root; PTB's own config downloads
    dm = checkpoint_data(read_checkpoint(_ckpt(tmp_path / "y.ckpt", data=theirs)), data_root=str(tmp_path / "given"))
    assert dm.root == str(tmp_path / "given")
    dm = checkpoint_data(read_checkpoint(_ckpt(tmp_path / "z.ckpt", data={**SYNTHETIC, "download": True})))
    assert not dm.download  # (a generated corpus is never fetched)
    assert not (tmp_path / "their_machine").exists()


def test_evaluate_refuses_a_network_on_another_corpus_in_one_paragraph(tmp_path):
    path = _ckpt(tmp_path / "x.ckpt", vocab=10_000)
    r = run("lmcal.evaluate", [f"ckpt={path}", "analysis=smoke", "logger=none", f"hydra.run.dir={tmp_path / 'ev'}"],
            tmp_path)
    assert_one_paragraph(r, str(path), "10,000 words")
    assert not (tmp_path / "ev").exists()


def test_resuming_a_checkpoint_without_its_optimiser_settings_grouped_is_refused_in_one_paragraph(tmp_path):
    """Training reads hyper_parameters.optim: a checkpoint that keeps the optimiser settings elsewhere is refused by
    name before Lightning sees it; analysis, which reads only the network and data settings, still loads it."""
    from lmcal.training.checkpoint_io import check_resume
    from lmcal.training.module import OptimConfig

    flat = _ckpt(tmp_path / "flat.ckpt", edit=lambda c: c["hyper_parameters"].update(lr=30.0, clip=0.25))
    with pytest.raises(LmcalError, match=r"hyper_parameters\.optim") as e:
        check_resume(str(flat), NET, 60)
    assert "\n" not in str(e.value) and str(flat) in str(e.value)
    load_net(flat)
    grouped = _ckpt(tmp_path / "grouped.ckpt",
                    edit=lambda c: c["hyper_parameters"].update(optim=OptimConfig().as_dict()))
    check_resume(str(grouped), NET, 60)


def test_a_memory_base_is_matched_by_its_whole_data_settings_not_its_corpus_name(tmp_path):
    """A base trained on another chain of the same name (another seed), or forged to the name with another
    vocabulary, is refused; the base of the same source loads."""
    from lmcal.models.checkpoint import load_base_net

    base = str(_ckpt(tmp_path / "base.ckpt"))
    kw = SYNTHETIC["corpus_kwargs"]
    assert load_base_net(base, "cpu", "synthetic", kw, 60) is not None
    with pytest.raises(LmcalError, match=r"another synthetic: its data.corpus_kwargs.seed=None \(this model: 7\)"):
        load_base_net(base, "cpu", "synthetic", {**kw, "seed": 7}, 60)
    with pytest.raises(LmcalError, match="vocabulary of 60 words, this model 61"):
        load_base_net(base, "cpu", "synthetic", kw, 61)
    with pytest.raises(LmcalError, match="was trained on synthetic, this model on markov"):
        load_base_net(base, "cpu", "markov", kw, 60)
