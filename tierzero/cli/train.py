"""`tierzero train` and `tierzero demo`: build the configured model and data, train, summarise.

The loop is the engine's public API and nothing more: `engine(x, y)`, `engine.backward`,
`engine.step`, `engine.memory_report`. Under torchrun every rank trains its slice of each
global batch (see tierzero.data) and rank 0 alone prints. Before the first step the
checkpoint directory is probed and locked for the run (tierzero/checkpoint/directory.py).
Ctrl-C ends the step in flight, closes the engine (which removes its swap files) once,
prints the summary so far and exits 130; pressing it again changes nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, TextIO

import psutil
import torch
from tqdm import tqdm

from tierzero.align import PreferenceBatches, dpo_train_step, reference_for_run
from tierzero.api import initialize
from tierzero.checkpoint import PeftAdapters, TransformersDirectory, probe_root
from tierzero.checkpoint.export import check_export
from tierzero.cli.commands import COMMANDS
from tierzero.cli.config import parse_overrides
from tierzero.cli.resume import NonFiniteLosses, checkpoint_due, no_checkpoint_under, resume_from
from tierzero.cli.run_header import RunHeader
from tierzero.cli.run_summary import TIERS, PartClock, RunSummary
from tierzero.cli.stops import CtrlC, lost_rank
from tierzero.comm.dist import RollCallAnswerer, launch_tag
from tierzero.common.output_paths import check_writable
from tierzero.common.sizes import format_size
from tierzero.config import ConfigError, TierZeroConfigWarning, read_config
from tierzero.config.precision import cpu_flags, slow_bf16_note
from tierzero.data import batches_from_config, check_vocab
from tierzero.engine.micro_step import micro_step
from tierzero.models.builtin import build_model, count_parameters
from tierzero.offload.disk.busy import Busy
from tierzero.placement.disk import learn
from tierzero.placement.progress import said_to
from tierzero.pretrained.files import check_positions
from tierzero.pretrained.lora import is_peft_model
from tierzero.units.kernels import chosen_text

__all__ = ["RunSummary", "add_demo_command", "add_train_command", "run_demo", "run_train", "train"]

DEMO_CONFIG = Path("configs") / "demo.yaml"
DEMO_SWAP = Path(".tierzero-swap")
MAX_STEPS = 10**9
"""The most optimizer steps `--steps` takes: past any run, and far inside the int64 step counters a checkpoint keeps."""


def add_train_command(subparsers: Any) -> None:
    """Register `tierzero train` on the `tierzero` command's sub-parsers."""
    parser = subparsers.add_parser("train", help=COMMANDS["train"].help)
    parser.add_argument("--config", required=True, help="a tierzero .yaml/.yml/.json config (or a DeepSpeed .json)")
    _add_run_flags(parser)
    parser.add_argument(
        "--resume", nargs="?", const=True, default=False, type=int, metavar="STEP",
        help="continue from the newest complete checkpoint, or from the one of STEP",
    )
    parser.set_defaults(func=run_train, process_ends=False)


def add_demo_command(subparsers: Any) -> None:
    """Register `tierzero demo`: `train --config configs/demo.yaml` swapping to ./.tierzero-swap."""
    parser = subparsers.add_parser("demo", help=COMMANDS["demo"].help)
    parser.add_argument("--config", default=None, help=f"another config to run instead of {DEMO_CONFIG}")
    _add_run_flags(parser)
    parser.set_defaults(func=run_demo, resume=False, process_ends=False)


def _add_run_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps to run (overrides train.steps)")
    parser.add_argument("--nvme-path", default=None, help="directory for the swap files (overrides tiers.nvme.path)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override one dotted config key, e.g. --set optimizer.lr=3e-4 (the value is read as YAML)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar; log lines only")
    parser.add_argument("--export", default=None, metavar="DIR", help="after the last step, write DIR for transformers' from_pretrained")
    parser.add_argument(
        "--export-merged", action="store_true",
        help="with --export, a LoRA run writes its base with the adapters merged (bf16) rather than the adapters alone",
    )  # fmt: skip
    parser.add_argument(
        "--summary-json", default=None, metavar="PATH",
        help="also write the summary as JSON (losses, each step's seconds, the plan's prediction, peak RSS)",
    )  # fmt: skip


