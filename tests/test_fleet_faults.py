"""Faults on a fleet: nothing hung, nothing silently wrong. Each case injects its fault into
a real 2-rank CPU fleet (torchrun and the CLI, or ranks spawned by torch.multiprocessing
calling `train_run` as the CLI does) and fails if the old behaviour comes back: a silent
wait until torch's 30-minute timeout, workers outliving their launcher, ranks that disagree
on a setting or on the data training on regardless, a rank-0-only refusal leaving the others
waiting. Every hang case runs with a dist_timeout of seconds and asserts a time bound.

docs/reliability.md (the fleet) lists every case with its test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dormouse.config import apply_sets, preset, validate
from dormouse.train.context import RankShape
from dormouse.train.fleet.launch import (
    PER_RANK_FIELDS,
    agreement_fields,
    disagreement,
    disagreement_message,
)  # fmt: skip
from dormouse.train.fleet.watchdog import WATCHDOG_EXIT
from dormouse.train.store import checkpoint as ckpt
from gates.spawn import free_port

ROOT = Path(__file__).resolve().parents[1]
#: The hang cases' dist_timeout: short, yet far above a heartbeat interval (0.4 s) on a
#: loaded two-core machine.
TIMEOUT_S = 4
#: A stalled or dead rank must end the fleet within this (dist_timeout, one heartbeat
#: interval, one watch interval, and slack for a loaded machine). The old behaviour: 30 min.
BOUND_S = TIMEOUT_S + 8


#: Each fleet's corpus: this repository's sources, repeated to this length.
CORPUS_BYTES = 200_000


# ---- torchrun and the CLI -----------------------------------------------------------------


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
    return sorted(out)


def _rank_of(pid: int) -> int:
    """A torchrun worker's RANK, from its environment: PIDs say nothing of the order (a
    machine whose pid_max is 32768 wraps them during a full suite; CI killed the rank it
    took for rank 1, which was rank 0)."""
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for k, _, v in (e.partition(b"=") for e in env) if k == b"RANK"))


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


class Torchrun:
    """`torchrun --nproc_per_node=2 -m dormouse train tiny --dist` in its own session, each
    worker's stdout and stderr in its own file (torchrun's own traceback stays apart)."""

    def __init__(self, tmp: Path, data: Path):
        self.tmp, self.logs, self.out = tmp, tmp / "logs", tmp / "run"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
        for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                  "TORCHELASTIC_RESTART_COUNT"):  # fmt: skip
            env.pop(k, None)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", "--log-dir", str(self.logs), "--redirects", "3",
               "-m", "dormouse", "train", "tiny", "--dist", "--device", "cpu",
               "--data", str(data), "--steps", "100000", "--out", str(self.out),
               "--set", "batch=2", "--set", "seq_len=32", "--set", "ckpt_every=5",
               "--set", "log_every=5", "--set", "eval_every=0",
               "--set", f"dist_timeout={TIMEOUT_S}"]  # fmt: skip
        self.p = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        self.workers: list[int] = []

    def log(self, rank: int, name: str) -> str:
        found = sorted(self.logs.glob(f"*/attempt_0/{rank}/{name}.log"))
        return found[0].read_text(errors="replace") if found else ""

    def wait_for_step(self, step: int, limit: float = 120) -> None:
        t0 = time.monotonic()
        while f"step={step} " not in self.log(0, "stdout"):
            assert self.p.poll() is None, self.log(0, "stderr")[-2000:]
            assert time.monotonic() - t0 < limit, "the fleet never reached the step"
            time.sleep(0.05)
        self.workers = sorted(_children(self.p.pid), key=_rank_of)  # rank order
        assert len(self.workers) == 2, self.workers

    def wait_gone(self, pids: list[int], limit: float) -> float:
        t0 = time.monotonic()
        while any(_running(p) for p in pids):
            if time.monotonic() - t0 > limit:
                return float("inf")
            time.sleep(0.05)
        return time.monotonic() - t0

    def close(self) -> None:
        # the session torchrun and its workers were started in: whatever is left of it
        for pid in [self.p.pid, *self.workers]:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        self.p.communicate(timeout=30)


@pytest.fixture
def torchrun(tmp_path, source_corpus):
    runs = []

    def start():
        runs.append(Torchrun(tmp_path, source_corpus(tmp_path, CORPUS_BYTES)))
        return runs[-1]

    yield start
    for r in runs:
        r.close()


def _one_line(err: str, *needles: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("dormouse:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def _checkpoint_loads(out: Path) -> int:
    return ckpt.read_checkpoint(out / "ckpt.pt")["step"]


@pytest.mark.slow
def test_a_stopped_rank_ends_every_rank_naming_it(torchrun):
    """SIGSTOP on rank 1 (old: rank 0 waited silently for torch's 30-minute timeout)."""
    fleet = torchrun()
    fleet.wait_for_step(40)
    rank0, rank1 = fleet.workers
    t0 = time.monotonic()
    os.kill(rank1, signal.SIGSTOP)
    took = fleet.wait_gone([rank0], BOUND_S)
    print(f"rank 0 ended {took:.1f} s after rank 1 was stopped (dist_timeout={TIMEOUT_S})")
    assert took <= BOUND_S, f"rank 0 still running {BOUND_S} s after rank 1 stopped"
    line = _one_line(fleet.log(0, "stderr"), "fleet watchdog on rank 0", "rank 1 has sent no "
                     "heartbeat", "its last heartbeat: step", "--resume auto")  # fmt: skip
    assert "the last checkpoint (step" in line
    # the stopped rank ends too once it runs again (torchrun sent it SIGTERM meanwhile; its
    # watchdog finds the fleet gone)
    os.kill(rank1, signal.SIGCONT)
    assert fleet.wait_gone([rank1], BOUND_S) <= BOUND_S
    assert fleet.p.wait(timeout=BOUND_S) != 0
    assert time.monotonic() - t0 < 2 * BOUND_S
    assert _checkpoint_loads(fleet.out) >= 35


@pytest.mark.slow
def test_a_killed_rank_is_one_line_on_the_survivor(torchrun):
    """SIGKILL on rank 1 (old: a gloo 'Connection reset by peer' traceback on rank 0)."""
    fleet = torchrun()
    fleet.wait_for_step(40)
    rank0, rank1 = fleet.workers
    os.kill(rank1, signal.SIGKILL)
    took = fleet.wait_gone([rank0], BOUND_S)
    print(f"rank 0 ended {took:.1f} s after rank 1 was killed")
    assert took <= BOUND_S
    line = _one_line(fleet.log(0, "stderr"), "rank 1", "--resume auto")
    # the step its heartbeat last said comes with the heartbeat's age: the loop runs many
    # steps between two pulses, and "last at step 2" read as if rank 1 had stopped there
    assert re.search(r"its last heartbeat, \d+\.\d s before, said step \d+", line), line
    assert _checkpoint_loads(fleet.out) >= 35


def test_a_peer_gone_during_a_store_barrier_is_named_with_its_heartbeats_age():
    """The other path a killed rank takes (the store barrier around a save, which CI hit):
    the same wording as the collective's, the step its last pulse said and how old it is."""
    from dormouse.train.context import DistError
    from dormouse.train.fleet.watchdog import Heartbeat

    store = torch.distributed.HashStore()
    hb = Heartbeat(0, 2, 10.0, lambda: store, "dormouse/test")  # threads never started
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that has exited
    hb.seen[1] = {"n": 3, "pid": gone.pid, "host": hb.host, "state": "alive", "step": 7,
                  "phase": "train"}  # fmt: skip
    hb.changed[1] = time.monotonic() - 1.5
    with pytest.raises(DistError) as e:
        hb.gather()
    m = re.search(r"rank 1 is gone .*its last heartbeat, (\d+\.\d) s before, said step 7\)",
                  str(e.value))  # fmt: skip
    assert m and 1.5 <= float(m.group(1)) < 10, str(e.value)  # 1.5 s old, plus the polling


def test_a_store_drop_seen_before_the_agents_exit_finished_names_the_agent(monkeypatch):
    """The race CI hit: a SIGKILLed agent's sockets (the store it hosts) close before the
    kernel re-parents its workers, so a worker's store call fails while getppid() still
    names the agent; the line must still say the agent is gone, not "no rank is known to
    have died". Here the "agent" is a process that exits 0.3 s after the drop."""
    from dormouse.train.fleet.watchdog import Heartbeat

    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])
    monkeypatch.setattr(os, "getppid", lambda: agent.pid)  # as if it launched this process
    store = torch.distributed.HashStore()
    hb = Heartbeat(1, 2, 10.0, lambda: store, "dormouse/test", launcher_pid=agent.pid)
    hb.seen[0] = {"n": 3, "pid": os.getpid(), "host": hb.host, "state": "alive", "step": 7,
                  "phase": "train"}  # fmt: skip
    line = hb.explain(RuntimeError("Connection reset by peer"))
    agent.wait()
    assert f"the torchrun agent that launched this rank (pid {agent.pid}) is gone" in line, line


