"""The token stream of a corpus: tokenized once, cached on disk, memory-mapped on every run.

[Note: token cache]
The stream is every document's ids followed by the tokenizer's EOS id, documents in
source order. It is written once as a .npy (uint16 while the vocabulary fits, else
uint32) under `data.cache_dir` (default $XDG_CACHE_HOME/tierzero/tokens, else
~/.cache/tierzero/tokens), streamed batch by batch, so neither the text nor the ids are
ever held whole; later runs memory-map it. Beside it a .json records the digest of what
the stream depends on (each source's bytes, the whole tokenizer, the text field, the
format version) and a CRC-32C of the ids.

A run trusts the cache only when the digest matches the inputs as they are now (it reads
and hashes them: about 2 GB/s, far below tokenizing) and the ids' CRC matches; else it
tokenizes again. A changed corpus or tokenizer is stale and rebuilt quietly, a damaged
file is rebuilt with a warning. The file name depends on where the inputs are
(the source files, data.tokenizer, data.text_field), so a changed corpus replaces its own entry
instead of leaving old ones behind. Ranks that share a cache directory take turns under
an flock: the first tokenizes, the others find its file and check it. Files are written
under temporary names and renamed into place, so a crash leaves no half file trusted.

The cache directory may be shared with other users, who can plant anything under its
names (they follow from the inputs' paths): the cache reads and writes as [Note: files in
a shared directory] says. A record or stream that is not this user's small regular file
is named in one warning and the corpus tokenized again; such a lock file is named and
passed over (the renames keep the files whole without it); and where the new files
cannot be renamed over what lies there, this run keeps its ids, uncached, from the file
it wrote.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import itertools
import json
import os
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import crc32c
import numpy as np

from tierzero.common.safe_files import RefusedFile, create_new, held_lock, load_json, open_regular, scratch_path
from tierzero.data.sources import Source, read_documents, source_digest
from tierzero.data.tokenizer import TextTokenizer

__all__ = ["CACHE_VERSION", "TokenStream", "default_cache_dir", "token_stream"]

CACHE_VERSION = 1
"""Bumped when the stream's layout changes, so older caches read as stale."""
BATCH_DOCUMENTS = 1024
BATCH_CHARS = 8 << 20
"""A tokenizer batch ends at this many documents or characters, whichever comes first."""
CRC_CHUNK = 64 << 20
RECORD_LIMIT = 1 << 20
"""Bytes a cache record may hold; one holds a few hundred plus the source paths."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenStream:
    """A corpus's token ids, end to end, memory-mapped from the cache."""

    ids: np.ndarray
    """1-D uint16 or uint32, read-only."""
    path: Path
    documents: int
    built: bool
    """Whether this call tokenized (False: the cache was good)."""

    def __len__(self) -> int:
        return int(self.ids.size)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tierzero" / "tokens"


