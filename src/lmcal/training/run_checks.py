"""What `python -m lmcal.train` checks from its settings alone, before any folder is written (lmcal.utils.precheck
calls check_settings through the entry point): a network it trains, one device, an accelerator this machine has,
W&B's mode; and which of a preset's analysis stages apply to the model it trains."""

from __future__ import annotations

import logging

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from lmcal.errors import LmcalError
from lmcal.stages.registry import STAGES, stage_kinds
from lmcal.stages.stage import KINDS
from lmcal.stages.wandb_run import check_online
from lmcal.training.known_keys import check_known_keys
from lmcal.utils.device import cpu_bf16_lstm, cuda_missing
from lmcal.utils.validate import check_config

log = logging.getLogger("lmcal")


TRAINABLE = ("AWDLSTM", "GPTLM")  # the networks python -m lmcal.train builds (lmcal.model, lmcal.transformer)


def device_count(trainer_cfg) -> int:
    """How many devices (or nodes x devices) `trainer` settings would train on: devices=2, "0,1", [0, 1], -1/"auto"
    (every visible GPU when the accelerator may be a GPU, else 1), times num_nodes."""
    devices, accel = trainer_cfg.get("devices", 1), str(trainer_cfg.get("accelerator", "auto"))
    if devices in (-1, "-1", "auto"):
        import torch

        n = torch.cuda.device_count() if accel in ("auto", "gpu", "cuda") else 1
    elif isinstance(devices, str):
        n = len([d for d in devices.split(",") if d.strip()]) if "," in devices else int(devices)
    elif isinstance(devices, int):
        n = devices
    else:  # a list of device indices
        n = len(devices)
    return max(n, 1) * int(trainer_cfg.get("num_nodes", 1) or 1)


def check_one_device(cfg: DictConfig) -> None:
    """Training runs on one device: refused, before any folder is written, where Lightning would start several."""
    t = cfg.get("trainer") or {}
    n, strategy = device_count(t), str(t.get("strategy", "auto"))
    if n > 1 or any(s in strategy for s in ("ddp", "fsdp", "deepspeed")):
        raise LmcalError(
            f"Training runs on one device, and these settings ask for more (trainer.devices="
            f"{t.get('devices')}, trainer.num_nodes={t.get('num_nodes', 1)}, trainer.strategy={strategy}). The "
            "AWD-LSTM is trained on BPTT streams that carry the hidden state from one window to the next; Lightning's "
            "DistributedSampler would give each process alternate windows, so each carried state would skip the "
            "other's tokens, the learning rate would follow each process's own window lengths and NT-ASGD each "
            "process's own validation loss: a different model, silently. Nothing was run or written. Train on one "
            "device (trainer.devices=1) and use the other devices for the runs that are independent: the tau-models "
            "and the analysis stages, side by side with `make reproduce ARGS='jobs=N'` (one device per running "
            "stage), as Slurm jobs with `make reproduce ARGS='launcher=slurm'`, or a tau-model sweep with "
            "`python -m lmcal.train -m hydra/launcher=slurm_gpu ...`.")


def check_accelerator(cfg: DictConfig) -> None:
    """trainer.accelerator=gpu (or cuda) on a machine without CUDA: refused in the words of the analysis entry point's
    device=cuda (lmcal.utils.device.resolve_device), before any folder is written."""
    import torch

    accel = str((cfg.get("trainer") or {}).get("accelerator", "auto"))
    if accel in ("gpu", "cuda") and not torch.cuda.is_available():
        raise LmcalError(f"trainer.accelerator={accel}, but this machine has no CUDA device torch can use "
                         f"({cuda_missing()}). Nothing was run or written. Train with trainer.accelerator=auto (the "
                         "GPU where there is one, else the CPU) or cpu.")


PRECISIONS = ("32-true", "32", "bf16-mixed")  # trainer.precision values that train as tested (tests/test_precision.py)


