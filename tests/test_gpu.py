"""The CUDA path (marker `gpu`: skipped without CUDA; `make gpu-check` runs these and writes its report): the
weight-dropped LSTM on CUDA against the CPU, a resume after the NT-ASGD switch with the module on CUDA, the
lookahead's two paths under the TF32 policy, and a Hugging Face model's candidates sharing their rows' past on CUDA
against the CPU's forks. Tolerances: float32 rounding with TF32 off (lmcal.utils.device). Without
CUDA: the no-CUDA report, and gpu_check's side-by-side section (bench/device_compare.py) on two CPU runs, its comparator
on made-up results (fast) and end to end (slow)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmcal.core.lookahead import candidate_entropies
from lmcal.models.awd_lstm import AWDLSTM
from lmcal.models.step_lm import LSTMStepLM
from lmcal.utils.device import apply_precision_policy
from tests.test_module import resumed_after_switch


@pytest.fixture(autouse=True)
def policy():  # the TF32 policy of every entry point
    apply_precision_policy()


@pytest.mark.gpu
def test_weight_dropped_lstm_outputs_and_gradients_match_the_cpu():
    torch.manual_seed(0)
    cpu = AWDLSTM(vocab_size=100, emb_size=32, hidden_size=64, num_layers=3).eval()
    gpu = AWDLSTM(vocab_size=100, emb_size=32, hidden_size=64, num_layers=3).eval()
    gpu.load_state_dict(cpu.state_dict())
    gpu.cuda()
    x = torch.randint(0, 100, (20, 4))
    grads = []
    for net, dev in ((cpu, "cpu"), (gpu, "cuda")):
        out, _, _ = net(x.to(dev), net.init_hidden(4))
        loss = net.logits(out).float().logsumexp(-1).mean()
        loss.backward()
        grads.append({n: p.grad.cpu() for n, p in net.named_parameters() if p.grad is not None})
        grads[-1]["out"] = out.detach().cpu()
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
def test_resume_after_the_switch_averages_on_cuda(tmp_path):
    fresh, loaded = resumed_after_switch(tmp_path)
    fresh.on_load_checkpoint(loaded)  # Lightning: restored on the CPU, then moved
    fresh.load_state_dict(loaded["state_dict"])
    fresh.cuda()
    fresh._update_average()
    assert all(a.is_cuda for a in fresh.avg.values())


@pytest.mark.gpu
def test_lookahead_fused_and_plain_paths_agree_on_cuda():
    torch.manual_seed(0)
    lm = LSTMStepLM(AWDLSTM(vocab_size=1000, emb_size=64, hidden_size=128, num_layers=3).cuda().eval())
    state = lm.init_state(8)
    for _ in range(3):
        _, state = lm.step(torch.randint(0, 1000, (8,), device="cuda"), state)
    cand = torch.randint(0, 1000, (8, 32), device="cuda")
    fused = candidate_entropies(lm, state, cand, 0.0)
    plain = candidate_entropies(lm, state, cand, 1e-30)  # eps > 0 takes the full-step path; 1e-30 changes nothing
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_hf_candidates_sharing_their_rows_past_on_cuda_match_the_cpus_forks():
    """HFCausalLM.candidate_step on CUDA (a 4D-masked sdpa forward over the shared past) against the CPU's forks."""
    transformers = pytest.importorskip("transformers")
    from lmcal.core.lookahead import lookahead_entropies
    from lmcal.models.hf import HFCausalLM

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500, n_positions=128,
                                  initializer_range=0.3)
    cpu = HFCausalLM(transformers.GPT2LMHeadModel(cfg))
    gpu = HFCausalLM(transformers.GPT2LMHeadModel(cfg), device="cuda")
    gpu.model.load_state_dict(cpu.model.state_dict())
    x = torch.randint(0, 500, (4, 30))
    (lp_c, st_c), (lp_g, st_g) = cpu.prefill(x, cpu.init_state(4)), gpu.prefill(x, gpu.init_state(4))
    assert gpu.shares_past(st_g)
    cpu.shares_past = lambda state: False
    torch.testing.assert_close(lookahead_entropies(gpu, st_g, lp_g).cpu(), lookahead_entropies(cpu, st_c, lp_c),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA half of make gpu-check")
def test_gpu_check_without_cuda_says_it_needs_cuda_and_fails(tmp_path):
    report = tmp_path / "REPORT.md"
    r = subprocess.run([sys.executable, "bench/gpu_check.py", "--out", str(report)],
                       cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "Not run: this check needs CUDA." in report.read_text() and "needs CUDA" in r.stderr


def test_precision_policy_is_set_explicitly_and_reported():
    from lmcal.utils.device import precision_policy

    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = True, True  # PyTorch's cuDNN default
    assert apply_precision_policy() == {"tf32_matmul": False, "tf32_cudnn": False,
                                        "float32_matmul_precision": "highest"} == precision_policy()


def _device_compare():
    """bench/device_compare.py (a bench script, not a package module), loaded from its path."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "device_compare.py"
    spec = importlib.util.spec_from_file_location("device_compare", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _fake_run(folder: Path, alpha: float = 0.25, curve_shift: float = 0.0, resumed: bool = True) -> Path:
    """The result files compare() reads, with the keys it reads (the slow test below checks them on real runs)."""
    import json

    curve = {"curve_nats": [2.5 + curve_shift, 2.4], "stderr_nats": [0.01, 0.01], "tail_nats": 2.4,
             "tail_stderr_nats": 0.01}
    row = {"tail_nats": 2.4, "tail_stderr_nats": 0.01, "test_ce_nats": 2.55}
    files = {
        "train/metrics.json": {"resumed_from": "/x/checkpoints/last.ckpt" if resumed else None, "asgd_epoch": 2,
                               "epochs": 4, "val_ce_nats": 2.75, "test_ce_nats": 2.76},
        "train_eval/entropy_rate.json": {"test_ce_nats": 2.76},
        "evaluate/entropy_rate.json": {"test_ce_nats": 2.48, **curve},
        "evaluate/calibration.json": {"alpha": alpha, "test_ce_before_nats": 2.55, "test_ce_after_nats": 2.54,
                                      **curve},
        "evaluate/decoders.json": {"rows": [{"method": "model", "params": {}, **row},
                                            {"method": "fitted_temperature",
                                             "params": {"temperature": 1.02, "temperature_stderr": 0.08}, **row}]},
        "evaluate/future_entropy.json": {"rows": [{"method": "future_entropy", "source": "future_entropy",
                                                   "params": {"horizon_k": 1, "alpha": 3.0, "alpha_stderr": 1.0},
                                                   "test_ce_diff_stderr_nats": 0.002, **row},
                                                  {"method": "top_k", "source": "decoders", "params": {"k": 50},
                                                   "test_ce_nats": 2.6}]},
        "evaluate/sequence_calibration.json": {"alpha": -0.01, "alpha_stderr": 0.1,
                                               "rows": [{"method": "model", **row}]},
        "evaluate/memory.json": {"ce_full_nats": 2.49, "ce_limited_nats": 2.55, "alpha": 0.06,
                                 "mi_upper_bound_nats": 0.04, "two_parameter": {"beta": 1.3}},
    }
    for name, content in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(content))
    return folder


def test_device_comparison_passes_equal_runs_and_flags_each_value_beyond_its_tolerance(tmp_path):
    dc = _device_compare()
    same = dc.compare(_fake_run(tmp_path / "a"), _fake_run(tmp_path / "b"))
    assert len(same) == 29 and all(r["ok"] for r in same)
    assert all(r["difference"] in (0, "same") for r in same)
    assert not any(r["quantity"].startswith("future_entropy top_k") for r in same)  # decoders' row, compared there

    def failing(**changed):
        return [r["quantity"] for r in dc.compare(tmp_path / "a", _fake_run(tmp_path / "c", **changed)) if not r["ok"]]

    # alpha* (fit): 1e-3 + 1e-3 |alpha| = 1.25e-3 at alpha = 0.25
    assert failing(alpha=0.25 + 1.0e-3) == []
    assert failing(alpha=0.25 + 1.5e-3) == ["calibration: alpha*"]
    # an entropy curve (sampled): 3 combined standard errors, 3 * sqrt(2) * 0.01 = 0.0424 nats at its worst step
    assert failing(curve_shift=0.04) == []
    assert failing(curve_shift=0.05) == ["entropy_rate: entropy curve (nats) (mean of 2 steps; max step difference)",
                                         "calibration: entropy curve after (nats) (mean of 2 steps; max step "
                                         "difference)"]
    assert failing(resumed=False) == ["training: resumed after the NT-ASGD switch"]
    table = dc.markdown(dc.compare(tmp_path / "a", tmp_path / "c"), "cpu", "cuda")
    assert table[0] == "| quantity | cpu | cuda | difference | tolerance | ok |" and len(table) == 2 + 29


@pytest.mark.slow  # nine runs of the entry points in subprocesses: about a minute and a half on 2 cores
def test_gpu_check_compares_two_cpu_runs_end_to_end(tmp_path):
    """`--compare-devices cpu,cpu` runs the side-by-side section without CUDA: every quantity within its tolerance,
    and, on one device, equal (seeds repeat runs exactly)."""
    report = tmp_path / "REPORT.md"
    r = subprocess.run([sys.executable, "bench/gpu_check.py", "--out", str(report), "--compare-devices", "cpu,cpu"],
                       cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    text = report.read_text()
    assert "### CPU against CUDA" in text and "| quantity | cpu | cpu (2nd run) | difference | tolerance | ok |" in text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and line.endswith(" |")][2:]
    assert len(rows) > 50 and all(row[-1] == "yes |" for row in rows)
    assert all(row[3] in ("0", "same") for row in rows), [row for row in rows if row[3] not in ("0", "same")]
    stages = {row[0].removeprefix("| ").split(":")[0].split(" ")[0] for row in rows}
    assert stages == {"training", "entropy_rate", "calibration", "decoders", "future_entropy",
                      "sequence_calibration", "memory"}
    assert (tmp_path / "devices" / "a" / "evaluate" / "memory.json").is_file()
