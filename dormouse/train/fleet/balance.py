"""Re-balancing a mixed fleet while it trains: the split of one global batch follows each
rank's measured compute, and never exceeds what fits a rank's memory.

* `StepTimer` — this rank's compute per step: from the step's start to the moment its last
  parameter gradient was accumulated (a post-accumulate-grad hook), so the time a fast rank
  spends in DDP's all-reduce waiting for a slow one is not counted; CUDA events on a card.
  `emulate_slow` (EMULATION, for the CPU box) sleeps inside that interval.
* `Balancer` — the policy, a pure function of the ranks' gathered timings (the deterministic
  gate g28 drives it with injected times): each rank's rate is the median of its last
  `rebalance_every` per-window times; the split is `split_capped` of those rates; it is taken
  only when the predicted step time falls by more than `rebalance_threshold` (hysteresis).
* `split_capped` / `rank_window_cap` / `memory_caps` — the proportional split under per-rank
  memory caps (windows a rank can hold at once, from the --fit memory model).
* `FleetStream` — the loop's data stream on a fleet: at a re-split every rank rebuilds its
  stream at the new offset at the same position and replaces its DPContext, on the same step;
  its state (position and the split in force) goes into the checkpoint, so a resume continues
  the split it stopped in. The bytes of a step do not depend on the split (train/data.py's layout).
* `fleet_table` — rank 0's one table of the fleet.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..context import DistError, DPContext, RankShape, accumulate, packed_split

log = logging.getLogger(__name__)


# ---- the split -------------------------------------------------------------------------------


def split_capped(
    rates: Sequence[float], total: int, caps: Sequence[int | None] | None = None
) -> tuple[list[int], list[int]]:
    """(`total` windows split in proportion to `rates`, the ranks a cap decided).

    Without caps this is fleet.split_by_rates. With caps, a rank whose proportional share
    exceeds its cap is fixed at the cap and the rest is split over the others by their rates,
    repeated until no share exceeds its cap (water-filling): memory bounds, speed shares.
    """
    from .launch import split_by_rates

    n = len(rates)
    caps = list(caps) if caps is not None else [None] * n
    room = sum(c if c is not None else total for c in caps)
    if room < total or any(c is not None and c < 1 for c in caps):
        raise DistError(
            f"the fleet's memory caps {caps} (windows a step per rank) hold {room} windows, "
            f"fewer than the global batch of {total}: lower --set global_batch or batch, or "
            f"add a card"
        )
    fixed: dict[int, int] = {}
    while True:
        free = [i for i in range(n) if i not in fixed]
        left = total - sum(fixed.values())
        part = split_by_rates([rates[i] for i in free], left) if free else []
        over = [i for i, b in zip(free, part) if caps[i] is not None and b > caps[i]]
        if not over:
            out = [0] * n
            for i, b in zip(free, part):
                out[i] = b
            for i, c in fixed.items():
                out[i] = c
            return out, sorted(fixed)
        for i in over:
            fixed[i] = caps[i]


def rank_window_cap(run, usable_bytes: int, world: int) -> int:
    """The most windows one forward of `run` may take on a rank with `usable_bytes`: the
    fleet's one question to the memory model (`fit.max_share`, per rank, with DDP's buckets
    or FSDP2's shards as the run's dist_shard says)."""
    from ..plan import fit

    return fit.max_share(run, usable_bytes, world=world, shard=run.train.dist_shard)


def budget_bytes(run, device: torch.device) -> int | None:
    """This rank's memory budget for the cap: --fit GB if given, else a card's total memory
    (both through fit.usable_bytes' headroom); None on the CPU (host memory is not the bound)."""
    from ..plan import fit

    if run.train.fit_gb:
        return fit.usable_bytes(run.train.fit_gb)
    if device.type == "cuda":
        return fit.usable_bytes(torch.cuda.get_device_properties(device).total_memory / 2**30)
    return None


# ---- timing one rank's compute ------------------------------------------------------------------


class StepTimer:
    """Seconds of this rank's compute in one step: start() -> the last gradient accumulated.

    DDP launches a bucket's all-reduce as its gradients become ready and waits for them only
    at the end of backward, so the last post-accumulate-grad hook marks where this rank's
    own work ended, before any wait for a slower peer. On a card two CUDA events (re-recorded,
    read at the next start, when the step is long done) time the device, not the launches.
    `slow` > 0 is the CPU box's EMULATION of a slower card: sleep `slow` x this rank's own
    recent compute (its EMA per window) inside the timed interval.
    """

    def __init__(self, model: torch.nn.Module, device: torch.device, slow: float = 0.0):
        self.cuda = device.type == "cuda"
        self.slow = float(slow)
        self.t0 = self.last = None
        self.slept = 0.0
        self.windows = 0
        self.ema = None  # seconds of unthrottled compute per window
        if self.cuda:
            self.ev0 = torch.cuda.Event(enable_timing=True)
            self.ev1 = torch.cuda.Event(enable_timing=True)
        self.handles = [
            p.register_post_accumulate_grad_hook(self._ready)
            for p in model.parameters()
            if p.requires_grad
        ]

    def _ready(self, _p) -> None:
        if self.t0 is None:
            return
        if self.cuda:
            self.ev1.record()
            self.last = True
        else:
            self.last = time.perf_counter()

    def start(self, windows: int) -> None:
        self.windows, self.last, self.slept = windows, None, 0.0
        if self.cuda:
            self.ev0.record()
        self.t0 = time.perf_counter()
        if self.slow > 0 and self.ema is not None:
            self.slept = self.slow * self.ema * windows
            time.sleep(self.slept)

    def stop(self) -> float | None:
        """The last started step's compute seconds (None: no step, or no gradient seen)."""
        if self.t0 is None or self.last is None:
            self.t0 = None
            return None
        if self.cuda:
            self.ev1.synchronize()
            seconds = self.ev0.elapsed_time(self.ev1) / 1000.0
            if self.slow > 0:
                seconds = max(seconds, time.perf_counter() - self.t0)  # the sleep stalls launches
        else:
            seconds = self.last - self.t0
        self.t0 = None
        own = max(seconds - self.slept, 1e-9) / max(1, self.windows)
        self.ema = own if self.ema is None else 0.8 * self.ema + 0.2 * own
        return seconds

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


# ---- the policy ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    step: int
    old: tuple[int, ...]
    new: tuple[int, ...]  # == old when the split is kept
    per_window: tuple[float, ...]  # each rank's median compute seconds per window
    capped: tuple[int, ...] = ()  # ranks whose share memory, not speed, decided
    caps: tuple[int | None, ...] = ()
    why: str = ""

    @property
    def switched(self) -> bool:
        return self.new != self.old

    def predicted(self, split: Sequence[int]) -> float:
        """The step's compute time under `split`: its slowest rank's."""
        return max(b * s for b, s in zip(split, self.per_window))

    def line(self) -> str:
        rates = ", ".join(f"{1 / s:.1f}" for s in self.per_window)
        head = (
            f"rebalance step={self.step}: {_text(self.old)} -> {_text(self.new)}"
            if self.switched
            else f"rebalance step={self.step}: split {_text(self.old)} kept"
        )
        mem = ""
        if self.capped:
            mem = "; memory, not speed, decided " + ", ".join(
                f"rank {r} (cap {self.caps[r]} windows)" for r in self.capped
            )
        return (
            f"{head} (rates {rates} windows/s; predicted step "
            f"{1000 * self.predicted(self.old):.1f} ms -> "
            f"{1000 * self.predicted(self.new):.1f} ms{mem}; {self.why})"
        )


def _text(split: Sequence[int]) -> str:
    return ",".join(map(str, split))


#: A rank's rate is the median over this many periods' steps (since the last switch): measured
#: on the injected times of gate g28, one period's 20 steps (+-20% noise) left the ratio of two
#: ranks' rates 4-5% uncertain and 4 of 10 seeds flapped at the 5% threshold; four periods
#: halve that. A card that changes speed moves the median within about two periods.
KEEP_PERIODS = 4


class RateMeter:
    """One rank's recent compute seconds per window: the median of the last `keep` steps,
    emptied at a re-split (the first step after one, and after a start, is dropped: its
    allocations and first-touch are no steady state)."""

    def __init__(self, keep: int):
        self.samples: collections.deque = collections.deque(maxlen=max(1, keep))
        self.skip = 1

    def add(self, seconds: float | None, windows: int) -> None:
        if seconds is None or not seconds > 0:
            return
        if self.skip:
            self.skip -= 1
            return
        self.samples.append(seconds / windows)

    def reset(self) -> None:
        self.samples.clear()
        self.skip = 1

    def value(self) -> float:
        return statistics.median(self.samples) if self.samples else float("nan")


class Balancer:
    """Every rank holds one and feeds it the same gathered numbers: the same decision."""

    def __init__(
        self,
        total: int,
        threshold: float,
        caps: Sequence[int | None] | None = None,
        micro: Sequence[int] | None = None,
    ):
        """`caps`: windows a step each rank's memory holds (None: no cap); `micro`: each rank's
        micro-batch cap under global_batch (None: a share is one forward), so that a new
        share is one `accumulate` runs in few full micro-batches (context.packed_split)."""
        self.total, self.threshold = int(total), float(threshold)
        self.caps = tuple(caps) if caps is not None else None
        self.micro = tuple(micro) if micro is not None else None

    def decide(self, step: int, split: Sequence[int], per_window: Sequence[float]) -> Decision:
        old = tuple(int(b) for b in split)
        pw = tuple(float(s) for s in per_window)
        new, capped = split_capped([1.0 / s for s in pw], self.total, self.caps)
        new = tuple(new)
        packed = ""
        if self.micro is not None:
            raw, new = new, packed_split(new, pw, self.micro, self.caps)
            if new != raw:
                packed = (
                    f"; the rates' split {_text(raw)} moved to shares that accumulate in "
                    f"full micro-batches of <= {_text(self.micro)}"
                )
        caps = self.caps or (None,) * len(old)
        d = Decision(step, old, new, pw, tuple(capped), caps)
        d = self._said(d, old, new, caps)
        return dataclasses.replace(d, why=d.why + packed) if packed else d

    def _said(self, d: Decision, old, new, caps) -> Decision:
        over_cap = any(c is not None and b > c for b, c in zip(old, caps))
        if new == old:
            return dataclasses.replace(d, why="already the rate-proportional split")
        gain = 1.0 - d.predicted(new) / d.predicted(old)
        if over_cap:
            return dataclasses.replace(d, why="the split in force exceeds a memory cap")
        if gain > self.threshold:
            return dataclasses.replace(
                d, why=f"{100 * gain:.1f}% shorter > threshold {100 * self.threshold:.1f}%"
            )
        return dataclasses.replace(
            d,
            new=old,
            why=f"{100 * gain:.1f}% shorter <= threshold "
            f"{100 * self.threshold:.1f}%: not worth a switch",
        )


# ---- forced splits and the knobs -------------------------------------------------------------


def parse_schedule(text: str, world: int, total: int) -> dict[int, tuple[int, ...]]:
    """`rebalance_at` "STEP:B0,B1,...;..." -> {step: split}; each split sums to the global batch."""
    out: dict[int, tuple[int, ...]] = {}
    for item in filter(None, (p.strip() for p in text.split(";"))):
        try:
            step, shares = item.split(":")
            split = tuple(int(b) for b in shares.split(","))
            step = int(step)
        except ValueError:
            raise DistError(
                f"rebalance_at={text!r}: {item!r} is not STEP:B0,B1,... (e.g. "
                f"4:{','.join(['1'] * world)})"
            ) from None
        if len(split) != world or min(split) < 1 or sum(split) != total or step < 0:
            raise DistError(
                f"rebalance_at={text!r}: {item!r} must give each of {world} ranks >= 1 window "
                f"at a step >= 0, {total} windows in all (the global batch)"
            )
        out[step] = split
    return out


# ---- the loop's stream on a fleet -------------------------------------------------------------


class FleetStream:
    """This rank's data stream, re-split on the fleet's agreed steps (module docstring).

    The loop reads `ctx` after each `next()`: a re-split replaces the DPContext (frozen) with
    one of the new shapes, so its offset, loss scale and fleet loss are the new split's.
    """

    def __init__(self, data, ctx: DPContext, run, model: torch.nn.Module):
        self.data, self.ctx, self.run = data, ctx, run
        t = run.train
        self.micro = t.batch if t.global_batch else None  # None: a share is one micro-batch
        self.inner = self._stream(ctx)
        self.total = sum(s.windows for s in ctx.shapes)
        self.schedule: dict[int, tuple[int, ...]] = {}
        self.every = 0
        self.timer = self.meter = self.balancer = None
        if ctx.world == 1:
            return
        seqs = {s.seq_len for s in ctx.shapes}
        self.schedule = parse_schedule(t.rebalance_at, ctx.world, self.total)
        auto = t.dist_capacity.strip().lower() == "auto"
        off = ""
        if len(seqs) > 1:
            off = f"ranks read windows of different lengths ({sorted(seqs)})"
        elif ctx.shard == "fsdp":
            off = (
                "dist_shard=fsdp: its ranks must run equal micro-batch counts and its "
                "forwards all-gather, so a rank's compute cannot be timed apart from waiting"
            )
        if off and self.schedule:
            raise DistError(
                f"rebalance_at={t.rebalance_at!r} cannot re-split this fleet: {off}; "
                f"drop rebalance_at"
            )
        budget = budget_bytes(run, ctx.device)
        cap = rank_window_cap(run, budget, ctx.world) if budget is not None else 0
        rows = _gather_objects(ctx, _card_row(run, ctx, cap))
        self.rows = rows
        caps = [r["cap"] or None for r in rows]
        # with global_batch a share runs in micro-batches: memory bounds the micro-batch,
        # not the share; without it a share is one forward and memory bounds the share
        self.micro_caps = [min(t.batch, c) if c else t.batch for c in caps]
        self.caps = None if t.global_batch else caps
        if auto and t.rebalance_every and not self.schedule:
            if off:
                log.info(f"rebalance off: {off} (the start-up split stays)")
            else:
                self.every = int(t.rebalance_every)
        from .launch import parse_slow  # a fleet only: one process never imports launch.py

        slow = parse_slow(t.emulate_slow, ctx.rank)
        if slow:
            log.info(
                f"emulate_slow: rank {ctx.rank} sleeps {slow:g} x its own compute every "
                f"step (EMULATION of a slower card, not a measurement of one)",
                extra={"every_rank": True},
            )
        if self.every or slow:
            self.timer = StepTimer(model, ctx.device, slow)
            self.meter = RateMeter(KEEP_PERIODS * (self.every or 1))
            self.balancer = Balancer(
                self.total,
                t.rebalance_threshold,
                self.caps,
                self.micro_caps if self.micro else None,
            )
        log.info(f"rank {ctx.rank}: {_row_text(rows[ctx.rank])}", extra={"every_rank": True})
        split = [s.windows for s in ctx.shapes]
        if self.caps and any(c is not None and b > c for b, c in zip(split, self.caps)):
            # the start-up split (matmul rates or by hand) overflows a card: capped at once
            new, capped = split_capped(split, self.total, self.caps)
            log.info(
                f"memory caps {self.caps}: start-up split {_text(split)} -> {_text(new)}; "
                f"memory, not speed, decided rank(s) {', '.join(map(str, capped))}"
            )
            self._switch(tuple(new))
        log.info(fleet_table(rows, [s.windows for s in self.ctx.shapes], None))

    # -- the stream interface the loop uses ----------------------------------------------------

    @property
    def position(self) -> int:
        return self.inner.position

    def check_source(self) -> None:
        self.inner.check_source()

    def next(self):
        step = self.inner.position
        if self.timer is not None:
            self.meter.add(self.timer.stop(), self.timer.windows)
        if step in self.schedule:
            new = self.schedule[step]
            if new != self._split():
                log.info(
                    f"rebalance step={step}: {_text(self._split())} -> {_text(new)} "
                    f"(forced by rebalance_at)"
                )
                self._switch(new)
        elif self.every and step > 0 and step % self.every == 0:
            self._rebalance(step)
        if self.timer is not None:
            self.timer.start(self.ctx.shape.windows)
        return self.inner.next()

    __next__ = next

    def __iter__(self):
        return self

    def state_dict(self) -> dict:
        return {**self.inner.state_dict(), "split": list(self._split()), "world": self.ctx.world}

    def load_state_dict(self, sd: dict) -> None:
        self.inner.load_state_dict(sd)
        saved = tuple(sd.get("split") or ())
        # a checkpoint of this fleet continues its split; another world keeps join's (the
        # bytes of a step are the same under any split of the same global batch)
        if (
            self.ctx.world > 1
            and sd.get("world") == self.ctx.world
            and sum(saved) == self.total
            and saved != self._split()
        ):
            log.info(
                f"resume: the checkpoint's split {_text(saved)} replaces {_text(self._split())}"
            )
            self._switch(saved)

    # -- re-splitting ------------------------------------------------------------------------------

    def _split(self) -> tuple[int, ...]:
        return tuple(s.windows for s in self.ctx.shapes)

    def _shape(self, r: int, windows: int) -> RankShape:
        seq = self.ctx.shapes[r].seq_len
        if self.micro is None:
            return RankShape(windows, seq)
        return accumulate(windows, self.micro_caps[r], seq)

    def _switch(self, split: Sequence[int]) -> None:
        from .launch import refuse_uneven_fsdp

        shapes = tuple(self._shape(r, b) for r, b in enumerate(split))
        refuse_uneven_fsdp(shapes, self.ctx.shard)
        pos = self.inner.state_dict()
        self.ctx = dataclasses.replace(self.ctx, shapes=shapes)
        self.inner = self._stream(self.ctx)
        self.inner.load_state_dict(pos)  # the same position: only which rows this rank reads
        if self.meter is not None:
            self.meter.reset()

    def _stream(self, ctx: DPContext):
        s = ctx.shape
        return self.data.train_stream(s.windows, s.seq_len, offset=ctx.offset, stride=ctx.stride)

    def _rebalance(self, step: int) -> None:
        from .launch import agree_values

        per_window = agree_values([self.meter.value()], self.ctx.device)  # the ONE collective
        if not all(math.isfinite(s) and s > 0 for s in per_window):
            return  # a rank without a measured step since the last switch (a resume): wait
        d = self.balancer.decide(step, self._split(), per_window)
        log.info(d.line())
        if d.switched:
            log.info(fleet_table(self.rows, d.new, d.per_window))
            self._switch(d.new)


# ---- each card speaks for itself -----------------------------------------------------------------


def _card_row(run, ctx: DPContext, cap: int) -> dict:
    from ...model.arms import require_arms
    from ..plan.device import fallback_count, policy_for, probe_device

    dev = ctx.device
    card = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    pol = policy_for(probe_device(dev))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(
        ctx.compute, torch.float32
    )
    kda, moe = require_arms(run.model, dev, dtype)
    return {
        "rank": ctx.rank,
        "card": card,
        "dtype": ctx.compute,
        "rung": pol.rung,
        "fallbacks": fallback_count(),
        "fallback": pol.fallback,
        "kda": kda.name,
        "moe": moe.name,
        "cap": cap,
        "share": ctx.shape.windows,
    }


def _row_text(row: dict) -> str:
    fb = (
        f", counted fp32 fallbacks {row['fallbacks']} ({row['fallback']})"
        if row["fallback"]
        else ""
    )
    cap = f"memory cap {row['cap']} windows" if row["cap"] else "no memory cap (CPU)"
    return (
        f"card={row['card']} dtype={row['dtype']} (rung {row['rung']}{fb}) arms "
        f"kda={row['kda']} moe={row['moe']}; {cap}; start-up share {row['share']} windows"
    )


def _gather_objects(ctx: DPContext, mine: dict) -> list[dict]:
    import torch.distributed as dist

    out: list = [None] * ctx.world
    dist.all_gather_object(out, mine)
    return out


def fleet_table(
    rows: Sequence[dict], split: Sequence[int], per_window: Sequence[float] | None
) -> str:
    """One table: rank, card, dtype, arms, measured rate, share, throughput index (a rank's
    rate over the slowest rank's; '-' before any step is measured)."""
    head = ["rank", "card", "dtype", "arms (kda/moe)", "rate (windows/s)", "share", "index"]
    body = []
    slowest = max(per_window) if per_window else None
    for r, row in enumerate(rows):
        rate = f"{1 / per_window[r]:.1f}" if per_window else "-"
        idx = f"{slowest / per_window[r]:.2f}" if per_window else "-"
        dtype = row["dtype"] + (f" (fallback x{row['fallbacks']})" if row["fallback"] else "")
        body.append(
            [str(r), row["card"], dtype, f"{row['kda']}/{row['moe']}", rate, str(split[r]), idx]
        )
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["fleet:"] + [
        "  " + "  ".join(x.ljust(w) for x, w in zip(line, widths)) for line in [head, *body]
    ]
    return "\n".join(lines)
