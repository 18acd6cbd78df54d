"""PROFILE=paper_mini and the plan check's time model: the miniature's estimate within its 8 minutes, every term
of the model listed with its source, measured rates replacing the assumed one, and the paper profile's figure the
same wherever the docs give it."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from lmcal.pipeline.check import check
from lmcal.pipeline.plan import load_profile
from lmcal.pipeline.timing import TERMS, measured_rates

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import paper_mini  # noqa: E402


def estimate_s(text: str) -> float:
    value, unit = re.search(r"ESTIMATE, ([\d.]+) (h|min)", text).groups()
    return float(value) * (3600 if unit == "h" else 60)


@pytest.fixture(scope="module")
def mini():
    terms: dict = {}
    return check(load_profile(["profile=paper_mini"]), terms=terms, rates={}), terms


def test_paper_mini_fits_eight_minutes_with_every_stage_of_paper(mini):
    text, terms = mini
    assert estimate_s(text) <= 8 * 60
    paper: dict = {}
    check(load_profile(["profile=paper"]), terms=paper, rates={})
    assert set(terms) == set(paper)  # the same stages, only the counts cut
    assert all(t["pipeline_seconds"] == max(x["ends_at"] for x in terms.values()) for t in terms.values())
    for name in TERMS:  # every term named, with where it comes from
        assert name in text
    assert "measured:" in text and "assumed:" in text


def test_paper_figure_is_one_figure_in_readme_presets_and_guide():
    hours = {p: round(estimate_s(check(load_profile([f"profile={p}"]), rates={})) / 3600, 1)
             for p in ("paper", "paper_full")}
    for path in ("README.md", "conf/reproduce/paper.yaml", "conf/reproduce/paper_full.yaml", "docs/guide/reproduce.md"):
        given = {float(h) for h in re.findall(r"about ([\d.]+) hours", (ROOT / path).read_text())}
        assert given and given <= set(hours.values()), (path, given, hours)
    assert hours["paper"] in {float(h) for h in re.findall(r"about ([\d.]+) hours", (ROOT / "README.md").read_text())}


def test_measured_rates_replace_the_assumed_one(tmp_path):
    path = tmp_path / "gpu_rates.json"
    path.write_text(json.dumps({"tflops": {"calibration": 50.0, "memory": float("nan"), "decoders": -1}}))
    assert measured_rates(path) == {"calibration": 50.0}
    assert measured_rates(tmp_path / "none.json") == {}
    (tmp_path / "bad.json").write_text("[1, 2")
    assert measured_rates(tmp_path / "bad.json") == {}
    cfg = load_profile(["profile=paper_mini"])
    assumed, faster = {}, {}
    check(cfg, terms=assumed, rates={})
    text = check(cfg, terms=faster, rates={"calibration": 50.0})
    assert "calibration 50 TFLOP/s" in text and "(measured)" in text
    a, f = assumed["calibration"], faster["calibration"]
    assert f["seconds"] - f["idle_seconds"] == pytest.approx((a["seconds"] - a["idle_seconds"]) / 2)
    assert f["idle_seconds"] == a["idle_seconds"]


def test_rates_and_table_from_measured_seconds(tmp_path):
    terms = {"calibration": {"seconds": 100.0, "flops": 2e15, "idle_seconds": 20.0, "kind": "calibration"},
             "transformer_calibration": {"seconds": 50.0, "flops": 1e15, "idle_seconds": 20.0, "kind": "calibration"},
             "memory_tau5": {"seconds": 30.0, "flops": 1e12, "idle_seconds": 25.0, "kind": "memory"},
             "base": {"seconds": 40.0, "flops": 0.0, "idle_seconds": 19.0, "kind": ""}}
    seconds = {"calibration": 60.0, "transformer_calibration": 40.0, "memory_tau5": 20.0, "base": 41.0}
    got = paper_mini.rates(terms, seconds)
    assert got == {"calibration": pytest.approx(3e15 / (40 + 20) / 1e12)}  # memory: within its idle terms
    lines = paper_mini.table(terms, {"calibration": 60.0}, 70.0, 90.0)
    assert "| calibration | 100 | 20 | 60 | 0.60 |" in lines
    assert "| base | 40 | 19 | not finished | – |" in lines
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "base.json").write_text(json.dumps({"status": "done", "seconds": 12.5}))
    (tmp_path / "stages" / "calibration.json").write_text(json.dumps({"status": "started"}))
    (tmp_path / "stages" / "broken.json").write_text("{")
    assert paper_mini.measured(tmp_path) == {"base": 12.5}


def test_measured_seconds_come_from_whole_done_records_only(tmp_path):
    st = tmp_path / "stages"
    st.mkdir()
    (st / "base.json").write_text(json.dumps({"status": "done", "seconds": 12.5, "settings": {}}))
    (st / "calibration.json").write_text(json.dumps({"status": "started", "settings": {}}))
    (st / "memory_tau5.json").write_text('{"status": "done", "seconds": NaN}')  # not whole: not measured
    (st / "decoders.json").write_text('{"status": "done", "seconds": -3}')
    assert paper_mini.measured(tmp_path) == {"base": 12.5}
