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

Both baselines above are timed minutes away from the fleet, one rank at a time, where a
shared box's speed moves by as much as the effect. The third (`--side S`, on by default)
is timed inside each fleet run: every `--every` steps all ranks stop together, each trains
its own solo trainer on the whole global batch for S seconds side by side with the others,
and they resume; each segment of fleet steps is divided by the summed solo rates of the two
blocks around it, seconds apart, taken while the ranks share the box as the fleet's do.
`--micro B` runs every step, solo and fleet, as micro-batches of at most B windows, so a
window costs the same at the whole batch and at a share (in one forward, a window's cost
moves with the batch: the forward's fixed part and the cache).

    python -m dormouse bench fleet --world 2 --slow 1:1.0 --global-batch 96 --micro 16 \
        --seq 64 --steps 48 --every 8 --rounds 3
"""

from __future__ import annotations

import itertools
import logging
import math
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
    ap.add_argument(
        "--rounds", type=int, default=1, help="repeat the three splits this many times (default 1)"
    )
    ap.add_argument(
        "--micro",
        type=int,
        default=0,
        help="run every step (solo and fleet) as micro-batches of at most this many "
        "windows, so a window costs the same at any share (0: each rank's share "
        "in one forward; default 0)",
    )
    ap.add_argument(
        "--side",
        type=float,
        default=2.0,
        help="seconds of each side-by-side solo block inside a fleet run, every "
        "--every steps (0: none; default 2.0)",
    )


def _sets(args, windows: int, extra=()) -> list[str]:
    """`windows` a step: one forward, or with --micro B micro-batches of at most B."""
    rows = (
        [f"batch={min(args.micro, windows)}", f"global_batch={windows}"]
        if args.micro
        else [f"batch={windows}"]
    )
    return [
        f"seq_len={args.seq}",
        *rows,
        "eval_every=0",
        "ckpt_every=0",
        "log_every=1000",
        "dtype=fp32",
        *args.set,
        *extra,
    ]


def _trainer(preset: str, sets: list[str], slow: str, rank: int, draws: int):
    """One rank's solo trainer (its emulation on): (one, tokens a step, its timer), where
    one() trains the next step on the next of `draws` random batches and returns its wall
    seconds."""
    from ..train.fleet.balance import StepTimer
    from ..train.fleet.launch import parse_slow
    from .common import build, windows

    run = configure(preset, sets)
    model, step, _ = build(run, torch.device("cpu"))
    timer = StepTimer(model, torch.device("cpu"), parse_slow(slow, rank))
    data = windows(run, draws)
    n = run.train.global_batch or run.train.batch
    done = [0]

    def one() -> float:
        i = done[0]
        done[0] += 1
        t0 = time.perf_counter()
        timer.start(n)
        step(i, data[i % len(data)])
        timer.stop()
        return time.perf_counter() - t0

    return one, n * run.train.seq_len, timer


def _solo(args, rank: int, share: int | None = None) -> float:
    """tokens/s of this rank alone on the whole global batch, or on `share` windows a step
    (its emulation on)."""
    one, tokens, timer = _trainer(
        args.preset, _sets(args, share or args.global_batch), args.slow, rank, 8
    )
    walls = [one() for _ in range(8)]
    timer.remove()
    return tokens / statistics.median(walls[2:])


def _side_by_side(preset: str, sets: list[str], slow: str, rank: int):
    """This rank's solo trainer inside its fleet process (the whole global batch, as one
    forward or with --micro in micro-batches, its emulation on), warmed by one step:
    `block(seconds)` trains it alone for at least that long (2 steps at least) and returns its
    tokens/s there."""
    one, tokens, _ = _trainer(preset, sets, slow, rank, 4)
    one()  # the warm step: first-use costs, and the emulation's first compute figure

    def block(seconds: float) -> float:
        walls: list[float] = []
        t0 = time.perf_counter()
        while len(walls) < 2 or time.perf_counter() - t0 < seconds:
            walls.append(one())
        return tokens * len(walls) / sum(walls)

    return block


def _rank(
    rank: int,
    world: int,
    port: int,
    sets: list[str],
    preset: str,
    out: str,
    side: tuple | None = None,
) -> None:
    """One fleet rank. side = (solo sets, emulate_slow, every, seconds): every `every` steps
    all ranks stop together (a barrier), each trains its own solo trainer alone for `seconds`
    side by side with the others, and they resume together; the fleet's step walls leave
    those blocks out."""
    import json

    import torch.distributed as dist

    from ..config import apply_sets
    from ..config import preset as load
    from ..train.run import train_run
    from ..train.step import Callbacks

    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
        }
    )
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
    blocks: list[dict] = []  # {"after": steps done, "rate": solo tokens/s, "resume": clock}
    solo = _side_by_side(preset, side[0], side[1], rank) if side else None

    def after(info):
        stamps.append(time.perf_counter())
        splits.append(",".join(str(s.windows) for s in info["ctx"].shapes))
        if solo is not None and len(stamps) % side[2] == 0:
            dist.barrier()
            rate = solo(side[3])
            dist.barrier()
            blocks.append({"after": len(stamps), "rate": rate, "resume": time.perf_counter()})

    computes = _record_compute(stamps)
    run = apply_sets(load(preset), sets + [f"out_dir={out}/run{rank}"])
    if solo is not None:  # the first fleet step starts with the other ranks' too
        blocks.append({"after": 0, "rate": solo(side[3]), "resume": None})
    train_run(run, device_type="cpu", callbacks=Callbacks(after_step=after))
    Path(out, f"rank{rank}.json").write_text(
        json.dumps(
            {
                "stamps": stamps,
                "splits": splits,
                "lines": lines if rank == 0 else [],
                "blocks": blocks,
                "computes": computes,
            }
        )
    )


def _record_compute(stamps: list[float]) -> dict[int, float]:
    """{step: this rank's timed compute seconds}, as the fleet's balancer times it (its
    StepTimer: the step's start to the last gradient accumulated, an emulated sleep
    included, waiting for a peer not), read as the loop's stream stops the timer at the start
    of the next step; only a fleet whose ranks all time themselves (re-balancing, or an
    emulated slow rank) fills it. The side-by-side trainer's timer is another instance."""
    from ..train.fleet import balance

    out: dict[int, float] = {}
    init, take = balance.FleetStream.__init__, balance.StepTimer.stop

    def fleet_init(self, *a, **kw):
        init(self, *a, **kw)
        if self.timer is not None:
            self.timer.bench_steps = stamps

    def stop(self):
        seconds = take(self)
        done = getattr(self, "bench_steps", None)
        if done is not None and seconds is not None and done:
            out[len(done) - 1] = seconds  # stopped at the start of step len(done)
        return seconds

    balance.FleetStream.__init__, balance.StepTimer.stop = fleet_init, stop
    return out


def _walls(stamps: list[float], blocks: list[dict]) -> list[float | None]:
    """Step i's wall (i >= 1) from the end of step i-1, or from the end of the side-by-side
    block run right after it; None for step 0 (no start stamp)."""
    resume = {b["after"]: b["resume"] for b in blocks if b["resume"] is not None}
    return [None] + [b - resume.get(i, a) for i, (a, b) in enumerate(itertools.pairwise(stamps), 1)]


def _fleet(args, capacity: str, every: int) -> dict:
    import json

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tempfile.mkdtemp(prefix="dormouse-bench-fleet-")
    sets = _sets(
        args,
        args.global_batch,
        [
            f"global_batch={args.global_batch}",
            "dist=true",
            f"dist_capacity={capacity}",
            f"rebalance_every={every}",
            f"emulate_slow={args.slow}",
            f"steps={args.steps}",
        ],
    )
    side = (
        (_sets(args, args.global_batch), args.slow, args.every, args.side)
        if args.side > 0 and args.every > 0
        else None
    )
    mp.start_processes(
        _rank,
        (args.world, port, sets, args.preset, out, side),
        nprocs=args.world,
        join=True,
        start_method="spawn",
    )
    got = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.world)]
    for g in got:  # json wrote the step keys as strings
        g["computes"] = {int(k): v for k, v in g["computes"].items()}
    walls = _walls(got[0]["stamps"], got[0]["blocks"])
    half = len(walls) // 2
    tail = walls[half:]  # the second half: after the re-balancer settled
    res = {
        "tok_s": args.global_batch * args.seq / statistics.median(tail),
        "start": got[0]["splits"][0],
        "end": got[0]["splits"][-1],
        # a taken re-split says "OLD -> NEW" before its rates; a kept split says "kept"
        "resplits": [
            ln
            for ln in got[0]["lines"]
            if ln.startswith("rebalance") and "->" in ln.split(" (rates")[0]
        ],
    }
    if side:
        res.update(_side_fractions(args, walls, [g["blocks"] for g in got], half))
    res.update(_where(walls, got[0]["splits"], [g["computes"] for g in got], half))
    return res


