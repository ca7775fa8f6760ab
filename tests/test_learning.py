"""Learning on small corpora (issue #17): keyed dropout, dropout=auto, best.pt and early stop,
the whole-split eval, the GPT baseline and `dormouse compare`."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys

import numpy as np
import pytest
import torch

from dormouse.config import DROPOUT_AUTO, ConfigError, ModelConfig, apply_sets, preset, validate
from dormouse.model import make_model
from dormouse.model.layers import KeyedDropout, row_keys
from dormouse.train.data import ByteCorpus, DataSource, Source
from dormouse.train.loop import _Best
from dormouse.train.run import AUTO_DROPOUT, resolve_dropout, train_run
from dormouse.train.store.folder import best_path

# ---- keyed dropout ----------------------------------------------------------------------------


def test_keyed_masks_depend_on_the_row_not_on_the_batch_it_sits_in():
    keys = row_keys(3, 17, torch.arange(10, 18))
    t = torch.ones(8, 32, 24)
    whole = KeyedDropout(keys, 0.25)(t, site=5)
    # rows 2..5 of the global batch dropped alone (another rank, another micro-batch)
    part = KeyedDropout(keys[2:6], 0.25)(t[2:6], site=5)
    assert torch.equal(whole[2:6], part)
    assert abs(float((whole == 0).float().mean()) - 0.25) < 0.02  # 6144 draws: 3 sigma ~ 0.017
    assert torch.allclose(whole.mean(), torch.tensor(1.0), atol=0.03)  # inverted scaling
    other_site = KeyedDropout(keys, 0.25)(t, site=6)
    other_step = KeyedDropout(row_keys(3, 18, torch.arange(10, 18)), 0.25)(t, site=5)
    assert not torch.equal(whole, other_site) and not torch.equal(whole, other_step)


@pytest.mark.parametrize("arch", ["dormouse", "gpt"])
def test_dropout_is_off_in_eval_and_keyed_in_training(arch, tiny_run):
    extra = ("n_layers=2", "d_ffn=256") if arch == "gpt" else ()
    run = tiny_run("dropout=0.3", f"arch={arch}", *extra)
    torch.manual_seed(0)
    m = make_model(run.model)
    x = torch.randint(0, 256, (4, 32))
    keys = row_keys(0, 1, torch.arange(4))
    a, _, _ = m(x, keys=keys)
    b, _, _ = m(x, keys=keys)
    assert torch.equal(a, b)  # the same keys, the same masks: no RNG state
    m.eval()
    e1, _, _ = m(x, keys=keys)
    m0 = make_model(dataclasses.replace(run.model, dropout=0.0))
    m0.load_state_dict(m.state_dict())
    m0.eval()
    assert torch.equal(e1, m0(x)[0])  # eval: no dropout at all
    assert not torch.allclose(a, e1)


def test_accumulated_micro_batches_draw_the_masks_of_one_forward(tmp_path, tiny_run):
    # keys by global row: a step of 8 windows in one forward and in 2 micro-batches of 4 give
    # the same gradients with dropout on (the fleet gates hold the same across ranks)
    data = tmp_path / "c.txt"
    data.write_bytes(bytes(np.random.default_rng(0).integers(0, 256, 40000, dtype=np.uint8)))
    norms = []
    for batch, gb in ((8, 0), (4, 8)):
        run = tiny_run("dropout=0.3")
        run = apply_sets(run, [f"batch={batch}", f"global_batch={gb}", "steps=3", "seq_len=32",
                               f"data={data}", "val_frac=0", f"out_dir={tmp_path / str(batch)}",
                               "eval_every=0", "log_every=1"])  # fmt: skip
        seen = []
        from dormouse.train.step import Callbacks

        train_run(run, callbacks=Callbacks(after_step=lambda i: seen.append(i["gnorm"])))
        norms.append(seen)
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)  # fp32 sum-order round-off


# ---- dropout=auto -----------------------------------------------------------------------------


def test_dropout_auto_reads_the_passes(tmp_path, caplog):
    data = tmp_path / "c.txt"
    data.write_bytes(b"x" * 100_000)
    run = apply_sets(preset("small"), [f"data={data}", "batch=4", "seq_len=64", "val_frac=0.1"])
    assert run.model.dropout == DROPOUT_AUTO
    with caplog.at_level(logging.INFO):
        many = resolve_dropout(apply_sets(run, ["steps=2000"]))  # 2000*260 B of 90 kB: 5.8 passes
        once = resolve_dropout(apply_sets(run, ["steps=100"]))  # 0.29 passes
    assert many.model.dropout == AUTO_DROPOUT and once.model.dropout == 0.0
    assert "passes -> dropout=0.4" in caplog.text and "passes -> dropout=0 " in caplog.text
    pinned = resolve_dropout(apply_sets(run, ["steps=2000", "dropout=0.1"]))
    assert pinned.model.dropout == 0.1
    assert apply_sets(run, ["dropout=auto"]).model.dropout == DROPOUT_AUTO
    with pytest.raises(ConfigError, match=r"dropout=1.5 must be in \[0, 1\)"):
        validate(apply_sets(run, ["dropout=1.5"]))


# ---- best validation, overfitting, early stop -------------------------------------------------


def test_best_record_says_overfitting_once_per_best():
    b = _Best()
    said = []
    points = [(100, 1.5, 1.2), (200, 1.4, 1.0), (300, 1.45, 0.9), (400, 1.5, 0.8),
              (500, 1.6, 0.7), (600, 1.7, 0.6), (700, 1.3, 0.5)]  # fmt: skip
    for step, val, tr in points:
        _improved, line = b.see(step, val, tr)
        said.append(line)
    assert [s is not None for s in said] == [False] * 4 + [True, False, False]
    assert "val up 3 evals in a row (1.4000 -> 1.6000)" in said[4]
    assert "best was step 200" in said[4]
    assert b.step == 700 and b.since == 0
    again = _Best.load(json.loads(json.dumps(b.state())))
    assert (again.step, again.loss, again.history) == (b.step, b.loss, b.history)


def test_best_checkpoint_and_early_stop(tmp_path):
    data = tmp_path / "c.txt"
    data.write_bytes(bytes(np.random.default_rng(1).integers(0, 256, 30000, dtype=np.uint8)))
    # random bytes: nothing to learn, so val stops improving soon and early_stop=2 ends the run
    run = apply_sets(preset("tiny"), [f"data={data}", "steps=200", "eval_every=5",
                                      "eval_batches=2", "lr=3e-3", "early_stop=2",
                                      f"out_dir={tmp_path / 'r'}", "val_frac=0.2"])  # fmt: skip
    report = train_run(run)
    assert report["steps"] < 200  # stopped early
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    ev = [r for r in rows if r["kind"] == "eval"]
    best = min((r for r in ev if r["step"] > 0), key=lambda r: r["loss"])  # trained ones
    assert report["best"]["step"] == best["step"]
    from dormouse.train.store.checkpoint import read_checkpoint

    ck = read_checkpoint(best_path(run))
    assert ck["step"] == best["step"] and ck["extra"]["best_step"] == best["step"]
    last = ev[-1]
    assert last["step"] == report["steps"] and last["step"] - best["step"] == 2 * 5
    assert all("val_bytes" in r and "train_s" in r and "bytes" in r for r in ev)


def test_no_best_checkpoint_of_an_untrained_model(tmp_path):
    """The evaluation before the first step is logged, never kept as a best: best.pt holds a
    trained model (train small --steps 1 wrote the untrained one as best.pt)."""
    from dormouse.train.step import Callbacks

    data = tmp_path / "c.txt"
    data.write_bytes(bytes(np.random.default_rng(1).integers(0, 256, 30000, dtype=np.uint8)))
    run = apply_sets(preset("tiny"), [f"data={data}", "steps=1", "eval_every=1",
                                      f"out_dir={tmp_path / 'r'}"])  # fmt: skip
    seen = []
    cb = Callbacks(on_eval=lambda d: seen.append((d["step"], best_path(run).exists())))
    report = train_run(run, callbacks=cb)
    assert seen == [(0, False), (1, True)] and report["best"]["step"] == 1


# ---- the whole-split eval ----------------------------------------------------------------------


def test_val_all_scores_every_val_byte_once(tmp_path):
    p = tmp_path / "c.bin"
    raw = np.random.default_rng(2).integers(0, 256, 5000, dtype=np.uint8)
    p.write_bytes(raw.tobytes())
    c = ByteCorpus(p)
    train, val = c.split(0.0, 1234, 1)
    ds = DataSource([Source("c", c, train, val, 1.0)], seed=0)
    ys = torch.cat([y.reshape(-1) for _, y in ds.val_all(batch=3, seq_len=50)])
    assert ys.numel() == ds.val_bytes_total() == 1233
    assert np.array_equal(ys.numpy(), raw[-1233:])


# ---- the GPT baseline ----------------------------------------------------------------------------


def _gpt(**kw):
    return ModelConfig(arch="gpt", d_model=32, n_heads=2, head_dim=16, d_ffn=64, n_layers=2,
                       max_seq_len=24, **kw)  # fmt: skip


def test_gpt_is_causal_and_its_cache_decodes_what_forward_computes():
    torch.manual_seed(0)
    m = make_model(_gpt()).eval()
    x = torch.randint(0, 256, (2, 20))
    full, _, _ = m(x)
    y = x.clone()
    y[:, 12] = (y[:, 12] + 1) % 256
    assert torch.equal(m(y)[0][:, :12], full[:, :12])  # a later byte changes nothing before it
    cache = m.init_cache()
    got = [m.step(x[:, :5], cache)]  # a prompt, then one byte at a time
    got += [m.step(x[:, t : t + 1], cache) for t in range(5, 20)]
    want = full[:, 4:]
    assert torch.allclose(torch.stack(got, 1), want, atol=1e-5)


def test_gpt_decodes_past_its_window():
    m = make_model(_gpt()).eval()
    cache = m.init_cache()
    m.step(torch.randint(0, 256, (1, 20)), cache)
    for _ in range(30):  # past max_seq_len=24: the window slides, nothing raises
        out = m.step(torch.randint(0, 256, (1, 1)), cache)
    assert out.shape == (1, 256) and cache["bytes"].shape[1] <= 24


@pytest.mark.slow
def test_gpt_preset_trains_checkpoints_and_samples(tmp_path):
    out = tmp_path / "g"
    cmd = [sys.executable, "-m", "dormouse", "train", "gpt-small-ne", "--steps", "4", "--out",
           str(out), "--set", "batch=2", "--set", "seq_len=32", "--set", "warmup=0", "--set",
           "eval_every=2", "--set", "eval_batches=1", "--set", "d_model=64", "--set",
           "n_heads=2", "--set", "head_dim=32", "--set", "n_layers=1", "--set", "d_ffn=128"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:] + r.stdout[-2000:]
    assert (out / "best.pt").exists() and (out / "ckpt.pt").exists()
    s = subprocess.run([sys.executable, "-m", "dormouse", "sample", str(out / "best.pt"),
                        "--bytes", "20"], capture_output=True, timeout=300)  # fmt: skip
    assert s.returncode == 0 and len(s.stdout) >= 20
    c = subprocess.run([sys.executable, "-m", "dormouse", "compare", str(out), str(out),
                        "--out", str(tmp_path / "c.png")], capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert c.returncode == 0 and "time to" in c.stdout and (tmp_path / "c.png").stat().st_size
    bad = subprocess.run([sys.executable, "-m", "dormouse", "compare", str(out), str(tmp_path)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert bad.returncode == 2 and "no metrics.jsonl" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_gpt_refuses_fit():
    run = apply_sets(preset("gpt-small"), ["fit_gb=8"])
    from dormouse.train.run import prepare

    with pytest.raises(Exception, match="--fit models dormouse's own architecture"):
        prepare(run, "cpu")
