"""The training runs of any set of folders as one table: each run's own overrides (the user's: not where it logs or
writes), dataset, tau, validation and test perplexity, wall time, status and folder, sorted with numbers as numbers.
A Hydra multirun of `python -m lmcal.train -m` ends with it (`SweepSummary`, the callback conf/train.yaml names: it
also makes the multirun exit 1 when a job failed), and `python -m lmcal.report` prints it for the folders it is given.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from hydra.experimental.callback import Callback

from lmcal.utils import records
from lmcal.utils.io import write_text_atomic
from lmcal.utils.progress import clock
from lmcal.utils.records import Maybe

log = logging.getLogger("lmcal")

# what the table reads from a run's files (lmcal.utils.records: another type, NaN or Infinity is refused naming the
# key; null where a perplexity was not finite)
METRICS = {"dataset?": Maybe(str), "memory_tau?": Maybe(int), "val_ppl?": Maybe(float), "test_ppl?": Maybe(float),
           "wall_seconds?": Maybe(records.Range(0))}
FAILED = {"error?": object}
MEMORY = {"mi_upper_bound_nats?": Maybe(float), "mi_stderr_nats?": Maybe(float)}  # a run's memory stage (memory.json)


def _read(path: Path, spec: dict) -> dict | None:
    """The record in `path`, whole, or None where there is none; one paragraph naming the file and key otherwise."""
    if not path.is_file():
        return None
    return records.read(path, spec, "a training run's record", "Delete it or rerun that run; nothing was written.")


# overrides that say where a run logs and writes, not what it trains: the pipeline's own (make reproduce passes
# them), and the keys conf/train.yaml keeps out of job folder names
NOT_SHOWN = ("logger", "hydra", "task_name", "paths", "init_ckpt", "ckpt_path", "data.root", "data.download",
             "memory.base_ckpt", "memory.base_runs", "trainer.enable_progress_bar", "analysis.stages")


def _yaml(path: Path):
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def _overrides(run: Path) -> list[str]:
    """The job's command-line overrides (Hydra's .hydra/overrides.yaml), else the folder's name."""
    items = _yaml(run / ".hydra" / "overrides.yaml")
    return [str(x) for x in items] if isinstance(items, list) else [run.name]


def users_overrides(overrides: list[str]) -> list[str]:
    """The overrides a user chose: without where the run logs and writes (NOT_SHOWN)."""
    key = lambda o: o.lstrip("+~").split("=")[0]  # noqa: E731
    return [o for o in overrides if not any(key(o) == k or key(o).startswith((k + ".", k + "/")) for k in NOT_SHOWN)]


def find_runs(dirs: list[str | Path], jobs: bool = False) -> list[Path]:
    """Training run folders under `dirs`: those holding metrics.json or failed.json; with `jobs`, also every Hydra
    job folder (one holding .hydra/), so that a job that left neither shows as 'no result'."""
    found: set[Path] = set()
    for d in map(Path, dirs):
        found.update(p.parent for name in ("metrics.json", "failed.json") for p in d.rglob(name))
        if jobs:
            found.update(p.parent.parent for p in d.rglob(".hydra/overrides.yaml"))
    return sorted(found)


def run_row(run: Path) -> dict:
    """One run: overrides (all, and the user's), dataset, tau, val/test perplexity, wall time, status (ok, failed:
    why, or no result) and folder. Dataset and tau from metrics.json, else from the job's composed config."""
    metrics, failed = _read(run / "metrics.json", METRICS), _read(run / "failed.json", FAILED)
    status = ("failed: " + " ".join(str(failed.get("error", "")).split()) if failed is not None
              else "ok" if metrics is not None else "no result (still running, or killed)")
    m, cfg = metrics or {}, _yaml(run / ".hydra" / "config.yaml") or {}
    data, model = (cfg.get(k) if isinstance(cfg.get(k), dict) else {} for k in ("data", "model"))
    overrides = _overrides(run)
    return {"overrides": overrides, "shown": users_overrides(overrides), "dataset": m.get("dataset", data.get("name")),
            "memory_tau": m.get("memory_tau", model.get("memory_tau")), "val_ppl": m.get("val_ppl"),
            "test_ppl": m.get("test_ppl"), "wall_seconds": m.get("wall_seconds"), "status": status,
            "folder": str(run), **memory_bound(run)}


def memory_bound(run: Path) -> dict:
    """The memory bound a run's memory stage wrote (memory.json): {mi_upper_bound_nats, mi_stderr_nats}, or {}."""
    mem = _read(run / "memory.json", MEMORY)
    if not mem or mem.get("mi_upper_bound_nats") is None:
        return {}
    return {"mi_upper_bound_nats": mem["mi_upper_bound_nats"], "mi_stderr_nats": mem.get("mi_stderr_nats")}


