"""tierzero: a ZeRO engine for PyTorch whose shards live in GPU memory, host memory and NVMe.

Importing tierzero before torch turns on transparent huge pages for torch's host
allocations of 2 MiB and more (`THP_MEM_ALLOC_ENABLE`, read by torch once, at its first
allocation; a value already in the environment wins). An offloaded step allocates
unit-sized host buffers all the time (gradients, scratch, fetched copies): with 4 KiB
pages each fresh GiB costs about 0.4 s of page faults on the cores the step computes on
(docs/benchmarks-journal.md, session 8). Programs that import torch first can set the variable
themselves.
"""

import os

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import importlib

# Its at-fork hook: a child fork()ed from here on runs the native kernels on threads of its own.
from tierzero.native import forks as _forks  # noqa: E402, F401

__version__ = "0.1.0"

__all__ = ["Engine", "initialize"]

_LAZY = {"initialize": "tierzero.api", "Engine": "tierzero.engine.engine"}
"""The public names, imported on first use: `tierzero --help` and the package's light modules
(the config, the command table) load without torch's seconds of import."""


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module 'tierzero' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value
