"""engram_ram: host-RAM Engram tables (HostTables) train exactly like VRAM tables.

(a) the same model with engram_ram off and on, 5 MixOptimizer steps: gradients and
    parameters equal; (b) the row-sparse Adam moves only touched rows; (c) the host table
    is no parameter or buffer and `to` never moves it; (d) checkpoint round trip, also
    across stores; (e) count_params does not depend on the store.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch

from dormouse.config import Optim, preset
from dormouse.model import DormouseModel, count_params
from dormouse.model.engram import HostTables, VramTables
from dormouse.train.optim.mix import MixOptimizer
from dormouse.train.optim.rowadam import row_adam_
from dormouse.train.store import checkpoint as ckpt
from gates.compare import rel_to_peak

TINY = preset("tiny")
KW = dict(lr=0.02, wd=0.1, ns_dtype="fp32", engram_lr_mult=5.0)  # lr large: a wrong row shows
B, T = 2, 32


def _model(ram: bool, rows: int | None = None, seed: int = 0) -> DormouseModel:
    cfg = replace(TINY.model, engram_ram=ram)
    if rows is not None:
        cfg = replace(cfg, engram_rows=rows)
    torch.manual_seed(seed)
    return DormouseModel(cfg)


def _pair(rows: int | None = None):
    """(VRAM model, host model) with identical weights: the host one loads the VRAM state."""
    vram = _model(False, rows)
    host = _model(True, rows, seed=123)  # another seed, so only the load can make them equal
    host.load_state_dict(vram.state_dict())
    return vram, host


def _batch(step: int, micro: int = 0):
    g = torch.Generator().manual_seed(7919 * step + micro)
    w = torch.randint(0, 256, (B, T + 1), generator=g)
    return w[:, :-1], w[:, 1:]


def _table(model) -> torch.Tensor:
    return model.engram.store.table


def _cycle(model, opt, step: int, micro: int = 1, clip: float = 0.0):
    """One training step: forward/backward per micro-batch, optional clip, optimizer step.
    Returns what the step saw: non-table grads, the table's gradient as {row: grad}."""
    opt.set_lr_factor(1.0 - 0.1 * step)  # a schedule: the Engram group must follow it
    for k in range(micro):
        x, y = _batch(step, k)
        _, loss, _ = model(x, y)
        loss.backward()
    if clip:
        opt.clip_grad_norm_(clip)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()
             if p.grad is not None and not n.endswith("store.table")}  # fmt: skip
    store = model.engram.store
    d = store.dim
    if isinstance(store, VramTables):
        g = store.table.grad.reshape(-1, d)
        rows = g.ne(0).any(1).nonzero().squeeze(1)
        table = {int(r): g[r].clone() for r in rows}
    else:
        table = {}
        for r, leaf in store._leaves:
            for i, row in enumerate(r.tolist()):
                gi = leaf.grad[i].clone()
                table[row] = table[row] + gi if row in table else gi
        table = {r: g for r, g in table.items() if g.ne(0).any()}
    opt.step()
    opt.zero_grad(set_to_none=True)
    return grads, table


def _table_state(model, opt) -> dict[str, torch.Tensor]:
    """The table's row-sparse Adam state: the optimizer's, under the parameter or the name."""
    store = model.engram.store
    return (
        opt.host_state["engram.store.table"]
        if isinstance(store, HostTables)
        else (opt.state[store.table])
    )


def _state(model, opt) -> dict[str, torch.Tensor]:
    """Every parameter, the table and the table's Adam state, by name."""
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    out["engram.store.table"] = _table(model).detach().clone()
    out.update({f"adam.{k}": v.clone() for k, v in _table_state(model, opt).items()})
    return out


# ---- (a) exactness: engram_ram on == off ------------------------------------------------


@pytest.mark.parametrize("micro, clip", [(1, 0.0), (3, 0.0), (1, 0.05), (2, 0.05)])
def test_host_tables_train_exactly_like_vram_tables(micro, clip):
    # micro=2, 3: several gathers per step (gradient accumulation), rows repeated across them;
    # clip=0.05 is below the gradient norm (2.5 .. 7.5 here), so the clip scales every step.
    vram, host = _pair()
    ov, oh = (
        MixOptimizer(vram, Optim(**KW)),
        MixOptimizer(host, Optim(**KW)),
    )
    assert isinstance(host.engram.store, HostTables) and isinstance(vram.engram.store, VramTables)
    worst_grad = worst_table_grad = 0.0
    moved_rows = 0
    for step in range(5):
        gv, tv = _cycle(vram, ov, step, micro, clip)
        gh, th = _cycle(host, oh, step, micro, clip)
        assert gv.keys() == gh.keys() and len(gv) > 10
        worst_grad = max([worst_grad] + [rel_to_peak(gh[n], gv[n]) for n in gv])
        assert tv.keys() == th.keys(), f"step {step}: the stores' touched rows differ"
        worst_table_grad = max([worst_table_grad] + [rel_to_peak(th[r], tv[r]) for r in tv])
        moved_rows += len(tv)
    # Step 0 touches no row (the Engram conv starts at zero); later steps must, or the
    # comparison would prove nothing about the table.
    assert moved_rows > 50
    sv, sh = _state(vram, ov), _state(host, oh)
    worst_param = max(rel_to_peak(sh[n], sv[n]) for n in sv)
    print(f"micro={micro} clip={clip}: max rel diff grads {worst_grad:.1e}, "
          f"table grads {worst_table_grad:.1e}, params+table+moments after 5 steps "
          f"{worst_param:.1e}")  # fmt: skip
    # Same ops on the same numbers in the same order: bit for bit (the clip too, as it
    # sums the table's touched rows in both stores).
    assert worst_grad == worst_table_grad == worst_param == 0.0
    assert not torch.equal(sh["engram.store.table"], _table(_model(False)))  # the table moved


