"""One training step and one evaluation, as the loop and `dormouse bench` run them.

`train_step(s, x, y, factor, step)` is the whole step on this rank's (x, y): forward, the
scaled backward, the fleet's reductions, the ONE agreed non-finite decision, clip, optimizer,
LFB update. `Step` holds what every step of a run uses; what a wrapper of the model asks of a
step (DDP's or FSDP2's gradient sync on the last micro-batch only, compile's CUDA-graph step
marks) arrives as `Wrapped`'s hooks from whoever wrapped it (fleet/parallelize.py, run.py's
compile), so nothing here asks what it was handed. Also here: the LR schedule and the
evaluation of a fixed list of batches.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from ..config import ConfigError, TrainConfig
from ..model.layers import row_keys
from .context import DPContext
from .optim.scaler import LossScaler

LN2 = math.log(2.0)
log = logging.getLogger(__name__)


# ---- schedule -----------------------------------------------------------------------


def lr_factor(step: int, cfg) -> float:
    """Multiplier on every group's base lr at `step` (0-based): warmup, then decay."""
    if cfg.warmup and step < cfg.warmup:
        return (step + 1) / cfg.warmup
    if cfg.schedule == "constant" or cfg.steps <= cfg.warmup:
        return 1.0
    lo = cfg.min_lr_frac
    if cfg.schedule == "cosine":
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return lo + (1 - lo) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    # wsd: warmup, stable at 1, then a linear decay over the last wsd_decay_frac of the run
    decay_start = cfg.steps - int(cfg.steps * cfg.wsd_decay_frac)
    if step < decay_start:
        return 1.0
    progress = (step - decay_start) / max(1, cfg.steps - decay_start)
    return 1.0 - (1.0 - lo) * min(1.0, progress)


@dataclass
class Callbacks:
    """Observation points of the loop (the gates record runs here); none may change what the
    loop does. Each gets one dict: {"model", "net", "opt", "ctx", ...} plus what is named."""

    #: after backward, the host-row reduction, the clip and the agreed finiteness verdict,
    #: before the optimizer: + "local" (this rank's verdict), "agreed" (the fleet's)
    after_backward: Callable[[dict], None] | None = None
    #: at the end of every step, taken or skipped: + "stepped", "gnorm" (pre-clip, nan if
    #: not finite), "scale" (the loss scale after this step's verdict; None without fp16)
    after_step: Callable[[dict], None] | None = None
    #: at each log step: + "loss" (the fleet's token-weighted loss), "local_loss"
    on_log: Callable[[dict], None] | None = None
    #: after each evaluation: + "step", "val" (rank 0's {loss, bpb}; {} elsewhere)
    on_eval: Callable[[dict], None] | None = None


def notify(hook, **info) -> None:
    if hook is not None:
        hook(info)


def dropout_keys(model, ctx: DPContext, seed: int, step: int | None, rows: int):
    """The keys of this rank's windows at `step` (layers.row_keys of their global rows), or
    None when the model drops nothing (or no step is given: a benchmark's random masks)."""
    if step is None or getattr(getattr(model, "cfg", None), "dropout", 0.0) <= 0:
        return None
    first = ctx.offset // (ctx.shape.seq_len + 1)  # this rank's first row in the global batch
    return row_keys(seed, step, torch.arange(first, first + rows))


# ---- what a step uses ---------------------------------------------------------------------


def _no_sync_free(last: bool):
    return nullcontext()


@dataclass(frozen=True)
class Wrapped:
    """The module a step runs forward and backward on, with what its wrappers ask of a step.

    `no_sync(last)`: a context for one micro-batch's backward; a data-parallel wrapper keeps a
    non-final micro-batch's gradients local in it (DDP's no_sync, FSDP2's gradient-sync flag),
    so the last one reduces their sum (fleet/parallelize.py supplies it). `graphs`: the
    compiled regions replay as CUDA graphs (compile_mode=reduce-overhead), so each forward is
    a new graph step and what outlives it a copy (run.py's `compiled` sets it)."""

    net: torch.nn.Module
    no_sync: Callable[[bool], contextlib.AbstractContextManager] = _no_sync_free
    graphs: bool = False


