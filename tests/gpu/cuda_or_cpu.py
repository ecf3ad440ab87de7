"""Where the CUDA tests run: the GPU, or the host for a dry run of their logic (TIERZERO_GPU_TESTS_ON_CPU=1).

The CUDA tests cannot run on a machine without a GPU, yet most of what they check (parity with
plain PyTorch, byte counts, the plan's budgets) is the same code on the host. With the variable
set, the tests written against `needs_cuda` and the `cuda` fixture (tests/gpu/conftest.py) run
on the CPU; an assertion that only means something on CUDA (memory_allocated, mem_get_info)
is skipped there, where the test says so. Without the variable and without CUDA they skip.
"""

from __future__ import annotations

import os

import pytest
import torch

__all__ = ["ON_CPU", "compute_device", "needs_cuda"]

ON_CPU = os.environ.get("TIERZERO_GPU_TESTS_ON_CPU") == "1"
"""A dry run on the host: the CUDA tests' logic, without a GPU (or beside one left unused)."""

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() or ON_CPU), reason="needs a CUDA GPU (TIERZERO_GPU_TESTS_ON_CPU=1 dry-runs it on the CPU)"
)


def compute_device() -> torch.device:
    """The device the tests compute on: the current CUDA device, or the CPU in a dry run."""
    return torch.device("cpu") if ON_CPU else torch.device("cuda", torch.cuda.current_device())
