"""Pretrained weights streamed from a transformers model directory into units: exact values, tied
and prefixed names, every refusal as one line, and reads that stay within a rank's shard."""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import tiny_llama
from torch import nn

from tierzero.engine.materialize import flat_fp32
from tierzero.pretrained import PretrainedError, PretrainedWeights, build_meta_model
from tierzero.units.unit import plan_units

transformers = pytest.importorskip("transformers")

BLOCK = {"gpt2": "GPT2Block", "llama": "LlamaDecoderLayer"}
CPU = torch.device("cpu")


def _gpt2(*, vocab: int = 48, width: int = 32, layers: int = 2, base: bool = False) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=vocab, n_positions=16, n_embd=width, n_layer=layers, n_head=2, bos_token_id=0, eos_token_id=0
    )
    return (transformers.GPT2Model if base else transformers.GPT2LMHeadModel)(config)


def _llama(*, tie: bool = False) -> nn.Module:
    return tiny_llama(vocab=48, kv_heads=1, positions=16, seed=1, tie_word_embeddings=tie)


def _save(model: nn.Module, directory: Path, *, dtype: torch.dtype = torch.float32, sharded: bool = False) -> nn.Module:
    """`model` converted to `dtype` and saved by save_pretrained; the converted copy is the reference."""
    saved = copy.deepcopy(model).to(dtype)
    saved.save_pretrained(directory, max_shard_size="8KB" if sharded else "5GB")
    return saved


