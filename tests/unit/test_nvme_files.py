"""The NVMe tier's files: layout and permissions, clean-up on close, exit, collection and SIGTERM, leftovers."""

from __future__ import annotations

import errno
import gc
import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from tierzero.cli.main import main
from tierzero.common.sizes import format_size
from tierzero.offload.disk.leftovers import Leftover, find_leftovers
from tierzero.offload.nvme import NvmeTier

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]


def make_tier(path: Path, **kwargs) -> NvmeTier:
    settings = {"capacity": 64 * MiB, "block_size": MiB, "queue_depth": 4, "threads": 4} | kwargs
    return NvmeTier(path, **settings)


# --- layout, clean-up and errors ---------------------------------------------------------


def test_layout_permissions_and_owner(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, rank=3, run_id="job7")
    assert tier.run_dir == tmp_path / "job7" and tier.file_path == tmp_path / "job7" / "rank3.swap"
    assert stat.S_IMODE(os.stat(tier.run_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tier.file_path).st_mode) == 0o600
    owner = json.loads((tmp_path / "job7" / "rank3.owner").read_text())
    assert (owner["pid"], owner["host"], owner["rank"]) == (os.getpid(), socket.gethostname(), 3)
    assert abs(owner["started"] - time.time()) < 60
    tier.close()
    tier.close()
    assert os.listdir(tmp_path) == []


def test_ranks_share_run_dir_and_last_close_removes_it(tmp_path: Path) -> None:
    r0 = make_tier(tmp_path, rank=0, run_id="job")
    r1 = make_tier(tmp_path, rank=1, run_id="job")
    r0.close()
    assert sorted(os.listdir(tmp_path / "job")) == ["rank1.owner", "rank1.swap"]
    r1.close()
    assert os.listdir(tmp_path) == []


def test_same_rank_twice_is_refused_without_damage(tmp_path: Path) -> None:
    with make_tier(tmp_path, run_id="job") as first:
        with pytest.raises(ValueError, match="rank0.owner already exists: another process uses run id job, pick another"):
            make_tier(tmp_path, run_id="job")
        assert sorted(os.listdir(first.run_dir)) == ["rank0.owner", "rank0.swap"]


def test_failed_start_after_the_files_exist_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    real_open = os.open
    direct_opens = []

    def refuse_aiofiles_handles(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            direct_opens.append(path)
            if len(direct_opens) > 1:  # the tier's own descriptor opens; the backend's handles do not
                raise PermissionError(errno.EACCES, "Permission denied")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse_aiofiles_handles)
    with pytest.raises(PermissionError):
        make_tier(tmp_path, backend="aiofiles")
    assert os.listdir(tmp_path) == []
    assert [t.name for t in threading.enumerate() if t.name.startswith("tierzero-nvme")] == []


def test_exception_in_with_block_cleans_up(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with make_tier(tmp_path) as tier:
            tier.write(tier.allocate(10, label="x"), torch.ones(10, dtype=torch.uint8))
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_dropped_tier_is_cleaned_by_gc(tmp_path: Path) -> None:
    tier = make_tier(tmp_path)
    del tier
    gc.collect()
    assert os.listdir(tmp_path) == []


CHILD = textwrap.dedent(
    """
    import os, signal, sys, time, torch
    from tierzero.offload.nvme import NvmeTier
    path, mode, backend = sys.argv[1:]
    if mode == "ignored":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "handler":
        def on_term(signum, frame):
            out = torch.empty(10, dtype=torch.uint8)
            tier.read(region, out)
            print("handled", int(out.sum()), tier.file_path.exists(), flush=True)
            sys.exit(3)
        signal.signal(signal.SIGTERM, on_term)
    tier = NvmeTier(path, capacity=1 << 20, run_id="child", backend=backend)
    region = tier.allocate(10, label="x")
    tier.write(region, torch.ones(10, dtype=torch.uint8))
    print("ready", flush=True)
    if mode in ("sigterm", "handler"):
        time.sleep(60)
    sys.stdin.readline()
    """
)


def run_child(tmp_path: Path, mode: str, backend: str, action) -> tuple[int, str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path), mode, backend],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=REPO,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "ready\n", proc.stderr.read()
        assert (tmp_path / "child" / "rank0.swap").exists()
        action(proc)
        code = proc.wait(timeout=60)
    finally:
        proc.kill()
    return code, proc.stdout.read() + proc.stderr.read()


