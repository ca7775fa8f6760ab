"""Checkpoints in two formats, written atomically and loaded safely, refusing a mismatched
shape or a damaged entry. Which files a run folder holds, and who may write them, is
folder.py's; `write_atomic` here is how every file of a run is replaced.

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

import contextlib
import dataclasses
import enum
import errno
import importlib
import logging
import os
import pickle
import re
import resource
import shutil
import stat
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)  # fmt: skip

from ...config import ConfigError, ModelConfig, RunConfig, validate
from ...errors import UserError
from ...model.engram import HostTables
from ..context import local_shard
from ..optim.routing import strip_name
from . import tensorfile
from .errors import CheckpointError
from .tensors import tensor_problems

log = logging.getLogger(__name__)

#: 2: the single file; the optimizer state is torch's (torch.distributed.checkpoint's full
#: state, keyed by parameter name); 1 held MixOptimizer's own format. 3: sharded (a manifest
#: file naming a directory of DCP shards). The model state is the same in all.
FORMAT = 2
SHARDED_FORMAT = 3


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
    mine = get_model_state_dict(net, options=StateDictOptions())  # no gather: shapes are global
    missing, unexpected = sorted(mine.keys() - state.keys()), sorted(state.keys() - mine.keys())
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path} does not match this model: missing {missing[:8]}, "
            f"unexpected {unexpected[:8]}"
        )
    # a tensor of another shape under a right name (a damaged or altered file) was torch's
    # load_state_dict traceback
    other = [f"{k} {tuple(state[k].shape)} (the model's {tuple(v.shape)})"
             for k, v in mine.items() if tuple(state[k].shape) != tuple(v.shape)]  # fmt: skip
    if other:
        raise CheckpointError(
            f"checkpoint {path} does not match this model: {len(other)} tensor(s) of another "
            f"shape, {'; '.join(other[:4])}; the file was altered or was not written for this "
            f"model's config"
        )
    bad = tensor_problems(state, mine)
    if bad:
        raise CheckpointError(
            f"checkpoint {path} holds {len(bad)} model tensor(s) no model can use: "
            f"{'; '.join(bad[:3])}; the file was altered or its run diverged: use another "
            f"checkpoint (best.pt, an earlier export), or train a new run"
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
    prune: bool = True,
) -> Path:
    """Write one checkpoint file atomically. Pass the gathered states (model_state(net) and
    optimizer_state(net, opt), called on every rank; rank 0 writes) or, in one process, the
    model and its optimizer. `rng`: this process's RNG state unless given (an export).
    `prune`: remove the shard directories of a sharded checkpoint this file replaced (a run's
    own save); an export writes beside files it does not own and prunes nothing."""
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
    if prune:
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


def write_error(e: OSError) -> str:
    """An OSError of a write as the one line's cause: the system's words, and what they mean
    where the fix is not obvious (a full disk, a quota, this process's file size limit)."""
    what = e.strerror or str(e)
    if e.errno == errno.ENOSPC:
        return f"{what} (the disk is full)"
    if e.errno == errno.EDQUOT:
        return f"{what} (over the disk quota)"
    if e.errno == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        said = "" if limit == resource.RLIM_INFINITY else f": {limit} bytes"
        return f"{what} (past this process's file size limit, ulimit -f{said})"
    return what


def write_escape(e: OSError, elsewhere: str = "pick another --out") -> str:
    """What frees a write that failed with `e`; `elsewhere`: where else it may write."""
    if e.errno == errno.EFBIG:
        return "raise the file size limit (ulimit -f unlimited)"
    return f"free space (or {elsewhere})"


def _write_failed(path: Path, step: int, e: OSError) -> CheckpointError:
    kept = ("the previous checkpoint there is untouched" if path.exists()
            else "no earlier checkpoint exists")  # fmt: skip
    err = CheckpointError(
        f"could not write {path} at step {step}: {write_error(e)}; the partial write was "
        f"removed and {kept}. {write_escape(e).capitalize()}, then --resume auto"
    )
    err.os_error = e  # export words its own line from it
    return err


class _Recording:
    """A file whose write() remembers the OSError it raised: torch's zip writer reports a
    failed write as RuntimeError('[enforce fail at inline_container.cc] ... unexpected pos'),
    which drops the errno (a full disk, a file size limit)."""

    def __init__(self, f: IO[bytes]):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except (OSError, KeyboardInterrupt) as e:  # a second Ctrl-C lands here as well
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.f.flush()


def write_atomic(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Replace `path` with what `write(f)` writes: a temp file beside it (created with
    O_EXCL, so never through a link; named with this pid, so a later start can tell a dead
    writer's leftover), fsync, rename over `path` (the commit point: a link at `path` is
    replaced, never followed), fsync the folder. On any failure the temp file is removed and
    `path` is as it was; a failed write raises its OSError, also where torch's zip writer
    turned it into a RuntimeError."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}.",
                               suffix=".tmp")  # fmt: skip
    try:
        # mkstemp creates 0600; our files are ordinary output files, so honour the umask
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            rec = _Recording(f)
            try:
                write(rec)
            except RuntimeError as e:
                # a Ctrl-C anywhere inside torch.save (its pickler, our write) ends in the zip
                # writer's 'unexpected pos' as it closes the archive: the interrupt is the cause
                rec.error = rec.error or _interrupt(e)
                if rec.error is None:
                    raise
            if rec.error is not None:
                raise rec.error
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _interrupt(e: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt among the exceptions `e` was raised while handling, if any."""
    seen = e.__context__
    while seen is not None and not isinstance(seen, KeyboardInterrupt):
        seen = seen.__context__
    return seen


def _write_file(path: Path, payload: dict, step: int) -> None:
    """torch.save `payload` to `path` atomically (write_atomic); a failure is one line."""
    _mkdir(path.parent)
    try:
        write_atomic(path, lambda f: torch.save(payload, f))
    except OSError as e:
        raise _write_failed(path, step, e) from None
    except KeyboardInterrupt:  # the second Ctrl-C, during the save the first one asked for
        kept = (
            "the previous checkpoint there is untouched: --resume auto continues from it"
            if path.exists()
            else "no earlier checkpoint exists"
        )
        raise CheckpointError(
            f"interrupted (a second Ctrl-C) while writing {path} at step {step}: the partial "
            f"write was removed and {kept}; one Ctrl-C lets the checkpoint finish"
        ) from None


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

#: A sharded checkpoint's directory: `<stem>.<step>.<token>.shards` beside `<stem>.pt` (the
#: step written with at least 6 digits, the token mkdtemp's).
SHARDS_NAME = re.compile(r"(?P<stem>.+)\.[0-9]{6,}\.(?P<token>[A-Za-z0-9_]+)\.shards\Z")
#: What DCP writes in a shards directory: its metadata and each rank's tensor files.
_DCP_FILE = re.compile(r"\.metadata|__[0-9]+_[0-9]+\.distcp\Z")


def dcp_dir(p: Path) -> bool:
    """Whether `p` is a directory holding DCP's files only (.metadata among them): what makes
    a `*.shards` directory dormouse's own, beside its name."""
    try:
        names = [q.name for q in p.iterdir()] if p.is_dir() and not p.is_symlink() else []
    except OSError:
        return False
    return ".metadata" in names and all(_DCP_FILE.match(n) for n in names)


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
            made = (
                f"!cannot create a directory in {path.parent} ({e.strerror or e}); pick a "
                f"writable --out"
            )
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
            inner = _failures(e)
            disk = next((f for f in inner if isinstance(f, OSError)), None)
            if disk is not None:
                raise _write_failed(path, step, disk) from None
            kept = ("the previous checkpoint there is untouched" if path.exists()
                    else "no earlier checkpoint exists")  # fmt: skip
            raise CheckpointError(
                f"could not write the shards of {path} at step {step} "
                f"({_one_line(inner[0] if inner else e)}); {kept}. Free "
                f"space (or pick another --out), then --resume auto"
            ) from None
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
        m = SHARDS_NAME.match(p.name)
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
            ok = isinstance(obj, type) and (
                dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)
            )
        elif module == "torch":
            obj = getattr(torch, name, None)
            ok = obj is torch.Size or isinstance(
                obj, (torch.dtype, torch.layout, torch.memory_format)
            )
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
        if where.is_symlink():
            raise CheckpointError(
                f"{where} is a symbolic link: a checkpoint's metadata is a file "
                f"in its own directory; the checkpoint is damaged"
            )
        try:
            with open(where, "rb") as f:
                md = _MetadataUnpickler(f).load()
        except Exception as e:
            raise CheckpointError(f"{where} could not be read as DCP metadata ("
                                  f"{type(e).__name__}: {e}); it is damaged or not DCP's, and no "
                                  f"code from it ran") from None  # fmt: skip
        files = (
            [getattr(i, "relative_path", None) for i in md.storage_data.values()]
            if isinstance(md, Metadata) and isinstance(md.storage_data, dict)
            else [None]
        )
        if any(not isinstance(f, str) or Path(f).name != f or f in ("", ".", "..") for f in files):
            raise CheckpointError(f"{where} is not DCP metadata of files in its own directory")
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def read_data(self, plan, planner):
        """torch's read, one shard file at a time, so that a failure names its file; a file
        that is a link, not a regular file, or shorter than its chunks is refused before
        torch opens it (a path read from a checkpoint stays inside its directory)."""
        from torch.futures import Future

        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path,
                                []).append(item)  # fmt: skip
        for name, items in per_file.items():
            where = Path(self.path) / name
            self._check_shard(where, items)
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except UserError:
                raise
            except Exception as e:
                raise CheckpointError(
                    f"the shard {where} could not be read ({_one_line(e)}): the checkpoint is "
                    f"damaged, and no code from it ran; resume from another checkpoint, or "
                    f"train a new run"
                ) from None
        done: Future = Future()
        done.set_result(None)
        return done

    def _check_shard(self, where: Path, items: list) -> None:
        need = max(self.storage_data[i.storage_index].offset
                   + self.storage_data[i.storage_index].length for i in items)  # fmt: skip
        try:
            st = os.lstat(where)
        except OSError as e:
            why = f"cannot be read ({e.strerror or e})"
        else:
            why = ("is a symbolic link (a shard is a file in its checkpoint's own directory)"
                   if stat.S_ISLNK(st.st_mode) else
                   "is not a regular file" if not stat.S_ISREG(st.st_mode) else
                   f"is truncated ({st.st_size} bytes; its chunks end at byte {need})"
                   if st.st_size < need else "")  # fmt: skip
        if why:
            raise CheckpointError(f"the shard {where} {why}: the checkpoint is damaged; resume "
                                  f"from another checkpoint, or train a new run")  # fmt: skip


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


