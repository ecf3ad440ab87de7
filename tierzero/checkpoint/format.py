"""The bytes of a checkpoint on disk: streamed safetensors files, checksums, JSON, fsync.

A checkpoint holds no pickle. Tensors go to safetensors files, written here by hand
(8-byte little-endian header length, a JSON header, then the raw bytes in header
order) so that each slice can be streamed in as it is fetched from its tier instead
of staging the whole state for `safetensors.torch.save_file`. Everything else is JSON.
Every file is checksummed while it is written, and verified before it is parsed, so a
flipped byte, a truncated file or a planted file is refused before anything reads it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from tierzero.offload.disk.files import forget, on_signals

try:
    # CRC-32C with the SSE4.2/ARMv8 instructions: measured 9.0 GB/s here, against 2.2 for
    # zlib's CRC-32 and 1.0 for SHA-256 (one 256 MiB buffer, 2026-11-29).
    from crc32c import crc32c as _crc32c
except ImportError:  # pragma: no cover - crc32c ships with the test environment
    _crc32c = None

#: Bytes copied (and, for device tensors, moved to host) per write call.
CHUNK_BYTES = 64 << 20

_SAFETENSORS_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.bool: "BOOL",
}
_DTYPE_NAMES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in _SAFETENSORS_DTYPES}
#: The safetensors dtype codes this reader knows, and their torch dtypes.
SAFETENSORS_CODES: dict[str, torch.dtype] = {code: d for d, code in _SAFETENSORS_DTYPES.items()}
DTYPE_NAMES = frozenset(_DTYPE_NAMES)
CHECKSUM_ALGORITHMS = ("crc32c", "crc32")
#: Checkpoint files are the run's own (as its swap files are): 0600, directories 0700.
FILE_MODE, DIR_MODE = 0o600, 0o700
#: A checkpoint's JSON files are small (the manifest grows with the units, a few KB each).
MAX_JSON_BYTES = 256 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted or used: corrupt, truncated, missing a file, or not ours."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, *, where: str) -> torch.dtype:
    if name not in _DTYPE_NAMES:
        raise CheckpointError(f"{where}: unknown dtype {name!r}, expected one of {sorted(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[name]


# ---- checksums ---------------------------------------------------------------------


def checksum_algorithm() -> str:
    return "crc32c" if _crc32c is not None else "crc32"


def _updater(algorithm: str) -> Callable[[bytes | memoryview, int], int]:
    if algorithm == "crc32c":
        if _crc32c is None:
            raise CheckpointError("this checkpoint is checksummed with crc32c: pip install crc32c to load it")
        return _crc32c
    if algorithm == "crc32":
        return zlib.crc32
    raise CheckpointError(f"unknown checksum algorithm {algorithm!r} in the manifest, expected one of {CHECKSUM_ALGORITHMS}")


@dataclass(frozen=True, slots=True)
class FileRecord:
    """One file of a checkpoint as the manifest lists it."""

    name: str
    nbytes: int
    checksum: str
    """Hex digest under the manifest's algorithm."""

    def to_json(self) -> dict[str, Any]:
        return {"bytes": self.nbytes, "checksum": self.checksum}


class _HashingWriter:
    """A file opened for writing whose bytes are counted and checksummed as they pass."""

    def __init__(self, path: Path, *, algorithm: str, mode: int = FILE_MODE) -> None:
        self.path = path
        self._update = _updater(algorithm)
        self._crc = 0
        self.nbytes = 0
        self._file = create_file(path, mode=mode)

    def write(self, data: bytes | memoryview) -> None:
        self._crc = self._update(data, self._crc)
        write_all(self._file, data)
        self.nbytes += len(data)

    def finish(self) -> FileRecord:
        """Flush, fsync and close; the record names the file by its base name."""
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return FileRecord(name=self.path.name, nbytes=self.nbytes, checksum=f"{self._crc:08x}")

    def abort(self) -> None:
        # Closing flushes; on a full disk that fails again, and the first error is the one to report.
        with contextlib.suppress(OSError):
            self._file.close()