@pytest.mark.slow
def test_workers_end_when_their_torchrun_agent_is_killed(torchrun):
    """SIGKILL on the torchrun agent (old: its workers trained on, orphaned, for ever)."""
    fleet = torchrun()
    fleet.wait_for_step(40)
    os.kill(fleet.p.pid, signal.SIGKILL)
    took = fleet.wait_gone(fleet.workers, BOUND_S)
    print(f"both workers ended {took:.1f} s after their agent was killed")
    assert took <= BOUND_S
    for r in (0, 1):
        _one_line(fleet.log(r, "stderr"), f"rank {r}", "torchrun agent", "is gone")
    assert _checkpoint_loads(fleet.out) >= 35


# ---- ranks spawned by torch.multiprocessing -------------------------------------------------


def _rank_run(out: Path, data: Path | str, *sets: str):
    """A fleet rank's run of the tiny preset: short, logging every step, seconds of timeout."""
    return validate(apply_sets(preset("tiny"), [
        f"data={data}", f"out_dir={out}", "device=cpu", "dist=true", "batch=2", "seq_len=32",
        "steps=6", "log_every=1", "eval_every=0", "ckpt_every=0", f"dist_timeout={TIMEOUT_S}",
        *sets]))  # fmt: skip


def _nan_on_rank0(rank: int) -> None:
    """Rank 0's gathered checkpoint state holds a NaN (a fault planted in this rank)."""
    real = ckpt.model_state

    def model_state(net):
        sd = real(net)
        if rank == 0 and sd:
            k = next(k for k, v in sd.items() if v.is_floating_point())
            sd[k] = torch.full_like(sd[k], float("nan"))
        return sd

    ckpt.model_state = model_state


