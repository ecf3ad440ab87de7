"""Fuzzing the config loader: hostile dicts, YAML, JSON, DeepSpeed configs and raw bytes, from a fixed seed.

Every input must either load to a valid Config (one that dumps and reads back equal) or
raise a one-line ConfigError; any other exception, or a newline in a message, fails.
"""

from __future__ import annotations

import json
import math
import random
import reprlib
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tierzero.config import Config, ConfigError, load_config
from tierzero.config.tree import schema

REPO = Path(__file__).resolve().parents[2]
SEED = 20240612
CASES_PER_KIND = 60
LEAVES = [key for key, child in schema(Config).items() if child is None]
SECTIONS = [key for key, child in schema(Config).items() if child is not None]
DEEPSPEED_KEYS = [
    "zero_optimization.stage", "zero_optimization.offload_param.device", "zero_optimization.offload_param.nvme_path",
    "zero_optimization.offload_param.buffer_count", "zero_optimization.offload_param.buffer_size",
    "zero_optimization.offload_optimizer.device", "zero_optimization.offload_optimizer.pin_memory",
    "zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_max_live_parameters", "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.overlap_comm", "aio.block_size", "aio.queue_depth", "aio.thread_count",
    "optimizer.type", "optimizer.params.lr", "optimizer.params.betas", "optimizer.params.adam_w_mode",
    "fp16.enabled", "fp16.loss_scale", "fp16.initial_scale_power", "fp16.loss_scale_window", "fp16.min_loss_scale",
    "bf16.enabled", "gradient_clipping", "gradient_accumulation_steps", "train_micro_batch_size_per_gpu",
    "train_batch_size", "steps_per_print", "zero_optimization.bogus",
]


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxlong, _SHORT.maxother = 4, 80, 40, 80


@pytest.fixture(autouse=True)
def _no_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _self_containing() -> list[Any]:
    loop: list[Any] = [1]
    loop.append(loop)
    return loop


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def hostile_value(rng: random.Random, swap: str) -> Any:
    """A value of a wrong type, out of range, non-finite, huge, deep or odd; sometimes a sane one."""
    pool: list[Callable[[], Any]] = [
        lambda: None, lambda: True, lambda: -1, lambda: 0, lambda: 1, lambda: 3, lambda: 2**31, lambda: 2**63,
        lambda: 2**64, lambda: 10**30, lambda: 10**400, lambda: -(10**30), lambda: 1e7, lambda: 1e300, lambda: -1e300,
        lambda: math.nan, lambda: math.inf, lambda: -math.inf, lambda: 0.5, lambda: 2.0, lambda: 1e-300,
        lambda: "", lambda: "x" * rng.choice((1, 200, 5000)), lambda: "1e7", lambda: "64GiB", lambda: "8MiB",
        lambda: "-1GiB", lambda: "nan", lambda: "inf", lambda: "a\nb", lambda: "\x00", lambda: "\u2028", lambda: "dynamic",
        lambda: "nvme", lambda: "cpu", lambda: "GPT2Block", lambda: swap, lambda: [], lambda: [1, 2], lambda: [0.9, 0.999],
        lambda: {}, lambda: {"a": 1}, lambda: {"n_layer": 2}, lambda: _nested(rng.choice((10, 70, 3000))),
        lambda: _self_containing(), lambda: b"\xff", lambda: {1: 2}, lambda: [math.nan], lambda: list(range(200_000)),
    ]
    return rng.choice(pool)()


