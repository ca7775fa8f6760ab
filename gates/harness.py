"""What every gate shares: the fixture run, the fleet spawner, the recorder, the record.

A gate pairs a FLEET run with a REFERENCE and turns the comparison into a `Record`
(claim, instrument, measured, tolerance + reason, verdict, environment). This module owns:

* the fixture: the `tiny` preset (dropless MoE, fp32) on a deterministic text corpus,
  exact fp32 gradient reduce, log every step;
* `fleet(spec)`: spawn `spec.world` ranks with torch.multiprocessing (gloo on the CPU, or
  one process per card on nccl with cuda=True), each calling `train_dist` exactly as the CLI
  does, with a `Parallel` subclass that only RECORDS what passes through the seams (losses,
  fingerprints, LFB biases, the parameters before and after step 1); results are cached per process (and
  per pytest session across xdist workers through $DORMOUSE_GATE_CACHE with a file lock),
  so one fleet run feeds every claim that reads it;
* `single(spec)`: the reference at the global batch (`references/single.py`) with the same
  recorder on the one-process seams.

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
import os
import pickle
import platform
import random
import socket
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
#: Collective timeout inside a gate's fleet: a rank stuck in a collective longer than this
#: fails the gate instead of hanging it (generous: two ranks share two loaded cores).
COLLECTIVE_TIMEOUT_S = 120
#: Wall-clock limit of one fleet spawn, after which its ranks are killed (a hang).
SPAWN_DEADLINE_S = 300


#: Every gate module, in the order of the status table.
GATES = [
    "g01_trajectory", "g02_identical", "g03_unequal", "g04_fsdp", "g05_nonfinite",
    "g06_nccl", "g07_launch", "g08_rank0", "g09_capacity", "g10_torchrun", "g11_lfb",
    "g12_fsdp_checkpoint", "g13_policy", "g14_engram_ram_fleet", "g15_signal_stop",
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


def environment(backend: str, device: str) -> dict:
    return {"torch": torch.__version__, "backend": backend, "device": device,
            "python": platform.python_version()}  # fmt: skip


def fleet_env(cuda: bool) -> dict:
    if cuda:
        name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cuda"
        return environment("nccl", f"{torch.cuda.device_count()}x {name}")
    return environment("gloo", "cpu")


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
    nan_rank: int = -1  # inject a non-finite LOSS (finite gradients) on this rank...
    nan_step: int = -1  # ...at this 0-based training forward
    per_rank_out: bool = False  # each rank gets its own out_dir (to see who writes what)
    resume_steps: int = 0  # after the run, resume its checkpoint on the fleet up to this step
    signal_rank: int = -1  # this rank sends itself SIGTERM...
    signal_step: int = -1  # ...during this 0-based training forward (the run must stop cleanly)
    cuda: bool = False

    def key(self) -> str:
        return hashlib.sha256(repr(dataclasses.astuple(self)).encode()).hexdigest()[:16]


def fixture_run(spec: FleetSpec, out_dir: Path, *, dist: bool):
    from dormouse.config import apply_sets, preset, validate

    sets = [
        f"data={corpus_path()}", f"out_dir={out_dir}", f"steps={spec.steps}",
        f"batch={spec.batch}", "seq_len=64", "log_every=1", "eval_every=0", "ckpt_every=0",
        "warmup=0", "dist_reduce=fp32", "moe_capacity=0", "seed=7",
        f"device={'cuda' if spec.cuda else 'cpu'}", f"dist={'true' if dist else 'false'}",
        f"dist_capacity={spec.capacity if dist else ''}", *spec.sets,
    ]  # fmt: skip
    return validate(apply_sets(preset("tiny"), sets))


# ---- recording seams --------------------------------------------------------------------------


def lfb_biases(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.detach().cpu().clone() for n, b in model.named_buffers() if n.endswith("lfb_bias")}


def host_tables(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """{name.table: CPU copy} of every host-RAM Engram table (engram_ram). They are no
    parameters, so the parameter fingerprint never sees them; empty without engram_ram."""
    from dormouse.model.engram import HostTables

    return {f"{n}.table": m.table.detach().clone() for n, m in model.named_modules()
            if isinstance(m, HostTables)}  # fmt: skip


class Recording:
    """Mixin over a seams class: records what passes through the seams, changes nothing.

    all_finite is called once per step after backward and before the optimizer, so the
    parameters it sees are those after the previous step: call k records the state after
    k steps. (A fingerprint under FSDP2 is a collective; every rank records at the same point.)
    """

    snap_steps = (0, 1)

    def _rec(self) -> dict:
        if not hasattr(self, "rec"):
            self.rec = {"fingerprints": [], "decisions": [], "losses": [], "local_losses": [],
                        "lfb": [], "params": {}, "probe": [], "host_fingerprints": [],
                        "host": {}}  # fmt: skip
        return self.rec

    def wrap(self, model):
        self.model = model
        return super().wrap(model)

    def all_finite(self, finite: bool) -> bool:
        from references.fingerprint import fingerprint, fingerprint_params, plain_params

        rec = self._rec()
        k = len(rec["decisions"])
        rec["fingerprints"].append(fingerprint(self.model))
        rec["lfb"].append(lfb_biases(self.model))
        host = host_tables(self.model)
        rec["host_fingerprints"].append(fingerprint_params(host) if host else None)
        if k in self.snap_steps:
            rec["params"][k] = plain_params(self.model)
            rec["host"][k] = host
        if getattr(self, "probe", None) is not None:
            rec["probe"].append(self.probe(k, self.model))
        ok = super().all_finite(finite)
        rec["decisions"].append((bool(finite), bool(ok)))
        return ok

    def fleet_loss(self, loss) -> float:
        v = super().fleet_loss(loss)
        rec = self._rec()
        rec["losses"].append(v)
        rec["local_losses"].append(float(loss))
        return v

    def finish(self) -> dict:
        from references.fingerprint import fingerprint, fingerprint_params, plain_params

        rec = self._rec()
        rec["final_fingerprint"] = fingerprint(self.model)
        rec["final_params"] = plain_params(self.model)
        rec["final_lfb"] = lfb_biases(self.model)
        rec["final_host"] = host_tables(self.model)
        rec["final_host_fingerprint"] = (fingerprint_params(rec["final_host"])
                                         if rec["final_host"] else None)  # fmt: skip
        return rec


def _recorder_classes():
    from dormouse.train.distributed import Parallel
    from dormouse.train.seams import Seams

    class FleetRecorder(Recording, Parallel):
        current = None

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            FleetRecorder.current = self

    class SingleRecorder(Recording, Seams):
        pass

    return FleetRecorder, SingleRecorder


# ---- the fleet --------------------------------------------------------------------------------


def exact_fp32() -> None:
    """No TF32 on a CUDA fleet or its reference: the gates measure the distributed
    arithmetic, and TF32's 10-bit mantissa would drown it (matmuls and cuDNN convs)."""
    os.environ["NVIDIA_TF32_OVERRIDE"] = "0"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


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
    from dormouse.train.distributed import NCCL_SAFE_ENV

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(spec.world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(spec.world), **NCCL_SAFE_ENV})  # fmt: skip
    torch.set_num_threads(1)
    if spec.cuda:
        exact_fp32()
    result_path = Path(out) / f"rank{rank}.pkl"
    try:
        result = _rank_body(rank, spec, Path(out))
    except BaseException:
        (Path(out) / f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    with open(result_path, "wb") as f:
        pickle.dump(result, f)


def _rank_body(rank: int, spec: FleetSpec, out: Path) -> dict:
    import shutil

    import torch.distributed as dist

    from dormouse.train.distributed import train_dist
    from references.single import build_model

    FleetRecorder, _ = _recorder_classes()
    run_dir = out / (f"rank{rank}" if spec.per_rank_out else "run")
    run = fixture_run(spec, run_dir, dist=True)
    model = build_model(run)
    if rank == spec.nan_rank:
        _inject_nan(model, spec.nan_step)
    if rank == spec.signal_rank:
        _signal_during(model, spec.signal_step)
    lines: list[str] = []
    t0 = time.perf_counter()
    stopped = False
    try:
        report = train_dist(run, log=lines.append, device_type="cuda" if spec.cuda else "cpu",
                            model=model, close=False, timeout_s=COLLECTIVE_TIMEOUT_S,
                            rate=spec.rates[rank] if spec.rates else None,
                            parallel_cls=FleetRecorder)  # fmt: skip
    except KeyboardInterrupt:  # a stop on a signal: the loop wrote its checkpoint first
        if spec.signal_rank < 0:
            raise
        stopped = True
        report = {"checkpoint": str(Path(run.train.out_dir) / f"{run.train.ckpt_name}.pt")}
    p = FleetRecorder.current
    rec = p.finish()
    shapes = [s.line() for s in p.shapes]
    elapsed = time.perf_counter() - t0
    resumed = None
    if spec.resume_steps:
        ck = Path(report["checkpoint"])
        if rank == 0:
            shutil.copy(ck, out / "first.pt")
        dist.barrier()
        run2 = fixture_run(dataclasses.replace(spec, steps=spec.resume_steps), run_dir, dist=True)
        model2 = build_model(run2)  # its values are replaced by the checkpoint's
        lines2: list[str] = []
        train_dist(run2, log=lines2.append, device_type="cuda" if spec.cuda else "cpu",
                   model=model2, close=False, resume=True, timeout_s=COLLECTIVE_TIMEOUT_S,
                   parallel_cls=FleetRecorder)  # fmt: skip
        resumed = {"rec": FleetRecorder.current.finish(), "lines": lines2}
    dist.barrier()  # before teardown: without it gloo aborts intermittently
    dist.destroy_process_group()
    return {"rank": rank, "rec": rec, "report": report, "lines": lines, "shapes": shapes,
            "stopped": stopped,
            "run_dir": str(run_dir), "elapsed": elapsed, "resumed": resumed}  # fmt: skip


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
        # loss curve at the end of every run.)
        ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo",
                                    "torch.distributed.fsdp",
                                    "torch.distributed.checkpoint.state_dict",
                                    "dormouse.model.model",
                                    "dormouse.train.loop", "dormouse.train.distributed",
                                    "gates.harness", "references.single",
                                    "references.fingerprint", "matplotlib.pyplot"])  # fmt: skip
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


