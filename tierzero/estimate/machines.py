"""The machine a plan is made for when it is not this one: `tierzero estimate --machine NAME|FILE`.

A machine is its GPU (memory, dense bf16 rate, memory bandwidth), the link to its host (PCIe,
each way), its host (memory, cores) and its disk (read and write rates, free space): all the
planner predicts with and fits into. With one, nothing of this host is measured: no matmul,
disk or copy is timed, and the device tier is the GPU's memory, never this host's.

The presets carry the GPUs' published figures (the datasheet is named beside each) and, for the
host and the disk, a typical single-GPU machine of the GPU's class, said as such: a file gives
any other machine, or the figures measured on it (`tierzero bench nvme` for its disk). Its keys
are checked as a config's are: a bad key or value is refused in one line naming the file, the
key and the fix.

How the figures become rates (each a stated share, from the H200 measured in ../shared/gpu-h200):
plain PyTorch trained the 2B GPT at 464-530 of the H200's 989 dense bf16 TFLOPS, so a step
computes at `MATMUL_SHARE` of the published rate; pinned copies peaked at 55 of PCIe Gen5's
64 GB/s each way (`LINK_SHARE`); the optimizer moves about 28 bytes an element (../shared/DESIGN.md),
at the GPU's memory bandwidth on the device and the host's on the host, whose default is what the
H200's 16-core host reached (CPU fused AdamW over the 2B model's 2.05e9 elements in 567 ms: 101 GB/s,
`HOST_BANDWIDTH_PER_CORE` a core).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tierzero.common.sizes import format_size, parse_size
from tierzero.config.checks import Check, float_check, int_check, show
from tierzero.config.errors import ConfigError
from tierzero.config.reading import read_mapping_file
from tierzero.config.tree import Section, setting, unknown_key
from tierzero.estimate.estimator import Bandwidth

__all__ = ["LINK_SHARE", "MATMUL_SHARE", "PRESETS", "Machine", "load_machine"]

#: The share of the published dense rate a training step's matmuls reach (see the module note).
MATMUL_SHARE = 0.5
#: The share of the published PCIe rate a pinned copy reaches, each way.
LINK_SHARE = 55 / 64
#: Bytes the optimizer reads and writes per element: fp32 master, both moments, the gradient, the new parameter.
OPTIMIZER_BYTES = 28
#: Host memory bandwidth a core when the machine names none, GB/s: the H200 host's 101 GB/s over its 16 cores.
HOST_BANDWIDTH_PER_CORE = 6.3

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def _size(value: Any) -> int | None:
    """A size as a machine's figures are written: "24GiB", and "72.6GiB" too (to the byte below)."""
    if value is None:
        return None
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        n = parse_size(value)
    else:
        n = int(float(match.group(1)) * parse_size(f"1{match.group(2)}"))
    if n <= 0:
        raise ValueError(value)
    return n


SIZE = Check("a positive size such as '24GiB' or '72.6GiB'", "size", _size, is_size=True)
RATE = float_check(lo=0.0, lo_open=True, optional=True)
_COUNT = int_check(1, limit=1 << 16)
COUNT = Check(_COUNT.expected, _COUNT.type_name, lambda v: None if v is None else _COUNT.convert(v))
_REQUIRED = (
    "gpu_memory", "bf16_tflops", "gpu_memory_bandwidth", "pcie", "host_memory", "cores", "nvme_read", "nvme_write",
    "disk_free",
)  # fmt: skip


