"""MixOptimizer: batched Muon vs the one-matrix reference, vs torch.optim.Muon, routing,
torch-standard state (torch.distributed.checkpoint's state_dict functions read it without
stepping, and it round-trips), bit-exact resume, the AdamW control arm, the 8-bit refusal, and
FSDP2 (3 gloo ranks, empty shards included) stepping as one process does, bit for bit."""

from __future__ import annotations

import copy
import io
import sys
from dataclasses import replace

import pytest
import torch
from torch import nn

from dormouse.config import ConfigError, Optim, TrainConfig
from dormouse.model.engram import HostTables
from dormouse.train.optim.mix import MixOptimizer
from dormouse.train.optim.quant import BLOCK, dequantize_signed
from dormouse.train.optim.routing import format_routes, route_params, strip_name
from dormouse.train.store import checkpoint as ckpt
from references.muon_single import muon_single_step

D = 32


class _Store(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(4, 64, 8) * 0.02)  # [n_tables, rows, dim]


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.Parameter(torch.ones(D))  # an RMSNorm gain
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):  # four 2D weights of one shape
            setattr(self, n, nn.Linear(D, D, bias=False))
        self.q_conv = nn.Conv1d(D, D, 4, groups=D, bias=False)  # weight [D, 1, 4]: not a matrix
        self.qkv_conv = nn.Module()  # a hand-rolled short conv keeps its taps as [C, K]
        self.qkv_conv.weight = nn.Parameter(torch.randn(3 * D, 4) * 0.1)
        self.f_proj = nn.Linear(D, 8, bias=True)  # a 2D weight + a bias
        self.A_log = nn.Parameter(torch.zeros(4))
        self.dt_bias = nn.Parameter(torch.zeros(4))
        self.delta = nn.Module()
        self.delta.A = nn.Parameter(torch.randn(4, D) * 0.02)  # [r, d_in]
        self.delta.B = nn.Parameter(torch.randn(48, 4) * 0.02)  # [d_out, r], tall
        self.router = nn.Linear(D, 4, bias=False)
        self.w1 = nn.Parameter(torch.randn(4, 48, D) * 0.02)  # [E, d_ffn, D]
        self.w2 = nn.Parameter(torch.randn(4, D, 48) * 0.02)  # [E, D, d_ffn]
        self.w3 = nn.Parameter(torch.randn(4, 48, D) * 0.02)
        self.shared = nn.Module()
        self.shared.up = nn.Linear(D, 48, bias=False)  # same matrix shape as one expert of w1


