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


# -- PROFILE=auto says what it chose and why (issue 76) ------------------------------------------------------------


def _torch_as(monkeypatch, version: str, cuda: str | None, gpus: list[str]):
    """torch as a machine with `gpus` would show it: its version, the CUDA it was built for (None: a CPU build)."""
    monkeypatch.setattr(torch, "__version__", version)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: bool(gpus))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(gpus))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: gpus[i])
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.mark.parametrize("version,cuda,gpus,env,want", [
    ("2.13.0+cu126", "12.6", ["NVIDIA H200"], None, ("paper", "profile=auto: paper (CUDA: NVIDIA H200)")),
    ("2.13.0+cu126", "12.6", ["NVIDIA H200"] * 4, None,
     ("paper", "profile=auto: paper (CUDA: NVIDIA H200, 4 visible)")),
    ("2.13.0+cpu", None, [], None,
     ("cpu", "profile=auto: cpu (no CUDA device: torch 2.13.0+cpu is a CPU build)")),
    ("2.13.0+cu126", "12.6", [], None,
     ("cpu", "profile=auto: cpu (torch 2.13.0+cu126 is a CUDA build but sees no GPU: driver older than CUDA 12.6, "
             "or CUDA_VISIBLE_DEVICES empty?)")),
    ("2.13.0+cu126", "12.6", [], "",
     ("cpu", "profile=auto: cpu (torch 2.13.0+cu126 is a CUDA build, but CUDA_VISIBLE_DEVICES='' hides every GPU)")),
])
def test_auto_profile_says_which_profile_and_why(monkeypatch, version, cuda, gpus, env, want):
    from lmcal.utils.device import auto_profile

    _torch_as(monkeypatch, version, cuda, gpus)
    if env is not None:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", env)
    assert auto_profile() == want


# -- the cuBLAS workspace deterministic CUDA runs need (issue 76) ---------------------------------------------------


@pytest.mark.parametrize("requested,preset,want", [("warn", None, ":4096:8"), (True, None, ":4096:8"),
                                                   (True, ":16:8", ":16:8"), (False, None, None),
                                                   (None, None, None)])
def test_deterministic_cublas_sets_the_workspace_when_asked(monkeypatch, requested, preset, want):
    """Set when deterministic algorithms are requested (trainer.deterministic: true or warn), never over a value the
    environment already gives."""
    from lmcal.utils.device import deterministic_cublas

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    if preset:
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", preset)
    assert deterministic_cublas(requested) == want
    assert os.environ.get("CUBLAS_WORKSPACE_CONFIG") == (want or preset)


class _Stop(Exception):
    pass


@pytest.mark.parametrize("entry", ["train", "evaluate"])
def test_entry_points_set_the_cublas_workspace_before_anything_else(tmp_path, monkeypatch, entry):
    """train() (trainer.deterministic: warn, the preset) and evaluate() set it first, before their settings' checks
    (stopped there)."""
    import importlib

    from hydra import compose, initialize_config_dir

    from lmcal.utils.settings import CONF_DIR

    module = importlib.import_module(f"lmcal.{entry}")
    seen = []

    def stop(cfg):
        seen.append(os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
        raise _Stop

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(module, "check_settings", stop)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name=entry, overrides=["experiment=smoke"] if entry == "train" else ["ckpt=/x.ckpt"])
    with pytest.raises(_Stop):
        getattr(module, entry)(cfg)
    assert seen == [":4096:8"]


# -- make install follows TORCH (issue 76) ----------------------------------------------------------------------------

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
CU126 = "torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"


def _dry_install(tmp_path, recorded: str | None, torch_req: str | None) -> str:
    """`make -n install` (prints, runs nothing) in a copy of the Makefile beside a venv stub installed after
    pyproject.toml changed, whose .torch holds `recorded` (None: a venv from before .torch)."""
    import shutil
    import time

    shutil.copy(ROOT / "Makefile", tmp_path / "Makefile")
    (tmp_path / "pyproject.toml").write_text("")
    venv = tmp_path / "v"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    if recorded is not None:
        (venv / ".torch").write_text(recorded + "\n")
    (venv / ".installed").write_text("")
    later = time.time() + 60
    os.utime(venv / ".installed", (later, later))
    env = {k: v for k, v in os.environ.items() if k not in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS")}  # under make test
    r = subprocess.run(["make", "-n", "--no-print-directory", "install", "VENV=v",
                        *([f"TORCH={torch_req}"] if torch_req else [])],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.mark.parametrize("recorded,torch_req", [(None, None), ("torch==2.13.0", None), (CU126, CU126)])
def test_make_install_does_nothing_for_the_torch_installed(tmp_path, recorded, torch_req):
    out = _dry_install(tmp_path, recorded, torch_req)
    assert "pip" not in out and "Nothing to be done" in out


@pytest.mark.parametrize("recorded,torch_req", [(None, CU126), ("torch==2.13.0", CU126), (CU126, None)])
def test_make_install_swaps_torch_when_torch_changes(tmp_path, recorded, torch_req):
    """Another TORCH than the venv holds: torch alone is uninstalled and the new one installed (the venv is kept),
    and the requirement recorded."""
    want = torch_req or "torch==2.13.0"
    lines = _dry_install(tmp_path, recorded, torch_req).splitlines()
    assert lines[0] == "test -x v/bin/python || python3 -m venv v"  # made only where missing
    assert lines[1:3] == ["v/bin/python -m pip uninstall --quiet --yes torch",
                          f"v/bin/python -m pip install --quiet {want}"]
    assert f"printf '%s\\n' '{want}' > v/.torch" in lines
