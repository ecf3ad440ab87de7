"""`tierzero generate`: completions of prompts from the configured model, its weights where the config puts them.

Prompts come from `--prompt TEXT` or a JSON Lines file (`{"prompt": "..."}` a line). They are
encoded with `data.tokenizer` (byte-level ids when it is null, as the built-in models train
on) and go through `engine.generate` (tierzero/inference/generate.py) `--batch-size` at a
time, left-padded; `auto` (`generate.batch_size`, the default) takes the largest batch whose KV
cache, logits and gathered weights fit the device tier's free budget (tierzero/inference/batch.py),
the same on every rank. The model is built as `tierzero train` builds it (`model.pretrained`,
`model.lora`), and `--checkpoint DIR` loads the weights a `tierzero train` run saved there,
the newest complete checkpoint as `--resume` finds it. Under torchrun every rank generates
(stage 3 gathers over all of them) and rank 0 alone prints each completion, or writes them
with `--out`, and at the end the tokens per second and the NVMe bytes read per token.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from tierzero.api import initialize
from tierzero.checkpoint import find_checkpoint
from tierzero.cli.commands import COMMANDS
from tierzero.cli.config import parse_batch_size, parse_overrides
from tierzero.comm import collectives as C
from tierzero.common.output_paths import check_writable
from tierzero.common.safe_files import RefusedFile, loads_bounded, read_regular
from tierzero.common.sizes import format_size
from tierzero.common.slices import Tier
from tierzero.config import AUTO, read_config
from tierzero.data import check_vocab
from tierzero.data.tokenizer import TextTokenizer, load_tokenizer
from tierzero.inference.batch import auto_batch, batch_cost
from tierzero.models.builtin import build_model
from tierzero.placement.budgets import machine_budgets

__all__ = ["add_generate_command", "run_generate"]

MAX_NEW_TOKENS = 1 << 20


def add_generate_command(subparsers: Any) -> None:
    """Register `tierzero generate` on the `tierzero` command's sub-parsers."""
    parser = subparsers.add_parser("generate", help=COMMANDS["generate"].help)
    parser.add_argument("--config", required=True, help="the tierzero config the model was trained with")
    given = parser.add_mutually_exclusive_group()  # neither: refused in one line by _check_flags
    given.add_argument("--prompt", default=None, help="one prompt")
    given.add_argument("--prompts", default=None, metavar="FILE.jsonl", help='a JSON Lines file, {"prompt": "..."} a line')
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="tokens to add to each prompt at most (64)")
    parser.add_argument("--out", default=None, metavar="FILE.jsonl", help="write the completions there instead of printing them")
    parser.add_argument("--checkpoint", default=None, metavar="DIR", help="load the weights of a tierzero train checkpoint (a root or a step)")
    parser.add_argument(
        "--batch-size", default=None, metavar="N|auto",
        help="prompts decoded together: each step reads the weights once for them (default: generate.batch_size, auto: "
        "the largest that fits the device budget)",
    )  # fmt: skip
    parser.add_argument("--sample", action="store_true", help="sample the tokens instead of taking the most likely")
    parser.add_argument("--temperature", type=float, default=1.0, help="with --sample: divide the logits by it (1.0)")
    parser.add_argument("--top-k", type=int, default=None, help="with --sample: only from the k most likely tokens")
    parser.add_argument("--top-p", type=float, default=None, help="with --sample: only from the most likely tokens of this much probability")
    parser.add_argument("--seed", type=int, default=None, help="with --sample: the sampling seed (default: train.seed)")
    parser.add_argument("--nvme-path", default=None, help="directory for the swap files (overrides tiers.nvme.path)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override one dotted config key, e.g. --set zero.stage=3 (the value is read as YAML)",
    )  # fmt: skip
    parser.set_defaults(func=run_generate)


@dataclass(frozen=True, slots=True)
class Codec:
    """Text to ids and back: `data.tokenizer`'s, or UTF-8 bytes where it is null."""

    tokenizer: TextTokenizer | None

    @property
    def eos(self) -> int | None:
        """Where a completion stops; byte-level text has none, so it runs to --max-new-tokens."""
        return None if self.tokenizer is None else self.tokenizer.eos_id

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self.tokenizer is None:
            return [list(text.encode()) for text in texts]
        return self.tokenizer.encode_batch(texts)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:  # a model with more than 256 ids may give others: no byte to show
            return bytes(i for i in ids if i < 256).decode(errors="replace")
        return self.tokenizer.backend.decode(ids, skip_special_tokens=True)

    def completion(self, prompt: list[int], new: list[int]) -> str:
        """The text `new` adds to `prompt`: decoded together, as a tokenizer puts the space (or the
        bytes of a character) between them, then the prompt's own text cut off."""
        whole, alone = self.decode(prompt + new), self.decode(prompt)
        return whole[len(alone) :] if whole.startswith(alone) else self.decode(new)


