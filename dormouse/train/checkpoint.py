"""Checkpoints in two formats, written atomically and loaded safely, refusing a mismatched
shape; and the run folder (fresh, resume or complete).

A checkpoint holds the run config, the model (fp32 masters, the LFB buffers and the host-RAM
Engram tables, which live in its state dict), the optimizer, the data position and the data's
fingerprint, the RNG states, the step and its format. `ckpt.pt` is always one file, replaced by
rename (the commit point of a save), in one of two formats:

* format 2, the single file (one process, DDP, `export_checkpoint`): the full state, gathered
  through torch.distributed.checkpoint.state_dict by `model_state` / `optimizer_state` (a
  collective under a process group; rank 0 gets it and writes the file); every rank loads it.
* format 3, sharded (FSDP2, chosen by `sharded(net)`): every rank writes its own shards with
  torch.distributed.checkpoint (`dcp.save` of the sharded state dicts) into one temporary
  directory; once every rank has written (dcp.save returns), rank 0 renames it to
  `ckpt.<step>.<token>.shards`, replaces `ckpt.pt` with a manifest (the non-tensor state, each
  rank's RNG, the optimizer's param groups, the directory's name) and removes the previous
  directory. A save killed at any point leaves the previous `ckpt.pt` and its directory intact.
  `load_train_state` reshards to any world size (DCP reads, for each rank's local shards, the
  saved chunks they overlap); `load_model` and `export_checkpoint` read the whole state in one
  process. The data position is the fleet's (the step of a block of the global batch), the
  same on every rank, so it resumes at any world size at the same global batch.

Nothing in a checkpoint runs code: files load with `weights_only=True`, and so do DCP's tensor
files (FileSystemReader). DCP's `.metadata` is a plain pickle, which torch reads with
`pickle.load`; `_Reader` reads it with `_MetadataUnpickler`, which builds only DCP's metadata
records (the dataclasses and enums of torch.distributed.checkpoint), torch.Size, dtypes,
layouts and paths and refuses every other global. A non-tensor entry (DCP unpickles those with
`weights_only=False`) is refused: a sharded checkpoint holds tensors only.
"""

from __future__ import annotations

import dataclasses
import enum
import errno
import importlib
import json
import logging
import os
import pickle
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict,
)  # fmt: skip

from ..config import ConfigError, ModelConfig, RunConfig, validate
from ..errors import UserError
from ..model.engram import HostTables
from .context import local_shard
from .routing import strip_name

log = logging.getLogger(__name__)

#: 2: the single file; the optimizer state is torch's (torch.distributed.checkpoint's full
#: state, keyed by parameter name); 1 held MixOptimizer's own format. 3: sharded (a manifest
#: file naming a directory of DCP shards). The model state is the same in all.
FORMAT = 2
SHARDED_FORMAT = 3


class CheckpointError(UserError, RuntimeError):
    """A checkpoint or run folder the run cannot use or write; names cause and escape."""


#: One process needs no process group for these; under one, the full state is rank 0's.
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
#: Each rank's own shards (DTensors under FSDP2), for dcp.save / dcp.load.
_SHARDED = StateDictOptions(full_state_dict=False)