def _where(walls: list, splits: list[str], computes: list[dict], half: int) -> dict:
    """Where the fleet's step goes, second half, from each rank's own timed compute (only
    where every rank timed itself): the median step wall; the median of the slowest rank's
    compute that step (the step's floor at this split); the median of wall - that floor (the
    fleet's own cost: all-reduce wait past the last gradient, clip, verdict, optimizer, the
    loop); and the step the ranks' in-fleet rates would give at a perfect split, the global
    batch over the sum of each rank's median windows per compute second."""
    steps = [
        i
        for i in range(max(half, 1), len(walls))
        if walls[i] is not None and all(i in c for c in computes)
    ]
    if not steps:  # the last step's compute is never read (no next step stops its timer)
        return {"where_n": 0}
    shares = {i: [int(w) for w in splits[i].split(",")] for i in steps}
    floor = [max(c[i] for c in computes) for i in steps]
    rates = [statistics.median(shares[i][r] / c[i] for i in steps) for r, c in enumerate(computes)]
    total = sum(shares[steps[0]])
    wall = statistics.median(walls[i] for i in steps)
    return {
        "where_n": len(steps),
        "wall_ms": 1000 * wall,
        "floor_ms": 1000 * statistics.median(floor),
        "own_ms": 1000 * statistics.median(walls[i] - f for i, f in zip(steps, floor)),
        "ideal_ms": 1000 * total / sum(rates),
    }