def _failures(e: CheckpointException) -> list[BaseException]:
    """The exceptions DCP wrapped, one a rank that failed (DCP keeps each with its traceback)."""
    out = []
    for f in getattr(e, "failures", {}).values():
        f = f[0] if isinstance(f, tuple) else f
        if isinstance(f, BaseException):
            out.append(f)
    return out


def _one_line(e: BaseException) -> str:
    """An exception as part of one line: a UserError's message, else its type and first line
    (torch's load advice, e.g. to retry with weights_only=False, is dropped)."""
    if isinstance(e, UserError):
        return str(e)
    return _load_failure(e)


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
        inner = _failures(e)
        ours = [f for f in inner if isinstance(f, CheckpointError)]
        raise (
            ours[0]
            if ours
            else CheckpointError(
                f"could not read the shards of {path} in {shards} ("
                f"{_one_line(inner[0]) if inner else type(e).__name__}); the checkpoint is damaged: "
                f"resume from another checkpoint, or train a new run"
            )
        ) from None


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
    """One file (format 2, whole) from a checkpoint file of either format: what `eval` and
    `sample` load anywhere, and one process can resume. The run folder's rules (which file a
    folder's checkpoint is, what --to may replace) are run_dir.export's; this writes `dest`
    and nothing beside it."""
    src, dest = Path(src), Path(dest)
    if dest.is_dir():
        raise CheckpointError(f"--to {dest} is a folder; name the file to write, e.g. "
                              f"{dest / 'model.pt'}")  # fmt: skip
    above = next((p for p in dest.parents if p.exists()), None)
    if above is not None and not above.is_dir():  # else save's refusal names the run's --out
        raise CheckpointError(f"--to {dest}: {above} is a file, not a folder; name a file in a "
                              f"folder, e.g. {above.parent / 'model.pt'}")  # fmt: skip
    ck = read_checkpoint(src)
    model, optim = (ck["model"], ck.get("optimizer")) if "model" in ck else _full_state(ck, src)
    try:
        if dest.suffix == tensorfile.SUFFIX:
            return _export_model_file(dest, ck, model)
        if ck["format"] == tensorfile.FORMAT:
            raise CheckpointError(
                f"{src} is a safetensors model (weights only): it exports "
                f"to another .safetensors file, not to {dest.name}"
            )
        return save_checkpoint(dest, run=ck["run"], model_state=model, optimizer_state=optim,
                               step=ck["step"], data_state=ck.get("data"),
                               data_fingerprint=ck.get("data_fingerprint"),
                               rng=rank_rng(ck, 0), extra=ck.get("extra"),
                               prune=False)  # fmt: skip
    except CheckpointError as e:
        cause = getattr(e, "os_error", None)
        if cause is None:
            raise
        # the writer's line speaks of a run (--out, --resume auto); an export has neither
        escape = write_escape(cause, "name a file in a folder this user can write")
        raise CheckpointError(
            f"export could not write --to {dest}: {write_error(cause)}; nothing is left there "
            f"and {src} is untouched: {escape}"
        ) from None


