"""The built-in GPT and Llama, build_model from a config section, meta construction."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from tierzero.models.builtin import (
    GPT,
    PRESETS,
    Llama,
    ModelSpec,
    apply_rotary,
    build_model,
    count_parameters,
    materialize,
    rotary_tables,
)
from tierzero.units.unit import plan_units

TINY = PRESETS["tiny"]
MODELS = [GPT, Llama]


def _model_cfg(kind: str, spec: ModelSpec = TINY, **extra: Any) -> SimpleNamespace:
    fields = ("vocab_size", "n_layer", "n_head", "d_model", "d_ff", "max_seq_len", "dropout")
    return SimpleNamespace(type=kind, **{name: getattr(spec, name) for name in fields}, **extra)


def _tokens(seed: int, shape: tuple[int, int] = (4, 32)) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cls", MODELS)
def test_forward_shapes_and_loss_at_init_is_uniform(cls: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = cls(TINY)
    idx, targets = _tokens(1), _tokens(2)
    logits = model(idx)
    assert logits.shape == (4, 32, 256)
    logits2, loss = model(idx, targets)
    torch.testing.assert_close(logits2, logits, rtol=0, atol=0)
    # Small random init: the prediction is near uniform over 256 bytes.
    assert loss.item() == pytest.approx(math.log(256), abs=0.05)
    assert loss.item() == pytest.approx(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).item())


@pytest.mark.parametrize("cls", MODELS)
def test_backward_reaches_every_parameter(cls: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = cls(TINY)
    _, loss = model(_tokens(1), _tokens(2))
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.shape == p.shape, name
        assert torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("cls", MODELS)
def test_attention_is_causal(cls: type[nn.Module]) -> None:
    torch.manual_seed(0)
    model = cls(TINY).eval()
    idx = _tokens(3, (1, 24))
    changed = idx.clone()
    changed[0, 16:] = (changed[0, 16:] + 1) % 256
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :16], b[:, :16], rtol=0, atol=0)
    assert not torch.allclose(a[:, 16:], b[:, 16:])


def test_gpt_head_is_tied_to_the_embedding_as_one_parameter() -> None:
    model = GPT(TINY)
    assert model.lm_head.weight is model.tok_emb.weight
    names = [name for name, _ in model.named_parameters()]
    assert "lm_head.weight" not in names and "tok_emb.weight" in names
    d, f, v, t, n = TINY.d_model, TINY.d_ff, TINY.vocab_size, TINY.max_seq_len, TINY.n_layer
    per_block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
    assert count_parameters(model) == v * d + t * d + n * per_block + 2 * d


def test_llama_head_is_untied_and_counted() -> None:
    model = Llama(TINY)
    assert model.lm_head.weight is not model.tok_emb.weight
    d, f, v, n = TINY.d_model, TINY.d_ff, TINY.vocab_size, TINY.n_layer
    per_block = 2 * d + 4 * d * d + 3 * d * f
    assert count_parameters(model) == 2 * v * d + n * per_block + d
    assert not any("rope" in name for name in model.state_dict())


@pytest.mark.parametrize("cls", MODELS)
def test_engine_cuts_one_unit_per_block(cls: type[nn.Module]) -> None:
    model = cls(TINY)
    units = plan_units(model, world_size=1, unit_classes=[])
    assert len(units) == TINY.n_layer + 1
    assert sum(u.numel for u in units) == count_parameters(model)


def test_rotary_keeps_norms_and_scores_depend_on_offset_only() -> None:
    cos, sin = rotary_tables(head_dim=8, max_seq_len=16)
    q, k = torch.randn(8, generator=torch.Generator().manual_seed(0)), torch.randn(8, generator=torch.Generator().manual_seed(1))
    qs = apply_rotary(q.expand(1, 1, 16, 8), cos, sin)[0, 0]
    ks = apply_rotary(k.expand(1, 1, 16, 8), cos, sin)[0, 0]
    torch.testing.assert_close(qs.norm(dim=-1), q.norm().expand(16))
    torch.testing.assert_close(qs[5] @ ks[2], qs[12] @ ks[9])
    torch.testing.assert_close(qs[0], q)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_meta_build_allocates_nothing_then_materializes(kind: str) -> None:
    model = build_model(_model_cfg(kind), device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    torch.manual_seed(0)
    materialize(model)
    if kind == "gpt":
        assert model.lm_head.weight is model.tok_emb.weight
    _, loss = model(_tokens(1), _tokens(2))
    assert loss.item() == pytest.approx(math.log(256), abs=0.05)


def test_two_billion_preset_is_at_least_two_billion_on_meta() -> None:
    with torch.device("meta"):
        model = GPT(PRESETS["2b"])
    assert 2.0e9 <= count_parameters(model) < 2.2e9
    with torch.device("meta"):
        model = GPT(PRESETS["30m"])
    assert 29e6 <= count_parameters(model) <= 31e6 and model.spec.n_layer == 8 and model.spec.d_model == 512


def test_build_model_gives_the_configured_built_in() -> None:
    torch.manual_seed(0)
    model = build_model(_model_cfg("llama"))
    assert isinstance(model, Llama) and model.spec == TINY


def test_build_model_transformers_class_by_name_with_random_weights() -> None:
    transformers = pytest.importorskip("transformers")
    kwargs = {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 256, "n_positions": 64}
    model = build_model(_model_cfg("transformers", transformers_class="GPT2LMHeadModel", transformers_config=kwargs))
    reference = transformers.GPT2LMHeadModel(transformers.GPT2Config(**kwargs))
    assert type(model) is type(reference)
    assert count_parameters(model) == count_parameters(reference)
    assert len(plan_units(model, world_size=1, unit_classes=[])) == 3


def test_transformers_errors_are_one_line() -> None:
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match=r"^model.transformers_class 'NoSuchModel' is not a transformers model class"):
        build_model(_model_cfg("transformers", transformers_class="NoSuchModel", transformers_config={}))
    with pytest.raises(ValueError, match=r"^model.type is transformers but model.transformers_class is not set"):
        build_model(_model_cfg("transformers", transformers_class=None, transformers_config={}))
    with pytest.raises(ValueError, match=r"^model.transformers_config has bogus, which GPT2Config does not take"):
        build_model(_model_cfg("transformers", transformers_class="GPT2LMHeadModel", transformers_config={"n_layer": 1, "bogus": 1}))
    for key in ("torch_dtype", "dtype"):  # a name transformers takes, but the engine's dtypes are the precision section's
        with pytest.raises(ValueError, match=rf"^model.transformers_config.{key}: .*: remove model.transformers_config.{key} and set precision.param_dtype$"):
            build_model(_model_cfg("transformers", transformers_class="GPT2LMHeadModel", transformers_config={"n_layer": 1, key: "bfloat16"}))


def test_spec_rejects_heads_that_do_not_divide_the_width() -> None:
    with pytest.raises(ValueError, match=r"^model.d_model 100 is not a multiple of model.n_head 3"):
        ModelSpec(d_model=100, n_head=3)


def test_sequence_longer_than_max_is_refused() -> None:
    with pytest.raises(ValueError, match="sequence length 129 is above model.max_seq_len 128"):
        GPT(TINY)(torch.zeros(1, 129, dtype=torch.long))
