"""FlatOptimizer against torch.optim on the un-flattened parameters."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tierzero.common.slices import Kind
from tierzero.optim.flat import (
    FlatAdam,
    FlatSGD,
    OptimizerSpec,
    OptimizerType,
    OptimSlice,
    SliceLayout,
    make_optimizer,
)
from tierzero.units.slice_layout import ParamGroup, adam_pieces, cpu_vector_width

# Sizes chosen so that tensor starts and slice boundaries fall at many offsets modulo
# the 8- and 16-wide vectors, and tails of many lengths occur.
SHAPES = [(37,), (5, 13), (1029,), (7,), (64, 3), (1,), (33, 31), (4096,), (17, 3, 5), (1023,), (120,)]
STEPS = 6


def lr_at(step: int) -> float:
    """A changing learning rate, so that the `lr` argument is exercised."""
    return 1e-2 * (0.8 ** (step - 1))


def make_params() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=g) for s in SHAPES]


def make_grads(step: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(s, generator=g) * 0.1 for s in SHAPES]


def flat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts])


def run_torch(cls: type[torch.optim.Optimizer], **kwargs) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Per-tensor reference: final flat params and flat states (in `state_kinds` order)."""
    params = [torch.nn.Parameter(p.clone()) for p in make_params()]
    opt = cls(params, lr=lr_at(1), **kwargs)
    for step in range(1, STEPS + 1):
        for p, g in zip(params, make_grads(step), strict=True):
            p.grad = g
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.step()
    names = [n for n in ("exp_avg", "exp_avg_sq", "momentum_buffer") if n in opt.state[params[0]]]
    states = [flat([opt.state[p][n] for p in params]) for n in names]
    return flat([p.detach() for p in params]), states


def run_flat(
    opt, *, cuts: list[int], with_layout: bool = True
) -> tuple[torch.Tensor, dict[Kind, torch.Tensor]]:
    """Steps the flattened parameters as slices [cuts[i], cuts[i+1]) of larger padded buffers."""
    pad = 5  # slices are views into a larger buffer, not whole tensors
    master = torch.zeros(pad + flat(make_params()).numel() + pad)
    numel = master.numel() - 2 * pad
    master[pad : pad + numel] = flat(make_params())
    grad_buf = torch.full_like(master, float("nan"))  # padding must never be read
    states = {k: torch.zeros_like(master) for k in opt.state_kinds}
    bounds = [0, *cuts, numel]
    numels = [torch.Size(s).numel() for s in SHAPES]
    for step in range(1, STEPS + 1):
        grad_buf[pad : pad + numel] = flat(make_grads(step))
        slices = [
            OptimSlice(
                param=master[pad + a : pad + b],
                grad=grad_buf[pad + a : pad + b],
                states={k: v[pad + a : pad + b] for k, v in states.items()},
                layout=SliceLayout.of(numels, offset=a) if with_layout else None,
            )
            for a, b in zip(bounds, bounds[1:], strict=False)
        ]
        for s in slices:
            opt.step(param=s.param, grad=s.grad, states=s.states, step=step, lr=lr_at(step), layout=s.layout)
    assert torch.isnan(master[:pad]).sum() == 0 and master[:pad].eq(0).all() and master[-pad:].eq(0).all()
    return master[pad : pad + numel], {k: v[pad : pad + numel] for k, v in states.items()}


def spec(kind: OptimizerType, **kw) -> OptimizerSpec:
    return OptimizerSpec(type=kind, lr=lr_at(1), **kw)


ADAM_CASES = [
    (OptimizerType.ADAMW, torch.optim.AdamW, dict(weight_decay=0.1)),
    (OptimizerType.ADAMW, torch.optim.AdamW, dict(weight_decay=0.0, betas=(0.8, 0.95), eps=1e-6)),
    (OptimizerType.ADAM, torch.optim.Adam, dict(weight_decay=0.05)),
    (OptimizerType.ADAM, torch.optim.Adam, dict(weight_decay=0.0)),
]


