"""MoE FFN (dormouse/model/moe.py) against its per-token twin references/moe_dense.py.

(a) dropless dispatch, every arm that runs here, forward and gradients; (b) the capacity
rule on hand-built routings where the dropped assignments are known in advance, on random
routings against the per-row reference references/moe_capacity.py, split across batches
and continued through a decoding cache; (c) the LFB controller; (d) moe_offload
is exact. CUDA variants run only where a GPU is visible.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dormouse.config import ModelConfig
from dormouse.model import arms
from dormouse.model.arms import ArmError, Card, why_not
from dormouse.model.moe import MoE
from gates.compare import routing_margin
from references.moe_capacity import moe_capacity
from references.moe_dense import moe_dense

D, FF, E, K, R = 16, 32, 4, 2, 8
# fp32 module vs fp64 reference: each output is a few dot products of length <= 32 over
# O(1) values, so fp32 round-off is ~1e-6; 2e-5 absolute leaves 10x headroom and is still
# far below any routing or gating mistake (those move outputs by O(0.1)).
ATOL, RTOL = 2e-5, 1e-4

ARMS = ["grouped", "batched", "dense"]


def cfg_of(**kw) -> ModelConfig:
    base = dict(
        d_model=D, d_ffn=FF, n_experts=E, moe_topk=K, shared_rank=R, init_std=0.3,
        n_heads=1, head_dim=D,
    )  # fmt: skip
    base.update(kw)
    return ModelConfig(**base)


def make(seed: int = 0, **kw) -> MoE:
    torch.manual_seed(seed)
    return MoE(cfg_of(**kw))


def skip_unless_arm(arm: str, device="cpu", dtype=torch.float32, d=D, f=FF):
    why = why_not("moe", arm, device, dtype, {"d_model": d, "d_ffn": f})
    if why:
        pytest.skip(f"{arm} arm unavailable here: {why}")


def leaves(m: MoE, dtype=torch.float64, device=None):
    """The module's weights as fresh fp64 leaves, in the reference's argument order."""
    return {
        n: p.detach().to(dtype=dtype, device=device).clone().requires_grad_()
        for n, p in m.named_parameters()
    }


def ref_forward(m: MoE, x, w, drop=(), bias=None):
    shared = None
    if m.shared is not None:
        shared = (w["shared.w1.weight"], w["shared.w3.weight"], w["shared.w2.weight"])
    return moe_dense(
        x, w["router.weight"], w["w1"], w["w3"], w["w2"], shared=shared, bias=bias,
        topk=m.topk, drop=drop,
    )  # fmt: skip


def compare_with_reference(m: MoE, x, drop=()):
    """Forward and every gradient of m vs the fp64 reference; returns (out, aux, x.grad)."""
    x32 = x.clone().requires_grad_()
    out, aux = m(x32)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out * probe).sum().backward()

    w = leaves(m)
    x64 = x.double().clone().requires_grad_()
    ref = ref_forward(m, x64, w, drop=drop, bias=m.lfb_bias.double())
    (ref * probe.double()).sum().backward()

    torch.testing.assert_close(out.double(), ref.detach(), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(x32.grad.double(), x64.grad, atol=ATOL, rtol=RTOL)
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad.double(), w[n].grad, atol=ATOL, rtol=RTOL, msg=n)
    return out, aux, x32.grad


# ---- shape of the module ------------------------------------------------------------


def test_parameter_names_and_shapes():
    m = make()
    shapes = {n: tuple(p.shape) for n, p in m.named_parameters()}
    assert shapes == {
        "router.weight": (E, D),
        "w1": (E, D, FF),
        "w3": (E, D, FF),
        "w2": (E, FF, D),
        "shared.w1.weight": (R, D),
        "shared.w3.weight": (R, D),
        "shared.w2.weight": (D, R),
    }
    assert {"lfb_counts", "lfb_bias"} <= set(m.state_dict())
    assert not any(n.startswith("shared") for n, _ in make(shared_rank=0).named_parameters())


def test_init_scales():
    torch.manual_seed(0)
    m = MoE(cfg_of(d_model=64, d_ffn=256, n_experts=8, init_std=0.02, n_layers=2, max_iter=2))
    # 8*64*256 samples: the sample std is within ~1% of the true one.
    assert abs(m.w1.std().item() - 0.02) < 0.02 * 0.03
    assert abs(m.router.weight.std().item() - 0.02) < 0.02 * 0.1
    assert abs(m.w2.std().item() - 0.02 / math.sqrt(8)) < 0.02 / math.sqrt(8) * 0.03


# ---- (a) dropless dispatch ----------------------------------------------------------


@pytest.mark.parametrize("arm", ARMS)
def test_dropless_matches_dense(arm):
    skip_unless_arm(arm)
    m = make(moe_impl=arm)
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1))
    # fp32 and fp64 must pick the same experts, or the comparison measures a flip.
    assert routing_margin(m, x) > 1e-4
    out, aux, _ = compare_with_reference(m, x)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert int(aux["dropped"]) == 0
    _s, experts, _ = m.route(x.reshape(-1, D))
    want = torch.bincount(experts.reshape(-1), minlength=E).float() / (10 * K)
    torch.testing.assert_close(aux["load"], want, atol=0, rtol=0)
    assert not aux["load"].requires_grad


@pytest.mark.parametrize("arm", ARMS)
def test_dropless_topk1_no_shared(arm):
    skip_unless_arm(arm)
    m = make(seed=3, moe_impl=arm, moe_topk=1, shared_rank=0)
    x = torch.randn(3, 4, D, generator=torch.Generator().manual_seed(2))
    assert routing_margin(m, x) > 1e-4
    compare_with_reference(m, x)


def test_arms_agree_and_empty_experts():
    """An expert nobody picks is an empty group: both arms must cope and agree."""
    skip_unless_arm("grouped")
    m = make(seed=4, moe_impl="grouped")
    with torch.no_grad():
        m.lfb_bias[3] = -10.0  # sigmoids live in (0, 1): expert 3 can never be picked
    x = torch.randn(6, D, generator=torch.Generator().manual_seed(3))
    out_g, aux = m(x)
    assert aux["load"][3] == 0
    m.impl = "batched"
    out_b, _ = m(x)
    torch.testing.assert_close(out_g, out_b, atol=1e-6, rtol=1e-5)  # same math, other GEMMs


def test_grouped_refusal_and_auto_fallback(caplog):
    d = 6  # 6 fp32 = 24 bytes: not a multiple of the grouped kernels' 16-byte rows
    m = make(moe_impl="grouped", d_model=d, n_heads=1, head_dim=d)
    x = torch.randn(4, d)
    with pytest.raises(ArmError, match="moe_impl=batched"):
        m(x)
    m.impl = "auto"
    with caplog.at_level(logging.INFO, logger="dormouse.model.arms"):
        arms._SAID.clear()
        m(x)
        m(x)
    lines = [r.getMessage() for r in caplog.records if r.name == "dormouse.model.arms"]
    assert len(lines) == 1, lines  # the verdict is logged once, not per forward
    assert lines[0].endswith("-> batched") and "16 bytes" in lines[0]


@pytest.mark.parametrize(
    "sm, dtype, grouped",
    [
        ((9, 0), torch.bfloat16, True),
        ((10, 0), torch.bfloat16, True),
        ((9, 0), torch.float32, False),
        ((8, 6), torch.bfloat16, False),
        ((12, 0), torch.bfloat16, False),  # no fused kernel on sm_120
    ],
)
def test_auto_policy_on_cuda(sm, dtype, grouped):
    """auto takes grouped on CUDA only where the fused kernel exists (bf16, sm_90/sm_100), for
    an MoE too wide for the dense arm."""
    m = make(moe_impl="auto", d_ffn=2048 // E + 16)  # too wide for the dense arm at 2048 too
    assert m.arm(Card("cuda", sm, "card"), dtype).name == ("grouped" if grouped else "batched")
    assert m.arm(Card("cpu", name="cpu"), torch.float32).name == "grouped"
    m.impl = "grouped"  # pinned: runs wherever the grouped matmul does (sm_80+ on torch 2.9+)
    assert m.arm(Card("cuda", sm, "card", torch_version=(2, 9)), dtype).name == "grouped"
    with pytest.raises(ArmError, match="sm_75"):
        m.arm(Card("cuda", (7, 5), "card"), dtype)


@pytest.mark.parametrize("sm", [(7, 5), (9, 0), (12, 0)])
def test_auto_takes_dense_for_narrow_moes_on_cuda_only(sm, monkeypatch):
    """n_experts * d_ffn <= DENSE_MAX_WIDTH: every expert on every token on any CUDA card and
    dtype (fp16 on sm_75 too), never on the CPU; one wider is the dispatch rule's, and the
    verdict names what it read. (The bound is 0 until measured on a card; the rule at 2048.)"""
    assert (
        arms.DENSE_MAX_WIDTH == 0
        and make(moe_impl="auto").arm(Card("cuda", sm, "c"), torch.bfloat16).name != "dense"
    )
    monkeypatch.setattr(arms, "DENSE_MAX_WIDTH", 2048)
    narrow = make(moe_impl="auto", d_ffn=arms.DENSE_MAX_WIDTH // E)
    wide = make(moe_impl="auto", d_ffn=arms.DENSE_MAX_WIDTH // E + 16)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        arm = narrow.arm(Card("cuda", sm, "card"), dtype)
        assert arm.name == "dense" and f"n_experts*d_ffn={arms.DENSE_MAX_WIDTH}" in arm.reason
        assert wide.arm(Card("cuda", sm, "card"), dtype).name != "dense"
    assert narrow.arm(Card("cpu", name="cpu"), torch.float32).name == "grouped"
    narrow.impl = "dense"  # pinned: runs everywhere
    assert narrow.arm(Card("cpu", name="cpu"), torch.float64).name == "dense"


def test_triton_refused_with_escape():
    with pytest.raises(ArmError, match="moe_impl=grouped.*moe_impl=batched"):
        make(moe_impl="triton")


def test_autocast_keeps_routing_fp32():
    skip_unless_arm("grouped", dtype=torch.bfloat16)
    m = make(seed=5)
    x = torch.randn(8, D, generator=torch.Generator().manual_seed(4))
    ref, _ = m(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s, _, gates = m.route(x)
        out, _ = m(x)
    assert s.dtype == torch.float32 and gates.dtype == torch.float32
    assert out.dtype == torch.float32  # the residual's dtype, not the matmuls'
    # bf16 matmuls: 8 mantissa bits, relative error ~4e-3 per product, a few accumulate.
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)


# ---- (b) capacity ---------------------------------------------------------------------

# Token i is the basis vector e_i, so router.weight[:, i] IS token i's logit vector.
LOGITS = [
    [3.0, 2.0, -3.0, -3.0],  # t0 picks {0, 1}
    [1.0, 2.5, -3.0, -3.0],  # t1 picks {1, 0}
    [2.0, -3.0, 1.0, -3.0],  # t2 picks {0, 2}
    [-3.0, -3.0, 2.0, 1.5],  # t3 picks {2, 3}
]
# Arrivals per expert, in position order: e0: t0, t1, t2; e1: t0, t1; e2: t2, t3; e3: t3.
CASES = {
    # cap = ceil(0.5 * 4 * 2 / 4) = 1: each expert keeps only its first arrival. (The old
    # lowest-affinity rule dropped t0 from e1 instead, because LATER t1 scored higher.)
    0.5: (1, {(1, 0), (2, 0), (1, 1), (3, 2)}),
    # cap = ceil(1.0 * 4 * 2 / 4) = 2: only expert 0 is over, its last arrival t2 goes.
    1.0: (2, {(2, 0)}),
    # cap = ceil(2.0 * 2) = 4: nobody is over.
    2.0: (4, set()),
}


def constructed(capacity: float, arm: str) -> tuple[MoE, torch.Tensor]:
    m = make(seed=6, moe_impl=arm, moe_capacity=capacity, d_model=8, n_heads=1, head_dim=8)
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[:, :4] = torch.tensor(LOGITS).t()
    return m, torch.eye(8)[:4]


@pytest.mark.parametrize("arm", ARMS)
@pytest.mark.parametrize("capacity", sorted(CASES))
def test_capacity_drops_exactly_the_late_arrivals(arm, capacity):
    skip_unless_arm(arm, d=8)
    cap, drop = CASES[capacity]
    m, x = constructed(capacity, arm)  # a 2-D input is one row of 4 tokens
    assert m.capacity_of(4) == cap
    out, aux, _ = compare_with_reference(m, x, drop=drop)
    assert int(aux["dropped"]) == len(drop)
    if drop:  # the drops are visible: the dropless model differs
        m.capacity = 0.0
        dropless, _ = m(x)
        assert (dropless - out).abs().max() > 1e-3


@pytest.mark.parametrize("arm", ARMS)
def test_capacity_ties_keep_the_earlier_token(arm):
    skip_unless_arm(arm, d=8)
    m = make(seed=7, moe_impl=arm, moe_capacity=0.5, moe_topk=1, n_experts=2, d_model=8,
             n_heads=1, head_dim=8)  # fmt: skip
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[0, 0] = 1.0  # both tokens: expert 0 with the same affinity
    x = torch.zeros(2, 8)
    x[:, 0] = 1.0
    x[1, 1] = 0.5  # token 1 differs off the router's axis: affinities tie exactly
    assert m.capacity_of(2) == 1
    _out, aux, _ = compare_with_reference(m, x, drop={(1, 0)})
    assert int(aux["dropped"]) == 1


def capacity_ref(m: MoE, x, w):
    shared = None
    if m.shared is not None:
        shared = (w["shared.w1.weight"], w["shared.w3.weight"], w["shared.w2.weight"])
    return moe_capacity(
        x, w["router.weight"], w["w1"], w["w3"], w["w2"], m.capacity, shared=shared,
        bias=m.lfb_bias.double(), topk=m.topk,
    )  # fmt: skip


@pytest.mark.parametrize("arm", ARMS)
@pytest.mark.parametrize("capacity", [0.5, 1.0])
def test_capacity_arms_match_the_per_row_reference(arm, capacity):
    """Random routings over 3 rows: forward, drops and every gradient vs the per-row loop."""
    skip_unless_arm(arm)
    m = make(seed=13, moe_impl=arm, moe_capacity=capacity)
    with torch.no_grad():
        m.lfb_bias.copy_(torch.tensor([0.0, 0.1, -0.05, 0.02]))  # steer some picks
    x = torch.randn(3, 8, D, generator=torch.Generator().manual_seed(14))
    assert routing_margin(m, x) > 1e-4  # fp32 and fp64 pick the same experts
    x32 = x.clone().requires_grad_()
    out, aux = m(x32)
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(15))
    (out * probe).sum().backward()

    w = leaves(m)
    x64 = x.double().clone().requires_grad_()
    ref, drops = capacity_ref(m, x64, w)
    (ref * probe.double()).sum().backward()
    n_drop = sum(len(d) for d in drops)
    assert n_drop > 0  # the comparison exercises the rule, not only dropless routing
    assert int(aux["dropped"]) == n_drop
    torch.testing.assert_close(out.double(), ref.detach(), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(x32.grad.double(), x64.grad, atol=ATOL, rtol=RTOL)
    for n, p in m.named_parameters():
        torch.testing.assert_close(p.grad.double(), w[n].grad, atol=ATOL, rtol=RTOL, msg=n)


@pytest.mark.parametrize("arm", ARMS)
def test_capacity_rows_are_independent(arm):
    """Rows [0:2] and [2:4] as two batches: the same outputs and drops as one batch of 4
    (bitwise: each row's keep decisions and slots depend on that row alone)."""
    skip_unless_arm(arm)
    m = make(seed=16, moe_impl=arm, moe_capacity=0.5)
    x = torch.randn(4, 8, D, generator=torch.Generator().manual_seed(17))
    with torch.no_grad():
        whole, aux = m(x)
        a, aux_a = m(x[:2])
        b, aux_b = m(x[2:])
    assert int(aux["dropped"]) > 0
    assert int(aux_a["dropped"]) + int(aux_b["dropped"]) == int(aux["dropped"])
    # The arms' GEMMs see other shapes when split, so round-off may differ: fp32 ATOL.
    torch.testing.assert_close(torch.cat([a, b]), whole, atol=ATOL, rtol=RTOL)
    place, width = m.capacity_places(m.route(x.reshape(-1, D))[1].view(4, 8, K))
    split = [m.capacity_places(m.route(x[i : i + 2].reshape(-1, D))[1].view(2, 8, K))
             for i in (0, 2)]  # fmt: skip
    # the same kept/dropped decision for every assignment, in both rows of both halves
    assert torch.equal(place == width, torch.cat([p == w for p, w in split]))


@pytest.mark.parametrize("arm", ARMS)
def test_capacity_decode_cache_equals_the_row(arm):
    """Feeding a row in chunks (a prefill, then token by token) with a cache drops what
    the forward over the whole row drops; past row_len the counts restart (a chunk that
    crosses the border is cut there), as two training windows would."""
    skip_unless_arm(arm)
    m = make(seed=18, moe_impl=arm, moe_capacity=0.5).eval()
    x = torch.randn(2, 20, D, generator=torch.Generator().manual_seed(19))
    with torch.no_grad():
        whole, aux = m(x[:, :10])
        cache = {"row_len": 10}
        parts = [m(x[:, :3], cache=cache)[0]] + [m(x[:, t : t + 1], cache=cache)[0]
                                                  for t in range(3, 10)]  # fmt: skip
        assert cache["pos"] == 10 and int(cache["seen"].sum()) == 2 * 10 * K
        two = torch.cat([m(x[:, :10])[0], m(x[:, 10:])[0]], 1)
        cache = {"row_len": 10}
        crossing = torch.cat([m(x[:, :7], cache=cache)[0], m(x[:, 7:], cache=cache)[0]], 1)
    assert int(aux["dropped"]) > 0
    torch.testing.assert_close(torch.cat(parts, 1), whole, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(crossing, two, atol=ATOL, rtol=RTOL)


# ---- (c) LFB ----------------------------------------------------------------------------


def swiglu(x, a, b, c):
    return (F.silu(x @ a) * (x @ b)) @ c


def test_bias_moves_selection_not_gates():
    m = make(seed=8, d_model=8, n_heads=1, head_dim=8, shared_rank=0)
    z = [2.0, 1.0, 0.0, -1.0]
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[:, 0] = torch.tensor(z)
    x = torch.eye(8)[:1]
    sig = [1 / (1 + math.exp(-v)) for v in z]

    _, experts, gates = m.route(x)
    assert sorted(experts[0].tolist()) == [0, 1]
    with torch.no_grad():
        m.lfb_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))
    _, experts, gates = m.route(x)
    picked = experts[0].tolist()
    assert sorted(picked) == [0, 2]
    # By hand: the unbiased sigmoids of the picked pair, renormalised; the +5 is absent.
    want = {0: sig[0] / (sig[0] + sig[2]), 2: sig[2] / (sig[0] + sig[2])}
    for e, g in zip(picked, gates[0].tolist()):
        assert abs(g - want[e]) < 1e-6  # fp32 sigmoid and one division

    out, _ = m(x)
    with torch.no_grad():
        hand = sum(want[e] * swiglu(x, m.w1[e], m.w3[e], m.w2[e]) for e in (0, 2))
    torch.testing.assert_close(out, hand, atol=1e-6, rtol=1e-5)  # fp32, same products


