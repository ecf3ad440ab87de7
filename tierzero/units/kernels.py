"""Kernels the engine may run in place of PyTorch's own: oneDNN's fp32 linear layer on the CPU.

[Note: the oneDNN linear]
PyTorch computes an fp32 `nn.Linear` on the CPU with MKL's sgemm. At the few tokens of
an offloaded fine-tuning step (64 on the oversized preset) that call packs the whole
weight on every use, and on an AMD host MKL picks its generic kernels: 100-131 GFLOP/s
on one dev machine's two cores, against 173-184 for the JIT kernels of oneDNN, which
PyTorch ships for its compiled CPU linear (`torch.ops.mkldnn._linear_pointwise`).
`precision.linear_kernel: onednn` runs each `nn.Linear`'s forward there.

The backward's two products go to whichever library this host runs faster at their
shape: the input gradient on oneDNN (against the transposed weight) or PyTorch's `mm`,
the weight gradient on `mm` or oneDNN (on transposed copies). Which one wins depends on
the CPU: on a Zen 1 host oneDNN took 61-193 ms for the 2B preset's input gradients where
`mm` took 40-64, and the block's forward and backward ran 58 GFLOP/s against 41
(docs/benchmarks-journal.md, session 26), while on the EPYC of sessions 10-21 oneDNN's forward and
input gradient together took the block from 79-90 GFLOP/s to 119-120 (session 13). So, as
`torch.backends.cudnn.benchmark` does on a GPU, the first backward of each layer shape
times both (`_fastest`: the best of a few alternating runs) and the process keeps the
faster for that shape; `chosen()` says what was kept. The token
counts go in powers of two (33-64 tokens are one shape), so a run whose batches vary in
length times each layer a few times, not once per length. Each choice is kept for a day
(`KEEP_S`) in `$TIERZERO_CACHE_DIR/kernels.json`, under the machine it was timed on (the
CPU's model, the threads torch computes with, torch's version): the processes of one
machine that day take the same kernels without timing them again (a few seconds for the
2B preset's shapes on a slow CPU), so they compute the same bits. An entry that cannot be
read is timed again and rewritten.

Both libraries compute in IEEE fp32, but they add a row's products in a different
order, so the bits differ from PyTorch's in the last places, and two machines whose
timings chose differently differ from each other there too; hence opt-in, and `torch`
(plain `F.linear`) by default, which tierzero's bit-for-bit tests hold to.

Only where both kernels compute the same thing: fp32 input and weight on the CPU,
outside autocast (which lowers the layer to bf16, where PyTorch already uses oneDNN).
Anything else, a GPU included, takes `F.linear`. Only modules of exactly the type
`nn.Linear` change (not subclasses such as quantized or adapter layers, whose forward
is their own); their `forward` becomes the dispatch below, recomputation under
activation checkpointing included.
"""

from __future__ import annotations

import functools
import logging
import math
import platform
import time
import types
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tierzero.common.cache_files import cache_path, read_json, write_json
from tierzero.config.precision import LINEAR_KERNELS

__all__ = [
    "KEEP_S", "KERNELS_FILE", "OneDnnLinear", "chosen", "chosen_text", "machine", "onednn_available",
    "use_linear_kernel",
]  # fmt: skip

log = logging.getLogger(__name__)