class StandIn(nn.Module):
    """Every parameter kind the real model has, with the real names, and no forward."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(256, D)
        self.engram = nn.Module()
        self.engram.store = _Store()
        self.engram.k_proj = nn.Linear(4 * 8, D, bias=False)
        self.blocks = nn.ModuleList([_Block(), _Block()])
        self.norm_f = nn.Parameter(torch.ones(D))
        self.head = nn.Linear(D, 256, bias=False)


def _dormouse_model(name: str):
    """DormouseModel(preset(name).model) on meta, or skip while the model is not importable."""
    mod = pytest.importorskip("dormouse.model")
    if not hasattr(mod, "DormouseModel"):
        pytest.skip("dormouse.model has no DormouseModel yet")
    from dormouse.config import preset

    return mod.DormouseModel, preset(name).model


def _grads(model: nn.Module, step: int, drop: tuple[str, ...] = ()) -> dict:
    """Deterministic gradients for `step`; names in `drop` get None (a parameter without grad)."""
    gen = torch.Generator().manual_seed(1000 + step)
    out = {}
    for n, p in model.named_parameters():
        g = torch.randn(p.shape, generator=gen) * 0.01
        out[strip_name(n)] = None if strip_name(n) in drop else g
    return out


def _set_grads(model: nn.Module, grads: dict) -> None:
    for n, p in model.named_parameters():
        g = grads[strip_name(n)]
        p.grad = None if g is None else g.clone().to(p.dtype)


# Steps at which one parameter (and, on step 3, a whole expert stack) has no gradient.
_DROPS = {1: ("blocks.0.q_proj.weight",), 3: ("blocks.1.w1", "blocks.0.delta.B")}
_KW = dict(lr=0.02, wd=0.1, ns_steps=5, muon_momentum=0.95)  # lr large so a wrong update shows


def _run_batched_vs_single(model: nn.Module, ns_kind: str, variant: str, sf: str) -> None:
    ref = copy.deepcopy(model)
    opt = MixOptimizer(
        model,
        Optim(
            **{
                **_KW,
                "ns_kind": ns_kind,
                "ns_dtype": "fp32",
                "muon_variant": variant,
                "muon_sf": sf,
            }
        ),
    )
    muon = {r.name for r in opt.routes if r.owner == "muon"}
    assert muon, "the model has no Muon parameters: the test would prove nothing"
    p0 = {strip_name(n): p.detach().clone() for n, p in model.named_parameters()}
    state = {strip_name(n): (p.detach().double().clone(), torch.zeros_like(p, dtype=torch.float64))
             for n, p in ref.named_parameters() if strip_name(n) in muon}  # fmt: skip
    for step in range(5):
        grads = _grads(model, step, _DROPS.get(step, ()))
        _set_grads(model, grads)
        opt.step()
        opt.zero_grad(set_to_none=True)
        for name, (p, m) in state.items():
            g = grads[name]
            if g is None:
                continue
            # a 3D stack is stepped one expert matrix at a time
            pm, mm, gm = (t.reshape(-1, *p.shape[-2:]) for t in (p, m, g.double()))
            outs = [muon_single_step(pm[i], gm[i], mm[i], _KW["lr"], _KW["wd"],
                                     _KW["muon_momentum"], variant == "nesterov", _KW["ns_steps"],
                                     ns_kind, sf) for i in range(pm.shape[0])]  # fmt: skip
            state[name] = (torch.stack([o[0] for o in outs]).reshape(p.shape),
                           torch.stack([o[1] for o in outs]).reshape(p.shape))  # fmt: skip
    # fp32 batched polar vs the fp64 reference: the error is the optimizer's fp32 round-off,
    # amplified by each polynomial's slope. Measured worst case over every parameter
    # (lr=0.02, where updates are as large as the init): quintic 7e-7, Polar Express 1.5e-6
    # (its first polynomial, 8.2x - 23.4x^3 + 16.5x^5, amplifies round-off ~2.5x more).
    # quintic is held to the 1e-6.
    tol = 1e-6 if ns_kind == "quintic" else 5e-6
    got = {strip_name(n): p.detach().double() for n, p in model.named_parameters()}
    for name, (want, _) in state.items():
        rel = float((got[name] - want).norm() / want.norm())
        assert rel <= tol, f"{name}: relative error {rel:.2e} vs muon_single"
        moved = want - p0[name].double()
        drel = float((got[name] - p0[name].double() - moved).norm() / moved.norm())
        # The displacement alone (measured <= 2.6e-6), so the check does not lean on the init:
        # a wrong scale, momentum or skip rule moves it by O(1e-2) or more.
        assert drel <= 1e-5, f"{name}: displacement relative error {drel:.2e} vs muon_single"


# ---- (a) batched Muon == muon_single, matrix by matrix ----------------------------------


@pytest.mark.parametrize(
    "ns_kind,variant,sf",
    [("quintic", "nesterov", "rms"), ("polar_express", "plain", "jordan")],
)
def test_batched_muon_matches_single_matrix_reference(ns_kind, variant, sf):
    torch.manual_seed(0)
    _run_batched_vs_single(StandIn(), ns_kind, variant, sf)


def test_batched_muon_matches_reference_on_tiny_model():
    cls, cfg = _dormouse_model("tiny")
    torch.manual_seed(0)
    _run_batched_vs_single(cls(cfg), "quintic", "nesterov", "rms")


def test_parameter_without_grad_does_not_move_and_keeps_its_momentum():
    torch.manual_seed(0)
    model = StandIn()
    opt = MixOptimizer(model, Optim(**{**_KW, "ns_dtype": "fp32"}))
    _set_grads(model, _grads(model, 0))
    opt.step()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    bufs = {n: opt.state[p]["momentum_buffer"].clone() for n, p in model.named_parameters()
            if "momentum_buffer" in opt.state[p]}  # fmt: skip
    _set_grads(model, _grads(model, 1, drop=("blocks.0.w1",)))
    opt.step()
    after = dict(model.named_parameters())
    assert torch.equal(after["blocks.0.w1"], before["blocks.0.w1"])
    assert not torch.equal(after["blocks.1.w1"], before["blocks.1.w1"])
    momentum = {n: opt.state[p]["momentum_buffer"] for n, p in after.items() if n in bufs}
    assert torch.equal(momentum["blocks.0.w1"], bufs["blocks.0.w1"])
    assert not torch.equal(momentum["blocks.1.w1"], bufs["blocks.1.w1"])


def test_adamw_side_is_torch_adamw_with_the_documented_groups():
    torch.manual_seed(0)
    model = StandIn()
    twin = copy.deepcopy(model)
    opt = MixOptimizer(model, Optim(ns_dtype="fp32", lr=0.01, wd=0.1, engram_lr_mult=5.0))
    routes = {r.name: r for r in opt.routes}
    p = dict(twin.named_parameters())
    groups = [
        {"params": [p[n] for n, r in routes.items() if r.owner == "adamw" and r.decay],
         "lr": 0.01, "weight_decay": 0.1},
        {"params": [p[n] for n, r in routes.items() if r.owner == "adamw" and not r.decay],
         "lr": 0.01, "weight_decay": 0.0},
        # The Engram table's row-sparse Adam: every row of these random grads is non-zero,
        # and then it must be torch Adam (weight_decay 0) bit for bit.
        {"params": [p["engram.store.table"]], "lr": 0.05, "weight_decay": 0.0},
    ]  # fmt: skip
    ref = torch.optim.AdamW(groups, betas=(0.9, 0.95), foreach=True)
    for step in range(3):
        grads = _grads(model, step)
        _set_grads(model, grads)
        _set_grads(twin, grads)
        opt.step()
        ref.step()
    got = dict(model.named_parameters())
    for n, r in routes.items():
        if r.owner != "muon":
            assert torch.equal(got[n], p[n]), f"{n} ({r.owner}) differs from torch AdamW"


def test_lr_factor_scales_every_group_from_its_base_lr():
    opt = MixOptimizer(StandIn(), Optim(wd=0.0, ns_dtype="fp32", lr=0.01, engram_lr_mult=5.0))
    opt.set_lr_factor(0.5)
    for g in opt.param_groups:
        want = 0.005 * (5.0 if g["kind"] == "engram" else 1.0)
        assert g["lr"] == pytest.approx(want)
    # the AdamW dicts the loop scales ARE the ones torch steps
    assert all(any(g is a for a in opt.param_groups) for g in opt.adamw.param_groups)


# ---- (b) an external check: torch.optim.Muon --------------------------------------------


def _against_torch_muon(shape, steps, ns_dtype, nesterov, sf, adjust, mu=0.95):
    """dormouse's Muon and torch.optim.Muon stepped `steps` times on one copied [shape] matrix
    with the same gradients: (relative distance of their displacements, our optimizer and
    module, torch's optimizer and module)."""
    torch.manual_seed(0)
    mine = nn.Module()
    mine.q_proj = nn.Linear(shape[1], shape[0], bias=False)
    theirs = copy.deepcopy(mine)
    p0 = mine.q_proj.weight.detach().clone()
    opt = MixOptimizer(
        mine,
        Optim(
            lr=0.02,
            wd=0.1,
            ns_dtype=ns_dtype,
            ns_kind="quintic",
            muon_variant="nesterov" if nesterov else "plain",
            muon_sf=sf,
            muon_momentum=mu,
        ),
    )
    ref = torch.optim.Muon([theirs.q_proj.weight], lr=0.02, weight_decay=0.1, momentum=mu,
                           nesterov=nesterov, ns_steps=5, adjust_lr_fn=adjust)  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        g = torch.randn(*shape, generator=gen)
        mine.q_proj.weight.grad = g.clone()
        theirs.q_proj.weight.grad = g.clone()
        opt.step()
        ref.step()
    d_mine = mine.q_proj.weight.detach() - p0
    d_ref = theirs.q_proj.weight.detach() - p0
    return float((d_mine - d_ref).norm() / d_ref.norm()), (opt, mine), (ref, theirs)


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
@pytest.mark.parametrize("sf,adjust", [("jordan", "original"), ("rms", "match_rms_adamw")])
def test_tracks_torch_muon_in_bf16(sf, adjust):
    # [64, 128]: wide; rms and jordan differ
    rel, _, _ = _against_torch_muon((64, 128), 5, "bf16", True, sf, adjust)
    # Both run 5 quintic iterations in bf16 (unit round-off 2^-8 = 3.9e-3) but round
    # differently: torch keeps an EMA momentum ((1-mu) x ours, which the normalisation
    # cancels only up to rounding) and normalises in bf16, we normalise in fp32. Each
    # iteration's rounding is amplified by the polynomial's slope: measured 9.7e-3 here;
    # 2e-2 leaves 2x room, while a wrong scale rule (jordan vs rms is x2.3 here) or dropping
    # Nesterov changes the displacement by O(1).
    assert rel <= 2e-2, f"displacement differs from torch.optim.Muon by {rel:.3e}"


def _keller_ns_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's Newton-Schulz (Keller Jordan's quintic) as torch writes it, in fp32
    instead of its fixed bf16: the one convention the fp32 test below sets aside."""
    a, b, c = ns_coefficients
    x = grad.float()
    tall = grad.size(0) > grad.size(1)
    x = x.T if tall else x
    x = x / (x.norm() + eps)
    for _ in range(ns_steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon needs torch >= 2.9")
@pytest.mark.parametrize("shape", [(64, 128), (128, 48)], ids=["wide", "tall"])
@pytest.mark.parametrize("nesterov", [True, False], ids=["nesterov", "plain"])
@pytest.mark.parametrize("sf,adjust", [("jordan", "original"), ("rms", "match_rms_adamw")])
def test_equals_torch_muon_in_fp32_where_conventions_agree(monkeypatch, shape, nesterov, sf,
                                                           adjust):  # fmt: skip
    """dormouse's Muon against torch.optim.Muon's step on one 2-D matrix, both in fp32: the
    same update (the polar's normalisation cancels the momentum forms' factor), each scale
    rule equal to its adjust_lr_fn, and the buffers in the ratio the two forms promise: ours
    m = mu m + g is torch's lerp buffer / (1 - mu) (docs/references.md)."""
    import torch.optim._muon as torch_muon

    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", _keller_ns_fp32)
    mu = 0.95
    rel, (opt, mine), (ref, theirs) = _against_torch_muon(
        shape, 3, "fp32", nesterov, sf, adjust, mu
    )
    # fp32 both, the same polynomial: measured <= 1.6e-6 over 3 steps (round-off of a
    # momentum 20x larger in ours, and of torch's two lerps); 1e-5 leaves ~6x, while a scale
    # rule off by x1.6..2.3 or a dropped Nesterov term moves the displacement by O(1)
    assert rel <= 1e-5, f"displacement differs from torch.optim.Muon by {rel:.3e}"
    buf = ckpt.optimizer_state(mine, opt)["state"]["q_proj.weight"]["momentum_buffer"]
    theirs_buf = ref.state[theirs.q_proj.weight]["momentum_buffer"]
    ratio = float((buf.float() * (1 - mu) - theirs_buf).norm() / theirs_buf.norm())
    # measured 6.6e-8 (fp32 round-off of the two recurrences); a lerp buffer would be 19.0
    assert ratio <= 1e-6, f"momentum buffer != torch's / (1 - mu): {ratio:.3e}"


