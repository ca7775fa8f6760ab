"""The one way a run is built and trained, in one process or as one rank of a fleet.

`train_run(run)`: resolve the device and the compute dtype -> apply `--fit` -> the
data-parallel context (`DPContext.single`, or `fleet.join` under torchrun) -> the seeded
model -> `parallelize(model, ctx)` -> the optimizer -> `loop.train`. The CLI calls it with or
without `--dist`; the gates call it too, observing the run through loop callbacks.
A single process never imports the fleet modules (fleet, watchdog, parallelize's wrappers).
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

import torch

from ..config import DROPOUT_AUTO, RunConfig, validate
from ..model import active_params, make_model
from ..model.arms import require_arms
from .context import DPContext, RefusedError, unpacked_lines
from .data import open_data, train_bytes
from .loop import Hooks, TrainingError, train
from .optim.mix import MixOptimizer
from .plan.device import probe_device, resolve_dtype
from .plan.fit import apply_fit
from .step import Callbacks, Wrapped
from .store import checkpoint as ckpt

log = logging.getLogger(__name__)


def resolve_device(name: str, local_rank: int | None = None) -> torch.device:
    """`auto` -> cuda when torch sees a card, else cpu (logged); a fleet rank on CUDA takes
    cuda:LOCAL_RANK. The one place a device name is resolved."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
        log.info(f"device=auto cuda_available={int(torch.cuda.is_available())} -> {name}")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TrainingError(
            f"--device {name} asked for CUDA but torch {torch.__version__} sees no CUDA device "
            f"(a CPU build, or no driver); use --device cpu"
        )
    if local_rank is not None and dev.type == "cuda":
        return torch.device("cuda", local_rank)
    return dev


def resolve_autocast(run: RunConfig, device: torch.device) -> torch.dtype | None:
    """The forward's compute dtype (None = plain fp32), by the device policy."""

    dtype, _ = resolve_dtype(run.train.dtype, probe_device(device))
    return None if dtype in (None, torch.float32) else dtype