def _where_row(rnd: int, name: str, f: dict) -> list[str] | None:
    if not f.get("where_n"):
        return None
    return [
        str(rnd),
        name,
        f["end"],
        f"{f['wall_ms']:.0f}",
        f"{f['floor_ms']:.0f}",
        f"{f['own_ms']:.0f} ({f['own_ms'] / f['wall_ms']:.1%})",
        f"{f['ideal_ms']:.0f}",
        f"{f['ideal_ms'] / f['wall_ms']:.3f} (n={f['where_n']})",
    ]


def _side_cells(f: dict) -> list[str]:
    if not f.get("side_n"):
        return ["-", "-"]
    return [f"{f['side_sum']:,.0f}", f"{f['side']:.3f} (n={f['side_n']})"]


def _side_fractions(args, walls: list, blocks: list[list[dict]], half: int) -> dict:
    """The fleet against its ranks side by side: each segment of fleet steps between two
    side-by-side blocks, at the median step wall of its steps, over the mean of the two blocks'
    summed solo rates; the median over the segments that start in the second half."""
    after = [b["after"] for b in blocks[0]]
    tokens = args.global_batch * args.seq
    fracs, sums = [], []
    for k in range(len(after) - 1):
        lo, hi = after[k], after[k + 1]
        seg = [w for w in walls[max(lo, 1) : hi] if w is not None]
        if lo < half or not seg:
            continue
        total = sum((r[k]["rate"] + r[k + 1]["rate"]) / 2 for r in blocks)
        sums.append(total)
        fracs.append(tokens / statistics.median(seg) / total)
    return {
        "side_sum": statistics.median(sums) if sums else float("nan"),
        "side": statistics.median(fracs) if fracs else float("nan"),
        "side_n": len(fracs),
    }


