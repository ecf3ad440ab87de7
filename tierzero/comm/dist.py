"""Process-group set-up for `tierzero.initialize`.

Inside a `torchrun` job (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) the default
group is created unless the user already did: NCCL when CUDA is present, gloo
otherwise. Without those variables the run is a single process and needs no group.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
ROLL_CALL_S = 2.0
"""The longest a rank that saw a collective fail waits for the others' answers (`unanswered_ranks`)."""
ANSWER_POLL_S = 0.05
"""How often a `RollCallAnswerer` looks for a roll call in the store."""


@dataclass(frozen=True, slots=True)
class DistContext:
    """Where this process sits in the job and which device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    created_group: bool
    """True when `setup` created the default group (and `teardown` should destroy it)."""


def roll_call_s(timeout_s: float) -> float:
    """The roll call's share of `dist.timeout`: `ROLL_CALL_S`, or a quarter of a timeout under 8 s.

    A hung rank fails the job within `timeout_s`: the collectives of a group `setup` creates
    wait `timeout_s - roll_call_s(timeout_s)`, then the ranks that noticed ask the store which
    ranks still answer, waiting the rest.
    """
    return min(ROLL_CALL_S, timeout_s / 4)


def setup(*, timeout_s: float = 600.0) -> DistContext:
    """Join (or create) the default process group when launched as one rank of several.

    A collective of a group created here waits `timeout_s` less the roll call's share
    (`roll_call_s`) for a rank that hung; a group the user created keeps its own timeout.
    """
    if dist.is_available() and dist.is_initialized():
        return _context(created=False)
    env_world = os.environ.get("WORLD_SIZE")
    if env_world is None or int(env_world) == 1:
        return DistContext(rank=0, world_size=1, local_rank=0, device=_device(0), created_group=False)
    missing = [name for name in _LAUNCH_VARS if name not in os.environ]
    if missing:
        raise ValueError(
            f"WORLD_SIZE is {env_world} but {', '.join(missing)} is not set: launch with torchrun, "
            "or create the process group before tierzero.initialize"
        )
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    collective_s = timeout_s - roll_call_s(timeout_s)
    dist.init_process_group(
        backend="nccl" if torch.cuda.is_available() else "gloo", timeout=timedelta(seconds=collective_s)
    )
    return _context(created=True)


def launch_tag() -> str:
    """The roll calls' key prefix: one roll call per launch (torchrun's restart count), whatever
    step each rank had reached, since a rank may fail in the next step's forward while a peer
    still waits in this step's backward."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def unanswered_ranks(*, rank: int, world_size: int, tag: str, wait_s: float = ROLL_CALL_S) -> list[int] | None:
    """After a collective failed: the ranks that do not answer a roll call within `wait_s` seconds.

    Every rank that saw the failure writes its own key under `tag` in the store the launcher
    named (MASTER_ADDR:MASTER_PORT: torchrun's agent on the first node, or rank 0's process),
    and the roll call's key, which the other ranks' `RollCallAnswerer` threads answer; then it
    waits for the others' keys. A rank that died or is stopped never writes one. None when
    there is no such store to ask: the variables are unset (the user made the group), or
    the store went with the ranks that were lost.
    """
    address = _store_address()
    if address is None:
        return None
    keys = _roll_call_keys(tag, world_size)
    try:
        store = dist.TCPStore(*address, is_master=False, timeout=timedelta(seconds=wait_s))
        store.set(keys[rank], "here")
        store.set(_asked_key(tag), "asked")
        deadline = time.monotonic() + wait_s
        while not store.check(keys) and time.monotonic() < deadline:
            time.sleep(0.05)
        return [r for r, key in enumerate(keys) if not store.check([key])]
    except (RuntimeError, OSError):  # torch's DistStoreError and DistNetworkError are RuntimeErrors
        return None


class RollCallAnswerer:
    """Answers a peer's roll call (`unanswered_ranks`) from a thread of its own while the rank trains.

    A rank can be alive and still unable to answer from its main thread: blocked in a
    collective that waits for data from a peer that already failed out of it (a ring
    all-gather's left neighbour), it notices only when that peer's process exits, after the
    peer's roll call has ended. Answered from here, such a rank counts as present, and the
    roll call names only the ranks that died or were stopped (whose threads are gone with them).
    Stop it as soon as the rank itself fails for any other reason, so that a rank on its way
    out is never counted as present.
    """

    def __init__(self, *, rank: int, world_size: int, tag: str) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        address = _store_address()
        if world_size > 1 and address is not None:
            self._thread = threading.Thread(
                target=self._answer, args=(address, _roll_call_keys(tag, world_size)[rank], _asked_key(tag)),
                name="tierzero-roll-call", daemon=True,
            )  # fmt: skip
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _answer(self, address: tuple[str, int], own: str, asked: str) -> None:
        try:
            store = dist.TCPStore(*address, is_master=False, timeout=timedelta(seconds=ROLL_CALL_S))
            while not self._stop.wait(ANSWER_POLL_S):
                if store.check([asked]):
                    store.set(own, "here")
                    return
        except (RuntimeError, OSError):  # no store to answer in: a roll call finds none either
            return


def _store_address() -> tuple[str, int] | None:
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return None if host is None or port is None else (host, int(port))


def _roll_call_keys(tag: str, world_size: int) -> list[str]:
    return [f"tierzero/roll-call/{tag}/{r}" for r in range(world_size)]


def _asked_key(tag: str) -> str:
    return f"tierzero/roll-call/{tag}/asked"


def teardown(ctx: DistContext) -> None:
    if ctx.created_group and dist.is_initialized():
        dist.destroy_process_group()


def _context(*, created: bool) -> DistContext:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return DistContext(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=local_rank,
        device=_device(local_rank),
        created_group=created,
    )


def _device(local_rank: int) -> torch.device:
    return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
