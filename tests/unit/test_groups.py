"""Parameter groups: no weight decay on biases and norms by default, name patterns, lr multipliers;
bitwise torch.optim.AdamW with the same groups and LambdaLR at world size 1."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import tierzero
from tierzero.config import ConfigError, load_config
from tierzero.optim.groups import GroupRules
from tierzero.units.unit import plan_units

transformers = pytest.importorskip("transformers")


class RMSNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 3 * width)
        self.down = nn.Linear(3 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(40, 24)
        self.blocks = nn.ModuleList(Block(24) for _ in range(2))
        self.final = RMSNorm(24)
        self.head = nn.Linear(24, 40)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(self.final(x)).flatten(0, 1), tokens.flatten())


BASE, DECAY, STEPS = 1e-2, 0.1, 6


def _torch_groups(model: nn.Module) -> list[dict[str, Any]]:
    """The groups a careful torch user writes: the Trainer's rule (no decay on biases and norm
    weights) and a tenth of the learning rate on the embedding."""
    norms = {id(p) for m in model.modules() if isinstance(m, (nn.LayerNorm, RMSNorm)) for p in m.parameters()}
    groups: dict[tuple[float, float], list[nn.Parameter]] = {}
    for name, p in model.named_parameters():
        decay = 0.0 if name.endswith("bias") or id(p) in norms else DECAY
        lr = BASE * 0.1 if name.startswith("embed") else BASE
        groups.setdefault((lr, decay), []).append(p)
    return [{"params": ps, "lr": lr, "weight_decay": wd} for (lr, wd), ps in groups.items()]


@pytest.mark.parametrize("stage", [1, 3])
def test_groups_step_bitwise_as_adamw_with_the_same_groups_and_lambdalr(stage: int) -> None:
    reference = Model()
    optimizer = torch.optim.AdamW(_torch_groups(reference), lr=BASE, fused=True)
    scheduler = transformers.get_cosine_schedule_with_warmup(optimizer, 2, STEPS)
    cfg = {
        "zero": {"stage": stage},
        "optimizer": {"type": "adamw", "lr": BASE, "weight_decay": DECAY, "lr_multipliers": {"embed.*": 0.1}},
        "scheduler": {"type": "cosine", "warmup_steps": 2, "total_steps": STEPS},
    }
    with tierzero.initialize(Model(), cfg) as engine:
        assert len(engine.stage.optimizer.groups) == 3  # decay, no decay, and the embedding (decays) at lr/10
        for k in range(STEPS):
            tokens = torch.randint(0, 40, (3, 7), generator=torch.Generator().manual_seed(k))
            engine.backward(engine(tokens))
            engine.step()
            reference(tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        state = engine.full_state_dict()
    for name, value in reference.state_dict().items():
        assert torch.equal(state[name], value), name


def test_default_rules_exempt_biases_and_norm_weights_and_can_be_turned_off() -> None:
    cfg = load_config({"zero": {"stage": 3}, "optimizer": {"weight_decay": 0.1}})
    rules = GroupRules.from_config(cfg.optimizer)
    units = plan_units(Model(), world_size=1, group_of=rules.group_of)
    decay = {s.name: rules.groups[s.group].weight_decay for u in units for s in u.slots}
    assert {n for n, wd in decay.items() if wd == 0.0} == {
        "blocks.0.norm.weight", "blocks.0.norm.bias", "blocks.0.up.bias", "blocks.0.down.bias",
        "blocks.1.norm.weight", "blocks.1.norm.bias", "blocks.1.up.bias", "blocks.1.down.bias",
        "final.weight", "head.bias",
    }  # fmt: skip
    assert {n for n, wd in decay.items() if wd == 0.1} == {"embed.weight", "blocks.0.up.weight", "blocks.0.down.weight",
                                                         "blocks.1.up.weight", "blocks.1.down.weight", "head.weight"}
    off = load_config({"zero": {"stage": 3}, "optimizer": {"no_decay": [], "no_decay_modules": []}})
    rules = GroupRules.from_config(off.optimizer)
    units = plan_units(Model(), world_size=1, group_of=rules.group_of)
    assert {s.group for u in units for s in u.slots} == {0} and len(rules.groups) == 1


def test_the_first_matching_multiplier_wins_and_bad_rules_name_the_key() -> None:
    rules = GroupRules(lr=1.0, weight_decay=0.0, lr_multipliers={"blocks.0.*": 2.0, "blocks.*": 0.5})
    assert (rules.multiplier("blocks.0.up.weight"), rules.multiplier("blocks.1.up.weight"), rules.multiplier("x")) == (2.0, 0.5, 1.0)
    with pytest.raises(ConfigError, match=r"optimizer.lr_multipliers: expected a mapping of name patterns to non-negative factors"):
        load_config({"zero": {"stage": 3}, "optimizer": {"lr_multipliers": {"embed*": -1}}})
    with pytest.raises(ConfigError, match=r"optimizer.no_decay: expected a list of patterns"):
        load_config({"zero": {"stage": 3}, "optimizer": {"no_decay": "*bias"}})