def dtype_name(dtype: torch.dtype | None) -> str:
    return {None: "fp32", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[
        dtype
    ]


def build_model(run: RunConfig, meta: bool = False) -> torch.nn.Module:
    """The model of `run`, seeded by run.train.seed (every rank builds the same one). An arm
    this build does not have (moe_impl=triton) is the model's own refusal, a UserError."""

    if meta:
        with torch.device("meta"):
            return make_model(run.model)
    torch.manual_seed(run.train.seed)
    return make_model(run.model)


def check_arms(run: RunConfig, device: torch.device, autocast: torch.dtype | None) -> None:
    """Refuse a pinned kernel arm that cannot run on this device before any step runs."""

    if run.model.arch == "dormouse":  # the GPT baseline has no kernel arms
        require_arms(run.model, device, autocast or torch.float32)


#: dropout=auto: a run that reads its train split at least AUTO_PASSES times gets AUTO_DROPOUT,
#: else none. Measured on one H200 (docs/learning.md, `small`, 64 x 256, 1250 steps = ~20
#: passes of two 1 MB corpora): without dropout val rose from its best (1.499) to 4.09 by the
#: end, with 0.4 the end stayed within 1.5% of the best on both corpora (0.1: 29%, 0.2: 8-16%,
#: 0.3: 4-7%); without dropout memorisation showed from ~5 passes on, so 3 passes switch it
#: on. A run that reads its data about once (1.7 passes of the whole default corpus) gains
#: nothing from dropout and pays for its masks.
AUTO_PASSES, AUTO_DROPOUT = 3.0, 0.4


def resolve_dropout(run: RunConfig, world: int = 1) -> RunConfig:
    """`dropout=auto` -> a probability, from the passes the run will make over its data
    (logged: what it read, what it chose); any other value is the user's."""

    if run.model.dropout != DROPOUT_AUTO:
        return run
    t = run.train
    windows = t.global_batch or t.batch * world
    read = t.steps * windows * (t.seq_len + 1)
    have = max(1, train_bytes(t))
    passes = read / have
    p = AUTO_DROPOUT if passes >= AUTO_PASSES else 0.0
    log.info(
        f"dropout=auto: {t.steps} steps x {windows} windows x {t.seq_len + 1} bytes = "
        f"{read / 2**20:.1f} MiB read from a train split of {have / 2**20:.2f} MiB = "
        f"{passes:.1f} passes -> dropout={p:g} ({AUTO_DROPOUT:g} from {AUTO_PASSES:g} passes "
        f"on, measured in docs/learning.md; --set dropout=X pins it)"
    )
    return replace(run, model=replace(run.model, dropout=p))


#: compile=auto compiles on CUDA cards of at least this capability: inductor's Triton kernels
#: need sm_70 (Volta); an older card trains eager.
COMPILE_MIN_SM = (7, 0)
#: compile_mode=auto replays CUDA graphs only below this much work a forward+backward (6N x
#: the micro-batch's tokens, TFLOP): there a step is launch-bound (small at 64 x 256, 0.49
#: TFLOP: 2,700 kernels, 17.8 ms graphed against 122.9 ms eager on an H200); above it the kernels
#: dominate and the graphs' static memory pools cost the batch (b1 at 32 x 2048, 190 TFLOP,
#: ran out of memory capturing the optimizer under reduce-overhead; default mode fits)
GRAPHS_MAX_TFLOP = 10.0


def resolve_compile(run: RunConfig, device: torch.device, world: int = 1) -> RunConfig:
    """`compile=auto` and `compile_mode=auto` -> what this run does, logged with what was read.

    compile: on CUDA (sm_70+), yes: on one H200 small's step went 122.9 -> 17.8 ms
    (docs/performance.md); on the CPU, no: inductor's C++ codegen costs minutes there and the
    step gains little. compile_mode: reduce-overhead (CUDA graphs of the step and the
    optimizer) where the shapes are static: one process on CUDA, no accumulation, nothing
    streamed from host memory (engram_ram, moe_offload), inductor; else default (a fleet's
    all-reduce hooks sit between the compiled pieces: gate g31 holds default mode there)."""

    t = run.train
    if t.compile == "auto":
        sm = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
        on = sm is not None and sm >= COMPILE_MIN_SM
        why = (f"{device.type}" if sm is None else f"cuda sm_{sm[0]}{sm[1]}") + (
            ""
            if on
            else (
                " (inductor's C++ codegen costs minutes on a CPU)"
                if sm is None
                else f" (inductor's Triton needs sm_{COMPILE_MIN_SM[0]}{COMPILE_MIN_SM[1]})"
            )
        )
        log.info(
            f"compile=auto: {why} -> compile={str(on).lower()} (--set compile=true|false pins it)"
        )
        t = replace(t, compile=on)
    if t.compile_mode == "auto":
        accum = bool(t.global_batch) and t.global_batch > t.batch * world
        work = step_tflop(run) if t.compile and device.type == "cuda" else 0.0
        blockers = [
            why
            for why, hit in (
                (
                    f"{work:.3g} TFLOP a step (6N x {t.batch} x {t.seq_len}) > {GRAPHS_MAX_TFLOP:g}: "
                    f"kernel-bound, CUDA graphs' pools would cost memory",
                    work > GRAPHS_MAX_TFLOP,
                ),
                (f"a fleet of {world}", t.dist or world > 1),
                (f"on {device.type}", device.type != "cuda"),
                (f"accumulation (global_batch={t.global_batch} > batch={t.batch})", accum),
                ("engram_ram streams rows from host memory", run.model.engram_ram),
                ("moe_offload streams experts from host memory", run.model.moe_offload),
                (f"compile_backend={t.compile_backend}", t.compile_backend != "inductor"),
            )
            if hit
        ]
        mode = "default" if blockers or not t.compile else "reduce-overhead"
        if t.compile:
            log.info(
                "compile_mode=auto: "
                + (
                    ", ".join(blockers)
                    if blockers
                    else f"one process on CUDA, static shapes, no accumulation, {work:.3g} TFLOP a "
                    f"step (launch-bound below {GRAPHS_MAX_TFLOP:g})"
                )
                + f" -> {mode}"
            )
        t = replace(t, compile_mode=mode)
    return replace(run, train=t)


def step_tflop(run: RunConfig) -> float:
    """TFLOP of one micro-batch's forward + backward by the 6N rule (built on the meta device)."""

    return (
        6 * active_params(build_model(run, meta=True)) * run.train.batch * run.train.seq_len / 1e12
    )


def prepare(
    run: RunConfig, device_type: str | None = None, local_rank: int | None = None, world: int = 1
) -> tuple[RunConfig, torch.device, torch.dtype | None]:
    """(run with --fit, dropout=auto and compile=auto applied, device, compute dtype): what
    every run checks first."""
    run = resolve_dropout(validate(run), world)  # the one validation of a run
    if run.train.fit_gb:
        if run.model.arch != "dormouse":
            raise TrainingError(
                f"--fit models dormouse's own architecture; arch={run.model.arch} is the "
                f"baseline: drop --fit and choose --set batch/seq_len by hand"
            )

        run = apply_fit(run, world)
    device = resolve_device(device_type or run.train.device, local_rank)
    run = resolve_compile(run, device, world)
    autocast = resolve_autocast(run, device)
    check_arms(run, device, autocast)
    return run, device, autocast


def compiled(
    w: Wrapped, run: RunConfig, device: torch.device, autocast: torch.dtype | None
) -> Wrapped:
    """What the step runs on: `w` itself, or with compile=true torch.compile(w.net) in
    compile_mode (static shapes: a run's windows never change shape), with its CUDA-graph
    step marks under reduce-overhead. The optimizer, the checkpoints and evaluation hold the
    model, whose parameters the compiled module shares. The kernel arms are chosen before the
    first trace (`resolve_arm`, for the `autocast` dtype), so that no trace mutates the model."""
    if "auto" in (run.train.compile, run.train.compile_mode):
        run = resolve_compile(run, device)
    t = run.train
    if not t.compile:
        return w
    if t.compile_mode == "reduce-overhead" and device.type != "cuda":
        log.info(
            f"compile_mode=reduce-overhead on {device.type}: CUDA graphs need a GPU; "
            f"inductor compiles without them here"
        )
    kw = (
        {"mode": t.compile_mode}
        if t.compile_backend == "inductor"
        else {"backend": t.compile_backend}
    )
    how = ", ".join(f"{k}={v}" for k, v in kw.items())
    log.info(
        f"compile=true: torch.compile(model, {how}, dynamic=False) on "
        f"{device.type}; the first step traces and compiles (tens of seconds; inductor "
        f"caches its work for the next run), evaluation runs uncompiled"
    )
    for m in w.net.modules():
        if hasattr(m, "resolve_arm"):
            m.resolve_arm(autocast or torch.float32)
    graphs = t.compile_mode == "reduce-overhead" and device.type == "cuda"
    return replace(w, net=torch.compile(w.net, dynamic=False, **kw), graphs=graphs)


def _optimizer(model: torch.nn.Module, run: RunConfig, device: torch.device):
    """The optimizer, built once on the model itself (a wrapper shares its parameters)."""

    return MixOptimizer.from_config(model, run.train, device.type)


def train_run(
    run: RunConfig,
    *,
    resume: bool = False,
    stop_at: int | None = None,
    progress: bool = False,
    model: torch.nn.Module | None = None,
    callbacks: Callbacks | None = None,
    device_type: str | None = None,
    rate: float | None = None,
    timeout_s: float | None = None,
    close: bool = True,
    folder=None,
    prepared: tuple | None = None,
) -> dict:
    """Build and train `run`; returns the loop's report.

    `model` replaces the seeded build (the caller must build it identically on every rank);
    `callbacks` observe the loop; `folder` is the run folder the CLI holds. Fleet only: `rate` replaces this rank's measured matmul rate
    (`--capacity auto`), `timeout_s` replaces dist_timeout, `close=False` leaves the process
    group up for a caller that gathers more afterwards. `prepared`: what `prepare` returned
    for this run (the CLI prepares before it plans the run folder); else prepared here.
    """
    hooks = Hooks(resume, stop_at, progress, callbacks or Callbacks(), folder)
    if not run.train.dist:
        run, device, autocast = prepared or prepare(run, device_type)
        t = run.train
        ctx = DPContext.single(device, t.batch, t.seq_len, t.global_batch)
        for line in unpacked_lines(ctx.shapes, t.batch):
            log.warning(line)
        model = (model if model is not None else build_model(run)).to(device).train()
        return train(
            model,
            compiled(Wrapped(model), run, device, autocast),
            _optimizer(model, run, device),
            ctx,
            run,
            autocast,
            hooks,
        )
    from .fleet.watchdog import ending  # a fleet only (as in _train_fleet)

    try:
        return _train_fleet(
            run, hooks, model, prepared, device_type, rate=rate, timeout_s=timeout_s, close=close
        )
    except BaseException:
        ending()  # a refusal while joining: every rank says its line before the agent's SIGTERM
        raise


def _train_fleet(
    run: RunConfig,
    hooks: Hooks,
    model: torch.nn.Module | None,
    prepared: tuple | None,
    device_type: str | None,
    *,
    rate: float | None,
    timeout_s: float | None,
    close: bool,
) -> dict:
    """train_run on a fleet rank (its arguments: train_run's)."""
    # a fleet's modules load on a fleet only: one process never imports them
    # (tests/test_layout.py holds it)
    import torch.distributed as dist

    from .fleet import launch as fleet
    from .fleet.balance import FleetStream
    from .fleet.parallelize import parallelize
    from .fleet.watchdog import ending, fleet_failure, short

    world = fleet.world_from(os.environ) or 1
    fleet.refuse_incompatible(run, world)
    fitted, device, autocast = prepared or prepare(run, device_type, _local_rank(), world)
    try:
        fleet.refuse_incompatible(fitted, world)  # --fit may engage what a fleet refuses
    except RefusedError as e:
        raise RefusedError(
            f"--fit {run.train.fit_gb} engaged a mechanism the fleet cannot run: {e}. The "
            f"planner should have skipped it (fit.unavailable): drop --fit and set the "
            f"mechanisms by hand (python -m dormouse plan PRESET --fit GB --world N --shard "
            f"{run.train.dist_shard} prints them)"
        ) from None
    run = fitted
    ctx = fleet.join(run, device, compute=dtype_name(autocast), rate=rate, timeout_s=timeout_s)
    ok, failed = False, None
    try:
        log.info(ctx.line(), extra={"every_rank": True})
        for line in unpacked_lines(ctx.shapes, run.train.batch):
            log.warning(line)  # rank 0's: every rank holds the same shapes
        model = (model if model is not None else build_model(run)).to(device).train()
        wrapped = compiled(parallelize(model, ctx), run, device, autocast)
        try:
            report = train(
                model,
                wrapped,
                _optimizer(model, run, device),
                ctx,
                run,
                autocast,
                hooks,
                FleetStream,
            )
        except Exception as e:
            ending()  # before the explaining: it may wait a second for the launcher's exit
            if not fleet_failure(e):
                raise
            # a peer died or the ranks fell out of step: one line naming what each peer was
            # doing, instead of the backend's traceback
            raise fleet.DistError(ctx.heartbeat.explain(e)) from None
        report.update(
            shapes=[s.line() for s in ctx.shapes],
            backend=ctx.backend,
            reduce=ctx.reduce,
            device=str(ctx.device),
        )
        if close:
            ctx.barrier()  # without it, gloo teardown aborts intermittently
        ok = True
        return report
    except BaseException as e:
        ending()  # the launcher's SIGTERM must not cut short this rank's one line
        failed = e
        raise
    finally:
        ctx.heartbeat.leave("done" if ok else "failed", "" if ok else short(failed))
        if close and dist.is_initialized():
            dist.destroy_process_group()


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))


