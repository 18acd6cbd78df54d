"""Checksummed downloads: a file's digest, a fetch that fails as one paragraph, and a download into a folder that
leaves nothing behind unless every file arrived whole and checked.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import urllib.request
from pathlib import Path

from lmcal.errors import DataError


def digest(path: Path, h) -> str:
    """The hex digest of a file's bytes with the hashlib object h, read 1 MiB at a time."""
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sha256(path: Path) -> str:
    return digest(path, hashlib.sha256())


def md5(path: Path) -> str:
    return digest(path, hashlib.md5())


def supply_hint(folder: Path, files: dict[str, str], release: str, subfolder: str, url: str) -> str:
    """The one paragraph that ends every missing-or-corrupt corpus error: the three ways to supply the files."""
    train, valid, test = files.values()
    return (f"Supply the files by putting {train}, {valid} and {test} ({release}) in {folder}, by pointing data.root= "
            f"(or $LMCAL_DATA_ROOT) at a folder that holds {subfolder}/, or by running with data.download=true on a "
            f"machine with a network ({url}).")


def download_into(folder: Path, fetch) -> None:
    """fetch(tmp) in a temporary folder inside `folder`; on failure no folder this call made is left behind.

    fetch moves its files into `folder` only once all of them are checked, so a failure writes nothing there.
    """
    made = [p for p in [folder, *folder.parents] if not p.exists()]  # the folders this call creates
    folder.mkdir(parents=True, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
            fetch(Path(tmp))
    except BaseException:
        for p in made:  # innermost first
            if p.is_dir() and not any(p.iterdir()):
                p.rmdir()
        raise


def fetch_url(url: str, archive: Path, title: str, hint: str) -> None:
    """url's bytes into the file `archive`; an unreachable url is one DataError that ends with `hint`."""
    try:
        with urllib.request.urlopen(url, timeout=60) as r, open(archive, "wb") as f:
            shutil.copyfileobj(r, f)
    except OSError as e:
        raise DataError(f"Could not download {title} from {url}: {e}. " + hint) from None
