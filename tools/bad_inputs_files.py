"""tools/bad_inputs.py's probes of links, names, records, sizes and the last tracebacks (`--only-files`): links inside
a run folder that point under /etc, settings that would become paths outside their folder, records that are not whole
(NaN, wrong types, deep nesting, truncation, a GPU report overwritten, two models' rows, a base checkpoint of another
source, a Hugging Face folder naming its own code), counts without bounds, and values that used to end in a traceback.
Each probe sets up its files under its own temporary folder (or a new folder of its own under /etc, removed after),
runs the real entry point in a subprocess, and says what was left."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import bad_inputs as b

SCALE = {"model": "m", "family": "f", "corpus": "c", "unit": "word", "params": 1000, "train_tokens": 10000,
         "test_ce_nats": 3.0, "tail_nats": 3.2, "tail_stderr_nats": 0.1, "gap_nats": 0.2, "gap_stderr_nats": 0.1,
         "tail_nats_per_prefix": [3.1, 3.3], "effects": {}, "num_prefixes": 2, "samples_per_prefix": 1,
         "prefix_len": 5, "horizon": 10}
OTHER = {**SCALE, "params": 3000, "train_tokens": 30000, "tail_nats_per_prefix": [3.0, 3.5]}
DEEP = "[" * 100_000 + "]" * 100_000


def _etc_link(tmp: Path, what: str) -> dict:
    """`train` into W where W/<what> is a link to a new folder (or file) of the probe's own under /etc."""
    run, target = tmp / f"link_{what.strip('.')}", Path(f"/etc/lmcal_probe_{what.strip('.').replace('.', '_')}")
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir()
    is_file = what.endswith(".log")
    target.write_text("precious\n") if is_file else target.mkdir(exist_ok=True)
    try:
        (run / what).symlink_to(target)
        r = b._run([*b.TRAIN, *b.SHORT, f"hydra.run.dir={run}"], tmp)
        if is_file:
            left = "the /etc file " + ("untouched" if target.read_text() == "precious\n" else "written to")
        else:
            left = f"under /etc: {b.left_in(target)}"
        return {**r, "left": left}
    finally:
        target.unlink() if is_file else shutil.rmtree(target, ignore_errors=True)


def _dataset_outside(tmp: Path, check: bool) -> dict:
    """`reproduce dataset=../data/ptb out=OUT force=true`, a file the user kept at OUT/../data/ptb/base."""
    out = tmp / ("ds_check" if check else "ds_out")
    kept = out.parent / "data" / "ptb" / "base" / "kept.txt"
    kept.parent.mkdir(parents=True, exist_ok=True)
    kept.write_text("mine")
    r = b._run(["lmcal.reproduce", "profile=smoke", "dataset=../data/ptb", f"out={out}", "logger=none", "force=true",
                *(["check=true"] if check else [])], tmp)
    return {**r, "left": f"kept.txt {'still there' if kept.exists() else 'removed'}; out: {b.left_in(out)}"}


def _report(tmp: Path, name: str, files: dict[str, str], *extra: str) -> dict:
    """`report RUNS --out OUT` over run folders holding `files` {relative path: text}."""
    runs, out = tmp / f"report_{name}", tmp / f"report_{name}_out"
    for rel, text in files.items():
        (runs / rel).parent.mkdir(parents=True, exist_ok=True)
        (runs / rel).write_text(text)
    r = b._run(["lmcal.report", str(runs), "--out", str(out), "--wandb", "disabled", *extra], tmp)
    return {**r, "left": f"--out: {b.left_in(out)}"}


def _scale_pair(**kw) -> dict[str, str]:
    return {"a/scale.json": json.dumps({**SCALE, **kw}), "b/scale.json": json.dumps(OTHER)}


