"""`consolidate --hf` of a LoRA run's checkpoint: the base (dequantized where it was kept as nf4) with the
adapters merged, for `AutoModelForCausalLM.from_pretrained`, or with `--adapters-only` the adapters alone in
peft's format; an output on the run's inputs, or a flag that does not fit, is refused in one line. The live
engine's merged export (`train --export DIR --export-merged`) writes the very bytes `consolidate --hf` does.

The merged reference is peft's own `merge_and_unload()` in fp32, on a plain Llama whose weights are the
pretrained ones as the engine stored them (rounded to bf16, or an nf4 round trip: every weight of the test
model is a whole number of 64-element blocks, so its blocks are the unit's) and whose adapters are the
engine's, cast to the written dtype: equal bit for bit. The engine's own forward adds the adapters' output
to the base's instead of merging them, which rounds the same sum in another order: in fp32 it agrees with
the merged model's to a tight tolerance, not bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import tiny_llama

import tierzero
from tierzero.checkpoint import TransformersDirectory, save_checkpoint
from tierzero.checkpoint.find import find_checkpoint
from tierzero.cli.main import main
from tierzero.pretrained import build_meta_model
from tierzero.pretrained.lora import apply_lora
from tierzero.units.blockwise import dequantize_nf4, quantize_nf4

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB, TARGETS, STEPS = 64, ["q_proj", "v_proj"], 2


def _batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))


def _save_base(directory: Path) -> None:
    tiny_llama(vocab=VOCAB, hidden=64).save_pretrained(directory, safe_serialization=True)


def _config(base: Path, *, base_dtype: str, lora: bool = True) -> dict[str, Any]:
    model: dict[str, Any] = {"pretrained": str(base)}
    if lora:
        model["lora"] = {"r": 4, "alpha": 8, "base_dtype": base_dtype, "target_modules": TARGETS}
    return {
        "zero": {"stage": 3},
        "optimizer": {"type": "sgd", "lr": 0.5},
        "precision": {"param_dtype": "bf16" if base_dtype == "bf16" else "fp32"},
        "model": model,
    }


class Run:
    """A LoRA run trained for STEPS steps and checkpointed: its files, and what its engine said."""

    def __init__(self, root: Path, base_dtype: str) -> None:
        self.base, self.root, self.base_dtype = root / "base", root / "ckpt", base_dtype
        _save_base(self.base)
        model = apply_lora(build_meta_model(self.base), r=4, alpha=8, target_modules=TARGETS)
        x = _batch()
        with tierzero.initialize(model, _config(self.base, base_dtype=base_dtype), pretrained=self.base) as engine:
            for _ in range(STEPS):
                loss = engine(input_ids=x, labels=x).loss
                engine.backward(loss)
                engine.step()
            with torch.no_grad():
                self.logits = engine(input_ids=x).logits.float()
            self.state = engine.full_state_dict()
            save_checkpoint(engine, self.root)
            self.live = root / "live-merged"
            TransformersDirectory(merged=True).write(engine, self.live)
        self.adapters = {n: t for n, t in self.state.items() if "lora_" in n}

    def stored_base(self) -> Any:
        """The pretrained Llama in fp32, its weights as the engine kept them."""
        plain = transformers.LlamaForCausalLM.from_pretrained(self.base, dtype=torch.float32)
        with torch.no_grad():
            for p in plain.parameters():
                p.copy_(p.bfloat16().float() if self.base_dtype == "bf16" else dequantize_nf4(quantize_nf4(p)))
        return plain

    def merged_reference(self, dtype: torch.dtype) -> Any:
        """peft's merge in fp32 of the stored base and the engine's adapters, cast to `dtype`, in the Llama
        that from_pretrained builds in `dtype` (its rotary table stays fp32, which `.to(dtype)` would cast)."""
        model = peft.get_peft_model(self.stored_base(), peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(self.adapters[name])
        merged = {n: t.to(dtype) for n, t in model.merge_and_unload().state_dict().items()}
        reference = transformers.LlamaForCausalLM.from_pretrained(self.base, dtype=dtype)
        reference.load_state_dict(merged)
        return reference.eval()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Run]:
    """The run of each base dtype, trained once for the whole file."""
    made: dict[str, Run] = {}

    def get(base_dtype: str) -> Run:
        if base_dtype not in made:
            made[base_dtype] = Run(tmp_path_factory.mktemp(f"lora-{base_dtype}"), base_dtype)
        return made[base_dtype]

    return get


def _consolidate(capsys: pytest.CaptureFixture[str], *words: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["consolidate", *words])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("base_dtype", ["bf16", "nf4"])
def test_the_merged_model_is_peft_merge_of_the_stored_base_bit_for_bit(
    runs: Callable[[str], Run], base_dtype: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = runs(base_dtype)
    assert all(bool(t.abs().sum()) for n, t in run.adapters.items() if "lora_B" in n)  # trained: B is off zero
    assert _consolidate(capsys, str(run.root), str(tmp_path / "merged"), "--hf")[0] == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    reference = run.merged_reference(torch.bfloat16)
    written, expected = loaded.state_dict(), reference.state_dict()
    assert sorted(written) == sorted(expected)
    assert all(written[n].dtype == torch.bfloat16 and torch.equal(written[n], expected[n]) for n in expected)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=_batch()).logits, reference(input_ids=_batch()).logits)


def test_merged_in_fp32_is_the_engines_forward_to_rounding(
    runs: Callable[[str], Run], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = runs("nf4")  # computes in fp32 (the bf16 run's engine computes in bf16: no fp32 reference)
    assert _consolidate(capsys, str(run.root), str(tmp_path / "merged"), "--hf", "--dtype", "fp32")[0] == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    reference = run.merged_reference(torch.float32)
    with torch.no_grad():
        logits = loaded(input_ids=_batch()).logits
        assert torch.equal(logits, reference(input_ids=_batch()).logits)
    # x W^T + (x A^T) B^T s against x (W + B A s)^T: one sum, rounded in two orders
    torch.testing.assert_close(logits, run.logits, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("base_dtype", ["bf16", "nf4"])
def test_adapters_only_load_in_peft_equal_to_the_engines(
    runs: Callable[[str], Run], base_dtype: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = runs(base_dtype)
    code, _ = _consolidate(capsys, str(run.root), str(tmp_path / "adapters"), "--hf", "--adapters-only")
    assert code == 0
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    model = peft.PeftModel.from_pretrained(run.stored_base(), tmp_path / "adapters")
    loaded = {n: p for n, p in model.named_parameters() if "lora_" in n}
    assert sorted(loaded) == sorted(run.adapters)
    assert all(torch.equal(loaded[n], run.adapters[n]) for n in loaded)
    # an earlier adapter export is replaced whole, as train --export replaces it
    (tmp_path / "adapters" / "stale.txt").write_text("from before")
    assert _consolidate(capsys, str(run.root), str(tmp_path / "adapters"), "--hf", "--adapters-only")[0] == 0
    assert sorted(p.name for p in (tmp_path / "adapters").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


def test_an_output_on_an_input_is_refused_in_one_line(runs: Callable[[str], Run], capsys: pytest.CaptureFixture[str]) -> None:
    run = runs("nf4")
    base, root = run.base.resolve(), run.root.resolve()
    for words, out, label, source in [
        (["--hf"], base / "merged", "model.pretrained", base),
        (["--hf", "--adapters-only"], base / "adapters", "model.pretrained", base),
        (["--hf"], root / "merged", "checkpoint root", root),
        (["--hf", "--adapters-only"], root, "checkpoint root", root),
    ]:
        code, err = _consolidate(capsys, str(root), str(out), *words)
        relation = "is" if out == source else "lies inside"
        assert (code, err) == (2, (
            f"tierzero: error: consolidate output {out} {relation} the run's {label} {source}: writing there would "
            "overwrite or delete what the run reads; name an output that neither is, holds nor lies inside it\n"
        ))  # fmt: skip
    assert not (base / "merged").exists() and not (base / "adapters").exists() and not (root / "merged").exists()


def test_flags_that_do_not_fit_are_refused_in_one_line(
    runs: Callable[[str], Run], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = runs("nf4")
    out, step = tmp_path / "out", find_checkpoint(run.root)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    cases = [
        ([str(out), "--adapters-only"], "--adapters-only shapes a transformers directory: add --hf"),
        (
            [str(out), "--hf", "--adapters-only", "--dtype", "bf16"],
            "--dtype shapes the merged model, and --adapters-only writes peft's adapter files alone (fp32, no tokenizer, "
            "as train --export writes them): drop --dtype or --adapters-only",
        ),
        (
            [str(tmp_path / "busy"), "--hf", "--adapters-only"],
            f"--adapters-only output {tmp_path / 'busy'} holds files and no adapter_config.json: it would be replaced "
            "whole; name a new directory, or one an earlier adapter export wrote",
        ),
    ]
    for words, message in cases:
        assert _consolidate(capsys, str(run.root), *words) == (2, f"tierzero: error: {message}\n")
    assert not out.exists() and (tmp_path / "busy" / "notes.txt").read_text() == "mine"
    # a run without LoRA has no adapters to write
    plain = transformers.LlamaForCausalLM.from_pretrained(run.base)
    with tierzero.initialize(plain, _config(run.base, base_dtype="fp32", lora=False)) as engine:
        save_checkpoint(engine, tmp_path / "plain")
    plain_step = find_checkpoint(tmp_path / "plain")
    assert _consolidate(capsys, str(tmp_path / "plain"), str(out), "--hf", "--adapters-only") == (2, (
        f"tierzero: error: {plain_step} is not a LoRA run's checkpoint (its model.lora.r is 0): --adapters-only writes "
        "a LoRA run's adapters; drop it to write the whole model\n"
    ))  # fmt: skip
    assert not out.exists() and step.is_dir()


@pytest.mark.parametrize("base_dtype", ["bf16", "nf4"])
def test_the_live_merged_export_is_consolidate_hf_byte_for_byte(
    runs: Callable[[str], Run], capsys: pytest.CaptureFixture[str], tmp_path: Path, base_dtype: str
) -> None:
    from safetensors.torch import load_file

    run = runs(base_dtype)
    out = tmp_path / "merged"
    assert _consolidate(capsys, str(run.root), str(out), "--hf") == (0, "")
    live, offline = load_file(run.live / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(live) == sorted(offline) and not any("lora_" in name for name in live)
    assert all(torch.equal(live[name], offline[name]) for name in live)
    assert (run.live / "config.json").read_text() == (out / "config.json").read_text()


def test_export_merged_without_a_lora_export_is_refused_in_one_line(
    runs: Callable[[str], Run], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import yaml

    run, data = runs("bf16"), tmp_path / "corpus.txt"
    data.write_text("the cat sat on the mat\n" * 20)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**_config(run.base, base_dtype="bf16", lora=False), "data": {"path": str(data)}}))
    for extra in ([], ["--export", str(tmp_path / "out")]):
        capsys.readouterr()
        assert main(["train", "--config", str(config), "--export-merged", *extra]) == 2
        assert capsys.readouterr().err == (
            "tierzero: error: --export-merged merges a LoRA run's adapters into the --export directory: give --export DIR and "
            "model.lora.r, or drop --export-merged\n"
        )
    assert not (tmp_path / "out").exists()


def test_a_merged_export_of_a_model_without_adapters_is_refused_in_one_line(runs: Callable[[str], Run], tmp_path: Path) -> None:
    run = runs("bf16")
    model = build_meta_model(run.base)
    with tierzero.initialize(model, _config(run.base, base_dtype="bf16", lora=False), pretrained=run.base) as engine:
        with pytest.raises(ValueError, match=r"^a merged export of .* this engine's model has none: export it unmerged$"):
            TransformersDirectory(merged=True).write(engine, tmp_path / "out")
    assert not (tmp_path / "out").exists()