@dataclass(kw_only=True, slots=True, frozen=True)
class Machine(Section):
    """One machine's published or measured figures; every key but `name`, `fp32_tflops`,
    `host_memory_bandwidth` and `source` is required."""

    SECTION: ClassVar[str] = ""
    name: str = setting("machine", Check("a name", "str", lambda v: str(v) if isinstance(v, (str, int)) else _bad(v)))
    """What the plan calls it."""
    gpu_memory: int | None = setting(None, SIZE)
    """The GPU's memory, e.g. 24GiB: the device tier's, less its margin."""
    bf16_tflops: float | None = setting(None, RATE)
    """Dense bf16 (and fp16) tensor TFLOPS, as published (without sparsity)."""
    fp32_tflops: float | None = setting(None, RATE)
    """Dense fp32 TFLOPS, for a run in fp32 (default: none, and an fp32 run is refused)."""
    gpu_memory_bandwidth: float | None = setting(None, RATE)
    """GB/s of the GPU's memory: the optimizer's rate for the states the device holds."""
    pcie: float | None = setting(None, RATE)
    """GB/s between host and GPU, each way, as published (PCIe Gen4 x16: 32, Gen5: 64)."""
    host_memory: int | None = setting(None, SIZE)
    """The host's memory: the cpu tier's, less its margin."""
    cores: int | None = setting(None, COUNT)
    """The host's cores (vCPUs), for its memory bandwidth when not given."""
    host_memory_bandwidth: float | None = setting(None, RATE)
    """GB/s of the host's memory: the optimizer's rate for the states the host holds (default: cores x 6.3)."""
    nvme_read: float | None = setting(None, RATE)
    """GB/s the disk reads, sustained."""
    nvme_write: float | None = setting(None, RATE)
    """GB/s the disk writes, sustained."""
    disk_free: int | None = setting(None, SIZE)
    """Free space at tiers.nvme.path on that machine: the nvme tier's budget."""
    source: str = setting("a machine file", Check("a text", "str", lambda v: str(v)))
    """Where the figures come from, as the plan says it."""

    def _validate(self) -> None:
        missing = [key for key in _REQUIRED if getattr(self, key) is None]
        if missing:
            raise ConfigError(
                f"{', '.join(missing)} not given: a machine needs {', '.join(_REQUIRED)} "
                f"(e.g. gpu_memory: 24GiB, bf16_tflops: 165, pcie: 32, nvme_read: 3.0)",
                key=missing[0],
            )

    def flops(self, param_dtype: str) -> Bandwidth:
        """The rate a step computes at, in the run's compute dtype: `MATMUL_SHARE` of the published one."""
        published = self.fp32_tflops if param_dtype == "fp32" else self.bf16_tflops
        if published is None:
            raise ConfigError(
                f"machine {self.name} gives no fp32_tflops for precision.param_dtype fp32: add fp32_tflops "
                "to the machine file, or train in bf16",
                key="fp32_tflops",
            )
        rate = published * 1e12 * MATMUL_SHARE
        source = f"{self.name}: {published:g} {param_dtype} TFLOPS published, at {MATMUL_SHARE:.0%}: {rate / 1e12:.0f} TFLOPS"
        return Bandwidth(read=rate, write=rate, source=source)

    def disk(self) -> Bandwidth:
        assert self.nvme_read is not None and self.nvme_write is not None
        source = f"{self.name}: {self.nvme_read:g} GB/s read, {self.nvme_write:g} GB/s write ({self.source})"
        return Bandwidth(read=self.nvme_read * 1e9, write=self.nvme_write * 1e9, source=source)

    @property
    def copy_rate(self) -> float:
        """Bytes/s of a pinned copy between host and GPU."""
        assert self.pcie is not None
        return self.pcie * 1e9 * LINK_SHARE

    @property
    def host_step_rate(self) -> float:
        """Elements/s of the optimizer on the host, bound by its memory."""
        assert self.cores is not None
        bandwidth = self.host_memory_bandwidth or self.cores * HOST_BANDWIDTH_PER_CORE
        return bandwidth * 1e9 / OPTIMIZER_BYTES

    @property
    def device_step_rate(self) -> float:
        """Elements/s of the optimizer on the GPU, bound by its memory."""
        assert self.gpu_memory_bandwidth is not None
        return self.gpu_memory_bandwidth * 1e9 / OPTIMIZER_BYTES

    def describe(self) -> str:
        """One line of what the plan takes from the machine."""
        assert self.gpu_memory is not None and self.host_memory is not None and self.disk_free is not None
        return (
            f"machine {self.name} (nothing of this host measured): GPU {format_size(self.gpu_memory)}, "
            f"{self.bf16_tflops:g} bf16 TFLOPS, PCIe {self.pcie:g} GB/s; host {format_size(self.host_memory)}, "
            f"{self.cores} cores; disk {self.nvme_read:g}/{self.nvme_write:g} GB/s read/write, "
            f"{format_size(self.disk_free)} free ({self.source})"
        )


def _bad(value: Any) -> Any:
    raise ValueError(value)


