"""What every gate shares: the fixture run, the fleet spawner, the recorder, the record.

A gate pairs a FLEET run with a REFERENCE and turns the comparison into a `Record`
(claim, instrument, measured, tolerance + reason, verdict, environment). This module owns:

* the fixture: the `tiny` preset (dropless MoE, fp32) on a deterministic text corpus,
  exact fp32 gradient reduce, log every step;
* `fleet(spec)`: spawn `spec.world` ranks with torch.multiprocessing (gloo on the CPU, or
  one process per card on nccl with cuda=True), each calling `train_run` exactly as the CLI
  does, with a `Recorder` on the loop's callbacks that only RECORDS what passes (losses,
  fingerprints, LFB biases, the parameters before and after step 1); results are cached per process (and
  per pytest session across xdist workers through $DORMOUSE_GATE_CACHE with a file lock),
  so one fleet run feeds every claim that reads it;
* `single(spec)`: the reference at the global batch (`references/single.py`) with the same
  recorder on the same callbacks.

Children start from a forkserver that has imported torch and dormouse once, so a 2-rank
spawn costs a fork, not two interpreter starts. Every rank sets the NCCL safety variables,
uses one CPU thread (two ranks on a two-core machine) and a finite collective timeout, so
a broken collective fails the gate instead of hanging it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import math
import os
import pickle
import platform
import random
import socket
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
#: Collective timeout inside a gate's fleet: a rank stuck in a collective longer than this
#: fails the gate instead of hanging it (generous: two ranks share two loaded cores).
COLLECTIVE_TIMEOUT_S = 120
#: The same under a planted bug (gates/mutations.py), where ranks that disagree are expected:
#: the gate's verdict comes from what they recorded, not from waiting out a hang.
MUTANT_TIMEOUT_S = 20
#: Wall-clock limit of one fleet spawn, after which its ranks are killed (a hang).
SPAWN_DEADLINE_S = 300
MUTANT_DEADLINE_S = 90


def _limits(spec: "FleetSpec") -> tuple[float, float]:
    """(collective timeout, spawn deadline) of a fleet. A planted bug gets the short ones,
    except in a compiling fleet: dynamo traces each graph on every rank before its first
    collective (~40 s a fleet on the quiet 2-core box, twice that under pytest -n 2), which a
    20 s collective timeout or a 90 s deadline would read as a hang (a crash, not a catch)."""
    compiles = any(s == "compile=true" for s in spec.sets)
    if spec.mutation and not compiles:
        return MUTANT_TIMEOUT_S, MUTANT_DEADLINE_S
    return COLLECTIVE_TIMEOUT_S, SPAWN_DEADLINE_S


#: Every gate module, in the order of the status table.
GATES = [
    "g01_trajectory", "g02_identical", "g03_unequal", "g04_fsdp", "g05_nonfinite",
    "g06_nccl", "g07_launch", "g08_rank0", "g09_capacity", "g10_torchrun", "g11_lfb",
    "g12_fsdp_checkpoint", "g13_policy", "g14_engram_ram_fleet", "g15_signal_stop",
    "g16_clip", "g17_bf16_reduce", "g18_causal", "g19_kernels", "g20_data", "g21_multinode",
    "g22_elastic", "g23_capacity_fleet", "g24_fsdp_muon", "g25_sharded_ckpt",
    "g26_accumulation", "g27_resplit", "g28_rebalance", "g29_dropout", "g30_mixed_dtype",
    "g31_compile_fleet", "g32_reference_model", "g33_reference_step",
]  # fmt: skip


def load(name: str):
    import importlib

    return importlib.import_module(f"gates.{name}")


# ---- the record ---------------------------------------------------------------------------


@dataclass
class Record:
    gate: str
    claim: str
    instrument: str
    measured: str
    tolerance: str
    passed: bool
    env: dict = field(default_factory=dict)
    seconds: float = 0.0
    details: dict = field(default_factory=dict)

    def verdict(self) -> str:
        return "PASS" if self.passed else "FAIL"

    def summary(self) -> str:
        return (f"[{self.verdict()}] {self.gate}: {self.claim}\n    measured: {self.measured}\n"
                f"    tolerance: {self.tolerance}\n    ({self.seconds:.1f} s, {self.env})")  # fmt: skip


def environment(backend: str, device: str, world: str = "-") -> dict:
    return {"torch": torch.__version__, "backend": backend, "device": device, "world": world,
            "python": platform.python_version()}  # fmt: skip


def fleet_env(cuda: bool, world: tuple[int, ...] | int = 2) -> dict:
    ws = ",".join(map(str, world)) if isinstance(world, tuple) else str(world)
    if cuda:
        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cuda"
        return environment("nccl", f"{torch.cuda.device_count()}x {name}", ws)
    return environment("gloo", "cpu", ws)


def timed(gate: str, fn: Callable[[], Record]) -> Record:
    """Run one gate; an exception is a FAIL whose measured text is the error."""
    t0 = time.perf_counter()
    try:
        with threads(1):  # the gate's own references: tiny matmuls, one core each
            rec = fn()
    except Exception as e:  # noqa: BLE001 - a gate that crashes has failed, visibly
        rec = Record(gate, "(gate crashed)", "", f"{type(e).__name__}: {e}"[:2000], "", False,
                     details={"traceback": traceback.format_exc()})  # fmt: skip
    rec.seconds = time.perf_counter() - t0
    return rec


# ---- the fixture ----------------------------------------------------------------------------

CORPUS_BYTES = 96_000
#: The fixture's per-rank batch; the global batch is BATCH * world.
BATCH = 2


def corpus_path() -> Path:
    """A deterministic text-like corpus (Zipf-ish words), large enough that the val split
    (1%) is longer than one window at every batch the gates use, so the train view is the
    same bytes for the fleet and for its global-batch reference."""
    where = Path(os.environ.get("DORMOUSE_GATE_CACHE") or _default_cache()) / "corpus.txt"
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


def _default_cache() -> str:
    return os.path.join(os.environ.get("TMPDIR", "/tmp"), f"dormouse-gates-{os.getuid()}")


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
    mutation: str = ""  # a name from gates/mutations.py, applied inside every rank
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


# ---- recording a run -------------------------------------------------------------------------------


def lfb_biases(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().cpu().clone() for n, b in model.named_buffers() if n.endswith("lfb_bias")}


def host_tables(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{name.table: CPU copy} of every host-RAM Engram table (engram_ram). They are no
    parameters, so the parameter fingerprint never sees them; empty without engram_ram."""
    from dormouse.model.engram import HostTables

    return {f"{n}.table": m.table.detach().clone() for n, m in model.named_modules()
            if isinstance(m, HostTables)}  # fmt: skip


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.to_local() if hasattr(t, "to_local") else t


