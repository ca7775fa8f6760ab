"""shards: per-rank parameter, gradient, optimizer and DDP-bucket bytes against --fit's estimate.

Spawns a CPU fleet on gloo per world (torch.multiprocessing, as the tests do), builds the
preset as `train` does (`build_model`, `parallelize`, `MixOptimizer.from_config`), takes one
step on random bytes and reads what each rank really holds: parameters and gradients as
`context.local_shard` sees them, the optimizer's state (Muon's flat stacks, AdamW's and the
Engram tables' moments; each storage once), DDP's own bucket bytes (its logging record). The
transient buffers (FSDP2's gathered units, Muon's gather) are freed by then: they stay
modelled only here (`bench memory` measures peaks on a card).
"""

from __future__ import annotations

import json
import logging
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from ..config import apply_sets, preset, validate
from ..errors import UserError
from .common import table

log = logging.getLogger(__name__)


def add_args(p) -> None:
    p.add_argument("presets", nargs="*", default=["medium"], help="presets (default medium)")
    p.add_argument("--worlds", default="2,4", help="fleet sizes, comma separated (default 2,4)")
    p.add_argument("--shards", default="none,fsdp", help="none (DDP), fsdp (FSDP2), or both")


def configure(name: str, sets: list[str]):
    """The run as measured: the CPU (fp32 compute, fp32 reduce), one window of 16 bytes (the
    activations play no part in what is measured)."""
    run = apply_sets(preset(name), ["device=cpu", "dtype=fp32", "dist_reduce=fp32", *sets])
    return validate(replace(run, train=replace(run.train, batch=1, seq_len=16)))


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def measure_rank(run, rank: int, world: int, shard: str) -> dict:
    """Inside a started gloo process group: build, parallelize, one step; this rank's bytes."""
    import torch.distributed as dist

    from ..train.context import DPContext, RankShape, local_shard
    from ..train.fleet.parallelize import parallelize
    from ..train.optim.mix import MixOptimizer
    from ..train.run import build_model

    t = run.train
    ctx = DPContext(
        torch.device("cpu"),
        (RankShape(t.batch, t.seq_len),) * world,
        rank=rank,
        world=world,
        backend="gloo",
        reduce="fp32",
        shard=shard,
    )
    model = build_model(run)
    net = parallelize(model, ctx).net
    opt = MixOptimizer.from_config(model, t, "cpu")
    gen = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (t.batch, t.seq_len + 1), generator=gen)
    _, loss, _ = net(x[:, :-1], x[:, 1:])
    loss.backward()
    opt.step()
    params = list(model.parameters())
    out = {
        "rank": rank,
        "world": world,
        "shard": shard,
        "params": sum(local_shard(p).numel() * p.element_size() for p in params),
        "param_storage": _storage_bytes(local_shard(p) for p in params),
        "grads": sum(
            local_shard(p.grad).numel() * p.grad.element_size()
            for p in params
            if p.grad is not None
        ),
        # the momentum_buffer entries are views of the stacks: each storage counted once
        "optimizer": _storage_bytes(
            [t for buf, _, absmax in opt._stacks for t in (buf, absmax) if t is not None]
            + [
                local_shard(v)
                for st in opt.state.values()
                for v in st.values()
                if torch.is_tensor(v)
            ]
        ),
        "host": _storage_bytes(v for st in opt.host_state.values() for v in st.values()),
        "buckets": 0,
    }
    if shard == "none":
        sizes = net._get_ddp_logging_data().get("bucket_sizes", "")
        out["buckets"] = sum(int(s) for s in str(sizes).split(",") if s.strip())
    del net, opt, model
    dist.barrier()
    return out


def _rank(rank: int, world: int, shards: list[str], name: str, sets: list[str], tmp: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(f"{tmp}/store", world), rank=rank, world_size=world
    )
    try:
        run = configure(name, sets)
        rows = [measure_rank(run, rank, world, s) for s in shards]
        Path(f"{tmp}/rank{rank}.json").write_text(json.dumps(rows))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure_fleet(name: str, world: int, shards: list[str], sets: list[str] = ()) -> list[dict]:
    """Every rank's measured bytes for each of `shards`, one spawned gloo fleet of `world`."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _rank,
            args=(world, list(shards), name, list(sets), tmp),
            nprocs=world,
            start_method="spawn",
        )
        return [
            row for r in range(world) for row in json.loads(Path(f"{tmp}/rank{r}.json").read_text())
        ]


def estimated(run, world: int, shard: str) -> dict:
    """The same quantities from `fit.estimate` (rank 0's: the full ceil(D0 / world) chunk)."""
    from ..train.plan import fit

    e = fit.estimate(run, world=world, shard=shard)
    return {
        "params": e.masters,
        "grads": e.grads,
        "optimizer": e.adamw + e.muon + e.engram,
        "buckets": e.comm_step,
    }


def compare(name: str, rows: list[dict], sets: list[str] = ()) -> list[dict]:
    """One line per (world, shard): the largest rank's measured bytes next to the estimate."""
    run = configure(name, list(sets))
    out = []
    for world, shard in sorted(
        {(r["world"], r["shard"]) for r in rows}, key=lambda ws: (ws[0], ws[1] != "none")
    ):  # DDP first
        mine = [r for r in rows if (r["world"], r["shard"]) == (world, shard)]
        got = {
            k: max(r[k] for r in mine)
            for k in ("params", "param_storage", "grads", "optimizer", "buckets", "host")
        }
        out.append(
            {
                "world": world,
                "shard": shard,
                "measured": got,
                "estimated": estimated(run, world, shard),
            }
        )
    return out


def run(args, command: str) -> str:
    shards = [s for s in args.shards.split(",") if s]
    bad = [s for s in shards if s not in ("none", "fsdp")]
    if bad:
        raise UserError(f"--shards {args.shards}: {bad} not among none, fsdp")
    worlds = [int(w) for w in args.worlds.split(",") if w]
    if not worlds or min(worlds) < 2:
        raise UserError(f"--worlds {args.worlds}: a fleet has at least 2 ranks")
    lines = [
        f"# Per-rank bytes: measured (gloo, CPU, torch {torch.__version__}) vs --fit's estimate",
        "",
        f"    {command}",
        "",
    ]
    mib = 2**20
    body = []
    for name in args.presets:
        for world in worlds:
            log.info(f"shards: {name} world {world} ({','.join(shards)})")
            for c in compare(name, measure_fleet(name, world, shards, args.set), args.set):
                m, e = c["measured"], c["estimated"]
                body.append(
                    [
                        name,
                        str(world),
                        "FSDP2" if c["shard"] == "fsdp" else "DDP",
                        f"{m['params'] / mib:.1f}",
                        f"{e['params'] / mib:.1f}",
                        f"{m['optimizer'] / mib:.1f}",
                        f"{e['optimizer'] / mib:.1f}",
                        f"{m['grads'] / mib:.1f}",
                        f"{e['grads'] / mib:.1f}",
                        f"{m['buckets'] / mib:.1f}" if c["shard"] == "none" else "-",
                        f"{e['buckets'] / mib:.1f}" if c["shard"] == "none" else "-",
                        f"{m['params'] + m['optimizer'] - e['params'] - e['optimizer']:+,d}",
                    ]
                )
    lines.append(
        table(
            [
                "preset",
                "world",
                "reducer",
                "params MiB",
                "est",
                "optimizer MiB",
                "est",
                "grads MiB",
                "est",
                "DDP buckets MiB",
                "est",
                "params+opt: measured - est, B",
            ],
            body,
        )
    )
    return "\n".join(lines) + "\n"
