"""Gate 7: both halves of a launch mismatch are refused, by the function and by the CLI."""

from __future__ import annotations

import subprocess
import sys

from gates.cache import work_dir
from gates.fixtures import corpus_path
from gates.spawn import launch_env
from gates.status import Record, environment

#: Not a fleet claim: `python -m gates --cuda-fleet` runs it as it is.
CUDA = False

CLAIM = "launch mismatches refused (both halves)"
INSTRUMENT = ("check_launch on (--dist, WORLD_SIZE unset/1) and (no --dist, WORLD_SIZE=2), then "
              "`python -m dormouse train tiny` in both situations: exit code and stderr")  # fmt: skip


def _cli(args: list[str], extra_env: dict) -> subprocess.Popen:
    env = launch_env()  # no inherited fleet variables; the repo on PYTHONPATH
    env.update(extra_env)
    return subprocess.Popen([sys.executable, "-m", "dormouse", "train", "tiny", *args],
                            cwd=work_dir("launch"), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def run(cuda: bool = False) -> Record:
    from dormouse.train.fleet.launch import LaunchError, check_launch

    # What torchrun --nproc_per_node=N sets, so each case differs from a real launch only in
    # the one fact under test.
    one = {"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29500"}  # fmt: skip
    two = dict(one, WORLD_SIZE="2")
    cases = {
        "--dist, WORLD_SIZE unset": (True, {}, ("WORLD_SIZE", "torchrun")),
        "--dist, torchrun nproc 1": (True, one, ("WORLD_SIZE=1", "torchrun")),
        "torchrun nproc 2, no --dist": (False, two, ("--dist", "WORLD_SIZE=2")),
    }
    notes, ok = [], True
    for name, (flag, env, must) in cases.items():
        try:
            check_launch(flag, env)
            ok = False
            notes.append(f"{name}: accepted")
        except LaunchError as e:
            named = all(m in str(e) for m in must)
            ok &= named
            notes.append(f"{name}: refused" + ("" if named else " (message lacks cause/escape)"))
    controls = (check_launch(False, {}), check_launch(True, two))
    ok &= controls == (False, True)
    data = ["--device", "cpu", "--data", str(corpus_path()), "--steps", "1"]
    procs = {
        "cli --dist, torchrun nproc 1": (_cli(["--dist", *data], one), "WORLD_SIZE=1"),
        "cli torchrun nproc 2, no --dist": (_cli(data, two), "--dist"),
    }
    for name, (p, must) in procs.items():
        out, err = p.communicate(timeout=120)
        refused = p.returncode == 2 and must in err and "step=" not in out
        ok &= refused
        notes.append(
            f"{name}: exit {p.returncode}" + ("" if refused else f" ({err.strip()[-200:]})")
        )
    return Record(
        "g07_launch",
        CLAIM,
        INSTRUMENT,
        "; ".join(notes) + f"; controls {controls}",
        "every mismatch refused with cause and escape (CLI: exit 2, no step run); the two "
        "consistent launches accepted",
        ok,
        environment("none", "cpu"),
    )