def test_lfb_update_rule_and_reset():
    m = make(moe_lb_coef=0.1)
    with torch.no_grad():
        m.lfb_counts.copy_(torch.tensor([3.0, 1.0, 2.0, 2.0]))  # mean 2
        m.lfb_bias.copy_(torch.tensor([0.5, 0.0, 0.0, -0.5]))
    m.lfb_update()
    torch.testing.assert_close(m.lfb_bias, torch.tensor([0.4, 0.1, 0.0, -0.5]))
    assert torch.equal(m.lfb_counts, torch.zeros(E))


def test_lfb_reduce_is_applied():
    m = make(moe_lb_coef=0.1)
    with torch.no_grad():
        m.lfb_counts.copy_(torch.tensor([3.0, 1.0, 2.0, 2.0]))
    seen = []

    def fleet_sum(c):  # another rank's counts [0, 4, 0, 0] -> [3, 5, 2, 2], mean 3
        seen.append(c.clone())
        return c + torch.tensor([0.0, 4.0, 0.0, 0.0])

    m.lfb_update(reduce=fleet_sum)
    assert len(seen) == 1 and torch.equal(seen[0], torch.tensor([3.0, 1.0, 2.0, 2.0]))
    torch.testing.assert_close(m.lfb_bias, torch.tensor([0.0, -0.1, 0.1, 0.1]))
    assert torch.equal(m.lfb_counts, torch.zeros(E))

    def in_place(c):  # torch.distributed.all_reduce's style: mutate, return None
        c.mul_(0).add_(torch.tensor([1.0, 0.0, 0.0, 3.0]))

    with torch.no_grad():
        m.lfb_counts.fill_(7.0)
    m.lfb_update(reduce=in_place)  # mean 1 -> sign [0, 1, 1, -1]
    torch.testing.assert_close(m.lfb_bias, torch.tensor([0.0, 0.0, 0.2, 0.0]))