#: Keys of the optimizer state that the schedule sets every step (not the step's doing).
_SCHEDULE_KEYS = ("lr",)


def _hash_tree(h, obj) -> None:
    """Feed every tensor (local shard of a DTensor) and scalar of a nested state into h."""
    if torch.is_tensor(obj):
        t = _local(obj).to("cpu").contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        for k in sorted(obj, key=repr):
            if k in _SCHEDULE_KEYS:
                continue
            h.update(repr(k).encode())
            _hash_tree(h, obj[k])
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _hash_tree(h, v)
    else:
        h.update(repr(obj).encode())


def _digest(*objs) -> str:
    h = hashlib.sha256()
    for o in objs:
        _hash_tree(h, o)
    return h.hexdigest()[:16]


def state_hash(model: torch.nn.Module, opt) -> dict[str, str]:
    """SHA-256 (per component) of everything a step may change on this rank: parameters,
    their gradients (None hashed as such), buffers (LFB counts and biases), host-RAM Engram
    tables with their Adam moments and pending row gradients, and the optimizer's state
    (its lr, which the schedule sets each step, left out). Local, no collective: compared on
    one rank before and after a step."""
    from dormouse.model.engram import HostTables

    params = sorted(model.named_parameters(), key=lambda kv: kv[0])
    hosts = [m for _, m in model.named_modules() if isinstance(m, HostTables)]
    return {
        "parameters": _digest([(n, p) for n, p in params]),
        "gradients": _digest([(n, "none" if p.grad is None else p.grad) for n, p in params]),
        "buffers": _digest(sorted(model.named_buffers(), key=lambda kv: kv[0])),
        "host tables": _digest([m.table for m in hosts]),
        "host row gradients": _digest([[leaf.grad for _, leaf in m._leaves
                                        if leaf.grad is not None] for m in hosts]),  # fmt: skip
        "optimizer": _digest(opt.state_dict()) if opt is not None else "",
    }


def plain_tensors(named) -> dict[str, torch.Tensor]:
    """references.fingerprint's {clean name: full CPU copy}, sorted by name, of (name, tensor)
    pairs, with every FSDP2 shard (a DTensor sharded on dim 0 of a 1-D mesh) gathered in ONE
    all-gather per process group and dtype instead of one full_tensor() each: the same bytes
    (a gather is a copy), so the same fingerprint. A COLLECTIVE like full_tensor(): every rank
    calls it at the same point. (The recorder gathers every parameter after every step, ~48
    tensors: one full_tensor() each cost 3.3 s of a 15 s 2-rank FSDP2 run and 9.7 s of a 28 s
    3-rank one, measured with cProfile on the 2-core box.)"""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard

    from references.fingerprint import _clean

    named = sorted(((_clean(n), t.detach()) for n, t in named), key=lambda kv: kv[0])
    out: dict[str, torch.Tensor] = {}
    groups: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for n, t in named:
        if not hasattr(t, "full_tensor"):
            out[n] = t.to("cpu").contiguous().clone()
        elif (t.device_mesh.ndim == 1 and tuple(t.placements) == (Shard(0),) and t.ndim >= 1):
            groups.setdefault((t.device_mesh, t.dtype), []).append((n, t))
        else:  # any other layout: torch's own gather, one tensor at a time
            out[n] = t.full_tensor().to("cpu").contiguous().clone()
    for (mesh, dtype), items in groups.items():
        world, me, pg = mesh.size(), mesh.get_local_rank(), mesh.get_group()
        # each rank's rows of each tensor, by torch's own (torch.chunk) rule; the last ranks
        # may hold fewer rows, or none
        sizes = [[Shard.local_shard_size_and_offset(t.shape[0], world, r)[0] for r in range(world)]
                 for _, t in items]  # fmt: skip
        rows = [math.prod(t.shape[1:]) for _, t in items]
        span = [max(s) * w for s, w in zip(sizes, rows)]  # one rank's padded piece per tensor
        local = [t.to_local() for _, t in items]
        for (n, t), loc, s in zip(items, local, sizes):
            if loc.shape[0] != s[me]:
                raise RuntimeError(f"{n}: rank {me} holds {loc.shape[0]} rows of {t.shape[0]}, "
                                   f"torch.chunk gives {s[me]}: not FSDP2's dim-0 sharding")
        send = torch.zeros(sum(span), dtype=dtype, device=local[0].device)
        at = 0
        for loc, L in zip(local, span):
            send[at:at + loc.numel()] = loc.reshape(-1)
            at += L
        recv = torch.empty(world * send.numel(), dtype=dtype, device=send.device)
        with warnings.catch_warnings():  # torch 2.13 renames it; 2.11 (the GPU box) has no new name
            warnings.simplefilter("ignore", FutureWarning)
            dist.all_gather_into_tensor(recv, send, group=pg)
        recv = recv.view(world, -1).to("cpu")
        at = 0
        for (n, t), s, w, L in zip(items, sizes, rows, span):
            out[n] = torch.cat([recv[r, at:at + s[r] * w] for r in range(world)]).view(t.shape)
            at += L
    return {n: out[n] for n, _ in named}


