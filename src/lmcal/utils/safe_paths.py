"""Writes that stay where they are meant to: no symbolic link inside a run or output folder (lmcal, Hydra, Lightning
and W&B would write through it, into wherever it points), no file replaced where a link stands, and every name a
setting gives a folder or file one plain name (no separator, not . or ..), so that nothing lands, or is removed,
outside its folder.

    check_no_links(folder, what)   refuses a folder that holds a symbolic link (W&B's own in its wandb/ folder and
                                   submitit's own to its submission scripts aside)
    check_not_link(path)           refuses to replace a file that is a symbolic link
    name_problem(value, ...)       why a value is not one plain name, or None
    check_name(value, setting)     refuses a setting whose value is not one plain name
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from lmcal.errors import LmcalError

MAX_NAME = 100  # characters of a name that becomes a folder's or file's name
# the links W&B makes in its wandb/ folder, each replaced, never written through, by W&B itself: to its latest run
# and that run's logs (leading inside wandb/), and in each run's logs/ to its core's log in W&B's cache
WANDB_LINKS = ("latest-run", "debug.log", "debug-internal.log")
WANDB_RUN = re.compile(r"(offline-)?run-[0-9]{8}_[0-9]{6}-[a-z0-9]+")
# the link submitit leaves where it wrote a job's script before submitting it, to the script it moved it to
SUBMITIT_LINK = re.compile(r"\.submission_file_[0-9a-f]{32}\.sh")


def _target(link: Path) -> str:
    try:
        return os.readlink(link)
    except OSError:
        return "?"


def _wandb_own(link: Path, root: Path) -> bool:
    """Whether `link` (inside `root`, reached through no link) is one of W&B's own in a wandb/ folder (WANDB_LINKS,
    leading inside that folder, or a run's logs/debug-core.log)."""
    parts = link.relative_to(root).parts
    if "wandb" not in parts[:-1]:
        return False
    at = len(parts) - 1 - parts[:-1][::-1].index("wandb")  # (the innermost wandb/ above it)
    wandb, rest = root.joinpath(*parts[:at]), parts[at:]
    if len(rest) == 1 and rest[0] in WANDB_LINKS:
        return link.resolve().is_relative_to(wandb.resolve())
    return len(rest) == 3 and bool(WANDB_RUN.fullmatch(rest[0])) and rest[1:] == ("logs", "debug-core.log")


def _submitit_own(link: Path, root: Path) -> bool:
    """Whether `link` is submitit's own (SUBMITIT_LINK), to a plain file inside `root`: writes never go through it."""
    if not SUBMITIT_LINK.fullmatch(link.name):
        return False
    target = link.resolve()
    return target.is_file() and not target.is_symlink() and target.is_relative_to(root.resolve())


def links_inside(folder: str | Path) -> list[Path]:
    """Every symbolic link inside `folder`, at any depth (links are not followed), but W&B's own (WANDB_LINKS) and
    submitit's (SUBMITIT_LINK)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for top, dirs, files in os.walk(folder, followlinks=False):
        for name in sorted(dirs) + sorted(files):
            p = Path(top) / name
            if p.is_symlink() and not (_wandb_own(p, folder) or _submitit_own(p, folder)):
                found.append(p)
    return found


def check_no_links(folder: str | Path, what: str = "run folder") -> None:
    """Refuses (LmcalError) a `folder` that holds a symbolic link, naming the first and where it points: a link
    named checkpoints, train.log, .hydra, logs, stages, wandb, metrics.json or a stage's folder would send the run's
    writes (or a FORCE rerun's removals) into the place it points to. The folder itself may be a link."""
    links = links_inside(folder)
    if not links:
        return
    link = links[0]
    more = f" (and {len(links) - 1} more: {', '.join(str(p) for p in links[1:4])}{', ...' if len(links) > 4 else ''})"
    raise LmcalError(f"{link} is a symbolic link (to {_target(link)}) inside the {what} {Path(folder)}"
                     f"{more if len(links) > 1 else ''}. lmcal, Hydra and Lightning write their files there (.hydra/, "
                     "the log, checkpoints/, the records and figures, wandb/, the stages' folders) and would write "
                     "through it, into where it points. Nothing was written. Remove the link (rm, which leaves what it "
                     "points to alone) or give the run another folder.")


def check_not_link(path: str | Path) -> None:
    """Refuses to replace `path` where it is a symbolic link: a file lmcal writes is its own, in its folder."""
    path = Path(path)
    if path.is_symlink():
        raise LmcalError(f"Refusing to write {path}: it is a symbolic link (to {_target(path)}), and lmcal writes its "
                         "files only in place of plain files, never where a link stands. Nothing was written there. "
                         "Remove the link (rm, which leaves what it points to alone) and rerun.")


_NAME_CHARS = re.compile(r"[A-Za-z0-9._+-]+")


def name_problem(value, max_len: int = MAX_NAME, strict: bool = False) -> str | None:
    """Why `value` cannot be one folder's or file's name, or None: it must be a non-empty string (or integer) with no
    / or \\, not . or .., no control characters, at most `max_len` characters; `strict`: only letters, digits and
    . _ + -."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return f"it is {type(value).__name__ if value is not None else 'null'}, not a name"
    text = str(value)
    if not text:
        return "it is empty"
    if len(text) > max_len:
        return f"it has {len(text):,} characters (at most {max_len})"
    if "/" in text or "\\" in text:
        return "it holds a path separator (/ or \\)"
    if text in (".", ".."):
        return f"{text} names a folder itself, or the one above"
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in text):
        return "it holds a control character"
    if strict and not _NAME_CHARS.fullmatch(text):
        return "it holds characters other than letters, digits and . _ + -"
    return None


def show(value) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 60 else f"{text[:40]}... ({len(text):,} characters)"


def check_name(value, setting: str, max_len: int = MAX_NAME, strict: bool = False, becomes: str = "a folder") -> None:
    """Refuses (LmcalError) a `setting` whose value is not one plain name (name_problem)."""
    why = name_problem(value, max_len, strict)
    if why:
        raise LmcalError(f"{setting}={show(value)} cannot be used: {why}. Its value becomes {becomes}'s name, so it "
                         f"must be one plain name (no / or \\, not . or .., no control characters, at most {max_len} "
                         "characters" + (", only letters, digits and . _ + -" if strict else "") + "), which keeps "
                         "every write and removal inside its folder. Nothing was run or written. Give it a plain "
                         "name.")
