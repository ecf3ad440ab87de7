"""Freed host memory kept for reuse: a block allocated where one was freed costs no page faults."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import tierzero
import tierzero.engine.engine
from tierzero.models.builtin import GPT, ModelSpec

# Allocates, touches and frees 64 MiB, then counts the page faults of a 40 MiB block: more than
# glibc ever serves from the heap by default, and small enough to fit the freed block wherever
# it lies (a block of the same size needs room for the alignment torch asks for).
_PROBE = """
import resource, sys, torch
from tierzero.offload.host_heap import keep_freed_memory
kept = keep_freed_memory(int(sys.argv[1]))
torch.empty(64 << 20, dtype=torch.uint8).fill_(1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty(40 << 20, dtype=torch.uint8).fill_(2)
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults_of_a_second_block(top: int) -> tuple[bool, int]:
    # 4 KiB pages, so that a block faulted in afresh shows 10240 faults.
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "0"}
    out = subprocess.run([sys.executable, "-c", _PROBE, str(top)], env=env, capture_output=True, text=True, check=True)
    kept, faults = out.stdout.split()
    return kept == "True", int(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc settings")
def test_a_freed_block_is_reused_without_faults_and_not_when_turned_off() -> None:
    kept, faults = _faults_of_a_second_block(512 << 20)
    assert kept and faults < 256
    kept, faults = _faults_of_a_second_block(0)
    assert not kept and faults >= (40 << 20) // 4096 // 2


@pytest.mark.parametrize("keep", [0, 256 << 20])
def test_the_engine_keeps_what_the_config_says(keep: int, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []
    monkeypatch.setattr(tierzero.engine.engine, "keep_freed_memory", asked.append)
    model = GPT(ModelSpec(n_layer=1, n_head=2, d_model=32, d_ff=64, max_seq_len=16, vocab_size=64))
    cfg = {"zero": {"stage": 3}, "optimizer": {"type": "adamw", "lr": 1e-3}, "tiers": {"cpu": {"keep_freed": keep}}}
    tierzero.initialize(model, cfg).close()
    assert asked == [keep]
