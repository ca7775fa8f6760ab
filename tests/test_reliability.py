"""Faults and bad input, one process: each case injects its fault and fails if the old
behaviour (lost data, a traceback, a silent reinterpretation) comes back.

docs/reliability.md lists every case with the test that holds it; the last test here
checks that each test named there exists.
"""

from __future__ import annotations

import ast
import errno
import json
import os
import re
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from trainlog import train

from dormouse.cli import main as cli_main
from dormouse.config import ConfigError, apply_sets, preset
from dormouse.errors import UserError
from dormouse.model import DormouseModel
from dormouse.model.sample import SampleError
from dormouse.train.data import DataError
from dormouse.train.loop import TrainingError
from dormouse.train.store import checkpoint as ckpt

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--device", "cpu", "--set", "batch=2", "--set", "seq_len=32"]


@pytest.fixture(autouse=True)
def _no_elastic(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)


@pytest.fixture
def corpus(tmp_path, source_corpus) -> Path:
    return source_corpus(tmp_path, 20_000)


def _cli(capsys, *argv) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        rc = cli_main([str(a) for a in argv])
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    got = capsys.readouterr()
    assert "Traceback" not in got.err
    return rc, got.out, got.err


def _train(capsys, corpus, out, *extra, steps=2):
    return _cli(capsys, "train", "tiny", "--data", corpus, "--steps", steps, "--out",
                out, *SMALL, *extra)  # fmt: skip


def _refused(rc, err, *needles):
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.startswith("dormouse:")]
    assert len(lines) == 1, err
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                 "allocate memory: you tried to allocate 131072 bytes. Error code 12"),
    MemoryError(),
])  # fmt: skip
def test_out_of_host_memory_is_one_line_not_a_traceback(tmp_path, corpus, capsys, monkeypatch,
                                                         error):  # fmt: skip
    """A model too large for the RAM (10^5 layers under `ulimit -v`): the CPU allocator's
    traceback. Injected where training starts."""
    import dormouse.train.run as run_mod

    def oom(*a, **k):
        raise error

    monkeypatch.setattr(run_mod, "train_run", oom)
    rc, _, err = _train(capsys, corpus, tmp_path / "run")
    _refused(rc, err, "out of host memory", "does not fit this machine's RAM", "--set batch")
    if isinstance(error, RuntimeError):
        assert "tried to allocate 131072 bytes" in err


