"""The --fit memory model against reality: estimated vs measured peak device memory.

A benchmark, not a test: it reports and asserts nothing. For each preset and budget it
resolves the plan `dormouse.train.fit.plan_fit` picks at batch x seq, builds the model on
CUDA with those mechanisms, runs one warm-up step (so AdamW's lazily created state exists
and the measured step is a steady-state one), then resets the peak counter and runs one
forward + backward + clip + MixOptimizer step, and reports torch.cuda.max_memory_allocated
beside the estimate. A combination the planner refuses is recorded as "does not fit";
with --measure-unfit the refused plan (every mechanism that helps) is measured anyway, which
checks the estimate the refusal quoted. --calibrate adds one row per preset with no
mechanism at all and prints the activation constant K that row's peak implies.

    python bench/memory_bench.py                          # on a CUDA box -> docs/memory.md
    python bench/memory_bench.py --measure-unfit --calibrate --out docs/memory.md
    python bench/memory_bench.py --dry                    # estimates only, CPU, no file

Each row frees its model, optimizer and tensors (del, gc, empty_cache) before the next,
and an out-of-memory error on one row is recorded in the table, not fatal.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import sys
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dormouse.config import preset  # noqa: E402
from dormouse.train import fit  # noqa: E402

GiB = fit.GiB


@dataclass
class Row:
    preset: str
    budget: str
    engaged: str
    phase: str = "-"
    estimate: float | None = None  # GiB
    measured: float | None = None  # GiB
    implied_k: float | None = None
    notes: str = ""

    def cells(self) -> list[str]:
        est = "-" if self.estimate is None else f"{self.estimate:.2f}"
        mea = "-" if self.measured is None else f"{self.measured:.2f}"
        err = "-"
        if self.estimate is not None and self.measured:
            err = f"{100 * (self.estimate - self.measured) / self.measured:+.1f}"
        k = "-" if self.implied_k is None else f"{self.implied_k:.0f}"
        return [self.preset, self.budget, self.engaged, self.phase, est, mea, err, k, self.notes]


HEADER = ["preset", "budget GB", "engaged", "peak phase (model)", "estimate GiB",
          "measured GiB", "error %", "implied K", "notes"]  # fmt: skip


def markdown(rows: list[Row]) -> str:
    out = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    out += ["| " + " | ".join(r.cells()) + " |" for r in rows]
    return "\n".join(out)


def implied_k(run, est, measured_bytes: int) -> float | None:
    """The K (bytes per token x d_model per block application) a measured peak implies,
    when the model says the peak is the start of backward with no checkpointing."""
    if est.phase != "backward" or run.model.act_ckpt:
        return None
    m = run.model
    act = measured_bytes - est.resident - est.casts
    denom = est.tokens * m.d_model * (m.n_layers * m.max_iter + fit.BACKWARD_WORKSET)
    return act / denom


def measure(run, batch: int, seq: int, device) -> tuple[int, str]:
    """(peak bytes of one steady-state step, notes). Raises torch.cuda.OutOfMemoryError."""
    import torch

    from dormouse.model import DormouseModel
    from dormouse.train.loop import resolve_autocast, train_step
    from dormouse.train.seams import RankShape, Seams
    from dormouse.train.optim import MixOptimizer

    notes = []
    torch.manual_seed(0)
    model = opt = x = y = None
    try:
        if run.model.engram_ram:
            # a host-RAM store decides itself where its tables live: build on CPU, move the rest
            model = DormouseModel(run.model).to(device)
        else:
            with torch.device(device):
                model = DormouseModel(run.model)
        model.train()
        names = [n for n, _ in model.named_parameters()]
        if run.model.engram_ram and any(n.endswith("store.table") for n in names):
            notes.append("engram_ram NOT honoured: the table is still a device parameter")
        opt = MixOptimizer.from_config(model, run.train, device.type, log=lambda _l: None)
        autocast = resolve_autocast(run, device, lambda _l: None)
        g = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randint(0, 256, (batch, seq), generator=g).to(device)
        y = torch.randint(0, 256, (batch, seq), generator=g).to(device)

        seams = Seams([RankShape(batch, seq)])

        def step():
            # the trainer's own step (forward, backward, clip through the optimizer, step)
            train_step(model, opt, seams, x, y, run.train, 1.0, device, autocast)

        step()  # warm-up: lazily created optimizer state, kernel autotuning
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        mixer = model.blocks[0].mixer
        notes.append(f"kda={getattr(mixer, 'impl', '?')}")
        return peak, "; ".join(notes)
    finally:
        del model, opt, x, y
        gc.collect()
        torch.cuda.empty_cache()


def row_for(name: str, budget: float | str | None, args, device, cache: dict) -> Row:
    """One table row; `cache` holds measurements by (preset, mechanisms), so budgets that
    resolve to the same plan are measured once."""
    base = fit._with_shape(preset(name), args.batch, args.seq)
    if budget is None or isinstance(budget, str):  # --calibrate: a forced mechanism set
        run = base
        for mech in ([] if budget in (None, "none") else budget.split(",")):
            run = fit.engage(run, mech)
        est = fit.estimate(run)
        engaged = [m for m in fit.MECHANISM_NAMES if fit.mechanism_on(run, m)]
        fits, label = True, "- (calibration)"
    else:
        run, est, engaged = fit.ladder(base, fit.usable_bytes(budget))
        fits, label = est.total <= fit.usable_bytes(budget), f"{budget:g}"
    row = Row(name, label, ",".join(engaged) or "none", est.phase, est.total / GiB)
    notes = []
    if not fits:
        notes.append("does not fit")
        if not args.measure_unfit:
            row.notes = notes[0]
            return row
        if not args.dry:
            notes.append("measured with every mechanism that helps")
    if args.dry:
        row.notes = "; ".join(notes)
        return row
    key = (name, tuple(engaged))
    if key not in cache:
        cache[key] = _measure_or_record(run, args.batch, args.seq, device)
    peak, mnotes = cache[key]
    if peak is not None:
        row.measured = peak / GiB
        row.implied_k = implied_k(run, est, peak)
    row.notes = "; ".join(notes + ([mnotes] if mnotes else []))
    return row


def _measure_or_record(run, batch: int, seq: int, device) -> tuple[int | None, str]:
    """(peak bytes or None, notes): an OOM or a mechanism that fails is recorded, not fatal."""
    import torch

    try:
        return measure(run, batch, seq, device)
    except torch.cuda.OutOfMemoryError as e:
        return None, f"OOM ({str(e).splitlines()[0][:80]})"
    except Exception as e:  # a mechanism not built yet, say: record it, keep the table going
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
    finally:
        gc.collect()
        torch.cuda.empty_cache()


def machine_line(dry: bool) -> str:
    import torch

    if dry or not torch.cuda.is_available():
        return f"dry run (estimates only) on {platform.machine()}, torch {torch.__version__}"
    p = torch.cuda.get_device_properties(0)
    return (f"{p.name}, {p.total_memory / GiB:.1f} GiB, sm_{p.major}{p.minor}, torch "
            f"{torch.__version__}, CUDA {torch.version.cuda}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="small,medium,b1")
    ap.add_argument("--budgets", default="4,8,16", help="GB, comma separated")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--out", help="markdown file (default docs/memory.md; none with --dry)")
    ap.add_argument("--dry", action="store_true", help="estimates only, on CPU")
    ap.add_argument("--measure-unfit", action="store_true",
                    help="measure refused plans with every mechanism that helps")
    ap.add_argument("--calibrate", action="store_true",
                    help="add rows per preset with no mechanism (and the K its peak "
                         "implies) and with act_ckpt alone")
    args = ap.parse_args(argv)
    import torch

    device = None
    if not args.dry:
        if not torch.cuda.is_available():
            print("memory_bench: no CUDA device; use --dry for the estimates alone",
                  file=sys.stderr)
            return 2
        device = torch.device("cuda", torch.cuda.current_device())
    out = args.out or (None if args.dry else "docs/memory.md")

    presets = [p for p in args.presets.split(",") if p]
    budgets = [float(b) for b in args.budgets.split(",") if b]
    rows: list[Row] = []
    measured: dict[tuple, tuple[int | None, str]] = {}
    for name in presets:
        for budget in (["none", "act_ckpt"] if args.calibrate else []) + budgets:
            row = row_for(name, budget, args, device, measured)
            rows.append(row)
            print("| " + " | ".join(row.cells()) + " |", flush=True)

    cmd = "python bench/memory_bench.py " + " ".join(argv if argv is not None else sys.argv[1:])
    table = markdown(rows)
    arms = sorted({fit.kda_arm(preset(p))[1] for p in presets})
    text = "\n".join([
        "# The --fit memory model against measured peaks",
        "",
        f"Machine: {machine_line(args.dry)}",
        f"Command: `{cmd.strip()}`",
        f"Date: {datetime.date.today().isoformat()}",
        f"Shape: batch {args.batch} x seq {args.seq}; the estimate assumes {'; '.join(arms)}.",
        f"Constants: ACT_SCALE={fit.ACT_SCALE}, BACKWARD_WORKSET={fit.BACKWARD_WORKSET}, "
        f"FIT_HEADROOM={fit.FIT_HEADROOM}",
        "",
        "Measured = torch.cuda.max_memory_allocated over the second of two identical steps "
        "(forward, backward, clip, MixOptimizer step, zero_grad(set_to_none)). Error % = "
        "(estimate - measured) / measured. Implied K = the bytes per token x d_model per block "
        "application that the measured peak implies, where the model puts the peak at the "
        "start of backward without checkpointing (set fit.ACT_SCALE from it).",
        "",
        table,
        "",
    ])  # fmt: skip
    print()
    print(text)
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            f.write(text)
        print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