def _rewrite(source: Path, target: Path, edit: Any) -> Path:
    """A single-file copy of `source` whose tensors `edit(tensors)` changed in place."""
    target.mkdir()
    shutil.copy(source / "config.json", target / "config.json")
    tensors = load_file(source / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors")
    return target


def _opened(directory: Path) -> tuple[PretrainedWeights, nn.Module]:
    model = build_meta_model(directory)
    weights = PretrainedWeights.open(directory).for_model(model)
    weights.check(model)
    return weights, model


def _refusal(call: Any) -> str:
    with pytest.raises(PretrainedError) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    return message


def _assert_units_match(weights: PretrainedWeights, meta: nn.Module, saved: nn.Module, *, block: str) -> None:
    """Every unit's full buffer and every rank's shard, for 1, 2 and 3 ranks, equal the saved model's bitwise."""
    for world_size in (1, 2, 3):
        units = plan_units(meta, world_size=world_size, unit_classes=[block])
        reference = plan_units(saved, world_size=world_size, unit_classes=[block])
        assert [u.name for u in units] == [u.name for u in reference] and len(units) == 3
        for unit, ref in zip(units, reference):
            assert [s.name for s in unit.slots] == [s.name for s in ref.slots]
            expected = flat_fp32(ref, device=CPU)
            assert torch.equal(weights.unit_range(unit, start=0, end=unit.padded_numel), expected)
            for rank in range(world_size):
                start, end = unit.shard_range(rank)
                assert torch.equal(weights.unit_range(unit, start=start, end=end), expected[start:end]), (unit.name, rank)


CASES = [
    ("gpt2", torch.float32, False),
    ("gpt2", torch.float32, True),
    ("gpt2", torch.bfloat16, True),
    ("llama", torch.float32, False),
    ("llama", torch.float16, True),
    ("llama", torch.bfloat16, False),
]


@pytest.mark.parametrize(("name", "dtype", "sharded"), CASES, ids=[f"{n}-{str(d)[6:]}-{'sharded' if s else 'single'}" for n, d, s in CASES])
def test_unit_ranges_equal_the_saved_model(tmp_path: Path, name: str, dtype: torch.dtype, sharded: bool) -> None:
    saved = _save(_gpt2() if name == "gpt2" else _llama(), tmp_path, dtype=dtype, sharded=sharded)
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    if sharded:
        assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 2
    weights, meta = _opened(tmp_path)
    assert all(p.is_meta for p in meta.parameters())
    assert {info.dtype for info in weights.tensors.values()} == {{torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}[dtype]}
    _assert_units_match(weights, meta, saved, block=BLOCK[name])


def test_read_range_of_odd_ranges_reads_whole_rows_and_returns_exactly_the_range(tmp_path: Path) -> None:
    saved = _save(_llama(), tmp_path, dtype=torch.bfloat16)
    weights, _ = _opened(tmp_path)
    wq = saved.model.layers[0].self_attn.q_proj.weight.detach().float().reshape(-1)
    norm = saved.model.norm.weight.detach().float()
    for start, end in [(0, 1), (5, 77), (31, 33), (32, 64), (0, wq.numel()), (wq.numel(), wq.numel())]:
        got = weights.read_range(["model.layers.0.self_attn.q_proj.weight"], shape=(32, 32), start=start, end=end)
        assert got.dtype == torch.float32 and torch.equal(got, wq[start:end])
    assert torch.equal(weights.read_range(["model.norm.weight"], shape=(32,), start=3, end=19), norm[3:19])
    with pytest.raises(ValueError, match=r"^range \[5, 1025\) is outside tensor model.norm.weight's 32 elements$"):
        weights.read_range(["model.norm.weight"], shape=(32,), start=5, end=1025)


def test_unit_range_across_slots_into_padding_and_into_out(tmp_path: Path) -> None:
    saved = _save(_gpt2(), tmp_path)
    weights, meta = _opened(tmp_path)
    unit = plan_units(meta, world_size=3, unit_classes=["GPT2Block"])[0]
    expected = flat_fp32(plan_units(saved, world_size=3, unit_classes=["GPT2Block"])[0], device=CPU)
    assert unit.padded_numel > unit.numel
    second = unit.slots[1].offset
    for start, end in [(second - 3, second + 5), (unit.numel - 7, unit.padded_numel), (unit.numel + 1, unit.padded_numel), (9, 9)]:
        out = torch.full((end - start,), float("nan"))
        assert weights.unit_range(unit, start=start, end=end, out=out) is out
        assert torch.equal(out, expected[start:end])
    with pytest.raises(ValueError, match=rf"^range \[0, {unit.padded_numel + 1}\) is outside unit transformer.h.0's"):
        weights.unit_range(unit, start=0, end=unit.padded_numel + 1)
    with pytest.raises(ValueError, match=r"^out has shape \[4\], expected \[8\] for range \[0, 8\)$"):
        weights.unit_range(unit, start=0, end=8, out=torch.empty(4))


def test_scalar_and_empty_tensors_and_buffers(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    model[1].running_mean.fill_(0.5)
    model[1].num_batches_tracked.fill_(7)
    model.register_buffer("scale", torch.tensor(2.5))
    (tmp_path / "config.json").write_text("{}")
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "model.safetensors")
    weights = PretrainedWeights.open(tmp_path)
    weights.check(model)
    assert torch.equal(weights.read_range(["scale"], shape=(), start=0, end=1), torch.tensor([2.5]))
    assert torch.equal(weights.read_range(["1.running_mean"], shape=(2,), start=1, end=2), torch.tensor([0.5]))
    steps = weights.read_tensor(["1.num_batches_tracked"], shape=())
    assert steps.dtype == torch.int64 and steps.item() == 7


def test_tied_gpt2_head_resolves_under_either_saved_name(tmp_path: Path) -> None:
    saved = _save(_gpt2(), tmp_path / "hf")
    weights, meta = _opened(tmp_path / "hf")
    assert "lm_head.weight" not in weights.tensors  # transformers saves one name of the tied pair
    root = plan_units(meta, world_size=2, unit_classes=["GPT2Block"])[-1]
    tied = next(s for s in root.slots if len(s.bindings) == 2)
    assert [b.name for b in tied.bindings] == ["transformer.wte.weight", "lm_head.weight"]
    assert weights.lookup(["lm_head.weight", "transformer.wte.weight"]).name == "transformer.wte.weight"

    head_only = _rewrite(tmp_path / "hf", tmp_path / "head", lambda t: t.update({"lm_head.weight": t.pop("transformer.wte.weight")}))
    weights, meta = _opened(head_only)
    assert weights.lookup(["transformer.wte.weight", "lm_head.weight"]).name == "lm_head.weight"
    _assert_units_match(weights, meta, saved, block="GPT2Block")


def test_tied_llama_embeddings(tmp_path: Path) -> None:
    saved = _save(_llama(tie=True), tmp_path, dtype=torch.bfloat16, sharded=True)
    weights, meta = _opened(tmp_path)
    assert "lm_head.weight" not in weights.tensors
    _assert_units_match(weights, meta, saved, block="LlamaDecoderLayer")


def test_files_of_the_base_model_read_under_the_head_models_prefix(tmp_path: Path) -> None:
    """GPT-2 on the hub: `h.0.attn.c_attn.weight` for `transformer.h.0...`, plus old `attn.bias` masks."""
    base = _save(_gpt2(base=True), tmp_path / "base")
    hub = _rewrite(tmp_path / "base", tmp_path / "hub", lambda t: t.update({"h.0.attn.bias": torch.ones(1, 1, 16, 16)}))
    config = json.loads((hub / "config.json").read_text())
    assert config["architectures"] == ["GPT2Model"]
    meta = build_meta_model(hub)
    assert type(meta).__name__ == "GPT2LMHeadModel"
    raw = PretrainedWeights.open(hub)
    assert "transformer.wte.weight" in _refusal(lambda: raw.check(meta))
    weights = raw.for_model(meta)
    assert weights.prefix == "transformer" and weights.for_model(meta) is weights
    weights.check(meta)  # the stray attn.bias is one transformers itself skips
    saved = transformers.GPT2LMHeadModel(base.config)
    saved.transformer.load_state_dict(base.state_dict())
    _assert_units_match(weights, meta, saved, block="GPT2Block")
    head = _save(_gpt2(), tmp_path / "head")
    assert PretrainedWeights.open(tmp_path / "head").for_model(head).prefix == ""


# ---- refusals of the directory -------------------------------------------------------


def test_refuses_a_directory_without_config_or_weights(tmp_path: Path) -> None:
    _save(_gpt2(), tmp_path)
    (tmp_path / "config.json").unlink()
    assert _refusal(lambda: PretrainedWeights.open(tmp_path)) == (
        f"{tmp_path}/config.json is missing: point at the folder save_pretrained wrote (config.json beside model.safetensors)"
    )
    assert _refusal(lambda: build_meta_model(tmp_path)).startswith(f"{tmp_path}/config.json is missing")
    assert _refusal(lambda: PretrainedWeights.open(tmp_path / "nowhere")).startswith(
        f"{tmp_path}/nowhere/config.json is missing ({tmp_path}/nowhere is not a directory)"
    )
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    assert _refusal(lambda: PretrainedWeights.open(tmp_path)) == (
        f"{tmp_path} holds neither model.safetensors nor model.safetensors.index.json "
        "(its pytorch_model.bin is a pickle, which tierzero does not load): "
        "save the model with save_pretrained(directory), which writes safetensors"
    )


def test_refuses_an_index_naming_a_missing_shard_or_a_shard_without_the_tensor(tmp_path: Path) -> None:
    _save(_gpt2(), tmp_path, sharded=True)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map = index["weight_map"]
    name = "transformer.h.1.mlp.c_fc.weight"
    shard, other = weight_map[name], weight_map["transformer.wte.weight"]
    assert shard != other

    weight_map[name] = other
    index_path.write_text(json.dumps(index))
    assert _refusal(lambda: PretrainedWeights.open(tmp_path)) == (
        f"{index_path} maps tensor {name} to {tmp_path / other}, which does not hold it: "
        "the index and its shards come from different saves; download or save_pretrained the model again"
    )
    weight_map[name] = shard
    index_path.write_text(json.dumps(index))
    (tmp_path / shard).unlink()
    first = next(n for n, s in weight_map.items() if s == shard)
    assert _refusal(lambda: PretrainedWeights.open(tmp_path)) == (
        f"{index_path} maps tensor {first} to {tmp_path / shard}, which is missing: download or save_pretrained the model again"
    )
    index_path.write_text("{\"weight_map\": ")
    assert _refusal(lambda: PretrainedWeights.open(tmp_path)) == (
        f"{index_path} is not valid JSON (Expecting value): it is corrupt or was replaced; "
        "download or save_pretrained the model again"
    )


def test_refuses_truncated_files_and_headers_that_are_not_json(tmp_path: Path) -> None:
    _save(_gpt2(), tmp_path)
    path = tmp_path / "model.safetensors"
    raw = path.read_bytes()
    (length,) = torch.tensor(list(raw[:8]), dtype=torch.uint8).view(torch.int64).tolist()
    last = max(json.loads(raw[8 : 8 + length]).items(), key=lambda kv: kv[1]["data_offsets"][1] if kv[0] != "__metadata__" else -1)

    path.write_bytes(raw[:-10])
    assert _refusal(lambda: PretrainedWeights.open(tmp_path)) == (
        f"{path} is truncated: tensor {last[0]} ends at data byte {last[1]['data_offsets'][1]}, "
        f"the file holds {len(raw) - 8 - length - 10} data bytes: download or save_pretrained the model again"
    )
    path.write_bytes(raw[: 8 + length // 2])
    assert _refusal(lambda: PretrainedWeights.open(tmp_path)) == (
        f"{path} is truncated: its header claims {8 + length} bytes, the file has {8 + length // 2}: "
        "download or save_pretrained the model again"
    )
    path.write_bytes(raw[:8] + b"#" + raw[9:])
    assert _refusal(lambda: PretrainedWeights.open(tmp_path)) == (
        f"{path} has a header that is not valid JSON (Expecting value): it is corrupt or was replaced; "
        "download or save_pretrained the model again"
    )


def test_refuses_header_entries_that_are_malformed_of_unknown_dtype_or_missized(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    path = tmp_path / "model.safetensors"

    def refusal(entry: dict[str, Any]) -> str:
        raw = json.dumps({"x": entry}).encode()
        path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(64))
        return _refusal(lambda: PretrainedWeights.open(tmp_path))

    refetch = "download or save_pretrained the model again"
    assert refusal({"dtype": "F32", "data_offsets": [0, 4]}) == (
        f'{path}: tensor x has a malformed header entry {{"dtype": "F32", "data_offsets": [0, 4]}} '
        f"(expected a dtype, a shape and data_offsets of ints): {refetch}"
    )
    assert refusal({"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}) == (
        f"{path}: tensor x is C64, which tierzero does not read "
        "(it reads F64, F32, F16, BF16, F8_E4M3, F8_E5M2, I64, I32, I16, I8, U8, BOOL): save the model in BF16, F16 or F32"
    )
    assert refusal({"dtype": "BF16", "shape": [2, 3], "data_offsets": [0, 8]}) == (
        f"{path}: tensor x spans bytes [0, 8), but BF16 [2, 3] needs 12: {refetch}"
    )


# ---- refusals of weights that do not fit the model -----------------------------------


def test_check_refuses_missing_unexpected_misshapen_and_non_float_tensors(tmp_path: Path) -> None:
    _save(_gpt2(), tmp_path / "hf")
    meta = build_meta_model(tmp_path / "hf")

    def refusal(name: str, edit: Any) -> str:
        weights = PretrainedWeights.open(_rewrite(tmp_path / "hf", tmp_path / name, edit))
        return _refusal(lambda: weights.check(meta))

    fix = "fix config.json or save_pretrained the model again"
    assert refusal("missing", lambda t: t.pop("transformer.h.0.ln_1.bias")) == (
        f"{tmp_path}/missing: tensor transformer.h.0.ln_1.bias of GPT2LMHeadModel is in none of its safetensors files: {fix}"
    )
    assert refusal("no_tie", lambda t: t.pop("transformer.wte.weight")) == (
        f"{tmp_path}/no_tie: tensor transformer.wte.weight (or lm_head.weight) of GPT2LMHeadModel "
        f"is in none of its safetensors files: {fix}"
    )
    assert refusal("unexpected", lambda t: t.update({"transformer.h.0.adapter.weight": torch.zeros(2)})) == (
        f"{tmp_path}/unexpected/model.safetensors: tensor transformer.h.0.adapter.weight is nowhere in GPT2LMHeadModel: {fix}"
    )
    assert refusal("shape", lambda t: t.update({"transformer.wpe.weight": torch.zeros(17, 32)})) == (
        f"{tmp_path}/shape/model.safetensors: tensor transformer.wpe.weight has shape [17, 32], "
        f"GPT2LMHeadModel expects [16, 32]: {fix}"
    )
    assert refusal("int", lambda t: t.update({"transformer.ln_f.weight": torch.ones(32, dtype=torch.int32)})) == (
        f"{tmp_path}/int/model.safetensors: tensor transformer.ln_f.weight is I32, "
        f"GPT2LMHeadModel expects floating point (BF16, F16 or F32): {fix}"
    )
    several = refusal("several", lambda t: [t.pop(k) for k in ("transformer.h.0.ln_1.bias", "transformer.h.1.ln_1.bias")])
    assert several.endswith(f"of GPT2LMHeadModel is in none of its safetensors files: {fix} (and 1 more)")


def test_check_refuses_a_buffer_of_another_integer_dtype(tmp_path: Path) -> None:
    model = nn.BatchNorm1d(2)
    (tmp_path / "config.json").write_text("{}")
    state = {k: v.float() for k, v in model.state_dict().items()}
    save_file(state, tmp_path / "model.safetensors")
    message = _refusal(lambda: PretrainedWeights.open(tmp_path).check(model))
    assert message.startswith(f"{tmp_path}/model.safetensors: tensor num_batches_tracked is F32, BatchNorm1d expects torch.int64")


def test_reads_refuse_names_absent_and_shapes_other_than_the_files(tmp_path: Path) -> None:
    _save(_gpt2(), tmp_path)
    weights = PretrainedWeights.open(tmp_path)
    assert _refusal(lambda: weights.read_range(["lm_head.bias"], shape=(48,), start=0, end=1)) == (
        f"{tmp_path}: tensor lm_head.bias is in none of its safetensors files: "
        "call weights.check(model) before reading, to learn what does not fit"
    )
    assert _refusal(lambda: weights.read_range(["transformer.wpe.weight"], shape=(8, 64), start=0, end=1)) == (
        f"{tmp_path}/model.safetensors: tensor transformer.wpe.weight has shape [16, 32], the model expects [8, 64]: "
        "fix config.json or save_pretrained the model again"
    )


def test_build_meta_model_refuses_an_unknown_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    message = _refusal(lambda: build_meta_model(tmp_path))
    assert message.startswith(f"{tmp_path}/config.json: transformers {transformers.__version__} cannot build a causal LM from it (")
    assert message.endswith("): fix config.json or upgrade transformers")


# ---- reading only what a rank keeps --------------------------------------------------


def test_a_rank_reads_its_shard_not_the_file(tmp_path: Path) -> None:
    _save(_gpt2(vocab=8192, width=256, layers=4), tmp_path)
    file_bytes = (tmp_path / "model.safetensors").stat().st_size
    assert file_bytes > 20e6
    weights, meta = _opened(tmp_path)
    assert weights.read.bytes == 0  # open and check read headers only
    world_size, total = 4, 0
    for unit in plan_units(meta, world_size=world_size, unit_classes=["GPT2Block"]):
        for rank in range(world_size):
            before = weights.read.bytes
            start, end = unit.shard_range(rank)
            weights.unit_range(unit, start=start, end=end)
            read = weights.read.bytes - before
            total += read
            # At most one partial row at each end of each parameter the shard touches.
            rows = sum(2 * math.prod(s.shape[1:]) for s in unit.slots if s.offset < end and start < s.offset + s.numel)
            assert read <= 4 * (end - start + rows), (unit.name, rank)
            assert read < file_bytes / 8, (unit.name, rank, read)
    assert total < file_bytes  # the blocks' shards: each row about once, the root's tensors not at all
