"""The --fit memory planner: a stated memory model, the mechanism ladder, the one-line report.

Owns `estimate` (bytes per component for a run at batch x seq), `plan_fit` (engage the
memory mechanisms cheapest first until the estimate fits FIT_HEADROOM of the budget, else
a loud `FitError`), `format_fit_line`, and the two entry points: `main_plan` for
`python -m dormouse plan PRESET --fit GB [--batch B --seq T]` and `apply_fit` for
`train --fit GB`. Nothing here allocates a tensor: the parameter split is read from
`route_params` on a META-device model. The model, its phases, the activation constants and
how they were measured: docs/fit.md; `python -m dormouse bench memory` checks it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import math
from dataclasses import dataclass, replace

import torch

from ...config import RunConfig, preset, preset_names, validate
from ...errors import UserError
from ...model import arms
from ...model.arms import Arm, card_of, choose_arm
from ..context import accumulate
from ..optim.quant import BLOCK

log = logging.getLogger(__name__)

GiB = 1 << 30
#: The plan must fit this fraction of the stated budget (the rest: CUDA context, allocator
#: fragmentation, kernel workspaces the model does not count).
FIT_HEADROOM = 0.90

# ---- the activation constants (bytes per token x d_model per block application) ------
#: Calibration hook: multiplies every activation term. 1.0 = the CPU saved-tensor count.
ACT_SCALE = 1.0
#: Extra blocks' worth of activations alive while one block is differentiated. First set
#: to 1.0 by reasoning; the H200 measurement (torch KDA arm, small/medium/b1 at 8 x 512,
#: with and without act_ckpt) put it at 0.5: with 1.0 the checkpointed plans were
#: over-estimated by 11-22%, with 0.5 every measured plan came within 6%.
BACKWARD_WORKSET = 0.5
#: (half precision, fp32) per part; what each part holds: docs/fit.md.
ACT_MIXER_PROJ = (60.0, 70.0)
ACT_KDA_FLA = (24.0, 28.0)
ACT_KDA_TORCH = (215.0, 205.0)  # at kda_chunk=16; scales with the chunk length
ACT_REST = (25.0, 22.0)
#: routed expert pass per token per assignment: (bytes x d_model, bytes x d_ffn)
ACT_ROUTED = ((7.0, 8.0), (10.0, 16.0))
#: act_ckpt: each application's input h, kept in the fp32 residual dtype (bf16 if quantized)
ACT_CKPT_INPUT = (4.0, 2.0)

#: Bytes of Muon's momentum per value, by muon_state_dtype. int8: the code and one fp32 absmax
#: per BLOCK (256) values (train/optim/quant.py). A parameter's last block is padded, up to 255 B a
#: tensor more; every preset's Muon tensors are multiples of 256 values, so none is padded.
MUON_STATE_BYTES = {"fp32": 4, "bf16": 2, "int8": 1 + 4 / BLOCK}
#: Bytes of the two Adam moments of one Engram table value, by engram_state_dtype.
ENGRAM_MOMENT_BYTES = {"fp32": 8, "bf16": 4, "int8": 2}
#: Bytes per Engram table row beside the moments: its int32 step count, and for int8 the two
#: moments' fp32 scales (a block is one row: train/optim/rowadam.py `row_state`).
ENGRAM_ROW_BYTES = {"fp32": 4, "bf16": 4, "int8": 12}

#: The ladder, cheapest first: (name, config field, value that engages it, its default).
MECHANISMS: tuple[tuple[str, str, object, object], ...] = (
    ("moe_offload", "moe_offload", True, False),
    ("engram_ram", "engram_ram", True, False),
    ("muon_state_dtype=bf16", "muon_state_dtype", "bf16", "fp32"),
    ("engram_state_dtype=bf16", "engram_state_dtype", "bf16", "fp32"),
    # the int8 rungs supersede the bf16 ones of the same field; released, they go back to it
    ("muon_state_dtype=int8", "muon_state_dtype", "int8", "bf16"),
    ("engram_state_dtype=int8", "engram_state_dtype", "int8", "bf16"),
    ("optim_8bit", "optim_8bit", True, False),
    ("act_ckpt", "act_ckpt", True, False),
)
MECHANISM_NAMES = tuple(m[0] for m in MECHANISMS)


class FitError(UserError, ValueError):
    """The run cannot fit the stated budget; the message names every component and the escapes."""


@dataclass(frozen=True)
class ParamSplit:
    """Parameter counts read from the optimizer's routing on a meta build (tables on device)."""

    total: int
    muon: int
    adamw: int
    engram: int
    expert: int  # routed expert stacks (moe.w1/w2/w3)
    body: int  # everything under `blocks.` (the looped body)
    matrices: int  # 2-D weights autocast casts once (all matrices but the embedding/router)
    muon_groups: tuple[tuple[tuple[int, int], int], ...]  # ((rows, cols), elements), largest first
    #: (name, owner, shape) of every parameter, in module order: what FSDP2 shards per tensor
    shapes: tuple[tuple[str, str, tuple[int, ...]], ...] = ()


@dataclass(frozen=True)
class Estimate:
    """Bytes per component of one training step's device memory, and how they combine."""

    masters: int
    grads: int
    adamw: int
    muon: int
    engram: int  # the Engram tables' Adam moments
    casts: int
    act: int  # saved activations + the backward working set
    opt_work: int
    # the phases (docs/fit.md); total = max of the three
    backward: int
    midpoint: int
    step: int
    # context, for the report
    params: int
    tokens: int
    k_act: float  # bytes per token x d_model per block application
    apps: int
    arm: str
    arm_reason: str
    half: bool
    notes: tuple[str, ...] = ()
    #: the data-parallel reducer's own buffers during forward and backward (DDP: its gradient
    #: buckets and the comm hook's half copies; FSDP2: the all-gathered units and the
    #: reduce-scatter buffers); `comm_step` is what of it is still alive in the step
    comm: int = 0
    comm_step: int = 0
    world: int = 1
    shard: str = "none"  # as planned: "none" is DDP on a fleet, one process at world 1

    @property
    def resident(self) -> int:
        return self.masters + self.adamw + self.muon + self.engram

    @property
    def total(self) -> int:
        return max(self.backward, self.midpoint, self.step)

    @property
    def phase(self) -> str:
        """Which moment of the step sets the peak."""
        return max(
            ("backward", self.backward),
            ("midpoint", self.midpoint),
            ("step", self.step),
            key=lambda kv: kv[1],
        )[0]

    def components(self) -> dict[str, int]:
        return {
            "masters": self.masters,
            "grads": self.grads,
            "adamw": self.adamw,
            "muon": self.muon,
            "engram": self.engram,
            "casts": self.casts,
            "act": self.act,
            "opt_work": self.opt_work,
            "buffers": self.comm,
        }


