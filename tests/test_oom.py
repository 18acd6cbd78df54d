"""An out-of-memory error is one paragraph naming the setting that lowers what ran out (issue 76, item 4): a stage's
generations (max_batch), its windows side by side (windows_per_batch), the training batch (data.batch_size)."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from lmcal.errors import LmcalError
from lmcal.stages import registry
from lmcal.utils.boundary import explain
from lmcal.utils.oom import is_out_of_memory, oom_refusal

CUDA_OOM = ("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.11 GiB of which "
            "3.12 GiB is free.")


def _raise_oom(*_):
    raise torch.cuda.OutOfMemoryError(CUDA_OOM)


def test_what_counts_as_running_out_of_memory():
    assert is_out_of_memory(torch.cuda.OutOfMemoryError(CUDA_OOM)) and is_out_of_memory(MemoryError())
    assert is_out_of_memory(RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"))
    wrapped = RuntimeError("a callback failed")
    wrapped.__cause__ = torch.cuda.OutOfMemoryError(CUDA_OOM)
    assert is_out_of_memory(wrapped)
    assert not is_out_of_memory(RuntimeError("shape mismatch")) and not is_out_of_memory(ValueError("memory"))


def test_a_stage_that_runs_out_names_its_batch_at_half(monkeypatch, tmp_path):
    st = registry.STAGES["entropy_rate"]
    monkeypatch.setitem(registry.STAGES, "entropy_rate", dataclasses.replace(st, compute=_raise_oom))
    with pytest.raises(LmcalError) as e:
        registry.run_stage("entropy_rate", {"kind": "full"}, {"max_batch": 300}, tmp_path)
    msg = explain(e.value)
    assert msg.startswith("Stage 'entropy_rate' ran out of memory (CUDA out of memory. Tried to allocate 20.00 GiB")
    assert "A setting that holds about half of it: analysis.entropy_rate.max_batch=150;" in msg and "\n" not in msg
    assert not list(tmp_path.iterdir())  # (nothing published)


def test_the_memory_stage_names_its_windows_and_its_rows(monkeypatch, tmp_path):
    st = registry.STAGES["memory"]
    monkeypatch.setitem(registry.STAGES, "memory", dataclasses.replace(st, compute=_raise_oom))
    with pytest.raises(LmcalError) as e:
        registry.run_stage("memory", {"kind": "tau"}, {"windows_per_batch": 512, "rows": "device"}, tmp_path)
    assert ("Settings that hold about half of it: analysis.memory.windows_per_batch=256 analysis.memory.rows=stream;"
            in str(e.value))


def test_another_error_of_a_stage_is_left_as_it_is(monkeypatch, tmp_path):
    st = registry.STAGES["entropy_rate"]

    def bug(*_):
        raise RuntimeError("shape mismatch")

    monkeypatch.setitem(registry.STAGES, "entropy_rate", dataclasses.replace(st, compute=bug))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        registry.run_stage("entropy_rate", {"kind": "full"}, {}, tmp_path)


def test_training_that_runs_out_names_data_batch_size():
    from lmcal.training.run import fit

    trainer = SimpleNamespace(fit=lambda *a, **k: _raise_oom())
    with pytest.raises(LmcalError, match=r"^Training ran out of memory .* data\.batch_size=10;"):
        fit(trainer, None, SimpleNamespace(batch_size=20), None)


def test_a_batch_of_one_has_nothing_to_halve():
    msg = str(oom_refusal(MemoryError("no room"), "Stage 'x'", "analysis.x", {"max_batch": 1}))
    assert "None of its settings sizes that memory: run it on a device with more memory" in msg
