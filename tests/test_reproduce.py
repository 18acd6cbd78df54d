"""`make reproduce PROFILE=smoke` end to end: every stage, the report, and resuming after a kill."""

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmcal.errors import LmcalError
from lmcal.pipeline.plan import load_profile, plan
from tests.conftest import DATA_ROOT, HAVE_PTB

pytestmark = [pytest.mark.skipif(not HAVE_PTB, reason="the pipeline reproduces PTB results: set LMCAL_DATA_ROOT"),
              pytest.mark.slow]  # the pipeline in subprocesses: minutes


def _cmd(out, *extra):
    return [sys.executable, "-m", "lmcal.reproduce", "profile=smoke", f"out={out}", "logger=csv", *extra]


def _env():  # no WANDB_MODE: offline is the runs' own setting, as for a user. One thread a stage whatever `jobs` is
    # (the stages of jobs=2 get cores // 2 anyway), so that jobs=1 and jobs=2 compare bit for bit
    return {**{k: v for k, v in os.environ.items() if k != "WANDB_MODE"}, "LMCAL_DATA_ROOT": DATA_ROOT,
            "OMP_NUM_THREADS": "1"}


def _numbers(results: dict) -> dict:
    """results.json without the wall times (at any depth: future_entropy's ms per word) and the provenance (date,
    command), which differ from run to run."""
    def strip(obj):
        if isinstance(obj, dict):
            return {k: strip(v) for k, v in obj.items() if k not in TIMING}
        return [strip(v) for v in obj] if isinstance(obj, list) else obj

    return strip(results)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("reproduce") / "straight"
    r = subprocess.run(_cmd(out, "logger=wandb"), env=_env(), capture_output=True, text=True, timeout=1800,
                       preexec_fn=lambda: os.umask(0o022))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, json.loads((out / "results.json").read_text())