# ---- (c) routing: every parameter owned exactly once -----------------------------------


def _assert_owned_once(model: nn.Module, opt_kind: str = "mix") -> list:
    routes = route_params(model, opt_kind)
    names = [strip_name(n) for n, _ in model.named_parameters()]
    assert [r.name for r in routes] == names, "a parameter is unrouted or routed twice"
    assert len(set(names)) == len(names)
    assert all(r.owner in ("muon", "adamw", "engram") for r in routes)
    opt = MixOptimizer(model, Optim(wd=0.0, ns_dtype="fp32", lr=1e-3, opt=opt_kind))
    seen = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(seen) == len(set(seen)), "a parameter sits in two optimizer groups"
    assert set(seen) == {id(p) for p in model.parameters()}, "a parameter has no group"
    return routes


def test_routing_of_the_stand_in():
    model = StandIn()
    routes = {r.name: r for r in _assert_owned_once(model)}
    expect = {
        "embed.weight": "adamw", "head.weight": "adamw", "norm_f": "adamw",
        "engram.store.table": "engram", "engram.k_proj.weight": "muon",
        "blocks.0.norm": "adamw", "blocks.0.q_proj.weight": "muon",
        "blocks.0.q_conv.weight": "adamw", "blocks.0.qkv_conv.weight": "adamw",
        "blocks.0.f_proj.weight": "muon",
        "blocks.0.f_proj.bias": "adamw", "blocks.0.A_log": "adamw", "blocks.0.dt_bias": "adamw",
        "blocks.0.delta.A": "muon", "blocks.0.delta.B": "muon", "blocks.0.router.weight": "muon",
        "blocks.0.w1": "muon", "blocks.0.w2": "muon", "blocks.1.shared.up.weight": "muon",
    }  # fmt: skip
    for name, owner in expect.items():
        assert routes[name].owner == owner, f"{name}: {routes[name]}"
    assert not routes["blocks.0.norm"].decay and not routes["engram.store.table"].decay
    assert routes["embed.weight"].decay and routes["blocks.0.w1"].decay
    text = format_routes(routes.values())
    assert "engram.store.table" in text and "total" in text


