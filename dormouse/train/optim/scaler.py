"""The dynamic loss scale of an fp16 forward: one number the whole fleet shares.

fp16 keeps 5 exponent bits: activation gradients below 2**-24 flush to zero, above 65504
they overflow. The loop multiplies each micro-batch's loss by `scale` before backward (so
small gradients survive the fp16 backward), divides every gradient by it before the clip
and the optimizer (`MixOptimizer.unscale_`, host-RAM Engram rows included), and after the
fleet's ONE agreed finiteness verdict calls `update(agreed)`: an overflow on any rank halves
the scale and the step is skipped; `every` clean steps in a row double it. The scale is a
power of two, so scaling and unscaling are exact in binary floating point: a step that does
not overflow computes the same fp32 gradient as one without the scale (bar subnormals).

On a fleet the scale is the FLEET's, not a rank's: DDP averages the ranks' gradients inside
backward, before any rank could unscale its own, so every rank (a bf16 or fp32 one beside an
fp16 one too) multiplies by the same scale. Every rank updates it from the same agreed
verdict, so the scales never part (gate g30). The state rides in the checkpoint's `extra`.
"""

from __future__ import annotations

import math

import torch

#: The first scale: torch.amp.GradScaler's default, 2**16.
INIT_SCALE = 2.0**16


def loss_scaled(autocast: torch.dtype | None, ctx) -> bool:
    """The one rule for whether a run carries a loss scale: this rank, or any rank of its
    fleet (`ctx.computes`, gathered at join), computes its forward in fp16."""
    return autocast == torch.float16 or "fp16" in getattr(ctx, "computes", ())


class LossScaler:
    """scale, and the count of clean steps since it last changed (GradScaler's arithmetic:
    x2 after `every` clean steps in a row, /2 on an overflow, the overflowing step skipped)."""

    def __init__(self, every: int = 2000, scale: float = INIT_SCALE):
        if every < 1:
            raise ValueError(f"loss_scale_every={every}: the scale needs >= 1 clean step to grow")
        self.every = int(every)
        self.scale = float(scale)
        self.clean = 0
        self._check()

    def _check(self) -> None:
        m, _ = math.frexp(self.scale)
        if not (math.isfinite(self.scale) and self.scale > 0 and m == 0.5):
            raise ValueError(
                f"loss scale {self.scale!r} is not a positive power of two: "
                f"unscaling by it would round every gradient"
            )

    @property
    def inverse(self) -> float:
        return 1.0 / self.scale  # exact: a power of two

    def update(self, agreed: bool) -> str | None:
        """After the fleet's verdict on this step: move the scale; the line saying so, or None
        when it stayed."""
        old = self.scale
        if not agreed:
            self.scale, self.clean = old / 2, 0
            return f"loss scale {old:g} -> {self.scale:g} (a non-finite gradient: overflow)"
        self.clean += 1
        if self.clean < self.every:
            return None
        self.scale, self.clean = old * 2, 0
        return f"loss scale {old:g} -> {self.scale:g} ({self.every} clean steps in a row)"

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean": self.clean}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.clean = float(state["scale"]), int(state["clean"])
        self._check()
