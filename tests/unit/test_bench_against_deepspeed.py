"""`bench train --against deepspeed` without DeepSpeed or a GPU: the refusals, the flags reaching the
comparison, and the children run for real, DeepSpeed's played by a stand-in `deepspeed` package on
their PYTHONPATH (ZeRO's API over a plain model, each step slowed by a known sleep), so that the
ratio, the JSON and gpu-check's report are checked against timings whose floor the test knows."""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tierzero.cli.bench import gpu_check
from tierzero.cli.bench import train as train_command
from tierzero.cli.bench.contenders import PlainTraining, token_batch
from tierzero.cli.bench.train.against import TARGET_RATIO, AgainstResult, _run_alone, compare_with_deepspeed, deepspeed_missing
from tierzero.cli.bench.train.alone import AloneSpec
from tierzero.cli.bench.train.gpu import bench_train_device
from tierzero.cli.main import main

STEP_S = 0.15
"""The stand-in's sleep in each step: DeepSpeed's steps can be no shorter."""

STAND_IN = f'''
"""A stand-in for DeepSpeed: init_distributed, and initialize's engine over the plain model."""
import json, os, time
import torch

__version__ = "0.0+stand-in"


def init_distributed(dist_backend=None, **kwargs):
    torch.distributed.init_process_group(
        dist_backend, init_method=f"tcp://{{os.environ['MASTER_ADDR']}}:{{os.environ['MASTER_PORT']}}",
        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
    )


class Engine:
    def __init__(self, model, config):
        self.module, self.clip = model, config["gradient_clipping"]
        self.optimizer = torch.optim.AdamW(model.parameters(), fused=True, **config["optimizer"]["params"])

    def __call__(self, *args):
        return self.module(*args)

    def backward(self, loss):
        loss.backward()

    def step(self):
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        time.sleep({STEP_S})


def initialize(model=None, model_parameters=None, config=None, **kwargs):
    if os.environ.get("STAND_IN_FAIL"):
        raise RuntimeError("the stand-in refuses: " + os.environ["STAND_IN_FAIL"])
    time.sleep(float(os.environ.get("STAND_IN_HANG_S", "0")))
    record = {{"backend": torch.distributed.get_backend(), "world_size": torch.distributed.get_world_size(), "config": config}}
    with open(os.environ["STAND_IN_RECORD"], "w") as f:
        json.dump(record, f)
    engine = Engine(model.to("cuda" if torch.cuda.is_available() else "cpu"), config)
    return engine, engine.optimizer, None, None
'''

SHAPE = {"preset": "tiny", "seq": 32, "batch": 2, "steps": 3, "warmup": 1, "dtype": "fp32", "clip": 1.0}


def _stand_in(root: Path, patch: pytest.MonkeyPatch) -> Path:
    """The stand-in importable here (find_spec) and in the children (PYTHONPATH); where it records what it was given."""
    (root / "deepspeed").mkdir(parents=True)
    (root / "deepspeed" / "__init__.py").write_text(STAND_IN)
    patch.syspath_prepend(str(root))
    patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    patch.setenv("STAND_IN_RECORD", str(root / "record.json"))
    return root / "record.json"


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    return _stand_in(tmp_path / "site", monkeypatch)


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> tuple[AgainstResult, dict[str, Any]]:
    """One real comparison: tierzero and the stand-in, each alone in a child process; and what the stand-in was given.
    The stand-in leaves the path when it is done: the other tests say where it is."""
    root = tmp_path_factory.mktemp("against")
    with pytest.MonkeyPatch.context() as patch:
        record = _stand_in(root / "site", patch)
        result = compare_with_deepspeed(nvme_path=root / "swap", **SHAPE)
        return result, json.loads(record.read_text())


def test_deepspeed_gets_the_first_gpu_runs_config(compared: tuple[AgainstResult, dict[str, Any]]) -> None:
    """scripts/ds_gpu.py's config at the tiny GPT's hidden size (64), offload to host memory unpinned on the CPU."""
    result, given = compared
    h = 64
    expected = {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "bf16": {"enabled": False}, "steps_per_print": 10**9, "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": 3, "overlap_comm": True, "contiguous_gradients": True,
            "offload_param": {"device": "cpu", "pin_memory": False}, "offload_optimizer": {"device": "cpu", "pin_memory": False},
            "reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": 3686, "stage3_param_persistence_threshold": 10 * h,
        },
    }  # fmt: skip
    assert given == {"backend": "gloo", "world_size": 1, "config": expected}
    assert result.config == expected


