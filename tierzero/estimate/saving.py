"""What quantized state saves: a config's estimate beside the same config with its base and moments unquantized.

`tierzero estimate` on a config with `model.lora.base_dtype: nf4 | int8` or `optimizer.state_dtype:
int8 | bf16` estimates the config a second time with those keys at their unquantized values (the
base in precision.param_dtype, fp32 moments) and the same homes, so that the two columns differ in
the quantized bytes alone: each tier's bytes, the NVMe traffic and the step-time floor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tierzero.common.sizes import format_size
from tierzero.common.slices import Kind, Tier
from tierzero.config import load_config
from tierzero.estimate.estimator import Estimate, Target, estimate
from tierzero.stages.plan import Homes

__all__ = ["Saving", "base_homes", "compare_unquantized", "unquantized_overrides"]


def unquantized_overrides(cfg: Any) -> dict[str, Any]:
    """The keys that turn `cfg`'s quantized state back into plain values; {} when none is quantized."""
    overrides: dict[str, Any] = {}
    if cfg.model.lora.quantized(cfg.precision.param_dtype) is not None:
        overrides.update({"model.lora.base_dtype": "param", "model.lora.double_quant": False})
    if cfg.optimizer.state_dtype != "fp32":
        overrides["optimizer.state_dtype"] = "fp32"
    return overrides


def _setting(cfg: Any, key: str) -> str:
    """`cfg`'s value at the dotted `key`, as a config file spells it (base_dtype param: the dtype it stands for)."""
    section, *rest = key.split(".")
    value = getattr(cfg, section)
    for name in rest:
        value = getattr(value, name)
    if key == "model.lora.base_dtype" and value == "param":
        return cfg.precision.param_dtype
    return str(value).lower() if isinstance(value, bool) else str(value)


def base_homes(result: Estimate) -> dict[Tier, int]:
    """Bytes of the quantized frozen base (the PARAM slices kept encoded) in each tier, per rank."""
    assert result.plan is not None
    homes = dict.fromkeys(Tier, 0)
    for spec in result.plan.all():
        if spec.kind is Kind.PARAM and spec.codec is not None:
            homes[spec.home] += spec.nbytes
    return homes


@dataclass(frozen=True, slots=True, kw_only=True)
class Saving:
    """One config's estimate (`quantized`) and the same config's with plain state (`unquantized`)."""

    changed: dict[str, tuple[str, str]]
    """Key -> (its value in the config, its unquantized value)."""
    quantized: Estimate
    unquantized: Estimate

    @staticmethod
    def _figures(result: Estimate) -> dict[str, Any]:
        return {
            "tiers": {t.value: {"homes": e.home_total, "peak": e.peak, "fits": e.fits} for t, e in result.tiers.items()},
            "nvme_read_per_step": result.nvme_read,
            "nvme_written_per_step": result.nvme_written,
            "step_floor_s": result.step_floor_s,
            "fits": result.fits,
        }

    def to_json(self) -> dict[str, Any]:
        """Both estimates' figures as plain JSON types, and the keys that tell them apart."""
        return {
            "changed": {key: {"config": q, "unquantized": u} for key, (q, u) in self.changed.items()},
            "base_homes": {t.value: n for t, n in base_homes(self.quantized).items()},
            "quantized": self._figures(self.quantized),
            "unquantized": self._figures(self.unquantized),
        }

    def lines(self) -> list[str]:
        """The two estimates side by side: per tier its homes and peak, then the disk traffic and step floor."""
        fs = format_size
        keys = ", ".join(f"{key} {q} (unquantized: {u})" for key, (q, u) in self.changed.items())
        rows = [["per rank", "quantized", "unquantized", "saved"]]
        for tier in Tier:
            q, u = self.quantized.tiers[tier], self.unquantized.tiers[tier]
            rows.append([f"{tier.value} homes", fs(q.home_total), fs(u.home_total), fs(u.home_total - q.home_total)])
            if tier is not Tier.NVME:
                rows.append([f"{tier.value} peak", fs(q.peak), fs(u.peak), fs(u.peak - q.peak)])
        for name, q_n, u_n in (
            ("nvme read/step", self.quantized.nvme_read, self.unquantized.nvme_read),
            ("nvme write/step", self.quantized.nvme_written, self.unquantized.nvme_written),
        ):
            rows.append([name, fs(q_n), fs(u_n), fs(u_n - q_n)])
        q_s, u_s = self.quantized.step_floor_s, self.unquantized.step_floor_s
        rows.append(["step-time floor", f"{q_s:.3f} s", f"{u_s:.3f} s", f"{u_s / q_s:.2f}x" if q_s > 0 else "-"])
        rows.append(["fits", *("yes" if r.fits else "NO" for r in (self.quantized, self.unquantized)), ""])
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        table = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
        lines = [f"quantized state beside the same config unquantized: {keys}", *table]
        base = {t: n for t, n in base_homes(self.quantized).items() if n}
        if base:
            where = ", ".join(f"{fs(n)} on {t.value}" for t, n in base.items())
            lines.append(f"the frozen base, {self.changed['model.lora.base_dtype'][0]}: {where}")
        return lines


def compare_unquantized(
    cfg: Any,
    result: Estimate,
    *,
    world_size: int = 1,
    local_world_size: int | None = None,
    target: Target | None = None,
    homes: Homes | None = None,
    extra: dict[str, Any] | None = None,
) -> Saving | None:
    """`result` (the estimate of `cfg`) beside `cfg` unquantized, estimated alike; None when nothing is quantized.

    `homes`: the slices' homes `result` was estimated with (a plan's), kept for the unquantized config, which
    then differs in its bytes alone (it may no longer fit where the quantized one does: that is the saving).
    `extra`: the overrides `result` was estimated with besides `cfg` (a plan's), applied to both alike.
    The disk and compute rates are `result`'s.
    """
    overrides = unquantized_overrides(cfg)
    if not overrides:
        return None
    plain = load_config(cfg, overrides={**(extra or {}), **overrides})
    unquantized = estimate(
        plain, world_size=world_size, local_world_size=local_world_size, disk=result.disk, flops=result.flops,
        suggest=False, homes=homes, target=target,
    )  # fmt: skip
    changed = {key: (_setting(cfg, key), _setting(plain, key)) for key in overrides if _setting(cfg, key) != _setting(plain, key)}
    return Saving(changed=changed, quantized=result, unquantized=unquantized)
