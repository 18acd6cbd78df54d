"""`make reproduce`: every result of the paper this project reproduces, in one resumable pipeline.

    python -m lmcal.reproduce [profile=auto|paper|paper_mini|paper_full|cpu|smoke|scale|scale_gpu] [out=DIR]
                            [key=value ...]

The profile (conf/reproduce/<profile>.yaml; `auto` is `paper` with CUDA, else `cpu`) names the overrides of each
stage; `key=value` pairs override the profile (OmegaConf dot-list, e.g. `taus=[5,10]`). Stages, in order:

    base              train the full model (python -m lmcal.train)
    tau_models        train the tau-limited models (a Hydra multirun: hydra/launcher= spreads it)
    entropy_rate      Table 1 row and Figure 2 (python -m lmcal.evaluate stages=[entropy_rate])
    calibration       alpha*, test ppl before/after, Figure 3
    decoders          temperature, top-k, top-p, typical, eta, min-p, Mirostat beside fitted temperature and calibration
    memory_tau<T>     the I_tau bound for each tau, P~ the tau-model
    memory_window_tau<T>  the same with P~ the base model itself on tau-token windows (windows: true)
                      then the same on data=markov (markov_*)
    transformer_*     a transformer trained on the same text (profile key `transformer`): its stages, and its
                      memory bound on tau-token windows (Table 1's second row, Figure 4's transformer column)
    report            results.json, REPORT.md, memory tables and Figure 4

The scale profiles (scale on 2 CPU cores, scale_gpu on one GPU) run the scale sweeps instead: every job of each
sweep's Hydra grid a stage, then the scale table and fit (lmcal.pipeline.scale_sweep, lmcal.reporting.scale_report).

Each stage runs as its own process (lmcal.pipeline: up to `jobs` at once, where they do not depend on each other)
with its log in <out>/logs/<stage>.log and records completion in <out>/stages/<stage>.json (written atomically,
after its outputs). A rerun skips recorded stages, and a training
that was killed resumes from its last checkpoint; the seeds make the results the same as an uninterrupted run's.
"""

from __future__ import annotations

import os
import sys

from lmcal.utils.boundary import Stopped, boundary, stop_on_signals


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return
    try:
        with boundary(), stop_on_signals():
            watched = os.environ.get("LMCAL_WATCH_PID", "")
            if watched.isdigit():  # started by `make reproduce`: end with make, not run on as an orphan
                from lmcal.pipeline.signals import watch_parent

                watch_parent(int(watched))
            print(f"lmcal reproduce {' '.join(argv)}: composing and checking every stage's settings (seconds)...",
                  flush=True)  # the first line, before the heavy imports (torch, Hydra, Lightning)
            from lmcal.pipeline.check import check
            from lmcal.pipeline.plan import load_profile
            from lmcal.pipeline.reproduce import reproduce
            from lmcal.pipeline.scale_sweep import check_sweeps, is_sweep_profile, reproduce_sweeps

            cfg = load_profile(argv)
            sweeps = is_sweep_profile(cfg)  # scale, scale_gpu: Hydra grids of trainings (lmcal.pipeline.scale_sweep)
            if cfg.get("check"):  # the plan check alone: composes and sizes every stage, runs nothing
                print(check_sweeps(cfg) if sweeps else check(cfg), flush=True)
                return
            reproduce_sweeps(cfg) if sweeps else reproduce(cfg)
    except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM, SIGHUP: the stages, temporary files and lock are cleaned up
        how = f"Stopped by {e}" if isinstance(e, Stopped) else "Interrupted"
        print(f"{how}: rerun the same command to resume; finished stages are kept.", file=sys.stderr)
        sys.exit(128 + e.signum if isinstance(e, Stopped) else 130)


if __name__ == "__main__":
    main()
