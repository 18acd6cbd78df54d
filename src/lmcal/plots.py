"""Figures (matplotlib, Agg backend): entropy of generated words against t (the paper's Figures 2 and 3) and the
memory bound against tau (Figure 4)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402


def entropy_curve_figure(curves: dict[str, tuple[np.ndarray, np.ndarray]], path: str | Path,
                         reference_nats: dict[str, float] | None = None, title: str = "") -> Path:
    """One line per curve (label -> (mean, stderr), nats, t = 1..horizon) with a ±1.96 se band,
    and dotted horizontal reference lines (e.g. the model's test cross-entropy). Written atomically."""
    path = Path(path)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for label, (mean, se) in curves.items():
        t = np.arange(1, len(mean) + 1)
        (line,) = ax.plot(t, mean, label=label, lw=1.4)
        ax.fill_between(t, mean - 1.96 * se, mean + 1.96 * se, color=line.get_color(), alpha=0.2, lw=0)
    for label, value in (reference_nats or {}).items():
        ax.axhline(value, ls=":", color="k", lw=1.2, label=label)
    ax.set_xlabel("t (generated words)")
    ax.set_ylabel("entropy of the t-th word's distribution (nats)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    tmp.replace(path)
    return path


def memory_figure(series: dict[str, tuple[list, list, list | None]], path: str | Path, title: str = "",
                  ylabel: str = "upper bound on I_tau (nats)") -> Path:
    """Figure 4: one line per series (label -> (tau, value, stderr or None)), with ±1.96 se error bars.
    Written atomically."""
    path = Path(path)
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    for label, (tau, value, se) in series.items():
        style = {"ls": "--", "marker": "s"} if label.startswith("paper") else {"marker": "o"}
        yerr = None if se is None else 1.96 * np.asarray(se, dtype=float)
        ax.errorbar(tau, value, yerr=yerr, label=label, capsize=3, lw=1.4, **style)
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xlabel("tau (tokens of context the limited model sees)")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
