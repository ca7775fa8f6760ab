"""The device policy written out by hand: what each card may run, the reference gate 13 reads.

`dormouse.train.plan.device.policy_for` and the model's own arm choice (`dormouse.model.arms`)
derive these answers from thresholds; this file types them out, one literal row per card,
from the rules below (nothing here imports dormouse). A row that disagrees with dormouse is a
bug in one of the two, and the gate says which cell.

The rules:

* dtype ladder (the CUDA tensor-core table): fp16 arithmetic from sm_53 (Maxwell GM20B),
  bf16 from sm_80 (Ampere). The rung is the best of bf16 > fp16 > fp32 the card has.
* what `dtype=auto` runs: the rung (bf16, or fp16 with its loss scale below sm_80, or fp32);
  no rung falls back. An explicit bf16 is honoured exactly where the card has bf16, an
  explicit fp16 where it has fp16.
* fla's KDA kernel (Triton): sm_80 and newer, given fla-core installed. Triton 3.3 moved its
  supported hardware to compute capability 8.0+ (tl.dot falls back to FMA below), and the
  torch versions dormouse runs on ship a newer Triton. So kda_impl=auto runs fla exactly
  where `fla_kda` says, in the card's auto dtype. (The design note's table marks fla KDA
  legal on sm_75/70/61; that predates Triton 3.3 and is superseded here.)
* torch._grouped_mm, by torch version (`grouped_mm`: moe_impl=grouped runs):
    - before 2.8: the op does not exist;
    - 2.8: compute capability 9.x only (the fused CUTLASS kernel), no CPU kernel;
    - 2.9 and later: legal from sm_80 (a mm-loop fallback outside the fused kernel), fused
      only on majors 9 and 10, and a CPU kernel exists (never "fused").
  `grouped_mm_fused`: bf16 operands reach the fused kernel, which is where moe_impl=auto takes
  the grouped arm on a CUDA card (bf16); on the CPU auto takes grouped wherever it runs.
* the CPU: no Triton arm; the rung and `auto` are fp32 (the CPU arm is the reference path);
  an explicit bf16 or fp16 is honoured (CPU autocast runs both, torch 2.13).

Example names are cards of that compute capability, for the reader; the policy reads the sm.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The torch eras grouped matmul legality is written for, with a version that stands for each.
ERAS = {"<2.8": "2.7.1", "2.8": "2.8.0", ">=2.9": "2.9.0"}  # each era at its first release


@dataclass(frozen=True)
class Row:
    """One card's expected policy. Field names follow `dormouse.train.plan.device.Policy`."""

    example: str
    sm: tuple[int, int] | None  # None: the CPU
    bf16: bool  # an explicit dtype=bf16 is honoured
    fp16: bool  # an explicit dtype=fp16 is honoured
    rung: str  # bf16 | fp16 | fp32
    auto: str  # what dtype=auto runs: bf16 | fp16 | fp32
    fp32_fallback: bool  # auto runs below the rung (none since the fp16 forward)
    fla_kda: bool
    grouped_mm: dict[str, bool]  # era -> legal
    grouped_mm_fused: dict[str, bool]  # era -> reaches the fused kernel


_NO_GMM = {"<2.8": False, "2.8": False, ">=2.9": False}
_LOOP_GMM = {"<2.8": False, "2.8": False, ">=2.9": True}

