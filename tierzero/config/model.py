"""The `model` section: which model `tierzero train` builds, and the bounds that keep a built-in one buildable.

Each size field has a limit well past any model trained today, and the parameter count of
a built-in model (computed from the fields, exactly as tierzero.models.builtin builds it) is held
under MAX_PARAMETERS, so a typo such as `n_layer: 1e7` is refused at once instead of
spending minutes building modules that could never be trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from tierzero.config.checks import (
    BOOL,
    DIRECTORY,
    KEYWORDS,
    OPTIONAL_NAME,
    Check,
    choice_check,
    float_check,
    int_check,
)
from tierzero.config.errors import ConfigError
from tierzero.config.hf_sizes import size_problem
from tierzero.config.tree import Section, section, setting

MODEL_TYPES = ("gpt", "llama", "transformers")
MAX_PARAMETERS = 10**13
"""Parameters of a built-in model: 160 TB of fp32 training state at 16 bytes a parameter."""


def _target_modules(value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, str) and v.strip() for v in value):
        raise ValueError(value)
    return tuple(value)


BASE_DTYPES = ("param", "fp32", "bf16", "fp16", "int8", "nf4")
QUANTIZED_BASE = ("int8", "nf4")
_DOUBLE_QUANT_ALONE = "model.lora.double_quant needs model.lora.base_dtype nf4: set both or neither"


TARGET_MODULES = Check("a list of module names such as [q_proj, v_proj] (or null)", "list[str] \\| null", _target_modules)


@dataclass(kw_only=True, slots=True, frozen=True)
class LoraConfig(Section):
    """LoRA adapters (through peft) on a frozen base: only the adapters are trained and carry
    optimizer states; the base is sharded and placed like any parameter (offload.params)."""

    SECTION: ClassVar[str] = "model.lora"
    r: int = setting(0, int_check(0, limit=1 << 16))
    """Rank of the adapters; 0 trains the whole model, without LoRA."""
    alpha: float = setting(16.0, float_check(lo=0.0, lo_open=True))
    """Scale of the adapters' output: alpha / r multiplies it (peft's lora_alpha)."""
    dropout: float = setting(0.0, float_check(lo=0.0, hi=1.0))
    """Dropout on the adapters' input (peft's lora_dropout)."""
    target_modules: tuple[str, ...] | None = setting(None, TARGET_MODULES)
    """Names of the Linear modules that get adapters; null: peft's default for the architecture
    (e.g. q_proj and v_proj for Llama)."""
    base_dtype: str = setting("param", choice_check(BASE_DTYPES))
    """How the frozen base is stored on its tier and in transfers: param (precision.param_dtype, the
    same name spelled out is equal), or int8 / nf4 (QLoRA), block-wise quantized once as it comes in
    (64-element blocks, an fp32 absmax each) and dequantized to the param dtype after each gather."""
    double_quant: bool = setting(False, BOOL)
    """With base_dtype nf4: double-quantize the absmax (8-bit codes, an fp32 scale per 256 blocks),
    0.516 bytes per parameter instead of 0.5625."""

    def quantized(self, param_dtype: str) -> str | None:
        """The quantized base dtype (int8 or nf4), None when the base is kept in `param_dtype`; refuses the
        combinations that are not built, in one line naming model.lora.base_dtype."""
        dtype = param_dtype if self.base_dtype == "param" else self.base_dtype
        if dtype == param_dtype:
            if self.double_quant:
                raise ConfigError(_DOUBLE_QUANT_ALONE, key="model.lora.double_quant")
            return None
        if self.r == 0:
            raise ConfigError(
                f"model.lora.base_dtype is {dtype} but model.lora.r is 0: only a frozen LoRA base is kept "
                "quantized; set model.lora.r (e.g. 8) or model.lora.base_dtype to param",
                key="model.lora.base_dtype",
            )
        if dtype not in QUANTIZED_BASE:
            raise ConfigError(
                f"model.lora.base_dtype {dtype} differs from precision.param_dtype {param_dtype}: a base stored in "
                "another float dtype is not supported; use param, int8 or nf4",
                key="model.lora.base_dtype",
            )
        if self.double_quant and dtype != "nf4":
            raise ConfigError(_DOUBLE_QUANT_ALONE, key="model.lora.double_quant")
        return dtype


@dataclass(kw_only=True, slots=True, frozen=True)
class ModelConfig(Section):
    """The model `tierzero train` builds, with fresh random weights: a built-in GPT or Llama, or a
    transformers class by name. The size fields apply to the built-ins."""

    SECTION: ClassVar[str] = "model"
    type: str = setting("gpt", choice_check(MODEL_TYPES))
    """gpt (pre-LN, learned positions, tied head), llama (RMSNorm, rotary, SwiGLU, untied head) or
    transformers."""
    vocab_size: int = setting(256, int_check(1, limit=1 << 24))
    """Vocabulary size; 256 for the byte-level data."""
    n_layer: int = setting(2, int_check(1, limit=1024))
    """Transformer blocks (one engine unit each)."""
    n_head: int = setting(2, int_check(1, limit=1024))
    """Attention heads; must divide model.d_model."""
    d_model: int = setting(64, int_check(1, limit=1 << 16))
    """Hidden width."""
    d_ff: int = setting(256, int_check(1, limit=1 << 18))
    """Width of the MLP's inner layer."""
    max_seq_len: int = setting(128, int_check(1, limit=1 << 20))
    """Longest sequence the built-in model takes (the GPT's learned positions, the Llama's rotary table);
    with model.pretrained the checkpoint's config.json says it."""
    dropout: float = setting(0.0, float_check(lo=0.0, hi=1.0))
    """Dropout probability (0 keeps runs deterministic)."""
    transformers_class: str | None = setting(None, OPTIONAL_NAME)
    """type transformers: the model class, e.g. GPT2LMHeadModel or LlamaForCausalLM."""
    transformers_config: dict[str, Any] = setting({}, KEYWORDS)
    """type transformers: keyword arguments of the class's config (e.g. GPT2Config); nothing is
    downloaded."""
    pretrained: str | None = setting(None, DIRECTORY)
    """A transformers model directory (config.json and model.safetensors, or sharded safetensors
    with their index) to start from: the model is built from its config.json on the meta device
    and each unit read from the files straight into its slices, each rank reading only what it
    keeps. The other model keys are then unused."""
    lora: LoraConfig = section(LoraConfig)

    def _validate(self) -> None:
        if self.pretrained is not None:
            return  # the directory's config.json says what the model is
        if self.type == "transformers":
            if self.transformers_class is None:
                raise ConfigError(
                    "model.type is transformers but model.transformers_class is not set: name a class such as "
                    "GPT2LMHeadModel, or set model.type to gpt or llama",
                    key="model.transformers_class",
                )
            if (problem := size_problem(self.transformers_config)) is not None:
                key, what = problem
                raise ConfigError(f"model.transformers_config: {what}: fix model.transformers_config.{key}",
                                  key=f"model.transformers_config.{key}")
            return
        if self.d_model % self.n_head:
            raise ConfigError(
                f"model.d_model {self.d_model} is not a multiple of model.n_head {self.n_head}: "
                "pick d_model = n_head x head size",
                key="model.d_model",
            )
        count = self.parameter_count()
        if count > MAX_PARAMETERS:
            raise ConfigError(
                f"model.n_layer {self.n_layer}, d_model {self.d_model}, d_ff {self.d_ff} and vocab_size "
                f"{self.vocab_size} make a {self.type} of {count:.2e} parameters, above the limit of "
                f"{MAX_PARAMETERS:.0e}: lower model.n_layer, model.d_model or model.d_ff",
                key="model.n_layer",
            )

    @property
    def is_transformers(self) -> bool:
        """A transformers model (by class name, or from a pretrained directory): it takes
        `input_ids` and returns an output with `.logits`, where the built-ins take (tokens, targets)."""
        return self.type == "transformers" or self.pretrained is not None

    def parameter_count(self) -> int:
        """Parameters of the built-in model (gpt or llama) these fields describe, tied weights once."""
        d, f, layers = self.d_model, self.d_ff, self.n_layer
        if self.type == "gpt":
            # Token and position embeddings (the head is tied to the first); per block two LayerNorms,
            # qkv and output projections, the MLP, all with biases; the final LayerNorm.
            block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
            return self.vocab_size * d + self.max_seq_len * d + layers * block + 2 * d
        if self.type == "llama":
            # Embedding and untied head; per block two RMSNorms, four attention and three MLP matrices; the final norm.
            block = 2 * d + 4 * d * d + 3 * d * f
            return 2 * self.vocab_size * d + layers * block + d
        raise ValueError(f"model.type {self.type}: only the built-in models have a parameter count here")
