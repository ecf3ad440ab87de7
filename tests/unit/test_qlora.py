"""LoRA on a block-wise quantized frozen base (`model.lora.base_dtype`: QLoRA), against peft on a plain model.

The reference is peft's LoRA in plain PyTorch on a model whose base weights are the dequantized
NF4 (or int8) values, each weight quantized alone by tierzero/units/blockwise.py (every weight of
the test model is a whole number of 64-element blocks, so its blocks are the unit's). In fp32 on
the CPU at one rank, the engine's run must be that run bit for bit, at every stage and tier (SGD:
the engine's AdamW rounds a few elements an ulp apart from torch's, which is not this test's subject).
"""

from __future__ import annotations

import copy
import json
import os
import struct
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import tiny_llama

import tierzero
from tierzero.config import ConfigError, load_config
from tierzero.config.deepspeed.translate import translate_deepspeed
from tierzero.units.blockwise import dequantize_int8, dequantize_nf4, nf4_nbytes, quantize_int8, quantize_nf4
from tierzero.units.quantized_base import BaseCodec, BaseDtype

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

STEPS, VOCAB = 3, 64
TARGETS = ["q_proj", "v_proj"]


def _llama() -> Any:
    return tiny_llama(vocab=VOCAB, hidden=64)


def _round_trip(weight: torch.Tensor, dtype: str) -> torch.Tensor:
    if dtype == "int8":
        return dequantize_int8(quantize_int8(weight))
    return dequantize_nf4(quantize_nf4(weight))


def _with_lora(base: Any) -> Any:
    model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
    with torch.no_grad():  # B away from zero, so that the adapters change the output from the first step
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.05)
    return model


def _pair(dtype: str = "nf4") -> tuple[Any, Any]:
    """(the model the engine gets, peft's on the dequantized base): the same adapters, the same base before quantizing."""
    base = _llama()
    reference = copy.deepcopy(base)
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(_round_trip(p, dtype))
    return _with_lora(base), _with_lora(reference)


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))


def _train_reference(model: Any, *, steps: int = STEPS) -> tuple[list[float], dict[str, torch.Tensor]]:
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    losses, x = [], _batch()
    for _ in range(steps):
        loss = model(input_ids=x, labels=x).loss
        losses.append(loss.item())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _config(tmp_path: Path, *, stage: int, params: str, dtype: str = "nf4", **lora: Any) -> dict[str, Any]:
    (tmp_path / "swap").mkdir(exist_ok=True)
    return {
        "zero": {"stage": stage},
        "optimizer": {"type": "sgd", "lr": 0.1},
        "precision": {"param_dtype": "fp32"},
        "model": {"lora": {"r": 4, "alpha": 8, "base_dtype": dtype, **lora}},
        "offload": {"params": params},
        "tiers": {"nvme": {"path": str(tmp_path / "swap")}},
    }