# ---- reading the model (meta device) --------------------------------------------------

_SPLITS: dict[tuple, ParamSplit] = {}


def param_split(run: RunConfig) -> ParamSplit:
    """Route the parameters of `run`'s model, built on the meta device (no memory).

    Always built with the VRAM Engram store and no memory mechanism: parameters do not
    depend on them, and a host store would allocate its tables at construction.
    """
    from ...model import DormouseModel
    from ..optim.routing import route_params

    m = replace(
        run.model, engram_ram=False, moe_offload=False, act_ckpt=False, act_ckpt_quant=False
    )
    key = (dataclasses.astuple(m), run.train.opt)
    if key in _SPLITS:
        return _SPLITS[key]
    with torch.device("meta"):
        model = DormouseModel(m)
    routes = route_params(model, opt=run.train.opt)
    by_owner = {"muon": 0, "adamw": 0, "engram": 0}
    groups: dict[tuple[int, int], int] = {}
    expert = body = matrices = 0
    for r in routes:
        by_owner[r.owner] += r.numel
        if r.owner == "muon":
            groups[r.matrix] = groups.get(r.matrix, 0) + r.numel
        leaf = r.name.rsplit(".", 1)[-1]
        if ".moe." in f".{r.name}" and leaf in ("w1", "w2", "w3") and len(r.shape) == 3:
            expert += r.numel
        elif len(r.shape) == 2 and not r.name.startswith("embed.") and ".router." not in r.name:
            matrices += r.numel
        if r.name.startswith("blocks."):
            body += r.numel
    split = ParamSplit(
        total=sum(r.numel for r in routes),
        muon=by_owner["muon"],
        adamw=by_owner["adamw"],
        engram=by_owner["engram"],
        expert=expert,
        body=body,
        matrices=matrices,
        muon_groups=tuple(sorted(groups.items(), key=lambda kv: -kv[1])),
        shapes=tuple((r.name, r.owner, tuple(r.shape)) for r in routes),
    )
    _SPLITS[key] = split
    return split


def _planned_card(run: RunConfig):
    """(device or described card, compute dtype) the arm rule reads for the run's card (which
    card: docs/fit.md): a CUDA card described where this machine has none."""
    dev = run.train.device
    if dev != "cpu" and not torch.cuda.is_available():
        dev = replace(card_of("cpu"), type="cuda", name="the planned card")
    elif dev == "auto":
        dev = "cuda"
    return dev, torch.bfloat16 if half_compute(run) else torch.float32


def kda_arm(run: RunConfig) -> Arm:
    """The KDA arm the training run will use (what the activation term assumes): pinned as
    pinned, auto by the model's rule on the run's card."""
    m = run.model
    if m.kda_impl != "auto":
        return Arm(m.kda_impl, f"kda_impl={m.kda_impl} (pinned)")
    return choose_arm("kda", "auto", *_planned_card(run), {"head_dim": m.head_dim})


def moe_dense(run: RunConfig) -> bool:
    """Whether the run's MoE computes every expert on every token (`moe_impl=dense`, or auto
    where the model's rule takes it on the run's card): its activations then scale with
    n_experts, not moe_topk."""
    m = run.model
    if m.moe_impl != "auto":
        return m.moe_impl == "dense"
    return choose_arm("moe", "auto", *_planned_card(run), arms.moe_shape(m)).name == "dense"


def half_compute(run: RunConfig) -> bool:
    """Whether the forward computes in half precision (casts exist, saves are half width)."""
    return run.train.dtype != "fp32"


def act_bytes_per_token_d(run: RunConfig, arm: str, half: bool) -> tuple[float, float]:
    """(K, routed part of K): bytes one block application saves per token x d_model. An
    attention block (`attn_every`) is counted as a KDA block: not measured yet; SDPA saves
    q, k, v, its output and a log-sum-exp, less than the chunked recurrence, so it errs high."""
    m = run.model
    i = 0 if half else 1
    kernel = ACT_KDA_FLA[i] if arm == "fla" else ACT_KDA_TORCH[i] * m.kda_chunk / 16
    a_d, a_f = ACT_ROUTED[i]
    routed = m.moe_topk * (a_d * m.d_model + a_f * m.d_ffn) / m.d_model
    if moe_dense(run):  # no gathered copies of x; every expert's hidden units (not measured)
        routed = (a_d * m.d_model + m.n_experts * a_f * m.d_ffn) / m.d_model
    mixer = (ACT_MIXER_PROJ[i] + kernel) * m.d_attn / m.d_model
    k = mixer + routed + ACT_REST[i]
    return k * ACT_SCALE, routed * ACT_SCALE