class Recorder:
    """Records a run through the loop's callbacks (`dormouse.train.step.Callbacks`); changes
    nothing.

    after_backward runs once per step after backward, the reductions, the clip and the
    agreed finiteness verdict, before the optimizer, so the parameters it sees are those after
    the previous step: call k records the state after k steps (and, at the snap steps, step
    k's reduced gradient). after_step runs at the end of every step, taken or skipped: it
    records the pre-clip global gradient norm and, with states=True, a hash of this rank's
    whole training state. (A fingerprint under FSDP2 is a collective; every rank records at
    the same point.)
    """

    snap_steps = (0, 1)

    def __init__(self, journal: Path | None = None, probe=None, states: bool = False):
        #: a file each step's verdict (and, with states, state hash) is appended to as it
        #: happens, so a rank that dies mid-run (a C++ abort cannot be caught) still leaves
        #: its evidence
        self.journal, self.probe, self.states = journal, probe, states
        self.model = self.net = self.opt = self.ctx = None
        self.rec = {"fingerprints": [], "decisions": [], "losses": [], "local_losses": [],
                    "lfb": [], "params": {}, "grads": {}, "probe": [],
                    "host_fingerprints": [], "host": {}, "gnorms": [], "states": [],
                    "scales": []}  # fmt: skip

    def callbacks(self):
        from dormouse.train.step import Callbacks

        return Callbacks(after_backward=self.after_backward, after_step=self.after_step,
                         on_log=self.on_log)  # fmt: skip

    def _seen(self, info: dict) -> None:
        self.model, self.net, self.opt, self.ctx = (info["model"], info["net"], info["opt"],
                                                    info["ctx"])  # fmt: skip

    def after_backward(self, info: dict) -> None:
        from references.fingerprint import fingerprint_params

        self._seen(info)
        rec, model = self.rec, self.model
        k = len(rec["decisions"])
        params = plain_tensors(model.named_parameters())
        rec["fingerprints"].append(fingerprint_params(params))
        rec["lfb"].append(lfb_biases(model))
        host = host_tables(model)
        rec["host_fingerprints"].append(fingerprint_params(host) if host else None)
        if k in self.snap_steps:
            rec["params"][k] = params
            rec["host"][k] = host
            rec["grads"][k] = plain_tensors((n, p.grad) for n, p in model.named_parameters()
                                            if p.grad is not None)  # fmt: skip
        if self.probe is not None:
            rec["probe"].append(self.probe(k, model))
        rec["decisions"].append((bool(info["local"]), bool(info["agreed"])))
        self._journal({"k": k, "local": bool(info["local"]), "agreed": bool(info["agreed"])})

    def _journal(self, row: dict) -> None:
        if self.journal is not None:
            import json

            with open(self.journal, "a") as f:
                f.write(json.dumps(row) + "\n")

    def after_step(self, info: dict) -> None:
        self._seen(info)
        self.rec["gnorms"].append(float(info["gnorm"]))
        self.rec["scales"].append(info.get("scale"))
        if self.states:
            self.rec["states"].append(state_hash(self.model, self.opt))
            self._journal({"state": self.rec["states"][-1]})

    def on_log(self, info: dict) -> None:
        self.rec["losses"].append(info["loss"])
        self.rec["local_losses"].append(info["local_loss"])

    def finish(self) -> dict:
        from dormouse.train.store.checkpoint import optimizer_state
        from references.fingerprint import fingerprint_params

        rec = self.rec
        rec["final_params"] = plain_tensors(self.model.named_parameters())
        rec["final_fingerprint"] = fingerprint_params(rec["final_params"])
        rec["final_lfb"] = lfb_biases(self.model)
        rec["final_host"] = host_tables(self.model)
        rec["final_host_fingerprint"] = (fingerprint_params(rec["final_host"])
                                         if rec["final_host"] else None)  # fmt: skip
        # The full optimizer state as a checkpoint would hold it (a collective under FSDP2;
        # rank 0 holds it, other ranks may get {}).
        rec["final_opt"] = optimizer_state(self.net, self.opt) if self.opt is not None else {}
        return rec


@contextlib.contextmanager
def no_plot(skip: bool = True):
    """Inside the block the loop does not draw its loss curve (loss.png, rank 0's last act of
    every run: 0.15-0.45 s each, measured, over a hundred runs a session), for the gates that
    never look at it; dormouse itself always plots. Gate 8, which lists what rank 0 wrote,
    keeps it (FleetSpec.plot)."""
    from dormouse.train import loop

    real = loop._plot
    if skip:
        loop._plot = lambda *a: None
    try:
        yield
    finally:
        loop._plot = real


@contextlib.contextmanager
def log_lines(sink: Callable[[str], None], name: str = "dormouse", ranked: bool = False):
    """Hand every line logger `name` emits at INFO or above inside the block to `sink`.
    `ranked`: only what the CLI would print on this rank (its rank filter: INFO from rank 0
    only, warnings and every-rank lines from all)."""
    import logging

    class Sink(logging.Handler):
        def emit(self, record):
            sink(self.format(record))

    handler = Sink(logging.INFO)
    if ranked:
        from dormouse.cli import _RankFilter

        handler.addFilter(_RankFilter())
    logger = logging.getLogger(name)
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


# ---- the fleet --------------------------------------------------------------------------------


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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _at_training_forward(model: torch.nn.Module, at: int, change: Callable) -> None:
    """Pass the loss of the `at`-th (0-based) training forward through `change(loss)`."""
    orig = model.forward
    calls = [0]

    def forward(x, y=None):
        logits, loss, aux = orig(x, y)
        if model.training and loss is not None:
            if calls[0] == at:
                loss = change(loss)
            calls[0] += 1
        return logits, loss, aux

    model.forward = forward