def test_smoke_profile_writes_every_result(uninterrupted):
    out, res = uninterrupted
    assert res["profile"] == "smoke" and res["dataset"] == "ptb"
    assert res["base"]["test_ppl"] > 1 and len(res["entropy_rate"]["curve_nats"]) == res["entropy_rate"]["horizon"]
    cal = res["calibration"]
    assert {"alpha", "test_ppl_before", "test_ppl_after", "entrate_ppl_before", "entrate_ppl_after",
            "tail_ppl_before", "tail_ppl_after", "tail_diff_nats", "tail_diff_stderr_nats"} <= set(cal)
    dec = res["decoders"]  # every decoder, then the fitted rows; calibration's is the calibration stage's own
    assert [d["method"] for d in dec] == ["model", "temperature", "top_k", "top_p", "typical", "eta", "min_p",
                                          "mirostat", "fitted_temperature", "calibration"]
    assert all({"method", "params", "entrate_ppl", "test_ce_nats", "zero_prob_fraction"} <= set(d) for d in dec)
    assert dec[-1]["entrate_ppl"] == cal["entrate_ppl_after"] and dec[0]["entrate_ppl"] == cal["entrate_ppl_before"]
    assert (dec[0]["tail_diff_nats"], dec[0]["tail_diff_stderr_nats"]) == (0.0, 0.0)  # the plain model against itself
    assert (dec[-1]["tail_diff_nats"], dec[-1]["tail_diff_stderr_nats"]) == (cal["tail_diff_nats"],
                                                                             cal["tail_diff_stderr_nats"])
    assert dec[2]["test_ce_nats"] is None and dec[2]["zero_prob_fraction"] > 0  # top-k 50 cuts test words
    assert [(m["model"], m["tau"], m["limited"]) for m in res["memory"]] == [
        ("awd_lstm", 2, "trained"), ("awd_lstm", 2, "window"), ("awd_lstm", 4, "trained"), ("awd_lstm", 4, "window"),
        ("transformer", 2, "window")]
    assert all(m["mi_upper_bound_nats"] >= 0 for m in res["memory"])  # alpha* fitted on the reported rows
    t1 = res["table1"]  # the AWD-LSTM's row and the transformer's
    assert [r["model"].split(" ")[0] for r in t1] == ["AWD-LSTM", "Transformer"]
    assert all(set(r) == {"model", "corpus", "test_ppl", "entrate_ppl", "horizon", "unit"} for r in t1)
    assert t1[0]["entrate_ppl"] == res["entropy_rate"]["entrate_ppl"] and t1[1]["unit"] == "word"
    assert res["transformer"]["base"]["test_ppl"] == pytest.approx(t1[1]["test_ppl"])
    assert all({"ce_limited_nats", "mi_upper_bound_nats", "alpha"} <= set(m) for m in res["memory"])
    mk = res["markov"]
    assert mk["order"] == 2 and mk["true_entropy_rate_nats"] == pytest.approx(0.9192, abs=1e-4)
    assert [(m["tau"], m["limited"]) for m in mk["memory"]] == [(1, "trained"), (1, "window"), (2, "trained"),
                                                                 (2, "window")]
    assert mk["memory"][2]["exact_mi_nats"] == mk["memory"][3]["exact_mi_nats"] == 0.0
    assert mk["memory"][0]["exact_mi_nats"] > 0.5  # tau = 1 < order: the source's own I_tau
    orc = mk["oracle"]  # the estimators on the exact oracles: within their error bars of the exact answers
    assert abs(orc["estimated_entropy_rate_nats"] - mk["true_entropy_rate_nats"]) < 4 * orc[
        "estimated_entropy_rate_stderr_nats"]
    assert [m["tau"] for m in orc["memory"]] == [1, 2]
    assert list(res["stages"]) == [s["name"] for s in plan(load_profile(["profile=smoke", f"out={out}"]))]
    assert all(s["status"] == "done" for s in res["stages"].values())
    assert res["stages"]["base"]["matmul_gflop_per_s"] > 0  # the machine's speed as the first stage started ...
    assert "matmul_gflop_per_s" not in res["stages"]["report"]  # ... not for the in-process report
    report = (out / "REPORT.md").read_text()
    assert "| stage | seconds | training tokens/s | machine GFLOP/s | run folder |" in report
    assert "The matmul rate ranged" in report
    for fig in ("figure2_entropy_rate.png", "figure3_calibration.png", "figure_decoders.png", "memory_ptb.png",
                "memory_markov.png"):
        assert f"({fig})" in report and (out / fig).stat().st_size > 1000
    assert "| AWD-LSTM (paper) | ptb | 58.3 | 93.1 |" in report and "| Transformer (ours, PTB)" in report
    assert "transformer, window P̃" in report
    for name in ("results.json", "REPORT.md", "ptb/base/metrics.json", "figure2_entropy_rate.png"):
        assert stat.S_IMODE((out / name).stat().st_mode) == 0o644, name  # readable by others under umask 022
    assert not list(out.rglob("*.tmp")) and not list(out.rglob(".lmcal.lock"))


