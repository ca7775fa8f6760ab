"""`python -m dormouse compare RUN_A RUN_B`: two runs' validation curves, one PNG, time-to-target.

Reads each run folder's metrics.jsonl (its eval rows carry `train_s`, seconds spent in
training steps excluding evaluation, checkpoint writes and each process's first step, where
kernels autotune and compile; and `bytes`, the training bytes consumed), plots validation loss
against both into one figure and prints, per run, the best validation loss and the time and
bytes each took to reach the target (default: RUN_B's best, RUN_B being the baseline).
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

from .config import loads
from .errors import UserError

log = logging.getLogger(__name__)


class CompareError(UserError, ValueError):
    """A run folder that cannot be compared; the message names the file and the escape."""


def read_evals(run: str | Path) -> tuple[str, list[dict]]:
    """(label, eval rows in step order) of one run folder."""
    from .train.store.folder import CONFIG, METRICS, read_rows

    folder = Path(run)
    metrics = folder / METRICS
    if not metrics.is_file():
        raise CompareError(f"{folder}: no metrics.jsonl (is it a run folder? pass the --out of "
                           f"a `dormouse train`)")  # fmt: skip
    rows = []
    # every row checked (read_rows); a torn last line (a run writing now) is not counted
    for n, row in read_rows(metrics)[0]:
        if row["kind"] == "eval":
            # a damaged row was a KeyError or TypeError deep in the table
            odd = [k for k in ("train_s", "bytes") if k in row and not _number(row[k])]
            if odd:
                raise CompareError(f"{metrics}: line {n} is an eval row with a non-numeric "
                                   f"{', '.join(odd)}; the file is damaged: delete that line or "
                                   f"pass another run")  # fmt: skip
            rows.append(row)
    if not rows:
        raise CompareError(f"{metrics}: no evaluation rows (train with eval_every > 0 and a "
                           f"validation split)")  # fmt: skip
    missing = [r["step"] for r in rows if "train_s" not in r or "bytes" not in r]
    if missing:
        raise CompareError(
            f"{metrics}: eval rows without train_s/bytes (steps {missing[:3]}...): "
            f"written by an older dormouse; train the run again to compare it"
        )
    # a name of bytes that are not UTF-8 (surrogate escapes in Python) is drawn as its escapes:
    # matplotlib's fonts refused the surrogates
    label = os.fsencode(folder.name).decode("utf-8", "backslashreplace")
    cfg = folder / CONFIG
    if cfg.is_file():
        try:
            source = loads(cfg.read_bytes().decode("utf-8")).get("source")
        except (ValueError, AttributeError):  # not JSON, not UTF-8, not an object
            raise CompareError(f"{cfg} is not a dormouse run config (the run's label comes from "
                               f"it); the file is damaged: restore it, or delete it to label "
                               f"the run by its folder name") from None  # fmt: skip
        label = f"{label} ({source if isinstance(source, str) else '?'})"
    return label, sorted(rows, key=lambda r: r["step"])


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _size(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def reach(rows: list[dict], target: float) -> dict | None:
    """The first eval row at or below `target`, or None."""
    return next((r for r in rows if r["loss"] <= target), None)


def summary(runs: list[tuple[str, list[dict]]], target: float | None) -> tuple[float, list[str]]:
    """(the target used, the table's lines)."""
    bests = [min(rows, key=lambda r: r["loss"]) for _, rows in runs]
    if target is None:
        target = bests[-1]["loss"]  # the baseline's best
    head = (
        f"{'run':<40} {'best val':>9} {'at step':>8} {'train s':>8}   "
        f"time to {target:.4f}   bytes to it"
    )
    lines = [head, "-" * len(head)]
    for (label, rows), b in zip(runs, bests):
        hit = reach(rows, target)
        to = (f"{hit['train_s']:>8.1f} s (step {hit['step']})   {_size(hit['bytes']):>9}"
              if hit else f"{'not reached':>24}")  # fmt: skip
        lines.append(
            f"{label[:40]:<40} {b['loss']:>9.4f} {b['step']:>8} {b['train_s']:>8.1f}   {to}"
        )
    return target, lines


def plot(runs: list[tuple[str, list[dict]]], png: Path, target: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2), sharey=True)
    for label, rows in runs:
        a.plot([r["train_s"] for r in rows], [r["loss"] for r in rows], "o-", ms=3, label=label)
        b.plot([r["bytes"] / 2**20 for r in rows], [r["loss"] for r in rows], "o-", ms=3,
               label=label)  # fmt: skip
    for ax, xl in ((a, "training seconds (eval, saves and first step excluded)"),
                   (b, "training bytes consumed (MiB)")):  # fmt: skip
        ax.axhline(target, color="grey", lw=0.8, ls="--")
        ax.set_xlabel(xl)
        ax.grid(alpha=0.3)
    a.set_ylabel("validation loss (nats/byte)")
    a.legend(fontsize=8)
    finite = [r["loss"] for _, rows in runs for r in rows if math.isfinite(r["loss"])]
    if finite:  # the untrained model's ~5.5 would flatten the curves that matter
        lo = min(finite)
        a.set_ylim(lo - 0.05, min(max(finite), lo + 2.5) + 0.05)
    fig.tight_layout()
    from .train.store.checkpoint import write_atomic

    fmt = png.suffix[1:].lower() or "png"  # for a name without one matplotlib wrote NAME.png
    try:
        # replaced by rename, as a run's files are: a link at --out is replaced, not followed
        write_atomic(png, lambda f: fig.savefig(f, dpi=110, format=fmt))
    except ValueError as e:  # "Format 'txt' is not supported (supported formats: ...)"
        raise CompareError(f"--out {png}: {e}; name the image .png (or .pdf, .svg)") from None
    finally:
        plt.close(fig)