def test_clip_is_torch_clip_over_the_parameters():
    # On a VRAM model MixOptimizer.clip_grad_norm_ is torch's clip over model.parameters()
    # up to the order in which the table's squares are summed.
    a = _model(False)
    oa = MixOptimizer(a, Optim(**KW))
    _cycle(a, oa, 0)  # one step opens the conv: from now on the table has a gradient
    b = copy.deepcopy(a)
    for m in (a, b):
        m(*_batch(1))[1].backward()
    assert _table(a).grad.ne(0).any()
    na = oa.clip_grad_norm_(0.05)
    nb = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.05)
    assert float(nb) > 0.05  # the clip fired
    # fp32 round-off of two summation orders of the table's squares: a few ulp at most.
    torch.testing.assert_close(na, nb, rtol=1e-6, atol=0)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0, msg=n)


# ---- (b) only touched rows change -------------------------------------------------------


def _host_snapshot(model, opt) -> dict[str, torch.Tensor]:
    state = {k: t.clone() for k, t in _table_state(model, opt).items()}
    return {"table": _table(model).clone(), **state}


def test_only_touched_rows_and_their_moments_change():
    model = _model(True, rows=512)  # many rows, so most stay untouched each step
    store = model.engram.store
    opt = MixOptimizer(model, Optim(**KW))
    before = _host_snapshot(model, opt)
    _cycle(model, opt, 0)
    # Step 0: rows were gathered, but the zero conv gives them zero gradient: none steps.
    after = _host_snapshot(model, opt)
    assert all(torch.equal(before[k], after[k]) for k in before)
    for step in range(1, 4):
        before = _host_snapshot(model, opt)
        _, touched = _cycle(model, opt, step)
        after = _host_snapshot(model, opt)
        hit = torch.zeros(store.n_tables * store.rows, dtype=torch.bool)
        hit[list(touched)] = True
        assert hit.any() and not hit.all()
        for k in before:
            b, a = before[k].reshape(hit.numel(), -1), after[k].reshape(hit.numel(), -1)
            assert torch.equal(b[~hit], a[~hit]), f"step {step}: an untouched row's {k} moved"
        assert (after["step"].view(-1)[hit] == before["step"].view(-1)[hit] + 1).all()
        assert (after["table"].view(hit.numel(), -1)[hit]
                != before["table"].view(hit.numel(), -1)[hit]).any(1).all()  # fmt: skip
        # Rows with momentum from an earlier step that this step did not touch: dense Adam
        # would move them; the lazy one must not.
        if step >= 2:
            assert (before["step"].view(-1)[~hit] > 0).any()


def test_vram_table_steps_only_touched_rows_too():
    model = _model(False, rows=512)
    opt = MixOptimizer(model, Optim(**KW))
    for step in range(2):
        _cycle(model, opt, step)
    before = _table(model).detach().clone().view(-1, model.engram.store.dim)
    _, touched = _cycle(model, opt, 2)
    after = _table(model).detach().view(-1, model.engram.store.dim)
    hit = torch.zeros(before.shape[0], dtype=torch.bool)
    hit[list(touched)] = True
    assert hit.any() and torch.equal(before[~hit], after[~hit])
    assert (before[hit] != after[hit]).any(1).all()


def test_first_touch_gets_a_full_adam_step_whatever_the_global_step():
    # Per-row bias correction: a row's first update is lr * g / (|g| + eps) whether the
    # run is at step 1 or step 1000 (a global-step correction, as in SparseAdam, would give
    # (1 - b1) / sqrt(1 - b2) = 0.447 of it at step 1000 with betas (0.9, 0.95)).
    p = torch.zeros(4, 3)
    m, v = torch.zeros(4, 3), torch.zeros(4, 3)
    steps = torch.tensor([0, 999, 0, 5], dtype=torch.int32)  # row 1 "has been around"
    m[1], v[1] = 0.0, 0.0  # ... but its moments decayed to zero
    g = torch.tensor([[0.5, -2.0, 1e-3], [3.0, -0.25, 0.1]])
    rows = torch.tensor([0, 1])
    row_adam_(p, m, v, steps, rows, g, lr=0.01, betas=(0.9, 0.95), eps=1e-8)
    torch.testing.assert_close(p[0], -0.01 * g[0] / (g[0].abs() + 1e-8), rtol=1e-6, atol=0)
    assert torch.equal(steps, torch.tensor([1, 1000, 0, 5], dtype=torch.int32))
    assert torch.equal(p[2:], torch.zeros(2, 3)) and torch.equal(m[2:], torch.zeros(2, 3))
    # row 1: bias corrections of step 1000 are ~1, so its update is ~0.447 lr: not the above.
    assert (p[1].abs() < 0.5 * 0.01).all()


