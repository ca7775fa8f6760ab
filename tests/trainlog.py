"""Tests' view of the `dormouse` logger: every line it logs, handed to a function.

`train(model, run, log=fn, ...)` runs `dormouse.train.run.train_run` on a given model (the
one entry point) and hands each logged line to `fn`, so a test can act when a line appears
(a signal at `step=5`) or collect the lines.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable


@contextlib.contextmanager
def lines_to(fn: Callable[[str], None]):
    class Call(logging.Handler):
        def emit(self, record):
            fn(self.format(record))

    handler = Call(logging.INFO)
    logger = logging.getLogger("dormouse")
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


def train(model, run, log: Callable[[str], None] | None = None, **kw) -> dict:
    from dormouse.train.run import train_run

    with lines_to(log or (lambda _line: None)):
        return train_run(run, model=model, **kw)
