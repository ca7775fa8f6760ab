"""Faults, round 3: nothing outside a run folder is touched, nothing inside it is lost, every
bad input is one line. Each case runs the CLI as a user would (`python -m dormouse ...` in a
child process, the tiny preset, a corpus written here) and checks the exit code, the one line
on stderr (no traceback) and, by hash, that no file outside the run folder changed. The
full-disk cases set a real limit in the child (RLIMIT_FSIZE: a write past it fails with EFBIG,
which torch's zip writer reports as RuntimeError 'unexpected pos'), never a mock.

docs/reliability.md (the run folder, round 3) lists every case with the test that holds it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dormouse.config import Optim, preset
from dormouse.train.store import checkpoint as ckpt

# every case runs the CLI in child processes (~5-45 s each): the slow tier of .ci/run
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
HOST = socket.gethostname()
SMALL = ["--device", "cpu", "--set", "batch=2", "--set", "seq_len=32"]
#: The tiny preset's checkpoint is 1.55 MB at these settings: a limit of LIMIT bytes lets the
#: small files (config.json ~2 KB, metrics rows, the lock) through and stops a checkpoint.
LIMIT = 400_000


#: The corpus every run here trains on: this repository's sources, repeated to this length.
CORPUS_BYTES = 50_000


@pytest.fixture
def corpus(tmp_path, source_corpus) -> Path:
    return source_corpus(tmp_path, CORPUS_BYTES)


def _env(**extra: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
              "TORCHELASTIC_RESTART_COUNT"):  # fmt: skip
        env.pop(k, None)
    return {**env, **extra}


def _limit(nbytes: int | None):
    if nbytes is None:
        return None

    def set_limit() -> None:  # in the child, before it runs anything
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))

    return set_limit


def dm(*argv, cwd: Path, limit: int | None = None, env: dict | None = None,
       code: str | None = None, timeout: float = 600) -> subprocess.CompletedProcess:  # fmt: skip
    """`python -m dormouse ARGV` (or `python -c CODE ARGV`) as a user runs it."""
    head = ["-c", code] if code else ["-m", "dormouse"]
    return subprocess.run([sys.executable, *head, *map(str, argv)], cwd=cwd,
                          env=env or _env(), capture_output=True, text=True, timeout=timeout,
                          preexec_fn=_limit(limit))  # fmt: skip


def start(*argv, cwd: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "dormouse", *map(str, argv)], cwd=cwd,
                            env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)  # fmt: skip


def wait_for(p: subprocess.Popen, needle: str, limit: float = 300) -> list[str]:
    """Read p's stdout until a line holds `needle`; the lines read. A thread keeps reading
    the rest, so the child never blocks on a full pipe."""
    seen: list[str] = []
    t0 = time.monotonic()
    for line in p.stdout:
        seen.append(line)
        if needle in line:
            threading.Thread(target=lambda: seen.extend(p.stdout), daemon=True).start()
            return seen
        assert time.monotonic() - t0 < limit, "".join(seen[-20:])
    raise AssertionError(f"{needle!r} never came (exit {p.wait()}): {p.stderr.read()[-3000:]}")


def one_line(p, *needles: str) -> str:
    """Exit 2 and ONE line `dormouse: ...` on stderr holding every needle, no traceback."""
    err = p.stderr if isinstance(p.stderr, str) else p.stderr.read()
    assert p.returncode == 2, (p.returncode, err[-3000:])
    lines = [ln for ln in err.splitlines() if ln.startswith("dormouse:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    for n in needles:
        assert n in lines[0], lines[0]
    assert "weights_only=False" not in lines[0], lines[0]
    return lines[0]


def ok(p) -> str:
    assert p.returncode == 0 and "Traceback" not in p.stderr, (p.stdout[-2000:], p.stderr[-3000:])
    return p.stdout + p.stderr


def hashes(root: Path, *inside: Path) -> dict[str, str]:
    """sha256 of every file under root but those inside the given run folders (a link: where
    it points)."""
    skip = [os.path.realpath(d) for d in inside]
    out = {}
    for dirpath, dirs, files in os.walk(root):
        if any(os.path.realpath(dirpath) == s or os.path.realpath(dirpath).startswith(s + os.sep)
               for s in skip):  # fmt: skip
            dirs[:] = []
            continue
        for f in files + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
            p = os.path.join(dirpath, f)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = "link -> " + os.readlink(p)
            else:
                out[rel] = hashlib.sha256(Path(p).read_bytes()).hexdigest()
    return out


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def trained(tmp_path_factory, source_corpus) -> tuple[Path, Path]:
    """(a run folder of 2 steps with best.pt, its corpus): tests copy it."""
    d = tmp_path_factory.mktemp("trained")
    data = source_corpus(d, CORPUS_BYTES)
    ok(dm("train", "tiny", "--data", data, "--steps", 2, "--out", d / "run", *SMALL, "--set",
          "eval_every=1", cwd=d))  # fmt: skip
    return d / "run", data


def copy_run(trained, tmp: Path, name: str = "run") -> Path:
    shutil.copytree(trained[0], tmp / name, symlinks=True)
    return tmp / name


def train_args(data: Path, out: Path, steps: int, *extra) -> list:
    return ["train", "tiny", "--data", data, "--steps", steps, "--out", out, *SMALL, *extra]


def _sharded_run(folder: Path) -> Path:
    """A run folder holding a sharded checkpoint (format 3: a manifest and its shards
    directory), written by the same writer as an FSDP2 fleet's, in this one process."""
    from dormouse.model import DormouseModel
    from dormouse.train.optim.mix import MixOptimizer

    folder.mkdir()
    run = preset("tiny")
    torch.manual_seed(0)
    model = DormouseModel(run.model)
    opt = MixOptimizer(model, Optim(wd=0.0, ns_dtype="fp32", lr=0.01, opt="adamw"))
    ckpt.save_sharded(folder / "ckpt.pt", model, opt,
                      run=run, step=3, data_state={"kind": "stream", "step": 3},
                      data_fingerprint=None)  # fmt: skip
    (folder / "config.json").write_text(run.to_json())
    return folder / "ckpt.pt"


