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
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import itertools
import json
import os
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import crc32c
import numpy as np

from tierzero.data.sources import Source, read_documents, source_digest
from tierzero.data.tokenizer import TextTokenizer

__all__ = ["CACHE_VERSION", "TokenStream", "default_cache_dir", "token_stream"]

CACHE_VERSION = 1
"""Bumped when the stream's layout changes, so older caches read as stale."""
BATCH_DOCUMENTS = 1024
BATCH_CHARS = 8 << 20
"""A tokenizer batch ends at this many documents or characters, whichever comes first."""
CRC_CHUNK = 64 << 20


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
        _build(npy, meta, sources, tokenizer, text_field=text_field, digest=digest)
        ids, documents, problem = _open_cache(npy, meta, digest, tokenizer.dtype)
    if ids is None:
        raise OSError(f"token cache {npy} was written but reads back {problem or 'with another digest'}: check the disk, or set data.cache_dir elsewhere")
    return TokenStream(ids=ids, path=npy, documents=documents, built=True)


def _stream_digest(sources: list[Source], tokenizer: TextTokenizer, text_field: str) -> str:
    digest = hashlib.sha256(json.dumps([CACHE_VERSION, tokenizer.digest, tokenizer.dtype.str, text_field]).encode())
    for source in sources:
        digest.update(source_digest(source).encode())
    return digest.hexdigest()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `path`; where the file system has none, go on unlocked (writes are atomic anyway)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise OSError(f"data.cache_dir {path.parent} cannot be written ({exc.strerror}): set data.cache_dir to a writable directory") from None
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _open_cache(npy: Path, meta: Path, digest: str, dtype: np.dtype) -> tuple[np.ndarray | None, int, str | None]:
    """(ids, documents, None) for a good cache; (None, 0, None) for none or a stale one; (None, 0, why) for a damaged one."""
    try:
        record = json.loads(meta.read_text())
    except FileNotFoundError:
        return None, 0, None
    except (OSError, ValueError) as exc:
        return None, 0, f"has an unreadable record {meta.name} ({type(exc).__name__})"
    if not isinstance(record, dict) or record.get("digest") != digest or record.get("version") != CACHE_VERSION:
        return None, 0, None
    try:
        ids = np.load(npy, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as exc:
        return None, 0, f"cannot be read ({(str(exc).splitlines() or [type(exc).__name__])[0][:120]})"
    if ids.dtype != dtype or ids.shape != (record.get("tokens"),):
        return None, 0, f"holds {ids.shape} {ids.dtype}, its record says ({record.get('tokens')},) {dtype}"
    if _crc(ids) != record.get("crc32c"):
        return None, 0, "fails its CRC-32C check"
    return ids, int(record.get("documents", 0)), None


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


def _build(npy: Path, meta: Path, sources: list[Source], tokenizer: TextTokenizer, *, text_field: str, digest: str) -> None:
    """Tokenize every document into `npy`, then write its record `meta`: each under a temporary name, renamed into place."""
    suffix = f".tmp-{os.getpid()}"
    tmp_npy, tmp_meta = npy.with_name(npy.name + suffix), meta.with_name(meta.name + suffix)
    dtype = tokenizer.dtype
    try:
        with open(tmp_npy, "wb") as f:
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
        record = {"version": CACHE_VERSION, "digest": digest, "tokens": count, "documents": documents, "crc32c": crc,
                  "dtype": dtype.name, "tokenizer": tokenizer.directory, "sources": [str(s.path) for s in sources]}
        tmp_meta.write_text(json.dumps(record, indent=1))
        # The old record goes first: a crash between the renames leaves new ids under no record, which reads as stale.
        meta.unlink(missing_ok=True)
        os.replace(tmp_npy, npy)
        os.replace(tmp_meta, meta)
    finally:
        tmp_npy.unlink(missing_ok=True)
        tmp_meta.unlink(missing_ok=True)


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
