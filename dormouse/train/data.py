"""Byte data: corpora on disk, the train/val split, windows, the fleet-aware stream,
weighted mixtures and the embedded default corpus.

Owns everything between "a file of bytes" and the int64 (x, y) tensors the loop
trains on. The loop calls one entry, `open_data(train_cfg)`, and gets a
`DataSource`; from it each rank takes `train_stream(...)` (its own byte range of
every step's block) and rank 0 takes the fixed `val_batches(...)`.

The layout. A step of the
whole fleet consumes one BLOCK of `stride = sum_r b_r * (seq_len + 1)` bytes.
Block s starts at `(s mod n_blocks) * stride`, `n_blocks = len(view) // stride`,
and rank r reads `[block_start + rank_byte_offset(r), + b_r * (seq_len + 1))`.
So the union of the ranks' reads at step s IS the block a single process with
batch sum(b) reads at step s, and over one pass no byte is read twice: the
blocks tile the view. Wrapping is per block, never per rank, so a block never
straddles the end; the last `len(view) % stride` bytes of the view are never
read (less than one step's worth).

Block order and phase. With `shuffle` (the default) the blocks of each pass over
the view are visited in a permutation drawn from (seed, pass), and each pass tiles
the view from its own PHASE, a byte offset drawn from (seed, pass): the view is
read as a ring, block i of a pass covering `[phase + i*stride, + stride) mod n`.
A window therefore starts at a different byte in every pass (two passes share
their windows only when their phases agree modulo seq_len+1: a coincidence of
about 1 in seq_len+1), which is what stops a model from memorising a small corpus
window by window; the layout above still holds block by block (no byte read twice
within a pass, fewer than `stride` bytes left unread, every rank and a resume
compute the same blocks). The one window per pass that crosses the seam reads
the view's last bytes then its first ones, like a document boundary. Without
`shuffle` blocks are read in file order from phase 0, which feeds the model one
source file after another (a strongly non-i.i.d. stream).

The draws, with numpy's default generator, seed = the run's seed (+ i for the i-th
--data file), pass = step // n_blocks, n = len(view):

    order of pass p:  np.random.default_rng([seed, p]).permutation(n_blocks)
    phase of pass p:  np.random.default_rng([seed, p, 0x70686173]).integers(0, n)
    step s reads      [(phase + order[s % n_blocks] * stride + rank offset) mod n, + window)
"""

from __future__ import annotations

import bisect
import hashlib
import logging
import math
import os
import stat
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..cache import cache_dir as dormouse_cache
from ..errors import UserError

log = logging.getLogger(__name__)


class DataError(UserError, ValueError):
    """Data the run cannot use; the message names the file, the measured fact and the escape."""


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _window_text(batch: int, seq_len: int) -> str:
    return f"batch*(seq_len+1) = {batch}*({seq_len}+1) = {batch * (seq_len + 1)} bytes"


# ---- one file of bytes ----------------------------------------------------------