# ---- export: never replaces what it did not write ---------------------------------------------


def test_export_into_another_run_folder_is_refused(tmp_path, trained):
    """`export RUN --to OTHER_RUN/ckpt.pt` replaced the other (sharded) run's manifest and
    deleted its shards directory, exit 0."""
    run = copy_run(trained, tmp_path)
    other = tmp_path / "other"
    _sharded_run(other)
    before = hashes(tmp_path, run)
    for dest in (other / "ckpt.pt", other / "new.pt", other / "sub" / "x.pt"):
        one_line(dm("export", run, "--to", dest, cwd=tmp_path), f"--to {dest} is inside the "
                 f"run folder {other}", "export writes only outside run folders")  # fmt: skip
        one_line(dm("export", run, "--to", dest, "--overwrite", cwd=tmp_path), "inside the run")
    # into its own run folder too
    one_line(dm("export", run, "--to", run / "model.pt", cwd=tmp_path), "inside the run folder")
    assert hashes(tmp_path, run) == before
    assert not (run / "model.pt").exists()


def test_an_export_that_cannot_write_says_so_as_an_export(tmp_path, trained):
    """A write failure under export said the run writer's escape ('pick another --out, then
    --resume auto'), flags export does not have."""
    run = copy_run(trained, tmp_path)
    before = hashes(tmp_path, run)
    p = dm("export", run, "--to", tmp_path / "model.pt", cwd=tmp_path, limit=LIMIT)
    line = one_line(p, f"export could not write --to {tmp_path / 'model.pt'}", "ulimit -f",
                    f"{run / 'ckpt.pt'} is untouched")  # fmt: skip
    assert "--resume" not in line and "--out" not in line, line
    assert not (tmp_path / "model.pt").exists() and hashes(tmp_path, run) == before


def test_export_never_replaces_a_file_it_did_not_write(tmp_path, trained):
    """`export RUN --to notes.txt` (an existing file) overwrote it, exit 0."""
    run = copy_run(trained, tmp_path)
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    before = hashes(tmp_path, run)
    one_line(dm("export", run, "--to", notes, cwd=tmp_path), f"--to {notes} exists",
             "never replaces a file it did not write", "--overwrite")  # fmt: skip
    assert hashes(tmp_path, run) == before
    # asked for: replaced, by a checkpoint that loads
    ok(dm("export", run, "--to", notes, "--overwrite", cwd=tmp_path))
    assert ckpt.read_checkpoint(notes)["step"] == 2
    # a link at --to is replaced by the new file; what it points to stays as it was
    target = tmp_path / "target.pt"
    target.write_bytes(b"not yours")
    (tmp_path / "link.pt").symlink_to(target)
    one_line(dm("export", run, "--to", tmp_path / "link.pt", cwd=tmp_path), "exists")
    ok(dm("export", run, "--to", tmp_path / "link.pt", "--overwrite", cwd=tmp_path))
    assert target.read_bytes() == b"not yours" and not (tmp_path / "link.pt").is_symlink()


# ---- one writer a folder ----------------------------------------------------------------------


