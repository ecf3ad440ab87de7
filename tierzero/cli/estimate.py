"""`tierzero estimate`'s output and command: the table, the JSON, the bench results it reads."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, TextIO

from tierzero.cli.commands import COMMANDS
from tierzero.cli.config import parse_batch_size, parse_overrides
from tierzero.common.safe_files import RefusedFile, loads_bounded, read_regular
from tierzero.common.sizes import format_size
from tierzero.common.slices import KEPT_KINDS, shown_kinds
from tierzero.config import AUTO, NvmeTierConfig, load_config
from tierzero.config.hf_sizes import position_limit
from tierzero.config.sections import MAX_GENERATE_BATCH
from tierzero.estimate.dry_run import dry_run
from tierzero.estimate.estimator import Bandwidth, Estimate, Target, estimate, measure_flops
from tierzero.estimate.generation import GeneratePrediction, device_room, predict_generate
from tierzero.estimate.machines import PRESETS, Machine, load_machine
from tierzero.estimate.saving import Saving, compare_unquantized
from tierzero.placement import MachineBudgets, machine_budgets, target_budgets
from tierzero.placement.disk import label_of
from tierzero.placement.planner import PlacementError, plan_placement
from tierzero.placement.prediction import measure_copy_rate
from tierzero.placement.progress import said_to
from tierzero.pretrained.files import check_positions
from tierzero.stages.plan import Homes

__all__ = ["DEFAULT_BENCH_PATHS", "add_estimate_command", "format_estimate", "load_bench", "run_estimate", "to_json"]


def to_json(result: Estimate, *, budgets: MachineBudgets | None = None) -> dict[str, Any]:
    """The estimate as plain JSON types: bytes as ints, times in seconds; with `budgets`, a "budgets" entry."""
    tiers = {
        t.value: {
            "capacity": e.capacity,
            "homes": {k.value: n for k, n in e.homes.items()},
            "working": dict(e.working),
            "peak": e.peak,
            "need": e.need,
            "fits": e.fits,
        }
        for t, e in result.tiers.items()
    }
    disk = result.disk
    disk_json = None if disk is None else {"read_Bps": disk.read, "write_Bps": disk.write, "source": disk.source}
    kinds = shown_kinds({k: sum(e.homes.get(k, 0) for e in result.tiers.values()) for k in KEPT_KINDS})
    data = {
        "stage": result.stage,
        "world_size": result.world_size,
        "parameters": result.parameters,
        "units": result.units,
        "tiers": tiers,
        "kinds": {k.value: sum(e.homes.get(k, 0) for e in result.tiers.values()) for k in kinds},
        "nvme": {"read_per_step": result.nvme_read, "written_per_step": result.nvme_written,
                 "file": result.nvme_file, "free": result.nvme_free},
        "host_bytes": result.host_bytes,
        "comm": {"local_world_size": result.local_world_size, "per_step": result.comm},
        "activations": result.activations,
        "disk": disk_json,
        "flops": {"rate": result.flops.read, "source": result.flops.source},
        "time": {
            "io_floor_s": result.io_floor_s,
            "compute_floor_s": result.compute_floor_s,
            "step_floor_s": result.step_floor_s,
        },
        "fits": result.fits,
        "problems": list(result.problems),
        "fixes": list(result.fixes),
    }
    if budgets is not None:
        data["budgets"] = budgets.to_json()
    return data


def format_estimate(result: Estimate, *, budgets: MachineBudgets | None = None) -> str:
    """The table `tierzero estimate` prints; with `budgets`, the tiers' budgets under it."""
    fs = format_size
    kinds = [k for k in KEPT_KINDS if any(e.homes.get(k) for e in result.tiers.values())]
    uses = sorted({use for e in result.tiers.values() for use in e.working})
    header = ["tier", *(k.value for k in kinds), *uses, "peak", "capacity", "fits"]
    rows = [header]
    for tier, e in result.tiers.items():
        capacity = "-" if e.capacity is None else fs(e.capacity)
        cells = [fs(e.homes.get(k, 0)) for k in kinds] + [fs(e.working.get(u, 0)) for u in uses]
        rows.append([tier.value, *cells, fs(e.peak), capacity, "yes" if e.fits else "NO"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    table = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines = [
        f"tierzero estimate: zero stage {result.stage}, world size {result.world_size}, {result.parameters:,} parameters "
        f"in {result.units} units; per rank:",
        "",
        *table,
        "",
        *([] if budgets is None else [*budgets.lines(), ""]),
        f"host memory held by the store: {fs(result.host_bytes)}"
        + ("" if result.activations is None else f"; activations about {fs(result.activations)} per micro-batch"),
    ]
    if result.disk is not None:
        lines += [
            f"nvme per step: read {fs(result.nvme_read)}, write {fs(result.nvme_written)}"
            + ("" if result.steps <= 2 else f" (step {result.steps}, once the nvme cache has settled)")
            + f"; swap file {fs(result.nvme_file)}"
            + ("" if result.nvme_free is None else f", {fs(result.nvme_free)} free"),
            f"disk: {result.disk.source}",
        ]
    lines += [*_comm_lines(result), f"compute: {result.flops.source}",
        f"step-time floor: {result.step_floor_s:.3f} s (I/O {result.io_floor_s:.3f} s, compute {result.compute_floor_s:.3f} s "
        f"for {result.tokens_per_step:,} tokens)",
        "",
    ]
    if result.fits:
        lines.append("fits: yes")
    else:
        lines += ["DOES NOT FIT:", *(f"  {p}" for p in result.problems)]
        lines += ["to make it fit:", *(f"  - {f}" for f in result.fixes)]
    return "\n".join(lines) + "\n"


def _comm_lines(result: Estimate) -> list[str]:
    """Each group's collectives with bytes: what a rank sends per step inside its node and across nodes."""
    sent = [(g, op, links) for g, ops in result.comm.items() for op, links in ops.items() if any(links.values())]
    if not sent:
        return []
    nodes, per_node = result.world_size // result.local_world_size, result.local_world_size
    layout = f"{nodes} node{'s' * (nodes > 1)} x {per_node} rank{'s' * (per_node > 1)}"
    head = f"collectives per step, {layout} (inside the node / across):"
    fs = format_size
    return [head, *(f"  {g} {op}: {fs(links['intra'])} / {fs(links['inter'])}" for g, op, links in sent)]


# ---------------------------------------------------------------- the command

MAX_WORLD_SIZE = 1 << 16
"""The most ranks `estimate --world-size` takes: its work grows with the ranks (tens of seconds at 2^18,
a quarter of an hour at 10^8), and 65,536 data-parallel ranks is past any machine it would plan for."""

#: Where `tierzero estimate` looks for `tierzero bench nvme --json` results when --nvme-bench is not given.
DEFAULT_BENCH_PATHS = ("bench-nvme.json", "results/bench-nvme.json")
BENCH_LIMIT = 64 << 20
"""A `bench nvme --json` file is kilobytes."""


def load_bench(
    path: str | None, *, nvme_path: str | None = None, nvme: NvmeTierConfig | None = None
) -> Bandwidth | None:
    """The read/write GB/s of a `bench nvme` JSON file at `nvme`'s I/O setting where its sweep ran
    that setting, else its best point's; None when no file is given or found."""
    if path is None:
        candidates = [Path(p) for p in DEFAULT_BENCH_PATHS]
        if nvme_path is not None:
            candidates.append(Path(nvme_path) / "bench-nvme.json")
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            return None
        path = str(found)
    try:
        report = loads_bounded(read_regular(path, limit=BENCH_LIMIT), name=f"--nvme-bench {path}")
        best = report["best"]
        read, write = float(best["read_GBps"]), float(best["write_GBps"])
        at = "best point"
        if nvme is not None and (own := _at_setting(report.get("runs") or [], nvme)) is not None:
            (read, write), at = own, label_of(nvme)
    except RefusedFile as exc:  # a FIFO or a device: never opened
        raise ValueError(f"--nvme-bench {exc}: pass the file `tierzero bench nvme --json` wrote") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"--nvme-bench {path}: expected `tierzero bench nvme --json` results with best.read_GBps and "
            f"best.write_GBps, got {type(exc).__name__}: {exc}; rerun the bench with --json"
        ) from None
    if read <= 0 or write <= 0:
        raise ValueError(f"--nvme-bench {path}: best read {read} and write {write} GB/s must be positive; rerun the bench")
    source = f"bench nvme {path} at {at}: {read:.2f} GB/s read, {write:.2f} GB/s write"
    return Bandwidth(read=read * 1e9, write=write * 1e9, source=source)


def _at_setting(runs: list[dict[str, Any]], nvme: NvmeTierConfig) -> tuple[float, float] | None:
    """(read, write) GB/s of the sweep's runs at `nvme`'s setting; None when it did not run it."""
    setting = (nvme.block_size, nvme.queue_depth, nvme.threads, nvme.backend)
    found = {
        run["direction"]: float(run["GBps"])
        for run in runs
        if (run["block_size"], run["queue_depth"], run["threads"], run["backend"]) == setting
    }
    return (found["read"], found["write"]) if found.keys() >= {"read", "write"} else None


def add_estimate_command(subparsers: Any) -> None:
    """Register `tierzero estimate` on the `tierzero` command's sub-parsers."""
    parser = subparsers.add_parser("estimate", help=COMMANDS["estimate"].help)
    parser.add_argument("--config", required=True, help="a tierzero .yaml/.yml/.json config (or a DeepSpeed .json)")
    parser.add_argument("--world-size", type=int, default=1, help="data-parallel ranks (default 1)")
    layout = parser.add_mutually_exclusive_group()
    layout.add_argument("--nodes", type=int, help="nodes the ranks are spread over, equally (default 1)")
    layout.add_argument("--local-world-size", type=int, help="ranks per node, as torchrun's --nproc-per-node")
    parser.add_argument(
        "--nvme-bench", default=None,
        help=f"`bench nvme --json` results, taken at tiers.nvme's setting where the sweep ran it, else its best "
        f"(default: {', '.join(DEFAULT_BENCH_PATHS)})",
    )
    parser.add_argument("--flops", type=float, default=None, help="compute rate in GFLOP/s (default: a stated CPU rate)")
    parser.add_argument("--measure-flops", action="store_true", help="time a matmul here instead of assuming a rate")
    parser.add_argument("--nvme-path", default=None, help="directory for the swap files (overrides tiers.nvme.path)")
    parser.add_argument(
        "--machine", default=None, metavar="NAME|FILE",
        help=f"plan for that machine, measuring nothing here: a preset ({', '.join(PRESETS)}) or a .yaml/.json file "
        "of its figures (docs/config.md, `tierzero estimate --machine`)",
    )
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override one dotted config key, e.g. --set zero.stage=2 (the value is read as YAML)",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    parser.add_argument(
        "--generate", action="store_true",
        help="also predict a generate run's tokens/s: its batch, weight bytes read per decoding step, step time",
    )
    parser.add_argument("--prompt-len", type=int, default=128, help="--generate: prompt tokens a row (default 128)")
    parser.add_argument("--new-tokens", type=int, default=32, help="--generate: new tokens a row (default 32)")
    parser.add_argument(
        "--batch-size", default=None, metavar="N|auto",
        help="--generate: rows decoded together (default: generate.batch_size; auto: the largest the device budget fits)",
    )
    parser.set_defaults(func=run_estimate)


