"""What the console and REPORT.md say about time and progress: one progress style (log lines, no carriage returns,
where stderr is not a terminal), tokens/s in the training bar, Lightning's tips silenced once, and the report's
total as wall time."""

import logging
import re

import pytest

from lmcal.reporting.report_md import wall_seconds
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


def test_lightnings_start_up_tips_are_silenced_once(monkeypatch):
    from lmcal.utils.quiet import quiet_third_party

    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    quiet_third_party()  # stderr is captured here, as in a log file: no Hugging Face bars either
    import os

    assert os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    quiet_third_party()  # idempotent: one filter
    logger = logging.getLogger("pytorch_lightning.utilities.rank_zero")
    assert len(logger.filters) == 1
    keep = logging.LogRecord("x", logging.INFO, "", 0, "`Trainer.fit` stopped", None, None)
    tip = logging.LogRecord("x", logging.INFO, "", 0, "💡 Tip: For seamless cloud logging ...", None, None)
    gpu = logging.LogRecord("x", logging.INFO, "", 0, "GPU available: False, used: False", None, None)
    assert [logger.filters[0].filter(r) for r in (keep, tip, gpu)] == [True, False, False]


def test_log_lines_give_the_time_left_and_a_minute_never_passes_silently(caplog, monkeypatch):
    clock = iter([0.0, 1.0, 62.0, 63.0, 200.0])  # a slow second step: a line at 62 s though not a tenth is done
    monkeypatch.setattr(progress_mod.time, "perf_counter", lambda: next(clock))
    with caplog.at_level(logging.INFO, logger="lmcal"):
        bar = progress_bar(total=100, desc="scoring")
        bar.update(1)  # t = 1
        bar.update(1)  # t = 62: a minute without a line
        bar.update(98)  # t = 63: the rest, 1 s after the last line: none
        bar.close()  # t = 200: the end
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "scoring: 2% (2/100 it, 62 s, 0.0 it/s, about 40m30s-1h03m left)"  # 98 more at 2 per 62 s
    assert lines[1:] == ["scoring: 100% (100/100 it, 200 s, 0.5 it/s)"] # done: no time left


