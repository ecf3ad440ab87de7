"""The device the new CUDA tests compute on, in one fixture (tests/gpu/cuda_or_cpu.py says when it is the CPU)."""

from __future__ import annotations

import pytest
import torch
from cuda_or_cpu import compute_device


@pytest.fixture
def cuda() -> torch.device:
    """torch.device("cuda", <current>), or torch.device("cpu") under TIERZERO_GPU_TESTS_ON_CPU=1."""
    return compute_device()
