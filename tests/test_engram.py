"""Engram: identity at init, the hash (pinned, spread, local), decode cache, sparse grads."""

from __future__ import annotations

import pathlib
from dataclasses import replace

import pytest
import torch

from dormouse.config import preset
from dormouse.model import engram as E
from dormouse.model.engram import Engram, VramTables, engram_indices

TINY = preset("tiny").model
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bytes(b, t, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, t), generator=g)


def _module(cfg, seed=0):
    torch.manual_seed(seed)
    return Engram(cfg)


# ---- a second, pure-Python statement of the hash in the module docstring ----------------

M64, M32 = (1 << 64) - 1, (1 << 32) - 1


def _sm64(x):
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def _ref_indices(rows_bytes, cfg, prev=None):
    """rows_bytes: list of byte lists -> nested list [B][T][n_tables], one int at a time."""
    p = max(cfg.engram_orders) - 1
    out = []
    for bi, seq in enumerate(rows_bytes):
        hist = list(prev[bi]) if prev is not None else [256] * p
        full = hist + list(seq)
        out_b = []
        for t in range(len(seq)):
            pos = p + t
            out_t = []
            for n in cfg.engram_orders:
                for j in range(cfg.engram_heads):
                    acc = 0
                    for d in range(n):
                        r = _sm64(E.HASH_SEED ^ (n << 48) ^ (j << 24) ^ d)
                        m = (r & ((1 << 22) - 1)) | (1 << 22) | 1
                        acc ^= (full[pos - d] + 1) * m
                    h = acc ^ (_sm64(E.HASH_SEED ^ (n << 48) ^ (j << 24) ^ 0xFFFFFF) & M32)
                    h = (((h >> 16) ^ h) * 0x45D9F3B) & M32
                    h = (((h >> 16) ^ h) * 0x45D9F3B) & M32
                    h = (h >> 16) ^ h
                    out_t.append(h % cfg.engram_rows)
            out_b.append(out_t)
        out.append(out_b)
    return out


# ---- (a) identity at init -----------------------------------------------------------------


@pytest.mark.parametrize("orders", [(2, 3), (2, 3, 5)])
def test_identity_at_init_exact(orders):
    cfg = replace(TINY, engram_orders=orders)
    m = _module(cfg)
    h = torch.randn(3, 17, cfg.d_model) * 5
    x = _bytes(3, 17)
    out, none = m(h, x)
    assert none is None
    assert torch.equal(out, h)
    out_c, cache = m(h, x, cache={})
    assert torch.equal(out_c, h) and cache is not None


def test_zero_conv_still_learns():
    # Zero-init must not be a dead end: the conv weight's own gradient is u * upstream.
    m = _module(TINY)
    h = torch.randn(2, 9, TINY.d_model)
    out, _ = m(h, _bytes(2, 9))
    (out * torch.randn_like(out)).sum().backward()
    assert m.conv.weight.grad.abs().sum() > 0


def test_parameter_names_and_shapes():
    m = _module(TINY)
    nt = len(TINY.engram_orders) * TINY.engram_heads
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes == {
        "store.table": (nt, TINY.engram_rows, TINY.engram_dim),
        "key.weight": (TINY.d_model, nt * TINY.engram_dim),
        "value.weight": (TINY.d_model, nt * TINY.engram_dim),
        "norm_h.weight": (TINY.d_model,),
        "norm_k.weight": (TINY.d_model,),
        "conv.weight": (TINY.d_model, 1, TINY.conv_size),
    }
    assert isinstance(m.store, VramTables)


def test_shape_mismatch_is_loud():
    m = _module(TINY)
    with pytest.raises(ValueError, match="x_bytes has shape"):
        m(torch.randn(2, 8, TINY.d_model), _bytes(2, 7))
    with pytest.raises(ValueError, match="integer bytes"):
        engram_indices(torch.randn(2, 8), TINY)


# ---- (b) the hash is deterministic and is the documented formula ---------------------------