def test_the_ratio_and_the_json_come_from_both_runs(compared: tuple[AgainstResult, dict[str, Any]]) -> None:
    result, _ = compared
    data = json.loads(json.dumps(result.to_dict()))
    tz, ds = data["tierzero"], data["deepspeed"]
    assert (len(tz["step_s"]), len(ds["step_s"]), len(tz["losses"]), len(ds["losses"])) == (3, 3, 4, 4)
    assert min(ds["step_s"]) >= STEP_S and tz["version"] != ds["version"] == "0.0+stand-in"
    assert ds["median_s"] == statistics.median(ds["step_s"]) and tz["median_s"] == statistics.median(tz["step_s"])
    assert data["ratio"] == tz["median_s"] / ds["median_s"] and data["target_ratio"] == TARGET_RATIO == 0.5
    assert data["met"] is (data["ratio"] <= 0.5)
    assert tz["device_peak_bytes"] is None and tz["build_s"] > 0 and ds["build_s"] > 0
    shape = {k: data[k] for k in ("preset", "seq", "batch", "dtype", "clip", "placement")}
    assert shape == {"preset": "tiny", "seq": 32, "batch": 2, "dtype": "fp32", "clip": 1.0, "placement": "cpu"}
    # the same seeded model on the same batches: plain PyTorch's losses, here, are both children's
    reference = PlainTraining("tiny", clip=1.0)
    losses = [float(reference.step(*token_batch(n, batch=2, seq=32))) for n in range(4)]
    assert ds["losses"] == losses and max(abs(a - b) for a, b in zip(tz["losses"], losses)) <= 1e-4
    assert data["max_loss_difference"] == max(abs(a - b) for a, b in zip(tz["losses"], ds["losses"])) <= 1e-4


def test_the_comparison_reads_as_one_block(compared: tuple[AgainstResult, dict[str, Any]]) -> None:
    result, _ = compared
    text = result.format()
    verdict = "met" if result.ratio <= 0.5 else "missed"
    assert text.splitlines()[0] == (
        "against DeepSpeed 0.0+stand-in: ZeRO-3, offload_param + offload_optimizer cpu, fp32, clip 1; "
        "each alone in a child process, median of 3 steps after 1"
    )
    assert f"DeepSpeed {result.other.median_s * 1e3:.1f} ms   ratio {result.ratio:.2f}x (target <= 0.50: {verdict})" in text
    assert "device peak    tierzero -   DeepSpeed -" in text


