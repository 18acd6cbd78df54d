"""One device policy (issue 32): the analysis entry point's single `device` key resolved once, and a device this
machine cannot run on refused in one paragraph by both entry points, before any model loads."""

import os
import subprocess
import sys

import pytest
import torch

from lmcal.errors import LmcalError
from lmcal.utils.device import resolve_device


def test_null_and_auto_mean_cuda_where_available_else_cpu():
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device(None) == resolve_device("auto") == want
    assert resolve_device("cpu") == "cpu"


@pytest.mark.parametrize("name", ["bogus", "tpu", "meta", "cuda:x"])
def test_a_device_lmcal_does_not_run_on_is_refused(name):
    with pytest.raises(LmcalError, match=rf"device={name} is not a device lmcal runs on: use cpu, cuda, cuda:N"):
        resolve_device(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
@pytest.mark.parametrize("name", ["cuda", "cuda:1"])
def test_cuda_without_cuda_is_refused_with_the_wheel_named(name):
    """A CPU-only wheel (this machine's venv) and a CUDA build without a GPU (a fresh `make install` may fetch one) are
    told apart, each with what would give torch a device."""
    why = "is a CPU-only wheel; on a machine with an NVIDIA GPU install a CUDA wheel" if not torch.version.cuda else \
        f"is built for CUDA {torch.version.cuda}, but no GPU or driver is visible: see nvidia-smi"
    with pytest.raises(LmcalError, match=rf"device={name}, but this machine has no CUDA device torch can use \(torch "
                                         rf"\S+ {why}.*\)\. Run with device=cpu"):
        resolve_device(name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_index_beyond_the_visible_gpus_is_refused():
    n = torch.cuda.device_count()
    assert resolve_device("cuda:0") == "cuda:0"
    with pytest.raises(LmcalError, match=rf"only {n} CUDA device"):
        resolve_device(f"cuda:{n}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without CUDA")
@pytest.mark.parametrize("entry,override,key", [("lmcal.evaluate", "device=cuda", "device=cuda"),
                                                ("lmcal.train", "trainer.accelerator=gpu", "trainer.accelerator=gpu")])
def test_entry_points_refuse_cuda_without_it_in_one_paragraph(tmp_path, entry, override, key):
    """Before, evaluate died in torch's lazy CUDA init with a traceback, and train in Lightning's words."""
    extra = ["ckpt=/nonexistent.ckpt", "stages=[entropy_rate]"] if entry == "lmcal.evaluate" else ["experiment=smoke"]
    env = {k: v for k, v in os.environ.items() if k not in ("LMCAL_DATA_ROOT", "WANDB_MODE")}
    r = subprocess.run([sys.executable, "-m", entry, override, *extra, "logger=none",
                        f"hydra.run.dir={tmp_path / 'run'}"], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"lmcal: error: {key}, but this machine has no CUDA device torch can use")
    assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "evaluation.json").exists()
