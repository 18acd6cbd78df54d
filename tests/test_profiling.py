"""Where the time goes: exclusive span times add up, the profiled StepLM counts its FLOPs, and the report's table."""

import json
import re
import time

import pytest
import torch

from lmcal.models.awd_lstm import AWDLSTM
from lmcal.models.step_lm import LSTMStepLM
from lmcal.reporting.report_md import profile_markdown
from lmcal.reporting.results import stage_profile
from lmcal.utils import profiling


def test_spans_are_exclusive_and_add_up_to_the_whole():
    profiling.reset()
    t0 = time.perf_counter()
    with profiling.span("stage"):
        with profiling.span("forward", flops=2e9):
            time.sleep(0.05)
        with profiling.span("sampling"):
            time.sleep(0.03)
            with profiling.span("forward", flops=1e9):
                time.sleep(0.02)
        time.sleep(0.01)
    wall = time.perf_counter() - t0
    snap = profiling.snapshot()
    assert set(snap) == {"stage", "stage/forward", "stage/sampling", "stage/sampling/forward"}
    assert sum(v["seconds"] for v in snap.values()) == pytest.approx(wall, abs=2e-3)
    assert snap["stage/sampling"]["seconds"] == pytest.approx(0.03, abs=0.01)  # its child's 0.02 s left out
    ops = profiling.by_operation(snap)
    assert ops["forward"] == pytest.approx(0.07, abs=0.015) and ops["stage"] == pytest.approx(0.01, abs=0.01)
    assert profiling.mfu(snap, peak_flops=1e11) == pytest.approx(3e9 / ops["forward"] / 1e11)


def test_a_profiled_lm_is_the_same_model_with_its_forwards_counted():
    net = AWDLSTM(vocab_size=50, emb_size=8, hidden_size=16, num_layers=2, dropout=0, dropouth=0, dropouti=0,
                  dropoute=0, wdrop=0)
    lm = LSTMStepLM(net)
    plm = profiling.profiled(lm)
    assert profiling.profiled(plm) is plm and plm.vocab_size == 50
    profiling.reset()
    tokens = torch.tensor([1, 2, 3])
    a, _ = lm.step(tokens, lm.init_state(3))
    with profiling.span("generation"):
        b, state = plm.step(tokens, plm.init_state(3))
        plm.select(state, torch.tensor([0, 0]))
    assert torch.equal(a, b)
    snap = profiling.snapshot()
    params = sum(p.numel() for p in net.parameters())
    assert snap["generation/forward"]["gflop"] * 1e9 == 2 * params * 3 and "generation/select" in snap


def test_the_report_table_reads_each_stage_folder(tmp_path):
    spans = {"calibration": {"seconds": 1.0, "gflop": 0.0}, "calibration/fit/lookahead/forward":
             {"seconds": 4.0, "gflop": 40.0}, "calibration/fit/lookahead": {"seconds": 2.0, "gflop": 0.0},
             "calibration/io": {"seconds": 1.0, "gflop": 0.0}}
    (tmp_path / "evaluation.json").write_text(json.dumps({"ckpt": "x", "calibration": {
        "alpha": 0.1, "profile": {"seconds": 8.0, "spans": spans}}}))
    s = {"seconds": 10.0, "status": "done"} | stage_profile(tmp_path)
    assert s["profile"]["forward"] == 4.0 and s["profile"]["lookahead"] == 2.0 and s["profile"]["other"] == 1.0
    assert stage_profile(tmp_path / "nothing") == {}
    lines = profile_markdown({"base": {"seconds": 600.0, "status": "done"}, "calibration": s}, peak_flops=100e9)
    assert len(lines) == 3  # the training stage has no profile: only the calibration row
    assert lines[2].startswith("| calibration | 10 | 20% | 40% | 0% | 20% |") and lines[2].endswith("| 10.0 | 10% |")


def test_spans_synchronise_the_device_once_cuda_is_in_use(monkeypatch):
    from lmcal.utils import profiling

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    with profiling.span("a"):
        pass
    assert calls == []  # the CPU's timeline: nothing to wait for
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with profiling.span("a"):
        calls.append("work")
    assert calls == ["sync", "work", "sync"]  # the device's work, not its launches
    assert profiling.matmul_flops(64, seconds=0.01, device="cpu") > 0


def test_the_benchmarks_machine_line_names_threads_torch_and_the_matmul_rate():
    line = profiling.machine_line("cpu", n=256)
    assert re.fullmatch(rf"{torch.get_num_threads()} threads, torch {re.escape(torch.__version__)}; float32 matmul "
                        r"\d+\.\d GFLOP/s \(256\^3\)", line), line
