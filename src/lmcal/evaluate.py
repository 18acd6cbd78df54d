"""Analysis stages on an existing checkpoint: `python -m lmcal.evaluate ckpt=PATH stages=[entropy_rate,calibration]`,
or, for a tau-model, `python -m lmcal.evaluate ckpt=TAU_CKPT memory.base_ckpt=BASE_CKPT stages=[memory]`.

`evaluate(cfg)` is a plain function; `main` is the Hydra entry point around it.
"""

from __future__ import annotations

import logging
import math
import sys
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from lmcal.callbacks import calibration_stage, entropy_rate_stage, load_base_net, markov_exact_mi, memory_stage
from lmcal.errors import LmcalError
from lmcal.lm import LSTMStepLM
from lmcal.model import evaluate_ce
from lmcal.module import LMDataModule, load_net
from lmcal.train import finish_logger, make_logger, model_name
from lmcal.utils import write_json_atomic

log = logging.getLogger("lmcal")
STAGES = ("entropy_rate", "calibration", "memory")


def load_checkpoint_and_data(ckpt_path: str, data_root: str | None = None, device: str | None = None):
    """The checkpoint's network (eval mode, on `device`) and the data module of the corpus it was trained on."""
    path = Path(ckpt_path).expanduser()
    if not path.is_file():
        raise LmcalError(f"Checkpoint not found: {path}. Pass ckpt= the best.ckpt or last.ckpt in a training run's "
                         "checkpoints/ folder.")
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


def evaluate(cfg: DictConfig) -> dict:
    unknown = [s for s in cfg.stages if s not in STAGES]
    if unknown:
        raise LmcalError(f"Unknown stage(s) {unknown}: choose from {list(STAGES)}, e.g. stages=[entropy_rate].")
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    net, ckpt, dm = load_checkpoint_and_data(cfg.ckpt, cfg.get("data_root"), cfg.get("device"))
    net_cfg = OmegaConf.create(ckpt["hyper_parameters"]["net"])
    name = model_name(net_cfg)
    tau = net.memory_tau
    full_only = [s for s in cfg.stages if s != "memory"]
    if tau and full_only:
        raise LmcalError(f"{cfg.ckpt} is a tau={tau} limited-memory model; stages {full_only} analyse full-context "
                         "models. Run them on the base model's checkpoint, and stages=[memory] on this one.")
    if "memory" in cfg.stages:
        if not tau:
            raise LmcalError(f"stages=[memory] needs ckpt= to be a tau-model (trained with model.memory_tau=TAU); "
                             f"{cfg.ckpt} is full-context.")
        base = load_base_net(cfg.get("memory", {}).get("base_ckpt"), net.decoder.weight.device, dm.name)
        # the splits as the base model has them: a tau-model may have been validated on a prefix only
        _, _, dm = load_checkpoint_and_data(cfg.memory.base_ckpt, cfg.get("data_root"), cfg.get("device"))
        results = {"ckpt": str(Path(cfg.ckpt).resolve()), "model": name, "dataset": dm.name}  # scores: the stage's
    else:
        test_ce, _ = evaluate_ce(net, dm.tokens("test"), dm.test_batch_size, dm.bptt)
        log.info(f"{name} on {dm.name}: test ppl {math.exp(test_ce):.2f}")
        results = {"ckpt": str(Path(cfg.ckpt).resolve()), "model": name, "dataset": dm.name,
                   "test_ce_nats": test_ce, "test_ppl": math.exp(test_ce)}
    logger = make_logger(cfg)
    try:
        for stage in cfg.stages:
            if stage == "entropy_rate":
                settings = {k: v for k, v in cfg.analysis.entropy_rate.items() if k != "every_n_epochs"}
                results[stage] = entropy_rate_stage(LSTMStepLM(net), dm.tokens("valid"), test_ce, out, logger=logger,
                                                    model_name=name, corpus=dm.name, **settings)
            elif stage == "calibration":
                results[stage] = calibration_stage(LSTMStepLM(net), dm.tokens("valid"), dm.tokens("test"), out,
                                                   logger=logger, model_name=name, corpus=dm.name,
                                                   **cfg.analysis.calibration)
            elif stage == "memory":
                results[stage] = memory_stage(base, net, dm.tokens("valid"), dm.tokens("test"), out, logger=logger,
                                              model_name=name, corpus=dm.name, bptt=dm.bptt,
                                              base_ckpt=str(Path(cfg.memory.base_ckpt).resolve()),
                                              ckpt=str(Path(cfg.ckpt).resolve()),
                                              exact_mi_nats=markov_exact_mi(dm.prepare().info, tau)
                                              if dm.name == "markov" else None, **cfg.analysis.memory)
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