def record_inputs(model: torch.nn.Module, sink: list) -> None:
    """Append the bytes of every training forward's input x to `sink` (uint8 [B, T] arrays):
    which windows this process trained on, step by step."""
    orig = model.forward

    # outside dynamo: traced, the append would make every compiled forward guard on
    # len(sink) and recompile at each step (8 times a rank, then run that frame eagerly)
    @torch.compiler.disable
    def keep(x):
        sink.append(x.detach().to("cpu", torch.uint8).numpy().copy())

    def forward(x, y=None, *args, **kwargs):
        if model.training and y is not None:
            keep(x)
        return orig(x, y, *args, **kwargs)

    model.forward = forward


def _inject_nan(model: torch.nn.Module, at: int) -> None:
    """Make the `at`-th training forward return a NaN loss whose GRADIENT is finite.

    loss + NaN (a constant) has d/d(loss) = 1, so backward and the reducer are untouched and
    only this rank's local finiteness check disagrees with the others': exactly the case the
    one-collective decision exists for.
    """
    _at_training_forward(model, at, lambda loss: loss + float("nan"))


def _signal_during(model: torch.nn.Module, at: int) -> None:
    """Send this process SIGTERM inside the `at`-th training forward: a scheduler's
    preemption notice reaching one rank only, in the middle of a step."""
    import signal

    def term(loss):
        os.kill(os.getpid(), signal.SIGTERM)
        return loss

    _at_training_forward(model, at, term)


def _rank_main(rank: int, spec: FleetSpec, out: str, port: int) -> None:
    from dormouse.train.fleet.launch import NCCL_SAFE_ENV

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(spec.world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(spec.world), **NCCL_SAFE_ENV})  # fmt: skip
    torch.set_num_threads(1)
    if spec.cuda:
        exact_fp32()
    if spec.mutation:  # a planted bug (gates/mutations.py): this rank runs the broken code
        from gates.mutations import apply

        apply(spec.mutation)
    result_path = Path(out) / f"rank{rank}.pkl"
    try:
        result = _rank_body(rank, spec, Path(out))
    except BaseException:
        (Path(out) / f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    tmp = result_path.with_suffix(".tmp")  # whole or absent: the spawner may kill this rank
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp, result_path)


def _rank_body(rank: int, spec: FleetSpec, out: Path) -> dict:
    import torch.distributed as dist

    from dormouse.train.run import train_run
    from references.single import build_model

    run_dir = out / (f"rank{rank}" if spec.per_rank_out else "run")
    run = _rank_dtype(fixture_run(spec, run_dir, dist=True), spec, rank)
    model = build_model(run)
    inputs: list = []
    record_inputs(model, inputs)
    if rank in spec.nan_ranks:
        _inject_nan(model, spec.nan_step)
    if rank == spec.signal_rank:
        _signal_during(model, spec.signal_step)
    recorder = Recorder(journal=out / f"rank{rank}.journal", states=spec.state_hashes)
    lines: list[str] = []
    timeout = _limits(spec)[0]
    device = "cuda" if spec.cuda else "cpu"
    t0 = time.perf_counter()
    stopped = False
    try:
        with no_plot(not spec.plot), log_lines(lines.append, ranked=True):
            report = train_run(run, device_type=device, model=model, close=False,
                               timeout_s=timeout, rate=spec.rates[rank] if spec.rates else None,
                               callbacks=recorder.callbacks())  # fmt: skip
    except KeyboardInterrupt:  # a stop on a signal: the loop wrote its checkpoint first
        if spec.signal_rank < 0:
            raise
        stopped = True
        report = {"checkpoint": str(Path(run.train.out_dir) / f"{run.train.ckpt_name}.pt")}
    except Exception:  # noqa: BLE001 - what this rank recorded before it failed is evidence
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        return {"rank": rank, "rec": recorder.rec, "error": traceback.format_exc()[-3000:],
                "lines": lines, "run_dir": str(run_dir)}  # fmt: skip
    rec = recorder.finish()
    shapes = [s.line() for s in recorder.ctx.shapes] if recorder.ctx else report.get("shapes")
    elapsed = time.perf_counter() - t0
    resumed = None
    if spec.resume_steps:
        ck = Path(report["checkpoint"])
        if rank == 0:  # the sharded checkpoint as one file (read alone, no collective)
            from dormouse.train.store.checkpoint import export_checkpoint

            export_checkpoint(ck, out / "first.pt")
        dist.barrier()
        run2 = _rank_dtype(fixture_run(dataclasses.replace(spec, steps=spec.resume_steps),
                                       run_dir, dist=True), spec, rank)  # fmt: skip
        again = Recorder(journal=out / f"rank{rank}.resume.journal", states=spec.state_hashes)
        model2 = build_model(run2)  # its values are replaced by the checkpoint's
        lines2: list[str] = []
        with no_plot(not spec.plot), log_lines(lines2.append, ranked=True):
            train_run(run2, device_type=device, model=model2, close=False, resume=True,
                      timeout_s=timeout, callbacks=again.callbacks())  # fmt: skip
        resumed = {"rec": again.finish(), "lines": lines2}
    dist.barrier()  # before teardown: without it gloo aborts intermittently
    dist.destroy_process_group()
    return {"rank": rank, "rec": rec, "report": report, "lines": lines, "shapes": shapes,
            "stopped": stopped, "inputs": inputs, "graphs": compiled_graphs(),
            "run_dir": str(run_dir), "elapsed": elapsed, "resumed": resumed}  # fmt: skip


