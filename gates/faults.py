"""Faults a gate plants in the processes it launches (torchrun's workers), through the same
sitecustomize hook as the mutations: $DORMOUSE_FAULT="kill:RANK:STEP" makes that rank kill
itself with SIGKILL at the start of its STEP-th training step (0-based), in the first launch
only (TORCHELASTIC_RESTART_COUNT unset or 0), so an elastic restart runs clean. A mock of
exactly the fault under test: the training code itself is untouched."""

from __future__ import annotations

import os
import signal


def apply_from_env() -> None:
    spec = os.environ.get("DORMOUSE_FAULT", "")
    if not spec or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0"):
        return
    kind, rank, step = spec.split(":")
    if kind != "kill" or os.environ.get("RANK") != rank:
        return
    from dormouse.train import loop  # the train_step the loop calls

    real, calls = loop.train_step, [0]

    def train_step(*args, **kwargs):
        if calls[0] == int(step):
            os.kill(os.getpid(), signal.SIGKILL)  # a preempted card: no handler, no cleanup
        calls[0] += 1
        return real(*args, **kwargs)

    loop.train_step = train_step
