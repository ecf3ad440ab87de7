"""The sections of the config tree: one keyword-only, frozen dataclass per part of a training run.

Each field carries its check and its docstring (see `tierzero.config.tree`); a section's
`_validate` checks its own fields together. Rules across sections live on the root,
`tierzero.config.schema.Config`. A part of the engine takes its own section, e.g. the NVMe
tier takes `NvmeTierConfig`, never the whole tree.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass
from typing import ClassVar

from tierzero.common.sizes import format_size
from tierzero.common.slices import IO_ALIGNMENT, Tier
from tierzero.config.checks import (
    AUTO,
    BOOL,
    DIRECTORY,
    NAMES,
    TIER_OR_AUTO,
    Check,
    GiB,
    MiB,
    TiB,
    choice_check,
    float_check,
    int_check,
    power_of_two_check,
    size_check,
)
from tierzero.config.errors import ConfigError
from tierzero.config.tree import Section, section, setting

STAGE = dataclasses.replace(
    int_check(1, 3), refusal="{key} is {got}, this engine runs stages 1, 2 and 3: set {key} to 1, 2 or 3"
)
"""`zero.stage`: only the stages the engine runs, so a config never promises one it cannot."""

OBJECTIVES = ("sft", "dpo")
"""`train.objective`: next-token training, or preference tuning (tierzero/align/)."""
DPO_REFERENCES = (AUTO, "adapters_off", "precomputed")
"""`dpo.reference`: where the DPO reference's log-probs come from (tierzero/align/reference.py)."""
MAX_CAPACITY = 1 << 50
"""The limit of a tier capacity: 1 PiB."""
MAX_HOST_BUFFERS = 64 * GiB
"""The limit of host memory in a pool of equal buffers (NVMe bounce blocks, swapper staging)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ZeroConfig(Section):
    """ZeRO sharding: which states are split across the data-parallel ranks, and how gradients travel."""

    SECTION: ClassVar[str] = "zero"
    stage: int = setting(3, STAGE)
    """1: shard optimizer states; 2: also gradients; 3: also parameters. These are the stages the engine
    runs; 0 (plain data parallel) is refused."""
    unit_classes: list[str] = setting([], NAMES)
    """Class names of the modules wrapped as units (gathered and offloaded as one flat buffer),
    e.g. [GPT2Block]; empty lets the engine choose."""
    reduce_bucket_size: int = setting(25 * MiB, size_check(limit=16 * GiB))
    """Bytes of ready gradients (and, in stages 1-2, of updated parameters) sent in one collective;
    a unit larger than this goes alone."""
    overlap_comm: bool = setting(True, BOOL)
    """Overlap collectives with compute instead of running them inline."""
    overlap_step: bool = setting(True, BOOL)
    """Stage 3 without clipping or fp16 overflow checks: each unit steps during backward, once
    its gradient is complete, its states read while backward goes on. With them, the states
    of the units that step first are read while backward ends. The same bits as stepping
    after backward (false)."""
    step_in_forward: bool = setting(True, BOOL)
    """Stage 3 with clipping or fp16 overflow checks: step each unit in the next forward, just
    before its gather (the units after it stepped ahead, their states read meanwhile), not
    after backward, and its new parameters go up from the step's memory instead of being read
    back. The same bits (bench train --clip 1.0, 30M GPT on NVMe: 1.2x plain, 1.38x after
    backward)."""
    step_schedule: str = setting("exact", choice_check(("exact", "speculative")))
    """Stage 3 with clipping (no fp16 overflow checks) and overlap_step: 'speculative' steps each
    unit during backward as soon as its gradient is complete, as if the norm did not clip, keeping
    what the step overwrites in host memory (a step's gradients, masters and optimizer states);
    when the norm clips, the units are put back and step again with the coefficient. The same bits
    as 'exact' (the step after backward, or step_in_forward). Pays only where the norm rarely clips:
    the 30M GPT on random tokens at clip 1.0 clips, so redoes, on all of 200 steps (1.24x exact's step)."""
    gather_ahead: int = setting(1, int_check(1, limit=64))
    """Stage 3: block units all-gathered ahead of the one computing, in the order of the last
    forward (and reversed in backward); beyond the first, only while their gathered bytes fit in
    prefetch.max_live_bytes."""
    param_persistence_threshold: int = setting(0, int_check(0))
    """Stage 3: units whose parameter count is below this threshold stay gathered on the device
    between forward and backward instead of being released after forward and gathered again for
    backward (0: every unit is released)."""
    shard_group_size: int = setting(0, int_check(0, limit=1 << 20))
    """Hybrid sharding (HSDP, MiCS), stage 3: shard inside groups of this many consecutive ranks
    (the ranks per node is the usual choice), each group a replica of the others; the sharded
    gradients are summed across the replicas once per micro-step. It must divide the world
    size. 0 or the world size: shard over every rank."""
    hpz_partition_size: int = setting(0, int_check(0, limit=1 << 20))
    """ZeRO++ hpZ, stage 3: after each unit's forward all-gather over all ranks, keep a second copy
    of its parameters split over groups of this many consecutive ranks (the ranks per node), from
    which backward gathers inside the group: no backward all-gather crosses nodes. The copy costs
    2 or 4 bytes a parameter / this size, at offload.params' tier. It must divide the world
    size. 0: off."""
    quantized_weights: bool = setting(False, BOOL)
    """ZeRO++ qwZ, stage 3: the parameter all-gathers send int8, one fp32 scale per
    zero.quantization_block_size elements (about 1/4 of fp32's bytes, 1/2 of bf16's), dequantised
    on arrival; the fp32 masters, the gradients and the optimizer never see a quantised value. Not
    bitwise plain stage 3: the forward computes with weights within half a block scale of the masters."""
    quantized_gradients: str = setting("none", choice_check(("none", "int8", "int4")))
    """ZeRO++ qgZ, stage 3: the gradients' reduce-scatter in two hops, inside the node first
    (unquantised), then each node's partial sums across nodes in int8 or int4, one fp32 scale per
    zero.quantization_block_size elements, summed in fp32 (the nodes from LOCAL_WORLD_SIZE). none:
    one flat reduce-scatter."""
    quantization_block_size: int = setting(2048, power_of_two_check(64, 16384))
    """Elements per fp32 scale wherever ZeRO++ quantises: qwZ's weights and qgZ's partial sums
    across nodes (one key: both are the same block-wise quantiser, trading the same 4 bytes a block
    against the same error, at most half a block's absmax / 127 (int8) or / 7 (int4) an element).
    Smaller blocks follow the values more closely and send more scales. With qwZ or qgZ on, units
    are padded so that every rank's shard is whole blocks and no block straddles two shards: under
    world size x block elements a unit, as the I/O alignment pads to world size x 2048. A power of
    two, so that padding to both is padding to the larger; 64 to 16384: below 64 the scales pass
    1/16 of int8's bytes, above 16384 they save under 0.03% while the padding grows."""

    @property
    def quant_block(self) -> int:
        """Elements each rank's shard of a unit is whole blocks of: the block with qwZ or qgZ on, else 1."""
        return self.quantization_block_size if self.quantized_weights or self.quantized_gradients != "none" else 1

    def _validate(self) -> None:
        if self.quantized_gradients != "none" and (self.stage != 3 or self.shard_group_size):
            raise ConfigError(
                f"zero.quantized_gradients is {self.quantized_gradients}, which needs zero.stage 3 (got "
                f"{self.stage}) without zero.shard_group_size (got {self.shard_group_size}): set those, or "
                "zero.quantized_gradients to none",
                key="zero.quantized_gradients",
            )
        for key in ("shard_group_size", "hpz_partition_size", "quantized_weights"):
            if getattr(self, key) and self.stage != 3:
                raise ConfigError(
                    f"zero.{key} is {getattr(self, key)}, which needs zero.stage 3 (got {self.stage}): "
                    f"set zero.stage to 3, or zero.{key} to 0",
                    key=f"zero.{key}",
                )
        if self.hpz_partition_size == 1:
            raise ConfigError(
                "zero.hpz_partition_size is 1, which would keep a whole copy of the parameters on every rank: "
                "set it to the ranks per node, or 0 for no secondary copy",
                key="zero.hpz_partition_size",
            )
        if self.hpz_partition_size and self.shard_group_size:
            raise ConfigError(
                f"zero.hpz_partition_size ({self.hpz_partition_size}) with zero.shard_group_size "
                f"({self.shard_group_size}): hybrid sharding already gathers inside its groups; set one of them to 0",
                key="zero.hpz_partition_size",
            )


@dataclass(kw_only=True, slots=True, frozen=True)
class TrainConfig(Section):
    """The training loop."""

    SECTION: ClassVar[str] = "train"
    micro_batch_size: int = setting(1, int_check(1, limit=1 << 16))
    """Samples per rank per forward/backward."""
    seed: int = setting(0, int_check(0))
    """Seed for parameter init and data order (the same on every rank)."""
    steps: int = setting(100, int_check(1))
    """Optimizer steps `tierzero train` runs (`--steps` overrides it)."""
    seq_len: int = setting(128, int_check(1, limit=1 << 20))
    """Tokens (bytes) per training sequence; at most model.max_seq_len for the built-in models, and at
    most the checkpoint's positions (max_position_embeddings or n_positions in its config.json) with
    model.pretrained."""
    log_every: int = setting(10, int_check(1))
    """`tierzero train` writes a log line every this many steps (the progress bar updates every step)."""
    max_nonfinite: int = setting(1, int_check(1))
    """`tierzero train` stops (exit 2) after this many steps in a row whose loss is NaN or inf (1: at the
    first), naming the step; a checkpoint due at such a step is not saved. An fp16 step skipped for
    overflowed gradients is not counted: only the loss is."""
    objective: str = setting("sft", choice_check(OBJECTIVES))
    """sft: next-token loss on data.path's text; dpo: preference tuning (the `dpo` section) on JSON Lines
    records {prompt, chosen, rejected} tokenized with data.tokenizer, against the reference dpo.reference
    names."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ActivationsConfig(Section):
    """What autograd saves for backward (tierzero/stages/activations.py): counted in the device tier
    (memory_report, tierzero estimate), recomputed or offloaded."""

    SECTION: ClassVar[str] = "activations"
    checkpoint: int = setting(0, int_check(0, limit=1 << 20))
    """Recompute in backward the activations of every n-th block unit (1: every block) instead
    of keeping them; 0 keeps them all."""
    offload: str = setting("none", choice_check(("none", "cpu")))
    """cpu: the saved tensors (besides parameters) wait in the cpu tier, pinned with CUDA, and
    come back for backward; none keeps them on the device."""


@dataclass(kw_only=True, slots=True, frozen=True)
class OffloadConfig(Section):
    """The home tier of each kind of state: device (accelerator memory), cpu (host memory), nvme,
    or auto: the planner chooses, unit by unit, within the tiers' budgets (tierzero/placement/planner.py).
    `offload: auto` sets all three."""

    SECTION: ClassVar[str] = "offload"
    SHORTHAND: ClassVar[dict[str, dict[str, str]]] = {
        AUTO: {"params": AUTO, "gradients": AUTO, "optimizer": AUTO}
    }
    params: Tier | str = setting(Tier.DEVICE, TIER_OR_AUTO)
    """Home of the parameter slices; cpu or nvme needs zero.stage 3."""
    gradients: Tier | str = setting(Tier.DEVICE, TIER_OR_AUTO)
    """Home of the gradient slices; cpu or nvme needs zero.stage 2 or 3."""
    optimizer: Tier | str = setting(Tier.DEVICE, TIER_OR_AUTO)
    """Home of the fp32 master weights and optimizer states; cpu or nvme works at every stage."""

    @property
    def planned(self) -> bool:
        """Whether any kind's home is left to the planner."""
        return AUTO in (self.params, self.gradients, self.optimizer)


@dataclass(kw_only=True, slots=True, frozen=True)
class DeviceTierConfig(Section):
    """Accelerator memory."""

    SECTION: ClassVar[str] = "tiers.device"
    capacity: int | None = setting(None, size_check(optional=True, limit=MAX_CAPACITY))
    """Bytes of model state the device tier may hold; null: what the device has."""


@dataclass(kw_only=True, slots=True, frozen=True)
class CpuTierConfig(Section):
    """Host memory."""

    SECTION: ClassVar[str] = "tiers.cpu"
    capacity: int | None = setting(None, size_check(optional=True, limit=MAX_CAPACITY))
    """Bytes of model state the host tier may hold; null: what the host has."""
    pin_memory: bool = setting(True, BOOL)
    """Page-lock host buffers for fast device copies; only where CUDA is available."""
    keep_freed: int = setting(512 * MiB, size_check(allow_zero=True, limit=GiB))
    """Freed host memory the process keeps for reuse (glibc): every block comes from the heap,
    whose freed blocks are reused instead of unmapped and faulted in fresh, and up to this many
    free bytes stay at its top; 0: the C library's defaults. Process-wide, set by the engine.
    Without a GPU it is also how far past its live peak the device tier (host memory) keeps
    freed buffers for reuse. `offload: auto` leaves host memory room for it when it moves
    units' slices into memory."""


@dataclass(kw_only=True, slots=True, frozen=True)
class NvmeTierConfig(Section):
    """The NVMe tier: one preallocated swap file per rank, read and written with direct I/O."""

    SECTION: ClassVar[str] = "tiers.nvme"
    path: str | None = setting(None, DIRECTORY)
    """Existing, writable directory for the swap files (made absolute when loaded); required when
    anything lives on nvme."""
    capacity: int | None = setting(None, size_check(optional=True, limit=MAX_CAPACITY))
    """Bytes of swap file per rank; null: what the state needs (checked against free space at
    start-up)."""
    block_size: int = setting(8 * MiB, size_check(multiple_of=IO_ALIGNMENT, limit=GiB))
    """Bytes per I/O request; a multiple of 4096 for direct I/O."""
    queue_depth: int = setting(16, int_check(1, limit=1024))
    """I/O requests in flight at once."""
    threads: int = setting(8, int_check(1, limit=256))
    """Worker threads issuing the I/O."""
    verify: bool = setting(False, BOOL)
    """Checksum every slice written and check it when read back."""
    backend: str = setting("pread", choice_check(("pread", "aiofiles")))
    """pread: os.preadv/pwritev on a thread pool; aiofiles: asyncio file I/O."""
    cache: int = setting(0, size_check(allow_zero=True, limit=MAX_CAPACITY))
    """Bytes of host memory that keep NVMe-homed slices cached (0: off): a cached slice is read from and
    written to memory, and reaches the disk only when evicted. Counted in the cpu tier, within
    tiers.cpu.capacity together with the swapper's staging. The slices first written fill it; later ones
    enter only in place of slices read fewer times between writes (tierzero/store/cache_policy.py)."""

    def _validate(self) -> None:
        if self.capacity is not None and self.block_size > self.capacity:
            raise ConfigError(
                f"tiers.nvme.block_size {format_size(self.block_size)} is above tiers.nvme.capacity "
                f"{format_size(self.capacity)}: lower tiers.nvme.block_size or raise tiers.nvme.capacity",
                key="tiers.nvme.block_size",
            )
        _check_product("tiers.nvme.queue_depth", self.queue_depth, "tiers.nvme.block_size", self.block_size, "bounce blocks")
        if self.path is not None:
            _check_swap_dir(self.path)


@dataclass(kw_only=True, slots=True, frozen=True)
class TiersConfig(Section):
    """Capacities and settings of the three tiers."""

    SECTION: ClassVar[str] = "tiers"
    device: DeviceTierConfig = section(DeviceTierConfig)
    cpu: CpuTierConfig = section(CpuTierConfig)
    nvme: NvmeTierConfig = section(NvmeTierConfig)


@dataclass(kw_only=True, slots=True, frozen=True)
class SwapperConfig(Section):
    """The pool of aligned host staging buffers that bytes pass through between tiers."""

    SECTION: ClassVar[str] = "swapper"
    buffer_size: int = setting(8 * MiB, size_check(multiple_of=IO_ALIGNMENT, limit=4 * GiB))
    """Bytes per staging buffer; a multiple of 4096."""
    buffer_count: int = setting(8, int_check(1, limit=1024))
    """Staging buffers in the pool."""

    def _validate(self) -> None:
        _check_product("swapper.buffer_count", self.buffer_count, "swapper.buffer_size", self.buffer_size, "staging buffers")


@dataclass(kw_only=True, slots=True, frozen=True)
class PrefetchConfig(Section):
    """How far ahead of compute the prefetcher brings slices up."""

    SECTION: ClassVar[str] = "prefetch"
    bytes: int = setting(64 * MiB, size_check(allow_zero=True, limit=TiB))
    """Bytes of upcoming units' slices kept in flight (0 turns prefetch off)."""
    max_live_bytes: int = setting(1 * GiB, size_check(limit=TiB))
    """Most bytes of parameter slices fetched to the device ahead of their gathers (issued, not
    yet used) together with those kept fetched for a unit's next use in the same step. Gathered
    units are bounded apart: stage 3 gathers at most two block units ahead."""

    def _validate(self) -> None:
        if self.bytes > self.max_live_bytes:
            raise ConfigError(
                f"prefetch.bytes {format_size(self.bytes)} is above prefetch.max_live_bytes "
                f"{format_size(self.max_live_bytes)}: lower prefetch.bytes or raise prefetch.max_live_bytes",
                key="prefetch.bytes",
            )


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointConfig(Section):
    """Sharded checkpoints: what `tierzero train` writes and `--resume` continues from."""

    SECTION: ClassVar[str] = "checkpoint"
    dir: str | None = setting(None, DIRECTORY)
    """Directory of the checkpoints, one `<step>` directory each and a `latest` pointer (created when
    needed; made absolute when loaded); null: `tierzero train` saves none."""
    every: int = setting(0, int_check(0))
    """`tierzero train` saves every this many optimizer steps, and after the last one (0: only after
    the last one)."""
    keep: int = setting(2, int_check(1))
    """Newest checkpoints kept under checkpoint.dir; older ones are deleted after each save."""


@dataclass(kw_only=True, slots=True, frozen=True)
class DpoConfig(Section):
    """Preference tuning, `train.objective: dpo` (tierzero/align/): the sigmoid DPO loss of each record's
    chosen completion against its rejected one, under a frozen reference: the base with the LoRA adapters
    off, or the initial model's log-probs computed before the first step."""

    SECTION: ClassVar[str] = "dpo"
    beta: float = setting(0.1, float_check(lo=0.0, lo_open=True, limit=1e6))
    """How far the policy may move from the reference: the loss is -log sigmoid(beta x the difference
    of the chosen and rejected completions' log-ratios to the reference); the reward margin logged is
    beta x that difference."""
    max_prompt_len: int = setting(0, int_check(0, limit=1 << 20))
    """Prompt tokens kept, the last ones (nearest the completion); the prompt and completion (its EOS
    appended) are then cut to train.seq_len + 1 tokens, the completion's end first. At most
    train.seq_len, so that every completion keeps a token; 0: half of train.seq_len."""
    reference: str = setting(AUTO, choice_check(DPO_REFERENCES))
    """adapters_off: each step's reference forward runs the base with the model.lora adapters switched off
    (needs model.lora). precomputed: before the first step the initial model's summed log-probs of every
    record's chosen and rejected completions (with model.lora, of the base and its adapters as they start)
    are computed once, without gradients (2 floats a record, each rank a share), and looked up at each
    step: full fine-tuning needs no second model, and a step saves the reference's forward. `tierzero train` keeps them in checkpoint.dir as dpo-reference.safetensors,
    which a --resume reads back (refused when missing or corrupt, never recomputed from the trained weights).
    auto: adapters_off with model.lora, precomputed without."""


MAX_GENERATE_BATCH = 1 << 16
"""The limit of `generate.batch_size`."""
_GENERATE_BATCH = int_check(1, limit=MAX_GENERATE_BATCH)
BATCH_OR_AUTO = Check(
    "a positive integer or auto",
    "int >= 1 \\| auto",
    lambda value: AUTO if isinstance(value, str) and value.lower() == AUTO else _GENERATE_BATCH.convert(value),
    limit=_GENERATE_BATCH.limit,
)


@dataclass(kw_only=True, slots=True, frozen=True)
class GenerateConfig(Section):
    """`tierzero generate` (tierzero/inference/): how many prompts are decoded together."""

    SECTION: ClassVar[str] = "generate"
    batch_size: int | str = setting(AUTO, BATCH_OR_AUTO)
    """Prompts decoded together; each decoding step reads every weight once for all of them, so a larger
    batch reads fewer weight bytes per token. auto: the largest batch, at most the number of prompts, whose
    KV cache, logits and gathered units fit the device tier's free budget (tierzero/inference/batch.py)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class DistConfig(Section):
    """The process group `tierzero.initialize` creates under torchrun."""

    SECTION: ClassVar[str] = "dist"
    timeout: float = setting(600.0, float_check(lo=0.0, lo_open=True, limit=7 * 24 * 3600))
    """Seconds from a rank hanging to the job stopping with an error naming the lost rank (a dead
    rank is noticed at once). The collectives of the group tierzero creates wait this less the roll
    call's share, 2 s or a quarter of a timeout under 8 s, in which the ranks that noticed ask the
    job's store which ranks still answer; a group created before tierzero.initialize keeps its own."""


def _check_product(count_key: str, count: int, size_key: str, size: int, what: str) -> None:
    if count * size > MAX_HOST_BUFFERS:
        raise ConfigError(
            f"{count_key} x {size_key} = {count} x {format_size(size)} = {format_size(count * size)} of host "
            f"{what}, above the limit of {format_size(MAX_HOST_BUFFERS)}: lower {count_key} or {size_key}",
            key=count_key,
        )


def _check_swap_dir(path: str) -> None:
    key = "tiers.nvme.path"
    if not os.path.exists(path):
        raise ConfigError(f"{key} {path} does not exist: create it (mkdir -p {path}) or pick another directory", key=key)
    if not os.path.isdir(path):
        raise ConfigError(f"{key} {path} is not a directory: point {key} at a directory, not a file", key=key)
    try:
        fd, probe = tempfile.mkstemp(prefix=".tierzero-probe-", dir=path)
    except OSError as exc:
        raise ConfigError(
            f"{key} {path} is not writable ({exc.strerror}): fix its permissions or pick another directory",
            key=key,
        ) from None
    os.close(fd)
    os.unlink(probe)
