"""The training runs of any set of folders as one table: each run's overrides (or folder), validation and test
perplexity, status and folder. A Hydra multirun of `python -m lmcal.train -m` ends with it (`SweepSummary`, the
callback conf/train.yaml names: it also makes the multirun exit 1 when a job failed), and `python -m lmcal.report`
prints it for the folders it is given.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from hydra.experimental.callback import Callback

from lmcal.utils.io import write_text_atomic

log = logging.getLogger("lmcal")


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _overrides(run: Path) -> str:
    """The job's command-line overrides (Hydra's .hydra/overrides.yaml), else the folder's name."""
    import yaml

    try:
        items = yaml.safe_load((run / ".hydra" / "overrides.yaml").read_text())
    except (OSError, yaml.YAMLError):
        items = None
    return " ".join(map(str, items)) if isinstance(items, list) else run.name


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
    """One run: overrides, val/test perplexity, status (ok, failed: the first line of why, or no result) and folder."""
    metrics, failed = _read(run / "metrics.json"), _read(run / "failed.json")
    status = ("failed: " + str(failed.get("error", "")).splitlines()[0][:160] if failed is not None
              else "ok" if metrics is not None else "no result (still running, or killed)")
    m = metrics or {}
    return {"overrides": _overrides(run), "dataset": m.get("dataset"), "memory_tau": m.get("memory_tau"),
            "val_ppl": m.get("val_ppl"), "test_ppl": m.get("test_ppl"), "status": status, "folder": str(run)}


def runs_markdown(rows: list[dict]) -> str:
    def ppl(x):
        return f"{x:.2f}" if isinstance(x, (int, float)) else "-"

    lines = ["| run | val ppl | test ppl | status | folder |", "|---|---|---|---|---|"]
    lines += [f"| {r['overrides']} | {ppl(r['val_ppl'])} | {ppl(r['test_ppl'])} | {r['status']} | {r['folder']} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def runs_report(dirs: list[str | Path], out: str | Path | None = None, jobs: bool = False) -> list[dict]:
    """The table of the training runs under `dirs` (`find_runs`), printed, and written to `out`/runs.{md,json} when
    given."""
    rows = [run_row(r) for r in find_runs(dirs, jobs)]
    if rows:
        print(runs_markdown(rows), end="", flush=True)
        if out is not None:
            write_text_atomic(Path(out) / "runs.md", runs_markdown(rows))
            write_text_atomic(Path(out) / "runs.json", json.dumps(rows, indent=1) + "\n")
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
