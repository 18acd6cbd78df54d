"""Nothing is written before the settings are checked: a Hydra callback (conf/train.yaml and conf/evaluate.yaml,
`hydra.callbacks.check_first`) that checks each job's config as Hydra will run it, before Hydra makes the run folder,
its `.hydra/` and its log (Hydra calls `on_run_start` and `on_multirun_start` before any of them).

For every job (a multirun's, each expanded as Hydra's basic sweeper will): its run folder (lmcal.utils.lock's folder
rule: no system folder, home, project or package, however spelt; and no symbolic link inside it, nor inside the sweep
folder, lmcal.utils.safe_paths), its required settings (a `~key` deletion is
refused, naming the key), every interpolation, the ranges and sizes (lmcal.utils.validate), the entry point's own
checks (`check_settings` of lmcal.train and lmcal.evaluate) and the W&B mode. The first problem stops the command
with one paragraph (LmcalError) and nothing anywhere written.
"""

from __future__ import annotations

import copy
import importlib
import os
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from lmcal.errors import LmcalError
from lmcal.utils.boundary import MADE, explain, fail
from lmcal.utils.lock import check_output_folder, live_holder
from lmcal.utils.rules import RULES
from lmcal.utils.safe_paths import check_no_links

# the keys a command line may delete (`~key`): choices of a config group that may be absent
DELETABLE = {"lmcal.train": ("logger", "experiment"), "lmcal.evaluate": ("logger", "model", "decoder")}


def deleted_required(entry: str, overrides: list[str]) -> str | None:
    """The paragraph refusing the `~key` overrides that delete a setting `entry` needs, or None."""
    keys = [o[1:].split("=", 1)[0] for o in overrides if o.startswith("~")]
    bad = [k for k in keys if k.split(".")[0] not in DELETABLE.get(entry, ()) and not k.startswith("hydra.")]
    if not bad:
        return None
    named = []
    for k in bad:
        meaning = next((m for p, (_, m) in RULES.items() if p == k), None)
        named.append(f"~{k}" + (f" ({meaning})" if meaning else ""))
    s = "s" if len(bad) > 1 else ""
    return (f"Cannot delete the setting{s} {', '.join(named)}: python -m {entry} needs {'them' if s else 'it'}, and "
            "without a value the code's own default would run in its place, silently. Nothing was run or written. "
            f"Give {'them values' if s else 'it a value'} instead ({', '.join(f'{k}=VALUE' for k in bad)}), or "
            "choose another preset.")


def _overrides(config: DictConfig) -> list[str]:
    """The command line's overrides as typed: an interpolation in one (data.root=${oc.env:X}) is not resolved here but
    where its setting is, so that an error names the setting."""
    return list(OmegaConf.to_container(config.hydra.overrides.task, resolve=False))


def job_config(config: DictConfig, out: Path) -> tuple[DictConfig, DictConfig]:
    """(the job's whole config, its task config) as it will run in `out`: hydra.runtime.output_dir and
    paths.output_dir set, so that every interpolation resolves, without touching the disk."""
    full = copy.deepcopy(config)
    with read_write(full.hydra.runtime), open_dict(full.hydra.runtime):
        full.hydra.runtime.output_dir = str(out)
    task = copy.deepcopy(full)
    with read_write(task), open_dict(task):
        del task["hydra"]
        if isinstance(task.get("paths"), DictConfig):
            task.paths.output_dir = str(out)
    return full, task


def _entry_module(entry: str):
    """The entry point's module: this process's __main__ where it is that entry point (not imported twice)."""
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) == entry:
        return main
    return importlib.import_module(entry)


