"""The training half of a run's config: TrainConfig and the eight parts it is made of.

Each part is a small dataclass of one component's knobs (the step's shape, the lr schedule,
the optimizer, the corpus, metrics, checkpoints, the fleet, compile) with its own checks
beside it (`check`); `Part` checks what every field declares (finite numbers, a Literal's
values, signs). TrainConfig is their union, flat, so a field has one name everywhere.
ModelConfig, the presets, `--set` and JSON are config.py's. Nothing here imports torch.
"""

from __future__ import annotations

import functools
import math
import re
import typing
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

from .errors import ConfigError

Dtype = Literal["auto", "fp32", "bf16", "fp16"]  # auto: the device policy's (train/plan/device.py)

#: Devices a run may name: what `torch.device` accepts and dormouse runs on.
_DEVICE = re.compile(r"(auto|cpu|cuda(:[0-9]+)?)\Z")
#: The longest dist_timeout (7 days, in seconds): longer is no timeout at all, and past
#: ~1e14 s Python's timedelta overflows.
_DIST_TIMEOUT_MAX = 7 * 24 * 3600


def check_device(name: str, flag: str = "--device") -> str:
    """Refuse a device string torch would choke on (`foo`, `cuda:abc`) before torch sees it."""
    if not isinstance(name, str) or not _DEVICE.match(name):
        raise ConfigError(
            f"{flag} {name!r} is not a device dormouse runs on; use auto, cpu, cuda or cuda:N "
            f"(N = a card index, 0 for the first)"
        )
    return name


def check_file_name(name: str, key: str = "ckpt_name") -> str:
    """A plain file name: no folder part, so a run writes only inside its --out."""
    if (
        not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or len(name.encode("utf-8", "surrogateescape")) > 200
    ):
        raise ConfigError(
            f"{key}={name!r} is not a plain file name (no '/', not '.' or '..', not empty, at "
            f"most 200 bytes): the checkpoint must stay inside --out. Pick the folder with "
            f"--out DIR and a bare name like --set {key}=ckpt"
        )
    return name


def _check_path(text: str, what: str) -> None:
    if not text or "\0" in text:
        raise ConfigError(
            f"{what}={text!r} is not a usable path (empty, or holds a NUL byte; "
            f"an unset shell variable gives an empty one); name the file or folder"
        )


@functools.cache
def _choices(cls: type) -> dict[str, tuple]:
    """Every field of `cls` with a fixed set of values: its Literal annotation's."""
    hints = typing.get_type_hints(cls)
    return {k: typing.get_args(tp) for k, tp in hints.items() if typing.get_origin(tp) is Literal}


class Part:
    """What a config part checks of its own fields, read from their annotations and the part's
    POSITIVE / NON_NEGATIVE lists: finite numbers, an integer range, a Literal's values, the
    signs. A part's `check` adds its own rules; a rule that reads two parts is `validate`'s."""

    POSITIVE: ClassVar[tuple[str, ...]] = ()
    NON_NEGATIVE: ClassVar[tuple[str, ...]] = ()

    def out_of_range(self, name: str, v: int) -> str | None:
        # Python's ints are unbounded, torch's and numpy's 64-bit
        return f"{name}={v} is out of range (|value| < 2**62)" if abs(v) >= 2**62 else None

    def check_fields(self) -> None:
        vals = {f.name: getattr(self, f.name) for f in fields(self)}
        for k, v in vals.items():
            # nan passes every `< 0` test and inf every `> 0` one: refuse them by name first
            for x in v if isinstance(v, (tuple, list)) else (v,):
                if isinstance(x, float) and not math.isfinite(x):
                    raise ConfigError(
                        f"{k}={v} is not a finite number; give a finite value with --set {k}=X"
                    )
        for k, v in vals.items():
            if isinstance(v, int) and not isinstance(v, bool) and (why := self.out_of_range(k, v)):
                raise ConfigError(why)
        choices = _choices(type(self))
        for k, v in vals.items():
            if k in choices and v not in choices[k]:
                raise ConfigError(f"{k}={v!r} is not one of {choices[k]}")
        for k in self.POSITIVE:
            if vals[k] <= 0:
                raise ConfigError(
                    f"{k}={vals[k]} must be positive; set it with --set {k}=N (N >= 1)"
                )
        for k in self.NON_NEGATIVE:
            if vals[k] < 0:
                raise ConfigError(f"{k}={vals[k]} must not be negative")

    def check(self) -> None:
        self.check_fields()


