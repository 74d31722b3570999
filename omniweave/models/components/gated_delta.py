"""The gated delta rule (Gated DeltaNet; Yang et al. 2024) on packed rows: Qwen3.5's and
Qwen3-Next's linear-attention layers.

Per value head the state S ∈ R^{dk×dv} evolves token by token

    S_t = α_t (I − β_t k_t k_tᵀ) S_{t−1} + β_t k_t v_tᵀ,      o_t = S_tᵀ q_t,      α_t = exp(g_t)

(g ≤ 0 the log-decay, β ∈ (0, 1) the write strength; q scaled by dk^-½, and with ``qk_l2norm``
q and k L2-normalised per head first, as transformers' and fla's kernels do). Key heads may be
fewer than value heads (GVA): value head j reads key head j // (HV / Hk).

**Packed rows.** Every function here takes one row of documents, flat ``[L, heads, dim]`` with
``cu_seqlens`` [N+1], and resets the state (and the short convolution's window) at each
document's first token, so a packed row equals each document alone. ``initial_state`` [N, HV,
dk, dv] / ``initial_window`` [N, k−1, C] continue documents from an earlier piece (chunked rows,
context parallelism, decoding); the functions return each document's final state.

- :func:`gated_delta_rule_recurrent`: the step-by-step recurrence, in the inputs' dtype — the
  oracle (fp64 in the tests) and the decode step.
- :func:`gated_delta_rule_chunked`: the chunkwise form (the UT/WY transform within chunks of
  ``chunk_size`` tokens, a scan over chunks), exact to fp32 rounding, O(L·C) memory; each
  document's chunks are its own (the last one padded), so the scan resets at documents. Runs in
  fp32 (fp64 for fp64 inputs) whatever the input dtype, as transformers' and fla's kernels do.
- :func:`causal_conv1d_varlen`: the depthwise causal convolution over q|k|v channels, reset per
  document.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x · rsqrt(Σ x² + eps) over the last dim (fla's and transformers' l2norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q: Tensor, k: Tensor, v: Tensor, scale: float | None, qk_l2norm: bool, dtype) -> tuple[Tensor, Tensor]:
    """q, k in ``dtype``, value heads' copies (GVA), L2-normalised and q scaled."""
    hk, hv = k.shape[1], v.shape[1]
    if hv % hk:
        raise ValueError(f"value heads {hv} must be a multiple of key heads {hk}")
    q, k = q.to(dtype), k.to(dtype)
    if qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if hv != hk:
        q, k = q.repeat_interleave(hv // hk, dim=1), k.repeat_interleave(hv // hk, dim=1)
    return q * (q.shape[-1] ** -0.5 if scale is None else scale), k


def _check(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor) -> None:
    L = q.shape[0]
    if not (k.shape[0] == v.shape[0] == g.shape[0] == beta.shape[0] == L) or q.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, "
                         f"beta {tuple(beta.shape)}: want q, k [L, Hk, dk], v [L, HV, dv], g, beta [L, HV]")
    if g.shape != beta.shape or g.shape != v.shape[:2]:
        raise ValueError(f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be [L, HV] = {tuple(v.shape[:2])}")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != L:
        raise ValueError(f"cu_seqlens must run from 0 to the row length {L}, got {cu_seqlens.tolist()}")


def _initial(initial_state: Tensor | None, n: int, hv: int, dk: int, dv: int, like: Tensor) -> Tensor:
    if initial_state is None:
        return like.new_zeros(n, hv, dk, dv)
    if tuple(initial_state.shape) != (n, hv, dk, dv):
        raise ValueError(f"initial_state {tuple(initial_state.shape)} must be [documents, HV, dk, dv] = "
                         f"{(n, hv, dk, dv)}")
    return initial_state.to(like.dtype)


def gated_delta_rule_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                               initial_state: Tensor | None = None, scale: float | None = None,
                               qk_l2norm: bool = False) -> tuple[Tensor, Tensor]:
    """(o [L, HV, dv], final states [N, HV, dk, dv]) token by token, in the promoted dtype of the
    inputs (at least fp32). q, k [L, Hk, dk]; v [L, HV, dv]; g, beta [L, HV]."""
    _check(q, k, v, g, beta, cu_seqlens)
    dtype = torch.promote_types(v.dtype, torch.float32)
    q, k = _prepare(q, k, v, scale, qk_l2norm, dtype)
    v, g, beta = v.to(dtype), g.to(dtype), beta.to(dtype)
    bounds = cu_seqlens.tolist()
    state = _initial(initial_state, len(bounds) - 1, v.shape[1], k.shape[-1], v.shape[-1], v)
    out, finals = [], []
    for d, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        S = state[d]
        for t in range(s, e):
            S = S * g[t].exp()[:, None, None]
            delta = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", S, k[t]))
            S = S + k[t][:, :, None] * delta[:, None, :]
            out.append(torch.einsum("hkv,hk->hv", S, q[t]))
        finals.append(S)
    o = torch.stack(out) if out else v.new_zeros(0, *v.shape[1:])
    return o, torch.stack(finals)


