"""Native host kernels: the optimizer step's elementwise passes fused in C++ where a compiler is
at hand (native/build.py), each checked to give torch's bits before it is used (native/adam.py)."""