def test_the_console_numbers_stages_as_they_start_and_gives_the_times_left(tmp_path, monkeypatch, capsys):
    """jobs=2 with plan order a, x (after a), b: b starts second and is [2/3], not [3/3]; each running stage shows its
    step's time left from its log, and the pipeline's from the estimates scaled by the stages that finished."""
    import sys

    from omegaconf import OmegaConf

    from lmcal.pipeline import schedule as S
    from lmcal.pipeline.eta import floored, plan_left, scaled, stage_line, step_eta

    def stage(name, deps=(), seconds=0.0):
        done = tmp_path / name / "done.txt"
        code = ("import time, pathlib; print(time.strftime('[%Y-%m-%d %H:%M:%S,000][lmcal][INFO] - scoring: 40% "
                "(4/10 it, 2 s, 2.0 it/s, about 30m00s left)'), flush=True); "
                f"time.sleep({seconds}); p = pathlib.Path({str(done)!r}); "
                "p.parent.mkdir(parents=True, exist_ok=True); p.write_text('ok')")
        return {"name": name, "dir": tmp_path / name, "done": [done], "deps": list(deps),
                "cmd": [sys.executable, "-c", code]}

    monkeypatch.setattr(S, "machine_gflops", lambda: 0.0)
    monkeypatch.setattr(S, "LINE_EVERY_S", 0.5)
    stages = [stage("a", seconds=1.0), stage("x", ["a"], seconds=3.0), stage("b", seconds=6.0)]
    S.schedule(stages, OmegaConf.create({}), tmp_path, {n: {} for n in "axb"}, jobs=2, ref={},
               estimates={"a": 1e-3, "x": 3e-3, "b": 6e-3})
    out = capsys.readouterr().out
    assert "[1/3] a: running" in out and "[2/3] b: running" in out and "[3/3] x: running" in out
    assert re.search(r"\(scoring 40%, about 29m5\ds left\)", out)  # the step's ETA from the stage's log, aged
    assert "; the pipeline about" in out.split("[1/3] a: done")[1]  # once a stage has been timed

    import time

    log = tmp_path / "train.log"
    log.write_text("[2026-11-26 03:50:00,123][lmcal][INFO] - training: epoch 3/300, 27/67 batches (40%), 4m10s in; "
                   "about 55s left in the epoch, about 2h10m left in all (300 epochs at most)\n")
    written = time.mktime(time.strptime("2026-11-26 03:50:00", "%Y-%m-%d %H:%M:%S"))
    assert step_eta(log, now=written + 600) == "epoch 3/300, about 2h00m left"  # ten minutes after the line
    assert step_eta(log, now=written + 9000) == "epoch 3/300, finishing"
    with log.open("a") as f:  # a step named with commas, then its last line: the step is done, not "finishing"
        f.write("[2026-11-26 03:51:00,000][lmcal][INFO] - nested SMC from word 200, 8 particles: 40% (4,800/12,000 "
                "word, 14 s, 353.4 word/s, about 20s left)\n")
        f.flush()
        assert step_eta(log, now=written + 65) == "nested SMC from word 200, 8 particles 40%, about 15s left"
        f.write("[2026-11-26 03:51:20,000][lmcal][INFO] - nested SMC from word 200, 8 particles: 100% (12,000/12,000 "
                "word, 34 s, 353.4 word/s)\n")
    assert step_eta(log, now=written + 120) == "nested SMC from word 200, 8 particles done 40s ago"
    basis = {"a": 10.0, "b": 20.0, "c": 40.0, "d": 80.0}
    exp = scaled(basis, {"a": 25.0, "b": 45.0, "c": 85.0}, reference=False)  # 5 + 2 x basis, from three stages
    assert exp == {"a": pytest.approx(25.0), "b": pytest.approx(45.0), "c": pytest.approx(85.0),
                   "d": pytest.approx(165.0)}
    # two stages: their ratio, not the line through them (the cpu reproduction's base 967 s -> 2165 s and its
    # tau-models 274 s -> 1235 s gave a 4-second Markov stage 873 s, and the pipeline 7h33m left)
    ref = {"base": 967.0, "tau_models": 274.0, "markov_memory_tau1": 4.0}
    two = scaled(ref, {"base": 2165.0, "tau_models": 1235.0}, reference=True)
    assert two["markov_memory_tau1"] == pytest.approx(4.0 * 3400.0 / 1241.0)
    assert scaled(ref, {"base": 2165.0, "tau_models": 1235.0, "markov_memory_tau1": 1.0}, True) == pytest.approx(
        {n: 3401.0 / 1245.0 * x for n, x in ref.items()})  # an intercept above the shortest stage: the ratio
    assert scaled({"a": 10.0, "b": 20.0}, {"a": 25.0, "b": 45.0}, reference=False) == pytest.approx(
        {"a": 70.0 / 3, "b": 140.0 / 3})  # (25 + 45) / (10 + 20) x basis
    assert scaled({"a": 10.0}, {}, reference=False) == {} and scaled({"a": 10.0}, {}, reference=True) == {"a": 10.0}
    assert stage_line("c", 3, 22, 25.0, 85.0, "scoring 40%, about 3s left") == \
        "[3/22] c: 25s, about 1m00s left (scoring 40%, about 3s left)"
    assert plan_left(exp, ["c"], {"b": 5.0}, jobs=1) == pytest.approx(85.0 + 40.0)
    assert plan_left(exp, ["e"], {}, jobs=1) is None  # a stage without an expectation: no total
    # a stage whose own step says 50 min are left is not shown ending in 13 (the reference run's machine was faster)
    low = floored({"base": 16 * 60.0, "c": 40.0}, {"base": 180.0}, {"base": 3000.0})
    assert low == {"base": 3180.0, "c": 40.0}
    assert stage_line("base", 1, 30, 180.0, low["base"], "epoch 1/6, about 50m00s left") == \
        "[1/30] base: 3m00s, about 50m00s left (epoch 1/6, about 50m00s left)"
    assert floored({"base": 4000.0}, {"base": 180.0}, {"base": 60.0}) == {"base": 4000.0}  # (a floor, not a cap)


