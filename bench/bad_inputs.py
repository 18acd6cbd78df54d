"""What a user sees for each bad input: runs the real entry points on bad settings and broken files, and prints a
Markdown table of the exit code and the first line of lmcal's message (docs/bad_inputs.md is its output).

    python bench/bad_inputs.py [--reproduction DIR]     # DIR: a finished `make reproduce PROFILE=smoke out=DIR`
    python bench/bad_inputs.py --only-41 --good RUN     # issue 41's probes alone (bench/bad_inputs_41.py)

Needs the real PTB files ($LMCAL_DATA_ROOT, or data/ in the project), and transformers for the Hugging Face rows.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def run(args: list[str], cwd: Path, env: dict | None = None, timeout: float = 900) -> tuple[int, str, str]:
    r = _run(args, cwd, env, timeout)
    return r["rc"], r["first"], r["tb"]


def _run(args: list[str], cwd: Path, env: dict | None = None, timeout: float = 900) -> dict:
    """The entry point `python -m <args>`: its exit code, first line (lmcal's paragraph, else stderr's last line),
    whether it printed a traceback, and its wall seconds. `env` values None remove that variable."""
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONWARNINGS": "ignore", **(env or {})}
    env = {k: v for k, v in env.items() if v is not None}
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=timeout, stdin=subprocess.DEVNULL)
    return {**_summary(r.returncode, r.stderr), "seconds": time.perf_counter() - t0, "stdout": r.stdout}


def _summary(rc: int, stderr: str) -> dict:
    lines = [line for line in stderr.splitlines() if line.startswith("lmcal: error:")]
    first = lines[0] if lines else (stderr.strip().splitlines() or [""])[-1]
    if stderr.startswith("\n"):
        first = "(a blank line, then) " + first
    return {"rc": rc, "first": first, "tb": "yes" if "Traceback" in stderr else "no", "stderr": stderr}


def left_in(folder: Path, before: set | None = None) -> str:
    """What a run left in `folder` (or, given `before`, what it added there): its entries, one level deep."""
    if not folder.exists():
        return "nothing (no folder)"
    names = sorted(str(p.relative_to(folder)) + ("/" if p.is_dir() else "") for p in folder.iterdir())
    if before is not None:
        names = [n for n in names if n.rstrip("/") not in before]
    return ", ".join(names[:8]) + (" ..." if len(names) > 8 else "") if names else "nothing"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reproduction", type=Path, help="a finished smoke reproduction, for the changed-settings row")
    ap.add_argument("--width", type=int, default=160, help="characters of each message shown")
    ap.add_argument("--only-new", action="store_true", help="only issue 29's probes (hostile_cases)")
    ap.add_argument("--only-41", action="store_true", help="only issue 41's probes (lmcal_41.cases)")
    ap.add_argument("--probes", help="with --only-41: only the probes whose label holds one of these words "
                                     "(comma-separated)")
    ap.add_argument("--good", type=Path, help="a finished `python -m lmcal.train experiment=smoke` run folder on "
                                              "PTB, instead of training one first")
    ap.add_argument("--unguarded", action="store_true",
                    help="the lmcal under test may lack issue 29's checks: skip the probes that would then write into "
                         "/ or the sources, or run for hours (out=/, out=src/lmcal, horizon=10^7)")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lmcal-bad-"))
    train = ["lmcal.train", "experiment=smoke", "logger=wandb", "trainer.enable_progress_bar=false"]
    good = a.good or tmp / "good"
    if not a.good:
        rc, first, _ = run([*train, "logger=none", "trainer.max_epochs=1", f"hydra.run.dir={good}"], tmp)
        assert rc == 0, first
    ckpt = good / "checkpoints" / "best.ckpt"
    rows = []
    if a.only_41:
        run_41(tmp, ckpt, a, rows)
        table(rows, a.width)
        print(json.dumps({"tmp": str(tmp)}), file=sys.stderr)
        return
    files = {"crafted": tmp / "crafted.ckpt", "truncated": tmp / "truncated.ckpt", "random": tmp / "random.ckpt",
             "empty": tmp / "empty.ckpt"}
    torch.save({"hyper_parameters": _Payload(tmp / "PWNED"), "state_dict": {}}, files["crafted"])
    files["truncated"].write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    files["random"].write_bytes(os.urandom(4096))
    files["empty"].write_bytes(b"")
    cases = [(f"`evaluate ckpt=` {k} checkpoint", ["lmcal.evaluate", f"ckpt={p}", "logger=none"]) for k, p in
             files.items()]
    cases += [(f"`train {o}`", [*train, *o.split()]) for o in (
        "optim.lr=1e30", "optim.lr=1e6", "data.batch_size=0", "optim.lr=-1", "model.memory_tau=0",
        "trainer.max_epochs=0", "analysis.calibration.topk=0", "data.root=/nowhere data.download=false")]
    cases += [("`evaluate stages=[decoders] decoder=top_p decoder.p=2`",
               ["lmcal.evaluate", f"ckpt={ckpt}", "stages=[decoders]", "decoder=top_p", "decoder.p=2"]),
              ("`train` resumed with `model.hidden_size=48`", [*train, "logger=none", "model.hidden_size=48",
                                                                f"hydra.run.dir={good}"]),
              ("`reproduce tuas=[9] outt=elsewhere`", ["lmcal.reproduce", "profile=smoke", "tuas=[9]",
                                                      "outt=elsewhere"])]
    if a.reproduction:
        cases.append(("`reproduce` rerun with another decoders setting",
                      ["lmcal.reproduce", "profile=smoke", f"out={a.reproduction}",
                       "analysis=[analysis=smoke,analysis.decoders.mix_epsilon=1e-4]"]))
    cases = [(label, args, {}) for label, args in cases if not a.only_new] + hostile_cases(tmp, ckpt)
    if a.unguarded:
        cases = [c for c in cases if not any(x in c[0] for x in ("out=/`", "out=src/lmcal", "horizon=10^7"))]
    for label, args, env in cases:
        out = tmp / f"run{len(rows)}"
        extra = [f"hydra.run.dir={out}"] if args[0] not in ("lmcal.reproduce", "lmcal.report") and not any(
            "hydra.run.dir" in x for x in args) else []
        r = _run(args + extra, tmp, env)
        wandb = "yes" if out.is_dir() and any(out.rglob("wandb")) else "no"
        rows.append((label, r["rc"], r["tb"], wandb, left_in(out) if extra else "", r["seconds"], r["first"]))
        print(f"{label}: exit {r['rc']}", file=sys.stderr, flush=True)
    # the busy folder: a live lock held by this process
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from lmcal.utils.lock import run_lock

    busy = tmp / "busy"
    if not a.only_new:
        with run_lock(busy):
            r = _run([*train, f"hydra.run.dir={busy}"], tmp)
        rows.append(("`train` into a folder another run holds", r["rc"], r["tb"], "no", left_in(busy),
                     r["seconds"], r["first"]))
        rows.append(("(the crafted checkpoint's payload ran)", "", "", "", "", "",
                     "yes" if (tmp / "PWNED").exists() else "no"))
    rows.append(("(the checkpoint settings' builtins.open truncated its file)", "", "", "", "", "",
                 "no" if (tmp / "victim.txt").read_text() == "precious" else "yes"))
    rows.append(("(the Hugging Face folder's own Python ran)", "", "", "", "", "",
                 "yes" if (tmp / "RAN").exists() else "no"))
    outside = [*tmp.rglob("x.md"), *tmp.rglob("x.png")]
    rows.append(("(the report wrote outside --out)", "", "", "", "", "", "yes" if outside else "no"))
    if not a.only_new:
        run_41(tmp, ckpt, a, rows)
    table(rows, a.width)
    print(json.dumps({"tmp": str(tmp)}), file=sys.stderr)


def run_41(tmp: Path, ckpt: Path, a, rows: list) -> None:
    """Issue 41's probes (bench/bad_inputs_41.py), each a scenario of its own: a row each."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bad_inputs_41 import cases

    for label, probe in cases(tmp, ckpt, a.reproduction, a.probes):
        r = probe()
        rows.append((label, r["rc"], r["tb"], r.get("wandb", "no"), r.get("left", ""), r["seconds"], r["first"]))
        print(f"{label}: exit {r['rc']}", file=sys.stderr, flush=True)


