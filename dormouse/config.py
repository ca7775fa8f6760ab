"""Run configuration: the three dataclasses, the presets, `--set`, validation, JSON.

Owns every knob of a run. One parser (`apply_sets`) turns `key=value` strings into
typed field values; one validator (`validate`) refuses impossible combinations
with the cause, the measured fact and the escape. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import logging
import math
import re
import typing
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Literal

from .errors import UserError

log = logging.getLogger(__name__)

KdaImpl = Literal["auto", "torch", "fla"]
MoeImpl = Literal["auto", "grouped", "batched", "dense", "triton"]
Dtype = Literal["auto", "fp32", "bf16", "fp16"]  # auto: the device policy's (train/plan/device.py)


class ConfigError(UserError, ValueError):
    """A configuration the system cannot honour; the message names cause and escape."""


#: `dropout=auto`, as stored in a config: resolved to a probability before the model is built.
DROPOUT_AUTO = -1.0


class _Part:
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
        for k, v in vals.items():
            if k in CHOICES and v not in CHOICES[k]:
                raise ConfigError(f"{k}={v!r} is not one of {CHOICES[k]}")
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
class ModelConfig(_Part):
    """The network's shape. Field names are unique across ModelConfig and TrainConfig."""

    # "dormouse" (Engram + looped KDA/MoE body) or "gpt": the plain causal transformer
    # baseline (model/gpt.py), which reads d_model, n_layers, n_heads, head_dim, d_ffn,
    # max_seq_len, init_std and dropout and ignores the rest
    arch: Literal["dormouse", "gpt"] = "dormouse"
    vocab: int = 256
    d_model: int = 256
    n_layers: int = 2  # distinct blocks in the body
    max_iter: int = 2  # times the body is applied
    rank: int = 8  # per-iteration low-rank delta on the mixer's projections (0 = pure tying)
    # KDA mixer
    n_heads: int = 4
    head_dim: int = 64
    conv_size: int = 4
    gate_rank: int = 16  # low-rank f(x) that feeds the per-key-dim decay
    kda_impl: KdaImpl = "auto"
    kda_chunk: int = 16  # chunk length of the torch arm
    segment_len: int = 0  # 0 = whole window; else carry state, cut gradient at borders
    # softmax attention in place of KDA (model/attn.py): 0 = every block mixes by KDA; N >= 1 =
    # every N-th block (blocks N-1, 2N-1, ...) by causal attention with RoPE; 1 = all of them
    attn_every: int = 0
    # MoE FFN
    d_ffn: int = 512
    n_experts: int = 4
    moe_topk: int = 2
    moe_capacity: float = 0.0  # 0 = dropless; > 0 = capacity factor
    moe_lb_coef: float = 0.0  # LFB update rate; 0 = controller off
    moe_impl: MoeImpl = "auto"
    shared_rank: int = 16
    # Engram
    engram_rows: int = 1024
    engram_dim: int = 16
    engram_heads: int = 2
    engram_orders: tuple[int, ...] = (2, 3)
    # memory mechanisms (exact ones leave the math unchanged)
    engram_ram: bool = False
    moe_offload: bool = False
    act_ckpt: bool = False
    act_ckpt_quant: bool = False  # quantize checkpointed inputs to bf16 (approximate)
    # the rest
    max_seq_len: int = 512
    init_std: float = 0.02
    # regularisation: dropout on the embedding and on every residual branch's output (GPT-2's
    # places), masks keyed by (seed, step, global row) so a fleet draws what one process draws.
    # DROPOUT_AUTO (`--set dropout=auto`, the presets' default): chosen from how many times the
    # run reads its train split (train/run.py resolve_dropout; measured in docs/learning.md)
    dropout: float = 0.0

    @property
    def d_attn(self) -> int:
        return self.n_heads * self.head_dim

    def mixer_of(self, layer: int) -> Literal["kda", "attn"]:
        """The mixer of body block `layer` (0-based): "attn" for every attn_every-th block."""
        return "attn" if self.attn_every and (layer + 1) % self.attn_every == 0 else "kda"

    POSITIVE = (
        "vocab",
        "d_model",
        "n_layers",
        "max_iter",
        "n_heads",
        "head_dim",
        "conv_size",
        "kda_chunk",
        "d_ffn",
        "n_experts",
        "moe_topk",
        "engram_rows",
        "engram_dim",
        "engram_heads",
        "max_seq_len",
    )
    NON_NEGATIVE = (
        "rank",
        "gate_rank",
        "segment_len",
        "attn_every",
        "shared_rank",
        "moe_capacity",
        "moe_lb_coef",
        "init_std",
    )

    def out_of_range(self, name: str, v: int) -> str | None:
        if v < _SHAPE_MAX:
            return None
        return (
            f"{name}={v} is beyond any model dormouse builds (limit {_SHAPE_MAX - 1}); "
            f"lower --set {name}"
        )

    def check(self) -> None:
        self.check_fields()
        m = self
        if m.dropout != DROPOUT_AUTO and not 0 <= m.dropout < 1:
            raise ConfigError(
                f"dropout={m.dropout} must be in [0, 1) (0.1 drops one value in ten), "
                f"or auto (chosen from the passes over the data)"
            )
        if m.vocab != 256:
            raise ConfigError(f"vocab={m.vocab}: dormouse is byte-level, vocab must be 256")
        if m.moe_topk > m.n_experts:
            raise ConfigError(
                f"moe_topk={m.moe_topk} exceeds n_experts={m.n_experts}: a token cannot pick more "
                f"experts than exist; lower --set moe_topk or raise --set n_experts"
            )
        if m.n_heads * m.head_dim != m.d_model:
            raise ConfigError(
                f"n_heads*head_dim = {m.n_heads}*{m.head_dim} = {m.n_heads * m.head_dim} but "
                f"d_model={m.d_model}; the mixer's heads must tile the model width: set head_dim="
                f"{m.d_model // m.n_heads if m.d_model % m.n_heads == 0 else '?'} or change n_heads"
            )
        if not m.engram_orders or any(n < 2 for n in m.engram_orders):
            raise ConfigError(f"engram_orders={m.engram_orders}: each order must be >= 2 bytes")
        if len(set(m.engram_orders)) != len(m.engram_orders):
            # an order's tables hash by (order, head) alone: a repeat reads the very same rows
            raise ConfigError(
                f"engram_orders={m.engram_orders} repeats an order: its tables would hash every "
                f"n-gram to the same rows as the first's (memory for nothing); for more tables of "
                f"one order raise --set engram_heads"
            )
        if m.attn_every and m.arch == "dormouse":
            if m.attn_every > m.n_layers:
                raise ConfigError(
                    f"attn_every={m.attn_every} exceeds n_layers={m.n_layers}: no block would mix "
                    f"by attention; pick 1..{m.n_layers} or attn_every=0 (KDA everywhere)"
                )
            if m.segment_len:
                raise ConfigError(
                    f"attn_every={m.attn_every} with segment_len={m.segment_len}: attention carries "
                    f"no state across segments; set segment_len=0 or attn_every=0"
                )
            if m.head_dim % 2:
                raise ConfigError(
                    f"attn_every={m.attn_every} with head_dim={m.head_dim}: rotary positions turn "
                    f"channel pairs, so head_dim must be even"
                )
        biggest = max(
            m.n_experts * m.d_model * m.d_ffn,
            m.engram_rows * m.engram_dim,
            m.d_model * m.d_attn,
            m.d_model * m.vocab,
        )
        if biggest > _TENSOR_MAX:
            raise ConfigError(
                f"one weight of this model would hold {biggest:.3g} elements (n_experts*d_model*"
                f"d_ffn = {m.n_experts}*{m.d_model}*{m.d_ffn}, engram_rows*engram_dim = "
                f"{m.engram_rows}*{m.engram_dim}): more than {_TENSOR_MAX:.3g}, beyond any card; "
                f"lower the sizes"
            )
        # a lower bound of the parameters: the experts (the MLP) and the mixers' projections of
        # every layer, the Engram tables, the embedding (count_params: tiny 133,120 of 170,000)
        ffn = 3 * m.n_experts if m.arch == "dormouse" else 2  # SwiGLU experts, or the GPT's MLP
        least = (
            m.n_layers * (ffn * m.d_model * m.d_ffn + 4 * m.d_model * m.d_attn)
            + (m.arch == "dormouse")
            * len(m.engram_orders)
            * m.engram_heads
            * m.engram_rows
            * m.engram_dim
            + m.vocab * m.d_model
        )
        if least > _MODEL_MAX:
            raise ConfigError(
                f"this model would have at least {least:.3g} parameters (n_layers={m.n_layers} of "
                f"d_model={m.d_model}, d_ffn={m.d_ffn}), more than "
                f"{_MODEL_MAX:.3g}: beyond any machine dormouse trains on; lower the sizes"
            )


