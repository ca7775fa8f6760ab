"""A model as a safetensors file: the weights (no pickle: nothing in it can run code) and the
run config in its metadata, so `eval` and `sample` build the model from the file alone.
`dormouse export RUN --to model.safetensors` writes one; `python -c "import safetensors.torch
as s; s.load_file('model.safetensors')"` reads it without dormouse. It holds no optimizer,
data position or RNG: a run resumes from its ckpt.pt, never from this.

`read_model` gives read_checkpoint's dict for such a file (checkpoint.py hands it over when
the header says safetensors). The run folder's rules (which checkpoint, where --to may go) are
folder.export's; the write's atomicity (write_atomic) is checkpoint.py's.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import IO, Any

import safetensors.torch
import torch

from ...config import ConfigError, RunConfig, loads, validate
from .errors import CheckpointError

SUFFIX = ".safetensors"
#: The metadata's `format` value: what tells a dormouse model from another safetensors file.
FORMAT = "dormouse-model-1"
#: safetensors' header: 8 bytes of little-endian length, then a JSON object; a header longer
#: than this is no model of ours (ours are a few KB) and is not parsed.
_HEADER_MAX = 100 << 20


def looks_like(path: Path) -> bool:
    """Whether the file starts as a safetensors file does (a torch checkpoint is a zip: 'PK')."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return False
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 2 <= n <= _HEADER_MAX and head[8:9] == b"{"


def write(f: IO[bytes], run_json: str, step: int, model: dict[str, torch.Tensor]) -> None:
    """The model's tensors (each its own contiguous copy: safetensors refuses tensors that
    share memory) and {format, config, step} as metadata, written to the open file `f`."""
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in model.items()}
    meta = {"format": FORMAT, "config": run_json, "step": str(int(step))}
    # one buffer of the file's size: the models dormouse exports fit in host memory twice
    f.write(safetensors.torch.save(tensors, metadata=meta))


def read(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(metadata, tensors) of a safetensors file; safetensors' own errors pass through, and
    a header that is not a JSON object with string metadata is a ValueError. The bytes are
    read here (the library takes a str path as UTF-8: a name of other bytes failed there)."""
    raw = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = loads(raw[8 : 8 + min(n, _HEADER_MAX)])
    meta = header.get("__metadata__", {}) if isinstance(header, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("its header holds no metadata of strings")
    return meta, safetensors.torch.load(raw)


def read_model(path: Path) -> dict[str, Any]:
    """A safetensors model (tensorfile.py) as read_checkpoint's dict: format, config, run,
    step and model; no optimizer, data position or RNG (eval and sample need none)."""
    try:
        meta, model = read(path)
    except Exception as e:  # safetensors' SafetensorError, a torn header
        raise CheckpointError(
            f"{path} could not be read as a safetensors model "
            f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); it may be truncated or not a model "
            f"at all"
        ) from None
    step = meta.get("step", "")
    if meta.get("format") != FORMAT or "config" not in meta or not step.isdigit():
        raise CheckpointError(
            f"{path} is a safetensors file but not a dormouse model (its metadata holds no "
            f"format {FORMAT!r}, config and step); export one with `dormouse "
            f"export RUN --to {path.name}`"
        )
    try:
        run = validate(RunConfig.from_json(meta["config"]))
    except ConfigError as e:
        raise CheckpointError(
            f"{path}: its embedded run config is unusable ({e}); the file is "
            f"damaged or from another version of dormouse"
        ) from None
    return {
        "format": FORMAT,
        "config": meta["config"],
        "run": run,
        "step": int(step),
        "model": model,
    }
