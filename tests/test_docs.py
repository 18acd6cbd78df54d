"""docs/RESULTS.md is regenerated from files runs wrote: reproduction snapshots and saved benchmark tables."""

import json
import shutil
from pathlib import Path

import pytest

from lmcal.docs import main
from lmcal.errors import LmcalError
from lmcal.reporting.docs import provenance, render, save_bench, snapshot

ROOT = Path(__file__).resolve().parents[1]


def _fake_run(folder):
    folder.mkdir()
    prov = {"command": "python -m lmcal.reproduce profile=smoke", "date": "2026-11-23 10:00 UTC",
            "machine": "test cpu, 2 cores, no GPU, torch x", "commit": "abc1234",
            # what the report stage adds (a snapshot of a real reproduction was refused for them)
            "matmul_gflop_per_s": 115.6, "precision": {"tf32_matmul": False, "float32_matmul_precision": "highest"}}
    # a whole reproduction's results (every key RESULTS.md reads), as this run's
    whole = json.loads((ROOT / "tests" / "fixtures" / "cpu_results_2026-11-24.json").read_text())
    (folder / "results.json").write_text(json.dumps({**whole, "profile": "smoke", "provenance": prov}))
    (folder / "REPORT.md").write_text("# lmcal reproduction\n\n## Entropy\n\n| a | b |\n|---|---|\n| 1.5 | 2 |\n\n"
                                      "![Figure 2](figure2_entropy_rate.png)\n\n| stage | folder |\n|---|---|\n"
                                      "| base | [ptb/base](ptb/base) |\n")
    (folder / "figure2_entropy_rate.png").write_bytes(b"png")


def test_results_md_comes_from_snapshots_and_saved_benchmarks(tmp_path):
    docs = tmp_path / "docs"
    _fake_run(tmp_path / "run")
    dest = snapshot(tmp_path / "run", docs)
    assert dest == docs / "runs" / "smoke" and (dest / "figure2_entropy_rate.png").read_bytes() == b"png"
    save_bench(docs / "bench" / "speed.md", "Speed", "| x | tokens/s |\n|---|---|\n| a | 12 |\n\nfloat32 matmul "
               "99.5 GFLOP/s", command="python b.py", result="a runs at 12 tokens/s.")
    assert "*Command:* `python b.py`" in (docs / "bench" / "speed.md").read_text()
    text = render(docs)
    assert "## Reproduction, profile `smoke`" in text and "*Command:* `python -m lmcal.reproduce profile=smoke`" in text
    assert "### Entropy" in text and "| 1.5 | 2 |" in text  # the report's own table, a heading level down
    assert "![Figure 2](runs/smoke/figure2_entropy_rate.png)" in text  # figures point into the snapshot
    assert "| base | ptb/base |" in text  # links into the (uncopied) run folders become plain text
    # a benchmark is one line: its result, the matmul rate its page records, a link to the page (its tables stay there)
    assert "- [Speed](bench/speed.md): a runs at 12 tokens/s. *(matmul 99.5 GFLOP/s)*" in text
    assert "| a | 12 |" not in text
    main(["--docs", str(docs)])
    assert (docs / "RESULTS.md").read_text() == text


def test_a_reports_title_and_provenance_are_not_repeated_under_the_sections(tmp_path):
    """RESULTS.md gave each reproduction two headings and its provenance line twice (the section's, then the
    report's own): the report's title, and its provenance line where it is the section's, are left out."""
    from lmcal.reporting.docs import provenance_line

    docs = tmp_path / "docs"
    _fake_run(tmp_path / "run")
    r = json.loads((tmp_path / "run" / "results.json").read_text())
    line = provenance_line(r["provenance"])
    (tmp_path / "run" / "REPORT.md").write_text(f"# Entropy miscalibration against scale\n\n{line}\n\nbody\n")
    snapshot(tmp_path / "run", docs)
    text = render(docs)
    assert text.count(line) == 1 and "miscalibration" not in text and "body" in text


def test_provenance_names_command_date_machine():
    p = provenance("cmd")
    assert p["command"] == "cmd" and p["date"] and "cores" in p["machine"] and "torch" in p["machine"]


