"""Where the memory stage keeps its rows (analysis.memory.rows): streamed rows (a function called once per pass, nothing
kept) give exactly the numbers of kept rows, in the core fit and in the stage; `device` and `auto` on the CPU are
today's `cpu` bit for bit; the plan check says where the rows are kept."""

import json
import math

import pytest
import torch

from lmcal.core.memory import memory_upper_bound
from lmcal.core.memory_summary import memory_summary
from lmcal.data.markov import make_markov_chain, markov_stationary, sample_markov


def _rows(seed=0, n=700, v=11):
    g = torch.Generator().manual_seed(seed)
    full = (torch.randn(n, v, generator=g, dtype=torch.float64) * 2).log_softmax(-1)  # [n, v]
    limited = (0.5 * full + torch.randn(n, v, generator=g, dtype=torch.float64)).log_softmax(-1)  # [n, v]
    y = torch.multinomial(full.exp(), 1, generator=g)[:, 0]  # [n]
    return full, limited, y


def _same(a, b):
    """Equal numbers (nan equal to nan), nested dicts too."""
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b


@pytest.mark.parametrize("jackknife", ["onestep", "exact"])
def test_streamed_rows_give_exactly_the_kept_rows_numbers(jackknife):
    full, limited, y = _rows()
    cuts = [0, 100, 250, 251, 700]
    passes = []

    def chunks():  # a fresh generator on every call: the fit's passes
        passes.append(1)
        for i, j in zip(cuts[:-1], cuts[1:], strict=True):
            yield full[i:j], limited[i:j], y[i:j]

    kept = memory_summary(list(chunks()), cluster_size=100, jackknife=jackknife)
    passes.clear()
    streamed = memory_summary(chunks, cluster_size=100, jackknife=jackknife)
    _same(streamed, kept)
    assert len(passes) > 3  # it was reread, not kept: every Newton step is a pass
    for temperature in (False, True):  # and the bound alone, fitted or at a given alpha
        for alpha in (None, 0.2):
            one = memory_upper_bound(list(chunks()), alpha=alpha, beta=1.1, temperature=temperature, cluster_size=70)
            two = memory_upper_bound(chunks, alpha=alpha, beta=1.1, temperature=temperature, cluster_size=70)
            _same(vars(two), vars(one))


MV, ORDER = 6, 2


@pytest.fixture(scope="module")
def markov_text():
    chain = make_markov_chain(vocab_size=MV, order=ORDER, support=3, smoothing=0.02, seed=0)
    pi = markov_stationary(chain.probs, MV, ORDER)
    return chain, torch.from_numpy(sample_markov(chain.probs, MV, ORDER, 3_000, 5, pi))


@pytest.mark.parametrize("limited", ["window", "trained"])
def test_memory_stage_rows_stream_device_and_auto_equal_cpu(tmp_path, markov_text, limited, monkeypatch):
    """The stage on an oracle (window) and on a small AWD-LSTM against a tau-model (trained): every setting gives
    memory.json's numbers of rows=cpu exactly; the choice and the bytes it keeps are recorded; streamed CPU rows trim
    the C heap as they go (kept rows do not)."""
    from lmcal.models.oracles import MarkovOracle
    from lmcal.stages import memory, run_stage, target

    trims = {}
    monkeypatch.setattr(memory, "TRIM_BYTES", 1)  # every chunk
    monkeypatch.setattr(memory, "_trim_heap", lambda: trims.__setitem__(rows, trims.get(rows, 0) + 1))

    chain, w = markov_text
    if limited == "window":
        t, extra = target(MarkovOracle.from_chain(chain), test=w, corpus="markov"), {"tau": 1}
    else:
        from lmcal.models.awd_lstm import AWDLSTM

        torch.manual_seed(0)
        kw = dict(vocab_size=MV, emb_size=8, hidden_size=12, num_layers=2)  # eval(): no dropout
        full, lim, extra = AWDLSTM(**kw).eval(), AWDLSTM(**kw, memory_tau=3).eval(), {}
        t = target(lim, test=w, corpus="markov", kind="tau", net=lim, base=full)
    out = {}
    for rows in ("cpu", "device", "auto", "stream"):
        settings = {"limited": limited, "rows": rows, "cluster_size": 500, "windows_per_batch": 256, **extra}
        out[rows] = run_stage("memory", t, settings, tmp_path / rows)
        assert json.loads((tmp_path / rows / "memory.json").read_text())["rows"] == out[rows]["rows"]
    n = out["cpu"]["test_tokens"]
    assert n == w.numel() - 1
    assert [out[r]["rows"] for r in out] == ["cpu", "cpu", "cpu", "stream"]  # on the CPU device and auto are cpu
    assert out["cpu"]["rows_bytes"] == 2 * n * MV * 4 and out["stream"]["rows_bytes"] == 2 * 256 * MV * 4
    assert out["stream"]["rows_passes"] > 3 and out["cpu"]["rows_passes"] == 1
    assert set(trims) == {"stream"} and trims["stream"] >= out["stream"]["rows_passes"]
    skip = {"rows", "rows_bytes", "rows_passes", "rows_seconds", "seconds"}
    for rows in ("device", "auto", "stream"):
        _same({k: v for k, v in out[rows].items() if k not in skip},
              {k: v for k, v in out["cpu"].items() if k not in skip})