def test_the_memory_fit_and_scoring_say_how_far_they_are(caplog, monkeypatch):
    """The steps that were silent for minutes: the memory fit's passes over its rows, and held-out scoring."""
    import itertools

    import torch

    from lmcal.core.decoders import heldout_cost
    from lmcal.core.memory_summary import memory_summary
    from lmcal.data.markov import make_markov_chain
    from lmcal.models.oracles import MarkovOracle

    ticks = itertools.count(0.0, 7.0)  # 7 s a call of the clock: every update is past the 5 s spacing
    monkeypatch.setattr(progress_mod.time, "perf_counter", lambda: next(ticks))
    g = torch.Generator().manual_seed(0)
    f = torch.randn(600, 20, generator=g).log_softmax(-1)
    q = (f + torch.randn(600, 20, generator=g)).log_softmax(-1)
    y = torch.randint(0, 20, (600,), generator=g)
    with caplog.at_level(logging.INFO, logger="lmcal"):
        memory_summary([(f, q, y)], cluster_size=100)
        lm = MarkovOracle.from_chain(make_markov_chain(vocab_size=20, order=1, seed=0))
        heldout_cost(lm, torch.randint(0, 20, (50, 2), generator=g), progress=True)
    lines = [r.getMessage() for r in caplog.records]
    fit = [x for x in lines if x.startswith("memory fit:")]
    assert fit and "/25 pass" in fit[0] and "left)" in fit[0]
    assert any(x.startswith("scoring: ") and "left)" in x for x in lines)


def test_a_training_in_a_log_says_the_time_left_in_the_epoch_and_in_all(caplog, monkeypatch):
    from types import SimpleNamespace

    from lmcal.training import callbacks

    now = iter([0.0, 0.0, 10.0, 70.0])  # train start, epoch start, batch 1 (a tenth done), batch 2 (a minute on)
    monkeypatch.setattr(callbacks.time, "perf_counter", lambda: next(now))
    trainer = SimpleNamespace(current_epoch=0, num_training_batches=10, max_epochs=3)
    cb = callbacks.TrainingProgress()
    with caplog.at_level(logging.INFO, logger="lmcal"):
        cb.on_train_start(trainer, None)
        cb.on_train_epoch_start(trainer, None)
        cb.on_train_batch_end(trainer, None, None, None, 0)
        cb.on_train_batch_end(trainer, None, None, None, 1)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["training: epoch 1/3, 1/10 batches (10%), 10s in; about 1m30s left in the epoch, about 4m50s "
                     "left in all (3 epochs at most)",
                     "training: epoch 1/3, 2/10 batches (20%), 1m10s in; about 4m40s left in the epoch, about 16m20s "
                     "left in all (3 epochs at most)"]


def _timed_loop(monkeypatch, durations, total):
    """LineProgress over steps of the given durations (a fake clock): its lines, and the true seconds left at each."""
    import logging

    import lmcal.utils.progress as P

    now = [0.0]
    monkeypatch.setattr(P.time, "perf_counter", lambda: now[0])
    lines = []
    handler = logging.Handler()
    handler.emit = lambda rec: lines.append((rec.getMessage(), sum(durations) - now[0]))
    P.log.addHandler(handler)
    level = P.log.level
    P.log.setLevel(logging.INFO)
    try:
        bar = P.LineProgress(total=total, desc="memory fit", unit="pass")
        for d in durations:
            now[0] += d
            bar.update()
        bar.close()
    finally:
        P.log.removeHandler(handler)
        P.log.setLevel(level)
    return lines


@pytest.mark.parametrize("slower_from", [None, 30])
def test_the_time_left_holds_for_a_loop_whose_steps_vary(monkeypatch, slower_from):
    """Steps of 10 s +-30% (seeded): the true time left lies within the range every line gives; where the machine
    gets a third busier from step 30 on, within the range of every line after that (one before cannot know)."""
    import random

    from lmcal.pipeline.eta import seconds

    rng = random.Random(0)
    durations = [10.0 * rng.uniform(0.7, 1.3) * (1.33 if slower_from and i >= slower_from else 1.0)
                 for i in range(60)]
    lines = _timed_loop(monkeypatch, durations, 60)
    ranges = [(m, true) for m, true in lines if " left)" in m
              and int(m.split("(")[1].split("/")[0]) > (slower_from or 0)]
    assert len(ranges) >= 4
    for m, true in ranges:
        low, high = m.split("about ")[1].split(" left")[0].split("-")
        assert seconds(low) - 1 <= true <= seconds(high) + 1, m


def test_no_percentage_past_100_when_a_loop_needs_more_steps_than_planned(monkeypatch):
    lines = _timed_loop(monkeypatch, [10.0] * 27, 25)
    assert not any("%" in m and int(m.split("%")[0].split()[-1]) > 100 for m, _ in lines)
    assert lines[-1][0].startswith("memory fit: 27 pass, past the 25 planned")
