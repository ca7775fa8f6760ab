"""The loop's distributed seams, with their one-process defaults.

The training loop is single-process code that asks this object five things:
(1) which bytes this rank reads (`shape`, `offset`, `stride`), (2) how to scale
its loss before backward (`loss_scale`), (3) what to reduce by hand after backward
that the gradient reducer does not see (`after_backward`: host-RAM Engram rows),
(4) whether EVERY rank's step is finite (`all_finite`, one collective on a fleet),
and (5) whether it is the rank that evaluates, checkpoints and logs (`is_main`).
`dormouse.train.distributed.Parallel` subclasses this and fills the seams in for a
fleet; here they are the identity.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RankShape:
    """One rank's micro-batch: `batch` windows of `seq_len` bytes."""

    batch: int
    seq_len: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    @property
    def window_bytes(self) -> int:
        return self.batch * (self.seq_len + 1)

    def line(self) -> str:
        return f"{self.batch}x{self.seq_len}"


class Seams:
    """One process, one device: every seam is the identity."""

    rank = 0
    world_size = 1
    #: FSDP2 runs its all-gathers inside forward, so every rank must evaluate together.
    eval_on_all_ranks = False

    def __init__(self, shapes: list[RankShape]):
        self.shapes = list(shapes)

    @property
    def shape(self) -> RankShape:
        return self.shapes[self.rank]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def offset(self) -> int:
        """Where this rank's bytes start inside the fleet's block of a step."""
        return sum(s.window_bytes for s in self.shapes[: self.rank])

    @property
    def stride(self) -> int:
        """Bytes the whole fleet consumes per step."""
        return sum(s.window_bytes for s in self.shapes)

    @property
    def global_tokens(self) -> int:
        return sum(s.tokens for s in self.shapes)

    @property
    def loss_scale(self) -> float:
        """world_size * t_rank / sum(t): the reducer's mean becomes the token-weighted mean."""
        return self.world_size * self.shape.tokens / self.global_tokens

    def after_backward(self, model: torch.nn.Module) -> None:
        """Called on every rank right after backward, before clipping: reduce the gradients
        the reducer never sees (host-RAM Engram rows). One process: nothing to reduce."""

    def all_finite(self, finite: bool) -> bool:
        return finite

    def after_step(self, net: torch.nn.Module, opt, info: dict) -> None:
        """Called on every rank at the end of each step, taken or skipped, with
        {"stepped": bool, "gnorm": the pre-clip global norm (nan when not finite)}: an
        observation point (gates record state here); changes nothing."""

    def any_rank(self, flag: bool) -> bool:
        """True when `flag` holds on any rank (a stop request: every rank must stop together)."""
        return flag

    def fleet_loss(self, loss: torch.Tensor) -> float:
        """The token-weighted mean of every rank's mean loss."""
        return float(loss)

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return model

    def model_state(self, net: torch.nn.Module) -> dict:
        """The full model state for a checkpoint (called on every rank)."""
        from .checkpoint import plain_state

        return plain_state(self.unwrap(net))

    def optimizer_state(self, opt) -> dict:
        """The full optimizer state for a checkpoint (called on every rank)."""
        return opt.state_dict()

    def load_model_state(self, net: torch.nn.Module, ck: dict, path="") -> None:
        """Load a checkpoint's (full, single-file) model state (called on every rank)."""
        from .checkpoint import load_model_state

        load_model_state(self.unwrap(net), ck, path)

    def load_optimizer_state(self, opt, state: dict) -> None:
        """Load a checkpoint's (full, single-file) optimizer state (called on every rank)."""
        opt.load_state_dict(state)

    #: passed to model.lfb_update: sums the routers' counts over the fleet
    lfb_reduce = None

    def barrier(self) -> None:
        pass

    def describe(self) -> str:
        return f"single process, shape={self.shape.line()}"
