"""engram_ram on a fleet: the host-row reduction, without a fleet.

(a) `merge_row_grads`, the arithmetic every rank runs on the all-gathered (rows, grad) sets:
    the union, per-row sums over the ranks that touched a row, the mean, the RANK order of the
    sum (what makes every rank's bits the same), refusals; (b) the HostTables API the seam
    uses (`pending`, `replace_pending`) and that step applies the installed gradient; (c) the
    seam on a one-rank gloo group, and the unused-parameter probe leaves no host gradient.
The two-rank claim itself (fleet == one process at the global batch, ranks bitwise equal) is
gate g14 (`python -m gates g14_engram_ram_fleet`).
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch

from dormouse.config import preset
from dormouse.model import DormouseModel
from dormouse.model.engram import HostTables
from dormouse.train.context import DPContext, RankShape, merge_row_grads
from dormouse.train.fleet.parallelize import parallelize, params_without_grad


def _part(rows: list[int], grads: list[list[float]]):
    return torch.tensor(rows, dtype=torch.int64), torch.tensor(grads, dtype=torch.float32)


# ---- (a) merge_row_grads ------------------------------------------------------------------------


def test_merge_sums_shared_rows_keeps_the_others_and_takes_the_mean():
    parts = [
        _part([1, 4, 7], [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]),
        _part([0, 4], [[10.0, 20.0], [30.0, 40.0]]),  # row 4 shared with ranks 0 and 2
        _part([4, 7, 9], [[100.0, 200.0], [300.0, 400.0], [500.0, 600.0]]),
    ]
    rows, grad = merge_row_grads(parts, 3)
    assert rows.tolist() == [0, 1, 4, 7, 9]  # the union, ascending
    want = {0: [10, 20], 1: [1, 2], 4: [3 + 30 + 100, 4 + 40 + 200], 7: [5 + 300, 6 + 400],
            9: [500, 600]}  # fmt: skip
    # The sums are small integers, exact in fp32: the merge must return them / 3 in fp32.
    sums = torch.tensor([want[r] for r in rows.tolist()], dtype=torch.float32)
    assert torch.equal(grad, sums / 3)


def test_merge_with_an_empty_rank_and_with_one_rank():
    empty = (torch.empty(0, dtype=torch.int64), torch.empty(0, 2))
    rows, grad = merge_row_grads([empty, _part([3], [[2.0, 4.0]])], 2)
    assert rows.tolist() == [3] and grad.tolist() == [[1.0, 2.0]]
    rows, grad = merge_row_grads([empty, empty], 2)
    assert rows.numel() == 0 and tuple(grad.shape) == (0, 2)
    alone = _part([2, 5], [[1.5, -2.0], [0.25, 8.0]])
    rows, grad = merge_row_grads([alone], 1)  # one rank: its own set, bit for bit
    assert torch.equal(rows, alone[0]) and torch.equal(grad, alone[1])


def test_merge_sums_in_rank_order_whatever_the_order_would_round_to():
    # fp32: 1e8 + 1 rounds back to 1e8 (the ulp there is 8), so the order of the three adds
    # decides the answer: rank order ((1 + 1e8) - 1e8) gives 0, reverse order
    # ((-1e8 + 1e8) + 1) gives 1/3. Every rank merging in rank order gets the same bits.
    vals = [1.0, 1e8, -1e8]
    parts = [_part([6], [[v]]) for v in vals]
    _, grad = merge_row_grads(parts, 3)
    a, b, c = (torch.tensor(v, dtype=torch.float32) for v in vals)
    assert torch.equal(grad, (((a + b) + c) / 3).reshape(1, 1)) and float(grad) == 0.0
    outcomes = {float(merge_row_grads([parts[i] for i in p], 3)[1]) for p in
                itertools.permutations(range(3))}  # fmt: skip
    assert len(outcomes) == 2  # the order is visible: the assertion above could fail


def test_merge_is_deterministic_and_matches_an_fp64_sum():
    g = torch.Generator().manual_seed(3)
    parts = []
    for _ in range(3):
        rows = torch.randperm(50, generator=g)[:30].sort().values
        parts.append((rows, torch.randn(30, 8, generator=g)))
    r1, g1 = merge_row_grads(parts, 3)
    r2, g2 = merge_row_grads([(r.clone(), x.clone()) for r, x in parts], 3)
    assert torch.equal(r1, r2) and torch.equal(g1, g2)
    dense = torch.zeros(50, 8, dtype=torch.float64)
    for rows, grad in parts:
        dense.index_add_(0, rows, grad.double())
    assert torch.allclose(g1.double(), dense[r1] / 3, rtol=0, atol=1e-6)  # fp32 round-off only
    assert r1.tolist() == sorted(set(torch.cat([r for r, _ in parts]).tolist()))


def test_merge_refuses_a_rank_that_repeats_a_row_or_has_bad_shapes():
    with pytest.raises(ValueError, match="lists a row twice"):
        merge_row_grads([_part([1, 1], [[1.0], [2.0]])], 1)
    with pytest.raises(ValueError, match=r"rank 1 has rows \(2,\) and grad \(1, 1\)"):
        merge_row_grads([_part([1], [[1.0]]), (torch.tensor([1, 2]), torch.zeros(1, 1))], 2)
    with pytest.raises(ValueError, match="at least one rank"):
        merge_row_grads([], 1)


# ---- (b) the HostTables API ----------------------------------------------------------------------


def _store_with_grad(seed: int = 0):
    torch.manual_seed(seed)
    store = HostTables(2, 8, 4, 0.02)
    idx = torch.tensor([[[0, 3], [5, 3], [0, 1]]])  # [1, 3, n_tables]: rows 0, 5; 11, 9
    w = torch.randn(1, 3, 2, 4)
    (store.gather(idx) * w).sum().backward()
    return store


def test_pending_is_the_consolidated_gradient_and_replace_installs_another():
    store = _store_with_grad()
    rows, grad = store.pending()
    assert rows.tolist() == [0, 5, 9, 11]  # flat rows (table 1 starts at 8), ascending
    assert tuple(grad.shape) == (4, 4) and bool(grad.ne(0).all())
    new_rows = torch.tensor([2, 9, 15])
    new_grad = torch.arange(12, dtype=torch.float32).reshape(3, 4) + 1
    store.replace_pending(new_rows, new_grad)
    r2, g2 = store.pending()
    assert torch.equal(r2, new_rows) and torch.equal(g2, new_grad)
    store.zero_grad()
    assert store.pending()[0].numel() == 0  # the cycle ended


def test_replace_with_nothing_drops_the_gradient_and_keeps_waiting_leaves():
    store = _store_with_grad()
    store.gather(torch.tensor([[[2, 2]]]))  # gathered under grad, not reached by a backward yet
    store.replace_pending(torch.empty(0, dtype=torch.int64), torch.empty(0, 4))
    assert store.pending()[0].numel() == 0
    assert len(store._leaves) == 1 and store._leaves[0][1].grad is None
    assert store.pending()[0].numel() == 0


@pytest.mark.parametrize("rows, shape, match", [
    ([3, 1], (2, 4), "distinct ascending"),
    ([1, 1], (2, 4), "distinct ascending"),
    ([1, 16], (2, 4), "distinct ascending"),  # 2 tables x 8 rows: 16 is past the end
    ([1, 2], (2, 3), r"grad \[K, 4\]"),
])  # fmt: skip
def test_replace_refuses_what_is_not_a_pending_set(rows, shape, match):
    store = _store_with_grad()
    with pytest.raises(ValueError, match=match):
        store.replace_pending(torch.tensor(rows), torch.zeros(shape))


# ---- (c) the seam --------------------------------------------------------------------------------


def _ram_model(seed: int = 0) -> DormouseModel:
    torch.manual_seed(seed)
    return DormouseModel(replace(preset("tiny").model, engram_ram=True))


def _backward(model, seed: int = 1):
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(seed))
    _, loss, _ = model(x[:, :-1], x[:, 1:])
    loss.backward()


def _open_the_conv(model):
    # The Engram conv starts at zero, which leaves the tables without a gradient.
    with torch.no_grad():
        model.engram.conv.weight.normal_(0, 0.05)


def test_one_process_context_is_the_identity():
    model = _ram_model()
    _open_the_conv(model)
    _backward(model)
    rows, grad = (t.clone() for t in model.engram.store.pending())
    assert rows.numel() > 0
    DPContext.single(torch.device("cpu"), 2, 16).reduce_host_grads(model)
    r2, g2 = model.engram.store.pending()
    assert torch.equal(rows, r2) and torch.equal(grad, g2)


def test_the_wrap_keeps_the_table_and_leaves_no_gradient(one_rank_group):
    # world 2 takes the fleet path (broadcast + DDP) on a one-rank process group; the row
    # reduction itself is gated at worlds 2 and 3 (g14)
    model = _ram_model()
    _open_the_conv(model)
    table = model.engram.store.table.clone()
    ctx = DPContext(torch.device("cpu"), (RankShape(2, 16),) * 2, world=2, backend="gloo")
    net = parallelize(model, ctx).net  # broadcasts the host tables from rank 0: the identity here
    assert torch.equal(model.engram.store.table, table)
    assert model.engram.store.pending()[0].numel() == 0  # the wrap's probe left no gradient
    _backward(net)
    assert model.engram.store.pending()[0].numel() > 0


def test_the_unused_parameter_probe_leaves_no_host_gradient():
    model = _ram_model()
    _open_the_conv(model)  # so the probe's backward does reach the table rows
    assert params_without_grad(model, torch.device("cpu")) == []
    assert model.engram.store._leaves == []
