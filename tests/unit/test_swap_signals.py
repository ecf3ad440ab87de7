"""No swap file outlives a process killed by SIGINT, SIGTERM or SIGHUP, from the first file on.

One driver process imports torch once and forks a child per case (a spawn costs seconds,
a fork milliseconds); each child builds a real NvmeTier and gets real signals from the
driver. The driver reports what it saw as JSON; the tests below read that report.
See [Note: signal clean-up] in tierzero/offload/disk/files.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

DRIVER = textwrap.dedent(
    """
    import json, os, random, select, signal, sys, time
    from pathlib import Path
    import torch
    from tierzero.offload.nvme import NvmeTier

    base = sys.argv[1]
    report = {}

    # The cases below assume a process as a terminal starts it. A suite run under nohup, or as
    # a background job, inherits SIGHUP (or SIGINT) ignored, and an ignored signal is one the
    # tier rightly leaves alone: the busy child would outlive its SIGHUP and hang this driver.
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def fork(body):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            code = 0
            try:
                body(lambda text: os.write(w, (text + "\\n").encode()))
            except BaseException as exc:
                print(f"child error: {exc!r}", file=sys.stderr, flush=True)
                code = 70
            finally:
                os._exit(code)
        os.close(w)
        return pid, r

    def read_line(fd, timeout=20.0):
        ready, _, _ = select.select([fd], [], [], timeout)
        assert ready, "child did not answer"
        out = b""
        while not out.endswith(b"\\n"):
            byte = os.read(fd, 1)
            assert byte, f"child ended without a line, after {out!r}"
            out += byte
        return out.decode().strip()

    def end(pid):
        _, status = os.waitpid(pid, 0)
        return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)

    def left(path):
        return sorted(str(p.relative_to(path)) for p in Path(path).rglob("*"))

    def subdir(name):
        path = os.path.join(base, name)
        os.mkdir(path)
        return path

    # --- SIGTERM at random moments of start-up (a fresh run id, 1 GiB preallocated) ---
    def start_then_wait(path, backend):
        def body(say):
            # Dropped at once: the later moments land in its finalizer, which a signal must not cut short.
            NvmeTier(path, capacity=1 << 30, block_size=1 << 20, backend=backend)
            say("up")
            time.sleep(30)
        return body

    spans = {}
    for backend in ("pread", "aiofiles"):
        path = subdir(f"measure-{backend}")
        t0 = time.perf_counter()
        pid, r = fork(start_then_wait(path, backend))
        read_line(r)
        spans[backend] = time.perf_counter() - t0
        os.kill(pid, signal.SIGTERM)
        assert end(pid) == -signal.SIGTERM and left(path) == []
    rng = random.Random(int(sys.argv[2]))
    trials = []
    for i in range(10):
        backend = ("pread", "aiofiles")[i % 2]
        path = subdir(f"trial{i}")
        delay = rng.uniform(0, 1.5 * spans[backend])
        pid, r = fork(start_then_wait(path, backend))
        time.sleep(delay)
        os.kill(pid, signal.SIGTERM)
        if i % 3 == 0:
            os.kill(pid, signal.SIGTERM)  # a second one while the first is handled
        trials.append({"backend": backend, "delay": delay, "status": end(pid), "left": left(path)})
    report["startup"] = {"spans": spans, "trials": trials}

    # --- SIGHUP in the middle of I/O ---
    def busy(path):
        def body(say):
            tier = NvmeTier(path, capacity=64 << 20, block_size=1 << 20)
            region = tier.allocate(8 << 20, label="x")
            data = torch.ones(8 << 20, dtype=torch.uint8)
            say("up")
            while True:
                tier.write(region, data)
                tier.read(region, data)
        return body

    path = subdir("sighup")
    pid, r = fork(busy(path))
    read_line(r)
    time.sleep(0.1)
    os.kill(pid, signal.SIGHUP)
    report["sighup"] = {"status": end(pid), "left": left(path)}

    # --- SIGHUP repeated, chained to a Python handler that lets the run go on ---
    def chained(path):
        def body(say):
            got = []

            def on_hup(signum, frame):
                got.append(signum)
                say("handled")

            signal.signal(signal.SIGHUP, on_hup)
            tier = NvmeTier(path, capacity=4 << 20, block_size=1 << 20)
            region = tier.allocate(4096, label="x")
            tier.write(region, torch.full((4096,), 7, dtype=torch.uint8))
            say("up")
            while len(got) < 3:
                time.sleep(0.01)
            out = torch.empty(4096, dtype=torch.uint8)
            tier.read(region, out)
            say(json.dumps({"calls": len(got), "sum": int(out.sum()), "swap": tier.file_path.exists()}))
            tier.close()
        return body

    path = subdir("chained")
    pid, r = fork(chained(path))
    read_line(r)
    for _ in range(3):
        os.kill(pid, signal.SIGHUP)
        assert read_line(r) == "handled"  # one at a time: two pending signals would run one handler
    seen = json.loads(read_line(r))
    report["chained"] = seen | {"status": end(pid), "left": left(path)}

    # --- an ignored SIGHUP stays ignored ---
    def ignoring(path):
        def body(say):
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
            tier = NvmeTier(path, capacity=4 << 20, block_size=1 << 20)
            say("up")
            time.sleep(0.5)
            say(json.dumps({"swap": tier.file_path.exists()}))
            tier.close()
        return body

    path = subdir("ignored")
    pid, r = fork(ignoring(path))
    read_line(r)
    os.kill(pid, signal.SIGHUP)
    seen = json.loads(read_line(r))
    report["ignored"] = seen | {"status": end(pid), "left": left(path)}

    # --- SIGINT: KeyboardInterrupt under Python's handler; clean-up and death under SIG_DFL ---
    def interrupted(path, default):
        def body(say):
            if default:
                signal.signal(signal.SIGINT, signal.SIG_DFL)
            tier = NvmeTier(path, capacity=4 << 20, block_size=1 << 20)
            region = tier.allocate(4096, label="x")
            tier.write(region, torch.full((4096,), 7, dtype=torch.uint8))
            try:
                say("up")  # inside: the signal may land as soon as the driver reads this
                time.sleep(30)
            except KeyboardInterrupt:
                out = torch.empty(4096, dtype=torch.uint8)
                tier.read(region, out)
                say(json.dumps({"caught": True, "sum": int(out.sum()), "swap": tier.file_path.exists()}))
                tier.close()
        return body

    for name, default in (("sigint", False), ("sigint-dfl", True)):
        path = subdir(name)
        pid, r = fork(interrupted(path, default))
        read_line(r)
        os.kill(pid, signal.SIGINT)
        seen = {} if default else json.loads(read_line(r))
        report[name] = seen | {"status": end(pid), "left": left(path)}

    print(json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    base = tmp_path_factory.mktemp("signals")
    seed = int.from_bytes(os.urandom(4), "little")
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, str(base), str(seed)], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "child error" not in done.stderr, done.stderr
    out = json.loads(done.stdout.splitlines()[-1])
    out["seed"] = seed
    return out