#: The long-work case's dist_timeout, and how long each of its one-rank waits lasts.
LONG_TIMEOUT_S = 3
LONG_WORK_S = 2.2 * LONG_TIMEOUT_S


def _slow_save_on_rank0(rank: int) -> None:
    """Rank 0's first checkpoint gathers for LONG_WORK_S (a large one on a slow disk)."""
    real, slow = ckpt.model_state, [rank == 0]

    def model_state(net):
        if slow[0]:
            slow[0] = False
            time.sleep(LONG_WORK_S)
        return real(net)

    ckpt.model_state = model_state


def _slow_first_forward(model, seconds: float) -> None:
    inner = model.forward
    calls = []

    def forward(x, y=None):
        if model.training and not calls:
            calls.append(1)
            time.sleep(seconds)  # a first-use kernel autotune on this card alone
        return inner(x, y)

    model.forward = forward


def _case(name: str, rank: int, tmp: Path) -> tuple:
    """(run, train_run keyword arguments) of `name` for `rank`."""
    from dormouse.model import DormouseModel

    out = tmp / "run"
    if name == "schedules":
        theirs = ("ckpt_every=2", "eval_every=3", "log_every=2", "wd=0.2", "grad_clip=0.5",
                  "muon_momentum=0.9")  # fmt: skip
        return _rank_run(out, tmp / "corpus.txt", *(theirs if rank == 1 else ())), {}
    if name == "paths":  # the same bytes under another path on each rank: that is fine
        d = tmp / f"node{rank}"
        return _rank_run(out, d / "corpus.txt", "steps=2"), {}
    if name == "bytes":  # the same path, other bytes on each rank ("two nodes")
        os.chdir(tmp / f"node{rank}")
        return _rank_run(out, "corpus.txt"), {}
    if name == "nan":
        _nan_on_rank0(rank)
        return _rank_run(out, tmp / "corpus.txt", "ckpt_every=2"), {}
    if name == "shrink":
        if rank == 1:  # this rank alone finds the file shrunk (another node's copy job)
            from dormouse.train.data import ByteStream, DataError

            check = ByteStream.check_source

            def shrunk(self):
                if self.step == 3:
                    raise DataError(f"data file {self.name!r} shrank (injected) before step 3")
                check(self)

            ByteStream.check_source = shrunk
        return _rank_run(out, tmp / "corpus.txt"), {}
    if name == "long":
        run = _rank_run(out, tmp / "corpus.txt", "steps=4", "ckpt_every=2",
                    f"dist_timeout={LONG_TIMEOUT_S}")  # fmt: skip
        torch.manual_seed(run.train.seed)
        model = DormouseModel(run.model)
        if rank == 1:
            _slow_first_forward(model, LONG_WORK_S)
        _slow_save_on_rank0(rank)
        return run, {"model": model}
    raise AssertionError(name)


