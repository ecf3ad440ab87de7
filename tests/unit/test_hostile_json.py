"""JSON that breaks Python itself, in every file tierzero parses, refused in one line naming the file
(and the line): nesting past the recursion limit, integers past int()'s digits, a lone surrogate,
a record of the wrong kind; a safetensors header whose tensors overlap; a pretrained config.json whose
sizes transformers would take with a traceback, or not at all."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tierzero.cli.main import main
from tierzero.common.safe_files import load_json, loads_bounded
from tierzero.data import Format, Source, load_tokenizer, read_documents
from tierzero.pretrained import PretrainedError, PretrainedWeights, build_meta_model

DEEP = "[" * 100_000
"""Deeper than Python's recursion limit, which json.loads recurses once a level against."""
LONG_INT = "1" * 5000
"""More digits than int() converts (4300 by default), which json.loads raises deep inside itself."""
REFETCH = "download or save_pretrained the model again"
LLAMA = {
    "model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 16,
}  # fmt: skip


def _one_line(call: Any, error: type[Exception] = ValueError) -> str:
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    return message


def _safetensors(path: Path, header: str | dict[str, Any], data: int = 64) -> Path:
    (path.parent / "config.json").write_text("{}")
    raw = (header if isinstance(header, str) else json.dumps(header)).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(data))
    return path


def _jsonl(path: Path, *lines: str) -> list[str]:
    path.write_text("\n".join(lines) + "\n")
    return list(read_documents(Source(path, Format.JSONL)))


# ---- the shared parser ----------------------------------------------------------------


def test_loads_bounded_names_what_it_parses_and_leaves_syntax_errors_to_the_caller(tmp_path: Path) -> None:
    assert _one_line(lambda: loads_bounded(DEEP, name="x.json")) == "x.json nests deeper than a JSON file may"
    assert _one_line(lambda: loads_bounded(f"[{LONG_INT}]", name="x.json")) == (
        f"x.json holds an integer of more than {sys.get_int_max_str_digits()} digits, more than Python reads"
    )
    with pytest.raises(json.JSONDecodeError):
        loads_bounded("{", name="x.json")
    (tmp_path / "deep.json").write_text(DEEP)
    assert _one_line(lambda: load_json(tmp_path / "deep.json", limit=1 << 20)) == (
        f"{tmp_path / 'deep.json'} nests deeper than a JSON file may"
    )


# ---- pretrained directories -----------------------------------------------------------


def test_a_safetensors_header_nested_too_deep_is_refused_naming_the_file(tmp_path: Path) -> None:
    path = _safetensors(tmp_path / "model.safetensors", DEEP)
    assert _one_line(lambda: PretrainedWeights.open(tmp_path), PretrainedError) == (
        f"{path}'s header nests deeper than a JSON file may: it is corrupt or was replaced; {REFETCH}"
    )


@pytest.mark.parametrize(
    ("second", "first_span", "second_span"),
    [
        ({"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}, "[0, 8)", "[4, 12)"),  # straddles
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "[0, 8)", "[0, 8)"),  # the same bytes
    ],
    ids=["straddling", "aliased"],
)
def test_tensors_whose_bytes_overlap_are_refused_naming_both(
    tmp_path: Path, second: dict[str, Any], first_span: str, second_span: str
) -> None:
    header = {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": second}
    path = _safetensors(tmp_path / "model.safetensors", header)
    assert _one_line(lambda: PretrainedWeights.open(tmp_path), PretrainedError) == (
        f"{path}: tensors a (data bytes {first_span}) and b ({second_span}) overlap: its header is corrupt; {REFETCH}"
    )


def test_a_tensor_inside_a_longer_one_is_refused_and_adjacent_or_empty_ones_are_not(tmp_path: Path) -> None:
    header = {
        "long": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "next": {"dtype": "F32", "shape": [1], "data_offsets": [16, 20]},
        "inside": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
    }
    path = _safetensors(tmp_path / "model.safetensors", header)
    assert _one_line(lambda: PretrainedWeights.open(tmp_path), PretrainedError) == (
        f"{path}: tensors long (data bytes [0, 16)) and inside ([8, 12)) overlap: its header is corrupt; {REFETCH}"
    )
    del header["inside"]
    header["empty"] = header["empty2"] = {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}
    _safetensors(path, header)
    assert sorted(PretrainedWeights.open(tmp_path).tensors) == ["empty", "empty2", "long", "next"]


def _checkpoint(directory: Path, config: str | dict[str, Any]) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    return directory


def test_a_config_json_nested_too_deep_is_refused_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = _checkpoint(tmp_path / "ckpt", DEEP)
    refusal = f"{checkpoint / 'config.json'} nests deeper than a JSON file may: it is corrupt or was replaced; {REFETCH}"
    assert _one_line(lambda: build_meta_model(checkpoint), PretrainedError) == refusal
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"model": {"pretrained": str(checkpoint)}, "train": {"steps": 1, "micro_batch_size": 1}}))
    capsys.readouterr()
    assert main(["train", "--config", str(run), "--no-progress"]) == 2
    assert capsys.readouterr().err == f"tierzero: error: {refusal}\n"


