"""Run a function on N real gloo ranks, and the single-process references they are held to.

One call of `run_ranks` forks N processes that join one gloo group on a free port,
run `fn(rank, world_size, payload)`, and send back what it returns. Forking (rather
than spawning) keeps a job to a fraction of a second instead of 1.5-3 s per rank.
"""

from __future__ import annotations

import io
import os
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from torch import nn
from torch.nn import functional as F


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable[..., Any], payload: Any, queue: Any, launched: bool) -> None:
    torch.set_num_threads(1)
    launch_env = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for name, value in launch_env.items():
        if launched:
            os.environ[name] = value
        else:
            os.environ.pop(name, None)
    try:
        if not launched:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        result = fn(rank, world_size, payload)
        # Bytes, not tensors: torch's queue pickling shares tensor memory through file
        # descriptors that vanish when this process exits.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the rank
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(
    fn: Callable[[int, int, Any], Any], *, world_size: int, payload: Any = None, launched: bool = False, timeout: float = 180
) -> list[Any]:
    """`fn`'s result on each rank, in rank order; raises with the failing rank's traceback.

    `launched=True` sets torchrun's environment (RANK, WORLD_SIZE, MASTER_*) instead of
    creating the group, so that `fn` can leave that to `tierzero.initialize`.
    """
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, payload, queue, launched)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    for _ in procs:
        rank, status, value = queue.get()
        if status == "ok":
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
        else:
            errors.append(f"rank {rank}:\n{value}")
            break
    for p in procs:
        p.join(timeout=5 if errors else timeout)
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]


