"""Train one language model: `python -m lmcal.train [hydra overrides]`.

`train(cfg)` is a plain function (tests call it through Hydra's compose API); `main` is
the Hydra entry point around it, which turns `LmcalError`s into one-paragraph messages. Its parts are in
lmcal.training: the settings' checks (run_checks, with `check_settings`, which lmcal.utils.precheck calls through
this module, and TRAINABLE, device_count), the run itself (run: Lightning, imported only once the settings have
passed, so that --help and a refusal answer in seconds), checkpoints (checkpoint_io), the W&B logger (wandb_logger),
the module and callbacks.
"""

from __future__ import annotations

import logging
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from lmcal.core.lookahead import set_memory_budget
from lmcal.models.checkpoint import base_checkpoint, load_base_net
from lmcal.pipeline.devices import apply_job_devices
from lmcal.pipeline.preflight import preflight
from lmcal.pipeline.sizes import model_of
from lmcal.pipeline.slurm import check_sweep_launcher
from lmcal.stages.registry import STAGES, check_plan
from lmcal.training.run_checks import TRAINABLE, applicable_stages, device_count, training_device  # noqa: F401
from lmcal.training.run_checks import check_settings as check_run_settings
from lmcal.utils.boundary import explain, fail, run_hydra
from lmcal.utils.device import TF32, apply_precision_policy, deterministic_cublas
from lmcal.utils.io import write_json_atomic
from lmcal.utils.lock import run_lock, sweep_temp_files
from lmcal.utils.quiet import quiet_third_party
from lmcal.utils.settings import CONF_DIR

log = logging.getLogger("lmcal")
quiet_third_party()  # once per process, before Lightning says anything


def check_settings(cfg: DictConfig) -> None:
    """Every check the settings alone allow (lmcal.training.run_checks), and a Slurm launcher's tools on this machine
    (`-m hydra/launcher=slurm_cpu`: lmcal.pipeline.slurm.check_sweep_launcher): what lmcal.utils.precheck runs for
    each job before Hydra writes anything."""
    check_run_settings(cfg)
    check_sweep_launcher()


def train(cfg: DictConfig) -> dict:
    """Fit (or resume), evaluate the best checkpoint on valid and test, write metrics.json. Settings are checked
    first (one device only), then the run folder is locked for this process, and the temporary files that killed
    runs left there are swept. cuBLAS's deterministic workspace and the TF32 flags (the `tf32` key) are set first,
    before any CUDA work."""
    deterministic_cublas(cfg.trainer.get("deterministic"))
    check_settings(cfg)
    apply_precision_policy(cfg.get("tf32", TF32))
    out = Path(cfg.paths.output_dir)
    with run_lock(out, "training"):
        sweep_temp_files(out)  # (a checkpoint half written when a run was killed: it holds the lock now)
        from lmcal.training.run import run  # (Lightning: imported only for a run that passed its checks)

        return run(cfg, out, _analysis_plan)


def _analysis_plan(cfg: DictConfig, dm) -> tuple[list[str], dict, str | None]:
    """The stages that run after training, their settings, and the memory stage's base checkpoint: every setting
    and size checked against the model before training (a misspelt stage or key costs nothing)."""
    tau = cfg.model.get("memory_tau")
    settings = {n: OmegaConf.to_container(cfg.analysis[n], resolve=True) for n in STAGES if n in cfg.analysis}
    stages = applicable_stages(list(cfg.analysis.get("stages") or []), "tau" if tau else "full", settings)
    check_plan(stages, "tau" if tau else "full", settings)
    every = (settings.get("entropy_rate") or {}).get("every_n_epochs")
    preflight({n: settings[n] for n in STAGES if n in stages or (n == "entropy_rate" and every)},
              model_of(cfg, dm.vocab_size, {s: int(dm.tokens(s).numel()) for s in ("train", "valid", "test")}),
              tau, device=training_device(cfg.trainer), bptt=int(cfg.data.bptt),
              force=bool(cfg.get("force_size")))  # sizes against the model, now
    set_memory_budget(cfg.analysis.get("memory_budget_gb"))  # the lookahead's chunks (lmcal.core.lookahead)
    base_ckpt = base_checkpoint(OmegaConf.to_container(cfg.memory, resolve=True) if cfg.get("memory") else None,
                                cfg.data.name)
    if "memory" in stages and tau:  # (a full model's memory stage, limited=window, is its own base)
        load_base_net(base_ckpt, "cpu", cfg.data.name, dm.corpus_kwargs, dm.vocab_size)  # now, not after
    return stages, settings, base_ckpt


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="train")  # absolute: lmcal-train too
def main(cfg: DictConfig) -> float | None:
    """One run, or one job of a sweep. In a sweep a failing job records why in `failed.json`
    in its own directory and returns, so the other jobs still run."""
    hc = HydraConfig.get()
    sweep = hc.mode == RunMode.MULTIRUN
    apply_job_devices(hc.job.num if sweep else 0)  # a side-by-side job's GPU and threads, before CUDA starts
    if sweep:  # a rerun of the job: an earlier failure is no longer its status
        (Path(hc.runtime.output_dir) / "failed.json").unlink(missing_ok=True)
    try:
        OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)  # every interpolation, before any work
        return train(cfg)["val_ce_nats"]
    except Exception as e:
        explained = explain(e)
        message = explained or f"{type(e).__name__}: {e}"
        if sweep:
            log.error(f"job {hc.job.num} ({hc.job.override_dirname}) failed: {message}", exc_info=not explained)
            write_json_atomic(Path(hc.runtime.output_dir) / "failed.json",
                              {"error": message, "traceback": None if explained else traceback.format_exc(),
                               "overrides": OmegaConf.to_container(hc.overrides.task, resolve=False)})
            return None
        if not explained:
            raise
        log.error(message)
        fail(message)


def cli() -> None:
    """`lmcal-train`: python -m lmcal.train as a command."""
    run_hydra(main)


if __name__ == "__main__":
    cli()