def create_file(path: Path, *, mode: int = FILE_MODE) -> BinaryIO:
    """A new file for writing: refused when anything (a planted symlink included) is already at `path`."""
    return open(path, "xb", opener=lambda p, flags: os.open(p, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode))


def open_for_reading(path: Path) -> BinaryIO:
    """`path` opened to read, never through a symlink; CheckpointError naming it for anything but a missing file."""
    try:
        info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            raise CheckpointError(f"checkpoint file {path} is a symbolic link: a checkpoint's files are never followed out of it")
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"checkpoint file {path} is not a regular file: the checkpoint was tampered with")
        return open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NOFOLLOW | os.O_CLOEXEC))
    except (FileNotFoundError, CheckpointError):
        raise
    except OSError as exc:
        raise CheckpointError(f"checkpoint file {path} cannot be read ({exc.strerror})") from None


def write_all(file: BinaryIO, data: bytes | memoryview) -> None:
    """One write of `data` (a module-level seam: the full-disk tests make it raise ENOSPC)."""
    file.write(data)


def verify_file(directory: Path, record: FileRecord, *, algorithm: str) -> None:
    """Check size and checksum of `directory/record.name`; CheckpointError naming the file otherwise."""
    path = directory / record.name
    try:
        f = open_for_reading(path)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing: the checkpoint is incomplete; load an earlier one") from None
    update, crc = _updater(algorithm), 0
    with f:
        size = os.fstat(f.fileno()).st_size
        if size != record.nbytes:
            raise CheckpointError(
                f"checkpoint file {path} has {size} bytes, the manifest recorded {record.nbytes}: "
                "it is truncated or replaced; load an earlier checkpoint"
            )
        while chunk := f.read(8 << 20):
            crc = update(chunk, crc)
    if f"{crc:08x}" != record.checksum:
        raise CheckpointError(
            f"checkpoint file {path} fails its {algorithm} check ({crc:08x}, manifest {record.checksum}): "
            "its bytes are corrupt or replaced; load an earlier checkpoint"
        )


def json_checksum(value: Any, *, algorithm: str) -> str:
    """The checksum of `value`'s canonical JSON (sorted keys, no spaces)."""
    raw = json.dumps(value, sort_keys=True, separators=(",", ":")).encode()
    return f"{_updater(algorithm)(raw, 0):08x}"


# ---- JSON --------------------------------------------------------------------------


