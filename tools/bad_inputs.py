"""What a user sees for each bad input: runs the real entry points on bad settings and broken files, and prints a
Markdown table of the exit code and the first line of lmcal's message (docs/bad_inputs.md is its output).

    python tools/bad_inputs.py [--reproduction DIR]     # DIR: a finished `make reproduce PROFILE=smoke out=DIR`
    python tools/bad_inputs.py --only-scenarios --good RUN [--probes WORD,...]   # the scenario probes alone
    python tools/bad_inputs.py --only-files --good RUN [--probes WORD,...]       # links, names, records, sizes

Four groups of probes: bad settings and broken checkpoints; hostile inputs (hostile_cases: code named by a
checkpoint's settings or a Hugging Face folder, names that would become paths, operating-system errors, sizes beyond
reason); scenarios (scenario_cases: refused runs that must write nothing anywhere, records that must be whole to be
trusted, checkpoints from elsewhere, required settings, stops: signals during training, `make` killed under a
reproduction, a training killed while it saved); and the probes of links, names, records, sizes and tracebacks
(bad_inputs_files.file_cases). A scenario sets up its files, runs the real entry point in a
subprocess, and says what was left on disk; the ones that aim at a system folder use a new folder of their own there
and remove it (and anything a run made in it) afterwards.

Needs the real PTB files ($LMCAL_DATA_ROOT, or data/ in the project), and transformers for the Hugging Face rows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PROJECT = Path(__file__).resolve().parents[1]
SRC = PROJECT / "src" / "lmcal"
TRAIN = ["lmcal.train", "experiment=smoke", "logger=none", "trainer.enable_progress_bar=false"]
SHORT = ["trainer.max_epochs=1", "data.max_train_tokens=2000", "data.max_eval_tokens=500", "analysis.stages=[]"]
SMOKE_EVAL = ["analysis=smoke", "logger=none", "stages=[entropy_rate]"]


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def run(args: list[str], cwd: Path, env: dict | None = None, timeout: float = 900) -> tuple[int, str, str]:
    r = _run(args, cwd, env, timeout)
    return r["rc"], r["first"], r["tb"]


def _run(args: list[str], cwd: Path, env: dict | None = None, timeout: float = 900) -> dict:
    """The entry point `python -m <args>` (run_argv)."""
    return run_argv([sys.executable, "-m", *args], cwd, env, timeout)


def run_argv(argv: list[str], cwd: Path, env: dict | None = None, timeout: float = 900) -> dict:
    """The command `argv`: its exit code, first line (lmcal's paragraph, else stderr's last line), whether it printed
    a traceback, and its wall seconds. `env` values None remove that variable."""
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONWARNINGS": "ignore", **(env or {})}
    env = {k: v for k, v in env.items() if v is not None}
    t0 = time.perf_counter()
    r = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
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
    ap.add_argument("--only-new", action="store_true", help="only the hostile probes (hostile_cases)")
    ap.add_argument("--only-scenarios", "--only-41", dest="only_scenarios", action="store_true",
                    help="only the scenario probes (scenario_cases)")
    ap.add_argument("--only-files", action="store_true",
                    help="only the probes of links, names, records, sizes and tracebacks (bad_inputs_files)")
    ap.add_argument("--probes", help="with --only-scenarios or --only-files: only the probes whose label holds one "
                                     "of these words (comma-separated)")
    ap.add_argument("--good", type=Path, help="a finished `python -m lmcal.train experiment=smoke` run folder on "
                                              "PTB, instead of training one first")
    ap.add_argument("--unguarded", action="store_true",
                    help="the lmcal under test may lack the hostile probes' checks: skip the probes that would then "
                         "write into / or the sources, or run for hours (out=/, out=src/lmcal, horizon=10^7)")
    a = ap.parse_args()
    from bad_inputs_files import file_cases  # (it imports this module's helpers)

    tmp = Path(tempfile.mkdtemp(prefix="lmcal-bad-"))
    train = ["lmcal.train", "experiment=smoke", "logger=wandb", "trainer.enable_progress_bar=false"]
    good = a.good or tmp / "good"
    if not a.good:
        rc, first, _ = run([*train, "logger=none", "trainer.max_epochs=1", f"hydra.run.dir={good}"], tmp)
        assert rc == 0, first
    ckpt = good / "checkpoints" / "best.ckpt"
    rows = []
    if a.only_scenarios or a.only_files:
        if a.only_scenarios:
            run_probes(scenario_cases(tmp, ckpt, a.reproduction), a.probes, rows)
        if a.only_files:
            run_probes(file_cases(tmp, ckpt), a.probes, rows)
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
    sys.path.insert(0, str(PROJECT / "src"))
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
        run_probes(scenario_cases(tmp, ckpt, a.reproduction), a.probes, rows)
        run_probes(file_cases(tmp, ckpt), a.probes, rows)
    table(rows, a.width)
    print(json.dumps({"tmp": str(tmp)}), file=sys.stderr)


def run_probes(cases: list[tuple[str, object]], probes: str | None, rows: list) -> None:
    """Runs each (label, probe) whose label holds one of the comma-separated words `probes` (None: all): a row each."""
    words = [w.strip() for w in probes.split(",")] if probes else None
    for label, probe in cases:
        if words is None or any(w in label for w in words):
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


MEMORY = {"tau": 5, "corpus": "ptb", "model": "m", "ce_limited_nats": 5.0, "mi_upper_bound_nats": 0.5,
          "mi_stderr_nats": 0.01, "alpha": 0.001, "alpha_stderr": 0.002, "entropy_calibrated_nats": 4.5,
          "test_tokens": 100, "cluster_size": 10}  # a memory stage's whole memory.json


def _memory_json(path: Path, corpus: str, drop: tuple = ()) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "memory.json").write_text(json.dumps({k: v for k, v in (MEMORY | {"corpus": corpus}).items()
                                                  if k not in drop}))
    return path


def hostile_cases(tmp: Path, ckpt: Path) -> list[tuple[str, list[str], dict]]:
    """The hostile probes: code named by a checkpoint's settings or a Hugging Face folder, names from files that would
    become paths, operating-system errors, text that is not UTF-8, plugins, interpolations and sizes beyond reason."""
    train = TRAIN
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
        ("`reproduce out=src/lmcal`", [*repro, f"out={SRC}"], {}),
        ("`reproduce out=` with a non-ASCII letter", [*repro, f"out={cafe}"], {}),
        *[(f"`train {k}=10^7`", [*train, "analysis.stages=[entropy_rate]", f"{k}=10000000"], {}) for k in (
            "analysis.entropy_rate.horizon", "analysis.entropy_rate.prefix_len",
            "analysis.entropy_rate.samples_per_prefix", "model.hidden_size")],
    ]



def _pick(r: dict, *needles: str) -> dict:
    """The row's first line: lmcal's paragraph, else the first stderr or stdout line holding one of `needles`."""
    if not r["first"].startswith("lmcal: error:"):
        for line in (r["stderr"] + "\n" + r.get("stdout", "")).splitlines():
            if any(n in line for n in needles):
                return {**r, "first": line.strip()}
    return r


def _into(folder: Path, args: list[str], cwd: Path, spelled: str | None = None, **kw) -> dict:
    """Runs `args` with hydra.run.dir=`spelled` (default: the folder) and says what it left in `folder`, which must be
    new (a folder of the probe's own): removed afterwards."""
    if folder.exists():
        shutil.rmtree(folder)
    try:
        r = _run([*args, f"hydra.run.dir={spelled or folder}"], cwd, **kw)
        return {**r, "left": left_in(folder)}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _guarded_etc(tmp: Path) -> dict:
    """hydra.run.dir=/tmp/../etc: /etc's entries are listed before; any a run adds (.hydra, train.log) are named in
    the row and removed at once."""
    before = set(os.listdir("/etc"))
    try:
        r = _run([*TRAIN, "optim.lr=-1", "hydra.run.dir=/tmp/../etc"], tmp)
    finally:
        added = sorted(set(os.listdir("/etc")) - before)
        for name in added:
            if name in (".hydra", "train.log"):  # only what a run of lmcal.train makes there
                p = Path("/etc") / name
                shutil.rmtree(p) if p.is_dir() else p.unlink()
    return {**r, "left": (", ".join(added) + " (removed by the probe)") if added else "nothing"}


def _hashes(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def _snapshot_probe(tmp: Path, name: str = "", results: str | None = None) -> dict:
    """lmcal.docs --snapshot of a results.json `results` (default: one that parses but has the wrong types), into a
    copy of docs/."""
    docs, fake = tmp / f"docs_copy{name}", tmp / f"FAKE{name}"
    shutil.copytree(PROJECT / "docs", docs, dirs_exist_ok=True)
    fake.mkdir(exist_ok=True)
    (fake / "results.json").write_text(results or json.dumps({"profile": "cpu", "provenance": ["not", "a", "mapping"],
                                                              "base": 3}))
    (fake / "REPORT.md").write_text("# a report\n")
    before = _hashes(docs)
    r = _run(["lmcal.docs", "--snapshot", str(fake), "--docs", str(docs)], tmp)
    after = _hashes(docs)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    return {**r, "left": ("changed in docs/: " + ", ".join(changed)) if changed else "docs/ unchanged"}


def _edited(ckpt: Path, dest: Path, edit) -> Path:
    c = torch.load(ckpt, weights_only=True)
    edit(c)
    torch.save(c, dest)
    return dest


def _nan(c: dict) -> None:
    for key in ("net.encoder.weight", "net.decoder.weight"):  # the embedding (tied to the output layer)
        c["state_dict"][key] = torch.full_like(c["state_dict"][key], float("nan"))


def _eval_probe(tmp: Path, ckpt: Path, name: str, edit, env: dict | None = None) -> dict:
    x = _edited(ckpt, tmp / f"{name}.ckpt", edit)
    out = tmp / f"eval_{name}"
    r = _run(["lmcal.evaluate", f"ckpt={x}", *SMOKE_EVAL, f"hydra.run.dir={out}"], tmp, env)
    ev = out / "evaluation.json"
    note = ""
    if ev.is_file():
        e = json.loads(ev.read_text()).get("entropy_rate", {})
        note = f" (test_ppl {e.get('test_ppl', float('nan')):.1f})"
    return {**r, "left": left_in(out) + note}


def _held_report(tmp: Path, ckpt: Path) -> dict:
    """lmcal.report DIR while a live run (this process) holds DIR's lock."""
    sys.path.insert(0, str(PROJECT / "src"))
    from lmcal.utils.lock import run_lock

    held = tmp / "held"
    (held / "run1").mkdir(parents=True, exist_ok=True)
    shutil.copy(ckpt.parents[1] / "metrics.json", held / "run1" / "metrics.json")
    with run_lock(held, "reproduction"):
        r = _run(["lmcal.report", str(held), "--wandb", "disabled"], tmp)
    return {**r, "left": left_in(held, before={"run1"})}


def _stage_json_emptied(tmp: Path, reproduction: Path) -> dict:
    """A finished smoke reproduction whose calibration.json became `{}`, rerun with its report to redo."""
    out = tmp / "repro_copy"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(reproduction, out, symlinks=True)
    cal = out / "ptb" / "calibration" / "calibration.json"
    cal.write_text("{}")
    (out / "results.json").unlink()
    r = _pick(_run(["lmcal.reproduce", "profile=smoke", f"out={out}", "logger=none"], tmp, timeout=3600),
              "calibration.json", "calibration:")
    whole = "alpha" in json.loads(cal.read_text())
    return {**r, "left": f"calibration.json {'written again' if whole else 'still {}'}; results.json "
                         f"{'written' if (out / 'results.json').is_file() else 'missing'}"}


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", ""])
    p.wait()
    return p.pid


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


def _killed_while_saving(tmp: Path) -> dict:
    """A training killed -9 while it wrote best.ckpt leaves its lock and the half-written .tmp: the rerun."""
    run = tmp / "killed_saving"
    (run / "checkpoints").mkdir(parents=True, exist_ok=True)
    dead = _dead_pid()
    half = run / "checkpoints" / f".best.ckpt.{dead}.0123abcd.tmp"
    half.write_bytes(os.urandom(1 << 20))
    (run / ".lmcal.lock").write_text(json.dumps({"pid": dead, "host": socket.gethostname(), "what": "training"}))
    r = _pick(_run([*TRAIN, *SHORT, f"hydra.run.dir={run}"], tmp), "temporary file", "stale lock")
    return {**r, "left": f"{half.name} {'still there' if half.exists() else 'removed'}"}


def _signal_in_fit(tmp: Path, sig: signal.Signals) -> dict:
    """SIGTERM or SIGINT once trainer.fit has started (Lightning has printed its model summary)."""
    run = tmp / f"fit_{sig.name}"
    shutil.rmtree(run, ignore_errors=True)
    err = tmp / f"fit_{sig.name}.err"
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore"}
    t0 = time.perf_counter()
    out = tmp / f"fit_{sig.name}.out"
    with open(err, "w") as f, open(out, "w") as o:
        # Lightning's model summary goes to stdout (not train.log); SIGINT as a terminal's Ctrl-C sends it (a shell's
        # background job passes it on ignored, and Python then never raises KeyboardInterrupt)
        p = subprocess.Popen([sys.executable, "-m", *TRAIN, "trainer.max_epochs=500",
                              "trainer.enable_model_summary=true", "analysis.stages=[]", f"hydra.run.dir={run}"],
                             cwd=tmp, env=env, stdout=o, stderr=f, stdin=subprocess.DEVNULL,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.time() + 600
        while time.time() < deadline and p.poll() is None:
            if "Trainable params" in out.read_text():
                break
            time.sleep(0.5)
        time.sleep(3)  # in the training loop
        p.send_signal(sig)
        try:
            p.wait(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    r = _summary(p.returncode, err.read_text())
    last = (r["stderr"].strip().splitlines() or [""])[-1]
    return {**r, "first": r["first"] if r["first"].startswith("lmcal") else last, "seconds": time.perf_counter() - t0,
            "left": left_in(run)}


def _make_killed(tmp: Path) -> dict:
    """`make reproduce` killed -9 while the pipeline runs: is lmcal.reproduce left running, holding its lock?"""
    out = tmp / "make_out"
    err = tmp / "make.err"
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONWARNINGS": "ignore"}
    t0 = time.perf_counter()
    with open(err, "w") as f:
        make = subprocess.Popen(["make", "-s", "-C", str(PROJECT), "-o", ".venv/.installed", "reproduce",
                                 "PROFILE=smoke", f"ARGS=out={out} logger=none"], env=env, stdout=subprocess.DEVNULL,
                                stderr=f, stdin=subprocess.DEVNULL, start_new_session=True)
        lock, pid, deadline = out / ".lmcal.lock", None, time.time() + 300
        while pid is None and time.time() < deadline:
            try:
                pid = json.loads(lock.read_text())["pid"]
            except (OSError, ValueError, KeyError):
                time.sleep(0.3)
        time.sleep(5)  # the stages have started
        make.send_signal(signal.SIGKILL)
        make.wait()
        time.sleep(15)
        orphan = pid is not None and _alive(pid)
        left = (f"lmcal.reproduce (pid {pid}) still running 15 s later, holding {lock.name}" if orphan else
                f"pipeline ended; {'lock left' if lock.exists() else 'lock released'}")
        said = err.read_text()  # (before the probe ends an orphan)
        if orphan:  # the probe ends it (its stages die with it)
            os.kill(pid, signal.SIGTERM)
            for _ in range(240):
                if not _alive(pid):
                    break
                time.sleep(0.5)
    r = _summary(-9, said)
    last = (said.strip().splitlines() or ["(nothing on stderr)"])[-1]
    return {**r, "rc": "-9 (make)", "first": last, "seconds": time.perf_counter() - t0, "left": left}


def _lock_body(tmp: Path, body: str | None) -> dict:
    """`train` into a folder whose .lmcal.lock holds `body`, untouched for a minute; None: the lock is a folder."""
    run = tmp / f"lock_{abs(hash(body))}"
    run.mkdir(parents=True, exist_ok=True)
    lock = run / ".lmcal.lock"
    lock.mkdir() if body is None else lock.write_text(body)
    os.utime(lock, (time.time() - 60, time.time() - 60))
    r = _pick(_run([*TRAIN, *SHORT, f"hydra.run.dir={run}"], tmp), ".lmcal.lock")
    return {**r, "left": left_in(run)}


def _wandb_online(tmp: Path) -> dict:
    home = tmp / "home_without_key"
    home.mkdir(exist_ok=True)
    env = {"WANDB_MODE": None, "WANDB_API_KEY": None, "HOME": str(home), "WANDB_CONFIG_DIR": str(home / "wandb")}
    out = tmp / "wandb_online"
    r = _run(["lmcal.train", "experiment=smoke", "trainer.enable_progress_bar=false", *SHORT, "logger=wandb",
              "logger.offline=false", f"hydra.run.dir={out}"], tmp, env, timeout=600)
    return {**r, "left": left_in(out), "wandb": "yes" if any(out.rglob("wandb")) else "no"}


def scenario_cases(tmp: Path, ckpt: Path, reproduction: Path | None) -> list[tuple[str, object]]:
    """(label, probe) of the scenario probes."""
    link = tmp / "link_to_usr_local"
    if not link.exists():
        link.symlink_to("/usr/local")
    usr = Path("/usr/local/lmcal_probe_scenario")
    markov = {"name": "markov", "corpus_kwargs": {"vocab_size": 16, "order": 2, "support": 3, "smoothing": 0.01,
                                                  "n_train": 200000, "n_valid": 20000, "n_test": 20000, "seed": 0}}

    def data(**kw):
        return lambda c: c["hyper_parameters"].__setitem__("data_cfg", kw.get("value", {
            **(c["hyper_parameters"].get("data_cfg") or {}), **kw.get("add", {})}))

    all_cases = [
        ("`train optim.lr=-1 hydra.run.dir=` a new folder under /usr (as root)",
         lambda: _into(usr, [*TRAIN, "optim.lr=-1"], tmp)),
        ("`train optim.lr=-1 hydra.run.dir=` the same, through a symlink to /usr/local",
         lambda: _into(usr, [*TRAIN, "optim.lr=-1"], tmp, spelled=str(link / usr.name))),
        ("`train optim.lr=-1 hydra.run.dir=/tmp/../etc` (as root)", lambda: _guarded_etc(tmp)),
        ("`train optim.lr=-1 hydra.run.dir=src/lmcal/probe_x` (in the project)",
         lambda: _into(SRC / "probe_x", [*TRAIN, "optim.lr=-1"], PROJECT, spelled="src/lmcal/probe_x")),
        ("`docs --snapshot FAKE`: results.json of valid JSON, wrong types", lambda: _snapshot_probe(tmp)),
        ("`evaluate ckpt=` a PTB network whose data settings name the Markov corpus",
         lambda: _eval_probe(tmp, ckpt, "ptb_as_markov", data(value=markov))),
        ("`train '~optim.lr'`", lambda: _into(tmp / "no_lr", [*TRAIN, *SHORT, "~optim.lr"], tmp)),
        ("`report DIR` while a reproduction holds DIR's lock", lambda: _held_report(tmp, ckpt)),
        ("`reproduce 'taus=[99999999999]' check=true`",
         lambda: _pick(_run(["lmcal.reproduce", "profile=smoke", f"out={tmp / 'huge'}", "taus=[99999999999]",
                             "check=true"], tmp), "Largest stages")),
        ("`reproduce 'taus=[50000]' check=true` (tau longer than the smoke corpus)",
         lambda: _pick(_run(["lmcal.reproduce", "profile=smoke", f"out={tmp / 'long'}", "taus=[50000]",
                             "check=true"], tmp), "Largest stages")),
        ("`kill -9` of `make` during `make reproduce`", lambda: _make_killed(tmp)),
        ("`train` rerun after a `kill -9` while it wrote best.ckpt", lambda: _killed_while_saving(tmp)),
        ("SIGTERM during `trainer.fit`", lambda: _signal_in_fit(tmp, signal.SIGTERM)),
        ("SIGINT during `trainer.fit`", lambda: _signal_in_fit(tmp, signal.SIGINT)),
        ("`reproduce out=.../my_tau_x check=true`",
         lambda: _pick(_run(["lmcal.reproduce", "profile=smoke", f"out={tmp / 'my_tau_x'}", "check=true"], tmp),
                       "Plan of")),
        *[(f"`train` into a folder whose .lmcal.lock holds `{body}`", (lambda b=body: _lock_body(tmp, b)))
          for body in ("[1, 2]", "null", "garbage")],
        ("`train seed=99999999999999999999`",
         lambda: _into(tmp / "seed", [*TRAIN, *SHORT, "seed=99999999999999999999"], tmp)),
        *[(f"`train data=markov data.corpus_kwargs.vocab_size={v}`",
           (lambda v=v: _into(tmp / f"vocab{v}", [*TRAIN, *SHORT, "data=markov", f"data.corpus_kwargs.vocab_size={v}"],
                              tmp))) for v in (0, 1)],
        ("`evaluate ckpt=` data settings with an unknown key",
         lambda: _eval_probe(tmp, ckpt, "unknown_key", data(add={"colour": "red"}))),
        ("`evaluate ckpt=` data settings that are a list",
         lambda: _eval_probe(tmp, ckpt, "data_list", data(value=["ptb"]))),
        ("`evaluate ckpt=` `hidden_size: -5`",
         lambda: _eval_probe(tmp, ckpt, "negative", lambda c: c["hyper_parameters"]["net"].__setitem__(
             "hidden_size", -5))),
        ("`evaluate ckpt=` NaN weights", lambda: _eval_probe(tmp, ckpt, "nan", _nan)),
        ("`evaluate ckpt=` data settings with another machine's `root` and `download: true`",
         lambda: _eval_probe(tmp, ckpt, "foreign_root", data(add={"root": "/nonexistent/their_machine/data",
                                                                  "download": True}))),
        ("`train logger.offline=false`, no API key, no network", lambda: _wandb_online(tmp)),
        ("`train '~data'`", lambda: _into(tmp / "no_data", [*TRAIN, "~data"], tmp)),
    ]
    if reproduction:
        all_cases.insert(7, ("`make reproduce` after a stage's calibration.json became `{}` (its report to redo)",
                             lambda: _stage_json_emptied(tmp, reproduction)))
    return all_cases

if __name__ == "__main__":
    main()