def test_a_failed_or_stuck_contender_says_so(stand_in: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = AloneSpec(which="deepspeed", **SHAPE, placement="cpu", nvme_path=str(tmp_path), result=str(tmp_path / "r.json"))
    monkeypatch.setenv("STAND_IN_FAIL", "no GPU today")
    with pytest.raises(RuntimeError, match=r"(?s)deepspeed alone failed \(exit 1\).*the stand-in refuses: no GPU today"):
        _run_alone(spec, timeout_s=None)
    monkeypatch.delenv("STAND_IN_FAIL")
    monkeypatch.setenv("STAND_IN_HANG_S", "600")
    with pytest.raises(RuntimeError, match=r"^deepspeed alone ran past 2 s and was stopped$"):
        _run_alone(spec, timeout_s=2.0)
    assert not stand_in.exists()


def _fail(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def test_refusals_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["bench", "train", "--nvme-path", str(tmp_path), "--against", "deepspeed"]
    assert _fail(base, capsys) == (
        "tierzero: error: --against deepspeed needs --device cuda, got --device cpu: DeepSpeed's ZeRO-3 offload moves "
        "state between host memory and a GPU, and on the CPU there is no device to offload from\n"
    )
    assert _fail(base + ["--device", "cuda"], capsys) == (
        "tierzero: error: --against deepspeed matches --placement cpu or device (DeepSpeed's offload_param and "
        "offload_optimizer to cpu, or none), got --placement params-optimizer-nvme: pass --placement cpu\n"
    )
    with pytest.raises(SystemExit):
        main(base[:-1] + ["megatron"])
    assert "invalid choice: 'megatron' (choose from deepspeed)" in capsys.readouterr().err.replace("'deepspeed'", "deepspeed")


def test_a_shape_the_children_cannot_run_is_refused_before_they_start(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^--against needs --steps >= 1 and --warmup >= 1, got 3 and 0$"):
        compare_with_deepspeed(nvme_path=tmp_path, **{**SHAPE, "warmup": 0})
    with pytest.raises(ValueError, match=r"^--preset 3b: the built-in GPTs are tiny, demo, .*2b"):
        compare_with_deepspeed(nvme_path=tmp_path, **{**SHAPE, "preset": "3b"})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(deepspeed_missing() is None, reason="DeepSpeed is installed here")
def test_missing_deepspeed_names_the_install(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "train", "--device", "cuda", "--placement", "cpu", "--nvme-path", str(tmp_path), "--against", "deepspeed"]
    assert _fail(argv, capsys) == (
        f"tierzero: error: --against deepspeed: DeepSpeed is not installed for {sys.executable}: `pip install deepspeed` "
        "(or the optional extra: pip install -e '.[gpu-compare]'), on the machine with the GPU\n"
    )
    report = gpu_check.run_against(mode="dry-run", nvme_path=tmp_path)
    assert report == {"ok": True, "skipped": deepspeed_missing()}
    built = gpu_check.build_report(mode="cuda", env={}, tests=None, bench=None, against=report)
    assert built["ok"] and built["against"] == report


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_with_deepspeed_but_no_gpu_the_device_is_refused(stand_in: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "train", "--device", "cuda", "--placement", "cpu", "--nvme-path", str(tmp_path), "--against", "deepspeed"]
    assert _fail(argv, capsys).startswith("tierzero: error: --device cuda needs a CUDA GPU and torch")
    assert not stand_in.exists()


def test_the_flags_reach_the_comparison_and_the_json(
    compared: tuple[AgainstResult, dict[str, Any]], stand_in: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """The whole command on the CPU: the comparison answered by the module's real one, the bench run here for real."""
    result, _ = compared
    calls: list[tuple[str, dict[str, Any]]] = []

    def comparison(**kwargs: Any) -> AgainstResult:
        calls.append(("against", kwargs))
        return result

    def bench(**kwargs: Any) -> Any:
        calls.append(("bench", kwargs))
        return bench_train_device(**{**kwargs, "device": "cpu", "peak_bytes": 1 << 20})

    monkeypatch.setattr(train_command, "check_device", lambda device: None)
    monkeypatch.setattr(train_command, "compare_with_deepspeed", comparison)
    monkeypatch.setattr(train_command, "bench_train_device", bench)
    out = tmp_path / "train.json"
    argv = ["bench", "train", "--device", "cuda", "--placement", "cpu", "--nvme-path", str(tmp_path / "swap"), "--json", str(out)]
    argv += ["--against", "deepspeed", "--preset", "tiny", "--seq", "16", "--steps", "1", "--warmup", "1", "--dtype", "bf16", "--clip", "1"]
    assert main(argv) == 0
    shape = {"preset": "tiny", "seq": 16, "batch": 8, "steps": 1, "warmup": 1, "dtype": "bf16", "clip": 1.0, "placement": "cpu"}
    assert [name for name, _ in calls] == ["against", "bench"]  # the children before anything of this process
    assert calls[0][1] == {"nvme_path": str(tmp_path / "swap"), **shape}
    assert {k: calls[1][1][k] for k in shape} == shape
    report = json.loads(out.read_text())
    assert report["against"] == json.loads(json.dumps(result.to_dict()))
    assert report["summary"]["tierzero_over_deepspeed"] == result.ratio and report["preset"] == "tiny"
    assert result.format() in capsys.readouterr().out


def test_gpu_check_runs_the_comparison_where_deepspeed_imports(stand_in: Path, tmp_path: Path) -> None:
    against = gpu_check.run_against(mode="dry-run", nvme_path=tmp_path)
    shape = gpu_check.AGAINST_SHAPES["dry-run"]
    assert against["ok"] and against["version"] == "0.0+stand-in" and against["seconds"] > 0
    assert len(against["deepspeed"]["step_s"]) == shape["steps"] and min(against["deepspeed"]["step_s"]) >= STEP_S
    assert against["ratio"] == against["tierzero"]["median_s"] / against["deepspeed"]["median_s"]
    out = tmp_path / "gpu-check.json"
    gpu_check.write_report(gpu_check.build_report(mode="dry-run", env={}, tests=None, bench=None, against=against), out)
    assert json.loads(out.read_text())["against"] == json.loads(json.dumps(against))
    broken = {"ok": False, "error": "RuntimeError: deepspeed alone failed (exit 1)"}
    assert gpu_check.build_report(mode="dry-run", env={}, tests=None, bench=None, against=broken)["ok"]
    assert gpu_check.build_report(mode="cuda", env={}, tests=None, bench=None, against=broken)["problems"] == [
        "against deepspeed: RuntimeError: deepspeed alone failed (exit 1)"
    ]