def test_routing_strips_wrapper_prefixes():
    class Wrap(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.module = m

    wrapped = Wrap(nn.ModuleDict({"_orig_mod": StandIn()}))  # module._orig_mod.embed.weight
    plain = [(r.name, r.owner) for r in route_params(StandIn())]
    assert [(r.name, r.owner) for r in route_params(wrapped)] == plain
    # torch.compile(DDP(model)) nests the other way round: _orig_mod.module.NAME (found by
    # gate g31: head.weight went to Muon on a compiled fleet)
    outer = nn.ModuleDict({"_orig_mod": Wrap(StandIn())})
    assert [(r.name, r.owner) for r in route_params(outer)] == plain
    assert strip_name("_orig_mod.module.head.weight") == "head.weight"


@pytest.mark.parametrize("preset_name", ["tiny", "small"])
def test_routing_of_preset_models_on_meta(preset_name):
    cls, cfg = _dormouse_model(preset_name)
    with torch.device("meta"):
        model = cls(cfg)
    routes = _assert_owned_once(model)
    assert any(r.owner == "muon" for r in routes)
    assert any(r.owner == "engram" for r in routes) or cfg.engram_ram
    print(format_routes(routes))


# ---- (d) torch-standard state, read by torch.distributed.checkpoint; bit-exact resume ------

_VARIANTS = [dict(ns_kind="quintic", muon_state_dtype="fp32"),
             dict(ns_kind="polar_express", muon_state_dtype="bf16", ns_dtype="bf16"),
             dict(muon_state_dtype="int8", engram_state_dtype="int8"),
             dict(opt="adamw")]  # fmt: skip
# optim_8bit has no CPU variant: bitsandbytes steps CUDA tensors only (refused below).


def _run(model, opt, steps):
    for step in steps:
        opt.set_lr_factor(0.5 + 0.1 * step)  # a schedule, so lr is restored from base_lr
        _set_grads(model, _grads(model, step, _DROPS.get(step, ())))
        opt.step()
        opt.zero_grad(set_to_none=True)


def _tensors(obj, path: str = "") -> dict[str, torch.Tensor]:
    """{path: copy} of every tensor in a nested state."""
    if torch.is_tensor(obj):
        return {path: obj.detach().clone()}
    items = (obj.items() if isinstance(obj, dict)
             else enumerate(obj) if isinstance(obj, (list, tuple)) else ())  # fmt: skip
    return {k: t for key, v in items for k, t in _tensors(v, f"{path}/{key}").items()}


def _assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].reshape(-1).view(torch.uint8),
                           b[k].reshape(-1).view(torch.uint8)), k  # fmt: skip


