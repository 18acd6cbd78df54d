"""docs/RESULTS.md, regenerated from files that runs wrote; no number in it is typed by hand. Provenance (command,
date, machine, commit), saved benchmark tables, snapshots of reproductions, and the rendering.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from lmcal.errors import LmcalError
from lmcal.reporting.claims import claims_markdown, results_claims
from lmcal.utils.io import file_name, inside, temp_path, write_text_atomic

ROOT = Path(__file__).resolve().parents[3]


DOCS = ROOT / "docs"


def machine() -> str:
    """The machine in words: CPU model and cores, accelerator, torch version."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores, {gpu}, torch {torch.__version__}"


def provenance(command: str | None = None) -> dict:
    """What made an output: the command, the date, the machine and the code's git commit."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip() or None
        changed = subprocess.run(["git", "status", "--porcelain", "--", "src", "conf", "bench"], cwd=ROOT,
                                 capture_output=True, text=True, timeout=10).stdout.strip()
        if commit and changed:  # the code that ran is not that commit's: say so
            commit += " with uncommitted changes"
    except (OSError, subprocess.SubprocessError):
        commit = None
    if command is None:  # this process's own command line, the script relative to the project
        script = Path(sys.argv[0]).resolve()
        command = "python " + shlex.join([str(script.relative_to(ROOT)) if script.is_relative_to(ROOT) else
                                          sys.argv[0], *sys.argv[1:]])
    return {"command": command,
            "date": time.strftime("%Y-%m-%d %H:%M %Z"), "machine": machine(), "commit": commit}


def versions() -> dict:
    """The versions of Python and of the packages the numbers depend on (those installed)."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for pkg in ("lmcal", "torch", "numpy", "scipy", "pytorch-lightning", "transformers", "hydra-core", "omegaconf",
                "wandb"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def provenance_line(p: dict) -> str:
    return (f"*Command:* `{p['command']}` · *date:* {p['date']} · *machine:* {p['machine']}"
            + (f" · *commit:* {p['commit']}" if p.get("commit") else ""))


def add_out_option(ap: argparse.ArgumentParser, name: str) -> None:
    """A benchmark's `--out` option: where save_bench writes its tables."""
    ap.add_argument("--out", help=f"also write the tables, with command, date and machine, to this Markdown file "
                    f"(e.g. docs/bench/{name}.md; `make docs` puts it in docs/RESULTS.md)")


