"""A forward without gradients reads its units' slices ahead, in the order the no-grad forwards before it ran.

[Note: reading ahead without grad] in tierzero/stages/param_prefetch.py: the first no-grad forward
learns its own order, the later ones follow it, and the training steps' order stays theirs.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

import tierzero
from tierzero.common.slices import Kind
from tierzero.models.builtin import GPT, ModelSpec
from tierzero.prefetch import Mode, Phase, UnitEvent

SPEC = ModelSpec(vocab_size=64, n_layer=4, n_head=2, d_model=32, d_ff=64, max_seq_len=64)
BLOCKS = [f"blocks.{i}" for i in range(SPEC.n_layer)]


def wide_gpt(spec: ModelSpec = SPEC) -> GPT:
    """Wide random weights: greedy decoding wanders over many tokens, so equal tokens say something."""
    torch.manual_seed(0)
    model = GPT(spec)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.3)
    return model


def _config(swap: Path, *, params: str = "nvme", prefetch: bool = True) -> dict[str, Any]:
    config: dict[str, Any] = {"zero": {"stage": 3}, "offload": {"params": params}, "tiers": {"nvme": {"path": str(swap)}}}
    if not prefetch:
        config["prefetch"] = {"bytes": 0}
    return config


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(0, SPEC.vocab_size, (3, 10), generator=torch.Generator().manual_seed(seed))


def _record(engine: Any, events: list[tuple[str, str]]) -> None:
    """Log each read of a PARAM slice and each unit's forward end, in order."""
    stage, store = engine.stage, engine.store
    post_forward, fetch = stage.post_forward, store.fetch

    def ended(unit: Any, output: Any) -> None:
        post_forward(unit, output)
        events.append(("end", unit.name))

    def fetched(key: Any, **kwargs: Any) -> Any:
        if key.kind is Kind.PARAM:
            events.append(("read", key.unit))
        return fetch(key, **kwargs)

    stage.post_forward = ended  # type: ignore[method-assign]
    store.fetch = fetched  # type: ignore[method-assign]


def test_a_no_grad_forward_reads_the_next_unit_before_the_current_one_ends(tmp_path: Path) -> None:
    first: list[tuple[str, str]] = []
    later: list[tuple[str, str]] = []
    with tierzero.initialize(wide_gpt(), _config(tmp_path)) as engine, torch.no_grad():
        _record(engine, first)
        engine(_ids(0))  # learns the order, on demand
        learned = engine.param_prefetch.last_read_report
        first_copy = list(first)
        _record(engine, later)
        engine(_ids(1))
        report = engine.param_prefetch.last_read_report
        order = engine.param_prefetch.reading.order
        assert engine.prefetch_report() is None  # no training step has run
    assert order == tuple(UnitEvent(unit, Phase.FORWARD) for unit in ["root", *BLOCKS])
    # on demand: each block is read only once the one before it has ended
    for k in range(len(BLOCKS) - 1):
        assert first_copy.index(("end", BLOCKS[k])) < first_copy.index(("read", BLOCKS[k + 1]))
    # following: block k+1's read is issued while block k computes (or earlier)
    for k in range(len(BLOCKS) - 1):
        assert later.index(("read", BLOCKS[k + 1])) < later.index(("end", BLOCKS[k])), later
    assert later.count(("read", "blocks.1")) == 1  # read once, taken by its gather
    assert learned.mode is Mode.LEARNING and report.mode is Mode.FOLLOWING
    assert report.events == len(order) == report.hits + report.misses
    # every unit's slice read ahead once (the root's as the forward opens), none left unused
    assert report.issued_bytes == sum(engine.param_prefetch.policy.unit_bytes.values()) and report.unused == ()


def test_the_bits_are_those_of_reads_on_demand_and_of_weights_on_the_device(tmp_path: Path) -> None:
    ids = _ids(2)
    outputs, tokens = {}, {}
    for name, config in {
        "ahead": _config(tmp_path),
        "on demand": _config(tmp_path, prefetch=False),
        "device": _config(tmp_path, params="device"),
    }.items():
        with tierzero.initialize(wide_gpt(), config) as engine:
            with torch.no_grad():
                outputs[name] = [engine(ids) for _ in range(3)]
            tokens[name] = engine.generate(ids, max_new_tokens=12)
            if name == "ahead":
                assert engine.param_prefetch.last_read_report.mode is Mode.FOLLOWING
                assert engine.param_prefetch.last_read_report.issued_bytes > 0
    for name in ("on demand", "device"):
        assert all(torch.equal(a, b) for a, b in zip(outputs["ahead"], outputs[name], strict=True)), name
        assert torch.equal(tokens["ahead"], tokens[name]), name
    assert len(set(tokens["ahead"][:, 10:].flatten().tolist())) > 3


def test_evaluation_between_training_steps_leaves_the_training_order_alone(tmp_path: Path) -> None:
    model = wide_gpt()
    ids = _ids(3)
    losses: dict[str, list[torch.Tensor]] = {"eval": [], "plain": []}
    for name in losses:
        with tierzero.initialize(copy.deepcopy(model), _config(tmp_path) | {"optimizer": {"type": "adamw", "lr": 1e-2}}) as engine:
            modes = []
            for step in range(4):
                loss = torch.nn.functional.cross_entropy(engine(ids).flatten(0, 1), ids.roll(-1, 1).flatten())
                engine.backward(loss)
                engine.step()
                modes.append(engine.prefetch_report().mode)
                losses[name].append(loss.detach())
                if name == "eval":
                    with torch.no_grad():
                        engine(_ids(10 + step))
            assert modes == [Mode.LEARNING] + [Mode.FOLLOWING] * 3, modes
            if name == "eval":
                assert engine.param_prefetch.last_read_report.mode is Mode.FOLLOWING
    assert all(torch.equal(a, b) for a, b in zip(losses["eval"], losses["plain"], strict=True))


def test_a_no_grad_forward_that_raises_teaches_nothing_and_the_next_one_runs(tmp_path: Path) -> None:
    with tierzero.initialize(wide_gpt(), _config(tmp_path)) as engine, torch.no_grad():
        engine(_ids(4))
        expected = engine(_ids(5))
        try:
            engine(torch.full((1, 3), SPEC.vocab_size))  # an id past the embedding: raises in the root's forward
        except IndexError:
            pass
        assert engine.param_prefetch.policy is engine.param_prefetch.training
        assert torch.equal(engine(_ids(5)), expected)
        assert engine.param_prefetch.last_read_report.mode is Mode.FOLLOWING
