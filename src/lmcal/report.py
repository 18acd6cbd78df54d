"""Aggregation of per-run results: the paper's Section 5 table and Figure 4, and decoder sweeps.

    python -m lmcal.report outputs/ptb_tau/multiruns/2026-11-22_10-00-00 [more dirs] [--out DIR] [--wandb offline]

Finds every `memory.json` under the given folders (written by the memory stage of each tau run, or by
`python -m lmcal.evaluate stages=[memory]`), groups them by corpus, and writes into --out (default: the first folder)
`memory_<corpus>.md` (ours beside the paper's), `memory_<corpus>.png` (the bound against tau) and
`memory_report.json`, and logs the tables and figures to Weights & Biases (offline by default).

Every `decoders.json` under them (a decoders stage, or each job of a sweep such as `python -m lmcal.evaluate -m
stages=[decoders] decoder=top_p decoder.p=0.8,0.9,0.95`) goes into one table per corpus, `decoders_<corpus>.md`, and
`decoders_<corpus>.png`: each setting's entropy at the horizon against its held-out cost, beside calibration's.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from lmcal import paper
from lmcal.errors import LmcalError
from lmcal.plots import decoders_tradeoff_figure, memory_figure
from lmcal.utils import format_ce, format_params, write_json_atomic, write_text_atomic

log = logging.getLogger("lmcal")


def table1_markdown(rows: list[dict]) -> str:
    """The paper's Table 1 layout: model, corpus, test ppl, EntRate (= exp of the last step's entropy)."""
    lines = ["| model | corpus | test ppl | EntRate |", "|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['corpus']} | {r['test_ppl']:.1f} | {r['entrate_ppl']:.1f} |" for r in rows]
    return "\n".join(lines) + "\n"


def _tail_diff(r: dict) -> str:
    """The paired difference from the plain model over the last tenth of the horizon, '± se' (– if not measured)."""
    if r.get("tail_diff_nats") is None:
        return "–"
    return f"{r['tail_diff_nats']:+.3f} ± {r['tail_diff_stderr_nats']:.3f}"


def decoders_table(rows: list[dict]) -> str:
    """Markdown: one row per method, entropies of the t = 1 and last generated words, EntRate, the paired difference
    of the last tenth's mean entropy from the plain model (± se, clustered by prefix) and held-out costs."""
    lines = ["| method | parameters | entropy t=1 (nats) | entropy t=horizon (nats) | EntRate | "
             "Δ entropy, last tenth, vs model (nats) | test CE (nats) | zero-prob. fraction | CE on kept words | "
             "CE, ε-mixed |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {format_params(r['params'])} | {r['entropy_t1_nats']:.3f} | "
                     f"{r['entropy_last_nats']:.3f} | {r['entrate_ppl']:.1f} | {_tail_diff(r)} | "
                     f"{format_ce(r['test_ce_nats'])} | {r['zero_prob_fraction']:.4f} | "
                     f"{format_ce(r['test_ce_kept_nats'])} | {format_ce(r['test_ce_mixed_nats'])} |")
    return "\n".join(lines) + "\n"


def collect_memory(dirs: list[str | Path]) -> dict[str, list[dict]]:
    """corpus -> memory.json results sorted by tau, then P~ (trained before window); of two results for one (corpus,
    tau, P~) the newest file wins."""
    found: dict[tuple[str, int, str], tuple[float, dict]] = {}
    for d in dirs:
        d = Path(d)
        if not d.is_dir():
            raise LmcalError(f"{d} is not a folder; pass the sweep (or run) folders that hold memory.json files.")
        for path in sorted(d.rglob("memory.json")):
            try:
                r = json.loads(path.read_text())
                key = (r["corpus"], int(r["tau"]), r.get("limited", "trained"))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise LmcalError(f"{path} is not a memory-stage result ({e}); delete it or rerun that stage.") from None
            r["path"] = str(path)
            mtime = path.stat().st_mtime
            if key in found:
                log.warning(f"two results for {key[0]} tau={key[1]} ({key[2]} P~): keeping the newer of "
                            f"{found[key][1]['path']} and {path}")
            if key not in found or mtime >= found[key][0]:
                found[key] = (mtime, r)
    by_corpus: dict[str, list[dict]] = {}
    for (corpus, *_), (_, r) in sorted(found.items()):
        by_corpus.setdefault(corpus, []).append(r)
    return by_corpus


def _pm(r: dict | None, key: str, se: str, digits: int = 4) -> str:
    """'value ± se' of r[key] (– where the result does not have it: a memory.json from before the key existed)."""
    if not r or r.get(key) is None:
        return "–"
    return f"{r[key]:.{digits}f}" + (f" ± {r[se]:.{digits}f}" if r.get(se) is not None else "")