def test_two_trains_into_one_folder_at_once_one_is_refused(tmp_path, corpus):
    """Two `train --out runs/cc` started at the same moment (the second with another lr) both
    exited 0: ckpt.pt was the second's while the first reported it as its own, and
    metrics.jsonl held interleaved rows with repeated steps."""
    out = tmp_path / "runs" / "cc"
    before = hashes(tmp_path, out)
    argv = train_args(corpus, out, 40, "--set", "eval_every=0", "--set", "log_every=1")
    a = start(*argv, cwd=tmp_path)
    b = start(*argv, "--set", "lr=5e-4", cwd=tmp_path)
    for p in (a, b):
        p.wait(timeout=600)
    won, lost = (a, b) if a.returncode == 0 else (b, a)
    assert won.returncode == 0, won.stderr.read()[-3000:]
    one_line(lost, f"{out} is in use by another dormouse process (pid {won.pid} on host "
             f"{HOST}", "one writer")  # fmt: skip
    lr = 1e-3 if won is a else 5e-4
    assert ckpt.read_checkpoint(out / "ckpt.pt")["run"].train.lr == lr
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == list(range(1, 41))
    assert hashes(tmp_path, out) == before


def test_a_second_writer_is_refused_naming_the_live_holder(tmp_path, trained):
    """A second train, an elastic restart and an `export --to` into a folder a live run holds
    are each refused in one line naming its pid and host; the live run goes on unharmed."""
    data = trained[1]
    out = tmp_path / "run"
    before = hashes(tmp_path, out)
    a = start(*train_args(data, out, 100000, "--set", "eval_every=0", "--set", "ckpt_every=5"),
              cwd=tmp_path)  # fmt: skip
    try:
        wait_for(a, "step=5 ")
        holder = f"in use by another dormouse process (pid {a.pid} on host {HOST}"
        one_line(dm(*train_args(data, out, 100, "--set", "lr=5e-4"), cwd=tmp_path), holder)
        one_line(dm(*train_args(data, out, 100000, "--resume", "auto"), cwd=tmp_path,
                    env=_env(TORCHELASTIC_RESTART_COUNT="1")), holder)  # fmt: skip
        one_line(dm("export", trained[0], "--to", out / "x.pt", cwd=tmp_path), holder)
        one_line(dm(*train_args(data, out, 100, "--dry-run"), cwd=tmp_path), holder)
        assert not (out / "x.pt").exists()
    finally:
        a.send_signal(signal.SIGTERM)  # the live run stops cleanly: a checkpoint at its step
        a.wait(timeout=120)
    assert ckpt.read_checkpoint(out / "ckpt.pt")["run"].train.lr == 1e-3
    assert hashes(tmp_path, out) == before


def test_a_refused_run_leaves_no_folder_behind(tmp_path, corpus):
    """The lock is taken before anything is read: a new folder a refusal left would be one
    more folder the user never asked for."""
    out = tmp_path / "new"
    one_line(dm(*train_args(corpus, out, 2, "--resume"), cwd=tmp_path), "no checkpoint")
    assert not out.exists()


# ---- nothing outside the run folder is written ------------------------------------------------


@pytest.mark.parametrize("name, mode", [("config.json", "fresh"), ("metrics.jsonl", "fresh"),
                                        ("config.json", "auto"), ("metrics.jsonl", "auto"),
                                        ("ckpt.pt", "auto"), ("loss.png", "auto"),
                                        ("dormouse.lock", "auto")])  # fmt: skip
def test_links_where_our_files_belong_are_refused(tmp_path, trained, name, mode):
    """`runs/x/config.json` or `metrics.jsonl` a symlink to a file elsewhere, then `train
    --out runs/x` (fresh or --resume auto): the file elsewhere was overwritten / truncated."""
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("the user's own file\n")
    if mode == "fresh":
        out = tmp_path / "runs" / "x"
        out.mkdir(parents=True)
        extra = []
    else:
        out = copy_run(trained, tmp_path)
        (out / name).unlink()
        extra = ["--resume", "auto"]
    (out / name).symlink_to(elsewhere)
    before = hashes(tmp_path)
    one_line(dm(*train_args(trained[1], out, 4, *extra), cwd=tmp_path),
             f"{out / name} is a symbolic link", "remove the link")  # fmt: skip
    assert hashes(tmp_path) == before


def test_a_link_made_during_the_run_is_never_written_through(tmp_path, trained):
    """metrics.jsonl replaced by a link to a file elsewhere while the run goes on: the append
    refuses to follow it (O_NOFOLLOW); a warning, the run completes, the file elsewhere as it
    was."""
    out = tmp_path / "run"
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("the user's own file\n")
    before = hashes(tmp_path, out)
    a = start(*train_args(trained[1], out, 30, "--set", "eval_every=0", "--set", "log_every=1"),
              cwd=tmp_path)  # fmt: skip
    lines = wait_for(a, "step=2 ")
    os.replace(out / "metrics.jsonl", tmp_path / "moved.jsonl")
    (out / "metrics.jsonl").symlink_to(elsewhere)
    assert a.wait(timeout=600) == 0, a.stderr.read()[-3000:]
    time.sleep(0.5)  # the reader thread takes the last lines
    said = "".join(lines) + a.stderr.read()
    assert "Traceback" not in said, said[-3000:]
    assert f"could not append to {out / 'metrics.jsonl'} (Too many levels of symbolic" in said
    assert f"{out / 'loss.png'} not drawn" in said
    assert hashes(tmp_path, out) == {**before, "moved.jsonl": digest(tmp_path / "moved.jsonl")}
    assert ckpt.read_checkpoint(out / "ckpt.pt")["step"] == 30


