"""Tier budgets from the machine: capacities win, cgroup v1 and v2 limits, the margins, the sources."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch

from tierzero.common.slices import Tier
from tierzero.config import CpuTierConfig, DeviceTierConfig, NvmeTierConfig, TiersConfig
from tierzero.config.checks import GiB, MiB
from tierzero.placement import CPU_MARGIN, DEVICE_MARGIN, Margin, cgroup_memory, machine_budgets

V1_UNLIMITED_AS_WRITTEN = 9223372036854771712
"""What cgroup v1 shows for "no limit" on x86-64: the largest page-aligned 64-bit count."""


@pytest.fixture
def available(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """psutil's available and total memory, as a test sets them (20 GiB of 32 GiB unless changed)."""
    memory = {"available": 20 * GiB, "total": 32 * GiB}
    monkeypatch.setattr(psutil, "virtual_memory", lambda: SimpleNamespace(**memory))
    return memory


def _proc(tmp_path: Path, *lines: str) -> Path:
    path = tmp_path / "proc-self-cgroup"
    path.write_text("".join(f"{line}\n" for line in lines))
    return path


def _cgroup(directory: Path, **files: str) -> Path:
    """A fake cgroup directory; keyword names stand for files with dots (limit_in_bytes -> memory.limit_in_bytes)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / f"memory.{name}").write_text(f"{text}\n")
    return directory


def _cpu(tmp_path: Path, proc: Path) -> tuple[int | None, str]:
    tiers, cgroup_root = TiersConfig(), tmp_path / "cg"
    cpu = machine_budgets(tiers, device=torch.device("cpu"), cgroup_root=cgroup_root, proc_self_cgroup=proc).cpu
    return cpu.nbytes, cpu.source


def test_margins_are_exact_byte_counts() -> None:
    assert Margin(floor=GiB, percent=10).of(5 * GiB) == GiB
    assert Margin(floor=GiB, percent=10).of(30 * GiB) == 3 * GiB
    assert Margin(floor=GiB, percent=10).of(9 * GiB) == GiB  # a tenth is 0.9 GiB, under the floor
    assert Margin(floor=GiB, percent=10).of(15 * GiB + 9) == 15 * GiB // 10  # floored, never rounded up
    assert CPU_MARGIN == Margin(floor=2 * GiB, percent=10) and str(CPU_MARGIN) == "max(2.0 GiB, 10%)"
    assert DEVICE_MARGIN == Margin(floor=2 * GiB, percent=10)


def test_explicit_capacities_win_and_nothing_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def unread(*_: object) -> None:
        raise AssertionError("an explicit capacity must win before the machine is read")

    monkeypatch.setattr(psutil, "virtual_memory", unread)
    monkeypatch.setattr(shutil, "disk_usage", unread)
    monkeypatch.setattr(torch.cuda, "mem_get_info", unread)
    proc = _proc(tmp_path, "not a cgroup line")
    tiers = TiersConfig(
        device=DeviceTierConfig(capacity="3GiB"),
        cpu=CpuTierConfig(capacity="5GiB"),
        nvme=NvmeTierConfig(capacity="7GiB", path=str(tmp_path)),
    )
    budgets = machine_budgets(tiers, device=torch.device("cuda", 0), cgroup_root=tmp_path, proc_self_cgroup=proc)
    got = {t: (b.nbytes, b.source) for t, b in budgets.by_tier().items()}
    assert got == {
        Tier.DEVICE: (3 * GiB, "tiers.device.capacity"),
        Tier.CPU: (5 * GiB, "tiers.cpu.capacity"),
        Tier.NVME: (7 * GiB, "tiers.nvme.capacity"),
    }


def test_a_v1_limit_below_available_memory_binds(tmp_path: Path, available: dict[str, int]) -> None:
    job = tmp_path / "cg" / "memory" / "slurm" / "job_7"
    _cgroup(job, limit_in_bytes=str(24 * GiB), usage_in_bytes=str(9 * GiB + 7))
    nbytes, source = _cpu(tmp_path, _proc(tmp_path, "5:cpu,cpuacct:/slurm/job_7", "4:memory:/slurm/job_7", "0::/"))
    headroom = 24 * GiB - (9 * GiB + 7)  # below psutil's 20 GiB; a tenth of it is under the 2 GiB floor
    assert nbytes == headroom - 2 * GiB == 16_106_127_353 - 2_147_483_648
    assert source == (
        f"cgroup v1 {job / 'memory.limit_in_bytes'} 24.0 GiB with 9.0 GiB used, less 2.0 GiB margin "
        "(max(2.0 GiB, 10%)); psutil available 20.0 GiB is more"
    )


def test_available_memory_below_a_v2_limit_binds(tmp_path: Path, available: dict[str, int]) -> None:
    available["available"] = 4 * GiB
    pod = _cgroup(tmp_path / "cg" / "kubepods" / "pod1", max=str(64 * GiB), current=str(GiB))
    nbytes, source = _cpu(tmp_path, _proc(tmp_path, "0::/kubepods/pod1"))
    assert nbytes == 4 * GiB - 2 * GiB  # a tenth of 4 GiB is under the 2 GiB floor
    assert source == (
        f"psutil available 4.0 GiB, less 2.0 GiB margin (max(2.0 GiB, 10%)); "
        f"the cgroup v2 {pod / 'memory.max'} 64.0 GiB with 1.0 GiB used leaves more"
    )


@pytest.mark.parametrize(
    ("lines", "files"),
    [
        (["0::/user.slice"], {"user.slice": {"max": "max", "current": str(GiB)}}),
        (["0::/"], {}),  # the v2 root cgroup has no memory.max
        (["4:memory:/a"], {"memory/a": {"limit_in_bytes": str(V1_UNLIMITED_AS_WRITTEN), "usage_in_bytes": "1"}}),
        (["1:cpu:/", "0::/"], {}),  # a v1 system without the memory controller mounted
    ],
    ids=["v2-max", "v2-root", "v1-unlimited", "no-memory-controller"],
)
def test_no_limit_leaves_psutil_with_its_margin(
    lines: list[str], files: dict[str, dict[str, str]], tmp_path: Path, available: dict[str, int]
) -> None:
    for directory, contents in files.items():
        _cgroup(tmp_path / "cg" / directory, **contents)
    nbytes, source = _cpu(tmp_path, _proc(tmp_path, *lines))
    assert nbytes == 20 * GiB - 2 * GiB
    assert source == "psutil available 20.0 GiB, less 2.0 GiB margin (max(2.0 GiB, 10%)); no cgroup memory limit"


def test_no_proc_self_cgroup_means_no_limit(tmp_path: Path, available: dict[str, int]) -> None:
    nbytes, source = _cpu(tmp_path, tmp_path / "absent")
    assert nbytes == 18 * GiB and source.endswith("; no cgroup memory limit")


def test_the_limit_with_least_headroom_binds_up_the_tree(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _cgroup(root / "job", max=str(8 * GiB), current=str(6 * GiB))
    _cgroup(root / "job" / "step", max=str(4 * GiB), current=str(512 * MiB))
    _cgroup(root / "job" / "step" / "task", max="max", current=str(100 * MiB))
    found = cgroup_memory(cgroup_root=root, proc_self_cgroup=_proc(tmp_path, "0::/job/step/task"))
    assert found is not None and found.version == 2
    assert (found.limit_file, found.limit, found.usage) == (root / "job" / "memory.max", 8 * GiB, 6 * GiB)
    assert found.headroom == 2 * GiB  # the step's 3.5 GiB and the task's no limit leave more


def test_a_container_without_a_cgroup_namespace_reads_the_mount(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _cgroup(root / "memory", limit_in_bytes=str(2 * GiB), usage_in_bytes=str(GiB))
    found = cgroup_memory(cgroup_root=root, proc_self_cgroup=_proc(tmp_path, "4:memory:/docker/0123abcd"))
    assert found is not None and (found.limit_file, found.headroom) == (root / "memory" / "memory.limit_in_bytes", GiB)


def test_hybrid_hierarchies_take_the_v1_memory_controller(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _cgroup(root / "memory" / "a", limit_in_bytes=str(6 * GiB), usage_in_bytes=str(GiB))
    _cgroup(root / "b", max=str(GiB), current="0")
    found = cgroup_memory(cgroup_root=root, proc_self_cgroup=_proc(tmp_path, "0::/b", "4:memory:/a"))
    assert found is not None and (found.version, found.limit) == (1, 6 * GiB)


@pytest.mark.parametrize(
    ("lines", "files", "bad", "expected"),
    [
        (["0::/a"], {"a": {"max": "lots", "current": "0"}},
         "a/memory.max", "expected 'max' or a byte count, got 'lots'"),
        (["0::/a"], {"a": {"max": str(GiB), "current": "-1"}}, "a/memory.current", "expected a byte count, got '-1'"),
        (["4:memory:/a"], {"memory/a": {"limit_in_bytes": "max", "usage_in_bytes": "0"}},
         "memory/a/memory.limit_in_bytes", "expected a byte count, got 'max'"),
        (["4:memory:/a"], {"memory/a": {"limit_in_bytes": str(GiB)}},
         "memory/a/memory.usage_in_bytes", "is missing beside its limit"),
    ],
    ids=["v2-word", "v2-negative-usage", "v1-max", "v1-no-usage"],
)
def test_a_malformed_cgroup_file_is_an_error_naming_it(
    lines: list[str],
    files: dict[str, dict[str, str]],
    bad: str,
    expected: str,
    tmp_path: Path,
    available: dict[str, int],
) -> None:
    for directory, contents in files.items():
        _cgroup(tmp_path / "cg" / directory, **contents)
    with pytest.raises(ValueError, match="set tiers.cpu.capacity") as caught:
        _cpu(tmp_path, _proc(tmp_path, *lines))
    assert str(tmp_path / "cg" / bad) in str(caught.value) and expected in str(caught.value)


def test_a_malformed_proc_self_cgroup_is_an_error_naming_it(tmp_path: Path, available: dict[str, int]) -> None:
    proc = _proc(tmp_path, "0::/", "garbage")
    expected = f"{proc}: expected 'id:controllers:/path' lines, got 'garbage'; set tiers.cpu.capacity"
    with pytest.raises(ValueError, match="^" + re.escape(expected)):
        _cpu(tmp_path, proc)


def test_the_device_tier_takes_cuda_free_memory_less_its_margin(monkeypatch: pytest.MonkeyPatch) -> None:
    free = {"bytes": 100 * GiB}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (free["bytes"], 141 * GiB))
    tiers = TiersConfig(cpu=CpuTierConfig(capacity="1GiB"))
    device = machine_budgets(tiers, device=torch.device("cuda", 1)).device
    assert device.nbytes == 90 * GiB
    assert device.source == (
        "cuda:1 free 100.0 GiB of 141.0 GiB, less 10.0 GiB margin (max(2.0 GiB, 10%): activations and the allocator)"
    )
    free["bytes"] = GiB  # other processes hold the rest: the 2 GiB floor leaves nothing
    assert machine_budgets(tiers, device=torch.device("cuda", 1)).device.nbytes == 0


def test_the_host_standing_in_for_the_device_gives_no_figure() -> None:
    device = machine_budgets(TiersConfig(cpu=CpuTierConfig(capacity="1GiB")), device=torch.device("cpu")).device
    assert device.nbytes is None
    assert device.source == "none from the machine (the host stands in for the device): set tiers.device.capacity"


def test_the_nvme_tier_takes_the_free_space_of_its_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = CpuTierConfig(capacity="1GiB")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=0, used=0, free=500 * GiB + 1))
    tiers = TiersConfig(cpu=cpu, nvme=NvmeTierConfig(path=str(tmp_path)))
    nvme = machine_budgets(tiers, device=torch.device("cpu")).nvme
    assert (nvme.nbytes, nvme.source) == (500 * GiB + 1, f"free space of {tmp_path}")

    def unreadable(path: str) -> None:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(shutil, "disk_usage", unreadable)
    nvme = machine_budgets(tiers, device=torch.device("cpu")).nvme
    assert (nvme.nbytes, nvme.source) == (None, f"none: the free space of {tmp_path} cannot be read")
    nvme = machine_budgets(TiersConfig(cpu=cpu), device=torch.device("cpu")).nvme
    assert (nvme.nbytes, nvme.source) == (None, "none: tiers.nvme.path is not set")


def test_lines_and_json_name_each_figure_and_its_source(tmp_path: Path) -> None:
    tiers = TiersConfig(cpu=CpuTierConfig(capacity="1536MiB"), nvme=NvmeTierConfig(capacity="2GiB"))
    budgets = machine_budgets(tiers, device=torch.device("cpu"))
    assert budgets.lines() == [
        "budgets (a capacity is a rank's; the machine's figures are shared by its ranks):",
        "tier     budget  from",
        "device        -  none from the machine (the host stands in for the device): set tiers.device.capacity",
        "cpu     1.5 GiB  tiers.cpu.capacity",
        "nvme    2.0 GiB  tiers.nvme.capacity",
    ]
    assert budgets.to_json()["cpu"] == {"bytes": 1536 * MiB, "source": "tiers.cpu.capacity"}
    assert budgets.to_json()["device"]["bytes"] is None


def test_budgets_of_this_machine() -> None:
    budgets = machine_budgets(TiersConfig())
    assert budgets.cpu.nbytes is not None and 0 < budgets.cpu.nbytes < psutil.virtual_memory().total
    assert budgets.cpu.source.startswith(("psutil available", "cgroup v"))