def run(args, command: str) -> str:
    if args.global_batch < 16:
        log.info(
            "note: a global batch under 16 windows cannot split 2:1 finely (8 windows: 5/3 "
            "at best, 0.89 of the sum)"
        )
    if args.rounds < 1:
        raise UserError(f"bench fleet: --rounds {args.rounds}; give at least 1")
    if not 0 <= args.micro <= args.global_batch:
        raise UserError(
            f"bench fleet: --micro {args.micro} with --global-batch "
            f"{args.global_batch}; give 0 (one forward a share) or 1 .. "
            f"{args.global_batch}"
        )
    if not (args.side >= 0 and math.isfinite(args.side)):
        raise UserError(
            f"bench fleet: --side {args.side}; give the seconds of a side-by-side "
            "block, >= 0 (0: none)"
        )
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
            got["share_ms"] = "/".join(
                f"{1000 * w * args.seq / x:.0f}" if x else "-" for w, x in zip(shares, rates)
            )
            solos.append([_solo(args, r) for r in range(args.world)])
            a, b = solos[-2], solos[-1]
            total = sum((x + y) / 2 for x, y in zip(a, b))
            drift = max(abs(x - y) / max(x, y) for x, y in zip(a, b))
            runs.append((rnd, name, got, total, drift, at_share))
    rows = [
        [
            str(rnd),
            name,
            f["start"],
            f["end"],
            str(len(f["resplits"])),
            f"{f['tok_s']:,.0f}",
            f"{total:,.0f}",
            f"{drift:.0%}",
            f"{f['tok_s'] / total:.3f}",
            f["share_ms"],
            f"{1000 * args.global_batch * args.seq / f['tok_s']:.0f}",
            f"{share:,.0f}",
            f"{f['tok_s'] / share:.3f}",
            *_side_cells(f),
        ]
        for rnd, name, f, total, drift, share in runs
    ]
    summary = []
    for name, _, _ in MODES:
        fr = [f["tok_s"] / total for _, n, f, total, _, _ in runs if n == name]
        fs = [f["tok_s"] / share for _, n, f, _, _, share in runs if n == name]
        fb = [f["side"] for _, n, f, _, _, _ in runs if n == name and f.get("side_n")]
        summary.append(
            [
                name,
                str(len(fr)),
                f"{statistics.median(fr):.3f}",
                f"{min(fr):.3f}",
                f"{max(fr):.3f}",
                f"{statistics.median(fs):.3f}",
                f"{min(fs):.3f}",
                f"{max(fs):.3f}",
                *(
                    [f"{statistics.median(fb):.3f}", f"{min(fb):.3f}", f"{max(fb):.3f}"]
                    if fb
                    else ["-", "-", "-"]
                ),
            ]
        )
    body = (
        table(
            ["measurement"] + [f"rank {r} solo tokens/s" for r in range(args.world)],
            [
                [("before the first fleet" if i == 0 else f"after fleet {i}")]
                + [f"{v:,.0f}" for v in row]
                for i, row in enumerate(solos)
            ],
        )
        + "\n\n"
        + table(
            [
                "round",
                "split",
                "first",
                "last",
                "re-splits",
                "fleet tokens/s",
                "sum of solo rates (mean of the two around it)",
                "solo drift across it",
                "of the sum",
                "solo step ms at the shares (per rank)",
                "fleet step ms",
                "sum of solo rates at the last split's shares",
                "of that sum",
                "side-by-side solo sum (second half)",
                "of the side-by-side sum (median of its segments)",
            ],
            rows,
        )
        + "\n\n"
        + table(
            [
                "split",
                "runs",
                "median of the sum",
                "min",
                "max",
                "median at the shares",
                "min",
                "max",
                "median side by side",
                "min",
                "max",
            ],
            summary,
        )
        + "\n"
    )
    where = [w for w in (_where_row(rnd, name, f) for rnd, name, f, *_ in runs) if w]
    if where:
        body += (
            "\n"
            + table(
                [
                    "round",
                    "split",
                    "last",
                    "fleet step ms",
                    "slowest rank's compute ms (the floor)",
                    "over the floor: the fleet's own cost ms",
                    "step at the in-fleet rates' sum ms",
                    "of the fleet step",
                ],
                where,
            )
            + "\n"
        )
    notes = [
        f"{args.preset}, global batch {args.global_batch} windows of {args.seq}, "
        + (
            f"in micro-batches of at most {args.micro} (solo and fleet alike), "
            if args.micro
            else "each rank's share in one forward, "
        )
        + f"{args.steps} steps per fleet, rebalance_every={args.every}; fleet tokens/s = "
        f"global batch x seq / median step wall over the second half of the steps (rank 0)",
        f"EMULATION: --slow {args.slow}: that rank sleeps FACTOR x its own compute each step "
        f"and its start-up matmul rate is divided by 1 + FACTOR (emulate_slow)",
        "every process one torch thread; the solo rates are measured one rank at a time, "
        "before the first fleet and after each fleet; a fleet's fraction divides by the "
        "mean of the two measurements around it (a drift over 10% says: this box's speed "
        "moved; repeat)",
        (
            "at the shares: right after each fleet, each rank alone on the windows it held "
            "at that fleet's last split (batch = its share, 8 steps, the median of the last "
            "6), summed; a rank pays the whole optimizer step per step there as in the fleet, "
            "so this sum is what the same ranks with the same work could do without each "
            "other, and a fraction under 1 is the fleet's own cost: waiting for the slower "
            "rank (the split's imbalance), the all-reduce, and on one box the ranks sharing "
            "its cores' cache and memory bandwidth, which each solo run had alone"
        ),
        (
            f"side by side: inside each fleet run, every {args.every} steps all ranks stop "
            f"together and each trains its own solo trainer (the whole global batch, its "
            f"emulation on) for {args.side:g} s at the same time as the others, then they "
            "resume together (those blocks are left out of the fleet's walls); each segment "
            "of fleet steps is divided by the mean of the summed solo rates of the two blocks "
            "around it, seconds apart, so the box's drift cancels, and the solo ranks share "
            "the box as the fleet's ranks do; the median over the segments in the second "
            "half (n in the cell)"
            if args.side > 0
            else "side by side: off (--side 0)"
        ),
        (
            "where the step goes (last table; fleets whose ranks all time themselves, i.e. "
            "re-balancing): each rank's compute per step as its balancer times it (the step's "
            "start to its last gradient, the emulated sleep included), second half; the floor "
            "is the slowest rank's compute that step, what is over it the fleet's own cost "
            "(the all-reduce's tail, the clip, the verdict, the optimizer, the loop), and the "
            "in-fleet rates' step the global batch over the sum of the ranks' median windows "
            "per compute second: the step of a perfect split with no per-step cost or noise. "
            "Drift-free (every figure from the same steps), but timed by the code under test"
        ),
    ]
    return report(
        "Mixed fleet (CPU emulation)", machine_lines(torch.device("cpu"), command), body, notes
    )