#: Timed runs of each candidate product, alternating, before `_fastest` keeps the best.
ROUNDS = 3
#: The file of this machine's choices under the cache directory, and how long one holds (seconds).
KERNELS_FILE = "kernels.json"
KEEP_S = 86400.0

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def onednn_available() -> bool:
    """Whether this PyTorch build has the oneDNN linear (`torch.ops.mkldnn._linear_pointwise`)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return torch.ops.mkldnn._linear_pointwise.default is not None
    except (AttributeError, RuntimeError):
        return False


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _input_grad_onednn(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return _onednn(grad, weight.t(), None)


def _input_grad_mm(grad: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return grad.mm(weight)


def _weight_grad_mm(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return grad.t().mm(x)


def _weight_grad_onednn(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return _onednn(grad.t().contiguous(), x.t().contiguous(), None)


#: The candidates of each product of the backward, by name: (a, b) -> the product.
CANDIDATES: dict[str, dict[str, Product]] = {
    "input gradient": {"onednn": _input_grad_onednn, "mm": _input_grad_mm},
    "weight gradient": {"mm": _weight_grad_mm, "onednn": _weight_grad_onednn},
}

_Key = tuple[str, int, int, int, torch.dtype]
#: (product, in features, out features, tokens rounded up to a power of two, dtype) -> the
#: candidate this process keeps, and each one's best time.
_kept: dict[_Key, tuple[str, dict[str, float]]] = {}


def chosen() -> dict[str, str]:
    """What the backward runs in this process, by product and layer shape: 'input gradient of 2560
    -> 10240 at 33-64 tokens' -> 'mm 54.1 ms, onednn 160.3 ms'."""
    return dict(_said(key, kept) for key, kept in _kept.items())


def chosen_text() -> str | None:
    """Where the backward's products ran in this process, in one line: 'input gradient on mm (4
    shapes); weight gradient on onednn (3 shapes), mm (1)', shapes as `chosen()` counts them;
    None before a backward chose any."""
    kept: dict[str, Counter[str]] = {}
    for (product, *_), (name, _) in _kept.items():
        kept.setdefault(product, Counter())[name] += 1
    parts = []
    for product, names in kept.items():
        (first, n), *rest = names.most_common()
        shapes = f"{n} shape{'s' if n > 1 else ''}"
        parts.append(f"{product} on {first} ({shapes})" + "".join(f", {name} ({k})" for name, k in rest))
    return "; ".join(parts) or None


def _said(key: _Key, kept: tuple[str, dict[str, float]]) -> tuple[str, str]:
    (product, inputs, outputs, tokens, _), (name, seconds) = key, kept
    times = [name] + [other for other in seconds if other != name]
    return (
        f"{product} of {inputs} -> {outputs} at {tokens // 2 + 1}-{tokens} tokens",
        ", ".join(f"{other} {1e3 * seconds[other]:.1f} ms" for other in times),
    )


