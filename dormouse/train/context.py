"""The data-parallel context: who this rank is, which bytes it reads, and the few collectives
the loop needs. In a world of one every collective is the identity and torch.distributed is
never imported.

`DPContext` is frozen: built once (`DPContext.single` for one process, `fleet.join` for a
rank of a fleet) and read by the loop. The loop asks it: this rank's shape and byte offset,
the loss scale that makes the reducer's mean token-weighted, one agreed finiteness verdict,
agreed stops, the fleet loss, the LFB counts' reduction, the host-RAM Engram rows' reduction
(no reducer sees them), the barrier, and whether this rank does rank 0's duties.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..errors import UserError
from ..model.engram import HostTables


class DistError(UserError, RuntimeError):
    """The fleet cannot start or cannot agree; the message names cause, fact and escape."""


class LaunchError(DistError):
    """--dist and the launcher disagree."""


class RefusedError(DistError):
    """A configuration the fleet would run incorrectly; refused rather than run."""


@dataclass(frozen=True)
class RankShape:
    """One rank's share of an optimizer step: `accum` micro-batches of `batch` windows of
    `seq_len` bytes (their gradients summed before the one reduction)."""

    batch: int
    seq_len: int
    accum: int = 1

    @property
    def windows(self) -> int:
        return self.batch * self.accum

    @property
    def tokens(self) -> int:
        return self.windows * self.seq_len

    @property
    def window_bytes(self) -> int:
        return self.windows * (self.seq_len + 1)

    def line(self) -> str:
        return f"{self.batch}x{self.seq_len}" + (f"*{self.accum}" if self.accum > 1 else "")


def accumulate(share: int, cap: int, seq_len: int) -> RankShape:
    """`share` windows per step as the fewest equal micro-batches of at most `cap` windows:
    k = the smallest divisor of share with share / k <= cap (k = 1 when the share fits)."""
    k = next(k for k in range(-(-share // cap), share + 1) if share % k == 0)
    return RankShape(share // k, seq_len, k)


def packed(share: int, cap: int) -> bool:
    """Whether `accumulate` runs `share` in at most twice the fewest micro-batches `cap`
    allows (ceil(share / cap)). A share with no divisor that near does not: 67 at a cap of 16
    (67 is prime) runs as 67 micro-batches of one window, each paying a whole forward's fixed
    cost, where 64 or 70 run as 4 or 5 full ones."""
    fewest = -(-share // cap)
    return any(share % k == 0 for k in range(fewest, 2 * fewest + 1))


def unpacked_lines(shapes: Sequence[RankShape], cap: int) -> list[str]:
    """One warning line per share that `accumulate` runs in more than twice the fewest
    micro-batches of at most `cap` windows (`packed`), naming the nearest packed shares."""
    out = []
    for r, s in enumerate(shapes):
        if s.accum == 1 or packed(s.windows, cap):
            continue
        lo = next(b for b in range(s.windows - 1, 0, -1) if packed(b, cap))
        hi = next(b for b in range(s.windows + 1, 2 * s.windows + cap) if packed(b, cap))
        who = f"rank {r}: " if len(shapes) > 1 else ""
        out.append(
            f"{who}{s.windows} windows a step in micro-batches of at most {cap} run as "
            f"{s.accum} micro-batches of {s.batch} (the fewest equal ones that divide "
            f"{s.windows}; {-(-s.windows // cap)} would do), each paying a forward's fixed "
            f"cost: a share of {lo} or {hi} windows runs as "
            f"{accumulate(lo, cap, s.seq_len).line()} or "
            f"{accumulate(hi, cap, s.seq_len).line()} (set global_batch or --capacity)"
        )
    return out


def packed_split(
    split: Sequence[int],
    per_window: Sequence[float],
    caps: Sequence[int],
    limits: Sequence[int | None] | None = None,
) -> tuple[int, ...]:
    """The split of sum(split) windows nearest `split` whose every share is `packed` at its
    rank's micro-batch cap (`caps`), chosen for the shortest predicted step (max over ranks of
    share x seconds per window) and then the least total move from `split`. Each share stays
    within a few micro-batches of its own, and under its `limits` (windows; None: none).
    `split` itself when it is packed already or no packed split lies that near."""
    split = tuple(int(b) for b in split)
    if all(packed(b, c) for b, c in zip(split, caps)):
        return split
    total, n = sum(split), len(split)
    limits = list(limits) if limits is not None else [None] * n
    options = []
    for b, c, lim in zip(split, caps, limits):
        reach = 2 * -(-b // c) + c  # room for packed shares on both sides
        top = min(total, b + reach, lim if lim is not None else total)
        options.append([v for v in range(max(1, b - reach), top + 1) if packed(v, c)])
    # best[s]: (predicted step, moved, shares) over the ranks so far, s windows given out
    best: dict[int, tuple[float, int, tuple[int, ...]]] = {0: (0.0, 0, ())}
    for r in range(n):
        nxt: dict[int, tuple[float, int, tuple[int, ...]]] = {}
        for s, (t, moved, shares) in best.items():
            for v in options[r]:
                if s + v > total:
                    break
                cand = (max(t, v * per_window[r]), moved + abs(v - split[r]), (*shares, v))
                if s + v not in nxt or cand[:2] < nxt[s + v][:2]:
                    nxt[s + v] = cand
        best = nxt
    return best[total][2] if total in best else split


@dataclass(frozen=True)
class DPContext:
    device: torch.device
    shapes: tuple[RankShape, ...]
    rank: int = 0
    world: int = 1
    backend: str = ""  # "" in one process; gloo | nccl on a fleet
    reduce: str = "fp32"  # the gradient reduce dtype (dist_reduce, resolved)
    shard: str = "none"  # none (DDP) | fsdp (FSDP2)
    bucket_mb: float = 0.0  # 0 = sized from the payload (link.bucket_mb_for)
    compute: str = "fp32"  # the forward's dtype, for the joining line
    #: every rank's compute dtype, in rank order (gathered at join; () in one process): a
    #: rank computing fp16 makes the whole fleet carry one loss scale (scaler.loss_scaled)
    computes: tuple[str, ...] = ()
    #: the fleet's watchdog (watchdog.Heartbeat); None in one process
    heartbeat: object | None = field(default=None, compare=False, repr=False)

    @classmethod
    def single(
        cls, device: torch.device, batch: int, seq_len: int, global_batch: int = 0
    ) -> DPContext:
        """One process: `global_batch` windows a step (0: `batch`) in micro-batches of at
        most `batch`."""
        shape = accumulate(global_batch or batch, batch, seq_len)
        return cls(torch.device(device), (shape,))

    def __post_init__(self):
        if len(self.shapes) != self.world or not 0 <= self.rank < self.world:
            raise DistError(f"rank {self.rank} of {self.world} with {len(self.shapes)} shapes")

    # -- what this rank reads ----------------------------------------------------------------

    @property
    def shape(self) -> RankShape:
        return self.shapes[self.rank]

    @property
    def is_main(self) -> bool:
        """Rank 0: evaluates, logs, writes the run folder."""
        return self.rank == 0

    @property
    def offset(self) -> int:
        """Where this rank's bytes start inside the fleet's block of a step."""
        return sum(s.window_bytes for s in self.shapes[: self.rank])

    @property
    def stride(self) -> int:
        """Bytes the whole fleet consumes per step."""
        return sum(s.window_bytes for s in self.shapes)

    @property
    def global_tokens(self) -> int:
        return sum(s.tokens for s in self.shapes)

    @property
    def loss_scale(self) -> float:
        """world * t_micro / sum(t) on each micro-batch's mean loss: summed over this rank's
        micro-batches and averaged by the reducer, the gradient is the token-weighted mean
        over the whole global batch."""
        return self.world * self.shape.batch * self.shape.seq_len / self.global_tokens

    @property
    def eval_on_all_ranks(self) -> bool:
        """FSDP2 all-gathers parameters inside forward: every rank runs the eval forward."""
        return self.shard == "fsdp" and self.world > 1

    # -- the collectives (the identity at world 1) ---------------------------------------------

    def _agree(self, flag: bool, op: str) -> bool:
        if self.world == 1:
            return bool(flag)
        import torch.distributed as dist

        x = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
        return bool(x.item())

    def all_finite(self, finite: bool) -> bool:
        """ONE collective: a rank that skipped alone would leave its parameters behind."""
        return self._agree(finite, "MIN")

    def all_finite_on_device(self, ok: torch.Tensor) -> torch.Tensor:
        """all_finite without the host: this rank's bool verdict tensor -> the fleet's (an
        all-reduce MIN on the device, queued like any other kernel)."""
        if self.world == 1:
            return ok
        import torch.distributed as dist

        x = ok.to(torch.int32).reshape(1)
        dist.all_reduce(x, op=dist.ReduceOp.MIN)
        return x.reshape(()).bool()

    def any_rank(self, flag: bool) -> bool:
        """True when `flag` holds on any rank (a stop: every rank stops on the same step)."""
        return self._agree(flag, "MAX")

    def fleet_loss(self, loss: torch.Tensor) -> float:
        """sum_r t_r * loss_r / sum_r t_r: the loss of the global batch, on every rank."""
        if self.world == 1:
            return float(loss)
        import torch.distributed as dist

        x = loss.detach().to(device=self.device, dtype=torch.float64).reshape(1) * self.shape.tokens
        dist.all_reduce(x)
        return float(x.item()) / self.global_tokens

    def sum_all(self, values: list[float]) -> list[float]:
        """Each value summed over the fleet in float64, on every rank (identity at world 1)."""
        if self.world == 1:
            return [float(v) for v in values]
        import torch.distributed as dist

        x = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(x)
        return [float(v) for v in x.tolist()]

    @property
    def lfb_reduce(self):
        """Passed to model.lfb_update: sums the routers' counts over the fleet, in place, so
        every rank moves its bias identically (None: one process, nothing to sum)."""
        if self.world == 1:
            return None
        import torch.distributed as dist

        return dist.all_reduce

    def reduce_host_grads(self, model: torch.nn.Module) -> None:
        """After backward: every rank installs the fleet's gradient of the host-RAM Engram rows
        (no reducer sees them; without this each rank would step its own rows). The union of
        the ranks' rows, each row's gradient summed in rank order and divided by world, in
        fp32 whatever dist_reduce says (the exact mean; rows are small next to the payload)."""
        if self.world == 1:
            return
        for store in host_stores(model):  # the same stores in the same order on every rank
            rows, grad = store.pending()
            store.replace_pending(*self._fleet_rows(rows, grad, store.dim))

    def _fleet_rows(self, rows: torch.Tensor, grad: torch.Tensor, dim: int):
        """All-gather every rank's (rows, grad) and merge them (`merge_row_grads`). all_gather
        wants equal sizes: counts first, then rows and gradients padded to the largest."""
        import torch.distributed as dist

        dev, world = self.device, self.world
        count = torch.tensor([rows.numel()], dtype=torch.int64, device=dev)
        counts = [torch.zeros_like(count) for _ in range(world)]
        dist.all_gather(counts, count)
        counts = [int(c) for c in torch.cat(counts).tolist()]
        most = max(counts)
        if most == 0:  # no rank has a row (step 0: the Engram conv starts at zero)
            return rows, grad
        k = rows.numel()
        pad_rows = torch.full((most,), -1, dtype=torch.int64, device=dev)
        pad_rows[:k] = rows.to(dev)
        pad_grad = torch.zeros(most, dim, dtype=torch.float32, device=dev)
        pad_grad[:k] = grad.to(dev, torch.float32)
        all_rows = [torch.empty_like(pad_rows) for _ in range(world)]
        all_grad = [torch.empty_like(pad_grad) for _ in range(world)]
        dist.all_gather(all_rows, pad_rows)
        dist.all_gather(all_grad, pad_grad)
        parts = [(r[:n], g[:n]) for r, g, n in zip(all_rows, all_grad, counts)]
        return merge_row_grads(parts, world)

    def barrier(self) -> None:
        if self.world == 1:
            return
        import torch.distributed as dist

        # First wait in the store, watched by the heartbeat: rank 0 may evaluate or write a
        # large checkpoint for longer than dist_timeout, and that is no hang while it beats.
        if self.heartbeat is not None:
            self.heartbeat.gather()
        if self.backend == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def describe(self) -> str:
        if self.world == 1:
            return f"single process, shape={self.shape.line()}"
        shapes = ",".join(s.line() for s in self.shapes)
        return (
            f"rank {self.rank}/{self.world} backend={self.backend} shapes={shapes} "
            f"reduce={self.reduce} shard={self.shard}"
        )

    def line(self) -> str:
        """The one line every rank of a fleet prints when it joins."""
        return (
            f"dist rank={self.rank}/{self.world} backend={self.backend} "
            f"device={self.device} shape={self.shape.line()} dtype={self.compute} "
            f"reduce={self.reduce} shard={self.shard}"
        )


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 (DTensor) tensor; a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def host_stores(model: torch.nn.Module) -> list[HostTables]:
    """The model's host-RAM Engram stores, in module order (the same on every rank)."""
    return [m for m in model.modules() if isinstance(m, HostTables)]


