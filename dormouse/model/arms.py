"""Which kernel arm runs: the one rule the KDA mixer, the MoE, the device policy and the
--fit planner ask. `choose_arm` turns `kda_impl` / `moe_impl` into an `Arm` (name, reason) for
a torch device (read here) or a described `Card` (an sm_75 card on a machine without one).
`auto` takes the fast arm where it runs and is fast, else the one that runs everywhere; a
pinned arm that cannot run raises `ArmError`, never a quiet substitute.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dormouse.config import KdaImpl, ModelConfig, MoeImpl
from dormouse.errors import UserError
from dormouse.model import fla_tuned

log = logging.getLogger(__name__)

# Triton 3.3 (triton-lang/triton#5066) moved its supported hardware to compute capability
# 8.0+ (tl.dot falls back to FMA below), and the torch releases dormouse runs on ship a newer
# Triton; fla names no floor but leaves its tuned path below sm_80. The torch arm runs there.
FLA_MIN_SM = (8, 0)
FLA_MAX_HEAD_DIM = 256  # chunk_kda asserts key head dim <= 256
# torch's grouped matmul: absent before 2.8; 2.8 admits compute capability 9.x only and has
# no CPU kernel; from 2.9 an mm-loop fallback serves CUDA sm_80+ (pytorch/pytorch#161407)
# and a CPU kernel exists (#161717). The fused CUTLASS kernel runs on majors 9 and 10 with
# bf16 operands only; elsewhere the fallback pays a host sync per call.
GROUPED_TORCH = (2, 8)
GROUPED_FALLBACK_TORCH = (2, 9)
GROUPED_MIN_SM = (8, 0)
GROUPED_FUSED_MAJORS = (9, 10)
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what both fast arms take

#: `moe_impl=auto` computes every expert on every token (the dense arm: a few large matmuls in
#: place of a sort, gathers and a grouped matmul per call) on CUDA where the experts' summed
#: width n_experts * d_ffn is at most this. 0 until measured on a card: for small the dense arm
#: does 4x the experts' arithmetic (~0.45 TFLOP more a 64 x 256 step) to save ~30 dispatch
#: kernels a call, an estimate that could go either way; `bench moe` on the card decides
#: (docs/performance.md). Pin `--set moe_impl=dense` to use it meanwhile.
DENSE_MAX_WIDTH = 0

_REQUESTS = {"kda": typing.get_args(KdaImpl), "moe": typing.get_args(MoeImpl)}
#: kind -> (the arm that runs on every device and dtype, the fast arm, the first in words)
_ARMS = {"kda": ("torch", "fla", "the chunked PyTorch arm, same math"),
         "moe": ("batched", "grouped", "runs everywhere")}  # fmt: skip


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a torch version string such as "2.11.0+cu128"."""
    return tuple(int(v) for v in re.match(r"(\d+)\.(\d+)", version).groups())


class ArmError(UserError, RuntimeError):
    """A pinned kernel arm that cannot run here; the message names why and the escape."""


class Arm(NamedTuple):
    name: str
    reason: str  # the request, the reading and the verdict, in words


@dataclass(frozen=True)
class Card:
    """What the rule reads about a device. `card_of` reads a real one; a described card
    (the device policy's) assumes fla imports unless told why not."""

    type: str  # "cuda" | "cpu" | another torch device type
    sm: tuple[int, int] | None = None  # compute capability; None off CUDA, or not known
    name: str = ""
    torch_version: tuple[int, int] = release(torch.__version__)  # whose kernels are asked about
    fla: str | None = None  # why fla's chunk_kda cannot be imported; None = it imports

    @property
    def label(self) -> str:
        sm = f" sm_{self.sm[0]}{self.sm[1]}" if self.sm else ""
        return f"{self.type}{f' ({self.name}{sm})' if self.type == 'cuda' else ''}"


@functools.cache
def _fla_missing(cuda: bool) -> str | None:
    if not cuda:  # no import off CUDA: importing Triton on a CPU box is slow and noisy
        installed = importlib.util.find_spec("fla") is not None
        return None if installed else "fla-core is not installed (pip install fla-core)"
    try:
        from fla.ops.kda import chunk_kda  # noqa: F401
    except Exception as e:  # ImportError, or Triton failing to initialise
        return f"`from fla.ops.kda import chunk_kda` failed ({type(e).__name__}: {e})"
    return None


