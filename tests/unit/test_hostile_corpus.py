"""Issue 46's numbers: a generated, seeded corpus of hostile inputs, each run through the real command
or reader it targets, with no traceback, no hang and no refusal of more than one line.

Families: config files (YAML and JSON) and DeepSpeed JSON through `tierzero config check`,
pretrained config.json fields and safetensors headers, tokenizer files, JSON Lines and saved
datasets, checkpoints (with and without re-signed checksums) through `consolidate`, the token
cache's record, and the kernel and disk caches. Each input either works or is refused in one line
naming its file or key (the cache files count as empty, and a damaged token cache is rebuilt with a
one-line warning). A watchdog stops the run if one case takes 30 s; the corpus asserts its size.
The generators of the fuzz tests beside it are imported, not copied.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import json
import random
import shutil
import struct
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_checkpoint_fuzz import MUTATIONS, _resign, saved  # noqa: F401 - saved: the fuzz test's checkpoint fixture
from test_config_fuzz import DEEPSPEED_KEYS, LEAVES, SECTIONS, _plain, hostile_deepspeed, hostile_text, hostile_value
from test_data_tokens import tiny_tokenizer
from test_hostile_json import DEEP, LLAMA, LONG_INT

from tierzero.checkpoint import CheckpointError
from tierzero.checkpoint.consolidate import consolidate
from tierzero.cli.main import main
from tierzero.common.cache_files import read_json
from tierzero.data import Format, Source, load_tokenizer, read_documents, token_stream
from tierzero.placement.disk import remembered
from tierzero.pretrained import PretrainedError, PretrainedWeights, build_meta_model

SEED = 46_500
HANG_S = 30
MINIMUM = 500
COUNTS = {
    "config": 150, "deepspeed": 50, "config.json": 60, "safetensors": 80, "tokenizer": 24, "jsonl": 80,
    "datasets": 16, "checkpoint": 60, "token cache": 20, "disk/kernel cache": 40,
}  # fmt: skip
KEYS = {key.split(".")[0] for key in LEAVES + SECTIONS} | {key.split(".")[0] for key in DEEPSPEED_KEYS}
"""A config refusal that does not name its file names one of these keys (or an unknown one)."""
JUNK = [DEEP, LONG_INT, "[]", "null", "{", '{"a": NaN}', "\ufeff{}", "\x00", "", '"\\ud800"', "1e999", '{"a": 1, "a": 2}']
"""Whole-file contents that break a JSON reader in each way it can break."""


@contextlib.contextmanager
def _watchdog(case: str) -> Iterator[None]:
    """Dumps every thread and ends the run if the case takes HANG_S (a hang, not a slow case, ends a suite)."""
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    began = time.perf_counter()
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert time.perf_counter() - began < HANG_S, case


def _refused(call: Callable[[], Any], error: type[Exception], *, case: str, names: Path | str) -> str:
    """'ok', or 'refused' when `call` raised `error` in one line naming `names`; anything else fails."""
    with _watchdog(case), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            call()
        except error as exc:
            message = str(exc)
            assert message and "\n" not in message, f"{case}: {message!r}"
            assert str(names) in message, f"{case}: names no {names}: {message}"
            return "refused"
        except Exception as exc:  # the point of the corpus: any other exception is a traceback
            raise AssertionError(f"{case}: {type(exc).__name__}: {str(exc)[:300]}") from exc
    assert all("\n" not in str(w.message) for w in caught), case
    return "ok"


# ---- the families: each yields (case, outcome) ---------------------------------------------------


def _config_check(path: Path, case: str) -> str:
    err = io.StringIO()
    with _watchdog(case), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["config", "check", str(path)])
    text = err.getvalue()
    if rc == 0:
        return "ok"
    assert rc == 2 and text.startswith("tierzero: error: ") and text.count("\n") == 1, f"{case}: rc {rc}: {text!r}"
    named = str(path) in text or "unknown key" in text or any(key in text for key in KEYS)
    assert named, f"{case}: names neither the file nor a key: {text}"
    return "refused"


def configs(rng: random.Random, tmp: Path) -> Iterator[tuple[str, str]]:
    for i in range(COUNTS["config"]):
        suffix, data = hostile_text(rng, str(tmp))
        path = tmp / f"config-{i}{suffix}"
        path.write_bytes(data)
        yield "config", _config_check(path, f"config {i} {suffix}: {data[:120]!r}")


def deepspeeds(rng: random.Random, tmp: Path) -> Iterator[tuple[str, str]]:
    for i in range(COUNTS["deepspeed"]):
        raw = _plain(hostile_deepspeed(rng, str(tmp)))
        path = tmp / f"ds-{i}.json"
        path.write_text(json.dumps(raw))
        yield "deepspeed", _config_check(path, f"deepspeed {i}: {json.dumps(raw)[:200]}")


GPT2 = {"model_type": "gpt2", "vocab_size": 64, "n_embd": 32, "n_layer": 1, "n_head": 2, "n_positions": 16}


def config_jsons(rng: random.Random, tmp: Path) -> Iterator[tuple[str, str]]:
    for i in range(COUNTS["config.json"]):
        directory = tmp / f"pretrained-{i}"
        directory.mkdir()
        base = dict(rng.choice((LLAMA, GPT2)))
        if rng.random() < 0.15:
            text = rng.choice(JUNK)
        else:
            for _ in range(rng.randint(1, 2)):
                key = rng.choice([*base, "head_dim", "torch_dtype", "architectures", "tie_word_embeddings"])
                base[key] = _plain(hostile_value(rng, str(tmp)))
            text = json.dumps(base)
        (directory / "config.json").write_text(text, errors="surrogatepass")
        yield "config.json", _refused(lambda d=directory: build_meta_model(d), PretrainedError, case=f"config.json {i}: {text[:200]}", names=directory / "config.json")


DTYPES = ["F32", "F16", "BF16", "I64", "U8", "BOOL", "F8_E4M3", "F64", "X", "", 7, None]


def _header(rng: random.Random) -> tuple[bytes, str]:
    """A safetensors file's bytes: a header of 1-3 tensors, one thing wrong (or nothing), then data."""
    tensors: dict[str, Any] = {}
    at = 0
    for name in rng.sample(["a", "b", "c", "model.w", "__metadata__"], rng.randint(1, 3)):
        size = 4 * rng.choice((0, 1, 2, 4))
        tensors[name] = {"dtype": "F32", "shape": [size // 4], "data_offsets": [at, at + size]}
        at += size
    how = rng.choice(["none", "overlap", "huge", "negative", "dtype", "shape", "reversed", "type", "metadata", "length", "truncate", "junk"])
    entry = tensors[rng.choice(list(tensors))]
    if how == "overlap" and len(tensors) > 1:
        entry["data_offsets"] = [0, max(4, entry["data_offsets"][1])]
    elif how == "huge":
        entry["data_offsets"] = [entry["data_offsets"][0], rng.choice((2**40, 2**64, 10**30))]
    elif how == "negative":
        entry["data_offsets"] = [-4, entry["data_offsets"][1]]
    elif how == "dtype":
        entry["dtype"] = rng.choice(DTYPES)
    elif how == "shape":
        entry["shape"] = rng.choice(([-1], [2**62, 2**62], [1.5], ["4"], None, [3], [0]))
    elif how == "reversed":
        entry["data_offsets"] = entry["data_offsets"][::-1] if entry["data_offsets"][1] else [4, 0]
    elif how == "type":
        entry[rng.choice(["dtype", "shape", "data_offsets"])] = rng.choice([None, "x", {}, [1, 2, 3], 1.0])
    elif how == "metadata":
        tensors["__metadata__"] = rng.choice([{"format": "pt"}, {"format": 1}, [], "x", {"a": {"b": 1}}])
    text = json.dumps(tensors).encode() if how != "junk" else rng.choice(JUNK).encode("utf-8", "surrogatepass")
    length = len(text)
    if how == "length":
        length = rng.choice((0, 7, length + 1, 2**40, 2**64 - 1))
    data = struct.pack("<Q", length) + text + bytes(at)
    if how == "truncate":
        data = data[: rng.randrange(len(data))]
    return data, how


def safetensors(rng: random.Random, tmp: Path) -> Iterator[tuple[str, str]]:
    for i in range(COUNTS["safetensors"]):
        directory = tmp / f"weights-{i}"
        directory.mkdir()
        (directory / "config.json").write_text(json.dumps(LLAMA))
        data, how = _header(rng)
        (directory / "model.safetensors").write_bytes(data)
        case = f"safetensors {i} ({how}): {data[:160]!r}"
        yield "safetensors", _refused(lambda d=directory: PretrainedWeights.open(d), PretrainedError, case=case, names=directory)


def _mangle(data: bytes, rng: random.Random) -> bytes:
    how = rng.choice(["truncate", "flip", "junk", "insert"])
    if how == "truncate":
        return data[: rng.randrange(len(data) + 1)]
    if how == "junk":
        return rng.choice(JUNK).encode("utf-8", "surrogatepass")
    at = rng.randrange(len(data) + 1)
    if how == "insert":
        return data[:at] + rng.choice((b"\xff", b"\x00", b"[" * 5000, b'"\\ud800"', b"1" * 5000)) + data[at:]
    flipped = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
    return bytes(flipped)


def tokenizers(rng: random.Random, tmp: Path) -> Iterator[tuple[str, str]]:
    pytest.importorskip("transformers")
    source = tiny_tokenizer(tmp / "tokenizer-source")
    for i in range(COUNTS["tokenizer"]):
        directory = tmp / f"tokenizer-{i}"
        shutil.copytree(source, directory)
        target = rng.choice(sorted(directory.iterdir()))
        name = target.name
        if rng.random() < 0.4:
            tree = json.loads(target.read_text())
            key = rng.choice(list(tree)) if isinstance(tree, dict) and tree else "x"
            tree[key] = _plain(hostile_value(rng, str(tmp)))
            target.write_text(json.dumps(tree))
        else:
            target.write_bytes(_mangle(target.read_bytes(), rng))
        case = f"tokenizer {i}: {name} mangled"
        yield "tokenizer", _refused(lambda d=directory: load_tokenizer(d), ValueError, case=case, names=directory)


def _jsonl_line(rng: random.Random) -> str:
    return rng.choice([
        lambda: json.dumps({"text": "fine"}),
        lambda: json.dumps({"text": _plain(hostile_value(rng, "/tmp"))}),
        lambda: json.dumps({rng.choice(["txt", "", "TEXT", "content"]): "x"}),
        lambda: json.dumps(_plain(hostile_value(rng, "/tmp"))),
        lambda: '{"text": "half \\ud800 a pair"}',
        lambda: '{"text": "pair \\ud83d\\ude00"}',
        lambda: f'{{"text": "a", "n": {LONG_INT}}}',
        lambda: DEEP[: rng.choice((100, 5000, 100_000))],
        lambda: '{"text": "a"',
        lambda: '{"text": NaN}',
        lambda: "\xff\xfe",
        lambda: "",
        lambda: '{"text": "a", "text": 1}',
    ])()  # fmt: skip


def jsonls(rng: random.Random, tmp: Path) -> Iterator[tuple[str, str]]:
    for i in range(COUNTS["jsonl"]):
        path = tmp / f"docs-{i}.jsonl"
        lines = [_jsonl_line(rng) for _ in range(rng.randint(1, 4))]
        path.write_bytes("\n".join(lines).encode("utf-8", "surrogateescape") + b"\n")
        case = f"jsonl {i}: {[line[:60] for line in lines]}"
        yield "jsonl", _refused(lambda p=path: list(read_documents(Source(p, Format.JSONL))), ValueError, case=case, names=path)


def datasets_dirs(rng: random.Random, tmp: Path) -> Iterator[tuple[str, str]]:
    datasets = pytest.importorskip("datasets")
    source = tmp / "dataset-source"
    datasets.Dataset.from_dict({"text": ["a", "b", "c"]}).save_to_disk(str(source))
    for i in range(COUNTS["datasets"]):
        directory = tmp / f"dataset-{i}"
        shutil.copytree(source, directory)
        target = rng.choice(sorted(directory.iterdir()))
        if target.suffix == ".json" and rng.random() < 0.4:
            tree = json.loads(target.read_text())
            key = rng.choice(list(tree)) if tree else "x"
            tree[key] = rng.choice(["../../etc/passwd", [{"filename": "../../etc/passwd"}], None, 1, [], {}, [{"filename": 3}]])
            target.write_text(json.dumps(tree))
        else:
            target.write_bytes(_mangle(target.read_bytes(), rng))
        case = f"datasets {i}: {target.name} mangled"
        yield "datasets", _refused(lambda d=directory: list(read_documents(Source(d, Format.DATASETS))), ValueError, case=case, names=directory)


def checkpoints(rng: random.Random, tmp: Path, saved: Path) -> Iterator[tuple[str, str]]:
    for i in range(COUNTS["checkpoint"]):
        step_dir = tmp / f"ckpt-{i}" / "1"
        shutil.copytree(saved, step_dir)
        mutation = rng.choice(MUTATIONS)
        what = mutation(step_dir, rng)
        signed = rng.random() < 0.5
        if signed:
            _resign(step_dir)
        out = tmp / f"consolidated-{i}.safetensors"
        case = f"checkpoint {i} ({mutation.__name__}: {what}, {'re-signed' if signed else 'as mutated'})"
        outcome = _refused(lambda d=step_dir, o=out: consolidate(d, o), CheckpointError, case=case, names=step_dir)
        assert out.exists() == (outcome == "ok") and not list(tmp.glob(".consolidated-*")), case
        shutil.rmtree(step_dir.parent)
        out.unlink(missing_ok=True)
        yield "checkpoint", outcome


def token_caches(rng: random.Random, tmp: Path) -> Iterator[tuple[str, str]]:
    pytest.importorskip("transformers")
    tokenizer = load_tokenizer(tiny_tokenizer(tmp / "cache-tokenizer"))
    corpus = tmp / "cache-corpus.txt"
    corpus.write_text("the cat sat on the mat")
    cache = tmp / "token-cache"
    sources = [Source(corpus, Format.TEXT)]
    expected = token_stream(sources, tokenizer, cache_dir=cache).ids.tolist()
    (record,) = cache.glob("*.json")
    sound = record.read_bytes()
    for i in range(COUNTS["token cache"]):
        if rng.random() < 0.5:
            tree = json.loads(sound)
            tree[rng.choice(list(tree))] = _plain(hostile_value(rng, str(tmp)))
            record.write_text(json.dumps(tree))
        else:
            record.write_bytes(_mangle(sound, rng))
        case = f"token cache {i}: {record.read_bytes()[:160]!r}"
        with _watchdog(case), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            stream = token_stream(sources, tokenizer, cache_dir=cache)
        assert stream.ids.tolist() == expected, case
        assert all("\n" not in str(w.message) and str(cache) in str(w.message) for w in caught), (case, caught)
        assert sorted(p.suffix for p in cache.iterdir()) == [".json", ".npy"], case  # no .lock, no temp file left
        yield "token cache", "rebuilt" if stream.built else "ok"


def machine_caches(rng: random.Random, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, str]]:
    home = tmp / "cache-home"
    home.mkdir()
    monkeypatch.setenv("TIERZERO_CACHE_DIR", str(home))
    swap = str(tmp)
    shapes = [
        lambda: {swap: {"s": {"read": _plain(hostile_value(rng, swap)), "write": 1.0, "when": 0}}},
        lambda: {swap: _plain(hostile_value(rng, swap))},
        lambda: {swap: {"s": _plain(hostile_value(rng, swap))}, "x": {}},
        lambda: _plain(hostile_value(rng, swap)),
    ]
    for i in range(COUNTS["disk/kernel cache"]):
        name = rng.choice(["disks.json", "kernels.json"])
        path = home / name
        if rng.random() < 0.5:
            path.write_text(json.dumps(rng.choice(shapes)()))
        else:
            path.write_bytes(rng.choice(JUNK).encode("utf-8", "surrogatepass"))
        case = f"{name} {i}: {path.read_bytes()[:160]!r}"
        with _watchdog(case), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                assert isinstance(read_json(path), dict), case
                found = remembered(swap, "s")
            except Exception as exc:  # an unreadable cache counts as empty: never a traceback
                raise AssertionError(f"{case}: {type(exc).__name__}: {exc}") from exc
        assert all("\n" not in str(w.message) for w in caught), case
        yield "disk/kernel cache", "ok" if found is None else "remembered"


# ---- the corpus ------------------------------------------------------------------------------------


def test_the_hostile_corpus_gives_no_traceback_and_no_hang(
    tmp_path: Path, saved: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811 - saved: the imported fixture
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    rng = random.Random(SEED)
    families: list[Iterator[tuple[str, str]]] = [
        configs(rng, tmp_path), deepspeeds(rng, tmp_path), config_jsons(rng, tmp_path), safetensors(rng, tmp_path),
        tokenizers(rng, tmp_path), jsonls(rng, tmp_path), datasets_dirs(rng, tmp_path), checkpoints(rng, tmp_path, saved),
        token_caches(rng, tmp_path), machine_caches(rng, tmp_path, monkeypatch),
    ]  # fmt: skip
    outcomes: dict[str, dict[str, int]] = {}
    seconds: dict[str, float] = {}
    for family in families:
        began = time.perf_counter()
        for kind, outcome in family:
            outcomes.setdefault(kind, {}).setdefault(outcome, 0)
            outcomes[kind][outcome] += 1
        seconds[kind] = time.perf_counter() - began
    counts = {kind: sum(by.values()) for kind, by in outcomes.items()}
    print({kind: (counts[kind], outcomes[kind], f"{seconds[kind]:.1f} s") for kind in outcomes})
    assert counts == COUNTS
    assert sum(counts.values()) >= MINIMUM
    # the generators reach refusals in every family that can refuse, and sound inputs somewhere
    for kind in ("config", "deepspeed", "config.json", "safetensors", "tokenizer", "jsonl", "datasets", "checkpoint"):
        assert outcomes[kind].get("refused", 0) > 0, (kind, outcomes[kind])
    assert outcomes["token cache"].get("rebuilt", 0) > 0
