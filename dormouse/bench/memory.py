"""memory: the --fit memory model against measured peak device memory (docs/memory.md).

For each preset and budget, the plan `fit.ladder` picks, built as `dormouse train` builds it,
measured over a steady-state step beside its estimate. A refused plan reads "does not fit"
(--measure-unfit measures it anyway, checking the figure the refusal quoted); --calibrate
adds rows with no mechanism and with act_ckpt alone. An OOM is a row, not the end.

    python -m dormouse bench memory --calibrate --measure-unfit --presets small   # CUDA
    python -m dormouse bench memory --dry --presets small,b1                      # estimates only
"""

from __future__ import annotations

import gc
import logging

import torch

from ..model.model import mixer_impl
from ..train.plan import fit
from .common import (
    BenchError,
    GiB,
    build,
    configure,
    machine_lines,
    report,
    resolve_device,
    table,
    windows,
)

log = logging.getLogger(__name__)

HEADER = [
    "preset",
    "budget GB",
    "engaged",
    "peak phase (model)",
    "estimate GiB",
    "measured GiB",
    "error %",
    "implied K",
    "notes",
]


def add_args(ap) -> None:
    ap.add_argument("--presets", default="small,medium,b1", help="comma separated")
    ap.add_argument("--budgets", default="4,8,16", help="GB, comma separated")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--dry", action="store_true", help="estimates only, no device needed")
    ap.add_argument(
        "--measure-unfit",
        action="store_true",
        help="measure refused plans with every mechanism that helps",
    )
    ap.add_argument(
        "--calibrate",
        action="store_true",
        help="add rows per preset with no "
        "mechanism (and the K its peak implies) and with act_ckpt alone",
    )


def implied_k(run, est, peak: int) -> float | None:
    """The K (bytes per token x d_model per block application) a measured peak implies,
    where the model puts the peak at the start of backward without checkpointing."""
    if est.phase != "backward" or run.model.act_ckpt:
        return None
    m = run.model
    return (peak - est.resident - est.casts) / (
        est.tokens * m.d_model * (m.n_layers * m.max_iter + fit.BACKWARD_WORKSET)
    )


def measure(run, device: torch.device) -> tuple[int | None, str]:
    """(peak bytes of a steady-state step or None, notes): a failure is recorded, not fatal."""
    model = step = None
    try:
        model, step, _ = build(run, device)
        w = windows(run, 1)[0]
        step(0, w)  # warm-up: lazily created optimizer state, kernel autotuning
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step(1, w)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device), f"kda={mixer_impl(model)}"
    except Exception as e:  # an OOM, or a mechanism that fails: a row, and the table goes on
        oom = isinstance(e, torch.cuda.OutOfMemoryError)
        return None, f"{'OOM' if oom else type(e).__name__}: {str(e).splitlines()[0][:100]}"
    finally:
        del model, step
        gc.collect()
        torch.cuda.empty_cache()


def row_for(name: str, budget, args, device, cache: dict) -> list[str]:
    base = configure(name, args.set, args.batch, args.seq)
    if isinstance(budget, str):  # --calibrate: a forced mechanism set
        run = base if budget == "none" else fit.engage(base, budget)
        est, fits, label = fit.estimate(run), True, "- (calibration)"
        engaged = [m for m in fit.MECHANISM_NAMES if fit.mechanism_on(run, m)]
    else:
        run, est, engaged = fit.ladder(base, fit.usable_bytes(budget))
        fits, label = est.total <= fit.usable_bytes(budget), f"{budget:g}"
    notes, peak = ([] if fits else ["does not fit"]), None
    if not args.dry and (fits or args.measure_unfit):
        notes += [] if fits else ["measured with every mechanism that helps"]
        key = (name, tuple(engaged))
        if key not in cache:
            cache[key] = measure(run, device)
        peak, note = cache[key]
        notes.append(note)
    k = implied_k(run, est, peak) if peak else None
    err = f"{100 * (est.total - peak) / peak:+.1f}" if peak else "-"
    return [
        name,
        label,
        ",".join(engaged) or "none",
        est.phase,
        f"{est.total / GiB:.2f}",
        f"{peak / GiB:.2f}" if peak else "-",
        err,
        "-" if k is None else f"{k:.0f}",
        "; ".join(notes),
    ]


def run(args, command: str) -> str:
    device = torch.device("cpu") if args.dry else resolve_device(args.device)
    if device.type != "cuda" and not args.dry:
        raise BenchError(
            f"bench memory measures CUDA peaks (max_memory_allocated) and this "
            f"run's device is {device}; use --device cuda, or --dry for the "
            f"estimates alone"
        )
    presets = [p for p in args.presets.split(",") if p]
    budgets = [float(b) for b in args.budgets.split(",") if b]
    rows, cache = [], {}
    for name in presets:
        for budget in (["none", "act_ckpt"] if args.calibrate else []) + budgets:
            rows.append(row_for(name, budget, args, device, cache))
            log.info("| " + " | ".join(rows[-1]) + " |")
    arms = sorted({fit.kda_arm(configure(p, args.set))[1] for p in presets})
    notes = [
        f"Shape: batch {args.batch} x seq {args.seq}; the estimate assumes {'; '.join(arms)}; "
        f"ACT_SCALE={fit.ACT_SCALE}, BACKWARD_WORKSET={fit.BACKWARD_WORKSET}, FIT_HEADROOM="
        f"{fit.FIT_HEADROOM}; the model: docs/fit.md.",
        "--dry: estimates only, nothing measured."
        if args.dry
        else "Measured = torch.cuda.max_memory_allocated over the second of two training steps. "
        "Error % = (estimate - measured) / measured. Implied K = the bytes per token x d_model "
        "per block application the peak implies where the model puts it at the start of "
        "backward without checkpointing (set fit.ACT_SCALE from it).",
    ]
    return report(
        "dormouse bench memory: the --fit memory model against measured peaks",
        machine_lines(device, command),
        table(HEADER, rows),
        notes,
    )