def go(proc: subprocess.Popen) -> None:
    proc.stdin.write("go\n")
    proc.stdin.flush()


def test_sigterm_removes_files_and_still_dies_by_sigterm(tmp_path: Path) -> None:
    (tmp_path / "keep.bin").write_bytes(b"precious")
    code, output = run_child(tmp_path, "sigterm", "pread", lambda proc: proc.send_signal(signal.SIGTERM))
    assert code == -signal.SIGTERM, output
    assert os.listdir(tmp_path) == ["keep.bin"]


def test_normal_exit_removes_files(tmp_path: Path) -> None:
    (tmp_path / "keep.bin").write_bytes(b"precious")
    code, output = run_child(tmp_path, "exit", "pread", go)
    assert code == 0, output
    assert os.listdir(tmp_path) == ["keep.bin"]


def test_ignored_sigterm_keeps_the_tier(tmp_path: Path) -> None:
    def term_then_go(proc: subprocess.Popen) -> None:
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proc.poll() is None and (tmp_path / "child" / "rank0.swap").exists()
        go(proc)

    code, output = run_child(tmp_path, "ignored", "aiofiles", term_then_go)
    assert code == 0, output
    assert os.listdir(tmp_path) == []


def test_sigterm_chains_to_a_python_handler_that_still_reads(tmp_path: Path) -> None:
    code, output = run_child(tmp_path, "handler", "pread", lambda proc: proc.send_signal(signal.SIGTERM))
    assert code == 3, output
    assert output.startswith("handled 10 False\n"), output
    assert os.listdir(tmp_path) == []


def test_forked_child_leaves_the_parent_tier_alone(tmp_path: Path) -> None:
    with make_tier(tmp_path) as tier:
        region = tier.allocate(4096, label="x")
        tier.write(region, torch.full((4096,), 9, dtype=torch.uint8))
        pid = os.fork()
        if pid == 0:
            # What a forked worker runs when it exits normally, then when it gets SIGTERM.
            tier._finalizer()
            os.kill(os.getpid(), signal.SIGTERM)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
        assert tier.file_path.exists()
        out = torch.empty(4096, dtype=torch.uint8)
        tier.read(region, out)
        assert torch.equal(out, torch.full((4096,), 9, dtype=torch.uint8))


# --- leftovers --------------------------------------------------------------------------


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def fake_run(
    base: Path, name: str, *, pid: int, host: str | None = None, payload: int = 10_000, started: float | None = None
) -> Path:
    run_dir = base / name
    run_dir.mkdir()
    record = {"pid": pid, "host": host or socket.gethostname(), "started": started or time.time(), "rank": 0}
    (run_dir / "rank0.owner").write_text(json.dumps(record))
    (run_dir / "rank0.swap").write_bytes(b"\1" * payload)
    return run_dir


def test_find_and_remove_leftovers(tmp_path: Path) -> None:
    pid = dead_pid()
    dead = fake_run(tmp_path, "tz-dead", pid=pid)
    fake_run(tmp_path, "tz-alive", pid=os.getpid())
    # Our pid, but written by a process that started a day before this one: the pid was reused.
    reused = fake_run(tmp_path, "tz-reused", pid=os.getpid(), started=time.time() - 86400, payload=5000)
    fake_run(tmp_path, "tz-elsewhere", pid=pid, host="another-host")
    (tmp_path / "not-ours").mkdir()
    expected = [
        Leftover(dir=d, pid=p, size_bytes=sum(f.stat().st_blocks * 512 for f in d.iterdir()))
        for d, p in ((dead, pid), (reused, os.getpid()))
    ]
    assert find_leftovers(tmp_path) == expected
    assert main(["clean", str(tmp_path)]) == 0
    assert sorted(os.listdir(tmp_path)) == ["not-ours", "tz-alive", "tz-elsewhere"]