def run_train(args: argparse.Namespace, *, out: TextIO | None = None) -> int:
    """`tierzero train`: 0 when done (or done already), 130 when interrupted; user errors raise ValueError/OSError."""
    overrides = parse_overrides(args.overrides, nvme_path=args.nvme_path)
    if args.steps is not None:
        if not 1 <= args.steps <= MAX_STEPS:
            raise ValueError(f"--steps {args.steps} is outside 1..{MAX_STEPS}: give at most {MAX_STEPS} optimizer steps")
        overrides["train.steps"] = args.steps
    loaded = read_config(args.config, overrides=overrides)
    cfg = loaded.config
    if not loaded.names_workload:
        raise ConfigError(
            f"{args.config} names no model and no data, so it would train the built-in {cfg.model.parameter_count():,}-parameter "
            "byte-level demo GPT on Python's own sources: set model.pretrained to a transformers model directory and "
            "data.path to your text (or model.type: gpt to train the demo model)"
        )
    if args.summary_json is not None:  # before training: found after it, the summary would be lost
        check_writable(args.summary_json, what="--summary-json", directory=False)
    step = None if isinstance(args.resume, bool) else args.resume
    summary = train(
        cfg, resume=args.resume is not False, resume_step=step, progress=not args.no_progress, out=out or sys.stdout, export=args.export,
        export_merged=args.export_merged, process_ends=args.process_ends, autos=loaded.autos,
    )
    # rank 0's, named by the launcher: the engine's close may have ended the process group; none
    # when the run was complete already (the file of the run that completed it stays)
    if args.summary_json is not None and int(os.environ.get("RANK", "0")) == 0 and summary.complete_at is None:
        Path(args.summary_json).write_text(json.dumps(dataclasses.asdict(summary), indent=1))
    if summary.interrupted:
        print("tierzero: interrupted", file=sys.stderr)
        return 130
    return 0


def run_demo(args: argparse.Namespace, *, out: TextIO | None = None) -> int:
    """`tierzero demo`: the demo config, with its swap files under ./.tierzero-swap unless --nvme-path is given."""
    created = False
    if args.nvme_path is None:
        created = not DEMO_SWAP.exists()
        DEMO_SWAP.mkdir(exist_ok=True)
        args.nvme_path = str(DEMO_SWAP)
    args.config = args.config or str(_demo_config())
    try:
        return run_train(args, out=out)
    finally:
        if created and DEMO_SWAP.is_dir() and not any(DEMO_SWAP.iterdir()):
            DEMO_SWAP.rmdir()


def _demo_config() -> Path:
    """configs/demo.yaml from the working directory, else from the checkout this package runs from."""
    if DEMO_CONFIG.is_file():
        return DEMO_CONFIG
    beside = Path(__file__).resolve().parents[2] / DEMO_CONFIG
    if beside.is_file():
        return beside
    raise OSError(f"demo config {DEMO_CONFIG} not found in {Path.cwd()} nor beside the package: run from the tierzero checkout or pass --config")


# ---------------------------------------------------------------- the loop