def _natural(text: str) -> list:
    """A sort key reading the numbers in `text` as numbers (tau=5 before tau=10)."""
    parts = re.split(r"(\d+(?:\.\d+)?)", text)
    return [(0, float(t), "") if t.replace(".", "", 1).isdigit() else (1, 0.0, t) for t in parts if t]


def sort_rows(rows: list[dict]) -> list[dict]:
    """By dataset, then tau (a number; full models first), then the user's overrides read with numbers as numbers."""
    return sorted(rows, key=lambda r: (str(r.get("dataset") or ""), r.get("memory_tau") or 0,
                                       _natural(" ".join(r.get("shown", r["overrides"]))), r["folder"]))


def runs_markdown(rows: list[dict]) -> str:
    """The table; with several runs, each shows the user's overrides that are its own, those all share go above it."""
    def ppl(x):
        return f"{x:.2f}" if isinstance(x, (int, float)) else "-"

    def cell(x) -> str:
        return str(x).replace("|", "\\|")

    shown = [r.get("shown", r["overrides"]) for r in rows]
    common = set.intersection(*map(set, shown)) if len(rows) > 1 else set()
    lines = [f"All runs: {' '.join(o for o in shown[0] if o in common)}", ""] if common else []
    bound = any("mi_upper_bound_nats" in r for r in rows)  # a sweep whose jobs ran the memory stage: its result

    def mi(r) -> str:
        if "mi_upper_bound_nats" not in r:
            return "- | - | "
        se = r.get("mi_stderr_nats")
        return f"{r['mi_upper_bound_nats']:.4f} | {'-' if se is None else f'{se:.4f}'} | "

    lines += ["| run | dataset | τ | val ppl | test ppl | " + ("memory bound I_τ (nats) | ± | " if bound else "")
              + "wall time | status | folder |", "|---|---|--:|--:|--:|" + ("--:|--:|" if bound else "")
              + "--:|---|---|"]
    lines += [f"| {cell(' '.join(o for o in mine if o not in common) or '-')} | {cell(r.get('dataset') or '-')} | "
              f"{'-' if r.get('memory_tau') is None else r['memory_tau']} | {ppl(r['val_ppl'])} | "
              f"{ppl(r['test_ppl'])} | {mi(r) if bound else ''}"
              f"{clock(r['wall_seconds']) if r.get('wall_seconds') is not None else '-'} | {cell(r['status'])} | "
              f"{cell(r['folder'])} |" for r, mine in zip(rows, shown, strict=True)]
    return "\n".join(lines) + "\n"


def collect_runs(dirs: list[str | Path], jobs: bool = False) -> list[dict]:
    """The rows of the training runs under `dirs` (`find_runs`), sorted; every record read and checked."""
    return sort_rows([run_row(r) for r in find_runs(dirs, jobs)])


def runs_report(dirs: list[str | Path], out: str | Path | None = None, jobs: bool = False,
                rows: list[dict] | None = None, name: str = "runs") -> list[dict]:
    """The table of the training runs under `dirs` (`collect_runs`; `rows`: what it returned, read before anything was
    written), printed, and written to `out`/<name>.{md,json} when given (a sweep's own: runs; lmcal.report's:
    report_runs, so that it never replaces a sweep's table)."""
    rows = collect_runs(dirs, jobs) if rows is None else rows
    if rows:
        print(runs_markdown(rows), end="", flush=True)
        if out is not None:
            write_text_atomic(Path(out) / f"{name}.md", runs_markdown(rows))
            write_text_atomic(Path(out) / f"{name}.json", json.dumps(rows, indent=1) + "\n")
    return rows


class SweepSummary(Callback):
    """Hydra callback (hydra.callbacks in conf/train.yaml): when a multirun ends, one table of its jobs in the
    sweep folder (runs.md, runs.json), and exit status 1 when any job failed or left no result."""

    def on_multirun_end(self, config, **kwargs) -> None:
        sweep = Path(config.hydra.sweep.dir)
        rows = runs_report([sweep], sweep, jobs=True)
        bad = [r for r in rows if r["status"] != "ok"]
        print(f"{len(rows) - len(bad)} of {len(rows)} jobs ok; the table is in {sweep / 'runs.md'}", flush=True)
        if bad:
            print(f"lmcal: error: {len(bad)} of {len(rows)} jobs failed (see their failed.json and logs).", flush=True)
            raise SystemExit(1)
