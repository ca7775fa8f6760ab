"""The fixture every fleet gate runs, the named fleet runs that several gates share, and the
kernels' random inputs.

The fixture: the `tiny` preset (dropless MoE, fp32) on a deterministic text corpus, exact fp32
gradient reduce, log every step (`fixture_run`); a `FleetSpec` names one fleet run of it (world,
steps, split, the faults to inject), and equal specs share one cached run. On a CUDA fleet the
arithmetic is pinned deterministic (`exact_fp32`); every rank and reference uses one thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import random
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from gates.cache import base_dir

CORPUS_BYTES = 96_000
#: The fixture's per-rank batch; the global batch is BATCH * world.
BATCH = 2


def corpus_path() -> Path:
    """A deterministic text-like corpus (Zipf-ish words), large enough that the val split
    (1%) is longer than one window at every batch the gates use, so the train view is the
    same bytes for the fleet and for its global-batch reference."""
    where = base_dir() / "corpus.txt"
    if where.exists() and where.stat().st_size == CORPUS_BYTES:
        return where
    where.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(20261019)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words = ["".join(rng.choice(letters[: rng.randint(6, 26)]) for _ in range(rng.randint(1, 9)))
             for _ in range(400)]  # fmt: skip
    weights = [1.0 / (i + 1) for i in range(len(words))]
    out = bytearray()
    while len(out) < CORPUS_BYTES:
        sentence = " ".join(rng.choices(words, weights, k=rng.randint(4, 14)))
        out += (sentence[:1].upper() + sentence[1:] + ". ").encode()
    tmp = where.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(bytes(out[:CORPUS_BYTES]))
    os.replace(tmp, where)
    return where


def second_corpus_path() -> Path:
    """Another deterministic corpus (the first one's words, shuffled by another seed, in
    lower case), for the data-mixture gate: a second source whose bytes differ."""
    where = corpus_path().with_name("corpus2.txt")
    if where.exists() and where.stat().st_size == CORPUS_BYTES:
        return where
    words = corpus_path().read_bytes().lower().split(b" ")
    random.Random(20261130).shuffle(words)
    tmp = where.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(b" ".join(words)[:CORPUS_BYTES].ljust(CORPUS_BYTES, b" "))
    os.replace(tmp, where)
    return where


@dataclass(frozen=True)
class FleetSpec:
    """One fleet run of the fixture. Equal specs share one cached run."""

    name: str
    world: int = 2
    steps: int = 20
    batch: int = BATCH  # TrainConfig.batch: each rank's batch when capacity is ""
    capacity: str = ""
    sets: tuple[str, ...] = ()
    rates: tuple[float, ...] = ()  # injected per-rank rates for capacity=auto
    nan_ranks: tuple[int, ...] = ()  # inject a non-finite LOSS (finite gradients) on these ranks...
    nan_step: int = -1  # ...at this 0-based training forward
    per_rank_out: bool = False  # each rank gets its own out_dir (to see who writes what)
    plot: bool = False  # rank 0 draws loss.png at the end, as dormouse does (see no_plot)
    resume_steps: int = 0  # after the run, resume its checkpoint on the fleet up to this step
    signal_rank: int = -1  # this rank sends itself SIGTERM...
    signal_step: int = -1  # ...during this 0-based training forward (the run must stop cleanly)
    cuda: bool = False
    mutation: str = ""  # a name from gates/mutation_list/, applied inside every rank
    # EMULATION of a mixed-dtype fleet: rank r trains with dtype=dtypes[r] (a card's policy
    # rung, given by hand: every CPU rank would otherwise resolve auto alike); () = sets' dtype
    dtypes: tuple[str, ...] = ()
    # SHA-256 of each rank's whole training state after every step (rec["states"]): what a
    # skip must leave untouched (gate 5). Off elsewhere: hashing the optimizer state every
    # step cost ~2.5% of the gate suite's CPU time for runs that never read it.
    state_hashes: bool = False

    def key(self) -> str:
        return hashlib.sha256(repr(dataclasses.astuple(self)).encode()).hexdigest()[:16]


def fixture_run(spec: FleetSpec, out_dir: Path, *, dist: bool):
    from dormouse.config import apply_sets, preset, validate

    sets = [
        f"data={corpus_path()}", f"out_dir={out_dir}", f"steps={spec.steps}",
        f"batch={spec.batch}", "seq_len=64", "log_every=1", "eval_every=0", "ckpt_every=0",
        "warmup=0", "dist_reduce=fp32", "moe_capacity=0", "seed=7",
        # No clip: the fixture's pre-clip norms are 1.4-4.0, so grad_clip=1 would rescale
        # every step to norm 1 and hide any uniform gradient-scale error (the clip has its
        # own gate, g16, which turns it back on).
        "grad_clip=0",
        # Deterministic arithmetic on a CUDA fleet as on the CPU: the polar in fp32 (auto is
        # bf16 on CUDA) and the torch KDA arm (fla's Triton dots run TF32 whatever torch's
        # flags say); the fla arm has its own gates (g18, g19). The CPU resolves both so anyway.
        "ns_dtype=fp32", "kda_impl=torch",
        f"device={'cuda' if spec.cuda else 'cpu'}", f"dist={'true' if dist else 'false'}",
        f"dist_capacity={spec.capacity if dist else ''}", *spec.sets,
    ]  # fmt: skip
    return validate(apply_sets(preset("tiny"), sets))


def batches_of(spec: FleetSpec) -> list[int]:
    """Each rank's windows per step, read off the spec by hand (not by parse_capacity)."""
    cap = spec.capacity.strip()
    if cap == "":
        return [spec.batch] * spec.world
    if cap == "auto":
        raise ValueError(f"spec {spec.name}: capacity auto; pass the expected batches")
    # B, BxT, B*K, BxT*K: B windows per micro-batch, K micro-batches
    return [int(part.split("*")[0].split("x")[0]) * (int(part.split("*")[1]) if "*" in part else 1)
            for part in cap.split(",")]  # fmt: skip


