"""Names from settings stay inside their folder (issue 77): every setting that becomes a folder's or file's name is one
plain name, the reproduce profile's scalar settings are checked before any work (check=true and a real run alike),
and FORCE removes only folders strictly inside out that lmcal's own stage records say it made."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lmcal.errors import LmcalError
from lmcal.pipeline.plan import load_profile, plan
from lmcal.pipeline.reproduce import clear_stages
from lmcal.pipeline.scale_sweep import plan_sweeps
from lmcal.utils.safe_paths import check_name, name_problem
from lmcal.utils.settings import composed
from lmcal.utils.validate import check_config


def run(module, args, cwd, timeout=300):
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def assert_one_paragraph(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr and r.stderr.count("lmcal: error:") == 1, r.stderr[-3000:]
    assert r.stderr.startswith("lmcal: error:"), r.stderr[-3000:]
    for n in needles:
        assert n in r.stderr, (n, r.stderr[-3000:])


@pytest.mark.parametrize("bad", ["../data/ptb", "a/b", "a\\b", ".", "..", "a\x00b", "tab\there", "x" * 101, "",
                                 None, 1.5, True])
def test_what_is_not_one_plain_name(bad):
    assert name_problem(bad)
    with pytest.raises(LmcalError, match="cannot be used"):
        check_name(bad, "dataset")


@pytest.mark.parametrize("ok", ["ptb", "tau_5", "awd_lstm_xs-116199", "ptb.v2", 5, "x" * 100])
def test_plain_names_pass(ok):
    assert name_problem(ok) is None


@pytest.mark.parametrize("setting, needle", [
    ("dataset=../data/ptb", "dataset='../data/ptb' cannot be used: it holds a path separator"),
    ("dataset=..", "dataset='..' cannot be used"),
    ("jobs=0", "jobs=0 (stages run side by side: must be an integer ≥ 1)"),
    ("jobs=-2", "jobs=-2"),
    ("jobs=1.5", "jobs=1.5"),
    ("jobs=many", "jobs='many'"),
    ("warm_worker=maybe", "warm_worker='maybe' (stages forked by a warm worker: must be one of true, false)"),
    ("force=maybe", "force='maybe'"),
    ("check=perhaps", "check='perhaps'"),
])
def test_the_smoke_profile_refuses_bad_settings_when_loaded(setting, needle, tmp_path):
    with pytest.raises(LmcalError) as e:
        load_profile(["profile=smoke", f"out={tmp_path / 'out'}", setting])
    assert needle in str(e.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("setting, needle", [
    ("estimate_for=tpu", "estimate_for='tpu' (where check=true's wall time is estimated for: must be one of cpu, gpu)"),
    ("bootstrap=lots", "bootstrap='lots' (the scale report's bootstrap replicates: must be an integer ≥ 1)"),
    ("bootstrap=0", "bootstrap=0"),
    ("bootstrap=-5", "bootstrap=-5"),
])
def test_the_scale_profile_refuses_bad_settings_when_loaded(setting, needle, tmp_path):
    with pytest.raises(LmcalError) as e:
        load_profile(["profile=scale", f"out={tmp_path / 'out'}", setting])
    assert needle in str(e.value)


def test_the_profiles_as_shipped_pass(tmp_path):
    for name in ("smoke", "cpu", "paper", "paper_mini", "paper_full", "scale", "scale_gpu"):
        load_profile([f"profile={name}", f"out={tmp_path / name}"])


def test_the_plan_refuses_a_dataset_that_is_not_a_plain_name(tmp_path):
    cfg = load_profile(["profile=smoke", f"out={tmp_path / 'out'}"])
    cfg.dataset = "../../elsewhere"
    with pytest.raises(LmcalError, match="dataset='../../elsewhere' cannot be used"):
        plan(cfg)


@pytest.mark.parametrize("name", ["../evil", "..", "a/b"])
def test_a_sweep_name_that_is_not_a_plain_name_is_refused(name, tmp_path):
    cfg = load_profile(["profile=scale", f"out={tmp_path / 'out'}"])
    cfg.sweeps = OmegaConf.create({name: ["experiment=scale"]})
    with pytest.raises(LmcalError, match=r"sweeps\..* \(a sweep's name\)=.* cannot be used"):
        plan_sweeps(cfg)


def test_a_long_wandb_name_suffix_and_a_run_name_with_a_separator_are_refused():
    with pytest.raises(LmcalError, match=r"logger.name_suffix='x.*\(100,002 characters\).*at most 64"):
        check_config(composed("lmcal.train", ["experiment=smoke", "logger.name_suffix=" + "x" * 100_000]))
    with pytest.raises(LmcalError, match="logger.name_suffix='a b'"):
        check_config(composed("lmcal.train", ["experiment=smoke", "logger.name_suffix='a b'"]))
    with pytest.raises(LmcalError, match="task_name='../x'"):
        check_config(composed("lmcal.evaluate", ["ckpt=x.ckpt", "task_name=../x"]))
    check_config(composed("lmcal.train", ["experiment=smoke", "logger.name_suffix=awd-lstm-64-1.1-20000"]))


def test_train_refuses_a_huge_name_suffix_before_writing(tmp_path):
    r = run("lmcal.train", ["experiment=smoke", "logger.offline=true", "logger.name_suffix=" + "x" * 100_000,
                            f"hydra.run.dir={tmp_path / 'W'}"], tmp_path)
    assert_one_paragraph(r, "logger.name_suffix=", "at most 64")
    assert not (tmp_path / "W").exists()


def test_reproduce_with_a_dataset_outside_out_removes_nothing(tmp_path):
    """The probe of issue 77: dataset=../data/ptb with force=true removed OUT/../data/ptb/base."""
    out, canary = tmp_path / "OUT", tmp_path / "data" / "ptb" / "base" / "canary.txt"
    (out / "stages").mkdir(parents=True)
    canary.parent.mkdir(parents=True)
    canary.write_text("precious")
    (out / "stages" / "base.json").write_text(json.dumps({"status": "done", "settings": {"x": 1},
                                                           "dir": str(out / ".." / "data" / "ptb" / "base")}))
    for extra in ([], ["check=true"]):
        r = run("lmcal.reproduce", ["profile=smoke", "dataset=../data/ptb", f"out={out}", "force=true", "logger=none",
                                    *extra], tmp_path)
        assert_one_paragraph(r, "dataset='../data/ptb' cannot be used")
        assert canary.read_text() == "precious"
        assert sorted(p.name for p in out.iterdir()) == ["stages"]


def test_reproduce_check_refuses_jobs_0(tmp_path):
    r = run("lmcal.reproduce", ["profile=smoke", "check=true", "jobs=0", f"out={tmp_path / 'OUT'}"], tmp_path)
    assert_one_paragraph(r, "jobs=0", "must be an integer ≥ 1")
    assert not (tmp_path / "OUT").exists()


# -- FORCE removes only what lmcal's own stages made inside out ---------------------------------------------------


def _stage(out: Path, d: Path, recorded: str | None) -> dict:
    (out / "stages").mkdir(parents=True, exist_ok=True)
    d.mkdir(parents=True, exist_ok=True)
    (d / "canary.txt").write_text("precious")
    name = d.name
    if recorded is not None:
        (out / "stages" / f"{name}.json").write_text(json.dumps({"status": "done", "settings": {}, "dir": recorded}))
    return {"name": name, "dir": d, "deps": [], "cmd": ["python", "-m", "lmcal.train"]}


def test_force_removes_a_stage_folder_its_record_names(tmp_path):
    out = tmp_path / "out"
    st = _stage(out, out / "ptb" / "base", str(out / "ptb" / "base"))
    clear_stages([st], {"base": None}, out)
    assert not st["dir"].exists() and not (out / "stages" / "base.json").exists()


def test_force_counts_the_records_of_a_moved_reproduction(tmp_path):
    out = tmp_path / "moved"
    st = _stage(out, out / "ptb" / "base", "/somewhere/else/out/ptb/base")
    clear_stages([st], {"base": None}, out)
    assert not st["dir"].exists()


@pytest.mark.parametrize("case", ["outside", "unrecorded", "other_record", "through_a_link", "out_itself"])
def test_force_refuses_what_is_not_lmcals_to_remove_and_removes_nothing(case, tmp_path):
    out = tmp_path / "out"
    ok = _stage(out, out / "ptb" / "calibration", str(out / "ptb" / "calibration"))  # fine alone; not removed either
    if case == "outside":
        d = out / ".." / "data" / "base"
        bad = _stage(out, d, str(d))
    elif case == "unrecorded":
        bad = _stage(out, out / "ptb" / "base", None)
    elif case == "other_record":
        bad = _stage(out, out / "ptb" / "base", "/elsewhere/markov/base")
    elif case == "through_a_link":
        (tmp_path / "real").mkdir()
        (out / "markov").symlink_to(tmp_path / "real")
        bad = _stage(out, out / "markov" / "base", str(out / "markov" / "base"))
    else:
        bad = {"name": "base", "dir": out, "deps": [], "cmd": []}
        (out / "canary.txt").write_text("precious")
        (out / "stages" / "base.json").write_text(json.dumps({"status": "done", "settings": {}, "dir": str(out)}))
    with pytest.raises(LmcalError, match="FORCE would remove .* Nothing was removed or run"):
        clear_stages([ok, bad], {ok["name"]: None, bad["name"]: None}, out)
    assert (ok["dir"] / "canary.txt").read_text() == "precious"
    assert (bad["dir"] / "canary.txt").read_text() == "precious"
    assert (out / "stages" / "calibration.json").exists()