def test_startup_notes_leftovers_once_in_one_line(tmp_path: Path, caplog) -> None:
    pid = dead_pid()
    dead = fake_run(tmp_path, "tz-old", pid=pid, payload=3 * MiB)
    size = sum(f.stat().st_blocks * 512 for f in dead.iterdir())
    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.WARNING):
        warnings.simplefilter("always")
        with make_tier(tmp_path, run_id="new1"), make_tier(tmp_path, run_id="new2"):
            pass
    assert caught == []
    assert caplog.messages == [
        f"tierzero: 1 leftover swap run directory under {tmp_path} (3.0 MiB) from dead processes: "
        f"remove it with `tierzero clean {tmp_path}`"
    ]
    assert format_size(size) == "3.0 MiB"
    assert sorted(os.listdir(tmp_path)) == ["tz-old"]


def test_clean_lists_then_removes_dead_runs_and_never_a_live_one(tmp_path: Path, capsys) -> None:
    pids = [dead_pid(), dead_pid()]
    dead = [fake_run(tmp_path, "tz-a", pid=pids[0], payload=3 * MiB), fake_run(tmp_path, "tz-b", pid=pids[1], payload=MiB)]
    sizes = [sum(f.stat().st_blocks * 512 for f in d.iterdir()) for d in dead]
    listing = [f"{d}  {format_size(s)}  pid {p}" for d, s, p in zip(dead, sizes, pids)]
    with make_tier(tmp_path, run_id="tz-live") as live:
        region = live.allocate(4096, label="x")
        live.write(region, torch.full((4096,), 4, dtype=torch.uint8))
        capsys.readouterr()

        assert main(["clean", str(tmp_path), "--dry-run"]) == 0
        assert capsys.readouterr().out.splitlines() == [
            *listing,
            f"would remove 2 run directories ({format_size(sum(sizes))}); run without --dry-run to remove them",
        ]
        assert sorted(os.listdir(tmp_path)) == ["tz-a", "tz-b", "tz-live"]

        assert main(["clean", str(tmp_path)]) == 0
        assert capsys.readouterr().out.splitlines() == [*listing, f"removed 2 run directories ({format_size(sum(sizes))})"]
        assert os.listdir(tmp_path) == ["tz-live"]
        out = torch.empty(4096, dtype=torch.uint8)
        live.read(region, out)
        assert torch.equal(out, torch.full((4096,), 4, dtype=torch.uint8))

        assert main(["clean", str(tmp_path)]) == 0
        assert capsys.readouterr().out == f"no leftover swap run directories under {tmp_path}\n"
    assert main(["clean", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err == (
        f"tierzero: error: {tmp_path / 'nope'} is not a directory: pass the tiers.nvme.path that holds the run directories\n"
    )


def test_startup_notice_is_one_line_on_stderr(tmp_path: Path) -> None:
    dead = [fake_run(tmp_path, f"tz-{i}", pid=dead_pid(), payload=MiB) for i in range(2)]
    total = sum(f.stat().st_blocks * 512 for d in dead for f in d.iterdir())
    code = "import sys; from tierzero.offload.nvme import NvmeTier; NvmeTier(sys.argv[1], capacity=1 << 20).close()"
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stderr == (
        f"tierzero: 2 leftover swap run directories under {tmp_path} ({format_size(total)}) from dead processes: "
        f"remove them with `tierzero clean {tmp_path}`\n"
    )
