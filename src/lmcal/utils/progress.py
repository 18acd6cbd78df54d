"""One progress style for the long loops of the analysis stages: a tqdm bar when stderr is a terminal; otherwise (a
log file, such as a reproduction's logs/<stage>.log) a plain log line now and then, with no carriage returns, each
with the time left at the rate measured so far.
"""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("lmcal")


def progress_bar(iterable=None, total: int | None = None, desc: str = "", unit: str = "it", disable: bool = False,
             leave: bool = True):
    """A progress bar over `iterable` (or updated by hand: `.update(n)`, `.close()`) with `total` steps."""
    if not disable and sys.stderr.isatty():
        from tqdm.auto import tqdm

        return tqdm(iterable, total=total, desc=desc, unit=unit, leave=leave)
    return LineProgress(iterable, total, desc, unit, quiet=disable)


def clock(seconds: float) -> str:
    """'1h02m', '4m05s', '12s'."""
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class LineProgress:
    """Progress as log lines: one whenever another tenth is done and 5 s have passed since the last, one whenever a
    minute has passed without one (no silence longer than that while it advances), and one at the end when the loop
    took over 5 s. Each gives the time left at the rate measured since the start ("about 2m10s left")."""

    def __init__(self, iterable=None, total: int | None = None, desc: str = "", unit: str = "it", quiet: bool = False):
        self.iterable, self.desc, self.unit, self.quiet = iterable, desc, unit, quiet
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)
        self.n, self.t0 = 0, time.perf_counter()
        self.last_t, self.last_n, self.closed = self.t0, 0, False

    def __iter__(self):
        for x in self.iterable:
            yield x
            self.update()
        self.close()

    def update(self, n: int = 1) -> None:
        self.n += n
        now = time.perf_counter()
        tenth = self.total and (self.n - self.last_n) * 10 >= self.total
        if (tenth and now - self.last_t >= 5.0) or now - self.last_t >= 60.0:
            self._line(now)

    def close(self) -> None:
        now = time.perf_counter()
        if not self.closed and self.n > self.last_n and now - self.t0 >= 5.0:
            self._line(now)
        self.closed = True

    def _line(self, now: float) -> None:
        recent = (self.n - self.last_n) / max(now - self.last_t, 1e-9)  # the rate since the last line
        self.last_t, self.last_n = now, self.n
        if self.quiet:
            return
        rate = self.n / max(now - self.t0, 1e-9)
        if self.total and self.n > self.total:  # more steps than planned (a fit that needed another pass)
            log.info(f"{self.desc}: {self.n:,} {self.unit}, past the {self.total:,} planned ({now - self.t0:.0f} s, "
                     f"{rate:,.1f} {self.unit}/s)")
            return
        of = f"/{self.total:,}" if self.total else ""
        pct = f" {100 * self.n / self.total:.0f}%" if self.total else ""
        left = f", {time_left(self.total - self.n, rate, recent)}" if self.total and self.n < self.total else ""
        log.info(f"{self.desc}:{pct} ({self.n:,}{of} {self.unit}, {now - self.t0:.0f} s, {rate:,.1f} {self.unit}/s"
                 f"{left})")


MARGIN = 1.25  # the time left as a range: a quarter either side of the two rates


def time_left(steps: float, rate: float, recent: float) -> str:
    """'about 1m10s-1m50s left': the steps left from the faster of the rate since the start and the recent rate, a
    MARGIN faster still, to the slower one, a MARGIN slower (steps that vary, or a machine that got busier, end
    within it)."""
    fast, slow = max(rate, recent, 1e-9), max(min(rate, recent), 1e-9)
    low, high = steps / (MARGIN * fast), MARGIN * steps / slow
    return f"about {clock(low)}-{clock(high)} left" if clock(low) != clock(high) else f"about {clock(low)} left"
