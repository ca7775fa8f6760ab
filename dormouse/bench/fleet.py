"""fleet: a mixed fleet's tokens/s against the sum of its ranks' solo rates (CPU, gloo).

Each rank's solo rate (one process, the whole global batch, the rank's emulation), measured
before the first fleet and again after each one, and the fleet of `--world` ranks under three
splits of the same global batch: equal, start-up auto (the matmul guess, `rebalance_every=0`)
and re-balanced auto (measured while training), `--rounds` times. Beside the whole-batch sum,
a second baseline: right after each fleet, every rank alone on the windows it held at that
fleet's last split (its share, optimizer step included, as the fleet rank pays it), so that a
time per window that grows or shrinks with the batch does not break the baseline (with the
whole batch it came out above 1 at 32 x 256 and at 192 x 64: docs/fleet.md). On
the CPU a slow card is EMULATED: `--slow RANK:FACTOR` (the `emulate_slow` knob) makes that
rank sleep FACTOR x its own compute each step, and divides its start-up matmul rate by
1 + FACTOR; it is not a measurement of a real slower card.

    python -m dormouse bench fleet --world 2 --slow 1:1.0 --global-batch 96 --seq 64 \
        --steps 40 --every 8 --rounds 3
"""

from __future__ import annotations

import logging
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch

from ..errors import UserError
from .common import configure, machine_lines, report, table

log = logging.getLogger(__name__)

MODES = (("equal", "", 0), ("start-up auto", "auto", 0), ("re-balanced auto", "auto", None))