def _export_model_file(dest: Path, ck: dict, model: dict) -> Path:
    """The weights and the run config as a safetensors file (tensorfile.py), atomically."""
    bad = nonfinite_entries(model)
    if bad:
        raise _diverged(
            dest, ck["step"], f"{len(bad)} tensor(s) of the model hold NaN/inf (first: {bad[0]})"
        )
    try:
        write_atomic(dest, lambda f: tensorfile.write(f, ck["run"].to_json(), ck["step"], model))
    except OSError as e:
        raise _write_failed(dest, ck["step"], e) from None
    return dest


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
    if not path.is_dir() and not path.is_file():  # a FIFO would block torch.load for ever
        raise CheckpointError(
            f"{path} is not a regular file (a FIFO, a device or a socket); pass a checkpoint file"
        )
    if path.is_dir():
        held = sorted(p.name for p in path.glob("*.pt"))[:4]
        raise CheckpointError(
            f"{path} is a directory, not a checkpoint file"
            + (f"; pass one of its checkpoints: {', '.join(str(path / n) for n in held)}"
               if held else "")
        )  # fmt: skip
    if tensorfile.looks_like(path):
        return tensorfile.read_model(path)
    try:
        if _utf8(path):
            ck = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        else:
            # torch hands a str path to C++ as UTF-8, and a name of other bytes (which Python
            # carries as surrogate escapes) failed there; an open file is read by its bytes
            with open(path, "rb") as f:
                ck = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"{path} could not be read as a dormouse checkpoint ({_load_failure(e)}); it may "
            f"be truncated or not a checkpoint at all"
        ) from None
    sharded_ = isinstance(ck, dict) and ck.get("format") == SHARDED_FORMAT
    if (
        isinstance(ck, dict)
        and "config" in ck
        and _int(ck.get("format"), 1)
        and ck["format"] not in (1, FORMAT, SHARDED_FORMAT)
    ):
        raise CheckpointError(
            f"{path}: checkpoint format {ck['format']}, which this dormouse does not know (it "
            f"reads 1 and {FORMAT}, and {SHARDED_FORMAT} for a sharded manifest); a newer "
            f"dormouse wrote it? Read it with that version, resume from another checkpoint, "
            f"or train a new run (--overwrite, or another --out)"
        )
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
        if not isinstance(name, str) or not SHARDS_NAME.match(name) or Path(name).name != name:
            raise CheckpointError(f"{path} names no valid shards directory ({name!r}); the file "
                                  f"is damaged")  # fmt: skip
        ck["shards_dir"] = path.parent / name
        if ck["shards_dir"].is_symlink():
            raise CheckpointError(f"{path} names the shards directory {name}, which is a symbolic "
                                  f"link: the shards must be in the run folder itself; the "
                                  f"checkpoint is damaged")  # fmt: skip
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
    _check_fields(ck, path, sharded_)
    return ck


