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

from ..config import RunConfig, preset, preset_names, validate
from ..errors import UserError
from ..model.arms import Arm, card_of, choose_arm

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

#: The ladder, cheapest first: (name, config field, value that engages it, its default).
MECHANISMS: tuple[tuple[str, str, object, object], ...] = (
    ("moe_offload", "moe_offload", True, False),
    ("engram_ram", "engram_ram", True, False),
    ("muon_state_dtype=bf16", "muon_state_dtype", "bf16", "fp32"),
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

    @property
    def resident(self) -> int:
        return self.masters + self.adamw + self.muon + self.engram

    @property
    def total(self) -> int:
        return max(self.backward, self.midpoint, self.step)

    @property
    def phase(self) -> str:
        """Which moment of the step sets the peak."""
        return max(("backward", self.backward), ("midpoint", self.midpoint),
                   ("step", self.step), key=lambda kv: kv[1])[0]  # fmt: skip

    def components(self) -> dict[str, int]:
        return {"masters": self.masters, "grads": self.grads, "adamw": self.adamw,
                "muon": self.muon, "engram": self.engram, "casts": self.casts,
                "act": self.act, "opt_work": self.opt_work}  # fmt: skip


# ---- reading the model (meta device) --------------------------------------------------

_SPLITS: dict[tuple, ParamSplit] = {}


def param_split(run: RunConfig) -> ParamSplit:
    """Route the parameters of `run`'s model, built on the meta device (no memory).

    Always built with the VRAM Engram store and no memory mechanism: parameters do not
    depend on them, and a host store would allocate its tables at construction.
    """
    from ..model import DormouseModel
    from .routing import route_params

    m = replace(run.model, engram_ram=False, moe_offload=False, act_ckpt=False,
                act_ckpt_quant=False)  # fmt: skip
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
        total=sum(r.numel for r in routes), muon=by_owner["muon"], adamw=by_owner["adamw"],
        engram=by_owner["engram"], expert=expert, body=body, matrices=matrices,
        muon_groups=tuple(sorted(groups.items(), key=lambda kv: -kv[1])),
    )  # fmt: skip
    _SPLITS[key] = split
    return split


def kda_arm(run: RunConfig) -> Arm:
    """The KDA arm the training run will use (what the activation term assumes): pinned as
    pinned, auto by the model's rule on the run's card (which card: docs/fit.md)."""
    m, dev = run.model, run.train.device
    if m.kda_impl != "auto":
        return Arm(m.kda_impl, f"kda_impl={m.kda_impl} (pinned)")
    if dev != "cpu" and not torch.cuda.is_available():
        dev = replace(card_of("cpu"), type="cuda", name="the planned card")
    elif dev == "auto":
        dev = "cuda"
    dtype = torch.bfloat16 if half_compute(run) else torch.float32
    return choose_arm("kda", "auto", dev, dtype, {"head_dim": m.head_dim})


def half_compute(run: RunConfig) -> bool:
    """Whether the forward computes in half precision (casts exist, saves are half width)."""
    return run.train.dtype != "fp32"


def act_bytes_per_token_d(run: RunConfig, arm: str, half: bool) -> tuple[float, float]:
    """(K, routed part of K): bytes one block application saves per token x d_model."""
    m = run.model
    i = 0 if half else 1
    kernel = ACT_KDA_FLA[i] if arm == "fla" else ACT_KDA_TORCH[i] * m.kda_chunk / 16
    a_d, a_f = ACT_ROUTED[i]
    routed = m.moe_topk * (a_d * m.d_model + a_f * m.d_ffn) / m.d_model
    mixer = (ACT_MIXER_PROJ[i] + kernel) * m.d_attn / m.d_model
    k = mixer + routed + ACT_REST[i]
    return k * ACT_SCALE, routed * ACT_SCALE


