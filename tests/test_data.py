"""Byte data: bad-input messages, windows, the fleet layout, resume, mixture, default corpus."""

from __future__ import annotations

import io
import os
import stat
from dataclasses import replace

import numpy as np
import pytest
import torch
from trainlog import lines_to

from dormouse.config import TrainConfig
from dormouse.train import data as D
from dormouse.train.data import (
    ByteCorpus,
    ByteStream,
    DataError,
    Mixture,
    default_corpus,
    fleet_stride,
    open_data,
    rank_byte_offset,
    val_length,
    windows,
)


def _file(tmp_path, n, name="c.bin", seed=0):
    p = tmp_path / name
    p.write_bytes(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes())
    return p


def _cfg(*paths, **kw):
    return replace(TrainConfig(), data=tuple(str(p) for p in paths), **kw)


# ---- bad input ------------------------------------------------------------------------


def test_missing_file(tmp_path):
    p = tmp_path / "nope.txt"
    with pytest.raises(DataError, match="does not exist") as e:
        open_data(_cfg(p))
    assert str(p) in str(e.value) and "--data" in str(e.value)


def test_directory(tmp_path):
    with pytest.raises(DataError, match="is a directory") as e:
        ByteCorpus(tmp_path)
    assert str(tmp_path) in str(e.value) and "cat DIR/*" in str(e.value)


def test_empty_file(tmp_path):
    p = tmp_path / "empty.txt"
    p.write_bytes(b"")
    with pytest.raises(DataError, match=r"is empty \(0 bytes\)") as e:
        open_data(_cfg(p))
    assert str(p) in str(e.value)


def test_not_a_regular_file(tmp_path):
    p = tmp_path / "fifo"
    os.mkfifo(p)
    with pytest.raises(DataError, match="not a regular file"):
        ByteCorpus(p)


def test_shorter_than_one_window(tmp_path):
    p = _file(tmp_path, 10)
    with pytest.raises(DataError) as e:
        open_data(_cfg(p, batch=2, seq_len=8))
    msg = str(e.value)
    assert str(p) in msg and "has 10 bytes" in msg
    assert "batch*(seq_len+1) = 2*(8+1) = 18 bytes" in msg
    assert "lower --set batch or --set seq_len" in msg


def test_a_one_byte_file_names_the_least_file_not_an_impossible_shape(tmp_path):
    """It said 'so that batch*(seq_len+1) <= 1', which no batch and seq_len meet."""
    with pytest.raises(DataError) as e:
        open_data(_cfg(_file(tmp_path, 1), batch=2, seq_len=8))
    assert "give a file of at least 2 bytes" in str(e.value)
    assert "<= 1" not in str(e.value)


def test_unreadable_file(tmp_path, monkeypatch):
    p = _file(tmp_path, 100)
    p.chmod(0)
    try:
        with open(p, "rb"):
            bites = False  # root reads through mode 000: simulate the fault instead
    except PermissionError:
        bites = True
    if not bites:

        def deny(*_a, **_k):
            raise PermissionError(13, "Permission denied")

        monkeypatch.setattr(np, "memmap", deny)
    try:
        with pytest.raises(DataError, match="not readable by this user") as e:
            open_data(_cfg(p, batch=1, seq_len=8, val_frac=0.0))
        assert str(p) in str(e.value) and "chmod a+r" in str(e.value)
    finally:
        p.chmod(stat.S_IRUSR | stat.S_IWUSR)


def test_val_split_too_big_for_file(tmp_path):
    p = _file(tmp_path, 30)
    with pytest.raises(DataError, match="has 30 bytes: too few") as e:
        open_data(_cfg(p, batch=2, seq_len=8))  # window 18, val raised to 18
    assert "val_frac=0" in str(e.value)


def test_stream_stride_longer_than_view():
    with pytest.raises(DataError, match="has 50 bytes, but one step of the fleet reads 54"):
        ByteStream(bytes(50), 2, 8, offset=0, stride=54, name="x")


# ---- the val split rule ---------------------------------------------------------------------


def test_val_length_rule():
    assert val_length(1000, 0.01, 0, window=1) == 10  # last ceil(1% of 1000)
    assert val_length(1001, 0.01, 0, window=1) == 11  # ceil, never rounds down to less
    assert val_length(1000, 0.01, 0, window=50) == 50  # raised to one window
    assert val_length(1000, 0.5, 123, window=50) == 123  # val_bytes wins over val_frac
    assert val_length(1000, 0.0, 0, window=50) == 0  # no val split at all
    with pytest.raises(DataError, match=r"val_frac=1.0 must be in \[0, 1\)"):
        val_length(1000, 1.0, 0)


