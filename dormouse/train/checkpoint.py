"""Single-file checkpoints: gather the state, write atomically, load safely, refuse a
mismatched shape; and the run folder (fresh, resume or complete).

One checkpoint = one file holding the run config, the model (fp32 masters, the LFB buffers
and the host-RAM Engram tables, which live in its state dict), the optimizer, the data
position and the data's fingerprint, the RNG states and the step. It is written to a
temporary file, fsynced and renamed, so a crash mid-write never leaves a torn checkpoint
behind, and loaded with `weights_only=True`, so nothing in a checkpoint file can execute code.

The model and optimizer states are full and keyed by canonical names, whatever wraps the
model: `model_state` / `optimizer_state` gather them and `load_model_state` /
`load_optimizer_state` put them back through torch.distributed.checkpoint.state_dict, the same
calls for a plain module, a DDP-wrapped one and an FSDP2 (`fully_shard`) one. Under a process
group they are collectives: call them on every rank (the full state comes back on rank 0 only,
which writes the file; every rank loads the whole file). One process needs no process group.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
    set_optimizer_state_dict,
)  # fmt: skip

from ..config import ConfigError, ModelConfig, RunConfig, validate
from ..errors import UserError
from ..model.engram import HostTables
from .routing import strip_name

log = logging.getLogger(__name__)

#: 2: the optimizer state is torch's (torch.distributed.checkpoint's full state, keyed by
#: parameter name); 1 held MixOptimizer's own format. The model state is the same in both.
FORMAT = 2


class CheckpointError(UserError, RuntimeError):
    """A checkpoint or run folder the run cannot use or write; names cause and escape."""


#: One process needs no process group for these; under one, the full state is rank 0's.
_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


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
    state = get_optimizer_state_dict(net, opt, options=_FULL)
    host = getattr(opt, "host_state", {})
    if state and host:
        state["state"].update(host)
        for g in state["param_groups"]:
            g["params"] = g["params"] + [n for n in g["names"] if n in host]
    return state


def load_model_state(net: torch.nn.Module, state: dict, path: str | Path = "") -> None:
    """Load a full model state (model_state's) into net: every rank, each with the whole state.

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
    set_model_state_dict(net, state, options=_FULL)


def load_optimizer_state(net: torch.nn.Module, opt, state: dict, path: str | Path = "") -> None:
    """Load a full optimizer state (optimizer_state's) into opt: every rank, each with the whole
    state. A state from checkpoint format 1 is refused."""
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
        set_optimizer_state_dict(net, opt, state, options=_FULL)
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
    extra: dict | None = None,
) -> Path:
    """Write one checkpoint file atomically. Pass the gathered states (model_state(net) and
    optimizer_state(net, opt), called on every rank; rank 0 writes) or, in one process, the
    model and its optimizer."""
    path = Path(path)
    if model is not None:
        model_state, optimizer_state = _gather(model, optimizer)
    bad = nonfinite_entries(model_state)
    if bad:
        # a NaN checkpoint would be resumed, evaluated and sampled as if it were a model
        raise CheckpointError(
            f"refusing to write {path} at step {step}: {len(bad)} tensor(s) of the model hold "
            f"NaN/inf (first: {bad[0]}), so the run diverged; "
            + ("the previous checkpoint there is untouched. " if path.exists() else "")
            + "Lower --set lr, or keep --set grad_clip > 0"
        )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create the run folder {path.parent} ({e.strerror or e}); "
                              f"pick a writable --out") from None  # fmt: skip
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
        "rng": rng_state(),
        "extra": extra or {},
    }
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
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError):
            full = " (the disk is full)" if e.errno in (errno.ENOSPC, errno.EDQUOT) else ""
            kept = ("the previous checkpoint there is untouched" if path.exists()
                    else "no earlier checkpoint exists")  # fmt: skip
            raise CheckpointError(
                f"could not write {path} at step {step}: {e.strerror or e}{full}; the partial "
                f"file was removed and {kept}. Free space (or pick another --out), then "
                f"--resume auto"
            ) from None
        raise
    return path


def _gather(net: torch.nn.Module, opt) -> tuple[dict, dict | None]:
    return model_state(net), (optimizer_state(net, opt) if opt is not None else None)


def _umask() -> int:
    # os.umask can only be read by setting it; the window is two system calls long
    old = os.umask(0o022)
    os.umask(old)
    return old


def nonfinite_entries(state: dict) -> list[str]:
    """Names of the floating tensors in a state dict that hold NaN or inf."""
    return [k for k, v in state.items()
            if torch.is_tensor(v) and v.is_floating_point() and not bool(torch.isfinite(v).all())]


def read_checkpoint(path: str | Path, mmap: bool = False) -> dict[str, Any]:
    """Load a checkpoint file with weights_only=True (no code runs from the file).

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
            f"{path} could not be read as a dormouse checkpoint ({type(e).__name__}: {e}); "
            f"it may be truncated or not a checkpoint at all"
        ) from None
    if not isinstance(ck, dict) or "config" not in ck or not isinstance(ck.get("model"), dict):
        raise CheckpointError(f"{path} is a torch file but not a dormouse checkpoint")
    step = ck.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(
            f"{path} has no valid step (found {step!r}); the file is damaged or was not "
            f"written by dormouse: train a new run (--overwrite, or another --out)"
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


def load_model(net: torch.nn.Module, ck: dict[str, Any], path: str | Path = "",
               cfg: ModelConfig | None = None) -> None:  # fmt: skip
    """A read_checkpoint() dict's model into net (eval, sample, resume): refuses another model
    shape, naming the fields (cfg: this run's model config, net.cfg by default), then
    load_model_state (every rank, under a process group)."""
    diff = shape_mismatch(ck["run"].model, cfg or net.cfg)
    if diff:
        raise CheckpointError(
            f"checkpoint {path} has another model shape: " + "; ".join(diff)
            + ". Train a new run (another --out) or use the checkpoint's own preset/--set."
        )
    load_model_state(net, ck["model"], path)


# ---- the run folder ---------------------------------------------------------------------

#: A checkpoint writer's temp file: `.NAME.PID.RANDOM.tmp` (or `.NAME.RANDOM.tmp`, older).
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
    """Remove checkpoint temp files that no live writer owns (a writer killed mid-save);
    returns their names. A file named with the pid of a live process is left alone."""
    out = Path(out)
    removed = []
    if not out.is_dir():
        return removed
    for p in sorted(out.iterdir()):
        m = _TEMP.match(p.name)
        if not m or not p.is_file():
            continue
        pid = int(m["pid"]) if m["pid"] else None
        if pid is not None and pid != os.getpid() and pid_alive(pid):
            continue
        p.unlink(missing_ok=True)
        removed.append(p.name)
    return removed


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


#: Training fields a resume may change; those the optimizer's state carries are re-applied.
RESUME_HYPER = ("base_lr", "weight_decay", "momentum", "nesterov", "ns_steps", "ns_kind",
                "ns_dtype", "muon_sf", "betas")  # fmt: skip


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
