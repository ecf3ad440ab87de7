"""`optimizer.state_dtype`: Adam's moments in bf16 or 8-bit block-wise codes ([Note: compact moments]).

The references are written here from the papers' definitions: the dynamic code of Dettmers et
al.'s 8-bit optimizers built from its bins, nearest-code quantization per block of 2048 with an
fp32 absmax, and torch.optim's fused AdamW on the dequantized moments; the flat optimizer must
give the same codes, absmax and master weights bit for bit. Then the engine: every placement and
stage gives the bits of the states on the device, a checkpoint keeps the bytes, and every count
of bytes is the layout's.
"""

from __future__ import annotations

import json
import struct
import sys
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
import torch
from test_checkpoint_fuzz import _resign

import tierzero
import tierzero.optim.windows as windows
from tierzero.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from tierzero.common.slices import Kind, SliceKey, Tier, align_up
from tierzero.config import ConfigError, load_config
from tierzero.estimate import estimate
from tierzero.optim.flat import FlatAdam, OptimizerSpec, OptimizerType
from tierzero.optim.moments import MOMENT_BLOCK, MomentFormat, StateDtype
from tierzero.units.slice_layout import SliceLayout

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
from harness import Case  # noqa: E402

BLOCK = 2048
NUMELS = [37, 65, 1029, 7, 192, 1, 1023, 4096, 255, 1023, 120]
"""A unit's tensors: tails of many lengths; 7848 elements, cut into a shard of two blocks and one of 1.8."""
CUTS = [0, 2 * BLOCK, sum(NUMELS)]
LR, WD, BETAS = 1e-2, 0.1, (0.9, 0.999)


# ---- the reference, from the papers -------------------------------------------------------------


def dynamic_code(signed: bool) -> torch.Tensor:
    """The dynamic data type: for i = 0..6, bin centres of [0.1, 1] split in 2^i (signed, with both
    signs) or 2^(i+1) bins, times 10^(i-6); plus 0 and 1. Each exact value rounded once to fp32."""
    values = {Fraction(0), Fraction(1)}
    for i in range(7):
        bins = 2**i if signed else 2 ** (i + 1)
        for j in range(bins):
            value = (Fraction(1, 10) + Fraction(9, 10) * Fraction(2 * j + 1, 2 * bins)) * Fraction(10) ** (i - 6)
            values |= {value, -value} if signed else {value}
    return torch.tensor([float(v) for v in sorted(values)], dtype=torch.float64).float()


CODES = {signed: dynamic_code(signed) for signed in (True, False)}