def test_the_run_folder_is_resolved_once(tmp_path, trained):
    """--out through a link: the folder is resolved at start, so a link swapped mid-run moves
    no write to the new target."""
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    a_dir.mkdir()
    b_dir.mkdir()
    link = tmp_path / "out"
    link.symlink_to(a_dir)
    p = start(*train_args(trained[1], link, 20, "--set", "eval_every=0", "--set", "log_every=1"),
              cwd=tmp_path)  # fmt: skip
    wait_for(p, "step=2 ")
    tmp = tmp_path / "out.new"
    tmp.symlink_to(b_dir)
    os.replace(tmp, link)
    assert p.wait(timeout=600) == 0, p.stderr.read()[-3000:]
    assert list(b_dir.iterdir()) == []
    assert ckpt.read_checkpoint(a_dir / "ckpt.pt")["step"] == 20


def test_out_in_a_users_folder_is_refused_unless_overwrite(tmp_path, trained):
    """`--out .` in a folder holding the user's own config.json overwrote it."""
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "config.json").write_text('{"my": "settings"}\n')
    (mine / "notes.md").write_text("mine\n")
    before = hashes(tmp_path)
    one_line(dm(*train_args(trained[1], ".", 2), cwd=mine), "--out . holds 2 entries",
             "no dormouse run", "--overwrite")  # fmt: skip
    assert hashes(tmp_path) == before
    # said on purpose: trained there
    ok(dm(*train_args(trained[1], ".", 2, "--overwrite"), cwd=mine))
    assert ckpt.read_checkpoint(mine / "ckpt.pt")["step"] == 2
    assert (mine / "notes.md").read_text() == "mine\n"


# ---- nothing inside is lost -------------------------------------------------------------------


def test_resume_auto_keeps_the_rows_of_a_run_that_wrote_no_checkpoint(tmp_path, trained):
    """A folder with metrics.jsonl and no checkpoint (a run killed before its first one): the
    refusal suggested --resume auto, which then erased the rows silently."""
    out = tmp_path / "run"
    a = start(*train_args(trained[1], out, 100000, "--set", "eval_every=0", "--set",
                          "log_every=1"), cwd=tmp_path)  # fmt: skip
    wait_for(a, "step=10 ")  # (step 9's row is written after its log line)
    a.kill()
    a.wait()
    assert not (out / "ckpt.pt").exists()
    rows = (out / "metrics.jsonl").read_bytes()
    n = len(rows.splitlines())
    assert n >= 9
    before = hashes(tmp_path, out)
    one_line(dm(*train_args(trained[1], out, 4), cwd=tmp_path), f"({n} rows)",
             "--resume auto to start afresh keeping them")  # fmt: skip
    said = ok(dm(*train_args(trained[1], out, 4, "--resume", "auto"), cwd=tmp_path))
    assert "are kept in metrics.1.jsonl" in said
    assert (out / "metrics.1.jsonl").read_bytes() == rows
    assert ckpt.read_checkpoint(out / "ckpt.pt")["step"] == 4
    assert hashes(tmp_path, out) == before


def test_a_full_disk_at_the_checkpoint_is_one_line_and_keeps_the_last(tmp_path, trained):
    """A real limit at the checkpoint write (ulimit -f): torch.save failed mid-archive with
    RuntimeError 'unexpected pos', which the OSError branch never saw: rc 1 and 40 lines."""
    out = copy_run(trained, tmp_path)
    kept = digest(out / "ckpt.pt")
    before = hashes(tmp_path, out)
    # ckpt_every=1: the step-3 checkpoint comes before the final evaluation's best.pt
    p = dm(*train_args(trained[1], out, 4, "--resume", "auto", "--set", "ckpt_every=1"),
           cwd=tmp_path, limit=LIMIT)  # fmt: skip
    one_line(p, f"could not write {out / 'ckpt.pt'} at step 3: File too large",
             f"ulimit -f: {LIMIT} bytes", "previous checkpoint there is untouched",
             "--resume auto")  # fmt: skip
    assert digest(out / "ckpt.pt") == kept
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]
    # freed: the same command goes on from the kept checkpoint
    ok(dm(*train_args(trained[1], out, 4, "--resume", "auto", "--set", "eval_every=0"),
          cwd=tmp_path))  # fmt: skip
    assert ckpt.read_checkpoint(out / "ckpt.pt")["step"] == 4
    assert hashes(tmp_path, out) == before


