"""The preflight of every entry point (lmcal.pipeline.preflight, and the plan check of make reproduce): each stage's
sizes against the model it will meet, before any work, refused in one paragraph naming the stage, the key, its value
and the limit, with settings that fit; the settings it proposes do fit (they are rerun here)."""

import itertools
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import open_dict

from lmcal.errors import LmcalError
from lmcal.pipeline.check import check
from lmcal.pipeline.plan import load_profile
from lmcal.pipeline.preflight import preflight
from lmcal.pipeline.sizes import Model, fitting_settings, size_problems
from lmcal.utils.budget import memory_bytes
from lmcal.utils.settings import CONF_DIR

transformers = pytest.importorskip("transformers")

from tests.test_hf import WORDS, tiny_tokenizer  # noqa: E402


def _gpt2_folder(tmp_path, n_positions=32, vocab_size=12):  # 12: the tokenizer's words
    """A tiny GPT-2 of bounded context and its word-level tokenizer, saved as model.name_or_path reads it."""
    import torch

    torch.manual_seed(0)
    folder = tmp_path / "tiny-gpt2"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=vocab_size,
                                                         n_positions=n_positions, bos_token_id=0,
                                                         eos_token_id=0)).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    g = np.random.default_rng(0)
    for split in ("valid", "test"):
        (tmp_path / f"{split}.txt").write_text("\n".join(" ".join(g.choice(WORDS[1:], size=8)) for _ in range(60)))
    return folder, [f"model.name_or_path={folder}", f"model.valid_text={tmp_path / 'valid.txt'}",
                    f"model.test_text={tmp_path / 'test.txt'}"]


def _settings(message: str) -> list[str]:
    return re.search(r"that fits?: (.*?) \(", message).group(1).split()


def test_evaluate_refuses_a_bounded_context_before_any_work_and_its_settings_fit(tmp_path):
    """The README's line on a model of 32 tokens: exit 2 with one paragraph per stage (key, value, limit) before the
    weights load; the settings it proposes, given back, run."""
    folder, model = _gpt2_folder(tmp_path)
    out = tmp_path / "eval"
    env = {k: v for k, v in os.environ.items() if k != "WANDB_MODE"}
    r = subprocess.run([sys.executable, "-m", "lmcal.evaluate", "model=hf", *model, "analysis=smoke",
                        "analysis.entropy_rate.horizon=700", "stages=[entropy_rate,calibration]", "logger=wandb",
                        f"hydra.run.dir={out}"], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 2, r.stderr[-3000:]
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lmcal: error: Stage 'entropy_rate' would feed its Hugging Face model "
                                               "(tiny-gpt2) more tokens than its context of 32 (n_positions in its "
                                               "config.json): prefix_len + horizon = 10 + 700 = 710 tokens.")
    assert ("Stage 'calibration' would feed its Hugging Face model (tiny-gpt2) more tokens than its context of 32 "
            "(n_positions in its config.json): prefix_len + horizon = 10 + 700 = 710 tokens; fit_tokens / "
            "fit_streams = 400 / 4 = 100 tokens; score_tokens / score_streams = 400 / 4 = 100 tokens.") in err[0]
    assert "nothing was run" in err[0] and "(on the command line)." in err[0]
    fits = _settings(err[0])
    assert sorted(fits) == ["analysis.calibration.fit_streams=13", "analysis.calibration.horizon=22",
                            "analysis.calibration.score_streams=13", "analysis.entropy_rate.horizon=22"]
    assert not (out / "evaluation.json").exists() and not (out / "wandb").exists()  # no W&B run was opened

    from lmcal.evaluate import evaluate

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("evaluate", overrides=["model=hf", *model, "analysis=smoke", "analysis.entropy_rate.horizon=700",
                                             "stages=[entropy_rate,calibration]", "logger=none", *fits])
    with open_dict(cfg):
        cfg.paths.output_dir = str(out)
    res = evaluate(cfg)
    assert len(res["calibration"]["curve_nats"]) == 22 and res["calibration"]["score_streams"] == 13


