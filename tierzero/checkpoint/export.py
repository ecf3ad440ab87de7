"""A transformers model directory written from tierzero's state: what `save_pretrained` writes, streamed.

`tierzero consolidate CKPT OUT --hf`, `tierzero train --export OUT` and `tierzero make-checkpoint`
all write through `PretrainedWriter` and `write_model_files`: safetensors shards
`model-0000i-of-0000N.safetensors` with `model.safetensors.index.json` (or one `model.safetensors`
when everything fits in a shard), `config.json` (its dtype the written one), `generation_config.json`,
and the tokenizer's files. `AutoModelForCausalLM.from_pretrained(OUT)` and
`AutoTokenizer.from_pretrained(OUT)` load the directory; so does tierzero's own `model.pretrained`.

[Note: streamed export]
Every tensor's name, shape and dtype is known before any value is (from the unit layout of a
checkpoint's manifest or of the live engine, or from a model built on the meta device), so the
shards are planned up front, in order: a shard closes when the next tensor would take it past
`max_shard_size`, and a tensor larger than that gets a shard of its own (huggingface_hub's rule,
kept in tensor order). Each shard's header is written first and every tensor's bytes are appended
as soon as the producer hands them over, so the writer holds no tensor: memory is what the producer
holds (one unit's fp32 buffer, or one generated tensor) plus that tensor cast to the written dtype.
A shard is written beside its final name and renamed when complete; the index comes last. When a
sharded export replaces an earlier one, the earlier index and single file go before the first new
shard lands, so a failed export leaves a directory from_pretrained refuses, never a mix of two.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tierzero.checkpoint.format import (
    SafetensorsStream,
    TempFile,
    TensorEntry,
    checksum_algorithm,
    dtype_name,
    fsync_dir,
    write_bytes_atomic,
)
from tierzero.common.output_paths import check_writable, refuse_overlap
from tierzero.common.sizes import format_size, parse_size
from tierzero.offload.disk.files import forget, on_signals
from tierzero.pretrained.files import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE

#: huggingface_hub's default before transformers 5 raised it to 50GB: shards a hub upload takes.
DEFAULT_MAX_SHARD_SIZE = "5GB"
#: An exported model is an ordinary file (the umask applies), unlike a checkpoint's own 0600 files.
OUTPUT_MODE = 0o644
GENERATION_CONFIG_FILE = "generation_config.json"
#: The dtypes an export writes, by the names the commands take.
EXPORT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: What a tokenizer's `save_pretrained` may write; an export copies those present.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "vocab.json",
    "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "chat_template.jinja", "chat_template.json",
)  # fmt: skip
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def shard_file_name(index: int, count: int) -> str:
    """The `index`-th (from 0) of `count` weight files, named as save_pretrained names them."""
    return WEIGHTS_FILE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def plan_shards(entries: Sequence[TensorEntry], *, max_shard_bytes: int) -> list[list[TensorEntry]]:
    """The tensors cut into consecutive shards of at most `max_shard_bytes` (a larger tensor alone)."""
    shards: list[list[TensorEntry]] = []
    size = max_shard_bytes  # no open shard yet
    for entry in entries:
        alone = entry.nbytes > max_shard_bytes
        if alone or size + entry.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size = max_shard_bytes if alone else size + entry.nbytes  # nothing joins a tensor over the limit
    return shards


@dataclass(frozen=True, slots=True)
class Exported:
    """What an export wrote into `directory`."""

    directory: Path
    files: tuple[str, ...]
    """The weight files, in tensor order."""
    tensors: int
    nbytes: int
    """Bytes of tensor data, the index's `total_size`."""
    dtype: torch.dtype

    def describe(self) -> str:
        return (
            f"{self.tensors} tensors ({format_size(self.nbytes)}, {dtype_name(self.dtype)}) in {len(self.files)} "
            f"safetensors file{'s' if len(self.files) > 1 else ''} to {self.directory}"
        )


