"""Pinned host memory: every `cudaHostRegister` the host tier makes, and its undoing, in one registry.

[Note: pinned registrations]
`cudaHostRegister` pins a range of pages for the GPU's copy engines. Registering a range that
overlaps a live registration fails (cudaErrorHostMemoryAlreadyRegistered, 712), and memory
freed while registered stays registered: the next block the C library places on those pages
cannot be pinned (712), or is mapped twice ("part or all of the requested memory range is
already mapped"). The first GPU run hit both (../shared/gpu-h200/README.md): buffers of a store
dropped without their tier's close went back to the heap still registered, and the heap kept
freed for reuse (`tiers.cpu.keep_freed`) handed those pages to the next engine's buffers.

So the host tier pins only through `PinnedRegistry.pin`, which refuses a range overlapping one
it holds (naming both) before CUDA sees it, and a range is unregistered exactly once: when the
tier unpins it (before dropping a buffer it does not keep), or at the latest when the tensor
that owns its memory is collected, by a finalizer that runs before the memory goes back to the
allocator. CUDA's registrations belong to the process, so one registry per process mirrors
them (`pinned_registry`); tests hand a tier a registry over a fake runtime, which is how the
CPU runs every path here.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["CudaRuntime", "PinnedRange", "PinnedRegistry", "pinned_registry"]

HOST_REGISTER_PORTABLE = 1
"""Pinned for every CUDA context, not only the current device's."""


class CudaRuntime(Protocol):
    """The two calls of the CUDA runtime the registry makes (`torch.cuda.cudart()` has them)."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int: ...  # noqa: N802 - CUDA's name

    def cudaHostUnregister(self, ptr: int) -> int: ...  # noqa: N802 - CUDA's name


@dataclass(frozen=True, slots=True)
class PinnedRange:
    """Bytes [start, start + nbytes) registered with CUDA."""

    start: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.start + self.nbytes

    def overlaps(self, other: PinnedRange) -> bool:
        return self.start < other.end and other.start < self.end


class PinnedRegistry:
    """The live registrations of this process's host tiers; see [Note: pinned registrations]."""

    def __init__(self, cudart: CudaRuntime | None = None) -> None:
        self._cudart = cudart
        """The runtime to call; None: CUDA's own, looked up at the first call."""
        self._live: dict[int, PinnedRange] = {}
        self._finalizers: dict[int, weakref.finalize] = {}
        # Reentrant: a finalizer may run on this thread, from a collection inside a locked block.
        self._lock = threading.RLock()

    @property
    def available(self) -> bool:
        """Whether pinning can happen at all: a runtime was given, or CUDA is present."""
        return self._cudart is not None or torch.cuda.is_available()

    def live(self) -> list[PinnedRange]:
        """The ranges registered now, in address order."""
        with self._lock:
            return sorted(self._live.values(), key=lambda r: r.start)

    def pin(self, buffer: torch.Tensor) -> None:
        """Register `buffer`'s bytes; unregistered by `unpin`, or when the memory's owner is collected."""
        wanted = PinnedRange(buffer.data_ptr(), buffer.numel() * buffer.element_size())
        with self._lock:
            clash = next((live for live in self._live.values() if live.overlaps(wanted)), None)
            if clash is not None:
                raise RuntimeError(
                    f"pinning {wanted.nbytes} bytes at {wanted.start:#x} overlaps the live registration of "
                    f"{clash.nbytes} bytes at {clash.start:#x}: a pinned buffer's memory was reused before it was unpinned"
                )
            error = int(self._runtime().cudaHostRegister(wanted.start, wanted.nbytes, HOST_REGISTER_PORTABLE))
            if error != 0:
                raise RuntimeError(f"cudaHostRegister of {wanted.nbytes} bytes at {wanted.start:#x} failed with cudaError {error}")
            self._live[wanted.start] = wanted
            owner = buffer if buffer._base is None else buffer._base
            self._finalizers[wanted.start] = weakref.finalize(owner, self._release, wanted.start)

    def unpin(self, buffer: torch.Tensor) -> None:
        """Unregister `buffer`'s bytes, which `pin` registered; the caller then drops or frees it."""
        start = buffer.data_ptr()
        with self._lock:
            finalizer = self._finalizers.pop(start, None)
            assert finalizer is not None, f"unpinning {start:#x}, which this registry did not pin (or unpinned already)"
            finalizer.detach()
            self._release(start)

    def _release(self, start: int) -> None:
        with self._lock:
            self._finalizers.pop(start, None)
            if self._live.pop(start, None) is None:
                return
            error = int(self._runtime().cudaHostUnregister(start))
        assert error == 0, f"cudaHostUnregister at {start:#x} failed with cudaError {error}"

    def _runtime(self) -> CudaRuntime:
        return self._cudart if self._cudart is not None else torch.cuda.cudart()


_PROCESS_REGISTRY = PinnedRegistry()


def pinned_registry() -> PinnedRegistry:
    """The registry of this process's CUDA registrations (CUDA keeps them per process)."""
    return _PROCESS_REGISTRY