# ---- models and data --------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, a ModuleList of blocks, a final norm and an LM head tied to the embedding.

    `reuse` runs block 0 a second time after the others (a unit used twice in a step);
    `unused` adds a block that never runs forward.
    """

    def __init__(self, *, vocab: int = 48, width: int = 32, layers: int = 3, reuse: bool = False, unused: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers + int(unused)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.reuse, self.active = reuse, layers

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks[: self.active]:
            x = block(x)
        if self.reuse:
            x = self.blocks[0](x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@dataclass(frozen=True, slots=True)
class Case:
    """One training run: ZeRO stage, optimizer, and the global batch split."""

    stage: int
    optimizer: str
    steps: int = 10
    accumulation: int = 2
    global_batch: int = 8
    seq: int = 8
    clip: float = 0.5
    dtype: str = "fp32"
    initial_scale: float = 2.0**16
    reuse: bool = False
    unused: bool = False
    seed: int = 0
    model_name: str = "tiny"
    """"tiny" (TinyLM), or "gpt2" / "llama" from transformers, random weights, dropout off."""
    checkpointing: str = ""
    overlap: bool = True
    """zero.overlap_comm: asynchronous collectives overlapped with compute."""
    """transformers models: "reentrant" or "non_reentrant" activation checkpointing (engine side only)."""
    frozen: tuple[str, ...] = ()
    """Name prefixes of the parameters to freeze (requires_grad=False)."""
    lora: bool = False
    """transformers models: peft's LoRA (rank 4 on the attention's input projections) on the frozen model."""
    zero: tuple[tuple[str, Any], ...] = ()
    """More `zero.*` settings, as (key, value) pairs."""

    def model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        model = TinyLM(reuse=self.reuse, unused=self.unused) if self.model_name == "tiny" else hf_model(self.model_name)
        for name, param in model.named_parameters():
            if name.startswith(self.frozen):
                param.requires_grad_(False)
        if self.lora:
            import peft

            targets = ["c_attn"] if self.model_name == "gpt2" else ["q_proj", "v_proj"]
            config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM")
            model = peft.get_peft_model(model, config)
            with torch.no_grad():  # B starts at zero: give it values, so that A's gradients are not all zero
                for name, param in model.named_parameters():
                    if "lora_B" in name:
                        param.normal_(0.0, 0.02)
        return model

    def loss(self, model: Any, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.model_name == "tiny":
            return model(tokens, targets)
        # transformers shifts the labels itself; with the full window the targets are implied
        return model(input_ids=tokens, labels=tokens).loss

    def config(self) -> dict[str, Any]:
        opt = {"type": "sgd", "lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}
        if self.optimizer == "adamw":
            opt = {"type": "adamw", "lr": 3e-3, "weight_decay": 0.01}
        return {
            "zero": {"stage": self.stage, "overlap_comm": self.overlap, **dict(self.zero)},
            "optimizer": opt,
            "precision": {"param_dtype": self.dtype, "initial_scale": self.initial_scale},
            "gradient_clipping": self.clip,
            "gradient_accumulation_steps": self.accumulation,
        }

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(0, 48, (self.global_batch, self.seq + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    def micro_batch(self, step: int, *, micro: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, targets = self.batch(step)
        size = self.global_batch // (world_size * self.accumulation)
        start = (micro * world_size + rank) * size
        return tokens[start : start + size], targets[start : start + size]


def hf_model(name: str) -> nn.Module:
    """A two-layer GPT-2 (tied embeddings) or Llama built from a config: nothing downloaded."""
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=48, n_positions=16, n_embd=32, n_layer=2, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
        return GPT2LMHeadModel(config).train()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16, attention_dropout=0.0,
    )
    return LlamaForCausalLM(config).train()


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The engine's default groups, as a torch user writes them: no weight decay on biases and
    the parameters of normalisation modules (the transformers Trainer's rule)."""
    norms = {id(p) for m in model.modules() if "Norm" in type(m).__name__ for p in m.parameters()}
    decay, exempt = [], []
    for name, p in model.named_parameters():
        (exempt if name.endswith("bias") or id(p) in norms else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": exempt, "weight_decay": 0.0}]


def torch_optimizer(case: Case, model: nn.Module) -> torch.optim.Optimizer:
    cfg = case.config()["optimizer"]
    groups = decay_groups(model, cfg["weight_decay"])
    if cfg["type"] == "sgd":
        return torch.optim.SGD(groups, lr=cfg["lr"], momentum=cfg["momentum"])
    return torch.optim.AdamW(groups, lr=cfg["lr"])


@dataclass(frozen=True, slots=True)
class Reference:
    losses: list[float]
    norms: list[float]
    params: dict[str, torch.Tensor]


def reference_run(case: Case, *, first_step: int = 0) -> Reference:
    """Plain single-process fp32 training on the whole global batch, torch's own optimizer and clipping.

    `first_step` > 0 starts at that step's batch, as a run whose first steps were skipped.
    """
    model = case.model()
    opt = torch_optimizer(case, model)
    losses, norms = [], []
    for step in range(first_step, case.steps):
        loss = case.loss(model, *case.batch(step))
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), case.clip)))
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return Reference(losses=losses, norms=norms, params={n: p.detach().clone() for n, p in model.named_parameters()})


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected.float()).norm() / expected.float().norm())


# ---- what each rank runs ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankRun:
    """One case as seen by one rank."""

    losses: list[float]
    """Per step, the global-batch loss (mean over ranks and micro-batches)."""
    params: dict[str, torch.Tensor] | None
    """`full_state_dict()` after the last step (rank 0 only)."""
    memory: dict[str, Any]
    steps_taken: int
    """`engine.global_step` at the end: fewer than the case's steps when fp16 overflowed."""


def train_case(case: Case, *, rank: int, world_size: int, make_engine: Callable[..., Any] | None = None) -> RankRun:
    import tierzero

    model = case.model()
    if case.checkpointing:
        # the reference trains without it: recomputation changes no number
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": case.checkpointing == "reentrant"})
    engine = (make_engine or tierzero.initialize)(model, case.config())
    losses = []
    with engine:
        for step in range(case.steps):
            total = torch.zeros(())
            for micro in range(case.accumulation):
                loss = case.loss(engine, *case.micro_batch(step, micro=micro, rank=rank, world_size=world_size))
                engine.backward(loss)
                engine.step()
                total += loss.detach().float()
            if world_size > 1:
                dist.all_reduce(total)
            losses.append(total.item() / (world_size * case.accumulation))
        return RankRun(
            losses=losses, params=engine.full_state_dict(), memory=engine.memory_report(), steps_taken=engine.global_step
        )