def run_estimate(args: Any, *, out: TextIO | None = None) -> int:
    """`tierzero estimate`: 0 when the config fits, 1 when it does not; user errors raise ValueError."""
    out = out or sys.stdout
    _check_flags(args)
    cfg = load_config(args.config, overrides=parse_overrides(args.overrides, nvme_path=args.nvme_path))
    # as train refuses them: an estimate of a run that cannot start says nothing
    if cfg.model.pretrained is not None:
        check_positions(Path(cfg.model.pretrained), seq_len=cfg.train.seq_len)
    elif cfg.model.type == "transformers" and (found := position_limit(cfg.model.transformers_config)) and cfg.train.seq_len > found[0]:
        raise ValueError(
            f"train.seq_len {cfg.train.seq_len} is above model.transformers_config.{found[1]} {found[0]}, the positions of "
            f"the model: lower train.seq_len or raise model.transformers_config.{found[1]}"
        )
    machine = None if getattr(args, "machine", None) is None else load_machine(args.machine)
    flops = None
    if args.flops is not None:
        flops = Bandwidth(read=args.flops * 1e9, write=args.flops * 1e9, source=f"given {args.flops:g} GFLOP/s (--flops)")
    elif args.measure_flops:
        flops = measure_flops(cfg.precision.param_dtype)
    elif machine is not None:
        flops = machine.flops(cfg.precision.param_dtype)
    local = _local_world_size(args)
    if machine is None:
        disk = load_bench(args.nvme_bench, nvme_path=cfg.tiers.nvme.path, nvme=cfg.tiers.nvme)
        budgets, target = machine_budgets(cfg.tiers), None
    else:  # its disk is not this host's: a bench file only when given (run on that machine)
        disk = machine.disk() if args.nvme_bench is None else load_bench(args.nvme_bench, nvme=cfg.tiers.nvme)
        budgets = target_budgets(cfg.tiers, machine)
        target = Target(gpu_memory=machine.gpu_memory or 0, disk_free=machine.disk_free or 0)
        out.write("" if args.json else machine.describe() + "\n")
    if cfg.offload.planned:
        return _plan(cfg, args, out=out, budgets=budgets, disk=disk, flops=flops, machine=machine, local=local)
    result = estimate(cfg, world_size=args.world_size, local_world_size=local, disk=disk, flops=flops, target=target)
    saving = compare_unquantized(cfg, result, world_size=args.world_size, local_world_size=local, target=target)
    generation = _generation(cfg, args, result, budgets=budgets, machine=machine) if getattr(args, "generate", False) else None
    if args.json:
        extra = {} if generation is None else {"generate": generation.to_json()}
        out.write(json.dumps({**to_json(result, budgets=budgets), **_saving_json(saving), **extra}, indent=2) + "\n")
    else:
        text = "" if generation is None else "\n" + "\n".join(generation.lines()) + "\n"
        out.write(format_estimate(result, budgets=budgets) + _saving_text(saving) + text)
    return 0 if result.fits else 1


