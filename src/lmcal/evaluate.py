"""Analysis stages on an existing checkpoint: `python -m lmcal.evaluate ckpt=PATH stages=[entropy_rate,calibration]`,
or, for a tau-model, `python -m lmcal.evaluate ckpt=TAU_CKPT memory.base_ckpt=BASE_CKPT stages=[memory]`; the model
itself on tau-token windows: `python -m lmcal.evaluate ckpt=BASE_CKPT stages=[memory] analysis.memory.limited=window
analysis.memory.tau=5`.
Decoders: `stages=[decoders]` (every method of analysis.decoders.methods), or one method and a sweep of its setting,
`python -m lmcal.evaluate -m ckpt=PATH stages=[decoders] decoder=top_p decoder.p=0.8,0.9,0.95`.

`evaluate(cfg)` is a plain function; `main` is the Hydra entry point around it.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf, open_dict

from lmcal.core.lookahead import set_memory_budget
from lmcal.errors import LmcalError
from lmcal.models.checkpoint import model_name, read_checkpoint
from lmcal.pipeline.preflight import checkpoint_model, hf_model, preflight
from lmcal.reporting.docs import provenance, versions
from lmcal.stages.registry import result_rows, run_stages
from lmcal.stages.scale_record import record_evaluation
from lmcal.stages.tables import results_markdown
from lmcal.stages.targets import checkpoint_target, hf_target, stage_settings
from lmcal.stages.wandb_run import (
    check_online,
    finish_run,
    log_files,
    multirun_member,
    slug,
    use_checkpoint,
    wandb_log,
    wandb_run,
)
from lmcal.training.known_keys import check_known_keys
from lmcal.utils.boundary import boundary, run_hydra
from lmcal.utils.device import TF32, apply_precision_policy, deterministic_cublas, precision_policy, resolve_device
from lmcal.utils.io import write_json_atomic
from lmcal.utils.lock import run_lock, sweep_temp_files
from lmcal.utils.quiet import quiet_third_party
from lmcal.utils.settings import CONF_DIR  # (importing it registers the configs' lmcal_root resolver)
from lmcal.utils.validate import check_config

log = logging.getLogger("lmcal")
quiet_third_party()  # once per process


def check_settings(cfg: DictConfig) -> dict[str, dict]:
    """Every check the settings alone allow (no model or file is read): ranges and sizes, the device, what to analyse,
    the stages and their settings, W&B's mode; returns the stages' settings. `python -m lmcal.evaluate` runs it
    before Hydra writes anything (lmcal.utils.precheck), evaluate() again."""
    check_known_keys(cfg, "lmcal.evaluate")
    check_config(cfg)
    resolve_device(cfg.get("device"))
    hf = cfg.get("model") is not None
    has_ckpt = "ckpt" in cfg and not OmegaConf.is_missing(cfg, "ckpt") and cfg.ckpt is not None
    if hf and has_ckpt:
        raise LmcalError("Give either ckpt= (a trained LSTM) or model=hf model.name_or_path= (a Hugging Face "
                         "model), not both.")
    if not hf and not has_ckpt:
        raise LmcalError("Say what to analyse: ckpt=PATH (a checkpoint of python -m lmcal.train) or model=hf "
                         "model.name_or_path=FOLDER (a Hugging Face causal LM).")
    settings = stage_settings(cfg)
    check_online(OmegaConf.to_container(cfg.logger, resolve=True) if cfg.get("logger") else None)
    return settings


def evaluate(cfg: DictConfig) -> dict:
    """Runs the stages on the checkpoint or Hugging Face model, writes evaluation.json. Settings are checked first,
    then the run folder is locked for this process. cuBLAS's deterministic workspace comes first, before any CUDA
    work (an analysis repeats for its seed), then the TF32 flags (the `tf32` key)."""
    deterministic_cublas()
    settings = check_settings(cfg)
    with open_dict(cfg):  # the one device every model of the run goes to (not one of the recorded settings)
        cfg.device = resolve_device(cfg.get("device"))
    apply_precision_policy(cfg.get("tf32", TF32))
    out = Path(cfg.paths.output_dir)
    with run_lock(out, "evaluation"):
        sweep_temp_files(out)  # what a killed run of this folder left half written
        return _evaluate(cfg, out, settings)


def _evaluate(cfg: DictConfig, out: Path, settings: dict[str, dict]) -> dict:
    set_memory_budget(cfg.analysis.get("memory_budget_gb"))  # the lookahead's chunks (lmcal.core.lookahead)
    hf = cfg.get("model") is not None
    check = functools.partial(check_sizes, cfg, settings)
    target = hf_target(cfg, settings, check) if hf else checkpoint_target(cfg, settings, check)
    results = target["results"]
    results["device"] = str(cfg.device)
    logger = evaluation_run(cfg, target, settings, out)
    try:
        stage_results = run_stages(list(cfg.stages), target, settings, out, logger)
        results.update(stage_results)
        record_evaluation(out, cfg, target, stage_results, logger)  # scale.json, after entropy_rate
        rows = result_rows(results)
        results.update(table=[{"stage": st, "metric": k, "value": v, "stderr": se} for st, k, v, se in rows],
                       config=OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False),
                       versions=versions(),  # what ran it: command, date, machine, commit, TF32 flags
                       provenance={**provenance(), "precision": precision_policy()})
        artifact = f"evaluation-{slug(target['name'])}-{slug(target.get('dataset', target['corpus']))}"
        results["artifact"] = artifact  # its W&B artifact's name: the report's run uses it (report_wandb)
        write_json_atomic(out / "evaluation.json", results)
        wandb_log(logger, summary={f"{st}/{k}": v for st, k, v, _ in rows},
                  tables={"results": (["stage", "metric", "value", "stderr"], [list(r) for r in rows])})
        log_files(logger, artifact, "evaluation", [out / "evaluation.json"])
        print(f"\n{target['name']} on {target['corpus']} ({'per model token' if hf else 'per word'}; ± one standard "
              f"error):\n\n{results_markdown(rows)}\nResults, config, versions and commit: {out / 'evaluation.json'}",
              flush=True)
        return results
    finally:
        finish_run(logger)


def evaluation_run(cfg: DictConfig, target: dict, settings: dict[str, dict], out: Path):
    """The W&B run of an evaluation (False for another logger), by the one naming rule (lmcal.stages.wandb_run):
    `<stages>[-window]-<model>[-tau<T>]-<dataset>`, a Hugging Face model by its label and its text's corpus; tau a
    config field; the checkpoint (and a memory stage's base) recorded as its input artifact."""
    stages = list(cfg.stages)
    memory = settings.get("memory") or {}
    window = memory.get("limited") == "window"
    tau = memory.get("tau") if window else target["net"].memory_tau if "net" in target else None
    model = target["name"] + (f", tau={tau}" if window and tau else "")
    config = {**OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False), "tau": tau}
    group, suffix = multirun_member()  # a multirun's jobs (a Hugging Face family, say): one group, told apart
    logger = wandb_run(cfg.get("logger"), config, out, job_type=stages[0] if len(stages) == 1 else "evaluate",
                       model=model, dataset=target.get("dataset", target["corpus"]), group=group, suffix=suffix,
                       tags=tuple(stages) + (("window",) if window else ()),
                       name="-".join([*stages, *(["window"] if window else [])]) or "evaluate")
    for key in ("ckpt", "base_ckpt"):  # the lineage: training run -> checkpoint artifact -> this run
        path = target.get(key)
        if path and (key == "ckpt" or path != target.get("ckpt")):
            name = target["name"] if key == "ckpt" else model_name(
                OmegaConf.create(read_checkpoint(path)["hyper_parameters"]["net"]))
            use_checkpoint(logger, path, name, target["corpus"])
    return logger