def test_zero_grad_ends_the_cycle_in_both_stores():
    # The loop's skip path: backward, then zero_grad instead of step. Nothing may move.
    vram, host = _pair()
    ov, oh = (
        MixOptimizer(vram, Optim(**KW)),
        MixOptimizer(host, Optim(**KW)),
    )
    for step in range(2):
        _cycle(vram, ov, step)
        _cycle(host, oh, step)
    sv, sh = _state(vram, ov), _state(host, oh)
    for model, opt in ((vram, ov), (host, oh)):
        x, y = _batch(99)
        model(x, y)[1].backward()
        opt.zero_grad(set_to_none=True)
        opt.step()
    assert host.engram.store._leaves == []
    for n, t in _state(vram, ov).items():
        assert torch.equal(t, sv[n]), n
    for n, t in _state(host, oh).items():
        assert torch.equal(t, sh[n]), n


def test_gathers_without_grad_record_nothing():
    model = _model(True).eval()
    with torch.no_grad():
        model(*_batch(0))
    cache = model.init_cache()
    for t in range(4):
        model.step(_batch(1)[0][:, t : t + 1], cache)  # decoding: one gather per byte
    assert model.engram.store._leaves == []


# ---- (c) the host table is state, not a parameter ---------------------------------------


def test_host_table_is_not_a_parameter_and_to_never_moves_it():
    model = _model(True)
    store = model.engram.store
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]
    assert not any("store" in n for n in names)
    assert all(p is not store.table for p in model.parameters())
    ptr = store.table.data_ptr()
    # A cast reaches every parameter and floating buffer: had the table been either, it
    # would come back float64 (and at another address).
    model.to(torch.float64)
    assert model.embed.weight.dtype == torch.float64  # the cast did run
    assert store.table.dtype == torch.float32 and store.table.device.type == "cpu"
    assert store.table.data_ptr() == ptr
    sd = model.state_dict()
    assert sd["engram.store.table"].shape == (store.n_tables, store.rows, store.dim)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_model_to_cuda_leaves_the_table_on_the_host():
    model = _model(True).to("cuda")
    assert model.engram.store.table.device.type == "cpu"
    opt = MixOptimizer(model, Optim(**KW))
    for step in range(2):
        x, y = _batch(step)
        model(x.cuda(), y.cuda())[1].backward()
        opt.step()
        opt.zero_grad()
    assert model.engram.store.table.device.type == "cpu"


# ---- (d) checkpoints --------------------------------------------------------------------


def _run_cfg(ram: bool):
    return replace(TINY, model=replace(TINY.model, engram_ram=ram))


@pytest.mark.parametrize("state", ["fp32", "int8"])
@pytest.mark.parametrize("resume_ram", [True, False])
def test_checkpoint_resume_is_bit_exact_and_crosses_stores(tmp_path, resume_ram, state):
    # Train 3 host steps, checkpoint, resume (into a host model, or a VRAM one: the key
    # and the Adam state are the same), 3 more: equal to 6 uninterrupted host steps.
    kw = dict(KW, muon_state_dtype=state, engram_state_dtype=state)
    straight = _model(True)
    opt = MixOptimizer(straight, Optim(**kw))
    for step in range(3):
        _cycle(straight, opt, step)
    path = ckpt.save_checkpoint(tmp_path / "ck.pt", run=_run_cfg(True), model=straight,
                                optimizer=opt, step=3)  # fmt: skip
    for step in range(3, 6):
        _cycle(straight, opt, step)

    ck = ckpt.read_checkpoint(path)
    resumed = _model(resume_ram, seed=5)
    ckpt.load_model(resumed, ck, path)
    opt2 = MixOptimizer(resumed, Optim(**kw))
    ckpt.load_optimizer_state(resumed, opt2, ck["optimizer"], path)
    for step in range(3, 6):
        _cycle(resumed, opt2, step)
    a, b = _state(straight, opt), _state(resumed, opt2)
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), f"{n} differs after resume"


def test_host_store_loads_refuse_another_shape():
    small = _model(True, rows=32)
    with pytest.raises(RuntimeError, match="size mismatch for engram.store.table"):
        small.load_state_dict(_model(False).state_dict())
    missing = _model(False).state_dict()
    del missing["engram.store.table"]
    out = _model(True).load_state_dict(missing, strict=False)
    assert out.missing_keys == ["engram.store.table"]


# ---- (e) parameter count ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_count_params_does_not_depend_on_the_store(name):
    cfg = preset(name).model
    on = count_params(replace(cfg, engram_ram=True))
    assert on == count_params(replace(cfg, engram_ram=False))
    with torch.device("meta"):
        host = copy.deepcopy(DormouseModel(replace(cfg, engram_ram=True)).engram.store)
    assert host.table.is_meta and host.host_numel() == host.table.numel() > 0
