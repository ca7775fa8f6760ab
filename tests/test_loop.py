"""The single-process loop: exact resume, the schedule, non-finite skips, outputs, the CLI."""

from __future__ import annotations

import json
import math
import os
import signal

import pytest
import torch
from trainlog import train

from dormouse.cli import main as cli_main
from dormouse.config import apply_sets, preset
from dormouse.model import DormouseModel
from dormouse.train.loop import TrainingError
from dormouse.train.step import lr_factor
from dormouse.train.store import checkpoint as ckpt
from references.fingerprint import fingerprint


def _run(corpus, out, steps=20, *sets):
    return apply_sets(preset("tiny"), [f"data={corpus}", f"out_dir={out}", f"steps={steps}",
                                       "batch=2", "seq_len=32", *sets])  # fmt: skip


def _model(run, seed=0):
    torch.manual_seed(seed)
    return DormouseModel(run.model)


def test_exact_resume(tmp_path, corpus):
    quiet = lambda _line: None
    full_run = _run(corpus, tmp_path / "full", 20, "moe_lb_coef=0.01")
    full = _model(full_run)
    train(full, full_run, log=quiet)

    half_run = _run(corpus, tmp_path / "half", 20, "moe_lb_coef=0.01")
    first = _model(half_run)
    train(first, half_run, log=quiet, stop_at=10)
    assert ckpt.read_checkpoint(tmp_path / "half" / "ckpt.pt")["step"] == 10
    second = _model(half_run, seed=123)  # a different init: everything must come from the file
    rep = train(second, half_run, log=quiet, resume=True)
    assert rep["steps"] == 20
    assert fingerprint(second) == fingerprint(full)
    # the LFB buffers travel too (they are state, not parameters)
    for a, b in zip(second.buffers(), full.buffers()):
        assert torch.equal(a, b)


@pytest.fixture
def default_signals():
    """SIGINT and SIGTERM at Python's defaults for the test: a shell's background job (nohup,
    `&`, many CI runners) starts with SIGINT ignored, and the loop rightly leaves an ignored
    signal alone, so a test of the stop must set the handlers it needs, not inherit them."""
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    for s, h in old.items():
        signal.signal(s, h)


def _signal_at(step: int, sig, lines: list, before=None):
    """A log callback that sends `sig` to this process when `step=<step> ` is logged."""

    def log(line: str) -> None:
        lines.append(line)
        if before is not None and line.startswith(f"step={before[0]} "):
            before[1]()
        if line.startswith(f"step={step} "):
            os.kill(os.getpid(), sig)

    return log


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_between_steps_and_resumes_exactly(tmp_path, corpus, sig, default_signals):
    quiet = lambda _line: None
    full_run = _run(corpus, tmp_path / "full", 12, "log_every=1", "ckpt_every=0")
    full = _model(full_run)
    train(full, full_run, log=quiet)

    before = signal.getsignal(sig)
    run = _run(corpus, tmp_path / "cut", 12, "log_every=1", "ckpt_every=0")
    lines: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        train(_model(run), run, log=_signal_at(5, sig, lines))
    assert signal.getsignal(sig) is before  # the loop puts the old handler back
    stop = [ln for ln in lines if ln.startswith("stop requested")]
    assert stop and f"({signal.Signals(sig).name}) at step 5" in stop[0], lines[-3:]
    assert ckpt.read_checkpoint(tmp_path / "cut" / "ckpt.pt")["step"] == 5
    second = _model(run, seed=123)
    assert train(second, run, log=quiet, resume=True)["steps"] == 12
    assert fingerprint(second) == fingerprint(full)