@dataclass
class Step:
    """What every step of a run uses. `model` is the model itself (its parameters are the
    optimizer's), `wrapped` what the forward runs on; `ctx` is this step's data-parallel
    context (a fleet's re-split replaces it); `defer`: the verdict stays on the device
    (`device_verdict`); `scaler`: an fp16 forward's loss scale."""

    model: torch.nn.Module
    wrapped: Wrapped
    opt: object
    ctx: DPContext
    cfg: TrainConfig
    autocast: torch.dtype | None = None
    scaler: LossScaler | None = None
    callbacks: Callbacks = field(default_factory=lambda: Callbacks())
    defer: bool = False

    @property
    def net(self) -> torch.nn.Module:
        return self.wrapped.net

    def seen(self) -> dict:
        """What every callback is handed."""
        return {"model": self.model, "net": self.net, "opt": self.opt, "ctx": self.ctx}


def train_step(s: Step, x, y, factor: float, step: int | None = None):
    """One optimizer step on this rank's (x, y): returns (loss, aux, stepped).

    The whole step lives here so the loop and `dormouse bench` time the same code:
    schedule, forward, the scaled backward, the fleet's post-backward reductions, the
    non-finite decision (ONE collective: every rank skips together), clip, step, LFB.
    `step` keys the dropout masks by (seed, step, global row) when the model drops.
    `scaler` (an fp16 forward on this rank or any rank of the fleet): the loss is multiplied
    by its scale before backward, every gradient divided by it before the clip, and the
    agreed verdict moves it (aux["scale_line"] says when it changed).
    `defer` (verdict=device, `device_verdict`): nothing here waits for the device; `stepped`
    is the verdict as a bool tensor on the device, which the optimizer step and the LFB
    update apply themselves, and aux["gnorm"] a tensor (nan when the loss is not finite).
    """
    model, opt, ctx, cfg, scaler = s.model, s.opt, s.ctx, s.cfg, s.scaler
    device = ctx.device
    opt.set_lr_factor(factor)
    if s.defer and device.type == "cuda" and not x.is_pinned():
        x, y = x.pin_memory(), y.pin_memory()  # so the copies below queue, never wait
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    k = ctx.shape.accum
    keys = dropout_keys(model, ctx, cfg.seed, step, x.shape[0])
    kw = [{} for _ in range(k)] if keys is None else [{"keys": kj} for kj in keys.chunk(k)]
    losses = []
    for j, (xj, yj) in enumerate(zip(x.chunk(k), y.chunk(k))):
        # the reducer runs once, on the last micro-batch's backward
        with s.wrapped.no_sync(j == k - 1), autocast_on(device, s.autocast):
            loss_j, aux = graph_forward(s.wrapped, xj, yj, **kw[j])
            weighted = loss_j * ctx.loss_scale
            # x a power of two after the fleet's weight: exact, so an unscaled gradient is the
            # same fp32 numbers as one never scaled
            with _phase("backward"):
                (weighted if scaler is None else weighted * scaler.scale).backward()
        losses.append(loss_j.detach())
    # equal micro-batches: their mean is the token-weighted mean of this rank's windows
    loss = losses[0] if k == 1 else torch.stack(losses).mean()
    if s.defer:
        local, agreed, gnorm = _device_verdict(s, loss, aux)
        return _apply_verdict(s, loss, aux, local, agreed, gnorm, None)
    loss_ok, gnorm, finite, agreed = clip_and_verdict(model, opt, ctx, loss, cfg, scaler)
    aux["gnorm"] = gnorm if loss_ok else float("nan")
    if scaler is not None:
        # the agreed verdict, never this rank's: every rank's scale moves identically
        aux["scale_line"] = scaler.update(agreed)
    scale = None if scaler is None else scaler.scale
    return _apply_verdict(s, loss, aux, finite, agreed, gnorm, scale)


