"""One fp32 state dict from a sharded checkpoint, or a transformers directory (`tierzero consolidate`).

Given a directory instead (`tierzero consolidate CKPT out/`), it writes `out/model.safetensors`
and, for a `model.type: transformers` run, the model's `config.json` beside it, so that the
class's `from_pretrained(out)` loads the trained weights. With `--hf` (`consolidate_hf`) it writes
the directory save_pretrained would, through tierzero/checkpoint/export.py: sharded safetensors
and their index in the training dtype (or `--dtype`), config.json, generation_config.json and the
run's tokenizer, for `AutoModelForCausalLM.from_pretrained(out)` and `AutoTokenizer.from_pretrained(out)`;
for a LoRA run, the base with the adapters merged into it, in bf16 unless told ([Note: merged LoRA
export] in lora_merge.py), or with `--adapters-only` (`consolidate_adapters`) the adapters alone in
peft's format, as `train --export` writes them.

The output is an ordinary safetensors file of the model's full fp32 parameters by the
model's own names, plus its buffers and frozen parameters, for `model.load_state_dict`
(through `load_consolidated`) or `safetensors.torch.load_model`. A tied parameter is
stored once, under its first name, as `save_pretrained` does; the file's metadata lists
its other names, which `load_consolidated` fills in.

It streams: one unit's full buffer is rebuilt from the rank files at a time, so memory
is bounded by the largest unit (in fp32), never the model; `--hf` adds one tensor cast to the
written dtype, and writes each tensor to its shard as it comes (a LoRA run's merge also holds its
adapters, all of them, in fp32). The checkpoint's files are verified
first, every number of its manifest against them; the output is written beside its final
name and renamed when complete, never on, in or around the checkpoint's root (it would replace
the checkpoint's own files, or be pruned with them) nor what the run read (its model.pretrained,
data and tokenizer, as the manifest records them).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tierzero.checkpoint.base_codes import BASE_KINDS, check_codes, codec_of_kind
from tierzero.checkpoint.export import (
    DEFAULT_MAX_SHARD_SIZE,
    OUTPUT_MODE,
    PretrainedWriter,
    check_export,
    copy_tokenizer,
    run_inputs,
    saved_name,
    shard_limit,
    tied_targets,
    write_model_files,
    written_dtype,
)
from tierzero.checkpoint.find import find_checkpoint
from tierzero.checkpoint.format import (
    CheckpointError,
    SafetensorsStream,
    TempFile,
    TensorEntry,
    checksum_algorithm,
    dtype_from_name,
    open_safetensors,
)
from tierzero.checkpoint.lora_merge import MERGED_DTYPE, LoraMerge
from tierzero.checkpoint.manifest import MANIFEST, MODULE_PREFIX, Manifest, SlotLayout, UnitLayout, is_step_name
from tierzero.checkpoint.save_load import ADAPTER_DIR
from tierzero.checkpoint.shards import ShardReader
from tierzero.common.output_paths import check_writable, refuse_overlap
from tierzero.config.model import ModelConfig
from tierzero.config.schema import Config
from tierzero.config.tree import build
from tierzero.models.builtin import build_model
from tierzero.offload.disk.files import forget, on_signals
from tierzero.pretrained import PretrainedError, build_meta_model
from tierzero.pretrained.lora import write_adapters

__all__ = [
    "Consolidated",
    "add_consolidate_command",
    "consolidate",
    "consolidate_adapters",
    "consolidate_hf",
    "consolidate_pretrained",
    "load_consolidated",
]

ALIASES_KEY = "tierzero.aliases"
#: peft's adapter config, in every directory an adapter export writes.
ADAPTER_CONFIG = "adapter_config.json"


@dataclass(frozen=True, slots=True)
class Consolidated:
    """What `consolidate` wrote."""

    path: Path
    step: int
    tensors: int
    nbytes: int
    largest_unit_bytes: int
    """The most memory one unit's rebuilt buffer took: the bound on what consolidation holds."""


