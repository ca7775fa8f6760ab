"""Stopping on a signal: SIGINT and SIGTERM become a flag the loop reads between steps."""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)


class GracefulStop:
    """SIGINT / SIGTERM while training: finish the step in hand, checkpoint, then stop.

    A signal only raises a flag; the loop reads it between steps, where model, optimizer
    and data position agree, so the checkpoint written then resumes exactly (a
    KeyboardInterrupt raised mid-step could not promise that). A second Ctrl-C stops at
    once, without a checkpoint. Schedulers send SIGTERM before they preempt a job: it is
    honoured the same way. A disposition of SIG_IGN (a shell's background job) is left
    alone. Some libraries put their own SIGINT handler in place on first use, so the loop
    re-installs ours between steps and says so once. Off the main thread (where Python
    cannot set handlers) this does nothing.
    """

    NAMES = ("SIGINT", "SIGTERM")

    def __init__(self):
        self.caught: str | None = None
        self.stopped = False  # the loop stopped on the signal, with a checkpoint
        self._handler = self._on_signal  # one bound method, so `is` finds it again
        self._previous: dict = {}
        self._told = False

    def _on_signal(self, signum, _frame) -> None:
        if self.caught is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        self.caught = signal.Signals(signum).name

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for name in self.NAMES:
            sig = getattr(signal, name, None)
            if sig is None:
                continue
            old = signal.getsignal(sig)
            if old is signal.SIG_IGN:
                continue
            self._previous[sig] = old
            signal.signal(sig, self._handler)

    def keep_installed(self) -> None:
        for sig in self._previous:
            now = signal.getsignal(sig)
            if now is not self._handler:
                if not self._told:
                    log.info(
                        f"note: the {signal.Signals(sig).name} handler was replaced "
                        f"({now!r}) by something the run loaded; re-installed so a stop "
                        f"still writes a checkpoint"
                    )
                    self._told = True
                signal.signal(sig, self._handler)

    def restore(self) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