@pytest.mark.parametrize(("kind", "cls", "kw"), ADAM_CASES)
def test_adam_bitwise_equal_to_torch_fused(kind, cls, kw) -> None:
    ref_param, ref_states = run_torch(cls, fused=True, **kw)
    total = ref_param.numel()
    # Cut at offsets unrelated to the tensor boundaries: a rank's shard of a unit.
    cuts = [3, 50, 51, 1500, total // 2, total - 17]
    param, states = run_flat(FlatAdam(spec(kind, **kw)), cuts=cuts)
    assert torch.equal(param, ref_param)
    assert torch.equal(states[Kind.EXP_AVG], ref_states[0])
    assert torch.equal(states[Kind.EXP_AVG_SQ], ref_states[1])


@pytest.mark.parametrize(
    ("kind", "cls"), [(OptimizerType.ADAMW, torch.optim.AdamW), (OptimizerType.ADAM, torch.optim.Adam)]
)
def test_adam_without_layout_matches_one_flat_torch_param(kind, cls) -> None:
    flat_param = torch.nn.Parameter(flat(make_params()))
    ref = cls([flat_param], lr=lr_at(1), weight_decay=0.1, fused=True)
    for step in range(1, STEPS + 1):
        flat_param.grad = flat(make_grads(step))
        ref.param_groups[0]["lr"] = lr_at(step)
        ref.step()
    param, states = run_flat(FlatAdam(spec(kind, weight_decay=0.1)), cuts=[], with_layout=False)
    assert torch.equal(param, flat_param.detach())
    assert torch.equal(states[Kind.EXP_AVG_SQ], ref.state[flat_param]["exp_avg_sq"])


@pytest.mark.parametrize("lanes", [8, 16])
def test_adam_pieces_cover_the_slice_once_each_in_its_group(lanes) -> None:
    numels = [37, 65, 1029, 7, 192, 1, 1023, 16, 255]
    groups = [0, 1, 1, 0, 2, 2, 1, 1, 0]
    layout_end = sum(numels)
    starts = [sum(numels[:i]) for i in range(len(numels))]
    for offset, numel in [(0, layout_end), (3, 100), (40, 1100), (1330, 1), (1000, layout_end - 1000 + 9)]:
        layout = SliceLayout.of(numels, offset=offset, groups=groups)
        direct, scratch = adam_pieces(numel, layout, lanes)
        covered = sorted(direct + scratch)
        assert covered[0][0] == 0 and covered[-1][1] == numel
        assert all(a < b and b == c for (a, b, _), (c, _, _) in zip(covered, covered[1:] + [(numel, 0, 0)], strict=True))
        assert all(b - a < lanes for a, b, _ in scratch)
        for a, b, group in covered:
            # every element of a piece is in the piece's group (padding past the tensors: group 0)
            owners = {groups[max(i for i, s0 in enumerate(starts) if s0 <= e)] if e < layout_end else 0 for e in range(offset + a, offset + b)}
            assert owners == {group}


@pytest.mark.parametrize(("kind", "cls", "kw"), ADAM_CASES)
@pytest.mark.parametrize("foreach", [False, True])
def test_adam_close_to_torch_unfused(kind, cls, kw, foreach) -> None:
    ref_param, _ = run_torch(cls, foreach=foreach, **kw)
    param, _ = run_flat(FlatAdam(spec(kind, **kw)), cuts=[100])
    assert not torch.equal(param, flat(make_params())), "the step must move the parameters"
    torch.testing.assert_close(param, ref_param, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("weight_decay", [0.0, 0.01])
@pytest.mark.parametrize("foreach", [False, True])
def test_sgd_bitwise_equal_to_torch(momentum, weight_decay, foreach) -> None:
    ref_param, ref_states = run_torch(torch.optim.SGD, momentum=momentum, weight_decay=weight_decay, foreach=foreach)
    opt = FlatSGD(spec(OptimizerType.SGD, momentum=momentum, weight_decay=weight_decay))
    param, states = run_flat(opt, cuts=[7, 1200, 3000])
    assert torch.equal(param, ref_param)
    if momentum:
        assert torch.equal(states[Kind.EXP_AVG], ref_states[0])


def test_sgd_first_step_ignores_whatever_the_buffer_held() -> None:
    # torch starts the momentum buffer as a copy of the first gradient; a zeroed
    # (or stale) slice must not leak into step 1.
    opt = FlatSGD(spec(OptimizerType.SGD, momentum=0.9))
    param, grad = torch.tensor([1.0, 2.0]), torch.tensor([0.5, -0.25])
    buf = torch.tensor([100.0, 100.0])
    opt.step(param=param, grad=grad, states={Kind.EXP_AVG: buf}, step=1, lr=0.1)
    assert torch.equal(buf, torch.tensor([0.5, -0.25]))
    assert torch.equal(param, torch.tensor([1.0 - 0.1 * 0.5, 2.0 + 0.1 * 0.25]))
    opt.step(param=param, grad=grad, states={Kind.EXP_AVG: buf}, step=2, lr=0.1)
    assert torch.equal(buf, torch.tensor([0.5, -0.25]) * 0.9 + torch.tensor([0.5, -0.25]))


def test_adam_leaves_grad_untouched() -> None:
    opt = FlatAdam(spec(OptimizerType.ADAMW, weight_decay=0.1))
    grad = torch.randn(300)
    before = grad.clone()
    opt.step(param=torch.randn(300), grad=grad, states=opt.new_states(300), step=1, lr=1e-3)
    assert torch.equal(grad, before)


def test_state_kinds() -> None:
    cfg = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, momentum=0.0)
    assert make_optimizer(SimpleNamespace(type="adamw", **cfg)).state_kinds == (Kind.EXP_AVG, Kind.EXP_AVG_SQ)
    assert make_optimizer(SimpleNamespace(type="adam", **cfg)).state_kinds == (Kind.EXP_AVG, Kind.EXP_AVG_SQ)
    assert make_optimizer(SimpleNamespace(type="sgd", **cfg)).state_kinds == ()
    assert make_optimizer(SimpleNamespace(type="sgd", **cfg | {"momentum": 0.9})).state_kinds == (Kind.EXP_AVG,)
    states = make_optimizer(SimpleNamespace(type="adam", **cfg)).new_states(10)
    assert set(states) == {Kind.EXP_AVG, Kind.EXP_AVG_SQ}
    assert all(t.dtype == torch.float32 and t.shape == (10,) and not t.any() for t in states.values())


def test_make_optimizer_reads_config() -> None:
    cfg = SimpleNamespace(type="AdamW", lr=3e-4, betas=[0.9, 0.95], eps=1e-6, weight_decay=0.1, momentum=0.0)
    opt = make_optimizer(cfg)
    assert isinstance(opt, FlatAdam)
    assert opt.spec == OptimizerSpec(
        type=OptimizerType.ADAMW, lr=3e-4, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1, momentum=0.0
    )


def test_make_optimizer_refuses_unknown_type() -> None:
    cfg = SimpleNamespace(type="lamb", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, momentum=0.0)
    with pytest.raises(ValueError, match=r"^optimizer.type must be one of adamw, adam, sgd, got 'lamb'$"):
        make_optimizer(cfg)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (dict(lr=-1.0), r"optimizer.lr must be >= 0, got -1.0"),
        (dict(betas=(0.9, 1.0)), r"optimizer.betas must be two numbers in \[0, 1\), got \(0.9, 1.0\)"),
        (dict(eps=-1e-8), r"optimizer.eps must be >= 0, got -1e-08"),
        (dict(weight_decay=-0.1), r"optimizer.weight_decay must be >= 0, got -0.1"),
        (dict(momentum=float("nan")), r"optimizer.momentum must be >= 0, got nan"),
    ],
)
def test_spec_validation(kw, message) -> None:
    with pytest.raises(ValueError, match=message):
        OptimizerSpec(type=OptimizerType.SGD, **({"lr": 0.1} | kw))


