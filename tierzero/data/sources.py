"""Where training text comes from: the files `data.path` names, their formats, and their documents.

A source is one file (plain text: the whole file is one document; JSON Lines: one
document per line, in the `data.text_field` field) or one directory written by
`datasets.Dataset.save_to_disk` (one document per row). `data.format: auto` decides by
name: *.jsonl and *.ndjson are JSON Lines, a directory holding `state.json` and
`dataset_info.json` is a saved dataset, anything else is text. Documents come in a fixed
order (files sorted, lines and rows in file order), so the same files always give the same
token stream. `source_digest` hashes what a source's documents depend on: its bytes, not
its path or times.
"""

from __future__ import annotations

import enum
import functools
import glob
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tierzero.common.safe_files import RefusedFile, check_regular, confined, load_json, loads_bounded, read_regular

__all__ = [
    "DATASET_MARKERS",
    "Format",
    "Source",
    "encodes_utf8",
    "find_files",
    "find_sources",
    "read_documents",
    "source_digest",
    "stdlib_dir",
    "stdlib_sources",
]

GLOB_CHARS = frozenset("*?[")
JSONL_SUFFIXES = frozenset({".jsonl", ".ndjson"})
DATASET_MARKERS = ("state.json", "dataset_info.json")
"""The files `Dataset.save_to_disk` writes beside its Arrow files; both mark a saved dataset."""
DATASET_BATCH = 1024
"""Rows read from a saved dataset at a time."""
HASH_CHUNK = 8 << 20
STATE_LIMIT = 16 << 20
"""Bytes a saved dataset's state.json or dataset_dict.json may hold; they list file and split names."""


class Format(enum.Enum):
    """How a source's bytes become documents."""

    TEXT = "text"
    JSONL = "jsonl"
    DATASETS = "datasets"


@dataclass(frozen=True, slots=True)
class Source:
    """One file or saved-dataset directory, and how to read it."""

    path: Path
    format: Format


def stdlib_dir() -> Path:
    """Where this Python's standard library sources live."""
    return Path(sysconfig.get_paths()["stdlib"])


@functools.cache
def stdlib_sources() -> tuple[Path, ...]:
    """The standard library's *.py files, sorted. Listed once a process: the walk takes 0.3-1 s
    (13,000 files), and a process that trains many times (a test run, a notebook) would pay it
    every time for a directory that does not change under it."""
    found = (Path(where, name) for where, _, names in os.walk(stdlib_dir()) for name in names if name.endswith(".py"))
    return tuple(sorted(p for p in found if p.is_file()))


def find_files(path: str | os.PathLike[str] | None) -> list[Path]:
    """The corpus files, sorted: one file, every file under a directory, a glob's matches, or the stdlib's *.py."""
    if path is None:
        if not (files := stdlib_sources()):
            raise ValueError(f"data.path is not set and no *.py files were found under {stdlib_dir()}: set data.path to a text corpus")
        return list(files)
    text = os.path.expanduser(os.fspath(path))
    if GLOB_CHARS & set(text):
        files = sorted(Path(p) for p in glob.glob(text, recursive=True) if os.path.isfile(p))
        if not files:
            raise ValueError(f"data.path {text!r} matches no files: fix the pattern (use ** for subdirectories) or point it at a file or directory")
        return files
    target = Path(text)
    if target.is_file():
        return [target]
    if target.exists() and not target.is_dir():  # a FIFO or a device: named as such, never opened
        raise ValueError(f"data.path {target} is {_kind_of(target)}, not a regular file: point it at a text file, a directory or a glob")
    if target.is_dir():
        files = sorted(p for p in target.rglob("*") if p.is_file())
        if not files:
            raise ValueError(f"data.path {target} is an empty directory: put text files in it or point data.path elsewhere")
        return files
    raise ValueError(f"data.path {target} does not exist: point it at a text file, a directory or a glob such as 'corpus/*.txt'")


