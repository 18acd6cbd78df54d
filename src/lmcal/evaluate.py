"""Analysis stages on an existing checkpoint: `python -m lmcal.evaluate ckpt=PATH stages=[entropy_rate,calibration]`,
or, for a tau-model, `python -m lmcal.evaluate ckpt=TAU_CKPT memory.base_ckpt=BASE_CKPT stages=[memory]`; the model
itself on tau-token windows: `python -m lmcal.evaluate ckpt=BASE_CKPT stages=[memory] analysis.memory.limited=window
analysis.memory.tau=5`.
Decoders: `stages=[decoders]` (every method of analysis.decoders.methods), or one method and a sweep of its setting,
`python -m lmcal.evaluate -m ckpt=PATH stages=[decoders] decoder=top_p decoder.p=0.8,0.9,0.95`.

`evaluate(cfg)` is a plain function; `main` is the Hydra entry point around it.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from lmcal.analysis import finish_run, wandb_run
from lmcal.checkpoint import checkpoint_data, load_base_net, load_net, model_name
from lmcal.errors import LmcalError
from lmcal.lm import as_step_lm
from lmcal.markov import markov_exact_mi
from lmcal.model import evaluate_ce
from lmcal.settings import CONF_DIR  # noqa: F401  (it registers the configs' lmcal_root resolver)
from lmcal.stages import STAGES, check_plan, check_stages, run_stages
from lmcal.utils import exp_or_inf, run_lock, write_json_atomic
from lmcal.validate import check_config

log = logging.getLogger("lmcal")


def load_checkpoint_and_data(ckpt_path: str, data_root: str | None = None, device: str | None = None):
    """The checkpoint's network (eval mode, on `device`) and the corpus it was trained on (lmcal.data.CorpusData,
    loaded)."""
    path = Path(ckpt_path).expanduser()
    net, ckpt = load_net(path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    net.to(device)
    dm = checkpoint_data(ckpt, data_root, path)
    dm.prepare()
    return net, ckpt, dm


def wants_test_ce(cfg: DictConfig) -> bool:
    """Whether the model's test CE is computed for these stages: for a stage that reads it (Stage.needs_test_ce), or
    for stages=[] (the model's perplexity alone); the other stages score their own test words."""
    return not cfg.stages or any(STAGES[n].needs_test_ce for n in cfg.stages)


def stage_settings(cfg: DictConfig) -> dict[str, dict]:
    """analysis.<stage> of every stage asked for, checked against the stage's parameters; `decoder=NAME` (one
    method, e.g. for a sweep of its setting) replaces analysis.decoders.methods."""
    settings = check_plan(list(cfg.stages), None, {n: OmegaConf.to_container(cfg.analysis[n], resolve=True)
                                                   for n in cfg.stages if n in cfg.analysis})
    if cfg.get("decoder") and "decoders" in settings:
        settings["decoders"]["methods"] = [OmegaConf.to_container(cfg.decoder, resolve=True)]
    return settings


def hf_target(cfg: DictConfig, settings: dict[str, dict] | None = None) -> dict:
    """model=hf: a Hugging Face causal LM from model.name_or_path, and the validation and test text tokenised with
    its own tokenizer (model.valid_text / model.test_text, else PTB's files under the data root). Its test
    cross-entropy is per model token, on model.score_tokens test tokens scored in windows of model.context tokens."""
    from lmcal.corpora import hf_text_tokens, ptb_text_file
    from lmcal.lm import hf_cross_entropy, load_hf_model

    m = cfg.model
    check_stages(list(cfg.stages), "hf", settings or stage_settings(cfg))  # before the model is loaded
    device = cfg.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    lm = load_hf_model(m.name_or_path, device=device, dtype=m.get("dtype"))
    root = cfg.get("data_root")
    splits = ("train", "valid", "test") if "future_entropy" in cfg.stages else ("valid", "test")  # heads need train
    texts = {split: Path(m.get(f"{split}_text") or ptb_text_file(split, root)) for split in splits}
    tokens = {split: hf_text_tokens(path, lm.tokenizer, m.get("max_tokens")) for split, path in texts.items()}
    name = m.get("label") or Path(str(m.name_or_path)).name
    corpus = f"{texts['valid'].stem} ({name} tokens)"
    results = {"model": name, "name_or_path": str(m.name_or_path), "dataset": corpus, "valid_text": str(texts["valid"]),
               "test_text": str(texts["test"]), "unit": "model token"}
    test_ce = None
    if wants_test_ce(cfg):
        test_ce, n = hf_cross_entropy(lm, tokens["test"][:m.get("score_tokens")], m.get("context"))
        log.info(f"{name}: test ppl {exp_or_inf(test_ce):.2f} per model token on {n:,} tokens of {texts['test']}")
        results.update({"test_ce_nats": test_ce, "test_ppl": exp_or_inf(test_ce), "test_tokens": n})
    return {"lm": lm, "kind": "hf", "unit": "model token", "name": name, "corpus": corpus, "valid": tokens["valid"],
            "test": tokens["test"], "test_ce": test_ce, "results": results,
            **({"train": tokens["train"]} if "train" in tokens else {})}


def checkpoint_target(cfg: DictConfig, settings: dict[str, dict] | None = None) -> dict:
    """ckpt=PATH: a trained LSTM (full or tau-limited) and its corpus; for stages=[memory] also its base model (a
    full-context model with analysis.memory.limited=window is its own)."""
    settings = settings or stage_settings(cfg)
    net, ckpt, dm = load_checkpoint_and_data(cfg.ckpt, cfg.get("data_root"), cfg.get("device"))
    name = model_name(OmegaConf.create(ckpt["hyper_parameters"]["net"]))
    tau = net.memory_tau
    check_stages(list(cfg.stages), "tau" if tau else "full", settings)
    target = {"lm": as_step_lm(net), "net": net, "kind": "tau" if tau else "full", "unit": "word", "name": name,
              "corpus": dm.name, "test_ce": None, "ckpt": str(Path(cfg.ckpt).resolve()),
              "results": {"ckpt": str(Path(cfg.ckpt).resolve()), "model": name, "dataset": dm.name}}
    if "memory" in cfg.stages:
        if tau:
            target["base_ckpt"] = str(Path(cfg.memory.base_ckpt).resolve()) if cfg.memory.base_ckpt else None
            target["base"] = load_base_net(cfg.get("memory", {}).get("base_ckpt"), net.decoder.weight.device, dm.name)
            # the splits as the base model has them: a tau-model may have been validated on a prefix only
            _, _, dm = load_checkpoint_and_data(cfg.memory.base_ckpt, cfg.get("data_root"), cfg.get("device"))
        else:  # limited=window (check_stages allowed it): the model is its own base
            target["base_ckpt"], target["base"] = target["ckpt"], net
        mtau = settings["memory"].get("tau") or tau  # the window length, else the tau-model's own
        target["exact_mi"] = markov_exact_mi(dm.prepare().info, mtau) if dm.name == "markov" and mtau else None
    if wants_test_ce(cfg):
        test_ce, _ = evaluate_ce(net, dm.tokens("test"), dm.test_batch_size, dm.bptt)
        log.info(f"{name} on {dm.name}: test ppl {exp_or_inf(test_ce):.2f}")
        target["test_ce"] = test_ce
        target["results"].update({"test_ce_nats": test_ce, "test_ppl": exp_or_inf(test_ce)})
    target.update(train=dm.tokens("train"), valid=dm.tokens("valid"), test=dm.tokens("test"), bptt=dm.bptt)
    return target


def evaluate(cfg: DictConfig) -> dict:
    """Runs the stages on the checkpoint or Hugging Face model, writes evaluation.json. Settings are checked first,
    then the run folder is locked for this process."""
    check_config(cfg)
    out = Path(cfg.paths.output_dir)
    with run_lock(out, "evaluation"):
        return _evaluate(cfg, out)


def _evaluate(cfg: DictConfig, out: Path) -> dict:
    settings = stage_settings(cfg)  # before any model is loaded
    hf = cfg.get("model") is not None
    has_ckpt = not OmegaConf.is_missing(cfg, "ckpt") and cfg.ckpt is not None
    if hf and has_ckpt:
        raise LmcalError("Give either ckpt= (a trained LSTM) or model=hf model.name_or_path= (a Hugging Face "
                         "model), not both.")
    if not hf and not has_ckpt:
        raise LmcalError("Say what to analyse: ckpt=PATH (a checkpoint of python -m lmcal.train) or model=hf "
                         "model.name_or_path=FOLDER (a Hugging Face causal LM).")
    target = hf_target(cfg, settings) if hf else checkpoint_target(cfg, settings)
    results = target["results"]
    logger = wandb_run(cfg.get("logger"), OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False))
    try:
        results.update(run_stages(list(cfg.stages), target, settings, out, logger))
        write_json_atomic(out / "evaluation.json", results)
        return results
    finally:
        finish_run(logger)


@hydra.main(version_base="1.3", config_path="../../conf", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    try:
        evaluate(cfg)
    except LmcalError as e:
        log.error(str(e))
        print(f"\nlmcal: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
