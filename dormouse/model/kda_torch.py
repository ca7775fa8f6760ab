"""KDA's torch arm: the chunked pure-PyTorch form of the recurrence (runs everywhere,
autograd-friendly; the CPU path). Its contract, and the fla arm's (`kda_fla.py`), is the
per-step recurrence of `references/kda_naive.py`."""

from __future__ import annotations

import torch


def _to_chunks(x: torch.Tensor, n: int, c: int) -> torch.Tensor:
    """[B, T, H, *] (T = n*c) -> [B, H, n, c, *]."""
    B, _, H = x.shape[:3]
    x = x.reshape(B, n, c, H, *x.shape[3:])
    return x.movedim(3, 1)


def _unit_lower_inverse(A: torch.Tensor, eye: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for strictly lower-triangular A [..., C, C], as a product of squarings.

    A is nilpotent (A^C = 0), so (I + A)^-1 = sum_k (-A)^k = (I - A)(I + A^2)(I + A^4)...
    with ceil(log2 C) factors: a handful of small batched matmuls instead of a batched
    triangular solve, which on the CPU costs ~1 s per call at the `small` shape (measured,
    torch 2.13) because it loops over thousands of 16x16 systems one by one.
    """
    inv = eye - A
    power = A
    span = 2
    while span < A.shape[-1]:
        power = power @ power
        inv = inv + inv @ power
        span *= 2
    return inv


def kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked KDA. Shapes as in `references/kda_naive.py`; returns (o in q's dtype, state).

    Inside a chunk of length C, with G the within-chunk cumulative log decay (G_r = sum of
    g over positions <= r), the delta-rule writes D (one row per position) solve the unit
    lower-triangular system

        (I + A) D = diag(beta) (V - (exp(G) * K) S0)
        A_rs = beta_r sum_d k_rd k_sd exp(G_rd - G_sd)        for s < r

    (the UT/WY form: D = U - W S0), the outputs are

        O = (Q * exp(G)) S0 + Aqk D
        Aqk_rs = sum_d q_rd k_sd exp(G_rd - G_sd)             for s <= r

    and the state handed to the next chunk is
        S = exp(G_C) * S0 + (K * exp(G_C - G))^T D.

    Every exponent is a difference G_r - G_s with s <= r, hence <= 0: the decay never
    overflows however strong it is (the upper triangle is masked BEFORE the exp). The cost is
    a [C, C, K] decay tensor per chunk, which is why the chunk stays small (16).
    Computes in fp32 (fp64 stays fp64, for gradient checks).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    if scale is None:
        scale = K**-0.5
    out_dtype = q.dtype
    cdt = torch.promote_types(q.dtype, torch.float32)
    if T == 0:
        S = q.new_zeros(B, H, K, V, dtype=cdt) if initial_state is None else initial_state.to(cdt)
        return q.new_zeros(B, 0, H, V), (S if output_final_state else None)

    C = max(1, min(chunk_size, T))  # a short input needs no padding up to a full chunk
    N = -(-T // C)
    pad = N * C - T

    def prep(x: torch.Tensor) -> torch.Tensor:
        x = x.to(cdt)
        if pad:
            # zero g (no decay), zero k and beta (no write): padded steps leave the state alone
            x = torch.cat([x, x.new_zeros(x.shape[0], pad, *x.shape[2:])], dim=1)
        return _to_chunks(x, N, C)

    q, k, v, g, beta = (prep(x) for x in (q, k, v, g, beta))  # [B,H,N,C,*]
    q = q * scale

    G = g.cumsum(dim=-2)  # [B,H,N,C,K]
    incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()  # s <= r
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # [B,H,N,C(r),C(s),K] = G_r - G_s
    decay = diff.masked_fill(~incl.unsqueeze(-1), float("-inf")).exp()
    k_dec = decay * k.unsqueeze(-3)  # k_s * e^(G_r - G_s)
    Akk = torch.einsum("bhnrsk,bhnrk->bhnrs", k_dec, k)
    Aqk = torch.einsum("bhnrsk,bhnrk->bhnrs", k_dec, q)
    Akk = (Akk * beta.unsqueeze(-1)).tril(-1)
    eye = torch.eye(C, dtype=cdt, device=q.device)

    b = beta.unsqueeze(-1)
    rhs = torch.cat([b * v, b * (G.exp() * k)], dim=-1)  # [B,H,N,C,V+K]
    UW = _unit_lower_inverse(Akk, eye) @ rhs
    U, W = UW.split([V, K], dim=-1)

    q_dec = q * G.exp()  # reads the chunk-start state through the decay so far
    G_end = G[..., -1, :]  # [B,H,N,K]
    k_end = k * (G_end.unsqueeze(-2) - G).exp()  # [B,H,N,C,K], exponent <= 0
    a_end = G_end.exp().unsqueeze(-1)  # [B,H,N,K,1]

    S = q.new_zeros(B, H, K, V) if initial_state is None else initial_state.to(cdt)
    outs = []
    for n in range(N):
        D = U[:, :, n] - W[:, :, n] @ S  # [B,H,C,V] the delta-rule writes of this chunk
        outs.append(q_dec[:, :, n] @ S + Aqk[:, :, n] @ D)
        S = a_end[:, :, n] * S + k_end[:, :, n].transpose(-1, -2) @ D
    o = torch.stack(outs, dim=2)  # [B,H,N,C,V]
    o = o.movedim(1, 3).reshape(B, N * C, H, V)[:, :T]
    return o.to(out_dtype), (S if output_final_state else None)
