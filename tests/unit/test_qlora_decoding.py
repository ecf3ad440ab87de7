"""How often stage 3 dequantizes a quantized frozen base: it keeps the last quantized units gathered
from their forward to their backward, as many as `prefetch.max_live_bytes` holds, so that each is read
and decoded once a step, and the run stays peft's on the dequantized base bit for bit.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from test_qlora import _config, _frozen_units, _pair, _train_engine, _train_reference

import tierzero
from tierzero.units.quantized_base import BaseCodec
from tierzero.units.unit import is_root


def _block_units(engine: Any) -> list[Any]:
    return [u for u in _frozen_units(engine) if not is_root(u)]


@pytest.mark.parametrize("kept", [0, 1, 2])
def test_stage3_decodes_the_last_units_once_a_step_as_many_as_max_live_bytes_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kept: int
) -> None:
    model, reference = _pair()
    ref_losses, ref_params = _train_reference(reference)
    decoded: Counter[str] = Counter()

    def counting(method: Any) -> Any:
        def counted(self: BaseCodec, stored: torch.Tensor, **kwargs: Any) -> Any:
            decoded[kwargs["what"].removeprefix("unit ")] += 1
            return method(self, stored, **kwargs)

        return counted

    # On the decoder's thread where the native kernels are built ([Note: decoding ahead]), else on the caller's.
    monkeypatch.setattr(BaseCodec, "decode", counting(BaseCodec.decode))
    monkeypatch.setattr(BaseCodec, "share_natively", counting(BaseCodec.share_natively))
    with tierzero.initialize(_pair()[0], _config(tmp_path, stage=3, params="cpu")) as probe:
        unit_bytes = {4 * u.padded_numel for u in _block_units(probe)}  # a block's frozen unit, gathered in fp32
    assert len(unit_bytes) == 1
    unit_bytes = unit_bytes.pop()
    config = _config(tmp_path, stage=3, params="nvme")
    config["prefetch"] = {"bytes": 1024, "max_live_bytes": kept * unit_bytes + unit_bytes // 2}
    decoded.clear()
    with tierzero.initialize(model, config) as engine:
        losses, trained = _train_engine(engine)
        names = [u.name for u in _block_units(engine)]
    assert losses == ref_losses
    for name, value in ref_params.items():
        assert torch.equal(trained[name], value), name
    # Forward and backward each decode a block's frozen unit, but the last `kept`, decoded once a step;
    # and `full_state_dict` decodes each once more.
    steps = len(ref_losses)
    assert [decoded[name] for name in names] == [2 * steps + 1] * (len(names) - kept) + [steps + 1] * kept
