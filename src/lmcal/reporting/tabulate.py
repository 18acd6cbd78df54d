"""Tables over any set of run folders: the paper's Section 5 table and Figure 4 from every memory.json, one decoders
table from every decoders.json (the logic of `python -m lmcal.report`).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

from lmcal import paper
from lmcal.errors import LmcalError
from lmcal.stages.plots import decoders_tradeoff_figure, memory_figure
from lmcal.stages.tables import decoders_table, memory_table
from lmcal.stages.wandb_run import init_args, open_run
from lmcal.utils.io import file_name, inside, write_json_atomic, write_text_atomic

# what the tables and figures read from each result (a file missing one is refused, naming the keys)
MEMORY_KEYS = ("corpus", "tau", "model", "ce_limited_nats", "mi_upper_bound_nats", "mi_stderr_nats", "alpha",
               "alpha_stderr", "entropy_calibrated_nats", "test_tokens", "cluster_size")
DECODER_KEYS = ("method", "params", "entrate_ppl", "test_ce_nats", "zero_prob_fraction", "test_ce_mixed_nats",
                "test_ce_kept_nats", "entropy_t1_nats", "entropy_last_nats", "stderr_nats")


def _missing(r, keys) -> list[str]:
    return [k for k in keys if k not in r] if isinstance(r, dict) else list(keys)

log = logging.getLogger("lmcal")


def _file_name(corpus: str, rows: list[dict]) -> str:
    """The corpus's name in file names (see lmcal.utils.io.file_name), with a warning when it had to change."""
    name = file_name(corpus, rows[0]["path"], "corpus")
    if name != corpus:
        log.warning(f"{rows[0]['path']}: the corpus {corpus!r} is written as {name!r} in file names.")
    return name


def results_under(d: Path, name: str) -> list[Path]:
    """Every stage result called `name` under `d`, but not a reproduction's own record of a stage of that name
    (<out>/stages/decoders.json beside <out>/profile.yaml: status, command and settings, not the stage's results)."""
    return [p for p in sorted(Path(d).rglob(name))
            if not (p.parent.name == "stages" and (p.parent.parent / "profile.yaml").is_file())]


def collect_memory(dirs: list[str | Path]) -> dict[str, list[dict]]:
    """corpus -> memory.json results sorted by tau, then P~ (trained before window); of two results for one (corpus,
    tau, P~) the newest file wins."""
    found: dict[tuple[str, int, str], tuple[float, dict]] = {}
    for d in dirs:
        d = Path(d)
        if not d.is_dir():
            raise LmcalError(f"{d} is not a folder; pass the sweep (or run) folders that hold memory.json files.")
        for path in results_under(d, "memory.json"):
            try:
                r = json.loads(path.read_text())
                if missing := _missing(r, MEMORY_KEYS):
                    raise KeyError(f"it lacks {', '.join(missing)}")
                key = (str(r["corpus"]), int(r["tau"]), r.get("limited", "trained"))
            except (ValueError, KeyError, TypeError) as e:  # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
                raise LmcalError(f"{path} is not a memory-stage result ({str(e).strip(chr(39))}); delete it or "
                                 "rerun that stage.") from None
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


def collect_decoders(dirs: list[str | Path]) -> dict[str, list[dict]]:
    """corpus -> decoder rows of every decoders.json under `dirs`, one row per (model, method, settings): the plain
    model and the fitted rows appear in many runs of a decoder sweep of one checkpoint, and are kept once (the
    newest). A model is its label and its own test CE (two runs of one architecture on other budgets share the label,
    not the CE; a scale sweep lost half its models to the label alone); each row's "model" names it, with its test CE
    where the label is shared."""
    found: dict[tuple, tuple[float, dict]] = {}
    for d in dirs:
        for path in results_under(d, "decoders.json"):
            try:
                res = json.loads(path.read_text())
                rows, corpus = res["rows"], str(res["corpus"])
                bad = [f"row {i} lacks {', '.join(m)}" for i, r in enumerate(rows) if (m := _missing(r, DECODER_KEYS))]
                if bad or not all(isinstance(r["params"], dict) for r in rows):
                    raise KeyError("; ".join(bad[:3]) or "a row's params is not a mapping")
                if not all(isinstance(r["stderr_nats"], list) and r["stderr_nats"] for r in rows):
                    raise TypeError("a row's stderr_nats is not a list (one standard error per generated position)")
            except (ValueError, KeyError, TypeError) as e:
                raise LmcalError(f"{path} is not a decoders-stage result ({str(e).strip(chr(39))}); delete it or "
                                 "rerun that stage.") from None
            mtime = path.stat().st_mtime
            ref = res.get("reference_test_ce_nats")
            model = (str(res.get("model") or "model"), round(ref, 6) if isinstance(ref, (int, float)) else None)
            for r in rows:
                params = {k: v for k, v in r["params"].items() if "stderr" not in k}
                fitted = r["method"] in ("fitted_temperature", "calibration")  # one per model, whatever its value
                key = (corpus, model, r["method"], json.dumps({} if fitted else params, sort_keys=True))
                if key not in found or mtime >= found[key][0]:
                    found[key] = (mtime, {**r, "path": str(path), "model": model})
    by_corpus: dict[str, list[dict]] = {}
    for (corpus, *_), (_, r) in sorted(found.items(), key=lambda kv: tuple(map(str, kv[0]))):
        by_corpus.setdefault(corpus, []).append(r)
    for rows in by_corpus.values():
        labels = Counter(label for label, _ in {r["model"] for r in rows})
        shared = {label for label, n in labels.items() if n > 1}
        for r in rows:
            label, ce = r["model"]
            r["model"] = f"{label} (test CE {ce:.3f})" if label in shared and ce is not None else label
    return by_corpus


