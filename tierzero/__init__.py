"""tierzero: a ZeRO engine for PyTorch whose shards live in GPU memory, host memory and NVMe."""

__version__ = "0.1.0"