def _memory_text(model: str, **raw: str) -> str:
    rec = b.MEMORY | {"tau": 2, "model": model, "limited": "window"}
    text = json.dumps(rec)
    for key, value in raw.items():
        text = text.replace(f'"{key}": {json.dumps(rec[key])}', f'"{key}": {value}')
    return text


def _two_models(tmp: Path) -> dict:
    """A smoke reproduction's AWD-LSTM and transformer window rows at one tau: does the report keep both?"""
    r = _report(tmp, "two_models", {"ptb/memory/window_tau_2/memory.json": _memory_text("AWD-LSTM"),
                                    "transformer/memory/window_tau_2/memory.json": _memory_text("Transformer")})
    table = tmp / "report_two_models_out" / "memory_ptb.md"
    kept = [m for m in ("AWD-LSTM", "Transformer") if table.is_file() and f"## {m}" in table.read_text()]
    return {**r, "first": r["first"] or "(no message)", "left": f"memory_ptb.md has {', '.join(kept) or 'neither'}"}


def _gpu_report_kept(tmp: Path) -> dict:
    """`tools/gpu_check.py --out D/REPORT.md` on this machine (no CUDA) where an earlier GPU run's report lies."""
    report = tmp / "gpu-check" / "REPORT.md"
    report.parent.mkdir(exist_ok=True)
    report.write_text("# the H200 run\n")
    r = b.run_argv([sys.executable, "tools/gpu_check.py", "--out", str(report)], b.PROJECT, timeout=300)
    return {**r, "left": f"REPORT.md {'kept' if report.read_text() == '# the H200 run' + chr(10) else 'replaced'}; "
                    f"{b.left_in(report.parent, before={'REPORT.md'})}"}


def _other_chain_base(tmp: Path) -> dict:
    """A tau-model whose memory.base_ckpt is a Markov base trained on another chain of the same name (seed 7)."""
    markov = ["data=markov", "data.corpus_kwargs.n_train=20000", "data.corpus_kwargs.n_valid=3000",
              "data.corpus_kwargs.n_test=3000"]
    base = tmp / "markov_base"
    if not (base / "checkpoints" / "best.ckpt").exists():
        b._run([*b.TRAIN, "trainer.max_epochs=1", "analysis.stages=[]", *markov, f"hydra.run.dir={base}"], tmp)
    return b._into(tmp / "other_chain", [*b.TRAIN, "trainer.max_epochs=1", *markov, "data.corpus_kwargs.seed=7",
                                         "model.memory_tau=2", "analysis.stages=[memory]",
                                         f"memory.base_ckpt={base / 'checkpoints' / 'best.ckpt'}"], tmp)


def _hf_edited(tmp: Path, name: str, **config) -> dict:
    """`evaluate model=hf` over a tiny GPT-2 folder whose config.json gains `config`."""
    folder = b._hf_folder(tmp / f"hf_{name}")
    cfg = json.loads((folder / "config.json").read_text()) | config
    (folder / "config.json").write_text(json.dumps(cfg))
    return b._into(tmp / f"hf_{name}_run", ["lmcal.evaluate", "model=hf", "logger=none",
                                             f"model.name_or_path={folder}"], tmp)


def _no_slurm(tmp: Path) -> dict:
    """`train -m hydra/launcher=slurm_cpu` where no Slurm tool is on PATH (an empty folder)."""
    empty, sweep = tmp / "empty_path", tmp / "slurm_sweep"
    empty.mkdir(exist_ok=True)
    r = b._run([b.TRAIN[0], "-m", *b.TRAIN[1:], "hydra/launcher=slurm_cpu", "model.memory_tau=2,4",
                f"hydra.sweep.dir={sweep}"], tmp, {"PATH": str(empty)})
    return {**r, "left": b.left_in(sweep)}


def _make(tmp: Path, args: str) -> dict:
    out = tmp / "make_jobs"
    r = b.run_argv(["make", "-s", "reproduce", "PROFILE=scale", f"ARGS=out={out} {args}"], b.PROJECT, timeout=600)
    return {**r, "left": b.left_in(out)}


