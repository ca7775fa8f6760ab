"""Joining a data-parallel fleet: launch rules, backend, capacity, refusals, agreement.

* `check_launch` — the two launch mismatches (--dist without a fleet, a fleet without --dist).
* `choose_backend` — nccl on CUDA, gloo on the CPU; NCCL missing on CUDA is an error, never gloo.
* `parse_capacity` / `split_by_rates` / `measure_rate` — each rank's share of a step
  (`"4,2"`, `"4x512,2x512"`, `"4,2*2"` = two micro-batches of 2, `auto` = split the global
  batch by measured matmul rates; `global_batch` fixes the total whatever the world).
* `refuse_incompatible` — what a fleet of N ranks cannot (yet) do correctly, with the escape.
* `agreement_fields` / `disagreement` — what every rank must share (every config field but
  PER_RANK_FIELDS, the capacity split, the data's bytes), refused naming fields and ranks.
* `join` — process group -> heartbeat -> capacity -> agreement -> reduce dtype: the rank's
  `DPContext`. The model is wrapped afterwards, from outside (`parallelize.py`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from ...config import RunConfig
from ..context import (
    DistError,
    DPContext,
    LaunchError,
    RankShape,
    RefusedError,
    accumulate,
    packed_split,
)
from .watchdog import (
    COLLECTIVE_TIMEOUT_FACTOR,
    FIRST_STEP_TIMEOUT_S,
    short,
    start_heartbeat,
)

log = logging.getLogger(__name__)


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


def world_from(env: Mapping[str, str]) -> int | None:
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
    world = world_from(env)
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

_ENTRY = re.compile(r"\s*([0-9]+)\s*(?:[xX]\s*([0-9]+))?\s*(?:\*\s*([0-9]+))?\s*", re.ASCII)


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
    out = [max(1, math.floor(q)) for q in ideal]
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
    global_batch: int = 0,
) -> list[RankShape]:
    """Each rank's share of a step, from `--capacity` (and `global_batch`, windows a step).

    ""            every rank takes `batch` windows of `seq_len`; with global_batch G, G / world
                  windows each (it must divide), in micro-batches of at most `batch`
    "4,2"         one batch per rank, each at `seq_len` (total 6)
    "4x512,2x256" batch x window length per rank (a length must be <= max_seq_len)
    "4,2*3"       `*K`: K micro-batches of that batch, their gradients summed (total 4 + 6)
    "auto"        split batch * world_size (or G) by `rates` (each rank's measured matmul
                  rate); with G, each share in micro-batches of at most `batch`
    Anything else is a ValueError naming the problem; so is a total other than G when G is set.
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
        if not global_batch:
            return [RankShape(batch, seq_len) for _ in range(world_size)]
        if global_batch % world_size:
            raise ValueError(
                f"global_batch={global_batch} does not split evenly over {world_size} ranks; "
                f"give a multiple of {world_size}, or each rank's share with --capacity "
                f"(e.g. {','.join([str(global_batch // world_size)] * (world_size - 1))},"
                f"{global_batch - (world_size - 1) * (global_batch // world_size)})"
            )
        return [accumulate(global_batch // world_size, batch, seq_len)] * world_size
    if text.lower() == "auto":
        if rates is None:
            raise ValueError(
                "--capacity auto needs each rank's measured rate; fleet.join measures and "
                "all-gathers them (pass rates= when calling parse_capacity directly)"
            )
        if len(rates) != world_size:
            raise ValueError(f"capacity auto: {len(rates)} rates for {world_size} ranks")
        if not global_batch:
            return [RankShape(b, seq_len) for b in split_by_rates(rates, batch * world_size)]
        # shares that run in few full micro-batches (a prime share would run windows one
        # at a time), the rates' split where it is such already
        split = packed_split(
            split_by_rates(rates, global_batch), [1.0 / r for r in rates], [batch] * world_size
        )
        return [accumulate(b, batch, seq_len) for b in split]
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
                f"--capacity {spec!r}: entry {r} ({part!r}) is not B, BxT, B*K or BxT*K "
                f"(positive integers, e.g. 4, 4x512, 2*3)"
            )
        b = int(m.group(1))
        t = int(m.group(2)) if m.group(2) is not None else seq_len
        k = int(m.group(3)) if m.group(3) is not None else 1
        if b < 1 or k < 1:
            raise ValueError(
                f"--capacity {spec!r}: rank {r} has batch {b} x {k} micro-batches; "
                f"every rank needs >= 1 of each"
            )
        if not 1 <= t <= max_seq_len:
            raise ValueError(
                f"--capacity {spec!r}: rank {r} asks for windows of {t} bytes; the model takes "
                f"1..{max_seq_len} (max_seq_len)"
            )
        shapes.append(RankShape(b, t, k))
    total = sum(s.windows for s in shapes)
    if global_batch and total != global_batch:
        raise ValueError(
            f"--capacity {spec!r} takes {total} windows a step but global_batch={global_batch}; "
            f"make the shares (batch x micro-batches) add up to it, or drop one of the two"
        )
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
        dtype = (
            torch.bfloat16 if cap >= (8, 0) else torch.float16 if cap >= (5, 3) else torch.float32
        )
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
    `DPContext.lfb_reduce`, gate g11), host-RAM Engram tables under DDP and FSDP2 (their rows
    are reduced by `DPContext.reduce_host_grads`, gates g14 and g24), Muon under FSDP2 (whole
    matrices all-gathered for the polar, each rank applying its rows; muon_state_dtype=bf16
    too: the momentum update is elementwise on the shard; gate g24), int8 optimizer state
    under DDP (every rank holds and steps the whole state alike), a data mixture (its
    source for step s is a hash of (seed, s), so every rank picks the same source: gate g20),
    the capacity-padded MoE (its cap and drops are decided per row, so splitting the global
    batch across ranks changes no drop: gate g23), and compile=true in compile_mode default
    under DDP (torch.compile of the DDP module: dynamo splits the graph at the buckets) and
    under FSDP2 (its all-gather and reduce-scatter hooks run between the compiled pieces):
    gate g31 for both.
    """
    if world_size <= 1:
        return
    t = run.train
    fleet = f"a fleet of {world_size} ranks"
    if t.dist_shard == "fsdp" and t.optim_8bit:
        raise RefusedError(
            "dist_shard=fsdp with optim_8bit=true: bitsandbytes' AdamW8bit steps plain CUDA "
            "tensors, not FSDP2's DTensor shards. Use --set optim_8bit=false or dist_shard=none"
        )
    int8 = [k for k in ("muon_state_dtype", "engram_state_dtype") if getattr(t, k) == "int8"]
    if t.dist_shard == "fsdp" and int8:
        raise RefusedError(
            f"dist_shard=fsdp with {'=int8, '.join(int8)}=int8: the 8-bit optimizer state is "
            f"not implemented for FSDP2 shards (a resume at another world size would have to "
            f"reshard it through fp32). Use --set {int8[0]}=bf16 or dist_shard=none"
        )
    if t.compile and t.compile_mode == "reduce-overhead":
        raise RefusedError(
            f"compile_mode=reduce-overhead on {fleet}: DDP's gradient all-reduce runs from hooks "
            f"between the compiled pieces, which CUDA graphs would have to capture; no gate "
            f"covers it. Use --set compile_mode=default (gate g31) or compile=false"
        )


# ---- the ranks' agreement -------------------------------------------------------------------

#: Config fields that may differ between ranks, and why. Everything else must agree.
PER_RANK_FIELDS = {
    "out_dir": "rank 0 writes the run folder (under FSDP2 each rank its shards, into the "
    "directory rank 0 names); a gate gives each rank its own folder to see who writes",
    "device": "every rank maps it to its own card (cuda -> cuda:LOCAL_RANK); the device TYPE "
    "must agree and is compared",
    "data": "a path may be spelled differently on each node; the BYTES behind it must agree "
    "and are compared (size + sampled blocks)",
    "dtype": "the compute dtype is each card's (the device policy's rung: bf16 beside fp16 "
    "beside fp32); what the fleet shares is gathered at join instead: the reduce dtype "
    "(dist_reduce=auto) and whether every rank carries the fp16 loss scale",
}


def agreement_fields(
    run: RunConfig,
    shapes: Sequence[RankShape],
    device_type: str,
    data_prints: Sequence[dict] | None,
) -> dict[str, str]:
    """name -> the text every rank must share: every config field but PER_RANK_FIELDS, the
    capacity split, the device type and the data's fingerprint."""
    out = {"preset/source": run.source}
    out.update({k: repr(v) for k, v in dataclasses.asdict(run.model).items()})
    out.update(
        {k: repr(v) for k, v in dataclasses.asdict(run.train).items() if k not in PER_RANK_FIELDS}
    )
    out["capacity split"] = ",".join(s.line() for s in shapes)
    out["device type"] = device_type
    out["data bytes"] = (
        repr([(p["size"], p["digest"]) for p in data_prints]) if data_prints is not None else "?"
    )
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