def ref_quantize(x: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of 2048: absmax a, then each x / a (fp32) to its nearest code, ties to the lower one."""
    blocks = list(x.split(BLOCK))
    absmax = torch.stack([b.abs().max() for b in blocks])
    codes = []
    for b, a in zip(blocks, absmax, strict=True):
        r = b / a if a > 0 else torch.zeros_like(b)
        distance = (r.double()[:, None] - CODES[signed].double()[None, :]).abs()
        codes.append(distance.argmin(dim=1))  # the first of equal minima: the lower code
    return torch.cat(codes).to(torch.uint8), absmax


def ref_dequantize(codes: torch.Tensor, absmax: torch.Tensor, signed: bool) -> torch.Tensor:
    values = CODES[signed][codes.long()]
    return torch.cat([v * a for v, a in zip(values.split(BLOCK), absmax, strict=True)])


def ref_adamw(params: list[torch.Tensor], grads: list[torch.Tensor], m: torch.Tensor, v: torch.Tensor, step: int) -> None:
    """torch.optim.AdamW(fused=True) on each original tensor, its moments set to `m`, `v` (flat, updated in place)."""
    offsets = [0]
    for p in params:
        offsets.append(offsets[-1] + p.numel())
    leaves = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = torch.optim.AdamW(leaves, lr=LR, betas=BETAS, weight_decay=WD, fused=True)
    for leaf, g, a, b in zip(leaves, grads, offsets, offsets[1:], strict=False):
        leaf.grad = g.clone()
        opt.state[leaf] = {"step": torch.tensor(float(step - 1)), "exp_avg": m[a:b].clone(), "exp_avg_sq": v[a:b].clone()}
    opt.step()
    for p, leaf, a, b in zip(params, leaves, offsets, offsets[1:], strict=False):
        p.copy_(leaf.detach())
        m[a:b], v[a:b] = opt.state[leaf]["exp_avg"], opt.state[leaf]["exp_avg_sq"]


def tensors(seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * scale for n in NUMELS]


# ---- the flat optimizer against the reference -----------------------------------------------------


def _flat_int8_run(steps: int, *, converting: bool) -> tuple[torch.Tensor, list[dict[Kind, torch.Tensor]]]:
    opt = FlatAdam(OptimizerSpec(type=OptimizerType.ADAMW, lr=LR, weight_decay=WD, state_dtype=StateDtype.INT8))
    master = torch.cat(tensors(0))
    states = [opt.new_states(b - a) for a, b in zip(CUTS, CUTS[1:], strict=False)]
    for step in range(1, steps + 1):
        grad = torch.cat(tensors(step, 0.1))
        for (a, b), state in zip(zip(CUTS, CUTS[1:], strict=False), states, strict=True):
            layout = SliceLayout.of(NUMELS, offset=a)
            if converting:
                g16 = (grad[a:b] * 4).to(torch.bfloat16)
                opt.step_converting(param=master[a:b], grad=g16, scale=0.25, states=state, step=step, lr=LR, layout=layout)
            else:
                opt.step(param=master[a:b], grad=grad[a:b], states=state, step=step, lr=LR, layout=layout)
    return master, states


@pytest.mark.parametrize("window", [BLOCK, 1 << 22])
@pytest.mark.parametrize("converting", [False, True])
def test_int8_adamw_equals_the_reference_bit_for_bit(window: int, converting: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(windows, "WINDOW", window)  # BLOCK: windows cut inside tensors, vectors and tails
    steps = 4
    master, states = _flat_int8_run(steps, converting=converting)
    params = tensors(0)
    slices = [(a, b) for a, b in zip(CUTS, CUTS[1:], strict=False)]
    ref = {s: [ref_quantize(torch.zeros(b - a), s) for a, b in slices] for s in (True, False)}
    for step in range(1, steps + 1):
        grads = tensors(step, 0.1)
        if converting:
            grads = [(g * 4).to(torch.bfloat16).float() * 0.25 for g in grads]
        m, v = (torch.cat([ref_dequantize(c, a, s) for c, a in ref[s]]) for s in (True, False))
        ref_adamw(params, grads, m, v, step)
        for s, values in ((True, m), (False, v)):
            ref[s] = [ref_quantize(values[a:b], s) for a, b in slices]
    assert torch.equal(master, torch.cat(params))
    fmt = MomentFormat(StateDtype.INT8)
    for (a, b), state, m_ref, v_ref in zip(slices, states, ref[True], ref[False], strict=True):
        for kind, (codes, absmax) in ((Kind.EXP_AVG, m_ref), (Kind.EXP_AVG_SQ, v_ref)):
            got_absmax, got_codes = fmt.split(state[kind], b - a)
            assert torch.equal(got_codes, codes), kind
            assert torch.equal(got_absmax, absmax), kind
    assert int(ref[True][0][1].gt(0).sum()) == 2  # the moments are not zero: the test compares something


def test_bf16_moments_equal_the_reference_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(windows, "WINDOW", BLOCK)
    opt = FlatAdam(OptimizerSpec(type=OptimizerType.ADAMW, lr=LR, weight_decay=WD, state_dtype=StateDtype.BF16))
    master, params = torch.cat(tensors(0)), tensors(0)
    states = opt.new_states(master.numel())
    m, v = torch.zeros(master.numel(), dtype=torch.bfloat16), torch.zeros(master.numel(), dtype=torch.bfloat16)
    assert states[Kind.EXP_AVG].dtype == torch.bfloat16 and states[Kind.EXP_AVG].numel() == master.numel()
    for step in range(1, 5):
        grads = tensors(step, 0.1)
        opt.step(param=master, grad=torch.cat(grads), states=states, step=step, lr=LR, layout=SliceLayout.of(NUMELS))
        m32, v32 = m.float(), v.float()
        ref_adamw(params, grads, m32, v32, step)
        m, v = m32.bfloat16(), v32.bfloat16()
    assert torch.equal(master, torch.cat(params))
    assert torch.equal(states[Kind.EXP_AVG], m) and torch.equal(states[Kind.EXP_AVG_SQ], v)


def test_the_code_tables_and_byte_counts_are_the_papers() -> None:
    from tierzero.units.blockwise import dynamic_code as ours

    for signed in (True, False):
        assert torch.equal(torch.tensor(ours(signed=signed)), CODES[signed])
    fmt = MomentFormat(StateDtype.INT8)
    for n in (1, 2048, 2049, 7848, 1 << 24):
        assert fmt.nbytes(n) == n + 4 * -(-n // MOMENT_BLOCK)
    assert 2 * fmt.nbytes(1 << 24) / (1 << 24) == 2.00390625  # <= 2.1 bytes a parameter for both moments
    assert MomentFormat(StateDtype.BF16).nbytes(100) == 200 and MomentFormat().nbytes(100) == 400


def test_non_finite_moments_and_sgd_are_refused_in_one_line() -> None:
    opt = FlatAdam(OptimizerSpec(type=OptimizerType.ADAMW, lr=LR, state_dtype=StateDtype.INT8))
    grad = torch.zeros(100)
    grad[7] = float("nan")
    with pytest.raises(ValueError, match=r"^optimizer.state_dtype int8: 1 of the exp_avg values .* gradient_clipping") as info:
        opt.step(param=torch.zeros(100), grad=grad, states=opt.new_states(100), step=1, lr=LR)
    assert "\n" not in str(info.value)
    fp32_states = {kind: torch.zeros(100) for kind in (Kind.EXP_AVG, Kind.EXP_AVG_SQ)}
    with pytest.raises(ValueError, match="must be a contiguous 1-D torch.uint8 tensor of 104 elements"):
        opt.step(param=torch.zeros(100), grad=torch.zeros(100), states=fp32_states, step=1, lr=LR)
    with pytest.raises(ConfigError, match=r"optimizer.state_dtype int8 stores Adam's moments.*set optimizer.state_dtype: fp32"):
        load_config({"optimizer": {"type": "sgd", "momentum": 0.9, "state_dtype": "int8"}})
    with pytest.raises(ConfigError, match="optimizer.state_dtype"):
        load_config({"optimizer": {"state_dtype": "int4"}})


# ---- the engine: placements, checkpoints, bytes -----------------------------------------------------

STEPS = 3
# (stage, param dtype, offload); each compared with the same stage and dtype, every state on the device
PLACEMENTS = [
    (1, "bf16", {"optimizer": "cpu"}),
    (1, "bf16", {"optimizer": "nvme"}),
    (2, "fp32", {"optimizer": "cpu"}),
    (2, "fp32", {"gradients": "cpu", "optimizer": "nvme"}),
    (3, "bf16", {"params": "cpu", "optimizer": "cpu"}),
    (3, "bf16", {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"}),
]


def _config(stage: int, dtype: str, offload: dict[str, str], swap: Path, state_dtype: str = "int8") -> dict[str, Any]:
    case = Case(stage=stage, optimizer="adamw", steps=STEPS, dtype=dtype, accumulation=1, global_batch=4)
    config = case.config() | {"offload": offload, "tiers": {"nvme": {"path": str(swap)}}}
    config["optimizer"] = config["optimizer"] | {"state_dtype": state_dtype}
    return config


def _states(engine: Any) -> dict[str, torch.Tensor]:
    """Every unit's stored moments (and master), as bytes, wherever they live."""
    out = {}
    for unit in engine.units:
        for spec in engine.plan.of(unit):
            if spec.kind in (Kind.EXP_AVG, Kind.EXP_AVG_SQ, Kind.MASTER):
                key = SliceKey(unit.name, spec.kind)
                out[str(key)] = engine.store.fetch(key, to=Tier.CPU).wait().clone()
                engine.store.release(key)
    return out


def _train(config: dict[str, Any], steps: range, *, engine: Any = None) -> tuple[list[float], Any]:
    case = Case(stage=config["zero"]["stage"], optimizer="adamw", steps=STEPS, accumulation=1, global_batch=4)
    engine = engine or tierzero.initialize(case.model(), config)
    losses = []
    for step in steps:
        loss = engine(*case.batch(step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine


def _run(config: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    losses, engine = _train(config, range(STEPS))
    with engine:
        params = engine.full_state_dict()
        assert params is not None
        return losses, params, _states(engine)


@pytest.fixture(scope="module")
def on_device(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, str], Any]:
    swap = tmp_path_factory.mktemp("swap")
    return {(s, d): _run(_config(s, d, {}, swap)) for s, d in sorted({(s, d) for s, d, _ in PLACEMENTS})}


@pytest.mark.parametrize(("stage", "dtype", "offload"), PLACEMENTS, ids=[f"stage{s}-{d}-{'-'.join(o.values())}" for s, d, o in PLACEMENTS])
def test_int8_moments_anywhere_give_the_bits_of_the_device(on_device: dict[Any, Any], tmp_path: Path, stage: int, dtype: str, offload: dict[str, str]) -> None:
    losses, params, states = _run(_config(stage, dtype, offload, tmp_path))
    ref_losses, ref_params, ref_states = on_device[(stage, dtype)]
    assert losses == ref_losses
    assert [n for n in ref_params if not torch.equal(params[n], ref_params[n])] == []
    assert [k for k in ref_states if not torch.equal(states[k], ref_states[k])] == []
    assert all(t.dtype == torch.uint8 for k, t in states.items() if "exp_avg" in k)


def test_bf16_moments_on_nvme_give_the_bits_of_the_device(tmp_path: Path) -> None:
    offload = {"params": "nvme", "optimizer": "nvme"}
    nvme, device = (_run(_config(3, "bf16", o, tmp_path, "bf16")) for o in (offload, {}))
    assert nvme[0] == device[0] and all(torch.equal(nvme[2][k], device[2][k]) for k in device[2])
    assert nvme[2]["root/exp_avg"].dtype == torch.bfloat16


def test_the_bytes_are_the_layouts(tmp_path: Path) -> None:
    config = _config(3, "bf16", {"params": "nvme", "optimizer": "nvme"}, tmp_path)
    with tierzero.initialize(Case(stage=3, optimizer="adamw").model(), config) as engine:
        shards = {unit.name: unit.shard_numel for unit in engine.units}
        for unit in engine.units:
            spec = engine.plan.spec(unit.name, Kind.EXP_AVG)
            assert (spec.numel, spec.dtype, spec.nbytes) == (shards[unit.name] + 4 * shards[unit.name] // BLOCK, torch.uint8, spec.numel)
        total = sum(shards.values())
        kinds = engine.memory_report()["kinds"]
        assert kinds["exp_avg"] == kinds["exp_avg_sq"] == total + 4 * total // BLOCK
        assert kinds["master"] == 4 * total
        # the swap file: each unit's bf16 param, fp32 master and two int8 moments, each I/O-aligned
        swap = sum(align_up(2 * s) + align_up(4 * s) + 2 * align_up(s + 4 * s // BLOCK) for s in shards.values())
        assert engine.plan.home_bytes(Tier.NVME) == swap
    # `tierzero estimate` (its own built-in model): the same layout, from the same plan
    fp32 = estimate(load_config(_config(3, "bf16", {"params": "nvme", "optimizer": "nvme"}, tmp_path, "fp32")))
    int8 = estimate(load_config(config))
    parameters = fp32.tiers[Tier.NVME].homes[Kind.EXP_AVG] // 4
    assert parameters % BLOCK == 0 and int8.tiers[Tier.NVME].homes[Kind.MASTER] == 4 * parameters
    for kind in (Kind.EXP_AVG, Kind.EXP_AVG_SQ):
        assert int8.tiers[Tier.NVME].homes[kind] == parameters + 4 * parameters // BLOCK


def _absmax_offset(path: Path, name: str) -> int:
    """Where tensor `name`'s bytes start in the safetensors file `path`."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return 8 + length + json.loads(raw[8 : 8 + length])[name]["data_offsets"][0]


def test_a_checkpoint_keeps_the_codes_and_absmax_and_resumes_bit_exactly(tmp_path: Path) -> None:
    saved_at = _config(3, "bf16", {"params": "nvme", "optimizer": "nvme"}, tmp_path)
    first, engine = _train(saved_at, range(2))
    with engine:
        directory = save_checkpoint(engine, tmp_path / "ckpt")
        states = _states(engine)
        rest, _ = _train(saved_at, range(2, STEPS), engine=engine)
        params = engine.full_state_dict()
    kinds = json.loads((directory / "manifest.json").read_text())["units"][0]["kinds"]
    assert kinds["exp_avg"] == "uint8" and kinds["exp_avg.absmax"] == "float32"
    resumed = _config(3, "bf16", {"optimizer": "cpu"}, tmp_path)  # another placement: the bytes move, never change
    case = Case(stage=3, optimizer="adamw", steps=STEPS, accumulation=1, global_batch=4)
    with tierzero.initialize(case.model(), resumed) as engine:
        load_checkpoint(engine, directory)
        loaded = _states(engine)
        assert [k for k in states if not torch.equal(states[k], loaded[k])] == []
        again, _ = _train(resumed, range(2, STEPS), engine=engine)
        assert again == rest
        assert all(torch.equal(t, params[n]) for n, t in engine.full_state_dict().items())
    for state_dtype in ("fp32", "bf16"):
        with tierzero.initialize(case.model(), _config(3, "bf16", {}, tmp_path, state_dtype)) as engine:
            with pytest.raises(CheckpointError) as info:
                load_checkpoint(engine, directory)
            message = str(info.value)
            assert "\n" not in message and f"this run's are {state_dtype}: resume with optimizer.state_dtype: int8" in message


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_a_corrupted_absmax_is_refused_in_one_line(tmp_path: Path, bad: float) -> None:
    config = _config(3, "bf16", {}, tmp_path)
    _, engine = _train(config, range(1))
    with engine:
        directory = save_checkpoint(engine, tmp_path / "ckpt")
        name = "blocks.1/exp_avg_sq.absmax"
        rank_file = directory / "rank-00000.safetensors"
        data = bytearray(rank_file.read_bytes())
        at = _absmax_offset(rank_file, name)
        data[at : at + 4] = struct.pack("<f", bad)
        rank_file.write_bytes(bytes(data))
        _resign(directory)  # the checksums vouch for it: the loader's own check must refuse it
        with pytest.raises(CheckpointError) as info:
            load_checkpoint(engine, directory)
    message = str(info.value)
    assert "\n" not in message and str(directory) in message and f"{name} holds {bad!r} at block 0" in message


def test_hostile_int8_checkpoints_load_or_are_refused_in_one_line(tmp_path: Path) -> None:
    """The checkpoint fuzz corpus's mutations, on a checkpoint of int8 moments, and absmax flipped bit by bit."""
    import random
    import shutil

    from test_checkpoint_fuzz import MUTATIONS, SEED, _outcome

    config = _config(3, "bf16", {}, tmp_path)
    _, engine = _train(config, range(1))
    refused = 0
    with engine:
        saved = save_checkpoint(engine, tmp_path / "source")
        for i in range(120):
            rng = random.Random(SEED + 7919 + i)
            step_dir = tmp_path / f"case-{i}" / "1"
            shutil.copytree(saved, step_dir)
            if i % 3:
                mutation = rng.choice(MUTATIONS)
                case = f"case {i} ({mutation.__name__}: {mutation(step_dir, rng)})"
            else:  # one absmax byte flipped, re-signed: refused where it is no absmax any more, else loaded
                rank_file = step_dir / "rank-00000.safetensors"
                data = bytearray(rank_file.read_bytes())
                at = _absmax_offset(rank_file, rng.choice(["root", "blocks.0", "blocks.2"]) + "/exp_avg.absmax") + rng.randrange(4)
                data[at] ^= 1 << rng.randrange(8)
                rank_file.write_bytes(bytes(data))
                case = f"case {i} (absmax byte {at} flipped)"
            if rng.random() < 0.9:
                _resign(step_dir)
            refused += _outcome(lambda d=step_dir: load_checkpoint(engine, d), where=step_dir, case=case) != "ok"
            shutil.rmtree(step_dir.parent)
    assert refused >= 60, refused


# ---- `tierzero bench moments`: the loss beside fp32 moments' -------------------------------------


def test_bench_moments_trains_each_state_dtype_from_the_same_weights_and_batches() -> None:
    from tierzero.cli.bench.moments import bench_moments

    result = bench_moments(preset="tiny", steps=6, every=3, batch=2, seq_len=32, dtypes=("int8", "bf16"))
    fp32, int8 = result.losses["fp32"], result.losses["int8"]
    assert list(result.losses) == ["fp32", "int8", "bf16"] and len(fp32) == 6
    # step 1's loss is before any update; step 2's follows an update from fresh fp32 moments, the same in all
    assert all(losses[:2] == fp32[:2] for losses in result.losses.values())
    assert all(a != b for a, b in zip(int8[2:], fp32[2:], strict=True))  # from step 3 the int8 codes are read back
    assert result.rel_diff("int8") == pytest.approx(sum(int8) / sum(fp32) - 1, rel=1e-9)  # the mean of all 6 (< 20)
    assert 0 < abs(result.rel_diff("int8")) < 1e-3 and result.met()
    lines = result.format().splitlines()
    assert [line.split()[0] for line in lines[2:4]] == ["3", "6"] and lines[4].split()[:2] == ["last", "6"]
    assert lines[-1] == "target: the mean of the last 6 steps within 1% of fp32 moments': True"
    with pytest.raises(ValueError, match="bench moments needs steps >= 1 and a multiple of every >= 1; got 5, 2"):
        bench_moments(steps=5, every=2)
