"""Bugs planted in the gate's own process (scope "process"): the launch rules, the capacity
split, the re-balancer, the device policy and the model's kernel arms, which those gates call
directly.
"""

from __future__ import annotations

from gates.mutation_list.common import Mutation


def _ignore_seq(orig):
    def parse(spec, world_size, batch, seq_len, max_seq_len, rates=None, global_batch=0):
        from dormouse.train.context import RankShape

        shapes = orig(spec, world_size, batch, seq_len, max_seq_len, rates=rates,
                      global_batch=global_batch)  # fmt: skip
        return [RankShape(s.batch, seq_len, s.accum) for s in shapes]

    return parse


def _remainder_to_rank0(orig):
    def split(rates, global_batch):
        orig(rates, global_batch)  # keep its refusals
        total = sum(rates)
        out = [max(1, int(global_batch * r / total)) for r in rates]
        out[0] += global_batch - sum(out)
        return out

    return split


def _shifted_order(orig, flat_e, counts):
    import torch

    _order, inv = orig(flat_e, counts)
    inv = (inv + 1) % max(inv.numel(), 1)
    return torch.empty_like(inv).scatter_(0, inv, torch.arange(inv.numel(), device=inv.device)), inv


def _first_copy_only(orig):
    def backward(ctx, g):
        (back,) = ctx.saved_tensors
        gx = g.index_select(0, back)
        if ctx.k > 1:
            gx = gx.view(-1, ctx.k, g.shape[-1])[:, 0]
        return gx, None, None, None

    return staticmethod(backward)


def _gloo_when_nccl_missing(orig):
    def choose(device_type, nccl_available=None):
        if device_type == "cuda" and nccl_available is False:
            return "gloo"
        return orig(device_type, nccl_available)

    return choose


def _accept_dist_without_fleet(orig):
    def check(dist_flag, env):
        if dist_flag and env.get("WORLD_SIZE", "1") in ("", "1"):
            return True
        return orig(dist_flag, env)

    return check


def window_wide_cap(orig):
    def capacity_places(self, experts, cache=None):
        B, T, k = experts.shape
        return orig(self, experts.reshape(1, B * T, k), cache)  # the whole window as one row

    return capacity_places


def _no_hysteresis(orig):
    def decide(self, *args):
        self.threshold = 0.0
        return orig(self, *args)

    return decide


MUTATIONS: list[Mutation] = [
    Mutation(
        "capacity_ignores_window_length",
        "--capacity B x T: the per-rank window length T is dropped (every rank gets seq_len)",
        (("dormouse.train.fleet.launch:parse_capacity", _ignore_seq),),
        ("g09_capacity",),
        scope="process",
    ),
    Mutation(
        "capacity_remainder_to_rank0",
        "capacity auto: floor shares, the whole remainder to rank 0",
        (("dormouse.train.fleet.launch:split_by_rates", _remainder_to_rank0),),
        ("g09_capacity",),
        scope="process",
    ),
    Mutation(
        "capacity_shares_not_packed",
        "capacity auto under global_batch: the rates' split as it is, a prime share run "
        "as micro-batches of one window",
        (
            (
                "dormouse.train.fleet.launch:packed_split",
                lambda orig: lambda split, *a, **k: tuple(split),
            ),
        ),
        ("g09_capacity",),
        scope="process",
    ),
    Mutation(
        "nccl_falls_back_to_gloo",
        "a CUDA fleet without NCCL quietly runs on gloo",
        (("dormouse.train.fleet.launch:choose_backend", _gloo_when_nccl_missing),),
        ("g06_nccl",),
        scope="process",
    ),
    Mutation(
        "dist_without_fleet_accepted",
        "--dist with WORLD_SIZE unset or 1 is accepted (a one-rank 'fleet')",
        (("dormouse.train.fleet.launch:check_launch", _accept_dist_without_fleet),),
        ("g07_launch",),
        scope="process",
    ),
    Mutation(
        "kda_fla_from_sm70",
        "the KDA arm's minimum sm set to (7, 0): fla's Triton kernel chosen on cards that "
        "cannot run it",
        (("dormouse.model.arms:FLA_MIN_SM", lambda orig: (7, 0)),),
        ("g13_policy",),
        scope="process",
    ),
    Mutation(
        "capacity_cut_window_wide",
        "the capacity MoE's cap and arrival order span the whole window (all rows) again: "
        "later bytes and other rows decide which earlier assignments drop",
        (("dormouse.model.moe:MoE.capacity_places", window_wide_cap),),
        ("g18_causal",),
        scope="process",
    ),
    Mutation(
        "capacity_cap_off_by_one",
        "the per-row cap is one too large (rank <= cap kept instead of rank < cap)",
        (
            (
                "dormouse.model.moe:MoE.capacity_of",
                lambda orig: lambda self, row_len: orig(self, row_len) + 1,
            ),
        ),
        ("g19_kernels",),
        scope="process",
    ),
    Mutation(
        "dense_moe_gate_up_swapped",
        "the dense MoE arm stacks each expert's up projection where its gate belongs: "
        "silu(x @ w3) * (x @ w1)",
        (
            (
                "dormouse.model.moe:_experts_dense",
                lambda orig: lambda x, weight, w1, w3, w2: orig(x, weight, w3, w1, w2),
            ),
        ),
        ("g19_kernels",),
        scope="process",
    ),
    Mutation(
        "expert_slots_from_one",
        "the counted expert order ranks each expert's first assignment 1, not 0: the slots "
        "shift by one inside every expert's group (and the last lands in the next group)",
        (
            (
                "dormouse.model.moe:expert_order",
                lambda orig: lambda flat_e, counts: _shifted_order(orig, flat_e, counts),
            ),
        ),
        ("g19_kernels",),
        scope="process",
    ),
    Mutation(
        "moe_backward_first_copy_only",
        "the MoE dispatch's backward reads back only each token's first assignment: the "
        "gradient into a token misses its other k-1 experts' shares",
        (("dormouse.model.moe:_GatherRows.backward", _first_copy_only),),
        ("g19_kernels",),
        scope="process",
    ),
    Mutation(
        "rebalance_without_hysteresis",
        "the re-balancer takes any split its noisy rates predict to be faster (threshold 0)",
        (("dormouse.train.fleet.balance:Balancer.decide", _no_hysteresis),),
        ("g28_rebalance",),
        scope="process",
    ),
    Mutation(
        "rebalance_by_time",
        "the split is proportional to each rank's step time instead of its rate",
        (
            (
                "dormouse.train.fleet.balance:split_capped",
                lambda orig: (
                    lambda rates, total, caps=None: orig([1 / r for r in rates], total, caps)
                ),
            ),
        ),
        ("g28_rebalance",),
        scope="process",
    ),
]
