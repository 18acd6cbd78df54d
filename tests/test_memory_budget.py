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

