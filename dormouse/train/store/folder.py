"""The run folder (--out): one writer, nothing written outside it, nothing in it lost.

A run folder holds config.json, metrics.jsonl, loss.png, the checkpoint (`ckpt.pt` and
`best.pt`; a sharded checkpoint's `*.shards` directories beside them) and dormouse.lock.
Every rule about it lives here:

* where each file is (`ckpt_path`, `best_path`, `RunDir.checkpoint`, a folder's export);
* who writes it: `RunDir.hold` takes an exclusive flock on dormouse.lock before anything
  is read or written and keeps it for the run's life (the OS drops it when the process
  dies); a second writer is refused naming the holder's pid and host;
* what may be written: the folder is resolved once; a file is replaced by rename from a
  temp file made with O_EXCL (checkpoint.write_atomic) or appended with O_NOFOLLOW, so no
  write follows a link out of the folder; a link where one of our files belongs is refused;
  a non-empty folder that holds no dormouse run is refused unless --overwrite;
* what training there means (`RunDir.plan`: fresh, resume or complete); rows a checkpoint
  does not cover (trimmed on resume, moved aside on a fresh start); rows read back are
  checked (`read_rows`);
* what a killed writer left (`RunDir.clean_stale_temps`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shutil
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from ...config import (
    ConfigError,
    DeepJSON,
    RunConfig,
    asked_differences,
    check_file_name,
    loads,
)
from ...errors import UserError
from . import checkpoint as ckpt
from .metrics import TB_DIR

log = logging.getLogger(__name__)

LOCK = "dormouse.lock"
CONFIG = "config.json"
METRICS = "metrics.jsonl"
PLOT = "loss.png"
#: A config.json longer than this is no dormouse run config (ours are ~2 KB): not parsed.
_CONFIG_MAX = 1 << 20


class RunDirError(UserError, RuntimeError):
    """A run folder the run may not use or could not write; names cause and escape."""


def ckpt_path(run: RunConfig) -> Path:
    return Path(run.train.out_dir) / f"{run.train.ckpt_name}.pt"


def best_path(run: RunConfig) -> Path:
    """Where the checkpoint of the best validation loss so far is kept: best.pt beside
    ckpt.pt (NAME.best.pt beside NAME.pt for another ckpt_name)."""
    name = run.train.ckpt_name
    return Path(run.train.out_dir) / ("best.pt" if name == "ckpt" else f"{name}.best.pt")


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


def _leftover(p: Path) -> bool:
    """What only a dormouse writer makes: a temp file named with a writer's pid, or a shards
    directory of DCP's files (a user's `photos.2024.summer.shards` is neither)."""
    return bool(
        ckpt.TEMP_NAME.match(p.name) or (ckpt.SHARDS_NAME.match(p.name) and ckpt.dcp_dir(p))
    )


class NotOurs(OSError):
    """A file at one of our names that a write must not go through: not a regular file (a
    FIFO would block), or one with other hard links (its data is shared with a file
    elsewhere, which an append or a truncate would change)."""


def open_own(path: Path, flags: int, mode: int = 0o666, *, writing: bool = True) -> int:
    """A descriptor of one of the run's own files: never through a symbolic link (O_NOFOLLOW),
    never blocking (O_NONBLOCK: a FIFO opened for reading waits for a writer for ever), and
    checked after opening, so what is written is the file itself: a regular file, with no other
    hard link when `writing`. NotOurs otherwise."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    st = os.fstat(fd)
    why = ""
    if not stat.S_ISREG(st.st_mode):
        why = "is not a regular file (a FIFO, a device or a socket)"
    elif writing and st.st_nlink > 1:
        why = (
            f"has {st.st_nlink} hard links: its data is shared with a file elsewhere (a "
            f"`cp -al` copy?), which a write here would change"
        )
    if why:
        os.close(fd)
        raise NotOurs(errno.EPERM, f"{path} {why}")
    return fd