def test_a_tokenizer_beyond_the_models_vocabulary_and_a_long_scoring_window_are_refused(tmp_path):
    from lmcal.stages.targets import hf_target

    _, model = _gpt2_folder(tmp_path, vocab_size=5)  # the tokenizer knows 12 words
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("evaluate", overrides=["model=hf", *model, "analysis=smoke", "stages=[entropy_rate]",
                                             "logger=none", "model.context=64"])
    from lmcal.evaluate import check_sizes

    with open_dict(cfg):
        cfg.device = "cpu"
    with pytest.raises(LmcalError) as e:
        hf_target(cfg, None, lambda **kw: check_sizes(cfg, {"entropy_rate": dict(cfg.analysis.entropy_rate)}, **kw))
    msg = str(e.value)
    assert ("Scoring the model's test cross-entropy would read windows longer than its context of 32 (n_positions in "
            "its config.json): model.context = 64 tokens.") in msg
    assert "The text has token ids up to 11, beyond the model's vocabulary of 5 (Hugging Face model (tiny-gpt2))" in msg
    assert "A setting that fits: model.context=32" in msg


def _train_cfg(overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=overrides)


def test_train_refuses_its_analysis_stages_before_training(tmp_path, data_overrides):
    """A transformer of context 64 with after-training stages that would not fit: refused before any epoch (no
    checkpoint, no logger run), with the stage, the keys, their values and the limit."""
    from lmcal.train import train

    cfg = _train_cfg(["experiment=ptb_transformer_small", "model.n_embd=16", "model.n_layer=1", "model.n_head=2",
                      "model.n_positions=64", "data.bptt=63", "logger=none", "analysis=smoke",
                      "analysis.stages=[entropy_rate,calibration]", "analysis.entropy_rate.prefix_len=50",
                      *data_overrides])
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "run")
    with pytest.raises(LmcalError) as e:
        train(cfg)
    msg = str(e.value)
    assert msg.startswith("Stage 'entropy_rate' would feed its transformer more tokens than its context of 64 "
                          "(model.n_positions): prefix_len + horizon = 50 + 20 = 70 tokens.")
    assert "Stage 'calibration' would feed" in msg  # prefix_len at most half the context, the horizon the rest
    assert "analysis.entropy_rate.prefix_len=16 analysis.entropy_rate.horizon=48" in msg
    assert not (tmp_path / "run" / "checkpoints").exists()
    cfg.data.bptt = 100  # the training windows too
    with pytest.raises(LmcalError, match=r"^Training would feed its transformer .* data.bptt = 100 tokens"):
        train(cfg)


def test_the_plan_check_proposes_profile_settings_that_pass_it(tmp_path):
    """make reproduce's refusal names the profile key and gives the whole ARGS; given back, the plan passes."""
    args = [f"out={tmp_path / 'out'}", "profile=smoke", "check=true"]
    with pytest.raises(LmcalError) as e:
        check(load_profile([*args, "transformer.analysis=[analysis=smoke,analysis.entropy_rate.horizon=100]"]))
    msg = str(e.value)
    assert msg.startswith("Stage 'transformer_entropy_rate' would feed its transformer more tokens than its context "
                          "of 64 (model.n_positions): prefix_len + horizon = 10 + 100 = 110 tokens.")
    fixed = re.search(r"ARGS='(.*)'", msg).group(1)
    assert fixed == "transformer.analysis=[analysis=smoke,analysis.entropy_rate.horizon=100," \
                    "analysis.entropy_rate.horizon=54]"
    assert check(load_profile([*args, fixed])).startswith("Plan of the smoke profile")


@pytest.mark.parametrize("context", [8, 33, 128, 1024])
def test_the_proposed_settings_fit_every_stage(context):
    m = Model("transformer", context, 50_257, 64, 2, 10**6, 1e6, {"train": 10**6, "valid": 70_000, "test": 80_000})
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("evaluate", overrides=["model=hf", "model.name_or_path=x"])
    from omegaconf import OmegaConf

    analysis = OmegaConf.to_container(cfg.analysis, resolve=True)
    for name, tau in itertools.product(("entropy_rate", "calibration", "decoders", "future_entropy",
                                        "sequence_calibration", "memory"), (None, 3 * context)):
        a = {**analysis[name], **({"tau": tau, "limited": "window"} if name == "memory" else {})}
        fits = fitting_settings(name, a, m)
        assert size_problems(name, {**a, **fits}, m) == ("", {}), (name, fits)
        if size_problems(name, a, m)[0]:
            assert fits


