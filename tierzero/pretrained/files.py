"""A transformers model directory on disk: which safetensors files it has and what their headers say.

`save_pretrained` writes `config.json` beside either one `model.safetensors` or shards
`model-0000N-of-0000M.safetensors` listed by `model.safetensors.index.json` (tensor name ->
shard). A safetensors file is an 8-byte little-endian header length, a JSON header (per
tensor: dtype tag, shape, byte range in the data section), then the data. Only the
headers are read here, and checked against the file sizes, so that a truncated download or
a stray file is refused before any rank reads a byte of data.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierzero.common.safe_files import RefusedFile, check_regular, loads_bounded, read_regular
from tierzero.config.hf_sizes import position_limit as limit_of
from tierzero.config.hf_sizes import size_problem

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_JSON_BYTES = 1 << 30
"""A config.json or an index: an index of a million tensors is about 100 MiB."""
#: The fix every refusal of a damaged file ends with.
_REFETCH = "download or save_pretrained the model again"

#: safetensors dtype tag -> the torch dtype it reads as.
DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


class PretrainedError(ValueError):
    """A model directory that cannot be read or does not fit the model: one line naming the file and the fix."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor as its file's header describes it; its data stays on disk."""

    name: str
    path: Path
    """The safetensors file that holds it."""
    dtype: str
    """The safetensors tag, a key of DTYPES."""
    shape: tuple[int, ...]
    data_offsets: tuple[int, int]
    """Byte range in the file's data section (after the 8-byte length and the header)."""
    data_start: int = 0
    """Where the file's data section starts: 8 + the header's length."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def is_float(self) -> bool:
        return self.torch_dtype.is_floating_point


def scan_directory(directory: Path) -> dict[str, TensorInfo]:
    """Every tensor of the model directory by name, validated; PretrainedError for the first problem.

    A single `model.safetensors` wins over an index, as transformers' own loader has it.
    """
    require_config(directory)
    # exists(), not is_file(): a FIFO or a device under either name is refused as such by the reader
    if (directory / WEIGHTS_FILE).exists():
        return read_header(directory / WEIGHTS_FILE)
    if (directory / INDEX_FILE).exists():
        return _scan_index(directory / INDEX_FILE)
    pickled = " (its pytorch_model.bin is a pickle, which tierzero does not load)" if (directory / "pytorch_model.bin").exists() else ""
    raise PretrainedError(
        f"{directory} holds neither {WEIGHTS_FILE} nor {INDEX_FILE}{pickled}: "
        "save the model with save_pretrained(directory), which writes safetensors"
    )


def require_config(directory: Path) -> Path:
    """`directory/config.json`, refused when the directory or the file is missing."""
    config = directory / CONFIG_FILE
    if config.exists():
        _regular(config)
    else:
        what = "is missing" if directory.is_dir() else f"is missing ({directory} is not a directory)"
        raise PretrainedError(
            f"{config} {what}: point at the folder save_pretrained wrote (config.json beside model.safetensors)"
        )
    return config


def read_config(directory: Path) -> dict[str, Any]:
    """`directory/config.json` as a JSON object with its sizes positive integers and its heads
    dividing its width; PretrainedError naming the file and the key otherwise."""
    config = require_config(directory)
    value = _json(_read(config), name=str(config), where=f"{config} is not valid JSON")
    if (problem := size_problem(value)) is not None:
        raise PretrainedError(f"{config}: {problem[1]}: fix {CONFIG_FILE}")
    if (dtype := _dtype_problem(value)) is not None:
        raise PretrainedError(f"{config}: {dtype}: fix {CONFIG_FILE}")
    return value


def _dtype_problem(value: dict[str, Any]) -> str | None:
    """What is wrong with the names config.json gives transformers to look up: its model type, and its
    dtype (`torch_dtype`, `dtype` in newer transformers), which transformers takes with a traceback
    when they are of another type, or (the dtype) no attribute of torch."""
    if "model_type" in value and not isinstance(value["model_type"], str):
        return f"model_type is {json.dumps(value['model_type'], default=repr)[:40]}, expected a name such as \"llama\""
    for key in ("torch_dtype", "dtype"):
        name = value.get(key)
        if name is None or name == "auto" or (isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype)):
            continue
        return f"{key} is {json.dumps(name, default=repr)[:40]}, expected a torch dtype's name such as \"bfloat16\""
    return None


def position_limit(directory: Path) -> tuple[int, str] | None:
    """The longest sequence the model of `directory/config.json` has positions for, and the key
    that says so (tierzero.config.hf_sizes.position_limit); None when it names none."""
    return limit_of(read_config(directory))


def check_positions(directory: Path, *, seq_len: int) -> None:
    """Refuse, in one line, a `train.seq_len` longer than the checkpoint's positions: past them a
    learned position table has no row, and a rotary model was never trained there."""
    found = position_limit(directory)
    if found is None or seq_len <= found[0]:
        return
    limit, key = found
    raise PretrainedError(
        f"train.seq_len {seq_len} is above the {limit} positions of model.pretrained {directory} "
        f"({key} {limit} in its {CONFIG_FILE}): set train.seq_len to at most {limit}"
    )


def _scan_index(index: Path) -> dict[str, TensorInfo]:
    weight_map = _weight_map(index)
    headers: dict[str, dict[str, TensorInfo]] = {}
    for shard in sorted(set(weight_map.values())):
        path = index.parent / shard
        if not path.exists():
            first = next(name for name, s in weight_map.items() if s == shard)
            raise PretrainedError(f"{index} maps tensor {first} to {path}, which is missing: {_REFETCH}")
        headers[shard] = read_header(path)
    tensors = {}
    for name, shard in weight_map.items():
        if name not in headers[shard]:
            raise PretrainedError(
                f"{index} maps tensor {name} to {index.parent / shard}, which does not hold it: "
                f"the index and its shards come from different saves; {_REFETCH}"
            )
        tensors[name] = headers[shard][name]
    return tensors


def _weight_map(index: Path) -> dict[str, str]:
    value = _json(_read(index), name=str(index), where=f"{index} is not valid JSON")
    weight_map = value.get("weight_map")
    valid = isinstance(weight_map, dict) and all(isinstance(v, str) and "/" not in v for v in weight_map.values())
    if not valid or not weight_map:
        raise PretrainedError(
            f"{index} has no weight_map of tensor name -> shard file name in this directory: {_REFETCH}"
        )
    return weight_map


def read_header(path: Path) -> dict[str, TensorInfo]:
    """The tensors a safetensors file declares, checked against its size; none of its data is read."""
    _regular(path)
    size = path.stat().st_size
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:  # a FIFO swapped in: no hang
        prefix = f.read(8)
        if len(prefix) < 8:
            raise PretrainedError(f"{path} is truncated: {size} bytes, fewer than a safetensors header length: {_REFETCH}")
        (length,) = struct.unpack("<Q", prefix)
        if 8 + length > size:
            raise PretrainedError(f"{path} is truncated: its header claims {8 + length} bytes, the file has {size}: {_REFETCH}")
        raw = f.read(length)
    header = _json(raw, name=f"{path}'s header", where=f"{path} has a header that is not valid JSON")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - length
    tensors = {name: _entry(path, name, entry, data_bytes=data_bytes, data_start=8 + length) for name, entry in header.items()}
    _refuse_overlaps(path, tensors)
    return tensors


def _refuse_overlaps(path: Path, tensors: dict[str, TensorInfo]) -> None:
    """PretrainedError naming two tensors whose bytes overlap: loading one would write into the other.
    Empty tensors (begin == end) hold no bytes and may share any offset."""
    spans = sorted((info.data_offsets, name) for name, info in tensors.items() if info.numel)
    previous: tuple[tuple[int, int], str] | None = None
    for (begin, end), name in spans:
        if previous is not None and begin < previous[0][1]:
            (other_begin, other_end), other = previous
            raise PretrainedError(
                f"{path}: tensors {other} (data bytes [{other_begin}, {other_end})) and {name} ([{begin}, {end})) "
                f"overlap: its header is corrupt; {_REFETCH}"
            )
        if previous is None or end > previous[0][1]:
            previous = ((begin, end), name)


def _regular(path: Path) -> None:
    """PretrainedError for a FIFO, a device or a socket where a model file should be: never opened."""
    try:
        check_regular(path)
    except RefusedFile as exc:
        raise PretrainedError(f"{exc}: point at the folder save_pretrained wrote, which holds regular files") from None


def _read(path: Path) -> bytes:
    """A model directory's JSON file, refused as `_regular` refuses before it is opened."""
    _regular(path)
    try:
        return read_regular(path, limit=MAX_JSON_BYTES)
    except RefusedFile as exc:
        raise PretrainedError(f"{exc}: {_REFETCH}") from None