def table(rows: list, width: int) -> None:
    print("| input | exit | traceback | W&B run started | left on disk | s | first line of the message |")
    print("|---|---|---|---|---|---|---|")
    for label, rc, tb, wandb, left, seconds, first in rows:
        seconds = f"{seconds:.0f}" if isinstance(seconds, float) else seconds
        cells = (label, rc, tb, wandb, left, seconds, str(first)[:width])
        print("| " + " | ".join(str(x).replace("|", r"\|") for x in cells) + " |")


def _hf_folder(folder: Path, tokenizer: bool = True) -> Path:
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40,
                                                         n_positions=64)).save_pretrained(folder)
    if tokenizer:
        tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "the", "cat"])}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(folder)
    return folder


def _memory_json(path: Path, corpus: str, drop: tuple = ()) -> Path:
    r = {"tau": 5, "corpus": corpus, "model": "m", "ce_limited_nats": 5.0, "mi_upper_bound_nats": 0.5,
         "mi_stderr_nats": 0.01, "alpha": 0.001, "alpha_stderr": 0.002, "entropy_calibrated_nats": 4.5,
         "test_tokens": 100, "cluster_size": 10}
    path.mkdir(parents=True, exist_ok=True)
    (path / "memory.json").write_text(json.dumps({k: v for k, v in r.items() if k not in drop}))
    return path


