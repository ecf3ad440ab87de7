"""Streamed pretrained weights are exact: full_state_dict() equals from_pretrained's weights bit for bit,
for sharded fp32 and bf16 files, Llama and GPT-2 (tied embeddings), at world size 1, 2 and 4."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import run_ranks
from tiny_models import tiny_llama

transformers = pytest.importorskip("transformers")

MODELS = ("llama", "gpt2")
DTYPES = ("float32", "bfloat16")


def _model(kind: str) -> Any:
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=3, n_head=2, n_positions=32)
        return transformers.GPT2LMHeadModel(config)
    return tiny_llama(vocab=96, layers=3, kv_heads=1)


def _job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    import tierzero
    from tierzero.pretrained import build_meta_model

    states = {}
    for kind in MODELS:
        for dtype in DTYPES:
            directory = Path(root) / f"{kind}-{dtype}"
            with tierzero.initialize(build_meta_model(directory), {"zero": {"stage": 3}}, pretrained=directory) as engine:
                states[(kind, dtype)] = engine.full_state_dict()
    return states


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pretrained")
    for kind in MODELS:
        for dtype in DTYPES:
            model = _model(kind).to(getattr(torch, dtype))
            # small shards: the model spans several files and their index
            model.save_pretrained(root / f"{kind}-{dtype}", safe_serialization=True, max_shard_size="20KB")
            assert (root / f"{kind}-{dtype}" / "model.safetensors.index.json").exists()
    return root


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_streamed_weights_equal_from_pretrained_bit_for_bit(saved: Path, world_size: int) -> None:
    states = run_ranks(_job, world_size=world_size, payload=str(saved))[0]
    for kind in MODELS:
        for dtype in DTYPES:
            reference = transformers.AutoModelForCausalLM.from_pretrained(saved / f"{kind}-{dtype}", dtype=getattr(torch, dtype))
            expected = dict(reference.named_parameters(remove_duplicate=False))
            state = states[(kind, dtype)]
            assert set(state) == set(expected), (kind, dtype)
            for name, value in expected.items():
                assert torch.equal(state[name], value.detach().float()), (kind, dtype, name)
            if kind == "gpt2":
                assert torch.equal(state["lm_head.weight"], state["transformer.wte.weight"])
