"""Analysis stages on an existing checkpoint: `python -m lmcal.evaluate ckpt=PATH stages=[entropy_rate,calibration]`,
or, for a tau-model, `python -m lmcal.evaluate ckpt=TAU_CKPT memory.base_ckpt=BASE_CKPT stages=[memory]`.
Decoders: `stages=[decoders]` (every method of analysis.decoders.methods), or one method and a sweep of its setting,
`python -m lmcal.evaluate -m ckpt=PATH stages=[decoders] decoder=top_p decoder.p=0.8,0.9,0.95`.

`evaluate(cfg)` is a plain function; `main` is the Hydra entry point around it.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from lmcal.callbacks import (
    calibration_stage,
    decoders_stage,
    entropy_rate_stage,
    load_base_net,
    markov_exact_mi,
    memory_stage,
)
from lmcal.errors import LmcalError
from lmcal.lm import LSTMStepLM
from lmcal.model import evaluate_ce
from lmcal.module import LMDataModule, load_net
from lmcal.train import finish_logger, make_logger, model_name
from lmcal.utils import exp_or_inf, run_lock, write_json_atomic
from lmcal.validate import check_config

log = logging.getLogger("lmcal")
STAGES = ("entropy_rate", "calibration", "decoders", "memory")


def load_checkpoint_and_data(ckpt_path: str, data_root: str | None = None, device: str | None = None):
    """The checkpoint's network (eval mode, on `device`) and the data module of the corpus it was trained on."""
    path = Path(ckpt_path).expanduser()
    net, ckpt = load_net(path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    net.to(device)
    data_cfg = dict(ckpt["hyper_parameters"].get("data_cfg") or {})
    if not data_cfg:  # checkpoints from before lmcal recorded their corpus: PTB with its default settings
        log.warning(f"{path} does not record its corpus; assuming data=ptb with the default batch settings.")
        data_cfg = {"name": "ptb"}
    data_cfg.pop("_target_", None)
    if data_root:
        data_cfg["root"] = data_root
    dm = LMDataModule(**data_cfg)
    dm.prepare()
    return net, ckpt, dm


def decoders_settings(cfg: DictConfig, calibration: dict | None) -> dict:
    """The decoders stage's keyword arguments: analysis.decoders, with `decoder=NAME` (one method) in place of its
    method list, and the calibration result of this run or of analysis.decoders.calibration_json to reuse."""
    settings = OmegaConf.to_container(cfg.analysis.decoders, resolve=True)
    if cfg.get("decoder"):
        settings["methods"] = [OmegaConf.to_container(cfg.decoder, resolve=True)]
    path = settings.pop("calibration_json", None)
    if calibration is None and path:
        if not Path(path).is_file():
            raise LmcalError(f"analysis.decoders.calibration_json={path} does not exist; run stages=[calibration] "
                             "first, or drop the setting to fit the calibration row in this stage.")
        calibration = json.loads(Path(path).read_text())
    return {**settings, "calibration": calibration}


def hf_target(cfg: DictConfig) -> dict:
    """model=hf: a Hugging Face causal LM from model.name_or_path, and the validation and test text tokenised with
    its own tokenizer (model.valid_text / model.test_text, else PTB's files under the data root). Its test
    cross-entropy is per model token, on model.score_tokens test tokens scored in windows of model.context tokens."""
    from lmcal.data import hf_text_tokens, ptb_text_file
    from lmcal.lm import hf_cross_entropy, load_hf_model

    m = cfg.model
    unsupported = [s for s in cfg.stages if s == "memory"]
    if unsupported:
        raise LmcalError("stages=[memory] needs trained tau-limited models (python -m lmcal.train "
                         "model.memory_tau=TAU); it does not run on Hugging Face models. Use entropy_rate, "
                         "calibration and decoders.")
    device = cfg.get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    lm = load_hf_model(m.name_or_path, device=device, dtype=m.get("dtype"))
    root = cfg.get("data_root")
    texts = {split: Path(m.get(f"{split}_text") or ptb_text_file(split, root)) for split in ("valid", "test")}
    tokens = {split: hf_text_tokens(path, lm.tokenizer, m.get("max_tokens")) for split, path in texts.items()}
    test_ce, n = hf_cross_entropy(lm, tokens["test"][:m.get("score_tokens")], m.get("context"))
    name = m.get("label") or Path(str(m.name_or_path)).name
    corpus = f"{texts['valid'].stem} ({name} tokens)"
    log.info(f"{name}: test ppl {exp_or_inf(test_ce):.2f} per model token on {n:,} tokens of {texts['test']}")
    return {"lm": lm, "name": name, "corpus": corpus, "valid": tokens["valid"], "test": tokens["test"],
            "test_ce": test_ce, "results": {"model": name, "name_or_path": str(m.name_or_path), "dataset": corpus,
                                            "valid_text": str(texts["valid"]), "test_text": str(texts["test"]),
                                            "test_ce_nats": test_ce, "test_ppl": exp_or_inf(test_ce),
                                            "test_tokens": n, "unit": "model token"}}


def checkpoint_target(cfg: DictConfig) -> dict:
    """ckpt=PATH: a trained LSTM (full or tau-limited) and its corpus; for stages=[memory] also its base model."""
    net, ckpt, dm = load_checkpoint_and_data(cfg.ckpt, cfg.get("data_root"), cfg.get("device"))
    name = model_name(OmegaConf.create(ckpt["hyper_parameters"]["net"]))
    tau = net.memory_tau
    full_only = [s for s in cfg.stages if s != "memory"]
    if tau and full_only:
        raise LmcalError(f"{cfg.ckpt} is a tau={tau} limited-memory model; stages {full_only} analyse full-context "
                         "models. Run them on the base model's checkpoint, and stages=[memory] on this one.")
    target = {"lm": LSTMStepLM(net), "net": net, "name": name, "corpus": dm.name, "test_ce": None,
              "results": {"ckpt": str(Path(cfg.ckpt).resolve()), "model": name, "dataset": dm.name}}
    if "memory" in cfg.stages:
        if not tau:
            raise LmcalError(f"stages=[memory] needs ckpt= to be a tau-model (trained with model.memory_tau=TAU); "
                             f"{cfg.ckpt} is full-context.")
        target["base"] = load_base_net(cfg.get("memory", {}).get("base_ckpt"), net.decoder.weight.device, dm.name)
        # the splits as the base model has them: a tau-model may have been validated on a prefix only
        _, _, dm = load_checkpoint_and_data(cfg.memory.base_ckpt, cfg.get("data_root"), cfg.get("device"))
        target["exact_mi"] = markov_exact_mi(dm.prepare().info, tau) if dm.name == "markov" else None
    else:  # scores of a tau-model are the memory stage's
        test_ce, _ = evaluate_ce(net, dm.tokens("test"), dm.test_batch_size, dm.bptt)
        log.info(f"{name} on {dm.name}: test ppl {exp_or_inf(test_ce):.2f}")
        target["test_ce"] = test_ce
        target["results"].update({"test_ce_nats": test_ce, "test_ppl": exp_or_inf(test_ce)})
    target.update(valid=dm.tokens("valid"), test=dm.tokens("test"), bptt=dm.bptt)
    return target


def evaluate(cfg: DictConfig) -> dict:
    """Runs the stages on the checkpoint or Hugging Face model, writes evaluation.json. Settings are checked first,
    then the run folder is locked for this process."""
    check_config(cfg)
    out = Path(cfg.paths.output_dir)
    with run_lock(out, "evaluation"):
        return _evaluate(cfg, out)


def _evaluate(cfg: DictConfig, out: Path) -> dict:
    unknown = [s for s in cfg.stages if s not in STAGES]
    if unknown:
        raise LmcalError(f"Unknown stage(s) {unknown}: choose from {list(STAGES)}, e.g. stages=[entropy_rate].")
    hf = cfg.get("model") is not None
    has_ckpt = not OmegaConf.is_missing(cfg, "ckpt") and cfg.ckpt is not None
    if hf and has_ckpt:
        raise LmcalError("Give either ckpt= (a trained LSTM) or model=hf model.name_or_path= (a Hugging Face "
                         "model), not both.")
    if not hf and not has_ckpt:
        raise LmcalError("Say what to analyse: ckpt=PATH (a checkpoint of python -m lmcal.train) or model=hf "
                         "model.name_or_path=FOLDER (a Hugging Face causal LM).")
    target = hf_target(cfg) if hf else checkpoint_target(cfg)
    lm, name, corpus, valid, test = (target[k] for k in ("lm", "name", "corpus", "valid", "test"))
    results = target["results"]
    unit = results.get("unit", "word")
    logger = make_logger(cfg)
    try:
        for stage in cfg.stages:
            if stage == "entropy_rate":
                settings = {k: v for k, v in cfg.analysis.entropy_rate.items() if k != "every_n_epochs"}
                results[stage] = entropy_rate_stage(lm, valid, target["test_ce"], out, logger=logger,
                                                    model_name=name, corpus=corpus, unit=unit, **settings)
            elif stage == "calibration":
                results[stage] = calibration_stage(lm, valid, test, out, logger=logger, model_name=name,
                                                   corpus=corpus, unit=unit, **cfg.analysis.calibration)
            elif stage == "decoders":
                results[stage] = decoders_stage(lm, valid, test, out, logger=logger, model_name=name, corpus=corpus,
                                                unit=unit, **decoders_settings(cfg, results.get("calibration")))
            elif stage == "memory":
                results[stage] = memory_stage(target["base"], target["net"], valid, test, out, logger=logger,
                                              model_name=name, corpus=corpus, bptt=target["bptt"],
                                              base_ckpt=str(Path(cfg.memory.base_ckpt).resolve()),
                                              ckpt=str(Path(cfg.ckpt).resolve()), exact_mi_nats=target["exact_mi"],
                                              **cfg.analysis.memory)
        write_json_atomic(out / "evaluation.json", results)
        return results
    finally:
        finish_logger(logger)


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