def test_split_is_the_tail(tmp_path):
    p = _file(tmp_path, 1000)
    c = ByteCorpus(p)
    tr, va = c.split(0.1, 0, window=18)
    raw = p.read_bytes()
    assert tr.tobytes() == raw[:900] and va.tobytes() == raw[900:]


# ---- windows -------------------------------------------------------------------------------


def test_windows_shift():
    raw = np.arange(3 * 5, dtype=np.uint8)  # 3 windows of seq_len 4
    x, y = windows(raw, 3, 4)
    assert x.dtype == torch.int64 and x.shape == (3, 4) and y.shape == (3, 4)
    assert x.tolist() == [[0, 1, 2, 3], [5, 6, 7, 8], [10, 11, 12, 13]]
    assert y.tolist() == [[1, 2, 3, 4], [6, 7, 8, 9], [11, 12, 13, 14]]
    with pytest.raises(ValueError, match="got 14 bytes"):
        windows(raw[:14], 3, 4)


# ---- the fleet layout -----------------------------------------------------------------------


def test_rank_offsets_and_stride():
    assert [rank_byte_offset([2, 1], 8, r) for r in range(2)] == [0, 18]
    assert [rank_byte_offset([1, 1, 1], 8, r) for r in range(3)] == [0, 9, 18]
    assert fleet_stride([2, 1], 8) == 27 and fleet_stride([4], 8) == 36


@pytest.mark.parametrize("batches", [[2, 1], [1, 1, 1], [3, 1, 2]])
def test_fleet_union_is_single_process_block(batches):
    seq = 8
    view = np.random.default_rng(1).integers(0, 256, 1000, dtype=np.uint8)
    stride = fleet_stride(batches, seq)
    ranks = [ByteStream(view, b, seq, rank_byte_offset(batches, seq, r), stride)
             for r, b in enumerate(batches)]  # fmt: skip
    single = ByteStream(view, sum(batches), seq)
    n_blocks = len(view) // stride
    # steps 0..5, and the steps either side of the wrap
    for s in list(range(6)) + list(range(n_blocks - 2, n_blocks + 3)):
        fleet = np.concatenate([rk.read(s) for rk in ranks])
        assert np.array_equal(fleet, single.read(s)), f"step {s}"
        xs = torch.cat([rk.peek(s)[0] for rk in ranks])
        assert torch.equal(xs, single.peek(s)[0])


@pytest.mark.parametrize("batches", [[2, 1], [1, 1, 1]])
def test_one_pass_reads_every_block_byte_once(batches):
    """Closes the seeds' gap 6: no byte is re-read within a pass (n_blocks steps)."""
    seq, n = 8, 1000
    stride = fleet_stride(batches, seq)
    ranks = [ByteStream(bytes(n), b, seq, rank_byte_offset(batches, seq, r), stride)
             for r, b in enumerate(batches)]  # fmt: skip
    n_blocks = n // stride
    hits = np.zeros(n, dtype=int)
    for s in range(n_blocks):
        for rk in ranks:
            a, b = rk.span(s)
            hits[a:b] += 1
    assert (hits[: n_blocks * stride] == 1).all()
    assert (hits[n_blocks * stride :] == 0).all()  # the tail shorter than one block
    assert ranks[0].span(n_blocks) == ranks[0].span(0)  # wraps per block


def test_stream_next_advances_and_matches_peek():
    view = np.random.default_rng(2).integers(0, 256, 500, dtype=np.uint8)
    st = ByteStream(view, 2, 8)
    want = [st.peek(s) for s in range(4)]
    for s in range(4):
        assert st.position == s
        x, y = st.next()
        assert torch.equal(x, want[s][0]) and torch.equal(y, want[s][1])


# ---- exact resume -----------------------------------------------------------------------------


def _roundtrip(sd):
    buf = io.BytesIO()
    torch.save(sd, buf)  # the checkpoint path: must survive weights_only loading
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_stream_exact_resume():
    view = np.random.default_rng(3).integers(0, 256, 700, dtype=np.uint8)
    a = ByteStream(view, 3, 8)
    full = [a.next()[0] for _ in range(40)]  # 40 > n_blocks = 25: crosses the wrap
    b = ByteStream(view, 3, 8)
    for _ in range(17):
        b.next()
    c = ByteStream(view, 3, 8)
    c.load_state_dict(_roundtrip(b.state_dict()))
    assert c.position == 17
    assert all(torch.equal(c.next()[0], full[s]) for s in range(17, 40))


