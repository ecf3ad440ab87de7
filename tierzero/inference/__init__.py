"""Using what was trained: generation from a model whose weights live in the tiers."""

from tierzero.inference.generate import GeneratingEngine, generate
from tierzero.inference.sampling import Sampling

__all__ = ["GeneratingEngine", "Sampling", "generate"]