@dataclass(frozen=True)
class Training(Part):
    """The step's shape, where it runs and how it survives a bad step."""

    batch: int = 8  # the most windows one forward takes (per rank: the micro-batch cap)
    seq_len: int = 256
    # windows per optimizer step, over the whole fleet; 0 = batch on every rank, no
    # accumulation. Else each rank runs k micro-batches of <= batch windows (context.accumulate)
    global_batch: int = 0
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: Dtype = "auto"
    # where the step's finiteness verdict (a non-finite loss or gradient skips the step) is
    # decided: "host" reads it before the optimizer, one synchronisation a step; "device"
    # keeps it on the device: the optimizer step and the LFB update apply it themselves (what
    # they write is copied aside first and put back on a skip) and the loop reads it a step
    # late, so the host queues the next step while the device runs this one (one process or
    # a DDP fleet, whose ranks agree it by an all-reduce on the device; no fp16 loss scale).
    # "auto": on one process, device where the optimizer step is a CUDA graph
    # (compile_mode=reduce-overhead on CUDA) and its copy aside takes at most 1/16 of the
    # card's memory, else host; logged with what it read.
    verdict: Literal["auto", "host", "device"] = "auto"
    grad_clip: float = 1.0
    max_skips: int = 10  # consecutive non-finite steps before the run stops
    # dtype=fp16 (on any rank of a fleet): the dynamic loss scale doubles after this many clean
    # steps in a row (train/optim/scaler.py; torch.amp.GradScaler's default growth interval)
    loss_scale_every: int = 2000
    fit_gb: float = 0.0  # 0 = no --fit

    POSITIVE = ("batch", "seq_len", "max_skips", "loss_scale_every")
    NON_NEGATIVE = ("grad_clip", "fit_gb", "global_batch")

    def check(self) -> None:
        self.check_fields()
        if self.seed < 0:
            raise ConfigError(
                f"seed={self.seed} must not be negative (torch and numpy seeds "
                f"are unsigned); pick a seed in [0, 2**62)"
            )
        check_device(self.device, "device")


@dataclass(frozen=True)
class Schedule(Part):
    """The run's length and the shape of its learning rate (a factor of the optimizer's lr)."""

    steps: int = 300
    warmup: int = 20
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    min_lr_frac: float = 0.1
    wsd_decay_frac: float = 0.2

    NON_NEGATIVE = ("steps", "warmup", "min_lr_frac")

    def check(self) -> None:
        self.check_fields()
        if self.min_lr_frac > 1:
            raise ConfigError(f"min_lr_frac={self.min_lr_frac} must be in [0, 1]")
        if self.warmup > self.steps and self.steps > 0:
            raise ConfigError(f"warmup={self.warmup} is longer than the run (steps={self.steps})")
        if not 0 <= self.wsd_decay_frac <= 1:
            raise ConfigError(f"wsd_decay_frac={self.wsd_decay_frac} must be in [0, 1]")


@dataclass(frozen=True)
class Optim(Part):
    """MixOptimizer's knobs (train/optim/mix.py): Muon, AdamW and the Engram tables' Adam."""

    opt: Literal["mix", "adamw"] = "mix"
    lr: float = 3e-3
    wd: float = 0.1
    ns_steps: int = 5
    ns_kind: Literal["quintic", "polar_express"] = "quintic"
    ns_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    # Muon's momentum: bf16 halves it; int8 (8-bit codes, an fp32 scale per 256 values) takes
    # 1.016 B a value
    muon_state_dtype: Literal["fp32", "bf16", "int8"] = "fp32"
    # the Engram tables' Adam moments (the bulk of b1's optimizer state): bf16 halves them,
    # int8 (8-bit codes, an fp32 scale per table row and moment) ~quarters them
    # (train/optim/quant.py)
    engram_state_dtype: Literal["fp32", "bf16", "int8"] = "fp32"
    muon_variant: Literal["nesterov", "plain"] = "nesterov"
    muon_sf: Literal["rms", "jordan"] = "rms"
    muon_momentum: float = 0.95
    adam_betas: tuple[float, ...] = (0.9, 0.95)
    # Adam's epsilon for the AdamW groups and the Engram tables (torch's default)
    adam_eps: float = 1e-8
    engram_lr_mult: float = 5.0
    optim_8bit: bool = False

    POSITIVE = ("ns_steps",)
    NON_NEGATIVE = ("wd", "lr", "engram_lr_mult")

    def check(self) -> None:
        self.check_fields()
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            raise ConfigError(f"adam_betas={self.adam_betas} must be two numbers in [0, 1)")
        if not (math.isfinite(self.adam_eps) and self.adam_eps > 0):
            raise ConfigError(
                f"adam_eps={self.adam_eps} must be a finite number > 0 (Adam's epsilon; "
                f"torch's default is 1e-8)"
            )
        if not 0 <= self.muon_momentum < 1:
            raise ConfigError(
                f"muon_momentum={self.muon_momentum} must be in [0, 1) (0.95 is usual); "
                f"at 1 or above the momentum never forgets and grows without bound"
            )