def _muon_workspace(run: RunConfig, split: ParamSplit) -> int:
    if not split.muon_groups:
        return 0
    t = run.train
    (rows, cols), n = split.muon_groups[0]
    ns_half = t.ns_dtype == "bf16" or t.ns_dtype == "auto"  # auto -> bf16 on CUDA
    per = 14 if ns_half else 16
    if t.muon_state_dtype == "bf16":
        per += 4  # the momentum is widened to fp32 for the update
    if t.muon_variant != "nesterov":
        per -= 4  # the update is the momentum itself: no blend tensor
    s = min(rows, cols)
    gram = 2 * (n // (rows * cols)) * s * s * (2 if ns_half else 4)
    return per * n + gram


# ---- the estimate ---------------------------------------------------------------------


def estimate(run: RunConfig, batch: int | None = None, seq: int | None = None) -> Estimate:
    """Device bytes of one steady-state training step of `run` at batch x seq (see the model)."""
    m, t = run.model, run.train
    batch = t.batch if batch is None else batch
    seq = t.seq_len if seq is None else seq
    split = param_split(run)
    arm, arm_reason = kda_arm(run)
    half = half_compute(run)

    host_tables = split.engram if m.engram_ram else 0
    p_dev = split.total - host_tables
    masters = 4 * p_dev
    grads = 4 * p_dev
    adamw = (2 if t.optim_8bit else 8) * split.adamw
    muon = (2 if t.muon_state_dtype == "bf16" else 4) * split.muon
    # The Engram group is dormouse's own row-sparse Adam (fp32 m and v, whatever
    # optim_8bit says) plus one int32 step count per row.
    engram = 0 if m.engram_ram else 8 * split.engram + 4 * (split.engram // m.engram_dim)

    apps = m.n_layers * m.max_iter
    tokens = batch * seq
    td = tokens * m.d_model
    k_full, routed = act_bytes_per_token_d(run, arm, half)
    k = k_full - routed if m.moe_offload else k_full

    expert_casts = 2 * split.expert * m.max_iter if half else 0
    one_block_experts = 2 * split.expert // m.n_layers if half else 0
    matrix_casts = 2 * split.matrices if half else 0
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
    opt_work = _muon_workspace(run, split)

    resident = masters + adamw + muon + engram
    keep = 1 - 1 / m.max_iter
    backward = resident + casts + act
    midpoint = resident + int((casts + saved) * keep) + work + 4 * split.body
    step = resident + grads + opt_work
    return Estimate(
        masters=masters, grads=grads, adamw=adamw, muon=muon, engram=engram, casts=casts,
        act=act, opt_work=opt_work, backward=backward, midpoint=midpoint, step=step,
        params=p_dev, tokens=tokens, k_act=k, apps=apps, arm=arm, arm_reason=arm_reason,
        half=half,
    )  # fmt: skip


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


def unavailable(name: str) -> str | None:
    """Why mechanism `name` cannot be engaged on this machine, or None."""
    if name == "optim_8bit" and importlib.util.find_spec("bitsandbytes") is None:
        return "bitsandbytes is not installed (pip install bitsandbytes; CUDA only)"
    return None


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
    est = estimate(run)
    engaged: list[str] = []
    notes: list[str] = []
    for name in MECHANISM_NAMES:
        if est.total <= usable:
            break
        if name in LOSSY and "accumulation" not in engaged:
            # exact: the same global batch in smaller micro-batches, before any lossy rung
            cand = _accumulated(run, usable, world)
            if cand is not None:
                e2 = estimate(cand)
                if e2.total < est.total:
                    run, est = cand, e2
                    engaged.append("accumulation")
                    if est.total <= usable:
                        break
        if mechanism_on(run, name):
            continue
        why = unavailable(name)
        if why:
            notes.append(f"{name} skipped: {why}")
            continue
        cand = engage(run, name)
        e2 = estimate(cand)
        if e2.total >= est.total:
            notes.append(
                f"{name} skipped: no gain ({_g(est.total)} -> {_g(e2.total)} GiB; "
                f"the peak is the {est.phase} phase)"
            )
            continue
        run, est = cand, e2
        engaged.append(name)
    # A later rung can move the peak to another phase, where an earlier rung no longer
    # helps (bf16 Muon momentum shrinks the resident state but widens the step's
    # workspace): release whatever the final plan does not need.
    for name in [n for n in engaged if n != "accumulation"]:
        cand = disengage(run, name)
        e2 = estimate(cand)
        if e2.total <= est.total:
            run, est = cand, e2
            engaged.remove(name)
            notes.append(f"{name} released: no gain once the peak is the {est.phase} phase")
    if "accumulation" in engaged and est.total <= usable:
        run = _grown(run, usable, world)
        est = estimate(run)
        t = run.train
        notes.append(f"accumulation: global_batch {t.global_batch} as micro-batches of "
                     f"{t.batch}")  # fmt: skip
    return run, replace(est, notes=tuple(notes)), engaged


#: Rungs that change the arithmetic (rounded optimizer state): accumulation comes first.
LOSSY = ("muon_state_dtype=bf16", "optim_8bit")


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
    return next((c for c in cands if estimate(c).total <= usable), cands[-1])


def _grown(run: RunConfig, usable: int, world: int) -> RunConfig:
    """The largest micro-batch (a divisor of the share) that still fits with the rungs the
    plan engaged after accumulation."""
    t = run.train
    share = t.global_batch // world
    for b in range(share, t.batch, -1):
        cand = replace(run, train=replace(t, batch=b))
        if share % b == 0 and estimate(cand).total <= usable:
            return cand
    return run


def plan_fit(
    run: RunConfig, budget_gb: float, batch: int | None = None, seq: int | None = None,
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
    raise FitError(_no_fit_message(run, planned, est, engaged, budget_gb))


def _no_fit_message(run, planned, est, engaged, budget_gb) -> str:
    usable = usable_bytes(budget_gb)
    t = run.train
    on = [n for n in MECHANISM_NAMES if mechanism_on(planned, n)]
    comps = " ".join(f"{k}={_g(v)}" for k, v in est.components().items())
    escapes = []
    b = _largest_batch(run, usable)
    if b:
        at_b = ladder(_with_shape(run, b, None), usable)[1].total
        escapes.append(f"--batch {b} (est {_g(at_b)} GiB)")
    else:
        escapes.append("no batch size fits at this seq_len (the terms that do not scale with "
                       "tokens already exceed it)")
    s = _largest_seq(run, usable)
    if s:
        escapes.append(f"--seq {s}")
    smaller = _smaller_preset(run, usable)
    if smaller:
        escapes.append(f"a smaller preset ({smaller})")
    need = math.ceil(est.total / FIT_HEADROOM / GiB)
    escapes.append(f"a card of >= {need} GB")
    return (
        f"--fit {budget_gb:g}GB: {run.source} at batch {t.batch} x seq {t.seq_len} does not fit. "
        f"Usable {_g(usable)} GiB ({FIT_HEADROOM:.0%} of {budget_gb:g} GiB); estimated peak "
        f"{_g(est.total)} GiB ({est.phase} phase) with every mechanism that lowers it "
        f"({', '.join(on) or 'none'}). Components in GiB: {comps} "
        f"[kda={est.arm}, K={est.k_act:.0f} B/(token x d_model) x {est.apps} applications"
        f"{'; ' + '; '.join(est.notes) if est.notes else ''}]. "
        f"Escapes: {'; '.join(escapes)}"
    )


def _fits(run: RunConfig, usable: int) -> bool:
    return ladder(run, usable)[1].total <= usable


def _largest_batch(run: RunConfig, usable: int) -> int:
    lo = 0
    b = run.train.batch - 1
    while b >= 1:
        if _fits(_with_shape(run, b, None), usable):
            lo = b
            break
        b = b // 2 if b > 8 else b - 1
    return lo


def _largest_seq(run: RunConfig, usable: int) -> int:
    s = run.train.seq_len // 2
    while s >= 16:
        if _fits(_with_shape(run, None, s), usable):
            return s
        s //= 2
    return 0


def _smaller_preset(run: RunConfig, usable: int) -> str | None:
    """The largest preset (by parameters) that fits at this batch x seq, if any other does."""
    best = None
    for name in preset_names():
        cand = preset(name)
        if name == "tiny" or cand.model == run.model:
            continue
        if run.train.seq_len > cand.model.max_seq_len:
            continue
        cand = _with_shape(cand, run.train.batch, run.train.seq_len)
        split = param_split(cand)
        if split.total >= param_split(run).total:
            continue
        if _fits(cand, usable) and (best is None or split.total > best[1]):
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
        f"({comps} GiB; kda={est.arm} K={est.k_act:.0f}B tokens={est.tokens})"
    )


def format_arithmetic(run: RunConfig, est: Estimate) -> list[str]:
    """The estimate's arithmetic, one component a line."""
    m, t = run.model, run.train
    split = param_split(run)
    M = 1e6
    td = est.tokens * m.d_model
    per_row = 2 if t.optim_8bit else 8
    eng = "0 (host RAM)" if m.engram_ram else f"{per_row} B x {split.engram / M:.2f}M"
    lines = [
        f"{run.source}: {split.total / M:.2f}M parameters (muon {split.muon / M:.2f}M, "
        f"adamw {split.adamw / M:.2f}M, engram tables {split.engram / M:.2f}M"
        f"{' in host RAM' if m.engram_ram else ''}), batch {t.batch} x seq {t.seq_len} = "
        f"{est.tokens} tokens, compute {'half' if est.half else 'fp32'}, kda={est.arm} "
        f"({est.arm_reason})",
        f"  masters  4 B x {est.params / M:.2f}M = {_g(est.masters)} GiB",
        f"  grads    4 B x {est.params / M:.2f}M = {_g(est.grads)} GiB",
        f"  adamw    {2 if t.optim_8bit else 8} B x {split.adamw / M:.2f}M = {_g(est.adamw)} GiB",
        f"  muon     {2 if t.muon_state_dtype == 'bf16' else 4} B x {split.muon / M:.2f}M = "
        f"{_g(est.muon)} GiB",
        f"  engram   {eng} = {_g(est.engram)} GiB",
        f"  casts    {_g(est.casts)} GiB (half-precision weight copies autograd keeps"
        f"{'' if est.half else '; none in fp32'})",
        f"  act      K={est.k_act:.0f} B x {est.tokens} tokens x {m.d_model} d_model x "
        + (f"{est.apps} applications + block inputs (act_ckpt)" if m.act_ckpt
           else f"({est.apps} applications + {BACKWARD_WORKSET:g} working)")
        + f" = {_g(est.act)} GiB  [{td * est.apps / M:.0f}M token x d_model x applications]",
        f"  opt_work {_g(est.opt_work)} GiB (Muon's polar on its largest shape group"
        f"{' ' + 'x'.join(map(str, split.muon_groups[0][0])) if split.muon_groups else ''})",
        f"  peak = max(backward {_g(est.backward)}, midpoint {_g(est.midpoint)}, "
        f"step {_g(est.step)}) = {_g(est.total)} GiB",
    ]
    lines += [f"  note: {n}" for n in est.notes]
    return lines


def main_plan(run: RunConfig, gb: float, batch: int | None = None,
              seq: int | None = None) -> RunConfig:  # fmt: skip
    """`plan PRESET --fit GB`: log the arithmetic and the fit line; FitError when it won't fit."""
    planned, est, engaged = plan_fit(run, gb, batch=batch, seq=seq)
    for line in format_arithmetic(planned, est):
        log.info("%s", line)
    log.info("%s", format_fit_line(gb, est, engaged))
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
        log.warning(f"fit: warning: --fit {gb:g} plans for {_g(usable_bytes(gb))} GiB but "
                    f"{dev} has {_g(budget)} GiB free (free - 512 MiB); lower --fit to what the "
                    f"card has")  # fmt: skip
