"""A model built on the meta device is materialised by the engine one unit at a time."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tierzero
from tierzero.models.builtin import GPT, Llama, ModelSpec, rotary_tables

SPEC = ModelSpec(n_layer=3, n_head=2, d_model=32, d_ff=64, max_seq_len=16)
SEED = 7


def _config(**extra: Any) -> dict[str, Any]:
    return {
        "zero": {"stage": 3},
        "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.0},
        "train": {"seed": SEED},
        **extra,
    }


def _per_unit_reference(model_class: type[nn.Module]) -> dict[str, torch.Tensor]:
    """The weights the engine must produce: block i drawn from seed + i, then the root from seed + n_layer."""
    model = model_class(SPEC)
    for index, block in enumerate(model.blocks):
        torch.manual_seed(SEED + index)
        for module in block.modules():
            model.init_module(module)
    torch.manual_seed(SEED + SPEC.n_layer)
    root_modules = [m for name, m in model.named_children() if name != "blocks"]
    for module in root_modules:
        model.init_module(module)
    return {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("model_class", [GPT, Llama])
def test_meta_built_model_gets_the_per_unit_seeded_init_and_leaves_the_rng_alone(model_class: type[nn.Module]) -> None:
    expected = _per_unit_reference(model_class)
    with torch.device("meta"):
        model = model_class(SPEC)
    torch.manual_seed(123)
    rng_before = torch.get_rng_state()
    with tierzero.initialize(model, _config()) as engine:
        assert torch.equal(torch.get_rng_state(), rng_before)
        state = engine.full_state_dict()
        assert state is not None and list(state) == list(expected)
        for name, value in expected.items():
            assert torch.equal(state[name], value), name
        assert not any(t.is_meta for t in [*engine.module.parameters(), *engine.module.buffers()])
        if model_class is Llama:
            cos, sin = rotary_tables(head_dim=SPEC.head_dim, max_seq_len=SPEC.max_seq_len)
            assert torch.equal(engine.module.rope_cos, cos) and torch.equal(engine.module.rope_sin, sin)


def test_meta_built_gpt_keeps_gpt2_init_statistics_and_the_tie() -> None:
    spec = ModelSpec(n_layer=4, n_head=4, d_model=128, d_ff=512, max_seq_len=16)
    with torch.device("meta"):
        model = GPT(spec)
    with tierzero.initialize(model, _config()) as engine:
        state = engine.full_state_dict()
    assert state is not None
    residual_std = 0.02 / math.sqrt(2 * spec.n_layer)
    assert state["blocks.0.qkv.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert state["blocks.2.fc_out.weight"].std().item() == pytest.approx(residual_std, rel=0.05)
    assert torch.equal(state["blocks.1.fc.bias"], torch.zeros(spec.d_ff))
    assert torch.equal(state["ln_f.weight"], torch.ones(spec.d_model))
    assert state["lm_head.weight"] is state["tok_emb.weight"]
    assert state["tok_emb.weight"].std().item() == pytest.approx(0.02, rel=0.05)


def test_meta_built_gpt_trains_and_its_loss_falls() -> None:
    with torch.device("meta"):
        model = GPT(SPEC)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, SPEC.vocab_size, (4, SPEC.max_seq_len + 1), generator=gen)
    losses = []
    with tierzero.initialize(model, _config()) as engine:
        for _ in range(15):
            _, loss = engine(idx[:, :-1], idx[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    assert abs(losses[0] - math.log(SPEC.vocab_size)) < 0.2
    assert losses[-1] < losses[0] - 1.0


def test_a_model_half_on_meta_is_refused_with_the_fix() -> None:
    with torch.device("meta"):
        model = GPT(SPEC)
    model.blocks[0].qkv.weight = nn.Parameter(torch.zeros(3 * SPEC.d_model, SPEC.d_model))
    with pytest.raises(ValueError, match=r"^unit blocks\.0 has parameters both on the meta device and off it: build"):
        tierzero.initialize(model, _config())


_PEAK_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    import tierzero
    from tierzero.models.builtin import GPT, ModelSpec

    def hwm_bytes():
        with open("/proc/self/status") as f:
            return 1024 * next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

    device, swap = sys.argv[1], sys.argv[2]
    config = {
        "zero": {"stage": 3},
        "optimizer": {"type": "adamw", "lr": 1e-3},
        "offload": {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"},
        # Freed buffers go back to the kernel at once (below), so the peak is what the engine holds.
        "tiers": {"nvme": {"path": swap}, "cpu": {"keep_freed": 0}},
        "swapper": {"buffer_size": "1MiB", "buffer_count": 2},
        "prefetch": {"bytes": "1MiB", "max_live_bytes": "2MiB"},
    }
    # A first engine pays for lazy imports and allocator set-up outside the measurement.
    with torch.device("meta"):
        warm_up = GPT(ModelSpec())
    tierzero.initialize(warm_up, config).close()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM, the peak resident set, to the current one
    base = hwm_bytes()
    with torch.device(device):
        model = GPT(ModelSpec(n_layer=8, n_head=8, d_model=512, d_ff=2560, max_seq_len=16))
    engine = tierzero.initialize(model, config)
    peak = hwm_bytes()
    staging = engine.memory_report()["tiers"]["cpu"]["current"]
    engine.close()
    print(json.dumps({"delta": peak - base, "staging": staging}))
    """
)


def _init_peak(device: str, swap: Path) -> dict[str, int]:
    # A fixed mmap threshold makes glibc return every freed buffer of 1 MiB or more at
    # once; its default, adaptive one keeps freed buffers up to 32 MiB resident.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    done = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, device, str(swap)], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_initialize_of_a_meta_model_holds_one_unit_at_a_time(tmp_path: Path) -> None:
    with torch.device("meta"):
        model = GPT(ModelSpec(n_layer=8, n_head=8, d_model=512, d_ff=2560, max_seq_len=16))
    block = 4 * sum(p.numel() for p in model.blocks[0].parameters())
    root = 4 * sum(p.numel() for name, p in model.named_parameters() if not name.startswith("blocks."))
    meta, cpu = _init_peak("meta", tmp_path), _init_peak("cpu", tmp_path)
    # Built on the CPU, the whole model (8 blocks) is resident before the engine starts.
    assert cpu["delta"] > 8 * block
    # Built on meta: the store's staging, the unit's full buffer, and the transients of
    # registering it (the zero-filled gradient and optimizer slices, the store's copy).
    assert meta["delta"] - meta["staging"] < 3.5 * block + root
