"""The fleet: spawn the fixture's ranks, each training as the CLI does, and collect their records.

`fleet(spec)` spawns `spec.world` ranks with torch.multiprocessing (gloo on the CPU, or one
process per card on nccl with cuda=True), each calling `train_run` with a `Recorder` on the
loop's callbacks; results are cached (gates/cache.py), so one fleet run feeds every claim that
reads it. Children start from a forkserver that has imported torch and dormouse once (and
frozen them: gates/_frozen.py), so a 2-rank spawn costs a fork, not two interpreter starts.
Every rank sets the NCCL safety variables, uses one CPU thread and a finite collective
timeout, so a broken collective fails the gate instead of hanging it. A planted bug
(gates/mutations.py) runs inside every rank. `launch_env` is the same for the torchrun fleets
a gate launches itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from gates import ROOT, mutations
from gates.cache import cached, work_dir
from gates.fixtures import FleetSpec, exact_fp32, fixture_run
from gates.recorder import (
    Recorder,
    compiled_graphs,
    log_lines,
    no_plot,
    read_journal,
    record_inputs,
)

#: Collective timeout inside a gate's fleet: a rank stuck in a collective longer than this
#: fails the gate instead of hanging it (generous: two ranks share two loaded cores).
COLLECTIVE_TIMEOUT_S = 120
#: The same under a planted bug (gates/mutations.py), where ranks that disagree are expected:
#: the gate's verdict comes from what they recorded, not from waiting out a hang.
MUTANT_TIMEOUT_S = 20
#: Wall-clock limit of one fleet spawn, after which its ranks are killed (a hang).
SPAWN_DEADLINE_S = 300
MUTANT_DEADLINE_S = 90


def _limits(spec: FleetSpec) -> tuple[float, float]:
    """(collective timeout, spawn deadline) of a fleet. A planted bug gets the short ones,
    except in a compiling fleet: dynamo traces each graph on every rank before its first
    collective (~40 s a fleet on the quiet 2-core box, twice that under pytest -n 2), which a
    20 s collective timeout or a 90 s deadline would read as a hang (a crash, not a catch)."""
    compiles = any(s == "compile=true" for s in spec.sets)
    if spec.mutation and not compiles:
        return MUTANT_TIMEOUT_S, MUTANT_DEADLINE_S
    return COLLECTIVE_TIMEOUT_S, SPAWN_DEADLINE_S


class FleetFailed(RuntimeError):
    pass


def fleet(spec: FleetSpec, *, allow_errors: bool = False) -> list[dict]:
    """Run the fleet of `spec` (cached); one result dict per rank, in rank order.

    A rank whose training raised returns what it recorded until then with an "error" entry;
    unless `allow_errors`, any such rank makes this raise FleetFailed (the gate crashes).
    """
    if mutations.ACTIVE_MUTATION and not spec.mutation:
        spec = dataclasses.replace(spec, mutation=mutations.ACTIVE_MUTATION)
    results = _fleet(spec)
    errors = [(r["rank"], r["error"]) for r in results if r.get("error")]
    if errors and not allow_errors:
        raise FleetFailed(
            f"fleet {spec.name}: rank(s) {[i for i, _ in errors]} raised:\n"
            + "\n".join(e for _, e in errors)
        )
    return results


def _fleet(spec: FleetSpec) -> list[dict]:

    def compute():
        t0 = time.perf_counter()
        for attempt in (1, 2):
            out = work_dir(f"fleet-{spec.name}")
            try:
                wall = spawn(
                    _rank_main, (spec, str(out), free_port()), spec.world, _limits(spec)[1]
                )
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
                results.append({"rank": r, "rec": read_journal(out / f"rank{r}.journal"),
                                "error": f"fleet {spec.name}: {failure}", "lines": []})  # fmt: skip
        for r in results:
            r["wall"] = wall
            r["out"] = str(out)
        return results

    return cached("fleet-" + spec.key(), compute)


def rank_errors(ranks: list[dict]) -> str:
    """'' when every rank finished; else one line per rank that raised (its last line)."""
    bad = [f"rank {r['rank']} raised {r['error'].strip().splitlines()[-1]}" for r in ranks
           if r.get("error")]  # fmt: skip
    return "; ".join(bad)


def _rank_main(rank: int, spec: FleetSpec, out: str, port: int) -> None:
    from dormouse.train.fleet.launch import NCCL_SAFE_ENV

    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(spec.world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(spec.world), **NCCL_SAFE_ENV})  # fmt: skip
    torch.set_num_threads(1)
    if spec.cuda:
        exact_fp32()
    if spec.mutation:  # a planted bug (gates/mutations.py): this rank runs the broken code
        mutations.apply(spec.mutation)
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
    except Exception:
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


def _rank_dtype(run, spec: FleetSpec, rank: int):
    """This rank's compute dtype from spec.dtypes (each card's own on a real mixed fleet)."""
    if not spec.dtypes:
        return run
    return dataclasses.replace(run, train=dataclasses.replace(run.train, dtype=spec.dtypes[rank]))


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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
                                    "gates.spawn", "references.single",
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


def child_env(env: dict, fault: str = "") -> dict:
    """`env` for a process a gate launches (torchrun and its workers): the repo on
    PYTHONPATH, and the active fleet mutation (gates/mutations.py) and `fault`
    (gates/faults.py) planted at interpreter start through a sitecustomize module placed
    first on the path."""
    env = dict(env)
    path = [str(ROOT)]
    if mutations.ACTIVE_MUTATION or fault:
        site = work_dir("mutant-site")
        (site / "sitecustomize.py").write_text(
            "from gates.mutations import apply_from_env\napply_from_env()\n"
            "from gates.faults import apply_from_env as plant_fault\nplant_fault()\n"
        )
        path.insert(0, str(site))
        env["DORMOUSE_MUTATION"] = mutations.ACTIVE_MUTATION
        env["DORMOUSE_FAULT"] = fault
    env["PYTHONPATH"] = os.pathsep.join(
        path + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    )
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
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
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
