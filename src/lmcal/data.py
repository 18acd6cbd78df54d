"""Corpora, batching and the AWD variable-length BPTT sampler (no Lightning here).

A corpus is three 1-D LongTensors of token ids (train/valid/test) and a vocabulary.
Batching is time-major: `batchify` gives [S, B], B contiguous streams.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lmcal.errors import LmcalError

PTB_URL = "http://www.fit.vutbr.cz/~imikolov/rnnlm/simple-examples.tgz"
PTB_FILES = {
    "train": "ptb.train.txt",
    "valid": "ptb.valid.txt",
    "test": "ptb.test.txt",
}
# SHA-256 of Mikolov's simple-examples release (data/ptb.*.txt), as in shared/data/ptb/SHA256SUMS.
PTB_SHA256 = {
    "ptb.train.txt": "fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf",
    "ptb.valid.txt": "c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2",
    "ptb.test.txt": "dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0",
}
PTB_TOKENS = {"train": 929_589, "valid": 73_760, "test": 82_430}
PTB_VOCAB = 10_000
EOS = "<eos>"


class DataError(LmcalError):
    """Missing, corrupt or malformed corpus files."""


@dataclass
class Corpus:
    name: str
    itos: list[str]
    train: torch.Tensor  # [N_train] int64
    valid: torch.Tensor
    test: torch.Tensor
    info: dict = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return len(self.itos)

    def split(self, name: str) -> torch.Tensor:
        return {"train": self.train, "valid": self.valid, "test": self.test}[name]


def default_root() -> Path:
    """`$LMCAL_DATA_ROOT` when set, else `data/` in the project."""
    env = os.environ.get("LMCAL_DATA_ROOT")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / "data"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tokenize_lines(path: Path) -> list[list[str]]:
    """Whitespace tokens of each line, one `<eos>` appended per line."""
    with open(path, encoding="utf-8") as f:
        return [line.split() + [EOS] for line in f]


def build_vocab(lines: list[list[str]]) -> list[str]:
    """Types in order of first appearance (the order of the reference code)."""
    seen: dict[str, None] = {}
    for line in lines:
        for w in line:
            seen.setdefault(w, None)
    return list(seen)


def encode(lines: list[list[str]], stoi: dict[str, int], path: Path) -> torch.Tensor:
    unk = stoi.get("<unk>")
    ids = []
    for n, line in enumerate(lines, 1):
        for w in line:
            i = stoi.get(w, unk)
            if i is None:
                raise DataError(f"{path}, line {n}: the word {w!r} is not in the training vocabulary "
                                "and the vocabulary has no <unk>.")
            ids.append(i)
    return torch.tensor(ids, dtype=torch.long)


def _how_to_supply(folder: Path) -> str:
    return (f"Supply the files by putting ptb.train.txt, ptb.valid.txt and ptb.test.txt (from Mikolov's "
            f"simple-examples release, data/ folder) in {folder}, by pointing data.root= (or $LMCAL_DATA_ROOT) "
            f"at a folder that holds ptb/, or by running with data.download=true on a machine with a network "
            f"({PTB_URL}).")


def verify_ptb(folder: Path) -> None:
    """Every file present and with its SHA-256; else one DataError that says how to fix it."""
    for fname, expected in PTB_SHA256.items():
        path = folder / fname
        if not path.is_file():
            raise DataError(f"Penn Treebank file not found: {path} (expected SHA-256 {expected}). "
                            + _how_to_supply(folder))
        got = sha256(path)
        if got != expected:
            raise DataError(f"Penn Treebank file is corrupt or a different version: {path} has SHA-256 {got}, "
                            f"expected {expected}. Delete it and " + _how_to_supply(folder)[0].lower()
                            + _how_to_supply(folder)[1:])


def download_ptb(folder: Path, url: str | None = None) -> None:
    """Fetch the simple-examples archive, check the three PTB files and move them in atomically.

    Nothing is left in `folder` unless all three files arrived with their expected sums.
    """
    url = url or PTB_URL
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        archive = Path(tmp) / "simple-examples.tgz"
        try:
            with urllib.request.urlopen(url, timeout=60) as r, open(archive, "wb") as f:
                shutil.copyfileobj(r, f)
        except OSError as e:
            raise DataError(f"Could not download the Penn Treebank from {url}: {e}. "
                            + _how_to_supply(folder)) from None
        with tarfile.open(archive) as tar:
            members = {Path(m.name).name: m for m in tar.getmembers()
                       if m.isfile() and Path(m.name).name in PTB_SHA256 and Path(m.name).parent.name == "data"}
            missing = sorted(set(PTB_SHA256) - set(members))
            if missing:
                raise DataError(f"The archive from {url} lacks {', '.join(missing)}. " + _how_to_supply(folder))
            for name, m in members.items():
                src = tar.extractfile(m)
                assert src is not None
                with open(Path(tmp) / name, "wb") as f:
                    shutil.copyfileobj(src, f)
        for name, expected in PTB_SHA256.items():
            got = sha256(Path(tmp) / name)
            if got != expected:
                raise DataError(f"Downloaded {name} from {url} has SHA-256 {got}, expected {expected}; "
                                "nothing was written. " + _how_to_supply(folder))
        for name in PTB_SHA256:
            os.replace(Path(tmp) / name, folder / name)


def load_ptb(root: str | Path | None = None, download: bool = False, check_counts: bool = True) -> Corpus:
    """The Penn Treebank from `root/ptb/` (downloaded there first if asked and missing)."""
    folder = Path(root if root is not None else default_root()).expanduser() / "ptb"
    if download and not all((folder / f).is_file() for f in PTB_SHA256):
        download_ptb(folder)
    verify_ptb(folder)
    lines = {split: tokenize_lines(folder / fname) for split, fname in PTB_FILES.items()}
    itos = build_vocab(lines["train"])
    stoi = {w: i for i, w in enumerate(itos)}
    ids = {split: encode(lines[split], stoi, folder / PTB_FILES[split]) for split in PTB_FILES}
    if check_counts:
        counts = {s: t.numel() for s, t in ids.items()}
        if counts != PTB_TOKENS or len(itos) != PTB_VOCAB:
            raise DataError(f"Penn Treebank in {folder} has token counts {counts} and {len(itos)} types; "
                            f"expected {PTB_TOKENS} and {PTB_VOCAB}.")
    return Corpus("ptb", itos, ids["train"], ids["valid"], ids["test"], info={"path": str(folder)})


def synthetic_corpus(vocab_size: int = 50, n_train: int = 20_000, n_valid: int = 2_000, n_test: int = 2_000,
                     seed: int = 0) -> Corpus:
    """A small learnable stand-in for PTB (a sparse random bigram source), for tests without the real corpus."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(vocab_size, vocab_size, generator=g) * 3.0  # peaked rows
    probs = torch.softmax(logits, dim=-1)
    n = n_train + n_valid + n_test
    seq = torch.empty(n, dtype=torch.long)
    seq[0] = 0
    u = torch.multinomial(probs, n, replacement=True, generator=g)  # [V, n]: a draw per row per step
    for t in range(1, n):
        seq[t] = u[seq[t - 1], t]
    itos = [f"w{i}" for i in range(vocab_size - 2)] + ["<unk>", EOS]
    return Corpus("synthetic", itos, seq[:n_train], seq[n_train:n_train + n_valid], seq[n_train + n_valid:],
                  info={"seed": seed})


