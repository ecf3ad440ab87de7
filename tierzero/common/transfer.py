"""A handle on bytes in flight between tiers, and what a finished move hands back.

The swapper returns a `Transfer` for every move; the store chains them (`then`) to
hand typed tensors to the stages. On CUDA the last copy of a move may still run on
the swapper's copy stream when the move is done on the host: the outcome carries
the event that copy recorded, and `wait()` (or `await`) makes the caller's current
stream wait on it instead of blocking the host.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Generator
from concurrent.futures import Future
from concurrent.futures._base import FINISHED
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

__all__ = ["Transfer", "TransferOutcome", "after_all"]

T = TypeVar("T")
U = TypeVar("U")


@dataclass(frozen=True, slots=True)
class TransferOutcome(Generic[T]):
    """What a finished operation hands back: its value, and the CUDA event its last copy recorded."""

    value: T | None = None
    event: torch.cuda.Event | None = None


class _Finished(Future[TransferOutcome[Any]]):
    """A future born finished: a move with nothing to move (`Transfer.ready`), some 80 a step on the host.
    `Future()` builds a condition and its lock for waiters such a future never has; this one sets the
    fields `Future`'s methods read, as `set_result` leaves them, and shares one condition for the methods
    that still take it (a callback added runs at once). Its state never changes, so the questions asked of
    every fetch, several a unit a step (`done`, `result`, `exception`), are answered without the lock."""

    _SHARED = threading.Condition()

    def __init__(self, outcome: TransferOutcome[Any]) -> None:  # no super().__init__(): no condition of its own
        self._condition = self._SHARED
        self._state = FINISHED
        self._result = outcome
        self._exception = None
        self._waiters: list[Any] = []
        self._done_callbacks: list[Any] = []

    def done(self) -> bool:
        return True

    def cancelled(self) -> bool:
        return False

    def result(self, timeout: float | None = None) -> TransferOutcome[Any]:
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return None


class Transfer(Generic[T]):
    """A handle on one move in flight. `wait()` returns its value; `await transfer` works too.

    On CUDA a host-to-device copy finishes with an event rather than a host
    block: `wait()` makes the caller's current stream wait on it, so kernels
    queued after `wait()` see the bytes while the host runs ahead.
    """

    __slots__ = ("_future",)

    def __init__(self, future: Future[TransferOutcome[T]]) -> None:
        self._future = future

    @classmethod
    def ready(cls, value: T | None = None) -> Transfer[T]:
        return cls(_Finished(TransferOutcome(value=value)))

    @property
    def future(self) -> Future[TransferOutcome[T]]:
        return self._future

    def done(self) -> bool:
        """Whether the bytes have landed: the host side has finished, and so has its last CUDA copy.

        A host-to-device copy is done on the host once queued; a prefetch counted done then
        would be a hit while its copy still runs. `Event.query()` never blocks.
        """
        if not self._future.done():
            return False
        if self._future.cancelled() or self._future.exception() is not None:
            return True
        event = self._future.result().event
        return event is None or event.query()

    def settled(self) -> bool:
        """Whether it was finished when made (`ready`): each callback added to its future runs before
        `add_done_callback` returns, so none is left to wait for."""
        return isinstance(self._future, _Finished)

    def wait(self, timeout: float | None = None) -> T:
        return self._consume(self._future.result(timeout))

    def then(self, fn: Callable[[T | None], U]) -> Transfer[U]:
        """A transfer that finishes with `fn(value)` once this one has finished."""
        mapped: Future[TransferOutcome[U]] = Future()

        def chain(done: Future[TransferOutcome[T]]) -> None:
            try:
                outcome = done.result()
                mapped.set_result(TransferOutcome(value=fn(outcome.value), event=outcome.event))
            except BaseException as exc:
                mapped.set_exception(exc)
                if not isinstance(exc, Exception) and done.exception() is not exc:
                    # A Ctrl-C that landed here, in the main thread running the callback of a
                    # transfer that had already finished: stored only in `mapped` it could be
                    # dropped unseen with a prefetch nobody waits for. Let it go on up.
                    raise

        self._future.add_done_callback(chain)
        return Transfer(mapped)

    def __await__(self) -> Generator[Any, None, T]:
        outcome = yield from asyncio.wrap_future(self._future).__await__()
        return self._consume(outcome)

    @staticmethod
    def _consume(outcome: TransferOutcome[T]) -> T:
        if outcome.event is not None:
            torch.cuda.current_stream().wait_event(outcome.event)
        return outcome.value


def after_all(pending: list[Transfer[Any]], fn: Callable[[], None]) -> None:
    """Call `fn` once every transfer in `pending` has finished: at once when none is pending,
    else in the thread that finishes the last one."""
    if not pending:
        fn()
        return
    remaining = [len(pending)]
    lock = threading.Lock()

    def one_done(_: object) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            fn()

    for transfer in pending:
        transfer.future.add_done_callback(one_done)