def compiled_graphs() -> int:
    """Graphs dynamo compiled in this process so far: 0 means compile=true compiled nothing
    (a wrapper dynamo skips whole would still train, eagerly, and pass any trajectory check)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _rank_dtype(run, spec: FleetSpec, rank: int):
    """This rank's compute dtype from spec.dtypes (each card's own on a real mixed fleet)."""
    if not spec.dtypes:
        return run
    return dataclasses.replace(run, train=dataclasses.replace(run.train, dtype=spec.dtypes[rank]))


class FleetFailed(RuntimeError):
    pass


_forkserver_ready = False


def _context():
    global _forkserver_ready
    import torch.multiprocessing as mp

    method = os.environ.get("DORMOUSE_GATE_START", "forkserver")
    ctx = mp.get_context(method)
    if method == "forkserver" and not _forkserver_ready:
        # Imported once in the server; each rank is then a fork of an interpreter that has
        # torch loaded but has run nothing (no thread pools, no CUDA context to inherit).
        # (torch._dynamo: DDP imports it on construction, ~3 s; matplotlib: rank 0 plots its
        # loss curve at the end of every run; fit, optim, muon, device: every rank's start
        # imports them, 8-9% of a short fleet's rank time when each fork imported them anew;
        # gates._frozen, last: gc.freeze, so no rank's collector walks what it inherited.)
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                    "torch.distributed.fsdp",
                                    "torch.distributed.checkpoint.state_dict",
                                    "dormouse.model.model",
                                    "dormouse.train.loop", "dormouse.train.run",
                                    "dormouse.train.fleet.launch", "dormouse.train.fleet.parallelize",
                                    "dormouse.train.plan.fit", "dormouse.train.optim.mix",
                                    "dormouse.train.optim.muon", "dormouse.train.plan.device",
                                    "gates.harness", "references.single",
                                    "references.fingerprint", "matplotlib.pyplot",
                                    "gates._frozen"])  # fmt: skip
        _forkserver_ready = True
    return ctx


def spawn(fn, args: tuple, nprocs: int, deadline_s: float = SPAWN_DEADLINE_S) -> float:
    """Start nprocs processes fn(i, *args); wait; raise FleetFailed on an error or a hang."""
    ctx = _context()
    procs = [ctx.Process(target=fn, args=(i, *args), daemon=False) for i in range(nprocs)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    try:
        # Poll rather than join in order: once one rank has failed, the others would only
        # wait in a collective for a peer that is gone.
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            if time.perf_counter() - t0 > deadline_s:
                hung = [i for i, p in enumerate(procs) if p.is_alive()]
                raise FleetFailed(f"ranks {hung} still running after {deadline_s:.0f} s: a hang")
            time.sleep(0.02)
        bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
        if bad:
            raise FleetFailed(f"ranks exited non-zero: {bad}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    return time.perf_counter() - t0


_memory: dict[str, Any] = {}


@contextlib.contextmanager
def _locked(key: str):
    shared = os.environ.get("DORMOUSE_GATE_CACHE")
    if not shared:
        yield None
        return
    d = Path(shared)
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield d / f"{key}.pkl"
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def cached(key: str, compute: Callable[[], Any]) -> Any:
    """compute() once per process, and once per pytest session when the cache dir is shared."""
    if key in _memory:
        return _memory[key]
    with _locked(key) as path:
        if path is not None and path.exists():
            with open(path, "rb") as f:
                value = pickle.load(f)
        else:
            value = compute()
            if path is not None:
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                with open(tmp, "wb") as f:
                    pickle.dump(value, f)
                os.replace(tmp, path)
    _memory[key] = value
    return value


def work_dir(name: str) -> Path:
    base = Path(os.environ.get("DORMOUSE_GATE_CACHE") or _default_cache())
    d = base / f"{name}-{os.getpid()}-{time.monotonic_ns()}"
    d.mkdir(parents=True, exist_ok=True)
    return d


#: The mutation (gates/mutations.py) every fleet started in this process runs; "" = none.
ACTIVE_MUTATION = ""


def fleet(spec: FleetSpec, *, allow_errors: bool = False) -> list[dict]:
    """Run the fleet of `spec` (cached); one result dict per rank, in rank order.

    A rank whose training raised returns what it recorded until then with an "error" entry;
    unless `allow_errors`, any such rank makes this raise FleetFailed (the gate crashes).
    """
    if ACTIVE_MUTATION and not spec.mutation:
        spec = dataclasses.replace(spec, mutation=ACTIVE_MUTATION)
    results = _fleet(spec)
    errors = [(r["rank"], r["error"]) for r in results if r.get("error")]
    if errors and not allow_errors:
        raise FleetFailed(f"fleet {spec.name}: rank(s) {[i for i, _ in errors]} raised:\n"
                          + "\n".join(e for _, e in errors))
    return results


def child_env(env: dict, fault: str = "") -> dict:
    """`env` for a process a gate launches (torchrun and its workers): the repo on
    PYTHONPATH, and the active fleet mutation (gates/mutations.py) and `fault`
    (gates/faults.py) planted at interpreter start through a sitecustomize module placed
    first on the path."""
    env = dict(env)
    path = [str(ROOT)]
    if ACTIVE_MUTATION or fault:
        site = work_dir("mutant-site")
        (site / "sitecustomize.py").write_text(
            "from gates.mutations import apply_from_env\napply_from_env()\n"
            "from gates.faults import apply_from_env as plant_fault\nplant_fault()\n")
        path.insert(0, str(site))
        env["DORMOUSE_MUTATION"] = ACTIVE_MUTATION
        env["DORMOUSE_FAULT"] = fault
    env["PYTHONPATH"] = os.pathsep.join(path + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def torchrun() -> list[str]:
    import shutil
    import sys

    exe = shutil.which("torchrun")
    return [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]


#: What every gate's torchrun child gets: one thread, NVLink multicast off, no TF32, a
#: deterministic cuBLAS.
LAUNCH_ENV = {"OMP_NUM_THREADS": "1", "NCCL_NVLS_ENABLE": "0",
              "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
              "NVIDIA_TF32_OVERRIDE": "0", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}  # fmt: skip


def launch_env(fault: str = "") -> dict:
    """os.environ for a torchrun a gate starts: no inherited fleet variables, LAUNCH_ENV."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(LAUNCH_ENV)
    return child_env(env, fault)


