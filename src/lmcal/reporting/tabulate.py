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
from lmcal.utils import records
from lmcal.utils.io import file_name, inside, write_json_atomic, write_text_atomic
from lmcal.utils.records import Maybe, Of, Range

# what the tables and figures read from each result, of its type (lmcal.utils.records: a file that lacks one, or
# holds another type, NaN or Infinity, is refused naming the key); null where a fit had no finite value
NUM = Maybe(float)
MEMORY = {"corpus": str, "tau": Range(1, integer=True), "model": str, "ce_limited_nats": float,
          "mi_upper_bound_nats": NUM, "mi_stderr_nats": NUM, "alpha": NUM, "alpha_stderr": NUM,
          "entropy_calibrated_nats": NUM, "test_tokens": Range(0, integer=True), "cluster_size": Range(1, integer=True),
          "limited?": str, "exact_mi_nats?": NUM, "mi_upper_bound_crossfit_nats?": NUM, "delta_ce_nats?": NUM,
          "delta_ce_stderr_nats?": NUM,
          "two_parameter?": Maybe({"beta": float, "alpha": float, "mi_upper_bound_nats?": NUM, "mi_stderr_nats?": NUM})}
DECODER_ROW = {"method": str, "params": dict, "entrate_ppl": float, "test_ce_nats": NUM, "zero_prob_fraction": float,
               "test_ce_mixed_nats": float, "test_ce_kept_nats": NUM, "entropy_t1_nats": float,
               "entropy_last_nats": float, "stderr_nats": Of(NUM, 1), "tail_diff_nats?": NUM,
               "tail_diff_stderr_nats?": NUM}
DECODERS = {"corpus": str, "rows": Of(DECODER_ROW, 1), "model?": Maybe(str), "reference_test_ce_nats?": NUM}

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


def model_of(r: dict) -> str:
    """The model a memory row bounds: its name without its tau (a trained tau-model's "X, tau=5" is model X)."""
    return str(r["model"]).split(", tau=")[0]