def fleet(spec: FleetSpec) -> list[dict]:
    """Run the fleet of `spec` (cached); one result dict per rank, in rank order."""

    def compute():
        for attempt in (1, 2):
            out = work_dir(f"fleet-{spec.name}")
            try:
                wall = spawn(_rank_main, (spec, str(out), free_port()), spec.world)
                break
            except FleetFailed as e:
                errors = "".join(f"\n--- rank error ---\n{p.read_text()[-3000:]}"
                                 for p in sorted(out.glob("rank*.error")))  # fmt: skip
                # free_port() releases the port before rank 0 binds it; another process can
                # take it in between (rare). That, and only that, is worth a second try.
                if attempt == 1 and "ddress already in use" in errors:
                    continue
                raise FleetFailed(f"fleet {spec.name}: {e}{errors}") from None
        results = []
        for r in range(spec.world):
            with open(out / f"rank{r}.pkl", "rb") as f:
                results.append(pickle.load(f))
        for r in results:
            r["wall"] = wall
            r["out"] = str(out)
        return results

    return cached("fleet-" + spec.key(), compute)


@contextlib.contextmanager
def threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def single(spec: FleetSpec, batches: list[int] | None = None, *, probe=None,
           resume_from: str | None = None, steps: int | None = None) -> dict:
    """The reference: one process at the global batch of `spec` (cached like a fleet)."""
    batches = batches or [spec.batch] * spec.world
    tag = repr((spec.key(), batches, probe.__name__ if probe else None, resume_from, steps))

    def compute():
        import shutil

        from references.single import build_model, global_run, run_single

        _, SingleRecorder = _recorder_classes()
        out = work_dir(f"single-{spec.name}")
        run = global_run(fixture_run(spec, out, dist=False), batches)
        if steps is not None:
            run = dataclasses.replace(run, train=dataclasses.replace(run.train, steps=steps))
        from dormouse.train.seams import RankShape

        seams = SingleRecorder([RankShape(run.train.batch, run.train.seq_len)])
        if probe is not None:
            seams.probe = probe
        if resume_from:
            shutil.copy(resume_from, Path(run.train.out_dir) / f"{run.train.ckpt_name}.pt")
        if spec.cuda:
            exact_fp32()
        t0 = time.perf_counter()
        with threads(1):
            model = build_model(run)
            _, report = run_single(run, seams=seams, model=model, resume=bool(resume_from))
            rec = seams.finish()
        return {"rec": rec, "report": report, "elapsed": time.perf_counter() - t0,
                "run": run.to_json(), "out": str(out)}  # fmt: skip

    return cached("single-" + hashlib.sha256(tag.encode()).hexdigest()[:16], compute)