def test_resume_across_a_new_rank_split_and_refusals():
    view = np.random.default_rng(4).integers(0, 256, 700, dtype=np.uint8)
    single = ByteStream(view, 3, 8)
    for _ in range(5):
        single.next()
    sd = single.state_dict()
    # same global block (3 windows), now split 2 + 1 across two ranks: allowed and exact
    r1 = ByteStream(view, 1, 8, offset=rank_byte_offset([2, 1], 8, 1), stride=27)
    r1.load_state_dict(sd)
    assert np.array_equal(r1.read(r1.position), single.read(5)[18:])
    with pytest.raises(DataError, match="read 27 bytes per step, this one reads 36"):
        ByteStream(view, 4, 8).load_state_dict(sd)
    with pytest.raises(DataError, match="train split of 700 bytes, this one has 600"):
        ByteStream(view[:600], 3, 8).load_state_dict(sd)


# ---- mixture ------------------------------------------------------------------------------------


def _mix(seed=0, weights=(3.0, 1.0)):
    views = [np.random.default_rng(10 + i).integers(0, 256, 900, dtype=np.uint8)
             for i in range(len(weights))]  # fmt: skip
    return Mixture([ByteStream(v, 2, 8, name=f"s{i}") for i, v in enumerate(views)],
                   weights, seed)  # fmt: skip


def test_mixture_deterministic_and_weighted():
    a, b = _mix(), _mix()
    for _ in range(30):
        assert torch.equal(a.next()[0], b.next()[0])
    picks = [a.source_at(s) for s in range(4000)]
    # 0.03: binomial std at p=0.75, n=4000 is 0.0068, so 0.03 is > 4 sigma
    assert abs(picks.count(0) / 4000 - 0.75) < 0.03
    assert picks != [_mix(seed=1).source_at(s) for s in range(4000)]  # the seed matters
    # each source's position counts exactly the steps that picked it
    assert a.streams[0].position == [a.source_at(s) for s in range(30)].count(0)
    z = _mix(weights=(1.0, 0.0, 2.0))
    assert 1 not in [z.source_at(s) for s in range(2000)]


def test_mixture_exact_resume():
    a = _mix()
    full = [a.next()[0] for _ in range(60)]
    b = _mix()
    for _ in range(23):
        b.next()
    c = _mix()
    c.load_state_dict(_roundtrip(b.state_dict()))
    assert all(torch.equal(c.next()[0], full[s]) for s in range(23, 60))
    with pytest.raises(DataError, match="seed=0 .* this run seed=5"):
        _mix(seed=5).load_state_dict(b.state_dict())
    with pytest.raises(DataError, match="covers 1 source"):
        c.load_state_dict(ByteStream(bytes(900), 2, 8).state_dict())


def test_mixture_weight_refusal(tmp_path):
    p, q = _file(tmp_path, 500, "a"), _file(tmp_path, 500, "b")
    with pytest.raises(DataError, match="at least one > 0"):
        open_data(_cfg(p, q, batch=2, seq_len=8, data_weights=(0.0, 0.0)))
    with pytest.raises(DataError, match="1 data_weights for 2 corpora"):
        open_data(_cfg(p, q, batch=2, seq_len=8, data_weights=(1.0,)))


# ---- open_data and val batches -----------------------------------------------------------------


def test_open_data_single_file_and_val_batches(tmp_path):
    p = _file(tmp_path, 2000)
    lines = []
    with lines_to(lines.append):
        ds = open_data(_cfg(p, batch=2, seq_len=8, val_frac=0.1, shuffle=False))
    assert "train 1800 + val 200" in lines[-1]
    st = ds.train_stream(2, 8)
    assert isinstance(st, ByteStream) and np.array_equal(st.read(0), np.frombuffer(
        p.read_bytes()[:18], np.uint8))  # fmt: skip
    v1, v2 = ds.val_batches(4, 2, 8), ds.val_batches(4, 2, 8)
    assert len(v1) == 4 and all(torch.equal(a[0], b[0]) for a, b in zip(v1, v2))
    raw = np.frombuffer(p.read_bytes(), np.uint8)
    first, last = v1[0], v1[-1]
    assert torch.equal(first[0], windows(raw[1800:1818], 2, 8)[0])  # starts the val split
    assert torch.equal(last[1], windows(raw[-18:], 2, 8)[1])  # ends it
    no_val = open_data(_cfg(p, batch=2, seq_len=8, val_frac=0.0))
    with pytest.raises(DataError, match="no validation split"):
        no_val.val_batches(4, 2, 8)


