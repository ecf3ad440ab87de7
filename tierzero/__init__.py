"""tierzero: a ZeRO engine for PyTorch whose shards live in GPU memory, host memory and NVMe."""

from tierzero.api import initialize
from tierzero.engine import Engine

__version__ = "0.1.0"

__all__ = ["Engine", "initialize"]