@dataclass(frozen=True)
class Training(_Part):
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
class Schedule(_Part):
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
class Optim(_Part):
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
class Corpus(_Part):
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
class Metrics(_Part):
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
class Checkpoint(_Part):
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
class Fleet(_Part):
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
class Compile(_Part):
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
PARTS: dict[str, type[_Part]] = {
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

    def part(self, cls: type[_Part]) -> Any:
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


@dataclass(frozen=True)
class RunConfig:
    source: str
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    # ---- JSON ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "model": dataclasses.asdict(self.model),
            "train": dataclasses.asdict(self.train),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        if not isinstance(d, dict) or not isinstance(d.get("source"), str):
            raise ConfigError(
                f"a run config must be a JSON object with a 'source' string, got "
                f"{type(d).__name__}{'' if not isinstance(d, dict) else ' without one'}"
            )
        for part in ("model", "train"):
            if not isinstance(d.get(part, {}), dict):
                raise ConfigError(
                    f"the run config's {part!r} must be a JSON object, got {type(d[part]).__name__}"
                )
        model, train = dict(d.get("model", {})), _flat_train(dict(d.get("train", {})))
        _one_dtype(model, train)
        return cls(str(d["source"]), _build(ModelConfig, model), _build(TrainConfig, train))

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        try:
            d = json.loads(text)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"the run config is not valid JSON ({e})") from None
        return cls.from_dict(d)