def test_auto_keeps_rows_on_a_gpu_within_the_budget_else_streams():
    """rows_where on a CUDA device needs no GPU with the budget set (analysis.memory_budget_gb)."""
    from lmcal.core.lookahead import set_memory_budget
    from lmcal.errors import LmcalError
    from lmcal.stages.memory import rows_where

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    set_memory_budget(1.0)
    try:
        assert rows_where("auto", cuda, 1e9) == "device" and rows_where("auto", cuda, 1e9 + 1) == "stream"
        assert rows_where("auto", cpu, 1e12) == "cpu" and rows_where("device", cpu, 1e12) == "cpu"
        assert [rows_where(r, cuda, 1e12) for r in ("device", "cpu", "stream")] == ["device", "cpu", "stream"]
        with pytest.raises(LmcalError, match="analysis.memory.rows='gpu'"):
            rows_where("gpu", cuda, 1.0)
    finally:
        set_memory_budget(None)


def test_the_plan_check_says_where_the_rows_are_kept():
    """GPT-2's 50,257 words on PTB's 82,430 test tokens: 33 GB of float32 rows, within the default budget (half of
    80 GB free); float16 rows over a 10 GB budget are streamed, one chunk of windows_per_batch rows at a time."""
    from lmcal.pipeline.check import peak_tensors
    from lmcal.pipeline.sizes import Model

    m = Model("transformer", 1024, 50_257, 768, 12, 124_000_000, 2.5e8, {"test": 82_430})
    kept = 2 * 82_430 * 50_257 * 4
    where = {}
    for rows in ("cpu", "device", "stream", "auto"):
        (text, size), = peak_tensors("memory", {"rows": rows, "windows_per_batch": 512}, m)
        where[rows] = text, size
    assert where["cpu"] == ("kept rows 2 x [N, V] float32 = 2 x [82,430, 50,257] on the CPU (rows=cpu)", kept)
    assert where["device"][0].endswith("on the model's device (rows=device)") and where["device"][1] == kept
    assert where["stream"] == ("streamed rows, one chunk 2 x [512, 50,257] float32 (rows=stream; recomputed on each "
                               "pass of the fit)", 2 * 512 * 50_257 * 4)
    assert where["auto"][1] == kept and "on the GPU (rows=auto: 33.14 GB within the 40 GB budget" in where["auto"][0]
    (text, size), = peak_tensors("memory", {"rows": "auto", "windows_per_batch": 512, "store_dtype": "float16"}, m,
                                 budget_gb=10)
    assert size == 2 * 512 * 50_257 * 2 and text.startswith("streamed rows, one chunk 2 x [512, 50,257] float16 "
                                                            "(rows=auto: 16.57 GB over the 10 GB budget;")
