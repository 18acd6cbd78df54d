"""The console's times while `make reproduce` runs: each running stage's elapsed time, the time its current step has
left (its log's last progress line: a rate measured in the stage itself), and the time the stage and the pipeline
have left, from stage times that are scaled to this machine as stages finish: a reference run's (docs/runs/<profile>)
or else the plan check's estimates (lmcal.pipeline.check), scaled by the finished stages (`scaled`).
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from lmcal.utils.progress import clock

# the progress lines of lmcal.utils.progress.LineProgress and lmcal.training.callbacks.TrainingProgress
_WHEN = r"^\[(?P<when>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)[^\]]*\]\[[^\]]*\]\[\w+\]"  # Hydra's log line head
_STEP = re.compile(_WHEN + r" - (?P<what>[^\n:]+): (?P<pct>\d+)% \((?:[^\n]*?about (?:\w+-)?(?P<left>\w+) left)?",
                   re.M)  # (a range "about 1m10s-1m50s left": its upper end; none on a step's last line, at 100%)
_TRAINING = re.compile(_WHEN + r" - training: epoch (?P<epoch>\S+), [^\n]*?about (?P<in_epoch>\w+) left in the "
                       r"epoch(?:, about (?P<left>\w+) left in all)?", re.M)


def seconds(text: str) -> float:
    """'1h02m', '4m05s' or '12s' (lmcal.utils.progress.clock) in seconds."""
    parts = dict((u, int(v)) for v, u in re.findall(r"(\d+)([hms])", text))
    return 3600 * parts.get("h", 0) + 60 * parts.get("m", 0) + parts.get("s", 0)


def step_eta(log_path: Path, tail_bytes: int = 8192, now: float | None = None) -> str | None:
    """The last progress line of a stage's log as "scoring 40%, about 1m20s left" (a training's: "epoch 3/300, about
    2h10m left"), the time left counted down by the line's age (its time stamp), or None when it has none yet."""
    found = step_progress(log_path, tail_bytes, now)
    return found[0] if found else None


def step_progress(log_path: Path, tail_bytes: int = 8192, now: float | None = None) -> tuple[str, float] | None:
    """step_eta's text and the seconds it says are left (0 when finishing), or None."""
    try:
        with open(log_path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - tail_bytes))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    found = [(m.start(), m) for rx in (_STEP, _TRAINING) for m in rx.finditer(text)]
    if not found:
        return None
    m = max(found, key=lambda e: e[0])[1]
    age = max(0.0, (time.time() if now is None else now) - time.mktime(time.strptime(m["when"], "%Y-%m-%d %H:%M:%S")))
    training = "epoch" in m.groupdict()
    if not training and not m["left"]:  # a step's last line (100%), or one before its rate is known
        done = m["pct"] == "100"
        return f"{m['what']} " + (f"done {clock(age)} ago" if done else f"{m['pct']}%"), 0.0
    left = seconds(m["left"] or m["in_epoch"])  # (a step line here has its own; a training's may be the epoch's)
    text = f"about {clock(left - age)} left" if left > age else "finishing"
    if training:
        in_all = bool(m["left"]) or text == "finishing"
        return f"epoch {m['epoch']}, {text}" + ("" if in_all else " in the epoch"), max(left - age, 0.0)
    return f"{m['what']} {m['pct']}%, {text}", max(left - age, 0.0)


def scaled(basis: dict[str, float], finished: dict[str, float], reference: bool) -> dict[str, float]:
    """Each stage's expected seconds on this machine: b x basis[name] with b the finished stages' ratio (finished:
    {name: seconds}, this run's), or a + b x basis[name] fitted by least squares once three or more have finished,
    a (the fixed cost of a stage) between 0 and the shortest finished stage's seconds: two points fit a line exactly
    and say nothing of it, and an intercept from two long stages swamps every short one. With none
    finished, the basis itself where it is a reference run's times (`reference`), else nothing ({}: an estimate for
    another device says nothing here until a stage has been timed)."""
    pts = [(basis[n], s) for n, s in finished.items() if n in basis]
    if not pts:
        return dict(basis) if reference else {}
    a, b = 0.0, sum(y for _, y in pts) / max(sum(x for x, _ in pts), 1e-9)
    if len(pts) >= 3:
        mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
        var = sum((x - mx) ** 2 for x, _ in pts)
        if var > 0:
            slope = sum((x - mx) * (y - my) for x, y in pts) / var
            if slope > 0 and 0 <= my - slope * mx <= min(y for _, y in pts):
                a, b = my - slope * mx, slope
    return {n: a + b * x for n, x in basis.items()}


def floored(expected: dict[str, float], elapsed: dict[str, float], step_left: dict[str, float]) -> dict[str, float]:
    """The expected seconds with each running stage's (elapsed: {name: seconds so far}) raised to at least its elapsed
    time plus its current step's own measured time left (step_left): a stage ends no sooner than the step it is in,
    whatever the reference run's times say of this machine."""
    out = dict(expected)
    for n, left in step_left.items():
        if n in out:
            out[n] = max(out[n], elapsed[n] + left)
    return out


def stage_line(name: str, number: int, total: int, elapsed: float, expected: float | None, step: str | None) -> str:
    """'[3/22] calibration: 4m10s, about 2m05s left (scoring 40%, about 1m20s left)': the stage's number in the order
    the stages started, its elapsed time, its expected time left and its current step's."""
    line = f"[{number}/{total}] {name}: {clock(elapsed)}"
    if expected is not None:
        line += f", about {clock(expected - elapsed)} left" if expected > elapsed else ", past its expected time"
    return line + (f" ({step})" if step else "")


def plan_left(expected: dict[str, float], waiting: list[str], running: dict[str, float], jobs: int) -> float | None:
    """Seconds the pipeline has left: the stages waiting and what the running ones (name: elapsed) have left, spread
    over `jobs` at once but never less than the longest running stage's; None without an expectation for each."""
    if not expected or any(n not in expected for n in [*waiting, *running]):
        return None
    left = {n: max(expected[n] - t, 0.0) for n, t in running.items()}
    return max(max(left.values(), default=0.0), (sum(expected[n] for n in waiting) + sum(left.values())) / jobs)