def test_hash_matches_python_loop():
    cfg = replace(TINY, engram_orders=(2, 3, 5), engram_heads=3, engram_rows=997)
    x = _bytes(2, 23, seed=3)
    x[0, :4] = torch.tensor([0, 0, 255, 0])  # zero bytes and 0xff right after the pad
    got = engram_indices(x, cfg).tolist()
    assert got == _ref_indices(x.tolist(), cfg)
    prev = _bytes(2, 4, seed=4)
    assert engram_indices(x, cfg, prev).tolist() == _ref_indices(x.tolist(), cfg, prev.tolist())


def test_hash_pinned_values():
    # Computed once from the formula; a change here silently re-maps every checkpoint's rows.
    cfg = replace(TINY, engram_rows=1000)
    x = torch.tensor([list(b"hello"), list(b"\x00\x00\xff a")])
    expected = [  # [table][batch][time]; tables: (order 2, head 0/1), (order 3, head 0/1)
        [[156, 344, 790, 841, 100], [836, 235, 642, 776, 924]],
        [[597, 408, 37, 526, 349], [79, 107, 959, 468, 982]],
        [[702, 115, 625, 538, 426], [206, 141, 928, 134, 551]],
        [[767, 214, 725, 253, 782], [38, 354, 978, 461, 73]],
    ]
    assert engram_indices(x, cfg).permute(2, 0, 1).tolist() == expected
    assert _ref_indices(x.tolist(), cfg) == engram_indices(x, cfg).tolist()


def test_hash_independent_of_torch_rng_and_caches():
    x = _bytes(2, 40)
    torch.manual_seed(1)
    a = engram_indices(x, TINY)
    torch.manual_seed(12345)
    torch.randn(100)
    E._CONSTS.clear()
    b = engram_indices(x.to(torch.uint8), TINY)
    assert a.dtype == torch.int64 and torch.equal(a, b)


def test_hash_reads_exactly_the_last_n_bytes():
    cfg = replace(TINY, engram_orders=(2, 4), engram_rows=1 << 16)
    x = _bytes(1, 64, seed=5)
    base = engram_indices(x, cfg)
    t = 40
    for table, n in enumerate([2, 2, 4, 4]):
        far = x.clone()
        far[0, t - n] ^= 0x5A  # just outside the n-gram that ends at t
        assert engram_indices(far, cfg)[0, t, table] == base[0, t, table]
        for d in range(n):  # every byte inside the n-gram moves the row
            near = x.clone()
            near[0, t - d] ^= 0x5A
            assert engram_indices(near, cfg)[0, t, table] != base[0, t, table]
    # The same n-gram at two places picks the same row (no position in the hash).
    y = torch.tensor([list(b"xyzabcd..abcd")])
    iy = engram_indices(y, cfg)
    assert torch.equal(iy[0, 6], iy[0, 12])


# ---- (c) spread -----------------------------------------------------------------------------


def _repo_text(limit=32768):
    data = b"".join(p.read_bytes() for p in sorted((ROOT / "dormouse").rglob("*.py")))
    assert len(data) > 8192, "need a real text sample from this repo's sources"
    return list(data[:limit])


@pytest.mark.parametrize("source", ["random", "text"])
@pytest.mark.parametrize("rows", [64, 1024])
def test_spread(source, rows):
    cfg = replace(TINY, engram_rows=rows, engram_heads=3, engram_orders=(2, 3, 4))
    seq = _bytes(1, 16384, seed=7)[0].tolist() if source == "random" else _repo_text()
    idx = engram_indices(torch.tensor([seq]), cfg)[0]  # [T, n_tables]
    p = max(cfg.engram_orders) - 1
    padded = torch.tensor([256] * p + seq)
    for table, n in enumerate(o for o in cfg.engram_orders for _ in range(cfg.engram_heads)):
        gram_id = sum(padded[p - d : p - d + len(seq)] * 257**d for d in range(n))
        grams, inv = torch.unique(gram_id, return_inverse=True)
        row_of_gram = torch.zeros(len(grams), dtype=torch.int64).scatter_(0, inv, idx[:, table])
        hit = len(torch.unique(row_of_gram))
        # A uniform hash of D keys into R rows covers R(1 - e^{-D/R}) >= 0.63 min(R, D).
        assert hit > 0.5 * min(rows, len(grams)), (table, hit, rows, len(grams))
        # No row soaks up the keys. Row loads are ~Poisson(fair); over <= 1024 rows the
        # maximum stays within fair + 6 sd + 8 (the +8 covers the small-mean tail).
        load = torch.bincount(row_of_gram, minlength=rows)
        fair = len(grams) / rows
        assert load.max() <= fair + 6 * fair**0.5 + 8, (table, int(load.max()), fair)