def _flat_train(train: dict[str, Any]) -> dict[str, Any]:
    """A config's train object, flat: a part written as an object (`"optim": {"lr": ..}`,
    what `--set optim.lr=` names) gives its fields; config.json as dormouse writes it is flat."""
    out = {}
    for k, v in train.items():
        if k in PARTS and isinstance(v, dict):
            known = {f.name for f in fields(PARTS[k])}
            if set(v) - known:
                raise ConfigError(
                    f"the run config's train.{k} has no field(s) "
                    f"{sorted(set(v) - known)}; this file was written by another "
                    f"version of dormouse"
                )
            out.update(v)
        else:
            out[k] = v
    return out


def _one_dtype(model: dict[str, Any], train: dict[str, Any]) -> None:
    """An older config's ModelConfig.bf16 and dtype=none (the flag decides) -> one dtype."""
    if "bf16" not in model and train.get("dtype") != "none":
        return
    bf16, old = model.pop("bf16", False), train.get("dtype", "none")
    train["dtype"] = ("auto" if bf16 is True else "fp32") if old == "none" else old
    log.info(
        "run config of an older dormouse: bf16=%s dtype=%s -> dtype=%s", bf16, old, train["dtype"]
    )


def _build(cls, d: dict[str, Any]):
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(d) - set(known))
    if unknown:
        raise ConfigError(
            f"{cls.__name__} has no field(s) {unknown}; "
            f"this file was written by another version of dormouse"
        )
    hints = typing.get_type_hints(cls)
    kw = {k: _coerce_json(hints[k], v, k) for k, v in d.items()}
    return cls(**kw)


def _coerce_json(tp, v, key: str = "?"):
    """A JSON value as the field's declared type; ConfigError when it is another kind."""
    if typing.get_origin(tp) is Literal:  # validate() checks the value itself
        if isinstance(v, bool) and v in typing.get_args(tp):
            return v  # compile: true|false in a config.json (and "auto")
        tp = str
    if typing.get_origin(tp) is tuple:
        if not isinstance(v, (list, tuple)):
            raise ConfigError(f"field {key}: expected a list, got {type(v).__name__} {v!r}")
        (inner, *_rest) = typing.get_args(tp)
        return tuple(_coerce_json(inner, x, key) for x in v)
    ok = {
        bool: lambda x: isinstance(x, bool),
        int: lambda x: isinstance(x, int) and not isinstance(x, bool),
        float: lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
        str: lambda x: isinstance(x, str),
    }.get(tp)
    if ok is not None and not ok(v):
        raise ConfigError(f"field {key}: expected {_tname(tp)}, got {type(v).__name__} {v!r}")
    return float(v) if tp is float else v


# ---- presets ---------------------------------------------------------------