def card_of(device: torch.device | str | Card) -> Card:
    """The card a torch device is (a `Card` is returned as it is)."""
    if isinstance(device, Card):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        return Card(device.type, name=str(device), fla=_fla_missing(False))
    sm = tuple(torch.cuda.get_device_capability(device))
    name = torch.cuda.get_device_name(device)
    fla_tuned.point_at(name)  # before fla's first kernel call reads FLA_CONFIG_DIR
    return Card("cuda", sm, name, fla=_fla_missing(True))


def _sm(sm: tuple[int, int]) -> str:
    return f"sm_{sm[0]}{sm[1]}"


def _fla_blockers(card: Card, dtype: torch.dtype, shape: Mapping[str, int]) -> list[str]:
    why = []
    if card.type != "cuda":
        why.append(f"device {card.type} is not CUDA (fla's chunk_kda is a Triton GPU kernel)")
    elif card.sm is not None and card.sm < FLA_MIN_SM:
        why.append(f"{card.name} is {_sm(card.sm)}; Triton kernels need {_sm(FLA_MIN_SM)}+")
    if card.fla:
        why.append(card.fla)
    if dtype not in _KERNEL_DTYPES:
        why.append(f"compute dtype {dtype} is not one fla supports (fp32, bf16, fp16)")
    if shape.get("head_dim", 0) > FLA_MAX_HEAD_DIM:
        why.append(f"head_dim={shape['head_dim']} exceeds chunk_kda's limit of {FLA_MAX_HEAD_DIM}")
    return why


def _grouped_blockers(card: Card, dtype: torch.dtype, shape: Mapping[str, int]) -> list[str]:
    v = f"torch {card.torch_version[0]}.{card.torch_version[1]}"
    if card.torch_version < GROUPED_TORCH:
        return [f"{v} has no grouped matmul (needs torch >= 2.8)"]
    why, fallback = [], card.torch_version >= GROUPED_FALLBACK_TORCH
    if card.type == "cpu" and not fallback:
        why.append(f"{v} has no CPU grouped matmul (needs torch >= 2.9)")
    elif card.type not in ("cpu", "cuda"):
        why.append(f"no grouped matmul is known to run on device type {card.type!r}")
    elif card.type == "cuda" and card.sm is not None:
        if not fallback and card.sm[0] != 9:
            why.append(f"{v}'s grouped matmul admits sm_9x only; this card is {_sm(card.sm)}")
        elif card.sm < GROUPED_MIN_SM:
            why.append(f"the CUDA grouped matmul needs {_sm(GROUPED_MIN_SM)}+, this card is "
                       f"{_sm(card.sm)}")  # fmt: skip
    if dtype not in _KERNEL_DTYPES:
        why.append(f"the grouped matmul takes fp32/bf16/fp16, not {dtype}")
    dims = [f"{k}={shape[k]}" for k in ("d_model", "d_ffn") if k in shape]
    # the kernels read rows with 16-byte vector loads (measured, torch 2.13 CPU)
    if any(shape[k] * dtype.itemsize % 16 for k in ("d_model", "d_ffn") if k in shape):
        why.append(f"{' and '.join(dims)} rows must be multiples of 16 bytes in {dtype}")
    return why


def _grouped_slow(card: Card, dtype: torch.dtype) -> str | None:
    """Why `auto` passes over a grouped matmul that runs: on CUDA only bf16 on majors 9/10
    reaches the fused kernel, and the per-group fallback lost to the batched arm on an H200
    (torch 2.11, the medium MoE shape, fp32 fwd+bwd: 8.5 ms grouped vs 6.6 ms batched; bf16
    fused: 4.9 vs 5.2 ms). The CPU has no fused kernel either way; grouped is kept there for
    its lack of padding and host sync."""
    if card.type != "cuda" or card.sm is None or (
            dtype == torch.bfloat16 and card.sm[0] in GROUPED_FUSED_MAJORS):  # fmt: skip
        return None
    return (f"grouped runs here but only bf16 on sm_90/sm_100 reaches the fused kernel "
            f"(this is {str(dtype).replace('torch.', '')} on {_sm(card.sm)})")  # fmt: skip