def _bench(tmp: Path, script: str, *args: str) -> dict:
    return b.run_argv([sys.executable, str(b.PROJECT / "bench" / script), *args], tmp, {"WANDB_MODE": "disabled"},
                      timeout=600)


def _json_file(path: Path, value) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(value if isinstance(value, str) else json.dumps(value))
    return path


def file_cases(tmp: Path, ckpt: Path) -> list[tuple[str, object]]:
    """(label, probe) of the link, name, record, size and traceback probes."""
    train, scale = [*b.TRAIN, *b.SHORT], ["lmcal.reproduce", "profile=scale", "logger=none", "check=true"]
    metrics = json.dumps({"val_ppl": 2.0, "test_ppl": 2.0})

    def into(name, *args):  # each key given once: the probe's value replaces the base's
        keys = {o.split("=")[0] for o in args}
        return lambda: b._into(tmp / name, [*(o for o in train if o.split("=")[0] not in keys), *args], tmp)

    def plan(*args):
        return lambda: b._run([*scale, f"out={tmp / 'scale_plan'}", *args], tmp)

    return [
        *[(f"`train hydra.run.dir=W`, W/{w} a link to a new {'file' if w.endswith('.log') else 'folder'} under /etc "
           "(as root)", (lambda w=w: _etc_link(tmp, w))) for w in ("checkpoints", "train.log", ".hydra")],
        ("`reproduce dataset=../data/ptb out=OUT force=true`", lambda: _dataset_outside(tmp, check=False)),
        ("`reproduce dataset=../data/ptb check=true`", lambda: _dataset_outside(tmp, check=True)),
        ("`train logger=wandb logger.name_suffix=` 100,000 characters",
         into("suffix", "logger=wandb", "logger.name_suffix=" + "x" * 100_000)),
        ("`docs --snapshot FAKE`: results.json `{\"profile\": \"cpu\"}`",
         lambda: b._snapshot_probe(tmp, "_profile_only", json.dumps({"profile": "cpu"}))),
        ("`docs --snapshot FAKE`: results.json with `stages: 3`",
         lambda: b._snapshot_probe(tmp, "_stages_int", json.dumps({"profile": "cpu", "stages": 3}))),
        ("`docs --snapshot FAKE`: results.json nested 100,000 deep",
         lambda: b._snapshot_probe(tmp, "_deep", '{"profile": "cpu", "x": ' + DEEP + "}")),
        ("`report`: scale.json with NaN", lambda: _report(tmp, "nan", _scale_pair(gap_nats=float("nan")))),
        ("`report`: scale.json with Infinity",
         lambda: _report(tmp, "inf", _scale_pair(tail_nats_per_prefix=[float("inf"), 1.0]))),
        ("`report`: scale.json with `params: 0` and an empty tail list",
         lambda: _report(tmp, "params0", _scale_pair(params=0, tail_nats_per_prefix=[]))),
        ("`report`: scale.json with a text where a number belongs",
         lambda: _report(tmp, "text", _scale_pair(params="big"))),
        ("`report`: metrics.json with a text where a number belongs",
         lambda: _report(tmp, "metrics_text",
                         {"a/metrics.json": json.dumps({"val_ppl": 2.0, "wall_seconds": "long"})})),
        ("`report`: scale.json nested 100,000 deep",
         lambda: _report(tmp, "deep", {"a/metrics.json": metrics, "a/scale.json": DEEP})),
        ("`report`: scale.json truncated (what lands in --out)",
         lambda: _report(tmp, "truncated", {"a/metrics.json": metrics, "a/scale.json": json.dumps(SCALE)[:40]})),
        ("`report --bootstrap -1`", lambda: _report(tmp, "boot_neg", _scale_pair(), "--bootstrap", "-1")),
        ("`report --bootstrap 0`", lambda: _report(tmp, "boot_zero", _scale_pair(), "--bootstrap", "0")),
        ("`report`: memory.json with a NaN bound and an infinite alpha",
         lambda: _report(tmp, "mem_nan", {"a/memory.json": _memory_text("m", mi_upper_bound_nats="NaN",
                                                                        alpha="Infinity")})),
        ("`report`: the AWD-LSTM's and the transformer's window rows at one tau", lambda: _two_models(tmp)),
        ("`tools/gpu_check.py` without CUDA where an earlier GPU run's REPORT.md lies", lambda: _gpu_report_kept(tmp)),
        ("`train memory.base_ckpt=` a Markov base of another chain (`data.corpus_kwargs.seed=7`)",
         lambda: _other_chain_base(tmp)),
        ("`evaluate model=hf`: `auto_map` and `tokenizer_class: EvilTok`, model_type gpt2",
         lambda: _hf_edited(tmp, "auto_map", auto_map={"AutoModelForCausalLM": "evil.M"}, tokenizer_class="EvilTok")),
        ("`evaluate model=hf`: config with `n_layer: -1`", lambda: _hf_edited(tmp, "n_layer", n_layer=-1)),
        ("`train analysis.sequence_calibration.goal_prefixes=10000000`",
         into("goal", "analysis.stages=[sequence_calibration]",
              "analysis.sequence_calibration.goal_prefixes=10000000")),
        ("`train data=powerlaw data.corpus_kwargs.tail_exponent=1e9`",
         into("tail", "data=powerlaw", "data.corpus_kwargs.tail_exponent=1e9")),
        ("`train data=powerlaw data.corpus_kwargs.order=4`",
         into("order4", "data=powerlaw", "data.corpus_kwargs.order=4")),
        ("`reproduce profile=scale check=true`, the transformer sweep with `data.bptt=100000`",
         plan("sweeps.awd_lstm=null", "sweeps.powerlaw=null",
              "sweeps.transformer=[experiment=scale_transformer,data.bptt=100000]")),
        *[(f"`reproduce profile=scale check=true {o}`", plan(o)) for o in
          ("jobs=0", "estimate_for=tpu", "bootstrap=-1", "bootstrap=lots")],
        ("`reproduce profile=smoke check=true warm_worker=maybe`",
         lambda: b._run(["lmcal.reproduce", "profile=smoke", f"out={tmp / 'warm'}", "check=true",
                         "warm_worker=maybe"], tmp)),
        ("`make reproduce PROFILE=scale ARGS='check=true jobs=abc'`", lambda: _make(tmp, "check=true jobs=abc")),
        ("`bench/calibration_topk.py --timing-prefixes -3`",
         lambda: _bench(tmp, "calibration_topk.py", "--ckpt", str(ckpt), "--timing-prefixes", "-3")),
        ("`bench/calibration_topk.py --calibration` a calibration.json with `alpha: \"high\"`",
         lambda: _bench(tmp, "calibration_topk.py", "--ckpt", str(ckpt), "--calibration",
                        str(_json_file(tmp / "cal" / "calibration.json", {"alpha": "high", "num_prefixes": 20})))),
        ("`bench/sequence_calibration.py --runs` over sequence_calibration.json `{\"rows\": []}`",
         lambda: _bench(tmp, "sequence_calibration.py", "--runs",
                        *[str(_json_file(tmp / "seq" / n / "sequence_calibration.json", {"rows": []}).parent)
                          for n in ("a", "b")])),
        ("`train` into a folder whose .lmcal.lock holds a pid of 10^30",
         lambda: b._lock_body(tmp, json.dumps({"pid": 10**30, "host": "h"}))),
        ("`train` into a folder whose .lmcal.lock is a folder", lambda: b._lock_body(tmp, None)),
        ("`train -m hydra/launcher=slurm_cpu` with no Slurm on PATH", lambda: _no_slurm(tmp)),
    ]
