"""tierzero: a ZeRO engine for PyTorch whose shards live in GPU memory, host memory and NVMe."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from tierzero.engine import Engine

__version__ = "0.1.0"


def initialize(model: nn.Module, config: Any) -> Engine:
    """Wrap `model` for ZeRO training; `config` is a .yaml/.yml/.json path, a dict or a Config.

    Imported lazily so that `import tierzero` stays light (no torch.distributed set-up).
    """
    from tierzero.engine import initialize as _initialize

    return _initialize(model, config)