def _set(raw: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = raw
    for name in parents:
        if not isinstance(node.get(name), dict):
            node[name] = {}
        node = node[name]
    node[leaf] = value


def hostile_dict(rng: random.Random, swap: str) -> dict[str, Any]:
    """A config that is valid but for one to three hostile keys or values."""
    raw: dict[str, Any] = {"zero": {"stage": rng.choice((1, 2, 3))}, "train": {"seq_len": 64}}
    for _ in range(rng.randint(1, 3)):
        roll = rng.random()
        if roll < 0.7:
            _set(raw, rng.choice(LEAVES), hostile_value(rng, swap))
        elif roll < 0.85:
            _set(raw, rng.choice(SECTIONS), hostile_value(rng, swap))
        else:
            name = rng.choice(("zero.stag", "bogus", "a\nb", "x" * 3000, "tiers.nvme.\u2028", "model.n_layers"))
            raw[name] = hostile_value(rng, swap)
    return raw


def hostile_deepspeed(rng: random.Random, swap: str) -> dict[str, Any]:
    raw: dict[str, Any] = {"zero_optimization": {"stage": rng.choice((1, 2, 3))}}
    for _ in range(rng.randint(1, 4)):
        _set(raw, rng.choice(DEEPSPEED_KEYS), hostile_value(rng, swap))
    return raw


def _plain(value: Any, depth: int = 0) -> Any:
    """A value YAML and JSON can both write: loops and bytes become strings, and the writers'
    recursion and time are spared (deep and long inputs are written as text by hostile_text)."""
    if depth > 40:
        return "deep"
    if isinstance(value, dict):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return "loop" if any(v is value for v in value) else [_plain(v, depth + 1) for v in value[:100]]
    return value.decode("latin-1") if isinstance(value, bytes) else value


def _alias_bomb(levels: int) -> str:
    lines = ["model:", "  transformers_config:", "    l0: &l0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def hostile_text(rng: random.Random, swap: str) -> tuple[str, bytes]:
    """A file suffix and bytes: a hostile config written out, then perhaps mangled."""
    raw = _plain(hostile_deepspeed(rng, swap) if rng.random() < 0.3 else hostile_dict(rng, swap))
    suffix = rng.choice((".yaml", ".json"))
    text = json.dumps(raw) if suffix == ".json" else yaml.safe_dump(raw, width=1 << 20)
    data = text.encode("utf-8", "surrogatepass")
    roll = rng.random()
    if roll < 0.1:
        data = data[: rng.randrange(len(data) + 1)]
    elif roll < 0.2:
        at = rng.randrange(len(data) + 1)
        data = data[:at] + rng.choice((b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x00", b"\t\x0c")) + data[at:]
    elif roll < 0.3 and suffix == ".yaml":
        lines = data.splitlines(keepends=True)
        data = b"".join(lines + [rng.choice(lines)]) if lines else data
    elif roll < 0.4 and suffix == ".yaml":
        data = _alias_bomb(rng.choice((3, 8, 16))).encode() + rng.choice((b"", b"x: &a [*a]\n", b"y: *nope\n"))
    elif roll < 0.5:
        depth = rng.choice((63, 65, 5000))
        inner = "[" * depth + "]" * depth
        data = (f'{{"model": {{"transformers_config": {{"x": {inner}}}}}}}' if suffix == ".json"
                else f"model:\n  transformers_config:\n    x: {inner}\n").encode()
    elif roll < 0.6:
        data = (b'{"zero": {"stage": 1, "stage": 3}}' if suffix == ".json"
                else b"zero:\n  stage: 1\n  stage: 3\n")
    elif roll < 0.7:
        data = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
    elif roll < 0.75:
        data = rng.choice((b"train:\n  seed: 0x" + b"f" * 4000 + b"\n", b"train:\n  seed: " + b"9" * 5000 + b"\n",
                           b"train: {seed: 2024-13-45}\n", b"model: {transformers_config: !!binary zz}\n",
                           b"zero: !!python/object:os.system {}\n", b"- 1\n- 2\n", b"zero:\n  stage: 3\n---\nx: 1\n"))
    return suffix, data


def _check_outcome(what: str, source: Any, overrides: dict[str, Any] | None = None) -> str:
    """Load `source`: 'ok' or 'refused'; anything else fails the test with `what`, the input's description."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            cfg = load_config(source, overrides=overrides)
        except ConfigError as exc:
            assert type(exc) is ConfigError, what
            assert "\n" not in str(exc) and len(str(exc).splitlines()) == 1, f"{what}: {exc!r}"
            return "refused"
        except Exception as exc:  # noqa: BLE001 - the point of the test
            pytest.fail(f"{what}: {type(exc).__name__}: {exc!s:.300}")
    assert all("\n" not in str(w.message) for w in caught), what
    assert isinstance(cfg, Config), what
    assert load_config(cfg.to_dict()) == cfg, what
    assert load_config(yaml.safe_load(str(cfg))) == cfg, what
    return "ok"


def test_fuzz_config_loader(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    swap = str(tmp_path)
    outcomes: dict[str, list[str]] = {"dict": [], "deepspeed": [], "file": [], "override": []}
    start = time.perf_counter()
    for i in range(CASES_PER_KIND):
        raw = hostile_dict(rng, swap)
        outcomes["dict"].append(_check_outcome(f"dict #{i}: {_SHORT.repr(raw)}", raw))
        ds = hostile_deepspeed(rng, swap)
        outcomes["deepspeed"].append(_check_outcome(f"deepspeed #{i}: {_SHORT.repr(ds)}", ds))
        suffix, data = hostile_text(rng, swap)
        path = tmp_path / f"case{i}{suffix}"
        path.write_bytes(data)
        outcomes["file"].append(_check_outcome(f"file #{i} {suffix}: {_SHORT.repr(data)}", path))
        key, value = rng.choice(LEAVES + SECTIONS), hostile_value(rng, swap)
        outcomes["override"].append(_check_outcome(f"override #{i} {key}={_SHORT.repr(value)}", {}, {key: value}))
    elapsed = time.perf_counter() - start
    assert sum(len(v) for v in outcomes.values()) >= 200
    assert elapsed < 30, f"{elapsed:.1f} s"
    # The inputs reach both ends: some load, and most kinds are refused.
    for kind, results in outcomes.items():
        assert "refused" in results, kind
    assert any("ok" in results for results in outcomes.values())


CLI_CASES = {
    "bomb.yaml": _alias_bomb(16).encode(),
    "deep.json": b'{"model": {"transformers_config": {"x": ' + b"[" * 5000 + b"]" * 5000 + b"}}}",
    "latin1.yaml": b"data:\n  path: caf\xe9\n",
    "power.json": b'{"zero_optimization": {"stage": 3}, "fp16": {"enabled": true, "initial_scale_power": 2000}}',
    "newline.yaml": b'"a\\nb": 1\n',
}


def test_cli_check_refuses_hostile_files_in_one_line(tmp_path: Path) -> None:
    pytest.importorskip("tierzero.cli.bench", reason="tierzero.cli needs tierzero.cli.bench")
    processes = {}
    for name, data in CLI_CASES.items():
        path = tmp_path / name
        path.write_bytes(data)
        processes[name] = subprocess.Popen(
            [sys.executable, "-m", "tierzero.cli", "config", "check", str(path)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
        )
    for name, process in processes.items():
        out, err = process.communicate(timeout=120)
        assert process.returncode == 2, (name, err)
        assert out == "" and err.startswith("tierzero: error: ") and err.count("\n") == 1, (name, err)