@dataclass(frozen=True)
class Corpus(Part):
    """Which bytes the run reads, and how it splits and orders them."""

    data: tuple[str, ...] = ()
    data_weights: tuple[float, ...] = ()
    shuffle: bool = True  # visit each pass's blocks in a seeded order (rank-consistent)
    val_frac: float = 0.01
    val_bytes: int = 0

    NON_NEGATIVE = ("val_bytes",)

    def check(self) -> None:
        self.check_fields()
        if not 0 <= self.val_frac < 1:
            raise ConfigError(
                f"val_frac={self.val_frac} must be in [0, 1); e.g. --set val_frac=0.01"
            )
        for d in self.data:
            _check_path(d, "data")
        if self.data_weights and len(self.data_weights) != len(self.data):
            raise ConfigError(
                f"{len(self.data_weights)} data_weights for {len(self.data)} corpora; give one "
                f"weight per --data file or none"
            )


@dataclass(frozen=True)
class Metrics(Part):
    """What the run logs and evaluates, and when evaluation stops it."""

    log_every: int = 10
    # also write the metrics rows as TensorBoard scalars into RUN/tb/ (rank 0; needs the [tb]
    # extra: pip install -e ".[tb]"); metrics.jsonl is written either way
    # (train/store/metrics.py)
    tensorboard: bool = False
    eval_every: int = 100
    eval_batches: int = 8
    # stop after this many evaluations in a row without a new best val loss (0 = never)
    early_stop: int = 0

    POSITIVE = ("eval_batches",)
    NON_NEGATIVE = ("log_every", "eval_every", "early_stop")


@dataclass(frozen=True)
class Checkpoint(Part):
    """Where the run folder is and how often the checkpoint is written."""

    ckpt_every: int = 500
    out_dir: str = "runs/default"
    ckpt_name: str = "ckpt"

    NON_NEGATIVE = ("ckpt_every",)

    def check(self) -> None:
        self.check_fields()
        check_file_name(self.ckpt_name)
        _check_path(self.out_dir, "out_dir")


@dataclass(frozen=True)
class Fleet(Part):
    """A data-parallel fleet: joining it, splitting its batch, reducing, re-balancing."""

    dist: bool = False
    dist_capacity: str = ""
    dist_reduce: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    dist_shard: Literal["none", "fsdp"] = "none"
    bucket_mb: float = 0.0  # 0 = sized from the payload
    # seconds: a rank whose heartbeat is older than this, or one collective that waits
    # longer, ends every rank of the fleet (docs/reliability.md, the fleet)
    dist_timeout: float = 600.0
    # re-balancing a fleet while it trains (train/fleet/balance.py): with dist_capacity=auto,
    # every rebalance_every steps the ranks' measured compute times re-split the same global
    # batch; a new split is taken only when it shortens the predicted step by more than
    # rebalance_threshold (the hysteresis). 0 = the start-up split stays.
    rebalance_every: int = 50
    rebalance_threshold: float = 0.05
    # forced re-splits "STEP:B0,B1,...;STEP:..." (windows per rank from that 0-based step on):
    # reproducible runs and the gates; replaces the measured re-balancing
    rebalance_at: str = ""
    # EMULATION of a slow card on a CPU fleet: "RANK:FACTOR" makes that rank sleep FACTOR x
    # its own measured compute every step (bench fleet, docs/fleet.md); "" = off
    emulate_slow: str = ""

    NON_NEGATIVE = ("bucket_mb", "rebalance_every", "rebalance_threshold")

    def check(self) -> None:
        self.check_fields()
        if not 0 < self.dist_timeout <= _DIST_TIMEOUT_MAX:
            raise ConfigError(
                f"dist_timeout={self.dist_timeout} must be in (0, {_DIST_TIMEOUT_MAX:.0f}] "
                f"seconds: it is how long a fleet waits for a silent rank or one collective "
                f"before every rank stops; e.g. --set dist_timeout=600"
            )
        if self.dist_capacity.strip() and not self.dist:
            raise ConfigError(
                f"--capacity / dist_capacity={self.dist_capacity!r} splits a fleet's batch, and "
                f"this run is one process (no --dist), so it would be ignored; drop --capacity, "
                f"or launch a fleet: torchrun --nproc_per_node=N -m dormouse train ... --dist "
                f"--capacity {self.dist_capacity}"
            )
        for knob in ("rebalance_at", "emulate_slow"):
            if getattr(self, knob).strip() and not self.dist:
                raise ConfigError(
                    f"{knob}={getattr(self, knob)!r} acts on a fleet's split, and this run is "
                    f"one process (no --dist), so it would be ignored; drop it, or launch a "
                    f"fleet with --dist"
                )