@dataclass(frozen=True, slots=True)
class Traffic:
    """One optimizer step of one rank, measured after a warm-up step."""

    comm: dict[str, int]
    peak_gathered: int
    """Peak bytes of Kind.GATHERED on the device tier during the step, by the store's accounting."""
    unit_bytes: dict[str, int]
    """Padded full-parameter bytes of each unit, in compute dtype."""
    kinds: dict[str, int]


def measure_case(case: Case, *, rank: int, world_size: int, make_engine: Callable[..., Any] | None = None) -> Traffic:
    import tierzero
    from tierzero.common.slices import Kind, Tier

    engine = (make_engine or tierzero.initialize)(case.model(), case.config())
    with engine:
        for step in range(2):
            if step == 1:
                engine.reset_comm_report()
                engine.store.reset_peaks()
            for micro in range(case.accumulation):
                engine.backward(case.loss(engine, *case.micro_batch(step, micro=micro, rank=rank, world_size=world_size)))
                engine.step()
        usage = engine.store.report().tiers[Tier.DEVICE]
        itemsize = torch.empty((), dtype=engine.stage.param_dtype).element_size()
        return Traffic(
            comm=engine.comm_report(),
            peak_gathered=int(usage.peak_by_kind.get(Kind.GATHERED, 0)),
            unit_bytes={u.name: u.padded_numel * itemsize for u in engine.units},
            kinds=engine.memory_report()["kinds"],
        )


def check_parity(run: RankRun, ref: Reference, *, tolerance: float) -> None:
    """Every parameter within `tolerance` (norm-wise relative), every step's loss within 1e-4."""
    assert run.steps_taken == len(ref.losses)
    assert run.params is not None and set(run.params) == set(ref.params) | {"head.weight"}
    errors = {name: rel_error(run.params[name], expected) for name, expected in ref.params.items()}
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= tolerance, f"{worst}: relative error {errors[worst]:.2e} > {tolerance:.0e}"
    # The tied LM head is the embedding, not a copy that drifted.
    assert run.params["head.weight"].equal(run.params["embed.weight"])
    diffs = [abs(a - b) for a, b in zip(run.losses, ref.losses, strict=True)]
    assert max(diffs) <= 1e-4, f"loss differs by {max(diffs):.2e} at step {diffs.index(max(diffs))}"


def tiny_train_config(directory: Path, *, steps: int, **sections: Any) -> Path:
    """A `tierzero train` config for a 2-layer GPT on a little of the standard library's text, written to `directory`."""
    config = directory / "tiny.yaml"
    config.write_text(yaml.safe_dump({
        "zero": {"stage": 3},
        "optimizer": {"type": "adamw", "lr": 1e-3},
        "model": {"type": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 32},
        "data": {"max_bytes": "256KiB"},
        "train": {"steps": steps, "micro_batch_size": 2, "seq_len": 32},
        **sections,
    }))  # fmt: skip
    return config


def measure_comm(case: Case, *, rank: int, world_size: int) -> dict[str, Any]:
    """Two steps of `case`; each unit's shard size and the second step's bytes by group and link."""
    import tierzero

    with tierzero.initialize(case.model(), case.config()) as engine:
        for step in range(2):
            engine.reset_comm_report()
            engine.backward(case.loss(engine, *case.micro_batch(step, micro=0, rank=rank, world_size=world_size)))
            engine.step()
        return {"shards": [u.shard_numel for u in engine.units], "groups": engine.comm_report(per_group=True)}
