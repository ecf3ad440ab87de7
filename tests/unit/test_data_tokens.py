"""Tokenized data: sources (text, JSON Lines, saved datasets), the tokenizer, and the token cache."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from tierzero.data import Format, Source, TextTokenizer, find_sources, load_tokenizer, read_documents, token_stream

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far", "end", "of", "story"]
DOCS = ["the cat sat on the mat", "a dog ran far", "the end of the story", "cat dog cat"]


def tiny_tokenizer(directory: Path, *, words: list[str] = WORDS, eos: str | None = "<eos>") -> Path:
    """A word-level tokenizer over `words` (ids 2.., [UNK] 0, <eos> 1), saved as save_pretrained writes it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    special = {"eos_token": eos} if eos else {}
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]", **special).save_pretrained(directory)
    return directory


def expected_stream(docs: list[str], words: list[str] = WORDS) -> list[int]:
    ids = {w: i + 2 for i, w in enumerate(words)}
    return [t for doc in docs for t in [*(ids.get(w, 0) for w in doc.split()), 1]]


def write_text(root: Path, docs: list[str]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i, doc in enumerate(docs):
        (root / f"doc{i:03d}.txt").write_text(doc)
    return root


def write_jsonl(path: Path, docs: list[str], *, field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"id": i, field: doc}) for i, doc in enumerate(docs)]
    path.write_text(lines[0] + "\n\n" + "\n".join(lines[1:]) + "\n")  # a blank line holds no document
    return path


def write_dataset(path: Path, docs: list[str], *, column: str = "text") -> Path:
    import datasets

    datasets.Dataset.from_dict({column: docs, "n": list(range(len(docs)))}).save_to_disk(str(path))
    return path


@pytest.fixture
def tokenizer(tmp_path: Path) -> TextTokenizer:
    return load_tokenizer(tiny_tokenizer(tmp_path / "tok"))


def test_tokenizer_loads_with_its_eos_vocab_and_dtype(tokenizer: TextTokenizer) -> None:
    assert tokenizer.eos_id == 1 and tokenizer.vocab_size == len(WORDS) + 2
    assert tokenizer.dtype == np.uint16
    assert tokenizer.encode_batch(["the cat", "zebra dog"]) == [[2, 3], [0, 8]]


def test_text_jsonl_and_datasets_give_the_same_stream_with_eos_between_documents(tmp_path: Path, tokenizer: TextTokenizer) -> None:
    paths = {
        "text": write_text(tmp_path / "txt", DOCS),
        "jsonl": write_jsonl(tmp_path / "docs.jsonl", DOCS),
        "datasets": write_dataset(tmp_path / "ds", DOCS),
    }
    streams = {}
    for name, path in paths.items():
        sources = find_sources(path)
        assert {s.format for s in sources} == {Format(name)}
        stream = token_stream(sources, tokenizer, cache_dir=tmp_path / "cache")
        assert stream.documents == len(DOCS) and stream.ids.dtype == np.uint16
        streams[name] = stream.ids.tolist()
    assert streams["text"] == streams["jsonl"] == streams["datasets"] == expected_stream(DOCS)
    ends = [i for i, t in enumerate(streams["text"]) if t == 1]
    assert ends == list(np.cumsum([len(d.split()) + 1 for d in DOCS]) - 1)


def test_format_comes_from_the_name_unless_set(tmp_path: Path) -> None:
    write_text(tmp_path / "mixed", ["a dog"])
    write_jsonl(tmp_path / "mixed" / "more.jsonl", ["a cat"])
    (tmp_path / "mixed" / "other.NDJSON").write_text('{"text": "x"}\n')
    auto = find_sources(tmp_path / "mixed")
    assert [(s.path.name, s.format) for s in auto] == [
        ("doc000.txt", Format.TEXT), ("more.jsonl", Format.JSONL), ("other.NDJSON", Format.JSONL)
    ]
    assert {s.format for s in find_sources(tmp_path / "mixed", format="text")} == {Format.TEXT}
    forced = find_sources(tmp_path / "mixed" / "doc000.txt", format="jsonl")
    assert forced == [Source(tmp_path / "mixed" / "doc000.txt", Format.JSONL)]
    with pytest.raises(ValueError, match=r"data.format is datasets but data.path .* is not a directory written by Dataset.save_to_disk"):
        find_sources(tmp_path / "mixed", format="datasets")


def test_jsonl_errors_name_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"

    def error(content: str, **kwargs: str) -> str:
        path.write_text(content)
        with pytest.raises(ValueError) as info:
            list(read_documents(Source(path, Format.JSONL), **kwargs))
        return str(info.value)

    good = '{"text": "a cat"}\n'
    assert re.fullmatch(
        rf"data.path file {re.escape(str(path))} line 3 is not a JSON object \(Expecting .*\): fix or remove the line",
        error(good + "\n" + '{"text": "a dog"\n'),
    )
    assert error(good + '{"body": "a dog", "id": 2}\n') == (
        f"data.path file {path} line 2 has no 'text' field (its keys: 'body', 'id'): "
        "set data.text_field to the field holding the text"
    )
    path.write_text('{"body": "a dog"}\n')
    assert list(read_documents(Source(path, Format.JSONL), text_field="body")) == ["a dog"]
    assert error('{"text": null}\n').endswith("line 1: field 'text' is null, expected a string: fix the line")
    assert "line 1 is a JSON list, expected an object with a 'text' field" in error('["a cat"]\n')


