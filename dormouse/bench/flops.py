"""What one training step computes beyond the 6N rule, and the card's measured matmul rate.

bench step quotes two utilisations against `matmul_peak`, the rate this card reaches on one
large matmul in this process:
- MFU (model FLOPs): 6 x active params x tokens (step.active_params_per_token), the rule that
  counts the weight matmuls only;
- HFU (hardware FLOPs): that plus the work the rule leaves out (`step_flops`): KDA's chunked
  recurrence (`kda_forward_flops`, forward x 3 for forward + backward, as 6N = 2N forward +
  4N backward), Muon's polar (`polar_flops`, per step: it does not grow with the batch), and
  causal attention's scores (`attention_forward_flops`, x 3 likewise: a GPT row's layers, a
  hybrid dormouse body's attention blocks).
A multiply-add is 2 FLOPs; elementwise work (decays, gates, norms, the momentum) is uncounted.
"""

from __future__ import annotations

import statistics

import torch

from ..model.model import kda_impl

#: fla's chunk_kda runs chunks of 64 positions whatever the config's kda_chunk (model/kda_fla.py)
FLA_CHUNK = 64


def kda_chunk_flops(C: int, K: int, V: int) -> int:
    """Forward FLOPs of one head over one chunk of C positions (key dim K, value dim V) by the
    chunked algorithm of model/kda_torch.py (its docstring), with P = C(C+1)/2 the causal
    pairs s <= r of the chunk:

        2 K C^2      the scores Aqk (s <= r) and Akk (s < r): C^2 pairs together, K each
        C(C^2-1)/3   (I + A)^-1 of the unit lower-triangular A, by substitution
        2 P (V + K)  [U | W] = (I + A)^-1 [beta V | beta exp(G) K]
        2 P V        Aqk D, the intra-chunk outputs
        6 C K V      W S0, (Q exp(G)) S0 and (K exp(G_C - G))^T D: the state's three products

    Triangular products are counted on their triangle (what the algorithm needs; a kernel
    multiplying whole blocks does more); per token that is 2KC + (2V+K)(C+1) + (C^2-1)/3 + 6KV.
    """
    P = C * (C + 1) // 2
    return 2 * K * C * C + C * (C * C - 1) // 3 + 2 * P * (V + K) + 2 * P * V + 6 * C * K * V


def kda_chunk_len(model, seg: int) -> int:
    """The chunk the model's KDA arm runs: fla's 64, or the torch arm's kda_chunk (cut to a
    shorter segment, as kda_torch cuts it)."""
    impl = kda_impl(model)
    if impl is None:  # guessing the torch arm's chunk would under-count an fla run 4x
        raise ValueError("the KDA arm is chosen by the model's first forward; count after it")
    return FLA_CHUNK if impl == "fla" else max(1, min(model.cfg.kda_chunk, seg))


def kda_forward_flops(model, batch: int, seq_len: int) -> int:
    """Forward FLOPs of every KDA recurrence in one forward over [batch, seq_len]: each block's
    KDA mixer once per iteration (its KDA blocks x max_iter), each head, each segment (segment_len, or the
    whole window) in chunks, the last one counted whole (padded). 0 for a model without KDA.
    After a first forward, which chose the arm (KDAMixer.impl) and so the chunk."""
    cfg = model.cfg
    if cfg.arch != "dormouse":
        return 0
    kda_layers = sum(cfg.mixer_of(layer) == "kda" for layer in range(cfg.n_layers))
    if kda_layers == 0:
        return 0
    seg = cfg.segment_len if 0 < cfg.segment_len < seq_len else seq_len
    C = kda_chunk_len(model, seg)
    chunks = -(-seg // C) * (seq_len // seg)  # validate(): segment_len divides seq_len
    apps = kda_layers * cfg.max_iter
    return batch * cfg.n_heads * apps * chunks * kda_chunk_flops(C, cfg.head_dim, cfg.head_dim)


def attention_forward_flops(model, batch: int, seq_len: int) -> int:
    """Forward FLOPs of causal attention's two products (Q K^T, then A V): per layer
    application and window 2 x 2 d_attn T(T+1)/2 (the causal pairs). A GPT row: every layer
    once; a dormouse model: its attention blocks (`attn_every`) max_iter times each (its KDA
    blocks: `kda_forward_flops`)."""
    cfg = model.cfg
    if cfg.arch == "gpt":
        apps = cfg.n_layers
    else:
        apps = cfg.max_iter * sum(cfg.mixer_of(layer) == "attn" for layer in range(cfg.n_layers))
    return batch * apps * 2 * cfg.d_attn * seq_len * (seq_len + 1)


def polar_flops(opt) -> int:
    """FLOPs of one optimizer step's Newton-Schulz polars: every matrix of every Muon group
    (MixOptimizer: one group per matrix shape [R, C], a 3-D stack counting each of its
    matrices), oriented wide (r = min(R, C), c = max) as muon.newton_schulz orients it, per
    iteration 2r^2c (X X^T) + 2r^3 (A A) + 2r^2c (B X), times the group's ns_steps."""
    total = 0
    for g in opt.param_groups:
        if g.get("kind") != "muon":
            continue
        R, C = g["matrix"]
        r, c = min(R, C), max(R, C)
        n = sum(p.numel() for p in g["params"]) // (R * C)
        total += g["ns_steps"] * n * (4 * r * r * c + 2 * r**3)
    return total


def step_flops(model, opt, batch: int, seq_len: int, active: float) -> dict[str, float]:
    """One training step's FLOPs by source: "6N" (6 x active x tokens), "KDA" and
    "attention" (forward x 3), "polar" (per step)."""
    tokens = batch * seq_len
    return {
        "6N": 6 * active * tokens,
        "KDA": 3 * kda_forward_flops(model, batch, seq_len),
        "attention": 3 * attention_forward_flops(model, batch, seq_len),
        "polar": float(polar_flops(opt)),
    }


#: matmul_peak's problem and repetitions: 8192^3 is ~1.4 ms of bf16 work on an H100-class card
#: (far past launch overhead) on inputs of 128 MiB each (several times the L2)
PEAK_N, PEAK_WARMUP, PEAK_REPS = 8192, 3, 20


def matmul_peak(device: torch.device, dtype: torch.dtype) -> tuple[float, float]:
    """(median, best) TFLOP/s of torch.mm on [PEAK_N, PEAK_N] x [PEAK_N, PEAK_N] random
    `dtype` inputs on a CUDA `device` (fp32 at torch's float32 matmul precision):
    PEAK_WARMUP untimed calls, then PEAK_REPS timed one by one with CUDA events. The median
    is what bench step divides by."""
    n = PEAK_N
    g = torch.Generator(device=device).manual_seed(0)  # random, never zeros: zeros run faster
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(PEAK_WARMUP):
        torch.mm(a, b, out=out)
    pairs = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(PEAK_REPS)
    ]
    for start, end in pairs:
        start.record()
        torch.mm(a, b, out=out)
        end.record()
    torch.cuda.synchronize(device)
    ms = [start.elapsed_time(end) for start, end in pairs]
    del a, b, out
    torch.cuda.empty_cache()
    flop = 2 * n**3
    return flop / statistics.median(ms) / 1e9, flop / min(ms) / 1e9  # per ms: / 1e9 = TFLOP/s
