"""A shared directory is a hostile place: what another user plants in a swap path, a data cache or
a cache directory never hangs a run, never fails it and never redirects its writes.

Each case plants what issue 46 found (a FIFO, a symlink to /dev/zero, a malformed or foreign
record, symlinks at the names the cache writes, a state.json naming ../../etc/passwd) and fails
when its guard in tierzero/common/safe_files.py or its callers is removed. Another user's files
are faked through `safe_files.this_user`; where the tests run as root, one test plants them as
`nobody` with setpriv.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_data_tokens import DOCS, expected_stream, tiny_tokenizer, write_dataset, write_jsonl

from tierzero.cli.main import main
from tierzero.common import safe_files
from tierzero.common.cache_files import read_json, write_json
from tierzero.data import find_sources, load_tokenizer, read_documents, token_stream
from tierzero.offload.disk import leftovers
from tierzero.offload.disk.files import owner_alive, read_owner
from tierzero.offload.disk.leftovers import find_leftovers

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534


def finishes(fn: Callable[[], Any], *, fifos: tuple[Path, ...] = (), seconds: float = 15.0) -> Any:
    """`fn()` run in a thread; a test failure, not a hung suite, when it takes longer than `seconds`
    (each FIFO is then opened for writing, which lets a reader blocked on it go)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        for fifo in fifos:
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(5)
        pytest.fail(f"still running after {seconds:.0f} s: blocked on a FIFO in {[str(f) for f in fifos]}")
    if "error" in out:
        raise out["error"]
    return out["value"]


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def run_dir(base: Path, name: str, owner: dict[str, Any] | str | None = None) -> Path:
    """A run directory of this user holding `rank0.owner` (a record, or raw text) unless `owner` is None."""
    where = base / name
    where.mkdir(mode=0o700)
    if owner is not None:
        (where / "rank0.owner").write_text(owner if isinstance(owner, str) else json.dumps(owner))
    (where / "rank0.swap").write_bytes(b"\1" * 4096)
    return where


def record(pid: int) -> dict[str, Any]:
    return {"pid": pid, "host": socket.gethostname(), "started": time.time(), "rank": 0}


@pytest.fixture
def other_user(monkeypatch: pytest.MonkeyPatch) -> int:
    """Every file this test makes now reads as another user's."""
    uid = os.geteuid() + 1
    monkeypatch.setattr(safe_files, "this_user", lambda: uid)
    return uid


# --- the swap path: owner files ------------------------------------------------------------


def test_a_fifo_owner_file_hangs_neither_the_scan_nor_clean(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    fifo = run_dir(tmp_path, "tz-x") / "rank0.owner"
    os.mkfifo(fifo)
    dead = run_dir(tmp_path, "tz-dead", record(dead_pid()))
    with caplog.at_level(logging.WARNING):
        assert [x.dir for x in finishes(lambda: find_leftovers(tmp_path), fifos=(fifo,))] == [dead]
        assert finishes(lambda: main(["clean", str(tmp_path)]), fifos=(fifo,)) == 0
    assert sorted(os.listdir(tmp_path)) == ["tz-x"] and fifo.is_fifo()
    assert caplog.messages == [f"tierzero: ignoring {fifo} is a FIFO, not a regular file"]


SCAN_UNDER_A_CAP = """
import resource, sys
from tierzero.offload.disk.leftovers import find_leftovers
mapped = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (mapped + (1 << 30), resource.RLIM_INFINITY))
sys.exit(len(find_leftovers(sys.argv[1])))
"""


def test_an_owner_file_linked_to_dev_zero_is_not_read(tmp_path: Path) -> None:
    # In a process capped 1 GiB above its imports: a read of /dev/zero ends there, not at the machine's memory.
    os.symlink("/dev/zero", run_dir(tmp_path, "tz-y") / "rank0.owner")
    env = os.environ | {"PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", SCAN_UNDER_A_CAP, str(tmp_path)], env=env, capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stderr.strip().splitlines()[-1:]) == (
        0, [f"tierzero: ignoring {tmp_path / 'tz-y' / 'rank0.owner'} is a symlink, not a regular file"]
    )  # fmt: skip


def test_an_oversized_owner_file_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    owner = run_dir(tmp_path, "tz-big", json.dumps(record(dead_pid()) | {"pad": "x" * 10_000}))
    with caplog.at_level(logging.WARNING):
        assert find_leftovers(tmp_path) == []
    assert caplog.messages == [f"tierzero: ignoring {owner / 'rank0.owner'} is larger than the 4.0 KiB such a file may hold"]