def _apply_verdict(s: Step, loss, aux, local, agreed, gnorm, scale):
    """The step's tail, one for either verdict: the callbacks, then the optimizer step and the
    LFB update, or the skip. On the host `agreed` is a bool, and a skip drops the gradients
    and the routers' counts here. Under verdict=device it is a bool tensor that the optimizer
    step and the LFB update apply themselves (MixOptimizer.step(commit=...),
    lfb_update(ok=...)), nothing read back; a callback that observes the verdict or the norm
    reads it on the host (the gates' recorders: slower, the same arithmetic)."""
    model, opt, cb = s.model, s.opt, s.callbacks
    on_device = torch.is_tensor(agreed)
    seen = s.seen()
    if cb.after_backward is not None:
        cb.after_backward({"local": bool(local), "agreed": bool(agreed), **seen})
    if not on_device and not agreed:
        # A skipped step leaves no trace: no gradient carried into the next step, and the
        # routers' counts of the dropped batch do not steer the load balancer.
        opt.zero_grad(set_to_none=True)
        if hasattr(model, "lfb_discard"):
            model.lfb_discard()
    else:
        with _phase("optimizer"):
            opt.step(**({"commit": agreed} if on_device else {}))
            opt.zero_grad(set_to_none=True)
        if hasattr(model, "lfb_update"):  # a model with MoE routers balances their load
            with _phase("lfb"):
                model.lfb_update(reduce=s.ctx.lfb_reduce, **({"ok": agreed} if on_device else {}))
    if cb.after_step is not None:
        stepped = bool(agreed)
        cb.after_step({"stepped": stepped, "gnorm": float(gnorm), "scale": scale, **seen})
    return loss, aux, agreed


def _device_verdict(s: Step, loss, aux):
    """verdict=device's clip phase: the clip and the verdict as device tensors. Returns
    (local: this rank's verdict, agreed: the fleet's, the pre-clip norm, nan where the loss is
    not finite), none of them read back."""
    with _phase("clip"):
        norm = s.opt.clip_grad_norm_(clip_norm(s.cfg)).detach()
        loss_ok = torch.isfinite(loss)
        local = loss_ok & torch.isfinite(norm)
        # a DDP fleet: the norm is of the reduced gradients, the loss this rank's; one
        # all-reduce on the device makes the verdict every rank's
        agreed = s.ctx.all_finite_on_device(local)
        aux["gnorm"] = torch.where(loss_ok, norm, torch.full_like(norm, float("nan")))
    return local, agreed, aux["gnorm"]


def clip_norm(cfg) -> float:
    """The clip's threshold: grad_clip, or no clip (inf: the norm is still computed) at 0."""
    return cfg.grad_clip if cfg.grad_clip > 0 else float("inf")


def graph_forward(w: Wrapped, x, y, **kw):
    """(loss, aux) of one training forward of `w.net`, as train_step runs it. `w.graphs`
    (compile_mode=reduce-overhead): the compiled regions replay as CUDA graphs, whose outputs
    the next replay overwrites, so each forward is a new graph step and what outlives it a
    copy."""
    if w.graphs:
        torch.compiler.cudagraph_mark_step_begin()
    with _phase("forward"):
        _, loss, aux = w.net(x, y, **kw)
    if w.graphs:
        loss = loss.clone()
        aux = {n: v.clone() if torch.is_tensor(v) else v for n, v in aux.items()}
    return loss, aux


def clip_and_verdict(model, opt, ctx: DPContext, loss, cfg, scaler: LossScaler | None):
    """train_step's clip phase after the backward: the host-row reduction, fp16's unscale, the
    clip and the agreed finiteness verdict. Returns (loss_ok, gnorm: the pre-clip global norm,
    finite: this rank's verdict, agreed: the fleet's)."""
    with _phase("clip"):
        # host-RAM Engram rows are no parameters: the fleet reduces them here, before the clip
        ctx.reduce_host_grads(model)
        if scaler is not None:
            # before the clip and the optimizer, host rows too; an overflow stays inf/nan and
            # reaches the one verdict below through the clip's norm
            opt.unscale_(scaler.inverse)
        # the optimizer's clip: it also sees host-RAM Engram rows (not parameters); the norm
        # it returns is the pre-clip global norm (the fleet's, once the reducer has run). It
        # runs whatever the loss: a skipped step's gradients are dropped by the caller, and
        # under FSDP2 the norm is a collective every rank must enter.
        norm = opt.clip_grad_norm_(clip_norm(cfg))
        # the loss's and the norm's verdicts reach the host together: one synchronisation
        loss_ok, gnorm = torch.stack([torch.isfinite(loss).to(norm), norm.detach()]).tolist()
        finite = bool(loss_ok) and math.isfinite(gnorm)
        return bool(loss_ok), gnorm, finite, ctx.all_finite(finite)