def collect_memory(dirs: list[str | Path]) -> dict[str, list[dict]]:
    """corpus -> memory.json results sorted by model, tau, then P~ (trained before window); of two results for one
    (corpus, model, tau, P~) the newest file wins: rows of two models (a reproduction's AWD-LSTM and transformer
    windows) never replace each other."""
    found: dict[tuple[str, str, int, str], tuple[float, dict]] = {}
    for d in dirs:
        d = Path(d)
        if not d.is_dir():
            raise LmcalError(f"{d} is not a folder; pass the sweep (or run) folders that hold memory.json files.")
        for path in results_under(d, "memory.json"):
            r = records.read(path, MEMORY, "a memory-stage result", "Delete it or rerun that stage; nothing was "
                             "written.")
            key = (r["corpus"], model_of(r), r["tau"], r.get("limited", "trained"))
            r["path"] = str(path)
            mtime = path.stat().st_mtime
            if key in found:
                log.warning(f"two results for {key[1]} on {key[0]} tau={key[2]} ({key[3]} P~): keeping the newer of "
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
            res = records.read(path, DECODERS, "a decoders-stage result", "Delete it or rerun that stage; nothing "
                               "was written.")
            rows, corpus = res["rows"], res["corpus"]
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


def decoders_report(dirs: list[str | Path], out: str | Path, found: dict[str, list[dict]] | None = None) -> dict:
    """Writes decoders_<corpus>.md and .png for the decoder rows under `dirs` (see collect_decoders; `found`: what it
    returned, when the records were read and checked before anything was written)."""

    out = Path(out)
    report = {}
    for corpus, rows in (collect_decoders(dirs) if found is None else found).items():
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


def memory_series(corpus: str, rows: list[dict], oracles: list[dict]) -> dict:
    """The memory figure's series of one corpus: ours per model and P~ (trained first), the estimators on exact
    oracles, the source's exact I_tau, and the paper's (PTB)."""
    series = {}
    models = list(dict.fromkeys(map(model_of, rows)))
    for model in models:
        for lim in dict.fromkeys(r.get("limited", "trained") for r in rows if model_of(r) == model):
            mine = [r for r in rows if model_of(r) == model and r.get("limited", "trained") == lim]
            label = f"ours ({model}, {lim} P̃)" if len(models) > 1 else f"ours ({lim} P̃)"
            series[label] = ([r["tau"] for r in mine], [r["mi_upper_bound_nats"] for r in mine],
                             [r["mi_stderr_nats"] for r in mine])
    orc = sorted(oracles, key=lambda r: r["tau"])
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
    return series


def memory_tables(rows: list[dict]) -> str:
    """The memory table of one corpus; with rows of several models, one table a model under its name."""
    models = list(dict.fromkeys(map(model_of, rows)))
    if len(models) == 1:
        return memory_table(rows)
    return "\n".join(f"## {m}\n\n{memory_table([r for r in rows if model_of(r) == m])}" for m in models)


def memory_report(dirs: list[str | Path], out: str | Path | None = None, wandb_mode: str = "offline",
                  project: str = "lmcal", group: str | None = None, oracles: dict[str, list[dict]] | None = None,
                  found: dict[str, list[dict]] | None = None) -> dict:
    """Collects the tau results under `dirs` (`found`: collect_memory's, read and checked already) and writes the
    tables, figures and `memory_report.json` into `out`. `oracles`: {corpus: rows} of the same estimators on exact
    oracles (a reproduction's Markov check), drawn beside."""
    by_corpus = collect_memory(dirs) if found is None else found
    if not by_corpus:
        raise LmcalError(f"No memory.json under {', '.join(map(str, dirs))}: run the tau models with "
                         "analysis.stages=[memory] memory.base_ckpt=PATH, or `python -m lmcal.evaluate "
                         "stages=[memory]` on their checkpoints, first.")
    out = Path(out or dirs[0])
    out.mkdir(parents=True, exist_ok=True)
    report = {}
    for corpus, rows in by_corpus.items():
        table = memory_tables(rows)
        name = _file_name(corpus, rows)
        png = memory_figure(memory_series(corpus, rows, (oracles or {}).get(corpus, [])),
                            inside(out, out / f"memory_{name}.png"),
                            title=f"{' and '.join(dict.fromkeys(map(model_of, rows)))} on {corpus}: the information "
                                  "the model draws from beyond tau tokens back (an upper bound)",
                            ylabel="upper bound on the model's I_tau (nats)")
        write_text_atomic(inside(out, out / f"memory_{name}.md"), f"# Memory bound on {corpus}\n\n{table}\n"
                                                                  f"![I_tau bound against tau](memory_{name}.png)\n")
        report[corpus] = {"rows": [{"model": model_of(r)} | {k: r[k] for k in (
                                       "tau", "ce_limited_nats", "mi_upper_bound_nats", "mi_stderr_nats", "alpha",
                                       "alpha_stderr", "entropy_calibrated_nats", "path")}
                                   | {k: r.get(k, "trained" if k == "limited" else None) for k in (
                                       "limited", "mi_upper_bound_crossfit_nats", "delta_ce_nats",
                                       "two_parameter")} for r in rows],
                          "table_md": str(out / f"memory_{name}.md"), "figure": str(png)}
        print(f"{corpus}:\n{table}")
    write_json_atomic(inside(out, out / "memory_report.json"), report)
    if wandb_mode != "disabled":
        _log_wandb(report, out, wandb_mode, project, group or runs_group(by_corpus))
    return report


def runs_group(by_corpus: dict[str, list[dict]]) -> str | None:
    """The W&B group the reported runs logged to (their records' wandb_group: a sweep's or a reproduction's) where
    they share one; None where they have none or several (the report's own default, by model and dataset)."""
    groups = {r.get("wandb_group") for rows in by_corpus.values() for r in rows}
    return groups.pop() if len(groups) == 1 else None


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