def disagreement_message(
    diff: Mapping[str, list[int]],
    mine: Mapping[str, str],
    rank: int,
    data_prints: Sequence[dict] | None = None,
) -> str:
    def ranks(rs):
        return f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"

    parts = [
        f"{k} ({ranks(rs)} differ{'s' if len(rs) == 1 else ''} from rank 0)"
        for k, rs in diff.items()
    ]
    here = []
    for k in diff:
        if k == "data bytes" and data_prints:
            here.append(
                "data "
                + ", ".join(
                    f"{p['path']} ({p['size']} bytes, sampled digest {p['digest'][:12]})"
                    for p in data_prints
                )
            )
        else:
            here.append(f"{k}={mine[k][:60]}")
    return (
        f"the fleet's ranks disagree on {len(diff)} setting(s): {'; '.join(parts)}. Here on "
        f"rank {rank}: {'; '.join(here)}. Every rank must run the same preset, --set values, "
        f"capacity and data bytes (only {', '.join(sorted(PER_RANK_FIELDS))} may differ): "
        f"launch every rank with the same command line and the same data"
    )


def _agree_config(run: RunConfig, shapes: list[RankShape], device: torch.device, rank: int) -> None:
    """All-gather a hash of each field; refuse on EVERY rank, naming the fields and ranks."""
    from ..data import DataError, data_fingerprint, default_corpus

    error = ""
    prints = None
    try:
        paths = list(run.train.data) or [str(default_corpus())]
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
            f"rank {rank} cannot read its data: {error}"
            if error
            else f"rank(s) {', '.join(map(str, failed))} cannot read their data (their own message "
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


