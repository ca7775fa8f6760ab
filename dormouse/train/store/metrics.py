"""Where a run's metrics rows go: `metrics.jsonl` always (the run folder's own writer,
`folder.Metrics`), TensorBoard when asked.

The loop hands every row (a train log line's numbers, an evaluation's) to each sink of a
`Sinks`, on rank 0 only. Adding a sink (W&B, MLflow, a CSV) is a class with the two methods
of `MetricsSink`, opened in `Sinks.open`:

    class MySink:
        def write(self, kind: str, step: int, values: dict) -> None: ...  # one row
        def close(self) -> None: ...  # the run ended (also on an error or a stop)

`kind` is "train" or "eval"; `values` maps a name to a number, or to a list of numbers
(the experts' load, the fleet's windows per rank), or to None (nothing measured).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Protocol

from ...errors import UserError

log = logging.getLogger(__name__)

#: The TensorBoard event files' folder inside the run folder.
TB_DIR = "tb"


class MetricsSink(Protocol):
    def write(self, kind: str, step: int, values: dict) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Scalars under `kind/name` (train/loss, eval/bpb, train/split/1...) in RUN/tb/. A resumed
    run hides what an earlier attempt logged after its checkpoint (TensorBoard's purge_step),
    as metrics.jsonl is trimmed; a fresh run removes the event files of the run it replaces.
    Flushed every row: a run killed mid-way keeps what it logged."""

    def __init__(self, folder: Path, resumed_at: int | None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:  # torch imports tensorboard lazily, here
            raise UserError(
                f"tensorboard=true needs the tensorboard package, which is not importable "
                f"here ({e}); pip install -e '.[tb]' (or pip install tensorboard), or drop "
                f"--set tensorboard=true"
            ) from None
        if resumed_at is None:
            for old in folder.glob("events.out.tfevents.*"):
                old.unlink()
        # rows at the checkpoint's own step stay (trim_metrics keeps them): purge from the next
        purge = None if resumed_at is None else resumed_at + 1
        self.writer = SummaryWriter(log_dir=str(folder), purge_step=purge)
        log.info(f"tensorboard: event files in {folder} (tensorboard --logdir {folder})")

    def write(self, kind: str, step: int, values: dict) -> None:
        for name, v in values.items():
            items = enumerate(v) if isinstance(v, (list, tuple)) else [(None, v)]
            for i, x in items:
                if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x):
                    tag = f"{kind}/{name}" if i is None else f"{kind}/{name}/{i}"
                    self.writer.add_scalar(tag, x, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Sinks:
    """Every sink of a run; `write` hands each the row. Empty on ranks other than 0."""

    def __init__(self, sinks: list[MetricsSink] | None = None):
        self.sinks = list(sinks or [])

    def open(self, folder, tensorboard: bool, resumed_at: int | None) -> None:
        """The run folder's sinks (a folder.RunDir): metrics.jsonl, and TensorBoard when
        `tensorboard`."""
        self.sinks.append(folder.metrics())
        if tensorboard:
            self.sinks.append(TensorBoardSink(folder.file(TB_DIR), resumed_at))

    def write(self, kind: str, step: int, values: dict) -> None:
        for s in self.sinks:
            s.write(kind, step, values)

    def close(self) -> None:
        sinks, self.sinks = self.sinks, []
        for s in sinks:
            s.close()
