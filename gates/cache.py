"""Where the gates keep what they computed, so one fleet run feeds every claim that reads it.

`cached(key, compute)` computes once per process and, when $DORMOUSE_GATE_CACHE names a folder
(`python -m gates` sets one for the command, pytest one for the session), once across the
processes that share it (pytest-xdist workers, `--mutations --jobs N`), under a file lock per
key. `work_dir(name)` is a fresh folder for one run under the same base.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def base_dir() -> Path:
    """$DORMOUSE_GATE_CACHE, or a per-user folder in the temp dir when none is set."""
    shared = os.environ.get("DORMOUSE_GATE_CACHE")
    if shared:
        return Path(shared)
    return Path(os.environ.get("TMPDIR", "/tmp")) / f"dormouse-gates-{os.getuid()}"


_memory: dict[str, Any] = {}


def remembered() -> set[str]:
    """The keys this process has computed or loaded so far."""
    return set(_memory)


def forget(keys) -> None:
    """Drop these keys from this process's memory (the shared folder keeps its files)."""
    for key in keys:
        _memory.pop(key, None)


@contextlib.contextmanager
def _locked(key: str):
    shared = os.environ.get("DORMOUSE_GATE_CACHE")
    if not shared:
        yield None
        return
    d = Path(shared)
    d.mkdir(parents=True, exist_ok=True)
    with open(d / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield d / f"{key}.pkl"
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def cached(key: str, compute: Callable[[], Any]) -> Any:
    """compute() once per process, and once per pytest session when the cache dir is shared."""
    if key in _memory:
        return _memory[key]
    with _locked(key) as path:
        if path is not None and path.exists():
            with open(path, "rb") as f:
                value = pickle.load(f)
        else:
            value = compute()
            if path is not None:
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                with open(tmp, "wb") as f:
                    pickle.dump(value, f)
                os.replace(tmp, path)
    _memory[key] = value
    return value


def work_dir(name: str) -> Path:
    d = base_dir() / f"{name}-{os.getpid()}-{time.monotonic_ns()}"
    d.mkdir(parents=True, exist_ok=True)
    return d
