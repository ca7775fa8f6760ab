"""Data parallelism on N ranks: launch rules, backend, capacity, the fleet's seams, refusals.

Owns everything that makes the single-process loop (`loop.py`) a fleet member:

* `check_launch` — the two launch mismatches (--dist without a fleet, a fleet without --dist).
* `choose_backend` — nccl on CUDA, gloo on the CPU; NCCL missing on CUDA is an error, never gloo.
* `parse_capacity` / `split_by_rates` / `measure_rate` — each rank's micro-batch
  (`"4,2"`, `"4x512,2x512"`, `auto` = split the global batch by measured matmul rates).
* `refuse_incompatible` — what the fleet cannot (yet) do correctly, refused with cause and escape.
* `Parallel` — the loop's seams (`seams.Seams`) filled in with collectives: the loss scale
  world_size * t_r / sum(t), ONE all-reduce for the non-finite decision, the token-weighted
  fleet loss, DDP (reduce dtype `dist_reduce`, buckets from `bucket_mb_for`) or FSDP2
  `fully_shard`, the LFB counts summed over the fleet, the host-RAM Engram rows (engram_ram)
  reduced by hand after backward, and full (gathered) checkpoint state that one process can
  reload.
* `merge_row_grads` — the pure arithmetic of that row reduction (union, rank-order sum, mean).
* `Heartbeat` — the watchdog: each rank's pulse in the store and its watch over the others'
  (a stalled or dead rank, a lost store or launcher ends every rank within dist_timeout), and
  the barrier that lets rank 0 evaluate or save for as long as it beats.
* `agreement_fields` / `disagreement` — what every rank must share (every config field but
  PER_RANK_FIELDS, the capacity split, the data's bytes), refused naming fields and ranks.
* `init_parallel` (probe -> policy -> process group -> heartbeat -> agreement -> capacity)
  and `train_dist`, the entry the CLI calls under torchrun.

Everything else the fleet runs is the single-process loop; the gates in `gates/` hold the
two together against hand-written references.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import logging
import math
import os
import re
import socket
import sys
import threading
import time
from datetime import timedelta
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from ..config import RunConfig, validate
from ..errors import UserError
from ..model.engram import HostTables
from .data import rank_byte_offset  # noqa: F401  (re-exported: the fleet's data layout)
from .checkpoint import pid_alive
from .seams import RankShape, Seams

__all__ = [
    "DistError", "LaunchError", "RefusedError", "NCCL_SAFE_ENV", "check_launch",
    "choose_backend", "parse_capacity", "split_by_rates", "measure_rate",
    "refuse_incompatible", "merge_row_grads", "Parallel", "init_parallel", "train_dist",
    "rank_byte_offset",
]  # fmt: skip


class DistError(UserError, RuntimeError):
    """The fleet cannot start or cannot agree; the message names cause, fact and escape."""


class LaunchError(DistError):
    """--dist and the launcher disagree."""


class RefusedError(DistError):
    """A configuration the fleet would run incorrectly; refused rather than run."""


#: Set (if unset) in every rank's environment before the process group starts. NVLink
#: multicast (NVLS) and symmetric-memory multicast are off: on shared or virtualised hosts
#: they fail at the first collective or hang, and a PCIe fleet gains nothing from them.
NCCL_SAFE_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

_LAUNCH = "torchrun --standalone --nproc_per_node=N -m dormouse train PRESET --dist ..."


# ---- launch ---------------------------------------------------------------------------


def _world_from(env: Mapping[str, str]) -> int | None:
    raw = env.get("WORLD_SIZE")
    if raw is None or raw.strip() == "":
        return None
    try:
        world = int(raw)
    except ValueError:
        raise LaunchError(
            f"WORLD_SIZE={raw!r} is not an integer; launch the fleet with {_LAUNCH}"
        ) from None
    if world < 1:
        raise LaunchError(f"WORLD_SIZE={world} must be >= 1; launch the fleet with {_LAUNCH}")
    return world


def check_launch(dist_flag: bool, env: Mapping[str, str]) -> bool:
    """True when this process is a fleet rank. Refuses both halves of a launch mismatch."""
    world = _world_from(env)
    if dist_flag and (world is None or world == 1):
        fact = "WORLD_SIZE is not set" if world is None else "WORLD_SIZE=1"
        raise LaunchError(
            f"--dist asks to join a fleet, but {fact}: there is no fleet to join. Launch N ranks "
            f"with `{_LAUNCH}`, or drop --dist to train in this one process"
        )
    if not dist_flag and world is not None and world > 1:
        raise LaunchError(
            f"WORLD_SIZE={world} (this process is one of {world} launched ranks) but --dist is "
            f"not given: {world} independent runs would train on the same bytes and overwrite "
            f"one checkpoint. Add --dist to train as one fleet, or launch with plain python"
        )
    if dist_flag:
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
        if missing:
            raise LaunchError(
                f"--dist with WORLD_SIZE={world} but {', '.join(missing)} not set: the rank "
                f"cannot find its fleet. Launch with `{_LAUNCH}` (torchrun sets them)"
            )
    return bool(dist_flag)


def choose_backend(device_type: str, nccl_available: bool | None = None) -> str:
    """nccl for CUDA ranks, gloo for CPU ranks. Never falls back from nccl to gloo."""
    if device_type == "cpu":
        return "gloo"
    if device_type == "cuda":
        if nccl_available is None:
            nccl_available = dist.is_available() and dist.is_nccl_available()
        if not nccl_available:
            raise DistError(
                f"this torch ({torch.__version__}) was built without NCCL, and a CUDA fleet "
                f"needs it: gloo would move every gradient through host memory at a fraction of "
                f"the link's speed, a different run under the same flags, so it is not used as a "
                f"fallback. Install a CUDA build of torch with NCCL (the pytorch.org wheels have "
                f"it), or run the fleet on the CPU with --device cpu"
            )
        return "nccl"
    raise DistError(
        f"device type {device_type!r} has no data-parallel backend here; use --device cuda "
        f"(nccl) or --device cpu (gloo)"
    )


# ---- capacity ---------------------------------------------------------------------------

_ENTRY = re.compile(r"\s*([0-9]+)\s*(?:[xX]\s*([0-9]+))?\s*", re.ASCII)


def split_by_rates(rates: Sequence[float], global_batch: int) -> list[int]:
    """Split `global_batch` samples over ranks in proportion to `rates`.

    The total is exact and every rank gets at least one sample. Ranks start at
    max(1, floor(share)); the surplus or deficit is then settled one sample at a time by
    the largest distance from the ideal share (ties to the lower rank), so the split is
    the proportional one wherever the minimum of one sample does not bind.
    """
    n = len(rates)
    if n < 1:
        raise ValueError("split_by_rates needs at least one rank's rate")
    bad = [r for r in rates if not (isinstance(r, (int, float)) and math.isfinite(r) and r > 0)]
    if bad:
        raise ValueError(
            f"capacity auto: every measured rate must be a positive finite number, got "
            f"{list(rates)}; a rank whose matmul could not be timed cannot be given a share "
            f"(give the profile by hand with --capacity B0,B1,...)"
        )
    if global_batch < n:
        raise ValueError(
            f"capacity auto: a global batch of {global_batch} cannot give each of {n} ranks at "
            f"least one sample; raise --set batch (the global batch is batch * world_size)"
        )
    top = float(max(rates))  # normalised first: a sum of huge rates must not overflow
    scaled = [r / top for r in rates]
    total = sum(scaled)
    ideal = [global_batch * r / total for r in scaled]
    out = [max(1, int(math.floor(q))) for q in ideal]
    while sum(out) > global_batch:
        i = max((i for i in range(n) if out[i] > 1), key=lambda i: (out[i] - ideal[i], -i))
        out[i] -= 1
    while sum(out) < global_batch:
        i = max(range(n), key=lambda i: (ideal[i] - out[i], -i))
        out[i] += 1
    return out


def parse_capacity(
    spec: str,
    world_size: int,
    batch: int,
    seq_len: int,
    max_seq_len: int,
    rates: Sequence[float] | None = None,
) -> list[RankShape]:
    """The per-rank micro-batches of a fleet, from `--capacity`.

    ""            every rank takes `batch` windows of `seq_len` (total batch * world_size)
    "4,2"         one batch per rank, each at `seq_len` (total 6)
    "4x512,2x256" batch x window length per rank (a length must be <= max_seq_len)
    "auto"        split batch * world_size by `rates` (each rank's measured matmul rate)
    Anything else is a ValueError naming the problem.
    """
    if not isinstance(spec, str):
        raise ValueError(f"--capacity must be text, got {type(spec).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: a fleet has at least one rank")
    if batch < 1 or seq_len < 1:
        raise ValueError(f"batch={batch} and seq_len={seq_len} must both be >= 1")
    if seq_len > max_seq_len:
        raise ValueError(f"seq_len={seq_len} exceeds the model's max_seq_len={max_seq_len}")
    text = spec.strip()
    if text == "":
        return [RankShape(batch, seq_len) for _ in range(world_size)]
    if text.lower() == "auto":
        if rates is None:
            raise ValueError(
                "--capacity auto needs each rank's measured rate; init_parallel measures and "
                "all-gathers them (pass rates= when calling parse_capacity directly)"
            )
        if len(rates) != world_size:
            raise ValueError(f"capacity auto: {len(rates)} rates for {world_size} ranks")
        return [RankShape(b, seq_len) for b in split_by_rates(rates, batch * world_size)]
    parts = text.split(",")
    if len(parts) != world_size:
        raise ValueError(
            f"--capacity {spec!r} names {len(parts)} rank(s) but the fleet has {world_size}; "
            f"give one entry per rank (e.g. {','.join(['4'] * world_size)}) or 'auto'"
        )
    shapes = []
    for r, part in enumerate(parts):
        m = _ENTRY.fullmatch(part)
        if not m:
            raise ValueError(
                f"--capacity {spec!r}: entry {r} ({part!r}) is not B or BxT (two positive "
                f"integers, e.g. 4 or 4x512)"
            )
        b = int(m.group(1))
        t = int(m.group(2)) if m.group(2) is not None else seq_len
        if b < 1:
            raise ValueError(f"--capacity {spec!r}: rank {r} has batch {b}; every rank needs >= 1")
        if not 1 <= t <= max_seq_len:
            raise ValueError(
                f"--capacity {spec!r}: rank {r} asks for windows of {t} bytes; the model takes "
                f"1..{max_seq_len} (max_seq_len)"
            )
        shapes.append(RankShape(b, t))
    return shapes


def measure_rate(device: torch.device | str, reps: int = 5) -> float:
    """This device's matmul rate in FLOP/s, timed on a fixed square product.

    CUDA: 4096^3 in the card's best half dtype (bf16 from sm_80, fp16 from sm_53, else fp32).
    CPU: 256^3 fp32, small enough to take milliseconds. Only the RATIO between ranks matters.
    """
    device = torch.device(device)
    if device.type == "cuda":
        n = 4096
        cap = torch.cuda.get_device_capability(device)
        dtype = (torch.bfloat16 if cap >= (8, 0)
                 else torch.float16 if cap >= (5, 3) else torch.float32)  # fmt: skip
    else:
        n, dtype = 256, torch.float32
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    torch.mm(a, b)  # warm-up: kernel selection and first-touch allocation
    sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    sync()
    seconds = max(time.perf_counter() - t0, 1e-9)
    return 2.0 * n**3 * reps / seconds


# ---- refusals ---------------------------------------------------------------------------


def refuse_incompatible(run: RunConfig, world_size: int) -> None:
    """Refuse what a fleet of `world_size` ranks would run incorrectly (cause and escape).

    Allowed on purpose: the LFB controller (its counts are summed over the fleet by
    `Parallel.lfb_reduce`, gate g11), host-RAM Engram tables under DDP (their rows are
    reduced by `Parallel.after_backward`, gate g14), a data mixture (its source for step s
    is a hash of (seed, s), so every rank picks the same source: gate g20), and the
    capacity-padded MoE (its cap and drops are decided per row, so splitting the global
    batch across ranks changes no drop: gate g23).
    """
    if world_size <= 1:
        return
    m, t = run.model, run.train
    fleet = f"a fleet of {world_size} ranks"
    if m.engram_ram and t.dist_shard == "fsdp":
        raise RefusedError(
            f"engram_ram=true with dist_shard=fsdp on {fleet}: the host rows' gradient is a "
            f"plain tensor while FSDP2's are DTensor shards, and the optimizer's clip cannot "
            f"take one norm over both (measured failure: '_foreach_norm got mixed torch.Tensor "
            f"and DTensor'); only the DDP path is gated (g14). Use --set dist_shard=none (DDP "
            f"reduces the host rows exactly), or engram_ram=false to keep FSDP2"
        )
    if t.dist_shard == "fsdp" and t.opt != "adamw":
        raise RefusedError(
            f"dist_shard=fsdp with opt={t.opt}: FSDP2 shards parameters as DTensors, and the "
            f"batched Muon keeps one plain stacked momentum per shape group and needs each full "
            f"matrix for its polar (no shard-aware Muon exists; measured failure: '_foreach_add_ "
            f"got mixed torch.Tensor and DTensor'). Use --set opt=adamw to keep FSDP2, or "
            f"--set dist_shard=none (DDP) to keep Muon"
        )
    if t.dist_shard == "fsdp" and t.optim_8bit:
        raise RefusedError(
            "dist_shard=fsdp with optim_8bit=true: bitsandbytes' AdamW8bit steps plain CUDA "
            "tensors, not FSDP2's DTensor shards. Use --set optim_8bit=false or dist_shard=none"
        )
    if t.compile:
        raise RefusedError(
            f"compile=true on {fleet}: torch.compile under DDP/FSDP2 has no gate here (graph "
            f"breaks at the reducer's hooks change what runs), so its result is unverified. "
            f"Use --set compile=false"
        )


# ---- host-RAM Engram rows ---------------------------------------------------------------


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
    union, inv = torch.unique(torch.cat([rows for rows, _ in parts]), sorted=True,
                              return_inverse=True)  # fmt: skip
    grads = [grad for _, grad in parts]
    out = grads[0].new_zeros(union.numel(), dim)
    start = 0
    for grad in grads:
        pos = inv[start:start + grad.shape[0]].to(out.device)
        start += grad.shape[0]
        out.index_copy_(0, pos, out.index_select(0, pos).add_(grad.to(out.dtype)))
    return union, out.div_(world_size)


def host_stores(model: torch.nn.Module) -> list[HostTables]:
    """The model's host-RAM Engram stores, in module order (the same on every rank)."""
    return [m for m in model.modules() if isinstance(m, HostTables)]


# ---- the fleet's seams ------------------------------------------------------------------

_DTYPE_NAMES = {None: "fp32", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
_REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Parallel(Seams):
    """One rank of a data-parallel fleet: the loop's seams, answered with collectives."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        device: torch.device,
        shapes: list[RankShape],
        *,
        backend: str,
        reduce: str = "fp32",
        shard: str = "none",
        bucket_mb: float = 0.0,
        compute: str = "fp32",
        log: Callable[[str], None] = print,
    ):
        super().__init__(shapes)
        if len(shapes) != world_size or not 0 <= rank < world_size:
            raise DistError(f"rank {rank} of {world_size} with {len(shapes)} shapes")
        self.rank, self.world_size = int(rank), int(world_size)
        self.device = torch.device(device)
        self.backend, self.reduce, self.shard = backend, reduce, shard
        self.bucket_mb, self.compute = float(bucket_mb), compute
        # FSDP2 all-gathers parameters inside forward: every rank must run the eval forward.
        self.eval_on_all_ranks = shard == "fsdp"
        self.say = log if self.rank == 0 else (lambda _line: None)
        self.find_unused: bool | None = None

    # -- the seams ---------------------------------------------------------------------

    def after_backward(self, model: torch.nn.Module) -> None:
        """Every rank installs the same host-row gradient: the union of the ranks' rows, each
        row's gradient summed over the ranks in rank order and divided by world_size.

        The host tables are no parameters, so the reducer never sees their rows; without this
        each rank would step its own rows and the fleet would hold N different tables. Rows
        cross in fp32 whatever dist_reduce says (a row's gradient is small next to the dense
        payload, and the fp32 mean is the exact one).
        """
        for store in host_stores(model):  # the same stores in the same order on every rank
            rows, grad = store.pending()
            store.replace_pending(*self._fleet_rows(rows, grad, store.dim))

    def _agree(self, flag: bool, op) -> bool:
        x = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.device)
        dist.all_reduce(x, op=op)
        return bool(x.item())

    def all_finite(self, finite: bool) -> bool:
        # ONE collective: a rank that skipped alone would leave its parameters behind.
        return self._agree(finite, dist.ReduceOp.MIN)

    def any_rank(self, flag: bool) -> bool:
        # a signal may reach one rank only: the stop must still happen on the same step
        # everywhere, or the others would wait in the next collective for ever
        return self._agree(flag, dist.ReduceOp.MAX)

    def fleet_loss(self, loss: torch.Tensor) -> float:
        """sum_r t_r * loss_r / sum_r t_r: the loss of the global batch, on every rank."""
        x = loss.detach().to(device=self.device, dtype=torch.float64).reshape(1) * self.shape.tokens
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return float(x.item()) / self.global_tokens

    @property
    def lfb_reduce(self):
        def reduce_sum(counts: torch.Tensor) -> None:
            # in place: every rank now holds the fleet's counts and moves its bias identically
            dist.all_reduce(counts, op=dist.ReduceOp.SUM)

        return reduce_sum

    def _fleet_rows(self, rows: torch.Tensor, grad: torch.Tensor, dim: int):
        """All-gather every rank's (rows, grad) and merge them (`merge_row_grads`).

        all_gather wants equal sizes: the counts go first, then rows and gradients padded to
        the largest count. Everything travels on the fleet's device (nccl needs CUDA tensors).
        """
        dev, world = self.device, self.world_size
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

    def _broadcast_host(self, model: torch.nn.Module) -> None:
        """Rank 0's host tables and their Adam state become every rank's, as DDP (and the
        FSDP2 wrap below) does for parameters: the reducer never sees these tensors."""
        chunk = 1 << 24  # elements per trip through the device on nccl (64 MiB of fp32)
        for store in host_stores(model):
            for t in (store.table, store.exp_avg, store.exp_avg_sq, store.row_step):
                if self.device.type == "cpu":
                    dist.broadcast(t, src=0)
                    continue
                flat = t.view(-1)
                for i in range(0, flat.numel(), chunk):
                    buf = flat[i:i + chunk].to(self.device)
                    dist.broadcast(buf, src=0)
                    flat[i:i + chunk].copy_(buf)

    #: the fleet's watchdog (`Heartbeat`), set by init_parallel; None in a bare Parallel
    heartbeat: Heartbeat | None = None

    def barrier(self) -> None:
        # First wait in the store, watched by the heartbeat: rank 0 may evaluate or write a
        # large checkpoint for longer than dist_timeout while the others wait here, and that
        # is not a hang while it beats. The collective barrier after it then returns at once.
        if self.heartbeat is not None:
            self.heartbeat.gather()
        if self.backend == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    # -- the reducer ---------------------------------------------------------------------

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        self._broadcast_host(model)
        if self.shard == "fsdp":
            return self._wrap_fsdp(model)
        return self._wrap_ddp(model)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
        return model.module if ddp else model

    def _payload_bytes(self, model: torch.nn.Module) -> int:
        per = 4 if self.reduce == "fp32" else 2
        return sum(p.numel() for p in model.parameters() if p.requires_grad) * per

    def _wrap_ddp(self, model):
        from torch.nn.parallel import DistributedDataParallel as DDP

        from .link import bucket_mb_for

        unused = _params_without_grad(model, self.device)
        self.find_unused = bool(unused)
        payload = self._payload_bytes(model)
        mb = self.bucket_mb if self.bucket_mb > 0 else bucket_mb_for(payload)
        # The only buffers are the LFB controller's, kept identical by lfb_reduce; DDP's
        # per-forward broadcast would overwrite every rank's counts with rank 0's. (torch
        # 2.13 renames the switch; 2.11 knows only the old name.)
        no_sync = ({"forward_sync_buffers": False}
                   if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
                   else {"broadcast_buffers": False})  # fmt: skip
        ddp = DDP(
            model,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            bucket_cap_mb=mb,
            find_unused_parameters=self.find_unused,
            **no_sync,
        )
        if self.reduce in ("bf16", "fp16"):
            ddp.register_comm_hook(None, _compress_hook(_REDUCE_DTYPES[self.reduce]))
        why = (f"probe: {len(unused)} parameter(s) got no gradient, e.g. {unused[0]}" if unused
               else "probe: every parameter received a gradient")  # fmt: skip
        self.say(f"ddp: reduce={self.reduce} bucket_cap_mb={mb:.1f} (payload "
                 f"{payload / 2**20:.2f} MiB{'' if self.bucket_mb > 0 else ', bucket_mb_for'}) "
                 f"find_unused_parameters={int(self.find_unused)} ({why})")  # fmt: skip
        return ddp

    def _wrap_fsdp(self, model):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # fully_shard does not broadcast: rank 0's initial values become everyone's here,
        # so a model seeded differently on some rank still starts the fleet in agreement.
        with torch.no_grad():
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t.data, src=0)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        mp = MixedPrecisionPolicy(reduce_dtype=_REDUCE_DTYPES[self.reduce])
        for block in getattr(model, "blocks", []):
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        self.say(f"fsdp2: fully_shard per block + root, reduce={self.reduce}, "
                 f"mesh={self.world_size}")
        return model

    # -- checkpoints: rank 0 writes one file that one process can reload ---------------------

    def model_state(self, net) -> dict:
        if self.shard != "fsdp":
            return super().model_state(net) if self.is_main else {}
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        sd = get_model_state_dict(net, options=opts)  # a collective; full on rank 0 only
        return dict(sd) if self.is_main else {}

    def optimizer_state(self, opt) -> dict:
        if self.shard != "fsdp":
            return opt.state_dict() if self.is_main else {}
        # Gather every DTensor in the optimizer's own state_dict format (the one a
        # single-process MixOptimizer loads), walking it in the same order on every rank.
        full = _gather_tree(opt.state_dict())
        return full if self.is_main else {}

    def load_model_state(self, net, ck: dict, path="") -> None:
        if self.shard != "fsdp":
            return super().load_model_state(net, ck, path)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        from .checkpoint import CheckpointError, shape_mismatch

        diff = shape_mismatch(ck["run"].model, net.cfg) if hasattr(net, "cfg") else []
        if diff:
            raise CheckpointError(f"checkpoint {path} has another model shape: " + "; ".join(diff))
        set_model_state_dict(net, ck["model"], options=StateDictOptions(full_state_dict=True))

    def load_optimizer_state(self, opt, state: dict) -> None:
        super().load_optimizer_state(opt, state)
        if self.shard == "fsdp":
            _shard_optimizer_state(opt)

    def describe(self) -> str:
        shapes = ",".join(s.line() for s in self.shapes)
        return (f"rank {self.rank}/{self.world_size} backend={self.backend} shapes={shapes} "
                f"reduce={self.reduce} shard={self.shard}")  # fmt: skip

    def line(self) -> str:
        """The one line every rank prints when it joins."""
        return (f"dist rank={self.rank}/{self.world_size} backend={self.backend} "
                f"device={self.device} shape={self.shape.line()} dtype={self.compute} "
                f"reduce={self.reduce} shard={self.shard}")  # fmt: skip


def _compress_hook(dtype: torch.dtype):
    """A DDP comm hook: all-reduce each bucket in `dtype` (the mean), then widen it back.

    torch's own bf16 hook refuses anything but NCCL (and its fp16 twin is the same cast); this
    one is the same arithmetic on any backend, so the CPU fleet runs what a card fleet runs.
    """

    def hook(state, bucket):
        buf = bucket.buffer()
        small = buf.to(dtype).div_(dist.get_world_size())
        fut = dist.all_reduce(small, async_op=True).get_future()

        def widen(f):
            out = bucket.buffer()
            out.copy_(f.value()[0])
            return out

        return fut.then(widen)

    return hook


def _params_without_grad(model: torch.nn.Module, device: torch.device) -> list[str]:
    """Names of parameters one small forward/backward leaves without a gradient.

    Run in eval mode (the LFB counts only move in training forwards) on fixed bytes, and the
    gradients are cleared afterwards, so the probe leaves no trace in the model.
    """
    cfg = getattr(model, "cfg", None)
    seq = min(8, getattr(cfg, "max_seq_len", 8))
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randint(0, 256, (1, seq + 1), generator=gen).to(device)
    was = model.training
    model.eval()
    try:
        with torch.enable_grad():
            _, loss, _ = model(x[:, :-1], x[:, 1:])
            loss.backward()
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    finally:
        for p in model.parameters():
            p.grad = None
        for store in host_stores(model):
            store.zero_grad()  # else the probe's host-row gradient joins the first step's
        model.train(was)
    return missing


def _is_dtensor(t) -> bool:
    return hasattr(t, "full_tensor") and hasattr(t, "placements")


def _gather_tree(obj):
    if _is_dtensor(obj):
        return obj.full_tensor().detach().cpu()
    if isinstance(obj, dict):
        return {k: _gather_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_gather_tree(v) for v in obj)
    if torch.is_tensor(obj):
        return obj.detach().cpu().clone()
    return obj


def _shard_optimizer_state(opt) -> None:
    """After loading a full (single-file) state: re-shard each state tensor like its parameter."""
    from torch.distributed.tensor import distribute_tensor

    inner = getattr(opt, "adamw", None) or opt
    for group in inner.param_groups:
        for p in group["params"]:
            st = inner.state.get(p)
            if not st or not _is_dtensor(p):
                continue
            for k, v in list(st.items()):
                if torch.is_tensor(v) and not _is_dtensor(v) and tuple(v.shape) == tuple(p.shape):
                    local = v.to(device=p.to_local().device, dtype=p.dtype)
                    # every rank holds the same full tensor: split locally, no communication
                    st[k] = distribute_tensor(local, p.device_mesh, p.placements,
                                              src_data_rank=None)


# ---- the watchdog -------------------------------------------------------------------------

#: Exit code of a rank its watchdog ends (a stalled or dead peer, a lost store or launcher).
WATCHDOG_EXIT = 3
#: The first step (and everything before it) runs against this collective timeout at least:
#: a first-use kernel autotune on one card may take minutes while the others wait in the
#: first all-reduce, and the heartbeat still ends the fleet within dist_timeout of a rank
#: that stops or dies. From the second step on, every collective waits dist_timeout.
FIRST_STEP_TIMEOUT_S = 3600.0
#: One collective waits this many dist_timeouts (see init_parallel).
COLLECTIVE_TIMEOUT_FACTOR = 2.0


def _short(e: BaseException, n: int = 200) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:n]}{'...' if len(text) > n else ''}"


class Heartbeat:
    """This rank's pulse in the fleet's c10d store, and the watch over its peers' pulses.

    Two daemon threads. The pulse writes (count, step, phase, pid, host) under this rank's
    key every `interval` seconds and reads the peers' keys. The watch never touches the
    network (a store call can block): it ends this process when a peer's pulse has not
    changed for `timeout` seconds (a SIGSTOPped, frozen or killed rank: its threads stop
    too), when the store has not answered for as long (it lives in the torchrun agent, or
    in rank 0), or when the torchrun agent that launched this rank is gone. Ending is one
    line on stderr naming the rank and its last step, then os._exit(WATCHDOG_EXIT): the main
    thread never runs again, and a checkpoint is replaced by rename, so the last one written
    stays whole. A rank that leaves on purpose (done, or an error it reports itself) says
    so, and its peers stop watching it; one the watchdog ended says so, and its peers end too.
    """

    def __init__(self, rank: int, world: int, timeout_s: float, connect: Callable[[], object],
                 prefix: str, *, store_where: str = "the fleet's store",
                 launcher_pid: int | None = None, settle_to: float | None = None):  # fmt: skip
        self.rank, self.world, self.timeout = int(rank), int(world), float(timeout_s)
        self.interval = min(2.0, max(0.05, self.timeout / 10))
        self.connect, self.prefix, self.where = connect, prefix, store_where
        self.launcher_pid, self.settle_to = launcher_pid, settle_to
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.step, self.phase, self.saved = 0, "start", None
        self.state, self.why = "alive", ""
        now = time.monotonic()
        self.last_io = now
        self.seen: dict[int, dict] = {}  # peer -> its last record
        self.changed = {r: now for r in range(self.world) if r != self.rank}
        self.left: dict[int, dict] = {}  # peers that said they left on purpose
        self._halt = threading.Event()
        self._barriers = 0
        self._main = None
        self._threads = [threading.Thread(target=f, name=f"dormouse-{n}-r{rank}", daemon=True)
                         for n, f in (("pulse", self._pulse), ("watch", self._watch))]  # fmt: skip

    # -- what the loop tells it -------------------------------------------------------------

    def at(self, step: int, what: str, saved: int | None = None) -> None:
        self.step, self.phase = int(step), what
        if saved is not None:
            self.saved = int(saved)

    def settled(self) -> None:
        """After the first step: every collective from now on waits `settle_to` at most."""
        if self.settle_to is None:
            return
        seconds, self.settle_to = self.settle_to, None
        self.set_collective_timeout(seconds)

    @staticmethod
    def set_collective_timeout(seconds: float) -> None:
        set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
        if set_timeout is not None:
            try:
                set_timeout(timedelta(seconds=seconds))
            except (RuntimeError, ValueError, AssertionError):  # an older torch or backend
                pass

    # -- lifetime --------------------------------------------------------------------------

    def start(self) -> Heartbeat:
        self._beat_once(self._store())  # a peer that looks before our first pulse finds one
        for t in self._threads:
            t.start()
        return self

    def leave(self, state: str, why: str = "") -> None:
        """Stop both threads; tell the peers this rank left on purpose (done or failed)."""
        if self._halt.is_set():
            return
        self.state, self.why = state, why
        self._halt.set()
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=2 * self.interval + 1)
        self._last_word()

    def _last_word(self) -> None:
        """Write this rank's state once more, waiting at most a second: the store may be gone
        with the fleet (connecting to a dead one retries for its whole timeout)."""

        def say():
            try:
                self._beat_once(self._main if self._main is not None else self.connect())
            except Exception:  # noqa: BLE001
                pass

        t = threading.Thread(target=say, daemon=True)
        t.start()
        t.join(1.0)

    # -- the store -----------------------------------------------------------------------

    def _key(self, r: int) -> str:
        return f"{self.prefix}/beat/{r}"

    def _store(self):
        if self._main is None:
            self._main = self.connect()
        return self._main

    def _record(self, n: int) -> str:

        return json.dumps({"n": n, "step": self.step, "phase": self.phase, "saved": self.saved,
                           "pid": self.pid, "host": self.host, "state": self.state,
                           "why": self.why})  # fmt: skip

    _count = 0

    def _beat_once(self, store) -> None:
        self._count += 1
        store.set(self._key(self.rank), self._record(self._count))

    def _pulse(self) -> None:

        store = None
        while not self._halt.is_set():
            try:
                if store is None:
                    store = self.connect()
                self._beat_once(store)
                for r in list(self.changed):
                    if r in self.left or not store.check([self._key(r)]):
                        continue
                    rec = json.loads(store.get(self._key(r)))
                    old = self.seen.get(r)
                    if old is None or old.get("n") != rec.get("n"):
                        self.changed[r] = time.monotonic()
                    self.seen[r] = rec
                    if rec.get("state") in ("done", "failed"):
                        self.left[r] = rec
                self.last_io = time.monotonic()
            except Exception:  # noqa: BLE001 - a missed round; the watch judges the silence
                store = None
            self._halt.wait(self.interval)

    # -- the watch --------------------------------------------------------------------------

    def _watch(self) -> None:
        tick = time.monotonic()
        while not self._halt.wait(self.interval):
            now, slept = time.monotonic(), time.monotonic() - tick
            tick = now
            if slept > max(3 * self.interval, self.timeout / 2):
                # this process itself was frozen (SIGSTOP, a suspended machine): its view of
                # the peers is stale, not theirs; let the pulse read them again first
                self.last_io = now
                self.changed = {r: now for r in self.changed}
                continue
            if self.launcher_pid is not None and os.getppid() != self.launcher_pid:
                self._end(f"the torchrun agent that launched it (pid {self.launcher_pid}) is "
                          f"gone")  # fmt: skip
            for r, rec in list(self.seen.items()):
                if rec.get("state") == "ended" and r not in self.left:
                    self._end(f"rank {r} ended itself ({rec.get('why')})")
            for r, t in list(self.changed.items()):
                if r in self.left or now - t <= self.timeout:
                    continue
                rec = self.seen.get(r)
                last = (f"its last heartbeat: step {rec['step']} ({rec['phase']})" if rec
                        else "it never sent a heartbeat")  # fmt: skip
                how = ("its process exited" if r in self._dead_peers()
                       else "it stopped, froze or died")  # fmt: skip
                self._end(f"rank {r} has sent no heartbeat for {now - t:.1f} s (dist_timeout="
                          f"{self.timeout:g} s): {how}; {last}")  # fmt: skip
            if now - self.last_io > self.timeout:
                self._end(f"{self.where} has not answered for {now - self.last_io:.1f} s "
                          f"(dist_timeout={self.timeout:g} s)")  # fmt: skip

    def _saved(self) -> str:
        # rank 0 knows its last file; the others know the last save the fleet agreed on
        # (rank 0 may have written a later one since)
        if self.saved is None:
            return "no checkpoint was written by this run yet"
        later = "" if self.rank == 0 else " or later"
        return (f"the last checkpoint (step {self.saved}{later}) is intact: a checkpoint is "
                f"replaced only by rename")

    def _end(self, reason: str) -> None:

        line = (f"dormouse: fleet watchdog on rank {self.rank}: {reason}. This rank was at step "
                f"{self.step} ({self.phase}) and ends now (exit {WATCHDOG_EXIT}), as does every "
                f"rank; {self._saved()}. Find what stopped the rank, then relaunch with --resume "
                f"auto")
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os.write(2, (line + "\n").encode("utf-8", "replace"))
        self.state, self.why = "ended", reason[:300]
        self._last_word()  # the peers end now rather than a dist_timeout later
        os._exit(WATCHDOG_EXIT)

    # -- what the main thread asks ----------------------------------------------------------

    def gather(self) -> None:
        """A barrier in the store: wait for every rank as long as the waited-for rank beats
        (the watch ends the fleet otherwise); a peer that left refuses the wait at once."""
        self._barriers += 1
        store = self._store()
        key = f"{self.prefix}/barrier/{self._barriers}"
        store.add(key, 1)
        delay, polls = 0.001, 0
        while int(store.add(key, 0)) < self.world:
            for r, rec in list(self.left.items()):
                raise DistError(
                    f"rank {r} left the fleet ({rec.get('state')}: {rec.get('why') or 'no reason'}"
                    f") at step {rec.get('step')} while rank {self.rank} waits for it at step "
                    f"{self.step} ({self.phase}); its own message names the cause"
                )
            polls += 1
            if polls % 20 == 0:
                for r in self._dead_peers():
                    rec = self.seen[r]
                    raise DistError(
                        f"rank {r} is gone (its process, pid {rec['pid']} on this host, exited "
                        f"without a word at step {rec.get('step')}) while rank {self.rank} waits "
                        f"for it at step {self.step} ({self.phase}). {self._saved()}; find why "
                        f"it died (out of memory?), then relaunch with --resume auto"
                    )
            time.sleep(delay)
            delay = min(2 * delay, 0.05)

    def _dead_peers(self) -> list[int]:
        """Peers on this host whose process exited without saying they left."""
        return [r for r, rec in list(self.seen.items())
                if r not in self.left and rec.get("state") == "alive"
                and rec.get("host") == self.host and rec.get("pid")
                and not pid_alive(int(rec["pid"]))]  # fmt: skip

    def explain(self, e: BaseException) -> str:
        """One line for a collective (or store call) that failed: what each peer was doing."""
        now = time.monotonic()
        peers, culprits = [], []
        for r in sorted(self.changed):
            rec = self.seen.get(r) or self.left.get(r)
            if rec is None:
                peers.append(f"rank {r} never sent a heartbeat")
                culprits.append(r)
                continue
            silent = now - self.changed[r]
            if rec.get("state") in ("done", "failed", "ended"):
                how = f"left ({rec['state']}: {rec.get('why') or 'no reason'})"
            elif rec.get("host") == self.host and rec.get("pid") and not pid_alive(int(rec["pid"])):
                how = f"is gone (its process, pid {rec['pid']} on this host, exited)"
            elif silent > 3 * self.interval:
                how = f"has been silent for {silent:.1f} s"
            else:
                peers.append(f"rank {r} beats (step {rec.get('step')}, {rec.get('phase')})")
                continue
            culprits.append(r)
            peers.append(f"rank {r} {how}, last at step {rec.get('step')} ({rec.get('phase')})")
        text = str(e)
        if self.launcher_pid is not None and os.getppid() != self.launcher_pid:
            hint = f"the torchrun agent that launched this rank (pid {self.launcher_pid}) is gone"
        elif culprits:
            hint = f"rank {', '.join(map(str, culprits))} stopped"
        elif "imed out" in text:
            hint = ("every peer still beats, so the ranks fell out of step (a bug: please report "
                    "it with the log)")  # fmt: skip
        else:
            hint = (f"a peer or {self.where} dropped its connection (no rank is known to have "
                    f"died here; another host?)")  # fmt: skip
        return (f"rank {self.rank} lost the fleet at step {self.step} ({self.phase}): {hint} "
                f"({'; '.join(peers)}); the failed call: {_short(e, 120)}. {self._saved()}; "
                f"relaunch with --resume auto")


def _fleet_failure(e: BaseException) -> bool:
    """A collective or the store failed (a peer died, a timeout): not a bug in this rank."""
    if isinstance(e, UserError):
        return False
    if isinstance(e, getattr(dist, "DistError", ())):  # DistBackendError, DistStoreError, ...
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(s in text for s in (
        "Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out",
        "timed out", "gloo", "NCCL"))  # fmt: skip


_SESSIONS = 0


def _start_heartbeat(rank: int, world: int, timeout_s: float, settle_to: float | None,
                     env: Mapping[str, str]) -> Heartbeat:  # fmt: skip
    """A Heartbeat on this fleet's store: its own TCPStore clients at MASTER_ADDR:PORT (so a
    blocked call of one thread cannot block another), else the process group's store."""
    global _SESSIONS
    _SESSIONS += 1  # every rank starts the same number of sessions: the keys match
    addr, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
    agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if addr and port:
        io = timedelta(seconds=max(1.0, min(30.0, timeout_s / 2)))

        def connect():
            return dist.TCPStore(addr, int(port), is_master=False, timeout=io)

        where = f"{'the torchrun agent' if agent else 'rank 0'}'s store at {addr}:{port}"
    else:
        store = dist.distributed_c10d._get_default_store()

        def connect():
            return store

        where = "the process group's store"
    restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
    launched = env.get("TORCHELASTIC_RUN_ID") is not None
    return Heartbeat(rank, world, timeout_s, connect, f"dormouse/{restart}/{_SESSIONS}",
                     store_where=where, launcher_pid=os.getppid() if launched else None,
                     settle_to=settle_to).start()  # fmt: skip


# ---- the ranks' agreement -------------------------------------------------------------------

#: Config fields that may differ between ranks, and why. Everything else must agree.
PER_RANK_FIELDS = {
    "out_dir": "only rank 0 writes; a gate gives each rank its own folder to see who writes",
    "device": "every rank maps it to its own card (cuda -> cuda:LOCAL_RANK); the device TYPE "
              "must agree and is compared",
    "data": "a path may be spelled differently on each node; the BYTES behind it must agree "
            "and are compared (size + sampled blocks)",
}


def agreement_fields(run: RunConfig, shapes: Sequence[RankShape], device_type: str,
                     data_prints: Sequence[dict] | None) -> dict[str, str]:  # fmt: skip
    """name -> the text every rank must share: every config field but PER_RANK_FIELDS, the
    capacity split, the device type and the data's fingerprint."""
    out = {"preset/source": run.source}
    out.update({k: repr(v) for k, v in dataclasses.asdict(run.model).items()})
    out.update({k: repr(v) for k, v in dataclasses.asdict(run.train).items()
                if k not in PER_RANK_FIELDS})  # fmt: skip
    out["capacity split"] = ",".join(s.line() for s in shapes)
    out["device type"] = device_type
    out["data bytes"] = (repr([(p["size"], p["digest"]) for p in data_prints])
                         if data_prints is not None else "?")  # fmt: skip
    return out


def _hash60(text: str) -> int:
    return int(hashlib.sha256(text.encode()).hexdigest()[:15], 16)


def disagreement(table: Sequence[Sequence[int]], names: Sequence[str]) -> dict[str, list[int]]:
    """{field: the ranks whose value differs from rank 0's} from every rank's field hashes."""
    out = {}
    for i, name in enumerate(names):
        ranks = [r for r, row in enumerate(table) if row[i] != table[0][i]]
        if ranks:
            out[name] = ranks
    return out


def disagreement_message(diff: Mapping[str, list[int]], mine: Mapping[str, str], rank: int,
                         data_prints: Sequence[dict] | None = None) -> str:  # fmt: skip
    def ranks(rs):
        return f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"

    parts = [f"{k} ({ranks(rs)} differ{'s' if len(rs) == 1 else ''} from rank 0)"
             for k, rs in diff.items()]  # fmt: skip
    here = []
    for k in diff:
        if k == "data bytes" and data_prints:
            here.append("data " + ", ".join(f"{p['path']} ({p['size']} bytes, sampled digest "
                                            f"{p['digest'][:12]})" for p in data_prints))
        else:
            here.append(f"{k}={mine[k][:60]}")
    return (f"the fleet's ranks disagree on {len(diff)} setting(s): {'; '.join(parts)}. Here on "
            f"rank {rank}: {'; '.join(here)}. Every rank must run the same preset, --set values, "
            f"capacity and data bytes (only {', '.join(sorted(PER_RANK_FIELDS))} may differ): "
            f"launch every rank with the same command line and the same data")


def _agree_config(run: RunConfig, shapes: list[RankShape], device: torch.device,
                  rank: int) -> None:  # fmt: skip
    """All-gather a hash of each field; refuse on EVERY rank, naming the fields and ranks."""
    from .data import DataError, data_fingerprint, default_corpus

    error = ""
    prints = None
    try:
        paths = list(run.train.data) or [str(default_corpus(log=lambda _l: None))]
        prints = [data_fingerprint(p) for p in paths]
    except DataError as e:
        error = str(e)
    mine = agreement_fields(run, shapes, device.type, prints)
    names = list(mine)
    # the field list itself first: ranks of other dormouse versions cannot gather one table
    head = _agree_ints([len(names), _hash60(repr(names)), 1 if error else 0], device)
    if len({(n, h) for n, h, _ in head}) != 1:
        raise DistError(
            "the fleet's ranks run different versions of dormouse (their config field lists "
            "differ); install the same version on every node"
        )
    failed = [r for r, (_, _, bad) in enumerate(head) if bad]
    if failed:
        raise DistError(
            f"rank {rank} cannot read its data: {error}" if error else
            f"rank(s) {', '.join(map(str, failed))} cannot read their data (their own message "
            f"names the file); every rank must read the same bytes"
        )
    table = _agree_ints([_hash60(mine[k]) for k in names], device)
    diff = disagreement(table, names)
    if diff:
        raise DistError(disagreement_message(diff, mine, rank, prints))


def _agree_ints(values: list[int], device: torch.device) -> list[list[int]]:
    """All-gather a list of int64 per rank (the same length on every rank)."""
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [t.tolist() for t in out]


# ---- joining the fleet --------------------------------------------------------------------


def _fleet_device(run: RunConfig, device_type: str | None, local_rank: int) -> torch.device:
    want = device_type or run.train.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    kind = torch.device(want).type
    if kind == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device(kind)


def _agree(values: list[float], device: torch.device) -> list[float]:
    """All-gather one float per rank."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [float(v) for t in out for v in t.tolist()]


def init_parallel(
    run: RunConfig,
    device_type: str | None = None,
    *,
    log: Callable[[str], None] = print,
    rate: float | None = None,
    nccl_available: bool | None = None,
    timeout_s: float | None = None,
    parallel_cls: type[Parallel] = Parallel,
    env: Mapping[str, str] | None = None,
) -> Parallel:
    """Join the fleet torchrun launched: backend, device, process group, heartbeat, the ranks'
    agreement on the config and the data, capacity, reduce dtype.

    `rate` replaces this rank's measured matmul rate for `--capacity auto` (tests inject
    rates to make the split deterministic); `nccl_available` simulates a torch without NCCL.
    `timeout_s` replaces `dist_timeout` and then bounds every collective, the first step's
    too (without it the first step may take FIRST_STEP_TIMEOUT_S: a kernel autotune).
    """
    env = os.environ if env is None else env
    world = _world_from(env)
    if world is None:
        raise LaunchError(f"init_parallel: WORLD_SIZE is not set; launch with `{_LAUNCH}`")
    rank = int(env.get("RANK", "0"))
    local_rank = int(env.get("LOCAL_RANK", str(rank)))
    cfg = run.train
    want = device_type or cfg.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    backend = choose_backend(torch.device(want).type, nccl_available)  # before anything else
    device = _fleet_device(run, want, local_rank)
    if device.type == "cuda":
        n = torch.cuda.device_count()
        if local_rank >= n:
            raise DistError(
                f"rank {rank} (local rank {local_rank}) needs cuda:{local_rank} but this node "
                f"sees {n} CUDA device(s); launch at most {n} ranks per node (--nproc_per_node)"
            )
        torch.cuda.set_device(device)
    for k, v in NCCL_SAFE_ENV.items():
        os.environ.setdefault(k, v)
    limit = float(timeout_s) if timeout_s else float(cfg.dist_timeout)
    # A collective waits twice the heartbeat's limit, so that a rank that stops is named by
    # the watchdog (within dist_timeout) before its peers' collective gives up on it.
    collective = limit if timeout_s else COLLECTIVE_TIMEOUT_FACTOR * limit
    patient = not timeout_s and collective < FIRST_STEP_TIMEOUT_S
    if not dist.is_initialized():
        # the rendezvous waits `collective` for a rank that never arrives
        kw = {"timeout": timedelta(seconds=collective)}
        if backend == "nccl":
            kw["device_id"] = device
        restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and restart not in ("", "0"):
            # torchrun keeps its store across an elastic restart, and torch adds no prefix
            # per attempt: a restarted rank could read a dead attempt's address from it (gloo:
            # "Connection refused" to a port nobody holds, measured on about half the
            # restarts of gate g22 on the CPU box). Each attempt gets keys of its own.
            base = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), world,
                                 is_master=False, timeout=kw["timeout"])  # fmt: skip
            kw["store"] = dist.PrefixStore(f"dormouse/attempt_{restart}", base)
        dist.init_process_group(backend, rank=rank, world_size=world, **kw)
    heartbeat = _start_heartbeat(rank, world, limit, collective if patient else None, env)
    if patient:
        heartbeat.set_collective_timeout(FIRST_STEP_TIMEOUT_S)
    try:
        parallel = _join(run, device, rank, world, backend, log, rate, parallel_cls)
    except BaseException as e:
        heartbeat.leave("failed", _short(e))
        raise
    parallel.heartbeat = heartbeat
    return parallel


def _join(run: RunConfig, device: torch.device, rank: int, world: int, backend: str, log,
          rate: float | None, parallel_cls: type[Parallel]) -> Parallel:  # fmt: skip
    cfg = run.train
    say = log if rank == 0 else (lambda _line: None)

    from .loop import resolve_autocast

    compute = _DTYPE_NAMES.get(resolve_autocast(run, device, lambda _l: None), "fp32")

    spec = cfg.dist_capacity.strip()
    rates = None
    if spec.lower() == "auto":
        mine = rate if rate is not None else measure_rate(device)
        rates = _agree([mine], device)
        say(f"capacity auto: matmul rates {', '.join(f'{r / 1e9:.2f}' for r in rates)} GFLOP/s "
            f"{'(injected)' if rate is not None else '(measured)'}")  # fmt: skip
    try:
        shapes = parse_capacity(spec, world, cfg.batch, cfg.seq_len, run.model.max_seq_len,
                                rates=rates)
    except ValueError as e:
        raise DistError(str(e)) from None
    if spec:
        say(f"capacity {spec}: " + ", ".join(f"rank{r}={s.line()}" for r, s in enumerate(shapes))
            + f" (global {sum(s.batch for s in shapes)} windows, "
            f"{sum(s.tokens for s in shapes)} tokens)")

    _agree_config(run, shapes, device, rank)

    reduce = cfg.dist_reduce
    if reduce == "auto":
        code = {"fp32": 0.0, "bf16": 1.0, "fp16": 2.0}[compute]
        codes = _agree([code], device)
        names = [("fp32", "bf16", "fp16")[int(c)] for c in codes]
        reduce = names[0] if len(set(names)) == 1 else "fp32"
        say(f"dist_reduce=auto -> {reduce} (fleet compute dtypes: {','.join(names)}"
            f"{'; they differ: the exact fp32 reduce' if len(set(names)) > 1 else ''})")  # fmt: skip

    return parallel_cls(rank, world, device, shapes, backend=backend, reduce=reduce,
                        shard=cfg.dist_shard, bucket_mb=cfg.bucket_mb, compute=compute,
                        log=log)  # fmt: skip


def train_dist(
    run: RunConfig,
    log: Callable[[str], None] = print,
    device_type: str | None = None,
    model: torch.nn.Module | None = None,
    close: bool = True,
    resume: bool = False,
    *,
    stop_at: int | None = None,
    rate: float | None = None,
    timeout_s: float | None = None,
    parallel_cls: type[Parallel] = Parallel,
) -> dict:
    """Train `run` as one rank of the fleet torchrun launched; rank 0's log is the run's log.

    Every rank prints one `dist rank=r/P ...` line; everything else is printed by rank 0.
    The model is built from `run.train.seed` on every rank BEFORE wrapping (or taken from
    `model`, which the caller must have built identically on every rank). `close=False`
    leaves the process group up (callers that gather more state afterwards).
    """
    run = validate(run)
    world = _world_from(os.environ) or 1
    refuse_incompatible(run, world)
    if run.train.fit_gb:
        from .fit import apply_fit

        run = apply_fit(run, log=log if os.environ.get("RANK", "0") == "0" else (lambda _l: None))
        try:
            refuse_incompatible(run, world)  # --fit may have engaged a mechanism a fleet refuses
        except RefusedError as e:
            raise RefusedError(
                f"--fit {run.train.fit_gb} engaged a mechanism the fleet cannot run: {e}. The "
                f"fit planner does not know about fleets yet: drop --fit and set the mechanisms "
                f"by hand (--set moe_offload=true, muon_state_dtype=bf16, ...)"
            ) from None

    parallel = init_parallel(run, device_type, log=log, rate=rate, timeout_s=timeout_s,
                             parallel_cls=parallel_cls)  # fmt: skip
    quiet = logging.getLogger("dormouse")
    level = quiet.level
    if not parallel.is_main:  # module loggers' `auto` verdicts too: rank 0 speaks for the fleet
        quiet.setLevel(logging.WARNING)
    ok = False
    try:
        log(parallel.line())
        if model is None:
            from ..model import DormouseModel

            torch.manual_seed(run.train.seed)
            model = DormouseModel(run.model)
        from .loop import train

        try:
            report = train(model, run, log=log, parallel=parallel, resume=resume, stop_at=stop_at)
        except Exception as e:
            if not _fleet_failure(e) or parallel.heartbeat is None:
                raise
            # a peer died or the ranks fell out of step: one line naming what each peer was
            # doing, instead of the backend's traceback
            why = parallel.heartbeat.explain(e)
            raise DistError(why) from None
        report.update(shapes=[s.line() for s in parallel.shapes], backend=parallel.backend,
                      reduce=parallel.reduce, device=str(parallel.device))  # fmt: skip
        if close:
            parallel.barrier()  # without it, gloo teardown aborts intermittently
        ok = True
        return report
    except BaseException as e:
        failed = e
        raise
    finally:
        quiet.setLevel(level)
        if parallel.heartbeat is not None:
            parallel.heartbeat.leave("done" if ok else "failed", "" if ok else _short(failed))
        if close and dist.is_initialized():
            dist.destroy_process_group()