def test_counts_accumulate_only_when_training_with_coef():
    x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(9))
    m = make(moe_lb_coef=0.01)
    _, experts, _ = m.route(x.reshape(-1, D))
    once = torch.bincount(experts.reshape(-1), minlength=E).float()
    m.train()
    m(x)
    assert torch.equal(m.lfb_counts, once) and once.sum() == 15 * K
    m(x)
    assert torch.equal(m.lfb_counts, 2 * once)
    m.eval()
    m(x)
    assert torch.equal(m.lfb_counts, 2 * once)

    off = make(moe_lb_coef=0.0).train()
    off(x)
    assert torch.equal(off.lfb_counts, torch.zeros(E))
    with torch.no_grad():
        off.lfb_counts.fill_(3.0)
    off.lfb_update()
    assert torch.equal(off.lfb_bias, torch.zeros(E))  # coef 0: the controller is off


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_recompute_counts_once(reentrant):
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(10), requires_grad=True)
    m = make(moe_lb_coef=0.01).train()
    _, experts, _ = m.route(x.detach().reshape(-1, D))
    once = torch.bincount(experts.reshape(-1), minlength=E).float()
    out, _ = checkpoint(m, x, use_reentrant=reentrant)
    out.sum().backward()
    assert torch.equal(m.lfb_counts, once)