def test_sigterm_at_random_moments_of_start_up_leaves_nothing(report: dict) -> None:
    trials = report["startup"]["trials"]
    assert len(trials) == 10
    for trial in trials:
        # Dead by SIGTERM (the default action survives the clean-up) and not one file left.
        assert trial["status"] == -signal.SIGTERM, (report["seed"], trial)
        assert trial["left"] == [], (report["seed"], report["startup"]["spans"], trial)


def test_sighup_in_the_middle_of_io_leaves_nothing(report: dict) -> None:
    assert report["sighup"] == {"status": -signal.SIGHUP, "left": []}


def test_repeated_sighup_chains_to_the_python_handler_and_an_ignored_one_stays_ignored(report: dict) -> None:
    # Unlinked at the first signal, still readable through the open descriptor, closed cleanly.
    assert report["chained"] == {"calls": 3, "sum": 7 * 4096, "swap": False, "status": 0, "left": []}
    # Ignored before the tier came: the process lives on and keeps its files until it closes them.
    assert report["ignored"] == {"swap": True, "status": 0, "left": []}


def test_sigint_raises_keyboard_interrupt_or_cleans_up_and_dies(report: dict) -> None:
    # Python's own SIGINT handler: KeyboardInterrupt, caught, and the tier is untouched.
    assert report["sigint"] == {"caught": True, "sum": 7 * 4096, "swap": True, "status": 0, "left": []}
    # SIGINT left at its default action: the files go, and the process dies by SIGINT.
    assert report["sigint-dfl"] == {"status": -signal.SIGINT, "left": []}