def exact_fp32() -> None:
    """No TF32 and no atomics on a CUDA fleet or its reference: the gates measure the
    distributed arithmetic, and TF32's 10-bit mantissa (matmuls, cuDNN convs) or the order in
    which atomic adds land (index_add, scatter) would drown it. CUBLAS_WORKSPACE_CONFIG must
    be set before cuBLAS starts: `python -m gates` sets it first thing."""
    os.environ["NVIDIA_TF32_OVERRIDE"] = "0"
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True)


@contextlib.contextmanager
def threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


# ---- the shared fleet runs (one run feeds several claims) ---------------------------------------

#: Adam's eps where a gate reads small gradients through Adam (gates 2, 3, 5, 14, 24). A short
#: fixture's Engram gradients are 1e-9 .. 1e-6, near torch's eps = 1e-8, where Adam's first step
#: lr * g / (|g| + eps) has the slope lr / eps: a 1e-10 round-off of a fleet's gradient sum
#: moved an update by ~5e-5 (worst at world 3, whose weights do not round exactly). At 1e-5 the
#: step is near-linear in the gradient and round-off stays round-off.
STEADY_ADAM = "adam_eps=1e-5"
#: 2 ranks x 2 windows, DDP, Muon, 20 steps; eval and checkpoints every 10 steps; each rank
#: gets its own out_dir so the gate can see which rank wrote what. Gates 1, 2, 8.
DDP_RUN = FleetSpec(
    "ddp", steps=20, per_rank_out=True, plot=True, sets=("eval_every=10", "ckpt_every=10")
)
#: Unequal capacity, two steps (the step-1 state is recorded inside step 2). Blocks in file
#: order (shuffle off), so the hand-written gradient reference reads step 0's block from byte
#: 0 without re-implementing the data module's block order. Gate 3, at world 2 and 3 (rank
#: order shows only from world 3 on), with STEADY_ADAM.
UNEQUAL_RUNS = {
    2: FleetSpec("unequal", steps=2, capacity="4,2", sets=("shuffle=false", STEADY_ADAM)),
    3: FleetSpec(
        "unequal3", world=3, steps=2, capacity="4,2,3", sets=("shuffle=false", STEADY_ADAM)
    ),
}
#: Faults: a NaN loss (finite gradient) at step index 2 on each rank in turn and on two at
#: once, unequal capacity, host-RAM Engram tables and the LFB controller on, so a skipped step
#: has every kind of state to leave untouched; STEADY_ADAM. Gates 5 and 2.
_FAULT_SETS = ("engram_ram=true", "moe_lb_coef=0.01", STEADY_ADAM)
FAULT_RUNS = [
    FleetSpec(f"fault-w{len(cap.split(','))}-nan{''.join(map(str, nan))}",
              world=len(cap.split(",")), steps=5, capacity=cap, nan_ranks=nan, nan_step=2,
              sets=_FAULT_SETS, state_hashes=True)
    for cap, nan in (("3,1", (0,)), ("3,1", (1,)), ("3,1", (0, 1)),
                     ("3,1,2", (0,)), ("3,1,2", (1,)), ("3,1,2", (2,)))
]  # fmt: skip
#: The same faults with the verdict kept on the device (verdict=device: the ranks agree it by
#: an all-reduce on the device, the optimizer and the LFB apply it, the loop reads it a step
#: late); no host tables (their rows step on the host, refused there). Gate 5.
DEVICE_VERDICT_RUNS = [
    FleetSpec(f"fault-w3-nan{nan}-device-verdict", world=3, steps=5, capacity="3,1,2",
              nan_ranks=(nan,), nan_step=2,
              sets=("moe_lb_coef=0.01", "verdict=device", STEADY_ADAM), state_hashes=True)
    for nan in (0, 2)
]  # fmt: skip
#: FSDP2 + AdamW, 20 steps, then its sharded checkpoint resumed on the fleet to 25 (and its
#: export to one file, first.pt, resumed by one process). Gates 4, 12.
FSDP_RUN = FleetSpec("fsdp", steps=20, sets=("dist_shard=fsdp", "opt=adamw"), resume_steps=25)
#: LFB on (coef 0.01), capacity auto with injected rates (global batch 4 -> 3,1; 6 -> 3,1,2).
#: Gates 9, 11.
LFB_RUNS = {
    2: FleetSpec("lfb", steps=8, capacity="auto", rates=(3.0, 1.0), sets=("moe_lb_coef=0.01",)),
    3: FleetSpec(
        "lfb3", world=3, steps=8, capacity="auto", rates=(3.0, 1.0, 2.0), sets=("moe_lb_coef=0.01",)
    ),
}
#: The last rank gets SIGTERM during step 3 of 20; the fleet agrees every 10 steps, so every
#: rank stops after step 10 with one checkpoint, which the fleet then resumes to step 20. Gate 15.
SIGNAL_RUNS = {
    2: FleetSpec("signal", steps=20, signal_rank=1, signal_step=3, resume_steps=20),
    3: FleetSpec("signal3", world=3, steps=20, signal_rank=2, signal_step=3, resume_steps=20),
}


