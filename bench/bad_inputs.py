"""What a user sees for each bad input: runs the real entry points on bad settings and broken files, and prints a
Markdown table of the exit code and the first line of lmcal's message (docs/bad_inputs.md is its output).

    python bench/bad_inputs.py [--reproduction DIR]     # DIR: a finished `make reproduce PROFILE=smoke out=DIR`

Needs the real PTB files ($LMCAL_DATA_ROOT, or data/ in the project). About three minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def run(args: list[str], cwd: Path) -> tuple[int, str, str]:
    env = {**os.environ, "WANDB_MODE": "offline", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    lines = [line for line in r.stderr.splitlines() if line.startswith("lmcal: error:")]
    first = lines[0] if lines else (r.stderr.strip().splitlines() or [""])[-1]
    traceback = "yes" if "Traceback" in r.stderr else "no"
    return r.returncode, first, traceback


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reproduction", type=Path, help="a finished smoke reproduction, for the changed-settings row")
    ap.add_argument("--width", type=int, default=160, help="characters of each message shown")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="lmcal-bad-"))
    train = ["lmcal.train", "experiment=smoke", "logger=wandb", "trainer.enable_progress_bar=false"]
    good = tmp / "good"
    rc, first, _ = run([*train, "logger=none", "trainer.max_epochs=1", f"hydra.run.dir={good}"], tmp)
    assert rc == 0, first
    ckpt = good / "checkpoints" / "best.ckpt"
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
    rows = []
    for label, args in cases:
        out = tmp / f"run{len(rows)}"
        extra = [f"hydra.run.dir={out}"] if args[0] != "lmcal.reproduce" and not any("hydra.run.dir" in x
                                                                                        for x in args) else []
        rc, first, tb = run(args + extra, tmp)
        wandb = "yes" if out.is_dir() and any(out.rglob("wandb")) else "no"
        rows.append((label, rc, tb, wandb, first[: a.width]))
        print(f"{label}: exit {rc}", file=sys.stderr, flush=True)
    # the busy folder: a live lock held by this process
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from lmcal.utils.lock import run_lock

    busy = tmp / "busy"
    with run_lock(busy):
        rc, first, tb = run([*train, f"hydra.run.dir={busy}"], tmp)
    rows.append(("`train` into a folder another run holds", rc, tb, "no", first[: a.width]))
    rows.append(("(the crafted checkpoint's payload ran)", "", "", "", "yes" if (tmp / "PWNED").exists() else "no"))
    print("| input | exit | traceback | W&B run started | first line of the message |")
    print("|---|---|---|---|---|")
    for label, rc, tb, wandb, first in rows:
        first = first.replace("|", r"\|")
        print(f"| {label} | {rc} | {tb} | {wandb} | {first} |")
    print(json.dumps({"tmp": str(tmp)}), file=sys.stderr)


if __name__ == "__main__":
    main()