@pytest.mark.parametrize(
    "bad", [{"pid": -1}, {"pid": 0}, {"pid": 1 << 70}, {"pid": True}, {"pid": "7"}, {"started": float("nan")}, {"host": None}]
)
def test_a_malformed_owner_record_is_skipped_never_fatal(tmp_path: Path, caplog: pytest.LogCaptureFixture, bad: dict) -> None:
    pid = dead_pid()
    odd = run_dir(tmp_path, "tz-odd", json.dumps(record(pid) | bad))
    dead = run_dir(tmp_path, "tz-dead", record(pid))
    with caplog.at_level(logging.WARNING):
        assert [x.dir for x in find_leftovers(tmp_path)] == [dead]
        assert main(["clean", str(tmp_path)]) == 0
        assert main(["clean", str(tmp_path)]) == 0
    assert os.listdir(tmp_path) == ["tz-odd"]
    assert caplog.messages == [f"tierzero: ignoring {odd / 'rank0.owner'}: not an owner record (a pid, host and start time)"]


def test_a_pid_psutil_refuses_counts_as_alive() -> None:
    assert owner_alive({"pid": -1, "started": time.time()}) is True


def test_an_owner_file_of_another_user_is_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture, other_user: int) -> None:
    owner = run_dir(tmp_path, "tz-theirs", record(dead_pid())) / "rank0.owner"
    with caplog.at_level(logging.WARNING):
        assert read_owner(owner) is None
        assert find_leftovers(tmp_path) == []
    assert caplog.messages == [f"tierzero: ignoring {owner} is owned by uid {os.geteuid()}, not by this user (uid {other_user})"]


def test_a_run_directory_of_another_user_is_not_even_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, other_user: int) -> None:
    run_dir(tmp_path, "tz-theirs", record(dead_pid()))
    read: list[Path] = []
    monkeypatch.setattr(leftovers, "read_owner", lambda path: read.append(path))
    assert find_leftovers(tmp_path) == [] and read == []


# --- the token cache ----------------------------------------------------------------------


@pytest.fixture
def corpus(tmp_path: Path) -> tuple[list, Any]:
    return find_sources(write_jsonl(tmp_path / "docs.jsonl", DOCS)), load_tokenizer(tiny_tokenizer(tmp_path / "tok"))


def cache_stem(corpus: tuple[list, Any], scratch: Path) -> str:
    """The name the cache gives this corpus: it follows from the inputs' paths, so another user can know it."""
    return token_stream(*corpus, cache_dir=scratch).path.stem


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    path = tmp_path / "victim" / "precious.txt"
    path.parent.mkdir()
    path.write_text("keep me")
    return path