def write_json(path: Path, value: Any, *, algorithm: str) -> FileRecord:
    writer = _HashingWriter(path, algorithm=algorithm)
    try:
        writer.write(json.dumps(value, indent=1, sort_keys=True).encode())
        return writer.finish()
    except BaseException:
        writer.abort()
        raise


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`; CheckpointError naming the file for anything else (FileNotFoundError when missing)."""
    with open_for_reading(path) as f:
        if os.fstat(f.fileno()).st_size > MAX_JSON_BYTES:
            raise CheckpointError(f"{path} is over {MAX_JSON_BYTES >> 20} MiB, no checkpoint JSON is this large: it was replaced")
        raw = f.read()
    try:
        value = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        # ValueError: malformed JSON, or an integer of more digits than Python converts
        raise CheckpointError(f"{path} is not a JSON file ({type(exc).__name__}): it is corrupt or was replaced") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, expected an object: it was replaced")
    return value


# ---- safetensors, streamed ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a safetensors file being streamed: declared first, written later."""

    name: str
    numel: int
    dtype: torch.dtype
    shape: tuple[int, ...] | None = None
    """None: 1-D of `numel` elements."""

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


class SafetensorsStream:
    """Writes a safetensors file tensor by tensor, in the order `entries` declared them.

    The header (names, dtypes, shapes, offsets) is known up front, so each tensor's
    bytes can be written as soon as that slice is fetched, then the slice released.
    """

    def __init__(
        self, path: Path, entries: list[TensorEntry], *, algorithm: str, metadata: dict[str, str] | None = None, mode: int = FILE_MODE
    ) -> None:
        self._entries = entries
        self._next = 0
        header: dict[str, Any] = {"__metadata__": metadata or {}}
        offset = 0
        for e in entries:
            header[e.name] = {"dtype": _SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape) if e.shape is not None else [e.numel], "data_offsets": [offset, offset + e.nbytes]}
            offset += e.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._writer = _HashingWriter(path, algorithm=algorithm, mode=mode)
        try:
            self._writer.write(struct.pack("<Q", len(raw)) + raw)
        except BaseException:
            self._writer.abort()
            raise

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next declared tensor's bytes, from any device, `CHUNK_BYTES` at a time."""
        entry = self._entries[self._next]
        assert entry.name == name and tensor.numel() == entry.numel and tensor.dtype == entry.dtype, (entry, name)
        flat = tensor.reshape(-1)
        step = max(1, CHUNK_BYTES // flat.element_size())
        for start in range(0, flat.numel(), step):
            piece = flat[start : start + step]
            host = piece.to("cpu", copy=True) if piece.device.type != "cpu" else piece.contiguous()
            self._writer.write(memoryview(host.view(torch.uint8).numpy()))
        self._next += 1

    def finish(self) -> FileRecord:
        assert self._next == len(self._entries), f"{len(self._entries) - self._next} declared tensors were not written"
        return self._writer.finish()

    def abort(self) -> None:
        self._writer.abort()


def open_safetensors(path: Path) -> Any:
    """A lazy reader (`keys()`, `get_slice(name)[a:b]`); CheckpointError when the file is not safetensors.

    safetensors parses only its JSON header and maps the bytes: no code in the file runs.
    """
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise CheckpointError(f"{path} is not a readable safetensors file ({first}): it is corrupt or was replaced") from None


def read_range(reader: Any, name: str, start: int, end: int, *, where: str) -> torch.Tensor:
    """Elements [start, end) of the 1-D tensor `name`."""
    try:
        return reader.get_slice(name)[start:end]
    except Exception as exc:  # safetensors raises its own error types for missing names and bad ranges
        raise CheckpointError(f"{where}: cannot read {name}[{start}:{end}] ({exc})") from None


# ---- directories -------------------------------------------------------------------


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_private_dir(path: Path) -> Path:
    """A new directory only this user can enter; refused (FileExistsError) when anything is at `path`."""
    os.mkdir(path, DIR_MODE)
    return path


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` by `text` all at once: write a new temp file beside it, fsync, rename, fsync the dir."""
    write_bytes_atomic(path, text.encode())


def write_bytes_atomic(path: Path, data: bytes, *, mode: int = FILE_MODE) -> None:
    """Replace `path` by `data` all at once (a new temp file beside it, fsync, rename, fsync the dir).

    The temp file is registered for the signal clean-up before it exists, so that SIGTERM or
    SIGHUP in the middle leaves nothing behind (a checkpoint's `latest` pointer is written so,
    at the end of every save)."""
    tmp = TempFile.beside(path)
    on_signals(tmp)
    try:
        f = create_file(tmp.path, mode=mode)  # only what this call created is removed on failure
        try:
            with f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp.path, path)
        except BaseException:
            tmp.remove()
            raise
    finally:
        forget(tmp)
    fsync_dir(path.parent)


@dataclass(frozen=True, slots=True)
class TempFile:
    """A file written under a temporary name until it is renamed into place: removed when the
    write fails, and on SIGTERM or SIGHUP while it is registered with `on_signals`."""

    path: Path

    @classmethod
    def beside(cls, final: Path) -> TempFile:
        """`.<name>.tmp-<32 random bits>` in `final`'s directory: hidden, and no name anyone can plant in advance."""
        return cls(final.with_name(f".{final.name}.tmp-{secrets.token_hex(4)}"))

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()

