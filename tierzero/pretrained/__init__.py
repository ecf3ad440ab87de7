"""Pretrained transformers weights streamed from a model directory into units: the directory
and its safetensors headers (files.py); the model built on meta, the fit check and the
ranged reads (weights.py). See [Note: streamed pretrained weights] in weights.py."""

from tierzero.pretrained.files import PretrainedError, TensorInfo
from tierzero.pretrained.weights import PretrainedWeights, build_meta_model

__all__ = ["PretrainedError", "PretrainedWeights", "TensorInfo", "build_meta_model"]