def consolidate(checkpoint: str | Path, out: str | Path, *, note: Callable[[str], None] | None = None) -> Consolidated:
    """Write the checkpoint's full fp32 model to `out` (a .safetensors file), unit by unit."""
    directory = find_checkpoint(checkpoint, note=note)
    out = Path(out)
    manifest = Manifest.read(directory)
    refuse_inputs(directory, manifest, out)
    reader, module = _open(directory, manifest)
    entries = [
        TensorEntry(slot.names[0], slot.numel, torch.float32, slot.shape) for unit in manifest.units for slot in unit.slots
    ]
    entries += [TensorEntry(name, t.numel(), t.dtype, tuple(t.shape)) for name, t in module.items()]
    aliases = {alias: slot.names[0] for unit in manifest.units for slot in unit.slots for alias in slot.names[1:]}
    metadata = {"format": "pt", ALIASES_KEY: json.dumps(aliases, sort_keys=True), "tierzero.step": str(manifest.step)}
    tmp = TempFile.beside(out)
    stream = SafetensorsStream(tmp.path, entries, algorithm=checksum_algorithm(), metadata=metadata, mode=OUTPUT_MODE)
    on_signals(tmp)  # SIGTERM or SIGHUP mid-write: no partial file outlives the command
    largest = 0
    try:
        for unit in manifest.units:
            full = _full_fp32(reader, unit)
            largest = max(largest, full.numel() * full.element_size())
            for slot in unit.slots:
                stream.write(slot.names[0], full[slot.offset : slot.offset + slot.numel])
            del full
        for name, tensor in module.items():
            stream.write(name, tensor)
        record = stream.finish()
    except BaseException:
        stream.abort()
        tmp.remove()
        raise
    finally:
        forget(tmp)
    os.replace(tmp.path, out)
    return Consolidated(path=out, step=manifest.step, tensors=len(entries), nbytes=record.nbytes, largest_unit_bytes=largest)


def _open(directory: Path, manifest: Manifest) -> tuple[ShardReader, dict[str, torch.Tensor]]:
    """The verified rank files, and the module's buffers and frozen parameters (from rank 0's file)."""
    reader = ShardReader(directory, manifest)
    reader.verify(set(range(manifest.world_size)))
    module = reader.whole_tensors(0, prefix=MODULE_PREFIX)
    named = {name for unit in manifest.units for slot in unit.slots for name in slot.names}
    clash = sorted(named & set(module))
    if clash:
        raise CheckpointError(f"{directory / MANIFEST}: {clash[0]} is both a parameter and a module buffer: it was edited")
    return reader, module


def refuse_inputs(directory: Path, manifest: Manifest, out: Path, *, tokenizer: str | Path | None = None) -> None:
    """ValueError when `out` is, holds or lies inside the root that holds the checkpoint `directory`
    (it would replace or be pruned with the checkpoints there) or what its run read, as its manifest
    records it; see [Note: an output never eats an input]."""
    root = directory.parent if is_step_name(directory.name) else directory
    inputs = {"checkpoint root": root, **run_inputs(manifest.config), "--tokenizer": tokenizer}
    refuse_overlap(out, inputs, what="consolidate output")


def _full_fp32(reader: ShardReader, unit: UnitLayout) -> torch.Tensor:
    """The unit's parameters end to end in fp32: its masters in mixed precision, else its parameters."""
    base = next((k for k in unit.kinds if k in BASE_KINDS), None)
    if base is not None:
        return _dequantized(reader, unit, base)
    kind = "master" if "master" in unit.kinds else "param"
    stored = torch.empty(unit.numel, dtype=dtype_from_name(unit.kinds[kind], where=f"{reader.directory} unit {unit.name}"))
    reader.read(unit, kind, 0, unit.numel, out=stored)
    return stored if stored.dtype == torch.float32 else stored.float()


def _dequantized(reader: ShardReader, unit: UnitLayout, kind: str) -> torch.Tensor:
    """A quantized base's parameters in fp32: all its pieces read and dequantized ([Note: a quantized base in a checkpoint])."""
    codec = codec_of_kind(kind)
    assert codec is not None
    nbytes = unit.of_kind(kind).numel
    stored = reader.read(unit, kind, 0, nbytes, out=torch.empty(nbytes, dtype=torch.uint8))
    full = torch.empty(unit.padded_numel, dtype=torch.float32)
    check_codes(codec, stored, numel=unit.padded_numel, pieces=unit.world_size, unit=unit.name, path=reader.directory)
    return codec.decode(stored, out=full, pieces=unit.world_size, what=f"{reader.directory}: unit {unit.name}")[: unit.numel]