def check_job(entry: str, config: DictConfig, out: Path, where: str = "") -> None:
    """Every check of one job, before anything of it is written (raises LmcalError)."""
    try:
        check_output_folder(out)
        check_no_links(out)  # (.hydra, the log, checkpoints/, ...: nothing written through a link in it)
        if held := live_holder(out, above=False):  # (Hydra would rewrite that run's .hydra/ before the lock refused)
            lock, h = held
            raise LmcalError(f"{out} is in use by another lmcal {h.get('what', 'run')}: process {h.get('pid')} on "
                             f"{h.get('host')}, started {h.get('started', '?')} ({h.get('command', '?')}). Two runs "
                             "writing one folder would mix their logs, checkpoints and results; nothing was written. "
                             "Wait for it to finish, or give this run another folder (hydra.run.dir=...). If no such "
                             f"process runs, delete {lock}.")
        if why := deleted_required(entry, _overrides(config)):
            raise LmcalError(why)
        full, cfg = job_config(config, out)
        before = HydraConfig.instance().cfg
        HydraConfig.instance().set_config(full)  # (an interpolation ${hydra:...} of the user's resolves as in the run)
        try:
            OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)  # every interpolation
            _entry_module(entry).check_settings(cfg)
        finally:
            HydraConfig.instance().cfg = before
    except LmcalError as e:
        if where:
            raise LmcalError(f"{where}: {e}") from None
        raise


def _folder(value) -> Path:
    """A run folder as Hydra will make it: relative to the current folder (links and .. resolved for the check)."""
    return Path(os.path.abspath(str(value)))


def sweep_jobs(config: DictConfig) -> list[tuple[list[str], DictConfig]]:
    """(overrides, config) of every job of the multirun `config`, expanded as Hydra's basic sweeper does (its
    hydra.sweeper.params, then the command line's sweeps); [] for another sweeper, which expands them itself."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not str(config.hydra.sweeper.get("_target_", "")).endswith("BasicSweeper"):
        return []
    loader = GlobalHydra.instance().config_loader()
    params = [f"{k}={v}" for k, v in (config.hydra.sweeper.get("params") or {}).items()]
    parsed = OverridesParser.create(config_loader=loader).parse_overrides(
        params + _overrides(config))
    jobs = []
    for num, overrides in enumerate(o for batch in BasicSweeper.split_arguments(parsed, None) for o in batch):
        job = loader.load_sweep_config(config, list(overrides))
        with open_dict(job):
            job.hydra.job.id, job.hydra.job.num = num, num
        jobs.append((list(overrides), job))
    return jobs


class PrecheckBug(BaseException):
    """A bug in the checks themselves: raised past Hydra, which would turn a callback's Exception into a warning and
    run the job anyway."""


class CheckFirst(Callback):
    """The Hydra callback: `entry` is the command it checks for (lmcal.train, lmcal.evaluate). A problem ends the
    process here, with one paragraph and exit status 2 (Hydra turns a callback's exceptions into warnings)."""

    def __init__(self, entry: str):
        self.entry = entry

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        _stop_on_problem(self._run, config)

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        _stop_on_problem(self._multirun, config)

    def _run(self, config: DictConfig) -> None:
        before = HydraConfig.instance().cfg
        HydraConfig.instance().set_config(config)
        try:
            out = _folder(config.hydra.run.dir)
        finally:
            HydraConfig.instance().cfg = before
        check_job(self.entry, config, out)
        if not out.exists():  # (with the first of its parents that does not exist either: outputs/evaluate/runs)
            top = out
            while not top.parent.exists() and top.parent != top:
                top = top.parent
            MADE.append((out, top))

    def _multirun(self, config: DictConfig) -> None:
        check_output_folder(_folder(config.hydra.sweep.dir))
        check_no_links(_folder(config.hydra.sweep.dir), "sweep folder")  # (its multirun.yaml, runs.md, jobs)
        for overrides, job in sweep_jobs(config):
            before = HydraConfig.instance().cfg
            HydraConfig.instance().set_config(job)
            try:
                out = _folder(config.hydra.sweep.dir) / str(job.hydra.sweep.subdir)
            finally:
                HydraConfig.instance().cfg = before
            check_job(self.entry, job, out, where=f"Job {job.hydra.job.num} of the multirun ({' '.join(overrides)})")


def _stop_on_problem(check, config: DictConfig) -> None:
    try:
        check(config)
    except Exception as e:
        message = explain(e)
        if message is None:
            raise PrecheckBug(f"{type(e).__name__}: {e}") from e
        fail(message)
