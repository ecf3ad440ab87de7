"""Hostile checkpoints, generated: each loads, or is refused in one line naming its file; nothing else.

A real save writes a small checkpoint; each case copies it, mutates the copy (numbers,
types, names, lists, file lengths, safetensors headers, RNG states, symlinks) and then, as
someone who can write the directory could, recomputes the file records and the manifest's
own checksum, so that the checksums catch nothing and the loader's checks must. Both
`load_checkpoint` and `consolidate` run on every case. Deterministic: case i uses seed
SEED + i, and a failure names the case and its mutation.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from crc32c import crc32c
from test_checkpoint import config, make_model, train

import tierzero
from tierzero.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from tierzero.checkpoint.consolidate import consolidate
from tierzero.checkpoint.format import json_checksum

SEED, CASES, BUDGET_S = 20261201, 400, 30.0
HOSTILE: list[Any] = [
    0, -1, 1, 2, 7, -(2**63), 2**63, 2**64 + 1, 10**30, 10**9, 1e9, 1.5, -0.0, math.inf, -math.inf, math.nan,
    "7", "", "../../etc/passwd", "x" * 5000, "float64", "F32", "param", "__metadata__", "module/seen",
    None, True, False, [], [1, 2], {}, {"a": 1},
]


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into a JSON tree (containers and leaves)."""
    out = [prefix]
    if isinstance(value, dict):
        for key, child in value.items():
            out += _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for i, child in enumerate(value):
            out += _paths(child, (*prefix, i))
    return out