def model_state(net: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The full model state on the CPU, keyed by canonical names; {} on ranks other than 0
    under a process group. On a CPU model the tensors are the live ones (as in torch's
    state_dict): save them before stepping again."""
    return get_model_state_dict(net, options=_FULL)


def optimizer_state(net: torch.nn.Module, opt) -> dict:
    """The full optimizer state on the CPU ({} on ranks other than 0 under a process group):
    torch's format keyed by parameter name, the host tables' row state included as if those
    tables were parameters (torch's gatherer does not see them), so it loads into either
    store. Live tensors on a CPU run, as model_state."""
    return _with_host(get_optimizer_state_dict(net, opt, options=_FULL), opt)


def _with_host(state: dict, opt) -> dict:
    host = getattr(opt, "host_state", {})
    if state and host:
        state["state"].update(host)
        for g in state["param_groups"]:
            g["params"] = g["params"] + [n for n in g["names"] if n in host]
    return state


def load_model_state(net: torch.nn.Module, state: dict, path: str | Path = "",
                     options: StateDictOptions = _FULL) -> None:  # fmt: skip
    """Load a model state into net: a full one (model_state's) on every rank, each with the
    whole state, or with `options=_SHARDED` each rank's own shards.

    Refuses a state whose keys are not this model's (missing or unexpected ones), naming them.
    """
    mine = get_model_state_dict(net, options=StateDictOptions()).keys()  # names only, no gather
    missing, unexpected = sorted(mine - state.keys()), sorted(state.keys() - mine)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path} does not match this model: missing {missing[:8]}, "
            f"unexpected {unexpected[:8]}"
        )
    state = dict(state)
    # torch puts a wrapper's prefix (DDP's `module.`) on the keys of parameters and buffers
    # only; a host table is neither
    for name, m in net.named_modules():
        if isinstance(m, HostTables) and strip_name(name) != name:
            state[name + ".table"] = state.pop(strip_name(name) + ".table")
    set_model_state_dict(net, state, options=options)


def load_optimizer_state(net: torch.nn.Module, opt, state: dict, path: str | Path = "",
                         options: StateDictOptions = _FULL) -> None:  # fmt: skip
    """Load an optimizer state (optimizer_state's, or with `options=_SHARDED` each rank's own
    shards) into opt, on every rank. A state from checkpoint format 1 is refused."""
    if "param_groups" not in state:
        raise CheckpointError(
            f"checkpoint {path} holds its optimizer state in checkpoint format 1 (MixOptimizer's "
            f"own); this dormouse resumes format {FORMAT} only. Its model still loads (eval, "
            f"sample): train a new run (--overwrite, or another --out)"
        )
    host = getattr(opt, "host_state", {})
    saved = state["state"]
    if host:  # the tables this optimizer keeps in host RAM are no parameters here
        state = {"state": {k: v for k, v in saved.items() if k not in host},
                 "param_groups": [{**g, "params": [n for n in g["params"] if n not in host]}
                                  for g in state["param_groups"]]}  # fmt: skip
    try:
        set_optimizer_state_dict(net, opt, state, options=options)
        if host:
            opt.load_host_state({n: saved.get(n) for n in host})
    except ConfigError as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None


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


def rank_rng(ck: dict, rank: int) -> dict[str, Any]:
    """This rank's saved RNG state. A sharded checkpoint keeps every rank's; a rank beyond the
    saved world takes rank 0's (training draws no random numbers: the states agree anyway)."""
    rng = ck["rng"]
    return rng if isinstance(rng, dict) else rng[rank if rank < len(rng) else 0]


def save_state(path: str | Path, net: torch.nn.Module, opt, *, run: RunConfig, step: int,
               data_state: dict, data_fingerprint: list[dict] | None,
               main: bool = True, extra: dict | None = None) -> None:  # fmt: skip
    """The loop's save, on every rank: sharded under FSDP2, else the full state gathered (a
    collective under a process group) and written by rank 0 (`main`) alone. `extra`: the
    loop's own bookkeeping (best validation so far, training seconds), plain values only."""
    if sharded(net):
        save_sharded(path, net, opt, run=run, step=step, data_state=data_state,
                     data_fingerprint=data_fingerprint, extra=extra)  # fmt: skip
        return
    model, optim = model_state(net), optimizer_state(net, opt)
    if main:
        save_checkpoint(path, run=run, model_state=model, optimizer_state=optim, step=step,
                        data_state=data_state, data_fingerprint=data_fingerprint,
                        extra=extra)  # fmt: skip


def sharded(net: torch.nn.Module) -> bool:
    """The one rule for the format: FSDP2's parameters are DTensors, which no rank holds whole,
    so its checkpoint is sharded. One process and DDP (every rank holds the whole model) write
    the single file, which needs no filesystem shared by the ranks."""
    return any(hasattr(p, "placements") for p in net.parameters())


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
    data_fingerprint: list[dict] | None = None,
    rng: dict | None = None,
    extra: dict | None = None,
) -> Path:
    """Write one checkpoint file atomically. Pass the gathered states (model_state(net) and
    optimizer_state(net, opt), called on every rank; rank 0 writes) or, in one process, the
    model and its optimizer. `rng`: this process's RNG state unless given (an export)."""
    path = Path(path)
    if model is not None:
        model_state, optimizer_state = _gather(model, optimizer)
    bad = nonfinite_entries(model_state)
    if bad:
        raise _diverged(path, step, f"{len(bad)} tensor(s) of the model hold NaN/inf (first: "
                                    f"{bad[0]})")  # fmt: skip
    payload = {
        "format": FORMAT,
        "config": run.to_json(),
        "step": int(step),
        "model": model_state,
        "optimizer": optimizer_state,
        "data": data_state,
        # each --data file's size and sampled-block digest (data.data_fingerprint): a resume
        # on other bytes behind the same path is refused (data.fingerprint_mismatch)
        "data_fingerprint": data_fingerprint,
        "rng": rng if rng is not None else rng_state(),
        "extra": extra or {},
    }
    _write_file(path, payload, step)
    _prune_shards(path, keep="")  # a sharded checkpoint this file replaced
    return path


def _diverged(path: Path, step: int, what: str) -> CheckpointError:
    # a NaN checkpoint would be resumed, evaluated and sampled as if it were a model
    return CheckpointError(
        f"refusing to write {path} at step {step}: {what}, so the run diverged; "
        + ("the previous checkpoint there is untouched. " if path.exists() else "")
        + "Lower --set lr, or keep --set grad_clip > 0"
    )


def _mkdir(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create the run folder {folder} ({e.strerror or e}); "
                              f"pick a writable --out") from None  # fmt: skip


def _write_failed(path: Path, step: int, e: OSError) -> CheckpointError:
    full = " (the disk is full)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
    kept = ("the previous checkpoint there is untouched" if path.exists()
            else "no earlier checkpoint exists")  # fmt: skip
    return CheckpointError(
        f"could not write {path} at step {step}: {e.strerror or e}{full}; the partial "
        f"write was removed and {kept}. Free space (or pick another --out), then --resume auto"
    )


def _write_file(path: Path, payload: dict, step: int) -> None:
    """torch.save to a temp file, fsync, rename over `path`, fsync the folder."""
    _mkdir(path.parent)
    # the pid in the name lets the next run tell a dead writer's leftover from a live one
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.",
                               suffix=".tmp")  # fmt: skip
    try:
        # mkstemp creates 0600; a checkpoint is an ordinary output file, so honour the umask
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise _write_failed(path, step, e) from None
        raise


def _fsync_dir(folder: Path) -> None:
    dfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _gather(net: torch.nn.Module, opt) -> tuple[dict, dict | None]:
    return model_state(net), (optimizer_state(net, opt) if opt is not None else None)


def _umask() -> int:
    # os.umask can only be read by setting it; the window is two system calls long
    old = os.umask(0o022)
    os.umask(old)
    return old


def nonfinite_entries(state: dict) -> list[str]:
    """Names of the floating tensors in a state dict that hold NaN or inf (a DTensor: its
    local shard)."""
    return [k for k, v in state.items()
            if torch.is_tensor(v) and v.is_floating_point()
            and not bool(torch.isfinite(local_shard(v)).all())]  # fmt: skip


# ---- the sharded format ------------------------------------------------------------------

#: A sharded checkpoint's directory: `<stem>.<step>.<token>.shards` beside `<stem>.pt`.
_SHARDS = re.compile(r"(?P<stem>.+)\.[0-9]+\.(?P<token>[A-Za-z0-9_]+)\.shards\Z")


def _dist() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if _dist() else 0


def _all_gather(obj) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank; [obj] without a process group."""
    if not _dist():
        return [obj]
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _from_rank0(obj):
    """Rank 0's obj on every rank."""
    if not _dist():
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _sharded_targets(net: torch.nn.Module, opt) -> tuple[dict, dict]:
    """This rank's model and optimizer state dicts (DTensors under FSDP2, live tensors): what
    dcp.save writes and dcp.load fills in place. The host tables' row state joins the
    optimizer's as in optimizer_state."""
    model = get_model_state_dict(net, options=_SHARDED)
    return model, _with_host(get_optimizer_state_dict(net, opt, options=_SHARDED), opt)


def _staging_dir(path: Path) -> Path:
    """The temporary directory every rank writes its shards into: rank 0 makes it (its pid in
    the name, as for a temp file) and every rank learns its name; rank 0's failure is every
    rank's."""
    made = ""
    if _rank() == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            made = tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.",
                                    suffix=".tmp")  # fmt: skip
            os.chmod(made, 0o777 & ~_umask())  # mkdtemp makes 0700
        except OSError as e:
            made = f"!cannot create a directory in {path.parent} ({e.strerror or e}); pick a " \
                   f"writable --out"
    made = _from_rank0(made)
    if made.startswith("!"):
        raise CheckpointError(made[1:])
    return Path(made)