def on_clock(rows: list[dict], step_ms: float) -> list[dict]:
    """The rows with train_s replaced by steps x a solo step time: for runs that shared a card
    (their own train_s counts the sharing), timed alone elsewhere."""
    return [{**r, "train_s": r["step"] * step_ms / 1000.0} for r in rows]


def parse_step_ms(text: str | None, n: int) -> list[float] | None:
    if not text:
        return None
    try:
        ms = [float(x) for x in text.split(",")]
    except ValueError:
        ms = []
    if len(ms) != n or not all(math.isfinite(x) and x > 0 for x in ms):
        raise CompareError(f"--step-ms {text!r}: give one positive step time in ms per run "
                           f"({n} runs), e.g. --step-ms 148,23")  # fmt: skip
    return ms


def main_compare(
    paths: list[str],
    out: str | None,
    target: float | None,
    step_ms: str | None = None,
    overwrite: bool = False,
) -> int:
    if len(paths) < 2:
        raise CompareError("compare needs at least two run folders: dormouse compare RUN_A RUN_B")
    # export's rule: a file compare did not write is never replaced unasked (RUN_A/compare.png,
    # the default, is compare's own)
    if out is not None and os.path.lexists(out) and not os.path.isdir(out) and not overwrite:
        raise CompareError(
            f"--out {out} exists; compare never replaces a file it did not "
            f"write: name a new file, or add --overwrite"
        )
    if target is not None and not math.isfinite(target):
        raise CompareError(f"--target {target}: give a finite validation loss (nats/byte)")
    runs = [read_evals(p) for p in paths]
    clock = parse_step_ms(step_ms, len(runs))
    if clock:
        runs = [(f"{label} @ {ms:g} ms/step", on_clock(rows, ms))
                for (label, rows), ms in zip(runs, clock)]  # fmt: skip
        log.info(
            "time axis: steps x the given solo step times (--step-ms), not the runs' own train_s"
        )
    target, lines = summary(runs, target)
    for line in lines:
        log.info(line)
    png = Path(out) if out is not None else Path(paths[0]) / "compare.png"
    if png.is_dir():  # matplotlib wrote DIR.png beside it, and the log named DIR (`--out ""`: .)
        raise CompareError(f"--out {png} is a folder; name the image, e.g. {png / 'compare.png'}")
    try:
        plot(runs, png, target)
    except ImportError:
        raise CompareError("the plot needs matplotlib (pip install matplotlib); the table above "
                           "is complete without it") from None  # fmt: skip
    except OSError as e:
        raise CompareError(f"cannot write {png} ({e.strerror or e}); pick another --out") from None
    log.info(f"validation curves (vs training seconds and vs bytes) written to {png}")
    return 0