@dataclass(frozen=True, slots=True)
class Completion:
    prompt: str
    completion: str
    tokens: int
    """New tokens, the EOS that ended it included."""


def run_generate(args: argparse.Namespace, *, out: TextIO | None = None) -> int:
    """`tierzero generate`: 0 when done; user errors raise ValueError/OSError (one line, exit 2)."""
    out = out or sys.stdout
    _check_flags(args)
    prompts = [args.prompt] if args.prompt is not None else read_prompts(Path(args.prompts))
    if args.out is not None:  # before minutes of building: a path that cannot be written costs nothing
        check_writable(args.out, what="--out", directory=False)
    cfg = read_config(args.config, overrides=parse_overrides(args.overrides, nvme_path=args.nvme_path)).config
    codec = Codec(None if cfg.data.tokenizer is None else load_tokenizer(cfg.data.tokenizer))
    encoded = codec.encode(prompts)
    empty = next((i for i, ids in enumerate(encoded) if not ids), None)
    if empty is not None:
        raise ValueError(f"prompt {empty + 1} encodes to no tokens: give it some text")
    rank0 = int(os.environ.get("RANK", "0")) == 0
    with _engine(cfg, checkpoint=args.checkpoint, out=out if rank0 else None) as engine:
        wanted = cfg.generate.batch_size if args.batch_size is None else parse_batch_size(args.batch_size)
        prompt, new = max(len(ids) for ids in encoded), args.max_new_tokens
        batch_size = wanted if wanted != AUTO else _auto_batch(engine, cfg, prompt=prompt, new=new, prompts=len(prompts))
        if batch_size < len(prompts) and wanted == AUTO and rank0:  # the budget splits them: say why
            cost = batch_cost(engine, prompt=prompt, new=new)
            out.write(f"batch size {batch_size} for {len(prompts)} prompts (auto: {cost.describe()})\n")
        seed = cfg.train.seed if args.seed is None else args.seed
        options = {"do_sample": args.sample, "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": seed}
        nvme_before, start = engine.store.nvme_traffic()[0], time.perf_counter()
        done: list[Completion] = []
        for first in range(0, len(prompts), batch_size):
            batch = slice(first, first + batch_size)
            done += _complete(engine, codec, prompts[batch], encoded[batch], max_new_tokens=args.max_new_tokens, **options)
        seconds, nvme_read = time.perf_counter() - start, engine.store.nvme_traffic()[0] - nvme_before
    if rank0:
        _show(done, out=out, path=args.out)
        tokens = sum(c.tokens for c in done)
        out.write(
            f"generated {tokens} tokens for {len(done)} prompt(s) in {seconds:.2f} s: {tokens / seconds:.1f} tokens/s, "
            f"{format_size(nvme_read // max(tokens, 1))} read from nvme per token\n"
        )
    return 0


def _check_flags(args: argparse.Namespace) -> None:
    """The numbers, before anything is read or built."""
    if not 1 <= args.max_new_tokens <= MAX_NEW_TOKENS:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} is outside 1..{MAX_NEW_TOKENS}: ask for at least one new token")
    if args.batch_size is not None:
        parse_batch_size(args.batch_size)
    if args.prompt is None and args.prompts is None:
        raise ValueError("no prompt: give --prompt TEXT or --prompts FILE.jsonl")
    if args.prompt == "":
        raise ValueError("--prompt is empty: give the text to complete")


def _auto_batch(engine: Any, cfg: Any, *, prompt: int, new: int, prompts: int) -> int:
    """The auto batch for this rank's free device budget, the smallest over the ranks (they decode in step)."""
    budget, source = _device_room(engine, cfg)
    batch = torch.tensor([auto_batch(batch_cost(engine, prompt=prompt, new=new), budget=budget, prompts=prompts, source=source)])
    C.all_reduce(batch, comm=engine.comm, op=dist.ReduceOp.MIN)
    return int(batch)