class ByteCorpus:
    """A file of raw bytes (any type: .txt, .bin, an image...) memory-mapped read-only.

    Indexing and slicing give numpy uint8 views that read from the page cache; nothing
    is loaded up front, so a corpus larger than RAM is fine.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(os.path.expanduser(os.fspath(path)))
        p = self.path
        try:
            st = p.stat()
        except FileNotFoundError:
            raise DataError(
                f"data file {str(p)!r} does not exist; check the path given to --data "
                f"(or omit --data to train on the embedded default corpus)"
            ) from None
        except PermissionError as e:
            raise DataError(
                f"data file {str(p)!r} cannot be inspected ({e.strerror}); make it readable "
                f"by this user (chmod a+r, and +x on its folders) or copy it somewhere that is"
            ) from None
        if stat.S_ISDIR(st.st_mode):
            raise DataError(
                f"data path {str(p)!r} is a directory, not a file; pass one file per --data "
                f"(concatenate the folder's files first, e.g. cat DIR/* > corpus.txt)"
            )
        if not stat.S_ISREG(st.st_mode):
            raise DataError(
                f"data path {str(p)!r} is not a regular file (a pipe, socket or device cannot "
                f"be memory-mapped); write its contents to a file and pass that"
            )
        if st.st_size == 0:
            raise DataError(
                f"data file {str(p)!r} is empty (0 bytes); give a file with content "
                f"(or omit --data to train on the embedded default corpus)"
            )
        try:
            self._mm = np.memmap(p, dtype=np.uint8, mode="r")
        except PermissionError as e:
            raise DataError(
                f"data file {str(p)!r} ({st.st_size} bytes) is not readable by this user "
                f"({e.strerror or e}); fix its permissions (chmod a+r) or copy it somewhere "
                f"readable"
            ) from None
        except (OSError, ValueError) as e:
            raise DataError(
                f"data file {str(p)!r} ({st.st_size} bytes) cannot be memory-mapped ({e}); "
                f"copy it to a local disk and pass that copy"
            ) from None

    def __len__(self) -> int:
        return int(self._mm.shape[0])

    def __getitem__(self, idx):
        return self._mm[idx]

    def __repr__(self) -> str:
        return f"ByteCorpus({str(self.path)!r}, {len(self)} bytes)"

    def require(self, batch: int, seq_len: int) -> None:
        """Refuse a file too short to hold one training window."""
        need = batch * (seq_len + 1)
        if len(self) < need:
            # the least window is one byte and its target (batch=1, seq_len=1): 2 bytes
            escape = (f"lower --set batch or --set seq_len (so that batch*(seq_len+1) <= "
                      f"{len(self)}), or give a larger file" if len(self) >= 2 else
                      "give a file of at least 2 bytes (a byte and the one after it)")  # fmt: skip
            raise DataError(
                f"data file {str(self.path)!r} has {len(self)} bytes, but one window needs "
                f"{_window_text(batch, seq_len)}; {escape}"
            )

    def split(self, val_frac: float, val_bytes: int = 0, window: int = 1):
        """(train_view, val_view) by byte offset: val is the file's tail. See `val_length`."""
        n_val = val_length(len(self), val_frac, val_bytes, window, name=str(self.path))
        cut = len(self) - n_val
        return self._mm[:cut], self._mm[cut:]


def val_length(n: int, val_frac: float, val_bytes: int, window: int = 1, name: str = "data") -> int:
    """How many tail bytes of an n-byte file form the validation split.

    The rule: the last `val_bytes` bytes when val_bytes > 0, else the last
    ceil(val_frac * n) bytes; 0 when both are 0 (no validation split). A non-empty
    split is raised to at least one `window` so that one val batch exists, and the
    train part must keep at least one window too, else DataError.
    """
    if not 0.0 <= val_frac < 1.0 or not math.isfinite(val_frac):
        raise DataError(f"val_frac={val_frac} must be in [0, 1); e.g. --set val_frac=0.01")
    if val_bytes < 0:
        raise DataError(f"val_bytes={val_bytes} must not be negative; 0 means 'use val_frac'")
    want = val_bytes if val_bytes > 0 else math.ceil(val_frac * n)
    if want == 0:
        return 0
    got = max(want, window)
    if n - got < window:
        asked = f"val_bytes={val_bytes}" if val_bytes > 0 else f"val_frac={val_frac}"
        raise DataError(
            f"data file {name!r} has {n} bytes: too few for a train window and a val split "
            f"({asked} -> {got} bytes, at least one window of {window}); both need "
            f"{window + got} bytes. Lower --set val_bytes/val_frac, lower batch or seq_len, "
            f"set --set val_frac=0 to train without evaluation, or give a larger file"
        )
    return got


def _as_bytes(view) -> np.ndarray:
    if isinstance(view, (bytes, bytearray, memoryview)):
        return np.frombuffer(view, dtype=np.uint8)
    arr = view._mm if isinstance(view, ByteCorpus) else view
    if not isinstance(arr, np.ndarray) or arr.dtype != np.uint8 or arr.ndim != 1:
        raise TypeError(f"a byte view must be a 1-D uint8 array or bytes, got {type(view)}")
    return arr


