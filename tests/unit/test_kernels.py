"""precision.linear_kernel: oneDNN's fp32 CPU linear, its gradients, where it applies, and the
engine's steps with it against plain PyTorch with the same kernel, bit for bit."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tierzero.cli.bench.contenders import LR, PLACEMENTS, EngineTraining, engine_config, gpt, token_batch
from tierzero.common.cache_files import cache_path
from tierzero.units import kernels
from tierzero.units.kernels import (
    CANDIDATES,
    KEEP_S,
    KERNELS_FILE,
    ROUNDS,
    OneDnnLinear,
    chosen,
    chosen_text,
    onednn_available,
    use_linear_kernel,
)

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this PyTorch has no oneDNN")


def _float64_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("shape", [(7, 300), (2, 7, 300), (3, 2, 5, 300)])
@pytest.mark.parametrize("bias", [True, False])
def test_forward_and_gradients_match_the_float64_linear(shape: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(*shape, requires_grad=True)
    w = torch.randn(200, 300, requires_grad=True)
    b = torch.randn(200, requires_grad=True) if bias else None
    y = OneDnnLinear.apply(x, w, b)
    upstream = torch.randn_like(y)
    y.backward(upstream)

    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    b64 = None if b is None else b.detach().double().requires_grad_()
    y64 = F.linear(x64, w64, b64)
    y64.backward(upstream.double())
    # fp32 sums of 300 (or 70) products of unit normals: a few ulps of their magnitude.
    for got, want in [(y, y64), (x.grad, x64.grad), (w.grad, w64.grad)] + ([(b.grad, b64.grad)] if bias else []):
        assert got is not None and want is not None and got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-4)


@pytest.mark.parametrize(("product", "name"), [(p, n) for p, names in CANDIDATES.items() for n in names])
def test_every_candidate_of_the_backward_computes_its_product(product: str, name: str) -> None:
    torch.manual_seed(2)
    grad, weight, x = torch.randn(9, 200), torch.randn(200, 300), torch.randn(9, 300)
    a, b, want = (
        (grad, weight, grad.double() @ weight.double())
        if product == "input gradient"
        else (grad, x, grad.double().t() @ x.double())
    )
    got = CANDIDATES[product][name](a, b)
    assert got.dtype == torch.float32 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-4)


def _fake_candidates(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """'slow' and 'quick' in place of the input gradient's candidates, in a process that kept none;
    the names they were called by, in order."""
    calls: list[str] = []

    def product(name: str, pause: float):
        def run(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            calls.append(name)
            time.sleep(pause)
            return a.mm(b)

        return run

    monkeypatch.setattr(kernels, "_kept", {})
    monkeypatch.setitem(CANDIDATES, "input gradient", {"slow": product("slow", 0.02), "quick": product("quick", 0.0)})
    return calls


def test_the_backward_keeps_the_faster_candidate_per_shape_timed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _fake_candidates(monkeypatch)
    a, b = torch.randn(4, 6), torch.randn(6, 5)
    torch.testing.assert_close(kernels._fastest("input gradient", a, b), a.mm(b))
    assert calls.count("slow") == 1 + ROUNDS and calls.count("quick") == 1 + ROUNDS + 1
    calls.clear()
    kernels._fastest("input gradient", a, b)
    kernels._fastest("input gradient", torch.randn(3, 6), b)  # 3 tokens round up to 4, as 4 do
    assert calls == ["quick", "quick"]  # kept, not timed again
    kernels._fastest("input gradient", torch.randn(5, 6), b)  # a new shape is timed anew
    assert calls.count("slow") == 1 + ROUNDS
    assert chosen().keys() == {"input gradient of 5 -> 6 at 3-4 tokens", "input gradient of 5 -> 6 at 5-8 tokens"}
    said = chosen()["input gradient of 5 -> 6 at 3-4 tokens"]
    assert said.startswith("quick ") and ", slow " in said


def test_a_choice_holds_for_the_machine_for_a_day_across_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    here, threads = kernels.machine(), torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:  # a process computing with other threads times for itself
        assert kernels.machine() != here and torch.__version__ in here
    finally:
        torch.set_num_threads(threads)
    calls = _fake_candidates(monkeypatch)
    a, b = torch.randn(4, 6), torch.randn(6, 5)
    kernels._fastest("input gradient", a, b)
    assert calls.count("slow") == 1 + ROUNDS
    path = cache_path(KERNELS_FILE)
    entry = json.loads(path.read_text())[here]["input gradient 5->6 at 4 tokens, float32"]
    assert entry["kept"] == "quick" and entry["seconds"]["slow"] > 0.02 > entry["seconds"]["quick"]

    def next_process(machine: str = here) -> None:
        monkeypatch.setattr(kernels, "_kept", {})
        monkeypatch.setattr(kernels, "machine", lambda: machine)
        calls.clear()
        torch.testing.assert_close(kernels._fastest("input gradient", a, b), a.mm(b))

    next_process()
    assert calls == ["quick"]  # taken from the file, not timed
    assert chosen()["input gradient of 5 -> 6 at 3-4 tokens"].startswith("quick ")
    next_process("another CPU, 2 threads, torch 2.13.0+cpu")
    assert calls.count("slow") == 1 + ROUNDS  # another machine's timing
    assert len(json.loads(path.read_text())) == 2
    stale = json.loads(path.read_text())
    stale[here]["input gradient 5->6 at 8 tokens, float32"] = {**entry, "measured": time.time() - KEEP_S}
    path.write_text(json.dumps(stale))
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + KEEP_S + 1)
    next_process()
    assert calls.count("slow") == 1 + ROUNDS  # a day later: timed again, and the older entries dropped
    assert list(json.loads(path.read_text())[here]) == ["input gradient 5->6 at 4 tokens, float32"]


@pytest.mark.parametrize(
    "stored",
    ['{"kept": "faster", "seconds": {"slow": 1, "quick": 1}, "measured": NOW}',
     '{"kept": "slow", "seconds": {"slow": 1}, "measured": NOW}',
     '{"kept": "slow", "seconds": {"slow": 1, "quick": NaN}, "measured": NOW}',
     '{"kept": "slow", "seconds": {"slow": 1, "quick": 1}, "measured": "yesterday"}',
     '"slow"',
     None],
    ids=["unknown-candidate", "missing-time", "nan-time", "bad-date", "not-an-entry", "not-json"],
)  # fmt: skip
def test_a_kept_choice_that_cannot_be_read_is_timed_again_and_rewritten(
    stored: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = _fake_candidates(monkeypatch)
    path = cache_path(KERNELS_FILE)
    path.parent.mkdir(parents=True, exist_ok=True)
    name = "input gradient 5->6 at 4 tokens, float32"
    entry = stored.replace("NOW", str(time.time())) if stored else None
    path.write_text(f'{{"{kernels.machine()}": {{"{name}": {entry}}}}}' if entry else "{not json")
    kernels._fastest("input gradient", torch.randn(4, 6), torch.randn(6, 5))
    assert calls.count("slow") == 1 + ROUNDS
    assert json.loads(path.read_text())[kernels.machine()][name]["kept"] == "quick"


def test_what_the_backward_kept_is_said_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "_kept", {})
    assert chosen_text() is None
    f32 = torch.float32
    kernels._kept.update({
        ("input gradient", 10240, 2560, 64, f32): ("mm", {"mm": 0.06, "onednn": 0.2}),
        ("weight gradient", 10240, 2560, 64, f32): ("onednn", {"mm": 0.06, "onednn": 0.05}),
        ("input gradient", 2560, 10240, 64, f32): ("mm", {"mm": 0.05, "onednn": 0.08}),
        ("weight gradient", 2560, 10240, 64, f32): ("mm", {"mm": 0.05, "onednn": 0.06}),
        ("weight gradient", 2560, 7680, 64, f32): ("onednn", {"mm": 0.04, "onednn": 0.03}),
    })  # fmt: skip
    assert chosen_text() == "input gradient on mm (2 shapes); weight gradient on onednn (2 shapes), mm (1)"
    assert chosen()["weight gradient of 10240 -> 2560 at 33-64 tokens"] == "onednn 50.0 ms, mm 60.0 ms"


def test_non_contiguous_inputs_and_a_weight_inside_a_flat_buffer() -> None:
    """The engine binds weights as views into a unit's flat buffer (offset, not at its start)."""
    torch.manual_seed(1)
    flat = torch.randn(3 + 40 * 60 + 40)
    w, b = flat[3 : 3 + 2400].view(40, 60), flat[3 + 2400 :]
    x = torch.randn(5, 120)[:, ::2]
    assert not x.is_contiguous()
    torch.testing.assert_close(OneDnnLinear.apply(x, w, b).double(), _float64_reference(x, w, b), rtol=0, atol=1e-4)