@pytest.mark.parametrize(
    ("edit", "refusal"),
    [
        ({"hidden_size": "64"}, 'hidden_size is "64", expected a positive integer'),
        ({"vocab_size": 0}, "vocab_size is 0, expected a positive integer"),
        ({"num_hidden_layers": 1.5}, "num_hidden_layers is 1.5, expected a positive integer"),
        ({"num_attention_heads": 3}, "num_attention_heads 3 does not divide hidden_size 32"),
        ({"model_type": "gpt2", "n_embd": 32, "n_head": 3}, "n_head 3 does not divide n_embd 32"),
    ],
    ids=["str-width", "vocab-0", "float-layers", "llama-heads", "gpt2-heads"],
)
def test_config_json_sizes_are_refused_naming_the_file_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit: dict[str, Any], refusal: str
) -> None:
    checkpoint = _checkpoint(tmp_path / "ckpt", {**LLAMA, **edit})
    message = f"{checkpoint / 'config.json'}: {refusal}: fix config.json"
    assert _one_line(lambda: build_meta_model(checkpoint), PretrainedError) == message
    run = tmp_path / "run.yaml"
    run.write_text(yaml.safe_dump({"model": {"pretrained": str(checkpoint)}}))
    capsys.readouterr()
    assert main(["estimate", "--config", str(run), "--flops", "50"]) == 2
    assert capsys.readouterr().err == f"tierzero: error: {message}\n"


def test_a_head_dim_of_its_own_lets_the_heads_not_divide_the_width(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    checkpoint = _checkpoint(tmp_path / "ckpt", {**LLAMA, "num_attention_heads": 3, "head_dim": 8})
    try:
        build_meta_model(checkpoint)
    except PretrainedError as exc:  # transformers may still refuse it, but in its own words
        assert "does not divide" not in str(exc)


def test_transformers_validation_errors_become_one_line_naming_the_field(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    checkpoint = _checkpoint(tmp_path / "ckpt", {**LLAMA, "intermediate_size": "64"})
    message = _one_line(lambda: build_meta_model(checkpoint), PretrainedError)
    assert message.startswith(f"{checkpoint / 'config.json'}: transformers ")
    assert "intermediate_size" in message and message.endswith(": fix config.json or upgrade transformers")


# ---- tokenizers -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tokenizer_config.json", "tokenizer.json"])
def test_a_tokenizer_file_nested_too_deep_is_refused_naming_it(tmp_path: Path, name: str) -> None:
    pytest.importorskip("transformers")
    from test_data_tokens import tiny_tokenizer

    directory = tiny_tokenizer(tmp_path / "tok")
    (directory / name).write_text(DEEP)
    assert _one_line(lambda: load_tokenizer(directory)) == (
        f"data.tokenizer {directory}: {name} nests deeper than a JSON file may: replace it with the file save_pretrained wrote"
    )


# ---- JSON Lines -------------------------------------------------------------------------


def test_jsonl_lines_that_break_python_are_refused_naming_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "docs.jsonl"
    good = json.dumps({"text": "fine"})
    assert _one_line(lambda: _jsonl(path, good, DEEP)) == (
        f"data.path file {path} line 2 nests deeper than a JSON file may: fix or remove the line"
    )
    assert _one_line(lambda: _jsonl(path, good, good, f'{{"text": "a", "n": {LONG_INT}}}')) == (
        f"data.path file {path} line 3 holds an integer of more than {sys.get_int_max_str_digits()} digits, "
        "more than Python reads: fix or remove the line"
    )
    assert _one_line(lambda: _jsonl(path, '{"text": "half a pair: \\ud800"}')) == (
        f"data.path file {path} line 1: field 'text' holds a lone surrogate escape (such as \\ud800), "
        "which is no character in UTF-8: fix the line"
    )
    # a whole pair is a character, a lone surrogate elsewhere in the record is not the text's
    assert _jsonl(path, '{"text": "\\ud83d\\ude00", "other": "\\udc00"}') == ["\U0001f600"]


# ---- saved datasets ---------------------------------------------------------------------


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "ds"
    datasets.Dataset.from_dict({"text": ["a", "b"]}).save_to_disk(str(path))
    return path


@pytest.mark.parametrize(
    ("name", "content", "detail"),
    [
        ("state.json", DEEP, "cannot be read ({where} nests deeper than a JSON file may)"),
        ("dataset_info.json", DEEP, "cannot be read ({where} nests deeper than a JSON file may)"),
        ("dataset_info.json", "[]", "holds a list, not a JSON object"),
        ("dataset_info.json", "null", "holds null, not a JSON object"),
    ],
    ids=["state-deep", "info-deep", "info-list", "info-null"],
)
def test_a_dataset_record_that_breaks_python_is_refused_naming_it(dataset: Path, name: str, content: str, detail: str) -> None:
    (dataset / name).write_text(content)
    where = dataset / name
    assert _one_line(lambda: list(read_documents(Source(dataset, Format.DATASETS)))) == (
        f"data.path {dataset}: {where} {detail.format(where=where)}: write the dataset again with save_to_disk"
    )


def test_a_sound_dataset_still_reads(dataset: Path) -> None:
    assert list(read_documents(Source(dataset, Format.DATASETS))) == ["a", "b"]