def hostile_cases(tmp: Path, ckpt: Path) -> list[tuple[str, list[str], dict]]:
    """Issue 29's probes: code named by a checkpoint's settings or a Hugging Face folder, names from files that would
    become paths, operating-system errors, text that is not UTF-8, plugins, interpolations and sizes beyond reason."""
    train = ["lmcal.train", "experiment=smoke", "logger=none", "trainer.enable_progress_bar=false"]
    victim = tmp / "victim.txt"
    victim.write_text("precious")
    evil = tmp / "settings.ckpt"  # passes torch.load(weights_only=True); instantiate would open victim for writing
    torch.save({"hyper_parameters": {"net": {"_target_": "lmcal.models.awd_lstm.AWDLSTM", "hidden_size": 8,
                                             "emb_size": {"_target_": "builtins.open", "file": str(victim),
                                                          "mode": "w"}}, "vocab_size": 10}, "state_dict": {}}, evil)
    remote = _hf_folder(tmp / "remote_code")
    (remote / "evil.py").write_text(f"open({str(tmp / 'RAN')!r}, 'w')\nfrom transformers import GPT2Config as C\n")
    cfg = json.loads((remote / "config.json").read_text())
    cfg.update(model_type="evil_unknown", auto_map={"AutoConfig": "evil.C", "AutoModelForCausalLM": "evil.C"})
    (remote / "config.json").write_text(json.dumps(cfg))
    latin1 = tmp / "latin1.txt"
    latin1.write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    (tmp / "afile").write_text("x")
    (tmp / "loop").symlink_to(tmp / "loop")
    (tmp / "raises_mod.py").write_text("raise RuntimeError('the plugin broke')\n")
    (tmp / "syntax_mod.py").write_text("def (:\n")
    plugins = {"PYTHONPATH": os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")])}
    dec = tmp / "decoders_noparams"
    dec.mkdir()
    (dec / "decoders.json").write_text(json.dumps({"corpus": "ptb", "rows": [{"method": "model"}]}))
    src = Path(__file__).resolve().parents[1] / "src" / "lmcal"
    cafe = tmp / "caf\u00e9" / "out"
    hf = ["lmcal.evaluate", "model=hf", "logger=none"]
    repro = ["lmcal.reproduce", "profile=smoke", "logger=none"]
    return [
        ("`evaluate ckpt=` settings nesting `_target_: builtins.open`", ["lmcal.evaluate", f"ckpt={evil}",
                                                                        "logger=none"], {}),
        ("`train init_ckpt=` the same checkpoint", [*train, f"init_ckpt={evil}"], {}),
        ("`train memory.base_ckpt=` the same checkpoint", [*train, "model.memory_tau=5", "analysis.stages=[memory]",
                                                           f"memory.base_ckpt={evil}"], {}),
        ("`evaluate model=hf` folder with `auto_map`, unknown model_type", [*hf, f"model.name_or_path={remote}"], {}),
        ("`evaluate model=hf` folder without tokenizer files",
         [*hf, f"model.name_or_path={_hf_folder(tmp / 'no_tokenizer', tokenizer=False)}"], {}),
        ("`evaluate model=hf model.valid_text=` latin-1 bytes",
         [*hf, f"model.name_or_path={_hf_folder(tmp / 'tiny_hf')}", f"model.valid_text={latin1}",
          f"model.test_text={latin1}"], {}),
        ("`report` memory.json with corpus `../../../x`",
         ["lmcal.report", str(_memory_json(tmp / "trav" / "a" / "b", "../../../x")), "--wandb", "disabled"], {}),
        ("`report` memory.json missing keys", ["lmcal.report", str(_memory_json(tmp / "nokeys", "ptb",
                                                                                  ("mi_upper_bound_nats",)))], {}),
        ("`report` a decoders row without params", ["lmcal.report", str(dec)], {}),
        ("`train data.root=` a file (download on)", [*train, f"data.root={tmp / 'afile'}", "data.download=true"], {}),
        ("`train data.root=` a symlink loop", [*train, f"data.root={tmp / 'loop'}"], {}),
        ("`reproduce out=` a folder that cannot be made", [*repro, "out=/sys/lmcal_probe/out"], {}),
        ("`report --out` a folder that cannot be made", ["lmcal.report", str(_memory_json(tmp / "mem", "ptb")),
                                                         "--out", "/sys/lmcal_probe/out", "--wandb", "disabled"], {}),
        ("`train` with `LMCAL_PLUGINS=no_such_module`", train, {"LMCAL_PLUGINS": "no_such_module", **plugins}),
        ("`reproduce` with `LMCAL_PLUGINS=` a module that raises", repro, {"LMCAL_PLUGINS": "raises_mod", **plugins}),
        ("`evaluate` with `LMCAL_PLUGINS=` a module that does not compile", ["lmcal.evaluate", f"ckpt={ckpt}"],
         {"LMCAL_PLUGINS": "syntax_mod", **plugins}),
        ("`train data.root=${oc.env:UNSET}`", [*train, "data.root=${oc.env:LMCAL_UNSET_VARIABLE}"], {}),
        ("`train data.root=${evil:1}`", [*train, "data.root=${evil:1}"], {}),
        ("`reproduce dataset=${oc.env:UNSET}`", [*repro, "dataset=${oc.env:LMCAL_UNSET_VARIABLE}"], {}),
        ("`reproduce jobs=abc`", [*repro, f"out={tmp / 'jobs'}", "jobs=abc"], {}),
        ("`reproduce out=/`", [*repro, "out=/"], {}),
        ("`reproduce out=src/lmcal`", [*repro, f"out={src}"], {}),
        ("`reproduce out=` with a non-ASCII letter", [*repro, f"out={cafe}"], {}),
        *[(f"`train {k}=10^7`", [*train, "analysis.stages=[entropy_rate]", f"{k}=10000000"], {}) for k in (
            "analysis.entropy_rate.horizon", "analysis.entropy_rate.prefix_len",
            "analysis.entropy_rate.samples_per_prefix", "model.hidden_size")],
    ]


if __name__ == "__main__":
    main()