def _device_room(engine: Any, cfg: Any) -> tuple[int, str]:
    """Bytes the device may still take beyond what the store holds there, and where that figure comes from.

    tiers.device.capacity less the device tier's bytes; else a GPU's free memory now, less its margin;
    else (the host stands in for the device) the cpu tier's budget, less both tiers' bytes where it is
    tiers.cpu.capacity (psutil's available memory is already net of them).
    """
    held = engine.store.report().tiers
    budgets = machine_budgets(cfg.tiers, device=engine.stage.device)
    device, cpu = budgets.device, budgets.cpu
    if cfg.tiers.device.capacity is not None:
        used = held[Tier.DEVICE].current
        return device.nbytes - used, f"tiers.device.capacity {format_size(device.nbytes)} less {format_size(used)} the device tier holds"
    if device.nbytes is not None:
        return device.nbytes, device.source
    assert cpu.nbytes is not None
    if cfg.tiers.cpu.capacity is None:
        return cpu.nbytes, f"the host stands in for the device: {cpu.source}"
    used = held[Tier.DEVICE].current + held[Tier.CPU].current
    return cpu.nbytes - used, f"tiers.cpu.capacity {format_size(cpu.nbytes)} less {format_size(used)} the device and cpu tiers hold"


PROMPTS_LIMIT = 1 << 30
"""The most bytes a prompts file may hold: a billion characters of prompts is past any batch."""


def read_prompts(path: Path) -> list[str]:
    """The prompts of a JSON Lines file, `{"prompt": "..."}` a line (blank lines skipped)."""
    wanted = 'give a JSON Lines file with a "prompt" string a line'
    try:
        text = read_regular(path, limit=PROMPTS_LIMIT).decode(errors="replace")
    except FileNotFoundError:
        raise FileNotFoundError(f"--prompts {path}: no such file; {wanted}") from None
    except RefusedFile as exc:  # a FIFO, a device, a directory: refused before a byte is read
        raise ValueError(f"--prompts {exc}: {wanted}") from None
    prompts = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = loads_bounded(line, name=f"--prompts {path} line {number}")
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
            raise ValueError(f"--prompts {path} line {number}: expected a JSON object with a non-empty \"prompt\" string")
        prompts.append(record["prompt"])
    if not prompts:
        raise ValueError(f"--prompts {path} holds no prompts: write one JSON object with a \"prompt\" string a line")
    return prompts


@contextmanager
def _engine(cfg: Any, *, checkpoint: str | None, out: TextIO | None) -> Iterator[Any]:
    """The configured model in an engine, with the trained weights of `checkpoint` where given; closed on leaving."""
    torch.manual_seed(cfg.train.seed)
    # As `tierzero train` builds it: built-ins on meta, materialised unit by unit by the engine.
    model = build_model(cfg.model, device=None if cfg.model.type == "transformers" else "meta", seed=cfg.train.seed)
    check_vocab(cfg, model)
    if checkpoint is None:
        # Nothing will train: frozen, the units keep their parameters alone, in the compute dtype, and no
        # fp32 master, gradient or optimizer state is made (for a 2B model on NVMe: 31 GB never written).
        model.requires_grad_(False)
    engine = initialize(model, cfg)
    try:
        if checkpoint is not None:
            _load(engine, Path(checkpoint), out=out)
        yield engine
    finally:
        engine.close()


def _load(engine: Any, root: Path, *, out: TextIO | None) -> None:
    """The newest complete checkpoint under `root` (or `root` itself), found as `tierzero train --resume` finds it."""
    try:
        chosen = find_checkpoint(root, note=lambda line: out.write(f"{line}\n") if out else None)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"--checkpoint {root}: {exc}") from None
    loaded = engine.load_checkpoint(chosen)
    if out is not None:
        out.write(f"weights from {loaded} (step {engine.global_step})\n")


def _complete(engine: Any, codec: Codec, prompts: list[str], encoded: list[list[int]], **options: Any) -> list[Completion]:
    """One batch: left-padded, generated, each row cut at its EOS and decoded."""
    width, pad = max(len(ids) for ids in encoded), codec.eos if codec.eos is not None else 0
    ids = torch.full((len(encoded), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, tokens in enumerate(encoded):
        ids[row, width - len(tokens) :] = torch.tensor(tokens)
        mask[row, width - len(tokens) :] = 1
    out = engine.generate(ids, mask, eos_token_id=codec.eos, pad_token_id=pad, **options)
    done = []
    for prompt, tokens, row in zip(prompts, encoded, out[:, width:].tolist(), strict=True):
        end = row.index(codec.eos) if codec.eos in row else len(row)
        done.append(Completion(prompt=prompt, completion=codec.completion(tokens, row[:end]), tokens=min(end + 1, len(row))))
    return done


def _show(done: list[Completion], *, out: TextIO, path: str | None) -> None:
    """Each completion after its prompt on `out`, or one JSON object a line in `path`."""
    if path is not None:
        lines = [json.dumps({"prompt": c.prompt, "completion": c.completion, "tokens": c.tokens}) for c in done]
        Path(path).write_text("".join(f"{line}\n" for line in lines))
        out.write(f"wrote {len(done)} completion(s) to {path}\n")
        return
    out.writelines(f"{c.prompt}{c.completion}\n\n" for c in done)