def is_saved_dataset(path: Path) -> bool:
    """Whether `path` is a directory `Dataset.save_to_disk` (or `DatasetDict.save_to_disk`) wrote."""
    return path.is_dir() and (all((path / m).is_file() for m in DATASET_MARKERS) or (path / "dataset_dict.json").is_file())


def find_sources(path: str | os.PathLike[str], *, format: str = "auto") -> list[Source]:
    """The sources `data.path` names, in reading order; `format` is auto, text, jsonl or datasets."""
    target = Path(os.path.expanduser(os.fspath(path)))
    if format == "datasets" or (format == "auto" and is_saved_dataset(target)):
        if not is_saved_dataset(target):
            raise ValueError(
                f"data.format is datasets but data.path {target} is not a directory written by Dataset.save_to_disk "
                f"(no {' and '.join(DATASET_MARKERS)}): point data.path at one, or set data.format to auto"
            )
        return [Source(target, Format.DATASETS)]
    if format not in ("auto", "text", "jsonl"):
        raise ValueError(f"data.format is {format!r}, expected one of auto, text, jsonl, datasets")
    files = find_files(path)
    if format != "auto":
        return [Source(f, Format(format)) for f in files]
    return [Source(f, Format.JSONL if f.suffix.lower() in JSONL_SUFFIXES else Format.TEXT) for f in files]


def read_documents(source: Source, *, text_field: str = "text") -> Iterator[str]:
    """The documents of one source, in order."""
    if source.format is Format.TEXT:
        yield _read_text(source.path)
    elif source.format is Format.JSONL:
        yield from _read_jsonl(source.path, text_field)
    else:
        yield from _read_dataset(source.path, text_field)


def _kind_of(path: Path) -> str:
    try:
        check_regular(path)
    except RefusedFile as exc:
        return exc.reason.removesuffix(", not a regular file")
    return "a regular file"


def _read_text(path: Path) -> str:
    data = read_regular(path)  # found a regular file; refused, never blocked on, if swapped for a FIFO since
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"data.path file {path} is not UTF-8 text ({exc.reason} at byte {exc.start}): convert it to UTF-8 "
            "or leave it out of data.path"
        ) from None


def _read_jsonl(path: Path, field: str) -> Iterator[str]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue  # blank lines (a trailing newline, spacing) hold no document
            where = f"data.path file {path} line {number}"
            try:
                record = loads_bounded(raw, name=where)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                detail = exc.reason if isinstance(exc, UnicodeDecodeError) else exc.msg
                raise ValueError(f"{where} is not a JSON object ({detail}): fix or remove the line") from None
            except ValueError as exc:  # nested past the recursion limit, or an integer past int()'s digits
                raise ValueError(f"{exc}: fix or remove the line") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where} is a JSON {type(record).__name__}, expected an object with a {field!r} field: fix or remove the line")
            if field not in record:
                keys = ", ".join(map(repr, list(record)[:8])) or "none"
                raise ValueError(
                    f"{where} has no {field!r} field (its keys: {keys}): set data.text_field to the field holding the text"
                )
            text = record[field]
            if not isinstance(text, str):
                raise ValueError(f"{where}: field {field!r} is {_kind(text)}, expected a string: fix the line")
            if b"\\u" in raw and not encodes_utf8(text):
                raise ValueError(
                    f"{where}: field {field!r} holds a lone surrogate escape (such as \\ud800), which is no character "
                    "in UTF-8: fix the line"
                )
            yield text


