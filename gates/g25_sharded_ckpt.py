"""Gate 25: FSDP2's sharded checkpoint resumes exactly, reshards to another world size at the
same global batch, survives a save killed midway, and exports to one file.

Every run is the fixture (tiny, FSDP2 + AdamW, the LFB controller on, global batch 6 windows,
the 20-step schedule), spawned here so that each can stop, resume or die where the claim needs;
the 1-process resumes are spawned too, so a planted bug (gates/mutations.py) runs in them.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from gates import mutations, spawn
from gates.cache import work_dir
from gates.compare import fmt, max_abs_diff
from gates.fixtures import FleetSpec, fixture_run
from gates.recorder import Recorder, no_plot
from gates.status import Record, fleet_env

CLAIM = ("FSDP2 sharded checkpoint: every rank writes its shards; resume 10 + 10 == 20; resumed "
         "on 1 and on 3 ranks (and back from 1 to 2) at the same global batch the run continues "
         "its trajectory; a save killed midway leaves the previous checkpoint loadable; "
         "`dormouse export` gives one file whose eval loss is the fleet's")  # fmt: skip
INSTRUMENT = ("tiny, opt=adamw, dist_shard=fsdp, moe_lb_coef=0.01, 20-step schedule, global batch "
              "6 windows: 2 ranks x 3 uninterrupted (the reference) vs the same stopped at step "
              "10 (a sharded checkpoint) and resumed on 2 ranks (SHA-256 of the parameters at "
              "20), on 1 process x 6 to step 15 (then that file on 2 ranks to 20) and on 3 ranks "
              "x 2: max |dloss| per step; a 2-rank run checkpointing every 5 steps whose rank 1 "
              "dies inside its write of the step-10 save: the surviving checkpoint's step, its "
              "parameters (SHA-256 vs the reference at 5), the temp directory removed by the "
              "next start, resumed to 10 (SHA-256 vs the reference at 10); `python -m dormouse "
              "export` of the resumed run's step-20 checkpoint: its eval loss in one process vs "
              "the fleet's own eval at step 20")  # fmt: skip

#: gloo only: the 3-rank resume needs three cards; the NCCL path of the sharded save and load
#: runs in the FSDP2 fleet gates (g04 and g12 end with a sharded save and resume it).
CUDA = False

STEPS, HALF = 20, 10
SETS = ("dist_shard=fsdp", "opt=adamw", "moe_lb_coef=0.01", "eval_batches=2")
#: A resume at another world size vs the uninterrupted run: fp32 summation order; gate 1's.
TOL_LOSS = 5e-6
#: The exported file's eval in one process vs the fleet's on the same batches: measured 0.
TOL_EVAL = 1e-6


def _spec(world: int) -> FleetSpec:
    batch, cap = {1: (6, ""), 2: (3, "3,3"), 3: (2, "2,2,2")}[world]
    return FleetSpec(f"sharded-w{world}", world=world, steps=STEPS, batch=batch, capacity=cap,
                     sets=SETS)  # fmt: skip


def _kill_in_save(nth: int) -> None:
    """This rank dies (os._exit, no cleanup) right after its shard file of the nth sharded save
    is written, before the save finished: a preempted machine in the middle of a save."""
    from torch.distributed.checkpoint import FileSystemWriter

    real, calls = FileSystemWriter.write_data, [0]

    def write_data(self, plan, planner):
        fut = real(self, plan, planner)
        calls[0] += 1
        if calls[0] == nth:
            fut.wait()
            os._exit(17)
        return fut

    FileSystemWriter.write_data = write_data


def _rank(rank: int, job: dict, out: str, port: int) -> None:
    import torch.distributed as dist

    from dormouse.train.fleet.launch import NCCL_SAFE_ENV
    from dormouse.train.run import train_run
    from references.single import build_model

    world = job["world"]
    if world > 1:
        os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                           "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                           "LOCAL_WORLD_SIZE": str(world), **NCCL_SAFE_ENV})  # fmt: skip
    torch.set_num_threads(1)
    if job["mutation"]:
        mutations.apply(job["mutation"])
    if rank == job.get("kill_rank", -1):
        _kill_in_save(job["kill_save"])
    result = {"rank": rank, "error": ""}
    try:
        run = fixture_run(_spec(world), Path(job["dir"]), dist=world > 1)
        run = dataclasses.replace(
            run, train=dataclasses.replace(run.train, ckpt_every=job.get("ckpt_every", 0))
        )
        recorder = Recorder()
        timeout = spawn.MUTANT_TIMEOUT_S if job["mutation"] else spawn.COLLECTIVE_TIMEOUT_S
        with no_plot():
            train_run(run, model=build_model(run), resume=job["resume"], stop_at=job["stop_at"],
                      callbacks=recorder.callbacks(), device_type="cpu", close=False,
                      timeout_s=timeout)  # fmt: skip
        rec = recorder.finish()
        result["rec"] = {k: rec[k] for k in ("losses", "fingerprints", "final_fingerprint")}
        if world > 1:
            dist.barrier()  # before teardown: without it gloo aborts intermittently
    except Exception:
        result["error"] = traceback.format_exc()[-3000:]
    finally:
        if world > 1 and dist.is_initialized():
            dist.destroy_process_group()
    path = Path(out) / f"rank{rank}.pkl"
    tmp = path.with_suffix(".tmp")  # whole or absent: the spawner may kill this rank mid-write
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp, path)


def _launch(name: str, world: int, run_dir: Path, *, resume: bool = False,
            stop_at: int | None = None, **fault) -> dict:  # fmt: skip
    """One run; rank 0's result (its record, or the error of whichever rank failed)."""
    out = work_dir(f"sharded-{name}")
    job = {"world": world, "dir": str(run_dir), "resume": resume, "stop_at": stop_at,
           "mutation": mutations.ACTIVE_MUTATION, **fault}  # fmt: skip
    died = ""
    try:
        spawn.spawn(
            _rank,
            (job, str(out), spawn.free_port()),
            world,
            spawn.MUTANT_DEADLINE_S if job["mutation"] else spawn.SPAWN_DEADLINE_S,
        )
    except spawn.FleetFailed as e:
        died = str(e)
    results = []
    for r in range(world):
        p = out / f"rank{r}.pkl"
        results.append(pickle.loads(p.read_bytes()) if p.exists() else {"error": "no result"})
    errors = [f"rank {r}: {x['error'].strip().splitlines()[-1]}"
              for r, x in enumerate(results) if x["error"]]  # fmt: skip
    return {**results[0], "error": "; ".join(errors) or died, "died": bool(died)}