_TINY = ModelConfig(
    d_model=64, n_heads=4, head_dim=16, d_ffn=128, n_layers=1, max_iter=2, rank=8,
    n_experts=4, moe_topk=2, engram_rows=64, engram_dim=8, engram_heads=2,
    shared_rank=16, gate_rank=8, max_seq_len=64,
)  # fmt: skip

_SMALL = ModelConfig(
    d_model=256, n_heads=4, head_dim=64, d_ffn=128, n_layers=4, max_iter=2, rank=16,
    n_experts=8, moe_topk=2, engram_rows=16384, engram_dim=32, engram_heads=4,
    shared_rank=64, gate_rank=32, max_seq_len=512,
    dropout=DROPOUT_AUTO,
)  # fmt: skip

#: The main job's shape (README): what a 2-core CPU learns most from in a few minutes. The CPU
#: is compute-bound at ~500 tokens/s for `small` whatever the batch, so this model is narrower
#: and shallower (1.1M parameters outside its Engram tables, whose row-sparse lookups are cheap)
#: and reads ~10x the bytes a second. max_iter 1: at equal CPU time 800 steps of two blocks once
#: reached val bpb 2.057, one block twice 2.085, two blocks twice (600 steps) 2.183. attn_every
#: 1: softmax attention in both blocks steps in 220 ms where the torch KDA arm took 453 (one
#: attention block of two: 330), so in the same time it reads twice the bytes: 2,000 steps
#: reached 1.834, the hybrid's 1,300 1.886, KDA's 800 2.057 (docs/learning.md). kda_chunk 8
#: (with attn_every=0): the torch arm ran 1.7x faster than at 16 here (853 vs 1,532 ms a step).
_CPU = ModelConfig(
    d_model=128, n_heads=4, head_dim=32, d_ffn=256, n_layers=2, max_iter=1, rank=8,
    n_experts=4, moe_topk=2, engram_rows=16384, engram_dim=32, engram_heads=4,
    shared_rank=32, gate_rank=16, kda_chunk=8, max_seq_len=128, attn_every=1,
    dropout=DROPOUT_AUTO,
)  # fmt: skip

_MEDIUM = ModelConfig(
    d_model=768, n_heads=12, head_dim=64, d_ffn=768, n_layers=6, max_iter=2, rank=32,
    n_experts=8, moe_topk=2, engram_rows=65536, engram_dim=64, engram_heads=4,
    shared_rank=128, gate_rank=64, max_seq_len=1024,
    dropout=DROPOUT_AUTO,
)  # fmt: skip

_B1 = ModelConfig(
    d_model=1536, n_heads=12, head_dim=128, d_ffn=1920, n_layers=8, max_iter=2, rank=64,
    n_experts=8, moe_topk=2, engram_rows=393216, engram_dim=128, engram_heads=4,
    shared_rank=256, gate_rank=128, max_seq_len=2048,
    dropout=DROPOUT_AUTO,
)  # fmt: skip

#: The plain-GPT baselines (model/gpt.py) for `small`: the same total parameters (9.15M vs
#: 9.34M), and the same parameters outside the Engram tables (4.92M vs 5.14M). Dropout 0.2:
#: the setting the well-known character-level GPT recipes use at this size and data scale.
_GPT_SMALL = ModelConfig(arch="gpt", d_model=384, n_heads=6, head_dim=64, d_ffn=1536,
                         n_layers=5, max_seq_len=512, dropout=0.2)  # fmt: skip
_GPT_SMALL_NE = ModelConfig(arch="gpt", d_model=256, n_heads=4, head_dim=64, d_ffn=1024,
                            n_layers=6, max_seq_len=512, dropout=0.2)  # fmt: skip