def test_the_wandb_dashboard_of_the_smoke_reproduction(uninterrupted):
    """Its offline runs, read from their files: every run named and typed, all in the reproduction's group, the
    generation curves as series, training's final numbers in its summary."""
    from tests.test_wandb import runs_under

    out, res = uninterrupted
    runs = runs_under(out)
    by_name = {r["name"]: r for r in runs}
    assert len(by_name) == len(runs) and all(r["name"] and r["job_type"] for r in runs)
    assert {r["group"] for r in runs} == {f"reproduce-{out.name}"}
    jobs = sorted(r["job_type"] for r in runs)
    assert jobs.count("train") == 3 and jobs.count("tau_model") == 4 and jobs.count("report") == 1  # PTB, Markov
    assert {"entropy_rate", "calibration", "decoders", "future_entropy", "memory"} <= set(jobs)
    assert all({"data", "model"} <= r["config"] for r in runs)
    base = next(r for r in runs if r["job_type"] == "train" and r["name"].endswith("-ptb")
                and r["name"].startswith("train-awd-lstm"))
    assert base["summary"]["final/test_ppl"] == pytest.approx(res["base"]["test_ppl"])
    assert any({"train/lr", "train/grad_norm", "train/tokens_per_s"} <= set(h) for h in base["history"])
    cal = next(r for r in runs if r["job_type"] == "calibration")
    horizon = res["entropy_rate"]["horizon"]
    assert [h["calibration/curves/t"] for h in cal["history"] if "calibration/curves/calibration" in h] == \
        list(range(1, horizon + 1))
    dec = next(r for r in runs if r["job_type"] == "decoders")
    assert sum(k.startswith("decoders/curves/") for k in set().union(*dec["history"])) >= 8  # one per decoder
    memory = [r for r in runs if r["job_type"] == "memory"]  # each logs its table row and its own figure
    assert memory and all({"memory/table/_type", "memory/figure/_type"} <= set().union(*r["history"]) for r in memory)
    # issue 42: one naming rule, the lineage, the report's numbers and files, the console
    names = set(by_name)
    assert {"memory-awd-lstm-32-64-3-tau2-ptb", "memory-window-awd-lstm-32-64-3-tau2-ptb",
            "memory-window-transformer-2x32-context-64-tau2-ptb"} <= names
    ckpt = next(a for a in base["artifacts"] if not a["used"])
    assert ckpt["name"] == "checkpoint-awd-lstm-32-64-3-ptb"
    users = [r["job_type"] for r in runs if any(a["used"] and a["digest"] == ckpt["digest"] for a in r["artifacts"])]
    assert {"entropy_rate", "calibration", "decoders", "future_entropy", "sequence_calibration"} <= set(users)
    assert base["summary"]["val/ppl"] == pytest.approx(res["base"]["val_ppl"])
    assert all("???" not in json.dumps(r["values"]) and "tau" in r["values"] for r in runs if r["job_type"] != "report")
    assert all(r["output"] for r in runs)  # every run's Logs tab
    report = next(r for r in runs if r["job_type"] == "report")
    assert report["summary"]["calibration/alpha"] == pytest.approx(res["calibration"]["alpha"])
    from lmcal.reporting.report_wandb import numbers

    (table,) = (report["folder"] / "files" / "media" / "table").glob("results_*.table.json")
    assert len(json.loads(table.read_text())["data"]) == len(numbers(res))  # every number of results.json
    (files,) = [a["files"] for a in report["artifacts"] if a["type"] == "report"]
    assert {"results.json", "REPORT.md", "figure2_entropy_rate.png"} <= set(files)
    dec_keys = {k for h in dec["history"] for k in h if k.startswith("decoders/curves/")}
    assert "decoders/curves/calibration" in dec_keys and not any("alpha=" in k for k in dec_keys)
    seq = next(r for r in runs if r["job_type"] == "sequence_calibration")
    assert any(k.startswith("sequence_calibration/curves/") for h in seq["history"] for k in h)


def test_every_effect_sentence_of_the_report_agrees_with_results_json(uninterrupted):
    """REPORT.md's claims are the rows lmcal.reporting.claims writes from results.json (and the future_entropy and
    sequence_calibration stages' own json), with verdicts that follow from the numbers; its setup table says what
    each stage ran on; a goal row says on which seed it was chosen and where it was measured."""
    from tests.test_report_claims import check_effect_sentences

    out, res = uninterrupted
    report = (out / "REPORT.md").read_text()
    assert len(check_effect_sentences(report, res, out)) >= 2  # at least calibration's tail and temperature claims
    fe = json.loads((out / "ptb" / "future_entropy" / "future_entropy.json").read_text())
    if fe["best_head"]:  # chosen on seed 0, measured on seed 1: the report says so
        b = fe["best_head"]
        assert f"| {len(b['candidates'])} | {b['chosen_on_seed']} | seed {b['reported_on_seed']} |" in report
    setup = report.split("## Setup", 1)[1].split("\n## ", 1)[0]
    for section in ("Table 1", "calibration", "decoders", "future entropy"):
        assert f"\n| {section} | " in setup, section
    cal = res["calibration"]
    assert {"tail_nats", "tail_stderr_nats", "tail_nats_before", "tail_stderr_nats_before", "epsilon"} <= set(cal)
    assert "ε = 0: no uniform mixture" in report and "clustered by prefix" in report
    shown = report.split("## Generations, as words", 1)[1].split("\n## ", 1)[0]  # plain and calibrated, as words
    assert shown.count("- plain (exp H, last tenth ") == shown.count("- calibrated (exp H, last tenth ") == 3


