"""REPORT.md of a reproduction, its figures, and the W&B report run: every table beside the paper's values
(lmcal.paper), each stage's wall time, and where each analysis stage's time went.
"""

from __future__ import annotations

import math
import shlex
import sys
from pathlib import Path

from omegaconf import DictConfig

from lmcal import paper
from lmcal.reporting.claim import comparability
from lmcal.reporting.claims_table import claim_rows, claims_table
from lmcal.reporting.provenance import provenance, stage_precision
from lmcal.reporting.report_sections import (
    calibration_markdown,
    decoders_markdown,
    future_and_sequence,
    markov_memory_markdown,
    memory_markdown,
    stage_folder,
    table1_markdown,
)
from lmcal.reporting.results import OPERATIONS, PAPER_STAGES, collect_results, read_json
from lmcal.reporting.samples_md import calibration_samples_markdown
from lmcal.reporting.setup_text import memory_lines, setup_lines
from lmcal.utils.io import copy_atomic, write_json_atomic, write_text_atomic


def profile_markdown(stages: dict, peak_flops: float) -> list[str]:
    """Where each analysis stage's time went, by operation, and the model forward's FLOP rate as a share of this
    machine's float32 matmul rate measured in the same run (MFU). Start-up: the process's time before and after the
    stage itself (imports, loading the model and the text, scoring its test CE)."""
    lines = ["| stage | seconds | start-up | " + " | ".join(OPERATIONS) + " | other | forward GFLOP/s | MFU |",
             "|---|---|---|" + "---|" * (len(OPERATIONS) + 3)]
    for name, s in stages.items():
        if "profile" not in s:
            continue
        p, total = s["profile"], max(s["seconds"], 1e-9)
        rate = s["forward_gflop"] / p["forward"] if p["forward"] > 0 and s["forward_gflop"] > 0 else None
        lines.append(f"| {name} | {s['seconds']:.0f} | {100 * (1 - s['analysis_seconds'] / total):.0f}% | "
                     + " | ".join(f"{100 * p[k] / total:.0f}%" for k in
                                                                       (*OPERATIONS, "other")) +
                     (f" | {rate:.1f} | {100 * rate * 1e9 / peak_flops:.0f}% |" if rate else " | – | – |"))
    return lines