#: verdict=auto keeps the verdict on the device only when the optimizer's copy aside (every
#: tensor its step writes, MixOptimizer.written_bytes) takes at most this share of the card:
#: small's is ~0.15 GB; b1's (~13 GB of parameters and fp32 state) would crowd its
#: activations, and its step is bound by the device, not by the host's wait (98% busy).
DEVICE_VERDICT_SHARE = 1 / 16


def device_verdict(cfg, ctx: DPContext, opt, scaler: LossScaler | None) -> bool:
    """Whether the loop keeps the step's verdict on the device (TrainConfig.verdict; see
    train_step's `defer`), arranging the optimizer for it; logs what it read and chose.
    verdict=device where it cannot be: ConfigError naming why."""
    want, device = cfg.verdict, ctx.device
    if want == "host":
        return False
    why = ""
    if ctx.world > 1 and want == "auto":
        why = (
            "a fleet reads its agreed verdict on the host unless verdict=device is asked "
            "(not measured on a GPU fleet yet)"
        )
    elif scaler is not None:
        why = "the fp16 loss scale moves with every verdict, on the host"
    elif not hasattr(opt, "commit_on_device"):
        why = f"{type(opt).__name__} takes no verdict on the device"
    elif want == "auto" and not getattr(opt, "device_side", False):
        why = (
            "the optimizer steps on the host (its device-side step, a CUDA graph, comes "
            "with compile=true compile_mode=reduce-overhead on CUDA)"
        )
    elif want == "auto":
        need = opt.written_bytes()
        total = torch.cuda.get_device_properties(device).total_memory
        if need > DEVICE_VERDICT_SHARE * total:
            why = (
                f"its copy aside of what the optimizer writes ({need / 2**30:.2f} GiB) is "
                f"over {DEVICE_VERDICT_SHARE:.3g} of the card ({total / 2**30:.1f} GiB)"
            )
    if not why and not getattr(opt, "device_side", False):  # verdict=device, eager optimizer
        why = opt.capture_step(capture=False)  # its device-side arithmetic, eagerly
    why = why or opt.commit_on_device()
    if why and want == "device":
        raise ConfigError(f"verdict=device: {why}; use --set verdict=auto (or host)")
    if why:
        log.info(f"verdict=auto: on the host ({why})")
        return False
    log.info(
        f"verdict={want}: on the device; the optimizer copies what it writes aside "
        f"({opt.written_bytes() / 2**20:.0f} MiB) and puts it back on a skip, and the loop "
        f"reads each verdict a step late"
    )
    return True


class Settled:
    """A step decided on the host (verdict=host): what the loop's bookkeeping reads of it."""

    def __init__(self, step: int, loss, aux: dict, ok: bool):
        self.step, self.loss, self.aux, self.ok = step, loss, aux, ok

    def read(self) -> tuple[bool, float]:
        """(stepped, pre-clip norm: nan when not finite)."""
        return self.ok, self.aux.get("gnorm", math.nan)  # (a reference's dropped step has none)

    def losses(self, ctx: DPContext) -> tuple[float, float]:
        """(the fleet's loss: a collective on a fleet, this rank's)."""
        return ctx.fleet_loss(self.loss.detach()), float(self.loss.detach())

    def load(self) -> list | None:
        load = self.aux.get("load")
        return load.tolist() if load is not None else None

    def wait(self) -> None:
        if self.loss.is_cuda:
            torch.cuda.synchronize(self.loss.device)


