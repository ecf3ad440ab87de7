"""Pretrained weights read straight into units, each rank reading only the elements it keeps.

[Note: streamed pretrained weights]
The model is built on the meta device from config.json (`build_meta_model`), cut into units
as for training (`plan_units`), and each rank asks `unit_range(unit, start=..., end=...)`
for its own range of each unit's flat buffer. That range covers parts of a few
parameters; of each, only the elements of its part are read from the file, with pread at
the offsets the header gives (never a mapping, whose pages would stay in the process's
memory), and converted to fp32. Host memory holds the headers and one range at a time,
never the model; `read.bytes` counts what was read, which for a whole model equals the
files' data: nothing is read twice.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from tierzero.pretrained.files import PretrainedError, TensorInfo, read_config, require_config, scan_directory
from tierzero.pretrained.lora import adapter_parameter_names, is_peft_model
from tierzero.units.unit import ParamSlot, Unit

#: What peft's wrapper puts before its base model's parameter names.
PEFT_WRAPPER = "base_model.model."

_RESAVE = "fix config.json or save_pretrained the model again"


@dataclass(slots=True)
class ReadCount:
    """Bytes of the files read so far (whole rows of each tensor, as they are read)."""

    bytes: int = 0


@dataclass(frozen=True, slots=True)
class PretrainedWeights:
    """The safetensors files of a transformers model directory, by tensor name; headers only."""

    directory: Path
    tensors: dict[str, TensorInfo]
    """Every tensor of the files, by the name the files give it."""
    prefix: str = ""
    """What the model's names start with and the files' names lack: set by `for_model` when the
    files were saved from the model's base (GPT-2 on the hub names `h.0.attn.c_attn.weight`
    what GPT2LMHeadModel calls `transformer.h.0.attn.c_attn.weight`)."""
    wrapper: str = ""
    """What a wrapping model (peft's) adds to the base model's names: `base_model.model.`, and
    `.base_layer` inside each adapted layer; set by `for_model`."""
    fresh: frozenset[str] = frozenset()
    """The model's parameters that no file holds because the model makes them (LoRA adapters):
    read from the model itself, never looked up."""
    read: ReadCount = field(default_factory=ReadCount, compare=False)
    """What the reads took from the files, shared by copies from `for_model` (`tierzero bench load`)."""
    _readers: dict[Path, int] = field(default_factory=dict, repr=False, compare=False)
    """Open file descriptors, opened on first read (shared by copies from `for_model`)."""

    @classmethod
    def open(cls, directory: str | Path) -> PretrainedWeights:
        """Read and check the directory's headers; PretrainedError naming the file for the first problem."""
        path = Path(directory)
        return cls(directory=path, tensors=scan_directory(path))

    def for_model(self, model: nn.Module) -> PretrainedWeights:
        """These weights under `model`'s names: with the prefix set when the files come from its base
        model, and a peft model's wrapping of its base's names undone (its adapters are `fresh`)."""
        weights = self
        if is_peft_model(model):
            weights = dataclasses.replace(self, wrapper=PEFT_WRAPPER, fresh=adapter_parameter_names(model))
            model = model.get_base_model()
        prefix = getattr(model, "base_model_prefix", "") or ""
        if not prefix or weights.prefix or not isinstance(getattr(model, prefix, None), nn.Module):
            return weights
        if any(name.startswith(prefix + ".") for name in self.tensors):
            return weights
        return dataclasses.replace(weights, prefix=prefix)

    def file_name(self, name: str) -> str:
        """The name the files give the model's tensor `name`."""
        if self.wrapper:
            name = name.removeprefix(self.wrapper).replace(".base_layer.", ".")
        return name.removeprefix(self.prefix + ".") if self.prefix else name

    def lookup(self, names: Sequence[str]) -> TensorInfo | None:
        """The tensor of the first of `names` (one parameter's tied aliases) that the files hold."""
        for name in names:
            info = self.tensors.get(self.file_name(name))
            if info is not None:
                return info
        return None

    def check(self, model: nn.Module) -> None:
        """Refuse, in one line naming the tensor and its file, weights that do not fit `model`.

        Every parameter and persistent buffer must be in the files under at least one of its
        names (transformers saves one name of a tied pair), with the model's shape, and in a
        floating-point dtype where the model holds floats; every tensor of the files must be
        somewhere in the model, unless the model's `_keys_to_ignore_on_load_unexpected` lets
        transformers skip it. Reads headers only.
        """
        problems, known = [], set()
        for names, tensor in model_tensors(model):
            if self.fresh.intersection(names):
                continue
            known.update(self.file_name(n) for n in names)
            held = [info for n in names if (info := self.tensors.get(self.file_name(n))) is not None]
            if not held:
                problems.append(self._missing(model, names))
            problems += [p for info in held if (p := _mismatch(model, info, tensor))]
        ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
        for name, info in self.tensors.items():
            if name not in known and not any(p.search(name) for p in ignored):
                problems.append(f"{info.path}: tensor {name} is nowhere in {type(model).__name__}: {_RESAVE}")
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise PretrainedError(problems[0] + more)

    def _missing(self, model: nn.Module, names: list[str]) -> str:
        aliases = f" (or {', '.join(names[1:])})" if len(names) > 1 else ""
        return (
            f"{self.directory}: tensor {self.file_name(names[0])}{aliases} of {type(model).__name__} "
            f"is in none of its safetensors files: {_RESAVE}"
        )

    def read_range(
        self, names: Sequence[str], *, shape: Sequence[int], start: int, end: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Elements [start, end) of one tensor flattened, in fp32 or `out`'s dtype, reading only those bytes.

        `names` are the tensor's aliases (the first the files hold wins), `shape` the model's.
        `out` (end - start elements, contiguous) receives them when given: a file in its dtype
        is read straight into it, any other converted.
        """
        info = self._find(names, shape=shape)
        if not 0 <= start <= end <= info.numel:
            raise ValueError(f"range [{start}, {end}) is outside tensor {info.name}'s {info.numel} elements")
        if out is None:
            out = torch.empty(end - start, dtype=torch.float32)
        if info.torch_dtype == out.dtype:
            return self._read_elements(info, start, end, out=out)
        return out.copy_(self._read_elements(info, start, end))

    def read_tensor(self, names: Sequence[str], *, shape: Sequence[int]) -> torch.Tensor:
        """One whole tensor in its file's dtype (a buffer, or a frozen parameter kept whole on every rank)."""
        info = self._find(names, shape=shape)
        return self._read_elements(info, 0, info.numel).reshape(info.shape)

    def _read_elements(self, info: TensorInfo, start: int, end: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [start, end) of `info` flattened, in its file's dtype (into `out` when given), read
        with pread: no mapping, so nothing of the file stays in the process's memory."""
        itemsize = info.torch_dtype.itemsize
        offset = info.data_start + info.data_offsets[0] + start * itemsize
        buffer = torch.empty((end - start) * itemsize, dtype=torch.uint8) if out is None else out.view(torch.uint8)
        view, done = memoryview(buffer.numpy()), 0
        fd = self._descriptor(info.path)
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise PretrainedError(f"{info.path} is truncated: tensor {info.name} ends past the file's end: {_RESAVE}")
            done += got
        self.read.bytes += len(view)
        return buffer.view(info.torch_dtype)

    def unit_range(self, unit: Unit, *, start: int, end: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [start, end) of the unit's flat padded buffer (padding zero), read slot by slot.

        Only the slots overlapping the range are read: rank r of a stage-3 unit asks for
        `unit.shard_range(r)` and reads no other rank's elements. `out` (fp32 unless a
        lower precision is wanted) receives them when given.
        """
        if not 0 <= start <= end <= unit.padded_numel:
            raise ValueError(f"range [{start}, {end}) is outside unit {unit.name}'s {unit.padded_numel} elements")
        if out is None:
            out = torch.empty(end - start, dtype=torch.float32)
        elif out.shape != (end - start,):
            raise ValueError(f"out has shape {list(out.shape)}, expected [{end - start}] for range [{start}, {end})")
        for slot in unit.slots:
            lo, hi = max(start, slot.offset), min(end, slot.offset + slot.numel)
            if lo < hi:
                names = [b.name for b in slot.bindings]
                target = out.narrow(0, lo - start, hi - lo)
                if self.fresh.intersection(names):
                    target.copy_(_own_value(slot)[lo - slot.offset : hi - slot.offset])
                else:
                    self.read_range(names, shape=slot.shape, start=lo - slot.offset, end=hi - slot.offset, out=target)
        # Slots lie end to end from 0 (units.py), so everything past unit.numel is padding.
        pad_from = min(end, max(start, unit.numel))
        out.narrow(0, pad_from - start, end - pad_from).zero_()
        return out

    def load_rest(self, model: nn.Module) -> None:
        """Copy into `model` the value of every parameter and persistent buffer it still holds itself.

        The engine calls it once the units have taken their parameters: what is left (frozen
        parameters outside units, buffers) is small and kept whole on every rank. A tensor the
        files do not hold (a buffer `check` let through) keeps the value its module's init gave it.
        """
        with torch.no_grad():
            for names, tensor in model_tensors(model):
                if self.lookup(names) is not None:
                    tensor.copy_(self.read_tensor(names, shape=tensor.shape))

    def close(self) -> None:
        """Close the files read so far; a later read opens them again."""
        for fd in self._readers.values():
            os.close(fd)
        self._readers.clear()

    def _find(self, names: Sequence[str], *, shape: Sequence[int]) -> TensorInfo:
        info = self.lookup(names)
        if info is None:
            raise PretrainedError(
                f"{self.directory}: tensor {names[0]} is in none of its safetensors files: "
                "call weights.check(model) before reading, to learn what does not fit"
            )
        if info.shape != tuple(shape):
            raise PretrainedError(
                f"{info.path}: tensor {info.name} has shape {list(info.shape)}, the model expects {list(shape)}: {_RESAVE}"
            )
        return info

    def _descriptor(self, path: Path) -> int:
        if path not in self._readers:
            self._readers[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        return self._readers[path]


def _own_value(slot: ParamSlot) -> torch.Tensor:
    """A parameter the model made itself (an adapter), flattened in fp32; it must not be on meta."""
    value = getattr(slot.bindings[0].module, slot.bindings[0].attr)
    if value.is_meta:
        raise ValueError(
            f"{slot.name} is on the meta device and in no pretrained file: "
            "materialise the adapters first (tierzero.pretrained.lora.apply_lora or materialize_adapters)"
        )
    return value.detach().reshape(-1).float()


def model_tensors(model: nn.Module) -> list[tuple[list[str], torch.Tensor]]:
    """Each distinct parameter and persistent buffer with all its state_dict names, in state_dict order.

    `keep_vars` hands back the tensors themselves, so tied names group by identity; on a
    meta-built model nothing is allocated.
    """
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), ([], tensor))[0].append(name)
    return list(groups.values())


def _mismatch(model: nn.Module, info: TensorInfo, tensor: torch.Tensor) -> str | None:
    expected = f"{type(model).__name__} expects"
    if info.shape != tuple(tensor.shape):
        return f"{info.path}: tensor {info.name} has shape {list(info.shape)}, {expected} {list(tensor.shape)}: {_RESAVE}"
    if tensor.is_floating_point() and not info.is_float:
        return f"{info.path}: tensor {info.name} is {info.dtype}, {expected} floating point (BF16, F16 or F32): {_RESAVE}"
    if not tensor.is_floating_point() and info.torch_dtype != tensor.dtype:
        return f"{info.path}: tensor {info.name} is {info.dtype}, {expected} {tensor.dtype}: {_RESAVE}"
    return None


def build_meta_model(directory: str | Path) -> nn.Module:
    """The causal LM that `directory/config.json` describes, built on the meta device: nothing allocated.

    No code from the directory runs (no trust_remote_code) and nothing is downloaded.
    """
    config_path = require_config(Path(directory))
    read_config(config_path.parent)  # its JSON and sizes, refused here in one line rather than deep in transformers
    try:
        import transformers
    except ImportError:
        raise PretrainedError(f"{config_path} needs the transformers package to build its model: pip install transformers") from None
    try:
        config = transformers.AutoConfig.from_pretrained(str(config_path.parent), local_files_only=True)
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError, OSError, *_config_errors()) as exc:
        # huggingface_hub's validation errors span two lines: the field, then the cause.
        detail = " ".join(line.strip() for line in str(exc).splitlines())[:200] or type(exc).__name__
        raise PretrainedError(
            f"{config_path}: transformers {transformers.__version__} cannot build a causal LM from it ({detail}): "
            "fix config.json or upgrade transformers"
        ) from None


def _config_errors() -> tuple[type[Exception], ...]:
    """What transformers' config classes raise for a bad value, beside ValueError: huggingface_hub's
    strict-dataclass errors (absent from an older huggingface_hub, whose transformers raised ValueError)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:
        return ()
    return (StrictDataclassError,)