def consolidate_pretrained(checkpoint: str | Path, out_dir: str | Path, *, note: Callable[[str], None] | None = None) -> Consolidated:
    """`out_dir/model.safetensors`, plus `config.json` when the checkpoint's run was a transformers model."""
    out_dir, directory = Path(out_dir), find_checkpoint(checkpoint, note=note)
    refuse_inputs(directory, Manifest.read(directory), out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    done = consolidate(directory, out_dir / "model.safetensors")
    model = _model_section(Manifest.read(directory), directory)
    if model.get("type") == "transformers":
        model_class = _model_class(model)
        model_class.config_class(**dict(model.get("transformers_config") or {})).save_pretrained(out_dir)
    return done


def consolidate_hf(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    tokenizer: str | Path | None = None,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    note: Callable[[str], None] | None = None,
) -> Consolidated:
    """`out_dir` as save_pretrained writes it, from a transformers run's checkpoint, unit by unit.

    `dtype` defaults to the run's training dtype (its PARAM slices'), and for a LoRA run, whose
    adapters are merged into the base ([Note: merged LoRA export] in lora_merge.py), to bf16;
    `tokenizer` to the run's own (see `check_export`). Tied weights are stored under the name
    save_pretrained keeps.
    """
    out_dir, directory = Path(out_dir), find_checkpoint(checkpoint, note=note)
    manifest = Manifest.read(directory)
    refuse_inputs(directory, manifest, out_dir, tokenizer=tokenizer)
    source = check_export(manifest.config, out_dir, what="--hf", tokenizer=None if tokenizer is None else Path(tokenizer))
    section = _model_section(manifest, directory)
    model = _run_model(section)  # first: it says in one line what is wrong with a model.pretrained gone since
    lora = _run_lora(section)
    if lora is None:
        _refuse_adapters(directory, manifest)
    merge = LoraMerge.of(lora) if lora is not None else None
    dtype = dtype or (MERGED_DTYPE if merge else dtype_from_name(manifest.param_dtype, where=str(directory / MANIFEST)))
    reader, module = _open(directory, manifest)
    plain = merge.plain_name if merge else str
    targets = tied_targets(model)
    plan = [
        (unit, [(slot, saved_name([plain(n) for n in slot.names], targets)) for slot in unit.slots if not _is_adapter(slot, merge)])
        for unit in manifest.units
    ]
    plan = [(unit, slots) for unit, slots in plan if slots]
    entries = [TensorEntry(name, slot.numel, dtype, slot.shape) for _, slots in plan for slot, name in slots]
    entries += [TensorEntry(plain(name), t.numel(), written_dtype(t, dtype), tuple(t.shape)) for name, t in module.items()]
    expected = set(model.state_dict())
    stray = [e.name for e in entries if e.name not in expected]
    if stray:
        raise CheckpointError(
            f"{directory / MANIFEST}: tensor {stray[0]} is not in {type(model).__name__}'s state dict: "
            "the checkpoint was not written by this model's run"
        )
    shard_limit(max_shard_size)  # before the directory exists: a bad size leaves nothing behind
    adapters, largest = _read_adapters(reader, manifest, merge) if merge else ({}, 0)
    out_dir.mkdir(parents=True, exist_ok=True)
    with PretrainedWriter(out_dir, entries, max_shard_size=max_shard_size) as writer:
        for unit, slots in plan:
            full = _full_fp32(reader, unit)
            largest = max(largest, full.numel() * full.element_size())
            for slot, name in slots:
                value = full[slot.offset : slot.offset + slot.numel]
                adapted = merge.weights.get(slot.names[0]) if merge else None
                writer.write(name, value if adapted is None else adapted.merged(value, adapters))
            del full
        for name, tensor in module.items():
            writer.write(plain(name), tensor)
        done = writer.finish()
    write_model_files(out_dir, model, dtype=dtype)
    if source is not None:
        copy_tokenizer(source, out_dir)
    return Consolidated(path=out_dir, step=manifest.step, tensors=done.tensors, nbytes=done.nbytes, largest_unit_bytes=largest)


def consolidate_adapters(checkpoint: str | Path, out_dir: str | Path, *, note: Callable[[str], None] | None = None) -> Consolidated:
    """A LoRA run's trained adapters in peft's format at `out_dir` (replaced whole), as `train --export`
    writes them (`write_adapters`), for `PeftModel.from_pretrained(base, out_dir)`. Only the adapters'
    units are read, never the base."""
    out_dir, directory = Path(out_dir), find_checkpoint(checkpoint, note=note)
    manifest = Manifest.read(directory)
    refuse_inputs(directory, manifest, out_dir)
    lora = _run_lora(_model_section(manifest, directory))
    if lora is None:
        raise ValueError(
            f"{directory} is not a LoRA run's checkpoint (its model.lora.r is 0): --adapters-only writes a LoRA run's "
            "adapters; drop it to write the whole model"
        )
    _check_adapter_output(out_dir)
    reader, _ = _open(directory, manifest)
    state, largest = _read_adapters(reader, manifest, LoraMerge.of(lora))
    written = write_adapters(lora, state, out_dir)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    return Consolidated(path=written, step=manifest.step, tensors=len(state), nbytes=nbytes, largest_unit_bytes=largest)


def _run_lora(model: dict[str, Any]) -> nn.Module | None:
    """A LoRA run's peft model built as its run built it (`build_model`), on the meta device but for its
    adapters (small, on the CPU); None for a run without LoRA."""
    lora = model.get("lora")
    if not isinstance(lora, dict) or not lora.get("r"):
        return None
    return build_model(build(ModelConfig, model, root=Config, prefix="model"), device="meta")


def _is_adapter(slot: SlotLayout, merge: LoraMerge | None) -> bool:
    return merge is not None and slot.names[0] in merge.adapters


def _read_adapters(reader: ShardReader, manifest: Manifest, merge: LoraMerge) -> tuple[dict[str, torch.Tensor], int]:
    """Every adapter parameter in fp32 by the peft model's name, read from the units that hold them
    (held whole: r * (in + out) numbers per adapted layer), and the largest unit buffer read."""
    state: dict[str, torch.Tensor] = {}
    largest = 0
    for unit in manifest.units:
        slots = [slot for slot in unit.slots if _is_adapter(slot, merge)]
        if not slots:
            continue
        full = _full_fp32(reader, unit)
        largest = max(largest, full.numel() * full.element_size())
        for slot in slots:
            state[slot.names[0]] = full[slot.offset : slot.offset + slot.numel].reshape(slot.shape).clone()
    missing = sorted({name for w in merge.weights.values() for name in (w.lora_a, w.lora_b)} - set(state))
    if missing:
        raise CheckpointError(f"{reader.directory / MANIFEST}: adapter {missing[0]} of the run's model.lora is not in the checkpoint")
    return state, largest


def _check_adapter_output(out_dir: Path) -> None:
    """--adapters-only replaces `out_dir` whole, as train --export does: only a new or empty directory,
    or one an earlier adapter export wrote, may be replaced."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"--adapters-only output {out_dir} is a file: name a directory (new, or one an earlier export wrote)")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / ADAPTER_CONFIG).is_file():
        raise ValueError(
            f"--adapters-only output {out_dir} holds files and no {ADAPTER_CONFIG}: it would be replaced whole; "
            "name a new directory, or one an earlier adapter export wrote"
        )
    check_writable(out_dir, what="--adapters-only output", directory=True)


def _refuse_adapters(directory: Path, manifest: Manifest) -> None:
    """A checkpoint that holds adapters its config's model.lora does not describe (a model wrapped by
    peft outside tierzero): --hf cannot rebuild them to merge; they are in peft's format beside it."""
    if not any("lora_" in name for unit in manifest.units for slot in unit.slots for name in slot.names):
        return
    raise CheckpointError(
        f"{directory} holds LoRA adapters that its run's model.lora does not describe (the model was wrapped by peft "
        f"outside tierzero), so --hf cannot merge them; {directory / ADAPTER_DIR} holds them in peft's format: load it "
        "with PeftModel.from_pretrained(base, that directory) and call merge_and_unload() for a merged model"
    )