def save_sharded(path: str | Path, net: torch.nn.Module, opt, *, run: RunConfig, step: int,
                 data_state: dict, data_fingerprint: list[dict] | None,
                 extra: dict | None = None) -> Path:  # fmt: skip
    """Every rank (a collective): write this rank's shards, then rank 0 commits (the module
    docstring). Without a process group, one process writes all of them."""
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    model, optim = _sharded_targets(net, opt)
    bad = nonfinite_entries(model)
    if any(_all_gather(bool(bad))):
        where = f"first on this rank: {bad[0]}" if bad else "on another rank"
        raise _diverged(path, step, f"the model holds NaN/inf ({where})")
    odd = [k for k, st in optim["state"].items() for v in st.values() if not torch.is_tensor(v)]
    if odd:  # bitsandbytes counts steps in a Python int; FSDP2 refuses it before this
        raise CheckpointError(f"a sharded checkpoint holds tensors only; the optimizer state of "
                              f"{odd[0]} is not one; train with optim_8bit=false")  # fmt: skip
    ranks = _all_gather((rng_state(), data_state))
    if any(d != ranks[0][1] for _, d in ranks):
        # the position is the fleet's (a step of the global batch's blocks), never a rank's
        raise CheckpointError(f"the ranks disagree on the data position at step {step}: "
                              f"{[d for _, d in ranks]}; a bug, please report it")  # fmt: skip
    tmp = _staging_dir(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns when it saves without a process group
            dcp.save({"model": model, "optimizer": optim["state"]},
                     storage_writer=FileSystemWriter(tmp), no_dist=not _dist())  # fmt: skip
        if _rank() == 0:
            manifest = {"format": SHARDED_FORMAT, "config": run.to_json(), "step": int(step),
                        "shards": "", "world": len(ranks), "data": data_state,
                        "data_fingerprint": data_fingerprint,
                        "param_groups": optim["param_groups"],
                        "rng": [r for r, _ in ranks], "extra": extra or {}}  # fmt: skip
            _commit(path, tmp, manifest, step)
    except BaseException as e:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise _write_failed(path, step, e) from None
        if isinstance(e, CheckpointException):  # a rank's write failed: every rank raises it
            kept = ("the previous checkpoint there is untouched" if path.exists()
                    else "no earlier checkpoint exists")  # fmt: skip
            raise CheckpointError(f"could not write the shards of {path} at step {step} ({e}); "
                                  f"{kept}. Free space (or pick another --out), then --resume "
                                  f"auto") from None  # fmt: skip
        raise
    return path


def _commit(path: Path, tmp: Path, manifest: dict, step: int) -> None:
    """Rank 0, after every rank wrote: check the shards are all here, rename the directory into
    place, replace the manifest (the commit point), drop the previous directory."""
    md = _Reader(tmp).read_metadata()  # also proves it reads back through the safe unpickler
    need: dict[str, int] = {}
    for info in md.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    short = sorted(f for f, n in need.items()
                   if not (tmp / f).is_file() or (tmp / f).stat().st_size < n)  # fmt: skip
    if short:
        raise CheckpointError(
            f"the shards {short[:4]} are missing from {tmp} as rank 0 sees it: every rank writes "
            f"its own shards into the run folder, so --out must be on a filesystem every rank "
            f"sees (one shared by the machines); the previous checkpoint is untouched"
        )
    token = tmp.name.removesuffix(".tmp").rsplit(".", 1)[-1]
    final = path.parent / f"{path.stem}.{step:06d}.{token}.shards"
    os.rename(tmp, final)
    try:
        _fsync_dir(path.parent)
        _write_file(path, {**manifest, "shards": final.name}, step)
    except BaseException:
        shutil.rmtree(final, ignore_errors=True)  # never committed: the previous one stands
        raise
    _prune_shards(path, keep=final.name)


def remove_checkpoint(path: str | Path) -> None:
    """Delete a checkpoint (a sharded one's shard directories too), if there is one."""
    path = Path(path)
    path.unlink(missing_ok=True)
    if path.parent.is_dir():
        _prune_shards(path, keep="")


def _prune_shards(path: Path, keep: str) -> None:
    """Remove `path`'s shard directories other than `keep` (those of replaced checkpoints)."""
    for p in path.parent.iterdir():
        m = _SHARDS.match(p.name)
        if m and m["stem"] == path.stem and p.name != keep and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata records and nothing else: a global outside the list is refused
    before its module is imported."""

    _DCP = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
    _PATHS = ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")

    def find_class(self, module: str, name: str):
        obj, ok = None, False
        if module in self._DCP:  # DCP's own records: dataclasses and enums
            obj = getattr(importlib.import_module(module), name, None)
            ok = isinstance(obj, type) and (dataclasses.is_dataclass(obj)
                                            or issubclass(obj, enum.Enum))
        elif module == "torch":
            obj = getattr(torch, name, None)
            ok = obj is torch.Size or isinstance(obj, (torch.dtype, torch.layout,
                                                       torch.memory_format))
        elif (module, name) == ("torch.serialization", "_get_layout"):  # a layout by its name
            obj, ok = torch.serialization._get_layout, True
        elif module in ("pathlib", "pathlib._local") and name in self._PATHS:
            obj, ok = getattr(importlib.import_module(module), name), True
        if not ok:
            raise pickle.UnpicklingError(f"{module}.{name} is no part of DCP's metadata")
        return obj


class _Reader(FileSystemReader):
    """torch's FileSystemReader (tensors by torch.load(weights_only=True)) with its one pickle,
    the `.metadata` file, read by _MetadataUnpickler, and refusing a file outside the
    directory. Only the global metadata (a save that finished) is read."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        where = Path(self.path) / ".metadata"
        if kwargs.get("rank") is not None or not where.is_file():
            raise CheckpointError(f"{where} is missing: the shards directory is incomplete")
        try:
            with open(where, "rb") as f:
                md = _MetadataUnpickler(f).load()
        except Exception as e:
            raise CheckpointError(f"{where} could not be read as DCP metadata ("
                                  f"{type(e).__name__}: {e}); it is damaged or not DCP's, and no "
                                  f"code from it ran") from None  # fmt: skip
        files = ([getattr(i, "relative_path", None) for i in md.storage_data.values()]
                 if isinstance(md, Metadata) and isinstance(md.storage_data, dict) else [None])
        if any(not isinstance(f, str) or Path(f).name != f or f in ("", ".", "..") for f in files):
            raise CheckpointError(f"{where} is not DCP metadata of files in its own directory")
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class _Planner(DefaultLoadPlanner):
    def load_bytes(self, read_item, value) -> None:
        raise CheckpointError(f"the shards hold a non-tensor entry "
                              f"{read_item.dest_index.fqn!r}; DCP would unpickle it with "
                              f"weights_only=False: refused")  # fmt: skip


def _flat(tree: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    """DCP's keys of a nested state: the dict path joined by dots."""
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _dcp_load(state: dict, shards: Path, path: Path, alone: bool) -> None:
    """Fill `state` in place from the shards directory. `alone`: this process reads without
    its peers (no process group, or one rank exporting); else every rank calls it together."""
    import torch.distributed.checkpoint as dcp

    saved = _Reader(shards).read_metadata().state_dict_metadata
    want = _flat(state)
    missing, unexpected = sorted(want.keys() - saved.keys()), sorted(saved.keys() - want.keys())
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path} does not match this model and optimizer: missing "
            f"{missing[:8]}, unexpected {unexpected[:8]} (another model, or another --set opt)"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns when it loads without a process group
            dcp.load(state, storage_reader=_Reader(shards), planner=_Planner(), no_dist=alone)
    except CheckpointException as e:  # DCP wraps each rank's failure: ours, or a damaged file
        ours = [f[0] if isinstance(f, tuple) else f for f in getattr(e, "failures", {}).values()]
        ours = [f for f in ours if isinstance(f, CheckpointError)]
        raise (ours[0] if ours else CheckpointError(
            f"could not read the shards of {path} in {shards} ({e}); the directory is damaged: "
            f"resume from another checkpoint, or train a new run")) from None


def _full_state(ck: dict, path: Path) -> tuple[dict, dict]:
    """(model state, optimizer state) of a sharded checkpoint, whole, in this process alone:
    tensors of the saved global shapes, filled by DCP from every rank's shards."""
    shards = ck["shards_dir"]
    md = _Reader(shards).read_metadata()
    flat = {}
    for key, m in md.state_dict_metadata.items():
        if not isinstance(m, TensorStorageMetadata):
            raise CheckpointError(f"{shards}: {key!r} is no tensor; a sharded checkpoint holds "
                                  f"tensors only")  # fmt: skip
        flat[key] = torch.empty(m.size, dtype=m.properties.dtype)
    _dcp_load(flat, shards, path, alone=True)
    tree: dict = {"model": {}, "optimizer": {}}
    for key, t in flat.items():
        where = (md.planner_data or {}).get(key)  # the nested path DCP flattened into `key`
        if not (isinstance(where, tuple) and len(where) > 1 and where[0] in tree):
            raise CheckpointError(f"{shards}: no model or optimizer path for {key!r}")
        *parents, leaf = where
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = t
    return tree["model"], {"state": tree["optimizer"], "param_groups": ck["param_groups"]}


def export_checkpoint(src: str | Path, dest: str | Path) -> Path:
    """One file (format 2, whole) from a checkpoint of either format or a run folder (its
    checkpoint): what `eval` and `sample` load anywhere, and one process can resume."""
    src, dest = Path(src), Path(dest)
    if src.is_dir():
        src = src / f"{_ckpt_name(src)}.pt"
    if dest.is_dir():
        raise CheckpointError(f"--to {dest} is a folder; name the file to write, e.g. "
                              f"{dest / 'model.pt'}")  # fmt: skip
    above = next((p for p in dest.parents if p.exists()), None)
    if above is not None and not above.is_dir():  # else save's refusal names the run's --out
        raise CheckpointError(f"--to {dest}: {above} is a file, not a folder; name a file in a "
                              f"folder, e.g. {above.parent / 'model.pt'}")  # fmt: skip
    ck = read_checkpoint(src)
    model, optim = (ck["model"], ck["optimizer"]) if "model" in ck else _full_state(ck, src)
    return save_checkpoint(dest, run=ck["run"], model_state=model, optimizer_state=optim,
                           step=ck["step"], data_state=ck.get("data"),
                           data_fingerprint=ck.get("data_fingerprint"), rng=rank_rng(ck, 0),
                           extra=ck.get("extra"))  # fmt: skip


def _ckpt_name(run_dir: Path) -> str:
    """A run folder's checkpoint name: its config.json's ckpt_name (default ckpt)."""
    try:
        return RunConfig.from_json((run_dir / "config.json").read_text()).train.ckpt_name
    except (OSError, ValueError, ConfigError):
        return "ckpt"


def _load_failure(e: Exception) -> str:
    """torch.load's failure in one line. A weights-only refusal is said as such, with torch's
    reason (e.g. "Unsupported operand 103", "unsupported GLOBAL posix.system") and without its
    advice to load with weights_only=False, which would run the file's code."""
    text = str(e)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if text.startswith("Weights only load failed"):
        noise = ("Weights only load failed", "Please file an issue", "Check the documentation")
        why = [ln for ln in lines if not ln.startswith(noise)]
        detail = why[0].removeprefix("WeightsUnpickler error:").strip().rstrip(".") if why else ""
        return ("a weights-only load refuses it" + (f": {detail[:160]}" if detail else "")
                + "; dormouse never runs code from a checkpoint")  # fmt: skip
    return f"{type(e).__name__}: {lines[0][:200]}" if lines else type(e).__name__


def read_checkpoint(path: str | Path, mmap: bool = False) -> dict[str, Any]:
    """Load a checkpoint file with weights_only=True (no code runs from the file). A sharded
    checkpoint's file is its manifest: ck["shards_dir"] is its directory, checked present; its
    tensors are read where they are loaded (load_model, load_train_state).

    `mmap=True` maps the tensors instead of reading them: cheap when only the step and the
    config are wanted (the run-folder checks)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}; train first or pass the right path")
    if path.is_dir():
        raise CheckpointError(f"{path} is a directory, not a checkpoint file")
    try:
        ck = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:
        raise CheckpointError(
            f"{path} could not be read as a dormouse checkpoint ({_load_failure(e)}); it may "
            f"be truncated or not a checkpoint at all"
        ) from None
    sharded_ = isinstance(ck, dict) and ck.get("format") == SHARDED_FORMAT
    if not isinstance(ck, dict) or "config" not in ck or not (
            sharded_ or isinstance(ck.get("model"), dict)):  # fmt: skip
        raise CheckpointError(f"{path} is a torch file but not a dormouse checkpoint")
    step = ck.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(
            f"{path} has no valid step (found {step!r}); the file is damaged or was not "
            f"written by dormouse: train a new run (--overwrite, or another --out)"
        )
    if sharded_:
        name = ck.get("shards")
        if not isinstance(name, str) or not _SHARDS.match(name) or Path(name).name != name:
            raise CheckpointError(f"{path} names no valid shards directory ({name!r}); the file "
                                  f"is damaged")  # fmt: skip
        ck["shards_dir"] = path.parent / name
        if not (ck["shards_dir"] / ".metadata").is_file():
            raise CheckpointError(
                f"{path} is a sharded checkpoint whose directory {name} is not beside it in "
                f"{path.parent} (a run folder copied without it?); copy the whole run folder, "
                f"or export the checkpoint where it was written (python -m dormouse export)"
            )
    try:
        ck["run"] = validate(RunConfig.from_json(ck["config"]))
    except ConfigError as e:
        raise CheckpointError(
            f"{path}: its embedded run config is unusable ({e}); the file is damaged or from "
            f"another version of dormouse: train a new run (--overwrite, or another --out)"
        ) from None
    return ck


def shape_mismatch(saved: ModelConfig, current: ModelConfig) -> list[str]:
    """Fields of the model config that change the set or shape of parameters."""
    irrelevant = {"kda_impl", "moe_impl", "engram_ram", "moe_offload", "act_ckpt",
                  "act_ckpt_quant", "bf16", "kda_chunk", "segment_len", "moe_capacity",
                  "moe_lb_coef", "init_std", "max_seq_len"}  # fmt: skip
    a, b = dataclasses.asdict(saved), dataclasses.asdict(current)
    return [f"{k}: checkpoint {a[k]!r} vs this run {b[k]!r}"
            for k in a if k not in irrelevant and a[k] != b[k]]  # fmt: skip


def _refuse_other_shape(ck: dict, cfg: ModelConfig, path) -> None:
    diff = shape_mismatch(ck["run"].model, cfg)
    if diff:
        raise CheckpointError(
            f"checkpoint {path} has another model shape: " + "; ".join(diff)
            + ". Train a new run (another --out) or use the checkpoint's own preset/--set."
        )


def load_model(net: torch.nn.Module, ck: dict[str, Any], path: str | Path = "",
               cfg: ModelConfig | None = None) -> None:  # fmt: skip
    """A read_checkpoint() dict's model into net, whole (eval, sample, export; a full state on
    every rank under a process group): refuses another model shape, naming the fields (cfg:
    this run's model config, net.cfg by default). A sharded checkpoint is read in this
    process alone."""
    _refuse_other_shape(ck, cfg or net.cfg, path)
    state = ck["model"] if "model" in ck else _full_state(ck, Path(path))[0]
    load_model_state(net, state, path)


def load_train_state(net: torch.nn.Module, opt, ck: dict[str, Any], path: str | Path,
                     cfg: ModelConfig) -> None:  # fmt: skip
    """A resume, on every rank: the model and the optimizer of either format. The single file:
    every rank loads the whole state (FSDP2 keeps its own shards of it). A sharded one: each
    rank reads the chunks its own shards overlap, at any world size (a collective under a
    process group)."""
    _refuse_other_shape(ck, cfg, path)
    if "model" in ck:
        load_model_state(net, ck["model"], path)
        load_optimizer_state(net, opt, ck["optimizer"], path)
        return
    model, optim = _sharded_targets(net, opt)
    state = {"model": model, "optimizer": optim["state"]}
    _dcp_load(state, ck["shards_dir"], Path(path), alone=not _dist())
    load_model_state(net, state["model"], path, _SHARDED)
    optim = {"state": state["optimizer"], "param_groups": ck["param_groups"]}
    load_optimizer_state(net, opt, optim, path, _SHARDED)


# ---- the run folder ---------------------------------------------------------------------

#: A checkpoint writer's temp file or shard directory: `.NAME.PID.RANDOM.tmp` (or
#: `.NAME.RANDOM.tmp`, older).
_TEMP = re.compile(r"\.(?P<name>.+\.pt)\.(?:(?P<pid>[0-9]+)\.)?[A-Za-z0-9_]+\.tmp\Z")


def check_out_dir(out: str | Path) -> None:
    """Refuse an --out that is a file, lies under a file, or cannot be created or written."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out} is a file, not a folder; give a folder path "
                              f"(it is created if missing)")  # fmt: skip
    anc = out
    while not anc.exists():
        if anc.parent == anc:
            break
        anc = anc.parent
    if anc != out and not anc.is_dir():
        raise CheckpointError(
            f"--out {out} lies under {anc}, which is a file, so the folder cannot be created; "
            f"give a path under a folder"
        )
    if not os.access(anc, os.W_OK | os.X_OK):
        what = "the run folder" if anc == out else f"its nearest existing parent {anc}"
        raise CheckpointError(
            f"--out {out}: {what} is not writable by this user, so no checkpoint could be "
            f"saved; pick a writable --out (or fix the folder's permissions)"
        )


