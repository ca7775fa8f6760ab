"""The fleet's watchdog: each rank's pulse in the c10d store and its watch over its peers'.

A stalled, frozen or dead rank, a lost store or a lost torchrun agent ends every rank within
`dist_timeout` seconds with one line naming the rank and its last step; a collective that
fails is explained the same way (`Heartbeat.explain`). `Heartbeat.gather` is the store
barrier that lets rank 0 evaluate or save for as long as it beats.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta

import torch.distributed as dist

from ...errors import UserError
from ..context import DistError
from ..store.folder import pid_alive

#: Exit code of a rank its watchdog ends (a stalled or dead peer, a lost store or launcher).
WATCHDOG_EXIT = 3
#: The first step (and everything before it) runs against this collective timeout at least:
#: a first-use kernel autotune on one card may take minutes while the others wait in the
#: first all-reduce, and the heartbeat still ends the fleet within dist_timeout of a rank
#: that stops or dies. From the second step on, every collective waits dist_timeout.
FIRST_STEP_TIMEOUT_S = 3600.0
#: One collective waits this many dist_timeouts (see init_parallel).
COLLECTIVE_TIMEOUT_FACTOR = 2.0
#: A store connection that dropped with every peer still beating: wait this long for the
#: torchrun agent's exit to finish (its sockets close before its children are re-parented;
#: CI saw the drop first) before saying "no rank is known to have died".
LAUNCHER_EXIT_S = 1.0


def short(e: BaseException, n: int = 200) -> str:
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

    def __init__(
        self,
        rank: int,
        world: int,
        timeout_s: float,
        connect: Callable[[], object],
        prefix: str,
        *,
        store_where: str = "the fleet's store",
        launcher_pid: int | None = None,
        settle_to: float | None = None,
    ):
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
        self._moved = threading.Event()
        self._barriers = 0
        self._main = None
        self._threads = [
            threading.Thread(target=f, name=f"dormouse-{n}-r{rank}", daemon=True)
            for n, f in (("pulse", self._pulse), ("watch", self._watch))
        ]

    # -- what the loop tells it -------------------------------------------------------------

    def at(self, step: int, what: str, saved: int | None = None) -> None:
        was = (self.step, self.phase, self.saved)
        self.step, self.phase = int(step), what
        if saved is not None:
            self.saved = int(saved)
        if (self.step, self.phase, self.saved) != was:
            self._moved.set()  # the pulse says it now, not an interval later

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
        self._moved.set()
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
            except Exception:
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
        return json.dumps(
            {
                "n": n,
                "step": self.step,
                "phase": self.phase,
                "saved": self.saved,
                "pid": self.pid,
                "host": self.host,
                "state": self.state,
                "why": self.why,
            }
        )

    _count = 0

    def _beat_once(self, store) -> None:
        self._count += 1
        store.set(self._key(self.rank), self._record(self._count))

    def _pulse(self) -> None:
        # This rank's record goes out whenever its step or phase moves (`at`), so a rank that
        # stops is named by the step it stopped at: a pulse only every `interval` said a step
        # up to a second behind on a fast loop (step 0/1 of a rank stopped at 5/6). The peers'
        # records are read every `interval`.
        store, read_at = None, 0.0
        while not self._halt.is_set():
            try:
                if store is None:
                    store = self.connect()
                self._moved.clear()
                self._beat_once(store)
                if time.monotonic() >= read_at:
                    self._read_peers(store)
                    read_at = time.monotonic() + self.interval
                self.last_io = time.monotonic()
            except Exception:
                store = None
            if store is None:
                self._halt.wait(self.interval)
            else:
                self._moved.wait(max(0.0, read_at - time.monotonic()))

    def _read_peers(self, store) -> None:
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

    def _refresh(self) -> None:
        """Read the peers' records once more before naming them, waiting at most a second (the
        store may be gone): the pulse reads them every `interval` (2 s, many steps of a fast
        loop), so the record it last read of a killed rank said step 5 of its real 13."""

        def read():
            try:
                self._read_peers(self._main if self._main is not None else self.connect())
            except Exception:
                pass

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(1.0)

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
                self.changed = dict.fromkeys(self.changed, now)
                continue
            if self._launcher_gone():
                self._end(f"the torchrun agent that launched it (pid {self.launcher_pid}) is gone")
            for r, rec in list(self.seen.items()):
                if rec.get("state") == "ended" and r not in self.left:
                    self._end(f"rank {r} ended itself ({rec.get('why')})")
            for r, t in list(self.changed.items()):
                if r in self.left or now - t <= self.timeout:
                    continue
                rec = self.seen.get(r)
                last = (
                    f"its last heartbeat: step {rec['step']} ({rec['phase']})"
                    if rec
                    else "it never sent a heartbeat"
                )
                how = (
                    "its process exited" if r in self._dead_peers() else "it stopped, froze or died"
                )
                self._end(
                    f"rank {r} has sent no heartbeat for {now - t:.1f} s (dist_timeout="
                    f"{self.timeout:g} s): {how}; {last}"
                )
            if now - self.last_io > self.timeout:
                self._end(
                    f"{self.where} has not answered for {now - self.last_io:.1f} s "
                    f"(dist_timeout={self.timeout:g} s)"
                )

    def _saved(self) -> str:
        # rank 0 knows its last file; the others know the last save the fleet agreed on
        # (rank 0 may have written a later one since)
        if self.saved is None:
            return "no checkpoint was written by this run yet"
        later = "" if self.rank == 0 else " or later"
        return (
            f"the last checkpoint (step {self.saved}{later}) is intact: a checkpoint is "
            f"replaced only by rename"
        )

    def _end(self, reason: str) -> None:

        line = (
            f"dormouse: fleet watchdog on rank {self.rank}: {reason}. This rank was at step "
            f"{self.step} ({self.phase}) and ends now (exit {WATCHDOG_EXIT}), as does every "
            f"rank; {self._saved()}. Find what stopped the rank, then relaunch with --resume "
            f"auto"
        )
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
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
                dead = self._dead_peers()
                if dead:
                    self._refresh()  # the step it said last, not the one the pulse read
                for r in dead:
                    rec = self.seen[r]
                    raise DistError(
                        f"rank {r} is gone (its process, pid {rec['pid']} on this host, exited "
                        f"without a word; its last heartbeat, {self._age(r):.1f} s before, said "
                        f"step {rec.get('step')}) while rank {self.rank} waits "
                        f"for it at step {self.step} ({self.phase}). {self._saved()}; find why "
                        f"it died (out of memory?), then relaunch with --resume auto"
                    )
            time.sleep(delay)
            delay = min(2 * delay, 0.05)

    def _age(self, r: int) -> float:
        """Seconds since peer r's heartbeat last changed. A pulse goes every `interval` s, so
        the step it said may be behind where the rank stopped (a fast loop runs many steps
        between two pulses): a message naming that step says how old it is."""
        return time.monotonic() - self.changed.get(r, time.monotonic())

    def _launcher_gone(self, wait_s: float = 0.0) -> bool:
        """True once the torchrun agent that launched this rank has exited (this process was
        re-parented). A SIGKILLed agent closes its sockets (the store it hosts) before the
        kernel re-parents its children, so a store connection can drop a few ms before
        getppid() changes: `wait_s` polls that long for it."""
        if self.launcher_pid is None:
            return False
        deadline = time.monotonic() + wait_s
        while os.getppid() == self.launcher_pid and pid_alive(self.launcher_pid):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True

    def _dead_peers(self) -> list[int]:
        """Peers on this host whose process exited without saying they left."""
        return [
            r
            for r, rec in list(self.seen.items())
            if r not in self.left
            and rec.get("state") == "alive"
            and rec.get("host") == self.host
            and rec.get("pid")
            and not pid_alive(int(rec["pid"]))
        ]

    def explain(self, e: BaseException) -> str:
        """One line for a collective (or store call) that failed: what each peer was doing."""
        self._refresh()
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
            # the step's age: see _age
            peers.append(
                f"rank {r} {how}; its last heartbeat, {silent:.1f} s before, said step "
                f"{rec.get('step')} ({rec.get('phase')})"
            )
        text = str(e)
        if self._launcher_gone(wait_s=0.0 if culprits or "imed out" in text else LAUNCHER_EXIT_S):
            hint = f"the torchrun agent that launched this rank (pid {self.launcher_pid}) is gone"
        elif culprits:
            hint = f"rank {', '.join(map(str, culprits))} stopped"
        elif "imed out" in text:
            hint = (
                "every peer still beats, so the ranks fell out of step (a bug: please report "
                "it with the log)"
            )
        else:
            hint = (
                f"a peer or {self.where} dropped its connection (no rank is known to have "
                f"died here; another host?)"
            )
        return (
            f"rank {self.rank} lost the fleet at step {self.step} ({self.phase}): {hint} "
            f"({'; '.join(peers)}); the failed call: {short(e, 120)}. {self._saved()}; "
            f"relaunch with --resume auto"
        )


def ending() -> None:
    """This rank is ending (a lost fleet, an error, a stop): SIGTERM is ignored from now on.
    The torchrun agent SIGTERMs every worker within its monitor interval (0.1 s) of seeing a
    rank exit; a rank still explaining the loss or in its teardown (the heartbeat's last word,
    destroy_process_group) died of it silently, its one line never written (CI: an empty
    stderr on the survivor of a killed rank). The agent's SIGKILL, 30 s on, still bounds it."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def fleet_failure(e: BaseException) -> bool:
    """A collective or the store failed (a peer died, a timeout): not a bug in this rank."""
    if isinstance(e, UserError):
        return False
    if isinstance(e, getattr(dist, "DistError", ())):  # DistBackendError, DistStoreError, ...
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(
        s in text
        for s in (
            "Connection closed by peer",
            "Connection reset by peer",
            "Broken pipe",
            "Timed out",
            "timed out",
            "gloo",
            "NCCL",
        )
    )


_SESSIONS = 0


def start_heartbeat(
    rank: int, world: int, timeout_s: float, settle_to: float | None, env: Mapping[str, str]
) -> Heartbeat:
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
    return Heartbeat(
        rank,
        world,
        timeout_s,
        connect,
        f"dormouse/{restart}/{_SESSIONS}",
        store_where=where,
        launcher_pid=os.getppid() if launched else None,
        settle_to=settle_to,
    ).start()