def worlds(cuda: bool, *available: int) -> tuple[int, ...]:
    """The world sizes a gate runs: all of them on gloo; on a CUDA fleet only world 2 (one
    process per card on the two-card machine; world 3 and 4 stay gloo rows)."""
    return tuple(w for w in available if w == 2) if cuda else available


def on(spec: FleetSpec, cuda: bool) -> FleetSpec:
    return dataclasses.replace(spec, cuda=True) if cuda else spec


# ---- the kernels' inputs ---------------------------------------------------------------------


def kda_inputs(B, T, H, K, V, dtype=torch.float32, decay=1.0, seed=0) -> list[torch.Tensor]:
    """[q, k, v, g, beta, S0] shaped like the KDA mixer's: unit-norm q, k; the log decay
    g = -decay * exp(A) * softplus(.); drawn in fp64 from `seed`, then cast to `dtype`."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*s):
        return torch.randn(*s, generator=gen, dtype=torch.float64)

    q = F.normalize(randn(B, T, H, K), dim=-1)
    k = F.normalize(randn(B, T, H, K), dim=-1)
    v = randn(B, T, H, V)
    A_log = torch.rand(H, K, generator=gen, dtype=torch.float64) * math.log(16.0)
    g = -decay * A_log.exp() * F.softplus(randn(B, T, H, K) - 3.0)
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    S0 = randn(B, H, K, V)
    return [x.to(dtype) for x in (q, k, v, g, beta, S0)]
