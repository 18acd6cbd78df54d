"""The lookahead's chunks from a memory budget (analysis.memory_budget_gb), and forks of a Hugging Face cache that hold
room for one step only."""

from types import SimpleNamespace

import pytest
import torch

from lmcal.core import lookahead as L
from lmcal.errors import LmcalError

transformers = pytest.importorskip("transformers")

from lmcal.models.hf import HFCausalLM  # noqa: E402
from tests.test_hf import V, feed, tiny_gpt2  # noqa: E402


@pytest.fixture
def budget():
    yield L.set_memory_budget
    L.set_memory_budget(None)


def test_chunk_sizes_follow_the_budget(budget):
    lm = SimpleNamespace(row_bytes=lambda state: 1_000_000)
    budget(0.01)  # 10 MB: 10e6 // (1e6 + 4 * 3 * block) candidates
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert L.chunk_sizes(lm, None, 10_000, 50_000, cuda, fused=True) == (10_000_000 // (1_000_000 + 600_000), 50_000)
    assert L.chunk_sizes(lm, None, 10_000, 50_000, cpu, fused=True) == (10_000_000 // (1_000_000 + 12 * 1024), 1024)
    assert L.chunk_sizes(lm, None, 3, 50_000, cpu, fused=True) == (3, 1024)  # never more than the candidates
    budget(1000.0)
    assert L.chunk_sizes(lm, None, 10_000, 50_000, cpu, fused=False)[0] == L.CPU_MAX_CHUNK  # the CPU's cap
    assert L.chunk_sizes(lm, None, 10_000, 50_000, cuda, fused=True)[0] == 10_000  # on CUDA the budget ...
    assert L.chunk_sizes(lm, None, 10**6, 50_000, cuda, fused=True)[0] == L.CUDA_MAX_CHUNK  # ... up to a cap
    budget(1e-9)
    assert L.chunk_sizes(lm, None, 10, 50_000, cpu, fused=True)[0] == 1  # at least one
    budget(None)
    assert L.memory_budget(cpu) == L.CPU_BUDGET_GB * 1e9
    for bad in (0, -1.0):
        with pytest.raises(LmcalError, match="memory_budget_gb"):
            budget(bad)


def test_forks_for_one_step_hold_that_step_only_and_give_the_same_entropies(budget):
    lm = HFCausalLM(tiny_gpt2())
    x = torch.randint(0, V, (3, 20))
    lp, state = feed(lm, x)
    rows = torch.tensor([0, 2, 2])
    growing, tight = lm.select(state, rows)[0], lm.select_for_step(state, rows)[0]
    assert [la.store.keys.size(2) for la in growing.layers] == [64, 64]  # max(64, 2 x 21): room to grow
    assert [la.store.keys.size(2) for la in tight.layers] == [21, 21]  # 20 read + the candidate
    # one row's copy: 2 layers x (keys, values) x 2 heads x 21 positions x 16 dims x 4 bytes
    assert lm.row_bytes(state) == 2 * 2 * 2 * 21 * 16 * 4
    ref = L.lookahead_entropies(lm, state, lp[:, -1], chunk=7)  # [3, V]
    budget(lm.row_bytes(state) * 11 / 1e9)  # about 10 candidates a chunk
    assert L.chunk_sizes(lm, state, 3 * V, V, torch.device("cpu"), fused=True)[0] < 11
    torch.testing.assert_close(L.lookahead_entropies(lm, state, lp[:, -1]), ref, atol=1e-5, rtol=1e-5)


def test_device_map_needs_accelerate_and_says_so(tmp_path, monkeypatch):
    from lmcal.models.hf import load_hf_model
    from tests.test_hf import tiny_folder

    monkeypatch.setitem(__import__("sys").modules, "accelerate", None)  # as if not installed
    with pytest.raises(LmcalError, match=r"model.device_map='auto' needs the accelerate package"):
        load_hf_model(tiny_folder(tmp_path), device_map="auto")


def test_device_map_and_bf16_keep_log_softmax_entropies_and_fits_in_float32(tmp_path, monkeypatch):
    """model.device_map goes to transformers' from_pretrained (accelerate places the layers); a bf16 model's
    log-softmax, entropies, lookahead and fit all come out in float32."""
    pytest.importorskip("accelerate")
    from lmcal.core.calibration import fit_lookahead_calibration
    from lmcal.models.hf import load_hf_model
    from tests.test_hf import WORDS, tiny_folder

    real, seen = transformers.AutoModelForCausalLM.from_pretrained, {}

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    lm = load_hf_model(tiny_folder(tmp_path), dtype="bfloat16", device_map={"": "cpu"})
    assert seen["device_map"] == {"": "cpu"}
    assert next(lm.model.parameters()).dtype == torch.bfloat16
    x = torch.randint(0, len(WORDS), (3, 8))
    lp, state = feed(lm, x)
    assert lp.dtype == torch.float32 and torch.allclose(lp.exp().sum(-1), torch.ones(3, 8))
    assert L.entropy(lp[:, -1]).dtype == torch.float32
    h = L.lookahead_entropies(lm, state, lp[:, -1])  # [3, V]: the fused path, a bf16 head read in float32
    assert h.dtype == torch.float32 and torch.isfinite(h).all()
    fit = fit_lookahead_calibration(lm, torch.randint(0, len(WORDS), (12, 4)), topk=4, tail_samples=2)
    assert all(isinstance(v, float) and v == v for v in (fit.alpha, fit.ce_before, fit.ce_after))
