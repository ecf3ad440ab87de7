"""The backends that run the NVMe tier's chunks: a thread pool doing `os.preadv`/`os.pwritev`,
or aiofiles coroutines on an event loop in a background thread.

Both take a chunk from the queue (`launch`), run `ChunkIO.prepare`, the system call and
`ChunkIO.finish`, and report to the queue's `done` exactly once, error or not.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import aiofiles

from tierzero.offload.disk.chunk_queue import Chunk, ChunkIO, Op


def transfer(fd: int, op: Op, iov: list[memoryview], offset: int) -> None:
    """`os.preadv`/`os.pwritev` until every byte of `iov` has moved; short transfers are resumed."""
    call = os.preadv if op is Op.READ else os.pwritev
    while iov:
        done = call(fd, iov, offset)
        if done == 0:
            raise OSError(errno.EIO, f"unexpected end of file at offset {offset}")
        offset += done
        iov = advance(iov, done)


def advance(iov: list[memoryview], done: int) -> list[memoryview]:
    """What is left of `iov` after its first `done` bytes moved."""
    rest = list(iov)
    while rest and done >= len(rest[0]):
        done -= len(rest.pop(0))
    if rest and done:
        rest[0] = rest[0][done:]
    return rest


DoneCallback = Callable[[Chunk, BaseException | None], None]


class ThreadBackend:
    """Each chunk on a pool of threads: prepare, `os.preadv`/`os.pwritev` (they drop the GIL), finish."""

    def __init__(self, *, fd: int, io: ChunkIO, threads: int, done: DoneCallback) -> None:
        self._fd, self._io, self._done = fd, io, done
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tierzero-nvme")

    def launch(self, chunk: Chunk) -> None:
        self._pool.submit(self._run, chunk)

    def _run(self, chunk: Chunk) -> None:
        error, bufs = None, None
        try:
            if chunk.request.error is None:
                bufs = self._io.prepare(chunk)
                transfer(self._fd, chunk.request.op, bufs.iov, chunk.file_offset)
                self._io.finish(chunk, bufs)
        except BaseException as exc:  # noqa: BLE001 - handed to the request's future
            error = self._io.describe_failure(chunk, exc)
        finally:
            self._io.release(bufs)
            self._done(chunk, error)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class AiofilesBackend:
    """Each chunk as a coroutine on an asyncio loop in a background thread, doing its I/O with aiofiles.

    aiofiles runs every file call on the loop's executor (`threads` workers). A file object
    has one position, so `queue_depth` handles are opened and each chunk borrows one for
    its seek and read/write. `path` only names the file: each handle's descriptor comes from
    `reopen(flags)`, which opens the very file the tier created and no other (nvme_files.reopen).
    """

    def __init__(
        self, *, path: Path, reopen: Callable[[int], int], io: ChunkIO, threads: int, handles: int, done: DoneCallback
    ) -> None:
        self._io, self._done = io, done
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tierzero-nvme-aio")
        self._loop = asyncio.new_event_loop()
        self._loop.set_default_executor(self._pool)
        self._thread = threading.Thread(target=self._loop.run_forever, name="tierzero-nvme-loop", daemon=True)
        self._thread.start()
        flags = os.O_DIRECT if io.direct else 0
        opened = asyncio.run_coroutine_threadsafe(self._open(path, reopen, flags, handles), self._loop)
        try:
            self._handles: asyncio.Queue = opened.result()
        except BaseException:
            self._stop_loop()
            raise

    async def _open(self, path: Path, reopen: Callable[[int], int], flags: int, count: int) -> asyncio.Queue:
        handles: asyncio.Queue = asyncio.Queue()
        try:
            for _ in range(count):
                opener = lambda _path, f: reopen(f | flags)  # noqa: E731
                handles.put_nowait(await aiofiles.open(path, "r+b", buffering=0, opener=opener))
        except BaseException:
            await self._close_queue(handles)
            raise
        return handles

    def launch(self, chunk: Chunk) -> None:
        asyncio.run_coroutine_threadsafe(self._run(chunk), self._loop)

    async def _run(self, chunk: Chunk) -> None:
        loop = asyncio.get_running_loop()
        error, bufs = None, None
        try:
            if chunk.request.error is None:
                bufs = await loop.run_in_executor(None, self._io.prepare, chunk)
                handle = await self._handles.get()
                try:
                    await _aio_transfer(handle, chunk.request.op, bufs.iov, chunk.file_offset)
                finally:
                    self._handles.put_nowait(handle)
                await loop.run_in_executor(None, self._io.finish, chunk, bufs)
        except BaseException as exc:  # noqa: BLE001 - handed to the request's future
            error = self._io.describe_failure(chunk, exc)
        finally:
            self._io.release(bufs)
            self._done(chunk, error)

    def close(self) -> None:
        try:
            asyncio.run_coroutine_threadsafe(self._close_handles(), self._loop).result()
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
        self._pool.shutdown(wait=True)

    async def _close_handles(self) -> None:
        await self._close_queue(self._handles)

    @staticmethod
    async def _close_queue(handles: asyncio.Queue) -> None:
        while not handles.empty():
            handle = handles.get_nowait()
            try:
                await handle.close()
            except RuntimeError:
                pass  # the executor already stopped at interpreter exit; the process closes the fd


async def _aio_transfer(handle: Any, op: Op, iov: list[memoryview], offset: int) -> None:
    await handle.seek(offset)
    for buf in iov:
        while buf:
            done = await (handle.readinto(buf) if op is Op.READ else handle.write(buf))
            if not done:
                raise OSError(errno.EIO, f"unexpected end of file at offset {offset}")
            offset += done
            buf = buf[done:]