def test_layout_validation() -> None:
    with pytest.raises(ValueError, match=r"got offset -1, tensor_offsets \(0, 4\)"):
        SliceLayout(offset=-1, tensor_offsets=(0, 4))
    assert SliceLayout.of([3, 5], offset=2) == SliceLayout(offset=2, tensor_offsets=(0, 3, 8))


def test_step_refuses_bad_slices() -> None:
    opt = FlatAdam(spec(OptimizerType.ADAM))
    states = opt.new_states(8)
    bf16 = torch.zeros(8, dtype=torch.bfloat16)
    bad_dtype = r"optimizer grad slice must be a contiguous 1-D float32 tensor, got dtype torch.bfloat16, shape \(8,\)"
    with pytest.raises(ValueError, match=bad_dtype):
        opt.step(param=torch.zeros(8), grad=bf16, states=states, step=1, lr=0.1)
    short = states | {Kind.EXP_AVG: torch.zeros(4)}
    with pytest.raises(ValueError, match=r"optimizer exp_avg slice has 4 elements on cpu, param has 8 on cpu"):
        opt.step(param=torch.zeros(8), grad=torch.zeros(8), states=short, step=1, lr=0.1)
    with pytest.raises(ValueError, match=r"missing \['exp_avg_sq'\]"):
        opt.step(param=torch.zeros(8), grad=torch.zeros(8), states={Kind.EXP_AVG: torch.zeros(8)}, step=1, lr=0.1)
    with pytest.raises(ValueError, match=r"optimizer step numbers start at 1, got 0"):
        opt.step(param=torch.zeros(8), grad=torch.zeros(8), states=states, step=0, lr=0.1)
    with pytest.raises(ValueError, match=r"optimizer param slice must be a contiguous 1-D"):
        opt.step(param=torch.zeros(16)[::2], grad=torch.zeros(8), states=states, step=1, lr=0.1)


@pytest.mark.parametrize("split", [1, 3])
def test_adam_benchmark_runs_both_and_agrees(split) -> None:
    from tierzero.cli.bench.adam import bench_cpu_adam

    result = bench_cpu_adam(10_007, steps=3, warmup=1, split=split)
    assert result.identical  # same update as torch.optim.AdamW(fused=True), even split across threads
    assert (len(result.flat_seconds), len(result.torch_seconds), result.split) == (3, 3, split)
    assert result.ratio == pytest.approx(result.flat_params_per_s / result.torch_params_per_s)
    assert "bitwise identical" in result.summary()


