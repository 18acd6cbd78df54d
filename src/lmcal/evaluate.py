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
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from lmcal.core.lookahead import set_memory_budget
from lmcal.errors import LmcalError
from lmcal.stages.registry import run_stages
from lmcal.stages.scale_record import record_evaluation
from lmcal.stages.targets import checkpoint_target, hf_target, stage_settings
from lmcal.stages.wandb_run import finish_run, wandb_run
from lmcal.utils.boundary import boundary, run_hydra
from lmcal.utils.device import apply_precision_policy, resolve_device
from lmcal.utils.io import write_json_atomic
from lmcal.utils.lock import run_lock
from lmcal.utils.quiet import quiet_third_party
from lmcal.utils.settings import CONF_DIR  # noqa: F401  (it registers the configs' lmcal_root resolver)
from lmcal.utils.validate import check_config

log = logging.getLogger("lmcal")
quiet_third_party()  # once per process


def evaluate(cfg: DictConfig) -> dict:
    """Runs the stages on the checkpoint or Hugging Face model, writes evaluation.json. Settings are checked first,
    then the run folder is locked for this process."""
    check_config(cfg)
    with open_dict(cfg):  # the one device every model of the run goes to (not one of the recorded settings)
        cfg.device = resolve_device(cfg.get("device"))
    apply_precision_policy()  # TF32 off, set explicitly (lmcal.utils.device)
    out = Path(cfg.paths.output_dir)
    with run_lock(out, "evaluation"):
        return _evaluate(cfg, out)


def _evaluate(cfg: DictConfig, out: Path) -> dict:
    settings = stage_settings(cfg)  # before any model is loaded
    set_memory_budget(cfg.analysis.get("memory_budget_gb"))  # the lookahead's chunks (lmcal.core.lookahead)
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
    results["device"] = str(cfg.device)
    stages = list(cfg.stages)
    window = (settings.get("memory") or {}).get("limited") == "window"
    logger = wandb_run(cfg.get("logger"), OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False), out,
                       job_type=stages[0] if len(stages) == 1 else "evaluate", model=target["name"],
                       dataset=target["corpus"], tags=tuple(stages) + (("window",) if window else ()),
                       name="-".join([*stages, *(["window", f"tau{settings['memory'].get('tau')}"] if window else [])])
                       or "evaluate")
    try:
        stage_results = run_stages(list(cfg.stages), target, settings, out, logger)
        results.update(stage_results)
        record_evaluation(out, cfg, target, stage_results, logger)  # scale.json, after entropy_rate
        write_json_atomic(out / "evaluation.json", results)
        return results
    finally:
        finish_run(logger)


@hydra.main(version_base="1.3", config_path="../../conf", config_name="evaluate")
def main(cfg: DictConfig) -> None:
    with boundary():
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)  # every interpolation, before any work
        evaluate(cfg)


if __name__ == "__main__":
    run_hydra(main)