def test_only_plain_linear_layers_change_and_torch_changes_nothing() -> None:
    class Adapter(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2

    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), Adapter(8, 8), nn.Linear(8, 4))
    assert use_linear_kernel(model, "torch") == 0
    assert all("forward" not in vars(m) for m in model.modules())
    assert use_linear_kernel(model, "onednn") == 2
    assert "forward" in vars(model[0]) and "forward" not in vars(model[2]) and "forward" in vars(model[3])
    with pytest.raises(ValueError, match="unknown linear kernel 'mkl'"):
        use_linear_kernel(model, "mkl")


def test_the_dispatch_takes_onednn_for_fp32_cpu_and_f_linear_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    real = OneDnnLinear.apply
    monkeypatch.setattr(OneDnnLinear, "apply", lambda *a: calls.append("onednn") or real(*a))
    layer = nn.Linear(16, 8)
    use_linear_kernel(layer, "onednn")
    x = torch.randn(4, 16)
    layer(x)
    assert calls == ["onednn"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lowered = layer(x)
    assert calls == ["onednn"] and lowered.dtype == torch.bfloat16  # autocast's own F.linear
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(lowered, F.linear(x, layer.weight, layer.bias))
    layer.to(torch.float64)
    assert torch.equal(layer(x.double()), F.linear(x.double(), layer.weight, layer.bias))
    assert calls == ["onednn"]


def test_a_deep_copy_computes_with_its_own_weights() -> None:
    layer = nn.Linear(6, 3)
    use_linear_kernel(layer, "onednn")
    twin = copy.deepcopy(layer)
    with torch.no_grad():
        twin.weight.zero_()
        twin.bias.fill_(1.0)
    assert torch.equal(twin(torch.randn(2, 6)), torch.ones(2, 3))


def _plain_steps(steps: int, kernel: str) -> dict[str, torch.Tensor]:
    model = gpt("tiny")
    use_linear_kernel(model, kernel)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    for step in range(steps):
        tokens, targets = token_batch(step, batch=4, seq=16)
        _, loss = model(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize(("stage", "placement"), [(3, "params-optimizer-nvme"), (1, "device")])
def test_the_engine_steps_as_plain_pytorch_with_the_same_kernel(
    stage: int, placement: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = engine_config(stage=stage, placement=PLACEMENTS[placement], nvme_path=tmp_path)
    cfg["precision"]["linear_kernel"] = "onednn"
    monkeypatch.setattr(kernels, "_kept", {})
    run = EngineTraining("tiny", cfg)
    try:
        for step in range(3):
            tokens, targets = token_batch(step, batch=4, seq=16)
            run.step(tokens, targets)
        got = run.engine.full_state_dict()
    finally:
        run.close()
    # The engine's backward ran the kernel's products (whether their bits differ from PyTorch's
    # own depends on the CPU: on one Xeon they did not, at these shapes).
    assert {product.split(" of ")[0] for product in chosen()} == set(CANDIDATES)
    want = _plain_steps(3, "onednn")
    assert got is not None and want.keys() <= got.keys()
    assert all(torch.equal(got[name], want[name]) for name in want)
