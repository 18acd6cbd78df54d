"""Figures (matplotlib, Agg backend): entropy of generated words against t (the paper's Figures 2 and 3) and the
memory bound against tau (Figure 4)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.lines  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402

from lmcal.utils.io import atomic_path
from lmcal.utils.numbers import format_params  # noqa: E402
from lmcal.utils.profiling import timed  # noqa: E402


@timed("io")
def entropy_curve_figure(curves: dict[str, tuple[np.ndarray, np.ndarray]], path: str | Path,
                         reference_nats: dict[str, float] | None = None, title: str = "",
                         legend_outside: bool = False, difference: dict | None = None,
                         tail_differences: dict[str, tuple[float, float]] | None = None,
                         quantity: str = "entropy of the t-th word's distribution") -> Path:
    """One line per curve (label -> (mean, stderr), nats, t = 1..horizon) with a ±1.96 se band,
    and dotted horizontal reference lines (e.g. the model's test cross-entropy). Written atomically.
    legend_outside: the legend to the right of the axes (for many curves); quantity: what the curves are (the
    y-axis's label).

    A second panel shows paired differences from the plain model (same prefixes and seeds), when given:
    difference: {"label", "mean" [horizon], "stderr" [horizon], "tail", "tail_stderr", "tail_steps"}, the difference
    at every t with its band and its mean over the last tail_steps words; tail_differences: label -> (the mean
    difference over the last tenth of the horizon, its se), one error bar per label."""
    path = Path(path)
    second = difference is not None or bool(tail_differences)
    width = 8.0 if legend_outside else 6.4
    height = (7.0 if second else 4.0) + (0.18 * (len(curves) + len(reference_nats or {})) if legend_outside else 0)
    fig, axes = plt.subplots(2 if second else 1, 1, figsize=(width, height), dpi=120, squeeze=False,
                             height_ratios=[1.4 + (0.1 * len(curves) if legend_outside else 0), 1] if second
                             else None, sharex=difference is not None)
    ax = axes[0, 0]
    horizon = max((len(m) for m, _ in curves.values()), default=1)
    covers = covered_curves({k: m for k, (m, _) in curves.items()})
    for label, (mean, se) in curves.items():
        mean, se = np.asarray(mean, dtype=float), np.asarray(se, dtype=float)  # [T] each (a record's lists too)
        t = np.arange(1, len(mean) + 1)
        hides = covers.get(label)  # drawn over an earlier, equal curve: dashed, and the legend says which
        (line,) = ax.plot(t, mean, label=f"{label} (the same curve as {hides}, drawn over it)" if hides else label,
                          lw=1.4, ls="--" if hides else "-")
        ax.fill_between(t, mean - 1.96 * se, mean + 1.96 * se, color=line.get_color(), alpha=0.2, lw=0)
    lo, hi = curve_range(curves)
    for i, (label, value) in enumerate((reference_nats or {}).items()):  # dotted black first, then other dashes
        style = {"ls": (":", "--", "-.", (0, (1, 4)))[i % 4], "color": ("k", "0.35", "0.55", "k")[i % 4]}
        if lo <= value <= hi:
            ax.axhline(value, lw=1.2, label=label, **style)
        else:  # far off the curves' range: a mark at the edge it lies beyond, its value in the legend
            up = value > hi
            ax.plot([], [], marker="^" if up else "v", ms=7, color=style["color"], ls="",
                    label=f"{label}: {value:.2f} nats, {'above' if up else 'below'} the axis")
            ax.annotate("", xy=(0.03 + 0.03 * i, 1.0 if up else 0.0), xycoords="axes fraction",
                        xytext=(0.03 + 0.03 * i, 0.93 if up else 0.07),
                        arrowprops={"arrowstyle": "-|>", "color": style["color"], "lw": 1.2})
    ax.set_ylim(lo, hi)  # the curves the figure is about fill it
    if len(curves) >= 4:  # close curves told apart: each named at its end
        end_labels(ax, {k: np.asarray(m, dtype=float) for k, (m, _) in curves.items()})
    ax.set_xlabel("" if difference is not None else "t (generated words)")  # shared: said under the lower panel
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # t is a count: no t = 2.5
    ax.set_xlim(0.5, horizon + 0.5)  # both panels: t = 1..horizon
    ax.set_ylabel(f"{quantity}\n(nats; bands ±1.96 se)")  # one quantity on the axis
    ax.set_title(wrapped(title, 0.7 * width), fontsize=10)  # over the axes, about 70% of the figure's width
    ax.grid(alpha=0.3)
    if legend_outside:  # below the axes, in columns: the curves keep the figure's width
        handles, labels = ax.get_legend_handles_labels()
        ax.legend(handles, [textwrap.fill(x, 44, break_on_hyphens=False) for x in labels], fontsize=7, ncol=2,
                  loc="upper center", bbox_to_anchor=(0.5, -0.16), borderaxespad=0, frameon=False)
    else:
        ax.legend(fontsize=8)
    if difference is not None:
        _difference_axes(axes[1, 0], **difference)
        axes[1, 0].set_xlim(0.5, horizon + 0.5)
    elif tail_differences:
        _tail_difference_axes(axes[1, 0], tail_differences)
    return _save(fig, path)


def curve_range(curves: dict[str, tuple], pad: float = 0.08) -> tuple[float, float]:
    """The y-range of the curves with their ±1.96 se bands, padded by `pad` of its span on each side."""
    ends = [(np.nanmin(np.asarray(m, float) - 1.96 * np.asarray(e, float)),
             np.nanmax(np.asarray(m, float) + 1.96 * np.asarray(e, float))) for m, e in curves.values() if len(m)]
    lo, hi = (min(a for a, _ in ends), max(b for _, b in ends)) if ends else (0.0, 1.0)
    span = hi - lo if hi > lo else max(abs(hi), 1.0) * 0.1
    return lo - pad * span, hi + pad * span


def end_labels(ax, curves: dict[str, np.ndarray], gap: float = 0.05) -> None:
    """Each curve's label at its last point, right of the axes, moved apart where ends are closer than `gap` of the
    axes' height (from the top down), with a thin leader to the point: curves that end close stay named."""
    to_axes = ax.transData + ax.transAxes.inverted()
    ends = {k: float(v[np.isfinite(v)][-1]) for k, v in curves.items() if np.isfinite(v).any()}
    ys = {k: to_axes.transform((1.0, y))[1] for k, y in ends.items()}
    placed: list[float] = []
    for k in sorted(ys, key=lambda k: -ys[k]):
        y = min([ys[k]] + [p - gap for p in placed if p - ys[k] < gap])
        placed.append(y)
        color = next((ln.get_color() for ln in ax.get_lines() if ln.get_label().startswith(k)), "0.3")
        ax.annotate(textwrap.shorten(k, 34, placeholder="…"), xy=(len(curves[k]), ends[k]), xycoords="data",
                    xytext=(1.02, y), textcoords="axes fraction", fontsize=6.5, va="center", color=color,
                    arrowprops={"arrowstyle": "-", "lw": 0.4, "color": color}, annotation_clip=False)


def wrapped(title: str, width_in: float, fontsize: float = 10) -> str:
    """A title broken into lines that fit a figure `width_in` inches wide (about 0.6 x fontsize points a character),
    so that it is never cut off at the figure's edge."""
    return textwrap.fill(title, max(20, int(width_in * 72 / (0.6 * fontsize)) - 4),
                         break_on_hyphens=False) if title else title


def covered_curves(curves: dict[str, np.ndarray], rel_tol: float = 0.003) -> dict[str, str]:
    """label -> the first earlier label whose curve it hides: the same length and, at every point, within rel_tol of
    the figure's y range (well under a line's width on these axes). Drawn later, it would cover the earlier curve
    without a word."""
    arrays = {k: np.asarray(v, dtype=float) for k, v in curves.items()}
    finite = np.concatenate([a[np.isfinite(a)] for a in arrays.values()]) if arrays else np.zeros(0)
    span_ = float(finite.max() - finite.min()) if finite.size else 0.0
    tol = rel_tol * span_ if span_ > 0 else 1e-12
    covers: dict[str, str] = {}
    labels = list(arrays)
    for i, b in enumerate(labels):
        for a in labels[:i]:
            if a not in covers and arrays[a].shape == arrays[b].shape and np.all(np.abs(arrays[a] - arrays[b]) <= tol):
                covers[b] = a
                break
    return covers


def _difference_axes(ax, label: str, mean: np.ndarray, stderr: np.ndarray, tail: float, tail_stderr: float,
                     tail_steps: int) -> None:
    """The paired difference at every t (±1.96 se band) and its mean over the last tail_steps words."""
    mean, stderr = np.asarray(mean, dtype=float), np.asarray(stderr, dtype=float)
    t = np.arange(1, len(mean) + 1)
    (line,) = ax.plot(t, mean, lw=1.2, label=label)
    ax.fill_between(t, mean - 1.96 * stderr, mean + 1.96 * stderr, color=line.get_color(), alpha=0.2, lw=0)
    lo = len(mean) - tail_steps + 0.5
    ax.hlines(tail, lo, len(mean) + 0.5, color="k", lw=2,
              label=f"last {tail_steps} words: {tail:+.3f} ± {tail_stderr:.3f} nats")
    ax.fill_between([lo, len(mean) + 0.5], tail - 1.96 * tail_stderr, tail + 1.96 * tail_stderr, color="k",
                    alpha=0.15, lw=0)
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xlabel("t (generated words)")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # t is a count: no t = 2.5
    ax.set_ylabel("paired difference (nats, ±1.96 se)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _tail_difference_axes(ax, diffs: dict[str, tuple[float, float]]) -> None:
    """One horizontal error bar (±1.96 se) per label: the paired difference of the last tenth's mean entropy."""
    labels = list(diffs)
    y = np.arange(len(labels))[::-1]
    x = np.array([diffs[k][0] for k in labels], dtype=float)
    se = np.array([diffs[k][1] for k in labels], dtype=float)
    ax.errorbar(x, y, xerr=1.96 * se, fmt="o", capsize=3, ms=4, lw=1)
    ax.axvline(0.0, color="k", lw=0.8)
    ax.set_yticks(y, [textwrap.fill(x, 40, break_on_hyphens=False) for x in labels], fontsize=7)
    ax.set_xlabel("mean entropy over the last tenth of the horizon minus the plain model's,\npaired (nats, ±1.96 se)")
    ax.grid(alpha=0.3, axis="x")


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format=path.suffix.lstrip(".") or "png")
    finally:
        plt.close(fig)
    return path


def memory_figure(series: dict[str, tuple[list, list, list | None]], path: str | Path, title: str = "",
                  ylabel: str = "upper bound on I_tau (nats)") -> Path:
    """Figure 4: one line per series (label -> (tau, value, stderr or None)), with ±1.96 se error bars.
    Written atomically."""
    path = Path(path)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    # a series at the same taus and values as an earlier one would hide it: it is said in the legend
    covers = {b: a for b, a in covered_curves({k: v for k, (_, v, _) in series.items()}).items()
              if list(series[a][0]) == list(series[b][0])}
    for label, (tau, value, se) in series.items():
        style = ({"ls": "--", "marker": "s"} if label.startswith("paper") else
                 {"ls": ":", "marker": "x", "color": "k"} if label.startswith("exact") else
                 {"ls": "-.", "marker": "D", "ms": 4, "color": "0.45"} if "oracle" in label else {"marker": "o"})
        if label in covers:
            style = {**style, "ls": "--", "marker": "+", "ms": 10}
            label = f"{label} (the same points as {covers[label]}, drawn over them)"
        yerr = None if se is None else 1.96 * np.asarray(se, dtype=float)
        ax.errorbar(tau, value, yerr=yerr, label=label, capsize=3, lw=1.4, **style)
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xlabel("tau (tokens of context the limited model sees)")
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))  # tau is a count: no tau = 1.2
    ax.set_ylabel(ylabel)
    ax.set_title(wrapped(title, 6.4), fontsize=10)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    ax.legend(handles, [textwrap.fill(x, 48, break_on_hyphens=False) for x in labels], fontsize=7)
    return _save(fig, path)