def merge_row_grads(
    parts: Sequence[tuple[torch.Tensor, torch.Tensor]], world_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fleet's gradient of host-table rows from every rank's (rows, grad), in rank order.

    parts[r] = (rows [K_r] distinct, grad [K_r, dim]): rank r's touched rows and their
    gradient. Returns (union [K] ascending, mean [K, dim]): each union row's gradient summed
    over the ranks that have it, rank 0 first, then divided by world_size -- the mean DDP
    takes of a parameter's gradient, so with the loss scaled by world_size * t_r / sum(t) it
    is the gradient one process sees at the global batch. The sum runs as one add per rank
    (gather the union rows, add, put back; no atomics), so every rank that merges the same
    parts gets the same bits, on any device.
    """
    if not parts:
        raise ValueError("merge_row_grads needs at least one rank's (rows, grad)")
    dim = parts[0][1].shape[-1]
    for r, (rows, grad) in enumerate(parts):
        if rows.dim() != 1 or grad.dim() != 2 or tuple(grad.shape) != (rows.numel(), dim):
            raise ValueError(
                f"merge_row_grads: rank {r} has rows {tuple(rows.shape)} and grad "
                f"{tuple(grad.shape)}; each rank needs rows [K] and grad [K, {dim}]"
            )
        if rows.unique().numel() != rows.numel():
            raise ValueError(
                f"merge_row_grads: rank {r} lists a row twice ({rows.numel()} rows, "
                f"{rows.unique().numel()} distinct); a rank's set must be summed per row first "
                f"(HostTables.pending is)"
            )
    union, inv = torch.unique(
        torch.cat([rows for rows, _ in parts]), sorted=True, return_inverse=True
    )
    grads = [grad for _, grad in parts]
    out = grads[0].new_zeros(union.numel(), dim)
    start = 0
    for grad in grads:
        pos = inv[start : start + grad.shape[0]].to(out.device)
        start += grad.shape[0]
        out.index_copy_(0, pos, out.index_select(0, pos).add_(grad.to(out.dtype)))
    return union, out.div_(world_size)


class OneStream:
    """One process's data stream: the data's own, read at the context it was built for. A
    fleet's (fleet/balance.py FleetStream) re-splits the batch and replaces its context; one
    process never does, and never imports the balancer."""

    def __init__(self, data, ctx: DPContext, run=None, model=None):  # FleetStream's signature
        s = ctx.shape
        self.inner = data.train_stream(s.windows, s.seq_len, offset=ctx.offset, stride=ctx.stride)
        self.ctx = ctx

    @property
    def position(self) -> int:
        return self.inner.position

    def check_source(self) -> None:
        self.inner.check_source()

    def next(self):
        return self.inner.next()

    def state_dict(self) -> dict:  # the keys a fleet's stream saves too: either resumes it
        return {**self.inner.state_dict(), "split": [self.ctx.shape.windows], "world": 1}

    def load_state_dict(self, sd: dict) -> None:
        self.inner.load_state_dict(sd)
