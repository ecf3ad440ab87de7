"""tierzero: a ZeRO engine for PyTorch whose shards live in GPU memory, host memory and NVMe."""

from tierzero.engine import Engine, initialize

__version__ = "0.1.0"

__all__ = ["Engine", "initialize"]