class RunDir:
    """One run folder, resolved once (a link swapped later redirects nothing); `typed` is the
    path as given, for messages."""

    def __init__(self, out: str | Path):
        self.typed = str(out)
        self.path = Path(os.path.realpath(out))
        self._fd: int | None = None
        #: the checkpoint `plan` chose to resume from when it is not ckpt.pt (best.pt)
        self.resume_from: Path | None = None

    def file(self, name: str) -> Path:
        return self.path / name

    def checkpoint(self, run: RunConfig) -> Path:
        return self.path / ckpt_path(run).name

    def best(self, run: RunConfig) -> Path:
        return self.path / best_path(run).name

    def resume_path(self, run: RunConfig) -> Path:
        """The checkpoint a resume reads: ckpt.pt, or best.pt where `plan` found it alone."""
        return self.resume_from or self.checkpoint(run)

    # -- is it ours? ------------------------------------------------------------------------

    def config(self) -> RunConfig | None:
        """The run config in config.json; None when there is none. RunDirError when there is
        one that is not a dormouse run config (a user's own, or a damaged one)."""
        f = self.file(CONFIG)
        if f.is_symlink():
            raise RunDirError(
                f"{f} is a symbolic link; a run's config.json is a file in its "
                f"folder: remove the link (or pass the checkpoint file itself)"
            )
        if not f.is_file():
            return None
        try:
            if f.stat().st_size > _CONFIG_MAX:
                raise ConfigError(f"{f.stat().st_size} bytes, far more than a run config")
            run = RunConfig.from_json(f.read_bytes().decode("utf-8"))
            check_file_name(run.train.ckpt_name)
        except (ConfigError, UnicodeDecodeError, OSError) as e:
            raise RunDirError(
                f"{f} is not a dormouse run config ({str(e)[:120]}); it is damaged or not "
                f"dormouse's: restore it, or pass the checkpoint file itself"
            ) from None
        return run

    def is_run(self) -> bool:
        """Whether the folder holds a dormouse run: its lock file, or a dormouse config.json."""
        if os.path.lexists(self.file(LOCK)):
            return True
        try:
            return self.config() is not None
        except RunDirError:
            return False

    def refuse_foreign(self, overwrite: bool) -> None:
        """A folder that is not empty and holds no dormouse run is the user's: refused."""
        if overwrite or not self.path.is_dir() or self.is_run():
            return
        entries = sorted(self.path.iterdir())
        names = [p.name for p in entries]
        if names and not all(map(_leftover, entries)):
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            raise RunDirError(
                f"--out {self.typed} holds {len(names)} entries ({shown}) and no dormouse run "
                f"(no {LOCK}, no dormouse {CONFIG}); training there could replace files "
                f"dormouse did not write. Pick a new or empty folder, or --overwrite to train "
                f"there anyway"
            )

    def refuse_links(self, run: RunConfig) -> None:
        """A symbolic link where one of our files belongs: a write through it would land
        outside the folder (or replace the user's link), so it is refused."""
        for name in (LOCK, CONFIG, METRICS, PLOT, TB_DIR, self.checkpoint(run).name,
                     self.best(run).name):  # fmt: skip
            p = self.file(name)
            if p.is_symlink():
                raise RunDirError(
                    f"{p} is a symbolic link (to {os.readlink(p)}); dormouse writes only its "
                    f"own files inside the run folder: remove the link, or pick another --out"
                )

    def check_writable(self) -> None:
        """Refuse an --out that is a file, lies under a file, or cannot be created or written."""
        out = Path(self.typed)
        if out.exists() and not out.is_dir():
            raise RunDirError(f"--out {out} is a file, not a folder; give a folder path (it is "
                              f"created if missing)")  # fmt: skip
        anc = out
        while not anc.exists():
            if anc.parent == anc:
                break
            anc = anc.parent
        if anc != out and not anc.is_dir():
            raise RunDirError(
                f"--out {out} lies under {anc}, which is a file, so the folder cannot be "
                f"created; give a path under a folder"
            )
        if not os.access(anc, os.W_OK | os.X_OK):
            what = "the run folder" if anc == out else f"its nearest existing parent {anc}"
            raise RunDirError(
                f"--out {out}: {what} is not writable by this user, so no checkpoint could be "
                f"saved; pick a writable --out (or fix the folder's permissions)"
            )

    # -- the one writer ----------------------------------------------------------------------

    @contextlib.contextmanager
    def hold(self, run: RunConfig, *, overwrite: bool = False, writer: bool = True,
             dry: bool = False) -> Iterator[RunDir]:  # fmt: skip
        """The run's hold on its folder, before anything in it is read or written: refuses a
        file or unwritable --out, a folder that is not dormouse's (unless `overwrite`), our
        files as links, and a folder another process holds. `writer` (one process, or rank
        0 of a fleet): creates the folder and takes the lock for the block's life; a folder
        this call created and nothing wrote is removed again. `dry`: checks only. Under
        `overwrite` a folder that is not dormouse's is trained into (its files of our names
        are replaced, on purpose)."""
        self.check_writable()
        self.refuse_links(run)
        self.refuse_foreign(overwrite)
        if dry or not writer:
            if dry:
                self.refuse_held()
            yield self
            return
        made = not self.path.exists()
        self.make()
        self._lock()  # a refusal here leaves the folder alone: its holder may have just made it
        try:
            yield self
        finally:
            if made:  # a refusal before any write: the folder goes, while still held
                with contextlib.suppress(OSError):
                    if [p.name for p in self.path.iterdir()] == [LOCK]:
                        self.file(LOCK).unlink()
                        self.path.rmdir()
            self.release()

    def make(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunDirError(f"cannot create the run folder {self.typed} ({ckpt.write_error(e)}"
                              f"); pick a writable --out") from None  # fmt: skip

    def _open_lock(self, flags: int) -> int | None:
        """The lock file's descriptor (never through a link, a FIFO or a hard link: its note
        truncates it); None when it is missing and not to be created."""
        try:
            return open_own(self.file(LOCK), flags)
        except NotOurs as e:
            raise RunDirError(
                f"{e.strerror}; dormouse makes its own lock file: remove "
                f"{self.file(LOCK)}, or pick another --out"
            ) from None
        except FileNotFoundError:
            if flags & os.O_CREAT:  # the folder itself went (removed under us)
                raise RunDirError(f"the run folder {self.typed} vanished as it was being "
                                  f"locked; train again") from None  # fmt: skip
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise RunDirError(f"{self.file(LOCK)} is a symbolic link; remove it (dormouse "
                                  f"makes its own lock file)") from None  # fmt: skip
            raise RunDirError(f"cannot open {self.file(LOCK)} ({ckpt.write_error(e)}); pick a "
                              f"writable --out") from None  # fmt: skip

    def _lock(self) -> None:
        fd = self._open_lock(os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            who = _holder(fd)
            os.close(fd)
            raise RunDirError(self._held_line(who)) from None
        self._fd = fd
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} host {socket.gethostname()} since "
                         f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())  # fmt: skip
        except OSError as e:  # the lock holds without its note; only the refusal reads it
            log.warning(f"{self.file(LOCK)}: holder not recorded ({ckpt.write_error(e)})")

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None

    def refuse_held(self) -> None:
        """Refuse a folder whose lock a live process holds, without creating anything."""
        fd = self._open_lock(os.O_RDONLY)
        if fd is None:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirError(self._held_line(_holder(fd))) from None
        finally:
            os.close(fd)

    def _held_line(self, who: str) -> str:
        return (
            f"{self.typed} is in use by another dormouse process ({who}): a run folder "
            f"has one writer. Wait for it to end (or stop it), or use another folder"
        )

    # -- what training here means -------------------------------------------------------------

    def plan(self, run: RunConfig, mode: str, overwrite: bool, elastic_restart: int = 0) -> str:
        """Decide what training into this folder means: "fresh", "resume" or "complete".

        mode: never (refuse a folder holding a run), auto (resume when a checkpoint exists),
        must (refuse when none does). --overwrite starts afresh on purpose. An elastic restart
        (torchrun's TORCHELASTIC_RESTART_COUNT > 0) resumes by itself: `overwrite` then
        applies to the first attempt only. Nothing is written here.
        """
        t = run.train
        out, path = self.typed, self.checkpoint(run)
        if overwrite and mode == "must":
            raise RunDirError("--overwrite starts afresh and --resume must continues: pick one")
        if elastic_restart > 0:
            if overwrite or mode == "never":
                log.info(
                    f"elastic restart {elastic_restart}: resuming the run in {out} "
                    f"(--resume auto), not {'overwriting it' if overwrite else 'refusing it'}"
                )
            overwrite, mode = False, ("auto" if mode != "must" else "must")
        has_ckpt = path.is_file()
        best = self.best(run)
        if not has_ckpt and not overwrite and best.is_file():
            # killed after its first best.pt and before its first ckpt.pt (the cpu preset: any
            # kill between steps 200 and 500): best.pt is the run's only model, and a checkpoint
            # like ckpt.pt (optimizer, data position, RNG); a fresh start would remove it
            path, has_ckpt, self.resume_from = best, True, best
        rows = self.metrics_rows()
        if overwrite:
            if has_ckpt or rows:
                log.info(f"--overwrite: starting afresh in {out} (replacing "
                         + ", ".join(x for x in (f"{path.name}" if has_ckpt else "",
                                                 f"{rows} metrics rows" if rows else "") if x)
                         + ")")  # fmt: skip
            return "fresh"
        if not has_ckpt:
            if mode == "must":
                raise RunDirError(
                    f"--resume: no checkpoint at {path}; start without --resume (or --resume "
                    f"auto, which starts fresh when there is none)"
                )
            if rows and mode == "never":
                raise RunDirError(
                    f"{out} already holds {METRICS} ({rows} rows) from an earlier run that "
                    f"wrote no checkpoint. Use --resume auto to start afresh keeping them (moved "
                    f"aside), --overwrite to start afresh without them, or another --out"
                )
            return "fresh"
        ck = ckpt.read_checkpoint(path, mmap=True)
        step = int(ck["step"])
        # a field left on auto matches what it resolved to when the run trained
        changed = asked_differences(ck["run"], run)
        same = ck["run"].source == run.source and not changed
        if mode == "never" and not (same and step == t.steps):
            why = ("this run's config" if same else "a different config ("
                   + "; ".join(changed or [f"source {ck['run'].source} -> {run.source}"])
                   + ")")  # fmt: skip
            raise RunDirError(
                f"{out} already holds a run: {path.name} at step {step} of "
                f"{ck['run'].train.steps}, {rows} metrics rows, {why}; training here would "
                f"replace it. Use --resume auto to continue it, --overwrite to start afresh, or "
                f"another --out"
            )
        if step > t.steps:
            raise RunDirError(
                f"{path} is at step {step}, beyond this run's steps={t.steps}; raise --steps to "
                f"continue it, or --overwrite to start afresh"
            )
        if self.resume_from is not None and mode != "never":
            log.info(
                f"{out}: no {self.checkpoint(run).name} (the run stopped before its first "
                f"one); {path.name} at step {step} is its only model: resuming from it"
            )
        if step == t.steps:
            log.info(
                f"{out}: the run is already complete at step {step} ({path}); nothing to "
                f"train. Raise --steps with --resume auto to continue it, or --overwrite "
                f"to start afresh"
            )
            return "complete"
        return "resume"

    # -- metrics.jsonl ------------------------------------------------------------------------

    def metrics_rows(self) -> int:
        f = self.file(METRICS)
        if not f.is_file():
            return 0
        with f.open("rb") as fh:
            return sum(1 for line in fh if line.strip())

    def set_metrics_aside(self) -> str | None:
        """A fresh start over an earlier run's rows (one that wrote no checkpoint) keeps them:
        metrics.jsonl is renamed to the first free metrics.N.jsonl, whose name is returned."""
        if not self.metrics_rows():
            return None
        n = 1
        while os.path.lexists(self.file(f"metrics.{n}.jsonl")):
            n += 1
        aside = self.file(f"metrics.{n}.jsonl")
        os.rename(self.file(METRICS), aside)  # we hold the folder: no one takes the name
        return aside.name

    def trim_metrics(self, step: int) -> int:
        """Drop rows written after `step` (and a torn last line); returns how many. A run that
        crashed after its last checkpoint logged rows the resumed run logs again. A damaged
        row elsewhere is refused (read_rows)."""
        f = self.file(METRICS)
        if not f.is_file():
            return 0
        rows, torn = read_rows(f)
        keep = [r for _, r in rows if r["step"] <= step]
        dropped = len(rows) - len(keep) + torn
        # a file with other hard links (a `cp -al` copy of a run) shares its data with the
        # original run's: the appends to come go to a copy of our own, put in place by rename
        shared = f.stat().st_nlink > 1
        if shared:
            log.info(
                f"{f} has {f.stat().st_nlink} hard links (a `cp -al` copy?): this run "
                f"appends to a copy of its own; the other names keep their rows"
            )
        if dropped or shared:
            text = "".join(json.dumps(r) + "\n" for r in keep).encode()
            try:
                ckpt.write_atomic(f, lambda fh: fh.write(text))
            except OSError as e:
                raise RunDirError(f"could not rewrite {f} without the rows after step {step} "
                                  f"({ckpt.write_error(e)}); it is as it was. "
                                  f"{ckpt.write_escape(e).capitalize()}, then --resume auto"
                                  ) from None  # fmt: skip
        return dropped

    def metrics(self) -> Metrics:
        return Metrics(self.file(METRICS))

    # -- whole files ----------------------------------------------------------------------------

    def write_config(self, run: RunConfig) -> None:
        """config.json at the run's start; a failure is one line (nothing trained yet)."""
        text = run.to_json().encode()
        try:
            ckpt.write_atomic(self.file(CONFIG), lambda f: f.write(text))
        except OSError as e:
            raise RunDirError(f"could not write {self.file(CONFIG)} ({ckpt.write_error(e)}); "
                              f"nothing was trained. {ckpt.write_escape(e).capitalize()}, then "
                              f"train again") from None  # fmt: skip

    def start_metrics(self) -> None:
        """A fresh run's empty metrics.jsonl (an earlier run's rows were set aside or, with
        --overwrite, are replaced on purpose)."""
        try:
            ckpt.write_atomic(self.file(METRICS), lambda f: None)
        except OSError as e:
            raise RunDirError(f"could not write {self.file(METRICS)} ({ckpt.write_error(e)}); "
                              f"nothing was trained. {ckpt.write_escape(e).capitalize()}, then "
                              f"train again") from None  # fmt: skip

    def write_plot(self, fig) -> bool:
        """loss.png from a matplotlib figure. A failure is a warning, never the run's end:
        the checkpoint is written and metrics.jsonl holds the curve."""
        f = self.file(PLOT)
        try:
            ckpt.write_atomic(f, lambda fh: fig.savefig(fh, dpi=110, format="png"))
        except OSError as e:
            log.warning(f"warning: {f} not written ({ckpt.write_error(e)}); the run and its "
                        f"checkpoint are complete, and {METRICS} holds the curve")  # fmt: skip
            return False
        return True

    # -- what a killed writer left -------------------------------------------------------------

    def clean_stale_temps(self) -> list[str]:
        """Remove what a writer killed mid-save left: temp files and temp shard directories no
        live writer owns (one named with the pid of a live process is left alone), and shard
        directories no checkpoint names; returns their names."""
        removed: list[str] = []
        if not self.path.is_dir():
            return removed
        for p in sorted(self.path.iterdir()):
            m, s = ckpt.TEMP_NAME.match(p.name), ckpt.SHARDS_NAME.match(p.name)
            if m:
                pid = int(m["pid"]) if m["pid"] else None
                if pid is not None and pid != os.getpid() and pid_alive(pid):
                    continue
            elif not (s and ckpt.dcp_dir(p) and _orphan(self.path / f"{s['stem']}.pt", p.name)):
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p.name)
        return removed


