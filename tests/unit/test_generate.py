"""engine.generate: transformers' greedy tokens wherever the weights live, the built-ins' KV cache, EOS, sampling."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tierzero
from tierzero.common.slices import Kind, SliceKey, Tier
from tierzero.inference import Sampling, generate
from tierzero.inference.decoders import contiguous_head
from tierzero.models.builtin import GPT, Llama, ModelSpec
from tierzero.models.kv_cache import KVCache

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
from generate_cases import (  # noqa: E402
    MODELS,
    NEW_TOKENS,
    PAD,
    PLACEMENTS,
    PROMPT_LENGTHS,
    engine_config,
    engine_generate,
    hf_model,
    prompts,
    reference,
    stopping_token,
)  # fmt: skip

WIDTH = max(PROMPT_LENGTHS)
SPEC = ModelSpec(vocab_size=64, n_layer=2, n_head=2, d_model=32, d_ff=64, max_seq_len=64)


@pytest.fixture(scope="module")
def hf() -> dict[str, tuple[nn.Module, torch.Tensor]]:
    """Each transformers model, and its own greedy `generate` on the batch."""
    pytest.importorskip("transformers")
    ids, mask = prompts()
    models = {name: hf_model(name) for name in MODELS}
    return {name: (model, reference(model, ids, mask, max_new_tokens=NEW_TOKENS)) for name, model in models.items()}


def _builtin(cls: type[GPT | Llama]) -> nn.Module:
    """A small built-in model with wide random weights (greedy decoding then wanders over many tokens)."""
    torch.manual_seed(0)
    model = cls(SPEC).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.3)
    return model


def _varied(tokens: torch.Tensor) -> bool:
    """Many distinct tokens: equal outputs then say something."""
    return len(set(tokens.flatten().tolist())) >= 10


# ---- transformers models: exactly the tokens of their own generate ------------------


@pytest.mark.parametrize(("name", "stage", "placement"), [(m, s, p) for m in MODELS for s in (1, 3) for p in PLACEMENTS])
def test_greedy_tokens_are_transformers_generate_s(hf: Any, tmp_path: Path, name: str, stage: int, placement: str) -> None:
    model, expected = hf[name]
    ids, mask = prompts()
    got = engine_generate(model, engine_config(stage, placement, tmp_path), ids, mask, max_new_tokens=NEW_TOKENS)
    assert expected.shape == (len(PROMPT_LENGTHS), WIDTH + NEW_TOKENS) and _varied(expected[:, WIDTH:])
    assert torch.equal(got, expected)


@pytest.mark.parametrize("name", MODELS)
def test_rows_stop_at_eos_as_in_transformers(hf: Any, tmp_path: Path, name: str) -> None:
    model, greedy = hf[name]
    ids, mask = prompts()
    eos = stopping_token(greedy, WIDTH)
    expected = reference(model, ids, mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos)
    got = engine_generate(model, engine_config(3, "nvme", tmp_path), ids, mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos)
    assert torch.equal(got, expected)
    new = got[1, WIDTH:].tolist()
    stop = new.index(eos)
    assert 3 <= stop < len(new) - 1 and set(new[stop + 1 :]) == {PAD}  # row 1 stopped, then padded
    assert any(eos not in row for row in got[:, WIDTH:].tolist())  # and another went on


def test_lora_adapters_on_a_frozen_base_on_nvme_generate_as_peft_does(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(hf_model("llama"), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # B starts at zero, which would hide the adapters
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(param.numel()))
    ids, mask = prompts()
    expected = reference(model, ids, mask, max_new_tokens=NEW_TOKENS)
    with model.disable_adapter():
        assert not expected.equal(reference(model, ids, mask, max_new_tokens=NEW_TOKENS))  # the adapters count
    got = engine_generate(model, engine_config(3, "nvme", tmp_path), ids, mask, max_new_tokens=NEW_TOKENS)
    assert torch.equal(got, expected)


def test_each_step_reads_every_nvme_weight_once_for_the_batch(hf: Any, tmp_path: Path) -> None:
    model, expected = hf["llama"]
    ids, mask = prompts()
    with tierzero.initialize(copy.deepcopy(model), engine_config(3, "nvme", tmp_path)) as engine:
        before = engine.store.nvme_traffic()[0]
        got = engine.generate(ids, mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD)
        read = engine.store.nvme_traffic()[0] - before
        weights = sum(s.nbytes for s in engine.plan.all() if s.kind is Kind.PARAM and s.home is Tier.NVME)
    assert torch.equal(got, expected)
    # the prompts' forward, then one per new token but the last: each reads every unit's slice once
    assert read == NEW_TOKENS * weights > 0


def test_the_head_takes_the_prompts_last_position_contiguous(hf: Any) -> None:
    # [Note: the head's input] in tierzero/inference/decoders.py: transformers slices the prompts' last
    # position out of the hidden states, a view a plain tensor weight would multiply row by row.
    model, _ = hf["llama"]
    model = copy.deepcopy(model)
    ids, mask = prompts()
    head = model.get_output_embeddings()
    forward, seen = head.forward, []
    head.forward = lambda hidden: (seen.append(hidden.is_contiguous()), forward(hidden))[1]
    with torch.no_grad():
        alone = model(ids, attention_mask=mask, logits_to_keep=1).logits
        with contiguous_head(model):
            hooked = model(ids, attention_mask=mask, logits_to_keep=1).logits
        model(ids, attention_mask=mask, logits_to_keep=1)
    assert seen == [False, True, False]  # the hook lives as long as the block
    assert torch.equal(hooked, alone) and not head._forward_pre_hooks
    with contiguous_head(_builtin(GPT)):  # the built-ins' head takes every position: nothing to do
        pass


def test_weights_homed_in_host_memory_decode_from_their_homes_with_nothing_in_the_device_tier(hf: Any, tmp_path: Path) -> None:
    # Without a GPU the device tier is host memory: a cpu-homed slice fetched to it is its home, no copy.
    model, expected = hf["llama"]
    ids, mask = prompts()
    with tierzero.initialize(copy.deepcopy(model), engine_config(3, "cpu", tmp_path)) as engine:
        homes = [engine.store.home_tensor(SliceKey(unit.name, Kind.PARAM)) for unit in engine.units]
        head = engine.module.get_output_embeddings()
        forward, seen = head.forward, []

        def spied(hidden: torch.Tensor) -> torch.Tensor:
            tiers, at = engine.store.report().tiers, head.weight.data_ptr()
            in_home = any(h.data_ptr() <= at < h.data_ptr() + h.nbytes for h in homes)
            seen.append((in_home, tiers[Tier.DEVICE].current_by_kind[Kind.PARAM], tiers[Tier.DEVICE].current_by_kind[Kind.GATHERED]))
            return forward(hidden)

        head.forward = spied
        got = engine.generate(ids, mask, max_new_tokens=NEW_TOKENS, pad_token_id=PAD)
        cpu = engine.store.report().tiers[Tier.CPU].current_by_kind[Kind.PARAM]
    assert torch.equal(got, expected) and seen == [(True, 0, 0)] * NEW_TOKENS
    assert cpu == sum(h.nbytes for h in homes) > 0


# ---- the built-in models' KV cache ---------------------------------------------------


@pytest.mark.parametrize("cls", [GPT, Llama])
def test_cached_decoding_is_the_uncached_forward_s_argmax_token_by_token(cls: type[GPT | Llama], tmp_path: Path) -> None:
    model = _builtin(cls)
    plain = copy.deepcopy(model)
    ids, mask = prompts()
    with tierzero.initialize(model, engine_config(3, "cpu", tmp_path)) as engine:
        got = engine.generate(ids, mask, max_new_tokens=NEW_TOKENS)
    assert _varied(got[:, WIDTH:])
    for row, length in enumerate(PROMPT_LENGTHS):
        tokens = ids[row, WIDTH - length :]  # the row alone, unpadded, run whole at every step
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                tokens = torch.cat([tokens, plain(tokens[None])[0, -1].argmax().reshape(1)])
        assert got[row, WIDTH:].tolist() == tokens[length:].tolist(), f"row {row}"


@pytest.mark.parametrize("cls", [GPT, Llama])
def test_a_cached_forward_in_two_calls_gives_the_uncached_logits(cls: type[GPT | Llama]) -> None:
    model = _builtin(cls)
    idx = torch.randint(0, SPEC.vocab_size, (3, 12), generator=torch.Generator().manual_seed(2))
    cache = KVCache(batch=3, n_layer=SPEC.n_layer, capacity=12, device="cpu")
    with torch.no_grad():
        whole = model(idx)
        first, rest = model(idx[:, :7], cache=cache), model(idx[:, 7:], cache=cache)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), whole, rtol=1e-5, atol=1e-5)
    assert cache.length == 12 and cache.nbytes == 2 * SPEC.n_layer * 3 * SPEC.n_head * 12 * SPEC.head_dim * 4


def test_the_training_forward_takes_no_mask_without_a_cache() -> None:
    model = _builtin(GPT)
    idx = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^attention_mask is for cached decoding: pass a KVCache with it"):
        model(idx, attention_mask=torch.ones_like(idx))
    with pytest.raises(ValueError, match=r"^the KV cache holds 4 tokens a row, this forward would fill 5: make it larger"):
        model(torch.zeros(1, 5, dtype=torch.long), cache=KVCache(batch=1, n_layer=2, capacity=4, device="cpu"))


def test_a_row_stops_at_eos_and_emits_pad_after(tmp_path: Path) -> None:
    ids, mask = prompts()
    with tierzero.initialize(_builtin(Llama), engine_config(1, "device", tmp_path)) as engine:
        greedy = engine.generate(ids, mask, max_new_tokens=NEW_TOKENS)
        eos = stopping_token(greedy, WIDTH)
        got = engine.generate(ids, mask, max_new_tokens=NEW_TOKENS, eos_token_id=eos, pad_token_id=PAD)
    expected = []
    for row in greedy[:, WIDTH:].tolist():
        stop = row.index(eos) + 1 if eos in row else len(row)
        expected.append(row[:stop] + [PAD] * (len(row) - stop))
    steps = got.shape[1] - WIDTH  # fewer than asked when every row stopped
    assert got[:, :WIDTH].equal(ids) and got[:, WIDTH:].tolist() == [row[:steps] for row in expected]
    assert steps == max(row.index(eos) + 1 if eos in row else NEW_TOKENS for row in greedy[:, WIDTH:].tolist())


def test_generation_drops_nothing_out_and_leaves_the_training_mode_as_it_was(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GPT(ModelSpec(vocab_size=64, n_layer=2, n_head=2, d_model=32, d_ff=64, max_seq_len=64, dropout=0.5))
    plain = copy.deepcopy(model).eval()
    ids, mask = prompts()
    with tierzero.initialize(model.train(), engine_config(3, "device", tmp_path)) as engine:
        got = engine.generate(ids[:1], mask[:1], max_new_tokens=8)
        assert all(sub.training for sub in engine.module.modules())
    expected = ids[0]
    with torch.no_grad():
        for _ in range(8):
            expected = torch.cat([expected, plain(expected[None])[0, -1].argmax().reshape(1)])
    assert got[0].tolist() == expected.tolist()


# ---- sampling ------------------------------------------------------------------------


def test_sampling_with_a_seed_repeats_and_top_k_1_is_greedy(tmp_path: Path) -> None:
    ids, mask = prompts()
    with tierzero.initialize(_builtin(GPT), engine_config(3, "device", tmp_path)) as engine:
        sample = {"max_new_tokens": NEW_TOKENS, "do_sample": True, "temperature": 1.5}
        first, again, other = (engine.generate(ids, mask, seed=seed, **sample) for seed in (7, 7, 8))
        greedy = engine.generate(ids, mask, max_new_tokens=NEW_TOKENS)
        top_1 = engine.generate(ids, mask, max_new_tokens=NEW_TOKENS, do_sample=True, top_k=1, seed=3)
    assert first.equal(again) and not first.equal(other)
    assert not first.equal(greedy) and top_1.equal(greedy)


def test_top_k_and_top_p_draw_only_from_the_most_likely_tokens() -> None:
    logits = torch.tensor([[0.50, 0.30, 0.15, 0.05]]).log().expand(400, 4)
    g = torch.Generator().manual_seed(0)
    # top_p 0.7: tokens 0 and 1 (0.5 is short of 0.7, 0.8 reaches it); top_k 3: all but the last
    assert set(Sampling(do_sample=True, top_p=0.7).pick(logits, generator=g).tolist()) == {0, 1}
    assert set(Sampling(do_sample=True, top_k=3).pick(logits, generator=g).tolist()) == {0, 1, 2}
    assert set(Sampling(do_sample=True).pick(logits, generator=g).tolist()) == {0, 1, 2, 3}
    assert set(Sampling(do_sample=True, temperature=0.05).pick(logits, generator=g).tolist()) == {0}


# ---- refusals ------------------------------------------------------------------------


def test_bad_requests_are_refused_in_one_line(tmp_path: Path) -> None:
    ids, mask = prompts()
    right = mask.flip(1)
    engine = tierzero.initialize(_builtin(GPT), engine_config(3, "device", tmp_path))
    with engine:
        for options, message in [
            ({"max_new_tokens": 0}, r"^max_new_tokens is 0, expected at least 1$"),
            ({"max_new_tokens": 4, "do_sample": True, "temperature": 0.0}, r"^temperature is 0.0, expected a number above 0"),
            ({"max_new_tokens": 4, "top_p": 1.5}, r"^top_p is 1.5, expected a number in \(0, 1\] or None$"),
            ({"max_new_tokens": 60}, r"^prompts of 9 tokens \+ max_new_tokens 60 = 69 is above model.max_seq_len 64: ask for fewer"),
        ]:
            with pytest.raises(ValueError, match=message):
                generate(engine, ids, mask, **options)
        with pytest.raises(ValueError, match=r"^row 1 of the batch ends in padding: pad prompts on the left"):
            engine.generate(ids, right, max_new_tokens=4)
        with pytest.raises(ValueError, match=r"^attention_mask has padding between real tokens: pad prompts on the left only$"):
            engine.generate(ids, torch.tensor([[1, 0, 1]] * 4).repeat(1, 3), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"^generate\(\) after engine.close\(\)"):
        engine.generate(ids, mask, max_new_tokens=4)
