"""`optimizer.type: torch:<class>`, `lion` and `adafactor`: one torch.optim instance per unit, the bits of the whole model.

The reference is the class itself (or Lion as written here from the paper) on the plain,
unsharded model, with the engine's default groups (no weight decay on biases and norms),
unclipped: the engine sums the gradient norm in its own order, an ulp off torch's at times,
which only rules whose update is not a sign (RAdam, Adafactor) would show. At one rank every
shard holds whole tensors, so even Adafactor's factored second moment matches ([Note: a
torch.optim class per unit]).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import tierzero
from tierzero.checkpoint import load_checkpoint, save_checkpoint
from tierzero.config import ConfigError, load_config
from tierzero.estimate import estimate
from tierzero.optim.flat import make_optimizer
from tierzero.optim.torch_opt import Lion

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
from harness import Case, decay_groups, run_ranks  # noqa: E402 (after the path)

STEPS = 4
LR, WD = 3e-3, 0.05


class RefLion(torch.optim.Optimizer):
    """Lion, Chen et al. 2023, Algorithm 2, written again from the paper: c = b1 m + (1 - b1) g,
    p <- p (1 - lr wd) - lr sign(c), m <- b2 m + (1 - b2) g (each a torch op, rounded once)."""

    def __init__(self, params: Any, lr: float, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                m = self.state[p].setdefault("m", torch.zeros_like(p))
                c = m.mul(b1).add(p.grad, alpha=1 - b1)
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(torch.sign(c), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


TYPES: dict[str, tuple[str, type[torch.optim.Optimizer], dict[str, Any]]] = {
    "radam": ("torch:torch.optim.RAdam", torch.optim.RAdam, {"betas": (0.8, 0.99)}),
    "lion": ("lion", RefLion, {"betas": (0.9, 0.95)}),
    "adafactor": ("adafactor", torch.optim.Adafactor, {"beta2_decay": -0.7}),
}


def _config(stage: int, name: str, **extra: Any) -> dict[str, Any]:
    kind, _, kwargs = TYPES[name]
    config = Case(stage=stage, optimizer="adamw", steps=STEPS, accumulation=1, global_batch=4, clip=0.0).config()
    listed = {k: list(v) if isinstance(v, tuple) else v for k, v in kwargs.items()}
    config["optimizer"] = {"type": kind, "lr": LR, "weight_decay": WD, "kwargs": listed}
    return config | extra


def _reference(name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    _, cls, kwargs = TYPES[name]
    case = Case(stage=1, optimizer="adamw", steps=STEPS, accumulation=1, global_batch=4)
    model = case.model()
    opt = cls(decay_groups(model, WD), lr=LR, **kwargs)
    losses = []
    for step in range(STEPS):
        loss = case.loss(model, *case.batch(step))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(config: dict[str, Any], steps: range, *, engine: Any = None, rank: int = 0, world: int = 1) -> tuple[list[float], Any]:
    case = Case(stage=config["zero"]["stage"], optimizer="adamw", steps=STEPS, accumulation=1, global_batch=4)
    engine = engine or tierzero.initialize(case.model(), config)
    losses = []
    for step in steps:
        loss = case.loss(engine, *case.micro_batch(step, micro=0, rank=rank, world_size=world))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine


@pytest.mark.parametrize("name", sorted(TYPES))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_one_instance_per_unit_gives_the_bits_of_the_class_on_the_whole_model(name: str, stage: int) -> None:
    ref_losses, ref_params = _reference(name)
    losses, engine = _train(_config(stage, name), range(STEPS))
    with engine:
        params = engine.full_state_dict()
    assert losses == ref_losses
    assert [n for n in ref_params if not torch.equal(params[n], ref_params[n])] == []


def test_states_on_the_host_give_the_same_bits() -> None:
    ref_losses, ref_params = _reference("lion")
    losses, engine = _train(_config(3, "lion", offload={"params": "cpu", "optimizer": "cpu"}), range(STEPS))
    with engine:
        params = engine.full_state_dict()
    assert losses == ref_losses
    assert [n for n in ref_params if not torch.equal(params[n], ref_params[n])] == []


def test_lion_here_is_the_papers() -> None:
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(300, generator=gen), torch.randn(300, generator=gen)
    ours, ref = torch.nn.Parameter(a.clone()), torch.nn.Parameter(a.clone())
    o, r = Lion([ours], lr=0.01, betas=(0.8, 0.9), weight_decay=0.1), RefLion([ref], lr=0.01, betas=(0.8, 0.9), weight_decay=0.1)
    for step in range(5):
        ours.grad, ref.grad = b * (step + 1), b * (step + 1)
        o.step()
        r.step()
    assert torch.equal(ours, ref) and torch.equal(o.state[ours]["exp_avg"], r.state[ref]["m"])


@pytest.mark.parametrize("name", ["adafactor", "radam"])
def test_a_checkpoint_keeps_the_states_and_resumes_bit_exactly(tmp_path: Path, name: str) -> None:
    config = _config(2, name)
    straight, engine = _train(config, range(STEPS))
    with engine:
        expected = engine.full_state_dict()
    first, engine = _train(config, range(2))
    with engine:
        save_checkpoint(engine, tmp_path)
    case = Case(stage=2, optimizer="adamw", steps=STEPS, accumulation=1, global_batch=4)
    with tierzero.initialize(case.model(), config) as resumed:
        load_checkpoint(resumed, tmp_path)
        rest, resumed = _train(config, range(2, STEPS), engine=resumed)
        params = resumed.full_state_dict()
    assert first + rest == straight
    assert [n for n in expected if not torch.equal(params[n], expected[n])] == []


def _ranks_job(rank: int, world_size: int, payload: tuple[int, str]) -> Any:
    stage, name = payload
    _, engine = _train(_config(stage, name), range(STEPS), rank=rank, world=world_size)
    with engine:
        return engine.full_state_dict()


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_give_the_bits_of_one(stage: int) -> None:
    """Lion is elementwise, and its update a sign: a tensor cut between two ranks, its gradient the mean
    of two half batches' (an ulp off the whole batch's at times), steps to the bits of the whole."""
    _, ref_params = _reference("lion")
    params = run_ranks(_ranks_job, world_size=2, payload=(stage, "lion"))[0]
    assert [n for n in ref_params if not torch.equal(params[n], ref_params[n])] == []


@pytest.mark.parametrize(
    ("optimizer", "key", "says"),
    [
        ({"type": "torch:torch.optim.NoSuch"}, "optimizer.type", "cannot be imported (AttributeError"),
        ({"type": "torch:nosuchpkg.Opt"}, "optimizer.type", "cannot be imported (ModuleNotFoundError"),
        ({"type": "torch:torch.nn.Linear"}, "optimizer.type", "not a torch.optim.Optimizer subclass"),
        ({"type": "lion", "kwargs": {"betaz": [0.9, 0.9]}}, "optimizer.kwargs", "refused by Lion"),
        ({"type": "torch:torch.optim.RAdam", "kwargs": {"lr": 0.1}}, "optimizer.kwargs", "sets lr, which the engine passes"),
    ],
)
def test_bad_classes_and_kwargs_are_refused_in_one_line(optimizer: dict[str, Any], key: str, says: str) -> None:
    with pytest.raises(ValueError) as err:
        make_optimizer(load_config({"optimizer": optimizer}).optimizer)
    message = str(err.value)
    assert message.startswith(key) and says in message and "\n" not in message, message


def test_states_on_nvme_and_compact_moments_are_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^offload.optimizer is nvme but optimizer.type lion keeps its states"):
        load_config({"zero": {"stage": 2}, "optimizer": {"type": "lion"}, "offload": {"optimizer": "nvme"},
                     "tiers": {"nvme": {"path": str(tmp_path)}}})  # fmt: skip
    with pytest.raises(ConfigError, match=r"optimizer.state_dtype int8 stores Adam's moments, and optimizer.type adafactor"):
        load_config({"optimizer": {"type": "adafactor", "state_dtype": "int8"}})
    with pytest.raises(ConfigError, match=r"optimizer.kwargs is set but optimizer.type adamw"):
        load_config({"optimizer": {"type": "adamw", "kwargs": {"foreach": False}}})


def test_the_estimate_runs_a_class_that_reads_values() -> None:
    """The estimate's dry run steps on meta tensors, where Adafactor's `.item()` cannot run: it counts the
    step's slices without running the class."""
    plans = {kind: estimate(load_config(_config(3, kind))) for kind in ("adafactor", "lion")}
    assert plans["adafactor"].parameters == plans["lion"].parameters > 0
