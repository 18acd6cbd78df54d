"""The lookahead's chunks from a memory budget (analysis.memory_budget_gb); forks of a Hugging Face cache that hold
room for one step only; and candidates that read their row's past together instead of each from a copy of it."""

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
    budget(0.01)  # 10 MB: 10e6 // (1e6 + 4 * 2 * block) candidates fused (two float32 rows a block), 3 rows of V not
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert L.chunk_sizes(lm, None, 10_000, 50_000, cuda, fused=True) == (10_000_000 // (1_000_000 + 400_000), 50_000)
    assert L.chunk_sizes(lm, None, 10_000, 50_000, cuda, fused=False) == (10_000_000 // (1_000_000 + 600_000), 50_000)
    assert L.chunk_sizes(lm, None, 10_000, 50_000, cpu, fused=True) == (10_000_000 // (1_000_000 + 8 * 1024), 1024)
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
    lm.shares_past = lambda state: False  # the forks' path (the shared past's: the tests below)
    ref = L.lookahead_entropies(lm, state, lp[:, -1], chunk=7)  # [3, V]
    budget(lm.row_bytes(state) * 11 / 1e9)  # about 10 candidates a chunk
    assert L.chunk_sizes(lm, state, 3 * V, V, torch.device("cpu"), fused=True)[0] < 11
    torch.testing.assert_close(L.lookahead_entropies(lm, state, lp[:, -1]), ref, atol=1e-5, rtol=1e-5)


def tiny_llama(vocab_size=V):
    """A tiny random Llama: rotary positions and grouped keys/values (4 query heads, 2 key/value heads)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128,
                                   initializer_range=0.3, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_candidates_reading_their_rows_past_together_equal_each_stepped_from_a_fork(arch, attention, monkeypatch):
    """candidate_step (one forward, a row's candidates as queries at position n under a 4D mask) against each
    candidate stepped alone from its fork: log-probs and features, rows unsorted and repeated, a row's candidates
    split over several pieces; the state is left as it was."""
    model = tiny_gpt2() if arch == "gpt2" else tiny_llama()
    model.config._attn_implementation = attention
    lm = HFCausalLM(model)
    lp, state = feed(lm, torch.randint(0, V, (3, 9)))
    assert lm.shares_past(state)
    keys = [la.keys.clone() for la in state[0].layers]
    rows = torch.tensor([2, 2, 2, 2, 2, 0, 1, 1, 2, 0])
    toks = torch.randint(0, V, (rows.numel(),))
    monkeypatch.setattr(lm, "candidate_width", lambda state: 2)  # row 2's first run of 5: pieces of 2, 2 and 1
    got = lm.candidate_step(toks, state, rows)  # [10, V]
    want = lm.step(toks, lm.select_for_step(state, rows))[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got.dtype == torch.float32
    if arch == "gpt2":  # the fused lookahead's input
        f = lm.candidate_step(toks, state, rows, features=True)  # [10, E]
        torch.testing.assert_close(f, lm.features(toks, lm.select_for_step(state, rows))[0], atol=1e-5, rtol=1e-5)
    assert all(torch.equal(a, la.keys) for a, la in zip(keys, state[0].layers, strict=True))  # untouched
    torch.testing.assert_close(lm.step(toks[:3], state)[0], lm.step(toks[:3], lm.select(state, torch.arange(3)))[0])


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_the_lookahead_with_a_shared_past_holds_far_less_and_gives_the_forks_entropies(arch, budget):
    lm = HFCausalLM(tiny_gpt2() if arch == "gpt2" else tiny_llama())
    lp, state = feed(lm, torch.randint(0, V, (3, 40)))
    n, heads, kv_heads, E = 40, lm.model.config.num_attention_heads, 2, 32  # both have 2 key/value heads
    layer = 2 * kv_heads * n * (E // heads) * 4  # one row's keys and values of one layer, float32
    k = min(V, lm.candidate_width(state))
    assert lm.candidate_bytes(state, V) == 2.0 * layer * (n + k) / n / k + 4.0 * (heads * (n + k) + 12 * E)
    assert lm.candidate_bytes(state, V) < lm.row_bytes(state) / 2
    budget(lm.row_bytes(state) * 11 / 1e9)  # 10 forks a chunk; many more candidates sharing their rows' past
    assert L.chunk_sizes(lm, state, 3 * V, V, torch.device("cpu"), fused=True, per_row=V)[0] > 20
    for eps in (0.0, 0.1):  # eps > 0: the log-probs' path (the fused one needs eps = 0)
        shared = L.lookahead_entropies(lm, state, lp[:, -1], eps)  # [3, V]
        lm.shares_past = lambda state: False
        forks = L.lookahead_entropies(lm, state, lp[:, -1], eps, chunk=16)
        del lm.shares_past
        torch.testing.assert_close(shared, forks, atol=1e-5, rtol=1e-5)


def test_a_past_not_shared_where_a_mask_would_not_state_the_attention_exactly(monkeypatch):
    """Architectures outside the list (a sliding window, say), attention kernels that take no 4D mask and caches
    without per-layer tensors go through the forks."""
    lm = HFCausalLM(tiny_gpt2())
    lp, state = feed(lm, torch.randint(0, V, (2, 5)))
    assert lm.shares_past(state) and not lm.shares_past(lm.init_state(2))
    monkeypatch.setattr(HFCausalLM, "_SHARED_PAST", frozenset())
    assert not lm.shares_past(state) and lm.candidate_bytes(state, 81) == lm.row_bytes(state)
    monkeypatch.undo()
    legacy = tuple((la.keys, la.values) for la in state[0].layers)
    assert not lm.shares_past((legacy, 5))
    monkeypatch.setattr(lm.model.config, "_attn_implementation", "flash_attention_2")
    assert not lm.shares_past(state)


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
    from lmcal.core.lookahead_law import make_rule
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
    assert lm.shares_past(state)  # ... its candidates reading their rows' bf16 past together; the forks agree
    lm.shares_past = lambda state: False
    torch.testing.assert_close(L.lookahead_entropies(lm, state, lp[:, -1]), h, atol=0.05, rtol=0.02)
    del lm.shares_past
    fit = fit_lookahead_calibration(lm, torch.randint(0, len(WORDS), (12, 4)), make_rule(topk=4, tail_samples=2))
    assert all(isinstance(v, float) and v == v for v in (fit.alpha, fit.ce_before, fit.ce_after))


@pytest.mark.parametrize("block", [1, 7, 64, 1000])
def test_linear_entropy_is_the_entropy_of_the_softmax_holding_two_blocks(block):
    """The online softmax against log_softmax's entropy, with logits far apart (a block whose max jumps) and a bias;
    the memory it holds: two [c, block] float32 tensors (LOGIT_ROWS), measured by the profiler's allocations."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    f, w, b = torch.randn(9, 16) * 3, torch.randn(200, 16), torch.randn(200) * 5
    w[150] *= 20  # one word far ahead in a late block
    exact = L.entropy(torch.log_softmax(f @ w.T + b, -1))
    torch.testing.assert_close(L.linear_entropy(f, w, b, block=block), exact, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(L.linear_entropy(f, w, None, block=block), L.entropy(torch.log_softmax(f @ w.T, -1)),
                               atol=2e-5, rtol=1e-5)
    c, V = 512, 4096
    f, w = torch.randn(c, 16), torch.randn(V, 16)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        L.linear_entropy(f, w, block=V)
    held = top = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += e.self_cpu_memory_usage
        top = max(top, held)
    assert top < (L.LOGIT_ROWS + 0.5) * 4 * c * V  # two [c, V] float32 blocks, not three


def test_stages_sharing_a_gpu_share_its_memory_budget(budget, monkeypatch):
    """null budget on CUDA: half the free memory, divided among the stages make reproduce may run on the GPU at once
    (LMCAL_GPU_SHARERS), so two stages side by side do not each claim half (mem_get_info stands in for a GPU)."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8e9, 16e9))
    cuda = torch.device("cuda")
    monkeypatch.delenv("LMCAL_GPU_SHARERS", raising=False)
    assert L.memory_budget(cuda) == 4e9
    monkeypatch.setenv("LMCAL_GPU_SHARERS", "2")
    assert L.memory_budget(cuda) == 2e9
    budget(1.5)  # a budget set in GB is the user's, for this stage alone
    assert L.memory_budget(cuda) == 1.5e9