def check_sizes(cfg: DictConfig, settings: dict[str, dict], *, hp: dict | None = None, vocab: int | None = None,
                corpus: dict | None = None, memory_tau: int | None = None, hf_config=None,
                text_vocab: int | None = None, name: str = "") -> None:
    """The preflight (lmcal.pipeline.preflight): every stage's sizes against the model the target read (a checkpoint's
    hyper-parameters, or a Hugging Face config and the text as its tokenizer reads it), before any work."""
    if hf_config is not None:
        m = hf_model(hf_config, corpus or {}, name)
        dtype = str(cfg.model.get("dtype") or "float32")
        preflight(settings, m, device=cfg.device, value_bytes=2 if dtype in ("bfloat16", "float16") else 4,
                  score_context=cfg.model.get("context"), text_vocab=text_vocab, force=bool(cfg.get("force_size")))
    else:
        preflight(settings, checkpoint_model(hp, hp["vocab_size"], corpus or {}), memory_tau, device=cfg.device,
                  text_vocab=vocab, force=bool(cfg.get("force_size")))


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="evaluate")  # absolute: lmcal-evaluate too
def main(cfg: DictConfig) -> None:
    with boundary():
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)  # every interpolation, before any work
        evaluate(cfg)


def cli() -> None:
    """`lmcal-evaluate`: python -m lmcal.evaluate as a command."""
    run_hydra(main, "rerun the same command to run the stages again (an analysis starts over; evaluation.json is "
                    "written once every stage has finished)")


if __name__ == "__main__":
    cli()
