"""The plan check's text in lines a terminal shows whole (at most WIDTH characters): a table of the stages, one a line
with its estimate and where the schedule places it, then each stage's arithmetic as a wrapped paragraph."""

from __future__ import annotations

import textwrap

from lmcal.pipeline.timing import Job

WIDTH = 120
INDENT = "    "  # a detail paragraph's continuation lines


def wrap(text: str, width: int = WIDTH) -> list[str]:
    """One paragraph as lines of at most `width` characters, continuation lines indented; long tokens are kept
    whole only where they alone exceed the width (then broken)."""
    return textwrap.wrap(text, width=width, subsequent_indent=INDENT, break_on_hyphens=False) or [""]


def duration(seconds: float) -> str:
    """A stage's time for the table: seconds under 2 minutes, minutes under 2 hours, else hours."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.2f} h"


def clock(seconds: float) -> str:
    """h:mm of a point in the schedule."""
    minutes = round(seconds / 60)
    return f"{minutes // 60}:{minutes % 60:02d}"


def stage_table(jobs: list[Job], spans: dict[str, tuple[float, float]]) -> list[str]:
    """One line per stage: its name, its time alone on the GPU, its start and end in the schedule, what it is."""
    name_w = max([len(j.name) for j in jobs] + [5])
    head = f"{'stage':<{name_w}}  {'alone':>8}  {'start-end':>11}  what"
    rows = [f"{j.name:<{name_w}}  {duration(j.seconds):>8}  "
            f"{clock(spans[j.name][0]) + '-' + clock(spans[j.name][1]):>11}  {j.what}"
            for j in jobs]
    return [head] + [r[:WIDTH] for r in rows]


def details_section(lines: list[tuple[str, str]]) -> list[str]:
    """Each stage's arithmetic (its models, streams, steps, FLOPs, peak tensors), one wrapped paragraph a run."""
    out = ["Each stage's arithmetic:"]
    for name, text in lines:
        out += wrap(f"{name}: {text}")
    return out


def paragraph_of(text: str, start: str) -> str:
    """The paragraph of plan `text` that begins with `start` (its wrapped lines joined again): for reading a plan."""
    lines = text.splitlines()
    i = next(k for k, ln in enumerate(lines) if ln.startswith(start))
    j = next((k for k in range(i + 1, len(lines)) if not lines[k].startswith(INDENT)), len(lines))
    return " ".join([lines[i]] + [ln[len(INDENT):] for ln in lines[i + 1:j]])