def test_a_full_disk_at_best_pt_is_one_line(tmp_path, trained):
    out = copy_run(trained, tmp_path)
    kept = {f: digest(out / f) for f in ("ckpt.pt", "best.pt")}
    before = hashes(tmp_path, out)
    p = dm(*train_args(trained[1], out, 8, "--resume", "auto", "--set", "eval_every=1"),
           cwd=tmp_path, limit=LIMIT)  # fmt: skip
    one_line(p, f"could not write {out / 'best.pt'}", "File too large",
             "previous checkpoint there is untouched")  # fmt: skip
    assert {f: digest(out / f) for f in kept} == kept
    assert hashes(tmp_path, out) == before


def test_a_full_disk_at_a_metrics_append_warns_and_the_run_goes_on(tmp_path, trained):
    """metrics.jsonl reaches the limit (padded to just under it with valid rows); the
    checkpoint still fits. Old: a traceback."""
    out = copy_run(trained, tmp_path)
    limit = 2_000_000  # above the checkpoint's 1.55 MB
    pad = json.dumps({"kind": "note", "step": 0, "pad": "x" * 1000}) + "\n"
    size = (out / "metrics.jsonl").stat().st_size
    with (out / "metrics.jsonl").open("a") as f:
        while size + len(pad) < limit - 300:  # room for a few rows of ~250 bytes, not 12
            size += f.write(pad)
    before = hashes(tmp_path, out)
    said = ok(dm(*train_args(trained[1], out, 14, "--resume", "auto", "--set", "eval_every=0",
                             "--set", "log_every=1"), cwd=tmp_path, limit=limit))  # fmt: skip
    assert f"could not append to {out / 'metrics.jsonl'} (File too large" in said
    assert "training goes on" in said and "row(s) could not be written" in said
    assert ckpt.read_checkpoint(out / "ckpt.pt")["step"] == 14
    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert all(json.loads(x) for x in lines)  # whole rows only: no half row left behind
    assert hashes(tmp_path, out) == before


