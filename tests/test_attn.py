"""The softmax-attention mixer (`attn_every`, model/attn.py): a hybrid body decodes byte by
byte what its training forward computes, refuses what it cannot run in one line, trains and
samples through the CLI, and the FLOP counts split the body by mixer. Its equations are held
by gate g32 (references/model.py) and its causality by gate g18."""

from __future__ import annotations

import json

import pytest
import torch

from dormouse.config import ConfigError, apply_sets, preset, validate
from dormouse.model.attn import AttnMixer, rope
from dormouse.model.kda import KDAMixer
from gates.g18_causal import wake


def _hybrid(tiny_model, **fields):
    fields = {"n_layers": 2, "attn_every": 2, "kda_impl": "torch", **fields}
    model = tiny_model(seed=5, **fields).double().eval()
    wake(model)  # the deltas' B and the other zero-initialised paths carry signal
    return model


def test_every_nth_block_mixes_by_attention(tiny_model):
    model = tiny_model(n_layers=4, attn_every=2)
    kinds = [type(b.mixer) for b in model.blocks]
    assert kinds == [KDAMixer, AttnMixer, KDAMixer, AttnMixer]
    assert all(type(b.mixer) is KDAMixer for b in tiny_model(n_layers=3).blocks)


@pytest.mark.parametrize("chunks", [(1,) * 24, (5, 1, 7, 11), (24,)])
def test_decoding_reproduces_the_training_forward(tiny_model, chunks):
    """Byte by byte, in chunks after a prefix, or whole: the KV cache (rotated keys at their
    positions) gives the logits of the window's forward at fp64 round-off."""
    model = _hybrid(tiny_model)
    x = torch.randint(0, 256, (2, sum(chunks)), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(x)[0]
        cache, at = model.init_cache(), 0
        for n in chunks:
            last = model.step(x[:, at : at + n], cache)
            at += n
            assert (last - full[:, at - 1]).abs().max() < 1e-12


def test_rope_turns_pairs_by_position():
    """The rotation keeps each pair's length, is the identity at position 0, and a score
    depends on the positions' difference only (what makes the decode cache valid)."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 1, 1, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 1, 1, 8, generator=g, dtype=torch.float64)
    assert torch.equal(rope(q, 0), q)
    assert torch.allclose(rope(q, 9).norm(), q.norm())
    s1 = (rope(q, 7) * rope(k, 3)).sum()
    s2 = (rope(q, 104) * rope(k, 100)).sum()
    assert torch.allclose(s1, s2) and not torch.allclose(s1, (q * k).sum())


@pytest.mark.parametrize(
    "sets, words",
    [
        (["n_layers=2", "attn_every=3"], "exceeds n_layers=2"),
        (["attn_every=1", "segment_len=16"], "no state across segments"),
        (["attn_every=1", "n_heads=4", "head_dim=15", "d_model=60"], "head_dim must be even"),
        (["attn_every=-1"], "must not be negative"),
    ],
)
def test_what_a_hybrid_cannot_run_is_refused(sets, words):
    with pytest.raises(ConfigError, match=words):
        validate(apply_sets(preset("tiny"), sets))


def test_flops_split_the_body_by_mixer(tiny_model):
    from dormouse.bench.flops import attention_forward_flops, kda_forward_flops

    model = _hybrid(tiny_model, n_layers=4, attn_every=4)
    model(torch.zeros(1, 16, dtype=torch.long))  # the first forward chooses the KDA arm
    cfg = model.cfg
    per_app = 2 * cfg.d_attn * 16 * 17  # Q K^T and A V over the causal pairs of 16 bytes
    assert attention_forward_flops(model, 1, 16) == cfg.max_iter * 1 * per_app
    kda_only = _hybrid(tiny_model, n_layers=4, attn_every=0)
    kda_only(torch.zeros(1, 16, dtype=torch.long))
    assert kda_forward_flops(model, 1, 16) * 4 == kda_forward_flops(kda_only, 1, 16) * 3


def test_a_hybrid_trains_resumes_and_samples(tmp_path, corpus):
    """Through the CLI: a hybrid run learns, writes a checkpoint the sampler decodes from, and
    a resume continues it."""
    from dormouse.cli import main

    out = tmp_path / "run"

    def train(steps: int, *more: str) -> int:
        return main(["train", "tiny", "--data", str(corpus), "--out", str(out), "--steps",
                     str(steps), "--set", "n_layers=2", "--set", "attn_every=2", "--set",
                     "eval_every=6", *more])  # fmt: skip

    assert train(12) == 0

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r["loss"] for r in rows if r.get("kind") == "eval"]
    assert len(evals) >= 2 and evals[-1] < evals[0]
    assert main(["sample", str(out / "ckpt.pt"), "--bytes", "16", "--prompt", "the "]) == 0
    assert train(24, "--resume", "auto") == 0
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 24


def test_decoding_past_max_seq_len_reads_a_sliding_window(tiny_model):
    """Past max_seq_len (tiny: 64) each attention reads the last 64 bytes: a long prompt in one
    call equals the same bytes fed one at a time (the band mask against the trimmed cache), the
    cache never holds more than 63 keys, and with attention in every block a byte beyond the
    stacked windows (4 applications x 63 back, plus Engram's few bytes) no longer moves the
    logits (KDA's state would carry it)."""
    model = _hybrid(tiny_model, n_layers=2, attn_every=1)
    W = model.cfg.max_seq_len
    x = torch.randint(0, 256, (2, 5 * W + 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        cache = model.init_cache()
        whole = model.step(x, cache)
        assert all(c["k"].shape[2] == W - 1 for m in cache["mix"].values() for c in m.values())
        cache, last = model.init_cache(), None
        for t in range(x.shape[1]):
            last = model.step(x[:, t : t + 1], cache)
        assert (whole - last).abs().max() < 1e-12
        y = x.clone()
        y[:, :8] = (y[:, :8] + 1) % 256  # > 4 x 63 + Engram's reach before the last byte
        assert (model.step(y, model.init_cache()) - whole).abs().max() < 1e-12
        y[:, -W + 2] = (y[:, -W + 2] + 1) % 256  # inside the window: it must move
        assert (model.step(y, model.init_cache()) - whole).abs().max() > 1e-6