_PRESETS: dict[str, tuple[ModelConfig, TrainConfig]] = {
    # tiny computes fp32 everywhere; the others take the device policy's dtype (auto).
    "tiny": (_TINY, TrainConfig(batch=4, seq_len=64, steps=20, lr=1e-3, warmup=0,
                                log_every=1, eval_every=0, ckpt_every=0, dtype="fp32")),
    # `small` was the main job once (300 steps inside 10 minutes on a 2-core CPU),
    # where Muon's polar is compute-bound: narrow experts (d_ffn 128) cut it ~4x, and the
    # parameters they gave up sit in Engram rows (row-sparse Adam, no polar). 8 x 128 with
    # d_ffn 256 measured 2.0-2.4 s a step there (11.9 min); 6 x 128 with d_ffn 128 ~1.5 s.
    # On a GPU raise the batch, e.g. --set batch=32 --set seq_len=512.
    "small": (_SMALL, TrainConfig(batch=6, seq_len=128, steps=300, lr=3e-3, warmup=30,
                                  eval_every=50)),
    # The README's main job: train + sample within 10 minutes on a 2-core CPU (docs/learning.md
    # has its measured wall time, val bpb and sample).
    "cpu": (_CPU, TrainConfig(batch=16, seq_len=128, steps=1600, lr=8e-3, warmup=30,
                              eval_every=200)),
    "medium": (_MEDIUM, TrainConfig(batch=8, seq_len=512, steps=5000, lr=2e-3, warmup=200,
                                    eval_every=250)),
    "b1": (_B1, TrainConfig(batch=8, seq_len=512, steps=20000, lr=1e-3, warmup=500,
                            eval_every=500)),
    # the baselines train exactly as `small` does (same data path, schedule and optimizer)
    "gpt-small": (_GPT_SMALL, TrainConfig(batch=6, seq_len=128, steps=300, lr=3e-3, warmup=30,
                                          eval_every=50)),
    "gpt-small-ne": (_GPT_SMALL_NE, TrainConfig(batch=6, seq_len=128, steps=300, lr=3e-3,
                                                warmup=30, eval_every=50)),
}  # fmt: skip

#: What DESIGN.md §2 promises (parameters including Engram tables); tested at +-10%.
PRESET_PARAMS = {
    "cpu": 5.3e6,
    "small": 9.5e6,
    "medium": 140e6,
    "b1": 1.07e9,
    "gpt-small": 9.5e6,
    "gpt-small-ne": 5.1e6,
}


def preset_names() -> list[str]:
    return list(_PRESETS)


def preset(name: str) -> RunConfig:
    if name not in _PRESETS:
        raise ConfigError(
            f"unknown preset {name!r}; choose one of {', '.join(_PRESETS)}"
            + _suggest(name, list(_PRESETS))
        )
    m, t = _PRESETS[name]
    return RunConfig(source=f"preset:{name}", model=m, train=t)


# ---- --set key=value ---------------------------------------------------------


def _field_owner() -> dict[str, str]:
    owner = {f.name: "model" for f in fields(ModelConfig)}
    for f in fields(TrainConfig):
        assert f.name not in owner, f"field name {f.name} used twice"
        owner[f.name] = "train"
    return owner


def _suggest(key: str, options: list[str]) -> str:
    near = difflib.get_close_matches(key, options, n=1, cutoff=0.5)
    return f" (did you mean {near[0]!r}?)" if near else ""


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def parse_value(tp, text: str, key: str):
    """Turn the text of `--set key=text` into the field's declared type."""
    origin = typing.get_origin(tp)
    try:
        if tp is bool:
            low = text.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError(f"expected one of {sorted(_TRUE | _FALSE)}")
        if tp is int:
            return int(text, 0)
        if tp is float:
            if key.rsplit(".", 1)[-1] == "dropout" and text.strip().lower() == "auto":
                return DROPOUT_AUTO
            return float(text)
        if origin is Literal and bool in {type(a) for a in typing.get_args(tp)}:
            low = text.strip().lower()  # compile=auto|true|false: a word or a bool
            return True if low in _TRUE else False if low in _FALSE else text.strip()
        if tp is str or origin is Literal:  # validate() checks a Literal's value
            return text
        if origin is tuple:
            (inner, *_rest) = typing.get_args(tp)
            # spaces around an item go, those inside stay: `data=my file.txt` is one path
            parts = [p.strip() for p in text.strip().strip("()[]").split(",") if p.strip()]
            return tuple(parse_value(inner, p, key) for p in parts)
    except ValueError as e:
        raise ConfigError(f"--set {key}={text!r}: not a valid {_tname(tp)} ({e})") from None
    raise ConfigError(f"--set {key}: fields of type {tp} cannot be set from the command line")


