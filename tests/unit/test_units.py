"""Cutting models into units: which parameters go where, offsets, padding, tied weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import tierzero.units.unit as units_module
from tierzero.units.precision import reads_fp32_under_autocast
from tierzero.units.unit import DEFAULT_ALIGN_NUMEL, ROOT, UnitState, is_root, module_of, plan_units


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, 2 * width)
        self.out = nn.Linear(2 * width, width, bias=False)


class TinyLM(nn.Module):
    def __init__(self, *, vocab: int = 11, width: int = 8, layers: int = 3, tie: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.heads = nn.ModuleList([nn.Linear(width, 1)])  # a smaller ModuleList: not the unit list
        self.lm_head = nn.Linear(width, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.embed.weight


def test_default_units_are_the_largest_module_list_plus_root() -> None:
    model = TinyLM(width=8)
    units = plan_units(model, world_size=2, align_numel=4)
    assert [u.name for u in units] == ["blocks.0", "blocks.1", "blocks.2", ROOT]
    block = units[0]
    assert [s.name for s in block.slots] == ["blocks.0.fc.weight", "blocks.0.fc.bias", "blocks.0.out.weight"]
    assert [s.offset for s in block.slots] == [0, 128, 144]
    assert block.numel == 8 * 16 + 16 + 16 * 8 == 272
    assert block.padded_numel == 272  # already a multiple of 2 x 4
    assert block.shard_range(1) == (136, 272)
    assert block.module is model.blocks[0]


def test_padding_makes_equal_contiguous_shards() -> None:
    units = plan_units(TinyLM(width=8), world_size=3, align_numel=4)
    root = units[-1]
    # root: embed (11 x 8, tied with lm_head) + heads.0 weight 8 + bias 1 = 97 -> multiple of 12
    assert root.numel == 97
    assert root.padded_numel == 108
    assert root.shard_numel == 36
    assert [root.shard_range(r) for r in range(3)] == [(0, 36), (36, 72), (72, 108)]


def test_tied_weights_are_one_slot_with_two_bindings() -> None:
    model = TinyLM(tie=True)
    root = plan_units(model, world_size=1)[-1]
    embed = next(s for s in root.slots if s.name == "embed.weight")
    assert [b.name for b in embed.bindings] == ["embed.weight", "lm_head.weight"]
    assert sum(s.numel for s in root.slots) == root.numel == 11 * 8 + 8 + 1
    untied_root = plan_units(TinyLM(tie=False), world_size=1)[-1]
    assert untied_root.numel == 2 * 11 * 8 + 8 + 1


def test_parameter_shared_by_two_blocks_moves_to_root() -> None:
    model = TinyLM(tie=False)
    model.blocks[2].out.weight = model.blocks[0].out.weight
    units = {u.name: u for u in plan_units(model, world_size=1)}
    assert "blocks.0.out.weight" not in [s.name for s in units["blocks.0"].slots]
    shared = next(s for s in units[ROOT].slots if s.name == "blocks.0.out.weight")
    assert [b.name for b in shared.bindings] == ["blocks.0.out.weight", "blocks.2.out.weight"]


def test_unit_classes_choose_wrapped_modules() -> None:
    model = TinyLM()
    units = plan_units(model, world_size=1, unit_classes=["Linear"])
    names = [u.name for u in units]
    # every Linear not inside another wrapped module; the tied lm_head weight is also
    # reachable from the root's embedding, so it lives in the root.
    assert names == ["blocks.0.fc", "blocks.0.out", "blocks.1.fc", "blocks.1.out", "blocks.2.fc", "blocks.2.out", "heads.0", ROOT]
    assert [s.name for s in units[-1].slots] == ["embed.weight"]


def test_unknown_unit_class_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"zero.unit_classes names \['GPT2Block'\], which the model does not contain"):
        plan_units(TinyLM(), world_size=1, unit_classes=["GPT2Block"])


def test_model_without_module_list_is_one_root_unit() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    units = plan_units(model, world_size=4, align_numel=8)
    assert [u.name for u in units] == [ROOT]
    assert units[0].numel == 20 + 10 and units[0].padded_numel == 32


def test_flatten_and_views_round_trip_with_zero_padding() -> None:
    model = TinyLM(width=4)
    unit = plan_units(model, world_size=2, align_numel=64)[0]
    params = [getattr(s.bindings[0].module, s.bindings[0].attr).detach() for s in unit.slots]
    out = torch.full((unit.padded_numel,), 7.0)
    unit.flatten(params, out=out)
    for slot, p in zip(unit.slots, params):
        assert torch.equal(slot.view(out), p)
    assert torch.count_nonzero(out[unit.numel :]) == 0
    assert unit.padded_numel == 128


def test_state_transitions_are_guarded() -> None:
    unit = plan_units(TinyLM(), world_size=1)[0]
    unit.transition(UnitState.GATHERING, allowed_from=(UnitState.SHARDED,))
    unit.transition(UnitState.GATHERED, allowed_from=(UnitState.GATHERING,))
    with pytest.raises(AssertionError, match="gathered -> gathering"):
        unit.transition(UnitState.GATHERING, allowed_from=(UnitState.SHARDED,))


def test_world_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        plan_units(TinyLM(), world_size=0)


def test_frozen_parameters_form_units_of_their_own_after_the_trained_ones() -> None:
    model = TinyLM(tie=False)
    model.embed.weight.requires_grad_(False)
    model.blocks[1].fc.bias.requires_grad_(False)
    units = plan_units(model, world_size=2)
    names = [u.name for u in units]
    trained = [u.name for u in plan_units(TinyLM(tie=False), world_size=2)]
    assert names == trained + ["blocks.1:frozen", "root:frozen"]
    by_name = {u.name: u for u in units}
    assert [s.name for s in by_name["root"].slots] == ["heads.0.weight", "heads.0.bias", "lm_head.weight"]
    assert [s.name for s in by_name["root:frozen"].slots] == ["embed.weight"]
    assert [s.name for s in by_name["blocks.1:frozen"].slots] == ["blocks.1.fc.bias"]
    assert not by_name["root:frozen"].trainable and by_name["root"].trainable
    assert by_name["blocks.1:frozen"].module is by_name["blocks.1"].module
    assert by_name["blocks.1:frozen"].padded_numel % (2 * DEFAULT_ALIGN_NUMEL) == 0


def _autocast_model() -> TinyLM:
    model = TinyLM(width=8, layers=2)
    for block in model.blocks:
        block.norm = nn.LayerNorm(8)  # type: ignore[assignment]
    model.blocks[1].norm.bias.requires_grad_(False)
    return model


def test_autocast_keeps_what_it_reads_in_fp32_in_units_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Linear weights and biases stay in the compute dtype; the embedding (tied to a Linear
    head), a norm and a frozen norm go to `:fp32` units, numbered after the trained ones."""
    monkeypatch.setattr(units_module, "SMALL_FP32_BYTES", 0)
    model = _autocast_model()
    units = plan_units(model, world_size=1, align_numel=4, keep_fp32=reads_fp32_under_autocast)
    names = {u.name: ([s.name for s in u.slots], u.dtype, u.trainable) for u in units}
    assert list(names) == [
        "blocks.0", "blocks.1", ROOT, "blocks.0:fp32", "blocks.1:fp32", "root:fp32", "blocks.1:fp32:frozen"
    ]  # fmt: skip
    assert names["blocks.0"] == (["blocks.0.fc.weight", "blocks.0.fc.bias", "blocks.0.out.weight"], None, True)
    assert names["blocks.0:fp32"] == (["blocks.0.norm.weight", "blocks.0.norm.bias"], torch.float32, True)
    assert names["blocks.1:fp32:frozen"] == (["blocks.1.norm.bias"], torch.float32, False)
    assert names["root:fp32"] == (["embed.weight"], torch.float32, True)  # also lm_head.weight
    assert names[ROOT] == (["heads.0.weight", "heads.0.bias"], None, True)
    assert {u.module for u in units if u.name.startswith("blocks.1")} == {model.blocks[1]}
    assert all(module_of(u.name) == ROOT for u in units if is_root(u)) and sum(map(is_root, units)) == 2