def _full_optimizer_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, opt, options=opts)


def test_state_is_torch_standard_and_made_at_construction():
    model = StandIn()
    opt = MixOptimizer(model, Optim(wd=0.0, ns_dtype="fp32", lr=0.01))
    assert all(opt.state[p] for p in model.parameters())
    assert opt.adamw.state is opt.state  # torch's AdamW steps the entries made here
    group = next(g for g in opt._muon_groups if len(g["params"]) > 1)
    bufs = [opt.state[p]["momentum_buffer"] for p in group["params"]]
    assert len({b.untyped_storage().data_ptr() for b in bufs}) == 1  # views of one stack
    assert [tuple(b.shape) for b in bufs] == [tuple(p.shape) for p in group["params"]]


@pytest.mark.parametrize("steps", [0, 3])
@pytest.mark.parametrize("kw", _VARIANTS)
def test_reading_the_state_twice_changes_nothing(kw, steps):
    # torch's reader takes a zero-gradient step() when the state is empty (decaying every
    # moment, counting a step): the state is never empty, so it only reads
    torch.manual_seed(0)
    model = StandIn()
    opt = MixOptimizer(model, Optim(**{"ns_dtype": "fp32", **kw, "lr": 0.01, "wd": 0.1}))
    _run(model, opt, range(steps))
    state, params = _tensors(opt.state_dict()), _tensors(dict(model.named_parameters()))
    first = _tensors(_full_optimizer_state(model, opt))
    second = _tensors(_full_optimizer_state(model, opt))
    _assert_bitwise(first, second)
    _assert_bitwise(_tensors(opt.state_dict()), state)
    _assert_bitwise(_tensors(dict(model.named_parameters())), params)
    assert all(p.grad is None for p in model.parameters())


