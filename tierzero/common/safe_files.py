"""Files in a directory another user may write to: created only new, read only when regular, ours and small.

[Note: files in a shared directory]
A swap path, a data cache or a cache directory may be shared (/tmp, a 1777 scratch disk).
There another user can plant, under any name tierzero will use, a symlink (a write through
it lands on a file of their choosing), a FIFO (a read blocks for ever), a device such as
/dev/zero (a read never ends) or a record of their own. So in such a directory:
- a new file is created with O_CREAT | O_EXCL | O_NOFOLLOW and mode 0600, and a scratch file
  that is renamed into place gets 64 random bits in its name (`scratch_path`): nothing
  planted is ever opened for writing, and the rename replaces a planted name instead of
  writing through it;
- a file is read only when lstat calls it a regular file (so a device or FIFO is never
  opened), it opens with O_NOFOLLOW | O_NONBLOCK (what was swapped in after the lstat opens
  without blocking), fstat still calls it a regular file owned by this user, and no more
  than a cap is read (`read_capped`, `load_json`);
- a name that a data file gives is joined to its directory only when it stays inside (`confined`).
A refused file raises `RefusedFile`, one line naming it; callers skip it and say so once
(`say_once`), so a planted file costs a run a line, never the run.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import stat
import sys
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

from tierzero.common.sizes import format_size

__all__ = [
    "RefusedFile",
    "check_regular",
    "confined",
    "create_new",
    "is_ours",
    "load_json",
    "loads_bounded",
    "open_lock",
    "open_regular",
    "read_capped",
    "read_regular",
    "say_once",
    "scratch_path",
    "this_user",
]

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_KINDS = (
    (stat.S_ISLNK, "a symlink"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)
_said: set[str] = set()
"""Lines `say_once` has logged in this process: a refused file is named once, not at every look."""


class RefusedFile(OSError):
    """A file that is not a small regular file of this user, where one was expected; never read, never trusted."""

    def __init__(self, path: str | os.PathLike[str], reason: str) -> None:
        self.path, self.reason = Path(path), reason
        super().__init__(f"{path} is {reason}")

    def __str__(self) -> str:
        return str(self.args[0])


def this_user() -> int:
    """The uid a file must belong to before tierzero trusts it (tests replace this to fake another user's files)."""
    return os.geteuid()


def is_ours(st: os.stat_result) -> bool:
    """Whether the file `st` describes belongs to this user (`this_user`)."""
    return st.st_uid == this_user()


def _check(path: str | os.PathLike[str], st: os.stat_result, *, owned: bool) -> None:
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
        raise RefusedFile(path, f"{kind}, not a regular file")
    if owned and not is_ours(st):
        raise RefusedFile(path, f"owned by uid {st.st_uid}, not by this user (uid {this_user()})")


def open_regular(path: str | os.PathLike[str], *, dir_fd: int | None = None, owned: bool = True) -> int:
    """A read-only descriptor of `path` (relative to `dir_fd` when given) if it is a regular file,
    and one of this user's while `owned`; else `RefusedFile`. A missing file is FileNotFoundError."""
    _check(path, os.stat(path, dir_fd=dir_fd, follow_symlinks=False), owned=owned)
    return _open_checked(path, _READ_FLAGS, dir_fd=dir_fd, owned=owned)


def _open_checked(path: str | os.PathLike[str], flags: int, *, dir_fd: int | None = None, owned: bool) -> int:
    """`os.open` with `flags` (O_NOFOLLOW among them), then the same checks on what was opened: a name
    swapped since the lstat for a symlink or a socket, or for anything `_check` refuses, is refused."""
    try:
        fd = os.open(path, flags, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # swapped for a symlink or a socket since the lstat
            raise RefusedFile(path, "a symlink or a socket, not a regular file") from None
        raise
    try:
        _check(path, os.fstat(fd), owned=owned)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_regular(path: str | os.PathLike[str]) -> None:
    """Refuse (`RefusedFile`, "<path> is a FIFO, not a regular file") a path the user gave, symlinks
    followed, that is no regular file: a FIFO blocks the open, a device such as /dev/zero never ends.
    For a file handed to a library that opens it itself (safetensors, tokenizers, pyarrow); a missing
    file is FileNotFoundError, for the caller to word."""
    _check(path, os.stat(path), owned=False)


def read_regular(path: str | os.PathLike[str], *, limit: int | None = None) -> bytes:
    """The bytes of a file the user named (their config, data, tokenizer, model), symlinks followed and
    any owner allowed, refused as `check_regular` refuses before any byte is read, and opened without
    blocking so that a FIFO swapped in after the check is refused too; `RefusedFile` past `limit` bytes."""
    check_regular(path)
    fd = _open_checked(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC, owned=False)
    with os.fdopen(fd, "rb") as f:
        data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise RefusedFile(path, f"larger than the {format_size(limit)} such a file may hold")
    return data


def read_capped(path: str | os.PathLike[str], *, limit: int, dir_fd: int | None = None, owned: bool = True) -> bytes:
    """The bytes of `path`, opened as `open_regular` does; `RefusedFile` when it holds more than `limit`."""
    with os.fdopen(open_regular(path, dir_fd=dir_fd, owned=owned), "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise RefusedFile(path, f"larger than the {format_size(limit)} such a file may hold")
    return data


def load_json(path: str | os.PathLike[str], *, limit: int, dir_fd: int | None = None, owned: bool = True) -> Any:
    """The JSON value in `path`, read as `read_capped` does. FileNotFoundError when missing, `RefusedFile`
    when refused, ValueError when it is not JSON in UTF-8 or nests deeper than Python's recursion limit."""
    return loads_bounded(read_capped(path, limit=limit, dir_fd=dir_fd, owned=owned), name=str(path))


def loads_bounded(data: bytes | str, *, name: str) -> Any:
    """`json.loads(data)`, with the two ways JSON breaks Python itself as a one-line ValueError naming
    `name` (the file, or the file and line): nesting past the recursion limit (a RecursionError) and
    an integer of more digits than `int()` converts (a ValueError from deep inside json, naming nothing).
    Other JSON errors (json.JSONDecodeError, UnicodeDecodeError) pass through for the caller to word."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError(f"{name} nests deeper than a JSON file may") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise
    except ValueError as exc:
        if "integer string conversion" not in str(exc):
            raise
        raise ValueError(
            f"{name} holds an integer of more than {sys.get_int_max_str_digits()} digits, more than Python reads"
        ) from None


def scratch_path(path: Path) -> Path:
    """`<name>.tmp-<64 random bits>` beside `path`: a name no one can plant anything at in advance."""
    return path.with_name(f"{path.name}.tmp-{secrets.token_hex(8)}")


def create_new(path: str | os.PathLike[str], *, dir_fd: int | None = None) -> int:
    """A read-write descriptor of a file made just now at `path` (mode 0600); FileExistsError
    when anything, a symlink included, is there already."""
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)


def open_lock(path: str | os.PathLike[str]) -> int:
    """A read-only descriptor to flock `path` by, the file made (0600) if missing; `RefusedFile` when
    `path` is a symlink, not a regular file or another user's. Nothing is ever written to it."""
    try:
        _check(path, os.lstat(path), owned=True)
    except FileNotFoundError:
        pass
    return _open_checked(path, _READ_FLAGS | os.O_CREAT, owned=True)


@contextlib.contextmanager
def held_lock(path: str | os.PathLike[str]) -> Iterator[None]:
    """An exclusive flock on `path` (made by `open_lock`) for the block, and the file removed after it.

    Removing a lock file others may be waiting on is safe only if each holder checks, once it
    has the lock, that the name still leads to the file it locked (a waiter may wake holding a
    file just unlinked): else it tries again on the new one. `RefusedFile` as `open_lock`.
    Where the file system has no locks the block runs unlocked.
    """
    fd = open_lock(path)
    for _ in range(16):  # past that, a file replaced again and again: go on with the newest
        with contextlib.suppress(OSError):  # no locks on this file system: the block runs unlocked
            fcntl.flock(fd, fcntl.LOCK_EX)
        if same_file(fd, path):
            break
        os.close(fd)
        fd = open_lock(path)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            if same_file(fd, path):
                os.unlink(path)
        os.close(fd)


def same_file(fd: int, path: str | os.PathLike[str]) -> bool:
    """Whether `path` (not followed if a symlink) is the file open as `fd`."""
    try:
        on_disk = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (on_disk.st_dev, on_disk.st_ino)


def confined(directory: Path, name: object) -> Path:
    """`directory / name` when `name` is a relative path that stays inside `directory` once symlinks
    are resolved; else ValueError saying how it leaves."""
    if not isinstance(name, str) or not name.strip() or "\0" in name:
        raise ValueError(f"{name!r} is not a file name")
    relative = PurePosixPath(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise ValueError(f"{name!r} leads out of {directory}")
    target = directory / relative
    base = directory.resolve()
    resolved = target.resolve()
    if resolved == base or not resolved.is_relative_to(base):
        raise ValueError(f"{name!r} leads out of {directory} (to {resolved})")
    return target


def say_once(log: logging.Logger, message: str) -> None:
    """Log `message` as a warning the first time this process says it."""
    if message not in _said:
        _said.add(message)
        log.warning(message)