def _holder(fd: int) -> str:
    """Who holds a lock file, from the note its holder wrote once it held it (read again for
    a moment: a holder that just took the lock may not have written it yet)."""
    text = ""
    for _ in range(20):
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 512).decode("utf-8", "replace").strip()
        parts = text.split()
        if len(parts) >= 4 and parts[0] == "pid" and parts[1].isdigit() and (
                parts[3] != socket.gethostname() or pid_alive(int(parts[1]))):  # fmt: skip
            return f"pid {parts[1]} on host {parts[3]}" + (
                f", since {' '.join(parts[5:7])}" if len(parts) >= 7 else ""
            )
        time.sleep(0.05)
    return f"a holder that left no note ({text[:40]!r})" if text else "a holder that left no note"


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


def read_rows(path: Path) -> tuple[list[tuple[int, dict]], int]:
    """metrics.jsonl's (line number, row) in file order, and whether its last line was torn (a
    write cut short: not JSON, not counted). Each row is checked: a JSON object with a string
    `kind` and an integer `step` >= 0, and a numeric `loss` in a train or eval row.
    RunDirError names the first damaged line."""
    try:  # a link put in place of the file is not read through either, a FIFO never waited on
        fd = open_own(path, os.O_RDONLY, writing=False)
        with os.fdopen(fd, "rb") as f:
            raw = f.read().split(b"\n")
    except OSError as e:
        raise RunDirError(f"cannot read {path} ({e.strerror or e}); if it is a link, put the "
                          f"run's own file back") from None  # fmt: skip
    while raw and not raw[-1].strip():
        raw.pop()
    rows, torn = [], 0
    for n, line in enumerate(raw, 1):
        if not line.strip():
            continue
        why = ""
        try:
            row = loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            why = "is not UTF-8 text"
        except DeepJSON as e:  # not a torn line: a cut one is no deeper than a whole one
            why = f"is {e}"
        except ValueError:
            if n == len(raw):  # the last line, cut short by a crash mid-write
                torn = 1
                continue
            why = "is not JSON"
        else:
            why = _row_problem(row)
        if why:
            raise RunDirError(f"{path}: line {n} {why}; the file is damaged: delete that line "
                              f"(or restore the file), or pass another run")  # fmt: skip
        rows.append((n, row))
    return rows, torn