def test_host_tables_state_is_read_unchanged_and_travels_by_name():
    cls, cfg = _dormouse_model("tiny")
    torch.manual_seed(0)
    model = cls(replace(cfg, engram_ram=True))
    opt = MixOptimizer(model, Optim(wd=0.0, lr=0.02, ns_dtype="fp32"))
    with torch.no_grad():
        model.engram.conv.weight.normal_(0, 0.05)  # a zero conv leaves the table without grad
    x = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    for _ in range(2):
        model(x[:, :-1], x[:, 1:])[1].backward()
        opt.step()
        opt.zero_grad()
    assert opt.host_state["engram.store.table"]["step"].any()  # rows were stepped
    state = _tensors(opt.state_dict())
    assert any(k.startswith("/host/engram.store.table/") for k in state)
    first, second = ckpt.optimizer_state(model, opt), ckpt.optimizer_state(model, opt)
    _assert_bitwise(_tensors(first), _tensors(second))
    _assert_bitwise(_tensors(opt.state_dict()), state)
    # in the file the host table's state sits under its name, as a VRAM table's would
    assert first["state"]["engram.store.table"].keys() == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("via", ["state_dict", "checkpoint functions"])
@pytest.mark.parametrize("kw", _VARIANTS)
def test_resume_is_bit_exact(kw, via):
    torch.manual_seed(0)
    kw = {"lr": 0.01, "wd": 0.1, **kw}
    straight = StandIn()
    opt = MixOptimizer(straight, Optim(**{"ns_dtype": "fp32", **kw}))
    _run(straight, opt, range(3))
    blob = io.BytesIO()
    if via == "state_dict":
        torch.save({"model": straight.state_dict(), "opt": opt.state_dict()}, blob)
    else:
        torch.save({"model": ckpt.model_state(straight),
                    "opt": ckpt.optimizer_state(straight, opt)}, blob)  # fmt: skip
    _run(straight, opt, range(3, 6))

    blob.seek(0)
    ck = torch.load(blob, weights_only=True)
    torch.manual_seed(1)  # another init: only the load can make the runs agree
    resumed = StandIn()
    opt2 = MixOptimizer(resumed, Optim(**{"ns_dtype": "fp32", **kw}))
    if via == "state_dict":
        resumed.load_state_dict(ck["model"])
        opt2.load_state_dict(ck["opt"])
    else:
        ckpt.load_model_state(resumed, ck["model"])
        ckpt.load_optimizer_state(resumed, opt2, ck["opt"])
    muon = [t for g in opt2._muon_groups for p in g["params"] for t in opt2.state[p].values()]
    assert all(b._base is not None for b in muon)  # loaded into the views, not replacing them
    _run(resumed, opt2, range(3, 6))
    _assert_bitwise(_tensors(dict(resumed.named_parameters())),
                    _tensors(dict(straight.named_parameters())))  # fmt: skip
    _assert_bitwise(_tensors(opt2.state_dict()), _tensors(opt.state_dict()))


