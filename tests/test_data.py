import hashlib
import io
import tarfile
from pathlib import Path

import pytest
import torch

from lmcal.data import batching as D
from lmcal.data import corpora as C
from tests.conftest import DATA_ROOT, needs_ptb


def test_batchify_makes_contiguous_streams():
    data = torch.arange(23)
    b = D.batchify(data, 4)
    assert b.shape == (5, 4)
    # each column is a contiguous piece of the stream; the 3-token tail is dropped
    assert torch.equal(b[:, 0], torch.arange(0, 5))
    assert torch.equal(b[:, 3], torch.arange(15, 20))
    with pytest.raises(D.DataError):
        D.batchify(torch.arange(3), 4)


def test_seq_len_distribution_follows_awd_rule():
    g = torch.Generator().manual_seed(0)
    lens = torch.tensor([D.sample_seq_len(70, g) for _ in range(20000)], dtype=torch.float)
    assert lens.min() >= 5
    short = lens < 52  # bptt/2 = 35 +- 5 sd; bptt = 70 +- 5 sd
    assert abs(short.float().mean().item() - 0.05) < 0.01
    assert abs(lens[~short].mean().item() - 69.5) < 0.3  # int() truncation lowers the mean by ~0.5
    assert abs(lens[~short].std().item() - 5.0) < 0.3
    assert abs(lens[short].mean().item() - 34.5) < 1.0
    # the floor of 5 applies
    assert min(D.sample_seq_len(4, torch.Generator().manual_seed(s)) for s in range(200)) == 5


def test_bptt_spans_cover_every_target_once():
    for gen in (None, D.epoch_generator(1, 3)):
        spans = list(D.bptt_spans(1000, 70, gen))
        targets = [t for s, n in spans for t in range(s + 1, s + n + 1)]
        assert targets == list(range(1, 1000))


def test_epoch_schedule_is_a_function_of_seed_and_epoch():
    a = list(D.bptt_spans(5000, 70, D.epoch_generator(141, 2)))
    b = list(D.bptt_spans(5000, 70, D.epoch_generator(141, 2)))
    c = list(D.bptt_spans(5000, 70, D.epoch_generator(141, 3)))
    assert a == b and a != c


def test_get_batch_targets_are_next_tokens():
    src = D.batchify(torch.arange(100), 2)
    x, y = D.get_batch(src, 3, 7)
    assert torch.equal(y, x + 1)


def _fake_ptb(folder: Path) -> dict[str, str]:
    folder.mkdir(parents=True)
    sums = {}
    for name in C.PTB_SHA256:
        text = f" the cat {name} sat\n a dog <unk>\n"
        (folder / name).write_text(text)
        sums[name] = hashlib.sha256(text.encode()).hexdigest()
    return sums


def test_missing_file_names_path_sum_and_remedy(tmp_path):
    with pytest.raises(C.DataError) as e:
        C.load_ptb(tmp_path)
    msg = str(e.value)
    assert str(tmp_path / "ptb" / "ptb.train.txt") in msg
    assert C.PTB_SHA256["ptb.train.txt"] in msg
    assert "data.root=" in msg and "LMCAL_DATA_ROOT" in msg


def test_corrupt_file_is_refused_with_both_sums(tmp_path):
    _fake_ptb(tmp_path / "ptb")
    with pytest.raises(C.DataError) as e:
        C.load_ptb(tmp_path)
    msg = str(e.value)
    assert "corrupt" in msg and C.PTB_SHA256["ptb.train.txt"] in msg
    assert C.sha256(tmp_path / "ptb" / "ptb.train.txt") in msg


def _tgz_of(files: dict[str, bytes], path: Path) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, content in files.items():
            info = tarfile.TarInfo(f"simple-examples/data/{name}")
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))


def _fake_release(tmp_path, monkeypatch) -> tuple[Path, dict[str, str], Path]:
    """A simple-examples-like archive of fake PTB files, with the module's sums patched to match."""
    src = tmp_path / "src"
    sums = _fake_ptb(src)
    monkeypatch.setattr(C, "PTB_SHA256", sums)
    archive = tmp_path / "simple-examples.tgz"
    _tgz_of({n: (src / n).read_bytes() for n in sums}, archive)
    return src, sums, archive


def test_download_checks_sums_and_leaves_nothing_on_failure(tmp_path, monkeypatch):
    src, sums, archive = _fake_release(tmp_path, monkeypatch)
    dest = tmp_path / "root" / "ptb"
    C.download_ptb(dest, url=archive.as_uri())
    assert all(C.sha256(dest / n) == s for n, s in sums.items())
    assert [p.name for p in dest.iterdir() if p.name.startswith(".")] == []

    # a tampered archive: refused, and nothing is written
    bad = tmp_path / "bad.tgz"
    _tgz_of({n: (b"tampered" if n == "ptb.valid.txt" else (src / n).read_bytes()) for n in sums}, bad)
    dest2 = tmp_path / "root2" / "ptb"
    with pytest.raises(C.DataError, match="nothing was written"):
        C.download_ptb(dest2, url=bad.as_uri())
    assert not (tmp_path / "root2").exists()  # not even the folders it made for the files

    # an unreachable address: a clear error, not a traceback; a folder that was there stays, empty
    (tmp_path / "root3").mkdir()
    with pytest.raises(C.DataError, match="Could not download"):
        C.download_ptb(tmp_path / "root3" / "ptb", url=(tmp_path / "nope.tgz").as_uri())
    assert list((tmp_path / "root3").iterdir()) == []


def test_load_ptb_with_download_flag_fetches_then_reads(tmp_path, monkeypatch):
    _, _, archive = _fake_release(tmp_path, monkeypatch)
    monkeypatch.setattr(C, "PTB_URL", archive.as_uri())
    c = C.load_ptb(tmp_path / "root", download=True, check_counts=False)
    assert c.itos[:3] == ["the", "cat", "ptb.train.txt"] and "<eos>" in c.itos
    assert c.train.numel() == 5 + 4  # two lines, one <eos> each


@needs_ptb
def test_real_ptb_counts_and_vocab():
    c = C.load_ptb(DATA_ROOT)
    assert (c.train.numel(), c.valid.numel(), c.test.numel()) == (929_589, 73_760, 82_430)
    assert c.vocab_size == 10_000
    assert c.itos[c.train[-1]] == "<eos>"
