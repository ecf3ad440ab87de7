"""Random-number generator states as JSON: torch (CPU and CUDA), numpy's global one, Python's `random`.

A loaded state is tried on scratch generators first (`parse_rng_state`), so a state file
that does not hold one is refused before any generator of the process changes.
"""

from __future__ import annotations

import base64
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tierzero.checkpoint.format import CheckpointError


def _encode(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode("ascii")


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8)


def rng_state() -> dict[str, Any]:
    legacy = np.random.get_state(legacy=True)
    assert isinstance(legacy, tuple), "legacy=True gives numpy's tuple form"
    kind, keys, pos, has_gauss, cached = legacy
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": _encode(torch.get_rng_state()),
        "numpy": {"kind": kind, "keys": [int(k) for k in keys], "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available():
        state["cuda"] = [_encode(s) for s in torch.cuda.get_rng_state_all()]
    return state


@dataclass(frozen=True, slots=True)
class RngState:
    """A saved state, decoded and known to be accepted by each generator."""

    torch: torch.Tensor
    numpy: tuple[Any, ...]
    python: tuple[Any, ...]
    cuda: list[torch.Tensor] | None


def parse_rng_state(state: Any, *, path: Path) -> RngState:
    """What `rng_state` saved, tried on scratch generators; CheckpointError naming `path` otherwise."""
    try:
        np_state, py = state["numpy"], state["python"]
        parsed = RngState(
            torch=_decode(state["torch"]),
            numpy=(np_state["kind"], np.asarray(np_state["keys"], dtype=np.uint32), np_state["pos"], np_state["has_gauss"], np_state["cached_gaussian"]),
            python=(py["version"], tuple(py["internal"]), py["gauss_next"]),
            cuda=[_decode(s) for s in state["cuda"]] if "cuda" in state else None,
        )
        keys, pos = np_state["keys"], np_state["pos"]
        # numpy takes any position and casts floats to keys silently: checked here
        if len(keys) != 624 or not all(type(k) is int for k in keys) or type(pos) is not int or not 0 <= pos <= 624:
            raise ValueError("numpy keys or position out of range")
        torch.Generator().set_state(parsed.torch)
        np.random.RandomState().set_state(parsed.numpy)
        random.Random().setstate(parsed.python)
    except (KeyError, TypeError, ValueError, OverflowError, RuntimeError, IndexError) as exc:
        raise CheckpointError(f"{path} holds no usable RNG state ({type(exc).__name__}): it is corrupt or was edited") from None
    return parsed


def set_rng_state(state: RngState) -> None:
    """Restore a parsed state (CUDA states only where CUDA is present and they were saved)."""
    torch.set_rng_state(state.torch)
    np.random.set_state(state.numpy)
    random.setstate(state.python)
    if torch.cuda.is_available() and state.cuda is not None:
        # A job resumed on fewer GPUs per node restores the devices it has.
        for index, value in enumerate(state.cuda[: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(value, device=index)
