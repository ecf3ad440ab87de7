"""Two real jobs on one checkpoint.dir: the ranks of the first never block each other, the second is refused.

Job A (`tierzero train` on 2 forked ranks) saves every step and pauses inside step 3 with
its checkpoints on disk; job B (`tierzero train`, 1 rank, same directory) must exit 2 with
one line naming A's rank-0 pid, before it trains or prunes anything. A then finishes.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from pathlib import Path

from harness import tiny_train_config
from test_checkpoint_resume import _free_port, launch

WAIT_S = 90.0


def _train(env: dict[str, str]) -> None:
    """`tierzero train` on one rank; with TZ_PAUSE, every rank waits inside step 3 until TZ_DIR/go exists."""
    os.environ.update(env)
    import torch

    import tierzero.cli.train as T
    from tierzero.cli.main import main

    torch.set_num_threads(1)
    rank, real_step = int(env.get("RANK", "0")), T._train_step

    def step(engine: object, data: object, *, step: int, **kwargs: object) -> float:
        if env.get("TZ_PAUSE") and step == 2:
            if rank == 0:
                Path(env["TZ_DIR"], "holding").write_text(str(os.getpid()))
            deadline = time.monotonic() + WAIT_S
            while not Path(env["TZ_DIR"], "go").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        return real_step(engine, data, step=step, **kwargs)

    T._train_step = step
    with open(Path(env["TZ_DIR"], f"stderr-{env['TZ_JOB']}-{rank}"), "w") as err:
        sys.stderr = err
        code = main(["train", "--config", env["TZ_CONFIG"], "--no-progress"])
    os._exit(code)


def _start(world: int, env: dict[str, str]) -> list[multiprocessing.process.BaseProcess]:
    ctx, port = multiprocessing.get_context("fork"), _free_port()
    procs = []
    for rank in range(world):
        rank_env = env | {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(ctx.Process(target=_train, args=(rank_env,)))
        procs[-1].start()
    return procs


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_second_job_on_the_same_directory_is_refused_and_the_first_finishes(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    config = tiny_train_config(tmp_path, steps=4, checkpoint={"dir": str(root), "every": 1, "keep": 2})
    env = {"TZ_DIR": str(tmp_path), "TZ_CONFIG": str(config)}
    first = _start(2, env | {"TZ_JOB": "a", "TZ_PAUSE": "1"})
    try:
        deadline = time.monotonic() + WAIT_S
        while not (tmp_path / "holding").exists() and time.monotonic() < deadline:
            assert all(p.exitcode is None for p in first), [p.exitcode for p in first]
            time.sleep(0.05)
        holder = int((tmp_path / "holding").read_text())
        before = _snapshot(root)
        assert launch(1, env | {"TZ_JOB": "b"}, target=_train, timeout=WAIT_S) == [2]
        message = (tmp_path / "stderr-b-0").read_text()
        assert message.startswith(f"tierzero: error: checkpoint.dir {root} is in use by another run (pid {holder} on "), message
        assert message.count("\n") == 1 and "Traceback" not in message
        assert _snapshot(root) == before  # nothing trained, saved or pruned by the second job
        assert sorted(p.name for p in root.iterdir()) == [".lock", "1", "2", "latest"]
    finally:
        (tmp_path / "go").write_text("")
        for p in first:
            p.join(WAIT_S)
            if p.exitcode is None:
                p.kill()
                p.join()
    assert [p.exitcode for p in first] == [0, 0], (tmp_path / "stderr-a-0").read_text()
    assert sorted(p.name for p in root.iterdir()) == ["3", "4", "latest"]  # the lock went with the run