def _copy(src: Path, name: str) -> Path:
    dst = work_dir(f"sharded-{name}") / "run"
    shutil.copytree(src, dst)
    return dst


def _saved_fingerprint(run_dir: Path) -> tuple[int, str]:
    """(step, SHA-256 of the parameters) of the checkpoint in run_dir, read in this process."""
    from dormouse.model import DormouseModel
    from dormouse.train.store.checkpoint import load_model, read_checkpoint
    from references.fingerprint import fingerprint

    ck = read_checkpoint(run_dir / "ckpt.pt")
    model = DormouseModel(ck["run"].model)
    load_model(model, ck, run_dir / "ckpt.pt")
    return ck["step"], fingerprint(model)


def _exported_eval(run_dir: Path) -> tuple[float, float, str]:
    """(the exported file's eval loss in this process, the fleet's own eval loss at step 20,
    the file's format and step): `python -m dormouse export`, then what `dormouse eval`
    computes (its functions, at full precision)."""
    import json

    from dormouse.model import DormouseModel
    from dormouse.train.data import open_data
    from dormouse.train.step import evaluate
    from dormouse.train.store.checkpoint import load_model, read_checkpoint

    dest = run_dir.parent / "model.pt"
    p = subprocess.run([sys.executable, "-m", "dormouse", "export", str(run_dir), "--to",
                        str(dest)], env=spawn.launch_env(), capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    if p.returncode != 0:
        raise RuntimeError(f"dormouse export exit {p.returncode}: {p.stderr.strip()[-300:]}")
    ck = read_checkpoint(dest)
    model = DormouseModel(ck["run"].model)
    load_model(model, ck, dest)
    t = ck["run"].train
    res = evaluate(model, open_data(t).val_batches(t.eval_batches, t.batch, t.seq_len),
                   torch.device("cpu"), None)  # fmt: skip
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    fleet = [r["loss"] for r in rows if r.get("kind") == "eval" and r["step"] == STEPS]
    what = f"format {ck['format']}, step {ck['step']}"
    return res["loss"], (fleet[-1] if fleet else float("nan")), what


def run(cuda: bool = False) -> Record:
    from dormouse.train.store.folder import RunDir

    t0 = time.perf_counter()
    ref = _launch("full", 2, work_dir("sharded-full") / "run")
    half_dir = work_dir("sharded-half") / "run"
    half = _launch("half", 2, half_dir, stop_at=HALF)
    runs = {"uninterrupted": ref, "stopped at 10": half}
    losses = ref.get("rec", {}).get("losses", [])
    checks, parts = [], []
    if ref["error"] or half["error"] or len(losses) != STEPS:
        checks.append(False)
    else:
        shards = sorted(p.name for p in half_dir.glob("*.shards"))
        # 10 + 10 on the same fleet: the same arithmetic, so bitwise
        two_dir = _copy(half_dir, "2to2")
        again = runs["2 -> 2"] = _launch("2to2", 2, two_dir, resume=True)
        same = again.get("rec", {}).get("final_fingerprint") == ref["rec"]["final_fingerprint"]
        # one shards directory per checkpoint file: ckpt.pt's, and best.pt's (its final eval)
        checks.append(same and sorted(s.split(".")[0] for s in shards) == ["best", "ckpt"])
        parts.append(f"shards {shards}; 10 + 10 == 20 uninterrupted (SHA-256): {same}")
        # other world sizes at the same global batch: 1 process to 15, that file on 2 ranks to 20
        one_dir = _copy(half_dir, "2to1")
        one = runs["2 -> 1"] = _launch("2to1", 1, one_dir, resume=True, stop_at=15)
        back = runs["1 -> 2"] = _launch("1to2", 2, _copy(one_dir, "1to2"), resume=True)
        three = runs["2 -> 3"] = _launch("2to3", 3, _copy(half_dir, "2to3"), resume=True)
        for name, r, span in (("2 -> 1", one, (10, 15)), ("1 -> 2", back, (15, 20)),
                              ("2 -> 3", three, (10, 20))):  # fmt: skip
            got = r.get("rec", {}).get("losses", [])
            d = max_abs_diff(got, losses[span[0] : span[1]]) if not r["error"] else float("inf")
            checks.append(d <= TOL_LOSS)
            parts.append(f"{name}: max |dloss| over steps {span[0] + 1}-{span[1]} {fmt(d)}")
        # export the resumed run's step-20 checkpoint: one file, eval = the fleet's
        try:
            mine, theirs, what = _exported_eval(two_dir)
        except Exception as e:
            mine, theirs, what = float("nan"), float("nan"), f"{type(e).__name__}: {e}"[:300]
        d = abs(mine - theirs)
        checks.append(d <= TOL_EVAL)
        parts.append(f"export ({what}): eval {mine:.6f} vs the fleet's {theirs:.6f}, |d| {fmt(d)}")
    # a save killed midway: rank 1 dies inside its write of the step-10 save of ckpt.pt (the
    # 3rd sharded save: ckpt.pt at 5, best.pt at the final eval of step 10, then ckpt.pt at 10)
    kill_dir = work_dir("sharded-kill") / "run"
    killed = runs["killed"] = _launch("kill", 2, kill_dir, stop_at=HALF, ckpt_every=5,
                                      kill_rank=1, kill_save=3)  # fmt: skip
    try:
        step, fp = _saved_fingerprint(kill_dir)
    except Exception as e:
        step, fp = -1, f"unloadable: {type(e).__name__}: {e}"[:200]
    removed = RunDir(kill_dir).clean_stale_temps()
    # rank 0 removes the temp directory itself when it lives to see the failure; the next
    # start removes it when rank 0 died first
    left = sorted(p.name for p in kill_dir.iterdir() if p.name.endswith(".tmp"))
    after = runs["resumed after the kill"] = _launch("afterkill", 2, kill_dir, resume=True,
                                                     stop_at=HALF)  # fmt: skip
    prints = ref.get("rec", {}).get("fingerprints", [])
    ok5 = len(prints) > 5 and fp == prints[5]
    ok10 = len(prints) > 10 and after.get("rec", {}).get("final_fingerprint") == prints[10]
    checks.append(killed["died"] and step == 5 and ok5 and not left and ok10)
    parts.append(
        f"save killed at step 10 (fleet died: {killed['died']}): the checkpoint left is "
        f"step {step}, parameters == the reference's at 5: {ok5}; temp directories "
        f"removed by the next start {removed}, left {left}; resumed to 10 == the "
        f"reference's at 10: {ok10}"
    )
    errors = [f"{n}: {r['error'][-300:]}" for n, r in runs.items()
              if r["error"] and n != "killed"]  # fmt: skip
    passed = bool(checks) and all(checks) and not errors
    return Record(
        "g25_sharded_ckpt",
        CLAIM,
        INSTRUMENT,
        "; ".join(parts + errors) + f" ({time.perf_counter() - t0:.0f} s)",
        f"bitwise where the arithmetic is the same (10 + 10, the survivor, its resume); |dloss| "
        f"<= {fmt(TOL_LOSS)} at another world size (fp32 round-off of the summation order); "
        f"export eval |d| <= {fmt(TOL_EVAL)}",
        passed,
        fleet_env(False, (1, 2, 3)),
    )
