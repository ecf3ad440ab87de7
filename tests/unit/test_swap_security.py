"""Swap files no other user can redirect: planted run directories and swapped swap files are refused.

See [Note: swap files no other user can redirect] in tierzero/offload/disk/files.py.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest
import torch

from tierzero.offload import nvme as nvme_mod
from tierzero.offload.disk.files import new_run_id
from tierzero.offload.nvme import NvmeTier

MiB = 1 << 20


def make_tier(path: Path, **kwargs) -> NvmeTier:
    settings = {"capacity": 4 * MiB, "block_size": MiB, "queue_depth": 2, "threads": 2} | kwargs
    return NvmeTier(path, **settings)


def victim(tmp_path: Path) -> Path:
    """A file an attacker would like the tier to overwrite, outside the swap path."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / "precious.bin"
    target.write_bytes(b"precious" * 512)
    return target


def one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_run_id_is_unguessable() -> None:
    ids = {new_run_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(re.fullmatch(rf"tz-\d{{8}}-\d{{6}}-{os.getpid()}-[0-9a-f]{{16}}", i) for i in ids), ids


@pytest.mark.parametrize("fresh", [True, False], ids=["fresh-id", "given-id"])
def test_symlink_planted_at_the_run_directory_is_refused(tmp_path: Path, monkeypatch, fresh: bool) -> None:
    base = tmp_path / "swap"
    base.mkdir()
    target = victim(tmp_path)
    (base / "tz-planted").symlink_to(target.parent)
    if fresh:  # the attacker guessed the random id: refused all the same
        monkeypatch.setattr(nvme_mod, "new_run_id", lambda: "tz-planted")
    with pytest.raises(ValueError) as info:
        make_tier(base, run_id=None if fresh else "tz-planted")
    text = one_line(info)
    assert str(base / "tz-planted") in text
    assert ("remove it" in text) and ("symlink" in text or "planted" in text), text
    assert os.listdir(target.parent) == ["precious.bin"]
    assert target.read_bytes() == b"precious" * 512
    assert os.listdir(base) == ["tz-planted"] and (base / "tz-planted").is_symlink()


def test_existing_directory_for_a_fresh_run_id_is_refused(tmp_path: Path, monkeypatch) -> None:
    planted = tmp_path / "tz-guessed"
    planted.mkdir(mode=0o700)
    monkeypatch.setattr(nvme_mod, "new_run_id", lambda: "tz-guessed")
    with pytest.raises(ValueError) as info:
        make_tier(tmp_path)
    assert one_line(info) == (
        f"{planted} already exists though its run id was drawn at random just now: something planted it; "
        f"remove it and make {tmp_path} writable by you alone"
    )
    assert planted.is_dir() and os.listdir(planted) == []


def test_existing_run_directory_of_the_wrong_mode_is_refused(tmp_path: Path) -> None:
    planted = tmp_path / "job"
    planted.mkdir()
    os.chmod(planted, 0o777)
    with pytest.raises(ValueError) as info:
        make_tier(tmp_path, run_id="job", rank=1)
    assert one_line(info) == (
        f"{planted} belongs to uid {os.geteuid()} with mode 0777, the NVMe tier needs uid {os.geteuid()} "
        "and mode 0700: something else made it; remove it or pick another run id"
    )
    assert os.listdir(planted) == [] and stat.S_IMODE(planted.stat().st_mode) == 0o777


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory owned by another user needs root")
def test_existing_run_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    planted = tmp_path / "job"
    planted.mkdir(mode=0o700)
    os.chown(planted, 65534, 65534)
    with pytest.raises(ValueError, match=r"belongs to uid 65534 with mode 0700, the NVMe tier needs uid 0 and mode"):
        make_tier(tmp_path, run_id="job", rank=1)
    assert os.listdir(planted) == []


def swap_for_symlink(swap: Path, target: Path) -> None:
    swap.unlink()
    swap.symlink_to(target)


def swap_for_copy(swap: Path, target: Path) -> None:
    """Another regular file under the same name: no symlink, but not the file the tier created."""
    swap.unlink()
    swap.write_bytes(bytes(4 * MiB))


@pytest.mark.parametrize("replace", [swap_for_symlink, swap_for_copy], ids=["symlink", "other-file"])
def test_swap_file_replaced_before_the_direct_reopen_is_refused(tmp_path: Path, monkeypatch, replace) -> None:
    base = tmp_path / "swap"
    base.mkdir()
    target = victim(tmp_path)
    real_reopen_direct = nvme_mod.reopen_direct

    def replace_then_reopen(*args, **kwargs):
        replace(base / "job" / "rank0.swap", target)
        return real_reopen_direct(*args, **kwargs)

    monkeypatch.setattr(nvme_mod, "reopen_direct", replace_then_reopen)
    with pytest.raises(ValueError) as info:
        make_tier(base, run_id="job")
    text = one_line(info)
    assert text.startswith(f"{base / 'job' / 'rank0.swap'} is no longer the swap file the NVMe tier created"), text
    assert target.read_bytes() == b"precious" * 512
    assert os.listdir(base) == []


def test_swap_file_replaced_before_the_aiofiles_handles_open_is_refused(tmp_path: Path, monkeypatch) -> None:
    base = tmp_path / "swap"
    base.mkdir()
    target = victim(tmp_path)

    class ReplacingBackend(nvme_mod.AiofilesBackend):
        def __init__(self, *, path: Path, **kwargs) -> None:
            swap_for_symlink(path, target)
            super().__init__(path=path, **kwargs)

    monkeypatch.setattr(nvme_mod, "AiofilesBackend", ReplacingBackend)
    with pytest.raises(ValueError, match=r"rank0\.swap is no longer the swap file the NVMe tier created"):
        make_tier(base, run_id="job", backend="aiofiles")
    assert target.read_bytes() == b"precious" * 512
    assert os.listdir(base) == []


def test_renaming_the_run_directory_away_redirects_nothing(tmp_path: Path) -> None:
    """Files inside are reached through the directory's descriptor, never by path again: the
    bytes and the clean-up go to the moved directory, nothing to the symlink planted in its place."""
    base = tmp_path / "swap"
    base.mkdir()
    target = victim(tmp_path)
    with make_tier(base, run_id="job", backend="aiofiles") as tier:
        region = tier.allocate(8192, label="x")
        (base / "job").rename(tmp_path / "moved")
        (base / "job").symlink_to(target.parent)
        tier.write(region, torch.full((8192,), 5, dtype=torch.uint8))
        out = torch.empty(8192, dtype=torch.uint8)
        tier.read(region, out)
        assert torch.equal(out, torch.full((8192,), 5, dtype=torch.uint8))
    assert os.listdir(target.parent) == ["precious.bin"] and target.read_bytes() == b"precious" * 512
    assert not (tmp_path / "moved").exists()  # emptied, then removed where it now is (its descriptor says where)
    assert (base / "job").is_symlink()  # the planted link is not this run's to remove