def token_stream(
    sources: list[Source],
    tokenizer: TextTokenizer,
    *,
    text_field: str = "text",
    cache_dir: str | os.PathLike[str] | None = None,
) -> TokenStream:
    """The sources' token stream from the cache, tokenized first if the cache is missing, stale or damaged.

    See [Note: token cache].
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(f"data.cache_dir {root} cannot be created ({exc.strerror}): set data.cache_dir to a writable directory") from None
    digest = _stream_digest(sources, tokenizer, text_field)
    where = json.dumps([CACHE_VERSION, [[str(s.path), s.format.value] for s in sources], tokenizer.directory, text_field])
    stem = root / hashlib.sha256(where.encode()).hexdigest()[:24]
    npy, meta = stem.with_suffix(".npy"), stem.with_suffix(".json")
    with _locked(stem.with_suffix(".lock")):
        ids, documents, problem = _open_cache(npy, meta, digest, tokenizer.dtype)
        if ids is not None:
            return TokenStream(ids=ids, path=npy, documents=documents, built=False)
        if problem is not None:
            warnings.warn(f"token cache {npy} {problem}: tokenizing the corpus again", stacklevel=2)
        ids, documents = _build(npy, meta, sources, tokenizer, text_field=text_field, digest=digest)
    return TokenStream(ids=ids, path=npy, documents=documents, built=True)


def _stream_digest(sources: list[Source], tokenizer: TextTokenizer, text_field: str) -> str:
    digest = hashlib.sha256(json.dumps([CACHE_VERSION, tokenizer.digest, tokenizer.dtype.str, text_field]).encode())
    for source in sources:
        digest.update(source_digest(source).encode())
    return digest.hexdigest()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `path`; where the file system has none, or something planted holds
    the name, go on unlocked (writes are atomic anyway)."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(held_lock(path))  # removed after: no lock file outlives a tokenization, failed or not
        except RefusedFile as exc:
            warnings.warn(f"token cache lock {exc}: going on without it", stacklevel=4)
        except OSError as exc:
            raise OSError(f"data.cache_dir {path.parent} cannot be written ({exc.strerror}): set data.cache_dir to a writable directory") from None
        yield


def _open_cache(npy: Path, meta: Path, digest: str, dtype: np.dtype) -> tuple[np.ndarray | None, int, str | None]:
    """(ids, documents, None) for a good cache; (None, 0, None) for none or a stale one; (None, 0, why) for a damaged one."""
    try:
        record = load_json(meta, limit=RECORD_LIMIT)
    except FileNotFoundError:
        return None, 0, None
    except RefusedFile as exc:
        return None, 0, f"has an unreadable record {meta.name} ({exc.reason})"
    except (OSError, ValueError) as exc:
        return None, 0, f"has an unreadable record {meta.name} ({type(exc).__name__})"
    if not isinstance(record, dict) or record.get("digest") != digest or record.get("version") != CACHE_VERSION:
        return None, 0, None
    try:
        with os.fdopen(open_regular(npy), "rb") as f:
            ids = _map_ids(f)
    except RefusedFile as exc:
        return None, 0, f"cannot be read ({exc.reason})"
    except (OSError, ValueError) as exc:
        return None, 0, f"cannot be read ({(str(exc).splitlines() or [type(exc).__name__])[0][:120]})"
    if ids.dtype != dtype or ids.shape != (record.get("tokens"),):
        return None, 0, f"holds {ids.shape} {ids.dtype}, its record says ({record.get('tokens')},) {dtype}"
    if _crc(ids) != record.get("crc32c"):
        return None, 0, "fails its CRC-32C check"
    documents = record.get("documents", 0)
    if type(documents) is not int or documents < 0:
        return None, 0, f"has a record {meta.name} whose document count is {json.dumps(documents, default=repr)[:40]}"
    return ids, documents, None


def _map_ids(f: BinaryIO) -> np.ndarray:
    """The 1-D array of the .npy open in `f`, memory-mapped read-only; the mapping outlives `f`."""
    f.seek(0)
    major, _ = np.lib.format.read_magic(f)
    read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    shape, fortran, dtype = read_header(f)
    if fortran or dtype.hasobject or len(shape) != 1:
        raise ValueError(f"it holds a {shape} {dtype} array, not a flat one of ids")
    return np.memmap(f, dtype=dtype, mode="r", shape=shape, offset=f.tell())


def _crc(ids: np.ndarray) -> int:
    flat = ids.view(np.uint8)
    value = 0
    for start in range(0, flat.size, CRC_CHUNK):
        value = crc32c.crc32c(flat[start : start + CRC_CHUNK], value=value)
    return value


def _npy_header(dtype: np.dtype, count: int) -> bytes:
    out = io.BytesIO()
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (count,)}
    np.lib.format.write_array_header_1_0(out, header)
    return out.getvalue()


def _build(
    npy: Path, meta: Path, sources: list[Source], tokenizer: TextTokenizer, *, text_field: str, digest: str
) -> tuple[np.ndarray, int]:
    """Tokenize every document into `npy`, then write its record `meta`, each under a fresh scratch name
    and renamed into place; the ids (mapped from the file written, whatever now lies at `npy`) and the
    count of documents."""
    tmp_npy, tmp_meta = scratch_path(npy), scratch_path(meta)
    dtype = tokenizer.dtype
    made: list[Path] = []  # only names it created are its to remove: a planted one is left as it is
    try:
        with os.fdopen(_create(tmp_npy, made), "w+b") as f:
            count, documents, crc = _write_ids(f, sources, tokenizer, text_field=text_field)
            ids = _map_ids(f)
        if ids.shape != (count,) or ids.dtype != dtype or _crc(ids) != crc:
            raise OSError(f"token cache {npy} was written but reads back {ids.shape} {ids.dtype} with another CRC-32C: "
                          "check the disk, or set data.cache_dir elsewhere")  # fmt: skip
        record = {"version": CACHE_VERSION, "digest": digest, "tokens": count, "documents": documents, "crc32c": crc,
                  "dtype": dtype.name, "tokenizer": tokenizer.directory, "sources": [str(s.path) for s in sources]}
        with os.fdopen(_create(tmp_meta, made), "w") as out:
            out.write(json.dumps(record, indent=1))
        try:
            # The old record goes first: a crash between the renames leaves new ids under no record, which reads as stale.
            meta.unlink(missing_ok=True)
            os.replace(tmp_npy, npy)
            os.replace(tmp_meta, meta)
        except OSError as exc:
            warnings.warn(f"token cache {npy} cannot be replaced ({exc.strerror or exc}): this run keeps its ids uncached", stacklevel=3)
    finally:
        for path in made:
            path.unlink(missing_ok=True)
    return ids, documents


def _create(path: Path, made: list[Path]) -> int:
    fd = create_new(path)
    made.append(path)
    return fd


def _write_ids(f: BinaryIO, sources: list[Source], tokenizer: TextTokenizer, *, text_field: str) -> tuple[int, int, int]:
    """Write the stream as a .npy to `f`, synced; its count of ids, of documents, and its CRC-32C."""
    dtype = tokenizer.dtype
    # numpy pads a header so its shape can grow to 21 digits: the real count fits the same bytes.
    header = _npy_header(dtype, 0)
    f.write(header)
    count = documents = crc = 0
    for texts in _batches(itertools.chain.from_iterable(read_documents(s, text_field=text_field) for s in sources)):
        chunk, kept = _with_eos(tokenizer.encode_batch(texts), tokenizer.eos_id, dtype)
        documents += kept
        f.write(chunk.tobytes())
        crc = crc32c.crc32c(chunk.view(np.uint8), value=crc)
        count += chunk.size
    final = _npy_header(dtype, count)
    assert len(final) == len(header), "the .npy header grew with the count"
    f.seek(0)
    f.write(final)
    f.flush()
    os.fsync(f.fileno())
    return count, documents, crc


def _batches(documents: Iterable[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for text in documents:
        batch.append(text)
        chars += len(text)
        if len(batch) >= BATCH_DOCUMENTS or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _with_eos(ids: list[list[int]], eos: int, dtype: np.dtype) -> tuple[np.ndarray, int]:
    """The documents' ids end to end, each followed by `eos`, and how many: a document of no tokens is left out."""
    kept = [doc for doc in ids if doc]
    out = np.empty(sum(len(doc) + 1 for doc in kept), dtype=dtype)
    at = 0
    for doc in kept:
        out[at : at + len(doc)] = doc
        out[at + len(doc)] = eos
        at += len(doc) + 1
    return out, len(kept)
