"""Importing tierzero first gives torch's large host allocations transparent huge pages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# Prints the environment's value, then the huge-page bytes backing a fresh 64 MiB tensor.
_PROBE = """
import os, tierzero, torch
t = torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
address, huge = t.data_ptr(), None
for line in open("/proc/self/smaps"):
    head = line.split()
    if "-" in head[0] and ":" not in head[0]:
        start, end = (int(x, 16) for x in head[0].split("-"))
        inside = start <= address < end
    elif inside and head[0] == "AnonHugePages:":
        huge = int(head[1]) << 10
print(os.environ.get("THP_MEM_ALLOC_ENABLE"), huge)
"""


def _probe(**env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    command = [sys.executable, "-c", _PROBE]
    out = subprocess.run(command, env={**clean, **env}, capture_output=True, text=True, check=True)
    value, huge = out.stdout.split()
    return value, int(huge)


def _thp_mode() -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise", "never"), None where unknown."""
    if not _MODE.exists():
        return None
    return _MODE.read_text().split("[")[1].split("]")[0]


def test_importing_tierzero_turns_huge_pages_on_and_a_user_value_wins() -> None:
    assert _probe()[0] == "1"
    assert _probe(THP_MEM_ALLOC_ENABLE="0")[0] == "0"


@pytest.mark.skipif(_thp_mode() != "madvise", reason="only a madvise kernel tells torch's choice apart")
def test_a_large_tensor_lies_in_huge_pages_unless_the_user_turns_them_off() -> None:
    assert _probe()[1] > 0
    assert _probe(THP_MEM_ALLOC_ENABLE="0")[1] == 0