def decoders_tradeoff_figure(rows: list[dict], path: str | Path, title: str = "") -> Path:
    """Each decoder setting as a point: entropy of the last generated word (nats, ±1.96 se) against its held-out
    cross-entropy after mixing in a little uniform mass (finite for truncating rules too). The plain model's entropy
    is a dotted line; the fitted rows (temperature, calibration) are squares. Labels that would overlap are moved
    apart and joined to their points by a thin line; those in the right part of the axes are set to the point's left,
    so none is cut at the edge; each label is in its point's colour. Written atomically."""
    path = Path(path)
    models = list(dict.fromkeys(r.get("model") for r in rows))
    if len(models) > 1:
        return _decoders_of_models(rows, models, path, title)
    fig, ax = plt.subplots(figsize=(7.2, 4.4), dpi=120)
    points = []  # (x, y, label, colour) of the plotted rows
    for r in rows:
        fitted = r["method"] in ("fitted_temperature", "calibration")
        x, y, se = r["test_ce_mixed_nats"], r["entropy_last_nats"], r["stderr_nats"][-1]
        if x is None:
            continue
        params = format_params(r["params"], digits=3, drop=("stderr", "topk"), empty="")
        bar = ax.errorbar([x], [y], yerr=[1.96 * se], marker="s" if fitted else "o", capsize=2, ms=5, lw=1)
        points.append((x, y, f"{r['method']} ({params})" if params else r["method"], bar[0].get_color()))
        if r["method"] == "model":
            ax.axhline(y, ls=":", color="k", lw=1, label="the model's own entropy at the horizon")
    _tradeoff_axes(ax, title, 7.2)
    ax.autoscale_view()
    ax.set_xlim(ax.get_xlim())  # freeze the limits, so axes fractions computed below stay true
    ax.set_ylim(ax.get_ylim())
    for (x, y, label, color), (lx, ly) in zip(points, _label_spots(ax, points), strict=True):
        right = lx > 0.55
        ax.annotate(label, (x, y), xytext=(lx + (-0.015 if right else 0.015), ly), textcoords="axes fraction",
                    fontsize=6, va="center", ha="right" if right else "left", color=color,
                    arrowprops=dict(arrowstyle="-", lw=0.5, color=color, shrinkA=0, shrinkB=3))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")
    return _save(fig, path)


