"""`engine.generate` on a GPU: the greedy tokens of transformers' own `generate` on the same GPU, for a
tiny Llama (grouped-query attention, left-padded prompts of mixed lengths) whose parameters live on
the device, in host memory or on NVMe at stage 3.

Skipped without CUDA; TIERZERO_GPU_TESTS_ON_CPU=1 runs it on the host (tests/gpu/cuda_or_cpu.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from cuda_or_cpu import needs_cuda

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
from generate_cases import NEW_TOKENS, PLACEMENTS, engine_config, engine_generate, hf_model, prompts, reference  # noqa: E402

pytestmark = needs_cuda
pytest.importorskip("transformers")


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_greedy_tokens_are_transformers_generate_s_on_the_same_gpu(cuda: torch.device, tmp_path: Path, placement: str) -> None:
    model = hf_model("llama")
    ids, mask = (t.to(cuda) for t in prompts())
    expected = reference(model.to(cuda), ids, mask, max_new_tokens=NEW_TOKENS).cpu()
    model.cpu()  # the engine takes the model from the host, as a user hands it over
    got = engine_generate(model, engine_config(3, placement, tmp_path), ids, mask, max_new_tokens=NEW_TOKENS)
    assert got.device == ids.device
    assert expected.shape == (ids.shape[0], ids.shape[1] + NEW_TOKENS)
    assert len(set(expected[:, ids.shape[1] :].flatten().tolist())) >= 10  # wandering greedy tokens: equality says something
    assert torch.equal(got.cpu(), expected)