def train(
    cfg: Any, *, resume: bool = False, resume_step: int | None = None, progress: bool = True, out: TextIO | None = None,
    export: str | os.PathLike[str] | None = None, export_merged: bool = False, process_ends: bool = False, autos: tuple[str, ...] = (),
) -> RunSummary:  # fmt: skip
    """Train `cfg.model` on `cfg.data` for `cfg.train.steps` optimizer steps; rank 0 reports to `out`.

    `resume`: continue from the newest complete checkpoint under checkpoint.dir, or the one of `resume_step`;
    a checkpoint at train.steps or past them trains nothing, says so in one line and prints no summary
    (`RunSummary.complete_at`). A checkpoint.dir that does not exist is refused before it is created.
    `export`: after the last step, write that directory for transformers' `from_pretrained`
    (tierzero/checkpoint/export.py); refused before training when the run cannot make it. A LoRA run
    writes its adapters in peft's format there, or with `export_merged` its base with them merged.
    `process_ends`: the process exits after this call (the command line), so Ctrl-C pressed
    once the run was interrupted stays ignored rather than handed back to the caller.
    `autos`: what the config's "auto" values became (`LoadedConfig.autos`), for the header.
    """
    out, resume = out or sys.stdout, resume or resume_step is not None
    root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir is not None else None
    if resume and root is None:
        raise ValueError("--resume needs checkpoint.dir, where the checkpoints are: set it in the config or with --set checkpoint.dir=PATH")
    if resume and not root.is_dir():  # before probe_root, which would create it: a failed --resume leaves nothing
        raise FileNotFoundError(no_checkpoint_under(root))
    if root is not None:
        probe_root(root)  # before the engine is built: a directory that cannot be written costs seconds, not the run
    if export_merged and (export is None or not cfg.model.lora.r):
        raise ValueError("--export-merged merges a LoRA run's adapters into the --export directory: give --export DIR and "
                         "model.lora.r, or drop --export-merged")
    tokenizer = check_export(cfg.to_dict(), Path(export), what="--export") if export is not None else None
    if cfg.model.pretrained is not None:  # its positions, before minutes of building and reading
        check_positions(Path(cfg.model.pretrained), seq_len=cfg.train.seq_len)
    torch.manual_seed(cfg.train.seed)
    # Built-ins are built on meta and materialised by the engine one unit at a time, so
    # host memory never holds the whole fp32 model. A transformers model stays on the CPU:
    # its buffers (position ids, rotary tables) are computed in __init__, not by a per-module init.
    device = None if cfg.model.type == "transformers" else "meta"
    model = build_model(cfg.model, device=device, seed=cfg.train.seed)
    check_vocab(cfg, model)  # before the engine: a model that cannot embed the data's ids is refused in seconds
    summary = RunSummary(planned_steps=cfg.train.steps, parameters=count_parameters(model))
    trained, model_class = count_parameters(model, trainable_only=True), type(model).__name__
    with CtrlC(ignore_after=process_ends) as ctrl_c:
        with said_to(out):  # a plan's minute of measuring, said as it goes (only rank 0 plans)
            engine = initialize(model, cfg)
        rank, world = _rank_and_world()
        if rank == 0 and not torch.cuda.is_available() and (note := slow_bf16_note(cfg.precision, flags=cpu_flags())):
            warnings.warn(note, TierZeroConfigWarning, stacklevel=1)  # once a run, on rank 0
        if engine.placement is not None:
            summary.predicted_step_s = engine.placement.prediction.step_s
            summary.predicted_parts = engine.placement.prediction.part_seconds()
            if rank == 0:
                out.write("\n".join(engine.placement.lines()) + "\n")
        answerer = RollCallAnswerer(rank=rank, world_size=world, tag=launch_tag())
        try:
            if root is not None:
                engine.claim_checkpoint_root(root, fresh=not resume)  # a root belongs to one run
            if resume:
                done = resume_from(engine, root, resume_step, show=rank == 0, out=out)
                summary.complete_at = done if done >= cfg.train.steps else None
            if summary.complete_at is None:
                if rank == 0:  # after the plan's table and the resume's lines: the last word before the first step
                    header = RunHeader.of(cfg, engine, model_class=model_class, parameters=summary.parameters, trained=trained, autos=autos)
                    out.write("\n".join(header.lines(world_size=world)) + "\n")
                batches = PreferenceBatches.from_config if cfg.train.objective == "dpo" else batches_from_config
                data = batches(cfg, rank=rank, world_size=world)
                table = reference_for_run(engine, cfg, data, resumed=resume, device=_compute_device(), out=out if rank == 0 else None)
                _loop(engine, cfg, data=data, summary=summary, ctrl_c=ctrl_c, show=rank == 0, progress=progress, out=out, table=table)
            elif rank == 0:
                out.write(
                    f"the run is already complete at step {summary.complete_at} (train.steps {cfg.train.steps}): "
                    "nothing to train; raise train.steps (or --steps) to train further\n"
                )
            if export is not None and not summary.interrupted:
                _export(engine, Path(export), tokenizer=tokenizer, merged=export_merged, out=out)
        except BaseException as exc:
            # Asked before the close, which may take down the store the roll call needs (rank 0's).
            lost = lost_rank(exc, rank=rank, world=world, step=engine.global_step + 1, timeout_s=cfg.dist.timeout)
            answerer.stop()  # failed: from now on, never counted as present
            # The first error is the one to report; a close that fails after it would hide it.
            with contextlib.suppress(Exception):
                _close(engine, ctrl_c)
            if lost is not None:
                raise lost from exc
            raise
        answerer.stop()
        _close(engine, ctrl_c)
        summary.interrupted = summary.interrupted or ctrl_c.count > 0
        if world == 1 and summary.nvme_busy is not None and cfg.tiers.nvme.path is not None:
            steps, seconds = summary.after_first
            learn(cfg.tiers.nvme.path, cfg.tiers.nvme, summary.nvme_busy, seconds=seconds, steps=steps)
        if cfg.precision.linear_kernel == "onednn":
            summary.linear_gradients = chosen_text()
        if rank == 0 and summary.complete_at is None:
            out.write(summary.format())
            out.flush()
    return summary