def _tname(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def apply_sets(run: RunConfig, sets: list[str] | tuple[str, ...]) -> RunConfig:
    """Apply `key=value` overrides. The key is a field's name (`lr`), or that name under its
    owner: `model.k`, `train.k`, a training part's `PART.k` or `train.PART.k` (`optim.lr`)."""
    owner = _field_owner()
    hints = {
        "model": typing.get_type_hints(ModelConfig),
        "train": typing.get_type_hints(TrainConfig),
    }
    new = {"model": {}, "train": {}}
    for item in sets:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, _, text = item.partition("=")
        key = key.strip()
        bare = _owned_key(key, owner)
        where = owner[bare]
        new[where][bare] = parse_value(hints[where][bare], text, key)
    return RunConfig(
        source=run.source,
        model=replace(run.model, **new["model"]),
        train=replace(run.train, **new["train"]),
    )


def _owned_key(key: str, owner: dict[str, str]) -> str:
    """The field a `--set` key names, refusing a prefix that does not own it."""
    prefix, _, bare = key.rpartition(".")
    if prefix.startswith("train."):
        prefix = prefix[len("train.") :]
    if prefix and prefix not in ("model", "train") and prefix not in PARTS:
        raise ConfigError(
            f"--set {key}: prefix must be 'model.', 'train.' or a part of the "
            f"training config ({', '.join(p + '.' for p in PARTS)})"
        )
    if bare not in owner:
        raise ConfigError(f"--set: unknown key {key!r}" + _suggest(bare, sorted(owner)))
    part = _PART_OF.get(bare)
    if prefix in PARTS and part != prefix:
        where = f"{part}.{bare}" if part else f"model.{bare}"
        raise ConfigError(f"--set {key}: {bare} is not in {prefix}; it is {where}")
    if prefix in ("model", "train") and owner[bare] != prefix:
        raise ConfigError(f"--set: unknown key {key!r}" + _suggest(bare, sorted(owner)))
    return bare


def asked_differences(saved: RunConfig, asked: RunConfig) -> list[str]:
    """`field old -> new` for each field where `asked` (a run as the user gave it, `auto`s
    unresolved) differs from `saved` (a run as it trained, its `auto`s resolved on the machine
    that trained it). A field the user left on auto matches any resolution of it."""
    out = []
    for part in ("model", "train"):
        a, b = dataclasses.asdict(getattr(saved, part)), dataclasses.asdict(getattr(asked, part))
        for k in a:
            auto = b[k] == "auto" or (k == "dropout" and b[k] == DROPOUT_AUTO)
            if a[k] != b[k] and not auto:
                out.append(f"{k} {a[k]!r} -> {b[k]!r}")
    return out


# ---- validation ----------------------------------------------------------------

#: Every field with a fixed set of values: its Literal annotation, stated once.
CHOICES = {
    name: typing.get_args(tp)
    for cls in (ModelConfig, TrainConfig)
    for name, tp in typing.get_type_hints(cls).items()
    if typing.get_origin(tp) is Literal
}
#: A training field's part: `lr` -> "optim".
_PART_OF = {f.name: name for name, cls in PARTS.items() for f in fields(cls)}

#: Devices a run may name: what `torch.device` accepts and dormouse runs on.
_DEVICE = re.compile(r"(auto|cpu|cuda(:[0-9]+)?)\Z")
#: Every model integer stays below this (16.7M): far beyond any preset (b1's largest is
#: engram_rows=393216), and small enough that no tensor's element count overflows int64.
_SHAPE_MAX = 2**24
#: The longest dist_timeout (7 days, in seconds): longer is no timeout at all, and past
#: ~1e14 s Python's timedelta overflows.
_DIST_TIMEOUT_MAX = 7 * 24 * 3600
#: The largest weight a run may ask for, in elements (4 TiB in fp32): no card holds it.
_TENSOR_MAX = 2**40
#: The most parameters a model may have, in elements (68.7B, 256 GiB in fp32: 69x b1, beyond
#: the memory of any one machine dormouse trains on); a depth of 10^6 tiny layers passed every
#: per-tensor bound and ran the build out of memory.
_MODEL_MAX = 2**36


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


def validate(run: RunConfig) -> RunConfig:
    """Refuse impossible combinations; return the run unchanged when it is sound: the model's
    rules, each training part's, then those that read the model and the training both."""
    m, t = run.model, run.train
    m.check()
    t.check()
    if t.seq_len > m.max_seq_len:
        raise ConfigError(
            f"seq_len={t.seq_len} exceeds the model's max_seq_len={m.max_seq_len}; "
            f"lower --set seq_len or raise --set max_seq_len"
        )
    if m.segment_len and t.seq_len % m.segment_len:
        raise ConfigError(
            f"segment_len={m.segment_len} does not divide seq_len={t.seq_len}; segments must "
            f"tile the window: pick a divisor of {t.seq_len} or segment_len=0 (whole window)"
        )
    return run