@dataclass(frozen=True)
class Compile(Part):
    """torch.compile of the training forward (and so its backward)."""

    # compile_mode is torch.compile's mode (reduce-overhead replays the compiled regions as
    # CUDA graphs, and the optimizer step is captured as one too). "auto" (the default of
    # both) is decided per run by train/run.py resolve_compile, which logs what it read: on
    # CUDA compile, in reduce-overhead where the step's shapes are static and nothing
    # accumulates or streams from the host, else default; on the CPU no compile. Evaluation
    # runs uncompiled.
    compile: Literal["auto", True, False] = "auto"
    compile_mode: Literal["auto", "default", "reduce-overhead", "max-autotune-no-cudagraphs"] = (
        "auto"
    )
    # torch.compile's backend: inductor generates fused kernels; aot_eager runs the same
    # dynamo graphs and AOTAutograd's forward/backward split with eager kernels (no codegen:
    # seconds, not minutes, on a CPU) to check what compiling does to a run's arithmetic
    # routing, wrappers and hooks apart from inductor's own kernels
    compile_backend: Literal["inductor", "aot_eager"] = "inductor"

    def check(self) -> None:
        self.check_fields()
        if self.compile_backend != "inductor" and self.compile_mode not in ("default", "auto"):
            raise ConfigError(
                f"compile_mode={self.compile_mode} is inductor's (CUDA graphs, autotuning); "
                f"compile_backend={self.compile_backend} has no modes. Use --set "
                f"compile_mode=default or compile_backend=inductor"
            )


#: The parts of TrainConfig by the name `--set PART.key=value` and `train.PART` give them.
PARTS: dict[str, type[Part]] = {
    "training": Training,
    "lr_schedule": Schedule,
    "optim": Optim,
    "corpus": Corpus,
    "metrics": Metrics,
    "checkpoint": Checkpoint,
    "fleet": Fleet,
    "compiler": Compile,
}


@dataclass(frozen=True)
class TrainConfig(Training, Schedule, Optim, Corpus, Metrics, Checkpoint, Fleet, Compile):
    """Every knob of training: the union of the parts above, each a small dataclass with its
    checks beside it. Stored flat, so a field has one name everywhere (`train.lr`,
    `replace(train, lr=...)`, `--set lr=`, config.json's keys); `train.optim` (and each part's
    name in PARTS) is that part alone, for the code that owns it."""

    def part(self, cls: type[Part]) -> Any:
        return cls(**{f.name: getattr(self, f.name) for f in fields(cls)})

    training = property(lambda self: self.part(Training))
    lr_schedule = property(lambda self: self.part(Schedule))
    optim = property(lambda self: self.part(Optim))
    corpus = property(lambda self: self.part(Corpus))
    metrics = property(lambda self: self.part(Metrics))
    checkpoint = property(lambda self: self.part(Checkpoint))
    fleet = property(lambda self: self.part(Fleet))
    compiler = property(lambda self: self.part(Compile))

    def check(self) -> None:
        """Each part's rules, then those that read two parts."""
        for cls in PARTS.values():
            self.part(cls).check()
        graphs = self.compile is True and self.compile_mode == "reduce-overhead"
        if graphs and not self.dist and self.global_batch > self.batch:
            # a CUDA graph's outputs live in its pool until the next replay: a micro-batch's
            # gradients, accumulated into .grad, would be overwritten by the next micro-batch's
            raise ConfigError(
                f"compile_mode=reduce-overhead with accumulation (global_batch="
                f"{self.global_batch} > batch={self.batch}): every micro-batch's replay reuses "
                f"the CUDA graphs' gradient buffers. Use --set compile_mode=default, or --set "
                f"batch={self.global_batch}"
            )
        if self.verdict == "device" and self.dist and self.dist_shard == "fsdp":
            raise ConfigError(
                "verdict=device needs the optimizer's device-side step, and FSDP2's shards step "
                "through collectives (DTensors), so the verdict is read on the host there. Use "
                "--set verdict=auto (host under FSDP2), or DDP (dist_shard=none)"
            )
