"""Built-in language models for `tierzero train`: a GPT and a Llama, plus transformers by name.

Both built-ins are plain `nn.Module`s whose transformer blocks sit in one `nn.ModuleList`
(`model.blocks`), so the engine cuts one unit per block and puts everything else (the
embeddings, the final norm, the head) in its root unit. `forward(idx, targets=None)`
returns the logits, or `(logits, loss)` when targets are given.

[Note: construction memory]
Parameters are allocated once, on the device the module is built on, and initialised in
place; nothing is built in fp32 and then copied. Build under `torch.device("meta")`
(`build_model(..., device="meta")`) to allocate nothing at all, then `materialize(model)`
allocates and initialises, either the whole model or one submodule at a time.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tierzero.models.by_name import transformers_model
from tierzero.models.kv_cache import CachedAttention, KVCache
from tierzero.pretrained import build_meta_model
from tierzero.pretrained.lora import apply_lora

__all__ = [
    "GPT",
    "PRESETS",
    "Llama",
    "ModelSpec",
    "build_model",
    "count_parameters",
    "materialize",
    "spec_from_config",
]

INIT_STD = 0.02


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpec:
    """The shape of a built-in model."""

    vocab_size: int = 256
    """256 for byte-level text."""
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64
    d_ff: int = 256
    max_seq_len: int = 128
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "d_model", "d_ff", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} is {getattr(self, name)}, expected a positive integer")
        if self.d_model % self.n_head:
            raise ValueError(
                f"model.d_model {self.d_model} is not a multiple of model.n_head {self.n_head}: "
                "pick d_model = n_head x head size"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout is {self.dropout}, expected a number in [0, 1)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


PRESETS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(n_layer=2, n_head=2, d_model=64, d_ff=256, max_seq_len=128),
    "demo": ModelSpec(n_layer=6, n_head=4, d_model=256, d_ff=1024, max_seq_len=256),
    # The overlap benchmark: 8 layers, hidden 512, about 30M parameters as a GPT.
    "30m": ModelSpec(n_layer=8, n_head=8, d_model=512, d_ff=2560, max_seq_len=512),
    # About 2.04B parameters as a GPT: 32.7 GB of fp32 training state at 16 bytes a parameter.
    "2b": ModelSpec(n_layer=26, n_head=20, d_model=2560, d_ff=10240, max_seq_len=1024),
}
"""Named sizes; `count_parameters(GPT(PRESETS[name]))` gives the exact counts."""


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dropout: float) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True)


def _lm_output(logits: torch.Tensor, targets: torch.Tensor | None) -> Any:
    if targets is None:
        return logits
    loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
    return logits, loss


# ---------------------------------------------------------------- GPT


class GPTBlock(nn.Module):
    """Pre-LN block: x + attn(ln(x)), then x + mlp(ln(x)) with a GELU MLP."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.ln_1 = nn.LayerNorm(spec.d_model)
        self.qkv = nn.Linear(spec.d_model, 3 * spec.d_model)
        self.proj = nn.Linear(spec.d_model, spec.d_model)
        self.ln_2 = nn.LayerNorm(spec.d_model)
        self.fc = nn.Linear(spec.d_model, spec.d_ff)
        self.fc_out = nn.Linear(spec.d_ff, spec.d_model)
        self.drop = nn.Dropout(spec.dropout)

    def forward(self, x: torch.Tensor, *, cache: CachedAttention | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(b, t, 3, self.spec.n_head, self.spec.head_dim).unbind(2)
        dropout = self.spec.dropout if self.training else 0.0
        if cache is not None:
            y = cache.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        else:
            y = _causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout=dropout)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.fc_out(F.gelu(self.fc(self.ln_2(x)))))