def test_heads_of_one_order_disagree():
    cfg = replace(TINY, engram_rows=1024, engram_heads=4, engram_orders=(2, 3))
    idx = engram_indices(torch.tensor([_repo_text()]), cfg)[0]
    for o in range(len(cfg.engram_orders)):
        for a in range(cfg.engram_heads):
            for b in range(a + 1, cfg.engram_heads):
                same = (idx[:, o * 4 + a] == idx[:, o * 4 + b]).float().mean().item()
                # Independent heads agree with probability 1/rows ~ 0.001 per position.
                assert same < 0.01, (o, a, b, same)


# ---- (d) decoding with the cache ----------------------------------------------------------


def _trained(cfg, seed=0):
    m = _module(cfg, seed)
    with torch.no_grad():
        m.conv.weight.normal_(0, 1.0)
        m.norm_h.weight.uniform_(0.5, 1.5)
        m.value.weight.mul_(20)  # make the update the same size as h
    return m


@pytest.mark.parametrize("orders,conv", [((2, 3), 4), ((2, 3, 5), 1), ((4,), 2)])
def test_decode_byte_by_byte_matches_full(orders, conv):
    cfg = replace(TINY, engram_orders=orders, conv_size=conv)
    m = _trained(cfg)
    b, t = 2, 19
    h, x = torch.randn(b, t, cfg.d_model), _bytes(b, t, seed=9)
    full, _ = m(h, x)
    assert (full - h).abs().max() > 1e-2  # the check below is not against an identity
    cache, steps = {}, []
    for i in range(t):
        out, cache = m(h[:, i : i + 1], x[:, i : i + 1], cache)
        steps.append(out)
    # fp32 round-off of the same few multiply-adds summed in another order: ~1e-7.
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-6)
    assert cache["bytes"].shape == (b, max(orders) - 1)
    assert cache["u"].shape == (b, conv - 1, cfg.d_model)


def test_prefill_then_decode_matches_full():
    m = _trained(TINY)
    h, x = torch.randn(2, 12, TINY.d_model), _bytes(2, 12, seed=11)
    full, _ = m(h, x)
    first, cache = m(h[:, :1], x[:, :1], {})  # shorter than the byte history
    mid, cache = m(h[:, 1:7], x[:, 1:7], cache)
    outs = [first, mid]
    for i in range(7, 12):
        o, cache = m(h[:, i : i + 1], x[:, i : i + 1], cache)
        outs.append(o)
    # Same round-off bound as the byte-by-byte test.
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=0, atol=1e-6)


# ---- (e) gradients land on the gathered rows only -------------------------------------------


def test_grad_touches_only_gathered_rows():
    cfg = replace(TINY, engram_rows=256)
    m = _trained(cfg)
    x = _bytes(2, 20, seed=13)
    out, _ = m(torch.randn(2, 20, cfg.d_model), x)
    (out * torch.randn_like(out)).sum().backward()
    g = m.store.table.grad  # [n_tables, rows, dim]
    touched = g.abs().sum(-1) > 0
    idx = engram_indices(x, cfg)
    gathered = torch.zeros_like(touched)
    for table in range(idx.shape[-1]):
        gathered[table, idx[..., table].flatten()] = True
    assert not (touched & ~gathered).any()  # nothing outside the gather
    assert torch.equal(touched, gathered)  # and every gathered row learns