def prepare_for_launch(run: RunConfig) -> tuple[RunConfig, torch.device, torch.dtype | None]:
    """`prepare` as this process will train: one process, or a torchrun rank of its fleet."""
    if not run.train.dist:
        return prepare(run)
    from .fleet import launch as fleet  # a fleet only (as in _train_fleet)

    return prepare(run, None, _local_rank(), fleet.world_from(os.environ) or 1)


def dry_run(run: RunConfig, device: torch.device, autocast, plan: str, folder) -> str:
    """Everything a run checks before its first step (the model on the meta device, the
    optimizer's routing, the data, a resumed checkpoint's shape), without training or writing
    a file; returns the line that says so."""

    model = build_model(run, meta=True)
    n = sum(p.numel() for p in model.parameters())
    _optimizer(model, run, device)
    t = run.train
    data = open_data(t)
    data.train_stream(
        DPContext.single(device, t.batch, t.seq_len, t.global_batch).shape.windows, t.seq_len
    )  # the whole global batch's bytes, every step
    if t.eval_every and data.has_val:
        data.val_batches(1, t.batch, t.seq_len)
    if plan == "resume":
        path = folder.resume_path(run)
        ck = ckpt.read_checkpoint(path, mmap=True)
        diff = ckpt.shape_mismatch(ck["run"].model, run.model)
        if diff:
            raise ckpt.CheckpointError(f"{path} has another model shape: " + "; ".join(diff))
    return (
        f"{run.source}, {n / 1e6:.2f}M parameters, device={device}, "
        f"dtype={dtype_name(autocast)}, steps={t.steps}"
    )