def test_rerun_skips_finished_stages(uninterrupted, tmp_path):
    out, res = uninterrupted
    r = subprocess.run(_cmd(out), env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.count("done before, skipped") == len(res["stages"])


@pytest.fixture(scope="module")
def killed_and_rerun(tmp_path_factory):
    """The smoke reproduction one stage at a time (jobs=1; the uninterrupted run has two side by side), each stage a
    fresh process (warm_worker=false; the uninterrupted run forks them from a warm worker), killed while a tau-model
    is training (after its first epoch's checkpoint), then rerun: one run serves both tests below."""
    out = tmp_path_factory.mktemp("killed") / "killed"
    p = subprocess.Popen(_cmd(out, "jobs=1", "warm_worker=false"), env=_env(), stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    ckpt = out / "ptb" / "tau" / "tau_2" / "checkpoints" / "last.ckpt"
    deadline = time.time() + 600
    while not ckpt.is_file() and p.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    killed = {"ckpt": ckpt.is_file(), "metrics": (out / "ptb" / "tau" / "tau_2" / "metrics.json").exists(),
              "lock": (out / ".lmcal.lock").is_file(),  # left by the killed process: the rerun takes it over
              "status": {n: json.loads((out / "stages" / f"{n}.json").read_text())["status"]
                         for n in ("base", "tau_models") if (out / "stages" / f"{n}.json").is_file()}}
    r = subprocess.run(_cmd(out, "jobs=1", "warm_worker=false"), env=_env(), capture_output=True, text=True,
                       timeout=1800)
    return out, killed, r


def test_killed_and_rerun_gives_the_same_results(uninterrupted, killed_and_rerun):
    """Killed while a tau-model is training, then rerun: the finished stages are kept, the training resumes from
    its checkpoint, and results.json equals the uninterrupted run's."""
    out, killed, r = killed_and_rerun
    assert killed == {"ckpt": True, "metrics": False, "lock": True,
                      "status": {"base": "done", "tau_models": "started"}}
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "base: done before, skipped" in r.stdout
    m = json.loads((out / "ptb" / "tau" / "tau_2" / "metrics.json").read_text())
    assert m["resumed_from"] and m["resumed_from"].endswith("last.ckpt")
    assert _numbers(json.loads((out / "results.json").read_text())) == _numbers(uninterrupted[1])


def test_changed_settings_are_reported_and_force_redoes_them_and_what_uses_them(uninterrupted, tmp_path):
    """A copy of the finished reproduction (paths are recorded relative to it), rerun with another decoders setting
    (which future_entropy shares, for its rows beside the decoders'): one paragraph naming the stages and the keys,
    nothing run; with force=true only they, sequence_calibration (which reads both) and the report rerun."""
    out = tmp_path / "copy"
    shutil.copytree(uninterrupted[0], out)
    changed = "analysis=[analysis=smoke,analysis.decoders.mix_epsilon=1e-4]"
    r = subprocess.run(_cmd(out, changed), env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    msg = r.stderr.strip().splitlines()[-1]
    assert "The settings of 2 stages in" in msg and "decoders (analysis.decoders.mix_epsilon: 1e-06 -> 0.0001)" in msg
    assert "future_entropy (analysis.future_entropy.mix_epsilon: 1e-06 -> 0.0001)" in msg
    assert "(sequence_calibration, report)" in msg and "FORCE=1" in msg and ": running (log" not in r.stdout
    r = subprocess.run(_cmd(out, changed, "force=true"), env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ran = [line.split("]")[1].split(":")[0].strip() for line in r.stdout.splitlines() if ": running (log" in line]
    assert ran == ["decoders", "future_entropy", "sequence_calibration", "report"], r.stdout  # it reads both
    res = json.loads((out / "results.json").read_text())
    assert _numbers(res)["calibration"] == _numbers(uninterrupted[1])["calibration"]
    assert res["decoders"] != uninterrupted[1]["decoders"]  # the mixed CE moved with epsilon
    r = subprocess.run(_cmd(out, changed), env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and ": running (log" not in r.stdout  # now recorded with the new setting


def test_a_stage_with_an_out_of_range_setting_stops_before_any_stage_runs(tmp_path):
    r = subprocess.run(_cmd(tmp_path / "bad", "base=[experiment=smoke,model.memory_tau=0]"), env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "Stage 'base' (python -m lmcal.train): Setting out of range: model.memory_tau=0" in r.stderr
    assert not (tmp_path / "bad" / "stages").exists() and not (tmp_path / "bad" / "ptb").exists()


def test_a_failing_stage_names_itself_its_log_and_the_command(tmp_path):
    r = subprocess.run(_cmd(tmp_path / "bad", f"base=[experiment=smoke,data.root={tmp_path / 'nowhere'},"
                            "data.download=false]"), env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr  # a failed stage: the table, exit 1
    assert "| base | exit status" in r.stderr and str(tmp_path / "bad" / "logs" / "base.log") in r.stderr
    assert "python -m lmcal.train" in r.stderr and "not run: needs base" in r.stderr
    assert json.loads((tmp_path / "bad" / "stages" / "base.json").read_text())["status"] == "failed"


def test_profiles_share_one_wandb_group_and_auto_picks_by_device():
    cfg = load_profile(["profile=cpu"])
    assert cfg.profile == "cpu" and cfg.out == "outputs/reproduce/cpu"
    cmds = [s["cmd"] for s in plan(cfg) if "cmd" in s]
    assert cmds and all("logger.group=reproduce-cpu" in c and "logger.offline=true" in c for c in cmds)
    auto = load_profile([])
    assert auto.profile in ("paper", "cpu")
    with pytest.raises(LmcalError, match="Unknown profile"):
        load_profile(["profile=gpu"])


def test_a_new_stage_runs_through_the_pipeline(uninterrupted, tmp_path):
    """The toy stage of tests/toy_stage.py, loaded in every process with LMCAL_PLUGINS and added to `stages`: on a
    copy of the finished reproduction only it and the report run, and its summary lands in results.json."""
    out = tmp_path / "copy"
    shutil.copytree(uninterrupted[0], out)
    root = str(Path(__file__).resolve().parents[1])
    env = {**_env(), "LMCAL_PLUGINS": "tests.toy_stage",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run(_cmd(out, "stages=[entropy_rate,calibration,decoders,toy]",
                            "analysis=[analysis=smoke,'+analysis.toy={positions: 5}']"), env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ran = [line.split("]")[1].split(":")[0].strip() for line in r.stdout.splitlines() if ": running (log" in line]
    assert ran == ["toy", "report"], r.stdout
    res = json.loads((out / "results.json").read_text())
    assert res["toy"]["toy_mean_entropy"] > 0 and "## Stage toy" in (out / "REPORT.md").read_text()


TIMING = {"seconds", "fit_seconds", "rows_seconds", "wall_seconds", "train_seconds", "tokens_per_s",
          "generated_tokens_per_s", "profile", "provenance", "stages", "_runtime", "_timestamp", "ms_per_token",
          "cost_ratio", "generation_ms_per_token", "rollout_seconds", "tail_seconds", "generation_seconds",
          "ms_per_word", "convergence",  # Algorithm 1's sentence: its ms a word and cost against plain sampling
          "wandb_group",  # a scale record's W&B group: the straight run logs to W&B, the others to CSV
          "config"}  # evaluation.json's config: each run's own folders and W&B group


def _without_timing(obj, out: str):
    """A result file's content less its wall times and where its runs logged (the straight run logs to W&B, the
    others to CSV; a sweep's runs.json records that among each run's overrides), with its own folder's path as
    <out>."""
    if isinstance(obj, dict):
        return {k: _without_timing([o for o in v if not o.startswith("logger")] if k == "overrides" else v, out)
                for k, v in obj.items() if k not in TIMING}
    if isinstance(obj, list):
        return [_without_timing(v, out) for v in obj]
    return obj.replace(out, "<out>") if isinstance(obj, str) else obj


def test_stages_side_by_side_write_the_same_results_as_one_at_a_time(uninterrupted, killed_and_rerun):
    """The smoke profile runs independent stages two at a time (jobs: 2), forked by a warm worker; one at a time
    (jobs=1), each a fresh process (the killed and rerun reproduction), every result file of every stage is the same
    but for its wall times and the resumed tau-model's record of its resume."""
    straight, _ = uninterrupted
    out, _, r = killed_and_rerun
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    names = sorted(str(p.relative_to(straight)) for p in straight.rglob("*.json")
                   if "wandb" not in p.parts and p.parts[len(straight.parts)] != "stages")
    assert len(names) > 20 and names == sorted(str(p.relative_to(out)) for p in out.rglob("*.json")
                                               if "wandb" not in p.parts and p.parts[len(out.parts)] != "stages")
    for name in names:
        a = _without_timing(json.loads((straight / name).read_text()), str(straight))
        b = _without_timing(json.loads((out / name).read_text()), str(out))
        if name == str(Path("ptb", "tau", "tau_2", "metrics.json")):
            a, b = ({k: v for k, v in d.items() if k != "resumed_from"} for d in (a, b))
        assert a == b, name