def _utf8(path: Path) -> bool:
    """Whether the path's name is UTF-8 (not surrogate-escaped bytes of another encoding)."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _int(x, lo: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= lo


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


_RNG_BYTES = torch.get_rng_state().numel()


def _rng_ok(r) -> bool:
    t = r.get("torch") if isinstance(r, dict) else None
    cuda = r.get("cuda", []) if isinstance(r, dict) else None
    # the CPU generator's state is a fixed size (5056 bytes): 3 bytes failed in set_rng_state
    return (torch.is_tensor(t) and t.dtype == torch.uint8 and t.dim() == 1
            and t.layout == torch.strided and t.numel() == _RNG_BYTES
            and isinstance(cuda, (list, tuple))
            and all(torch.is_tensor(c) and c.dtype == torch.uint8 for c in cuda))  # fmt: skip


def _stream_ok(d) -> bool:
    # the fields a stream reads back (data.ByteStream.load_state_dict), where present
    return (isinstance(d, dict) and d.get("kind") == "stream" and _int(d.get("step"))
            and all(_int(d[k]) for k in ("n_bytes", "stride") if k in d)
            and (d.get("shuffle_seed") is None or _int(d["shuffle_seed"]))
            and isinstance(d.get("phased", False), bool))  # fmt: skip


def _data_ok(d) -> bool:
    if d is None:
        return True
    if not isinstance(d, dict) or not (d.get("split") is None or (
            isinstance(d["split"], list) and all(_int(b, 1) for b in d["split"]))):  # fmt: skip
        return False
    if d.get("world") is not None and not _int(d["world"], 1):
        return False
    if d.get("kind") == "mixture":
        return (
            _int(d.get("step"))
            and _int(d.get("seed"))
            and isinstance(d.get("weights"), list)
            and all(_num(w) for w in d["weights"])
            and isinstance(d.get("streams"), list)
            and all(map(_stream_ok, d["streams"]))
        )
    return _stream_ok(d)


def _extra_ok(e) -> bool:
    if not isinstance(e, dict):
        return False
    scale = e.get("loss_scale")
    return (
        (e.get("best_step") is None or _int(e["best_step"]))
        and (e.get("best_loss") is None or _num(e["best_loss"]))
        and _int(e.get("since_best", 0))
        and _num(e.get("train_s", 0.0))
        and e.get("train_s", 0.0) >= 0
        and isinstance(e.get("history", []), list)
        and all(
            isinstance(h, (list, tuple))
            and len(h) == 3
            and _int(h[0])
            and _num(h[1])
            and _num(h[2])
            for h in e.get("history", [])
        )
        and (
            scale is None
            or (
                isinstance(scale, dict)
                and _num(scale.get("scale"))
                and scale["scale"] > 0
                and _int(scale.get("clean"))
            )
        )
    )


def _groups_ok(g) -> bool:
    return isinstance(g, list) and all(
        isinstance(x, dict) and isinstance(x.get("params"), list) for x in g
    )


#: What each entry a checkpoint file holds besides the model must be: read_checkpoint refuses
#: a file where one is not, naming it, before any of it is used (a tampered `rng` or
#: `extra.best_loss` was a traceback on resume).
_FIELDS = {
    "format": lambda v: _int(v, 1),
    "rng": _rng_ok,
    "data": _data_ok,
    "data_fingerprint": lambda v: (
        v is None
        or (
            isinstance(v, list)
            and all(
                isinstance(f, dict)
                and isinstance(f.get("path"), str)
                and _int(f.get("size"))
                and isinstance(f.get("digest"), str)
                for f in v
            )
        )
    ),
    "extra": lambda v: v is None or _extra_ok(v),
    "optimizer": lambda v: v is None or isinstance(v, dict),
}
_SHARDED_FIELDS = {
    "rng": lambda v: isinstance(v, list) and len(v) > 0 and all(map(_rng_ok, v)),
    "world": lambda v: _int(v, 1),
    "param_groups": _groups_ok,
}


def _check_fields(ck: dict, path: Path, sharded_: bool) -> None:
    rules = {**_FIELDS, **(_SHARDED_FIELDS if sharded_ else {})}
    for name, ok in rules.items():
        if name in ("data", "data_fingerprint", "extra", "optimizer") and name not in ck:
            continue  # optional: an export or an older writer may leave them out
        if name not in ck or not ok(ck[name]):
            found = repr(ck.get(name, "nothing"))
            raise CheckpointError(
                f"{path}: its '{name}' entry is damaged (found {found[:60]}); the file was "
                f"altered or was not written by dormouse, so none of it is used: resume from "
                f"another checkpoint, or train a new run (--overwrite, or another --out)"
            )
    if not sharded_ and not all(isinstance(k, str) and torch.is_tensor(v)
                                for k, v in ck["model"].items()):  # fmt: skip
        raise CheckpointError(
            f"{path}: its 'model' entry holds something other than named "
            f"tensors; the file was altered or was not written by dormouse"
        )


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
            f"checkpoint {path} has another model shape: "
            + "; ".join(diff)
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


#: A writer's temp file or shard staging directory (write_atomic, _staging_dir):
#: `.NAME.PID.RANDOM.tmp` of one of the names dormouse writes in a run folder. The pid is what
#: makes it dormouse's (a user's `.figure.png.v2.tmp` or `.notes.json.backup.tmp` is not); the
#: run folder's cleaner (folder.clean_stale_temps) removes a dead writer's.
TEMP_NAME = re.compile(
    r"\.(?P<name>config\.json|metrics\.jsonl|loss\.png|compare\.png|[^/]+\.pt)"
    r"\.(?P<pid>[0-9]+)\.[A-Za-z0-9_]+\.tmp\Z"
)


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