def windows(raw, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """batch*(seq_len+1) bytes laid out window after window -> (x, y), int64 [batch, seq_len]."""
    arr = _as_bytes(raw)
    need = batch * (seq_len + 1)
    if arr.shape[0] != need:
        raise ValueError(f"windows() got {arr.shape[0]} bytes; {_window_text(batch, seq_len)}")
    # np.array copies out of the read-only memmap, so torch owns writable memory
    w = torch.from_numpy(np.array(arr, dtype=np.int64)).view(batch, seq_len + 1)
    return w[:, :-1], w[:, 1:]


# ---- the fleet layout -------------------------------------------------------------


def rank_byte_offset(batches: Sequence[int], seq_len: int, r: int) -> int:
    """Where rank r's slice starts inside each step's block: sum_{i<r} b_i*(seq_len+1)."""
    if not 0 <= r < len(batches):
        raise ValueError(f"rank {r} is outside a fleet of {len(batches)} ranks")
    return sum(int(b) for b in batches[:r]) * (seq_len + 1)


def fleet_stride(batches: Sequence[int], seq_len: int) -> int:
    """Bytes the whole fleet consumes per step: sum_r b_r*(seq_len+1)."""
    return sum(int(b) for b in batches) * (seq_len + 1)


class ByteStream:
    """One rank's reader of one byte view: step s -> its slice of block s (module docstring).

    `position` is the step counter; `state_dict()` saves it together with the layout
    it is meaningful for, so a resume continues on exactly the next block. A resume
    may change how a global batch is split across ranks (the blocks stay the same),
    but not the global block size or the view.
    """

    def __init__(self, view, batch: int, seq_len: int, offset: int = 0,
                 stride: int | None = None, name: str = "data",
                 shuffle_seed: int | None = None,
                 source: tuple[str | os.PathLike, int] | None = None):  # fmt: skip
        self.view = _as_bytes(view)
        # (file, its size when mapped): a file truncated under the map kills the process
        # with SIGBUS on the next read, so each step first checks it has not shrunk
        self.source = source
        self.shuffle_seed = shuffle_seed
        self._perm: tuple[int, np.ndarray] | None = None
        self.batch, self.seq_len, self.name = int(batch), int(seq_len), name
        if self.batch < 1 or self.seq_len < 1:
            raise ValueError(f"batch={batch} and seq_len={seq_len} must both be >= 1")
        self.window = self.batch * (self.seq_len + 1)
        self.offset = int(offset)
        self.stride = self.window if stride is None else int(stride)
        if self.offset < 0 or self.offset + self.window > self.stride:
            raise ValueError(
                f"this rank's slice [offset {self.offset}, +{self.window}) does not fit in the "
                f"fleet's block of {self.stride} bytes; derive offset and stride from the same "
                f"batches with rank_byte_offset / fleet_stride"
            )
        n = int(self.view.shape[0])
        if n < self.stride:
            raise DataError(
                f"{name!r}: the train split has {n} bytes, but one step of the "
                f"{'fleet' if self.stride != self.window else 'run'} reads {self.stride} bytes "
                f"(sum over ranks of batch*(seq_len+1)); lower batch or seq_len, or give a "
                f"larger file"
            )
        self.n_blocks = n // self.stride
        # layout 2: each pass from its own phase (module docstring); a checkpoint written
        # before phases existed resumes with phase 0, exactly as it was trained
        self.phased = shuffle_seed is not None
        self.step = 0

    @property
    def position(self) -> int:
        return self.step

    def span(self, step: int) -> tuple[int, int]:
        """[start, stop) byte offsets of the ring that this rank reads at `step`: `stop` may
        pass the view's end, the excess then wraps to its start (`read`)."""
        start = (self.phase(step // self.n_blocks) + self.block(step) * self.stride
                 + self.offset) % self.view.shape[0]  # fmt: skip
        return start, start + self.window

    def phase(self, n_pass: int) -> int:
        """Where pass `n_pass` starts tiling the view: drawn from (seed, pass), 0 unshuffled."""
        if not self.phased:
            return 0
        rng = np.random.default_rng([int(self.shuffle_seed), n_pass, 0x70686173])  # "phas"
        return int(rng.integers(0, self.view.shape[0]))

    def block(self, step: int) -> int:
        """Which block of the view the fleet reads at `step`."""
        i = step % self.n_blocks
        if self.shuffle_seed is None:
            return i
        n_pass = step // self.n_blocks
        if self._perm is None or self._perm[0] != n_pass:
            rng = np.random.default_rng([int(self.shuffle_seed), n_pass])
            self._perm = (n_pass, rng.permutation(self.n_blocks))
        return int(self._perm[1][i])

    def read(self, step: int) -> np.ndarray:
        a, b = self.span(step)
        n = self.view.shape[0]
        if b <= n:
            return self.view[a:b]
        return np.concatenate([self.view[a:], self.view[: b - n]])

    def peek(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return windows(self.read(step), self.batch, self.seq_len)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.check_source()
        out = self.peek(self.step)
        self.step += 1
        return out

    __next__ = next

    def __iter__(self):
        return self

    def check_source(self) -> None:
        """Refuse to read a file that shrank since it was mapped (reading it would SIGBUS)."""
        if self.source is None:
            return
        path, size = self.source
        try:
            now = os.stat(path).st_size
        except OSError as e:
            now, why = -1, f"can no longer be inspected ({e.strerror or e})"
        else:
            why = f"shrank from {size} to {now} bytes"
        if now < size:
            raise DataError(
                f"data file {os.fspath(path)!r} {why} while training, before step {self.step}; "
                f"reading it now would crash the process (SIGBUS on its memory map). Restore "
                f"the file (or train on a copy that nothing rewrites), then --resume auto"
            )

    def state_dict(self) -> dict:
        return {"kind": "stream", "step": self.step, "n_bytes": int(self.view.shape[0]),
                "stride": self.stride, "shuffle_seed": self.shuffle_seed,
                "phased": self.phased}  # fmt: skip

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("kind") != "stream":
            raise DataError(
                f"{self.name!r}: the checkpoint's data position is a {sd.get('kind')!r}, this "
                f"run reads a single stream; resume with the same --data files"
            )
        if sd.get("n_bytes") != self.view.shape[0]:
            raise DataError(
                f"{self.name!r}: the checkpoint's stream read a train split of {sd.get('n_bytes')} "
                f"bytes, this one has {self.view.shape[0]}; resume with the same --data, "
                f"val_frac and val_bytes (or start a new run without --resume)"
            )
        if sd.get("stride") != self.stride:
            raise DataError(
                f"{self.name!r}: the checkpoint's run read {sd.get('stride')} bytes per step, this "
                f"one reads {self.stride} (global batch*(seq_len+1)); resume with the same "
                f"global batch and seq_len"
            )
        if sd.get("shuffle_seed") != self.shuffle_seed:
            raise DataError(
                f"{self.name!r}: the checkpoint's stream visited blocks with shuffle_seed="
                f"{sd.get('shuffle_seed')}, this run with {self.shuffle_seed}; resume with the "
                f"same seed and shuffle setting"
            )
        # a checkpoint from before per-pass phases read every pass from byte 0: its run
        # continues on that layout, so the resume reads exactly the bytes it would have
        self.phased = bool(sd.get("phased", False)) and self.shuffle_seed is not None
        self.step = int(sd["step"])


# ---- several corpora ----------------------------------------------------------------


def check_weights(weights: Sequence[float]) -> list[float]:
    w = [float(x) for x in weights]
    if any(not math.isfinite(x) or x < 0 for x in w) or sum(w) <= 0:
        raise DataError(
            f"data_weights={tuple(weights)}: each weight must be finite and >= 0 and at "
            f"least one > 0; e.g. --set data_weights=1,1"
        )
    return w


def _uniform(seed: int, step: int) -> float:
    # a hash rather than a numpy/torch RNG: the draw for step s depends on (seed, s)
    # alone, is the same on every rank and every library version, and needs no state
    h = hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2.0**64


class Mixture:
    """Weighted choice of one source per step; each source keeps its own ByteStream.

    The source of step s is a pure function of (seed, s), so every rank picks the same
    source, a source's position is the number of times it was picked, and resuming
    needs only the counters.
    """

    def __init__(self, streams: Sequence[ByteStream], weights: Sequence[float], seed: int,
                 names: Sequence[str] | None = None):  # fmt: skip
        if len(streams) != len(weights) or not streams:
            raise DataError(f"{len(weights)} weights for {len(streams)} sources; give one each")
        w = check_weights(weights)
        self.streams = list(streams)
        self.weights = w
        self.seed = int(seed)
        self.names = list(names) if names else [s.name for s in self.streams]
        self._cum = list(np.cumsum(w))
        self._last = max(i for i, x in enumerate(w) if x > 0)
        self.step = 0

    @property
    def position(self) -> int:
        return self.step

    def source_at(self, step: int) -> int:
        u = _uniform(self.seed, step) * self._cum[-1]
        return min(bisect.bisect_right(self._cum, u), self._last)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.streams[self.source_at(self.step)].next()
        self.step += 1
        return out

    __next__ = next

    def __iter__(self):
        return self

    def check_source(self) -> None:
        for s in self.streams:
            s.check_source()

    def state_dict(self) -> dict:
        return {"kind": "mixture", "step": self.step, "seed": self.seed,
                "weights": list(self.weights),
                "streams": [s.state_dict() for s in self.streams]}  # fmt: skip

    def load_state_dict(self, sd: dict) -> None:
        if sd.get("kind") != "mixture" or len(sd["streams"]) != len(self.streams):
            got = len(sd["streams"]) if sd.get("kind") == "mixture" else 1
            raise DataError(
                f"the checkpoint's data position covers {got} source(s), this run has "
                f"{len(self.streams)}; resume with the same --data files"
            )
        if sd["seed"] != self.seed or list(sd["weights"]) != self.weights:
            raise DataError(
                f"the checkpoint's mixture used seed={sd['seed']} weights={sd['weights']}, "
                f"this run seed={self.seed} weights={self.weights}; resume with the same "
                f"seed and data_weights"
            )
        for s, ssd in zip(self.streams, sd["streams"]):
            s.load_state_dict(ssd)
        self.step = int(sd["step"])


# ---- what the bytes are -------------------------------------------------------------------

#: A data fingerprint reads the first and the last block of the file and FINGERPRINT_SAMPLES
#: more at offsets drawn from a generator seeded by the file's size: 72 KiB of any corpus
#: (milliseconds), the same offsets on every machine for a file of that size.
FINGERPRINT_BLOCK = 4096
FINGERPRINT_SAMPLES = 16


def data_fingerprint(path: str | os.PathLike) -> dict:
    """{"path", "size", "digest"} of one data file: its size and a BLAKE2b of sampled blocks.

    Two ranks (or a run and its resume) that read different bytes behind the same path
    differ here unless every difference falls outside the sampled blocks; a same-size file
    rewritten with other content is caught unless the rewrite spares all 18 blocks.
    """
    p = Path(os.path.expanduser(os.fspath(path)))
    try:
        with open(p, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            block = FINGERPRINT_BLOCK
            last = max(0, size - block)
            rng = np.random.default_rng([0x646F726D, size])  # "dorm", then the size
            starts = [0, last] + sorted(
                int(x) for x in rng.integers(0, last + 1, FINGERPRINT_SAMPLES)
            )
            h = hashlib.blake2b(str(size).encode(), digest_size=16)
            for s in starts:
                f.seek(s)
                h.update(f.read(block))
    except OSError as e:
        raise DataError(f"data file {str(p)!r} cannot be read ({e.strerror or e}); check the "
                        f"path given to --data and its permissions") from None  # fmt: skip
    return {"path": str(p), "size": int(size), "digest": h.hexdigest()}


def fingerprint_mismatch(saved: Sequence[dict], now: Sequence[dict]) -> list[str]:
    """Why the data fingerprints `saved` (a checkpoint's) and `now` (this run's) differ:
    one line per file, empty when they agree. Paths are not compared (a moved file is the
    same data); sizes and sampled contents are."""
    if len(saved) != len(now):
        return [
            f"the checkpoint was trained on {len(saved)} data file(s), this run reads {len(now)}"
        ]
    out = []
    for a, b in zip(saved, now):
        if a.get("size") != b["size"]:
            out.append(
                f"{b['path']} has {b['size']} bytes, the checkpoint's data "
                f"({a.get('path')}) had {a.get('size')}"
            )
        elif a.get("digest") != b["digest"]:
            out.append(
                f"{b['path']} has the same size ({b['size']} bytes) as the checkpoint's "
                f"data ({a.get('path')}) but other content (sampled-block digest "
                f"{b['digest'][:12]}, the checkpoint's {str(a.get('digest'))[:12]})"
            )
    return out


# ---- the embedded default corpus --------------------------------------------------------

#: The default corpus stops before the first file (in sorted order) that would take it
#: past this size. CPython's stdlib sources without tests are ~12 MiB, so today the cap
#: only guards against an unusually large install.
DEFAULT_CORPUS_CAP = 24 * 2**20
_CORPUS_FORMAT = 1  # bump when the layout below changes, so old caches are not reused
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def _header(rel: str) -> bytes:
    return f"# file: {rel}\n".encode()


def _stdlib_plan(root: Path, cap: int) -> list[tuple[str, Path, int]]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for f in filenames:
            if not f.endswith(".py"):
                continue
            p = Path(dirpath) / f
            try:
                size = p.stat().st_size
            except OSError:
                continue
            found.append((p.relative_to(root).as_posix(), p, size))
    found.sort(key=lambda t: t[0])
    plan, total = [], 0
    for rel, p, size in found:
        cost = len(_header(rel)) + size + 1  # +1: the newline added to a file that lacks one
        if total + cost > cap:
            break
        plan.append((rel, p, size))
        total += cost
    return plan


def default_corpus(cache_dir: str | os.PathLike | None = None,
                   cap_bytes: int | None = None, quiet: bool = False) -> Path:  # fmt: skip
    """The running interpreter's standard-library .py sources as one cached file.

    Files in sorted relative-path order (site-packages and test folders skipped, as
    is any file that cannot be read), each preceded by a `# file: REL` line. Built
    once into $DORMOUSE_CACHE (default ~/.cache/dormouse) under a name carrying the
    Python version and a tag of the file list; written to a temp file and renamed,
    so concurrent builders (ranks) are harmless. Two builds give identical bytes.
    """
    cap_bytes = DEFAULT_CORPUS_CAP if cap_bytes is None else int(cap_bytes)
    root = Path(sysconfig.get_paths()["stdlib"])
    where = Path(os.path.expanduser(os.fspath(cache_dir))) if cache_dir else dormouse_cache()
    plan = _stdlib_plan(root, cap_bytes)
    if not plan:
        raise DataError(
            f"no standard-library .py sources found under {str(root)!r} (this Python may "
            f"ship its stdlib zipped); give a corpus with --data FILE"
        )
    key = repr((_CORPUS_FORMAT, cap_bytes, [(rel, size) for rel, _, size in plan]))
    tag = hashlib.sha256(key.encode()).hexdigest()[:12]
    v = sys.version_info
    path = where / f"stdlib-py{v.major}.{v.minor}.{v.micro}-{tag}.txt"
    what = f"the standard-library .py sources of Python {v.major}.{v.minor}.{v.micro}"
    if path.is_file() and path.stat().st_size > 0:
        if not quiet:
            log.info(f"data: default corpus = {what} ({_mib(path.stat().st_size)}, cap "
            f"{_mib(cap_bytes)}), reused from the cache {path}")  # fmt: skip
        return path
    t0 = time.perf_counter()
    try:
        where.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=where, prefix=path.name + ".", suffix=".tmp")
    except OSError as e:
        raise DataError(
            f"cannot write the default corpus cache in {str(where)!r} ({e.strerror or e}); "
            f"set DORMOUSE_CACHE to a writable folder, or give a corpus with --data FILE"
        ) from None
    n_files = 0
    try:
        with os.fdopen(fd, "wb") as out:
            for rel, p, _ in plan:
                try:
                    body = p.read_bytes()
                except OSError:
                    continue  # unreadable source: skipped, as documented
                out.write(_header(rel))
                out.write(body)
                if not body.endswith(b"\n"):
                    out.write(b"\n")
                n_files += 1
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    took = time.perf_counter() - t0
    log.info(f"data: default corpus = {what} ({n_files} files, {_mib(path.stat().st_size)}, cap "
        f"{_mib(cap_bytes)}), built in {took:.1f} s and cached at {path}")  # fmt: skip
    return path


# ---- the loop's entry ----------------------------------------------------------------------


@dataclass
class Source:
    name: str
    corpus: ByteCorpus
    train: np.ndarray
    val: np.ndarray
    weight: float


class DataSource:
    """The run's data: one or more files, each split into a train and a val view."""

    def __init__(self, sources: list[Source], seed: int, is_default: bool = False,
                 shuffle: bool = True):  # fmt: skip
        self.sources, self.seed, self.is_default = sources, int(seed), is_default
        self.shuffle = shuffle

    @property
    def has_val(self) -> bool:
        return all(len(s.val) > 0 for s in self.sources)

    def fingerprint(self) -> list[dict]:
        """Each file's `data_fingerprint`, in --data order (stored in every checkpoint)."""
        return [data_fingerprint(s.corpus.path) for s in self.sources]

    def train_stream(self, batch: int, seq_len: int, offset: int = 0,
                     stride: int | None = None) -> ByteStream | Mixture:  # fmt: skip
        """This rank's stream. Single process: (batch, seq_len). A fleet rank r:
        offset=rank_byte_offset(batches, seq_len, r), stride=fleet_stride(batches, seq_len)."""
        # each source gets its own block order (seed + index), all of them rank-consistent
        streams = [ByteStream(s.train, batch, seq_len, offset, stride, name=s.name,
                              shuffle_seed=(self.seed + i) if self.shuffle else None,
                              source=(s.corpus.path, len(s.corpus)))
                   for i, s in enumerate(self.sources)]  # fmt: skip
        if len(streams) == 1:
            return streams[0]
        return Mixture(streams, [s.weight for s in self.sources], self.seed)

    def val_batches(self, n: int, batch: int, seq_len: int) -> ValBatches:
        """A fixed list of n (x, y) batches: the same every call, evenly spaced over each
        source's val split; a mixture gives each source a share of n by weight. A split
        holds L - window + 1 distinct windows: a share past that would repeat them, so it is
        clamped there (logged). The batches are made when read (ValBatches), so n costs no
        memory (a list of 10^9 windows grew to 4.9 GB before it was killed)."""
        if not self.has_val:
            raise DataError(
                "this run has no validation split (val_frac=0 and val_bytes=0); set "
                "--set val_frac=0.01 (or val_bytes=N), or turn evaluation off with eval_every=0"
            )
        window = batch * (seq_len + 1)
        parts = []
        for s, k in zip(self.sources, _shares(n, [s.weight for s in self.sources])):
            L = len(s.val)
            if k and window > L:
                raise DataError(
                    f"{s.name!r}: the val split has {L} bytes, but one val batch needs "
                    f"{_window_text(batch, seq_len)}; raise --set val_bytes to >= {window}, "
                    f"or lower batch or seq_len"
                )
            if k > L - window + 1:
                log.info(f"val batches: {k} asked of {s.name}, whose val split of {L} bytes "
                         f"holds {L - window + 1} distinct windows of "
                         f"{_window_text(batch, seq_len)}; evaluating those {L - window + 1} "
                         f"(more would repeat them)")  # fmt: skip
                k = L - window + 1
            parts.append((s.val, k))
        return ValBatches(parts, batch, seq_len)

    def val_all(self, batch: int, seq_len: int):
        """Every byte of every val split once: (x, y) batches of up to `batch` windows that
        advance seq_len bytes at a time (each byte after a split's first is a target exactly
        once); a split's last, shorter window comes alone. Deterministic; built lazily."""
        if not self.has_val:
            raise DataError("this run has no validation split (val_frac=0 and val_bytes=0); "
                            "pass --data FILE to evaluate on the tail of another file")  # fmt: skip
        for s in self.sources:
            v = s.val
            n_full = (len(v) - 1) // seq_len
            for i in range(0, n_full, batch):
                k = min(batch, n_full - i)
                rows = np.stack([v[(i + j) * seq_len:(i + j + 1) * seq_len + 1]
                                 for j in range(k)])  # fmt: skip
                w = torch.from_numpy(rows.astype(np.int64))
                yield w[:, :-1], w[:, 1:]
            rest = (len(v) - 1) - n_full * seq_len
            if rest > 0:
                w = torch.from_numpy(np.array(v[n_full * seq_len :], dtype=np.int64)).view(1, -1)
                yield w[:, :-1], w[:, 1:]

    def val_bytes_total(self) -> int:
        """The targets `val_all` scores: each split's bytes but its first."""
        return sum(max(0, len(s.val) - 1) for s in self.sources)


class ValBatches(Sequence):
    """DataSource.val_batches' batches, each made when it is read: the i-th of a split's k is
    the window at (i * (L - window)) // (k - 1). Slices are views (a fleet rank's share)."""

    def __init__(self, parts: list, batch: int, seq_len: int, index: range | None = None):
        self.parts, self.batch, self.seq_len = parts, batch, seq_len
        self.index = range(sum(k for _, k in parts)) if index is None else index

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return ValBatches(self.parts, self.batch, self.seq_len, self.index[i])
        j = self.index[i]
        window = self.batch * (self.seq_len + 1)
        for val, k in self.parts:
            if j < k:
                start = (j * (len(val) - window)) // (k - 1) if k > 1 else 0
                return windows(val[start : start + window], self.batch, self.seq_len)
            j -= k
        raise IndexError(i)


def _shares(n: int, weights: Sequence[float]) -> list[int]:
    # largest remainder: the shares sum to n exactly; ties go to the earlier source
    total = sum(weights)
    raw = [n * w / total for w in weights]
    shares = [math.floor(r) for r in raw]
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - shares[i]), i))
    for i in order[: n - sum(shares)]:
        shares[i] += 1
    return shares


