"""Exact resume: runs killed by SIGKILL at chosen points, resumed, end bitwise equal to an unbroken run.

`launch` forks one process per rank with torchrun's variables set (forking from this
already-initialised interpreter saves the 2-3 s a fresh one spends importing torch),
and each runs `_main`, a plain training loop. `TZ_KILL=<point>:<step>:<rank>` makes
that rank SIGKILL itself at the point once `engine.global_step` is <step>: `forward`
(inside a block's forward), `optimizer` (inside the optimizer step, once its first unit
is stepped), `write` (inside a checkpoint write, after two slices) or `publish` (after
the rename, before `latest` moves). As torchrun does, the launcher kills the other
ranks once one dies. The QLoRA runs (peft's LoRA on a tiny Llama, its frozen base stored
as NF4 codes, the adapters' Adam moments as int8 codes) resume those quantized bytes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

STEPS, EVERY = 8, 2


def _job_case(stage: int, dtype: str, model: dict[str, Any]) -> Any:
    """The run's Case: TinyLM, or with `model` {"model_name": "llama", "lora": True} peft's LoRA on a tiny Llama."""
    from harness import Case

    return Case(stage=stage, optimizer="adamw", dtype=dtype, steps=STEPS, accumulation=2, **model)


def _merged(config: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`config` with `extra`'s sections laid over it key by key (`optimizer.state_dtype` keeps the Case's lr)."""
    return config | {k: config[k] | v if isinstance(v, dict) and isinstance(config.get(k), dict) else v for k, v in extra.items()}


def _second_block(module: Any) -> Any:
    """Block 1 of TinyLM, or decoder layer 1 of the Llama under peft's wrappers."""
    return module.blocks[1] if hasattr(module, "blocks") else module.get_submodule("base_model.model.model.layers.1")


def _kill_if(point: str, *, rank: int, now: int) -> None:
    want = os.environ.get("TZ_KILL", "")
    if want and want.split(":") == [point, str(now), str(rank)]:
        os.kill(os.getpid(), signal.SIGKILL)


class _DyingOptimizer:
    """The engine's optimizer, calling `die` after each unit it steps (so some units are stepped, some not)."""

    def __init__(self, inner: Any, *, die: Any) -> None:
        self._inner, self._die = inner, die

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def step(self, **kwargs: Any) -> None:
        self._inner.step(**kwargs)
        self._die()

    def step_converting(self, **kwargs: Any) -> None:
        """A bf16 gradient's step on the host ([Note: the converting step]): the same unit step."""
        self._inner.step_converting(**kwargs)
        self._die()


def _install_kill_hooks(engine: Any, rank: int) -> None:
    import tierzero.checkpoint.save_load as ckpt
    from tierzero.checkpoint.format import SafetensorsStream

    _second_block(engine.module).register_forward_pre_hook(
        lambda *_: _kill_if("forward", rank=rank, now=engine.global_step)
    )
    engine.stage.optimizer = _DyingOptimizer(engine.stage.optimizer, die=lambda: _kill_if("optimizer", rank=rank, now=engine.global_step))
    stream_write, writes = SafetensorsStream.write, [0]

    def write_then_maybe_die(self: SafetensorsStream, name: str, tensor: Any) -> None:
        stream_write(self, name, tensor)
        writes[0] += 1
        if writes[0] % 2 == 0:
            _kill_if("write", rank=rank, now=engine.global_step)

    SafetensorsStream.write = write_then_maybe_die  # type: ignore[method-assign]
    text_atomic = ckpt.write_text_atomic

    def die_before_latest(path: Path, text: str) -> None:
        _kill_if("publish", rank=rank, now=engine.global_step)
        text_atomic(path, text)

    ckpt.write_text_atomic = die_before_latest


