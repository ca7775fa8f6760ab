"""fla's autotune winners kept as fla's own config files, so a fresh machine skips the tuning.

fla-core reads a kernel's launch config from `$FLA_CONFIG_DIR/<kernel>.json` before it
autotunes when FLA_CACHE_MODE asks it to (a variable fla reads once, when it is imported).
On a fresh machine the tuning is most of the wait before step 1: every config of every KDA
kernel is compiled and timed (small's first forward took 48 s of an H100's 240 s first step).

- `dormouse.cache` sets FLA_CACHE_MODE=strict where the user has not: an entry is used only
  for its exact key (the kernel's shape arguments and dtypes); any other call tunes as before.
- `point_at(card)` (before the first fla call: `arms.card_of`) sets FLA_CONFIG_DIR to
  <cache>/fla-configs/<card>, merging in the winners shipped with dormouse for that card
  (`model/fla_configs/<card>/`, written by `bench warm` on it).
- `save(folder)` writes every kernel this process tuned into `folder`, merged with what is
  there: `bench warm` saves into the cache folder, so the configs can be copied to the next
  machine of the same kind.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import re
import warnings
from pathlib import Path

from dormouse import cache

log = logging.getLogger(__name__)

MODE, DIR = "FLA_CACHE_MODE", "FLA_CONFIG_DIR"
SHIPPED = Path(__file__).with_name("fla_configs")
_POINTED: list[str] = []


def card_folder_name(card: str) -> str:
    """fla's own spelling of a card's name (fla.ops.utils.cache.sanitize_gpu_name)."""
    return re.sub(r"[^0-9A-Za-z]+", "_", card).strip("_") or "unknown_gpu"


def folder_for(card: str) -> Path:
    return cache.cache_dir() / "fla-configs" / card_folder_name(card)


def _read(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _merge_into(path: Path, entries: dict, kernel: str) -> int:
    """Add `entries` (key hash -> entry) to fla's file at `path` where it lacks them; the
    file's own entries win. Written whole and renamed into place (fleet ranks race here)."""
    data = _read(path)
    have = data.get("autotune_entries")
    have = have if isinstance(have, dict) else {}
    new = {h: e for h, e in entries.items() if h not in have}
    if not new and path.exists():
        return 0
    data.update(kernel_name=kernel, autotune_entries={**new, **have})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)
    return len(new)


def point_at(card: str) -> None:
    """Before the first fla call on `card`: FLA_CONFIG_DIR = <cache>/fla-configs/<card>,
    seeded from the shipped winners for that card; the user's FLA_CONFIG_DIR is left alone.
    Once per process; logs what it read and chose."""
    if _POINTED or os.environ.get(DIR):
        return
    _POINTED.append(card)
    dest, shipped = folder_for(card), SHIPPED / card_folder_name(card)
    added = 0
    if shipped.is_dir():
        try:
            for f in sorted(shipped.glob("*.json")):
                added += _merge_into(dest / f.name, _read(f).get("autotune_entries") or {}, f.stem)
        except OSError as e:  # a read-only cache folder: fla reads the shipped ones directly
            log.info(f"fla configs: cannot write {dest} ({e}); reading {shipped}")
            dest = shipped
    if not dest.is_dir():
        log.info(f"fla configs: none for {card} (shipped: "
                 f"{', '.join(p.name for p in SHIPPED.glob('*')) or 'none'}); fla tunes each "
                 f"new shape on its first call (`bench warm` saves the winners)")  # fmt: skip
        return
    os.environ[DIR] = str(dest)
    log.info(f"fla configs: {dest} ({len(list(dest.glob('*.json')))} kernels, {added} "
             f"entries added from dormouse's own for {card}); FLA_CACHE_MODE="
             f"{os.environ.get(MODE, '')}: a kernel call whose exact key is there skips "
             "its autotune")  # fmt: skip


def _config_of(cfg) -> dict:
    return {
        "kwargs": dict(cfg.kwargs),
        "num_warps": cfg.num_warps,
        "num_stages": cfg.num_stages,
        "num_ctas": getattr(cfg, "num_ctas", 1),
        "maxnreg": getattr(cfg, "maxnreg", None),
    }


def tuned_now() -> dict[str, dict]:
    """kernel name -> {key hash: entry} for every fla kernel this process has tuned (its
    autotuners' in-memory winners), in fla's file layout."""
    try:
        from fla.ops.utils.cache import AutotuneKey, CachedAutotuner
    except ImportError:
        return {}
    out: dict[str, dict] = {}
    with warnings.catch_warnings():  # isinstance on some deprecated torch objects warns
        warnings.simplefilter("ignore")
        tuners = [o for o in gc.get_objects() if isinstance(o, CachedAutotuner)]
    for obj in tuners:
        for key, cfg in getattr(obj, "cache", {}).items():
            entry = {"autotune_key": AutotuneKey.normalize_autotune_key(list(key)),
                     "config": _config_of(cfg)}  # fmt: skip
            out.setdefault(obj.kernel_name, {})[AutotuneKey.key_hash(key)] = entry
    return out


def save(folder: Path) -> tuple[int, int]:
    """Write what this process tuned into `folder` (merged); (kernels, new entries)."""
    tuned = tuned_now()
    added = sum(_merge_into(folder / f"{k}.json", e, k) for k, e in tuned.items())
    return len(tuned), added
