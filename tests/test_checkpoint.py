"""Checkpoints: atomic writes, safe loads, loud shape mismatches."""

from __future__ import annotations

import os

import pytest
import torch

from dormouse.config import apply_sets, preset
from dormouse.model import DormouseModel
from dormouse.train import checkpoint as ckpt


def _save(tmp_path, run=None, **kw):
    run = run or preset("tiny")
    torch.manual_seed(0)
    model = DormouseModel(run.model)
    path = ckpt.save_checkpoint(tmp_path / "c.pt", run=run, model=model, step=3, **kw)
    return path, model


def test_round_trip_and_contents(tmp_path):
    path, model = _save(tmp_path, data_state={"kind": "stream", "step": 3})
    ck = ckpt.read_checkpoint(path)
    assert ck["step"] == 3 and ck["run"] == preset("tiny") and ck["data"]["step"] == 3
    fresh = DormouseModel(preset("tiny").model)
    ckpt.load_model_state(fresh, ck, path)
    for (n, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), n
    assert any("lfb_bias" in k for k in ck["model"])  # LFB buffers are in the file


def test_atomic_write_leaves_the_old_file_on_failure(tmp_path, monkeypatch):
    path, _ = _save(tmp_path)
    before = path.read_bytes()

    def boom(*a, **k):  # a fault in the middle of the write
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(ckpt.CheckpointError, match="disk full.*previous checkpoint there is untou"):
        _save(tmp_path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]  # no temp file left behind


def test_loads_with_weights_only(tmp_path, monkeypatch):
    path, _ = _save(tmp_path)
    seen = {}
    real = torch.load

    def spy(*a, **k):
        seen.update(k)
        return real(*a, **k)

    monkeypatch.setattr(torch, "load", spy)
    ckpt.read_checkpoint(path)
    assert seen.get("weights_only") is True


def test_a_pickle_with_code_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    bad = tmp_path / "evil.pt"
    torch.save({"config": "{}", "model": Evil()}, bad)
    with pytest.raises(ckpt.CheckpointError, match="could not be read"):
        ckpt.read_checkpoint(bad)


def test_shape_mismatch_names_the_fields(tmp_path):
    path, _ = _save(tmp_path)
    other = apply_sets(preset("tiny"), ["d_ffn=256", "n_experts=2", "moe_topk=1"])
    model = DormouseModel(other.model)
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.load_model_state(model, ckpt.read_checkpoint(path), path)
    msg = str(e.value)
    assert "d_ffn: checkpoint 128 vs this run 256" in msg and "n_experts" in msg


@pytest.mark.parametrize("what", ["missing", "dir", "garbage"])
def test_bad_checkpoint_paths(tmp_path, what):
    p = tmp_path / "x.pt"
    if what == "dir":
        p.mkdir()
    elif what == "garbage":
        p.write_bytes(b"not a checkpoint")
    with pytest.raises(ckpt.CheckpointError):
        ckpt.read_checkpoint(p)


def test_a_truncated_checkpoint_is_refused(tmp_path):
    path, _ = _save(tmp_path)
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ckpt.CheckpointError, match="may be truncated"):
        ckpt.read_checkpoint(path)