def report(cfg: DictConfig, out: Path, names: list[str]) -> None:
    """results.json, REPORT.md and the figures; `names`: the pipeline's stages, in order."""
    from lmcal.reporting.tabulate import memory_report
    from lmcal.stages.plots import entropy_curve_figure

    results = collect_results(cfg, out, names)
    results["stages"]["report"] = {"seconds": 0.0, "status": "done"}
    results["provenance"] = provenance("python -m lmcal.reproduce " + shlex.join(sys.argv[1:]))
    from lmcal.utils.profiling import matmul_flops

    results["provenance"]["matmul_gflop_per_s"] = matmul_flops(seconds=2.0) / 1e9  # the MFU's denominator
    results["provenance"]["precision"] = stage_precision(out)  # the TF32 flags the stages ran with, as they recorded
    import numpy as np

    er, cal, tr = results["entropy_rate"], results["calibration"], results.get("transformer", {})
    lstm = results["base"]["model"]
    curves = {f"{lstm}: generations": (np.array(er["curve_nats"]), np.array(er["stderr_nats"]))}
    refs = {f"{lstm}: test cross-entropy": math.log(results["base"]["test_ppl"])}
    if "entropy_rate" in tr:  # Table 1's second row, as Figure 2 shows it
        curves[f"{tr['base']['model']}: generations"] = (np.array(tr["entropy_rate"]["curve_nats"]),
                                                         np.array(tr["entropy_rate"]["stderr_nats"]))
        refs[f"{tr['base']['model']}: test cross-entropy"] = math.log(tr["entropy_rate"]["test_ppl"])
    p = paper.AWD_LSTM_PTB
    refs[f"paper, AWD-LSTM (500 epochs): EntRate {p['entrate_ppl']} at t = {paper.HORIZON}"] = math.log(
        p["entrate_ppl"])
    refs[f"paper, AWD-LSTM: test ppl {p['test_ppl']}"] = math.log(p["test_ppl"])
    entropy_curve_figure(curves, out / "figure2_entropy_rate.png", reference_nats=refs, legend_outside=True,
                         title=f"Entropy of generated words on {cfg.dataset} (Figure 2), beside the paper's AWD-LSTM")
    entropy_curve_figure({"uncalibrated": (np.array(cal["curve_nats_before"]), np.array(cal["stderr_nats_before"])),
                          f"calibrated (alpha* = {cal['alpha']:.3g})": (np.array(cal["curve_nats"]),
                                                                        np.array(cal["stderr_nats"]))},
                         out / "figure3_calibration.png",
                         reference_nats={"test cross-entropy": math.log(cal["test_ppl_before"])},
                         title="Lookahead calibration (Algorithm 2)",
                         difference={"label": "calibrated minus uncalibrated, paired",
                                     "mean": np.array(cal["diff_curve_nats"]),
                                     "stderr": np.array(cal["diff_stderr_nats"]), "tail": cal["tail_diff_nats"],
                                     "tail_stderr": cal["tail_diff_stderr_nats"], "tail_steps": cal["tail_steps"]})
    if cal.get("dose_response"):  # with the rows other runs added (results.calibration_dose)
        from lmcal.stages.dose_response import dose_figure

        dose_figure(cal["dose_response"], out / "figure_dose_response.png", cal["dose_response"].get("extra_rows"))
    copy_atomic(out / cfg.dataset / "decoders" / "decoders.png", out / "figure_decoders.png")
    if "future_entropy" in cfg.stages:
        copy_atomic(out / cfg.dataset / "future_entropy" / "future_entropy.png", out / "figure_future_entropy.png")
    if "sequence_calibration" in cfg.stages:
        for part in ("", "_surprisal"):  # (the surprisal figure: where SMC rows ran)
            src = out / cfg.dataset / "sequence_calibration" / f"sequence_calibration{part}.png"
            if src.is_file():
                copy_atomic(src, out / f"figure_sequence_calibration{part}.png")
    memory_report([out / cfg.dataset / "memory", out / "markov" / "memory"], out, wandb_mode="disabled",
                  oracles={"markov": results["markov"]["oracle"]["memory"]})
    write_json_atomic(out / "results.json", results)
    write_text_atomic(out / "REPORT.md", report_markdown(cfg, results, out))
    if cfg.logger == "wandb":
        from lmcal.reporting.report_wandb import log_report  # (W&B is imported only when it logs)

        log_report(cfg, results, out)


def stage_tokens_line(cal: dict) -> list[str]:
    """The analysis stages' own test stream, where its perplexity differs from the whole test set's: one line."""
    if not cal.get("test_tokens") or not cal.get("test_ppl_before"):
        return []
    return [f"The analysis stages score on {cal['test_tokens']:,} test tokens, where the model's test perplexity is "
            f"{cal['test_ppl_before']:.1f}: the sections below, and the claims that say so, use that figure."]