def _generation(
    cfg: Any, args: Any, result: Estimate, *, budgets: MachineBudgets, machine: Machine | None, homes: Homes | None = None
) -> GeneratePrediction:
    """--generate: the decoding step of the estimated placement (`homes`: the plan's, for offload: auto), its
    batch auto's unless given."""
    wanted = cfg.generate.batch_size if args.batch_size is None else args.batch_size
    parsed = parse_batch_size(str(wanted))
    batch = None if parsed == AUTO else int(parsed)
    if machine is not None:
        copy = Bandwidth(read=machine.copy_rate, write=machine.copy_rate, source=f"{machine.name}'s {machine.copy_rate / 1e9:.1f} GB/s")
    else:
        rate = measure_copy_rate()
        copy = Bandwidth(read=rate, write=rate, source=f"measured {rate / 1e9:.1f} GB/s")
    # the estimate's own dry run, kept by its arguments: the model and units it built
    run = dry_run(cfg, world_size=result.world_size, local_world_size=result.local_world_size, cuda=result.cuda, homes=homes)
    return predict_generate(
        cfg, result, model=run.model, units=run.units, prompt=args.prompt_len, new=args.new_tokens, batch=batch,
        room=device_room(result, device=budgets.device, cpu=budgets.cpu), copy=copy, most=MAX_GENERATE_BATCH,
    )