def test_held_metrics_rows_are_written_once_the_file_takes_them(tmp_path):
    """The rows a failed append kept go out with the next append that succeeds, in order
    (the failure here: a link put in the file's place, refused by O_NOFOLLOW, then undone)."""
    from dormouse.train.store.folder import Metrics

    path = tmp_path / "metrics.jsonl"
    m = Metrics(path)
    m.write("train", 1, {"loss": 1.0})
    path.rename(tmp_path / "real.jsonl")
    path.symlink_to(tmp_path / "real.jsonl")
    for step in (2, 3):
        m.write("train", step, {"loss": 1.0})
    held = (tmp_path / "real.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in held] == [1]
    path.unlink()
    (tmp_path / "real.jsonl").rename(path)
    m.write("train", 4, {"loss": 1.0})
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [1, 2, 3, 4]
    assert m.pending == []


PLOT_FULL = """\
import resource, sys
import matplotlib.figure as mf
real = mf.Figure.savefig
def savefig(self, *a, **k):  # the disk fills as loss.png is written: a real limit from here
    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))
    return real(self, *a, **k)
mf.Figure.savefig = savefig
from dormouse.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_full_disk_at_loss_png_warns_and_the_run_is_complete(tmp_path, trained):
    out = copy_run(trained, tmp_path)
    png = digest(out / "loss.png")
    before = hashes(tmp_path, out)
    said = ok(dm(*train_args(trained[1], out, 4, "--resume", "auto", "--set", "eval_every=0"),
                 cwd=tmp_path, code=PLOT_FULL))  # fmt: skip
    assert f"warning: {out / 'loss.png'} not written (File too large" in said, said[-2000:]
    assert "the run and its checkpoint are complete" in said
    assert ckpt.read_checkpoint(out / "ckpt.pt")["step"] == 4
    assert digest(out / "loss.png") == png  # the previous image, whole
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]
    assert hashes(tmp_path, out) == before


def test_a_full_disk_at_config_json_is_one_line(tmp_path, corpus):
    out = tmp_path / "run"
    before = hashes(tmp_path, out)
    p = dm(*train_args(corpus, out, 2), cwd=tmp_path, limit=1000)  # config.json is ~2 KB
    one_line(p, f"could not write {out / 'config.json'} (File too large", "nothing was trained")
    assert hashes(tmp_path, out) == before


# ---- bounds ------------------------------------------------------------------------------------


def test_eval_batches_past_the_val_split_are_clamped(tmp_path, trained):
    """`eval CKPT --batches 1000000000` and `train --set eval_batches=1000000000`: no output,
    memory 0.7 -> 4.9 GB in 30 s, killed."""
    run = copy_run(trained, tmp_path)
    before = hashes(tmp_path, run)
    t0 = time.monotonic()
    said = ok(dm("eval", run / "ckpt.pt", "--batches", 1_000_000_000, "--device", "cpu",
                 cwd=tmp_path, timeout=300))  # fmt: skip
    # the val split: the last 1% of 50000 bytes, 500 bytes, is covered once by 8 batches of
    # 2 x 32 targets: more asked scores the whole split once (round 4: were overlapping ones)
    assert "--batches 1000000000 is at least the 8 batches" in said
    assert "scoring the whole split" in said and "eval checkpoint=" in said
    said = ok(dm(*train_args(trained[1], tmp_path / "r2", 1, "--set", "eval_batches=1000000000",
                             "--set", "eval_every=0"), cwd=tmp_path, timeout=300))  # fmt: skip
    assert "val batches: 1000000000 asked" in said and "done: steps=1" in said
    assert time.monotonic() - t0 < 300
    assert hashes(tmp_path, run, tmp_path / "r2") == before


def test_plan_world_has_a_ceiling(tmp_path):
    """`plan small --fit 16 --world 1000000000` did not finish in 300 s (100000: 222 s)."""
    t0 = time.monotonic()
    one_line(dm("plan", "small", "--fit", 16, "--world", 1_000_000_000, cwd=tmp_path,
                timeout=60), "--world 1000000000", "at most 65536 ranks")  # fmt: skip
    said = ok(dm("plan", "small", "--fit", 16, "--world", 4096, cwd=tmp_path, timeout=120))
    assert "fleet plan: 4096 rank(s)" in said and "\n4095 " in said
    assert time.monotonic() - t0 < 150


def test_sample_bytes_has_a_ceiling(tmp_path, trained):
    one_line(
        dm(
            "sample",
            trained[0] / "ckpt.pt",
            "--bytes",
            1_000_000_000,
            "--device",
            "cpu",
            cwd=tmp_path,
            timeout=60,
        ),
        "--bytes 1000000000",
        "at most 1048576 bytes",
    )


# ---- damaged files are one line ---------------------------------------------------------------


def _tamper(shard: Path, how: str, tmp: Path) -> None:
    if how == "bytes":  # the same size, other bytes in the middle (a tensor's record)
        raw = bytearray(shard.read_bytes())
        mid = len(raw) // 2
        raw[mid : mid + 64] = b"\xff" * 64
        shard.write_bytes(bytes(raw))
    elif how == "truncated":
        os.truncate(shard, shard.stat().st_size // 2)
    else:  # a link to a copy elsewhere
        copy = tmp / "elsewhere.distcp"
        shutil.copy(shard, copy)
        shard.unlink()
        shard.symlink_to(copy)


@pytest.mark.parametrize("how", ["bytes", "truncated", "link"])
def test_a_damaged_shard_is_one_line_naming_it(tmp_path, corpus, how):
    """A tampered, truncated or symlinked .distcp shard: a 22-line refusal embedding torch's
    traceback and its advice to re-run with weights_only=False."""
    path = _sharded_run(tmp_path / "run")
    shard = min(ckpt.read_checkpoint(path)["shards_dir"].glob("*.distcp"))
    _tamper(shard, how, tmp_path)
    before = hashes(tmp_path, tmp_path / "run")
    for argv in (["eval", path, "--device", "cpu", "--data", corpus],
                 ["export", tmp_path / "run", "--to", tmp_path / "one.pt"]):  # fmt: skip
        line = one_line(dm(*argv, cwd=tmp_path), f"the shard {shard}", "damaged")
        assert len(line) < 600, line
    assert hashes(tmp_path, tmp_path / "run") == before
    assert not (tmp_path / "one.pt").exists()


def test_a_ckpt_name_out_of_the_run_folder_is_refused(tmp_path, trained):
    """config.json's ckpt_name = ../../elsewhere/ckpt, then export: a checkpoint from outside
    the run folder was exported."""
    run = copy_run(trained, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(run / "ckpt.pt", elsewhere / "ckpt.pt")
    cfg = json.loads((run / "config.json").read_text())
    cfg["train"]["ckpt_name"] = "../elsewhere/ckpt"
    (run / "config.json").write_text(json.dumps(cfg))
    before = hashes(tmp_path, run)
    one_line(
        dm("export", run, "--to", tmp_path / "out.pt", cwd=tmp_path),
        f"{run / 'config.json'} is not a dormouse run config",
        "not a plain file name",
    )
    assert not (tmp_path / "out.pt").exists() and hashes(tmp_path, run) == before


def _rewrite(path: Path, **changes) -> None:
    raw = torch.load(path, weights_only=True)
    for k, v in changes.items():
        if "." in k:
            a, b = k.split(".")
            raw[a][b] = v
        else:
            raw[k] = v
    torch.save(raw, path)


@pytest.mark.parametrize("entry, value, needle", [
    ("rng", "x", "its 'rng' entry is damaged"),
    ("extra.best_loss", "abc", "its 'extra' entry is damaged"),
    ("data", {"kind": "stream", "step": "2"}, "its 'data' entry is damaged"),
    ("format", 99, "checkpoint format 99, which this dormouse does not know"),  # was read
])  # fmt: skip
def test_tampered_checkpoint_entries_are_one_line(tmp_path, trained, entry, value, needle):
    """manifest rng="x" or extra.best_loss="abc": tracebacks on resume (and eval)."""
    run = copy_run(trained, tmp_path)
    _rewrite(run / "ckpt.pt", **{entry: value})
    sharded = _sharded_run(tmp_path / "sharded")
    _rewrite(sharded, **{entry: [value] if entry == "rng" else value})
    before = hashes(tmp_path, run, sharded.parent)
    one_line(dm(*train_args(trained[1], run, 4, "--resume", "auto"), cwd=tmp_path),
             f"{run / 'ckpt.pt'}: {needle}", "resume from another checkpoint")  # fmt: skip
    one_line(dm("eval", sharded, "--device", "cpu", "--data", trained[1], cwd=tmp_path), needle)
    assert hashes(tmp_path, run, sharded.parent) == before


def test_eval_and_sample_of_a_run_folder_name_its_checkpoints(tmp_path, trained):
    """`eval RUN` said only that RUN is a directory."""
    run = copy_run(trained, tmp_path)
    for cmd in ("eval", "sample"):
        one_line(dm(cmd, run, cwd=tmp_path), f"{run} is a directory, not a checkpoint file",
                 f"pass one of its checkpoints: {run / 'best.pt'}, {run / 'ckpt.pt'}")  # fmt: skip


def test_a_model_tensor_of_another_shape_is_one_line(tmp_path, trained):
    """embed.weight replaced by a [3] tensor: torch's load_state_dict traceback on eval,
    sample and resume."""
    run = copy_run(trained, tmp_path)
    raw = torch.load(run / "ckpt.pt", weights_only=True)
    raw["model"]["embed.weight"] = torch.zeros(3)
    torch.save(raw, run / "ckpt.pt")
    needle = "1 tensor(s) of another shape, embed.weight (3,) (the model's (256,"
    one_line(dm("eval", run / "ckpt.pt", "--device", "cpu", "--data", trained[1],
                cwd=tmp_path), needle)  # fmt: skip
    one_line(dm(*train_args(trained[1], run, 4, "--resume", "auto"), cwd=tmp_path), needle)


def test_a_damaged_metrics_row_is_one_line_on_resume(tmp_path, trained):
    """A metrics row `{"kind": "train", "step": 1}` (no loss), then resume: a traceback when
    the loss curve was drawn at the end."""
    run = copy_run(trained, tmp_path)
    text = (run / "metrics.jsonl").read_text()
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n' + text)
    kept = digest(run / "ckpt.pt")
    one_line(dm(*train_args(trained[1], run, 4, "--resume", "auto"), cwd=tmp_path),
             f"{run / 'metrics.jsonl'}: line 1 is a 'train' row without a numeric loss",
             "damaged")  # fmt: skip
    assert digest(run / "ckpt.pt") == kept


def test_compare_on_a_damaged_config_or_metrics_is_one_line(tmp_path, trained):
    """`compare` on a config.json `[1, 2]` or a metrics.jsonl with a byte 0xff: tracebacks."""
    a = copy_run(trained, tmp_path, "a")
    b = copy_run(trained, tmp_path, "b")
    (b / "config.json").write_text("[1, 2]")
    out = tmp_path / "c.png"
    one_line(dm("compare", a, b, "--out", out, cwd=tmp_path), f"{b / 'config.json'} is not a "
             "dormouse run config", "damaged")  # fmt: skip
    (b / "config.json").write_bytes((a / "config.json").read_bytes())
    raw = (b / "metrics.jsonl").read_bytes()
    (b / "metrics.jsonl").write_bytes(raw[:10] + b"\xff" + raw[10:])
    one_line(dm("compare", a, b, "--out", out, cwd=tmp_path), f"{b / 'metrics.jsonl'}: line 1 "
             "is not UTF-8", "damaged")  # fmt: skip
    assert not out.exists()


# ---- the fleet ---------------------------------------------------------------------------------


class Fleet:
    """`torchrun --nproc_per_node=2 -m dormouse train tiny --dist` with each worker's output in
    its own file, in its own session."""

    def __init__(self, tmp: Path, data: Path, out: Path, *sets: str):
        self.logs = tmp / "logs"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", "--log-dir", str(self.logs), "--redirects", "3",
               "-m", "dormouse", *map(str, train_args(data, out, 100000)), "--dist",
               "--set", "eval_every=0", "--set", "ckpt_every=5", "--set", "log_every=1",
               *[x for s in sets for x in ("--set", s)]]  # fmt: skip
        self.p = subprocess.Popen(
            cmd,
            cwd=tmp,
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.pids: list[int] = []

    def log(self, rank: int, name: str) -> str:
        found = sorted(self.logs.glob(f"*/attempt_0/{rank}/{name}.log"))
        return found[0].read_text(errors="replace") if found else ""

    def workers(self, step: int, limit: float = 300) -> list[int]:
        """The workers' pids in rank order, once rank 0 logged `step`."""
        from test_fleet_faults import _children, _rank_of

        t0 = time.monotonic()
        while f"step={step} " not in self.log(0, "stdout"):
            assert self.p.poll() is None, self.log(0, "stderr")[-3000:]
            assert time.monotonic() - t0 < limit, "the fleet never reached the step"
            time.sleep(0.05)
        self.pids = sorted(_children(self.p.pid), key=_rank_of)
        return self.pids

    def stderr_line(self, rank: int, needle: str, limit: float) -> str:
        """The first line of rank's stderr holding `needle`, waited for up to `limit` seconds
        (and half a second more, so the line is whole)."""
        t0 = time.monotonic()
        while needle not in self.log(rank, "stderr"):
            assert time.monotonic() - t0 < limit, self.log(rank, "stderr")[-2000:]
            time.sleep(0.1)
        time.sleep(0.5)
        return next(ln for ln in self.log(rank, "stderr").splitlines() if needle in ln)

    def close(self) -> None:
        # the workers too, one by one: torchrun may start them in sessions of their own, and
        # a SIGSTOPped one outlived the agent's group (left stopped after the suite)
        for pid in [self.p.pid, *self.pids]:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    (os.killpg if pid == self.p.pid else os.kill)(pid, sig)
        self.p.wait(timeout=60)


def test_under_torchrun_rank_0_alone_holds_the_folder(tmp_path, corpus):
    """Both ranks run the CLI on one --out; rank 0 holds the lock (rank 1 would be refused if
    it took it too), and a second writer is refused naming rank 0."""
    out = tmp_path / "run"
    fleet = Fleet(tmp_path, corpus, out)
    try:
        rank0, _ = fleet.workers(5)
        one_line(dm(*train_args(corpus, out, 10, "--set", "lr=5e-4"),
                    cwd=tmp_path), f"pid {rank0} on host {HOST}")  # fmt: skip
    finally:
        fleet.close()


#: The fleet's dist_timeout in the stopped-rank case: its heartbeat pulses every timeout/10
#: = 1 s, many steps of a 2-rank tiny fleet, so a step said only at a pulse lags the real one.
STOP_TIMEOUT_S = 10


def test_the_watchdog_names_the_peers_real_last_step(tmp_path, corpus):
    """One rank SIGSTOPped: the survivor's line named the peer's last heartbeat as step 0/1
    while it was at step 5/6 (a pulse every min(2 s, dist_timeout/10) said an old step)."""
    fleet = Fleet(tmp_path, corpus, tmp_path / "run", f"dist_timeout={STOP_TIMEOUT_S}")
    try:
        _, rank1 = fleet.workers(30)
        os.kill(rank1, signal.SIGSTOP)
        line = fleet.stderr_line(0, "fleet watchdog on rank 0", STOP_TIMEOUT_S + 20)
    finally:
        fleet.close()
    peer = int(re.search(r"its last heartbeat: step (\d+)", line)[1])
    mine = int(re.search(r"This rank was at step (\d+)", line)[1])
    # lockstep: rank 0 waits in step `mine` for rank 1, which stopped in it or the one before
    # (and its record, written as it moved, may miss the very last move)
    assert mine - 2 <= peer <= mine, line


def test_a_heartbeat_says_a_new_step_at_once():
    """The pulse writes this rank's record when its step moves, not an interval later."""
    from dormouse.train.fleet.watchdog import Heartbeat

    store = torch.distributed.HashStore()
    hb = Heartbeat(0, 2, 100.0, lambda: store, "t")  # a pulse every 2 s
    hb.start()
    try:
        time.sleep(0.2)
        for step in (5, 6, 7):
            hb.at(step, "train")
            time.sleep(0.1)
            assert json.loads(store.get("t/beat/0"))["step"] == step
    finally:
        hb.leave("done")