class GPT(nn.Module):
    """GPT-2 style: learned positions, pre-LN blocks, final LayerNorm, head tied to the embedding."""

    Block = GPTBlock

    @staticmethod
    def block_inputs(spec: ModelSpec, seq_len: int) -> tuple[torch.Tensor, ...]:
        """What a block takes besides the hidden states at `seq_len` tokens: nothing."""
        return ()

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.tok_emb = _embedding(spec.vocab_size, spec.d_model)
        self.pos_emb = _embedding(spec.max_seq_len, spec.d_model)
        self.drop = nn.Dropout(spec.dropout)
        self.blocks = nn.ModuleList(GPTBlock(spec) for _ in range(spec.n_layer))
        self.ln_f = nn.LayerNorm(spec.d_model)
        self.lm_head = nn.Linear(spec.d_model, spec.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        self.init_weights()

    def init_weights(self) -> None:
        """GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layer), zero biases."""
        for module in self.modules():
            self.init_module(module)

    def init_module(self, module: nn.Module) -> None:
        """Initialise `module`'s own parameters (not its children's) as `init_weights` does.

        The engine calls it unit by unit on a meta-built model (see tierzero/engine/engine.py).
        """
        if isinstance(module, (nn.Linear, nn.Embedding)) and module.weight.device.type != "meta":
            residual = any(module is block.proj or module is block.fc_out for block in self.blocks)
            _normal_(module.weight, std=_residual_std(self.spec) if residual else INIT_STD)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm) and module.weight.device.type != "meta":
            module.reset_parameters()

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, cache: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> Any:  # fmt: skip
        """Logits (and the loss with `targets`); with `cache`, `idx` follows the tokens cached, which
        `attention_mask` (batch, cached + new) marks as real or padding (tierzero/models/kv_cache.py)."""
        _check_length(idx, self.spec, cache=cache, attention_mask=attention_mask)
        if cache is None:
            pos, extra = torch.arange(idx.shape[1], device=idx.device), [{}] * len(self.blocks)
        else:
            window = cache.open(idx, attention_mask)
            pos, extra = window.positions, [{"cache": layer} for layer in cache.attention(window)]
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block, kwargs in zip(self.blocks, extra, strict=True):
            x = block(x, **kwargs)
        return _lm_output(self.lm_head(self.ln_f(x)), targets)


# ---------------------------------------------------------------- Llama