def _export(engine: Any, directory: Path, *, tokenizer: Path | None, merged: bool, out: TextIO) -> None:
    """A LoRA run's adapters in peft's format (`merged`: its base with them merged); any other run's model
    for transformers' from_pretrained."""
    if is_peft_model(engine.module) and not merged:
        written = PeftAdapters().write(engine, directory)
        if written is not None:
            out.write(f"exported the LoRA adapters to {written} (peft's format)\n")
        return
    exported = TransformersDirectory(tokenizer=tokenizer, merged=merged).write(engine, directory)
    if exported is not None:
        out.write(f"exported {exported.describe()}\n")


def _close(engine: Any, ctrl_c: CtrlC) -> None:
    """The engine's swap files and its checkpoint directory's lock, whole: Ctrl-C from here on only counts."""
    ctrl_c.closing = True
    engine.close()


def _loop(
    engine: Any, cfg: Any, *, data: Any, summary: RunSummary, ctrl_c: CtrlC, show: bool, progress: bool, out: TextIO, table: Any = None
) -> None:
    accumulation = cfg.gradient_accumulation_steps
    tokens_per_step = data.tokens_per_batch * data.world_size * accumulation
    device = _compute_device()
    # Loop steps, not optimizer steps: an fp16 step skipped on overflow still used its batches.
    start = engine.micro_steps // accumulation
    bar = tqdm(total=cfg.train.steps, initial=start, disable=not (show and progress), unit="step", dynamic_ncols=True)
    process = psutil.Process(os.getpid())
    began = time.perf_counter()
    try:
        traffic = getattr(engine.store, "nvme_traffic", lambda: (0, 0))
        busy, after_first = getattr(engine.store, "nvme_busy", Busy), Busy()
        # Parts are timed only where a plan predicted them: the summary sets the two side by side.
        clock = PartClock(cuda=device.type == "cuda") if summary.predicted_parts else None
        nonfinite = NonFiniteLosses(limit=cfg.train.max_nonfinite)
        for step in range(start, cfg.train.steps):
            t0, moved, lr = time.perf_counter(), traffic(), float(engine.lr)
            if cfg.train.objective == "dpo":  # preference tuning (tierzero/align/): its step in place of the next-token one
                loss = summary.note_preference(dpo_train_step(engine, data, cfg.dpo, step=step, accumulation=accumulation, device=device,
                                                              is_hf=cfg.model.is_transformers, mark=clock and clock.mark, table=table))
            else:
                loss = _train_step(
                    engine, data, step=step, accumulation=accumulation, device=device, is_hf=cfg.model.is_transformers, clock=clock
                )  # fmt: skip
            ctrl_c.check()
            saves = nonfinite.saves(loss, step=step + 1, steps=cfg.train.steps)  # the same on every rank: the loss is reduced
            elapsed = time.perf_counter() - t0
            summary.step_seconds.append(elapsed)
            if clock is not None:
                summary.part_seconds.append(clock.step_done())
            now = traffic()
            summary.nvme_steps.append((now[0] - moved[0], now[1] - moved[1]))
            summary.steps, summary.tokens = summary.steps + 1, summary.tokens + tokens_per_step
            if summary.steps == 1:
                after_first = busy()
            else:
                summary.nvme_busy = busy() - after_first
            summary.losses.append(loss)
            summary.lrs.append(lr)
            _note_memory(engine, summary, process)
            postfix = _postfix(loss, lr, tokens_per_step / elapsed, summary, engine)
            bar.set_postfix_str(postfix, refresh=False)
            bar.update(1)
            if show and ((step + 1) % cfg.train.log_every == 0 or step + 1 == cfg.train.steps):
                bar.write(f"step {step + 1}/{cfg.train.steps} {postfix}", file=out)
            if checkpoint_due(cfg, step + 1) and not saves:
                if show:
                    bar.write(f"no checkpoint at step {step + 1}: its loss is {loss}", file=out)
            elif checkpoint_due(cfg, step + 1):
                saved = engine.save_checkpoint()
                if show:
                    bar.write(f"saved checkpoint {saved}", file=out)
    except KeyboardInterrupt:
        summary.interrupted = True
        if show:
            bar.write(f"interrupted after {summary.steps} steps: closing the engine and removing swap files", file=out)
    finally:
        summary.seconds = time.perf_counter() - began
        bar.close()