def test_generations_beyond_the_devices_memory_are_refused_with_a_batch_that_fits():
    m = Model("awd_lstm", None, 50_000, 400, 3, 10**7, 1e7, {"test": 80_000})
    big = {"num_prefixes": 10**4, "samples_per_prefix": 100, "prefix_len": 10, "horizon": 10, "max_batch": 10**6}
    with pytest.raises(LmcalError) as e:
        preflight({"entropy_rate": big}, m)
    msg = str(e.value)
    assert "Stage 'entropy_rate' would hold about 400.0 GB at once in its generations ([max_batch, V] = " \
           "[1,000,000, 50,000] log-probs)" in msg and "GB of cpu" in msg
    batch = int(re.search(r"analysis.entropy_rate.max_batch=(\d+)", msg).group(1))
    assert batch * 2 * 4 * 50_000 <= memory_bytes() / 2
    preflight({"entropy_rate": {**big, "max_batch": batch}}, m)


def test_a_hugging_face_model_is_named_after_its_label_or_folder(tmp_path):
    """Item 8 of issue 42: not "hf" for every model; a folder of python -m lmcal.train names its own model."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from lmcal.stages.targets import hf_label

    cfg = SimpleNamespace()
    m = OmegaConf.create({"label": None, "name_or_path": str(tmp_path / "run" / "base" / "hf")})
    assert hf_label(m, cfg) == "hf"  # a folder's name where nothing better is known
    cfg.lmcal_label = "Transformer 2x32, context 64"  # written by GPTLM.save_hf
    assert hf_label(m, cfg) == "Transformer 2x32, context 64"
    m.label = "GPT-2"
    assert hf_label(m, cfg) == "GPT-2"
    folder, model = _gpt2_folder(tmp_path)
    from lmcal.stages.targets import hf_target

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("evaluate", overrides=["model=hf", *model, "analysis=smoke", "stages=[calibration]",
                                             "logger=none"])
    t = hf_target(cfg)
    assert (t["name"], t["dataset"], t["corpus"]) == ("tiny-gpt2", "valid", "valid (tiny-gpt2 tokens)")


def test_memory_rows_beyond_the_machines_memory_are_refused_with_streaming():
    m = Model("transformer", 1024, 50_257, 768, 12, 10**8, 1e8, {"test": 10**7})  # 10M test tokens x 50k words
    a = {"rows": "auto", "score_tokens": None, "store_dtype": "float32", "tau": 30, "limited": "window"}
    with pytest.raises(LmcalError, match=r"Stage 'memory' would keep rows 2 x \[N, V\] = 2 x \[10,000,000, 50,257\] "
                                         r"float32 \(analysis.memory.rows=auto\): 4,020.6 GB, more than the .* GB of "
                                         r"this machine.* A setting that fits: analysis.memory.rows=stream"):
        preflight({"memory": a}, m, device="cpu")
    preflight({"memory": {**a, "rows": "stream"}}, m, device="cpu")


@pytest.mark.slow
def test_evaluate_stopped_by_sigterm_says_it_starts_over(tmp_path):
    """Item 8 of issue 42: an analysis has no checkpoint to resume from; its stop line says so."""
    import signal

    _, model = _gpt2_folder(tmp_path, n_positions=128)
    p = subprocess.Popen([sys.executable, "-m", "lmcal.evaluate", "model=hf", *model, "analysis=smoke",
                          "analysis.entropy_rate.num_prefixes=200", "analysis.entropy_rate.samples_per_prefix=100",
                          "analysis.entropy_rate.horizon=100", "stages=[entropy_rate]", "logger=none",
                          f"hydra.run.dir={tmp_path / 'eval'}"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    seen = []
    for line in p.stdout:  # its first line of work: the model's test cross-entropy
        seen.append(line)
        if "test ppl" in line:
            break
    p.send_signal(signal.SIGTERM)
    rest = p.stdout.read()
    assert p.wait(timeout=300) == 128 + signal.SIGTERM, "".join(seen) + rest
    assert rest.strip().splitlines()[-1] == ("Stopped by SIGTERM: rerun the same command to run the stages again (an "
                                             "analysis starts over; evaluation.json is written once every stage has "
                                             "finished).")
    assert not (tmp_path / "eval" / "evaluation.json").exists()


def test_stages_sharing_a_gpu_are_sized_together_with_the_settings_that_fit():
    """Six tau-models side by side (hydra.launcher.n_jobs=6) each fit an 80 GB GPU alone but not six together: the
    refusal names the set on one GPU and proposes fewer at once or a smaller batch, each of which fits; spread over
    three GPUs (two a GPU) they fit as they are."""
    from lmcal.pipeline.preflight import (
        CUDA_CONTEXT_BYTES,
        GpuPeak,
        check_shared_gpu,
        held,
        shared_gpu_problem,
        sharing,
    )

    GB = 1e9
    taus = [GpuPeak(f"tau_models tau={t}", 4 * GB, 0.5 * GB, "data.batch_size", 20) for t in (5, 10, 20, 50, 100, 200)]
    assert held(taus[:1]) == 14 * GB + CUDA_CONTEXT_BYTES
    text, fits = shared_gpu_problem(taus, 6, 1, 80 * GB, jobs_key="hydra.launcher.n_jobs")
    assert text.startswith("tau_models tau=5, tau_models tau=10, tau_models tau=20, tau_models tau=50, tau_models "
                           "tau=100 and tau_models tau=200, side by side on one GPU (6 at once over 1 GPU: 6 on one), "
                           "would hold about 87.00 GB at once (14.00 GB + ")
    assert fits == {"hydra.launcher.n_jobs": 5, "data.batch_size": 17}
    assert held(sharing(taus, 5, 1)) <= 80 * GB
    assert shared_gpu_problem([GpuPeak(p.name, p.fixed, p.per_batch, p.batch_key, 17) for p in taus], 6, 1,
                              80 * GB) is None
    assert shared_gpu_problem(taus, 6, 3, 80 * GB) is None and shared_gpu_problem(taus, 6, 1, 0) is None
    with pytest.raises(LmcalError, match=r"6 on one\), would hold about 87.00 GB .* nothing was run. Either setting "
                                         r"fits: hydra.launcher.n_jobs=5, or data.batch_size=17 \(in the profile's "
                                         r"tau\)\."):
        check_shared_gpu(taus, 6, 1, 80 * GB, "in the profile's tau", jobs_key="hydra.launcher.n_jobs")
    # stages of their own under jobs=2 on one GPU: the two largest; one that does not fit alone says so
    stages = [GpuPeak("calibration", 50 * GB), GpuPeak("decoders", 40 * GB), GpuPeak("memory_tau5", 1 * GB)]
    text, fits = shared_gpu_problem(stages, 2, 1, 80 * GB)
    assert text.startswith("calibration and decoders, side by side") and fits == {"jobs": 1}
    with pytest.raises(LmcalError, match="Not even the largest fits alone"):
        check_shared_gpu([GpuPeak("huge", 90 * GB)], 1, 1, 80 * GB, "")


def test_a_stage_on_a_shared_gpu_is_sized_against_its_share(monkeypatch):
    """Where the pipeline runs several processes on the GPU (LMCAL_GPU_SHARERS), a stage's generations are checked
    against its share of the GPU's memory, not the whole of it."""
    import lmcal.pipeline.preflight as P

    m = Model("awd_lstm", None, 50_000, 400, 3, 10**7, 1e7, {"test": 80_000})
    gen = {"num_prefixes": 100, "samples_per_prefix": 100, "prefix_len": 10, "horizon": 10, "max_batch": 10_000}
    monkeypatch.setattr(P, "device_bytes", lambda device: int(6 * 1e9))  # 4 GB of generations on a 6 GB GPU
    monkeypatch.delenv("LMCAL_GPU_SHARERS", raising=False)
    preflight({"entropy_rate": gen}, m, device="cuda:0")
    monkeypatch.setenv("LMCAL_GPU_SHARERS", "2")
    with pytest.raises(LmcalError, match=r"more than the 3.0 GB of cuda:0's share \(1 of the 2 processes on it\)"):
        preflight({"entropy_rate": gen}, m, device="cuda:0")
    assert P.gpu_sharers("cpu", {"LMCAL_GPU_SHARERS": "2"}) == 1 and P.gpu_sharers("cuda", {}) == 1