# ---- comparisons -------------------------------------------------------------------------------


def max_abs_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b):
        return float("inf")
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


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


def write_status(records: list[Record], path: Path) -> None:
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
    for r in records:
        cells = [r.gate, r.claim, r.instrument, r.measured, r.tolerance,
                 f"{r.verdict()} ({r.env.get('backend', '-')}, {r.env.get('device', '-')})"]
        lines.append("| " + " | ".join(c.replace("|", "\\|").replace("\n", " ") for c in cells) + " |")
    lines.append("")
    path.write_text("\n".join(lines))



# ---- the shared fleet runs (one run feeds several claims) ---------------------------------------

#: 2 ranks x 2 windows, DDP, Muon, 20 steps; eval and checkpoints every 10 steps; each rank
#: gets its own out_dir so the gate can see which rank wrote what. Gates 1, 2, 8.
DDP_RUN = FleetSpec("ddp", steps=20, per_rank_out=True, sets=("eval_every=10", "ckpt_every=10"))
#: capacity 4,2 for 3 steps; rank 1's loss is made non-finite at step index 1. Gates 3, 5.
#: Blocks in file order (shuffle off), so the hand-written gradient reference reads step 0's
#: block from byte 0 without re-implementing the data module's block order.
UNEQUAL_RUN = FleetSpec("unequal", steps=3, capacity="4,2", nan_rank=1, nan_step=1,
                        sets=("shuffle=false",))
#: FSDP2 + AdamW, 20 steps, then its single-file checkpoint resumed on the fleet to 25. Gates 4, 12.
FSDP_RUN = FleetSpec("fsdp", steps=20, sets=("dist_shard=fsdp", "opt=adamw"), resume_steps=25)
#: LFB on (coef 0.01), capacity auto with injected rates 3:1 (global batch 4 -> 3,1). Gates 9, 11.
LFB_RUN = FleetSpec("lfb", steps=8, capacity="auto", rates=(3.0, 1.0), sets=("moe_lb_coef=0.01",))


#: rank 1 gets SIGTERM during step 3 of 20; the fleet agrees every 10 steps, so both ranks stop
#: after step 10 with one checkpoint, which the fleet then resumes to step 20. Gate 15.
SIGNAL_RUN = FleetSpec("signal", steps=20, signal_rank=1, signal_step=3, resume_steps=20)


def on(spec: FleetSpec, cuda: bool) -> FleetSpec:
    return dataclasses.replace(spec, cuda=True) if cuda else spec