#: The eight synthetic cards of issue 6's acceptance, newest first. Typed, not computed.
ROWS: tuple[Row, ...] = (
    Row("NVIDIA GeForce RTX 5060 Ti", (12, 0), bf16=True, fp16=True, rung="bf16", auto="bf16",
        fp32_fallback=False, fla_kda=True,
        grouped_mm=_LOOP_GMM, grouped_mm_fused=_NO_GMM),
    Row("NVIDIA GeForce RTX 4090", (8, 9), bf16=True, fp16=True, rung="bf16", auto="bf16",
        fp32_fallback=False, fla_kda=True,
        grouped_mm=_LOOP_GMM, grouped_mm_fused=_NO_GMM),
    Row("NVIDIA GeForce RTX 3090", (8, 6), bf16=True, fp16=True, rung="bf16", auto="bf16",
        fp32_fallback=False, fla_kda=True,
        grouped_mm=_LOOP_GMM, grouped_mm_fused=_NO_GMM),
    Row("NVIDIA A100-SXM4-40GB", (8, 0), bf16=True, fp16=True, rung="bf16", auto="bf16",
        fp32_fallback=False, fla_kda=True,
        grouped_mm=_LOOP_GMM, grouped_mm_fused=_NO_GMM),
    Row("NVIDIA GeForce GTX 1650", (7, 5), bf16=False, fp16=True, rung="fp16", auto="fp16",
        fp32_fallback=False, fla_kda=False,
        grouped_mm=_NO_GMM, grouped_mm_fused=_NO_GMM),
    Row("Tesla V100-SXM2-16GB", (7, 0), bf16=False, fp16=True, rung="fp16", auto="fp16",
        fp32_fallback=False, fla_kda=False,
        grouped_mm=_NO_GMM, grouped_mm_fused=_NO_GMM),
    Row("NVIDIA GeForce GTX 1080 Ti", (6, 1), bf16=False, fp16=True, rung="fp16", auto="fp16",
        fp32_fallback=False, fla_kda=False,
        grouped_mm=_NO_GMM, grouped_mm_fused=_NO_GMM),
    Row("NVIDIA GeForce GTX 980", (5, 2), bf16=False, fp16=False, rung="fp32", auto="fp32",
        fp32_fallback=False, fla_kda=False,
        grouped_mm=_NO_GMM, grouped_mm_fused=_NO_GMM),
)  # fmt: skip

#: Beyond the acceptance set: the only majors that reach the fused grouped kernel.
EXTRA_ROWS: tuple[Row, ...] = (
    Row("NVIDIA H100 80GB HBM3", (9, 0), bf16=True, fp16=True, rung="bf16", auto="bf16",
        fp32_fallback=False, fla_kda=True,
        grouped_mm={"<2.8": False, "2.8": True, ">=2.9": True},
        grouped_mm_fused={"<2.8": False, "2.8": True, ">=2.9": True}),
    Row("NVIDIA B200", (10, 0), bf16=True, fp16=True, rung="bf16", auto="bf16",
        fp32_fallback=False, fla_kda=True,
        grouped_mm=_LOOP_GMM, grouped_mm_fused={"<2.8": False, "2.8": False, ">=2.9": True}),
)  # fmt: skip

CPU_ROW = Row("cpu", None, bf16=True, fp16=True, rung="fp32", auto="fp32", fp32_fallback=False,
              fla_kda=False, grouped_mm=_LOOP_GMM,
              grouped_mm_fused=_NO_GMM)  # fmt: skip


def era_of(torch_version: str) -> str:
    """The ERAS key a torch version string ("2.11.0+cu128") falls in."""
    major, minor = (int(p) for p in torch_version.split("+")[0].split(".")[:2])
    if (major, minor) < (2, 8):
        return "<2.8"
    return "2.8" if (major, minor) == (2, 8) else ">=2.9"


def rule(sm: tuple[int, int] | None) -> Row:
    """The same rules as the literal rows, as arithmetic on the compute capability: what the
    gate checks a real probe's card against (its sm need not be one of the rows)."""
    if sm is None:
        return CPU_ROW
    major = sm[0]
    bf16 = sm >= (8, 0)
    fp16 = sm >= (5, 3)
    rung = "bf16" if bf16 else ("fp16" if fp16 else "fp32")
    triton = sm >= (8, 0)
    gmm = {"<2.8": False, "2.8": major == 9, ">=2.9": sm >= (8, 0)}
    fused = {"<2.8": False, "2.8": major == 9, ">=2.9": major in (9, 10)}
    return Row(f"sm_{major}{sm[1]}", sm, bf16=bf16, fp16=fp16, rung=rung,
               auto=rung, fp32_fallback=False,
               fla_kda=triton, grouped_mm=gmm,
               grouped_mm_fused=fused)  # fmt: skip
