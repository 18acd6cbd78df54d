"""What an analysis process analyses, built from its config: a checkpoint's network and corpus, or a Hugging Face
model and its text, as the target dict the stages take (lm, valid, test, test_ce, name, corpus, unit, kind, ...).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from lmcal.data.markov import markov_exact_mi
from lmcal.errors import LmcalError
from lmcal.models.awd_lstm import evaluate_ce
from lmcal.models.checkpoint import base_checkpoint, checkpoint_data, load_base_net, load_net, model_name
from lmcal.models.step_lm import as_step_lm
from lmcal.stages.registry import STAGES, check_plan, check_stages
from lmcal.utils.device import resolve_device
from lmcal.utils.numbers import exp_or_inf
from lmcal.utils.settings import CONF_DIR  # noqa: F401  (it registers the configs' lmcal_root resolver)

log = logging.getLogger("lmcal")


def load_checkpoint_and_data(ckpt_path: str, data_root: str | None = None, device: str | None = None):
    """The checkpoint's network (eval mode, on `device`) and the corpus it was trained on (a CorpusData,
    loaded)."""
    path = Path(ckpt_path).expanduser()
    net, ckpt = load_net(path)
    net.to(resolve_device(device))
    dm = checkpoint_data(ckpt, data_root, path)
    dm.prepare()
    if dm.vocab_size != net.vocab_size:  # (the network was not trained on the corpus its data settings name)
        raise LmcalError(f"{path}: its network reads a vocabulary of {net.vocab_size:,} words, but the corpus its "
                         f"data settings name ({dm.name}) has {dm.vocab_size:,}: they do not belong together (the "
                         "data settings were edited, or come from another checkpoint). Nothing was run; use the "
                         "checkpoint as its training wrote it.")
    return net, ckpt, dm


def wants_test_ce(cfg: DictConfig) -> bool:
    """Whether the model's test CE is computed for these stages: for a stage that reads it (Stage.needs_test_ce), or
    for stages=[] (the model's perplexity alone); the other stages score their own test words."""
    return not cfg.stages or any(STAGES[n].needs_test_ce for n in cfg.stages)


def stage_settings(cfg: DictConfig) -> dict[str, dict]:
    """analysis.<stage> of every stage asked for, checked against the stage's parameters; `decoder=NAME` (one
    method, e.g. for a sweep of its setting) replaces analysis.decoders.methods."""
    given = {n: OmegaConf.to_container(cfg.analysis[n], resolve=True) for n in cfg.stages if n in cfg.analysis}
    if cfg.get("decoder") and "decoders" in cfg.stages:  # before the check: the method is checked as the others
        one = [OmegaConf.to_container(cfg.decoder, resolve=True)]
        given["decoders"] = {**given.get("decoders", {}), "methods": one}
    return check_plan(list(cfg.stages), None, given)


def hf_target(cfg: DictConfig, settings: dict[str, dict] | None = None, check_sizes=None) -> dict:
    """model=hf: a Hugging Face causal LM from model.name_or_path, and the validation and test text tokenised with
    its own tokenizer (model.valid_text / model.test_text, else PTB's files under the data root). Its test
    cross-entropy is per model token, on model.score_tokens test tokens scored in windows of model.context tokens.
    `check_sizes(hf_config=, corpus=, text_vocab=, name=)` is called once the text is read, before the weights are
    loaded (the entry point's preflight)."""
    from lmcal.data.corpora import hf_text_tokens, ptb_text_file
    from lmcal.models.hf import hf_cross_entropy, load_hf_model, load_hf_tokenizer

    m = cfg.model
    check_stages(list(cfg.stages), "hf", settings or stage_settings(cfg))  # before the model is loaded
    device = resolve_device(cfg.get("device"))
    dmap = m.get("device_map")
    tokenizer, config = load_hf_tokenizer(m.name_or_path)
    root = cfg.get("data_root")
    splits = ("train", "valid", "test") if "future_entropy" in cfg.stages else ("valid", "test")  # heads need train
    texts = {split: Path(m.get(f"{split}_text") or ptb_text_file(split, root)) for split in splits}
    tokens = {split: hf_text_tokens(path, tokenizer, m.get("max_tokens")) for split, path in texts.items()}
    name = hf_label(m, config)
    if check_sizes is not None:
        check_sizes(hf_config=config, corpus={s: int(t.numel()) for s, t in tokens.items()},
                    text_vocab=1 + max(int(t.max()) for t in tokens.values() if t.numel()), name=name)
    lm = load_hf_model(m.name_or_path, device=device, dtype=m.get("dtype"), tokenizer=tokenizer,
                       device_map=OmegaConf.to_container(dmap) if OmegaConf.is_config(dmap) else dmap)
    corpus = f"{texts['valid'].stem} ({name} tokens)"
    dataset = re.sub(r"[._-]?valid$", "", texts["valid"].stem) or texts["valid"].stem  # ptb.valid: ptb (for W&B)
    results = {"model": name, "name_or_path": str(m.name_or_path), "dataset": corpus, "valid_text": str(texts["valid"]),
               "test_text": str(texts["test"]), "unit": "model token"}
    test_ce = None
    if wants_test_ce(cfg):
        test_ce, n = hf_cross_entropy(lm, tokens["test"][:m.get("score_tokens")], m.get("context"))
        log.info(f"{name}: test ppl {exp_or_inf(test_ce):.2f} per model token on {n:,} tokens of {texts['test']}")
        results.update({"test_ce_nats": test_ce, "test_ppl": exp_or_inf(test_ce), "test_tokens": n})
    return {"lm": lm, "kind": "hf", "unit": "model token", "name": name, "corpus": corpus, "dataset": dataset,
            "valid": tokens["valid"], "test": tokens["test"], "test_ce": test_ce, "results": results,
            **({"train": tokens["train"]} if "train" in tokens else {})}


def hf_label(m, config) -> str:
    """A Hugging Face model's name in tables, figures and W&B: model.label, else the name a folder of lmcal.train
    recorded (lmcal_label in its config.json, as display text only), else the folder's (or hub id's) last part."""
    recorded = getattr(config, "lmcal_label", None)
    return str(m.get("label") or (str(recorded)[:80] if isinstance(recorded, str) and recorded.strip() else "")
               or Path(str(m.name_or_path)).name)


def checkpoint_target(cfg: DictConfig, settings: dict[str, dict] | None = None, check_sizes=None) -> dict:
    """ckpt=PATH: a trained LSTM or transformer (full or tau-limited) and its corpus; for stages=[memory] also its base
    model (a full-context model with analysis.memory.limited=window is its own). `check_sizes(hp=, vocab=, corpus=,
    memory_tau=)` is called once the checkpoint and its corpus are read, before any work (the entry point's
    preflight)."""
    settings = settings or stage_settings(cfg)
    net, ckpt, dm = load_checkpoint_and_data(cfg.ckpt, cfg.get("data_root"), cfg.get("device"))
    name = model_name(OmegaConf.create(ckpt["hyper_parameters"]["net"]))
    tau = net.memory_tau
    check_stages(list(cfg.stages), "tau" if tau else "full", settings)
    if check_sizes is not None:
        check_sizes(hp=ckpt["hyper_parameters"], vocab=int(dm.vocab_size), memory_tau=tau,
                    corpus={s: int(dm.tokens(s).numel()) for s in ("train", "valid", "test")})
    target = {"lm": as_step_lm(net), "net": net, "kind": "tau" if tau else "full", "unit": "word", "name": name,
              "corpus": dm.name, "test_ce": None, "ckpt": str(Path(cfg.ckpt).resolve()),
              "results": {"ckpt": str(Path(cfg.ckpt).resolve()), "model": name, "dataset": dm.name}}
    if "memory" in cfg.stages:
        if tau:
            base = base_checkpoint(OmegaConf.to_container(cfg.memory, resolve=True) if cfg.get("memory") else None,
                                   dm.name)
            target["base_ckpt"] = str(Path(base).resolve()) if base else None
            target["base"] = load_base_net(base, net.decoder.weight.device, dm.name, dm.corpus_kwargs,
                                           dm.vocab_size)
            # the splits as the base model has them: a tau-model may have been validated on a prefix only
            _, _, dm = load_checkpoint_and_data(base, cfg.get("data_root"), cfg.get("device"))
        else:  # limited=window (check_stages allowed it): the model is its own base
            target["base_ckpt"], target["base"] = target["ckpt"], net
        mtau = settings["memory"].get("tau") or tau  # the window length, else the tau-model's own
        target["exact_mi"] = markov_exact_mi(dm.prepare().info, mtau) if dm.name == "markov" and mtau else None
    if wants_test_ce(cfg):
        test_ce, _ = evaluate_ce(net, dm.tokens("test"), dm.test_batch_size, dm.bptt, progress="scoring test")
        log.info(f"{name} on {dm.name}: test ppl {exp_or_inf(test_ce):.2f}")
        target["test_ce"] = test_ce
        target["results"].update({"test_ce_nats": test_ce, "test_ppl": exp_or_inf(test_ce)})
    target.update(train=dm.tokens("train"), valid=dm.tokens("valid"), test=dm.tokens("test"), bptt=dm.bptt)
    return target