def test_text_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    path = tmp_path / "latin.txt"
    path.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match=rf"^data.path file {re.escape(str(path))} is not UTF-8 text .* at byte 3\): convert"):
        list(read_documents(Source(path, Format.TEXT)))


def test_dataset_errors_name_the_column_and_the_split(tmp_path: Path) -> None:
    import datasets

    write_dataset(tmp_path / "ds", DOCS, column="body")
    with pytest.raises(ValueError, match=r"the dataset has no column 'text' \(its columns: body, n\): set data.text_field"):
        list(read_documents(Source(tmp_path / "ds", Format.DATASETS)))
    assert list(read_documents(Source(tmp_path / "ds", Format.DATASETS), text_field="body")) == DOCS
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS})}).save_to_disk(str(tmp_path / "dd"))
    assert find_sources(tmp_path / "dd") == [Source(tmp_path / "dd", Format.DATASETS)]
    with pytest.raises(ValueError, match=r"holds a DatasetDict with splits train: point data.path at one split's directory"):
        list(read_documents(Source(tmp_path / "dd", Format.DATASETS)))


def test_tokenizer_errors_say_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^data.tokenizer .*nope is not a directory"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"has no EOS token, which marks where each document ends: set eos_token"):
        load_tokenizer(tiny_tokenizer(tmp_path / "no-eos", eos=None))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"^data.tokenizer .*empty cannot be loaded"):
        load_tokenizer(tmp_path / "empty")


class _Counting:
    """Counts TextTokenizer.encode_batch calls."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = TextTokenizer.encode_batch

        def encode_batch(tok: TextTokenizer, texts: list[str]) -> list[list[int]]:
            self.calls += 1
            return real(tok, texts)

        monkeypatch.setattr(TextTokenizer, "encode_batch", encode_batch)


def test_the_cache_is_memory_mapped_and_reused_without_tokenizing(
    tmp_path: Path, tokenizer: TextTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    counting = _Counting(monkeypatch)
    sources = find_sources(write_jsonl(tmp_path / "docs.jsonl", DOCS))
    first = token_stream(sources, tokenizer, cache_dir=tmp_path / "cache")
    assert first.built and counting.calls == 1
    again = token_stream(sources, load_tokenizer(tmp_path / "tok"), cache_dir=tmp_path / "cache")
    assert not again.built and counting.calls == 1 and again.path == first.path
    assert isinstance(again.ids, np.memmap) and not again.ids.flags.writeable
    assert again.ids.tolist() == expected_stream(DOCS)
    assert sorted(p.suffix for p in (tmp_path / "cache").iterdir()) == [".json", ".npy"]  # the lock went with its holder


def test_a_changed_corpus_or_tokenizer_is_stale_and_rebuilt_in_place(
    tmp_path: Path, tokenizer: TextTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    counting = _Counting(monkeypatch)
    path = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    cache = tmp_path / "cache"
    token_stream(find_sources(path), tokenizer, cache_dir=cache)
    write_jsonl(path, ["the dog", *DOCS[1:]])  # same name, new bytes
    changed = token_stream(find_sources(path), tokenizer, cache_dir=cache)
    assert changed.built and counting.calls == 2
    assert changed.ids.tolist() == expected_stream(["the dog", *DOCS[1:]])
    # The same path with other words: the tokenizer's digest changes, so the ids are made again.
    words = ["dog", *WORDS[1:]]
    renamed = load_tokenizer(tiny_tokenizer(tmp_path / "tok", words=words))
    assert renamed.digest != tokenizer.digest
    rebuilt = token_stream(find_sources(path), renamed, cache_dir=cache)
    assert rebuilt.built and counting.calls == 3
    assert rebuilt.ids.tolist() == expected_stream(["the dog", *DOCS[1:]], words)
    assert len(list(cache.glob("*.npy"))) == 1  # one entry per corpus and tokenizer place, replaced, not piled up


@pytest.mark.parametrize("damage", ["flip", "truncate", "record"])
def test_a_damaged_cache_is_never_trusted(
    tmp_path: Path, tokenizer: TextTokenizer, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    sources = find_sources(write_jsonl(tmp_path / "docs.jsonl", DOCS))
    built = token_stream(sources, tokenizer, cache_dir=tmp_path / "cache")
    npy, record = built.path, built.path.with_suffix(".json")
    del built
    data = bytearray(npy.read_bytes())
    if damage == "flip":
        data[-3] ^= 0x01
        npy.write_bytes(bytes(data))
        message = "fails its CRC-32C check"
    elif damage == "truncate":
        npy.write_bytes(bytes(data[:-4]))
        message = "cannot be read"
    else:
        record.write_text(record.read_text()[:-10])
        message = "has an unreadable record"
    counting = _Counting(monkeypatch)
    with pytest.warns(UserWarning, match=rf"token cache {re.escape(str(npy))} {message}.*: tokenizing the corpus again"):
        again = token_stream(sources, tokenizer, cache_dir=tmp_path / "cache")
    assert again.built and counting.calls == 1
    assert again.ids.tolist() == expected_stream(DOCS)


def test_documents_without_tokens_leave_no_lone_eos(tmp_path: Path, tokenizer: TextTokenizer) -> None:
    stream = token_stream(find_sources(write_jsonl(tmp_path / "d.jsonl", ["a dog", "", "the end"])), tokenizer, cache_dir=tmp_path / "c")
    assert stream.ids.tolist() == expected_stream(["a dog", "the end"]) and stream.documents == 2
