"""`tierzero.comm.dist.unanswered_ranks`: after a failed collective, the ranks that do not answer in the job's store."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from tierzero.comm.dist import RollCallAnswerer, roll_call_s, setup, unanswered_ranks

pytestmark = pytest.mark.serial  # timed to a second or two: `make test` runs it alone on the cores


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_ranks_that_never_answer_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    port = _port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    store.set("tierzero/roll-call/0/2", "here")  # rank 2 answered; 1 and 3 went away
    started = time.monotonic()
    assert unanswered_ranks(rank=0, world_size=4, tag="0", wait_s=0.5) == [1, 3]
    assert 0.5 <= time.monotonic() - started < 3.0  # it waited for them, and no longer
    for rank in (1, 3):
        store.set(f"tierzero/roll-call/0/{rank}", "here")
    started = time.monotonic()
    assert unanswered_ranks(rank=2, world_size=4, tag="0", wait_s=5.0) == []
    assert time.monotonic() - started < 2.0  # everyone answered: no wait


def test_a_rank_busy_elsewhere_answers_from_its_thread_until_it_stops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 is alive but its main thread could not answer (here: it is this test's main thread, in the
    roll call for rank 0); its answerer answers for it. Rank 2 has none (it died) and is named alone."""
    port = _port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    answerer = RollCallAnswerer(rank=1, world_size=3, tag="0")
    try:
        assert unanswered_ranks(rank=0, world_size=3, tag="0", wait_s=1.0) == [2]
        assert store.get("tierzero/roll-call/0/1") == b"here"
    finally:
        answerer.stop()
    stopped = RollCallAnswerer(rank=1, world_size=3, tag="1")
    stopped.stop()  # failed for a reason of its own: on its way out, never counted as present
    assert unanswered_ranks(rank=0, world_size=3, tag="1", wait_s=0.5) == [1, 2]


def test_without_a_store_to_ask_nobody_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert unanswered_ranks(rank=0, world_size=2, tag="0") is None
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_port()))  # nothing listens: the store went with the lost ranks
    started = time.monotonic()
    assert unanswered_ranks(rank=0, world_size=2, tag="0", wait_s=0.5) is None
    assert time.monotonic() - started < 5.0


@pytest.mark.parametrize(
    ("timeout", "collective", "roll_call"), [(600.0, 598.0, 2.0), (8.0, 6.0, 2.0), (5.0, 3.75, 1.25)]
)
def test_the_collectives_leave_the_roll_call_its_share_of_the_timeout(
    monkeypatch: pytest.MonkeyPatch, timeout: float, collective: float, roll_call: float
) -> None:
    """A hung rank stops the job within dist.timeout: the group waits the rest after the roll call's share."""
    seen: dict[str, timedelta] = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kwargs: seen.update(kwargs))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    ctx = setup(timeout_s=timeout)
    assert ctx.created_group and seen["timeout"] == timedelta(seconds=collective)
    assert roll_call_s(timeout) == roll_call and collective + roll_call == timeout