def test_snapshot_of_an_unfinished_run_is_one_paragraph(tmp_path, capsys):
    with pytest.raises(LmcalError, match="holds no finished reproduction"):
        snapshot(tmp_path, tmp_path / "docs")
    with pytest.raises(SystemExit) as e:
        main(["--docs", str(tmp_path / "docs"), "--snapshot", str(tmp_path / "nothing")])
    assert e.value.code == 2 and "no finished reproduction" in capsys.readouterr().err
    assert not (tmp_path / "docs" / "RESULTS.md").exists()


@pytest.mark.parametrize("prov", [["a", "b"], {"command": 3, "date": "d", "machine": "m"},
                                  {"command": "c", "date": "d", "machine": "m", "commit": {"x": 1}}])
def test_a_snapshot_whose_provenance_has_wrong_types_changes_nothing(tmp_path, prov):
    _fake_run(tmp_path / "run")
    r = json.loads((tmp_path / "run" / "results.json").read_text())
    (tmp_path / "run" / "results.json").write_text(json.dumps({**r, "provenance": prov}))
    with pytest.raises(LmcalError, match="provenance"):
        snapshot(tmp_path / "run", tmp_path / "docs")
    assert not (tmp_path / "docs").exists()


def test_rerender_writes_a_snapshots_report_from_its_results_json(tmp_path):
    """A snapshot keeps only results.json and figures: its REPORT.md is written again from results.json alone, opening
    with the claims table that RESULTS.md's rows share (lmcal.reporting.claims_table)."""
    from lmcal.reporting.claims_table import claim_rows
    from lmcal.reporting.docs import rerender

    run = tmp_path / "cpu"
    run.mkdir()
    shutil.copyfile(ROOT / "tests" / "fixtures" / "cpu_results_2026-11-24.json", run / "results.json")
    text = rerender(run).read_text()
    r = json.loads((run / "results.json").read_text())
    assert text.startswith("# lmcal reproduction: profile `cpu`") and "## Claims" in text
    assert all("| " + " | ".join(row) + " |" in text for row in claim_rows(r))


def test_results_md_opens_with_the_paper_against_lmcal_and_fits_600_lines(tmp_path):
    """The project's own RESULTS.md, rendered from a copy of its docs/: the claims table first, every verdict that
    lmcal.reporting.claims gives, at most 600 lines."""
    import shutil

    from lmcal.reporting.docs import DOCS

    docs = tmp_path / "docs"
    for sub in ("runs", "bench"):
        shutil.copytree(DOCS / sub, docs / sub)
    text = render(docs)
    heads = [ln for ln in text.splitlines() if ln.startswith("## ")]
    assert heads[0] == "## The paper against lmcal" and len(text.splitlines()) <= 600
    table = text[text.index("| claim | paper | lmcal | ± se | shown at 2 se |"):text.index(heads[1])]
    assert "| `cpu`: Calibration lowers the last tenth's entropy (nats) | -0.24 |" in table and "rules out" in table
    assert "(bench/sequence_calibration.md)" in table and heads[-1] == "## Benchmarks"


def test_a_benchmark_summary_is_tested_as_a_goal_row(tmp_path):
    """bench/<page>.json, a study's level against its test perplexity: a row of the claims table, with the verdict
    lmcal.reporting.claims.within gives."""
    import math

    bench = tmp_path / "docs" / "bench"
    bench.mkdir(parents=True)
    (tmp_path / "docs" / "runs").mkdir()
    (bench / "study.md").write_text("## Study\n\n*Result:* close.\n")
    (bench / "study.json").write_text(json.dumps({"label": "A row", "tail_nats": math.log(100.0),
                                                  "tail_stderr_nats": 0.01, "test_ppl": 100.0}))
    text = render(tmp_path / "docs")
    assert "| bench: [A row](bench/study.md): last tenth within 10% of the test perplexity 100.0 | " \
           "equal (Algorithm 1) | 100.0 | 1.0 | yes (within) | – |" in text
    assert "- [Study](bench/study.md): close." in text
    # α*'s error and the spread between seeds are counted where the summary records them
    (bench / "study.json").write_text(json.dumps({"label": "A row", "tail_nats": math.log(100.0),
                                                  "tail_stderr_nats": 0.01, "tail_alpha_stderr_nats": 0.05,
                                                  "run_to_run_stderr_nats": 0.02, "test_ppl": 100.0}))
    assert "| equal (Algorithm 1) | 100.0 | 5.5 | undecided (undecided) | – |" in render(tmp_path / "docs")