def encodes_utf8(text: str) -> bool:
    """Whether `text` is UTF-8-encodable: JSON's \\u escapes can spell half a surrogate pair, which is not."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _read_dataset(path: Path, field: str) -> Iterator[str]:
    try:
        import datasets  # an optional extra, and slow to import: only for a saved dataset
    except ImportError:
        raise ValueError(
            f"data.path {path} is a saved dataset, which needs the datasets package: pip install 'tierzero[data]'"
        ) from None
    if not all((path / m).is_file() for m in DATASET_MARKERS):
        splits = [str(split) for split in _named_files(path, "dataset_dict.json", "splits")]
        raise ValueError(
            f"data.path {path} holds a DatasetDict with splits {', '.join(splits)}: point data.path at one split's "
            f"directory, e.g. {path / next(iter(splits), 'train')}"
        )
    _named_files(path, "state.json", "_data_files")  # datasets opens each: none may lead out of `path`
    _record(path, "dataset_info.json")  # datasets reads it as an object, with a traceback for anything else
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets and pyarrow raise their own types for a damaged file, naming none
        raise ValueError(_unreadable(path, exc)) from None
    if field not in loaded.column_names:
        raise ValueError(
            f"data.path {path}: the dataset has no column {field!r} (its columns: {', '.join(loaded.column_names)}): "
            "set data.text_field to the column holding the text"
        )
    row, batches = 0, None
    while True:
        try:
            batches = batches or iter(loaded.select_columns([field]).iter(batch_size=DATASET_BATCH))
            texts = next(batches)[field]
        except StopIteration:
            return
        except Exception as exc:  # a table (or its state.json) damaged past the header fails only when read
            raise ValueError(_unreadable(path, exc)) from None
        for text in texts:
            if not isinstance(text, str):
                raise ValueError(f"data.path {path} row {row}: column {field!r} is {_kind(text)}, expected a string")
            row += 1
            yield text


def _unreadable(path: Path, exc: Exception) -> str:
    detail = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
    return f"data.path {path}: datasets cannot read it ({type(exc).__name__}: {detail}): write the dataset again with save_to_disk"


def _named_files(path: Path, name: str, key: str) -> list[object]:
    """The names the list `key` in `path / name` gives (`{"filename": ...}` records or plain names),
    each confined to `path`; a ValueError naming the file when it cannot be read or a name leads out."""
    where = path / name
    entries = _record(path, name).get(key)
    if not isinstance(entries, list):
        raise ValueError(f"data.path {path}: {where} has no list {key!r}: write the dataset again with save_to_disk")
    names = [entry.get("filename") if isinstance(entry, dict) else entry for entry in entries]
    for entry in names:
        try:
            confined(path, entry)
        except ValueError:
            raise ValueError(
                f"data.path {path}: {where} names {entry!r}, not a file inside the dataset's directory: "
                "write the dataset again with save_to_disk"
            ) from None
    return names


def _record(path: Path, name: str) -> dict[str, Any]:
    """The JSON object in `path / name`, a file `save_to_disk` wrote; a ValueError naming it otherwise."""
    where = path / name
    try:
        record = load_json(where, limit=STATE_LIMIT, owned=False)
    except (OSError, ValueError) as exc:
        detail = exc.reason if isinstance(exc, RefusedFile) else getattr(exc, "strerror", None) or str(exc)
        raise ValueError(f"data.path {path}: {where} cannot be read ({detail}): write the dataset again with save_to_disk") from None
    if not isinstance(record, dict):
        raise ValueError(
            f"data.path {path}: {where} holds {_kind(record)}, not a JSON object: write the dataset again with save_to_disk"
        )
    return record


def _kind(value: Any) -> str:
    return "null" if value is None else f"a {type(value).__name__}"


def source_digest(source: Source) -> str:
    """A SHA-256 of what the source's documents depend on: the file's bytes, or a dataset directory's files."""
    digest = hashlib.sha256(source.format.value.encode())
    files = [source.path] if source.path.is_file() else sorted(p for p in source.path.rglob("*") if p.is_file())
    for file in files:
        if source.path.is_dir():
            digest.update(f"\0{file.relative_to(source.path).as_posix()}\0".encode())
        with open(file, "rb") as f:
            while chunk := f.read(HASH_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()