def agree_values(values: list[float], device: torch.device) -> list[float]:
    """All-gather one float per rank."""
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    out = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(out, mine)
    return [float(v) for t in out for v in t.tolist()]


def join(
    run: RunConfig,
    device: torch.device,
    *,
    compute: str = "fp32",
    rate: float | None = None,
    nccl_available: bool | None = None,
    timeout_s: float | None = None,
    env: Mapping[str, str] | None = None,
) -> DPContext:
    """Join the fleet torchrun launched: backend, process group, heartbeat, capacity, the
    ranks' agreement on the config and the data, reduce dtype -> this rank's DPContext.

    `device` is this rank's (cuda:LOCAL_RANK on a card). `rate` replaces this rank's measured
    matmul rate for `--capacity auto` (tests inject rates); `nccl_available` simulates a torch
    without NCCL. `timeout_s` replaces `dist_timeout` and then bounds every collective, the
    first step's too (without it the first step may take FIRST_STEP_TIMEOUT_S: an autotune).
    """
    env = os.environ if env is None else env
    world = world_from(env)
    if world is None:
        raise LaunchError(f"WORLD_SIZE is not set; launch with `{_LAUNCH}`")
    rank = int(env.get("RANK", "0"))
    local_rank = int(env.get("LOCAL_RANK", str(rank)))
    cfg = run.train
    backend = choose_backend(device.type, nccl_available)  # before anything else
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
            base = dist.TCPStore(
                env["MASTER_ADDR"],
                int(env["MASTER_PORT"]),
                world,
                is_master=False,
                timeout=kw["timeout"],
            )
            kw["store"] = dist.PrefixStore(f"dormouse/attempt_{restart}", base)
        dist.init_process_group(backend, rank=rank, world_size=world, **kw)
    heartbeat = start_heartbeat(rank, world, limit, collective if patient else None, env)
    if patient:
        heartbeat.set_collective_timeout(FIRST_STEP_TIMEOUT_S)
    try:
        shapes = _capacity(run, device, world, rate)
        refuse_uneven_fsdp(shapes, cfg.dist_shard)
        _agree_config(run, shapes, device, rank)
        # every rank's compute dtype: a bf16 card beside an fp16 one is a fleet by design
        codes = agree_values([float(("fp32", "bf16", "fp16").index(compute))], device)
        names = tuple(("fp32", "bf16", "fp16")[int(c)] for c in codes)
        reduce = cfg.dist_reduce
        if reduce == "auto":
            reduce = names[0] if len(set(names)) == 1 else "fp32"
            log.info(
                f"dist_reduce=auto -> {reduce} (fleet compute dtypes: {','.join(names)}"
                f"{'; they differ: the exact fp32 reduce' if len(set(names)) > 1 else ''})"
            )
        if "fp16" in names and len(set(names)) > 1:
            log.info(
                f"compute dtypes {','.join(names)} by rank: every rank carries the fp16 "
                f"ranks' loss scale (DDP averages scaled gradients), and all skip together"
            )
    except BaseException as e:
        heartbeat.leave("failed", short(e))
        raise
    return DPContext(
        device,
        tuple(shapes),
        rank=rank,
        world=world,
        backend=backend,
        reduce=reduce,
        shard=cfg.dist_shard,
        bucket_mb=float(cfg.bucket_mb),
        compute=compute,
        computes=names,
        heartbeat=heartbeat,
    )