def _rank_main(rank: int, world: int, port: int, tmp: str, name: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))  # fmt: skip
    torch.set_num_threads(1)
    from dormouse.errors import UserError
    from dormouse.train.run import train_run

    res: dict = {"rank": rank}
    t0 = time.monotonic()
    try:
        run, kw = _case(name, rank, Path(tmp))
        train_run(run, device_type="cpu", **kw)
        res["ok"] = True
    except Exception as e:
        res.update(ok=False, error=type(e).__name__, message=str(e), user=isinstance(e, UserError))
    # a rank that failed is ending: the launcher's SIGTERM (sent when it sees any rank exit)
    # must not cut short its one line (CI: a survivor's empty stderr)
    res["sigterm_ignored"] = signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    res["seconds"] = time.monotonic() - t0
    (Path(tmp) / f"rank{rank}.json").write_text(json.dumps(res))


def _fleet(tmp: Path, name: str, deadline: float = 120) -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "dormouse.train.distributed",
                                "dormouse.train.loop", "dormouse.model.model"])  # fmt: skip
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, 2, port, str(tmp), name)) for r in (0, 1)]
    for p in procs:
        p.start()
    t0 = time.monotonic()
    try:
        for p in procs:
            p.join(max(1.0, deadline - (time.monotonic() - t0)))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        assert not hung, f"ranks {hung} still running after {deadline} s: a hang"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    out = []
    for r, p in enumerate(procs):
        f = tmp / f"rank{r}.json"
        assert f.exists(), f"rank {r} exited {p.exitcode} without a result"
        out.append(json.loads(f.read_text()))
    return out


@pytest.fixture
def nodes(tmp_path, source_corpus) -> None:
    """The corpus in tmp_path, and one in node0/ and node1/ (the same size, other bytes on 1)."""
    source_corpus(tmp_path, CORPUS_BYTES)
    for r in (0, 1):
        source_corpus(tmp_path / f"node{r}", CORPUS_BYTES, salt=b"#" * r)


@pytest.mark.slow
@pytest.mark.usefixtures("nodes")
def test_ranks_launched_with_different_settings_are_refused_naming_the_fields(tmp_path):
    """ckpt_every/eval_every/log_every differences hung the fleet after the first checkpoint;
    wd/grad_clip/muon_momentum differences trained silently into diverging ranks."""
    for r in _fleet(tmp_path, "schedules"):
        assert r["error"] == "DistError" and r["user"], r
        for field in ("ckpt_every", "eval_every", "log_every", "wd", "grad_clip",
                      "muon_momentum"):  # fmt: skip
            assert f"{field} (rank 1 differs from rank 0)" in r["message"], r["message"]
        assert "lr (" not in r["message"] and "steps (" not in r["message"]


@pytest.mark.usefixtures("nodes")
def test_different_bytes_behind_the_same_data_path_are_refused(tmp_path):
    """The check compared the --data strings: two nodes' different files passed."""
    for r in _fleet(tmp_path, "bytes"):
        assert r["error"] == "DistError", r
        assert "data bytes (rank 1 differs from rank 0)" in r["message"], r["message"]
        assert "corpus.txt (200000 bytes, sampled digest" in r["message"]
        assert r["sigterm_ignored"], "a refused rank must outlive the launcher's SIGTERM"


