"""docs/tutorial-finetune.md runs as written: its blocks, in order, in an empty directory.

A ```sh block is run by bash with the virtual environment's `tierzero` and `python` first on
PATH and must exit 0; a ```yaml or ```python block starts with `# file: NAME` and is written to
NAME. A block of any other kind fails the test, so the tutorial cannot grow a step nobody runs.
Then what the tutorial promises is checked against the files themselves: transformers loads
exactly the tensors tierzero wrote (a weight transformers initialised itself, for a name it did
not find, would pass a load with a warning only), `--export` after a resume and `consolidate
--hf` of the last checkpoint agree bit for bit with an uninterrupted run, the weights moved
away from the base, and the LoRA export carries trained adapters on the untouched base.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("peft")

TUTORIAL = Path(__file__).resolve().parents[2] / "docs" / "tutorial-finetune.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
FILE_LINE = re.compile(r"# file: (\S+)\n")
PROMPT = "def add(a, b):"


def blocks(text: str) -> list[tuple[str, str]]:
    """The fenced blocks of a markdown text, in order: (language, body)."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def _env(cwd: Path) -> dict[str, str]:
    """This interpreter's bin directory first on PATH (its `tierzero` and `python`), no network, and
    the token and Hugging Face caches in `cwd` rather than the user's ~/.cache."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(XDG_CACHE_HOME=str(cwd / ".cache"), HF_HOME=str(cwd / ".cache" / "huggingface"))
    return env


def _sh(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["bash", "-ec", script], cwd=cwd, env=_env(cwd), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the tutorial's command failed (exit {done.returncode}):\n{script}\n{done.stdout}\n{done.stderr}"
    return done


def follow(tutorial: Path, cwd: Path) -> list[str]:
    """Run every block of `tutorial` in `cwd` in order; the stdout of each sh block."""
    printed = []
    for lang, body in blocks(tutorial.read_text()):
        if lang == "sh":
            printed.append(_sh(body, cwd).stdout)
            continue
        named = FILE_LINE.match(body)
        assert lang in ("yaml", "python") and named, f"a ```{lang} block the test cannot run or write:\n{body}"
        (cwd / named.group(1)).write_text(body)
    return printed


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a directory's safetensors files, by name."""
    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out |= load_file(path)
    return out


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits


def test_the_tutorial_runs_and_transformers_loads_what_it_wrote(tmp_path: Path) -> None:
    printed = follow(TUTORIAL, tmp_path)
    assert any(out.startswith("<s>" + PROMPT) for out in printed), printed  # generate.py: the prompt and its new tokens
    base, written = _tensors(tmp_path / "base"), _tensors(tmp_path / "finetuned")

    # What transformers loads is what tierzero wrote, every tensor and no other.
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "finetuned").eval()
    assert type(model).__name__ == "LlamaForCausalLM" and model.dtype == torch.float32
    assert _equal(model.state_dict(), written)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "finetuned")
    ids = tokenizer(PROMPT).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == PROMPT
    logits = _logits(model, ids)
    assert logits.shape == (1, len(ids), model.config.vocab_size) and torch.isfinite(logits).all()

    # Full fine-tuning moved every matrix; the shapes are the base's.
    assert {k: v.shape for k, v in written.items()} == {k: v.shape for k, v in base.items()}
    assert all(not torch.equal(written[k], base[k]) for k in written if k.endswith("proj.weight"))

    # consolidate --hf of the newest checkpoint is the export, and stopping at step 2 and
    # resuming is the run that never stopped.
    assert _equal(_tensors(tmp_path / "finetuned-hf"), written)
    _sh("tierzero train --config finetune.yaml --set checkpoint.dir=straight-checkpoints --export straight --no-progress", tmp_path)
    assert _equal(_tensors(tmp_path / "straight"), written)

    # LoRA: trained adapters on the base as make-checkpoint wrote it.
    adapters = _tensors(tmp_path / "finetuned-lora")
    assert adapters and all(".lora_A." in k or ".lora_B." in k for k in adapters)
    assert any(".lora_B." in k and v.abs().sum() > 0 for k, v in adapters.items())  # lora_B starts at zero
    assert _equal(_tensors(tmp_path / "lora-checkpoints" / "4" / "adapter"), adapters)
    lora = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "finetuned-lora").eval()
    state = lora.state_dict()
    expected = {name.removeprefix("base_model.model.").replace(".weight", ".default.weight"): v for name, v in adapters.items()}
    for name, value in base.items():  # a module with adapters keeps its own weight as base_layer
        wrapped = name.replace(".weight", ".base_layer.weight")
        expected[wrapped if wrapped in state else name] = value
    assert _equal(state, expected)
    assert torch.isfinite(_logits(lora, ids)).all()