def parse_slow(text: str, rank: int) -> float:
    """`emulate_slow` "RANK:FACTOR" -> this rank's sleep factor (0 elsewhere)."""
    if not text.strip():
        return 0.0
    try:
        r, f = text.split(":")
        r, f = int(r), float(f)
    except ValueError:
        raise DistError(
            f"emulate_slow={text!r} is not RANK:FACTOR (e.g. 1:1.0: rank 1 sleeps "
            f"as long as it computes, a card at half speed)"
        ) from None
    if not (f >= 0 and math.isfinite(f)):
        raise DistError(f"emulate_slow={text!r}: FACTOR must be finite and >= 0")
    return f if r == rank else 0.0


def refuse_uneven_fsdp(shapes: Sequence[RankShape], shard: str) -> None:
    """FSDP2 all-gathers every layer's parameters in each forward: its ranks must run the
    same number of micro-batches (their sizes may differ)."""
    counts = [s.accum for s in shapes]
    if shard == "fsdp" and len(set(counts)) > 1:
        raise DistError(
            f"dist_shard=fsdp with micro-batch counts {counts} per rank: FSDP2 all-gathers each "
            f"layer's parameters in every forward, so a rank with fewer micro-batches would leave "
            f"the others waiting in a collective. Give every rank the same count (e.g. "
            f"--capacity {','.join(f'{s.windows // max(counts)}*{max(counts)}' for s in shapes)} "
            f"where the shares divide), or use DDP (--set dist_shard=none)"
        )


def _capacity(
    run: RunConfig, device: torch.device, world: int, rate: float | None
) -> list[RankShape]:
    cfg = run.train
    spec = cfg.dist_capacity.strip()
    rates = None
    if spec.lower() == "auto":
        mine = rate if rate is not None else measure_rate(device)

        # EMULATION (emulate_slow): the rank named trains 1 + FACTOR times slower, and its
        # start-up guess says so too (a matmul burst would not see a sleep)
        mine /= 1.0 + parse_slow(cfg.emulate_slow, int(os.environ.get("RANK", "0")))
        rates = agree_values([mine], device)
        log.info(
            f"capacity auto: matmul rates {', '.join(f'{r / 1e9:.2f}' for r in rates)} "
            f"GFLOP/s {'(injected)' if rate is not None else '(measured)'}"
        )
    try:
        shapes = parse_capacity(
            spec,
            world,
            cfg.batch,
            cfg.seq_len,
            run.model.max_seq_len,
            rates=rates,
            global_batch=cfg.global_batch,
        )
    except ValueError as e:
        raise DistError(str(e)) from None
    if spec or cfg.global_batch:
        log.info(
            f"capacity {spec}: "
            + ", ".join(f"rank{r}={s.line()}" for r, s in enumerate(shapes))
            + f" (global {sum(s.windows for s in shapes)} windows, "
            f"{sum(s.tokens for s in shapes)} tokens)"
        )
    return shapes