@pytest.mark.usefixtures("nodes")
def test_the_same_bytes_under_other_paths_are_accepted(tmp_path):
    (tmp_path / "node1" / "corpus.txt").write_bytes(
        (tmp_path / "node0" / "corpus.txt").read_bytes()
    )
    ranks = _fleet(tmp_path, "paths")
    assert all(r["ok"] and not r["sigterm_ignored"] for r in ranks), ranks


@pytest.mark.usefixtures("nodes")
def test_a_checkpoint_refused_on_rank0_stops_every_rank(tmp_path):
    """save_checkpoint refused NaN parameters on rank 0 alone; the others waited for it."""
    ranks = _fleet(tmp_path, "nan", deadline=60)
    assert [r["error"] for r in ranks] == ["CheckpointError", "CheckpointError"], ranks
    assert "hold NaN/inf" in ranks[0]["message"]
    assert "rank 0 could not write the checkpoint at step 2" in ranks[1]["message"]
    assert not (tmp_path / "run" / "ckpt.pt").exists()


@pytest.mark.usefixtures("nodes")
def test_a_data_file_shrunk_on_one_rank_stops_every_rank_on_one_step(tmp_path):
    """The truncated-file stop wrote its checkpoint on one process only; on a fleet the rank
    that saw the shrink stopped while the others trained on into its collectives."""
    ranks = _fleet(tmp_path, "shrink", deadline=60)
    assert [r["error"] for r in ranks] == ["DataError", "DataError"], ranks
    assert "another rank found a data file shrunk" in ranks[0]["message"]
    assert "shrank (injected) before step 3" in ranks[1]["message"]
    assert all(r["sigterm_ignored"] for r in ranks), "an ending rank must say its line first"
    assert _checkpoint_loads(tmp_path / "run") == 3


@pytest.mark.slow
@pytest.mark.usefixtures("nodes")
def test_long_work_on_one_rank_runs_under_the_heartbeat(tmp_path):
    """A first forward (kernel autotune) and a checkpoint save, each 2.2 dist_timeouts long, on
    one rank while the other waits in a collective or a barrier: the run completes."""
    ranks = _fleet(tmp_path, "long", deadline=120)
    assert all(r["ok"] for r in ranks), ranks
    assert min(r["seconds"] for r in ranks) > 2 * LONG_WORK_S  # both waits really happened
    assert _checkpoint_loads(tmp_path / "run") == 4


# ---- the agreement's arithmetic ----------------------------------------------------------


def test_the_agreement_covers_every_field_but_the_per_rank_ones():
    run = preset("tiny")
    fields = agreement_fields(run, [RankShape(2, 32)] * 2, "cpu", [])
    everything = {**run.to_dict()["model"], **run.to_dict()["train"]}
    # dtype: each card computes in its own (a bf16 rank beside an fp16 one: gate g30)
    assert set(everything) - set(fields) == set(PER_RANK_FIELDS) == {"out_dir", "device", "data",
                                                                      "dtype"}  # fmt: skip
    assert {"capacity split", "device type", "data bytes", "preset/source"} <= set(fields)


def test_the_disagreement_names_fields_and_ranks():
    names = ["lr", "wd", "data bytes"]
    table = [[1, 2, 3], [1, 9, 3], [1, 9, 4]]
    diff = disagreement(table, names)
    assert diff == {"wd": [1, 2], "data bytes": [2]}
    msg = disagreement_message(
        diff,
        {"lr": "0.1", "wd": "0.2", "data bytes": "x"},
        2,
        [{"path": "/d/c.txt", "size": 10, "digest": "ab" * 16}],
    )
    assert "wd (ranks 1, 2 differ from rank 0)" in msg and "data bytes (rank 2 differs" in msg
    assert "wd=0.2" in msg and "/d/c.txt (10 bytes" in msg and "lr" not in msg.split(".")[0]


def test_the_watchdog_exit_code_is_not_a_user_error():
    assert WATCHDOG_EXIT not in (0, 1, 2)