def test_int8_momentum_is_per_parameter_blocks_of_one_stack():
    torch.manual_seed(0)
    model = StandIn()
    opt = MixOptimizer(model, Optim(wd=0.0, ns_dtype="fp32", lr=0.01, muon_state_dtype="int8"))
    for g, (codes, offsets, absmax) in zip(opt._muon_groups, opt._stacks, strict=True):
        for p, a, b in zip(g["params"], offsets, offsets[1:]):
            st = opt.state[p]
            assert st["momentum_q"].shape == (b - a, BLOCK) == (-(-p.numel() // BLOCK), BLOCK)
            assert st["momentum_q"]._base is codes and st["momentum_absmax"]._base is absmax
    padded = [p for p in model.parameters()
              if "momentum_q" in opt.state[p] and p.numel() % BLOCK]  # fmt: skip
    assert padded  # delta.A [4, 32]: 128 values in a block of 256
    # After one step the momentum is the gradient: the codes give it back within half a code
    # step (absmax / 254) of each block; a padded block's tail stays 0; a parameter without
    # a gradient (step 1 drops one) keeps zero codes.
    grads = _grads(model, 1, _DROPS[1])
    _set_grads(model, grads)
    opt.step()
    for n, p in model.named_parameters():
        st, g = opt.state[p], grads[strip_name(n)]
        if "momentum_q" not in st:
            continue
        q, a = st["momentum_q"], st["momentum_absmax"]
        if g is None:
            assert not q.any() and not a.any(), n
            continue
        m, g = dequantize_signed(q, a).reshape(-1), g.reshape(-1)
        assert not m[g.numel() :].any(), n
        bound = a.repeat_interleave(BLOCK)[: g.numel()] / 254 * (1 + 2**-20)  # + fp32 slack
        assert bool(((m[: g.numel()] - g).abs() <= bound).all()), n


def test_load_refuses_a_state_from_another_model():
    opt = MixOptimizer(StandIn(), Optim(wd=0.0, ns_dtype="fp32", lr=0.01))
    other = nn.Module()
    other.q_proj = nn.Linear(D, D, bias=False)
    with pytest.raises(ConfigError, match="routing"):
        MixOptimizer(other, Optim(wd=0.0, ns_dtype="fp32", lr=0.01)).load_state_dict(
            opt.state_dict()
        )


# ---- (e) the AdamW control arm, 8-bit refusal, from_config -------------------------------


def test_opt_adamw_puts_every_parameter_on_adamw():
    model = StandIn()
    routes = _assert_owned_once(model, "adamw")
    assert all(r.owner in ("adamw", "engram") for r in routes)
    opt = MixOptimizer(model, Optim(wd=0.0, ns_dtype="fp32", lr=0.01, opt="adamw"))
    assert not opt._muon_groups
    adam = {id(p) for g in opt.adamw.param_groups for p in g["params"]}
    # The Engram table keeps its row-sparse Adam in both arms; everything else is AdamW.
    assert [g["kind"] for g in opt.param_groups if g["kind"] == "engram"] == ["engram"]
    table = {id(model.engram.store.table)}
    assert adam == {id(p) for p in model.parameters()} - table
    assert {id(p) for p in opt.param_groups[-1]["params"]} == table
    assert isinstance(opt.adamw, torch.optim.AdamW)


def test_optim_8bit_without_bitsandbytes_is_loud(monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` fail
    with pytest.raises(ConfigError) as e:
        MixOptimizer(StandIn(), Optim(wd=0.0, ns_dtype="fp32", lr=0.01, optim_8bit=True))
    msg = str(e.value)
    assert "pip install bitsandbytes" in msg and "optim_8bit=false" in msg


def test_from_config_resolves_ns_dtype_auto(caplog):
    cfg = TrainConfig(ns_dtype="auto", lr=0.01, muon_momentum=0.9)
    with caplog.at_level("INFO", logger="dormouse.train.optim.mix"):
        opt = MixOptimizer.from_config(StandIn(), cfg, "cpu")
        assert {g["ns_dtype"] for g in opt._muon_groups} == {"fp32"}
        assert {g["momentum"] for g in opt._muon_groups} == {0.9}
        assert "ns_dtype=auto -> fp32" in caplog.text
        opt = MixOptimizer.from_config(StandIn(), cfg, "cuda")
    assert {g["ns_dtype"] for g in opt._muon_groups} == {"bf16"}
    assert "ns_dtype=auto -> bf16" in caplog.text


def test_adam_eps_reaches_every_adam_group():
    # the AdamW groups (torch's AdamW reads eps from its own dicts) and the Engram group
    opt = MixOptimizer.from_config(StandIn(), TrainConfig(lr=0.01, adam_eps=1e-5), "cpu")
    kinds = {g["kind"] for g in opt.param_groups if "eps" in g}
    assert {"engram"} <= kinds and len(kinds) >= 2, kinds
    assert all(g["eps"] == 1e-5 for g in opt.param_groups if "eps" in g)
    assert all(g["eps"] == 1e-5 for g in opt.adamw.param_groups)
    with pytest.raises(ConfigError, match="adam_eps=0 must be"):
        MixOptimizer(StandIn(), Optim(wd=0.0, ns_dtype="fp32", lr=0.01, adam_eps=0))


def test_unknown_knob_is_refused():
    with pytest.raises(ConfigError, match="ns_kind"):
        MixOptimizer(StandIn(), Optim(wd=0.0, ns_dtype="fp32", lr=0.01, ns_kind="cubic"))


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
def test_ddp_routes_like_plain():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already live in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(StandIn())
        assert [
            (r.name, r.owner)
            for r in MixOptimizer(ddp, Optim(wd=0.0, ns_dtype="fp32", lr=0.01)).routes
        ] == [(r.name, r.owner) for r in route_params(StandIn())]
    finally:
        dist.destroy_process_group()


# ---- (e) FSDP2: the same steps on DTensor shards ---------------------------------------------

#: One process stepping whole tensors, and a fleet stepping shards (world 3: the stand-in's
#: router [4, 32], delta.A [4, 32], expert stacks [4, 48, 32], Engram table [4, 64, 8] and
#: A_log [4] split 2, 2, 0, so rank 2 holds empty shards; q_proj [32, 32] splits 11, 11, 10).
_FSDP_WORLD = 3


class _WithHost(StandIn):
    """The stand-in with a host-RAM Engram store beside the VRAM one (engram_ram's kind)."""

    def __init__(self):
        super().__init__()
        self.engram.host = HostTables(2, 16, 8, std=0.02)


def _drive(model, opt, mesh=None) -> list[float]:
    """_run's steps with each gradient a DTensor placed like its parameter (on a mesh), host
    rows whose gradient outweighs the rest (as the fleet's row reduction leaves them: the same
    on every rank), and the clip's norm before each step (max_norm inf: the scale is 1)."""
    from torch.distributed.tensor import distribute_tensor

    norms = []
    for step in range(5):
        opt.set_lr_factor(0.5 + 0.1 * step)
        grads = _grads(model, step, _DROPS.get(step, ()))
        for n, p in model.named_parameters():
            g = grads[strip_name(n)]
            p.grad = (None if g is None else g.clone() if mesh is None
                      else distribute_tensor(g, mesh, p.placements))  # fmt: skip
        gen = torch.Generator().manual_seed(2000 + step)
        rows = torch.randperm(32, generator=gen)[:5].sort().values
        model.engram.host.replace_pending(rows, torch.randn(5, 8, generator=gen))
        norms.append(float(opt.clip_grad_norm_(float("inf"))))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms


def _whole(model) -> dict[str, torch.Tensor]:
    """Every parameter gathered, and the host table: the model's full state (a collective)."""
    out = {n: p.full_tensor() if hasattr(p, "full_tensor") else p.detach().clone()
           for n, p in model.named_parameters()}  # fmt: skip
    return out | {"engram.host.table": model.engram.host.table.clone()}


def _fsdp_muon_rank(rank: int, tmp: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{tmp}/store", _FSDP_WORLD),
                            rank=rank, world_size=_FSDP_WORLD)  # fmt: skip
    mesh = init_device_mesh("cpu", (_FSDP_WORLD,))
    try:
        for i, kw in enumerate(_VARIANTS[:2]):

            def build(seed):
                torch.manual_seed(seed)
                model = _WithHost()
                for block in model.blocks:
                    fully_shard(block, mesh=mesh)
                fully_shard(model, mesh=mesh)
                return model, MixOptimizer(
                    model,
                    Optim(**{"ns_dtype": "fp32", **_KW, **kw}),
                )

            model, opt = build(0)
            norms = _drive(model, opt, mesh)
            out = {"model": _whole(model), "opt": ckpt.optimizer_state(model, opt),
                   "norms": norms}  # fmt: skip
            if rank == 0:
                torch.save(out, f"{tmp}/fsdp{i}.pt")
            dist.barrier()
            # the gathered state loads back into shards (each rank's momentum rows into its
            # view of the local stack) and gathers again to the same bytes
            model, opt = build(1)
            saved = torch.load(f"{tmp}/fsdp{i}.pt", weights_only=True)
            ckpt.load_model_state(model, saved["model"])
            ckpt.load_optimizer_state(model, opt, saved["opt"])
            again = ckpt.optimizer_state(model, opt)
            if rank == 0:
                torch.save(again, f"{tmp}/again{i}.pt")
            dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")
def test_fsdp2_steps_the_shards_as_one_process_steps_the_whole(tmp_path):
    # Muon on shards: momentum on the local elements, the polar on all-gathered whole matrices
    # (the same bytes as one process's), each rank's own rows applied; AdamW and the row Adam
    # elementwise on the shards. So the arithmetic is one process's, bit for bit, and so is
    # the state the checkpoint gathers. Only the clip's norm sums in another order (and counts
    # the host rows, the same on every rank, once).
    import torch.multiprocessing as mp

    mp.start_processes(_fsdp_muon_rank, args=(str(tmp_path),), nprocs=_FSDP_WORLD,
                       start_method="spawn")  # fmt: skip
    for i, kw in enumerate(_VARIANTS[:2]):
        fleet = torch.load(tmp_path / f"fsdp{i}.pt", weights_only=True)
        torch.manual_seed(0)
        model = _WithHost()
        opt = MixOptimizer(model, Optim(**{"ns_dtype": "fp32", **_KW, **kw}))
        norms = _drive(model, opt)
        _assert_bitwise(_tensors(fleet["model"]), _tensors(_whole(model)))
        _assert_bitwise(_tensors(fleet["opt"]), _tensors(ckpt.optimizer_state(model, opt)))
        _assert_bitwise(_tensors(torch.load(tmp_path / f"again{i}.pt", weights_only=True)),
                        _tensors(fleet["opt"]))  # fmt: skip
        # fp32 sums of squares in per-shard partial sums vs one pass: a few ulp (the host rows
        # carry most of the norm here: counted once per rank, it would be off by ~sqrt(3))
        assert fleet["norms"] == pytest.approx(norms, rel=1e-6)