def metrics_losses(run_dir: Path) -> list[float]:
    """The train losses rank 0 logged to metrics.jsonl, in order."""
    import json

    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r["loss"] for r in map(json.loads, path.read_text().splitlines())
            if r.get("kind") == "train"]  # fmt: skip


def cli_reference(sets: tuple[str, ...], batches: list[int], steps: int) -> dict:
    """One process at the global batch of a CLI fleet run of `tiny` with these --set
    values (cached): the recorder's record, losses per step."""
    from dormouse.config import apply_sets, preset, validate

    tag = "cli-ref-" + hashlib.sha256(repr((sets, batches, steps)).encode()).hexdigest()[:16]

    def compute():
        from references.single import global_run, run_single

        out = work_dir("cli-ref")
        fleet_run = validate(apply_sets(preset("tiny"), [*sets, f"out_dir={out}",
                                                         f"steps={steps}"]))  # fmt: skip
        run = global_run(fleet_run, batches)
        if run.train.device == "cuda":
            exact_fp32()
        recorder = Recorder()
        with threads(1), no_plot():
            run_single(run, callbacks=recorder.callbacks())
        return recorder.finish()

    return cached(tag, compute)


def rank_errors(ranks: list[dict]) -> str:
    """'' when every rank finished; else one line per rank that raised (its last line)."""
    bad = [f"rank {r['rank']} raised {r['error'].strip().splitlines()[-1]}" for r in ranks
           if r.get("error")]  # fmt: skip
    return "; ".join(bad)


def _fleet(spec: FleetSpec) -> list[dict]:

    def compute():
        t0 = time.perf_counter()
        for attempt in (1, 2):
            out = work_dir(f"fleet-{spec.name}")
            try:
                wall = spawn(_rank_main, (spec, str(out), free_port()), spec.world,
                             _limits(spec)[1])
                break
            except FleetFailed as e:
                errors = "".join(f"\n--- rank error ---\n{p.read_text()[-3000:]}"
                                 for p in sorted(out.glob("rank*.error")))  # fmt: skip
                # free_port() releases the port before rank 0 binds it; another process can
                # take it in between (rare). That, and only that, is worth a second try.
                if attempt == 1 and "ddress already in use" in errors:
                    continue
                # A rank that died (a C++ abort on a collective mismatch, a hang) leaves its
                # journal: what it decided, step by step, is still evidence.
                wall = time.perf_counter() - t0
                failure = f"{e}{errors}"
                break
        else:  # pragma: no cover - the loop always breaks
            raise AssertionError
        results = []
        for r in range(spec.world):
            pkl = out / f"rank{r}.pkl"
            if pkl.exists():
                with open(pkl, "rb") as f:
                    results.append(pickle.load(f))
            else:
                results.append({"rank": r, "rec": _read_journal(out / f"rank{r}.journal"),
                                "error": f"fleet {spec.name}: {failure}", "lines": []})  # fmt: skip
        for r in results:
            r["wall"] = wall
            r["out"] = str(out)
        return results

    return cached("fleet-" + spec.key(), compute)


def _read_journal(path: Path) -> dict:
    import json

    rec = {"decisions": [], "states": []}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if "agreed" in row:
                rec["decisions"].append((row["local"], row["agreed"]))
            else:
                rec["states"].append(row["state"])
    return rec


@contextlib.contextmanager
def threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


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


#: Fields a one-process run never reads (the fleet's reduce, sharding, buckets and timeout):
#: two gates whose references differ only there share one reference run.
_FLEET_ONLY = {"dist_shard": "none", "dist_reduce": "auto", "bucket_mb": 0.0,
               "dist_timeout": 600.0}  # fmt: skip


def _reference_key(spec: FleetSpec, batches: list[int], steps: int | None) -> str:
    """What a reference's result depends on: its effective config (the fixture at the global
    batch sum(batches), without its folder and the fields in _FLEET_ONLY), so that the gates
    whose references are the same run share one (the fleet specs differ by name and split)."""
    from references.single import global_run

    run = global_run(fixture_run(spec, Path("reference"), dist=False), batches)
    t = dataclasses.replace(run.train, out_dir="", **_FLEET_ONLY,
                            **({"steps": steps} if steps is not None else {}))  # fmt: skip
    return repr(dataclasses.replace(run, train=t).to_json())


def single(spec: FleetSpec, batches: list[int] | None = None, *, probe=None,
           resume_from: str | None = None, steps: int | None = None,
           drop_steps: tuple[int, ...] = (), split_rows: bool = False,
           fresh: bool = False) -> dict:  # fmt: skip
    """The reference: one process at the global batch of `spec` (cached like a fleet, by its
    effective config: `_reference_key`, so gates whose references are the same run share it).

    `drop_steps`: 0-based steps whose batch the reference never trains on (no forward, no
    backward): what a fleet's skipped step must be equivalent to. `split_rows`: the same run
    with each batch run as the fleet's per-rank pieces in one process, for the reference's
    own round-off spread. `fresh`: run it now and keep it out of every cache, for a run under
    a patch of this process (a test's monkeypatch): no reference, and the config key cannot
    see the patch, so a cached run would answer for it, or it for a later reference.
    """
    spec = dataclasses.replace(spec, mutation="")  # the reference never runs a planted bug
    batches = batches or batches_of(spec)
    tag = repr((_reference_key(spec, batches, steps), tuple(batches) if split_rows else (),
                probe.__name__ if probe else None, resume_from, drop_steps))  # fmt: skip

    def compute():
        import shutil

        from references.single import build_model, global_run, run_single

        out = work_dir(f"single-{spec.name}")
        run = global_run(fixture_run(spec, out, dist=False), batches)
        if steps is not None:
            run = dataclasses.replace(run, train=dataclasses.replace(run.train, steps=steps))
        recorder = Recorder(probe=probe)
        if resume_from:
            shutil.copy(resume_from, Path(run.train.out_dir) / f"{run.train.ckpt_name}.pt")
        if spec.cuda:
            exact_fp32()
        t0 = time.perf_counter()
        with threads(1), no_plot():
            model = build_model(run)
            inputs: list = []
            record_inputs(model, inputs)
            _, report = run_single(run, callbacks=recorder.callbacks(), model=model,
                                   resume=bool(resume_from),
                                   drop_steps=drop_steps,
                                   split_rows=tuple(batches) if split_rows else ())  # fmt: skip
            rec = recorder.finish()
        return {"rec": rec, "report": report, "elapsed": time.perf_counter() - t0,
                "run": run.to_json(), "out": str(out), "inputs": inputs}  # fmt: skip

    if fresh:
        return compute()
    return cached("single-" + hashlib.sha256(tag.encode()).hexdigest()[:16], compute)


