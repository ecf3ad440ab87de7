"""The dry run's model functions as shapes only (estimate/shapes.py): the same replay, bit for bit in its counts."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn import functional as F

from tierzero.config import load_config
from tierzero.estimate import dry_run as D
from tierzero.estimate.shapes import ShapesOnly
from tierzero.models.builtin import build_model

NVME = {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"}


def _raw(swap: Path, *, stage: int, offload: dict[str, str], model: str = "gpt", **top: Any) -> dict[str, Any]:
    return {
        "zero": {"stage": stage, "unit_classes": ["Linear"] if stage == 3 else []},
        "optimizer": {"type": "adamw", "lr": 1e-3},
        "model": {"type": model, "n_layer": 2, "n_head": 2, "d_model": 64, "d_ff": 256, "max_seq_len": 16},
        "train": {"steps": 3, "micro_batch_size": 2, "seq_len": 16},
        "offload": offload,
        "tiers": {"nvme": {"path": str(swap), "block_size": "64KiB", "queue_depth": 4}},
        "swapper": {"buffer_size": "64KiB", "buffer_count": 4},
        **top,
    }


def _counts(run: D.DryRun) -> dict[str, Any]:
    return {f.name: getattr(run, f.name) for f in dataclasses.fields(run) if f.name not in ("model", "plan", "units")}


@pytest.mark.parametrize(
    "case",
    [
        {"stage": 3, "offload": NVME},
        {"stage": 3, "offload": {"params": "cpu", "gradients": "nvme", "optimizer": "nvme"}, "gradient_clipping": 1.0},
        {"stage": 3, "offload": NVME, "model": "llama", "gradient_accumulation_steps": 2},
        {"stage": 2, "offload": {"optimizer": "nvme"}},
        {"stage": 1, "offload": {"optimizer": "cpu"}, "precision": {"param_dtype": "bf16"}},
        {"stage": 3, "offload": NVME, "activations": {"checkpoint": 1}},
        {"stage": 3, "offload": NVME, "activations": {"offload": "cpu"}},
    ],
    ids=["stage3-nvme", "stage3-clipped", "llama-accumulated", "stage2", "stage1-bf16", "checkpointed", "offloaded"],
)
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_dry_run_counts_as_it_does_through_the_meta_kernels(
    case: dict[str, Any], world_size: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_config(_raw(tmp_path, **case))
    shaped = _counts(D.dry_run(cfg, world_size=world_size))
    D._kept.clear()
    monkeypatch.setattr(D, "ShapesOnly", contextlib.nullcontext)
    assert shaped == _counts(D.dry_run(cfg, world_size=world_size))


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_every_parameter_gets_a_gradient_of_its_shape_module_by_module_in_the_meta_kernels_order(
    model: str, tmp_path: Path
) -> None:
    """Within one module the parameters' gradients may land in another order (a linear's weight
    before its bias, in one node): the modules finish in the meta kernels' order."""
    cfg = load_config(_raw(tmp_path, stage=3, offload=NVME, model=model))

    def arrivals(mode: Any) -> list[tuple[str, torch.Size, torch.dtype]]:
        landed: list[tuple[str, torch.Size, torch.dtype]] = []
        with mode:
            net = build_model(cfg.model, device="meta", seed=0)
            for name, p in net.named_parameters():
                p.register_post_accumulate_grad_hook(
                    lambda p, name=name: landed.append((name, p.grad.shape, p.grad.dtype))
                )
            ids = torch.empty(2, 16, dtype=torch.long, device="meta")
            _, loss = net(ids, ids)
            loss.backward()
        return landed

    def modules(landed: list[tuple[str, torch.Size, torch.dtype]]) -> list[str]:
        order = [name.rsplit(".", 1)[0] for name, _, _ in landed]
        return [m for i, m in enumerate(order) if i == 0 or order[i - 1] != m]

    shaped, kernels = arrivals(ShapesOnly()), arrivals(contextlib.nullcontext())
    assert modules(shaped) == modules(kernels) and sorted(shaped) == sorted(kernels)
    net = build_model(cfg.model, device="meta", seed=0)
    assert sorted(shaped) == sorted((name, p.shape, p.dtype) for name, p in net.named_parameters())


def test_off_the_meta_device_and_for_per_token_losses_torch_computes() -> None:
    x, w, b = torch.randn(3, 4, 8), torch.randn(5, 8), torch.randn(5)
    logits, target = torch.randn(6, 5), torch.tensor([0, 1, 2, 3, 4, 0])
    with ShapesOnly():
        linear = F.linear(x, w, b)
        init = torch.nn.init.normal_(torch.zeros(4))
        per_token = F.cross_entropy(logits.to("meta"), target.to("meta"), reduction="none")
        with pytest.warns(UserWarning, match="size_average and reduce"):
            legacy = F.cross_entropy(logits.to("meta"), target.to("meta"), reduce=False)
        mean = F.cross_entropy(logits.to("meta"), target.to("meta"))
    assert torch.equal(linear, F.linear(x, w, b))
    assert bool(init.ne(0).all())
    assert per_token.shape == legacy.shape == (6,) and mean.shape == () and mean.dtype == torch.float32