class RMSNorm(nn.Module):
    def __init__(self, dim: int, *, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rotary_tables(*, head_dim: int, max_seq_len: int, base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (max_seq_len, head_dim // 2) for rotating (even, odd) pairs."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (even, odd) feature pair of x (b, h, t, d) by its position's angle."""
    even, odd = x.float()[..., 0::2], x.float()[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


class LlamaBlock(nn.Module):
    """RMSNorm, rotary multi-head attention without biases, RMSNorm, SwiGLU MLP."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.attn_norm = RMSNorm(spec.d_model)
        self.wq = nn.Linear(spec.d_model, spec.d_model, bias=False)
        self.wk = nn.Linear(spec.d_model, spec.d_model, bias=False)
        self.wv = nn.Linear(spec.d_model, spec.d_model, bias=False)
        self.wo = nn.Linear(spec.d_model, spec.d_model, bias=False)
        self.mlp_norm = RMSNorm(spec.d_model)
        self.w_gate = nn.Linear(spec.d_model, spec.d_ff, bias=False)
        self.w_up = nn.Linear(spec.d_model, spec.d_ff, bias=False)
        self.w_down = nn.Linear(spec.d_ff, spec.d_model, bias=False)
        self.drop = nn.Dropout(spec.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, cache: CachedAttention | None = None) -> torch.Tensor:
        b, t, d = x.shape
        h = self.attn_norm(x)
        q, k, v = (w(h).view(b, t, self.spec.n_head, self.spec.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        dropout = self.spec.dropout if self.training else 0.0
        if cache is not None:
            y = cache.attend(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v)
        else:
            y = _causal_attention(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v, dropout=dropout)
        x = x + self.drop(self.wo(y.transpose(1, 2).reshape(b, t, d)))
        h = self.mlp_norm(x)
        return x + self.drop(self.w_down(F.silu(self.w_gate(h)) * self.w_up(h)))


class Llama(nn.Module):
    """Llama style: rotary positions, RMSNorm, SwiGLU, an untied output head."""

    Block = LlamaBlock

    @staticmethod
    def block_inputs(spec: ModelSpec, seq_len: int) -> tuple[torch.Tensor, ...]:
        """What a block takes besides the hidden states at `seq_len` tokens: the rotary tables."""
        cos, sin = rotary_tables(head_dim=spec.head_dim, max_seq_len=spec.max_seq_len)
        return cos[:seq_len], sin[:seq_len]

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        if spec.head_dim % 2:
            raise ValueError(f"llama head size d_model / n_head = {spec.head_dim} is odd: rotary needs an even head size")
        self.spec = spec
        self.tok_emb = _embedding(spec.vocab_size, spec.d_model)
        self.drop = nn.Dropout(spec.dropout)
        self.blocks = nn.ModuleList(LlamaBlock(spec) for _ in range(spec.n_layer))
        self.norm = RMSNorm(spec.d_model)
        self.lm_head = nn.Linear(spec.d_model, spec.vocab_size, bias=False)
        # Derived tables, not state: recomputed by init_weights, never saved.
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.init_weights()

    def init_weights(self) -> None:
        """N(0, 0.02) linears and embedding, output projections scaled by 1/sqrt(2 n_layer), unit norms."""
        for module in self.modules():
            self.init_module(module)

    def init_module(self, module: nn.Module) -> None:
        """Initialise `module`'s own parameters and buffers (not its children's) as `init_weights` does.

        The engine calls it unit by unit on a meta-built model; on the model itself it
        recomputes the rotary tables once they are no longer on the meta device.
        """
        if isinstance(module, (nn.Linear, nn.Embedding)) and module.weight.device.type != "meta":
            residual = any(module is block.wo or module is block.w_down for block in self.blocks)
            _normal_(module.weight, std=_residual_std(self.spec) if residual else INIT_STD)
        elif isinstance(module, RMSNorm) and module.weight.device.type != "meta":
            module.reset_parameters()
        elif module is self and self.rope_cos.device.type == "meta":
            # Shapes only, for `tierzero estimate`'s forward on the meta device.
            shape = (self.spec.max_seq_len, self.spec.head_dim // 2)
            self.rope_cos, self.rope_sin = torch.empty(shape, device="meta"), torch.empty(shape, device="meta")
        elif module is self:
            cos, sin = rotary_tables(head_dim=self.spec.head_dim, max_seq_len=self.spec.max_seq_len)
            self.rope_cos, self.rope_sin = cos.to(self.rope_cos.device), sin.to(self.rope_cos.device)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, cache: KVCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> Any:  # fmt: skip
        """As `GPT.forward`; with `cache`, each row's rotary angles are those of its own positions."""
        t = _check_length(idx, self.spec, cache=cache, attention_mask=attention_mask)
        if cache is None:
            cos, sin, extra = self.rope_cos[:t], self.rope_sin[:t], [{}] * len(self.blocks)
        else:
            window = cache.open(idx, attention_mask)
            # (batch, 1, new, head size / 2): one angle table per row, broadcast over the heads
            cos, sin = self.rope_cos[window.positions].unsqueeze(1), self.rope_sin[window.positions].unsqueeze(1)
            extra = [{"cache": layer} for layer in cache.attention(window)]
        x = self.drop(self.tok_emb(idx))
        for block, kwargs in zip(self.blocks, extra, strict=True):
            x = block(x, cos, sin, **kwargs)
        return _lm_output(self.lm_head(self.norm(x)), targets)


def _check_length(idx: torch.Tensor, spec: ModelSpec, *, cache: KVCache | None, attention_mask: torch.Tensor | None) -> int:
    """The new tokens' count, refused past model.max_seq_len (cached tokens included); a mask needs a cache."""
    t = idx.shape[1] + (0 if cache is None else cache.length)
    if t > spec.max_seq_len:
        raise ValueError(f"sequence length {t} is above model.max_seq_len {spec.max_seq_len}: shorten it")
    if attention_mask is not None and cache is None:
        raise ValueError("attention_mask is for cached decoding: pass a KVCache with it (tierzero.models.kv_cache)")
    return idx.shape[1]


def _normal_(weight: torch.Tensor, *, std: float) -> None:
    nn.init.normal_(weight, mean=0.0, std=std)


def _residual_std(spec: ModelSpec) -> float:
    # GPT-2's scaling: each block adds two residual branches, so 2 n_layer of them in all.
    return INIT_STD / math.sqrt(2 * spec.n_layer)


# ---------------------------------------------------------------- building


BUILT_IN: dict[str, type[GPT] | type[Llama]] = {"gpt": GPT, "llama": Llama}


def spec_from_config(model_cfg: Any) -> ModelSpec:
    """The `ModelSpec` of a `model` config section (or anything with the same attributes)."""
    return ModelSpec(
        vocab_size=model_cfg.vocab_size,
        n_layer=model_cfg.n_layer,
        n_head=model_cfg.n_head,
        d_model=model_cfg.d_model,
        d_ff=model_cfg.d_ff,
        max_seq_len=model_cfg.max_seq_len,
        dropout=model_cfg.dropout,
    )


def _embedding(rows: int, dim: int) -> nn.Embedding:
    """An embedding whose weight `init_module` draws, once: torch's own draw would be thrown away,
    and on the meta device its normal_ imports torch._dynamo (seconds of every run's start-up)."""
    return nn.Embedding(rows, dim, _weight=torch.empty(rows, dim))


def build_model(model_cfg: Any, *, device: str | torch.device | None = None, seed: int = 0) -> nn.Module:
    """The model a `model` config section describes, with fresh random weights.

    `model_cfg.type` is gpt, llama or transformers; for transformers,
    `model_cfg.transformers_class` names a class of the transformers package (e.g.
    GPT2LMHeadModel) and `model_cfg.transformers_config` holds the keyword arguments of
    its config class. Nothing is downloaded. `device="meta"` allocates nothing: see
    `materialize`. With `model_cfg.pretrained` set, the model is the one that directory's
    config.json describes, always on the meta device: its weights come from the files.
    With `model_cfg.lora.r` > 0, peft wraps it with LoRA adapters initialised from `seed`
    (tierzero.pretrained.lora), the base frozen.
    """
    model = _base_model(model_cfg, device=device)
    lora = getattr(model_cfg, "lora", None)
    if lora is None or lora.r == 0:
        return model
    return apply_lora(
        model, r=lora.r, alpha=lora.alpha, dropout=lora.dropout, target_modules=lora.target_modules, seed=seed
    )


def _base_model(model_cfg: Any, *, device: str | torch.device | None) -> nn.Module:
    if getattr(model_cfg, "pretrained", None) is not None:
        return build_meta_model(model_cfg.pretrained)
    kind = model_cfg.type
    with torch.device(device) if device is not None else nullcontext():
        if kind in BUILT_IN:
            return BUILT_IN[kind](spec_from_config(model_cfg))
        if kind == "transformers":
            return transformers_model(model_cfg.transformers_class, dict(model_cfg.transformers_config or {}), device=device)
    raise ValueError(f"model.type is {kind!r}, expected one of gpt, llama, transformers")


def materialize(module: nn.Module, *, device: str | torch.device = "cpu") -> nn.Module:
    """Allocate a meta-built module (or one of its submodules) on `device` and initialise it.

    The root model's `init_weights` is called when `module` is a built-in model; a
    submodule gets its layers' own `reset_parameters`, which is the init a unit-by-unit
    materialisation can afford without the whole model.
    """
    module.to_empty(device=device)
    if isinstance(module, (GPT, Llama)):
        module.init_weights()
        if isinstance(module, GPT):
            module.lm_head.weight = module.tok_emb.weight
        return module
    for sub in module.modules():
        if isinstance(sub, (nn.Linear, nn.Embedding)):
            _normal_(sub.weight, std=INIT_STD)
            if isinstance(sub, nn.Linear) and sub.bias is not None:
                nn.init.zeros_(sub.bias)
        elif isinstance(sub, (nn.LayerNorm, RMSNorm)):
            sub.reset_parameters()
    return module


def count_parameters(model: nn.Module, *, trainable_only: bool = False) -> int:
    """Elements of the model's distinct parameters (a tied weight counts once); meta works too."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)
