"""Byte-level data: corpus discovery, bounded sampling, determinism, per-rank sharding."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from tierzero.data import ByteBatches, ByteCorpus, find_files, load_corpus, stdlib_dir, stdlib_sources


def _write(tmp_path: Path, texts: dict[str, bytes]) -> list[Path]:
    paths = []
    for name, data in texts.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        paths.append(path)
    return paths


def _corpus(n: int = 4096) -> ByteCorpus:
    data = bytes((i * 7 + i // 256) % 256 for i in range(n))
    return ByteCorpus(tokens=torch.tensor(list(data), dtype=torch.uint8), files=[])


def test_stdlib_fallback_finds_python_sources() -> None:
    files = find_files(None)
    assert len(files) > 100
    assert all(f.suffix == ".py" and f.is_relative_to(stdlib_dir()) for f in files)
    assert stdlib_dir() / "os.py" in files


def test_the_stdlib_is_listed_once_a_process_as_a_sorted_glob_would(monkeypatch: pytest.MonkeyPatch) -> None:
    listed = stdlib_sources()
    assert list(listed) == sorted(p for p in stdlib_dir().rglob("*.py") if p.is_file())

    def walk(*args: object, **kwargs: object) -> None:
        raise AssertionError("the standard library was walked a second time")

    monkeypatch.setattr(os, "walk", walk)
    assert stdlib_sources() is listed
    assert find_files(None) == list(listed)


def test_path_forms_file_directory_and_glob(tmp_path: Path) -> None:
    a, b, c = _write(tmp_path, {"a.txt": b"alpha", "sub/b.txt": b"beta", "sub/c.md": b"gamma"})
    assert find_files(a) == [a]
    assert find_files(tmp_path) == [a, b, c]
    assert find_files(str(tmp_path / "**" / "*.txt")) == [a, b]


def test_empty_glob_and_missing_path_are_clear_errors(tmp_path: Path) -> None:
    pattern = str(tmp_path / "*.txt")
    with pytest.raises(ValueError, match=rf"^data.path '{re.escape(pattern)}' matches no files: fix the pattern"):
        find_files(pattern)
    with pytest.raises(ValueError, match=rf"^data.path {re.escape(str(tmp_path / 'nope'))} does not exist"):
        find_files(tmp_path / "nope")
    with pytest.raises(ValueError, match=rf"^data.path {re.escape(str(tmp_path))} is an empty directory"):
        find_files(tmp_path)


def test_corpus_is_the_files_end_to_end_in_seeded_order(tmp_path: Path) -> None:
    texts = {f"f{i}.txt": bytes([65 + i]) * (10 + i) for i in range(5)}
    files = _write(tmp_path, texts)
    corpus = load_corpus(files, max_bytes=1 << 20, seed=3)
    assert sorted(corpus.files) == files and len(corpus) == sum(len(t) for t in texts.values())
    expected = b"".join(f.read_bytes() for f in corpus.files)
    assert bytes(corpus.tokens.tolist()) == expected
    assert load_corpus(files, max_bytes=1 << 20, seed=3).files == corpus.files
    orders = {tuple(load_corpus(files, max_bytes=1 << 20, seed=s).files) for s in range(6)}
    assert len(orders) > 1


def test_corpus_is_bounded_and_reads_only_a_prefix_of_the_last_file(tmp_path: Path) -> None:
    files = _write(tmp_path, {"big.txt": bytes(range(256)) * 400, "small.txt": b"x" * 50})
    corpus = load_corpus(files, max_bytes=1000, seed=0)
    assert len(corpus) == 1000 and corpus.tokens.dtype == torch.uint8
    expected = b"".join(f.read_bytes() for f in corpus.files)[:1000]
    assert bytes(corpus.tokens.tolist()) == expected


def test_corpus_looks_only_at_the_files_it_takes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    files = _write(tmp_path, {f"f{i:02}.txt": bytes([i]) * 100 for i in range(40)})
    looked: list[str] = []
    real = os.path.getsize
    monkeypatch.setattr(os.path, "getsize", lambda p: looked.append(str(p)) or real(p))
    corpus = load_corpus(files, max_bytes=250, seed=5)
    assert len(corpus) == 250 and len(corpus.files) == 3
    assert looked == [str(f) for f in corpus.files]
    assert bytes(corpus.tokens.tolist()) == b"".join(f.read_bytes() for f in corpus.files)[:250]


def test_batches_are_shifted_windows_of_the_corpus() -> None:
    corpus = _corpus()
    data = ByteBatches(corpus=corpus, seq_len=16, micro_batch_size=3, seed=0)
    x, y = data.batch(5)
    assert x.shape == y.shape == (3, 16) and x.dtype == y.dtype == torch.int64
    torch.testing.assert_close(x[:, 1:], y[:, :-1])
    flat = corpus.tokens.long()
    for row_x, row_y in zip(x, y):
        starts = [s for s in range(len(flat) - 16) if torch.equal(flat[s : s + 16], row_x)]
        assert starts and any(torch.equal(flat[s + 1 : s + 17], row_y) for s in starts)


def test_batches_are_deterministic_by_seed_and_index() -> None:
    corpus = _corpus()
    a = ByteBatches(corpus=corpus, seq_len=16, micro_batch_size=2, seed=1)
    b = ByteBatches(corpus=corpus, seq_len=16, micro_batch_size=2, seed=1)
    assert all(torch.equal(a.batch(i)[0], b.batch(i)[0]) for i in (0, 1, 7))
    assert not torch.equal(a.batch(0)[0], a.batch(1)[0])
    other = ByteBatches(corpus=corpus, seq_len=16, micro_batch_size=2, seed=2)
    assert not torch.equal(a.batch(0)[0], other.batch(0)[0])
    # Random access: batch 7 does not depend on having drawn batches 0..6.
    assert torch.equal(ByteBatches(corpus=corpus, seq_len=16, micro_batch_size=2, seed=1).batch(7)[0], a.batch(7)[0])


def test_two_ranks_together_see_the_single_process_batch() -> None:
    corpus = _corpus()
    single = ByteBatches(corpus=corpus, seq_len=16, micro_batch_size=4, seed=9)
    ranks = [ByteBatches(corpus=corpus, seq_len=16, micro_batch_size=2, seed=9, rank=r, world_size=2) for r in (0, 1)]
    for index in (0, 3):
        x, y = single.batch(index)
        parts = [r.batch(index) for r in ranks]
        torch.testing.assert_close(torch.cat([p[0] for p in parts]), x, rtol=0, atol=0)
        torch.testing.assert_close(torch.cat([p[1] for p in parts]), y, rtol=0, atol=0)
        assert not torch.equal(parts[0][0], parts[1][0])


def test_corpus_shorter_than_a_window_is_refused() -> None:
    with pytest.raises(ValueError, match=r"fewer than seq_len \+ 1 = 33 bytes: add text to data.path"):
        ByteBatches(corpus=_corpus(20), seq_len=32, micro_batch_size=1, seed=0)


def test_stdlib_corpus_is_text_and_trains_from_config() -> None:
    from types import SimpleNamespace

    cfg = SimpleNamespace(
        data=SimpleNamespace(path=None, max_bytes=1 << 20),
        train=SimpleNamespace(seq_len=64, micro_batch_size=2, seed=0),
    )
    data = ByteBatches.from_config(cfg, rank=1, world_size=2)
    assert len(data.corpus) == 1 << 20 and len(data.corpus.files) < len(stdlib_sources())
    assert all(f.suffix == ".py" for f in data.corpus.files)
    x, _ = data.batch(0)
    assert x.shape == (2, 64)
    # Python source is mostly printable ASCII.
    text = data.corpus.tokens[:100_000]
    printable = ((text >= 32) & (text < 127)) | (text == 10)
    assert printable.float().mean() > 0.95
