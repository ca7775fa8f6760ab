"""The training loop, the same code in one process and on every rank of a fleet.

`train(model, net, opt, ctx, run)` owns the step: data, forward, the scaled backward, the
non-finite decision, clipping, the optimizer and LFB update, the LR schedule, logging,
evaluation, checkpoints and resume. What differs on a fleet is asked of the data-parallel
context (`context.DPContext`: the identity in one process); the model arrives built and
wrapped (`run.py`). `Callbacks` are observation points: the gates record runs through them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..config import ConfigError, RunConfig, validate
from ..errors import UserError
from .store import checkpoint as ckpt
from ..model.layers import row_keys
# best_path, ckpt_path: still importable from here, their home before run_dir
from .store.folder import (  # noqa: F401
    METRICS, PLOT, RunDir, RunDirError, best_path, ckpt_path, read_rows,
)  # fmt: skip
from .fleet.balance import FleetStream
from .context import DPContext
from .data import DataError, fingerprint_mismatch, open_data
from .optim.scaler import LossScaler, loss_scaled
from .store.metrics import Sinks

LN2 = math.log(2.0)
log = logging.getLogger(__name__)


class TrainingError(UserError, RuntimeError):
    pass


# ---- stopping on a signal -------------------------------------------------------------


class _GracefulStop:
    """SIGINT / SIGTERM while training: finish the step in hand, checkpoint, then stop.

    A signal only raises a flag; the loop reads it between steps, where model, optimizer
    and data position agree, so the checkpoint written then resumes exactly (a
    KeyboardInterrupt raised mid-step could not promise that). A second Ctrl-C stops at
    once, without a checkpoint. Schedulers send SIGTERM before they preempt a job: it is
    honoured the same way. A disposition of SIG_IGN (a shell's background job) is left
    alone. Some libraries put their own SIGINT handler in place on first use, so the loop
    re-installs ours between steps and says so once. Off the main thread (where Python
    cannot set handlers) this does nothing.
    """

    NAMES = ("SIGINT", "SIGTERM")

    def __init__(self):
        self.caught: str | None = None
        self._handler = self._on_signal  # one bound method, so `is` finds it again
        self._previous: dict = {}
        self._told = False

    def _on_signal(self, signum, _frame) -> None:
        if self.caught is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        self.caught = signal.Signals(signum).name

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for name in self.NAMES:
            sig = getattr(signal, name, None)
            if sig is None:
                continue
            old = signal.getsignal(sig)
            if old is signal.SIG_IGN:
                continue
            self._previous[sig] = old
            signal.signal(sig, self._handler)

    def keep_installed(self) -> None:
        for sig in self._previous:
            now = signal.getsignal(sig)
            if now is not self._handler:
                if not self._told:
                    log.info(f"note: the {signal.Signals(sig).name} handler was replaced "
                             f"({now!r}) by something the run loaded; re-installed so a stop "
                             f"still writes a checkpoint")  # fmt: skip
                    self._told = True
                signal.signal(sig, self._handler)

    def restore(self) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)


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


# ---- progress output --------------------------------------------------------------------


class _Progress:
    """A one-line progress bar on a terminal; nothing otherwise (plain log lines suffice)."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled and sys.stderr.isatty()

    def update(self, step: int, loss: float) -> None:
        if not self.enabled:
            return
        width = 30
        done = int(width * step / max(1, self.total))
        sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{self.total} loss={loss:.4f}")
        sys.stderr.flush()

    def clear(self) -> None:
        if self.enabled:
            sys.stderr.write("\r" + " " * 70 + "\r")
            sys.stderr.flush()


# ---- evaluation -------------------------------------------------------------------------


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
            with _autocast(device, autocast_dtype):
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
    mine = batches[ctx.rank::ctx.world]
    pad = []
    if ctx.eval_on_all_ranks:  # a rank with fewer (or no) batches of its own repeats the first
        pad = list(batches[:1]) * (-(-len(batches) // ctx.world) - len(mine))
    total, count = _sums(model, mine, ctx.device, autocast_dtype, pad)
    total, count = ctx.sum_all([total, count])
    return _result(total, int(count))


def _autocast(device: torch.device, dtype):
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _plot(folder: RunDir) -> None:
    """loss.png from metrics.jsonl. Never the run's end: the checkpoint is written by now,
    so a damaged row or a failed write is a warning naming the file."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("loss curve skipped: matplotlib is not installed (pip install matplotlib)")
        return
    try:
        rows, _ = read_rows(folder.file(METRICS))
    except (RunDirError, OSError) as e:
        log.warning(f"warning: {folder.file(PLOT)} not drawn ({e})")
        return
    tr = [(r["step"], r["loss"]) for _, r in rows if r["kind"] == "train"]
    ev = [(r["step"], r["loss"]) for _, r in rows if r["kind"] == "eval"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if tr:
        ax.plot(*zip(*tr), label="train loss", lw=1)
    if ev:
        ax.plot(*zip(*ev), "o-", label="val loss", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.grid(alpha=0.3)
    if tr or ev:
        ax.legend()
    fig.tight_layout()
    try:
        if folder.write_plot(fig):
            log.info(f"loss curve written to {folder.file(PLOT)}")
    finally:
        plt.close(fig)


# ---- the loop -------------------------------------------------------------------------------


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


def _call(hook, **info) -> None:
    if hook is not None:
        hook(info)


def dropout_keys(model, ctx: DPContext, seed: int, step: int | None, rows: int):
    """The keys of this rank's windows at `step` (layers.row_keys of their global rows), or
    None when the model drops nothing (or no step is given: a benchmark's random masks)."""
    if step is None or getattr(getattr(model, "cfg", None), "dropout", 0.0) <= 0:
        return None
    first = ctx.offset // (ctx.shape.seq_len + 1)  # this rank's first row in the global batch
    return row_keys(seed, step, torch.arange(first, first + rows))


def _say_first_step(t_step: float, device: torch.device) -> None:
    """The cold start in the log: the first step (compile, CUDA-graph capture, kernel
    autotune) and the time since the process imported dormouse."""
    from .. import STARTED

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    now = time.perf_counter()
    log.info(f"first step took {now - t_step:.1f} s (tracing, compiling, autotuning where "
             f"they run; cached for the next run); step 1 reached {now - STARTED:.1f} s after "
             f"start")  # fmt: skip


def train_step(model, net, opt, ctx: DPContext, x, y, cfg, factor: float, autocast,
               cb: Callbacks | None = None, step: int | None = None,
               scaler: LossScaler | None = None, defer: bool = False):
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
    cb = cb or Callbacks()
    device = ctx.device
    opt.set_lr_factor(factor)
    if defer and device.type == "cuda" and not x.is_pinned():
        x, y = x.pin_memory(), y.pin_memory()  # so the copies below queue, never wait
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    k = ctx.shape.accum
    keys = dropout_keys(model, ctx, cfg.seed, step, x.shape[0])
    kw = [{} for _ in range(k)] if keys is None else [{"keys": kj} for kj in keys.chunk(k)]
    losses = []
    # compile_mode=reduce-overhead replays the compiled regions as CUDA graphs, whose outputs
    # the next replay overwrites: each forward is a new graph step, what outlives it a copy
    graphs = getattr(cfg, "compile", False) and cfg.compile_mode == "reduce-overhead"
    for j, (xj, yj) in enumerate(zip(x.chunk(k), y.chunk(k))):
        # the reducer runs once, on the last micro-batch's backward
        with _no_sync(net, last=j == k - 1), _autocast(device, autocast):
            loss_j, aux = graph_forward(net, xj, yj, graphs, **kw[j])
            weighted = loss_j * ctx.loss_scale
            # x a power of two after the fleet's weight: exact, so an unscaled gradient is the
            # same fp32 numbers as one never scaled
            with _phase("backward"):
                (weighted if scaler is None else weighted * scaler.scale).backward()
        losses.append(loss_j.detach())
    # equal micro-batches: their mean is the token-weighted mean of this rank's windows
    loss = losses[0] if k == 1 else torch.stack(losses).mean()
    if defer:
        return _deferred_step(model, net, opt, ctx, loss, aux, cfg, cb)
    loss_ok, gnorm, finite, agreed = clip_and_verdict(model, opt, ctx, loss, cfg, scaler)
    aux["gnorm"] = gnorm if loss_ok else float("nan")
    if scaler is not None:
        # the agreed verdict, never this rank's: every rank's scale moves identically
        aux["scale_line"] = scaler.update(agreed)
    seen = dict(model=model, net=net, opt=opt, ctx=ctx)
    scale = None if scaler is None else scaler.scale
    _call(cb.after_backward, local=finite, agreed=agreed, **seen)
    if not agreed:
        # A skipped step leaves no trace: no gradient carried into the next step, and the
        # routers' counts of the dropped batch do not steer the load balancer.
        opt.zero_grad(set_to_none=True)
        model.lfb_discard()
        _call(cb.after_step, stepped=False, gnorm=gnorm, scale=scale, **seen)
        return loss, aux, False
    with _phase("optimizer"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    with _phase("lfb"):
        model.lfb_update(reduce=ctx.lfb_reduce)
    _call(cb.after_step, stepped=True, gnorm=gnorm, scale=scale, **seen)
    return loss, aux, True


def _deferred_step(model, net, opt, ctx: DPContext, loss, aux, cfg, cb: Callbacks):
    """train_step after the backward under verdict=device: the clip and the verdict as device
    tensors, the optimizer step and the LFB update taking the verdict on the device
    (MixOptimizer.step(commit=...), lfb_update(ok=...)), nothing read back. Callbacks that
    observe the verdict get it read on the host (the gates' recorders: slower, the same
    arithmetic)."""
    with _phase("clip"):
        clip = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        norm = opt.clip_grad_norm_(clip).detach()
        loss_ok = torch.isfinite(loss)
        local = loss_ok & torch.isfinite(norm)
        # a DDP fleet: the norm is of the reduced gradients, the loss this rank's; one
        # all-reduce on the device makes the verdict every rank's
        ok = ctx.all_finite_on_device(local)
        aux["gnorm"] = torch.where(loss_ok, norm, torch.full_like(norm, float("nan")))
    seen = {"model": model, "net": net, "opt": opt, "ctx": ctx}
    if cb.after_backward is not None:
        _call(cb.after_backward, local=bool(local), agreed=bool(ok), **seen)
    with _phase("optimizer"):
        opt.step(commit=ok)
        opt.zero_grad(set_to_none=True)
    with _phase("lfb"):
        model.lfb_update(reduce=ctx.lfb_reduce, ok=ok)
    if cb.after_step is not None:
        _call(cb.after_step, stepped=bool(ok), gnorm=float(aux["gnorm"]), scale=None, **seen)
    return loss, aux, ok


def graph_forward(net, x, y, graphs: bool, **kw):
    """(loss, aux) of one training forward of `net`, as train_step runs it. `graphs`
    (compile_mode=reduce-overhead): the compiled regions replay as CUDA graphs, whose outputs
    the next replay overwrites, so each forward is a new graph step and what outlives it a
    copy."""
    if graphs:
        torch.compiler.cudagraph_mark_step_begin()
    with _phase("forward"):
        _, loss, aux = net(x, y, **kw)
    if graphs:
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
        clip = cfg.grad_clip if cfg.grad_clip > 0 else float("inf")
        norm = opt.clip_grad_norm_(clip)
        if hasattr(norm, "full_tensor"):  # a DTensor (torch's own clip over FSDP2 shards)
            norm = norm.full_tensor()
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
        why = ("a fleet reads its agreed verdict on the host unless verdict=device is asked "
               "(not measured on a GPU fleet yet)")  # fmt: skip
    elif scaler is not None:
        why = "the fp16 loss scale moves with every verdict, on the host"
    elif not hasattr(opt, "commit_on_device"):
        why = f"{type(opt).__name__} takes no verdict on the device"
    elif want == "auto" and getattr(opt, "_graph", None) is None:
        why = ("the optimizer steps on the host (its device-side step, a CUDA graph, comes "
               "with compile=true compile_mode=reduce-overhead on CUDA)")  # fmt: skip
    elif want == "auto":
        need = opt.written_bytes()
        total = torch.cuda.get_device_properties(device).total_memory
        if need > DEVICE_VERDICT_SHARE * total:
            why = (f"its copy aside of what the optimizer writes ({need / 2**30:.2f} GiB) is "
                   f"over {DEVICE_VERDICT_SHARE:.3g} of the card ({total / 2**30:.1f} GiB)")
    if not why and getattr(opt, "_graph", None) is None:  # verdict=device, eager optimizer
        why = opt.capture_step(capture=False)  # its device-side arithmetic, eagerly
    why = why or opt.commit_on_device()
    if why and want == "device":
        raise ConfigError(f"verdict=device: {why}; use --set verdict=auto (or host)")
    if why:
        log.info(f"verdict=auto: on the host ({why})")
        return False
    log.info(f"verdict={want}: on the device; the optimizer copies what it writes aside "
             f"({opt.written_bytes() / 2**20:.0f} MiB) and puts it back on a skip, and the loop "
             f"reads each verdict a step late")  # fmt: skip
    return True


class _Settled:
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


class _Deferred(_Settled):
    """A step whose verdict is still on the device (verdict=device): its verdict, loss, norm
    (and at log steps the experts' load) copied to pinned host memory behind its kernels, and
    an event at their end, so reading it waits for this step only, not the one queued after."""

    def __init__(self, step: int, loss, aux: dict, ok, want_load: bool):
        super().__init__(step, loss, aux, ok)
        vals = [ok.to(torch.float32).reshape(1), loss.detach().float().reshape(1),
                aux["gnorm"].float().reshape(1)]  # fmt: skip
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


@contextlib.contextmanager
def _no_sync(net, last: bool):
    """Gradients of a non-final micro-batch stay local (DDP's no_sync, FSDP2's
    set_requires_gradient_sync); the last micro-batch's backward reduces their sum. A
    compiled net (compile=true) is asked through the module it wraps."""
    net = getattr(net, "_orig_mod", net)
    if hasattr(net, "set_requires_gradient_sync"):  # an FSDP2 module
        net.set_requires_gradient_sync(last)
        yield
    elif not last and isinstance(net, torch.nn.parallel.DistributedDataParallel):
        with net.no_sync():
            yield
    else:
        yield


class _NoHeartbeat:
    """One process has no peers to watch: where the loop is goes nowhere."""

    def at(self, step: int, what: str, saved: int | None = None) -> None:
        pass

    def settled(self) -> None:
        pass


#: Evaluations in a row with val up and train loss down before the loop says "overfitting".
OVERFIT_EVALS = 3


@dataclass
class _Best:
    """The loop's record of validation: the best so far, evaluations since it, and the last
    few (step, val, train loss) points for the overfitting line. Saved in every checkpoint."""

    step: int | None = None
    loss: float = math.inf
    since: int = 0
    # [(step, val loss, train loss)], the last OVERFIT_EVALS + 1
    history: list = field(default_factory=list)
    train_s: float = 0.0  # seconds spent in training steps (not eval, saves or the 1st step)
    warned: int | None = None  # the best step the overfitting line last spoke of: once each

    def state(self) -> dict:
        return {"best_step": self.step, "best_loss": self.loss if self.step is not None else None,
                "since_best": self.since, "history": [list(h) for h in self.history],
                "train_s": self.train_s}  # fmt: skip

    @classmethod
    def load(cls, extra: dict | None) -> "_Best":
        e = extra or {}
        loss = e.get("best_loss")
        return cls(step=e.get("best_step"), loss=math.inf if loss is None else float(loss),
                   since=int(e.get("since_best", 0)),
                   history=[tuple(h) for h in e.get("history", [])],
                   train_s=float(e.get("train_s", 0.0)))  # fmt: skip

    def see(self, step: int, val: float, train_loss: float) -> tuple[bool, str | None]:
        """Record one evaluation: (a new best?, the overfitting line when the streak of val up
        while train loss falls reaches OVERFIT_EVALS, else None)."""
        improved = val < self.loss
        if improved:
            self.step, self.loss, self.since = step, val, 0
        else:
            self.since += 1
        self.history = (self.history + [(step, val, train_loss)])[-(OVERFIT_EVALS + 1):]
        h = self.history
        if len(h) == OVERFIT_EVALS + 1 and self.warned != self.step and all(
                b[1] > a[1] and b[2] < a[2] for a, b in zip(h, h[1:])):  # fmt: skip
            self.warned = self.step
            return improved, (
                f"overfitting: val up {OVERFIT_EVALS} evals in a row ({h[0][1]:.4f} -> "
                f"{h[-1][1]:.4f}) while train loss fell ({h[0][2]:.4f} -> {h[-1][2]:.4f}); best "
                f"was step {self.step} (val {self.loss:.4f}, kept in best.pt). More data, "
                f"more dropout (--set dropout=0.4), or --set early_stop=N stops such a run"
            )
        return improved, None


def train(
    model: torch.nn.Module,
    net: torch.nn.Module,
    opt,
    ctx: DPContext,
    run: RunConfig,
    *,
    autocast: torch.dtype | None = None,
    resume: bool = False,
    stop_at: int | None = None,
    progress: bool = False,
    callbacks: Callbacks | None = None,
    folder: RunDir | None = None,
) -> dict:
    """Train `model` (wrapped as `net`, on ctx.device) as `run` says; returns a report.

    `stop_at` ends the run after that many steps while keeping the schedule of the
    full run (an interrupted run, for resume tests); the final checkpoint is written.
    `folder`: the run folder as the CLI holds it (run_dir.RunDir.hold); else resolved here.
    The metrics sinks (store/metrics.py) are closed however the run ends.
    """
    sinks = Sinks()
    try:
        return _train(model, net, opt, ctx, run, sinks, autocast=autocast, resume=resume,
                      stop_at=stop_at, progress=progress, callbacks=callbacks,
                      folder=folder)  # fmt: skip
    finally:
        sinks.close()


def _train(model, net, opt, ctx: DPContext, run: RunConfig, sinks: Sinks, *, autocast,
           resume: bool, stop_at: int | None, progress: bool,
           callbacks: Callbacks | None, folder: RunDir | None) -> dict:  # fmt: skip
    run = validate(run)
    cfg = run.train
    cb = callbacks or Callbacks()
    main = ctx.is_main
    device = ctx.device

    data = open_data(cfg)
    # on a fleet the split may change while training (balance.py): the stream re-splits on the
    # fleet's agreed steps and the loop takes its context after every read
    stream = FleetStream(data, ctx, run, model)
    data_print = data.fingerprint()
    # a fleet's watchdog (watchdog.Heartbeat) hears where this rank is; one process: nothing
    beat = ctx.heartbeat or _NoHeartbeat()
    # every rank holds the list and evaluates its share of it (evaluate_fleet)
    val = data.val_batches(cfg.eval_batches, cfg.batch, cfg.seq_len) if data.has_val else []

    folder = folder or RunDir(cfg.out_dir)
    path, best_file = folder.checkpoint(run), folder.best(run)
    best = _Best()
    # fp16 anywhere in the fleet: one loss scale, the same on every rank (scaler.py)
    scaler = LossScaler(cfg.loss_scale_every) if loss_scaled(autocast, ctx) else None
    start = 0
    if resume:
        if not path.exists():
            raise TrainingError(f"--resume: no checkpoint at {path}; start without --resume")
        ck = ckpt.read_checkpoint(path)
        if int(ck["step"]) > cfg.steps:
            raise TrainingError(f"--resume: {path} is at step {ck['step']}, beyond steps="
                                f"{cfg.steps}; raise --steps to continue it")  # fmt: skip
        # The saved optimizer state carries its groups' lr, wd, eps, momentum...: put this
        # run's back, so a hyperparameter given on resume is applied, not only recorded.
        mine = [{k: v for k, v in g.items() if k not in ckpt.RESUME_FROM_CHECKPOINT}
                for g in opt.param_groups]  # fmt: skip
        # either format, at any world size (a sharded one is resharded to this fleet's)
        ckpt.load_train_state(net, opt, ck, path, run.model)
        for g, hyper in zip(opt.param_groups, mine, strict=True):
            g.update(hyper)
        stream.load_state_dict(ck["data"])
        changed = fingerprint_mismatch(ck.get("data_fingerprint") or data_print, data_print)
        if changed:
            raise DataError(
                f"--resume: {path} was trained on other bytes: {'; '.join(changed)}. Resuming "
                f"would continue the run on data it never saw, at the old data position. Restore "
                f"the file the run was trained on, or train a new run on this one (--overwrite, "
                f"or another --out)"
            )
        ckpt.set_rng_state(ckpt.rank_rng(ck, ctx.rank))
        best = _Best.load(ck.get("extra"))
        saved_scale = (ck.get("extra") or {}).get("loss_scale")
        if scaler is not None and saved_scale is not None:
            scaler.load_state_dict(saved_scale)
            log.info(f"loss scale {scaler.scale:g} restored ({scaler.clean} clean steps since "
                     f"it last moved)")  # fmt: skip
        elif scaler is not None:
            log.info(f"loss scale: {path} holds none (it was not trained in fp16): starting at "
                     f"{scaler.scale:g}")  # fmt: skip
        start = int(ck["step"])
        log.info(f"resumed from {path} at step {start}")
        for change in ckpt.resume_changes(ck["run"], run):
            log.info(f"changed on resume: {change}")
        dropped = folder.trim_metrics(start) if main else 0
        if dropped:
            log.info(f"metrics.jsonl: dropped {dropped} row(s) logged after step {start} (the "
                     f"run went on past its last checkpoint); they are logged again from here")
    if main:
        folder.make()
        if not resume:
            folder.start_metrics()
            # a best.pt from the run this one replaces (--overwrite) is not this run's best
            ckpt.remove_checkpoint(best_file)
        folder.write_config(run)
        sinks.open(folder, cfg.tensorboard, start if resume else None)
    log.info(f"run {run.source}: {ctx.describe()} steps={cfg.steps} lr={cfg.lr} "
             f"dtype={'fp32' if autocast is None else str(autocast).replace('torch.', '')}"
             + ("" if scaler is None else
                f" loss_scale={scaler.scale:g} (x2 every {scaler.every} clean steps, /2 and a "
                f"skip on overflow{'; the fleet shares it' if ctx.world > 1 else ''})"))  # fmt: skip

    def extra_state() -> dict:
        extra = best.state()
        if scaler is not None:
            extra["loss_scale"] = scaler.state_dict()
        return extra

    def save(step: int, where=path) -> None:
        # Every rank takes part: under FSDP2 each writes its shards and rank 0 commits them;
        # else the state is gathered (a collective) and rank 0 writes the one file.
        beat.at(step, "save")
        refused = None
        try:
            ckpt.save_state(where, net, opt, run=run, step=step, data_state=stream.state_dict(),
                            data_fingerprint=data_print, main=main,
                            extra=extra_state())  # fmt: skip
        except ckpt.CheckpointError as e:  # NaN parameters, a full disk...
            refused = e
        else:
            if main:
                beat.at(step, "save", saved=step)
        ctx.barrier()
        # one rank's refusal is every rank's: the others would otherwise train on into a
        # collective that rank never joins
        if ctx.any_rank(refused is not None):
            if refused is not None:
                raise refused
            raise ckpt.CheckpointError(
                f"{'a rank' if ckpt.sharded(net) else 'rank 0'} could not write the checkpoint "
                f"at step {step} (its message names the cause); rank {ctx.rank} stops with it"
            )
        beat.at(step, "train", saved=step)

    def write_metrics(kind: str, step: int, values: dict) -> None:
        sinks.write(kind, step, values)  # no sink on ranks other than 0

    def do_eval(step: int, train_loss: float) -> tuple[dict, bool]:
        """Evaluate (the fleet splits the batches), log, keep best.pt; (result, stop?)."""
        beat.at(step, "eval")
        res = evaluate_fleet(model, val, ctx, autocast)
        tag = f" dist={ctx.rank}/{ctx.world} (split over the ranks)" if ctx.world > 1 else ""
        log.info(f"eval step={step} loss={res['loss']:.4f} bpb={res['bpb']:.4f} on "
                 f"{res['tokens']} val bytes{tag}")  # fmt: skip
        write_metrics("eval", step, {"loss": res["loss"], "bpb": res["bpb"],
                                     "val_bytes": res["tokens"], "bytes": step * ctx.stride,
                                     "train_s": round(best.train_s, 3)})  # fmt: skip
        stop = False
        improved, overfit = best.see(step, res["loss"], train_loss)
        if overfit:
            log.warning(overfit)
        if improved:  # at step 0 too: on data with nothing to learn, the start is the best
            save(step, best_file)
            log.info(f"best val so far ({res['loss']:.4f}) at step {step}: {best_file}")
        if cfg.early_stop and best.since >= cfg.early_stop:
            log.warning(f"early stop at step {step}: {best.since} evaluations without a new "
                        f"best (early_stop={cfg.early_stop}); best was step {best.step} "
                        f"(val {best.loss:.4f}, in {best_file})")  # fmt: skip
            stop = True
        _call(cb.on_eval, step=step, val=res if main else {}, model=model, net=net, opt=opt,
              ctx=ctx)  # fmt: skip
        return res, stop

    end = cfg.steps if stop_at is None else min(cfg.steps, stop_at)
    bar = _Progress(cfg.steps, progress and main)
    # `data.has_val`, not `val`: val is empty on ranks that do not evaluate, yet every rank
    # must enter do_eval for its barrier (else the fleet's collectives fall out of step).
    first_eval = {}
    if cfg.eval_every and start == 0 and data.has_val:
        first_eval, _ = do_eval(start, math.nan)
    skips = consecutive = 0
    last_loss = float("nan")
    tokens_seen = 0
    # verdict=device: the loop reads a step's verdict while the next one runs (`pending`),
    # except before an evaluation, a checkpoint, a stop and the end, which see a settled state
    defer = device_verdict(cfg, ctx, opt, scaler)
    pending: _Settled | None = None

    def logs(done: int) -> bool:
        return bool(cfg.log_every and (done % cfg.log_every == 0 or done == end))

    def settle(p: _Settled) -> bool:
        """The loop's bookkeeping of step p.step once its verdict is read: the skip count
        (and the divergence stop), the log line and metrics row, the bar. False: skipped."""
        nonlocal skips, consecutive, tokens_seen, steps_since_log, t_log, last_loss
        stepped, gnorm = p.read()
        moved = p.aux.get("scale_line")
        if not stepped:
            skips += 1
            consecutive += 1
            log.info(f"step={p.step} skipped: non-finite loss or gradient (skips={skips})"
                     + (f"; {moved}" if moved else ""))  # fmt: skip
            if consecutive >= cfg.max_skips:
                fp16 = ("" if scaler is None else
                        f"; the fp16 loss scale fell to {scaler.scale:g}, so the forward "
                        f"itself is non-finite (an fp16 overflow past 65504 if fp32 trains): "
                        f"--set dtype=bf16 on sm_80+ or dtype=fp32")  # fmt: skip
                raise TrainingError(
                    f"{consecutive} consecutive non-finite steps (max_skips={cfg.max_skips}) "
                    f"at step {p.step}: the run diverged; lower --set lr (now {cfg.lr}) or "
                    f"check the data{fp16}"
                )
            return False
        if moved:
            log.info(f"step={p.step} {moved}")
        consecutive = 0
        tokens_seen += ctx.global_tokens
        steps_since_log += 1
        done = p.step + 1
        if logs(done):
            fleet, local = p.losses(ctx)
            _call(cb.on_log, loss=fleet, local_loss=local, model=model, net=net, opt=opt,
                  ctx=ctx)  # fmt: skip
            p.wait()
            now = time.perf_counter()
            ms = 1000 * (now - t_log) / max(1, steps_since_log)
            tps = ctx.global_tokens * steps_since_log / max(1e-9, now - t_log)
            t_log, steps_since_log = now, 0
            last_loss = fleet
            lr_now = cfg.lr * lr_factor(p.step, cfg)
            bar.clear()
            said = "" if scaler is None else f" scale={scaler.scale:g}"
            log.info(f"step={done} loss={fleet:.4f} bpb={fleet / LN2:.4f} lr={lr_now:.3e} "
                f"gnorm={gnorm:.3f}{said} tok/s={tps:.0f} ms={ms:.1f}")  # fmt: skip
            write_metrics("train", done, {
                "loss": fleet, "bpb": fleet / LN2, "lr": lr_now, "gnorm": gnorm, "tok_s": tps,
                "ms": ms, "load": p.load(),
                **({} if scaler is None else {"scale": scaler.scale}),
                # a fleet's windows per rank this step (re-balancing moves them)
                **({} if ctx.world == 1 else {"split": [s.windows for s in ctx.shapes]})})
        bar.update(done, last_loss)
        return True

    t_log = time.perf_counter()
    steps_since_log = 0
    step = start
    # a fleet must stop on the same step on every rank: the ranks agree every 10 steps
    stop_every = 1 if ctx.world == 1 else 10
    stopper = _GracefulStop()
    stopped = False
    last_saved = start if resume else None
    stopper.install()
    early, last_val = False, {}
    try:
        for step in range(start, end):
            # here `step` steps are complete: the one place a stop leaves a resumable state
            beat.at(step, "train")
            stopper.keep_installed()
            if (step - start) % stop_every == 0 and ctx.any_rank(stopper.caught is not None):
                if pending is not None:  # the checkpoint holds this step's settled state
                    settle(pending)
                    pending = None
                why = stopper.caught or "a signal on another rank"
                bar.clear()
                log.info(f"stop requested ({why}) at step {step}: writing a checkpoint so --resume "
                    f"continues from here")  # fmt: skip
                save(step)
                stopped = True
                raise KeyboardInterrupt
            factor = lr_factor(step, cfg)
            try:
                stream.check_source()
                shrunk = None
            except DataError as e:  # the file shrank under the run: the model is still at `step`
                shrunk = e
            # ranks may see the shrink a step apart: every rank stops on this step together
            if ctx.any_rank(shrunk is not None):
                if pending is not None:
                    settle(pending)
                    pending = None
                save(step)
                log.info(f"checkpoint written at step {step}; restore the data file, then "
                    f"--resume auto continues from there")  # fmt: skip
                raise shrunk or DataError(
                    f"another rank found a data file shrunk under the run before step {step} "
                    f"(its message names the file); rank {ctx.rank} stops with it"
                )
            t_step = time.perf_counter()
            x, y = stream.next()
            ctx = stream.ctx
            loss, aux, ok = train_step(model, net, opt, ctx, x, y, cfg, factor, autocast, cb,
                                       step=step, scaler=scaler, defer=defer)  # fmt: skip
            if step == start:  # the first step may be long on one rank (kernel autotune)
                beat.settled()
                _say_first_step(t_step, device)
            done = step + 1
            evals = bool(cfg.eval_every and done % cfg.eval_every == 0 and done != end
                         and data.has_val)  # fmt: skip
            saves = bool(cfg.ckpt_every and done % cfg.ckpt_every == 0 and done != end)
            if defer:
                # (a step decided on the host anyway, e.g. a reference's dropped batch: settled)
                this = (_Deferred(step, loss, aux, ok, want_load=logs(done)) if torch.is_tensor(ok)
                        else _Settled(step, loss, aux, ok))  # fmt: skip
                if pending is not None:  # the step before, read while this one runs
                    settle(pending)
                    pending = None
                if not (evals or saves or done == end):
                    pending = this  # settled behind the next step
                    if step > start:  # (a skipped step's time counts too: it cannot be told yet)
                        best.train_s += time.perf_counter() - t_step
                    continue
            else:
                this = _Settled(step, loss, aux, ok)
            # a skipped step is a step all the same: the evaluations and checkpoints keep their
            # cadence (a skip at step 499 used to drop the checkpoint at 500)
            settle(this)
            if evals and device.type == "cuda":
                torch.cuda.synchronize(device)  # this step's kernels count as training time
            if step > start:  # the first step of a process holds kernel autotune / compile
                best.train_s += time.perf_counter() - t_step
            if evals:
                last_val, early = do_eval(done, last_loss)
                if early:
                    save(done)
                    end = done
                    break
            if saves:
                save(done)
                last_saved = done
        step = end
    except KeyboardInterrupt:
        if not stopped:
            bar.clear()
            where = f"step {last_saved}" if last_saved is not None else "none yet"
            log.info(f"interrupted during step {step + 1}: no checkpoint written, since the state is "
                f"mid-step (last checkpoint: {where}; one Ctrl-C, or SIGTERM, stops cleanly)")  # fmt: skip
        raise
    finally:
        stopper.restore()
    bar.clear()
    final = last_val if early else {}
    if data.has_val and not early:
        final, _ = do_eval(end, last_loss)
    if not early:
        save(end)
    if best.step is not None:
        log.info(f"best val {best.loss:.4f} at step {best.step}: {best_file}")
    if main:
        if folder.file(METRICS).exists():
            _plot(folder)
    return {
        "steps": end,
        "loss": last_loss,
        "val": final,
        "val_start": first_eval,
        "skips": skips,
        "tokens": tokens_seen,
        "rank": ctx.rank,
        "world_size": ctx.world,
        "checkpoint": str(path),
        "best": {"step": best.step, "loss": best.loss, "path": str(best_file)}
        if best.step is not None else None,
    }