def test_open_data_mixture(tmp_path):
    p, q = _file(tmp_path, 900, "a", 1), _file(tmp_path, 300, "b", 2)
    lines = []
    with lines_to(lines.append):
        ds = open_data(_cfg(p, q, batch=2, seq_len=8, val_frac=0.1))
    assert "weights by train size" in lines[-1]
    st = ds.train_stream(2, 8, offset=0, stride=27)  # a fleet of [2, 1]
    assert isinstance(st, Mixture) and len(st.streams) == 2
    assert len(ds.val_batches(5, 2, 8)) == 5
    assert D._shares(5, [3.0, 1.0]) == [4, 1] and D._shares(7, [1, 1, 1]) == [3, 2, 2]


# ---- the default corpus ------------------------------------------------------------------

_CAP = 200_000  # a prefix of the stdlib keeps the test fast; the rule is the same as the full build


def test_default_corpus_deterministic_and_cached(tmp_path, monkeypatch):
    logs = []
    with lines_to(logs.append):
        a = default_corpus(tmp_path / "one", cap_bytes=_CAP)
        monkeypatch.setenv("DORMOUSE_CACHE", str(tmp_path / "two"))
        b = default_corpus(cap_bytes=_CAP)
    assert a.parent == tmp_path / "one" and b.parent == tmp_path / "two"
    assert a.name == b.name and a.read_bytes() == b.read_bytes()
    assert "built in" in logs[0] and str(a) in logs[0] and "cap 0.2 MiB" in logs[0]
    mtime = b.stat().st_mtime_ns
    with lines_to(logs.append):
        assert default_corpus(cap_bytes=_CAP) == b
    assert "reused from the cache" in logs[-1] and b.stat().st_mtime_ns == mtime
    text = a.read_bytes()
    assert 0 < len(text) <= _CAP
    heads = [ln[len(b"# file: "):].decode() for ln in text.split(b"\n")
             if ln.startswith(b"# file: ")]  # fmt: skip
    assert heads and heads == sorted(heads) and text.startswith(b"# file: ")
    assert not any(h.split("/")[0] in ("site-packages", "test") for h in heads)
    assert not list(tmp_path.glob("*/*.tmp"))  # the temp file was renamed, not left behind


def test_default_corpus_is_used_without_data(tmp_path, monkeypatch):
    monkeypatch.setattr(D, "DEFAULT_CORPUS_CAP", _CAP)
    lines = []
    with lines_to(lines.append):
        ds = open_data(replace(TrainConfig(), batch=2, seq_len=16, shuffle=False),
                       cache_dir=tmp_path)  # fmt: skip
    assert ds.is_default and "no --data given" in lines[0] and "default corpus" in lines[1]
    x, _ = ds.train_stream(2, 16).next()
    assert bytes(x[0].tolist()).startswith(b"# file: ")


def test_default_corpus_selection_rule(tmp_path, monkeypatch):
    root = tmp_path / "lib"
    files = {
        "b.py": b"B\n", "a.py": b"A",  # a lacks its final newline: one is added
        "pkg/__init__.py": b"P\n", "pkg/tests/t.py": b"T\n", "test/x.py": b"X\n",
        "site-packages/s.py": b"S\n", "idlelib/idle_test/i.py": b"I\n", "notes.txt": b"N\n",
        "zz.py": b"Z" * 100,  # would pass the cap below: the corpus stops before it
    }  # fmt: skip
    for rel, body in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(body)
    (root / "gone.py").symlink_to(root / "missing")  # unreadable: skipped
    monkeypatch.setattr(D.sysconfig, "get_paths", lambda: {"stdlib": str(root)})
    p = default_corpus(tmp_path / "cache", cap_bytes=80)
    assert p.read_bytes() == b"# file: a.py\nA\n# file: b.py\nB\n# file: pkg/__init__.py\nP\n"
    empty = tmp_path / "nolib"
    empty.mkdir()
    monkeypatch.setattr(D.sysconfig, "get_paths", lambda: {"stdlib": str(empty)})
    with pytest.raises(DataError, match="no standard-library .py sources found .* --data"):
        default_corpus(tmp_path / "cache")


def test_shuffled_blocks_keep_the_fleet_layout_and_cover_each_pass(tmp_path):
    # The shuffled order is a function of (seed, step): ranks split the same block, a pass
    # visits every block once, and the order differs from file order.
    view = np.arange(3 * 7 * 40, dtype=np.int64).astype(np.uint8)
    ByteStream, fleet_stride, rank_byte_offset = D.ByteStream, D.fleet_stride, D.rank_byte_offset
    batches, seq = [2, 1], 6
    stride = fleet_stride(batches, seq)
    single = ByteStream(view, 3, seq, shuffle_seed=5)
    ranks = [ByteStream(view, b, seq, rank_byte_offset(batches, seq, r), stride, shuffle_seed=5)
             for r, b in enumerate(batches)]  # fmt: skip
    for step in range(2 * single.n_blocks):
        assert np.array_equal(np.concatenate([r.read(step) for r in ranks]), single.read(step))
    first = [single.block(s) for s in range(single.n_blocks)]
    assert sorted(first) == list(range(single.n_blocks)) and first != sorted(first)
    second = [single.block(s) for s in range(single.n_blocks, 2 * single.n_blocks)]
    assert second != first  # a new order each pass