def _row_problem(row) -> str:
    if not isinstance(row, dict):
        return f"is JSON but not an object ({json.dumps(row)[:40]})"
    kind, step = row.get("kind"), row.get("step")
    if not isinstance(kind, str):
        return "has no string 'kind'"
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return f"is a {kind!r} row without an integer step >= 0 (found {step!r})"
    loss = row.get("loss")
    if kind in ("train", "eval") and (not isinstance(loss, (int, float)) or isinstance(loss, bool)):
        return f"is a {kind!r} row without a numeric loss (found {loss!r})"
    return ""


class Metrics:
    """Appends rows to metrics.jsonl (O_NOFOLLOW: never through a link). A failed append
    (a full disk, a file size limit) is a warning, not the run's end while its checkpoint can
    be written: the rows are kept and written with the next append that succeeds; a partial
    line is cut off again, so the file stays whole lines."""

    #: Rows held at most while appends fail (~25 MB of ~250-byte rows); older ones are let go.
    HELD = 100_000

    def __init__(self, path: Path):
        self.path = path
        self.pending: list[str] = []
        self.failing = False
        self.lost = 0

    def write(self, kind: str, step: int, values: dict) -> None:
        """One row, {"kind", "step", **values} (what `dormouse compare`, the plot and
        trim_metrics read); a store/metrics.MetricsSink."""
        self.pending.append(json.dumps({"kind": kind, "step": step, **values}) + "\n")
        if len(self.pending) > self.HELD:
            self.pending.pop(0)
            self.lost += 1
        data = "".join(self.pending).encode()
        try:
            _append(self.path, data)
        except OSError as e:
            if not self.failing:
                log.warning(f"warning: could not append to {self.path} ({ckpt.write_error(e)});"
                            f" training goes on, its rows are kept and written once the file "
                            f"takes them (the log has them too)")  # fmt: skip
            self.failing = True
            return
        if self.failing:
            log.info(f"{self.path}: appending again; {len(self.pending)} held row(s) written")
        self.pending, self.failing = [], False

    def close(self) -> None:
        if self.pending or self.lost:
            log.warning(f"warning: {len(self.pending) + self.lost} row(s) could not be written "
                        f"to {self.path} (the log has them)")  # fmt: skip