def report_markdown(cfg: DictConfig, r: dict, out: Path) -> str:
    """REPORT.md from results.json `r`: the claims table, the setup table, then each section's tables; the stages'
    own json under `out` adds what results.json does not keep (the generations as words, the heads' R²)."""
    b, fe_path = r["base"], out / r["dataset"] / "future_entropy" / "future_entropy.json"
    why = comparability(r)
    lines = [f"# lmcal reproduction: profile `{r.get('profile', cfg.profile)}`", "",
             *([f"**Not comparable with the paper:** {why}. Its numbers are this model's; its verdicts against the "
                "paper's figures are labelled \"not comparable\".", ""] if why else []),
             f"Base model: {b['model']}, {b['params']:,} parameters, {b['epochs']} epochs.",
             f"Validation perplexity {b['val_ppl']:.1f}, test {b['test_ppl']:.1f} (the whole sets); the paper's: "
             f"{paper.AWD_LSTM_PTB_VAL_TEST[0]} / {paper.AWD_LSTM_PTB_VAL_TEST[1]}, after 500 epochs.",
             *stage_tokens_line(r.get("calibration") or {}), "",
             "## Claims", "", *claims_table(claim_rows(r)), "",
             "Nats are changes of the mean entropy over the last tenth of the horizon; ± is one standard error.",
             f"The paper's calibration figure is its -{paper.CALIBRATION_PPL_DROP:g} points from "
             f"{paper.AWD_LSTM_PTB['entrate_ppl']}.", "",
             "## Setup", "", *setup_lines(r, read_json(fe_path) if fe_path.is_file() else None),
             *table1_markdown(r, r.get("profile", cfg.profile)), *calibration_markdown(r),
             *(calibration_samples_markdown(out, r["dataset"])
               if (out / r["dataset"] / "calibration" / "calibration.json").is_file() else []),
             *decoders_markdown(r["decoders"]), *future_and_sequence(r, out, r["dataset"]),
             "## Memory (Section 5, Figure 4)", "",
             *memory_lines(bool(cfg.get("warm_start", False)), list(cfg.get("tau") or []),
                           [m for m in r["memory"] if m.get("model") != "transformer"]),
             *memory_markdown(r), *markov_memory_markdown(r["markov"]),
             *[line for n in cfg.stages if n in r and n not in (*PAPER_STAGES, *OWN_SECTIONS) for line in
                (f"## Stage {n}", "", *(f"- {k}: {v}" for k, v in r[n].items()), "")],
             *time_markdown(r, out)]
    return "\n".join(lines) + "\n"


OWN_SECTIONS = ("future_entropy", "sequence_calibration")  # analysis stages with a section of their own


def time_markdown(r: dict, out: Path) -> list[str]:
    """Where the time goes, by operation, and each stage's wall time and machine."""
    rate = r["provenance"].get("matmul_gflop_per_s", float("nan"))
    lines = ["## Where the time goes", "",
             *profile_markdown(r["stages"], rate * 1e9), "",
             "Shares of each analysis stage's seconds (utils.profiling); forward = the model's steps.",
             "Lookahead and scoring count beyond their forwards; fit = the exponential-family fits; io = files.",
             f"MFU: the forward's FLOP rate (2 x parameters per token) over {rate:.0f} GFLOP/s, this machine's float32 "
             "matmul rate.", "",
             "## Stages", "", "| stage | seconds | training tokens/s | machine GFLOP/s | run folder |",
             "|---|---|---|---|---|"]
    for name, s in r["stages"].items():
        tps = f"{s['tokens_per_s']:.0f}" if s.get("tokens_per_s") else "–"
        gf = f"{s['matmul_gflop_per_s']:.0f}" if s.get("matmul_gflop_per_s") else "–"
        lines.append(f"| {name} | {s['seconds']:.0f} | {tps} | {gf} | {stage_folder(out, name)} |")
    total, summed = wall_seconds(r["stages"]), sum(s["seconds"] for s in r["stages"].values())
    rates = [s["matmul_gflop_per_s"] for s in r["stages"].values() if s.get("matmul_gflop_per_s")]
    lines += ["", f"Total: {total / 60:.1f} minutes of wall time while stages ran; the stage times add up to "
              f"{summed / 60:.1f}."]
    if rates:
        lines.append(f"The matmul rate ranged {min(rates):.0f}-{max(rates):.0f} GFLOP/s over {len(rates)} stages.")
    return [*lines, "Settings: [profile.yaml](profile.yaml); logs in [logs/](logs)."]


def wall_seconds(stages: dict[str, dict]) -> float:
    """The wall time the stages covered: the union of their [started_at, finished_at] spans (stages run side by side
    count once; the gaps between a pipeline's interrupted and resumed runs not at all). Records without the times
    (older ones) add their seconds."""
    spans = sorted((s["started_at"], s["finished_at"]) for s in stages.values() if "finished_at" in s
                   and "started_at" in s)
    total, end = 0.0, float("-inf")
    for a, b in spans:
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total + sum(s["seconds"] for s in stages.values() if "finished_at" not in s or "started_at" not in s)
