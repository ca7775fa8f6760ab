"""Where dormouse keeps what it builds once per machine: the default corpus, Triton's compiled
kernels and its autotune results (fla's KDA kernels tune through Triton's autotuner), and
inductor's caches (FX graphs, AOTAutograd's forward/backward, autotune choices): a second run
of a compiled shape loads its kernels instead of generating them.

One rule for the folder: $DORMOUSE_CACHE, else ~/.cache/dormouse. `place_kernel_caches` runs
when the package is imported (dormouse/__init__.py), so every entry point gets it before
anything imports Triton: the CLI's commands, a torchrun fleet's ranks, spawned ranks, gates.
Imports nothing heavy (no torch): it runs at import time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping
from pathlib import Path

log = logging.getLogger(__name__)

#: The variables dormouse fills in when the user has not: Triton's cache folder, and its
#: on-disk autotune cache (off by default in Triton; read when a kernel's @triton.autotune
#: decorator runs, i.e. when fla is imported, so it must be set before that import).
TRITON_DIR, TRITON_AUTOTUNE = "TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING"
#: inductor's cache root (its FX-graph, AOTAutograd and autotune caches live under it; torch's
#: default is /tmp/torchinductor_$USER, which a reboot or a tmp cleaner empties)
INDUCTOR_DIR = "TORCHINDUCTOR_CACHE_DIR"
#: fla's config-file lookup (read when fla is imported): strict = a kernel call whose exact key
#: is in $FLA_CONFIG_DIR/<kernel>.json runs that config without tuning (model/fla_tuned.py)
FLA_MODE = "FLA_CACHE_MODE"

#: What place_kernel_caches set in this process (name -> value); empty when the user's won.
_PLACED: dict[str, str] = {}
_SAID = False


def cache_dir(env: MutableMapping[str, str] | None = None) -> Path:
    """$DORMOUSE_CACHE (a leading ~ expanded), else ~/.cache/dormouse. Not created here."""
    env = os.environ if env is None else env
    where = env.get("DORMOUSE_CACHE") or os.path.join("~", ".cache", "dormouse")
    return Path(os.path.expanduser(where))


def place_kernel_caches(env: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Point Triton's cache at <cache>/triton, turn on its autotune-result cache, point
    inductor's at <cache>/inductor and let fla read tuned configs (FLA_CACHE_MODE=strict), each
    only where `env` (default os.environ) leaves it unset or empty; returns what it set.
    Triton and inductor create the folders when they write."""
    env = os.environ if env is None else env
    want = {
        TRITON_DIR: str(cache_dir(env) / "triton"),
        TRITON_AUTOTUNE: "1",
        INDUCTOR_DIR: str(cache_dir(env) / "inductor"),
        FLA_MODE: "strict",
    }
    placed = {k: v for k, v in want.items() if not env.get(k)}
    env.update(placed)
    if env is os.environ:
        _PLACED.clear()
        _PLACED.update(placed)
    return placed


def kernel_cache_line() -> str:
    """Where Triton's kernels and autotune results go in this process, and who said so."""
    where = triton_dir()
    whose = (
        "dormouse's cache folder"
        if TRITON_DIR in _PLACED
        else f"{TRITON_DIR} from the environment"
        if os.environ.get(TRITON_DIR)
        else "unset"
    )
    tune = os.environ.get(TRITON_AUTOTUNE, "")
    tuned = ("autotune results cached on disk" if autotune_cached() else
             f"autotune results NOT cached on disk ({TRITON_AUTOTUNE}={tune!r} in the environment; "
             f"unset it or set 1 so a second run skips the tuning)")  # fmt: skip
    ind = os.environ.get(INDUCTOR_DIR) or "torch's default"
    return f"kernel cache: {where} ({whose}; {tuned}); inductor's cache: {ind}"


def say_kernel_cache() -> None:
    """Log kernel_cache_line() once per process, where a Triton kernel is about to run."""
    global _SAID
    if not _SAID:
        _SAID = True
        log.info(kernel_cache_line())


def autotune_cached() -> bool:
    """Whether Triton will keep autotune winners on disk in this process."""
    return os.environ.get(TRITON_AUTOTUNE, "") == "1"


def triton_dir() -> str:
    """The folder Triton writes its kernels (and, when cached, autotune results) to."""
    return os.environ.get(TRITON_DIR) or "~/.triton/cache (Triton's default)"