def _saving_json(saving: Saving | None) -> dict[str, Any]:
    """--json's "unquantized" entry: the same config's figures with plain state (none when nothing is quantized)."""
    return {} if saving is None else {"unquantized": saving.to_json()}


def _saving_text(saving: Saving | None) -> str:
    return "" if saving is None else "\n" + "\n".join(saving.lines()) + "\n"


def _plan(
    cfg: Any,
    args: Any,
    *,
    out: TextIO,
    budgets: MachineBudgets,
    disk: Bandwidth | None,
    flops: Bandwidth | None,
    machine: Machine | None,
    local: int | None,
) -> int:
    """`offload: auto`: the plan and its estimate, 0; or DOES NOT FIT with what would fit, 1."""
    shares = {} if local is None else {"local_world_size": local}  # a machine's memory is shared by its ranks
    try:
        with said_to(sys.stderr):  # beside the report, not in it: --json's output stays JSON
            plan = plan_placement(
                cfg, world_size=args.world_size, budgets=budgets, disk=disk, flops=flops, machine=machine, **shares
            )
    except PlacementError as refused:
        if args.json:
            data = {"fits": False, "budgets": budgets.to_json(), "problems": refused.problems, "fixes": refused.fixes}
            out.write(json.dumps(data, indent=2) + "\n")
        else:
            lines = [*budgets.lines(), "", "DOES NOT FIT:", *(f"  {p}" for p in refused.problems)]
            lines += ["to make it fit:", *(f"  - {f}" for f in refused.fixes)]
            out.write("\n".join(lines) + "\n")
        return 1
    result = plan.estimate
    # the plan's homes and overrides, replayed without capacities as the planner does: the bytes alone differ
    free = {"tiers.device.capacity": None, "tiers.cpu.capacity": None, **plan.overrides}
    target = None if machine is None else Target(gpu_memory=machine.gpu_memory or 0, disk_free=machine.disk_free or 0)
    saving = compare_unquantized(
        cfg, result, world_size=args.world_size, local_world_size=local, target=target, homes=plan.homes, extra=free
    )
    generation = None
    if getattr(args, "generate", False):  # the planned placement's decoding step
        generation = _generation(cfg, args, result, budgets=budgets, machine=machine, homes=plan.homes)
    if args.json:
        extra = {} if generation is None else {"generate": generation.to_json()}
        data = {**to_json(result, budgets=budgets), "placement": plan.summary(), **_saving_json(saving), **extra}
        out.write(json.dumps(data, indent=2) + "\n")
    else:
        text = "" if generation is None else "\n" + "\n".join(generation.lines()) + "\n"
        out.write(format_estimate(result, budgets=budgets) + "\n" + "\n".join(plan.lines()) + "\n" + _saving_text(saving) + text)
    return 0