def _model_section(manifest: Manifest, directory: Path) -> dict[str, Any]:
    model = manifest.config.get("model", {})
    if not isinstance(model, dict) or not isinstance(model.get("transformers_config") or {}, dict):
        raise CheckpointError(f"{directory / MANIFEST}: config.model is not a model section: it was edited")
    return model


def _model_class(model: dict[str, Any]) -> Any:
    import transformers

    model_class = getattr(transformers, str(model.get("transformers_class")), None)
    if model_class is None or getattr(model_class, "config_class", None) is None:
        raise ValueError(
            f"the checkpoint's model.transformers_class {model.get('transformers_class')!r} is not in this "
            "transformers: install the version it was trained with"
        )
    return model_class


def _run_model(model: dict[str, Any]) -> nn.Module:
    """The run's transformers model on the meta device: its class, config and state-dict names, nothing allocated."""
    if model.get("pretrained") is not None:
        try:
            return build_meta_model(model["pretrained"])
        except PretrainedError as exc:
            raise ValueError(f"the run started from model.pretrained {model['pretrained']}, which describes its model: {exc}") from None
    model_class = _model_class(model)
    with torch.device("meta"):
        return model_class(model_class.config_class(**dict(model.get("transformers_config") or {})))


def load_consolidated(path: str | Path) -> dict[str, torch.Tensor]:
    """The state dict in a consolidated file, tied names included (sharing one tensor), for `load_state_dict`."""
    reader = open_safetensors(Path(path))
    state = {name: reader.get_tensor(name) for name in reader.keys()}
    aliases = json.loads((reader.metadata() or {}).get(ALIASES_KEY, "{}"))
    for alias, name in aliases.items():
        state[alias] = state[name]
    return state