def _at(tree: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def _set(tree: Any, path: tuple[Any, ...], value: Any) -> None:
    _at(tree, path[:-1])[path[-1]] = value


def _near(value: Any, rng: random.Random) -> Any:
    """A plausible wrong number: off by one, doubled, halved, negated, or a hostile one."""
    if isinstance(value, int) and not isinstance(value, bool) and rng.random() < 0.6:
        return rng.choice([value + 1, value - 1, value * 2, value // 2, -value, value + 2**40])
    return rng.choice(HOSTILE)


# ---- mutations: each edits the step directory and says what it did ------------------


def _edit_json(path: Path, edit: Callable[[Any], str]) -> str:
    tree = json.loads(path.read_text())
    what = edit(tree)
    path.write_text(json.dumps(tree))
    return what


def _manifest_value(d: Path, rng: random.Random) -> str:
    def edit(tree: Any) -> str:
        path = rng.choice([p for p in _paths(tree) if p and p[0] != "self_checksum"])
        old = _at(tree, path)
        new = _near(old, rng) if not isinstance(old, dict | list) or rng.random() < 0.3 else rng.choice(HOSTILE)
        _set(tree, path, new)
        return f"manifest {path} = {new!r:.40}"

    return _edit_json(d / "manifest.json", edit)


def _manifest_key(d: Path, rng: random.Random) -> str:
    def edit(tree: Any) -> str:
        path = rng.choice([p for p in _paths(tree) if p and isinstance(p[-1], str) and p[0] != "self_checksum"])
        parent, key = _at(tree, path[:-1]), path[-1]
        value = parent.pop(key)
        if rng.random() < 0.5:
            new = rng.choice(["../evil", "rank-00001.safetensors", "rank-00000.json", "", "module", key + "x", "__metadata__"])
            parent[new] = value
            return f"manifest {path} renamed {new!r}"
        return f"manifest {path} deleted"

    return _edit_json(d / "manifest.json", edit)


def _manifest_list(d: Path, rng: random.Random) -> str:
    def edit(tree: Any) -> str:
        lists = [p for p in _paths(tree) if isinstance(_at(tree, p), list) and _at(tree, p)]
        path = rng.choice(lists)
        items = _at(tree, path)
        how = rng.choice(["duplicate", "drop", "reverse", "empty"])
        new = {"duplicate": items + items[-1:], "drop": items[1:], "reverse": items[::-1], "empty": []}[how]
        _set(tree, path, new) if path else None
        return f"manifest list {path} {how}"

    return _edit_json(d / "manifest.json", edit)


def _world_size(d: Path, rng: random.Random) -> str:
    size = rng.choice([0, 2, 3, 10**9, -1])

    def edit(tree: Any) -> str:
        tree["world_size"] = size
        for unit in tree["units"]:
            unit["world_size"] = size
            if rng.random() < 0.5 and size > 0:
                unit["padded_numel"] = unit["padded_numel"] * size
        if rng.random() < 0.5 and 0 < size < 4:
            for rank in range(1, size):
                for name in (f"rank-{rank:05d}.safetensors", f"rank-{rank:05d}.json"):
                    shutil.copy(d / name.replace(f"{rank:05d}", "00000"), d / name)
        return f"world size {size}"

    return _edit_json(d / "manifest.json", edit)


def _rank_state(d: Path, rng: random.Random) -> str:
    def edit(tree: Any) -> str:
        path = rng.choice([p for p in _paths(tree) if p])
        new = _near(_at(tree, path), rng)
        _set(tree, path, new)
        return f"rank state {path[:3]} = {new!r:.40}"

    return _edit_json(d / "rank-00000.json", edit)


def _header(d: Path, rng: random.Random) -> str:
    """Rewrite the tensor file's safetensors header with one field changed; the data stays."""
    target = d / "rank-00000.safetensors"
    raw = target.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header, data = json.loads(raw[8 : 8 + length]), raw[8 + length :]
    path = rng.choice([p for p in _paths(header) if len(p) >= 2])
    old = _at(header, path)
    new = rng.choice(["F16", "I32", "BF16", "F8_E4M3", "X"]) if path[-1] == "dtype" else _near(old, rng)
    _set(header, path, new)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    target.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return f"header {path} = {new!r:.40}"


def _bytes(d: Path, rng: random.Random) -> str:
    target = d / rng.choice(["rank-00000.safetensors", "rank-00000.json", "manifest.json"])
    data = bytearray(target.read_bytes())
    how = rng.choice(["truncate", "append", "flip", "flip"])
    if how == "truncate":
        data = data[: rng.randrange(len(data))]
    elif how == "append":
        data += bytes(rng.randrange(256) for _ in range(rng.choice([1, 8, 100])))
    else:
        for _ in range(rng.randrange(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    target.write_bytes(bytes(data))
    return f"{target.name} {how}"


def _files(d: Path, rng: random.Random) -> str:
    name = rng.choice(["rank-00000.safetensors", "rank-00000.json", "manifest.json"])
    how = rng.choice(["remove", "symlink", "extra", "directory"])
    target = d / name
    if how == "remove":
        target.unlink()
    elif how == "symlink":
        outside = d.parent / f"outside-{name}"
        target.rename(outside)
        target.symlink_to(outside)
    elif how == "extra":
        shutil.copy(target, d / name.replace("00000", "00001").replace("manifest", "rank-00001"))
    else:
        target.unlink()
        target.mkdir()
    return f"{name} {how}"


def _json_bomb(d: Path, rng: random.Random) -> str:
    target = d / rng.choice(["manifest.json", "rank-00000.json"])
    bomb = rng.choice(["[" * 100_000 + "]" * 100_000, "1" * 5000, '{"format": NaN}', "\xff\xfe", "[]"])
    target.write_text(bomb, errors="surrogateescape")
    return f"{target.name} = {bomb[:12]!r}..."


MUTATIONS = [_manifest_value] * 6 + [_manifest_key] * 2 + [_manifest_list, _world_size, _rank_state, _header, _header, _bytes, _files, _json_bomb]


def _resign(d: Path) -> None:
    """What an attacker can do: make the manifest vouch for every file as it now is, and for itself."""
    try:
        manifest = json.loads((d / "manifest.json").read_text())
        records = manifest["files"]
        for name, record in records.items():
            path = d / name
            if isinstance(record, dict) and path.is_file() and not path.is_symlink():
                data = path.read_bytes()
                record.update({"bytes": len(data), "checksum": f"{crc32c(data):08x}"})
        manifest.pop("self_checksum", None)
        manifest["self_checksum"] = json_checksum(manifest, algorithm="crc32c")
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return  # not a manifest any more: nothing to vouch for
    (d / "manifest.json").write_text(json.dumps(manifest))


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _outcome(fn: Callable[[], Any], *, where: Path, case: str) -> str:
    """'ok', or the refusal's message: anything but a one-line CheckpointError naming `where` fails the test."""
    try:
        fn()
    except CheckpointError as exc:
        message = str(exc)
        assert "\n" not in message, f"{case}: {message}"
        assert str(where) in message, f"{case}: the message names no file of it: {message}"
        return message
    except Exception as exc:  # the point of the test: re-raised as a failure
        raise AssertionError(f"{case}: {type(exc).__name__}: {exc}") from exc
    return "ok"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real checkpoint of a model with a buffer: stage 3, bf16 (param, master and Adam states)."""
    model = make_model()
    model.register_buffer("seen", torch.arange(3.0))
    root = tmp_path_factory.mktemp("fuzz-source")
    with tierzero.initialize(model, config(3, dtype="bf16")) as engine:
        train(engine, 0, 1)
        return save_checkpoint(engine, root / "ckpt")


def test_hostile_checkpoints_load_or_are_refused_in_one_line(saved: Path, tmp_path: Path) -> None:
    model = make_model()
    model.register_buffer("seen", torch.zeros(3))
    outcomes: dict[str, int] = {}
    with tierzero.initialize(model, config(3, dtype="bf16")) as engine:
        began = time.perf_counter()
        for i in range(CASES):
            rng = random.Random(SEED + i)
            root = tmp_path / f"case-{i}"
            step_dir = root / "1"
            shutil.copytree(saved, step_dir)
            mutation = rng.choice(MUTATIONS)
            case = f"case {i} ({mutation.__name__}: {mutation(step_dir, rng)})"
            if rng.random() < 0.9:
                _resign(step_dir)
            before = _listing(root)
            out = tmp_path / f"out-{i}"
            out.mkdir()
            loaded = _outcome(lambda d=step_dir: load_checkpoint(engine, d), where=step_dir, case=case)
            merged = _outcome(lambda d=step_dir, o=out: consolidate(d, o / "model.safetensors"), where=step_dir, case=case)
            assert _listing(root) == before, f"{case}: the checkpoint's directory changed"
            assert _listing(out) == ([] if merged != "ok" else ["model.safetensors"]), f"{case}: {_listing(out)} left behind"
            for result in (loaded, merged):
                outcomes["ok" if result == "ok" else "refused"] = outcomes.get("ok" if result == "ok" else "refused", 0) + 1
            shutil.rmtree(root)
            shutil.rmtree(out)
        elapsed = time.perf_counter() - began
    assert elapsed < BUDGET_S, f"{CASES} cases took {elapsed:.1f} s"
    # the generator reaches both outcomes: refusals, and mutations a loader rightly accepts
    assert outcomes["refused"] >= CASES and outcomes["ok"] >= 10, outcomes


def test_the_unmutated_copy_loads_and_consolidates(saved: Path, tmp_path: Path) -> None:
    step_dir = tmp_path / "root" / "1"
    shutil.copytree(saved, step_dir)
    _resign(step_dir)
    model = make_model()
    model.register_buffer("seen", torch.zeros(3))
    with tierzero.initialize(model, config(3, dtype="bf16")) as engine:
        assert load_checkpoint(engine, step_dir) == step_dir
        assert torch.equal(engine.module.seen, torch.arange(3.0))
    assert consolidate(step_dir, tmp_path / "m.safetensors").step == 1
    assert os.path.getsize(tmp_path / "m.safetensors") > 0
