"""Data parallelism applied to a built model from outside: `parallelize(model, ctx)`.

One process: the model itself. A fleet: rank 0's host-RAM Engram tables become every rank's,
then DDP (reduce dtype `dist_reduce`, buckets from `link.bucket_mb_for`, the LFB buffers left
alone: the context sums their counts) or FSDP2 `fully_shard` per block and root. `unwrap`
is the inverse. The model package never knows which wrapper it is in.
"""

from __future__ import annotations

import contextlib
import inspect
import logging

import torch

from ..context import DPContext, host_stores
from ..step import Wrapped

log = logging.getLogger(__name__)

REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parallelize(model: torch.nn.Module, ctx: DPContext) -> Wrapped:
    """What a step runs forward and backward on (the model, or its DDP wrapper; FSDP2 shards
    the model in place), with the hook that keeps a non-final micro-batch's gradients local:
    the last micro-batch's backward reduces their sum."""
    if ctx.world == 1:
        return Wrapped(model)
    _broadcast_host(model, ctx)
    if ctx.shard == "fsdp":
        sharded = _fsdp(model, ctx)

        @contextlib.contextmanager
        def gradient_sync(last: bool):
            sharded.set_requires_gradient_sync(last)
            yield

        return Wrapped(sharded, gradient_sync)
    ddp = _ddp(model, ctx)
    return Wrapped(ddp, lambda last: contextlib.nullcontext() if last else ddp.no_sync())


def unwrap(net: torch.nn.Module) -> torch.nn.Module:
    """The model inside a DDP wrapper (FSDP2 shards the model in place: it is the model)."""
    ddp = isinstance(net, torch.nn.parallel.DistributedDataParallel)
    return net.module if ddp else net


def _broadcast_host(model: torch.nn.Module, ctx: DPContext) -> None:
    """Rank 0's host tables become every rank's, as DDP (and the FSDP2 wrap) does for
    parameters: no reducer sees these tensors. (A fresh optimizer's row state is zero on
    every rank, and a resume loads one file on every rank.)"""
    import torch.distributed as dist

    chunk = 1 << 24  # elements per trip through the device on nccl (64 MiB of fp32)
    for store in host_stores(model):
        t = store.table
        if ctx.device.type == "cpu":
            dist.broadcast(t, src=0)
            continue
        flat = t.view(-1)
        for i in range(0, flat.numel(), chunk):
            buf = flat[i : i + chunk].to(ctx.device)
            dist.broadcast(buf, src=0)
            flat[i : i + chunk].copy_(buf)


def _ddp(model: torch.nn.Module, ctx: DPContext) -> torch.nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .link import bucket_mb_for

    unused = params_without_grad(model, ctx.device)
    payload = sum(p.numel() for p in model.parameters() if p.requires_grad) * (
        4 if ctx.reduce == "fp32" else 2
    )
    mb = ctx.bucket_mb if ctx.bucket_mb > 0 else bucket_mb_for(payload)
    # The only buffers are the LFB controller's, kept identical by the context's lfb_reduce;
    # DDP's per-forward broadcast would overwrite every rank's counts with rank 0's. (torch
    # 2.13 renames the switch; 2.11 knows only the old name.)
    no_sync = (
        {"forward_sync_buffers": False}
        if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
        else {"broadcast_buffers": False}
    )
    ddp = DDP(
        model,
        device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None,
        bucket_cap_mb=mb,
        find_unused_parameters=bool(unused),
        **no_sync,
    )
    if ctx.reduce in ("bf16", "fp16"):
        ddp.register_comm_hook(None, compress_hook(REDUCE_DTYPES[ctx.reduce]))
    why = (
        f"probe: {len(unused)} parameter(s) got no gradient, e.g. {unused[0]}"
        if unused
        else "probe: every parameter received a gradient"
    )
    log.info(
        f"ddp: reduce={ctx.reduce} bucket_cap_mb={mb:.1f} (payload "
        f"{payload / 2**20:.2f} MiB{'' if ctx.bucket_mb > 0 else ', bucket_mb_for'}) "
        f"find_unused_parameters={int(bool(unused))} ({why})"
    )
    return ddp


def _fsdp(model: torch.nn.Module, ctx: DPContext) -> torch.nn.Module:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # fully_shard does not broadcast: rank 0's initial values become everyone's here,
    # so a model seeded differently on some rank still starts the fleet in agreement.
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)
    mesh = init_device_mesh(ctx.device.type, (ctx.world,))
    # the forward's weights in the compute dtype the device policy chose (the all-gathers move
    # half the bytes); the optimizer keeps fp32 shards and fp32 gradients
    # (bf16 on every rank: all-gathers of one dtype; ranks of mixed dtypes gather fp32)
    param = torch.bfloat16 if set(ctx.computes or (ctx.compute,)) == {"bf16"} else None
    mp = MixedPrecisionPolicy(param_dtype=param, reduce_dtype=REDUCE_DTYPES[ctx.reduce])
    for block in getattr(model, "blocks", []):
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    log.info(
        f"fsdp2: fully_shard per block + root, param={ctx.compute if param else 'fp32'} "
        f"reduce={ctx.reduce}, mesh={ctx.world}"
    )
    return model


def compress_hook(dtype: torch.dtype):
    """A DDP comm hook: all-reduce each bucket in `dtype` (the mean), then widen it back.

    torch's own bf16 hook refuses anything but NCCL (and its fp16 twin is the same cast); this
    one is the same arithmetic on any backend, so the CPU fleet runs what a card fleet runs.
    """
    import torch.distributed as dist

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


def params_without_grad(model: torch.nn.Module, device: torch.device) -> list[str]:
    """Names of parameters one small forward/backward leaves without a gradient.

    Run in eval mode (the LFB counts only move in training forwards) on fixed bytes, and the
    gradients are cleared afterwards, so the probe leaves no trace in the model.
    """
    gen = torch.Generator(device="cpu").manual_seed(0)
    seq = min(8, model.cfg.max_seq_len)
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