def test_cpu_vector_width_matches_the_kernel() -> None:
    # Find inputs whose vector and scalar results differ, then see where the kernel's
    # scalar tail starts in a 47-element tensor: 40 for 8-wide vectors, 32 for 16-wide.
    g = torch.Generator().manual_seed(7)
    n = 2048
    p, grad, m = (torch.randn(n, generator=g) for _ in range(3))
    v = torch.rand(n, generator=g)

    def adamw(*ts: torch.Tensor) -> torch.Tensor:
        ts = tuple(t.clone() for t in ts)
        torch._fused_adamw_(
            [ts[0]], [ts[1]], [ts[2]], [ts[3]], [], [torch.tensor(3.0)],
            lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False,
        )  # fmt: skip
        return torch.stack([ts[0], ts[2], ts[3]])

    vector = adamw(p, grad, m, v)  # 2048 elements: whole vectors only
    scalar = torch.stack([adamw(p[i : i + 1], grad[i : i + 1], m[i : i + 1], v[i : i + 1])[:, 0] for i in range(n)], 1)
    pick = (vector != scalar).any(0).nonzero().flatten()[:47]
    assert len(pick) == 47, "the scalar and vector paths round alike here: nothing to check"
    out = adamw(p[pick], grad[pick], m[pick], v[pick])
    is_scalar = [bool((out[:, i] == scalar[:, pick[i]]).all()) for i in range(47)]
    width = cpu_vector_width()
    assert is_scalar == [i >= 47 - 47 % width for i in range(47)]


@pytest.mark.parametrize(
    "optimizer",
    [
        FlatAdam(OptimizerSpec(type=OptimizerType.ADAMW, lr=1e-3, weight_decay=0.1), [ParamGroup(1e-3, 0.1), ParamGroup(3e-3, 0.0)]),
        FlatSGD(OptimizerSpec(type=OptimizerType.SGD, lr=1e-2, momentum=0.9, weight_decay=0.01), [ParamGroup(1e-2, 0.01), ParamGroup(5e-3, 0.0)]),
    ],
    ids=["adamw", "sgd"],
)
@pytest.mark.parametrize("converting", [False, True], ids=["fp32", "converting"])
def test_a_units_slots_stepped_together_give_the_bits_of_a_step_a_slot(optimizer, converting) -> None:
    """`step_slots` / `step_converting_slots` (gradient pieces, one slot a parameter of two groups, padding
    after them) against `step` / `step_converting` of each slot alone, with a clip scale, three steps."""
    if converting and not optimizer.converts_gradients:
        pytest.skip("SGD steps fp32 gradients only")
    numels, groups = [37, 1029, 7, 4096, 1], [0, 1, 0, 1, 1]
    offsets = [sum(numels[:i]) for i in range(len(numels))]
    n = sum(numels) + 13
    gen = torch.Generator().manual_seed(4)
    start = torch.randn(n, generator=gen)
    runs = [(start.clone(), optimizer.new_states(n)) for _ in range(2)]
    for step in (1, 2, 3):
        grads = [torch.randn(k, generator=gen).to(torch.bfloat16 if converting else torch.float32) for k in numels]
        (together, states), (alone, alone_states) = runs
        slots = [(o, g.clone(), group) for o, g, group in zip(offsets, grads, groups, strict=True)]
        if converting:
            optimizer.step_converting_slots(param=together, grads=slots, scale=0.37, states=states, step=step, lr=[1e-3, 3e-3])
        else:
            optimizer.step_slots(param=together, grads=slots, scale=0.37, states=states, step=step, lr=[1e-2, 5e-3])
        for offset, grad, group in zip(offsets, grads, groups, strict=True):
            part = slice(offset, offset + grad.numel())
            layout = SliceLayout.of([grad.numel()], groups=[group])
            one = {kind: state[part] for kind, state in alone_states.items()}
            if converting:
                optimizer.step_converting(param=alone[part], grad=grad, scale=0.37, states=one, step=step, lr=[1e-3, 3e-3], layout=layout)
            else:
                optimizer.step(param=alone[part], grad=grad.mul(0.37), states=one, step=step, lr=[1e-2, 5e-3], layout=layout)
    (together, states), (alone, alone_states) = runs
    assert torch.equal(together.view(torch.int32), alone.view(torch.int32))
    assert all(torch.equal(states[k].view(torch.int32), alone_states[k].view(torch.int32)) for k in states)
    assert torch.equal(together[-13:], start[-13:]) and not torch.equal(together, start)
