"""`python -m dormouse bench {step,profile,optim,...}`: benchmarks that print a table, never tests.

Owns the command and what its sub-benchmarks (step.py, profile.py, optim.py, memory.py, shards.py,
fleet.py, warm.py, kernels.py, race.py, moe.py: each adds its flags and returns its report; no sub-command means
step) share: the machine lines, the timer, the table, --out, and a preset's model and training
step built as `train` builds them (common.py). step's own helpers: flops.py (the FLOPs beyond
6N, the measured matmul peak) and parts.py (the step's parts timed alone).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..errors import UserError
from .common import command_line

log = logging.getLogger(__name__)


def _parser() -> argparse.ArgumentParser:
    from . import fleet, kernels, memory, moe, optim, profile, race, shards, step, warm

    ap = argparse.ArgumentParser(
        prog="dormouse bench",
        description=__doc__.splitlines()[0],
        epilog="No sub-command runs step: `dormouse bench [PRESET ...] [flags]`.",
    )
    sub = ap.add_subparsers(
        dest="bench", metavar="{step,profile,optim,memory,shards,fleet,warm,kernels,race,moe}"
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    common.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, as in train",
    )
    common.add_argument("--out", help="also write the markdown report to this file")
    for mod in (step, profile, optim, memory, shards, fleet, warm, kernels, race, moe):
        first = mod.__doc__.splitlines()[0]  # "name: what it measures"
        p = sub.add_parser(
            first.split(":")[0], parents=[common], help=first.split(": ", 1)[1], description=first
        )
        mod.add_args(p)
        p.set_defaults(run=mod.run)
    return ap


def main_bench(argv: list[str]) -> int:
    """`python -m dormouse bench [step|profile|optim|memory|shards|fleet|warm|kernels|race|moe]
    [flags]`: print (and --out) a report."""
    argv = list(argv[1:] if argv[:1] == ["--"] else argv)
    if not argv or argv[0] not in (
        "step",
        "profile",
        "optim",
        "memory",
        "shards",
        "fleet",
        "warm",
        "kernels",
        "race",
        "moe",
        "-h",
        "--help",
    ):
        argv = ["step", *argv]  # the default sub-benchmark
    args = _parser().parse_args(argv)

    try:  # progress through the logger (stderr); the table on stdout
        text = args.run(args, command_line(argv))
    except UserError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    print(text, end="", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
        log.info(f"written to {args.out}")
    return 0