def _train_engine(engine: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses = _steps(engine, STEPS)
    return losses, engine.full_state_dict()


def _frozen_units(engine: Any) -> list[Any]:
    return [u for u in engine.units if not u.trainable]


@pytest.mark.parametrize(
    ("stage", "params", "dtype"),
    [(1, "device", "nf4"), (2, "device", "nf4"), (3, "device", "nf4"), (3, "cpu", "nf4"), (3, "nvme", "nf4"), (3, "nvme", "int8")],
)
def test_lora_on_a_quantized_base_is_peft_on_the_dequantized_base_bit_for_bit(
    tmp_path: Path, stage: int, params: str, dtype: str
) -> None:
    model, reference = _pair(dtype)
    ref_losses, ref_params = _train_reference(reference)
    with tierzero.initialize(model, _config(tmp_path, stage=stage, params=params, dtype=dtype)) as engine:
        losses, trained = _train_engine(engine)
        report = engine.memory_report()
        frozen = _frozen_units(engine)
        trained_units = [u for u in engine.units if u.trainable]
    assert losses == ref_losses
    for name, value in ref_params.items():
        assert torch.equal(trained[name], value), name
    # The base's bytes on its tier: one piece per unit (one rank), codes and fp32 scales, nothing else.
    codec = BaseCodec(dtype=BaseDtype(dtype))
    per_piece = {"nf4": lambda n: n // 2 + 4 * (n // 64), "int8": lambda n: n + 4 * (n // 64)}[dtype]
    base_bytes = sum(per_piece(u.padded_numel) for u in frozen)
    assert base_bytes == sum(codec.stored_nbytes(u.padded_numel, pieces=1) for u in frozen)
    adapters = sum(4 * u.padded_numel for u in trained_units)
    placement = report["placement"]
    assert placement[params]["param"] == base_bytes + adapters  # the adapters' fp32 parameters live beside it
    assert report["kinds"]["param"] == base_bytes + adapters


@pytest.mark.parametrize("dtype", ["nf4", "int8"])
def test_stage_3_decodes_fetched_units_ahead_on_a_thread_of_their_own(
    tmp_path: Path, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # [Note: decoding ahead]: the native decode of each fetched unit starts on the decoder's thread and
    # the compute thread finishes it, sharing what is left ([Note: a shared decode]); the run stays
    # peft's bit for bit.
    from tierzero.native.dequant import SharedDecode, native_dequant

    if native_dequant() is None:
        pytest.skip("the native library is not built here")
    calls: list[str] = []

    def recorded(method: Any) -> Any:
        def call(self: SharedDecode) -> Any:
            idle = os.sched_getscheduler(threading.get_native_id()) == os.SCHED_IDLE
            calls.append(f"{method.__name__} on {threading.current_thread().name}{' (idle)' if idle else ''}")
            return method(self)

        return call

    monkeypatch.setattr(SharedDecode, "help", recorded(SharedDecode.help))
    monkeypatch.setattr(SharedDecode, "finish", recorded(SharedDecode.finish))
    model, reference = _pair(dtype)
    ref_losses, ref_params = _train_reference(reference)
    with tierzero.initialize(model, _config(tmp_path, stage=3, params="nvme", dtype=dtype)) as engine:
        losses = _steps(engine, STEPS)
        in_steps = list(calls)
        trained = engine.full_state_dict()
    assert losses == ref_losses
    for name, value in ref_params.items():
        assert torch.equal(trained[name], value), name
    # Each step gathers the base at least once, and the compute finishes every decode it reaches.
    finished = [c for c in in_steps if c.startswith("finish")]
    assert len(finished) >= STEPS and set(finished) == {"finish on MainThread"}, in_steps
    # Every decode was started on the decoder's thread, which runs only where the compute leaves a core
    # idle (`yield_to_others`): at its turn, perhaps after the compute finished it; the last by close.
    helps, finishes = Counter(c for c in calls if c.startswith("help")), Counter(c for c in calls if c.startswith("finish"))
    assert helps == {"help on tierzero-decode_0 (idle)": finishes["finish on MainThread"]}, calls


def test_the_base_streams_from_pretrained_files_quantized_unit_by_unit(tmp_path: Path) -> None:
    from tierzero.pretrained import build_meta_model

    base = _llama()
    base.save_pretrained(tmp_path / "llama", safe_serialization=True, max_shard_size="40KB")
    saved = {n: p.detach().clone() for n, p in base.named_parameters()}
    model = tierzero.pretrained.lora.apply_lora(build_meta_model(tmp_path / "llama"), r=4, alpha=8, target_modules=TARGETS)
    with tierzero.initialize(model, _config(tmp_path, stage=3, params="nvme"), pretrained=tmp_path / "llama") as engine:
        state = engine.full_state_dict()
    for name, value in state.items():
        if "lora_" in name:
            continue
        plain = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        assert torch.equal(value, dequantize_nf4(quantize_nf4(saved[plain]))), name


def test_double_quantized_nf4_keeps_fewer_bytes_and_decodes_as_blockwise_does(tmp_path: Path) -> None:
    model, _ = _pair()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with tierzero.initialize(model, _config(tmp_path, stage=3, params="cpu", double_quant=True)) as engine:
        frozen = _frozen_units(engine)
        adapters = sum(4 * u.padded_numel for u in engine.units if u.trainable)
        cpu = engine.memory_report()["placement"]["cpu"]["param"] - adapters
        state = engine.full_state_dict()
    assert cpu == sum(nf4_nbytes(u.padded_numel, double_quant=True) for u in frozen)
    assert cpu < sum(nf4_nbytes(u.padded_numel) for u in frozen)
    for unit in frozen:  # one piece per unit (one rank): blockwise's double quantization of its padded flat values
        flat = torch.zeros(unit.padded_numel)
        for slot in unit.slots:
            flat[slot.offset : slot.offset + slot.numel] = before[slot.name].reshape(-1)
        expected = dequantize_nf4(quantize_nf4(flat, double_quant=True))
        for slot in unit.slots:
            assert torch.equal(state[slot.name].reshape(-1), expected[slot.offset : slot.offset + slot.numel]), slot.name


def test_a_corrupted_scale_is_refused_in_one_line(tmp_path: Path) -> None:
    from tierzero.common.slices import Kind, SliceKey

    model, _ = _pair()
    with tierzero.initialize(model, _config(tmp_path, stage=3, params="cpu")) as engine:
        unit = _frozen_units(engine)[0]
        key = SliceKey(unit.name, Kind.PARAM)
        stored = engine.store.fetch(key, to=tierzero.common.slices.Tier.CPU).wait().clone()
        engine.store.release(key)
        stored[unit.padded_numel // 2 + 4 : unit.padded_numel // 2 + 8] = torch.tensor([float("nan")]).view(torch.uint8)
        engine.store.write_back(key, stored).wait()
        with pytest.raises(ValueError) as caught:
            engine(input_ids=_batch(), labels=_batch())
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"unit {unit.name}: quantized base holds absmax nan at block 1 (1 bad)")


def test_base_dtype_is_refused_where_it_is_not_built() -> None:
    with pytest.raises(ConfigError, match=r"model.lora.base_dtype is nf4 but model.lora.r is 0"):
        load_config({"model": {"lora": {"base_dtype": "nf4"}}})
    with pytest.raises(ConfigError, match=r"model.lora.base_dtype bf16 differs from precision.param_dtype fp32"):
        load_config({"precision": {"param_dtype": "fp32"}, "model": {"lora": {"r": 4, "base_dtype": "bf16"}}})
    with pytest.raises(ConfigError, match=r"model.lora.double_quant needs model.lora.base_dtype nf4"):
        load_config({"model": {"lora": {"r": 4, "base_dtype": "int8", "double_quant": True}}})
    # the param dtype spelled out is the default, LoRA or not
    assert load_config({"precision": {"param_dtype": "bf16"}, "model": {"lora": {"base_dtype": "bf16"}}}).model.lora.base_dtype == "bf16"


def test_deepspeed_quantized_nontrainable_weights_is_an_int8_base() -> None:
    ds = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": True}}
    assert translate_deepspeed(ds).config["model"]["lora"]["base_dtype"] == "int8"
    off = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "zero_quantized_nontrainable_weights": False}}
    assert "model" not in translate_deepspeed(off).config


def _tensor_offset(path: Path, name: str) -> int:
    """Where tensor `name`'s bytes start in the safetensors file `path`."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return 8 + length + json.loads(raw[8 : 8 + length])[name]["data_offsets"][0]


def _frozen_codes(engine: Any) -> dict[str, torch.Tensor]:
    from tierzero.common.slices import Kind, SliceKey, Tier

    out = {}
    for unit in _frozen_units(engine):
        key = SliceKey(unit.name, Kind.PARAM)
        out[unit.name] = engine.store.fetch(key, to=Tier.CPU).wait().clone()
        engine.store.release(key)
    return out


def _steps(engine: Any, count: int) -> list[float]:
    losses, x = [], _batch()
    for _ in range(count):
        loss = engine(input_ids=x, labels=x).loss
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
    return losses


@pytest.mark.parametrize(("stage", "params", "resume_stage", "resume_params"), [(3, "nvme", 1, "device"), (1, "device", 3, "cpu")])
def test_a_checkpoint_keeps_the_codes_and_scales_and_resumes_bit_exactly(
    tmp_path: Path, stage: int, params: str, resume_stage: int, resume_params: str
) -> None:
    from tierzero.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    model, _ = _pair()
    with tierzero.initialize(model, _config(tmp_path, stage=stage, params=params)) as engine:
        _steps(engine, 1)
        directory = save_checkpoint(engine, tmp_path / "ckpt")
        codes = _frozen_codes(engine)
        rest = _steps(engine, 2)
        final = engine.full_state_dict()
    unit = next(iter(codes))
    kinds = next(u for u in json.loads((directory / "manifest.json").read_text())["units"] if u["name"] == unit)["kinds"]
    assert kinds == {"param.nf4": "uint8"}
    with tierzero.initialize(_pair()[0], _config(tmp_path, stage=resume_stage, params=resume_params)) as engine:
        load_checkpoint(engine, directory)
        assert all(torch.equal(c, _frozen_codes(engine)[name]) for name, c in codes.items())
        assert _steps(engine, 2) == rest
        assert all(torch.equal(value, final[name]) for name, value in engine.full_state_dict().items())
    for other in ({"base_dtype": "int8"}, {"base_dtype": "param"}, {"double_quant": True}):
        config = _config(tmp_path, stage=3, params="cpu")
        config["model"]["lora"].update(other)
        with tierzero.initialize(_pair()[0], config) as engine:
            with pytest.raises(CheckpointError) as info:
                load_checkpoint(engine, directory)
        message = str(info.value)
        assert "\n" not in message and "resume with the model.lora.base_dtype the checkpoint was written with" in message
        assert f"{unit}'s frozen base is stored as model.lora.base_dtype nf4, this run's is" in message


def test_a_corrupted_scale_in_a_checkpoint_is_refused_in_one_line(tmp_path: Path) -> None:
    from test_checkpoint_fuzz import _resign

    from tierzero.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    with tierzero.initialize(_pair()[0], _config(tmp_path, stage=3, params="cpu")) as engine:
        directory = save_checkpoint(engine, tmp_path / "ckpt")
        unit = _frozen_units(engine)[1]
        rank_file = directory / "rank-00000.safetensors"
        data = bytearray(rank_file.read_bytes())
        at = _tensor_offset(rank_file, f"{unit.name}/param.nf4") + unit.padded_numel // 2 + 4 * 3  # block 3's absmax
        data[at : at + 4] = struct.pack("<f", -2.0)
        rank_file.write_bytes(bytes(data))
        _resign(directory)  # the checksums vouch for it: the loader's own check must refuse it
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(engine, directory)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"rank 0: {directory}: unit {unit.name}: quantized base holds absmax -2.0 at block 3")


@pytest.mark.parametrize(("dtype", "double_quant"), [("nf4", False), ("nf4", True), ("int8", False)])
def test_the_codec_is_blockwise_piece_by_piece(dtype: str, double_quant: bool) -> None:
    values = torch.randn(3 * 4096, generator=torch.Generator().manual_seed(5)) * torch.linspace(0.01, 3.0, 3 * 4096)
    codec = BaseCodec(dtype=BaseDtype(dtype), double_quant=double_quant)
    stored = codec.encode(values, pieces=3)
    assert stored.dtype == torch.uint8 and stored.numel() == codec.stored_nbytes(values.numel(), pieces=3)
    expected = torch.cat([
        dequantize_nf4(quantize_nf4(piece, double_quant=double_quant)) if dtype == "nf4" else dequantize_int8(quantize_int8(piece))
        for piece in values.view(3, 4096)
    ])  # fmt: skip
    for out_dtype in (torch.float32, torch.bfloat16):
        out = codec.decode(stored, out=torch.empty(values.numel(), dtype=out_dtype), pieces=3, what="test")
        assert torch.equal(out, expected.to(out_dtype))