# ---- comparisons -------------------------------------------------------------------------------


def max_abs_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        return float("inf")
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def flat_tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """{path: tensor} of every floating-point tensor in a nested state (an optimizer's)."""
    out: dict[str, torch.Tensor] = {}
    if torch.is_tensor(obj):
        if obj.is_floating_point():
            out[prefix] = _local(obj).to("cpu")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flat_tensors(v, f"{prefix}/{k}"))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            out.update(flat_tensors(v, f"{prefix}/{i}"))
    return out


#: On CUDA a tolerance is this multiple of the reference's own round-off spread on the card,
#: never less than the CPU's fp32 tolerance. The spread: the one-process reference against
#: itself run with each global batch cut into the fleet's per-rank pieces (forwards of 3 and
#: 1 windows instead of one of 4, in one process, no communication): the same mathematics,
#: but GPU kernels pick their blocking by shape, so the pieces round differently, by more
#: than the CPU's kernels do, and Adam's elementwise normalisation turns that round-off on
#: near-zero gradient entries into visible update differences. Measured on the card in the
#: same run, both numbers in the record. 4x, like the CPU tolerances. (Reversing the windows
#: was tried first and under-measures it: a row permutation leaves every matmul's shape, and
#: so its blocking, unchanged; measured 17x below the fleet's update error on an H200.)
SPREAD_K = 4.0


def tol_on(cuda: bool, fp32_tol: float, spread: float) -> float:
    """The tolerance a gate applies: the fp32 one on the CPU; on CUDA at least SPREAD_K x
    the reference's measured spread."""
    return max(fp32_tol, SPREAD_K * spread) if cuda else fp32_tol


def judge(cuda: bool, figures: dict[str, float], fp32_tol: dict[str, float],
          spread: dict[str, float] | None = None) -> tuple[bool, str, str]:
    """(every figure within its tolerance, "name figure, ..." text, "name <= tol, ..." text).
    On CUDA each tolerance is tol_on(...) of the reference's spread of the same figure."""
    spread = spread or {}
    tol = {k: tol_on(cuda, t, spread.get(k, 0.0)) for k, t in fp32_tol.items()}
    ok = all(figures[k] <= tol[k] for k in tol)
    text = ", ".join(f"{k} {fmt(figures[k])}" for k in tol)
    if cuda and spread:
        text += " (the reference's own spread: " + ", ".join(
            f"{k} {fmt(spread[k])}" for k in tol if k in spread) + ")"
    return ok, text, ", ".join(f"{k} <= {fmt(v)}" for k, v in tol.items())


def max_rel_diff(a: list[float], b: list[float]) -> float:
    """max |a_i - b_i| / |b_i| (inf on a length mismatch or a non-finite entry)."""
    if len(a) != len(b) or not a:
        return float("inf")
    out = 0.0
    for x, y in zip(a, b):
        if not (math.isfinite(x) and math.isfinite(y)):
            return float("inf")
        out = max(out, abs(x - y) / max(abs(y), 1e-30))
    return out


def rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||b|| over all tensors together (fp64)."""
    if set(a) != set(b):
        return float("inf")
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b)
    den = sum(float(b[k].double().pow(2).sum()) for k in b)
    return (num / max(den, 1e-300)) ** 0.5


def update_rel_err(after: dict, ref_after: dict, before: dict) -> float:
    """Relative error of the UPDATE: ||(a - p0) - (r - p0)|| / ||r - p0||. Far more sensitive
    than the parameter error, whose denominator is the (large) parameters themselves."""
    du = {k: after[k].double() - before[k].double() for k in before}
    dr = {k: ref_after[k].double() - before[k].double() for k in before}
    return rel_err(du, dr)


def fmt(x: float) -> str:
    return f"{x:.2e}" if x != 0 else "0"


def gate_source_hash(gate: str) -> str:
    """What marks a recorded row stale: the gate module's source changed since it ran."""
    return hashlib.sha256((ROOT / "gates" / f"{gate}.py").read_bytes()).hexdigest()[:12]


#: Records of the GPU runs (`--cuda-fleet`, `--cuda`), kept so the CPU run can show them.
CUDA_RECORDS = ROOT / "docs" / "status-cuda.json"


def save_cuda_records(records: list[Record]) -> None:
    """Merge these GPU records into docs/status-cuda.json (the newest entry per gate)."""
    import json

    old = json.loads(CUDA_RECORDS.read_text()) if CUDA_RECORDS.exists() else []
    new = {r.gate: r for r in records}
    keep = [e for e in old if e["gate"] not in new]
    rows = keep + [{**dataclasses.asdict(r), "details": {}, "source": gate_source_hash(r.gate)}
                   for r in new.values()]  # fmt: skip
    CUDA_RECORDS.write_text(json.dumps(rows, indent=1) + "\n")