def clean_stale_temps(out: str | Path) -> list[str]:
    """Remove what a checkpoint writer killed mid-save left: temp files and temp shard
    directories no live writer owns (one named with the pid of a live process is left alone),
    and shard directories no checkpoint names; returns their names."""
    out = Path(out)
    removed = []
    if not out.is_dir():
        return removed
    for p in sorted(out.iterdir()):
        m, s = _TEMP.match(p.name), _SHARDS.match(p.name)
        if m:
            pid = int(m["pid"]) if m["pid"] else None
            if pid is not None and pid != os.getpid() and pid_alive(pid):
                continue
        elif not (s and p.is_dir() and _orphan(out / f"{s['stem']}.pt", p.name)):
            continue
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed.append(p.name)
    return removed


def _orphan(manifest: Path, shards: str) -> bool:
    """True when `shards` is no directory the checkpoint `manifest` names (a save killed
    between renaming its directory and replacing the manifest); an unreadable manifest
    keeps it."""
    if not manifest.is_file():
        return True
    try:
        ck = torch.load(manifest, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return False
    return not (isinstance(ck, dict) and ck.get("shards") == shards)


def pid_alive(pid: int) -> bool:
    """False once the process has exited (a zombie its parent has not reaped yet included)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):  # no /proc (not Linux): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except (PermissionError, OverflowError):
            return True
        return True


def metrics_rows(path: str | Path) -> int:
    path = Path(path)
    if not path.is_file():
        return 0
    with path.open("rb") as f:
        return sum(1 for line in f if line.strip())


def trim_metrics(path: str | Path, step: int) -> int:
    """Drop metrics rows written after `step` (and a torn last line); returns how many.

    A run that crashed after its last checkpoint logged rows the resumed run logs again."""
    path = Path(path)
    if not path.is_file():
        return 0
    keep, dropped = [], 0
    for line in path.read_text(errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row_step = json.loads(line).get("step")
            ok = isinstance(row_step, (int, float)) and row_step <= step
        except (ValueError, AttributeError):
            ok = False
        if ok:
            keep.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(f".{path.name}.{os.getpid()}.trim.tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, path)
    return dropped


#: The optimizer group entries a resume takes from the checkpoint: its parameters and the lr
#: last set (the loop sets it again from base_lr before the next step). Every other entry
#: (base_lr, betas, eps, weight_decay, momentum, the polar's knobs, ...) is this run's, so a
#: hyperparameter given on resume is applied, not only logged as changed.
RESUME_FROM_CHECKPOINT = ("params", "lr")


def resume_changes(saved: RunConfig, now: RunConfig) -> list[str]:
    """`field old -> new` for each training field that differs between a checkpoint and this
    run (the model's shape, the data and the optimizer's routing are checked where loaded)."""
    a, b = dataclasses.asdict(saved.train), dataclasses.asdict(now.train)
    return [f"{k} {a[k]!r} -> {b[k]!r}" for k in a if a[k] != b[k]]


def plan_run_folder(run: RunConfig, mode: str, overwrite: bool, elastic_restart: int = 0) -> str:
    """Decide what training into `run`'s folder means: "fresh", "resume" or "complete".

    mode: never (refuse a folder holding a run), auto (resume when a checkpoint exists),
    must (refuse when none does). --overwrite starts afresh on purpose. An elastic restart
    (torchrun's TORCHELASTIC_RESTART_COUNT > 0) resumes by itself: `overwrite` then applies
    to the first attempt only. Nothing is written here.
    """
    t = run.train
    out = Path(t.out_dir)
    path = out / f"{t.ckpt_name}.pt"
    check_out_dir(out)
    if overwrite and mode == "must":
        raise CheckpointError("--overwrite starts afresh and --resume must continues: pick one")
    if elastic_restart > 0:
        if overwrite or mode == "never":
            log.info(f"elastic restart {elastic_restart}: resuming the run in {out} "
                     f"(--resume auto), not {'overwriting it' if overwrite else 'refusing it'}")
        overwrite, mode = False, ("auto" if mode != "must" else "must")
    has_ckpt = path.is_file()
    rows = metrics_rows(out / "metrics.jsonl")
    if overwrite:
        if has_ckpt or rows:
            log.info(f"--overwrite: starting afresh in {out} (replacing "
                     + ", ".join(x for x in (f"{path.name}" if has_ckpt else "",
                                             f"{rows} metrics rows" if rows else "") if x)
                     + ")")  # fmt: skip
        return "fresh"
    if not has_ckpt:
        if mode == "must":
            raise CheckpointError(
                f"--resume: no checkpoint at {path}; start without --resume (or --resume auto, "
                f"which starts fresh when there is none)"
            )
        if rows and mode == "never":
            raise CheckpointError(
                f"{out} already holds metrics.jsonl ({rows} rows) from an earlier run that wrote "
                f"no checkpoint; training here would erase them. Use --overwrite to start "
                f"afresh, --resume auto, or another --out"
            )
        return "fresh"
    ck = read_checkpoint(path, mmap=True)
    step = int(ck["step"])
    same = ck["run"] == run
    if mode == "never" and not (same and step == t.steps):
        why = ("this run's config" if same else "a different config ("
               + "; ".join(resume_changes(ck["run"], run) or ["the model differs"]) + ")")
        raise CheckpointError(
            f"{out} already holds a run: {path.name} at step {step} of {ck['run'].train.steps}, "
            f"{rows} metrics rows, {why}; training here would replace it. Use --resume auto to "
            f"continue it, --overwrite to start afresh, or another --out"
        )
    if step > t.steps:
        raise CheckpointError(
            f"{path} is at step {step}, beyond this run's steps={t.steps}; raise --steps to "
            f"continue it, or --overwrite to start afresh"
        )
    if step == t.steps:
        log.info(f"{out}: the run is already complete at step {step} ({path}); nothing to "
                 f"train. Raise --steps with --resume auto to continue it, or --overwrite to "
                 f"start afresh")
        return "complete"
    return "resume"
