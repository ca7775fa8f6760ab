"""Single-file checkpoints: write atomically, load safely, refuse a mismatched shape.

One checkpoint = one file holding the run config, the model (fp32 masters and the
LFB buffers, which live in the state dict), the optimizer, the data position, the
RNG states and the step. It is written to a temporary file, fsynced and renamed,
so a crash mid-write never leaves a torn checkpoint behind, and loaded with
`weights_only=True`, so nothing in a checkpoint file can execute code.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig, RunConfig

FORMAT = 1


class CheckpointError(RuntimeError):
    pass


def plain_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state with wrapper prefixes removed and tensors on the CPU."""
    sd = module.state_dict()
    out = {}
    for k, v in sd.items():
        for prefix in ("module.", "_orig_mod."):
            while k.startswith(prefix):
                k = k[len(prefix):]
        if hasattr(v, "full_tensor"):  # a DTensor from FSDP2: gather (a collective)
            v = v.full_tensor()
        out[k] = v.detach().cpu().clone()
    return out


def rng_state() -> dict[str, Any]:
    st = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    if "cuda" in st and torch.cuda.is_available():
        try:
            torch.cuda.set_rng_state_all(st["cuda"])
        except Exception:  # a different number of cards: the model has no stochastic layers
            pass


def save_checkpoint(
    path: str | Path,
    *,
    run: RunConfig,
    model: torch.nn.Module | None = None,
    model_state: dict | None = None,
    optimizer=None,
    optimizer_state: dict | None = None,
    step: int,
    data_state: dict | None = None,
    extra: dict | None = None,
) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "format": FORMAT,
        "config": run.to_json(),
        "step": int(step),
        "model": model_state if model_state is not None else plain_state(model),
        "optimizer": (optimizer_state if optimizer_state is not None
                      else optimizer.state_dict() if optimizer is not None else None),
        "data": data_state,
        "rng": rng_state(),
        "extra": extra or {},
    }
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load a checkpoint file with weights_only=True (no code runs from the file)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}; train first or pass the right path")
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory, not a checkpoint file")
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"{path} could not be read as a dormouse checkpoint ({type(e).__name__}: {e}); "
            f"it may be truncated or not a checkpoint at all"
        ) from None
    if not isinstance(ck, dict) or "config" not in ck or "model" not in ck:
        raise CheckpointError(f"{path} is a torch file but not a dormouse checkpoint")
    ck["run"] = RunConfig.from_json(ck["config"])
    return ck


def shape_mismatch(saved: ModelConfig, current: ModelConfig) -> list[str]:
    """Fields of the model config that change the set or shape of parameters."""
    irrelevant = {"kda_impl", "moe_impl", "engram_ram", "moe_offload", "act_ckpt",
                  "act_ckpt_quant", "bf16", "kda_chunk", "segment_len", "moe_capacity",
                  "moe_lb_coef", "init_std", "max_seq_len"}  # fmt: skip
    a, b = dataclasses.asdict(saved), dataclasses.asdict(current)
    return [f"{k}: checkpoint {a[k]!r} vs this run {b[k]!r}"
            for k in a if k not in irrelevant and a[k] != b[k]]  # fmt: skip


def load_model_state(model: torch.nn.Module, ck: dict[str, Any], path: str | Path = "") -> None:
    cfg = getattr(model, "cfg", None)
    if cfg is not None:
        diff = shape_mismatch(ck["run"].model, cfg)
        if diff:
            raise CheckpointError(
                f"checkpoint {path} has another model shape: " + "; ".join(diff)
                + ". Train a new run (another --out) or use the checkpoint's own preset/--set."
            )
    target = model.module if hasattr(model, "module") else model
    missing, unexpected = target.load_state_dict(ck["model"], strict=False)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path} does not match this model: missing {missing[:8]}, "
            f"unexpected {unexpected[:8]}"
        )