def _fastest(product: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`product` of `a`, the output gradient (tokens x out features), and `b`, the weight (input
    gradient) or the input (weight gradient), both 2-D, on the candidate this process keeps for
    the layer's shape, timed at first sight (see the note)."""
    key = (product, b.shape[1], a.shape[1], 1 << (a.shape[0] - 1).bit_length(), a.dtype)
    kept = _kept.get(key)
    if kept is None:
        kept, how = _remembered(key), "kept from an earlier run on this machine"
        if kept is None:
            kept, how = _timed(product, a, b), "timed"
            _remember(key, kept)
        _kept[key] = kept
        log.info("linear %s: %s (%s)", *_said(key, kept), how)
    return CANDIDATES[product][kept[0]](a, b)


def machine() -> str:
    """What a timing holds for: the CPU's model, the threads torch computes with and torch's version."""
    return f"{_cpu_model()}, {torch.get_num_threads()} threads, torch {torch.__version__}"


@functools.cache
def _cpu_model() -> str:
    """'Intel(R) Xeon(R) Processor family 6 model 167', from /proc/cpuinfo (read once a process);
    Python's word for the processor where there is none."""
    cpu = {}
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                name, _, value = line.partition(":")
                if name.strip() in ("model name", "cpu family", "model") and name.strip() not in cpu:
                    cpu[name.strip()] = value.strip()
    except OSError:
        pass
    model = " family ".join(filter(None, [cpu.get("model name"), cpu.get("cpu family")]))
    model += f" model {cpu['model']}" if "model" in cpu else ""
    return model or platform.processor() or platform.machine()


def _entry_name(key: _Key) -> str:
    product, inputs, outputs, tokens, dtype = key
    return f"{product} {inputs}->{outputs} at {tokens} tokens, {str(dtype).removeprefix('torch.')}"


def _remembered(key: _Key) -> tuple[str, dict[str, float]] | None:
    """The choice this machine made for `key` within `KEEP_S`, if the file holds a sound one."""
    entry = read_json(cache_path(KERNELS_FILE)).get(machine())
    entry = entry.get(_entry_name(key)) if isinstance(entry, dict) else None
    if not isinstance(entry, dict):
        return None
    name, seconds = entry.get("kept"), entry.get("seconds")
    candidates = CANDIDATES[key[0]]
    try:
        times = {other: float(seconds[other]) for other in candidates}
    except (TypeError, KeyError, ValueError):
        return None
    fresh = _age(entry, time.time()) <= KEEP_S
    sound = isinstance(name, str) and name in candidates and all(math.isfinite(t) and t > 0 for t in times.values())
    return (name, times) if fresh and sound else None


def _age(entry: Any, now: float) -> float:
    """Seconds since `entry` was measured; infinite where it says no sound time (or one to come)."""
    try:
        age = now - float(entry["measured"])
    except (TypeError, KeyError, ValueError):
        return math.inf
    return age if 0 <= age else math.inf


def _remember(key: _Key, kept: tuple[str, dict[str, float]]) -> None:
    """Add this process's choice for `key` to the machine's file, less the machine's entries over
    `KEEP_S` old; a file it cannot write is left as it is."""
    path, now, here = cache_path(KERNELS_FILE), time.time(), machine()
    known = read_json(path)
    mine = known.get(here)
    mine = {k: e for k, e in mine.items() if _age(e, now) <= KEEP_S} if isinstance(mine, dict) else {}
    mine[_entry_name(key)] = {"kept": kept[0], "seconds": kept[1], "measured": now}
    known[here] = mine
    try:
        write_json(path, known)
    except OSError as err:
        log.warning("linear kernels: cannot keep the choice in %s (%s); it holds for this process", path, err)


def _timed(product: str, a: torch.Tensor, b: torch.Tensor) -> tuple[str, dict[str, float]]:
    """The fastest candidate of `product` and each one's best time, after a warm-up run each."""
    candidates = CANDIDATES[product]
    best = {}
    for name, run in candidates.items():
        run(a, b)
        best[name] = float("inf")
    for _ in range(ROUNDS):
        for name, run in candidates.items():
            began = time.perf_counter()
            run(a, b)
            best[name] = min(best[name], time.perf_counter() - began)
    return min(best, key=best.__getitem__), best


class OneDnnLinear(torch.autograd.Function):
    """`F.linear(x, weight, bias)` with the forward on oneDNN and each gradient on the faster
    library at its shape (see the note)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return _onednn(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        flat = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[0]:
            grad_x = _fastest("input gradient", flat, weight).view(*grad.shape[:-1], weight.shape[1])
        if ctx.needs_input_grad[1]:
            grad_weight = _fastest("weight gradient", flat, x.reshape(-1, x.shape[-1]))
        if ctx.needs_input_grad[2]:  # False for a None bias
            grad_bias = flat.sum(0)
        return grad_x, grad_weight, grad_bias


def _linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight, bias = module.weight, module.bias
    if (
        x.device.type == "cpu"
        and x.dtype == weight.dtype == torch.float32
        and weight.device.type == "cpu"
        and not torch.is_autocast_enabled("cpu")
    ):
        return OneDnnLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def use_linear_kernel(model: nn.Module, kernel: str) -> int:
    """Give every `nn.Linear` of `model` the `kernel`'s forward (see the note); how many changed.
    `torch` changes nothing."""
    if kernel not in LINEAR_KERNELS:
        raise ValueError(f"unknown linear kernel {kernel!r}: one of {', '.join(LINEAR_KERNELS)}")
    if kernel == "torch":
        return 0
    if not onednn_available():
        raise RuntimeError(
            "precision.linear_kernel onednn needs a PyTorch built with oneDNN "
            "(torch.backends.mkldnn.is_available() is False here): set precision.linear_kernel to torch"
        )
    changed = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            # A bound method, so that a deep copy of the model calls its own copy's weights.
            module.forward = types.MethodType(_linear, module)
            changed += 1
    return changed
