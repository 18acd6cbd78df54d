"""Batching and the AWD variable-length BPTT sampler, and a corpus's splits as a data config describes them
(CorpusData; no Lightning here). Batching is time-major: `batchify` gives [S, B], B contiguous streams. The corpora
themselves (files, checksums, vocabularies) are lmcal.data.corpora.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lmcal.data.corpora import Corpus, load_ptb, load_wikitext2, synthetic_corpus
from lmcal.data.markov import markov_corpus
from lmcal.data.powerlaw import powerlaw_corpus
from lmcal.errors import DataError


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


def bptt_spans(n_steps: int, bptt: int, generator: torch.Generator | None = None, multiple_of: int | None = None,
               variable: bool = True):
    """(start, seq_len) windows covering time steps 0..n_steps-2 of a batchified stream.

    With a generator the lengths follow `sample_seq_len` (training); without, they are
    fixed at bptt (evaluation). Each window predicts tokens start+1..start+seq_len.
    `multiple_of=tau` (limited-memory models) rounds every length to a multiple of tau, so
    windows start on tau boundaries of the stream; a last remainder shorter than tau is dropped.
    `variable=False` (transformers, whose windows may not exceed their context): with a generator, windows of
    exactly bptt after a first one of random length 1..bptt, so each epoch cuts the text at other places.
    """
    i = 0
    first = int(torch.randint(1, bptt + 1, (1,), generator=generator)) if generator is not None and not variable \
        else None
    while i < n_steps - 1:
        if first is not None:
            seq_len, first = first, None
        else:
            seq_len = bptt if generator is None or not variable else sample_seq_len(bptt, generator)
        if multiple_of:
            seq_len = max(multiple_of, round(seq_len / multiple_of) * multiple_of)
        seq_len = min(seq_len, n_steps - 1 - i)
        if multiple_of:
            seq_len -= seq_len % multiple_of
            if seq_len == 0:
                return
        yield i, seq_len
        i += seq_len


def get_batch(source: torch.Tensor, start: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs [seq_len, B] and next-token targets [seq_len, B]."""
    return source[start:start + seq_len], source[start + 1:start + 1 + seq_len]


def epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """The sampler's RNG for one epoch: a function of (seed, epoch) only, so resumed runs repeat."""
    return torch.Generator().manual_seed(seed * 1_000_003 + epoch)


@dataclass(frozen=True)
class DataConfig:
    """A data config (conf/data) as CorpusData reads it: which corpus and where its files are, its batches, and the
    token limits that training applied."""

    name: str = "ptb"
    root: str | None = None
    download: bool = False
    batch_size: int = 20
    eval_batch_size: int = 10
    test_batch_size: int = 1
    bptt: int = 70
    seed: int = 141
    max_train_tokens: int | None = None
    max_eval_tokens: int | None = None
    corpus_kwargs: dict | None = None  # the generated corpora's settings (markov, powerlaw, synthetic)
    memory_tau: int | None = None  # windows start on tau boundaries for limited-memory models
    variable_length: bool = True  # False: training windows of exactly bptt (transformers)


class CorpusData:
    """A corpus and its splits as a data config (conf/data) describes them: the batch settings, and the token limits
    that training applied. training.module.LMDataModule adds Lightning's loaders; the analysis entry points use this
    alone, so that they never import Lightning. Each setting is an attribute (dm.bptt, dm.batch_size, ...)."""

    def __init__(self, cfg: DataConfig | None = None):
        cfg = cfg or DataConfig()
        self.name, self.root, self.download = cfg.name, cfg.root, cfg.download
        self.batch_size, self.eval_batch_size = cfg.batch_size, cfg.eval_batch_size
        self.test_batch_size, self.bptt, self.seed = cfg.test_batch_size, cfg.bptt, cfg.seed
        self.max_train_tokens, self.max_eval_tokens = cfg.max_train_tokens, cfg.max_eval_tokens
        self.corpus_kwargs = dict(cfg.corpus_kwargs or {})
        self.memory_tau, self.variable_length = cfg.memory_tau, cfg.variable_length
        self.corpus: Corpus | None = None

    def prepare(self) -> Corpus:
        if self.corpus is None:
            self.corpus = load_corpus(self.name, self.root, self.download, **self.corpus_kwargs)
        return self.corpus

    @property
    def vocab_size(self) -> int:
        return self.prepare().vocab_size

    def tokens(self, split: str) -> torch.Tensor:
        t = self.prepare().split(split)
        limit = self.max_train_tokens if split == "train" else self.max_eval_tokens
        return t[:limit] if limit else t


def load_corpus(name: str = "ptb", root: str | None = None, download: bool = False, **kwargs) -> Corpus:
    """The corpus `name`; `kwargs` (data.corpus_kwargs) configure the generated ones (markov, powerlaw, synthetic)."""
    if name == "ptb":
        return load_ptb(root, download=download)
    if name == "wikitext2":
        return load_wikitext2(root, download=download)
    if name == "markov":
        return markov_corpus(**kwargs)
    if name == "powerlaw":
        return powerlaw_corpus(**kwargs)
    if name == "synthetic":
        return synthetic_corpus(**kwargs)
    raise DataError(f"Unknown corpus {name!r}: choose data=ptb, data=wikitext2, data=markov or data=powerlaw "
                    "(or name=synthetic in tests).")