def test_a_shrunken_file_is_refused_before_it_is_read(tmp_path):
    # reading a memory map past a truncated file's end kills the process with SIGBUS
    path = tmp_path / "c.bin"
    path.write_bytes(bytes(range(256)) * 40)
    cfg = TrainConfig(data=(str(path),), batch=2, seq_len=16, val_frac=0.0)
    stream = D.open_data(cfg).train_stream(2, 16)
    stream.next()
    os.truncate(path, 100)
    with pytest.raises(D.DataError, match="shrank from 10240 to 100 bytes.*before step 1"):
        stream.next()
    assert stream.position == 1  # nothing consumed: a checkpoint now resumes exactly


# ---- per-pass phases: windows that never repeat exactly ------------------------------------


@pytest.mark.parametrize("batches", [[2, 1], [1, 1, 1], [3, 1, 2]])
def test_phased_passes_read_each_byte_once_and_keep_the_fleet_layout(batches):
    # the ring layout: each pass from its own phase; per pass every byte at most once, fewer
    # than one stride unread, and the ranks' slices still make up the single process's block
    seq, n = 6, 1009
    view = np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8)
    stride = fleet_stride(batches, seq)
    ranks = [ByteStream(view, b, seq, rank_byte_offset(batches, seq, r), stride, shuffle_seed=3)
             for r, b in enumerate(batches)]  # fmt: skip
    single = ByteStream(view, sum(batches), seq, shuffle_seed=3)
    nb = single.n_blocks
    phases = {single.phase(p) for p in range(3)}
    assert len(phases) == 3  # three passes, three starting bytes
    for p in range(3):
        hits = np.zeros(n, dtype=int)
        for s in range(p * nb, (p + 1) * nb):
            assert np.array_equal(np.concatenate([r.read(s) for r in ranks]), single.read(s))
            for r in ranks:
                a, b = r.span(s)
                idx = np.arange(a, b) % n
                hits[idx] += 1
                assert np.array_equal(view[idx], r.read(s))  # the seam wraps, byte for byte
        assert hits.max() == 1 and (hits == 0).sum() == n - nb * stride < stride


def test_phased_windows_differ_between_passes():
    # the memorisation fix: a window (seq_len+1 bytes at one offset) seen in pass 0 comes back
    # in pass 1 only when the phases agree modulo seq_len+1
    seq, n = 16, 20000
    view = np.random.default_rng(8).integers(0, 256, n, dtype=np.uint8)
    st = ByteStream(view, 4, seq, shuffle_seed=11)
    nb = st.n_blocks

    def starts(p):
        return {(st.span(s)[0] + k * (seq + 1)) % n for s in range(p * nb, (p + 1) * nb)
                for k in range(4)}  # fmt: skip

    same_mod = (st.phase(0) - st.phase(1)) % (seq + 1) == 0
    shared = len(starts(0) & starts(1))
    assert (shared > 0) == same_mod and shared < (nb * 4) // 2
    # unshuffled: phase 0 in every pass, the old fixed layout
    plain = ByteStream(view, 4, seq)
    assert plain.phase(5) == 0 and plain.span(nb) == plain.span(0)


def test_phased_resume_is_exact_and_an_old_checkpoint_keeps_its_layout():
    view = np.random.default_rng(9).integers(0, 256, 700, dtype=np.uint8)
    a = ByteStream(view, 3, 8, shuffle_seed=4)
    full = [a.next()[0] for _ in range(60)]  # > 2 passes of 25 blocks
    b = ByteStream(view, 3, 8, shuffle_seed=4)
    for _ in range(31):
        b.next()
    c = ByteStream(view, 3, 8, shuffle_seed=4)
    c.load_state_dict(_roundtrip(b.state_dict()))
    assert all(torch.equal(c.next()[0], full[s]) for s in range(31, 60))
    # a data state written before phases existed (no "phased" key) resumes on phase 0
    old = {k: v for k, v in b.state_dict().items() if k != "phased"}
    d = ByteStream(view, 3, 8, shuffle_seed=4)
    d.load_state_dict(old)
    assert not d.phased and d.span(31)[0] == d.block(31) * d.stride