def _check_flags(args: Any) -> None:
    """Refuse, before any work, a world size past MAX_WORLD_SIZE and a rate that is no number of GFLOP/s."""
    if not 1 <= args.world_size <= MAX_WORLD_SIZE:
        raise ValueError(
            f"--world-size {args.world_size} is outside 1..{MAX_WORLD_SIZE}, the ranks an estimate covers: "
            f"give at most {MAX_WORLD_SIZE}"
        )
    if args.flops is not None and not (math.isfinite(args.flops) and args.flops > 0):
        raise ValueError(f"--flops must be a positive GFLOP/s rate, got {args.flops}")
    if getattr(args, "machine", None) is not None and args.measure_flops:
        raise ValueError("--measure-flops times this host, --machine plans for another: drop --measure-flops")


def _local_world_size(args: Any) -> int | None:
    """Ranks per node from --nodes or --local-world-size; None (one node) when neither is given."""
    world, nodes, local = args.world_size, getattr(args, "nodes", None), getattr(args, "local_world_size", None)
    if nodes is not None:
        if nodes < 1 or world % nodes:
            raise ValueError(f"--nodes {nodes} does not divide --world-size {world}: give a divisor of {world}")
        return world // nodes
    if local is not None and (local < 1 or world % local):
        raise ValueError(f"--local-world-size {local} does not divide --world-size {world}: give a divisor of {world}")
    return local
