"""Figures fit the curves they are about (lmcal.stages.plots): the y-range is the curves' with their bands, a
reference far outside it is a mark at the edge (its value in the legend), and close curves are named at their ends."""

import numpy as np

from lmcal.stages.plots import curve_range, end_labels, plt


def test_the_y_range_is_the_curves_and_their_bands():
    lo, hi = curve_range({"a": (np.array([1.0, 2.0]), np.array([0.0, 0.5])), "b": (np.array([1.5]), np.array([0.0]))},
                         pad=0.0)
    assert (lo, hi) == (1.0, 2.0 + 1.96 * 0.5)


def test_close_curves_get_labels_at_their_ends_that_do_not_overlap():
    fig, ax = plt.subplots()
    curves = {f"c{i}": np.linspace(7.0, 7.4 + 0.001 * i, 50) for i in range(5)}
    for k, v in curves.items():
        ax.plot(np.arange(1, 51), v, label=k)
    ax.set_ylim(6.0, 8.0)
    end_labels(ax, curves, gap=0.05)
    ys = sorted(t.xyann[1] for t in ax.texts)
    assert len(ys) == 5 and min(np.diff(ys)) >= 0.05 - 1e-9
    plt.close(fig)


def test_a_far_reference_is_drawn_as_a_mark_not_a_line(tmp_path):
    from lmcal.stages.plots import entropy_curve_figure

    t = np.arange(1, 101)
    path = entropy_curve_figure({"model": (6.5 + 0.004 * t, 0.03 + 0 * t)}, tmp_path / "f.png",
                                reference_nats={"paper": 9.3, "test CE": 6.6})
    assert path.is_file() and path.stat().st_size > 1000