def memory_table(rows: list[dict]) -> str:
    """Markdown: per tau and limited model P~ (trained tau-model, or the base model on tau-token windows): CE(P||P~),
    ΔCE, the I_tau bound (± 1 se) fitted on the reported rows, cross-fitted, alpha*, and the two-parameter variant
    (beta*, alpha* and its bound); the paper's values beside ours (PTB), the exact I_tau beside (Markov source)."""
    ptb = rows[0]["corpus"] == "ptb"
    exact = any(r.get("exact_mi_nats") is not None for r in rows)
    cols = ["tau", "P̃", "CE(P‖P̃)", "ΔCE", "I_tau upper bound", "cross-fitted", "alpha*", "with temperature",
            "beta*, alpha*"]
    after = (2, 4, 6)  # ours whose paper's value follows (PTB): CE(P‖P̃), the bound, alpha*
    if ptb:
        cols = [c for i, col in enumerate(cols) for c in ([col, "paper"] if i in after else [col])]
    if exact:
        cols.append("exact I_tau")
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        two = r.get("two_parameter")
        cells = [str(r["tau"]), r.get("limited", "trained"), f"{r['ce_limited_nats']:.4f}", _pm(r, "delta_ce_nats",
                 "delta_ce_stderr_nats"), _pm(r, "mi_upper_bound_nats", "mi_stderr_nats"),
                 _pm(r, "mi_upper_bound_crossfit_nats", ""), _pm(r, "alpha", "alpha_stderr", 5),
                 _pm(two, "mi_upper_bound_nats", "mi_stderr_nats"),
                 f"{two['beta']:.4f}, {two['alpha']:.5f}" if two else "–"]
        if ptb:
            p = paper.MEMORY_PTB.get(int(r["tau"]))
            theirs = [f"{v:.4f}" if i < 2 else f"{v:.5f}" for i, v in enumerate(p)] if p else ["–"] * 3
            cells = [c for i, cell in enumerate(cells) for c in ([cell, theirs[after.index(i)]] if i in after
                                                                  else [cell])]
        if exact:
            cells.append("–" if r.get("exact_mi_nats") is None else f"{r['exact_mi_nats']:.4f}")
        lines.append("| " + " | ".join(cells) + " |")
    r0 = rows[0]
    lines.append("")
    lines.append(f"Nats per token on {r0['test_tokens']:,} test tokens. P̃: trained = the τ-model, window = the base "
                 "model itself fed only the last τ tokens. alpha* of P̂·P̃^alpha is fitted on the rows the bound is "
                 "reported on, so the bound is the mean KL(P̂_alpha*‖P̃) ≥ 0; ± is one standard error: a "
                 f"delete-one-block jackknife over blocks of {r0['cluster_size']:,} positions with alpha refitted in "
                 "each replicate. Cross-fitted: alpha* fitted on one half of the blocks, the bound scored on the "
                 "other, both ways. ΔCE = CE(P‖P̃) − CE(P‖P̂). With temperature: P̂^beta·P̃^alpha fitted jointly, so "
                 "a mere sharpening of P̂ does not count as memory.")
    return "\n".join(lines) + "\n"