def test_small_fp32_parameters_join_the_roots_after_its_own() -> None:
    """A block's norms (a few bytes here, below SMALL_FP32_BYTES) are kept gathered with the root's."""
    model = _autocast_model()
    units = plan_units(model, world_size=1, align_numel=4, keep_fp32=reads_fp32_under_autocast)
    names = {u.name: [s.name for s in u.slots] for u in units}
    assert list(names) == ["blocks.0", "blocks.1", ROOT, "root:fp32", "root:fp32:frozen"]
    assert names["root:fp32"] == ["embed.weight", "blocks.0.norm.weight", "blocks.0.norm.bias", "blocks.1.norm.weight"]
    assert names["root:fp32:frozen"] == ["blocks.1.norm.bias"]


def _same_views(ours: tuple[torch.Tensor, ...], theirs: list[torch.Tensor], flat: torch.Tensor) -> bool:
    return all(
        a.shape == b.shape and a.stride() == b.stride() and a.data_ptr() == b.data_ptr() and a._base is flat
        for a, b in zip(ours, theirs, strict=True)
    )


def test_a_units_views_are_each_slots_view_of_the_buffer() -> None:
    unit = plan_units(TinyLM(width=8), world_size=2, align_numel=4)[0]
    flat = torch.arange(unit.padded_numel, dtype=torch.bfloat16)
    assert _same_views(unit.views(flat), [slot.view(flat) for slot in unit.slots], flat)
    inner = flat.new_zeros(unit.padded_numel + 5)[5:]  # a buffer that starts inside its storage
    assert _same_views(unit.views(inner), [slot.view(inner) for slot in unit.slots], inner._base)


def test_a_unit_with_an_empty_parameter_or_slots_out_of_order_gets_each_slots_own_view() -> None:
    model = TinyLM(width=8)
    model.blocks[0].fc.bias = nn.Parameter(torch.empty(0))
    unit = plan_units(model, world_size=1)[0]
    flat = torch.zeros(unit.padded_numel)
    views = unit.views(flat)
    assert [v.shape for v in views] == [slot.shape for slot in unit.slots]
    assert all(v.data_ptr() == s.view(flat).data_ptr() for v, s in zip(views, unit.slots, strict=True))
    reordered = plan_units(TinyLM(width=8), world_size=1)[0]
    reordered.slots = tuple(reversed(reordered.slots))
    flat = torch.zeros(reordered.padded_numel)
    assert [v.data_ptr() for v in reordered.views(flat)] == [s.view(flat).data_ptr() for s in reordered.slots]


def test_a_binding_sets_a_plain_tensor_and_respects_a_modules_own_setattr() -> None:
    seen: list[str] = []

    class Watched(nn.Linear):
        def __setattr__(self, name: str, value: object) -> None:
            seen.append(name)
            super().__setattr__(name, value)

    plain, watched = nn.Linear(2, 2), Watched(2, 2)
    seen.clear()
    for module in (plain, watched):
        del module._parameters["weight"]
        value = torch.ones(2, 2)
        units_module.Binding(module=module, attr="weight", name="weight").set(value)
        assert module.weight is value and "weight" not in module._parameters
    assert seen == ["weight"]
