"""docs/RESULTS.md, regenerated from files that runs wrote; no number in it is typed by hand. Provenance (command,
date, machine, commit), saved benchmark tables, snapshots of reproductions, and the rendering.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from lmcal.errors import LmcalError
from lmcal.reporting.claim import Z, shown
from lmcal.reporting.claims import within
from lmcal.reporting.claims_table import claim_rows, claims_table
from lmcal.reporting.provenance import ROOT, machine, provenance, provenance_line, versions  # noqa: F401
from lmcal.utils import records
from lmcal.utils.io import file_name, inside, temp_path, write_text_atomic
from lmcal.utils.records import POSITIVE, Each, Maybe, Of

DOCS = ROOT / "docs"

# What RESULTS.md and REPORT.md read from a results.json, of its type (lmcal.utils.records): a reproduction's (make
# reproduce's report stage writes every one of these keys) or a scale sweep's (python -m lmcal.report).
NUM = Maybe(float)
REPRODUCTION = {"profile": str, "dataset": str, "base": dict, "calibration": dict, "decoders": Of(dict),
                "entropy_rate": {"test_ppl": NUM, "tail_nats?": NUM, "tail_stderr_nats?": NUM},
                "table1": Of(dict, 1), "markov": dict, "stages": Each(dict), "provenance?": Maybe(dict),
                "memory": Of({"tau": int, "mi_upper_bound_nats": NUM, "mi_stderr_nats?": NUM, "model?": str,
                              "limited?": str})}
SWEEP = {"profile": str, "groups": Of({"label": str, "fits": Each(dict), "trends?": dict}, 1), "stages?": Each(dict),
         "runs": Of({"params": NUM, "train_tokens": NUM}, 1), "provenance?": Maybe(dict)}
BENCH = {"label": str, "tail_nats": float, "test_ppl": POSITIVE, "tail_stderr_nats?": NUM,
         "tail_alpha_stderr_nats?": NUM, "run_to_run_stderr_nats?": NUM}
FIGURE = re.compile(r"!\[[^\]]*\]\(([^)/]+\.png)\)")  # a figure REPORT.md shows from its own folder


def read_results(path: Path, fix: str) -> dict:
    """The results.json at `path`, whole: a reproduction's or a scale sweep's (lmcal.utils.records's one check);
    one paragraph naming the file, the key and `fix` otherwise."""
    what = "a reproduction's results"
    r = records.read(path, {"profile": str}, what, fix)
    return records.check(r, SWEEP if "groups" in r else REPRODUCTION, path, what, fix)


def read_report(folder: Path, fix: str) -> str:
    """folder/REPORT.md, UTF-8 text of at most lmcal.utils.records.MAX_BYTES; one paragraph otherwise."""
    path = folder / "REPORT.md"
    with open(path, "rb") as f:
        data = f.read(records.MAX_BYTES + 1)
    try:
        if len(data) > records.MAX_BYTES:
            raise ValueError(f"it is over {records.MAX_BYTES / 2**20:g} MiB")
        return data.decode("utf-8")
    except ValueError as e:  # (UnicodeDecodeError too)
        raise LmcalError(f"{path} is not a reproduction's report ({' '.join(str(e).split())[:120]}). {fix}") from None


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


def save_bench(path: str | Path | None, title: str, body: str, command: str | None = None,
               result: str | None = None) -> None:
    """A benchmark's Markdown (its tables) with a heading, its provenance and, given one, its result in a sentence
    (the line RESULTS.md lists it by), written atomically to `path` (nothing when path is None: the bench only
    printed)."""
    if path is None:
        return
    head = f"## {title}\n\n{provenance_line(provenance(command))}\n\n" + (f"*Result:* {result}\n\n" if result else "")
    write_text_atomic(path, f"{head}{body.strip()}\n")


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


SNAPSHOT_FIX = ("Rerun its report stage (make reproduce in that folder) before taking a snapshot; nothing was copied "
                "or changed.")


def check_snapshot(run: Path, fix: str = SNAPSHOT_FIX) -> str:
    """The profile of the finished reproduction in `run`, once its results.json and REPORT.md are known to render
    (every key RESULTS.md reads there, of its type; every figure REPORT.md shows beside it); LmcalError otherwise,
    naming the file and what is wrong."""
    if not (run / "results.json").is_file() or not (run / "REPORT.md").is_file():
        raise LmcalError(f"{run} holds no finished reproduction (results.json and REPORT.md are written by its last "
                         f"stage): run `make reproduce` to the end first, or pass the folder it wrote to.")
    r = read_results(run / "results.json", fix)
    missing = [f for f in dict.fromkeys(FIGURE.findall(read_report(run, fix))) if not (run / f).is_file()]
    if missing:
        raise LmcalError(f"{run / 'REPORT.md'} shows figures its folder lacks ({', '.join(missing[:4])}): a snapshot "
                         f"of it would have broken images. {fix}")
    try:
        profile = r["profile"]
        # what provenance_line reads must be text; the report stage adds numbers of its own (matmul_gflop_per_s,
        # precision) that nothing here reads
        prov = r.get("provenance") or {}
        if not isinstance(prov, dict):
            raise TypeError(f"its provenance is a {type(prov).__name__}, not a mapping")
        if prov and not all(isinstance(prov.get(k), str) for k in ("command", "date", "machine")) or not isinstance(
                prov.get("commit"), (str, type(None))):
            raise TypeError("its provenance's command, date, machine and commit are not texts")
        run_section(run, "runs/" + run.name)  # everything else RESULTS.md reads, read as it will be
        paper_rows(r)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
        raise LmcalError(f"{run / 'results.json'} is not a reproduction's results ({type(e).__name__}: "
                         f"{str(e).strip(chr(39))[:200]}). {fix}") from None
    return profile


def check_docs(docs: Path, runs: list[Path], rerendered: list[Path]) -> None:
    """Everything `python -m lmcal.docs` will read, checked before it changes anything in `docs`: each reproduction
    to snapshot, each snapshot to write REPORT.md for again, and each snapshot already in docs/runs/ that the new ones
    do not replace (RESULTS.md renders them all), and the benchmark summaries."""
    replaced = {file_name(check_snapshot(run), run / "results.json", "profile") for run in runs}
    fix = "Nothing was written. Snapshot that reproduction again (make docs RUNS=...), or remove that folder."
    for folder in rerendered:
        read_results(Path(folder) / "results.json", fix)
    for folder in sorted(f for f in (docs / "runs").glob("*/") if not f.name.startswith(".")):
        if folder.name not in replaced:
            check_snapshot(folder, fix)
    for f in sorted((docs / "bench").glob("*.json")):
        records.read(f, BENCH, "a benchmark's summary", "Write it again (bench/<name>.py --out ...), or remove it; "
                     "nothing was written.")


def rerender(folder: str | Path) -> Path:
    """Writes folder/REPORT.md again from its results.json with this code (a snapshot keeps no stage files, so the
    sections that need them are left out; a reproduction's folder gives them all). The profile's settings
    (conf/reproduce/<profile>.yaml) name its stages and how its τ-models were trained."""
    folder = Path(folder)
    r = read_results(folder / "results.json", "Nothing was written. Snapshot that reproduction again.")
    if "groups" in r:  # the scale sweep
        from lmcal.reporting.scale_text import report_markdown as scale_markdown

        key = ("corpus", "tail_exponent", "family", "unit")
        runs = sorted(r["runs"], key=lambda x: (x["params"] or 0, x["train_tokens"] or 0))  # as scale_report orders
        groups = [(g, [x for x in runs if all(x.get(k) == g.get(k) for k in key)]) for g in r["groups"]]
        text = scale_markdown(r, groups, "scale.png")
    else:
        from omegaconf import OmegaConf

        from lmcal.reporting.report_md import report_markdown

        conf = ROOT / "conf" / "reproduce" / f"{file_name(r['profile'], folder / 'results.json', 'profile')}.yaml"
        cfg = OmegaConf.load(conf) if conf.is_file() else OmegaConf.create({"stages": []})
        cfg.profile = r["profile"]
        text = report_markdown(cfg, r, folder)
    write_text_atomic(folder / "REPORT.md", text)
    return folder / "REPORT.md"


def _report_body(folder: Path, rel: str, provenance: str = "") -> str:
    """A snapshot's REPORT.md as a section of RESULTS.md: without its title and its provenance line where that is the
    section's own (the section's heading and line stand for them), headings one level down, figures pointing into the
    snapshot, links into the run's folders (not copied) turned into plain text."""
    text = re.sub(r"\A# [^\n]*\n+", "", read_report(folder, "Nothing was written."))
    if provenance and text.startswith(provenance):
        text = text[len(provenance):].lstrip("\n")
    text = re.sub(r"^(#+) ", lambda m: "#" + m.group(1) + " ", text, flags=re.M)
    text = re.sub(r"!\[([^\]]*)\]\(([^)/]+\.png)\)", rf"![\1]({rel}/\2)", text)
    return re.sub(r"(?<!!)\[([^\]]+)\]\((?!https?:|runs/)[^)]*\)", r"\1", text)


def run_section(folder: Path, rel: str) -> list[str]:
    """RESULTS.md's section of the snapshot (or finished reproduction) in `folder`; `rel`: its figures' folder."""
    r = read_results(folder / "results.json", "RESULTS.md was not written. Snapshot that reproduction again (make "
                     "docs RUNS=...), or remove its folder.")
    prov = r.get("provenance") or {}
    line = provenance_line(prov) if prov else "*Provenance not recorded by this run.*"
    return [f"## Reproduction, profile `{r.get('profile', folder.name)}`", "", line, "",
            _report_body(folder, rel, line), ""]


def paper_rows(r: dict, rel: str = "") -> list[tuple[str, ...]]:
    """One reproduction's rows of RESULTS.md's claims table (lmcal.reporting.claims_table), its claims prefixed with
    its profile."""
    where = f"`{r.get('profile', '?')}`: "
    return [(where + row[0], *row[1:]) for row in claim_rows(r, rel)]


def bench_rows(docs: Path) -> list[tuple[str, ...]]:
    """The claims table's rows of the benchmarks' summaries (bench/<page>.json: a study's level, tail_nats, against its
    model's test_ppl), each tested as lmcal.reporting.claims.within tests a reproduction's goal row, at a standard
    error that counts every error the summary records: tail_stderr_nats (the generations'), tail_alpha_stderr_nats
    (α*'s, carried into the level) and run_to_run_stderr_nats (the spread between training seeds)."""
    rows = []
    for f in sorted((docs / "bench").glob("*.json")):
        s = records.read(f, BENCH, "a benchmark's summary", "Write it again (bench/<name>.py --out ...), or remove "
                         "it; nothing was written.")
        errors = [s.get(k) for k in ("tail_stderr_nats", "tail_alpha_stderr_nats", "run_to_run_stderr_nats")]
        se = math.sqrt(sum(x * x for x in errors if isinstance(x, (int, float))))
        level = math.exp(s["tail_nats"])
        rows.append((f"bench: [{s['label']}](bench/{f.stem}.md): last tenth within 10% of the test perplexity "
                     f"{s['test_ppl']:.1f}", "equal (Algorithm 1)", f"{level:.1f}", f"{level * se:.1f}",
                     shown(within("", s["tail_nats"], se, s["test_ppl"]).verdict), "–"))
    return rows


def bench_line(page: Path) -> str:
    """A benchmark page as one line of RESULTS.md: its title, its result, the machine's matmul rate as the page
    records it, and a link to it."""
    text = page.read_text()
    title = text.splitlines()[0].removeprefix("## ")
    result = re.search(r"^\*Result:\* (.+)$", text, re.M)
    rate = re.search(r"matmul[^|\n]*?(\d[\d,.]*) GFLOP/s", text)
    return (f"- [{title}](bench/{page.name}): {result.group(1) if result else 'see the page.'}"
            + (f" *(matmul {rate.group(1)} GFLOP/s)*" if rate else ""))


def render(docs: Path = DOCS) -> str:
    runs = sorted(f for f in (docs / "runs").glob("*/") if not f.name.startswith("."))
    parts = ["# Measured results", "",
             "Generated by `make docs` (`python -m lmcal.docs`) from the files the runs wrote: the reproductions "
             "snapshotted under [runs/](runs) and the benchmark pages under [bench/](bench). Each section names the "
             "command, date and machine that made it. Do not edit by hand: rerun the run, then `make docs`.", "",
             "## The paper against lmcal", "",
             f"Each claim's verdict at {Z:g} standard errors, as lmcal.reporting.claims tests it. A scale exponent "
             "is tested by its 95% interval against the reference's: a t-interval over every run, or an earlier "
             "report's bootstrap interval. Below 2 degrees of freedom, or with a gap ≤ 0, it is not fitted and "
             "undecided. Nats are changes of the mean entropy over the last tenth of the horizon; the paper's "
             "calibration figure is its -20 points from 93.1.", ""]
    sections, rows = [], []
    for folder in runs:
        try:
            rows += paper_rows(read_results(folder / "results.json", "RESULTS.md was not written. Snapshot that "
                                            "reproduction again (make docs RUNS=...), or remove its folder."),
                               f"runs/{folder.name}/")
            sections += run_section(folder, f"runs/{folder.name}")
        except (ValueError, TypeError, KeyError, AttributeError, IndexError) as e:
            raise LmcalError(f"{folder / 'results.json'} is not a reproduction's results ({type(e).__name__}: "
                             f"{str(e).strip(chr(39))[:200]}); RESULTS.md was not written. Snapshot that "
                             "reproduction again (make docs RUNS=...), or remove its folder.") from None
    pages = sorted((docs / "bench").glob("*.md"))
    parts += [*claims_table([*rows, *bench_rows(docs)]), "", *sections]
    if pages:
        parts += ["## Benchmarks", "", "One line a page; each page holds its tables, command, date and machine.", "",
                  *map(bench_line, pages)]
    return "\n".join(parts).rstrip() + "\n"
