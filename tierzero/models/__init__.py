"""Built-in language models for `tierzero train`, and transformers models by name.

`from tierzero.models import ...` was the import path before the models became a package;
it keeps working for one release (use `tierzero.models.builtin`).
"""

from tierzero.models.builtin import (
    GPT,
    PRESETS,
    Llama,
    ModelSpec,
    build_model,
    count_parameters,
    materialize,
    spec_from_config,
)

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