def _append(path: Path, data: bytes) -> None:
    fd = open_own(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        size = os.fstat(fd).st_size
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)  # no half row left for the next append to join
            raise
    finally:
        os.close(fd)


# ---- export: a checkpoint out of a run folder ------------------------------------------------


def export(src: str | Path, dest: str | Path, overwrite: bool = False) -> Path:
    """`dormouse export RUN --to FILE`: the checkpoint of a run folder (its config.json names
    it) or a checkpoint file, as one file at FILE. FILE is never inside a run folder, and
    never replaces an existing file unless `overwrite`."""
    src, dest = Path(src), Path(dest)
    if src.is_dir():
        folder = RunDir(src)
        run = folder.config()
        name = f"{run.train.ckpt_name}.pt" if run is not None else "ckpt.pt"
        src = folder.file(name)
        if src.is_symlink() or Path(os.path.realpath(src)).parent != folder.path:
            raise RunDirError(f"{src} is a link out of its run folder; export reads the run's "
                              f"own checkpoint only: pass the file it points to")  # fmt: skip
    where = Path(os.path.realpath(dest))
    for anc in where.parents:
        if RunDir(anc).is_run():
            RunDir(anc).refuse_held()
            raise RunDirError(
                f"--to {dest} is inside the run folder {anc}: export writes only outside run "
                f"folders (a run's files are its own); name a file elsewhere"
            )
    if os.path.lexists(dest) and not os.path.isdir(dest) and not overwrite:
        raise RunDirError(f"--to {dest} exists; export never replaces a file it did not "
                          f"write: name a new file, or add --overwrite")  # fmt: skip
    # (with --overwrite a link at `dest` is replaced by the rename, never written through)
    return ckpt.export_checkpoint(src, dest)