def _tradeoff_axes(ax, title: str, width: float) -> None:
    """The decoders figure's axes: test CE on a log scale with plain labels, entropy at the horizon, margins that
    keep edge points' bars and labels inside."""
    ax.set_xscale("log")
    ax.margins(x=0.08, y=0.08)
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
    ax.tick_params(axis="x", which="both", labelsize=7)
    ax.set_xlabel("test cross-entropy, ε-mixed (nats, log scale)")
    ax.set_ylabel("entropy of the last generated word (nats)")
    ax.set_title(wrapped(title, width), fontsize=10)
    ax.grid(alpha=0.3)


def _decoders_of_models(rows: list[dict], models: list, path: Path, title: str) -> Path:
    """The decoders figure over several models (lmcal.report over a sweep): one colour per model, one marker per
    method, no per-point labels (dozens would cover the points); the legend names both."""
    fig, ax = plt.subplots(figsize=(8.6, 4.8), dpi=120)
    colours = {m: plt.get_cmap("tab20" if len(models) > 10 else "tab10")(i % 20) for i, m in enumerate(models)}
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fixed = {"model": "o", "fitted_temperature": "s", "calibration": "D"}
    shapes = {**dict(zip([m for m in methods if m not in fixed], "^v<>pP*hX", strict=False)), **fixed}
    for r in rows:
        if r["test_ce_mixed_nats"] is None:
            continue
        ax.errorbar([r["test_ce_mixed_nats"]], [r["entropy_last_nats"]], yerr=[1.96 * r["stderr_nats"][-1]],
                    marker=shapes.get(r["method"], "o"), color=colours[r.get("model")], capsize=2, ms=5, lw=1)
    _tradeoff_axes(ax, title, 8.6)
    handles = [matplotlib.lines.Line2D([], [], color=colours[m], marker="o", ls="", label=str(m)) for m in models]
    handles += [matplotlib.lines.Line2D([], [], color="0.3", marker=shapes.get(k, "o"), ls="", label=k)
                for k in methods]
    ax.legend(handles=handles, fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    return _save(fig, path)


def _label_spots(ax, points: list[tuple], gap: float = 0.045) -> list[tuple[float, float]]:
    """Axes-fraction spots for the points' labels: each at its point's height unless a label above it on the same
    side, near in x, is closer than `gap`; then just below that one (greedy, from the top). A label starts beyond
    every point near its height on its side, so that no label crosses a neighbouring point."""
    to_axes = ax.transData + ax.transAxes.inverted()
    spots = [tuple(to_axes.transform(p[:2])) for p in points]
    side = [x > 0.55 for x, _ in spots]
    placed: list[tuple[float, float, bool]] = []
    out = [(0.0, 0.0)] * len(points)
    for i in sorted(range(len(points)), key=lambda i: -spots[i][1]):
        x, y = spots[i]
        for px, py, ps in sorted(placed, key=lambda p: -p[1]):
            if abs(px - x) < 0.3 and ps == side[i] and py - y < gap:
                y = min(y, py - gap)
        near = [sx for (sx, sy), s in zip(spots, side, strict=True)
                if s == side[i] and abs(sx - x) < 0.3 and abs(sy - y) < gap]
        placed.append((x, y, side[i]))
        out[i] = (min(near) if side[i] else max(near), y) if near else (x, y)
    return out


def memory_bound_figure(result: dict, path: str | Path, title: str = "") -> Path:
    """One memory run (a memory.json's keys): left, the cross-entropies and the entropy the bound is made of (nats);
    right, the upper bound on I_tau = CE(P||P~) - H(calibrated P~) by each estimator, ±1.96 se where there is one,
    beside the exact I_tau (synthetic sources) and the paper's value when known. Written atomically."""
    path = Path(path)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9.6, 3.6), dpi=120, width_ratios=[1.2, 1])
    levels = [("CE of the model", result.get("ce_full_nats"), result.get("ce_full_stderr_nats")),
              ("CE of P~ (tau-limited)", result.get("ce_limited_nats"), None),
              ("CE of P~ calibrated (alpha*)", result.get("ce_calibrated_nats"), None),
              ("entropy of P~ calibrated", result.get("entropy_calibrated_nats"), None)]
    levels = [(k, v, se) for k, v, se in levels if v is not None]
    y = np.arange(len(levels))[::-1]
    left.errorbar([v for _, v, _ in levels], y, xerr=[1.96 * (se or 0.0) for _, _, se in levels], fmt="o",
                  capsize=3, ms=5)
    left.set_yticks(y, [k for k, _, _ in levels], fontsize=8)
    left.set_xlabel("nats (±1.96 se where known)")
    left.grid(alpha=0.3, axis="x")
    two = result.get("two_parameter") or {}
    bounds = [("alpha*, fit on the test rows", result.get("mi_upper_bound_nats"), result.get("mi_stderr_nats")),
              ("alpha*, cross-fit", result.get("mi_upper_bound_crossfit_nats"), None),
              ("alpha*, beta* (with temperature)", two.get("mi_upper_bound_nats"), two.get("mi_stderr_nats")),
              ("exact I_tau", result.get("exact_mi_nats"), None),
              ("paper", (result.get("paper") or {}).get("mi_upper_bound_nats"), None)]
    bounds = [(k, v, se) for k, v, se in bounds if v is not None]
    y = np.arange(len(bounds))[::-1]
    for yi, (k, v, se) in zip(y, bounds, strict=True):
        exact = k.startswith(("exact", "paper"))
        right.errorbar([v], [yi], xerr=[1.96 * (se or 0.0)], fmt="x" if exact else "o", color="k" if exact else None,
                       capsize=3, ms=6)
    right.axvline(0.0, color="k", lw=0.8)
    right.set_yticks(y, [k for k, _, _ in bounds], fontsize=8)
    right.set_xlabel("upper bound on I_tau (nats, ±1.96 se)")
    right.grid(alpha=0.3, axis="x")
    fig.suptitle(wrapped(title, 9.6), fontsize=10)
    return _save(fig, path)