class PretrainedWriter:
    """The weight files of a model directory, written tensor by tensor; see [Note: streamed export].

    Call order: `write` every declared tensor once, in the declared order, then `finish`; `abort`
    (or leaving the `with` block on an error) removes the shard in progress.
    """

    def __init__(self, directory: str | Path, entries: Sequence[TensorEntry], *, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> None:
        limit = shard_limit(max_shard_size)
        if not entries:
            raise ValueError(f"nothing to write to {directory}: the model has no tensors")
        self.directory = Path(directory)
        self._shards = plan_shards(entries, max_shard_bytes=limit)
        self.files = tuple(shard_file_name(i, len(self._shards)) for i in range(len(self._shards)))
        self._entries = len(entries)
        self._nbytes = sum(e.nbytes for e in entries)
        self._dtype = next((e.dtype for e in entries if e.dtype.is_floating_point), entries[0].dtype)
        self._shard, self._done_in_shard = 0, 0
        self._stream: SafetensorsStream | None = None
        self._tmp: TempFile | None = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """The next declared tensor's value, cast to its declared dtype, from any device."""
        if self._stream is None:
            self._open_shard()
        assert self._stream is not None
        entry = self._shards[self._shard][self._done_in_shard]
        value = tensor.detach()
        self._stream.write(name, value if value.dtype == entry.dtype else value.to(entry.dtype))
        self._done_in_shard += 1
        if self._done_in_shard == len(self._shards[self._shard]):
            self._close_shard()

    def finish(self) -> Exported:
        """The index (for shards), then earlier saves' weight files this one does not replace removed."""
        assert self._shard == len(self._shards), f"{len(self._shards) - self._shard} shards were not written"
        if len(self.files) > 1:
            weight_map = {e.name: self.files[i] for i, shard in enumerate(self._shards) for e in shard}
            index = {"metadata": {"total_size": self._nbytes}, "weight_map": weight_map}
            write_json_file(self.directory / INDEX_FILE, index)
        else:
            (self.directory / INDEX_FILE).unlink(missing_ok=True)
        for entry in self.directory.iterdir():
            if _SHARD.fullmatch(entry.name) and entry.name not in self.files:
                entry.unlink()
        fsync_dir(self.directory)
        return Exported(directory=self.directory, files=self.files, tensors=self._entries, nbytes=self._nbytes, dtype=self._dtype)

    def abort(self) -> None:
        if self._stream is not None:
            self._stream.abort()
            self._stream = None
        if self._tmp is not None:
            self._tmp.remove()
            forget(self._tmp)
            self._tmp = None

    def __enter__(self) -> PretrainedWriter:
        return self

    def __exit__(self, kind: object, *exc: object) -> None:
        if kind is not None:
            self.abort()

    def _open_shard(self) -> None:
        final = self.directory / self.files[self._shard]
        self._tmp = TempFile.beside(final)
        on_signals(self._tmp)  # SIGTERM or SIGHUP mid-shard: no partial file outlives the export
        self._stream = SafetensorsStream(
            self._tmp.path, self._shards[self._shard], algorithm=checksum_algorithm(), metadata={"format": "pt"}, mode=OUTPUT_MODE
        )

    def _close_shard(self) -> None:
        assert self._stream is not None and self._tmp is not None
        self._stream.finish()
        if self._shard == 0 and len(self.files) > 1:
            # An earlier save's entry points: from here until the index lands, nothing loads.
            (self.directory / INDEX_FILE).unlink(missing_ok=True)
            (self.directory / WEIGHTS_FILE).unlink(missing_ok=True)
        os.replace(self._tmp.path, self.directory / self.files[self._shard])
        forget(self._tmp)
        self._stream, self._tmp = None, None
        self._shard, self._done_in_shard = self._shard + 1, 0


def shard_limit(max_shard_size: int | str, *, what: str = "max shard size") -> int:
    """The largest weight file in bytes; ValueError naming `what` when it is no positive size.
    Checked before any output directory is made, so that a bad setting leaves nothing behind."""
    try:
        limit = parse_size(max_shard_size)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    if limit < 1:
        raise ValueError(f"{what} is {max_shard_size!r}, expected a positive size such as 5GB or 500MB")
    return limit


# ---- the other files of the directory -------------------------------------------------


def write_file_atomic(path: Path, data: bytes) -> None:
    """Replace `path` by `data` at once, as an ordinary 0644 file (the checkpoint's own are 0600)."""
    write_bytes_atomic(path, data, mode=OUTPUT_MODE)


def write_json_file(path: Path, value: Any) -> None:
    write_file_atomic(path, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())


def write_model_files(directory: Path, model: nn.Module, *, dtype: torch.dtype) -> None:
    """`config.json` of `model` (a transformers model, meta-built is enough) with `dtype` as its dtype,
    and `generation_config.json` where the class generates, as save_pretrained writes them."""
    transformers_model: Any = model  # a transformers PreTrainedModel: its config and can_generate
    config = copy.deepcopy(transformers_model.config)
    config.dtype = dtype_name(dtype)
    config.architectures = [type(model).__name__]
    write_file_atomic(directory / CONFIG_FILE, config.to_json_string(use_diff=True).encode())
    if type(transformers_model).can_generate():
        import transformers

        generation = transformers.GenerationConfig.from_model_config(config)
        write_file_atomic(directory / GENERATION_CONFIG_FILE, generation.to_json_string(use_diff=True).encode())


def copy_tokenizer(source: Path, directory: Path) -> list[str]:
    """Copy the tokenizer files of `source` into `directory`; their names."""
    names = tokenizer_files(source, what="tokenizer")
    for name in names:
        tmp = TempFile.beside(directory / name)
        on_signals(tmp)
        try:
            shutil.copyfile(source / name, tmp.path)  # an ordinary file: 0666 less the umask
            os.replace(tmp.path, directory / name)
        except BaseException:
            tmp.remove()
            raise
        finally:
            forget(tmp)
    return names


def tokenizer_files(source: Path, *, what: str) -> list[str]:
    """The tokenizer files in `source`; ValueError naming `what` when it holds none."""
    names = [n for n in TOKENIZER_FILES if (source / n).is_file()] if source.is_dir() else []
    if not names:
        state = "holds no tokenizer files" if source.is_dir() else "is not a directory"
        raise ValueError(
            f"{what} {source} {state} (expected {', '.join(TOKENIZER_FILES[:3])}, ...): "
            "point at the directory a tokenizer's save_pretrained wrote"
        )
    return names


# ---- names and runs ---------------------------------------------------------------------


def tied_targets(model: nn.Module) -> list[re.Pattern[str]]:
    """Patterns of the tied names save_pretrained drops (the head tied to the embedding)."""
    keys = getattr(model, "all_tied_weights_keys", None) or getattr(type(model), "_tied_weights_keys", None) or ()
    return [re.compile(key) for key in keys]


def saved_name(names: Sequence[str], targets: Sequence[re.Pattern[str]]) -> str:
    """Which of one tensor's tied names save_pretrained stores: the first that is no tie's target."""
    kept = [name for name in names if not any(p.search(name) for p in targets)]
    return kept[0] if kept else sorted(names)[-1]


def run_inputs(run_config: Mapping[str, Any]) -> dict[str, str | None]:
    """What a run reads, by key, from its config (a manifest's or the live one): what no output may touch."""

    def key(section: str, name: str) -> str | None:
        part = run_config.get(section)
        value = part.get(name) if isinstance(part, Mapping) else None
        return value if isinstance(value, str) else None

    return {
        "model.pretrained": key("model", "pretrained"), "data.path": key("data", "path"),
        "data.tokenizer": key("data", "tokenizer"), "checkpoint.dir": key("checkpoint", "dir"),
    }  # fmt: skip


def check_export(
    run_config: Mapping[str, Any], out: Path, *, what: str, tokenizer: Path | None = None, module: nn.Module | None = None
) -> Path | None:
    """Refuse at once an export this run cannot make; the tokenizer directory to copy, if any.

    The model must be a transformers one: `module` when given (the live model), else the one
    the run config's model section names. The tokenizer is `tokenizer` when given, else the
    run's `data.tokenizer`, else the `model.pretrained` directory's own tokenizer when it has one.
    An `out` on one of the run's inputs, or where this user cannot write, is refused.
    """
    model = run_config.get("model")
    model = model if isinstance(model, Mapping) else {}
    if module is not None and not _is_transformers(module):
        trains = f"a {type(module).__name__}, not a transformers PreTrainedModel"
    elif module is None and model.get("pretrained") is None and model.get("type") != "transformers":
        trains = f"tierzero's built-in {model.get('type')!r} model, which transformers has no class for"
    else:
        trains = None
    if trains is not None:
        raise ValueError(
            f"{what} writes a transformers model directory, and this run trains {trains}: train a transformers "
            "model (model.type: transformers, or model.pretrained), or consolidate to one .safetensors file instead"
        )
    if out.exists() and not out.is_dir():
        raise ValueError(f"{what} {out} is a file: name a directory (new, or one an earlier export wrote)")
    refuse_overlap(out, {**run_inputs(run_config), "--tokenizer": tokenizer}, what=what)
    check_writable(out, what=what, directory=True)
    data = run_config.get("data")
    if tokenizer is None and isinstance(data, Mapping) and data.get("tokenizer") is not None:
        tokenizer = Path(str(data["tokenizer"])).expanduser()
        tokenizer_files(tokenizer, what="data.tokenizer")
    elif tokenizer is not None:
        tokenizer_files(tokenizer, what="--tokenizer")
    elif model.get("pretrained") is not None and any((Path(model["pretrained"]) / n).is_file() for n in TOKENIZER_FILES):
        tokenizer = Path(model["pretrained"])
    return tokenizer


def _is_transformers(module: nn.Module) -> bool:
    """A transformers model itself (a peft wrapper is not: its names are not the model's)."""
    try:
        import transformers
    except ImportError:
        return False
    return isinstance(module, transformers.PreTrainedModel)


def written_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """Floating buffers and frozen parameters follow the written dtype, as `model.to(dtype)` casts them."""
    return dtype if tensor.is_floating_point() else tensor.dtype