def train_bytes(train_cfg) -> int:
    """The bytes of every --data file's train split (the default corpus's without --data),
    found without reading them and without a log line: what `dropout=auto` divides by."""
    t = train_cfg
    paths = list(t.data) or [str(default_corpus(quiet=True))]
    window = t.batch * (t.seq_len + 1)
    total = 0
    for p in paths:
        n = len(ByteCorpus(p))
        total += n - val_length(n, t.val_frac, t.val_bytes, window, name=str(p))
    return total


def open_data(train_cfg, cache_dir=None) -> DataSource:
    """Resolve `train_cfg.data` (empty -> the default corpus), validate every file against
    one window of batch*(seq_len+1) bytes, split train/val, announce it, return a DataSource."""
    t = train_cfg
    paths = list(t.data)
    is_default = not paths
    if is_default:
        log.info("data: no --data given; using the embedded default corpus")
        paths = [str(default_corpus(cache_dir=cache_dir))]
    if t.data_weights and len(t.data_weights) != len(paths):
        raise DataError(
            f"{len(t.data_weights)} data_weights for {len(paths)} corpora; give one weight "
            f"per --data file or none"
        )
    window = t.batch * (t.seq_len + 1)
    corpora = [ByteCorpus(p) for p in paths]
    sources = []
    for c in corpora:
        c.require(t.batch, t.seq_len)
        train, val = c.split(t.val_frac, t.val_bytes, window)
        sources.append(Source(str(c.path), c, train, val, float(len(train))))
    if t.data_weights:
        for s, w in zip(sources, check_weights(t.data_weights)):
            s.weight = w
    rule = (f"last val_bytes={t.val_bytes}" if t.val_bytes > 0
            else f"last val_frac={t.val_frac}" if t.val_frac > 0 else "none")  # fmt: skip
    for s in sources:
        log.info(f"data: {s.name}: {len(s.corpus)} bytes -> train {len(s.train)} + val {len(s.val)} "
            f"(val = {rule}, at least one window of {window} bytes)")  # fmt: skip
    if len(sources) > 1:
        total = sum(s.weight for s in sources)
        how = "data_weights" if t.data_weights else "weights by train size"
        log.info("data: mixture (" + how + "): " + ", ".join(
            f"{Path(s.name).name}={s.weight / total:.3f}" for s in sources))  # fmt: skip
    return DataSource(sources, t.seed, is_default, shuffle=t.shuffle)
