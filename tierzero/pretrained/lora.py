"""LoRA through peft: small trained adapters on a frozen base that the engine shards and offloads.

A peft model is an ordinary module to the engine: its adapters (`lora_A`, `lora_B`) are
trained parameters and the base's weights frozen ones, so each block becomes a small
trained unit and a large frozen one (units.py), and only the adapters carry gradients
and optimizer states. The base can live on NVMe like any parameter slice.

Two things need help here. A base built on the meta device (the only way to hold a model
larger than memory) makes peft build its adapters on meta too, where peft's own
initialisation does nothing: `materialize_adapters` allocates them on the CPU and runs
peft's init from a seed, the same on every rank. And the adapters are saved in peft's
format (`adapter_model.safetensors`, `adapter_config.json`) by `save_adapters`, which
gathers only the trained units, never the base.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = [
    "adapter_parameter_names", "adapter_state", "adapters_off", "apply_lora", "is_peft_model", "materialize_adapters",
    "save_adapters", "write_adapters",
]  # fmt: skip

#: peft's name of the adapter tierzero trains.
ADAPTER = "default"


def is_peft_model(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def _adapter_modules(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(module name, tuner layer, attribute) of every adapter container of peft's tuner layers."""
    found = []
    for name, module in model.named_modules():
        for attr in getattr(module, "adapter_layer_names", ()):
            if isinstance(getattr(module, attr, None), (nn.ModuleDict, nn.ParameterDict)):
                found.append((name, module, attr))
    return found


def adapter_parameter_names(model: nn.Module) -> frozenset[str]:
    """The state-dict names of the adapters' parameters: what no pretrained file holds."""
    names = set()
    for name, module, attr in _adapter_modules(model):
        for sub, _ in getattr(module, attr).named_parameters():
            names.add(f"{name}.{attr}.{sub}" if name else f"{attr}.{sub}")
    return frozenset(names)


def materialize_adapters(model: nn.Module, *, seed: int) -> None:
    """Adapters still on the meta device: allocated on the CPU and initialised by peft, from `seed`.

    Every rank computes the same values, so no broadcast is needed. The caller's RNG is left as it was.
    """
    layers = {id(module): module for _, module, attr in _adapter_modules(model) if _on_meta(getattr(module, attr))}
    if not layers:
        return
    config = getattr(model, "peft_config", {}).get(ADAPTER)
    init = getattr(config, "init_lora_weights", True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for module in layers.values():
            for attr in module.adapter_layer_names:
                container = getattr(module, attr, None)
                if isinstance(container, (nn.ModuleDict, nn.ParameterDict)) and _on_meta(container):
                    container.to_empty(device="cpu")
            with torch.no_grad():
                module.reset_lora_parameters(ADAPTER, init)


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Within the block, `model`'s LoRA adapters are switched off: its forward is the frozen base's.

    DPO's reference (tierzero/align/) is this forward: the same base, no second copy of the
    model. Under the engine the units gather as usual (a block's adapters and base are gathered
    together); the adapters are only not applied. The layers that were on are turned on again
    on the way out, whatever happens inside. peft's switch also sets the adapters' requires_grad
    (on again: trained), as its own `disable_adapter` does; under the engine the adapters are
    no module's parameters any more, so that changes nothing there.
    """
    tuners = list({id(module): module for _, module, _ in _adapter_modules(model)}.values())
    if not tuners:
        raise ValueError(f"adapters_off needs a model with LoRA adapters, got {type(model).__name__}: set model.lora (or use apply_lora)")
    layers = [layer for layer in tuners if not layer.disable_adapters]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def _on_meta(container: nn.Module) -> bool:
    return any(p.is_meta for p in container.parameters())


def apply_lora(
    model: nn.Module,
    *,
    r: int,
    alpha: float,
    dropout: float = 0.0,
    target_modules: Sequence[str] | None = None,
    seed: int = 0,
) -> nn.Module:
    """`model` wrapped by peft with LoRA adapters of rank `r` on `target_modules` (None: peft's
    default for the architecture), the base frozen, the adapters materialised even on a meta base."""
    try:
        import peft
    except ImportError:
        raise ValueError("model.lora needs the peft package: pip install peft (or tierzero[lora])") from None
    config = peft.LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=list(target_modules) if target_modules else None,
        task_type="CAUSAL_LM" if hasattr(model, "generation_config") else None,
    )
    try:
        wrapped = peft.get_peft_model(model, config)
    except ValueError as exc:
        detail = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise ValueError(f"model.lora.target_modules {list(target_modules or [])} do not fit the model ({detail}): "
                         "name Linear modules it has, e.g. q_proj, v_proj") from None
    _refuse_non_linear(wrapped, target_modules)
    materialize_adapters(wrapped, seed=seed)
    return wrapped


def _refuse_non_linear(wrapped: nn.Module, target_modules: Sequence[str] | None) -> None:
    """Adapters only on Linear layers (GPT-2's Conv1D counts): peft's embedding and convolution adapters
    keep their weights under other names and shapes (lora_embedding_A), which the engine's adapter
    init, units and saved adapters do not handle."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    for name, module in wrapped.named_modules():
        if isinstance(module, LoraLayer) and not isinstance(module, LoraLinear):
            base = type(module.get_base_layer()).__name__
            raise ValueError(
                f"model.lora.target_modules {list(target_modules or [])} puts an adapter on {name.split('.')[-1]} "
                f"({base}), and tierzero trains LoRA on Linear layers only: name Linear modules, e.g. q_proj, v_proj"
            )


def save_adapters(engine: Any, directory: str | os.PathLike[str]) -> Path | None:
    """Write the trained adapters in peft's format to `directory` (rank 0; None elsewhere). Collective.

    Only the trained units are gathered: the frozen base is never read. The directory is
    written beside its final name and renamed when complete; `PeftModel.from_pretrained(base,
    directory)` loads it.
    """
    state = adapter_state(engine)
    return None if state is None else write_adapters(engine.module, state, directory)


def adapter_state(engine: Any) -> dict[str, torch.Tensor] | None:
    """The trained units' fp32 parameters by the model's names, on rank 0 (None elsewhere). Collective."""
    model = engine.module
    if not is_peft_model(model):
        raise ValueError(f"save_adapters needs a peft model, got {type(model).__name__}: wrap it with tierzero.pretrained.lora.apply_lora")
    state: dict[str, torch.Tensor] = {}
    for unit in engine.units:
        if not unit.trainable:
            continue
        full = engine.stage.gather_fp32(unit)
        for slot in unit.slots:
            for b in slot.bindings:
                state[b.name] = slot.view(full).detach().to("cpu", copy=True)
    return state if engine.comm.rank == 0 else None


def write_adapters(model: nn.Module, state: dict[str, torch.Tensor], directory: str | os.PathLike[str]) -> Path:
    """`adapter_model.safetensors` and `adapter_config.json` of `state` in `directory`, all at once."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import save_file

    adapters = get_peft_model_state_dict(model, state_dict=state, adapter_name=ADAPTER, save_embedding_layers=False)
    final = Path(directory)
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.parent / f".{final.name}.tmp-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        save_file({k: v.contiguous() for k, v in adapters.items()}, staging / "adapter_model.safetensors", {"format": "pt"})
        model.peft_config[ADAPTER].save_pretrained(str(staging))
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final