# ---- (d) moe_offload ----------------------------------------------------------------------


@pytest.mark.parametrize("arm", ARMS)
@pytest.mark.parametrize("capacity", [0.0, 1.0])
def test_offload_is_exact_and_engaged(arm, capacity):
    skip_unless_arm(arm)
    x = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(11))
    results = []
    for offload in (False, True):
        m = make(seed=12, moe_impl=arm, moe_capacity=capacity, moe_offload=offload)
        xi = x.clone().requires_grad_()
        packed = []

        def pack(t):
            packed.append(t.shape)
            return t

        # Hooks nest innermost-first: tensors the module offloads never reach this one.
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out, _ = m(xi)
        out.pow(2).sum().backward()
        grads = [xi.grad] + [p.grad for p in m.parameters()]
        results.append((out.detach(), grads, len(packed)))
    (o0, g0, n0), (o1, g1, n1) = results
    assert torch.equal(o0, o1)
    for a, b in zip(g0, g1):
        assert torch.equal(a, b)
    assert n1 < n0  # the routed pass's saved tensors went through save_on_cpu


# ---- CUDA (only where a GPU is visible) ----------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")


@cuda
@pytest.mark.parametrize("arm", ARMS)
def test_cuda_dropless_matches_dense(arm):
    skip_unless_arm(arm, device="cuda")
    m = make(moe_impl=arm).cuda()
    x = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(1))
    cpu = make(moe_impl="batched")
    assert routing_margin(cpu, x) > 1e-4
    out_cpu, _, x_grad_cpu = compare_with_reference(cpu, x)
    xc = x.cuda().requires_grad_()
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 products, so the CPU tolerance holds
    try:
        out, _ = m(xc)
        probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))  # as above
        (out * probe.cuda()).sum().backward()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.testing.assert_close(out.cpu(), out_cpu.detach(), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(xc.grad.cpu(), x_grad_cpu, atol=ATOL, rtol=RTOL)
    for (n, p), q in zip(m.named_parameters(), cpu.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad, atol=ATOL, rtol=RTOL, msg=n)


@cuda
@pytest.mark.parametrize("arm", ARMS)
def test_cuda_bf16_autocast_close_to_fp32(arm):
    skip_unless_arm(arm, device="cuda", dtype=torch.bfloat16)
    m = make(moe_impl=arm).cuda()
    x = torch.randn(4, 16, D, device="cuda")
    ref, _ = m(x)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out, _ = m(x)
    torch.testing.assert_close(out, ref, atol=3e-2, rtol=3e-2)  # bf16 GEMMs, as on CPU


@cuda
def test_cuda_offload_exact():
    x = torch.randn(2, 6, D, device="cuda")
    res = []
    for offload in (False, True):
        m = make(seed=12, moe_offload=offload).cuda()
        xi = x.clone().requires_grad_()
        out, _ = m(xi)
        out.pow(2).sum().backward()
        res.append([out.detach(), xi.grad] + [p.grad for p in m.parameters()])
    for a, b in zip(*res):
        assert torch.equal(a, b)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_gather_rows_backward_equals_autograd_index_backward(k):
    """The dispatch's gather (moe._GatherRows): each token read k times in expert order; its
    backward (a gather through the inverse permutation and a fixed-order sum of the k copies)
    against autograd's own backward of x[order // k] (an index_put with accumulation)."""
    from dormouse.model.moe import _GatherRows

    g = torch.Generator().manual_seed(k)
    n, d = 37, 5
    x = torch.randn(n, d, generator=g, requires_grad=True)
    order = torch.randperm(n * k, generator=g)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(n * k)
    probe = torch.randn(n * k, d, generator=g)
    out = _GatherRows.apply(x, order // k, inv, k)
    (out * probe).sum().backward()
    ours = x.grad.clone()
    x.grad = None
    ref = x[order // k]
    (ref * probe).sum().backward()
    assert torch.equal(out, ref)
    # k = 1, 2: one addend or a commutative pair, bit for bit; k = 3: another summation order
    torch.testing.assert_close(ours, x.grad, rtol=0, atol=0 if k < 3 else 1e-6)


@pytest.mark.parametrize("E, A", [(8, 1000), (4, 7), (16, 5000), (3, 0), (1, 9)])
def test_the_counted_expert_order_is_the_stable_sort(E, A):
    """expert_order's counted permutation is torch.sort(stable=True)'s, and inv its inverse."""
    from dormouse.model.moe import expert_order

    e = torch.randint(0, E, (A,), generator=torch.Generator().manual_seed(A))
    order, inv = expert_order(e, (e.unsqueeze(1) == torch.arange(E)).sum(0))
    ref = torch.sort(e, stable=True).indices
    assert torch.equal(order, ref) and torch.equal(inv[ref], torch.arange(A))
