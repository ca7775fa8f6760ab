"""MixOptimizer.step as one CUDA graph: captured after a few eager steps, kept when its replay
is not slower than the eager step (both timed), and able to take the step's verdict on the
device (what the step writes copied aside and put back on a skip)."""

from __future__ import annotations

import logging
import statistics
import time

import torch
from torch import Tensor

log = logging.getLogger(__name__)

#: Eager steps before the optimizer step is captured (`MixOptimizer.capture_step`): AdamW's
#: kernels, cuBLAS's workspace on the capture stream and the allocator settle first (the
#: first, on the capture stream), and the host-side eager step is timed (the others).
GRAPH_WARMUP = 3
#: Replays timed after the capture, against the timed eager steps: the graph stays only when
#: its median is at most GRAPH_KEEP x the eager median. Measured on one H200 (the log's own
#: line, docs/performance.md): small at 64 x 256 1.85 ms replayed against 25.15 ms eager
#: (launch-bound); b1 at 24 x 2048 97.0 ms replayed against 84.4 ms eager (the captured step
#: updates every Engram row by mask, the eager one only the touched rows), so the choice goes
#: both ways. 1.05: a tie keeps the graph (it frees the host); a few percent of noise does
#: not flip it.
GRAPH_TIMED, GRAPH_KEEP = 3, 1.05


