"""The Kimi Delta Attention recurrence, one time step at a time: the reference both arms
of `dormouse.model.kda` (chunked torch, fla's Triton kernel) are held against.

Per head, with a state S of shape [K, V] and a per-key-dim log decay g_t <= 0:

    S   <- diag(exp g_t) S                      decay each key row of the state
    S   <- S + beta_t k_t (v_t - S^T k_t)^T      delta-rule write (uses the decayed S)
    o_t  = scale * q_t^T S                       read after the write

Shapes follow flash-linear-attention: q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K];
beta [B, T, H]; state [B, H, K, V]. The scale defaults to K ** -0.5 and multiplies q, as
in fla's `naive_recurrent_kda`, so an fla kernel is a drop-in twin of this loop.

Nothing clever lives here on purpose: a plain Python loop over time, computed in fp32
(fp64 stays fp64, so gradient checks can run in double precision).
"""

from __future__ import annotations

import torch


def kda_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Return (o [B, T, H, V] in v's dtype, final state [B, H, K, V] or None)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K**-0.5
    out_dtype = v.dtype
    cdt = torch.promote_types(q.dtype, torch.float32)
    q, k, v, g, beta = (x.to(cdt) for x in (q, k, v, g, beta))

    S = q.new_zeros(B, H, K, V)
    if initial_state is not None:
        S = S + initial_state.to(cdt)
    outs = []
    for t in range(T):
        q_t, k_t, v_t, g_t, b_t = q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t]
        S = S * torch.exp(g_t).unsqueeze(-1)  # [B,H,K,1]: row d of S decays by exp(g_t[d])
        pred = torch.einsum("bhk,bhkv->bhv", k_t, S)  # S^T k_t
        S = S + torch.einsum("bhk,bhv->bhkv", b_t.unsqueeze(-1) * k_t, v_t - pred)
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q_t, S))
    o = torch.stack(outs, dim=1) if T else v.new_zeros(B, 0, H, V)
    return o.to(out_dtype), (S if output_final_state else None)