def _main(env: dict[str, str]) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist
    from safetensors.torch import save_file

    import tierzero
    from tierzero.checkpoint import load_checkpoint, save_checkpoint

    torch.set_num_threads(1)
    root, out = Path(os.environ["TZ_ROOT"]), os.environ.get("TZ_OUT")
    extra = json.loads(os.environ.get("TZ_CONFIG", "{}"))
    case = _job_case(extra.pop("stage"), extra.pop("dtype"), extra.pop("case", {}))
    engine = tierzero.initialize(case.model(), _merged(case.config(), extra))
    rank, world = engine.comm.rank, engine.comm.world_size
    _install_kill_hooks(engine, rank)
    if os.environ.get("TZ_RESUME"):
        resumed = load_checkpoint(engine, root)
        if rank == 0:
            Path(os.environ["TZ_LOG"]).write_text(f"resumed from {resumed.name}\n")
    for step in range(engine.global_step, case.steps):
        for micro in range(case.accumulation):
            engine.backward(case.loss(engine, *case.micro_batch(step, micro=micro, rank=rank, world_size=world)))
            engine.step()
        if engine.global_step % EVERY == 0:
            save_checkpoint(engine, root, keep=2)
    state = engine.full_state_dict()
    if rank == 0 and out:
        save_file({k: v.clone() for k, v in state.items()}, out)
    engine.close()
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- the launcher ----------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(
    world: int, env: dict[str, str], *, target: Callable[[dict[str, str]], None] = _main, wait_for: int | None = None, timeout: float = 120
) -> list[int | None]:
    """Run `target(env)` on `world` forked ranks with torchrun's variables set; their exit codes.

    By default the others are killed once one fails, as torchrun does. With `wait_for`,
    only that rank's exit ends the wait: the others are left to notice a failure on
    their own. Ranks still running at the end are killed and reported as None.
    """
    import multiprocessing

    port = _free_port()
    ctx = multiprocessing.get_context("fork")
    procs = []
    for rank in range(world):
        rank_env = dict(env)
        if world > 1:
            rank_env |= {"RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(ctx.Process(target=target, args=(rank_env,)))
        procs[-1].start()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if wait_for is not None and procs[wait_for].exitcode is not None:
            break
        if wait_for is None and (all(p.exitcode is not None for p in procs) or any(p.exitcode for p in procs)):
            break
        time.sleep(0.05)
    codes = [p.exitcode for p in procs]
    for p in procs:
        if p.exitcode is None:
            p.kill()
        p.join()
    return codes if wait_for is not None else [p.exitcode for p in procs]


# Each kill leaves the run where the next launch resumes it: from the newest complete
# checkpoint, which after `publish` is newer than the one `latest` names.
# At two ranks the last rank dies where {last} stands; `publish` runs on rank 0 only.
CHAIN = [
    ("forward:3:{last}", None, "2"),  # dies in step 4's forward; checkpoint 2 exists
    ("optimizer:5:0", "2", "4"),  # resumes at 2, saves 4, dies inside step 6's optimizer step
    ("write:6:{last}", "4", "4"),  # dies writing checkpoint 6: only a .tmp directory is left
    ("publish:6:0", "4", "4"),  # checkpoint 6 is complete, but latest still says 4
    ("", "6", "8"),  # resumes at 6, the newest complete one, and finishes
]


QLORA = {
    "dtype": "bf16",
    "case": {"model_name": "llama", "lora": True},
    "model": {"lora": {"r": 4, "alpha": 8, "base_dtype": "nf4"}},
    "optimizer": {"state_dtype": "int8"},
}
RUNS = {
    "world1-stage3-bf16-nvme": (1, {"stage": 3, "dtype": "bf16", "offload": {"optimizer": "nvme", "params": "nvme"}}),
    "world2-stage3-bf16": (2, {"stage": 3, "dtype": "bf16"}),
    "world2-stage1-fp32-optimizer_cpu": (2, {"stage": 1, "dtype": "fp32", "offload": {"optimizer": "cpu"}}),
    # QLoRA with 8-bit moments (issue 43): an NF4 base and int8 exp_avg / exp_avg_sq, kept and resumed as bytes
    "world1-stage3-nf4-int8-nvme": (1, QLORA | {"stage": 3, "offload": {"optimizer": "nvme", "params": "nvme"}}),
    "world2-stage2-nf4-int8-optimizer_cpu": (2, QLORA | {"stage": 2, "offload": {"optimizer": "cpu"}}),
}


@pytest.mark.parametrize(("world", "config"), list(RUNS.values()), ids=list(RUNS))
def test_killed_and_resumed_runs_end_bitwise_equal(tmp_path: Path, world: int, config: dict[str, Any]) -> None:
    from safetensors.torch import load_file

    if "case" in config:
        pytest.importorskip("peft")
        _job_case(3, "fp32", config["case"]).model()  # imports transformers and peft here, not in each forked rank
    swap = tmp_path / "swap"
    swap.mkdir()
    base = {"TZ_CONFIG": json.dumps(config | {"tiers": {"nvme": {"path": str(swap)}}}), "TZ_LOG": str(tmp_path / "log")}
    assert launch(world, base | {"TZ_ROOT": str(tmp_path / "unbroken"), "TZ_OUT": str(tmp_path / "unbroken.safetensors")}) == [0] * world
    root = tmp_path / "broken"
    for kill, resumed_from, latest in CHAIN:
        env = base | {"TZ_ROOT": str(root), "TZ_OUT": str(tmp_path / "broken.safetensors"), "TZ_KILL": kill.format(last=world - 1)}
        if resumed_from is not None:
            env["TZ_RESUME"] = "1"
        codes = launch(world, env)
        assert (-signal.SIGKILL in codes) if kill else (codes == [0] * world), (kill, codes)
        if resumed_from is not None:
            assert (tmp_path / "log").read_text() == f"resumed from {resumed_from}\n"
        assert (root / "latest").read_text() == f"{latest}\n"
    if "case" in config:  # what was written and resumed: the base's NF4 codes, the adapters' int8 moments
        kinds = {k: v for unit in json.loads((root / "8" / "manifest.json").read_text())["units"] for k, v in unit["kinds"].items()}
        assert kinds["param.nf4"] == kinds["exp_avg"] == kinds["exp_avg_sq"] == "uint8", kinds
    expected, actual = load_file(tmp_path / "unbroken.safetensors"), load_file(tmp_path / "broken.safetensors")
    assert expected.keys() == actual.keys()
    assert all(expected[k].equal(actual[k]) for k in expected)