def collect_decoders(dirs: list[str | Path]) -> dict[str, list[dict]]:
    """corpus -> decoder rows of every decoders.json under `dirs`, one row per (method, settings): the plain model and
    the fitted rows appear in many runs of a sweep, and are kept once (the newest)."""
    found: dict[tuple, tuple[float, dict]] = {}
    for d in dirs:
        for path in sorted(Path(d).rglob("decoders.json")):
            try:
                res = json.loads(path.read_text())
                rows, corpus = res["rows"], res["corpus"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise LmcalError(f"{path} is not a decoders-stage result ({e}); delete it or rerun that "
                                 "stage.") from None
            mtime = path.stat().st_mtime
            for r in rows:
                params = {k: v for k, v in r["params"].items() if "stderr" not in k}
                fitted = r["method"] in ("fitted_temperature", "calibration")  # one per model, whatever its value
                key = (corpus, res.get("model"), r["method"], json.dumps({} if fitted else params, sort_keys=True))
                if key not in found or mtime >= found[key][0]:
                    found[key] = (mtime, {**r, "path": str(path)})
    by_corpus: dict[str, list[dict]] = {}
    for (corpus, *_), (_, r) in sorted(found.items(), key=lambda kv: tuple(map(str, kv[0]))):
        by_corpus.setdefault(corpus, []).append(r)
    return by_corpus


def decoders_report(dirs: list[str | Path], out: str | Path) -> dict:
    """Writes decoders_<corpus>.md and .png for the decoder rows under `dirs` (see collect_decoders)."""

    out = Path(out)
    report = {}
    for corpus, rows in collect_decoders(dirs).items():
        out.mkdir(parents=True, exist_ok=True)
        table = decoders_table(rows)
        png = decoders_tradeoff_figure(rows, out / f"decoders_{corpus}.png",
                                       title=f"Decoders on {corpus}: flatness against held-out cost")
        write_text_atomic(out / f"decoders_{corpus}.md", f"# Decoders on {corpus}\n\n{table}\n"
                                                         f"![entropy at the horizon against test CE]"
                                                         f"(decoders_{corpus}.png)\n")
        report[corpus] = {"rows": [{k: r[k] for k in ("method", "params", "entrate_ppl", "test_ce_nats",
                                                      "zero_prob_fraction", "test_ce_mixed_nats", "path")}
                                   for r in rows], "table_md": str(out / f"decoders_{corpus}.md"), "figure": str(png)}
        print(f"{corpus} decoders:\n{table}")
    return report


def memory_report(dirs: list[str | Path], out: str | Path | None = None, wandb_mode: str = "offline",
                  project: str = "lmcal", group: str | None = None) -> dict:
    """Collects the tau results under `dirs` and writes the tables, figures and `memory_report.json` into `out`."""
    by_corpus = collect_memory(dirs)
    if not by_corpus:
        raise LmcalError(f"No memory.json under {', '.join(map(str, dirs))}: run the tau models with "
                         "analysis.stages=[memory] memory.base_ckpt=PATH, or `python -m lmcal.evaluate "
                         "stages=[memory]` on their checkpoints, first.")
    out = Path(out or dirs[0])
    out.mkdir(parents=True, exist_ok=True)
    report = {}
    for corpus, rows in by_corpus.items():
        table = memory_table(rows)
        series = {}
        for lim in dict.fromkeys(r.get("limited", "trained") for r in rows):  # trained first
            mine = [r for r in rows if r.get("limited", "trained") == lim]
            series[f"ours ({lim} P̃)"] = ([r["tau"] for r in mine], [r["mi_upper_bound_nats"] for r in mine],
                                         [r["mi_stderr_nats"] for r in mine])
        if corpus == "ptb":
            taus = sorted(paper.MEMORY_PTB)
            series["paper (AWD-LSTM, 500 epochs)"] = (taus, [paper.MEMORY_PTB[t][1] for t in taus], None)
        png = memory_figure(series, out / f"memory_{corpus}.png",
                            title=f"{rows[0]['model'].split(', tau=')[0]} on {corpus}: information from beyond "
                                  "tau tokens back")
        write_text_atomic(out / f"memory_{corpus}.md", f"# Memory bound on {corpus}\n\n{table}\n"
                                                       f"![I_tau bound against tau](memory_{corpus}.png)\n")
        report[corpus] = {"rows": [{k: r[k] for k in ("tau", "ce_limited_nats", "mi_upper_bound_nats",
                                                      "mi_stderr_nats", "alpha", "alpha_stderr",
                                                      "entropy_calibrated_nats", "path")}
                                   | {k: r.get(k, "trained" if k == "limited" else None) for k in (
                                       "limited", "mi_upper_bound_crossfit_nats", "delta_ce_nats",
                                       "two_parameter")} for r in rows],
                          "table_md": str(out / f"memory_{corpus}.md"), "figure": str(png)}
        print(f"{corpus}:\n{table}")
    write_json_atomic(out / "memory_report.json", report)
    if wandb_mode != "disabled":
        _log_wandb(report, out, wandb_mode, project, group)
    return report


def _log_wandb(report: dict, out: Path, mode: str, project: str, group: str | None) -> None:
    import wandb

    run = wandb.init(project=project, group=group, job_type="report", name="memory_report", mode=mode, dir=str(out),
                     reinit="finish_previous")
    try:
        for corpus, r in report.items():
            cols = ["tau", "limited", "ce_limited_nats", "delta_ce_nats", "mi_upper_bound_nats", "mi_stderr_nats",
                    "mi_upper_bound_crossfit_nats", "alpha"]
            data = [[x[c] for c in cols] for x in r["rows"]]
            run.log({f"memory/{corpus}/table": wandb.Table(columns=cols, data=data),
                     f"memory/{corpus}/figure": wandb.Image(r["figure"])})
    finally:
        run.finish()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lmcal.report", description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+", help="sweep or run folders holding memory.json files (searched recursively)")
    ap.add_argument("--out", help="where to write the tables and figures (default: the first folder)")
    ap.add_argument("--wandb", default="offline", choices=["offline", "online", "disabled"])
    ap.add_argument("--project", default="lmcal")
    ap.add_argument("--group")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        for d in args.dirs:
            if not Path(d).is_dir():
                raise LmcalError(f"{d} is not a folder; pass the sweep (or run) folders that hold memory.json or "
                                 "decoders.json files.")
        out = Path(args.out or args.dirs[0])
        decoders = decoders_report(args.dirs, out)
        if decoders:
            write_json_atomic(out / "decoders_report.json", decoders)
        if decoders and not collect_memory(args.dirs):
            return  # a decoder sweep: nothing else to aggregate
        memory_report(args.dirs, args.out, args.wandb, args.project, args.group)
    except LmcalError as e:
        print(f"lmcal: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
