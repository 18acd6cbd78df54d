"""Issue 41's probes for bench/bad_inputs.py: refused runs that must write nothing anywhere (system folders, the
package, the docs), records that must be whole to be trusted, checkpoints from elsewhere, required settings, stops
(signals during training, `make` killed under a reproduction, a training killed while it saved) and the tracebacks
that must become one paragraph. Each probe is a scenario: it sets up its files, runs the real entry point in a
subprocess, and says what was left on disk. Nothing is left in a system folder: the probes that aim at one use a new
folder of their own there and remove it (and anything a run made in it) afterwards.

    python bench/bad_inputs.py --only-41 --good RUN [--reproduction DIR] [--probes WORD,...]
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
from bad_inputs import _run, _summary, left_in

PROJECT = Path(__file__).resolve().parents[1]
SRC = PROJECT / "src" / "lmcal"
TRAIN = ["lmcal.train", "experiment=smoke", "logger=none", "trainer.enable_progress_bar=false"]
SHORT = ["trainer.max_epochs=1", "data.max_train_tokens=2000", "data.max_eval_tokens=500", "analysis.stages=[]"]
SMOKE_EVAL = ["analysis=smoke", "logger=none", "stages=[entropy_rate]"]


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
    return {**r, "left": (", ".join(added) + " (removed by the bench)") if added else "nothing"}


def _hashes(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def _snapshot_probe(tmp: Path) -> dict:
    """lmcal.docs --snapshot of a results.json that parses but has the wrong types, into a copy of docs/."""
    docs, fake = tmp / "docs_copy", tmp / "FAKE"
    shutil.copytree(PROJECT / "docs", docs, dirs_exist_ok=True)
    fake.mkdir(exist_ok=True)
    (fake / "results.json").write_text(json.dumps({"profile": "cpu", "provenance": ["not", "a", "mapping"],
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
        said = err.read_text()  # (before the bench ends an orphan)
        if orphan:  # the bench ends it (its stages die with it)
            os.kill(pid, signal.SIGTERM)
            for _ in range(240):
                if not _alive(pid):
                    break
                time.sleep(0.5)
    r = _summary(-9, said)
    last = (said.strip().splitlines() or ["(nothing on stderr)"])[-1]
    return {**r, "rc": "-9 (make)", "first": last, "seconds": time.perf_counter() - t0, "left": left}


def _lock_body(tmp: Path, body: str) -> dict:
    run = tmp / f"lock_{abs(hash(body))}"
    run.mkdir(parents=True, exist_ok=True)
    (run / ".lmcal.lock").write_text(body)
    os.utime(run / ".lmcal.lock", (time.time() - 60, time.time() - 60))
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


def cases(tmp: Path, ckpt: Path, reproduction: Path | None, probes: str | None) -> list[tuple[str, object]]:
    """(label, probe) of issue 41's probes; `probes`: comma-separated words, the labels to keep (None: all)."""
    link = tmp / "link_to_usr_local"
    if not link.exists():
        link.symlink_to("/usr/local")
    usr = Path("/usr/local/lmcal_probe_41")
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
    words = [w.strip() for w in probes.split(",")] if probes else None
    return [(label, probe) for label, probe in all_cases if words is None or any(w in label for w in words)]