def test_a_replaced_sigint_handler_is_put_back(tmp_path, corpus, default_signals):
    # some libraries install their own SIGINT handler on first use; the loop notices
    run = _run(corpus, tmp_path / "o", 8, "log_every=1", "ckpt_every=0")
    lines: list[str] = []
    swap = (2, lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    with pytest.raises(KeyboardInterrupt):
        train(_model(run), run, log=_signal_at(4, signal.SIGINT, lines, before=swap))
    assert any(ln.startswith("note: the SIGINT handler was replaced") for ln in lines)
    assert any(ln.startswith("stop requested (SIGINT) at step 4") for ln in lines)
    assert ckpt.read_checkpoint(tmp_path / "o" / "ckpt.pt")["step"] == 4


def test_a_second_ctrl_c_stops_at_once_without_a_checkpoint(tmp_path, corpus, default_signals):
    run = _run(corpus, tmp_path / "o", 8, "log_every=1", "ckpt_every=0")
    lines: list[str] = []

    def log(line: str) -> None:
        lines.append(line)
        if line.startswith("step=3 "):
            os.kill(os.getpid(), signal.SIGINT)  # the first asks for a clean stop...
            os.kill(os.getpid(), signal.SIGINT)  # ...the second means now

    with pytest.raises(KeyboardInterrupt):
        train(_model(run), run, log=log)
    assert any(ln.startswith("interrupted during step 3: no checkpoint written") for ln in lines)
    assert not (tmp_path / "o" / "ckpt.pt").exists()


def test_log_lines_metrics_and_plot(tmp_path, corpus):
    lines = []
    run = _run(corpus, tmp_path / "o", 6, "log_every=2", "eval_every=3", "eval_batches=2")
    train(_model(run), run, log=lines.append)
    steps = [ln for ln in lines if ln.startswith("step=")]
    assert len(steps) == 3 and all(k in steps[0] for k in ("loss=", "bpb=", "lr=", "tok/s=", "ms="))
    evals = [ln for ln in lines if ln.startswith("eval ")]
    assert len(evals) == 3  # step 0, step 3, and the end
    rows = [json.loads(x) for x in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    assert {r["kind"] for r in rows} == {"train", "eval"}
    loss = rows[-1]["loss"]
    assert abs(rows[-1]["bpb"] - loss / math.log(2)) < 1e-9
    assert (tmp_path / "o" / "loss.png").stat().st_size > 1000


def test_schedules():
    cfg = preset("small").train
    assert lr_factor(0, cfg) == pytest.approx(1 / cfg.warmup)
    assert lr_factor(cfg.warmup - 1, cfg) == pytest.approx(1.0)
    assert lr_factor(cfg.steps - 1, cfg) == pytest.approx(cfg.min_lr_frac, abs=1e-3)
    wsd = apply_sets(preset("small"), ["schedule=wsd", "wsd_decay_frac=0.5", "warmup=0"]).train
    assert lr_factor(149, wsd) == 1.0 and lr_factor(225, wsd) == pytest.approx(0.55)


def test_nonfinite_steps_are_skipped_then_the_run_stops(tmp_path, corpus, monkeypatch):
    run = _run(corpus, tmp_path / "nan", 8, "max_skips=3")
    model = _model(run)
    real = model.forward

    def poisoned(x, y=None):  # a fault: every forward from the third on is non-finite
        logits, loss, aux = real(x, y)
        poisoned.calls += 1
        return logits, (loss * float("nan") if poisoned.calls >= 3 else loss), aux

    poisoned.calls = 0
    monkeypatch.setattr(model, "forward", poisoned)
    lines = []
    before = None
    with pytest.raises(TrainingError, match="3 consecutive non-finite steps"):
        train(model, run, log=lines.append)
    assert sum("skipped: non-finite" in ln for ln in lines) == 3
    assert all(torch.isfinite(p).all() for p in model.parameters())
    del before


def test_a_skipped_step_keeps_the_eval_and_checkpoint_cadence(tmp_path, corpus, monkeypatch):
    """A non-finite step at eval_every - 1 still evaluates and checkpoints after it (the
    loop's bookkeeping used to stop at the skip: no evaluation, no checkpoint that step)."""
    from dormouse.train.step import Callbacks

    run = _run(corpus, tmp_path / "skip", 6, "eval_every=4", "ckpt_every=4", "val_frac=0.05")
    model = _model(run)
    real = model.forward

    def poisoned(x, y=None, **kw):  # step 3's loss is non-finite, its gradient finite
        logits, loss, aux = real(x, y, **kw)
        if model.training:
            poisoned.calls += 1
            if poisoned.calls == 4:
                loss = loss + float("nan")
        return logits, loss, aux

    poisoned.calls = 0
    monkeypatch.setattr(model, "forward", poisoned)
    saved = []
    real_save = ckpt.save_state
    monkeypatch.setattr(
        ckpt,
        "save_state",
        lambda *a, step, **kw: (saved.append(step), real_save(*a, step=step, **kw))[1],
    )
    evals, skipped = [], []
    cb = Callbacks(
        on_eval=lambda i: evals.append(i["step"]),
        after_step=lambda i: skipped.append(not i["stepped"]),
    )
    train(model, run, callbacks=cb)
    assert skipped == [False, False, False, True, False, False]
    assert evals == [0, 4, 6] and 4 in saved


def test_resume_without_checkpoint_is_refused(tmp_path, corpus):
    run = _run(corpus, tmp_path / "none", 2)
    with pytest.raises(TrainingError, match="no checkpoint"):
        train(_model(run), run, log=lambda _l: None, resume=True)


def test_cli_train_eval_sample(tmp_path, corpus, capsys):
    data = corpus
    out = tmp_path / "cli"
    assert cli_main(["train", "tiny", "--data", str(data), "--steps", "4", "--out", str(out),
                     "--device", "cpu", "--set", "batch=2", "--set", "seq_len=32"]) == 0  # fmt: skip
    assert cli_main(["eval", str(out / "ckpt.pt"), "--batches", "2", "--device", "cpu"]) == 0
    assert cli_main(["sample", str(out / "ckpt.pt"), "--prompt", "def ", "--bytes", "20",
                     "--device", "cpu"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "eval checkpoint=" in text and "\ndef " in text


def test_a_gpu_trained_checkpoint_evaluates_and_samples_on_the_cpu(tmp_path, corpus, capsys):
    # a checkpoint from an H200 records kda_impl=fla; eval/sample on a CPU must still run
    data = corpus
    out = tmp_path / "gpu"
    assert cli_main(["train", "tiny", "--data", str(data), "--steps", "2", "--out", str(out),
                     "--device", "cpu", "--set", "batch=2", "--set", "seq_len=32"]) == 0  # fmt: skip
    path = out / "ckpt.pt"
    raw = torch.load(path, weights_only=True)
    cfg = json.loads(raw["config"])
    cfg["model"]["kda_impl"] = "fla"
    raw["config"] = json.dumps(cfg)
    torch.save(raw, path)
    capsys.readouterr()
    assert cli_main(["eval", str(path), "--batches", "1", "--device", "cpu"]) == 0
    assert (
        cli_main(["sample", str(path), "--prompt", "def ", "--bytes", "8", "--device", "cpu"]) == 0
    )
    said = capsys.readouterr()
    said = said.out + said.err
    assert "trained with kda_impl=fla" in said and "(kda_impl=auto)" in said


def test_cli_reports_user_errors_cleanly(tmp_path, capsys):
    assert cli_main(["train", "tiny", "--data", str(tmp_path / "missing.bin"), "--steps", "1",
                     "--out", str(tmp_path / "x"), "--device", "cpu"]) == 2  # fmt: skip
    err = capsys.readouterr().err
    assert "missing.bin" in err and "Traceback" not in err
    assert cli_main(["train", "tiny", "--set", "d_modle=3"]) == 2
    assert "did you mean 'd_model'" in capsys.readouterr().err


def test_a_train_validates_its_config_once(tmp_path, monkeypatch):
    """One pass from the command line to the first step: the config is validated once, at
    entry (train.run.prepare), not again by each layer it passes through."""
    import sys

    import dormouse.train.run
    import dormouse.train.store.folder  # noqa: F401
    from dormouse import config
    from dormouse.cli import main

    real, calls = config.validate, []

    def counting(run):
        calls.append(1)
        return real(run)

    for mod in [m for name, m in sys.modules.items() if name.startswith("dormouse")]:
        if getattr(mod, "validate", None) is real:
            monkeypatch.setattr(mod, "validate", counting)
    data = tmp_path / "c.txt"
    data.write_bytes(b"the quick brown fox jumps over the lazy dog\n" * 200)
    assert main(["train", "tiny", "--data", str(data), "--steps", "2", "--out",
                 str(tmp_path / "r"), "--device", "cpu"]) == 0  # fmt: skip
    assert len(calls) == 1