class Deferred(Settled):
    """A step whose verdict is still on the device (verdict=device): its verdict, loss, norm
    (and at log steps the experts' load) copied to pinned host memory behind its kernels, and
    an event at their end, so reading it waits for this step only, not the one queued after."""

    def __init__(self, step: int, loss, aux: dict, ok, want_load: bool):
        super().__init__(step, loss, aux, ok)
        vals = [
            ok.to(torch.float32).reshape(1),
            loss.detach().float().reshape(1),
            aux["gnorm"].float().reshape(1),
        ]
        load = aux.get("load") if want_load else None
        if load is not None:
            vals.append(load.detach().float().reshape(-1))
        vals = torch.cat(vals)
        cuda = vals.is_cuda
        self.host = torch.empty(vals.shape, dtype=torch.float32, pin_memory=cuda)
        self.host.copy_(vals, non_blocking=cuda)
        self.has_load = load is not None
        self.event = torch.cuda.Event() if cuda else None
        if self.event is not None:
            self.event.record()
        self._vals: list[float] | None = None

    def _read(self) -> list[float]:
        if self._vals is None:
            self.wait()
            self._vals = self.host.tolist()
        return self._vals

    def read(self) -> tuple[bool, float]:
        v = self._read()
        return v[0] == 1.0, v[2]

    def losses(self, ctx: DPContext) -> tuple[float, float]:
        v = self._read()  # one process: its loss is the fleet's; a fleet sums (a collective)
        return (v[1] if ctx.world == 1 else ctx.fleet_loss(self.loss.detach())), v[1]

    def load(self) -> list | None:
        return self._read()[3:] if self.has_load else None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


#: The step's phases as `dormouse bench profile` attributes GPU time to them (each a
#: record_function range named "dormouse.<phase>", opened only while a profiler records).
PHASES = ("forward", "backward", "clip", "optimizer", "lfb")


def _phase(name: str):
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(f"dormouse.{name}")
    return nullcontext()


# ---- evaluation --------------------------------------------------------------------


def _sums(model, batches, device, autocast_dtype, pad: list | None = None) -> tuple[float, int]:
    """(sum of nats, tokens) over `batches`, then forwards of the `pad` batches that count for
    nothing (FSDP2: every rank must run as many forwards as the others)."""
    was = model.training
    model.eval()
    total, count = 0.0, 0
    n_real = None
    if pad:
        batches = list(batches)
        n_real = len(batches)
        batches += pad
    with torch.no_grad():
        for i, (x, y) in enumerate(batches):
            x, y = x.to(device), y.to(device)
            with autocast_on(device, autocast_dtype):
                _, loss, _ = model(x, y)
            if n_real is None or i < n_real:
                total += float(loss) * y.numel()
                count += y.numel()
    model.train(was)
    return total, count


def _result(total: float, count: int) -> dict[str, float]:
    nats = total / max(1, count)
    return {"loss": nats, "bpb": nats / LN2, "tokens": int(count)}


def evaluate(model, batches, device, autocast_dtype) -> dict[str, float]:
    """Token-weighted mean loss over `batches` (any iterable) in one process: {loss, bpb,
    tokens}."""
    return _result(*_sums(model, batches, device, autocast_dtype))


def evaluate_fleet(model, batches, ctx: DPContext, autocast_dtype) -> dict[str, float]:
    """The fleet's evaluation of one fixed list of batches: rank r takes batches r::world, the
    sums meet in one collective, every rank gets the same result (one process: `evaluate`).
    So no rank waits in a barrier while rank 0 evaluates alone. DDP ranks run their local
    replica; FSDP2 ranks run the sharded model (fully_shard is in place: `model` is the
    sharded module), padded to the same number of forwards. Never the compiled `net`: an
    evaluation forward (eval mode, no grad) would trace and compile graphs of its own."""
    mine = batches[ctx.rank :: ctx.world]
    pad = []
    if ctx.eval_on_all_ranks:  # a rank with fewer (or no) batches of its own repeats the first
        pad = list(batches[:1]) * (-(-len(batches) // ctx.world) - len(mine))
    total, count = _sums(model, mine, ctx.device, autocast_dtype, pad)
    total, count = ctx.sum_all([total, count])
    return _result(total, int(count))


def autocast_on(device: torch.device, dtype):
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
