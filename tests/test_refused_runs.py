"""A refused run writes nothing anywhere (issue 41): the folder rule (system folders, home, project, package, however
spelt), settings checked before Hydra makes the run folder, its .hydra/ and its log (single runs and multiruns),
required settings that stay required, lock files that hold no lock, a docs snapshot that does not render, the
report beside a live run, the plan check's memory lengths, and the W&B online case. Through the real entry points in
subprocesses where the exit code and the files left matter."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

import lmcal.stages  # noqa: F401  (registers the analysis stages' schemas, which composing the configs needs)
from lmcal.errors import LmcalError
from lmcal.utils.lock import LOCK_NAME, PACKAGE, check_output_folder, live_holder, run_lock
from lmcal.utils.settings import CONF_DIR
from lmcal.utils.validate import check_config
from tests.test_hostile_inputs import SYNTHETIC, assert_one_paragraph, run

PROJECT = PACKAGE.parents[1]
TRAIN = ["experiment=smoke", "logger=none", "trainer.enable_progress_bar=false"]


# -- the folder rule -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spelling", ["/etc", "/etc/lmcal_x", "/usr/local/x", "/bin", "/proc/self", "/sys/x",
                                      "/tmp/../etc", "/tmp/../usr/lib/x", "/", "/home", "/tmp", "~",
                                      "{project}", "{project}/src/lmcal/probe_x", "{project}/conf/../docs/x",
                                      "{package}", "{package}/models/x", "{link}/x", "{venv}/lib/x"])
def test_the_folder_rule_refuses_whatever_the_spelling(spelling, tmp_path):
    link = tmp_path / "link_to_usr"
    link.symlink_to("/usr")
    path = spelling.format(project=PROJECT, package=PACKAGE, link=link, venv=sys.prefix)
    with pytest.raises(LmcalError, match="Refusing to write a run into"):
        check_output_folder(path)


@pytest.mark.parametrize("ok", ["{tmp}/run", "/tmp/lmcal_ok_41/run", "{project}/outputs/x", "{home}/runs/x"])
def test_the_folder_rule_lets_a_folder_of_its_own_through(ok, tmp_path):
    check_output_folder(ok.format(tmp=tmp_path, project=PROJECT, home=Path.home()))


# -- nothing written before the settings are checked --------------------------------------------------------------


def _train(cwd, *args, env=None):
    return run("lmcal.train", [*TRAIN, *args], cwd, env=env)


@pytest.mark.parametrize("args", [["optim.lr=-1"], *(pytest.param(a, marks=pytest.mark.slow) for a in (
    ["~optim.lr"], ["~data"], ["seed=99999999999999999999"], ["data=markov", "data.corpus_kwargs.vocab_size=1"]))])
def test_a_refused_training_makes_no_folder(args, tmp_path):
    out = tmp_path / "new" / "run"
    r = _train(tmp_path, *SYNTHETIC if "data=markov" not in args and "~data" not in args else [], *args,
               f"hydra.run.dir={out}")
    key = args[-1].lstrip("~").split("=")[0]
    assert_one_paragraph(r, key)
    assert not (tmp_path / "new").exists()  # no run folder, no .hydra/, no train.log


def test_a_refused_run_into_the_package_or_a_system_folder_leaves_nothing(tmp_path):
    probe = PACKAGE / "probe_41"
    r = _train(PROJECT, "optim.lr=-1", "hydra.run.dir=src/lmcal/probe_41")
    assert_one_paragraph(r, "Refusing to write a run into", "lmcal's own package")
    assert not probe.exists()
    link = tmp_path / "usr_local"
    link.symlink_to("/usr/local")
    r = _train(tmp_path, "optim.lr=-1", f"hydra.run.dir={link}/lmcal_probe_41")
    assert_one_paragraph(r, "/usr/local/lmcal_probe_41", "a system folder")
    assert not Path("/usr/local/lmcal_probe_41").exists()


def test_a_run_refused_after_hydra_started_removes_the_folder_it_made(tmp_path):
    out = tmp_path / "run"
    r = _train(tmp_path, "data.root=/nowhere_41", "data.download=false", f"hydra.run.dir={out}")
    assert_one_paragraph(r, "/nowhere_41")
    assert not out.exists()
    out.mkdir()  # a folder that was there before is left as it was (a resumed run's, say)
    (out / "keep.txt").write_text("x")
    r = _train(tmp_path, "data.root=/nowhere_41", "data.download=false", f"hydra.run.dir={out}")
    assert_one_paragraph(r, "/nowhere_41")
    assert (out / "keep.txt").read_text() == "x"


def test_a_refused_evaluation_makes_no_folder(tmp_path):
    out = tmp_path / "ev"
    r = run("lmcal.evaluate", ["logger=none", f"hydra.run.dir={out}"], tmp_path)  # neither ckpt= nor model=hf
    assert_one_paragraph(r, "Say what to analyse")
    r = run("lmcal.evaluate", ["ckpt=x.ckpt", "logger=none", "analysis.entropy_rate.horizon=0",
                               f"hydra.run.dir={out}"], tmp_path)
    assert_one_paragraph(r, "analysis.entropy_rate.horizon=0")
    assert not out.exists()
    (tmp_path / "outputs" / "keep").mkdir(parents=True)
    r = run("lmcal.evaluate", ["ckpt=/nowhere_41.ckpt", "logger=none"], tmp_path)  # refused after Hydra started
    assert_one_paragraph(r, "/nowhere_41.ckpt")
    # the default run folder and the parents made for it are gone (no empty outputs/evaluate/runs); the rest stays
    assert [p.relative_to(tmp_path).as_posix() for p in sorted(tmp_path.rglob("*"))] == ["outputs", "outputs/keep"]


def test_train_into_a_folder_another_run_holds_does_not_touch_it(tmp_path):
    busy = tmp_path / "busy"
    with run_lock(busy):
        r = _train(tmp_path, *SYNTHETIC, f"hydra.run.dir={busy}")
    assert_one_paragraph(r, "in use by another lmcal run")
    assert sorted(p.name for p in busy.iterdir()) == []  # (its lock is gone with it; no .hydra/ of this run)


# -- required settings, and values that were tracebacks ------------------------------------------------------------


def _compose(*overrides):
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides))


@pytest.mark.parametrize("setting,needle", [
    ("seed=99999999999999999999", "seed=99999999999999999999 (the run's random seed: must be an integer in "
                                  "[0, 4,294,967,295])"),
    ("data.corpus_kwargs.vocab_size=0", "data.corpus_kwargs.vocab_size=0"),
    ("data.corpus_kwargs.support=20", "must be at most data.corpus_kwargs.vocab_size=16"),
    ("data.corpus_kwargs.smoothing=0", "data.corpus_kwargs.smoothing=0"),
    ("model.memory_tau=99999999999", "model.memory_tau=99,999,999,999 (at most 100,000)"),
])
def test_settings_that_were_tracebacks_are_refused_by_their_rules(setting, needle):
    cfg = _compose("experiment=smoke", "data=markov", setting)
    with pytest.raises(LmcalError) as e:
        check_config(cfg)
    assert needle in str(e.value)


def test_deleting_a_required_setting_is_refused_naming_it():
    from lmcal.utils.precheck import deleted_required

    why = deleted_required("lmcal.train", ["experiment=smoke", "~optim.lr", "~data"])
    assert "~optim.lr (learning rate)" in why and "~data" in why and "optim.lr=VALUE" in why
    assert deleted_required("lmcal.train", ["~logger", "~experiment", "~hydra.callbacks.sweep_summary"]) is None
    assert deleted_required("lmcal.evaluate", ["~decoder", "~model"]) is None


# -- locks that hold no lock -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("body", ["[1, 2]", "null", "garbage", "{}", '{"pid": "x"}', ""])
def test_a_lock_file_that_holds_no_lock_is_taken_over_with_a_warning(body, tmp_path, caplog):
    lock = tmp_path / LOCK_NAME
    lock.write_text(body)
    old = time.time() - 60
    os.utime(lock, (old, old))
    with run_lock(tmp_path):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert "holds no lmcal lock" in caplog.text and not lock.exists()


def test_a_lock_being_written_is_waited_for_not_taken(tmp_path):
    lock = tmp_path / LOCK_NAME
    lock.write_text("")  # this instant: another process between creating it and writing its holder

    def write_later():
        time.sleep(0.5)
        lock.write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(), "what": "training"}))

    import threading

    threading.Thread(target=write_later).start()
    with pytest.raises(LmcalError, match="in use by another lmcal training"):
        with run_lock(tmp_path):
            pass


# -- the docs snapshot, the report beside a live run ---------------------------------------------------------------


def test_a_snapshot_that_does_not_render_changes_nothing(tmp_path):
    docs, fake = tmp_path / "docs", tmp_path / "FAKE"
    (docs / "runs" / "cpu").mkdir(parents=True)
    (docs / "runs" / "cpu" / "results.json").write_text(json.dumps({"profile": "cpu"}))
    (docs / "runs" / "cpu" / "REPORT.md").write_text("# the real one\n")
    (docs / "bench").mkdir()
    fake.mkdir()
    whole = json.loads((PROJECT / "tests" / "fixtures" / "cpu_results_2026-11-24.json").read_text())
    (fake / "results.json").write_text(json.dumps({**whole, "profile": "cpu", "provenance": ["not", "a", "mapping"]}))
    (fake / "REPORT.md").write_text("# fake\n")
    before = {p: p.read_bytes() for p in docs.rglob("*") if p.is_file()}
    r = run("lmcal.docs", ["--snapshot", str(fake), "--docs", str(docs)], tmp_path)
    assert_one_paragraph(r, str(fake / "results.json"), "provenance", "nothing was copied")
    assert {p: p.read_bytes() for p in docs.rglob("*") if p.is_file()} == before


def test_report_refuses_to_write_into_a_folder_a_live_run_holds(tmp_path):
    held = tmp_path / "held"
    (held / "run1").mkdir(parents=True)
    (held / "run1" / "metrics.json").write_text(json.dumps({"val_ppl": 2.0, "test_ppl": 2.0}))
    with run_lock(held, "reproduction"):
        assert live_holder(held / "run1") is None or live_holder(held / "run1")[0] == held / LOCK_NAME
        r = run("lmcal.report", [str(held / "run1"), "--wandb", "disabled"], tmp_path)
        assert_one_paragraph(r, "held by a live lmcal reproduction", "--out")
        assert sorted(p.name for p in held.rglob("*")) == [LOCK_NAME, "metrics.json", "run1"]
        r = run("lmcal.report", [str(held), "--out", str(tmp_path / "elsewhere"), "--wandb", "disabled"], tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "may be partial" in r.stderr and (tmp_path / "elsewhere" / "report_runs.md").is_file()


# -- the plan check refuses what the run would ----------------------------------------------------------------------


@pytest.mark.parametrize("extra,needle", [
    (["taus=[99999999999]"], "model.memory_tau=99,999,999,999 (at most 100,000)"),
    (["taus=[50000]"], "model.memory_tau=50,000 is not shorter than the 8,000 training tokens"),
])
def test_the_plan_check_refuses_memory_lengths_the_run_would(extra, needle):
    from lmcal.pipeline.check import check
    from lmcal.pipeline.plan import load_profile

    with pytest.raises(LmcalError) as e:
        check(load_profile(["profile=smoke", "out=/tmp/lmcal_plan_41", *extra]))
    assert needle in str(e.value)


def test_the_plan_check_reads_an_out_with_tau_in_its_name(tmp_path):
    from lmcal.pipeline.check import check
    from lmcal.pipeline.plan import load_profile

    text = check(load_profile(["profile=smoke", f"out={tmp_path / 'my_tau_x'}"]))
    assert "memory_tau2: memory" in text and "memory_window_tau2: memory" in text


# -- W&B online -------------------------------------------------------------------------------------------------------


def test_wandb_online_without_a_key_says_what_to_set_at_once(tmp_path):
    env = {"WANDB_API_KEY": "", "HOME": str(tmp_path), "NETRC": str(tmp_path / "none")}
    r = subprocess.run([sys.executable, "-m", "lmcal.train", *TRAIN, *SYNTHETIC, "logger=wandb", "logger.offline=false",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, capture_output=True, text=True,
                       env={**{k: v for k, v in os.environ.items() if k != "WANDB_MODE"}, **env}, timeout=300)
    assert_one_paragraph(r, "logger.offline=false", "WANDB_API_KEY", "wandb login")
    assert not (tmp_path / "run").exists()  # refused before the run folder, so before W&B was asked anything


def test_wandb_online_with_a_key_but_no_server_says_so(monkeypatch):
    from lmcal.stages.wandb_run import check_online

    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(LmcalError, match="127.0.0.1:9 cannot be reached"):
        check_online({"_target_": "pytorch_lightning.loggers.WandbLogger", "offline": False})
    check_online({"_target_": "pytorch_lightning.loggers.WandbLogger", "offline": True})  # offline: nothing asked
