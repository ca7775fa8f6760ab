"""The metrics sinks (train/metrics.py): TensorBoard's event files hold what metrics.jsonl
holds, read back with TensorBoard's own reader; a resumed run's events do not repeat."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_loop import _model, _run
from trainlog import train

from dormouse.cli import main as cli_main
from dormouse.train.step import Callbacks
from dormouse.train.store.metrics import TensorBoardSink


def _events(folder) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})  # 0: keep every event
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _rows(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_train_tiny_writes_the_jsonl_rows_as_tensorboard_scalars(tmp_path, corpus):
    out = tmp_path / "run"
    rc = cli_main(["train", "tiny", "--data", str(corpus), "--out", str(out),
                   "--steps", "6", "--set", "tensorboard=true", "--set", "log_every=2",
                   "--set", "eval_every=3", "--set", "eval_batches=2"])  # fmt: skip
    assert rc == 0
    events = _events(out / "tb")
    rows = _rows(out)
    for kind, names in (("train", ("loss", "bpb", "lr", "gnorm", "tok_s", "ms")),
                        ("eval", ("loss", "bpb"))):  # fmt: skip
        want = [r for r in rows if r["kind"] == kind]
        assert want, kind
        for name in names:
            got = events[f"{kind}/{name}"]
            assert [s for s, _ in got] == [r["step"] for r in want], (kind, name)
            for (_, v), r in zip(got, want):  # event files hold float32
                assert v == pytest.approx(r[name], rel=1e-6), (kind, name, r["step"])
    # the experts' load, one scalar per expert
    assert events["train/load/0"] and f"train/load/{len(rows[1]['load']) - 1}" in events
    assert [s for s, _ in events["train/loss"]] == [2, 4, 6]
    assert [s for s, _ in events["eval/bpb"]] == [0, 3, 6]


def test_off_unless_asked(tmp_path, corpus):
    run = _run(corpus, tmp_path / "o", 2)
    train(_model(run), run)
    assert (tmp_path / "o" / "metrics.jsonl").stat().st_size > 0
    assert not (tmp_path / "o" / "tb").exists()


def test_a_resumed_run_logs_each_step_once(tmp_path, corpus):
    """An attempt that crashed at step 5 (checkpoint at 3) logged steps 4 and 5 that the
    resumed run logs again: TensorBoard shows each step once, the resumed run's values."""
    out = tmp_path / "r"
    run = _run(corpus, out, 6, "tensorboard=true", "ckpt_every=3")

    def crash(info):
        if len(_rows(out)) >= 4:  # rows 1..4 written: this is step 5
            raise RuntimeError("crash")

    with pytest.raises(RuntimeError, match="crash"):
        train(_model(run), run, callbacks=Callbacks(after_step=crash))
    assert [s for s, _ in _events(out / "tb")["train/loss"]] == [1, 2, 3, 4]
    train(_model(run, seed=1), run, resume=True)
    events = _events(out / "tb")
    rows = [r for r in _rows(out) if r["kind"] == "train"]
    assert [s for s, _ in events["train/ms"]] == [1, 2, 3, 4, 5, 6]
    assert [v for _, v in events["train/ms"]] == pytest.approx([r["ms"] for r in rows], rel=1e-6)


def test_a_fleets_split_is_one_scalar_per_rank(tmp_path):
    sink = TensorBoardSink(tmp_path / "tb", None)
    sink.write("train", 7, {"loss": 2.5, "split": [3, 1], "load": None, "skip": float("nan")})
    sink.close()
    events = _events(tmp_path / "tb")
    assert events == {"train/loss": [(7, 2.5)], "train/split/0": [(7, 3.0)],
                      "train/split/1": [(7, 1.0)]}  # fmt: skip