def gated_delta_rule_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                          scale: float | None = None, qk_l2norm: bool = False) -> tuple[Tensor, Tensor]:
    """One token of each of N sequences (decoding): q, k [N, Hk, dk], v [N, HV, dv], g, beta
    [N, HV], ``state`` [N, HV, dk, dv] -> (o [N, HV, dv], the new states), the recurrence's step
    for all sequences at once (O(1) in the length decoded so far)."""
    dtype, out_dtype = torch.promote_types(v.dtype, torch.float32), v.dtype
    q, k = _prepare(q, k, v, scale, qk_l2norm, dtype)
    v, g, beta = v.to(dtype), g.to(dtype), beta.to(dtype)
    S = state.to(dtype) * g.exp()[..., None, None]
    delta = beta[..., None] * (v - torch.einsum("nhkv,nhk->nhv", S, k))
    S = S + k[..., :, None] * delta[..., None, :]
    return torch.einsum("nhkv,nhk->nhv", S, q).to(out_dtype), S


def _chunk_layout(cu_seqlens: Tensor, chunk: int) -> tuple[Tensor, Tensor, list[int]]:
    """(index [M·C] of each chunk slot's token, −1 for the pad slots; valid [M·C]; each
    document's first chunk) for documents cut into chunks of their own."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long)
    n_chunks = (lengths + chunk - 1) // chunk
    first = torch.cumsum(n_chunks, 0) - n_chunks
    doc_of_chunk = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), n_chunks)
    chunk_in_doc = torch.arange(int(n_chunks.sum()), device=lengths.device) - first[doc_of_chunk]
    pos = (chunk_in_doc[:, None] * chunk + torch.arange(chunk, device=lengths.device)).reshape(-1)
    doc = doc_of_chunk.repeat_interleave(chunk)
    valid = pos < lengths[doc]
    index = torch.where(valid, cu_seqlens[:-1].to(torch.long)[doc] + pos, -1)
    return index, valid, first.tolist()


def gated_delta_rule_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                             chunk_size: int = 64, initial_state: Tensor | None = None, scale: float | None = None,
                             qk_l2norm: bool = False) -> tuple[Tensor, Tensor]:
    """The chunkwise gated delta rule over a packed row: as :func:`gated_delta_rule_recurrent`
    (same arguments and results), in chunks of ``chunk_size`` tokens of one document each."""
    _check(q, k, v, g, beta, cu_seqlens)
    dtype = torch.promote_types(v.dtype, torch.float32)
    out_dtype = v.dtype
    q, k = _prepare(q, k, v, scale, qk_l2norm, dtype)
    v, g, beta = v.to(dtype), g.to(dtype), beta.to(dtype)
    L, H, dk, dv, C = v.shape[0], v.shape[1], k.shape[-1], v.shape[-1], chunk_size
    index, valid, firsts = _chunk_layout(cu_seqlens.to(q.device), C)
    M = index.numel() // C

    def chunked(x: Tensor) -> Tensor:  # [L, H, ...] -> [H, M, C, ...], zeros in the pad slots
        x = x[index.clamp(min=0)] * valid.reshape(-1, *[1] * (x.dim() - 1)).to(x.dtype)
        return x.reshape(M, C, *x.shape[1:]).movedim(2, 0)

    qc, kc, vc, gc, bc = (chunked(x) for x in (q, k, v, g, beta))  # pads: k = v = q = β = 0, g = 0
    decay = gc.cumsum(-1)  # [H, M, C] log-decay from the chunk's start to each position
    lower = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # Γ_ij, j ≤ i
    k_beta = kc * bc[..., None]
    system = (k_beta @ kc.transpose(-1, -2)) * pair  # (I + strictly lower part) is the UT system
    new_values = torch.linalg.solve_triangular(system, vc * bc[..., None], upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False,
                                              unitriangular=True)
    attn = (qc @ kc.transpose(-1, -2)) * pair
    q_decayed = qc * decay.exp()[..., None]
    k_to_end = kc * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]  # [H, M, 1, 1]

    start = _initial(initial_state, len(firsts), H, dk, dv, v).unbind(0)  # N x [H, dk, dv]
    doc_starts = {c: d for d, c in enumerate(firsts)}
    outs, finals = [], [None] * len(firsts)
    S, doc = None, -1
    # per-chunk views made once (unbind): indexing [:, i] inside the loop would make the backward write
    # each chunk's gradient into a zero tensor the size of the whole row, quadratic in the row length
    per_chunk = zip(*(t.unbind(1) for t in (new_values, k_decayed, q_decayed, attn, chunk_decay, k_to_end)))
    for i, (values_i, k_decayed_i, q_i, attn_i, decay_i, k_end_i) in enumerate(per_chunk):
        if i in doc_starts:  # a document's first chunk: its own initial state
            if doc >= 0:
                finals[doc] = S
            doc = doc_starts[i]
            S = start[doc]
        v_new = values_i - k_decayed_i @ S
        outs.append(q_i @ S + attn_i @ v_new)
        S = S * decay_i + k_end_i.transpose(-1, -2) @ v_new
    if doc >= 0:
        finals[doc] = S
    for d, f in enumerate(finals):  # an empty document keeps its initial state
        if f is None:
            finals[d] = start[d]
    o = torch.stack(outs, 1).movedim(0, 2).reshape(M * C, H, dv) if outs else v.new_zeros(0, H, dv)
    out = v.new_zeros(L, H, dv).index_copy(0, index[valid], o[valid])
    return out.to(out_dtype), torch.stack(finals)


def causal_conv1d_varlen(x: Tensor, weight: Tensor, cu_seqlens: Tensor, initial_window: Tensor | None = None,
                         activation: bool = True) -> tuple[Tensor, Tensor]:
    """(the depthwise causal convolution of ``x`` [L, C] with ``weight`` [C, K], SiLU'd with
    ``activation``, each document's inputs before its start being its ``initial_window``
    [N, K−1, C] rows (zeros without one: transformers' left padding); each document's last K−1
    inputs [N, K−1, C] for the next piece). ``out_t = Σ_s weight[:, K−1−s] · x_{t−s}`` as
    ``nn.Conv1d(C, C, K, groups=C, padding=K−1)`` keeping the first L outputs.

    One ``F.conv1d`` over the row with each document preceded by its window (gathered, so the
    backward keeps only that padded input): outputs never mix documents, as each sees K−1 rows of
    its own window before its first token."""
    L, C = x.shape
    K = weight.shape[-1]
    n = len(cu_seqlens) - 1
    window = x.new_zeros(n, K - 1, C) if initial_window is None else initial_window.to(x.dtype)
    if K == 1:
        out = x * weight[:, 0]
        return (F.silu(out) if activation else out), window
    rows, first, last = _padded_layout(cu_seqlens, K, L, x.device)
    padded = torch.cat([x, window.reshape(-1, C)])[rows]  # [L + N·(K−1), C]
    out = F.conv1d(padded.t()[None], weight[:, None, :], groups=C)[0].t()[first]
    return (F.silu(out) if activation else out), padded[last].reshape(n, K - 1, C)


def _padded_layout(cu_seqlens: Tensor, K: int, L: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """For ``[window_0 | doc_0 | window_1 | doc_1 | …]`` built from ``cat([x, windows])``: the source
    row of each padded row, the convolution output row of each of x's rows, and the padded rows of
    each document's last K−1 inputs."""
    starts = cu_seqlens[:-1].to(torch.long).to(device)
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long).to(device)
    n = len(starts)
    doc = torch.repeat_interleave(torch.arange(n, device=device), lengths, output_size=L)
    pad_start = starts + torch.arange(n, device=device) * (K - 1)  # P_d: where document d's window begins
    total = L + n * (K - 1)
    rows = torch.empty(total, dtype=torch.long, device=device)
    w = torch.arange(K - 1, device=device)
    rows[(pad_start[:, None] + w).reshape(-1)] = L + torch.arange(n * (K - 1), device=device)
    in_doc = torch.arange(L, device=device) + doc * (K - 1) + (K - 1)  # padded row of x's row i
    rows[in_doc] = torch.arange(L, device=device)
    first = in_doc - (K - 1)  # conv output r covers padded rows r .. r + K − 1
    last = (pad_start + lengths)[:, None] + w  # the last K − 1 rows of [window_d | doc_d]
    return rows, first, last.reshape(-1)