# The GPUs' figures are their datasheets' (dense, without sparsity; memory as published, of which
# the CUDA context and the device margin come out). Host and disk are not the GPU's: a typical
# single-GPU cloud machine of its class, and a PCIe Gen4 datacenter NVMe drive's sustained 3.0 GB/s
# read and 2.0 GB/s write with 1 TiB free. Give a machine file with the real ones.
_DATACENTER_DISK = {"nvme_read": 3.0, "nvme_write": 2.0, "disk_free": "1TiB"}
_PRESETS: dict[str, dict[str, Any]] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4): 312 bf16, 19.5 fp32, HBM2 1,555 GB/s, PCIe Gen4.
    # Host: GCP a2-highgpu-1g, 12 vCPUs, 85 GB.
    "A100-40GB": {"gpu_memory": "40GiB", "bf16_tflops": 312, "fp32_tflops": 19.5, "gpu_memory_bandwidth": 1555,
                  "pcie": 32, "host_memory": "85GB", "cores": 12},
    # The same datasheet, 80GB SXM4: HBM2e 2,039 GB/s. Host: GCP a2-ultragpu-1g, 12 vCPUs, 170 GB.
    "A100-80GB": {"gpu_memory": "80GiB", "bf16_tflops": 312, "fp32_tflops": 19.5, "gpu_memory_bandwidth": 2039,
                  "pcie": 32, "host_memory": "170GB", "cores": 12},
    # NVIDIA H100 Tensor Core GPU datasheet (SXM): 989 bf16, 67 fp32, HBM3 3.35 TB/s, PCIe Gen5 (128 GB/s both ways).
    # Host: GCP a3-highgpu-1g, 26 vCPUs, 234 GB.
    "H100-80GB": {"gpu_memory": "80GiB", "bf16_tflops": 989, "fp32_tflops": 67, "gpu_memory_bandwidth": 3350,
                  "pcie": 64, "host_memory": "234GB", "cores": 26},
    # NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e at 4.8 TB/s, 989 bf16, 67 fp32, PCIe Gen5.
    # Memory, host and its bandwidth as measured on the one this project ran on (../shared/gpu-h200):
    # torch saw 139 GiB, the host had 16 cores and 125 GiB.
    "H200": {"gpu_memory": "139GiB", "bf16_tflops": 989, "fp32_tflops": 67, "gpu_memory_bandwidth": 4800,
             "pcie": 64, "host_memory": "125GiB", "cores": 16, "host_memory_bandwidth": 101},
    # NVIDIA L4 Tensor Core GPU datasheet: 121 bf16, 30.3 fp32, GDDR6 300 GB/s, PCIe Gen4 x16.
    # Host: GCP g2-standard-8, 8 vCPUs, 32 GB.
    "L4": {"gpu_memory": "24GiB", "bf16_tflops": 121, "fp32_tflops": 30.3, "gpu_memory_bandwidth": 300,
           "pcie": 32, "host_memory": "32GB", "cores": 8},
    # NVIDIA Ada Lovelace architecture whitepaper, GeForce RTX 4090: 165.2 bf16 with fp32 accumulation
    # (as torch's matmuls accumulate), 82.6 fp32, GDDR6X 1,008 GB/s, PCIe Gen4 x16.
    # Host: a desktop of its class, 16 cores, 64 GiB.
    "RTX-4090": {"gpu_memory": "24GiB", "bf16_tflops": 165.2, "fp32_tflops": 82.6, "gpu_memory_bandwidth": 1008,
                 "pcie": 32, "host_memory": "64GiB", "cores": 16},
}  # fmt: skip

PRESETS: dict[str, Machine] = {
    name: Machine(
        name=name, source=f"the {name} preset: the GPU's datasheet, a typical host and disk", **_DATACENTER_DISK, **figures
    )
    for name, figures in _PRESETS.items()
}
"""The machines `--machine NAME` takes, by name (any case)."""


def load_machine(name_or_path: str) -> Machine:
    """A preset by its name (any case), else a .yaml/.yml/.json machine file; one-line errors name the file."""
    by_name = {name.lower(): machine for name, machine in PRESETS.items()}
    if name_or_path.lower() in by_name:
        return by_name[name_or_path.lower()]
    path = Path(name_or_path)
    if path.suffix.lower() not in (".yaml", ".yml", ".json"):
        raise ConfigError(
            f"--machine {show(name_or_path)} is neither a preset ({', '.join(PRESETS)}) nor a .yaml/.json machine file: "
            "name a preset or give a file"
        )
    try:
        raw = read_mapping_file(path)
        for key in raw:
            if key not in Machine.__dataclass_fields__:
                raise unknown_key(Machine, str(key))
        return Machine(**{"name": path.stem, "source": f"machine file {path}", **raw})
    except ConfigError as exc:
        said = str(exc)
        said = said.replace(f"config file {path}", f"machine file {path}", 1) if "config file" in said else f"machine file {path}: {said}"
        raise ConfigError(said, key=exc.key) from None
