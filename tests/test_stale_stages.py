"""Which stages a rerun with other settings redoes (lmcal.pipeline.reproduce.stale_stages), from the stage records
alone: the stages whose settings differ, those downstream of them, and what a change of taus does."""

import json

import pytest

from lmcal.errors import LmcalError
from lmcal.pipeline.reproduce import stale_stages


def _finished(out, records):
    (out / "stages").mkdir(parents=True)
    for name, settings in records.items():
        (out / "stages" / f"{name}.json").write_text(json.dumps({"status": "done", "settings": settings}))


def test_a_change_of_taus_names_the_taus_trained_anew_and_those_no_longer_reported(tmp_path):
    tau = {"model.memory_tau": 2}
    _finished(tmp_path, {"tau_models": {"2": tau, "4": {"model.memory_tau": 4}}, "report": {"taus": [2, 4]}})
    stages = [{"name": "tau_models", "dir": tmp_path / "tau", "deps": [],
               "taus": {2: tmp_path / "tau" / "tau_2", 3: tmp_path / "tau" / "tau_3"}},
              {"name": "report", "dir": tmp_path, "deps": ["tau_models"]}]
    current = {"tau_models": {"2": tau, "3": {"model.memory_tau": 3}}, "report": {"taus": [2, 3]}}
    with pytest.raises(LmcalError) as e:
        stale_stages(stages, current, tmp_path, force=False)
    msg = str(e.value)
    assert "The settings of 1 stage in" in msg and "report (taus: [2, 4] -> [2, 3])" in msg
    assert "tau_models trains tau=3 anew" in msg and "tau=4 of tau_models is kept on disk but no longer reported" in msg
    # forced: the report is redone; tau 2, whose settings are those it ran with, is kept (tau 3 is simply not done)
    assert stale_stages(stages, current, tmp_path, force=True) == {"report": None}


def test_a_changed_tau_is_redone_alone_with_what_uses_it(tmp_path):
    _finished(tmp_path, {"tau_models": {"2": {"optim.lr": 1}, "3": {"optim.lr": 1}}, "report": {"taus": [2, 3]}})
    stages = [{"name": "tau_models", "dir": tmp_path / "tau", "deps": [], "taus": {2: None, 3: None}},
              {"name": "report", "dir": tmp_path, "deps": ["tau_models"]}]
    current = {"tau_models": {"2": {"optim.lr": 1}, "3": {"optim.lr": 2}}, "report": {"taus": [2, 3]}}
    with pytest.raises(LmcalError, match=r"tau_models \(tau=3 optim.lr: 1 -> 2\).*\(report\)"):
        stale_stages(stages, current, tmp_path, force=False)
    assert stale_stages(stages, current, tmp_path, force=True) == {"tau_models": {"3"}, "report": None}
