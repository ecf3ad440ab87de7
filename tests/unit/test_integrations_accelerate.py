"""An Accelerate script with one line changed (`TierzeroAccelerator(config)` for `Accelerator()`,
tierzero/integrations/accelerate.py) against the same engine config driven by hand: the same
weights and losses bit for bit, the rate and gradient norm the engine's, `save_state`/`load_state`
bit-exact, and what disagrees with the config refused in one line."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

import tierzero

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
integration = pytest.importorskip("tierzero.integrations.accelerate")

VOCAB, GA, LR, WARMUP, TOTAL = 64, 2, 1e-2, 1, 4
CONFIG = {"zero": {"stage": 3}, "optimizer": {"type": "adamw", "lr": LR}, "gradient_clipping": 0.5, "gradient_accumulation_steps": GA}


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Iterator[None]:
    """Accelerate keeps its process state in singletons: each test starts from none."""
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    yield
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)


def _gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _loader() -> DataLoader:
    rows = [torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(k)) for k in range(16)]
    return DataLoader(rows, batch_size=2)


def _schedule(optimizer: torch.optim.Optimizer) -> Any:
    return transformers.get_linear_schedule_with_warmup(optimizer, WARMUP, TOTAL)


def _script(accelerator: Any, batches: Any, model: Any, optimizer: Any, scheduler: Any) -> list[tuple[float, ...]]:
    """The training loop of an Accelerate script, as its docs write it: (loss, rate, norm) each micro-batch."""
    seen = []
    for x in batches:
        with accelerator.accumulate(model):
            loss = model(input_ids=x, labels=x).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            rate = optimizer.param_groups[0]["lr"]
            scheduler.step()
            optimizer.zero_grad()
        seen.append((loss.item(), rate, accelerator.engine.grad_norm if accelerator.sync_gradients else None))
    return seen


def _prepared(**kwargs: Any) -> tuple[Any, ...]:
    accelerator = integration.TierzeroAccelerator(CONFIG, cpu=True, gradient_accumulation_steps=GA, **kwargs)
    model = _gpt2()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    return accelerator, *accelerator.prepare(model, optimizer, _loader(), _schedule(optimizer))


def _by_hand(engine: Any, batches: Any) -> list[tuple[float, ...]]:
    seen = []
    for k, x in enumerate(batches):
        rate = engine.lr
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        seen.append((loss.item(), rate, engine.grad_norm if (k + 1) % GA == 0 else None))
    return seen


def _reference() -> Any:
    """The same config with the script's schedule, the engine driven by hand."""
    scratch = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LR)
    return tierzero.initialize(_gpt2(), CONFIG, lr_lambda=_schedule(scratch).lr_lambdas[0])


def test_a_script_with_one_line_changed_trains_as_the_engines_own_loop() -> None:
    accelerator, model, optimizer, loader, scheduler = _prepared()
    with accelerator.engine:
        assert list(accelerator.unwrap_model(model).parameters()) == []
        seen = _script(accelerator, loader, model, optimizer, scheduler)
        trained = accelerator.get_state_dict(model)
    with _reference() as engine:
        assert seen == _by_hand(engine, list(_loader()))
        expected = engine.full_state_dict()
    assert trained.keys() == expected.keys() and all(torch.equal(trained[n], expected[n]) for n in trained)
    assert len({rate for _, rate, _ in seen}) > 2  # warm-up, then linear decay: the script's schedule steps the engine


def test_save_state_then_load_state_resumes_bit_exactly(tmp_path: Path) -> None:
    accelerator, model, optimizer, loader, scheduler = _prepared()
    batches = list(loader)
    with accelerator.engine:
        _script(accelerator, batches[:4], model, optimizer, scheduler)
        accelerator.save_state(str(tmp_path / "state"))
        rest = _script(accelerator, batches[4:], model, optimizer, scheduler)
        expected = accelerator.get_state_dict(model)
    assert (tmp_path / "state" / integration.CHECKPOINT_DIR / "2" / "manifest.json").is_file()

    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerator, model, optimizer, _, scheduler = _prepared()
    with accelerator.engine:
        accelerator.load_state(str(tmp_path / "state"))
        assert accelerator.engine.global_step == 2
        assert _script(accelerator, batches[4:], model, optimizer, scheduler) == rest
        resumed = accelerator.get_state_dict(model)
    assert all(torch.equal(resumed[n], expected[n]) for n in expected)


def test_what_disagrees_with_the_config_is_refused_in_one_line() -> None:
    with pytest.raises(ValueError) as raised:
        integration.TierzeroAccelerator(CONFIG, cpu=True, mixed_precision="bf16")
    assert str(raised.value).startswith("TierzeroAccelerator(mixed_precision='bf16'): the engine's precision is its config's")

    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    accelerator = integration.TierzeroAccelerator(CONFIG, cpu=True)
    model = _gpt2()
    with pytest.raises(ValueError) as raised:
        accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    assert str(raised.value) == (
        "the optimizer's learning rate [0.0003] is not the tierzero config's optimizer.lr 0.01: the engine's optimizer "
        "replaces it and steps by its config; set optimizer.lr there"
    )
    assert accelerator.engine is None and len(list(model.parameters())) > 0  # refused before the engine took the model

    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    with accelerator.engine:
        with pytest.raises(ValueError) as raised:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
        assert str(raised.value) == (
            "clip_grad_norm_(max_norm=1.0, norm_type=2) but the tierzero config's gradient_clipping is 0.5 (an L2 norm): "
            "the engine clips at its step; set gradient_clipping: 1.0 in the config"
        )
        with pytest.raises(ValueError, match="a TierzeroAccelerator trains one model"):
            accelerator.prepare(_gpt2())
