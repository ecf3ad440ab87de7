"""Unit arithmetic: cutting a model into flat padded units, where each element of a slice sits,
compute dtypes and loss scaling, and the CPU kernels the units run."""
