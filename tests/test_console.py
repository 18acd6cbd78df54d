"""What the console and REPORT.md say about time and progress: one progress style (log lines, no carriage returns,
where stderr is not a terminal), tokens/s in the training bar, Lightning's tips silenced once, and the report's
total as wall time."""

import logging

import pytest

from lmcal.pipeline.report_md import wall_seconds
from lmcal.utils import progress as progress_mod
from lmcal.utils.progress import LineProgress, progress_bar


def test_progress_in_a_log_is_lines_without_carriage_returns(caplog, monkeypatch):
    clock = iter(range(0, 1000, 3))  # 3 s a step
    monkeypatch.setattr(progress_mod.time, "perf_counter", lambda: float(next(clock)))
    with caplog.at_level(logging.INFO, logger="lmcal"):
        bar = progress_bar(range(20), desc="generating")  # stderr is captured: not a terminal
        assert isinstance(bar, LineProgress)
        assert list(bar) == list(range(20))
    lines = [r.getMessage() for r in caplog.records]
    # a line once another tenth is done and 5 s have passed: every second step (6 s), and none twice
    assert lines[0].startswith("generating: 10% (2/20 it, 6 s") and len(lines) == 10
    assert lines[-1].startswith("generating: 100% (20/20 it") and not any("\r" in x for x in lines)


def test_a_short_loop_says_nothing(caplog):
    with caplog.at_level(logging.INFO, logger="lmcal"):
        bar = progress_bar(total=5, desc="quick")
        for _ in range(5):
            bar.update()
        bar.close()
        list(progress_bar(range(3), desc="off", disable=True))
    assert not caplog.records


def test_the_report_total_is_wall_time_not_the_sum_of_stage_times():
    stages = {"a": {"seconds": 10, "started_at": 100.0, "finished_at": 110.0},
              "b": {"seconds": 15, "started_at": 105.0, "finished_at": 120.0},  # beside a: counts from 110 only
              "c": {"seconds": 10, "started_at": 130.0, "finished_at": 140.0},  # after a gap (a resumed pipeline)
              "old": {"seconds": 7}}  # a record from before the times were kept: its seconds
    assert wall_seconds(stages) == pytest.approx(20 + 10 + 7)


def test_the_training_bar_shows_tokens_per_second_and_no_logger_version():
    from lmcal.training.callbacks import progress_bar as training_bar

    bar = training_bar()
    parent = type(bar).__mro__[1]
    parent_get = parent.get_metrics
    try:
        parent.get_metrics = lambda self, t, m: {"v_num": "ab12", "train/tokens_per_s": 18074.4, "train/loss": 3.8}
        assert bar.get_metrics(None, None) == {"tokens/s": "18,074", "train/loss": 3.8}
    finally:
        parent.get_metrics = parent_get
    if hasattr(bar, "configure_columns"):
        names = [type(c).__name__ for c in bar.configure_columns(None)]
        assert "ProcessingSpeedColumn" not in names and "BatchesProcessedColumn" in names


def test_lightnings_start_up_tips_are_silenced_once():
    from lmcal.utils.quiet import quiet_third_party

    quiet_third_party()
    quiet_third_party()  # idempotent: one filter
    logger = logging.getLogger("pytorch_lightning.utilities.rank_zero")
    assert len(logger.filters) == 1
    keep = logging.LogRecord("x", logging.INFO, "", 0, "`Trainer.fit` stopped", None, None)
    tip = logging.LogRecord("x", logging.INFO, "", 0, "💡 Tip: For seamless cloud logging ...", None, None)
    gpu = logging.LogRecord("x", logging.INFO, "", 0, "GPU available: False, used: False", None, None)
    assert [logger.filters[0].filter(r) for r in (keep, tip, gpu)] == [True, False, False]
