"""The CUDA path (marker `gpu`: skipped without CUDA; `make gpu-check` runs these and writes its report): the
weight-dropped LSTM on CUDA against the CPU, a resume after the NT-ASGD switch with the module on CUDA, the
lookahead's two paths under the TF32 policy, and a Hugging Face model's candidates sharing their rows' past on CUDA
against the CPU's forks. Tolerances: float32 rounding with TF32 off (lmcal.utils.device). Without
CUDA: the no-CUDA report, and gpu_check's side-by-side section (tools/device_compare.py) on two CPU runs, its comparator
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


class CpuMasks:
    """Every dropout mask the AWD-LSTM draws (weight drop: torch.rand_like; locked and embedding dropout:
    Tensor.bernoulli_), drawn on the CPU from one seed and moved to the tensor's device: the CPU and cuDNN then train
    with the same masks, and their outputs and gradients can be compared in training mode."""

    def __init__(self, monkeypatch, seed: int = 0):
        self.g = torch.Generator().manual_seed(seed)
        rand_like, bernoulli_ = torch.rand_like, torch.Tensor.bernoulli_
        monkeypatch.setattr(torch, "rand_like", lambda t, **k: torch.rand(t.shape, generator=self.g).to(t.device))

        def bernoulli(t, p=0.5, **k):
            return t.copy_(torch.rand(t.shape, generator=self.g).lt(p).to(t.dtype))
        monkeypatch.setattr(torch.Tensor, "bernoulli_", bernoulli)
        self.undo = (rand_like, bernoulli_)

    def reseed(self, seed: int = 0):
        self.g.manual_seed(seed)


@pytest.mark.gpu
def test_weight_dropped_lstm_trains_on_cudnn_as_on_the_cpu_with_the_same_masks(monkeypatch):
    """The training path in training mode (weight drop on W_hh through functional_call into cuDNN, locked and
    embedding dropout, AR/TAR): a step's loss, outputs and every gradient on CUDA against the CPU's, same masks."""
    from lmcal.models.awd_lstm import ar_tar

    masks = CpuMasks(monkeypatch)
    torch.manual_seed(0)
    kw = dict(vocab_size=100, emb_size=32, hidden_size=64, num_layers=3, dropout=0.3, dropouth=0.2, dropouti=0.3,
              dropoute=0.1, wdrop=0.5)
    cpu, gpu = AWDLSTM(**kw).train(), AWDLSTM(**kw).train()
    gpu.load_state_dict(cpu.state_dict())
    gpu.cuda()
    x, y = torch.randint(0, 100, (20, 4)), torch.randint(0, 100, (20, 4))
    got = []
    for net, dev in ((cpu, "cpu"), (gpu, "cuda")):
        masks.reseed(1)
        out, raw, _ = net(x.to(dev), net.init_hidden(4))
        ce = torch.nn.functional.cross_entropy(net.logits(out).flatten(0, 1), y.to(dev).flatten())
        loss = ce + ar_tar(out, raw, 2.0, 1.0)
        loss.backward()
        got.append({"loss": loss.detach().cpu(), "out": out.detach().cpu(),
                    **{n: p.grad.cpu() for n, p in net.named_parameters() if p.grad is not None}})
    assert set(got[0]) == set(got[1]) and any("weight_hh" in k for k in got[0])
    assert (got[0]["out"] == 0).any()  # the dropouts did drop
    for k in got[0]:
        torch.testing.assert_close(got[1][k], got[0][k], atol=1e-5, rtol=1e-4, msg=k)


@pytest.mark.gpu
def test_a_cuda_training_step_never_waits_for_the_device_between_reads(tmp_path):
    """CUDA's own detector of synchronising calls (torch.cuda.set_sync_debug_mode: .item(), a blocking copy of a
    Python number to the device...) over two epochs through the real Lightning path, its logger and progress bar
    included: every one in a training step falls on a step where Lightning writes its logs (log_every_n_steps), or
    on an epoch's first step or the run's last."""
    import warnings

    import pytorch_lightning as pl
    from pytorch_lightning.loggers import CSVLogger

    from lmcal.training.callbacks import progress_bar
    from lmcal.training.module import LMDataModule, LMModule, OptimConfig
    from tests.test_module import NET

    class Steps(pl.Callback):
        step, on = -1, False

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.on, self.step = True, trainer.global_step

        def on_validation_epoch_start(self, trainer, module):
            self.on = False

    steps, syncs = Steps(), []
    dm = LMDataModule(name="synthetic", batch_size=4, eval_batch_size=2, bptt=12, seed=3,
                      corpus_kwargs={"vocab_size": 20, "n_train": 3000, "n_valid": 400, "n_test": 400})
    module = LMModule(net=NET, vocab_size=dm.vocab_size, optim=OptimConfig(lr=5.0), bptt=12)
    trainer = pl.Trainer(max_epochs=2, accelerator="gpu", devices=1, logger=CSVLogger(tmp_path), log_every_n_steps=10,
                         enable_checkpointing=False, reload_dataloaders_every_n_epochs=1, num_sanity_val_steps=0,
                         default_root_dir=tmp_path, callbacks=[steps, progress_bar()])

    def record(message, *args, **kwargs):
        if steps.on and "synchroniz" in str(message):
            syncs.append(steps.step)
    shown = warnings.showwarning
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            trainer.fit(module, datamodule=dm)
    finally:
        warnings.showwarning = shown
        torch.cuda.set_sync_debug_mode(0)
    total = trainer.global_step
    assert total > 100 and module.bar_metrics["train/loss"] > 0
    off_beat = sorted({s for s in syncs if (s + 1) % 10 and s not in (0, trainer.num_training_batches, total - 1)})
    assert not off_beat, f"synchronising calls at steps {off_beat} (of {total}); all at: {sorted(set(syncs))[:20]}"


@pytest.mark.gpu
def test_a_bf16_head_on_cuda_gives_the_float32_entropies_within_bf16_rounding():
    """linear_entropy with a bf16 head multiplies on the tensor cores with float32 outputs (torch.mm's out_dtype):
    against the float32 product of the same bf16 numbers, the entropies agree to float32 accumulation."""
    from lmcal.core.lookahead import entropy, linear_entropy

    torch.manual_seed(0)
    f, w = torch.randn(64, 128, device="cuda"), torch.randn(5000, 128, device="cuda") / 8
    fb, wb = f.bfloat16(), w.bfloat16()
    exact = entropy(torch.log_softmax(fb.float() @ wb.float().T, -1))
    torch.testing.assert_close(linear_entropy(fb, wb, block=5000), exact, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(linear_entropy(fb, wb, block=700), exact, atol=1e-3, rtol=1e-3)


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
    """The note goes beside the report, never over an earlier GPU run's REPORT.md (issue 77)."""
    report = tmp_path / "REPORT.md"
    report.write_text("## GPU check\n\nan earlier GPU run's results\n")
    r = subprocess.run([sys.executable, "tools/gpu_check.py", "--out", str(report)],
                       cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "Not run: this check needs CUDA." in (tmp_path / "REPORT.no-cuda.md").read_text()
    assert "needs CUDA" in r.stderr and report.read_text() == "## GPU check\n\nan earlier GPU run's results\n"


def test_gpu_check_keeps_to_its_budget_and_reports_every_part(tmp_path):
    """A budget too small for any part: each is reported as not run, with the time that was left, in the one report
    the check writes (and its results.json beside it); the first line says what the machine gave it."""
    report = tmp_path / "REPORT.md"
    r = subprocess.run([sys.executable, "tools/gpu_check.py", "--dry-run", "--parts", "train,lookahead",
                        "--budget-min", "0.4", "--out", str(report)], cwd=Path(__file__).resolve().parents[1],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stdout.startswith(f"gpu-check: torch {torch.__version__}")
    text = report.read_text()
    assert text.count("**Not run: ") == 2 and "s of the budget left.**" in text
    assert (tmp_path / "results.json").is_file()


def test_precision_policy_is_set_explicitly_and_reported():
    from lmcal.utils.device import precision_policy

    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = True, True  # PyTorch's cuDNN default
    assert apply_precision_policy() == {"tf32_matmul": False, "tf32_cudnn": False,
                                        "float32_matmul_precision": "highest"} == precision_policy()


def _device_compare():
    """tools/device_compare.py (a tool script, not a package module), loaded from its path."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "tools" / "device_compare.py"
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
    r = subprocess.run([sys.executable, "tools/gpu_check.py", "--out", str(report), "--compare-devices", "cpu,cpu"],
                       cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    text = report.read_text()
    assert "### CPU against CUDA" in text and "| quantity | cpu | cpu (2nd run) | difference | tolerance | ok |" in text
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and line.endswith(" |")][2:]
    assert len(rows) > 50 and all(row[-1] == "yes |" for row in rows)
    assert all(row[3] in ("0", "same") for row in rows), [row for row in rows if row[3] not in ("0", "same")]
    stages = {row[0].removeprefix("| ").split(":")[0].split(" ")[0] for row in rows}
    assert stages == {"training", "entropy_rate", "calibration", "decoders", "future_entropy",
                      "sequence_calibration", "memory", "cpu"}  # cpu: each run resumed vs straight
    assert sum("resumed training's last weights against the uninterrupted run's" in row[0] for row in rows) == 2
    assert (tmp_path / "devices" / "a" / "evaluate" / "memory.json").is_file()


def test_device_comparison_refuses_a_result_that_is_not_whole(tmp_path):
    from lmcal.errors import LmcalError

    dc = _device_compare()
    _fake_run(tmp_path / "a"), _fake_run(tmp_path / "b")
    (tmp_path / "b" / "train" / "metrics.json").write_text('{"val_ce_nats": NaN, "test_ce_nats": 2.7}')
    with pytest.raises(LmcalError, match=r"b/train/metrics.json is not a result of this comparison's runs"):
        dc.compare(tmp_path / "a", tmp_path / "b")
    (tmp_path / "b" / "train" / "metrics.json").write_text('{"val_ce_nats": 2.7, "test_ce_nats": 2.7}')
    with pytest.raises(LmcalError, match="resumed_from"):
        dc.compare(tmp_path / "a", tmp_path / "b")
