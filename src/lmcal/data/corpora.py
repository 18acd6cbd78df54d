"""The corpora: the Penn Treebank and WikiText-2 (download with checksums, parsing, a word vocabulary), a small
synthetic bigram stand-in, and raw text files for Hugging Face models' own tokenizers. The random order-k Markov
source, whose entropy rate and limited-memory conditionals are known exactly, is lmcal.markov (load_corpus reaches
it). A corpus is three 1-D LongTensors of token ids (train/valid/test) and a vocabulary; batching is lmcal.data.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lmcal.data.download import download_into, fetch_url, md5, sha256, supply_hint
from lmcal.errors import DataError

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
    return Path(__file__).resolve().parents[3] / "data"


def corpus_folder(root: str | Path | None, name: str) -> Path:
    """root/name, root defaulting to default_root()."""
    return Path(root if root is not None else default_root()).expanduser() / name


def tokenize_lines(path: Path) -> list[list[str]]:
    """Whitespace tokens of each line, one `<eos>` appended per line."""
    with _utf8(path) as f:
        return [line.split() + [EOS] for line in f]


class _utf8:
    """`open(path, encoding="utf-8")` whose decoding error names the file and where in it (not a traceback)."""

    def __init__(self, path: Path):
        self.path, self.f = Path(path), open(path, encoding="utf-8")

    def __enter__(self):
        return self.f

    def __exit__(self, kind, e, tb):
        self.f.close()
        if isinstance(e, UnicodeDecodeError):
            raise DataError(f"{self.path} is not UTF-8 text (it holds the bytes {e.object[e.start:e.start + 8]!r}: "
                            f"{e.reason}). Corpora and text files are read as UTF-8: convert it "
                            f"(iconv -f latin1 -t utf-8 {self.path}) or give another file.") from None


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
    return supply_hint(folder, PTB_FILES, "from Mikolov's simple-examples release, data/ folder", "ptb", PTB_URL)


def verify_ptb(folder: Path) -> None:
    """Every file present and with its SHA-256; else one DataError that says how to fix it."""
    for fname in PTB_SHA256:
        verify_ptb_file(folder, fname)


def verify_ptb_file(folder: Path, fname: str) -> Path:
    """folder/fname, present and with its SHA-256; else one DataError that says how to fix it."""
    expected = PTB_SHA256[fname]
    path = folder / fname
    if not path.is_file():
        raise DataError(f"Penn Treebank file not found: {path} (expected SHA-256 {expected}). "
                        + _how_to_supply(folder))
    got = sha256(path)
    if got != expected:
        hint = _how_to_supply(folder)
        raise DataError(f"Penn Treebank file is corrupt or a different version: {path} has SHA-256 {got}, "
                        f"expected {expected}. Delete it and " + hint[0].lower() + hint[1:])
    return path


def download_ptb(folder: Path, url: str | None = None) -> None:
    """Fetch the simple-examples archive, check the three PTB files and move them in atomically.

    Nothing is left in `folder` unless all three files arrived with their expected sums.
    """
    url = url or PTB_URL
    download_into(folder, lambda tmp: _fetch_ptb(folder, tmp, url))


def _fetch_ptb(folder: Path, tmp: Path, url: str) -> None:
    archive = tmp / "simple-examples.tgz"
    fetch_url(url, archive, "the Penn Treebank", _how_to_supply(folder))
    with tarfile.open(archive) as tar:
        members = {Path(m.name).name: m for m in tar.getmembers()
                   if m.isfile() and Path(m.name).name in PTB_SHA256 and Path(m.name).parent.name == "data"}
        missing = sorted(set(PTB_SHA256) - set(members))
        if missing:
            raise DataError(f"The archive from {url} lacks {', '.join(missing)}. " + _how_to_supply(folder))
        for name, m in members.items():
            src = tar.extractfile(m)
            assert src is not None
            with open(tmp / name, "wb") as f:
                shutil.copyfileobj(src, f)
    for name, expected in PTB_SHA256.items():
        got = sha256(tmp / name)
        if got != expected:
            raise DataError(f"Downloaded {name} from {url} has SHA-256 {got}, expected {expected}; "
                            "nothing was written. " + _how_to_supply(folder))
    for name in PTB_SHA256:
        os.replace(tmp / name, folder / name)


def load_ptb(root: str | Path | None = None, download: bool = False, check_counts: bool = True) -> Corpus:
    """The Penn Treebank from `root/ptb/` (downloaded there first if asked and missing)."""
    folder = corpus_folder(root, "ptb")
    if download and not all((folder / f).is_file() for f in PTB_SHA256):
        download_ptb(folder)
    verify_ptb(folder)
    expected = (PTB_TOKENS, PTB_VOCAB) if check_counts else None
    return read_word_corpus("ptb", "Penn Treebank", folder, PTB_FILES, expected)


def read_word_corpus(name: str, title: str, folder: Path, files: dict[str, str],
                     expected: tuple[dict[str, int], int] | None, note: str = "") -> Corpus:
    """A word-level corpus of three text files: one `<eos>` per line, vocabulary from the training split,
    token and type counts checked against `expected` = ({split: tokens}, types) when given."""
    lines = {split: tokenize_lines(folder / fname) for split, fname in files.items()}
    itos = build_vocab(lines["train"])
    stoi = {w: i for i, w in enumerate(itos)}
    ids = {split: encode(lines[split], stoi, folder / files[split]) for split in files}
    if expected is not None:
        counts = {s: t.numel() for s, t in ids.items()}
        if counts != expected[0] or len(itos) != expected[1]:
            raise DataError(f"{title} in {folder} has token counts {counts} and {len(itos)} types; "
                            f"expected {expected[0]} and {expected[1]}{note}.")
    return Corpus(name, itos, ids["train"], ids["valid"], ids["test"], info={"path": str(folder)})


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


WIKITEXT2_URL = "https://wikitext.smerity.com/wikitext-2-v1.zip"


# MD5 of wikitext-2-v1.zip as torchtext records it (torchtext's WikiText2 dataset, for the original
# research.metamind.io release that this mirror serves unchanged). The release publishes no per-file sums, so the
# archive's MD5 plus the token counts below are the integrity checks.
WIKITEXT2_ZIP_MD5 = "542ccefacc6c27f945fb54453812b3cd"


WIKITEXT2_FILES = {
    "train": "wiki.train.tokens",
    "valid": "wiki.valid.tokens",
    "test": "wiki.test.tokens",
}


# With one <eos> per line, empty lines included: the convention of PyTorch's word_language_model and the AWD code.
WIKITEXT2_TOKENS = {"train": 2_088_628, "valid": 217_646, "test": 245_569}


WIKITEXT2_VOCAB = 33_278


def _how_to_supply_wikitext2(folder: Path) -> str:
    return supply_hint(folder, WIKITEXT2_FILES, "the wikitext-2/ folder of wikitext-2-v1.zip, the tokenised release, "
                        "not -raw-", "wikitext-2", WIKITEXT2_URL)


def verify_wikitext2(folder: Path) -> None:
    """Every file present; else one DataError that says how to fix it (the counts are checked after reading)."""
    for fname in WIKITEXT2_FILES.values():
        path = folder / fname
        if not path.is_file():
            raise DataError(f"WikiText-2 file not found: {path}. " + _how_to_supply_wikitext2(folder))


def download_wikitext2(folder: Path, url: str | None = None) -> None:
    """Fetch wikitext-2-v1.zip, check its MD5, and move the three token files into `folder` atomically.

    Nothing is left in `folder` unless the archive had the expected MD5 and all three files.
    """
    url = url or WIKITEXT2_URL  # read at call time, so tests can point it at a local archive
    download_into(folder, lambda tmp: _fetch_wikitext2(folder, tmp, url))


def _fetch_wikitext2(folder: Path, tmp: Path, url: str) -> None:
    archive = tmp / "wikitext-2-v1.zip"
    fetch_url(url, archive, "WikiText-2", _how_to_supply_wikitext2(folder))
    got = md5(archive)
    if got != WIKITEXT2_ZIP_MD5:
        raise DataError(f"The archive from {url} has MD5 {got}, expected {WIKITEXT2_ZIP_MD5}; nothing was "
                        "written. " + _how_to_supply_wikitext2(folder))
    wanted = set(WIKITEXT2_FILES.values())
    try:
        with zipfile.ZipFile(archive) as zf:
            # only the three named members, written under names we choose (no paths from the archive)
            members = {Path(n).name: n for n in zf.namelist()
                       if Path(n).name in wanted and Path(n).parent.name == "wikitext-2"}
            missing = sorted(wanted - set(members))
            if missing:
                raise DataError(f"The archive from {url} lacks wikitext-2/{', wikitext-2/'.join(missing)}; "
                                "nothing was written. " + _how_to_supply_wikitext2(folder))
            for name, member in members.items():
                with zf.open(member) as src, open(tmp / name, "wb") as f:
                    shutil.copyfileobj(src, f)
    except zipfile.BadZipFile as e:
        raise DataError(f"The archive from {url} is not a readable zip ({e}); nothing was written. "
                        + _how_to_supply_wikitext2(folder)) from None
    for name in WIKITEXT2_FILES.values():
        os.replace(tmp / name, folder / name)


def load_wikitext2(root: str | Path | None = None, download: bool = False, check_counts: bool = True) -> Corpus:
    """WikiText-2 from `root/wikitext-2/`, tokenised exactly like PTB (downloaded there first if asked and missing).

    The files already mark out-of-vocabulary words as <unk>; the vocabulary is the training split's types.
    """
    folder = corpus_folder(root, "wikitext-2")
    if download and not all((folder / f).is_file() for f in WIKITEXT2_FILES.values()):
        download_wikitext2(folder)
    verify_wikitext2(folder)
    expected = (WIKITEXT2_TOKENS, WIKITEXT2_VOCAB) if check_counts else None
    return read_word_corpus("wikitext2", "WikiText-2", folder, WIKITEXT2_FILES, expected,
                            note=" (the tokenised wikitext-2-v1 release, not wikitext-2-raw-v1)")


def ptb_text_file(split: str = "valid", root: str | Path | None = None) -> Path:
    """The path of ptb.<split>.txt under `root/ptb/` (root: $LMCAL_DATA_ROOT or data/), after checking its SHA-256."""
    if split not in PTB_FILES:
        raise DataError(f"Unknown Penn Treebank split {split!r}; use one of {', '.join(PTB_FILES)}.")
    folder = corpus_folder(root, "ptb")
    return verify_ptb_file(folder, PTB_FILES[split])


def hf_text_tokens(path: str | Path, tokenizer, max_tokens: int | None = None) -> torch.Tensor:
    """A UTF-8 text file as one 1-D stream of `tokenizer`'s token ids, LongTensor [S] (S <= max_tokens if given).

    Lines are joined as text before tokenising: each line is stripped of surrounding whitespace, empty lines are
    dropped, and every remaining line is followed by one "\\n". For PTB (ptb_text_file) that makes one line per
    sentence, the newline standing where our word-level corpus puts <eos>; the corpus's own "<unk>" placeholders
    stay literal text (the model sees them as it sees any other characters). The whole text is tokenised in one
    call without special tokens (no BOS/EOS), so prefixes cut anywhere in the stream (lmcal.core.entropy_rate.
    random_prefixes) look like running text; max_tokens keeps the first max_tokens tokens.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"Text file not found: {path}. Give the path of an existing UTF-8 text file, e.g. "
                        f"ptb.valid.txt or ptb.test.txt of the Penn Treebank under <data root>/ptb/ (data root: "
                        f"$LMCAL_DATA_ROOT, else data/ in the project).")
    with _utf8(path) as f:
        text = "".join(line.strip() + "\n" for line in f if line.strip())
    # verbose=False: a whole corpus exceeds the model's context length, which is fine for a token stream
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if not ids:
        raise DataError(f"{path} gives no tokens (the file is empty or only whitespace).")
    return torch.tensor(ids, dtype=torch.long)