def _dense_fits(card: Card, shape: Mapping[str, int]) -> str | None:
    """Why `auto` computes every expert on every token here, or None. The wager: on CUDA a
    narrow MoE's dispatch (gathers, a grouped matmul and their backward per call) may cost
    more in kernel launches than the E/k-fold matmul work of the dense arm, up to a width
    DENSE_MAX_WIDTH is to hold once measured; off CUDA the arithmetic is what costs, so the
    dispatch stays."""
    width = shape.get("n_experts", 0) * shape.get("d_ffn", 0)
    if card.type != "cuda" or not 0 < width <= DENSE_MAX_WIDTH:
        return None
    return f"n_experts*d_ffn={width} <= {DENSE_MAX_WIDTH} on CUDA: every expert on every token"


def check_request(kind: str, request: str) -> None:
    """Refuse what no device runs: a value that names no arm, or an arm not built."""
    if request not in _REQUESTS[kind]:
        raise ValueError(f"{kind}_impl={request!r} is not one of {_REQUESTS[kind]}")
    if (kind, request) == ("moe", "triton"):
        raise ArmError(
            "moe_impl=triton: this build of dormouse has no Triton MoE arm; use --set "
            "moe_impl=grouped (torch grouped matmul: CUDA sm_80+, CPU torch >= 2.9), "
            "moe_impl=batched (runs everywhere), moe_impl=dense (every expert on every token, "
            "runs everywhere) or moe_impl=auto (picks between them)"
        )


def why_not(kind: str, arm: str, device, dtype=torch.float32, shape=None) -> str | None:
    """None when `arm` runs on `device` at `dtype` (and `shape`), else why not."""
    if arm == _ARMS[kind][0] or (kind, arm) == ("moe", "dense"):
        return None
    blockers = _fla_blockers if kind == "kda" else _grouped_blockers
    return "; ".join(blockers(card_of(device), dtype, shape or {})) or None


def choose_arm(
    kind: str,
    request: str,
    device: torch.device | str | Card,
    dtype: torch.dtype = torch.float32,
    shape: Mapping[str, int] | None = None,
) -> Arm:
    """The arm `request` runs for `kind` ("kda" | "moe") on `device` at compute `dtype`.

    `shape` holds the dims that matter: head_dim (KDA), d_model, d_ffn and n_experts (MoE); a
    dim left out is not checked (without n_experts `auto` does not weigh the dense arm).
    ArmError for a pinned arm that cannot run here.
    """
    check_request(kind, request)
    card, (safe, fast, safe_text) = card_of(device), _ARMS[kind]
    said = f"{kind}_impl={request}"
    if request == safe or (kind, request) == ("moe", "dense"):  # both run everywhere
        return Arm(request, f"{said} (pinned) on {card.label}")
    shape = shape or {}
    why = why_not(kind, fast, card, dtype, shape)
    reading = " ".join(
        [f"device={card.label}", f"dtype={str(dtype).replace('torch.', '')}"]
        + [f"{k}={v}" for k, v in shape.items()]
        + ([f"fla={'ok' if card.fla is None else 'no'}"] if kind == "kda" else [])
    )
    if request == fast and why:
        raise ArmError(f"{said} cannot run here: {why} [{reading}]; use --set {kind}_impl="
                       f"{safe} ({safe_text}) or {kind}_impl=auto")  # fmt: skip
    if request == "auto" and kind == "moe":
        dense = _dense_fits(card, shape)
        if dense:
            return Arm("dense", f"{said}: {reading}; {dense} -> dense")
        why = why or _grouped_slow(card, dtype)
    arm = safe if why else fast
    return Arm(arm, f"{said}: {reading}{f'; {why}' if why else ''} -> {arm}")


def require_arms(cfg: ModelConfig, device, dtype: torch.dtype = torch.float32) -> tuple[Arm, Arm]:
    """(KDA arm, MoE arm) a model of `cfg` runs on `device` at `dtype`: what the CLI asks before
    training, so a pinned arm that cannot run is refused (ArmError) before any step."""
    return (
        choose_arm("kda", cfg.kda_impl, device, dtype, {"head_dim": cfg.head_dim}),
        choose_arm("moe", cfg.moe_impl, device, dtype, moe_shape(cfg)),
    )


def moe_shape(cfg: ModelConfig) -> dict[str, int]:
    """The MoE dims the arm rule reads."""
    return {"d_model": cfg.d_model, "d_ffn": cfg.d_ffn, "n_experts": cfg.n_experts}


_SAID: set[str] = set()


def announce(arm: Arm) -> Arm:
    """Log `arm`'s reason once per process: one line per distinct verdict, not per layer."""
    if arm.reason not in _SAID:
        _SAID.add(arm.reason)
        log.info("%s", arm.reason)
    return arm