def test_symlinks_at_the_names_the_cache_wrote_redirect_nothing(tmp_path: Path, corpus, victim: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    stem = cache_stem(corpus, tmp_path / "scratch")
    # The names the cache used to write under: `<stem>.npy.tmp-<pid>`, `<stem>.json.tmp-<pid>`, for pids near ours.
    for pid in range(os.getpid() - 50, os.getpid() + 50):
        for suffix in (".npy", ".json"):
            os.symlink(victim, cache / f"{stem}{suffix}.tmp-{pid}")
    missing = tmp_path / "victim" / "made-by-the-lock"
    os.symlink(missing, cache / f"{stem}.lock")
    with pytest.warns(UserWarning, match=rf"^token cache lock {re.escape(str(cache / stem))}.lock is a symlink, not a regular file: going on"):
        stream = token_stream(*corpus, cache_dir=cache)
    assert stream.built and stream.ids.tolist() == expected_stream(DOCS)
    assert victim.read_text() == "keep me" and not missing.exists()


def test_a_scratch_name_that_was_guessed_is_refused_not_written_through(
    tmp_path: Path, corpus, victim: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = safe_files.scratch_path(tmp_path / "x"), safe_files.scratch_path(tmp_path / "x")
    assert first != second and str(os.getpid()) not in first.name
    os.symlink(victim, tmp_path / f"kernels.{os.getpid()}.tmp")  # the name the cache files were written under
    write_json(tmp_path / "kernels.json", {"a": 1})
    assert read_json(tmp_path / "kernels.json") == {"a": 1} and victim.read_text() == "keep me"
    (tmp_path / "kernels.json").unlink()
    monkeypatch.setattr(safe_files.secrets, "token_hex", lambda n: "guessed")
    cache = tmp_path / "cache"
    cache.mkdir()
    stem = cache_stem(corpus, tmp_path / "scratch")
    os.symlink(victim, cache / f"{stem}.npy.tmp-guessed")
    with pytest.raises(FileExistsError, match=f"{stem}.npy.tmp-guessed"):
        token_stream(*corpus, cache_dir=cache)
    os.symlink(victim, tmp_path / "kernels.json.tmp-guessed")
    with pytest.raises(FileExistsError, match="kernels.json.tmp-guessed"):
        write_json(tmp_path / "kernels.json", {"a": 1})
    assert victim.read_text() == "keep me"


@pytest.mark.parametrize("planted", ["record", "ids"])
def test_a_fifo_in_the_cache_hangs_nothing_and_is_rebuilt_over(tmp_path: Path, corpus, planted: str) -> None:
    cache = tmp_path / "cache"
    npy = token_stream(*corpus, cache_dir=cache).path
    fifo = npy.with_suffix(".json") if planted == "record" else npy
    fifo.unlink()
    os.mkfifo(fifo)
    said = "has an unreadable record .*json" if planted == "record" else "cannot be read"
    with pytest.warns(UserWarning, match=rf"token cache {re.escape(str(npy))} {said} \(a FIFO, not a regular file\): tokenizing the corpus again"):
        stream = finishes(lambda: token_stream(*corpus, cache_dir=cache), fifos=(fifo,))
    assert stream.built and stream.ids.tolist() == expected_stream(DOCS) and fifo.is_file()


@pytest.mark.parametrize("damage", ["deep", "foreign"])
def test_a_deep_or_foreign_cache_record_is_ignored_and_the_cache_rebuilt(
    tmp_path: Path, corpus, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    cache = tmp_path / "cache"
    npy = token_stream(*corpus, cache_dir=cache).path
    meta = npy.with_suffix(".json")
    if damage == "deep":
        meta.write_text("[" * 100_000)
        said = rf"has an unreadable record {meta.name} \(ValueError\)"
    else:
        monkeypatch.setattr(safe_files, "this_user", lambda: os.geteuid() + 1)
        said = rf"has an unreadable record {meta.name} \(owned by uid {os.geteuid()}, not by this user"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stream = token_stream(*corpus, cache_dir=cache)
    assert stream.built and stream.ids.tolist() == expected_stream(DOCS)
    assert any(f"token cache {npy} " in str(w.message) and re.search(said, str(w.message)) for w in caught)


def test_a_cache_whose_names_cannot_be_replaced_is_bypassed(tmp_path: Path, corpus, monkeypatch: pytest.MonkeyPatch) -> None:
    # Another user's file at `<stem>.npy` in a sticky directory: the rename over it fails with EPERM.
    def refused(src: Any, dst: Any) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "replace", refused)
    cache = tmp_path / "cache"
    with pytest.warns(UserWarning, match=r"cannot be replaced \(Operation not permitted\): this run keeps its ids uncached"):
        stream = token_stream(*corpus, cache_dir=cache)
    assert stream.ids.tolist() == expected_stream(DOCS)
    assert list(cache.iterdir()) == []  # no scratch file left behind, nor the lock


# --- the kernel and disk caches -----------------------------------------------------------


@pytest.mark.parametrize("damage", ["deep", "large", "fifo", "link", "foreign"])
def test_a_cache_file_that_cannot_be_trusted_counts_as_empty(
    tmp_path: Path, victim: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    path = tmp_path / "kernels.json"
    good = {"k": {"kept": "mkl"}}
    path.write_text(json.dumps(good))
    assert read_json(path) == good
    if damage == "deep":
        path.write_text("{\"a\": " * 100_000)
    elif damage == "large":
        path.write_text(json.dumps(good | {"pad": "x" * (17 << 20)}))
    elif damage == "fifo":
        path.unlink()
        os.mkfifo(path)
    elif damage == "link":
        path.unlink()
        victim.write_text(json.dumps(good))
        os.symlink(victim, path)
    else:
        monkeypatch.setattr(safe_files, "this_user", lambda: os.geteuid() + 1)
    with caplog.at_level(logging.WARNING):
        assert finishes(lambda: read_json(path), fifos=(path,)) == {}
    named = [] if damage == "deep" else [m for m in caplog.messages if m.startswith(f"tierzero: ignoring the cache file {path} is ")]
    assert len(named) == (0 if damage == "deep" else 1)


# --- saved datasets -------------------------------------------------------------------------


@pytest.mark.parametrize("escape", ["dotdot", "absolute", "symlink", "split"])
def test_a_saved_dataset_names_no_file_outside_its_directory(tmp_path: Path, escape: str) -> None:
    data = write_dataset(tmp_path / "ds", DOCS)
    state = data / "state.json"
    fields = json.loads(state.read_text())
    name = fields["_data_files"][0]["filename"]
    if escape == "dotdot":
        fields["_data_files"] = [{"filename": "../../etc/passwd"}]
    elif escape == "absolute":
        fields["_data_files"] = [{"filename": "/etc/passwd"}]
    elif escape == "symlink":
        (data / name).unlink()
        os.symlink("/etc/passwd", data / name)
    if escape == "split":
        for marker in ("state.json", "dataset_info.json"):
            (data / marker).rename(tmp_path / marker)
        (data / "dataset_dict.json").write_text(json.dumps({"splits": ["../../etc"]}))
        where, bad = data / "dataset_dict.json", "'../../etc'"
    else:
        state.write_text(json.dumps(fields))
        where, bad = state, repr(fields["_data_files"][0]["filename"])
    source = find_sources(data, format="datasets")[0]
    with pytest.raises(ValueError, match=rf"^data.path {re.escape(str(data))}: {re.escape(str(where))} names {re.escape(bad)}, not a file inside"):
        next(read_documents(source))


def test_a_good_saved_dataset_still_reads(tmp_path: Path) -> None:
    source = find_sources(write_dataset(tmp_path / "ds", DOCS), format="datasets")[0]
    assert list(read_documents(source)) == DOCS


# --- a real second user --------------------------------------------------------------------


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A 1777 directory under /tmp that `nobody` can reach (a test's tmp_path sits under a 0700 one)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("planting as a second user needs root and setpriv")
    path = Path(tempfile.mkdtemp(prefix="tz-shared-", dir="/tmp"))
    path.chmod(0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def as_nobody(script: str) -> None:
    command = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sh", "-ec", script]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        pytest.skip(f"setpriv cannot run as uid {NOBODY} here: {done.stderr.strip()[:200]}")


def test_what_another_user_plants_in_a_shared_swap_path_and_cache(tmp_path: Path, shared_dir: Path, corpus, victim: Path) -> None:
    pid, host = dead_pid(), socket.gethostname()
    cache = shared_dir / "cache"
    stem = cache_stem(corpus, tmp_path / "scratch")
    theirs = json.dumps({"pid": pid, "host": host, "started": time.time(), "rank": 0})
    as_nobody(
        f"cd {shared_dir}; mkdir tz-x tz-y tz-z; mkfifo tz-x/rank0.owner; ln -s /dev/zero tz-y/rank0.owner; "
        f"echo '{theirs}' > tz-z/rank0.owner; echo 1 > tz-z/rank0.swap; "
        f"mkdir -m 1777 cache; mkfifo cache/{stem}.json; ln -s {victim.parent / 'made'} cache/{stem}.lock; "
        f"for p in $(seq {os.getpid() - 20} {os.getpid() + 20}); do ln -s {victim} cache/{stem}.npy.tmp-$p; done"
    )
    mine = run_dir(shared_dir, "tz-mine", record(pid))
    fifos = (shared_dir / "tz-x" / "rank0.owner", cache / f"{stem}.json")
    assert [x.dir for x in finishes(lambda: find_leftovers(shared_dir), fifos=fifos)] == [mine]
    assert finishes(lambda: main(["clean", str(shared_dir)]), fifos=fifos) == 0
    assert sorted(p.name for p in shared_dir.iterdir()) == ["cache", "tz-x", "tz-y", "tz-z"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stream = finishes(lambda: token_stream(*corpus, cache_dir=cache), fifos=fifos)
    assert stream.ids.tolist() == expected_stream(DOCS)
    assert victim.read_text() == "keep me" and not (victim.parent / "made").exists()
    assert {str(w.message).split(" (")[0].split(": ")[0] for w in caught} >= {
        f"token cache lock {cache / stem}.lock is a symlink, not a regular file",
        f"token cache {cache / stem}.npy has an unreadable record {stem}.json",
    }