def test_out_of_device_memory_is_one_line_not_a_traceback(tmp_path, corpus, capsys, monkeypatch):
    """A card too small for the request (b1 at 32 x 2048 with reduce-overhead died in torch's
    traceback inside the optimizer's graph capture): one line, exit 2, with what torch tried
    to allocate and the escapes. The OOM is injected where training starts."""
    import dormouse.train.run as run_mod

    def oom(*a, **k):
        raise torch.cuda.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
            "139.80 GiB of which 1.25 GiB is free."
        )

    monkeypatch.setattr(run_mod, "train_run", oom)
    rc, _, err = _train(capsys, corpus, tmp_path / "run")
    _refused(
        rc,
        err,
        "out of memory on the GPU",
        "Tried to allocate 2.00 GiB",
        "--set batch",
        "--fit GB",
        "compile_mode=default",
    )
    # any other exception is still a bug and keeps its traceback
    monkeypatch.setattr(run_mod, "train_run", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        cli_main(
            [
                "train",
                "tiny",
                "--data",
                str(corpus),
                "--steps",
                "2",
                "--out",
                str(tmp_path / "run2"),
                *SMALL,
            ]
        )


# ---- the run folder: never lose a run ------------------------------------------------------


def test_rerunning_train_into_a_run_folder_is_refused(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    assert _train(capsys, corpus, out)[0] == 0
    before = (out / "ckpt.pt").read_bytes(), (out / "metrics.jsonl").read_text()
    rc, _, err = _train(capsys, corpus, out, "--set", "lr=5e-4")  # another config, no --resume
    _refused(rc, err, "already holds a run", "--resume auto", "--overwrite", "lr 0.001 -> 0.0005")
    assert ((out / "ckpt.pt").read_bytes(), (out / "metrics.jsonl").read_text()) == before


def test_the_main_job_twice_is_a_no_op_the_second_time(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    assert _train(capsys, corpus, out)[0] == 0
    before = (out / "ckpt.pt").read_bytes(), (out / "metrics.jsonl").read_text()
    rc, said, _ = _train(capsys, corpus, out)  # the same command again
    assert rc == 0 and "already complete at step 2" in said
    assert ((out / "ckpt.pt").read_bytes(), (out / "metrics.jsonl").read_text()) == before
    assert _cli(capsys, "sample", out / "ckpt.pt", "--bytes", "4", "--device", "cpu")[0] == 0


def test_resume_auto_starts_fresh_or_continues(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    rc, said, _ = _train(capsys, corpus, out, "--resume", "auto")
    assert rc == 0 and "resumed" not in said
    rc, said, _ = _train(capsys, corpus, out, "--resume", "auto", steps=4)
    assert rc == 0 and "resumed from" in said and "at step 2" in said
    assert ckpt.read_checkpoint(out / "ckpt.pt")["step"] == 4


def test_plain_resume_means_must(tmp_path, corpus, capsys):
    rc, _, err = _train(capsys, corpus, tmp_path / "empty", "--resume")
    _refused(rc, err, "no checkpoint", "--resume auto")
    rc, _, err = _train(capsys, corpus, tmp_path / "empty", "--resume", "must", "--overwrite")
    _refused(rc, err, "pick one")


def test_overwrite_starts_afresh(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    assert _train(capsys, corpus, out, steps=3)[0] == 0
    rc, said, _ = _train(capsys, corpus, out, "--overwrite")
    assert rc == 0 and "--overwrite: starting afresh" in said
    assert ckpt.read_checkpoint(out / "ckpt.pt")["step"] == 2
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 2


def test_an_elastic_restart_resumes_by_itself(tmp_path, corpus, capsys, monkeypatch):
    out = tmp_path / "run"
    assert _train(capsys, corpus, out)[0] == 0
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    rc, said, _ = _train(capsys, corpus, out, "--overwrite", steps=4)  # the same command line
    assert rc == 0 and "elastic restart 1" in said and "resumed from" in said


def test_resume_of_a_checkpoint_beyond_steps_is_refused(tmp_path, corpus, capsys):
    out = tmp_path / "run"
    assert _train(capsys, corpus, out, steps=4)[0] == 0
    rc, _, err = _train(capsys, corpus, out, "--resume", "auto", steps=2)
    _refused(rc, err, "at step 4, beyond this run's steps=2")


# ---- resume: what is recorded is what runs ---------------------------------------------------


def _run(corpus, out, *sets):
    return apply_sets(preset("tiny"), [f"data={corpus}", f"out_dir={out}", "batch=2",
                                       "seq_len=32", "log_every=1", *sets])  # fmt: skip


def _quiet(_line):
    pass


def test_an_lr_given_on_resume_is_applied(tmp_path, corpus):
    run = _run(corpus, tmp_path / "r", "steps=4")
    torch.manual_seed(0)
    train(DormouseModel(run.model), run, log=_quiet, stop_at=2)
    saved = ckpt.read_checkpoint(tmp_path / "r" / "ckpt.pt")["model"]
    # lr=0 on resume: if the file's lr (1e-3) still ran, the parameters would move
    zero = apply_sets(run, ["lr=0"])
    model = DormouseModel(zero.model)
    lines = []
    train(model, zero, log=lines.append, resume=True)
    assert "changed on resume: lr 0.001 -> 0.0" in lines
    for name, p in model.named_parameters():
        assert torch.equal(p, saved[name]), name
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["lr"] == 0 for r in rows if r["kind"] == "train" and r["step"] > 2)


def test_every_optimizer_hyperparameter_given_on_resume_is_applied(tmp_path, corpus):
    """A resume with other optimizer settings steps with this run's groups, entry for entry
    (a fresh optimizer's for the new config), not the checkpoint's: adam_eps used to be
    logged as changed and then stepped with the file's value."""
    from dormouse.train.run import _optimizer
    from dormouse.train.step import Callbacks

    run = _run(corpus, tmp_path / "r", "steps=4")
    torch.manual_seed(0)
    train(DormouseModel(run.model), run, log=_quiet, stop_at=2)
    new = apply_sets(run, ["adam_eps=1e-5", "adam_betas=0.8,0.9", "muon_momentum=0.9",
                           "wd=0.05", "ns_steps=3", "muon_variant=plain", "engram_lr_mult=2"])  # fmt: skip
    seen = []
    lines = []
    train(DormouseModel(new.model), new, log=lines.append, resume=True,
          callbacks=Callbacks(after_step=lambda i: seen.append(
              [{k: v for k, v in g.items() if k not in ("params", "lr")}
               for g in i["opt"].param_groups])))  # fmt: skip
    assert any(x.startswith("changed on resume: adam_eps") for x in lines), lines
    fresh = _optimizer(DormouseModel(new.model), new, torch.device("cpu"))
    want = [{k: v for k, v in g.items() if k not in ("params", "lr")} for g in fresh.param_groups]
    assert seen and all(groups == want for groups in seen), (seen[0], want)
    assert {g["eps"] for g in fresh.param_groups if "eps" in g} == {1e-5}


def test_resume_on_other_bytes_of_the_same_size_is_refused(tmp_path, corpus, capsys):
    """The data file rewritten with other content of the same size resumed silently: the
    checkpoint now holds the data's fingerprint (size + sampled blocks)."""
    data = tmp_path / "data.txt"
    data.write_bytes(corpus.read_bytes())
    out = tmp_path / "r"
    argv = ["train", "tiny", "--data", data, "--out", out, *SMALL]
    assert _cli(capsys, *argv, "--steps", 2)[0] == 0
    assert ckpt.read_checkpoint(out / "ckpt.pt")["data_fingerprint"][0]["size"] == 20_000
    body = bytearray(data.read_bytes())
    body[:4096] = bytes(4096)  # the same size, other bytes
    data.write_bytes(bytes(body))
    rc, _, err = _cli(capsys, *argv, "--steps", 4, "--resume", "auto")
    _refused(
        rc,
        err,
        "was trained on other bytes",
        str(data),
        "same size (20000 bytes)",
        "Restore the file",
        "--overwrite",
    )
    assert ckpt.read_checkpoint(out / "ckpt.pt")["step"] == 2  # nothing trained on it
    data.write_bytes(corpus.read_bytes())  # restored: the resume goes on
    assert _cli(capsys, *argv, "--steps", 4, "--resume", "auto")[0] == 0


def test_metrics_rows_after_the_checkpoint_are_dropped_on_resume(tmp_path, corpus):
    out = tmp_path / "r"
    run = _run(corpus, out, "steps=6")
    torch.manual_seed(0)
    train(DormouseModel(run.model), run, log=_quiet, stop_at=3)
    at3 = (out / "ckpt.pt").read_bytes()
    train(DormouseModel(run.model), run, log=_quiet, resume=True, stop_at=5)
    (out / "ckpt.pt").write_bytes(at3)  # a crash after step 5's rows, before its checkpoint
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"kind": "train", "st')  # and a row torn mid-write
    lines = []
    train(DormouseModel(run.model), run, log=lines.append, resume=True)
    assert any("dropped 4 row(s) logged after step 3" in ln for ln in lines)
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()
             if json.loads(x)["kind"] == "train"]  # fmt: skip
    assert steps == [1, 2, 3, 4, 5, 6]


# ---- values that mean nothing ---------------------------------------------------------------


@pytest.mark.parametrize("sets, needle", [
    (["lr=inf"], "lr=inf is not a finite number"),
    (["lr=nan"], "lr=nan is not a finite number"),
    (["grad_clip=nan"], "grad_clip=nan is not a finite number"),
    (["muon_momentum=5"], "muon_momentum=5.0 must be in [0, 1)"),
    (["ckpt_name=../../x"], "not a plain file name"),
    (["compile=true", "compile_mode=reduce-overhead", "global_batch=8"],
         "reduce-overhead with accumulation"),
    (["seed=-1"], "seed=-1 must not be negative"),
    (["dist_timeout=0"], "dist_timeout=0.0 must be in (0, 604800] seconds"),
    (["dist_timeout=-5"], "dist_timeout=-5.0 must be in (0, 604800] seconds"),
    (["dist_timeout=1e30"], "dist_timeout=1e+30 must be in (0, 604800] seconds"),
])  # fmt: skip
def test_meaningless_config_values_are_refused(tmp_path, corpus, capsys, sets, needle):
    args = [x for s in sets for x in ("--set", s)]
    rc, _, err = _train(capsys, corpus, tmp_path / "r", *args)
    _refused(rc, err, needle)
    assert not (tmp_path / "r").exists() and not (tmp_path.parent / "x.pt").exists()


def test_capacity_without_dist_is_refused(tmp_path, corpus, capsys):
    rc, _, err = _train(capsys, corpus, tmp_path / "r", "--capacity", "4,2")
    _refused(rc, err, "dist_capacity='4,2'", "no --dist", "drop --capacity")


@pytest.mark.parametrize("device", ["foo", "cuda:abc"])
def test_bad_devices_are_one_line(tmp_path, corpus, capsys, device):
    rc, _, err = _train(capsys, corpus, tmp_path / "r", "--device", device)
    _refused(rc, err, f"{device!r} is not a device")
    path = tmp_path / "nothing.pt"
    _refused(*_cli(capsys, "eval", path, "--device", device)[::2], "is not a device")
    _refused(*_cli(capsys, "sample", path, "--device", device)[::2], "is not a device")


@pytest.mark.parametrize("sets, needle", [
    (["kda_impl=fla"], "kda_impl=fla cannot run here"),
    (["moe_impl=triton"], "no Triton MoE arm"),
    # 6 fp32 columns are 24 bytes, not a multiple of the kernel's 16-byte loads
    (["moe_impl=grouped", "d_model=6", "n_heads=1", "head_dim=6"], "moe_impl=grouped cannot run"),
])  # fmt: skip
def test_arms_that_cannot_run_here_are_refused_before_training(
    tmp_path, corpus, capsys, sets, needle
):
    args = [x for s in sets for x in ("--set", s)]
    rc, said, err = _train(capsys, corpus, tmp_path / "r", *args)
    _refused(rc, err, needle)
    assert "step=" not in said


def test_eval_refuses_a_batch_count_below_one(tmp_path, corpus, capsys):
    out = tmp_path / "r"
    assert _train(capsys, corpus, out)[0] == 0
    for n in ("-1", "0"):
        _refused(*_cli(capsys, "eval", out / "ckpt.pt", "--batches", n)[::2], f"--batches {n}")


@pytest.mark.parametrize("flag, value, needle", [
    ("--bytes", "-5", "negative number of bytes"),
    ("--temperature", "-1", "finite number >= 0"),
    ("--temperature", "nan", "finite number >= 0"),
    ("--temperature", "inf", "finite number >= 0"),
    ("--top-k", "-3", "--top-k -3"),
])  # fmt: skip
def test_sample_refuses_meaningless_arguments(tmp_path, capsys, flag, value, needle):
    _refused(*_cli(capsys, "sample", tmp_path / "any.pt", flag, value)[::2], needle)


def test_sample_takes_a_non_utf8_prompt_as_its_bytes(tmp_path, corpus, capsys, monkeypatch):
    out = tmp_path / "r"
    assert _train(capsys, corpus, out)[0] == 0
    import dormouse.model.sample as sample

    seen = {}
    real = sample.generate

    def spy(model, prompt, n, **kw):
        seen["prompt"] = prompt
        return real(model, prompt, n, **kw)

    monkeypatch.setattr(sample, "generate", spy)
    prompt = b"\xff\xfedef ".decode("utf-8", "surrogateescape")  # how Linux hands such argv over
    rc, text, _ = _cli(capsys, "sample", out / "ckpt.pt", "--prompt", prompt, "--bytes", "4",
                       "--device", "cpu")  # fmt: skip
    assert rc == 0 and seen["prompt"] == b"\xff\xfedef " and "def " in text


def test_empty_flag_values_are_refused_not_defaulted(tmp_path, corpus, capsys, monkeypatch):
    """An empty --data, --out or --device (an unset shell variable: `--data "$CORPUS"`) fell
    back to the embedded corpus, runs/PRESET in the working folder, or auto, and trained."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "r"
    dry = ["train", "tiny", "--steps", 2, "--dry-run", "--set", "batch=2", "--set", "seq_len=32"]
    _refused(
        *_cli(capsys, *dry, "--out", out, "--data", "")[::2],
        "--data ''",
        "empty path",
        "omit --data",
    )
    _refused(*_cli(capsys, *dry, "--out", out, "--data", corpus, "")[::2], "empty path")
    _refused(
        *_cli(capsys, *dry, "--data", corpus, "--out", "")[::2], "out_dir=''", "not a usable path"
    )
    _refused(
        *_cli(capsys, *dry, "--data", corpus, "--out", out, "--device", "")[::2],
        "device '' is not a device",
    )
    for cmd in ("eval", "sample"):
        _refused(
            *_cli(capsys, cmd, tmp_path / "nothing.pt", "--device", "")[::2],
            "--device '' is not a device",
        )
    assert not (tmp_path / "runs").exists() and not out.exists()
    assert _train(capsys, corpus, out)[0] == 0
    _refused(*_cli(capsys, "eval", out / "ckpt.pt", "--data", "")[::2], "--data ''", "empty path")


def test_data_paths_are_taken_as_typed(tmp_path, corpus, capsys):
    """--data went through `--set data=`: a comma split a path in two and every space was
    dropped (`my file.txt` was read as `myfile.txt`, which may be another file)."""
    text = corpus.read_bytes()
    paths = [tmp_path / "my file.txt", tmp_path / "a,b.txt"]
    for p in paths:
        p.write_bytes(text)
    (tmp_path / "myfile.txt").write_bytes(text[:5000])  # what the old parsing read instead
    rc, said, err = _cli(capsys, "train", "tiny", "--data", *paths, "--out", tmp_path / "r",
                         "--dry-run", *SMALL)  # fmt: skip
    assert rc == 0, err
    for p in paths:
        assert f"data: {p}: {len(text)} bytes" in said, said
    assert "myfile.txt" not in said
    out = tmp_path / "r"
    assert _train(capsys, corpus, out)[0] == 0
    rc, said, err = _cli(capsys, "eval", out / "ckpt.pt", "--data", paths[0], "--device", "cpu")
    assert rc == 0 and f"data: {paths[0]}:" in said, err


def test_fit_zero_is_refused_not_ignored(tmp_path, corpus, capsys):
    """fit_gb=0 is "no --fit", so `--fit 0` trained unfitted without a word."""
    for gb in ("0", "-3"):
        rc, _, err = _train(capsys, corpus, tmp_path / "r", "--fit", gb, "--dry-run")
        _refused(rc, err, f"--fit {gb}:", "not a card size", "omit --fit")


@pytest.mark.parametrize("sets, needle", [
    (["d_model=0"], "d_model=0 must be positive"),  # was torch's traceback from nn.Conv1d
    (["lr=nan"], "lr=nan is not a finite number"),  # was a parameter count, exit 0
    (["dropout=1.5"], "dropout=1.5 must be in [0, 1)"),
])  # fmt: skip
def test_plan_validates_its_sets(capsys, sets, needle):
    args = [x for s in sets for x in ("--set", s)]
    for extra in ([], ["--routes"]):
        _refused(*_cli(capsys, "plan", "tiny", *args, *extra)[::2], needle)


def test_bench_batch_or_seq_zero_is_refused(capsys):
    """bench --batch 0 / --seq 0 timed the preset's own 4 x 64 and printed a table."""
    for flag, needle in (("--batch", "batch=0 must be positive"),
                         ("--seq", "seq_len=0 must be positive")):  # fmt: skip
        rc, said, err = _cli(capsys, "bench", "step", "tiny", "--device", "cpu", flag, "0")
        assert rc == 2 and needle in err and "| tiny |" not in said, (rc, said, err)


# ---- divergence ------------------------------------------------------------------------------


def test_a_checkpoint_with_nonfinite_parameters_is_never_written(tmp_path):
    run = preset("tiny")
    model = DormouseModel(run.model)
    path = ckpt.save_checkpoint(tmp_path / "c.pt", run=run, model=model, step=1)
    before = path.read_bytes()
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    with pytest.raises(ckpt.CheckpointError, match="NaN/inf.*previous checkpoint there is untou"):
        ckpt.save_checkpoint(path, run=run, model=model, step=2)
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["c.pt"]


def test_a_diverged_run_exits_nonzero(tmp_path, corpus, capsys):
    # finite but absurd: the first step overflows the weights, the rest are skipped
    rc, _, err = _train(capsys, corpus, tmp_path / "r", "--set", "lr=1e30", steps=3)
    _refused(rc, err, "diverged")


# ---- files that are not what they should be -------------------------------------------------


def _damaged(tmp_path, corpus, capsys, how) -> Path:
    out = tmp_path / "r"
    assert _train(capsys, corpus, out)[0] == 0
    path = out / "ckpt.pt"
    raw = torch.load(path, weights_only=True)
    how(raw)
    torch.save(raw, path)
    return path


@pytest.mark.parametrize("how, needle", [
    (lambda raw: raw.update(config="{not json"), "not valid JSON"),
    (lambda raw: raw.update(config=json.dumps([1, 2])), "must be a JSON object"),
    (lambda raw: raw.update(config=raw["config"].replace('"d_model": 64', '"d_model": "64"')),
     "field d_model: expected int"),
    (lambda raw: raw.pop("step"), "no valid step"),
    (lambda raw: raw.update(step="7"), "no valid step"),
])  # fmt: skip
def test_a_checkpoint_with_a_bad_embedded_config_is_refused(tmp_path, corpus, capsys, how, needle):
    path = _damaged(tmp_path, corpus, capsys, how)
    _refused(*_cli(capsys, "eval", path, "--device", "cpu")[::2], needle)
    _refused(*_cli(capsys, "sample", path, "--device", "cpu")[::2], needle)
    rc, _, err = _train(capsys, corpus, path.parent, "--resume", "auto", steps=4)
    _refused(rc, err, needle)


def test_bad_out_folders_are_refused(tmp_path, corpus, capsys, monkeypatch):
    afile = tmp_path / "afile"
    afile.write_text("x")
    _refused(*_train(capsys, corpus, afile)[::2], "is a file, not a folder")
    _refused(*_train(capsys, corpus, afile / "sub")[::2], "which is a file")
    locked = tmp_path / "locked"
    locked.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m: False if Path(p) == locked else real(p, m))
    _refused(*_train(capsys, corpus, locked / "run")[::2], "not writable")
    assert afile.read_text() == "x" and list(locked.iterdir()) == []


def _evals(folder: Path, *rows) -> Path:
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_compare_refuses_damaged_metrics_and_images_it_cannot_write(tmp_path, capsys):
    """A metrics row that is a list or has no numeric loss was an AttributeError, KeyError or
    TypeError; `--out c.txt` was matplotlib's ValueError; `--out DIR` (or a name without a
    suffix) wrote DIR.png beside it while the log named DIR."""
    row = {"kind": "eval", "step": 2, "loss": 5.5, "train_s": 0.1, "bytes": 100}
    a = _evals(tmp_path / "a", row, {**row, "step": 4, "loss": 5.4})
    damaged = {
        "list": [1, 2],
        "noloss": {k: v for k, v in row.items() if k != "loss"},
        "strloss": {**row, "loss": "x"},
        "strbytes": {**row, "bytes": "1k"},
    }
    for name, bad in damaged.items():
        b = _evals(tmp_path / name, row, bad)
        _refused(
            *_cli(capsys, "compare", a, b, "--out", tmp_path / "c.png")[::2],
            f"{b / 'metrics.jsonl'}: line 2",
            "damaged",
        )
    _refused(
        *_cli(capsys, "compare", a, a, "--out", tmp_path / "c.txt")[::2],
        "--out",
        "c.txt",
        "name the image .png",
    )
    pics = tmp_path / "pics"
    pics.mkdir()
    _refused(
        *_cli(capsys, "compare", a, a, "--out", pics)[::2], "is a folder", str(pics / "compare.png")
    )
    _refused(*_cli(capsys, "compare", a, a, "--out", "")[::2], "--out . is a folder")
    rc, said, _ = _cli(capsys, "compare", a, a, "--out", tmp_path / "plot")
    assert rc == 0 and f"written to {tmp_path / 'plot'}" in said
    assert (tmp_path / "plot").read_bytes()[:4] == b"\x89PNG"
    assert not list(tmp_path.glob("*.png")) and not (tmp_path / "c.txt").exists()


def test_a_full_disk_at_save_keeps_the_previous_checkpoint(tmp_path, corpus, capsys, monkeypatch):
    out = tmp_path / "r"
    real, real_write = torch.save, ckpt._write_file
    calls, writing = [], []

    def write_file(path, *a, **k):  # which file torch.save is writing (ckpt.pt or best.pt)
        writing.append(Path(path).name)
        return real_write(path, *a, **k)

    def save(obj, f, *a, **k):
        if writing[-1] == "ckpt.pt":
            calls.append(1)
            if len(calls) == 2:  # the second write of ckpt.pt finds the disk full
                f.write(b"partial")
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(ckpt, "_write_file", write_file)
    rc, _, err = _train(capsys, corpus, out, "--set", "ckpt_every=2", steps=4)
    _refused(rc, err, "No space left on device", "the disk is full", "previous checkpoint")
    assert ckpt.read_checkpoint(out / "ckpt.pt")["step"] == 2
    assert not [p for p in os.listdir(out) if p.endswith(".tmp")]


def test_a_data_file_truncated_during_training_stops_with_a_checkpoint(tmp_path, corpus):
    data = tmp_path / "shrinks.txt"
    data.write_bytes(corpus.read_bytes())
    run = apply_sets(_run(corpus, tmp_path / "r", "steps=6"), [f"data={data}"])

    def log(line):
        if line.startswith("step=2 "):
            os.truncate(data, 1000)  # a copy job rewrote the file under the run

    with pytest.raises(DataError, match="shrank from 20000 to 1000 bytes.*before step 2"):
        train(DormouseModel(run.model), run, log=log)
    assert ckpt.read_checkpoint(tmp_path / "r" / "ckpt.pt")["step"] == 2


def test_stale_temp_files_are_cleaned_at_start(tmp_path, corpus, capsys):
    out = tmp_path / "r"
    out.mkdir()
    dead = out / ".ckpt.pt.999999999.abcd1234.tmp"  # no such pid: a writer killed mid-save
    # no pid: nothing says dormouse wrote it (a user's `.figure.png.v2.tmp` was removed)
    nopid = out / ".ckpt.pt.abcd1234.tmp"
    live = out / f".ckpt.pt.{os.getppid()}.abcd1234.tmp"  # a live process may still write it
    for p in (dead, nopid, live):
        p.write_bytes(b"partial")
    rc, said, _ = _train(capsys, corpus, out, "--overwrite")
    assert rc == 0 and "removed 1 temp file(s)" in said
    assert not dead.exists() and nopid.exists() and live.exists()


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_checkpoints_honour_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        path = ckpt.save_checkpoint(tmp_path / "c.pt", run=preset("tiny"),
                                    model=DormouseModel(preset("tiny").model), step=0)  # fmt: skip
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == mode


# ---- the error classes ----------------------------------------------------------------------


def test_user_errors_share_one_base_class():
    from dormouse.train.context import DistError, LaunchError, RefusedError
    from dormouse.train.plan.device import DeviceError, DtypeError
    from dormouse.train.plan.fit import FitError

    for cls in (ConfigError, DataError, ckpt.CheckpointError, TrainingError, SampleError,
                DtypeError, DeviceError, FitError, DistError, LaunchError, RefusedError):  # fmt: skip
        assert issubclass(cls, UserError), cls


def test_a_bug_keeps_its_traceback(monkeypatch):
    import dormouse.cli as cli

    monkeypatch.setattr(cli, "_run_from_args", lambda _a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        cli_main(["train", "tiny"])


def test_dry_run_trains_nothing_and_writes_nothing(tmp_path, corpus, capsys):
    out = tmp_path / "r"
    rc, said, _ = _train(capsys, corpus, out, "--dry-run")
    assert rc == 0 and "dry run: ok" in said and "would start afresh" in said
    assert "step=" not in said and not out.exists()
    _refused(*_train(capsys, corpus, out, "--dry-run", "--set", "batch=100000")[::2], "bytes")


# ---- the fuzz: every input is accepted or refused in one line ---------------------------------

_KEYS = sorted(
    k
    for k in {**preset("tiny").to_dict()["model"], **preset("tiny").to_dict()["train"]}
    if k not in ("data", "out_dir")  # paths: held by their own tests, and the fuzz writes nowhere
)
_VALUES = st.one_of(
    st.integers(-3, 70).map(str),
    st.sampled_from(
        [
            "0",
            "1",
            "-1",
            "nan",
            "inf",
            "-inf",
            "1e30",
            "0.5",
            "1e-3",
            "2**3",
            "",
            "true",
            "false",
            "yes",
            "abc",
            "1,2",
            "2,3,4",
            "(0.9,0.95)",
            "cuda:abc",
            "cpu",
            "cuda",
            "auto",
            "fla",
            "torch",
            "grouped",
            "batched",
            "triton",
            "..",
            "a/b",
            "fp16",
            "bf16",
            "fsdp",
            "wsd",
            "adamw",
            "0x10",
            "99999999999",
        ]
    ),
    st.text(alphabet="ab01.,-_:/ x", max_size=6),
)
_DEFAULTS = {**preset("tiny").to_dict()["model"], **preset("tiny").to_dict()["train"]}


def _plausible(key: str):
    """Values near what the key holds in the tiny preset (so that many runs are accepted)."""
    from dormouse.config import CHOICES

    v = _DEFAULTS[key]
    if key in CHOICES:
        return st.sampled_from(CHOICES[key])
    if isinstance(v, bool):
        return st.sampled_from(["true", "false"])
    if isinstance(v, int):
        return st.integers(max(0, v // 2), v * 2 + 1).map(str)
    if isinstance(v, float):
        return st.floats(0, max(2 * v, 1.0)).map(repr)
    return _VALUES


_SETS = st.lists(
    st.sampled_from(_KEYS).flatmap(
        lambda k: st.one_of(_plausible(k), _VALUES).map(lambda v: f"{k}={v}")),
    max_size=3,
)  # fmt: skip
_FLAGS = st.lists(st.sampled_from([
    ["--steps", "-1"], ["--steps", "0"], ["--steps", "x"], ["--device", "foo"],
    ["--device", "cuda:abc"], ["--device", "cuda"], ["--capacity", "4,2"], ["--fit", "nan"],
    ["--fit", "-1"], ["--resume"], ["--resume", "auto"], ["--resume", "bogus"], ["--overwrite"],
    ["--dist"], ["--set", "noequals"], ["--set", "model.steps=1"],
]), max_size=1)  # fmt: skip


@settings(max_examples=300, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])  # fmt: skip
@pytest.mark.slow
@given(sets=_SETS, flags=_FLAGS)
def test_fuzz_cli_arguments_and_set_values(tmp_path, corpus, capsys, sets, flags):
    argv = ["train", "tiny", "--data", corpus, "--out", tmp_path / "fuzz", "--dry-run",
            "--device", "cpu", *[x for s in sets for x in ("--set", s)],
            *[x for f in flags for x in f]]  # fmt: skip
    rc, said, err = _cli(capsys, *argv)  # a traceback or any other exception fails here
    assert rc in (0, 2), (argv, rc, err)
    if rc == 0:
        assert "dry run: ok" in said or "dry run: fleet" in said, said
    assert not (tmp_path / "fuzz").exists()  # a dry run writes nothing


# ---- the table cannot rot ---------------------------------------------------------------------


def test_reliability_table_names_real_tests():
    text = (ROOT / "docs" / "reliability.md").read_text()
    named = set(re.findall(r"`(tests/test_\w+\.py)::(test_\w+)`", text))
    assert len(named) >= 25, named
    missing = []
    for file, name in sorted(named):
        tree = ast.parse((ROOT / file).read_text())
        defs = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        if name not in defs:
            missing.append(f"{file}::{name}")
    assert not missing, f"docs/reliability.md names tests that do not exist: {missing}"


def test_a_folder_trained_with_auto_settings_is_the_same_run_again(tmp_path, corpus, capsys):
    """dropout=auto and compile=auto are resolved before the run trains (the checkpoint holds
    the resolution); the same command again is the same run, not 'a different config'."""
    out = tmp_path / "run"
    sets = ("--set", "dropout=auto", "--set", "compile=auto", "--set", "compile_mode=auto")
    assert _train(capsys, corpus, out, *sets)[0] == 0
    rc, said, _ = _train(capsys, corpus, out, *sets)
    assert rc == 0 and "already complete at step 2" in said
    rc, _, err = _train(capsys, corpus, out, "--set", "dropout=0.3")  # pinned: differs
    _refused(rc, err, "already holds a run", "dropout")