def _json(raw: bytes, *, name: str, where: str) -> dict[str, Any]:
    try:
        value = loads_bounded(raw.decode("utf-8"), name=name)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        detail = exc.msg if isinstance(exc, json.JSONDecodeError) else "not UTF-8"
        raise PretrainedError(f"{where} ({detail}): it is corrupt or was replaced; {_REFETCH}") from None
    except ValueError as exc:  # nested past the recursion limit, or an integer past int()'s digits
        raise PretrainedError(f"{exc}: it is corrupt or was replaced; {_REFETCH}") from None
    if not isinstance(value, dict):
        raise PretrainedError(f"{where} (a JSON {type(value).__name__}, expected an object): {_REFETCH}")
    return value


def _entry(path: Path, name: str, entry: Any, *, data_bytes: int, data_start: int) -> TensorInfo:
    """One header entry as a TensorInfo, refused when malformed or when its bytes lie past the file's end."""
    try:
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        well_formed = isinstance(dtype, str) and all(isinstance(n, int) and n >= 0 for n in (*shape, begin, end))
    except (TypeError, KeyError, ValueError):
        well_formed = False
    if not well_formed:
        raise PretrainedError(
            f"{path}: tensor {name} has a malformed header entry {json.dumps(entry)[:120]} "
            f"(expected a dtype, a shape and data_offsets of ints): {_REFETCH}"
        )
    if dtype not in DTYPES:
        raise PretrainedError(
            f"{path}: tensor {name} is {dtype}, which tierzero does not read (it reads {', '.join(DTYPES)}): "
            "save the model in BF16, F16 or F32"
        )
    info = TensorInfo(name=name, path=path, dtype=dtype, shape=shape, data_offsets=(begin, end), data_start=data_start)
    if end - begin != info.numel * DTYPES[dtype].itemsize:
        raise PretrainedError(
            f"{path}: tensor {name} spans bytes [{begin}, {end}), but {dtype} {list(shape)} needs "
            f"{info.numel * DTYPES[dtype].itemsize}: {_REFETCH}"
        )
    if end > data_bytes:
        raise PretrainedError(
            f"{path} is truncated: tensor {name} ends at data byte {end}, the file holds {data_bytes} data bytes: {_REFETCH}"
        )
    return info