def check_precision(cfg: DictConfig) -> None:
    """trainer.precision one of PRECISIONS: 16-mixed needs a gradient scaler the recipe's clipping and NT-ASGD were not
    checked with, and *-true half precision keeps the weights and the averaged ASGD copy in 16 bits."""
    value = str((cfg.get("trainer") or {}).get("precision", "32-true"))
    if value not in PRECISIONS:
        raise LmcalError(f"trainer.precision={value} is not a precision lmcal trains with: its weights, checkpoints "
                         "and scores are checked in full float32 (32-true, the default) and with bfloat16 autocast "
                         "(bf16-mixed, float32 weights). Nothing was run or written. Use trainer.precision=32-true or "
                         "bf16-mixed (and tf32=true for TensorFloat-32 matmuls on a GPU).")
    if value == "bf16-mixed" and str((cfg.get("model") or {}).get("_target_") or "").endswith("AWDLSTM") \
            and training_device(cfg.get("trainer")) == "cpu" and not cpu_bf16_lstm():
        raise LmcalError("trainer.precision=bf16-mixed trains the AWD-LSTM's LSTM in bfloat16, which this CPU cannot "
                         "run: oneDNN has no bfloat16 LSTM without AVX-512 BF16 instructions. Nothing was run or "
                         "written. Use trainer.precision=32-true here (the default), or bf16-mixed on a GPU "
                         "(trainer.accelerator=gpu) or a CPU that has them.")


def training_device(trainer_cfg) -> str:
    """The device `trainer` settings train on, as the stages see it: cuda where the accelerator may be a GPU
    (auto, gpu, cuda) and CUDA is available, else cpu."""
    import torch

    accelerator = str((trainer_cfg or {}).get("accelerator", "auto"))
    return "cuda" if accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available() else "cpu"


def check_settings(cfg: DictConfig) -> None:
    """Every check the settings alone allow (no file is read): ranges and sizes, a network this command trains, one
    device, the accelerator, W&B's mode. `python -m lmcal.train` runs it before Hydra writes anything
    (lmcal.utils.precheck), train() again."""
    check_known_keys(cfg, "lmcal.train")
    check_config(cfg)
    if not str((cfg.get("model") or {}).get("_target_") or "").endswith(TRAINABLE):
        raise LmcalError("python -m lmcal.train trains AWD-LSTMs (model=awd_lstm or awd_lstm_small) and transformers "
                         "(model=transformer_small or transformer); a Hugging Face model (model=hf) is analysed as "
                         "it is: python -m lmcal.evaluate model=hf model.name_or_path=FOLDER "
                         "stages=[entropy_rate,calibration,decoders].")
    check_one_device(cfg)
    check_accelerator(cfg)
    check_precision(cfg)
    check_online(OmegaConf.to_container(cfg.logger, resolve=True) if cfg.get("logger") else None)


def stages_on_command_line() -> bool:
    """Whether analysis.stages was set on the command line (or the run is not a Hydra one: the compose API's
    overrides count as the caller's own choice)."""
    if not HydraConfig.initialized():
        return True
    return any(o.lstrip("+~").split("=")[0] == "analysis.stages"
               for o in OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False))


def applicable_stages(stages: list[str], kind: str, settings: dict[str, dict]) -> list[str]:
    """The stages to run: those a preset lists (conf/experiment) but that do not apply to this kind of model (the
    full model's stages in a tau sweep) are skipped with a one-line note; stages named on the command line
    (analysis.stages=[...]) are kept, and one that does not apply stays an error (check_plan)."""
    if stages_on_command_line():
        return stages
    skip = [n for n in stages if n in STAGES and kind not in stage_kinds(n, settings.get(n))]
    if skip:
        log.info(f"Skipping stage{'s' if len(skip) > 1 else ''} {', '.join(skip)}: the preset lists "
                 f"{'them' if len(skip) > 1 else 'it'}, but {'they do' if len(skip) > 1 else 'it does'} not apply "
                 f"to a {KINDS[kind]} (analysis.stages=[...] chooses the stages).")
    return [n for n in stages if n not in skip]