def batchify(data: torch.Tensor, batch_size: int) -> torch.Tensor:
    """[N] -> [N // B, B]: B contiguous streams side by side; the tail that does not fill a row is dropped."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    n = data.numel() // batch_size
    if n < 2:
        raise DataError(f"{data.numel()} tokens are too few for {batch_size} streams of at least 2 tokens.")
    return data[: n * batch_size].view(batch_size, n).t().contiguous()


def sample_seq_len(bptt: int, generator: torch.Generator, min_len: int = 5) -> int:
    """AWD variable BPTT: bptt with p=0.95 else bptt/2, then Normal(that, 5), at least `min_len`."""
    base = bptt if torch.rand((), generator=generator).item() < 0.95 else bptt / 2
    seq_len = int(torch.normal(float(base), 5.0, (), generator=generator).item())
    return max(min_len, seq_len)


def bptt_spans(n_steps: int, bptt: int, generator: torch.Generator | None = None):
    """(start, seq_len) windows covering time steps 0..n_steps-2 of a batchified stream.

    With a generator the lengths follow `sample_seq_len` (training); without, they are
    fixed at bptt (evaluation). Each window predicts tokens start+1..start+seq_len.
    """
    i = 0
    while i < n_steps - 1:
        seq_len = bptt if generator is None else sample_seq_len(bptt, generator)
        seq_len = min(seq_len, n_steps - 1 - i)
        yield i, seq_len
        i += seq_len


def get_batch(source: torch.Tensor, start: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs [seq_len, B] and next-token targets [seq_len, B]."""
    return source[start:start + seq_len], source[start + 1:start + 1 + seq_len]


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """The sampler's RNG for one epoch: a function of (seed, epoch) only, so resumed runs repeat."""
    return torch.Generator().manual_seed(seed * 1_000_003 + epoch)