def tee() -> tuple[Callable[[str], None], list[str]]:
    """(emit, lines): emit prints a line at once and keeps it in lines, for save_bench at the end."""
    lines: list[str] = []

    def emit(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    return emit, lines


def save_bench(path: str | Path | None, title: str, body: str, command: str | None = None) -> None:
    """A benchmark's Markdown (its tables) with a heading and its provenance, written atomically to `path`
    (nothing when path is None: the bench only printed)."""
    if path is None:
        return
    write_text_atomic(path, f"## {title}\n\n{provenance_line(provenance(command))}\n\n{body.strip()}\n")


def snapshot(run: str | Path, docs: Path = DOCS) -> Path:
    """Copies a finished reproduction's results.json, REPORT.md and figures into docs/runs/<profile>/, after checking
    that RESULTS.md can be rendered from them (`check_snapshot`), and all at once: the files go to a temporary folder
    beside it that then takes the old snapshot's place. A bad snapshot changes nothing."""
    run = Path(run)
    profile = check_snapshot(run)
    runs = docs / "runs"
    dest = inside(runs, runs / file_name(profile, run / "results.json", "profile"))
    tmp, old = temp_path(dest), temp_path(dest)
    try:
        tmp.mkdir(parents=True)
        for f in ["results.json", "REPORT.md", *sorted(p.name for p in run.glob("*.png"))]:
            shutil.copyfile(run / f, tmp / f)
        if dest.exists():
            os.replace(dest, old)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return dest


def check_snapshot(run: Path) -> str:
    """The profile of the finished reproduction in `run`, once its results.json and REPORT.md are known to render
    (every key RESULTS.md reads there, of its type); LmcalError otherwise, naming the file and what is wrong."""
    if not (run / "results.json").is_file() or not (run / "REPORT.md").is_file():
        raise LmcalError(f"{run} holds no finished reproduction (results.json and REPORT.md are written by its last "
                         f"stage): run `make reproduce` to the end first, or pass the folder it wrote to.")
    try:
        r = json.loads((run / "results.json").read_text())
        if not isinstance(r, dict):
            raise TypeError(f"it holds a JSON {type(r).__name__}, not an object")
        profile = r.get("profile") or run.name
        if not isinstance(profile, str):
            raise TypeError(f"its profile is a {type(profile).__name__}")
        # what provenance_line reads must be text; the report stage adds numbers of its own (matmul_gflop_per_s,
        # precision) that nothing here reads
        prov = r.get("provenance") or {}
        if not isinstance(prov, dict):
            raise TypeError(f"its provenance is a {type(prov).__name__}, not a mapping")
        if prov and not all(isinstance(prov.get(k), str) for k in ("command", "date", "machine")) or not isinstance(
                prov.get("commit"), (str, type(None))):
            raise TypeError("its provenance's command, date, machine and commit are not texts")
        run_section(run, "runs/" + run.name)  # everything else RESULTS.md reads, read as it will be
    except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
        raise LmcalError(f"{run / 'results.json'} is not a reproduction's results ({type(e).__name__}: "
                         f"{str(e).strip(chr(39))[:200]}); nothing was copied or changed. Rerun its report stage "
                         "(make reproduce in that folder) before taking a snapshot.") from None
    return profile


def _report_body(folder: Path, rel: str, provenance: str = "") -> str:
    """A snapshot's REPORT.md as a section of RESULTS.md: without its title and its provenance line where that is the
    section's own (the section's heading and line stand for them), headings one level down, figures pointing into the
    snapshot, links into the run's folders (not copied) turned into plain text."""
    text = re.sub(r"\A# [^\n]*\n+", "", (folder / "REPORT.md").read_text())
    if provenance and text.startswith(provenance):
        text = text[len(provenance):].lstrip("\n")
    text = re.sub(r"^(#+) ", lambda m: "#" + m.group(1) + " ", text, flags=re.M)
    text = re.sub(r"!\[([^\]]*)\]\(([^)/]+\.png)\)", rf"![\1]({rel}/\2)", text)
    return re.sub(r"(?<!!)\[([^\]]+)\]\((?!https?:|runs/)[^)]*\)", r"\1", text)


def _claims_section(r: dict, report_text: str) -> list[str]:
    """The effect sentences results.json supports (lmcal.reporting.claims), where the snapshot's REPORT.md does not
    hold them already (a report written before they were generated): its own effect sentences are then superseded."""
    claims = results_claims(r)
    if not claims or all(c.sentence in report_text for c in claims):
        return []
    return ["### What the numbers support", "",
            "Generated from this snapshot's results.json by `lmcal.reporting.claims` (each effect tested against "
            "twice its standard error, and against the fitted temperature). The report below predates these "
            "sentences; where its text states an effect, these supersede it.", "", *claims_markdown(claims)]


def run_section(folder: Path, rel: str) -> list[str]:
    """RESULTS.md's section of the snapshot (or finished reproduction) in `folder`; `rel`: its figures' folder."""
    r = json.loads((folder / "results.json").read_text())
    prov = r.get("provenance") or {}
    line = provenance_line(prov) if prov else "*Provenance not recorded by this run.*"
    return [f"## Reproduction, profile `{r.get('profile', folder.name)}`", "", line, "",
            *_claims_section(r, (folder / "REPORT.md").read_text()), _report_body(folder, rel, line), ""]


def render(docs: Path = DOCS) -> str:
    parts = ["# Measured results", "",
             "Generated by `make docs` (`python -m lmcal.docs`) from the files the runs wrote: the reproductions "
             "snapshotted under [runs/](runs) and the benchmark tables under [bench/](bench). Each section names the "
             "command, date and machine that made it. Do not edit by hand: rerun the run, then `make docs`.", ""]
    for folder in sorted(f for f in (docs / "runs").glob("*/") if not f.name.startswith(".")):
        try:
            parts += run_section(folder, f"runs/{folder.name}")
        except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
            raise LmcalError(f"{folder / 'results.json'} is not a reproduction's results ({type(e).__name__}: "
                             f"{str(e).strip(chr(39))[:200]}); RESULTS.md was not written. Snapshot that "
                             "reproduction again (make docs RUNS=...), or remove its folder.") from None
    for f in sorted((docs / "bench").glob("*.md")):
        parts += [re.sub(r"^## ", "## Benchmark: ", f.read_text(), count=1), ""]
    return "\n".join(parts).rstrip() + "\n"
