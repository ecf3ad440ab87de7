"""`tierzero.lora`, the LoRA helpers' import path until they moved to `tierzero.pretrained.lora`.

Kept for one release so that code written against the README's earlier `from tierzero.lora
import apply_lora` still runs; new code imports `tierzero.pretrained.lora`.
"""

from tierzero.pretrained.lora import (
    adapter_parameter_names,
    adapter_state,
    apply_lora,
    is_peft_model,
    materialize_adapters,
    save_adapters,
    write_adapters,
)

__all__ = [
    "adapter_parameter_names", "adapter_state", "apply_lora", "is_peft_model", "materialize_adapters", "save_adapters",
    "write_adapters",
]  # fmt: skip