def add_args(ap) -> None:
    ap.add_argument("preset", nargs="?", default="tiny", help="the preset (default tiny)")
    ap.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    ap.add_argument("--slow", default="1:1.0", help="RANK:FACTOR emulated slow rank (1:1.0)")
    ap.add_argument("--global-batch", type=int, default=24, help="windows a step (default 24)")
    ap.add_argument("--seq", type=int, default=64, help="window length (default 64)")
    ap.add_argument("--steps", type=int, default=60, help="steps per fleet run (default 60)")
    ap.add_argument("--every", type=int, default=10, help="rebalance_every (default 10)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="repeat the three splits this many times (default 1)")


def _sets(args, extra=()) -> list[str]:
    return [f"seq_len={args.seq}", f"batch={args.global_batch}", "eval_every=0", "ckpt_every=0",
            "log_every=1000", "dtype=fp32", *args.set, *extra]  # fmt: skip


def _solo(args, rank: int, share: int | None = None) -> float:
    """tokens/s of this rank alone on the whole global batch, or on `share` windows a step
    (its emulation on)."""
    from ..train.balance import StepTimer
    from ..train.fleet import parse_slow
    from .common import build, windows

    n = share or args.global_batch
    run = configure(args.preset, _sets(args, [f"batch={n}"]))
    model, step, _ = build(run, torch.device("cpu"))
    timer = StepTimer(model, torch.device("cpu"), parse_slow(args.slow, rank))
    data = windows(run, 8)
    walls = []
    for i in range(8):
        t0 = time.perf_counter()
        timer.start(n)
        step(i, data[i])
        timer.stop()
        walls.append(time.perf_counter() - t0)
    timer.remove()
    return n * args.seq / statistics.median(walls[2:])


def _rank(rank: int, world: int, port: int, sets: list[str], preset: str, out: str) -> None:
    from ..config import apply_sets, preset as load
    from ..train.loop import Callbacks
    from ..train.run import train_run

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank)})  # fmt: skip
    torch.set_num_threads(1)
    lines: list[str] = []

    class Sink(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    lg = logging.getLogger("dormouse")
    lg.addHandler(Sink(logging.INFO))
    lg.setLevel(logging.INFO)
    stamps: list[float] = []
    splits: list[str] = []

    def after(info):
        stamps.append(time.perf_counter())
        splits.append(",".join(str(s.windows) for s in info["ctx"].shapes))

    run = apply_sets(load(preset), sets + [f"out_dir={out}/run{rank}"])
    train_run(run, device_type="cpu", callbacks=Callbacks(after_step=after))
    if rank == 0:
        import json

        Path(out, "rank0.json").write_text(json.dumps({"stamps": stamps, "splits": splits,
                                                        "lines": lines}))  # fmt: skip


def _fleet(args, capacity: str, every: int) -> dict:
    import json

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp(prefix="dormouse-bench-fleet-")
    sets = _sets(args, [f"global_batch={args.global_batch}", "dist=true",
                        f"dist_capacity={capacity}", f"rebalance_every={every}",
                        f"emulate_slow={args.slow}", f"steps={args.steps}"])  # fmt: skip
    mp.start_processes(_rank, (args.world, port, sets, args.preset, out), nprocs=args.world,
                       join=True, start_method="spawn")  # fmt: skip
    got = json.loads(Path(out, "rank0.json").read_text())
    walls = [b - a for a, b in zip(got["stamps"], got["stamps"][1:])]
    tail = walls[len(walls) // 2:]  # the second half: after the re-balancer settled
    return {"tok_s": args.global_batch * args.seq / statistics.median(tail),
            "start": got["splits"][0], "end": got["splits"][-1],
            # a taken re-split says "OLD -> NEW" before its rates; a kept split says "kept"
            "resplits": [ln for ln in got["lines"] if ln.startswith("rebalance")
                         and "->" in ln.split(" (rates")[0]]}  # fmt: skip


def run(args, command: str) -> str:
    if args.global_batch < 16:
        log.info("note: a global batch under 16 windows cannot split 2:1 finely (8 windows: 5/3 "
                 "at best, 0.89 of the sum)")
    if args.rounds < 1:
        raise UserError(f"bench fleet: --rounds {args.rounds}; give at least 1")
    torch.set_num_threads(1)
    # Every fleet run sits between two measurements of the solo rates and is divided by their
    # mean: a shared box's speed drifts between runs by as much as the effect measured (23%
    # in ~3 minutes on the 2-core VM), so each fraction uses the rates nearest in time to it,
    # the drift across each fleet is printed, and --rounds repeats the three splits.
    solos = [[_solo(args, r) for r in range(args.world)]]
    runs = []
    for rnd in range(1, args.rounds + 1):
        for name, cap, every in MODES:
            every = args.every if every is None else every
            log.info(f"fleet: round {rnd}/{args.rounds}, {name} ...")
            got = _fleet(args, cap, every)
            shares = [int(w) for w in got["end"].split(",")]
            # a rank with no windows does no work: its solo rate there is 0
            rates = [_solo(args, r, w) if w > 0 else 0.0 for r, w in enumerate(shares)]
            at_share = sum(rates)
            got["share_ms"] = "/".join(f"{1000 * w * args.seq / x:.0f}" if x else "-"
                                       for w, x in zip(shares, rates))  # fmt: skip
            solos.append([_solo(args, r) for r in range(args.world)])
            a, b = solos[-2], solos[-1]
            total = sum((x + y) / 2 for x, y in zip(a, b))
            drift = max(abs(x - y) / max(x, y) for x, y in zip(a, b))
            runs.append((rnd, name, got, total, drift, at_share))
    rows = [[str(rnd), name, f["start"], f["end"], str(len(f["resplits"])), f"{f['tok_s']:,.0f}",
             f"{total:,.0f}", f"{drift:.0%}", f"{f['tok_s'] / total:.3f}", f["share_ms"],
             f"{1000 * args.global_batch * args.seq / f['tok_s']:.0f}", f"{share:,.0f}",
             f"{f['tok_s'] / share:.3f}"]
            for rnd, name, f, total, drift, share in runs]  # fmt: skip
    summary = []
    for name, _, _ in MODES:
        fr = [f["tok_s"] / total for _, n, f, total, _, _ in runs if n == name]
        fs = [f["tok_s"] / share for _, n, f, _, _, share in runs if n == name]
        summary.append([name, str(len(fr)), f"{statistics.median(fr):.3f}", f"{min(fr):.3f}",
                        f"{max(fr):.3f}", f"{statistics.median(fs):.3f}", f"{min(fs):.3f}",
                        f"{max(fs):.3f}"])  # fmt: skip
    body = (table(["measurement"] + [f"rank {r} solo tokens/s" for r in range(args.world)],
                  [[("before the first fleet" if i == 0 else f"after fleet {i}")]
                   + [f"{v:,.0f}" for v in row] for i, row in enumerate(solos)])
            + "\n\n"
            + table(["round", "split", "first", "last", "re-splits", "fleet tokens/s",
                     "sum of solo rates (mean of the two around it)", "solo drift across it",
                     "of the sum", "solo step ms at the shares (per rank)", "fleet step ms",
                     "sum of solo rates at the last split's shares",
                     "of that sum"], rows)
            + "\n\n"
            + table(["split", "runs", "median of the sum", "min", "max",
                     "median at the shares", "min", "max"], summary)
            + "\n")
    notes = [f"{args.preset}, global batch {args.global_batch} windows of {args.seq}, "
             f"{args.steps} steps per fleet, rebalance_every={args.every}; fleet tokens/s = "
             f"global batch x seq / median step wall over the second half of the steps (rank 0)",
             f"EMULATION: --slow {args.slow}: that rank sleeps FACTOR x its own compute each step "
             f"and its start-up matmul rate is divided by 1 + FACTOR (emulate_slow)",
             "every process one torch thread; the solo rates are measured one rank at a time, "
             "before the first fleet and after each fleet; a fleet's fraction divides by the "
             "mean of the two measurements around it (a drift over 10% says: this box's speed "
             "moved; repeat)",
             ("at the shares: right after each fleet, each rank alone on the windows it held "
              "at that fleet's last split (batch = its share, 8 steps, the median of the last "
              "6), summed; a rank pays the whole optimizer step per step there as in the fleet, "
              "so this sum is what the same ranks with the same work could do without each "
              "other, and a fraction under 1 is the fleet's own cost: waiting for the slower "
              "rank (the split's imbalance), the all-reduce, and on one box the ranks sharing "
              "its cores' cache and memory bandwidth, which each solo run had alone")]
    return report("Mixed fleet (CPU emulation)", machine_lines(torch.device("cpu"), command),
                  body, notes)