def _train_step(
    engine: Any, data: Any, *, step: int, accumulation: int, device: torch.device, is_hf: bool, clock: PartClock | None
) -> float:
    """One optimizer step over `accumulation` micro-batches; the mean loss over them and over ranks.
    `clock`, if any, hears each micro-step's parts begin and end."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for micro in range(accumulation):
        # Pinned, the copies to a GPU are asynchronous indeed (from pageable memory they block).
        batch = data.batch(step * accumulation + micro)
        x, y = (t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t for t in batch)
        if clock is None:
            total += micro_step(engine, x, y, is_hf=is_hf).float()
        else:
            total += micro_step(engine, x, y, is_hf=is_hf, mark=clock.mark).float()
            clock.mark("")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(total)
        total /= torch.distributed.get_world_size()
    return total.item() / accumulation


def _postfix(loss: float, lr: float, tokens_per_s: float, summary: RunSummary, engine: Any) -> str:
    # Peaks, not end-of-step values: a stage-3 device tier is empty between steps.
    tiers = " ".join(f"{tier}<={format_size(summary.peak_tier_bytes[tier])}" for tier in TIERS if tier in summary.peak_tier_bytes)
    parts = [f"loss={loss:.4f}", summary.preference_text(), f"lr={lr:.3g}", f"tok/s={tokens_per_s:,.0f}", tiers]
    # Seconds compute waited on I/O in the last step, where the engine reports its prefetcher.
    report_fn = getattr(engine, "prefetch_report", None)
    report = report_fn() if callable(report_fn) else None
    if report is not None:
        summary.io_wait_s = (summary.io_wait_s or 0.0) + float(report.waited_s)
        parts.append(f"io_wait={float(report.waited_s):.2f}s")
    return " ".join(p for p in parts if p)


def _note_memory(engine: Any, summary: RunSummary, process: psutil.Process) -> None:
    report = engine.memory_report()
    summary.state_bytes = sum(report["kinds"].values())
    summary.nvme_cache = int(report.get("nvme_cache", 0))
    for tier, usage in report["tiers"].items():
        summary.peak_tier_bytes[tier] = max(summary.peak_tier_bytes.get(tier, 0), int(usage["peak"]))
        summary.tier_capacity[tier] = usage["capacity"]
    summary.peak_rss = max(summary.peak_rss, int(process.memory_info().rss))


def _rank_and_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _compute_device() -> torch.device:
    # tierzero.comm.dist.setup has already selected this rank's GPU where there is one.
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