def load_cuda_records() -> list[tuple[Record, bool]]:
    """(record, stale) for every saved GPU row; stale when its gate's code changed since."""
    import json

    if not CUDA_RECORDS.exists():
        return []
    out = []
    for e in json.loads(CUDA_RECORDS.read_text()):
        source = e.pop("source", "")
        rec = Record(**e)
        fresh = (ROOT / "gates" / f"{rec.gate}.py").exists() and source == gate_source_hash(rec.gate)
        out.append((rec, not fresh))
    return out


def write_status(records: list[Record], path: Path,
                 extra: list[tuple[Record, bool]] = ()) -> None:
    """The status table: `records` (this run), each followed by the saved GPU rows of the same
    gate from `extra` (marked stale where the gate changed after they ran)."""
    env = records[0].env if records else {}
    lines = [
        "# Status: every claim is a gate",
        "",
        "Generated by `python -m gates` (do not edit by hand): each row is a fleet run compared "
        "with a hand-written reference in `references/`; the tolerance carries its reason.",
        "",
        f"Environment: torch {env.get('torch', torch.__version__)}, "
        f"python {platform.python_version()}; backend/device per row.",
        "",
        "| gate | claim | instrument | measured | tolerance | verdict |",
        "|---|---|---|---|---|---|",
    ]
    def row(r: Record, stale: bool = False) -> str:
        world = r.env.get("world", "-")
        verdict = (f"{r.verdict()} ({r.env.get('backend', '-')}, {r.env.get('device', '-')}"
                   + (f", world {world})" if world != "-" else ")"))
        if stale:
            verdict += " STALE: the gate changed since this row ran"
        cells = [r.gate, r.claim, r.instrument, r.measured, r.tolerance, verdict]
        return "| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |"

    for r in records:
        lines.append(row(r))
        lines += [row(e, stale) for e, stale in extra if e.gate == r.gate]
    lines.append("")
    path.write_text("\n".join(lines))


def gate_lines(records: list[Record], extra: list[tuple[Record, bool]] = ()) -> list[str]:
    """The README's lines, from the records of the status table: one per gate, its verdict on
    the CPU, its last GPU row's (nccl, or one card; STALE as in the table), its claim."""
    def verdict(r: Record) -> str:
        backend, device = r.env.get("backend", "-"), r.env.get("device", "-")
        where = [backend] if backend not in ("-", "none") else []
        if not where or not device.startswith("cpu"):
            where.append(device)
        return f"{r.verdict()} ({', '.join(where)})"

    out = []
    for r in records:
        gpu = [(e, stale) for e, stale in extra if e.gate == r.gate]
        last = (verdict(gpu[-1][0]) + (" STALE" if gpu[-1][1] else "")) if gpu else "not run"
        out.append(f"- [`{r.gate}`](docs/status.md): {verdict(r)}; GPU: {last}. {r.claim}")
    return out



# ---- the shared fleet runs (one run feeds several claims) ---------------------------------------

#: Adam's eps for the fixtures whose figures read small gradients through Adam (gates 2, 3, 5,
#: 14, 24; torch's default is 1e-8). Why, isolated 2026-12-03 on gate 14: the Engram conv
#: starts at zero, so in a short fixture the tables' gradients are 1e-9 .. 1e-6, many within
#: 0.1-10x of eps = 1e-8. There Adam's first step lr * g / (|g| + eps) has the slope lr / eps
#: (5e3 at the Engram lr 5e-3), so an fp32 round-off of 1e-10 in a gradient sum (a fleet sums
#: per rank, then over the ranks) moves that element's update by ~5e-5; the dense AdamW
#: groups' near-zero entries do the same. World 3 shows it most: its loss weights 3/2, 1/2, 1
#: and DDP's division by 3 round where world 2 and 4's (powers of two) are exact. At 1e-5 the
#: fixtures' gradients sit below eps, each update is near-linear in its gradient, and
#: round-off stays round-off (each gate's comment has its figures before and after).
STEADY_ADAM = "adam_eps=1e-5"
#: 2 ranks x 2 windows, DDP, Muon, 20 steps; eval and checkpoints every 10 steps; each rank
#: gets its own out_dir so the gate can see which rank wrote what. Gates 1, 2, 8.
DDP_RUN = FleetSpec("ddp", steps=20, per_rank_out=True, plot=True,
                   sets=("eval_every=10", "ckpt_every=10"))
#: Unequal capacity, two steps (the step-1 state is recorded inside step 2). Blocks in file
#: order (shuffle off), so the hand-written gradient reference reads step 0's block from byte
#: 0 without re-implementing the data module's block order. Gate 3, at world 2 and 3 (rank
#: order shows only from world 3 on). STEADY_ADAM (the update's world-3 tail at eps = 1e-8
#: was AdamW's first step on gradients near eps: 2.1e-5 -> 1.7e-6).
UNEQUAL_RUNS = {
    2: FleetSpec("unequal", steps=2, capacity="4,2", sets=("shuffle=false", STEADY_ADAM)),
    3: FleetSpec("unequal3", world=3, steps=2, capacity="4,2,3",
                 sets=("shuffle=false", STEADY_ADAM)),
}
#: Faults: a NaN loss (finite gradient) at step index 2 on each rank in turn and on two at
#: once, unequal capacity, host-RAM Engram tables and the LFB controller on, so a skipped step
#: has every kind of state to leave untouched. STEADY_ADAM (measured at world 3: host tables
#: 6.7e-5 at eps = 1e-8 -> 2.1e-7). Gates 5 and 2.
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
    3: FleetSpec("lfb3", world=3, steps=8, capacity="auto", rates=(3.0, 1.0, 2.0),
                 sets=("moe_lb_coef=0.01",)),
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