class StepGraph:
    """MixOptimizer.step as one CUDA graph (`MixOptimizer.capture_step`); warmup=None: the
    same device-side arithmetic, eagerly, never captured."""

    def __init__(self, opt: torch.optim.Optimizer, warmup: int | None, timed: bool = False):
        self.opt = opt
        # eager vs replayed ms (keep="auto"; capture only): see MixOptimizer.capture_step
        self.times: dict[str, list[float]] | None = (
            {"eager": [], "replay": []} if timed and warmup is not None else None
        )
        self.params = [p for g in opt.param_groups for p in g["params"]]
        self.device = self.params[0].device
        self.lrs = torch.zeros(len(opt.param_groups), dtype=torch.float64, device=self.device)
        # the host side of the lr copy: pinned, so the copy queues without waiting for the
        # device; `copied` marks when the last copy has read it, before it is written again
        # (long done by then: the loop's verdict has synchronised since)
        self.host_lrs = torch.zeros(
            len(opt.param_groups), dtype=torch.float64, pin_memory=warmup is not None
        )
        self.copied = torch.cuda.Event() if warmup is not None else None
        self.warmup = warmup
        self.steps = 0
        self.graph = None
        self.key: tuple[bool, ...] = ()
        self.static: list[Tensor] = []
        self.stream = torch.cuda.Stream(self.device) if warmup is not None else None
        self.said = False
        # commit_on_device: the step copies what it writes aside and puts it back where the
        # device-side verdict `ok` is False (`_transacted`), captured so in the graph
        self.transact = False
        self.ok = torch.ones((), dtype=torch.bool, device=self.device)
        # (what the step writes, its copy aside): made once, before any capture (`_aside`)
        self.backup: tuple[list[Tensor], list[Tensor]] | None = None

    def step(self, commit: Tensor | None = None) -> None:
        opt = self.opt
        if self.copied is not None:
            self.copied.synchronize()
        for i, g in enumerate(opt.param_groups):
            self.host_lrs[i] = float(g["lr"])
        self.lrs.copy_(self.host_lrs, non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        grads = [p.grad for p in self.params]
        key = tuple(g is not None for g in grads)
        replays = self.graph is not None and key == self.key
        if commit is not None and not (self.transact and (replays or self.warmup is None)):
            # a path that does not take the verdict on the device: decided on the host
            if not bool(commit):
                return
            commit = None
        self.steps += 1
        if replays:

            def replay() -> None:
                torch._foreach_copy_(self.static, [g for g in grads if g is not None])
                if commit is not None:
                    self.ok.copy_(commit)
                elif self.transact:
                    self.ok.fill_(True)
                self.graph.replay()

            if self.times is None:
                replay()
                return
            self.times["replay"].append(self._timed(replay))
            if len(self.times["replay"]) == GRAPH_TIMED:
                self._choose()
            return
        if commit is not None:  # the device-side arithmetic, eagerly (warmup None): by `ok`
            self.ok.copy_(commit)
            self._transacted(lambda: opt._step_body(self.lrs))
            return
        if self.warmup is None:
            opt._step_body(self.lrs)
            return
        if self.graph is None and self.steps > self.warmup:
            self._capture(key)
            self.ok.fill_(True)  # the host has decided this one (above)
            self.graph.replay()
            return
        if self.times is not None and self.graph is None and self.steps > 1:
            # the host-side eager step, as it runs without the graph: what a replay must beat
            self.times["eager"].append(self._timed(lambda: opt._step_body(None)))
            return
        if self.graph is not None and not self.said:
            self.said = True
            log.info(
                f"optimizer graph: step {self.steps} has gradients on "
                f"{sum(key)}/{len(key)} parameters, the graph was captured with "
                f"{sum(self.key)}; such steps run eagerly"
            )
        # eager, on the capture stream: its cuBLAS workspace and allocations are warm
        main = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            opt._step_body(self.lrs)
        main.wait_stream(self.stream)

    def _transacted(self, body) -> None:
        """body() (the step), then every tensor it wrote put back where `self.ok` is False:
        torch.where, so a skipped step leaves the state bit for bit as it was, NaN or not."""
        written, aside = self._aside()
        torch._foreach_copy_(aside, written)
        body()
        for t, b in zip(written, aside, strict=True):
            torch.where(self.ok, t, b, out=t)  # in place: one kernel a tensor

    def _aside(self) -> tuple[list[Tensor], list[Tensor]]:
        """(every tensor the step writes, a buffer like each), listed and allocated once."""
        if self.backup is None:
            written = self.opt.written()
            self.backup = (written, [torch.empty_like(t) for t in written])
        return self.backup

    def _timed(self, fn) -> float:
        """ms of fn() with the device synchronised before and after (the loop's verdict has
        synchronised just before the optimizer anyway: the wait costs nothing here)."""
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize(self.device)
        return 1000 * (time.perf_counter() - t0)

    def _choose(self) -> None:
        """Keep the graph or drop it (the optimizer's eager step from the next step on)."""
        eager, replay = (
            statistics.median(self.times[k]) if self.times[k] else None for k in ("eager", "replay")
        )
        self.times = None
        if eager is None:  # every warm-up step was the first: nothing to compare with
            return
        keep = replay <= GRAPH_KEEP * eager
        log.info(
            f"optimizer graph: a replay takes {replay:.2f} ms, the eager step {eager:.2f} "
            f"ms (medians, device synchronised): "
            + (
                "the graph stays"
                if keep
                else f"the eager step is faster, so it runs from the next step on (the graph "
                f"is kept only within {GRAPH_KEEP:g}x of it)"
            )
        )
        if not keep:
            self.graph = None
            self.static = []
            self.backup = None  # the eager step decides a deferred verdict on the host
            self.opt._graph = None

    def _capture(self, key: tuple[bool, ...]) -> None:
        opt = self.opt
        have = [p for p, k in zip(self.params, key) if k]
        self.static = [p.grad.detach().clone() for p in have]
        for p, s in zip(have, self.static):
            p.grad = s
        adam = opt.adamw.param_groups if opt.adamw is not None else []
        for g in adam:
            g["capturable"] = True  # torch refuses a capture otherwise
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        graph = torch.cuda.CUDAGraph()

        def body() -> None:
            opt._step_body(self.lrs)

        if self.transact:
            self._aside()  # allocated outside the graph's pool
        try:
            with torch.cuda.graph(graph, stream=self.stream):
                if self.transact:
                    self._transacted(body)
                else:
                    body()
        finally:
            for g in adam:
                g["capturable"] = False
        self.graph, self.key = graph, key
        log.info(
            f"optimizer graph: the step captured after {self.steps - 1} eager step(s) "
            f"({sum(key)} parameters with gradients); replayed from now on"
        )