def decoders_report(dirs: list[str | Path], out: str | Path) -> dict:
    """Writes decoders_<corpus>.md and .png for the decoder rows under `dirs` (see collect_decoders)."""

    out = Path(out)
    report = {}
    for corpus, rows in collect_decoders(dirs).items():
        out.mkdir(parents=True, exist_ok=True)
        table = decoders_table(rows)
        name = _file_name(corpus, rows)
        png = decoders_tradeoff_figure(rows, inside(out, out / f"decoders_{name}.png"),
                                       title=f"Decoders on {corpus}: flatness against held-out cost")
        write_text_atomic(inside(out, out / f"decoders_{name}.md"), f"# Decoders on {corpus}\n\n{table}\n"
                                                                    f"![entropy at the horizon against test CE]"
                                                                    f"(decoders_{name}.png)\n")
        report[corpus] = {"rows": [{k: r[k] for k in ("model", "method", "params", "entrate_ppl", "test_ce_nats",
                                                      "zero_prob_fraction", "test_ce_mixed_nats", "path")}
                                   for r in rows], "table_md": str(out / f"decoders_{name}.md"), "figure": str(png)}
        print(f"{corpus} decoders:\n{table}")
    return report


def memory_report(dirs: list[str | Path], out: str | Path | None = None, wandb_mode: str = "offline",
                  project: str = "lmcal", group: str | None = None, oracles: dict[str, list[dict]] | None = None
                  ) -> dict:
    """Collects the tau results under `dirs` and writes the tables, figures and `memory_report.json` into `out`.
    `oracles`: {corpus: rows} of the same estimators on exact oracles (a reproduction's Markov check), drawn beside."""
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
        orc = sorted((oracles or {}).get(corpus, []), key=lambda r: r["tau"])
        if orc:  # the estimators on the exact P^ and P~_tau: they must land on the exact I_tau (the check)
            series["the estimators on exact oracles (their check)"] = (
                [r["tau"] for r in orc], [r["mi_upper_bound_nats"] for r in orc], [r["mi_stderr_nats"] for r in orc])
        exact = sorted({r["tau"]: r["exact_mi_nats"] for r in rows if r.get("exact_mi_nats") is not None}.items())
        if exact:  # the Markov source: the exact I_tau beside its bounds, as its table gives it
            series["exact I_tau of the source (what the oracles' bound must equal; the LSTM's bound is on the "
                   "LSTM's own I_tau)"] = ([t for t, _ in exact], [v for _, v in exact], None)
        if corpus == "ptb":
            taus = sorted(paper.MEMORY_PTB)
            shared = sorted(set(taus) & {r["tau"] for r in rows})
            note = "" if shared else f"; tau = {taus[0]}-{taus[-1]}: none of this run's"
            series[f"paper (AWD-LSTM, 500 epochs{note})"] = (taus, [paper.MEMORY_PTB[t][1] for t in taus], None)
        name = _file_name(corpus, rows)
        png = memory_figure(series, inside(out, out / f"memory_{name}.png"),
                            title=f"{rows[0]['model'].split(', tau=')[0]} on {corpus}: the information the model "
                                  "draws from beyond tau tokens back (an upper bound)",
                            ylabel="upper bound on the model's I_tau (nats)")
        write_text_atomic(inside(out, out / f"memory_{name}.md"), f"# Memory bound on {corpus}\n\n{table}\n"
                                                                  f"![I_tau bound against tau](memory_{name}.png)\n")
        report[corpus] = {"rows": [{k: r[k] for k in ("tau", "ce_limited_nats", "mi_upper_bound_nats",
                                                      "mi_stderr_nats", "alpha", "alpha_stderr",
                                                      "entropy_calibrated_nats", "path")}
                                   | {k: r.get(k, "trained" if k == "limited" else None) for k in (
                                       "limited", "mi_upper_bound_crossfit_nats", "delta_ce_nats",
                                       "two_parameter")} for r in rows],
                          "table_md": str(out / f"memory_{name}.md"), "figure": str(png)}
        print(f"{corpus}:\n{table}")
    write_json_atomic(inside(out, out / "memory_report.json"), report)
    if wandb_mode != "disabled":
        _log_wandb(report, out, wandb_mode, project, group)
    return report


def _log_wandb(report: dict, out: Path, mode: str, project: str, group: str | None) -> None:
    import wandb

    node = {"_target_": "WandbLogger", "project": project, "offline": mode != "online"}
    run = open_run(init_args(node, out, job_type="report", name="memory_report", group=group,
                             dataset="+".join(report)))
    try:
        for corpus, r in report.items():
            cols = ["tau", "limited", "ce_limited_nats", "delta_ce_nats", "mi_upper_bound_nats", "mi_stderr_nats",
                    "mi_upper_bound_crossfit_nats", "alpha"]
            data = [[x[c] for c in cols] for x in r["rows"]]
            run.log({f"memory/{corpus}/table": wandb.Table(columns=cols, data=data),
                     f"memory/{corpus}/figure": wandb.Image(r["figure"])})
    finally:
        run.finish()
