"""Packed batches: sequence lengths and shift, per-epoch shuffling, rank shares, resume at any micro-step."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_data_tokens import DOCS, expected_stream, tiny_tokenizer, write_jsonl

from tierzero.data import Batches, ByteBatches, PackedBatches, batches_from_config


def _packed(n: int = 97, **kwargs: int) -> PackedBatches:
    """Tokens 0..n-1, so a row's first token says where it was cut from."""
    defaults = {"seq_len": 8, "micro_batch_size": 2, "seed": 0}
    return PackedBatches(tokens=np.arange(n, dtype=np.uint16), **{**defaults, **kwargs})


def _starts(data: PackedBatches, indices: range) -> list[int]:
    return [int(row[0]) for i in indices for row in data.batch(i)[0]]


def test_sequences_are_seq_len_plus_one_tokens_shifted_by_one() -> None:
    data = _packed(97, seq_len=8, micro_batch_size=3)
    assert data.sequences == 12  # (97 - 1) // 8: sequence i is tokens [8i, 8i + 9)
    x, y = data.batch(0)
    assert x.shape == y.shape == (3, 8) and x.dtype == y.dtype == torch.int64
    for row_x, row_y in zip(x, y):
        start = int(row_x[0])
        assert start % 8 == 0 and start + 9 <= 97
        assert torch.equal(row_x, torch.arange(start, start + 8)) and torch.equal(row_y, torch.arange(start + 1, start + 9))


def test_one_epoch_visits_every_sequence_once_in_a_seeded_order() -> None:
    data = _packed(97, seq_len=8, micro_batch_size=3)  # 12 sequences: 4 batches an epoch
    first_epoch = _starts(data, range(4))
    assert sorted(first_epoch) == list(range(0, 96, 8))
    assert first_epoch != sorted(first_epoch)  # shuffled
    assert _starts(_packed(97, seq_len=8, micro_batch_size=3), range(4)) == first_epoch
    assert _starts(_packed(97, seq_len=8, micro_batch_size=3, seed=1), range(4)) != first_epoch
    second_epoch = _starts(data, range(4, 8))
    assert sorted(second_epoch) == sorted(first_epoch) and second_epoch != first_epoch
    assert [8 * int(s) for s in data.order(1)] == second_epoch


def test_epochs_roll_over_inside_a_batch() -> None:
    data = _packed(41, seq_len=8, micro_batch_size=2)  # 5 sequences, 2 a batch
    starts = _starts(data, range(5))  # positions 0..9: two whole epochs
    assert starts[4] == 8 * int(data.order(0)[4]) and starts[5] == 8 * int(data.order(1)[0])
    assert sorted(starts[:5]) == sorted(starts[5:]) == [0, 8, 16, 24, 32]
    assert data.epoch(5) == 2.0 and data.epoch(2) == 0.8


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_take_disjoint_shares_that_make_the_global_batch(world: int) -> None:
    single = _packed(400, seq_len=4, micro_batch_size=2 * world, seed=5)
    ranks = [_packed(400, seq_len=4, micro_batch_size=2, seed=5, rank=r, world_size=world) for r in range(world)]
    assert all(r.global_batch == single.global_batch for r in ranks)
    for index in (0, 7, 33):  # 99 sequences: index 33 is past the first epoch
        x, y = single.batch(index)
        parts = [r.batch(index) for r in ranks]
        assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(torch.cat([p[1] for p in parts]), y)
        firsts = [int(row[0]) for p in parts for row in p[0]]
        assert len(set(firsts)) == len(firsts)


def test_a_fresh_object_resumes_mid_epoch_exactly() -> None:
    unbroken = _packed(200, seq_len=8, micro_batch_size=3, seed=2)  # 24 sequences, 8 batches an epoch
    expected = [unbroken.batch(i) for i in range(20)]
    for k in (5, 8, 13):  # mid-epoch, at an epoch boundary, mid-epoch of the second
        resumed = _packed(200, seq_len=8, micro_batch_size=3, seed=2)
        for i in range(k, 20):
            x, y = resumed.batch(i)
            assert torch.equal(x, expected[i][0]) and torch.equal(y, expected[i][1])
    # Random access, backwards too: no batch depends on the ones drawn before.
    assert torch.equal(unbroken.batch(2)[0], expected[2][0])


def test_a_stream_shorter_than_one_sequence_is_refused() -> None:
    with pytest.raises(ValueError, match=r"holds 8 tokens, fewer than seq_len \+ 1 = 9: add documents to data.path or lower train.seq_len"):
        _packed(8, seq_len=8)
    with pytest.raises(ValueError, match="batch index -1 is negative"):
        _packed().batch(-1)


def test_the_factory_picks_packed_tokens_or_bytes_by_data_tokenizer(tmp_path: Path) -> None:
    corpus = write_jsonl(tmp_path / "docs.jsonl", DOCS * 3)
    train = SimpleNamespace(seq_len=4, micro_batch_size=2, seed=0)
    data = SimpleNamespace(
        path=str(corpus), tokenizer=str(tiny_tokenizer(tmp_path / "tok")), format="auto", text_field="text",
        cache_dir=str(tmp_path / "cache"), max_bytes=1 << 20,
    )
    packed = batches_from_config(SimpleNamespace(data=data, train=train), rank=1, world_size=2)
    assert isinstance(packed, PackedBatches) and isinstance(packed, Batches)
    assert packed.tokens.tolist() == expected_stream(DOCS * 3)
    assert packed.tokens_per_batch == 8 and packed.global_batch == 4 and packed.world_size == 2
    as_bytes = SimpleNamespace(**{**vars(data), "tokenizer": None})
    plain = batches_from_config(SimpleNamespace(data=as_bytes, train=train), rank=0, world_size=1)
    assert isinstance(plain, ByteBatches) and isinstance(plain, Batches)
    assert bytes(plain.corpus.tokens.tolist()) == corpus.read_bytes()