def _muon_workspace(run: RunConfig, split: ParamSplit, lay: Layout | None = None) -> int:
    """Muon's step on its largest shape group: the elementwise part on this rank's elements,
    the polar on whole matrices (under FSDP2 gathered first: docs/fit.md, "Fleets")."""
    if not split.muon_groups:
        return 0
    t = run.train
    if lay is not None and lay.muon_group:
        (rows, cols), local, gathered, n = lay.muon_group
    else:
        (rows, cols), n = split.muon_groups[0]
        local, gathered = n, 0
    ns_half = t.ns_dtype == "bf16" or t.ns_dtype == "auto"  # auto -> bf16 on CUDA
    per_local = 8  # the fp32 gradient stack and the Nesterov blend
    if t.muon_state_dtype == "bf16":
        per_local += 4  # the momentum is widened to fp32 for the update
    # int8: the momentum dequantised to fp32 and its new codes (5 B) are freed before the
    # polar, whose workspace is larger, so they add nothing; the plain variant's update is a
    # copy of the fp32 momentum (the momentum is re-quantised in place), so it keeps its 4 B
    if t.muon_variant != "nesterov" and t.muon_state_dtype != "int8":
        per_local -= 4  # the update is the momentum itself: no blend tensor
    per_whole = 6 if ns_half else 8  # the polar's normalised input and its iterate
    s = min(rows, cols)
    gram = 2 * (n // (rows * cols)) * s * s * (2 if ns_half else 4)
    polar = per_whole * n + gram
    if gathered:
        # FSDP2 (muon._whole_matrices, fp32): while gathering, the padded pieces and the rows
        # sent (2 x local), the receive buffer (world x local) and the whole matrices cut out
        # of it (n); then the polar runs with those whole matrices alive beside it
        polar = max(4 * (2 * local + gathered + n), 4 * n + polar)
    return per_local * local + polar


@dataclass(frozen=True)
class Layout:
    """Parameter elements one rank holds on its card, and what FSDP2 gathers around them.

    One process and DDP: every tensor whole. FSDP2 (`fully_shard` per block + root, Shard(0)):
    each tensor's dim 0 in ceil(D0 / world) rows per rank (rank 0 always has the full chunk;
    FSDP2 pads every rank's shard storage to it), counted per tensor, so a [8, R, C] expert
    stack on 3 ranks is 3 experts a rank, not 8/3."""

    dev: int  # parameters on the card
    muon: int
    adamw: int
    engram: int  # the VRAM Engram tables (0 when engram_ram)
    engram_rows: int
    body: int  # the blocks' parameters (their grads fill in during the first backward pass)
    root_unit: int = 0  # FSDP2: elements of the root unit (everything outside the blocks)
    block_unit: int = 0  # FSDP2: elements of the largest block
    #: FSDP2: Muon's largest group as (matrix, local elements, gathered elements, whole elements)
    muon_group: tuple | None = None


def layout(split: ParamSplit, m, world: int = 1, shard: str = "none") -> Layout:
    """This rank's share of `split`'s parameters for model config `m` (see `Layout`)."""

    def numel(shape):
        return math.prod(shape)

    engram_ram = m.engram_ram
    if world == 1 or shard != "fsdp":
        eng = 0 if engram_ram else split.engram
        return Layout(
            dev=split.total - split.engram + eng,
            muon=split.muon,
            adamw=split.adamw,
            engram=eng,
            engram_rows=eng // m.engram_dim,
            body=split.body,
        )
    if not split.shapes:
        raise ValueError("an FSDP2 layout needs the parameter shapes (param_split's `shapes`)")

    def local(shape):
        return -(-shape[0] // world) * numel(shape[1:])

    own = {"muon": 0, "adamw": 0, "engram": 0}
    rows = body = root = 0
    blocks: dict[str, int] = {}
    groups: dict[tuple[int, int], list[int]] = {}
    for name, owner, shape in split.shapes:
        if owner == "engram" and engram_ram:
            continue
        n = local(shape)
        own[owner] += n
        if owner == "engram":
            rows += n // shape[-1]
        if owner == "muon":
            g = groups.setdefault((shape[-2], shape[-1]), [0, 0, 0])
            g[0] += n
            g[1] += world * n
            g[2] += numel(shape)
        if name.startswith("blocks."):
            body += n
            unit = name.split(".")[1]
            blocks[unit] = blocks.get(unit, 0) + numel(shape)
        else:
            root += numel(shape)
    group = max(groups.items(), key=lambda kv: kv[1][2]) if groups else None
    return Layout(
        dev=sum(own.values()),
        muon=own["muon"],
        adamw=own["adamw"],
        engram=own["engram"],
        engram_rows=rows,
        body=body,
        root_unit=root,
        block_unit=max(blocks.values(), default=0),
        muon_group=(group[0], *group[1]) if group else None,
    )


def reduce_bytes(run: RunConfig) -> int:
    """Bytes per element of the fleet's gradient reduction: dist_reduce, auto = the compute
    dtype (fleet.join's rule; the plan assumes every rank computes as `half_compute` says)."""
    r = run.train.dist_reduce
    if r == "auto":
        return 2 if half_compute(run) else 4
    return 4 if r == "fp32" else 2


def _comm(run: RunConfig, lay: Layout, world: int, shard: str) -> tuple[int, int]:
    """(the reducer's buffers during forward/backward, those still alive in the step)."""
    if world == 1:
        return 0, 0
    red = reduce_bytes(run)
    if shard != "fsdp":
        # DDP (gradient_as_bucket_view off, torch's default) keeps a flat fp32 copy of every
        # gradient in its buckets, whatever bucket_mb says (it sets how they are cut), for the
        # whole run; the half-precision comm hook adds a reduced copy of each bucket until its
        # all-reduce completes: counted for all buckets (on nccl they are in flight together).
        buckets = 4 * lay.dev
        return buckets + (red * lay.dev if red < 4 else 0), buckets
    # FSDP2: the root unit stays gathered from forward to the end of backward (torch does not
    # reshard the root after forward); a block is gathered for its forward and again for its
    # backward, with the next one prefetched (2 blocks); the reduce-scatter takes the
    # largest unit's unsharded gradient (in the param dtype), its copy in the reduce dtype and
    # the sharded result. Param dtype: bf16 when the run computes in bf16 (parallelize._fsdp).
    pb = 2 if half_compute(run) and run.train.dtype != "fp16" else 4
    gathered = pb * (lay.root_unit + 2 * lay.block_unit)
    unit = max(lay.root_unit, lay.block_unit)
    scatter = (pb + red) * unit + red * -(-unit // world)
    return gathered + scatter, 0


# ---- the estimate ---------------------------------------------------------------------


SHARDS = ("none", "fsdp")


def muon_state_bytes(dtype: str, values: int) -> int:
    """Bytes of Muon's momentum over `values` values (int8: codes + a scale per block)."""
    if dtype == "int8":
        return values + 4 * -(-values // BLOCK)
    return MUON_STATE_BYTES[dtype] * values


def engram_state_bytes(dtype: str, values: int, rows: int) -> int:
    """Bytes of the Engram tables' row-sparse Adam state: both moments and the per-row terms."""
    return ENGRAM_MOMENT_BYTES[dtype] * values + ENGRAM_ROW_BYTES[dtype] * rows


def estimate(
    run: RunConfig,
    batch: int | None = None,
    seq: int | None = None,
    *,
    world: int = 1,
    shard: str = "none",
) -> Estimate:
    """Device bytes of one steady-state training step of `run` at batch x seq on ONE rank of
    a fleet of `world` (shard "none": DDP, "fsdp": FSDP2; at world 1 one process, whatever
    `shard` says, as `parallelize` does). batch is the rank's micro-batch. See docs/fit.md."""
    m, t = run.model, run.train
    if shard not in SHARDS:
        raise FitError(
            f"--shard {shard!r} is not one of {', '.join(SHARDS)} (none = DDP, every "
            f"rank holds the whole model; fsdp = FSDP2, each rank 1/world of it)"
        )
    if not isinstance(world, int) or world < 1:
        raise FitError(f"--world {world!r}: a fleet has at least one rank; give an integer >= 1")
    batch = t.batch if batch is None else batch
    seq = t.seq_len if seq is None else seq
    split = param_split(run)
    arm, arm_reason = kda_arm(run)
    half = half_compute(run)
    fsdp = world > 1 and shard == "fsdp"
    lay = layout(split, m, world, shard)

    # Host-RAM Engram tables (engram_ram) live in host memory: not in the layout's `dev`.
    masters = 4 * lay.dev
    grads = 4 * lay.dev
    adamw = (2 if t.optim_8bit else 8) * lay.adamw
    muon = muon_state_bytes(t.muon_state_dtype, lay.muon)
    # The Engram group is dormouse's own row-sparse Adam (m and v in engram_state_dtype,
    # whatever optim_8bit says) plus one int32 step count per row (and int8's row scales).
    engram = engram_state_bytes(t.engram_state_dtype, lay.engram, lay.engram_rows)

    apps = m.n_layers * m.max_iter
    tokens = batch * seq
    td = tokens * m.d_model
    k_full, routed = act_bytes_per_token_d(run, arm, half)
    k = k_full - routed if m.moe_offload else k_full

    # Under FSDP2 with bf16 params the gathered weights are already bf16: autocast and the
    # experts' .to(bf16) cast nothing (the gathered units are counted in `comm` instead).
    cast_free = fsdp and half and t.dtype != "fp16"
    expert_casts = 2 * split.expert * m.max_iter if half and not cast_free else 0
    one_block_experts = 2 * split.expert // m.n_layers if half and not cast_free else 0
    matrix_casts = 2 * split.matrices if half and not cast_free else 0
    if m.act_ckpt:
        # The body keeps each application's input; backward recomputes one block at a time.
        inp = ACT_CKPT_INPUT[1 if m.act_ckpt_quant else 0]  # exact: a stored tensor, not a count
        saved = inp * td * apps
        work = k * td * (1 + BACKWARD_WORKSET)
        casts = matrix_casts + one_block_experts
    else:
        saved = k * td * apps
        work = k * td * BACKWARD_WORKSET
        casts = matrix_casts + (one_block_experts if m.moe_offload else expert_casts)
    saved, work, casts = int(saved), int(work), int(casts)
    act = saved + work
    opt_work = _muon_workspace(run, split, lay if fsdp else None)
    comm, comm_step = _comm(run, lay, world, shard)

    resident = masters + adamw + muon + engram
    keep = 1 - 1 / m.max_iter
    backward = resident + casts + act + comm
    midpoint = resident + int((casts + saved) * keep) + work + 4 * lay.body + comm
    step = resident + grads + opt_work + comm_step
    return Estimate(
        masters=masters,
        grads=grads,
        adamw=adamw,
        muon=muon,
        engram=engram,
        casts=casts,
        act=act,
        opt_work=opt_work,
        backward=backward,
        midpoint=midpoint,
        step=step,
        params=lay.dev,
        tokens=tokens,
        k_act=k,
        apps=apps,
        arm=arm,
        arm_reason=arm_reason,
        half=half,
        comm=comm,
        comm_step=comm_step,
        world=world,
        shard=shard,
    )


def max_share(run: RunConfig, usable_bytes: int, *, world: int, shard: str) -> int:
    """The largest micro-batch (windows of run.train.seq_len, in one forward) one rank of a
    fleet of `world` can run within `usable_bytes` with the run's mechanisms as they are; 0
    when not even one window fits. A rank takes any multiple of it by accumulation at the
    same peak. (Named for its use: capping a mixed fleet's shares by each card's memory.)"""

    def fits(b: int) -> bool:
        return estimate(run, b, world=world, shard=shard).total <= usable_bytes

    if not fits(1):
        return 0
    lo, hi = 1, 2
    while fits(hi):  # activations grow with every window: this ends
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


# ---- the plan -------------------------------------------------------------------------


def _mechanism(name: str) -> tuple[str, object, object]:
    for n, key, on, off in MECHANISMS:
        if n == name:
            return key, on, off
    raise KeyError(f"unknown mechanism {name!r}; known: {', '.join(MECHANISM_NAMES)}")


def _set(run: RunConfig, key: str, value) -> RunConfig:
    if hasattr(run.model, key):
        return replace(run, model=replace(run.model, **{key: value}))
    return replace(run, train=replace(run.train, **{key: value}))


def _superseded(run: RunConfig, name: str) -> bool:
    """Whether a later rung of the same field is on (int8 state beyond the bf16 rung)."""
    key = _mechanism(name)[0]
    later = MECHANISM_NAMES[MECHANISM_NAMES.index(name) + 1 :]
    return any(_mechanism(n)[0] == key and mechanism_on(run, n) for n in later)


def mechanism_on(run: RunConfig, name: str) -> bool:
    if name == "accumulation":  # the global batch in more than one micro-batch a step
        return run.train.global_batch > run.train.batch
    key, on, _ = _mechanism(name)
    return getattr(run.model if hasattr(run.model, key) else run.train, key) == on


def engage(run: RunConfig, name: str) -> RunConfig:
    """`run` with mechanism `name` switched on."""
    key, on, _ = _mechanism(name)
    return _set(run, key, on)


def disengage(run: RunConfig, name: str) -> RunConfig:
    """`run` with mechanism `name` back at its default."""
    key, _, off = _mechanism(name)
    return _set(run, key, off)


def unavailable(name: str, run: RunConfig | None = None, world: int = 1) -> str | None:
    """Why mechanism `name` cannot be engaged on this machine (or on `run`'s fleet), or None."""
    if name == "optim_8bit" and importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed (pip install bitsandbytes; CUDA only)"
    if name == "optim_8bit" and run is not None and world > 1 and run.train.dist_shard == "fsdp":
        return (
            "bitsandbytes' AdamW8bit steps plain tensors, not FSDP2's shards (the fleet refuses it)"
        )
    if name.endswith("=int8") and run is not None and world > 1 and run.train.dist_shard == "fsdp":
        return "int8 optimizer state is not implemented for FSDP2's shards (the fleet refuses it)"
    return None


def _est(run: RunConfig, world: int) -> Estimate:
    """The estimate the planner works with: one rank of `world`, sharded as the run says."""
    return estimate(run, world=world, shard=run.train.dist_shard)


def usable_bytes(budget_gb: float) -> int:
    return int(budget_gb * GiB * FIT_HEADROOM)


def _with_shape(run: RunConfig, batch: int | None, seq: int | None) -> RunConfig:
    sets = {}
    if batch is not None:
        sets["batch"] = batch
    if seq is not None:
        sets["seq_len"] = seq
    return replace(run, train=replace(run.train, **sets)) if sets else run


def ladder(run: RunConfig, usable: int, world: int = 1) -> tuple[RunConfig, Estimate, list[str]]:
    """Engage mechanisms cheapest first while the estimate exceeds `usable` bytes.

    Never raises: returns the best plan found (every available mechanism that helps) even
    when it does not fit; skipped and released mechanisms are in the estimate's notes.
    """
    est = _est(run, world)
    engaged: list[str] = []
    notes: list[str] = []
    for name in MECHANISM_NAMES:
        if est.total <= usable:
            break
        if name in LOSSY and "accumulation" not in engaged:
            # exact: the same global batch in smaller micro-batches, before any lossy rung
            cand = _accumulated(run, usable, world)
            if cand is not None:
                e2 = _est(cand, world)
                if e2.total < est.total:
                    run, est = cand, e2
                    engaged.append("accumulation")
                    if est.total <= usable:
                        break
        if mechanism_on(run, name) or _superseded(run, name):
            continue
        why = unavailable(name, run, world)
        if why:
            notes.append(f"{name} skipped: {why}")
            continue
        cand = engage(run, name)
        e2 = _est(cand, world)
        if e2.total >= est.total:
            notes.append(
                f"{name} skipped: no gain ({_g(est.total)} -> {_g(e2.total)} GiB; "
                f"the peak is the {est.phase} phase)"
            )
            continue
        run, est = cand, e2
        # an int8 rung replaces the bf16 rung of its field (releasing it goes back to bf16)
        field = _mechanism(name)[0]
        engaged = [n for n in engaged if n == "accumulation" or _mechanism(n)[0] != field]
        engaged.append(name)
    # A later rung can move the peak to another phase, where an earlier rung no longer
    # helps (bf16 Muon momentum shrinks the resident state but widens the step's
    # workspace): release whatever the final plan does not need.
    for name in [n for n in engaged if n != "accumulation"]:
        cand = disengage(run, name)
        e2 = _est(cand, world)
        if e2.total <= est.total:
            run, est = cand, e2
            engaged.remove(name)
            notes.append(f"{name} released: no gain once the peak is the {est.phase} phase")
    if "accumulation" in engaged and est.total <= usable:
        run = _grown(run, usable, world)
        est = _est(run, world)
        t = run.train
        notes.append(f"accumulation: global_batch {t.global_batch} as micro-batches of {t.batch}")
    return run, replace(est, notes=tuple(notes)), engaged


#: Rungs that change the arithmetic (rounded optimizer state): accumulation comes first.
LOSSY = (
    "muon_state_dtype=bf16",
    "engram_state_dtype=bf16",
    "muon_state_dtype=int8",
    "engram_state_dtype=int8",
    "optim_8bit",
)


def _accumulated(run: RunConfig, usable: int, world: int) -> RunConfig | None:
    """The run with each rank's share of the global batch taken in the largest micro-batch
    that fits (a divisor of the share), or in micro-batches of 1 window when none does; None
    when there is no smaller micro-batch (or the global batch does not split evenly)."""
    t = run.train
    total = t.global_batch or t.batch * world
    share = total // world if total % world == 0 else 0
    sizes = [b for b in range(min(t.batch, share) - 1, 0, -1) if share % b == 0]
    if not sizes:
        return None
    cands = [replace(run, train=replace(t, batch=b, global_batch=total)) for b in sizes]
    return next((c for c in cands if _est(c, world).total <= usable), cands[-1])


def _grown(run: RunConfig, usable: int, world: int) -> RunConfig:
    """The largest micro-batch (a divisor of the share) that still fits with the rungs the
    plan engaged after accumulation."""
    t = run.train
    share = t.global_batch // world
    for b in range(share, t.batch, -1):
        cand = replace(run, train=replace(t, batch=b))
        if share % b == 0 and _est(cand, world).total <= usable:
            return cand
    return run


def plan_fit(
    run: RunConfig,
    budget_gb: float,
    batch: int | None = None,
    seq: int | None = None,
    world: int = 1,
) -> tuple[RunConfig, Estimate, list[str]]:
    """(run with mechanisms set, its estimate, mechanisms engaged) that fits FIT_HEADROOM of
    `budget_gb`; raises FitError naming every component when even all mechanisms do not."""
    if not budget_gb > 0:
        raise FitError(f"--fit {budget_gb}: the budget must be a positive number of GB")
    run = validate(_with_shape(run, batch, seq))
    usable = usable_bytes(budget_gb)
    planned, est, engaged = ladder(run, usable, world)
    if est.total <= usable:
        return planned, est, engaged
    raise FitError(_no_fit_message(run, planned, est, engaged, budget_gb, world))


def _no_fit_message(run, planned, est, engaged, budget_gb, world=1, who="") -> str:
    usable = usable_bytes(budget_gb)
    t = run.train
    on = [n for n in MECHANISM_NAMES if mechanism_on(planned, n)]
    comps = " ".join(f"{k}={_g(v)}" for k, v in est.components().items())
    escapes = []
    b = _largest_batch(run, usable, world)
    if b:
        at_b = ladder(_with_shape(run, b, None), usable, world)[1].total
        escapes.append(f"--batch {b} (est {_g(at_b)} GiB)")
    else:
        escapes.append(
            "no batch size fits at this seq_len (the terms that do not scale with "
            "tokens already exceed it)"
        )
    s = _largest_seq(run, usable, world)
    if s:
        escapes.append(f"--seq {s}")
    if world > 1 and t.dist_shard != "fsdp":
        sharded = _set(run, "dist_shard", "fsdp")
        at = ladder(sharded, usable, world)[1].total
        if at <= usable:
            escapes.append(f"--shard fsdp (est {_g(at)} GiB a rank)")
    smaller = _smaller_preset(run, usable, world)
    if smaller:
        escapes.append(f"a smaller preset ({smaller})")
    need = math.ceil(est.total / FIT_HEADROOM / GiB)
    escapes.append(f"a card of >= {need} GB")
    fleet = (
        f" on {who or 'each rank'} of a fleet of {world} "
        f"({'FSDP2' if t.dist_shard == 'fsdp' else 'DDP'})"
        if world > 1
        else ""
    )
    return (
        f"--fit {budget_gb:g}GB: {run.source} at batch {t.batch} x seq {t.seq_len}{fleet} does "
        f"not fit. "
        f"Usable {_g(usable)} GiB ({FIT_HEADROOM:.0%} of {budget_gb:g} GiB); estimated peak "
        f"{_g(est.total)} GiB ({est.phase} phase) with every mechanism that lowers it "
        f"({', '.join(on) or 'none'}). Components in GiB: {comps} "
        f"[kda={est.arm}, K={est.k_act:.0f} B/(token x d_model) x {est.apps} applications"
        f"{'; ' + '; '.join(est.notes) if est.notes else ''}]. "
        f"Escapes: {'; '.join(escapes)}"
    )


def _fits(run: RunConfig, usable: int, world: int = 1) -> bool:
    return ladder(run, usable, world)[1].total <= usable


def _largest_batch(run: RunConfig, usable: int, world: int = 1) -> int:
    lo = 0
    b = run.train.batch - 1
    while b >= 1:
        if _fits(_with_shape(run, b, None), usable, world):
            lo = b
            break
        b = b // 2 if b > 8 else b - 1
    return lo


def _largest_seq(run: RunConfig, usable: int, world: int = 1) -> int:
    s = run.train.seq_len // 2
    while s >= 16:
        if _fits(_with_shape(run, None, s), usable, world):
            return s
        s //= 2
    return 0


def _smaller_preset(run: RunConfig, usable: int, world: int = 1) -> str | None:
    """The largest preset (by parameters) that fits at this batch x seq, if any other does."""
    best = None
    for name in preset_names():
        cand = preset(name)
        if name == "tiny" or cand.model == run.model:
            continue
        if run.train.seq_len > cand.model.max_seq_len:
            continue
        cand = _with_shape(cand, run.train.batch, run.train.seq_len)
        cand = _set(cand, "dist_shard", run.train.dist_shard)
        split = param_split(cand)
        if split.total >= param_split(run).total:
            continue
        if _fits(cand, usable, world) and (best is None or split.total > best[1]):
            best = (name, split.total)
    return best[0] if best else None


# ---- reporting --------------------------------------------------------------------------


def _g(n: int | float) -> str:
    return f"{n / GiB:.2f}"


def format_fit_line(budget_gb: float, est: Estimate, engaged: list[str]) -> str:
    """The one line both `plan --fit` and `train --fit` print."""
    comps = " ".join(f"{k}={_g(v)}" for k, v in est.components().items())
    return (
        f"fit={budget_gb:g}GB usable={_g(usable_bytes(budget_gb))}GiB "
        f"est_peak={_g(est.total)}GiB ({est.phase}) engaged={','.join(engaged) or 'none'} "
        f"({comps} GiB; kda={est.arm} K={est.k_act:.0f}B tokens={est.tokens}"
        + (
            f"; a rank of {est.world}, {'FSDP2' if est.shard == 'fsdp' else 'DDP'})"
            if est.world > 1
            else ")"
        )
    )


def format_arithmetic(run: RunConfig, est: Estimate) -> list[str]:
    """The estimate's arithmetic, one component a line."""
    m, t = run.model, run.train
    split = param_split(run)
    M = 1e6
    td = est.tokens * m.d_model
    # the counts the estimate multiplies: one rank's (its shards under FSDP2)
    lay = layout(split, m, est.world, est.shard)
    ed = t.engram_state_dtype
    per_value, per_row = ENGRAM_MOMENT_BYTES[ed], ENGRAM_ROW_BYTES[ed]
    if m.engram_ram:
        rows = split.engram // m.engram_dim
        host = engram_state_bytes(ed, split.engram, rows)
        eng = (
            f"0 on the card (host RAM: {per_value} B x {split.engram / M:.2f}M + {per_row} B "
            f"x {rows / M:.2f}M rows = {_g(host)} GiB)"
        )
    else:
        eng = (
            f"{per_value} B x {lay.engram / M:.2f}M + {per_row} B x {lay.engram_rows / M:.2f}M rows"
        )
    muon_b = (
        f"(1 B + 4 B / {BLOCK})"
        if t.muon_state_dtype == "int8"
        else (f"{MUON_STATE_BYTES[t.muon_state_dtype]} B")
    )
    lines = [
        f"{run.source}: {split.total / M:.2f}M parameters (muon {split.muon / M:.2f}M, "
        f"adamw {split.adamw / M:.2f}M, engram tables {split.engram / M:.2f}M"
        f"{' in host RAM' if m.engram_ram else ''}), batch {t.batch} x seq {t.seq_len} = "
        f"{est.tokens} tokens, compute {'half' if est.half else 'fp32'}, kda={est.arm} "
        f"({est.arm_reason})",
        f"  masters  4 B x {est.params / M:.2f}M = {_g(est.masters)} GiB",
        f"  grads    4 B x {est.params / M:.2f}M = {_g(est.grads)} GiB",
        f"  adamw    {2 if t.optim_8bit else 8} B x {lay.adamw / M:.2f}M = {_g(est.adamw)} GiB",
        f"  muon     {muon_b} x {lay.muon / M:.2f}M = {_g(est.muon)} GiB",
        f"  engram   {eng} = {_g(est.engram)} GiB",
        f"  casts    {_g(est.casts)} GiB (half-precision weight copies autograd keeps"
        f"{'' if est.half else '; none in fp32'})",
        f"  act      K={est.k_act:.0f} B x {est.tokens} tokens x {m.d_model} d_model x "
        + (
            f"{est.apps} applications + block inputs (act_ckpt)"
            if m.act_ckpt
            else f"({est.apps} applications + {BACKWARD_WORKSET:g} working)"
        )
        + f" = {_g(est.act)} GiB  [{td * est.apps / M:.0f}M token x d_model x applications]",
        f"  opt_work {_g(est.opt_work)} GiB (Muon's polar on its largest shape group"
        f"{' ' + 'x'.join(map(str, split.muon_groups[0][0])) if split.muon_groups else ''})",
        *([_buffers_line(run, est)] if est.world > 1 else []),
        f"  peak = max(backward {_g(est.backward)}, midpoint {_g(est.midpoint)}, "
        f"step {_g(est.step)}) = {_g(est.total)} GiB",
    ]
    lines += [f"  note: {n}" for n in est.notes]
    return lines


def _buffers_line(run: RunConfig, est: Estimate) -> str:
    if est.shard == "fsdp":
        return (
            f"  buffers  {_g(est.comm)} GiB in forward/backward (FSDP2: the root unit gathered "
            f"throughout, two blocks gathered (one prefetched), the largest unit's "
            f"reduce-scatter); masters, grads and optimizer state are this rank's shards of "
            f"a fleet of {est.world}"
        )
    return (
        f"  buffers  {_g(est.comm)} GiB in forward/backward, {_g(est.comm_step)} GiB in the "
        f"step (DDP: its gradient buckets, a flat fp32 copy of every gradient"
        f"{', + the comm hook half copies' if est.comm > est.comm_step else ''})"
    )


@dataclass(frozen=True)
class RankPlan:
    """One rank's row of a fleet plan: its card, its micro-batch and accumulation, its bytes."""

    rank: int
    gb: float
    batch: int
    accum: int
    est: Estimate

    @property
    def fits(self) -> bool:
        return self.est.total <= usable_bytes(self.gb)


def parse_budgets(text: str) -> list[float]:
    """`--fit GB[,GB...]`: one card size, or one per rank (a mixed fleet)."""
    out = []
    for part in str(text).split(","):
        try:
            gb = float(part)
        except ValueError:
            gb = float("nan")
        if not (gb > 0 and math.isfinite(gb)):
            raise FitError(
                f"--fit {text}: {part.strip()!r} is not a card size; give a positive "
                f"number of GB, or one per rank separated by commas (e.g. 16,8)"
            )
        out.append(gb)
    return out


#: The largest --world a plan takes: its table has a row a rank (`plan small --fit 16 --world
#: 65536`: 4.7 s of CPU against 3.8 s for one rank on the 2-core box, imports included;
#: --world 10^9 ran for hours). Past it a rank's share stays put (DDP) or shrinks further
#: toward nothing (FSDP2's 1/world of the parameters).
MAX_PLAN_WORLD = 65536


def plan_fleet(
    run: RunConfig,
    budgets: list[float],
    world: int | None = None,
    batch: int | None = None,
    seq: int | None = None,
) -> tuple[RunConfig, Estimate, list[str], list[RankPlan]]:
    """A fleet of `world` ranks whose rank r has a card of budgets[r] GB (one GB: N equal
    cards): (the planned run, the tightest rank's estimate, mechanisms engaged, one RankPlan a
    rank). Mechanisms are config, which every rank must share, so the card with the least
    memory picks them; each rank then takes its equal share of the global batch in the
    largest micro-batch its own card holds (under FSDP2 every rank the same micro-batch
    count, as the fleet requires). Sharded as run.train.dist_shard says. FitError when the
    tightest card cannot hold its share even with every mechanism."""
    world = len(budgets) if world is None else world
    if not isinstance(world, int) or world < 1:
        raise FitError(f"--world {world}: a fleet has at least one rank; give an integer >= 1")
    if world > MAX_PLAN_WORLD:
        raise FitError(
            f"--world {world}: a fleet plan holds a row a rank, and plans at most "
            f"{MAX_PLAN_WORLD} ranks; give --world <= {MAX_PLAN_WORLD}"
        )
    if len(budgets) not in (1, world):
        raise FitError(
            f"--fit {','.join(f'{g:g}' for g in budgets)} names {len(budgets)} cards but "
            f"--world is {world}: give one GB per rank (e.g. "
            f"{','.join(f'{budgets[0]:g}' for _ in range(world))}) or one GB for {world} "
            f"identical cards"
        )
    budgets = list(budgets) * world if len(budgets) == 1 else list(budgets)
    for gb in budgets:
        if not gb > 0:
            raise FitError(f"--fit {gb}: the budget must be a positive number of GB")
    run = validate(_with_shape(run, batch, seq))
    t = run.train
    total = t.global_batch or t.batch * world
    if total % world:
        raise FitError(
            f"--fit plans equal shares, but global_batch={total} does not split over {world} "
            f"ranks; give a multiple of {world} (--set global_batch={total - total % world or world})"
        )
    share = total // world
    tight = min(range(world), key=lambda r: budgets[r])
    gb = budgets[tight]
    usable = usable_bytes(gb)
    planned, est, engaged = ladder(run, usable, world)
    if est.total > usable:
        who = f"rank {tight}'s {gb:g} GB card" if len(set(budgets)) > 1 else "each rank"
        raise FitError(_no_fit_message(run, planned, est, engaged, gb, world, who))
    shard = planned.train.dist_shard
    low = planned.train.batch  # fits the tightest card; the config's cap is t.batch
    rows, per_card = [], {}
    for r, g in enumerate(budgets):
        if g not in per_card:  # one card size, one computation (not one a rank)
            cap = low
            if shard != "fsdp" or world == 1:
                room = max_share(planned, usable_bytes(g), world=world, shard=shard)
                cap = max(low, min(t.batch, room))
            shape = accumulate(share, cap, planned.train.seq_len)
            per_card[g] = (shape, estimate(planned, shape.batch, world=world, shard=shard))
        shape, e = per_card[g]
        rows.append(RankPlan(r, g, shape.batch, shape.accum, e))
    return planned, est, engaged, rows


def capacity_for(planned: RunConfig, rows: list[RankPlan]) -> str:
    """The --capacity a fleet trains the plan's rows with ("" where the run's own batch and
    global_batch already give every rank its row)."""
    t = planned.train
    world = len(rows)
    default = accumulate((t.global_batch or t.batch * world) // world, t.batch, t.seq_len)
    if all((p.batch, p.accum) == (default.batch, default.accum) for p in rows):
        return ""
    return ",".join(f"{p.batch}" + (f"*{p.accum}" if p.accum > 1 else "") for p in rows)


def format_fleet_table(planned: RunConfig, rows: list[RankPlan]) -> list[str]:
    """One line a rank: card, micro-batch x accumulation, the components, the peak, fits."""
    world = len(rows)
    t = planned.train
    kind = (
        "one process"
        if world == 1
        else "FSDP2, per-rank shards"
        if t.dist_shard == "fsdp"
        else "DDP, whole model per rank"
    )
    head = (
        f"{'rank':>4} {'card GB':>8} {'micro x accum':>13} {'params':>7} {'grads':>7} "
        f"{'optim':>7} {'buffers':>8} {'activ':>7} {'peak':>7} {'phase':>9} {'usable':>7} fits"
    )
    lines = [
        f"fleet plan: {world} rank(s), {kind}, global batch "
        f"{sum(p.batch * p.accum for p in rows)} windows x seq {t.seq_len}; GiB a rank "
        f"(optim = adamw + muon + engram moments; buffers = the reducer's + Muon's step "
        f"workspace; activ = activations + half casts; peak = the largest phase, not the "
        f"sum)",
        head,
    ]
    for p in rows:
        e = p.est
        lines.append(
            f"{p.rank:>4} {p.gb:>8g} {f'{p.batch} x {p.accum}':>13} {_g(e.masters):>7} "
            f"{_g(e.grads):>7} {_g(e.adamw + e.muon + e.engram):>7} "
            f"{_g(e.comm + e.opt_work):>8} {_g(e.act + e.casts):>7} {_g(e.total):>7} "
            f"{e.phase:>9} {_g(usable_bytes(p.gb)):>7} {'yes' if p.fits else 'NO'}"
        )
    cap = capacity_for(planned, rows)
    sets = [f"global_batch={t.global_batch}"] if t.global_batch else []
    for key in dict.fromkeys(k for _, k, _, _ in MECHANISMS):  # a field once (bf16, int8 rungs)
        v = getattr(planned.model if hasattr(planned.model, key) else t, key)
        default = next(off for _, k, _, off in MECHANISMS if k == key)  # its first rung's off
        if v != default:
            sets.append(f"{key}={str(v).lower()}")
    if world > 1:
        lines.append(
            f"train it: torchrun --nproc_per_node={world} -m dormouse train "
            f"{planned.source.removeprefix('preset:')} --dist "
            f"--set dist_shard={t.dist_shard}"
            + "".join(f" --set {x}" for x in sets)
            + (f" --capacity {cap}" if cap else "")
        )
    return lines


def main_plan(
    run: RunConfig, gb, batch: int | None = None, seq: int | None = None, world: int | None = None
) -> RunConfig:
    """`plan PRESET --fit GB[,GB...] [--world N]`: log the arithmetic and the fit line of the
    tightest rank, then one row a rank; FitError when it won't fit."""
    budgets = (
        parse_budgets(gb)
        if isinstance(gb, str)
        else ([float(g) for g in gb] if isinstance(gb, (list, tuple)) else [float(gb)])
    )
    planned, est, engaged, rows = plan_fleet(run, budgets, world, batch=batch, seq=seq)
    tight = min(rows, key=lambda p: p.gb)
    for line in format_arithmetic(planned, est):
        log.info("%s", line)
    log.info("%s", format_fit_line(tight.gb, est, engaged))
    for line in format_fleet_table(planned, rows):
        log.info("%s", line)
    return planned


def apply_fit(run: RunConfig, world: int = 1) -> RunConfig:
    """`train --fit GB` (run.train.fit_gb) on a rank of `world`: the planned run, after
    logging the fit line."""
    gb = run.train.fit_gb
    if not gb:
        return run
    planned, est, engaged = plan_fit(run, gb, world=world)
    for n in est.notes:
        log.info("fit: %s", n)
    log.info("%s", format_fit_line(gb, est, engaged))
    _compare_with_card(run, gb)
    return planned


def _compare_with_card(run: RunConfig, gb: float) -> None:
    """Say so when the card in hand has less free memory than the budget the plan assumed."""
    if run.train.device == "cpu" or not torch.cuda.is_available():
        return
    from .device import memory_budget, probe_device

    dev = run.train.device if run.train.device.startswith("cuda") else "cuda"
    budget = memory_budget(probe_device(dev))
    if budget is not None and budget < usable_bytes(gb):
        log.warning(
            f"fit: warning: --fit {gb:g} plans for {_g(usable_bytes(gb))} GiB but "
            f"{dev} has {_g(budget)} GiB free (free - 512 MiB); lower --fit to what the "
            f"card has"
        )
