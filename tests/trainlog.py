"""Tests' view of the `dormouse` logger, and `train` on a given model.

`train(model, run, log=fn, ...)` runs `dormouse.train.run.train_run` on a given model (the
one entry point) and hands each logged line to `fn`, so a test can act when a line appears
(a signal at `step=5`) or collect the lines. `lines_to(fn)` is gates/recorder.py's `log_lines`.
"""

from __future__ import annotations

from collections.abc import Callable

from gates.recorder import log_lines as lines_to


def train(model, run, log: Callable[[str], None] | None = None, **kw) -> dict:
    from dormouse.train.run import train_run

    with lines_to(log or (lambda _line: None)):
        return train_run(run, model=model, **kw)
