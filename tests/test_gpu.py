"""The CUDA path (marker `gpu`: skipped without CUDA; `make gpu-check` runs these and writes its report): the
weight-dropped LSTM on CUDA against the CPU, a resume after the NT-ASGD switch with the module on CUDA, and the
lookahead's two paths under the TF32 policy. Tolerances: float32 rounding with TF32 off (lmcal.utils.device)."""

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
