"""Pure-PyTorch attention kernels (any device): the ``math`` reference, ``sdpa`` per document, and
the math block kernels of ring attention. The interface they implement and how a backend is chosen
are in :mod:`omniweave.models.components.attention`."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F


def fp32_math(fn):
    """Run a kernel with autocast off: its einsums must stay in fp32 (autocast would run them in
    bf16, and the fp32 sentinels below overflow bf16)."""

    @functools.wraps(fn)
    def wrapper(first, *args, **kw):
        with torch.autocast(first.device.type, enabled=False):
            return fn(first, *args, **kw)

    return wrapper


def doc_bounds(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor) -> list[tuple[int, int, int, int]]:
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    if len(cq) != len(ck):
        raise ValueError(f"cu_seqlens_q has {len(cq) - 1} documents but cu_seqlens_k has {len(ck) - 1}")
    return [(cq[i], cq[i + 1], ck[i], ck[i + 1]) for i in range(len(cq) - 1)]


def visible_mask(lq: int, lk: int, causal: bool, window: int | None, device=None) -> torch.Tensor | None:
    """bool [lq, lk], True where query i may see key j; None when everything is visible."""
    if not causal and window is None:
        return None
    qi = torch.arange(lq, device=device)[:, None] + (lk - lq)  # query position on the key axis
    kj = torch.arange(lk, device=device)[None, :]
    mask = torch.ones(lq, lk, dtype=torch.bool, device=device)
    if causal:
        mask &= kj <= qi
    if window is not None:
        mask &= (qi - kj) < window
        if not causal:
            mask &= (kj - qi) < window
    return mask


def scaled_dot(q: torch.Tensor, k: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """fp32 scores [H, Lq, Lk] of q [Lq, H, D] against k [Lk, Hkv, D] (GQA: k heads repeated)."""
    h, hkv = q.shape[1], k.shape[1]
    if h % hkv:
        raise ValueError(f"{h} query heads are not a multiple of {hkv} key/value heads")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k = k.repeat_interleave(h // hkv, dim=1) if h != hkv else k
    return torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale


def masked_scores(q, k, causal: bool, window: int | None = None, scale: float | None = None) -> torch.Tensor:
    """fp32 scores [H, Lq, Lk] of one document, ``-inf`` where a query may not see a key."""
    s = scaled_dot(q, k, scale)
    mask = visible_mask(q.shape[0], k.shape[0], causal, window, q.device)
    return s if mask is None else s.masked_fill(~mask, float("-inf"))


@fp32_math
def math_attn_fp32(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window=None, scale=None):
    """:func:`math_attn` with the output left in fp32 (ring attention merges partial outputs)."""
    h, hkv = q.shape[1], k.shape[1]
    outs, lses = [], []
    for q0, q1, k0, k1 in doc_bounds(cu_seqlens_q, cu_seqlens_k):
        s = masked_scores(q[q0:q1], k[k0:k1], causal, window, scale)  # [H, lq, lk]
        lse = torch.logsumexp(s, dim=-1)  # [H, lq]
        p = torch.exp(s - lse.clamp_min(torch.finfo(torch.float32).min)[..., None])  # 0 where masked
        vd = v[k0:k1].float()
        vd = vd.repeat_interleave(h // hkv, dim=1) if h != hkv else vd
        outs.append(torch.einsum("hqk,khd->qhd", p, vd))
        lses.append(lse)
    out = torch.cat(outs) if outs else q.new_zeros(q.shape, dtype=torch.float32)
    lse = torch.cat(lses, dim=1) if lses else q.new_zeros((h, 0), dtype=torch.float32)
    return out, lse


def math_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window=None, scale=None, **_):
    """Reference kernel in fp32, one document at a time."""
    out, lse = math_attn_fp32(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window, scale)
    return out.to(q.dtype), lse


@fp32_math
def chunked_lse(q, k, cu_seqlens_q, cu_seqlens_k, causal, window=None, scale=None, chunk=1024):
    """lse [H, Tq] alone, query chunk by query chunk (bounded memory); differentiable."""
    lses = []
    for q0, q1, k0, k1 in doc_bounds(cu_seqlens_q, cu_seqlens_k):
        lq, lk = q1 - q0, k1 - k0
        full = visible_mask(lq, lk, causal, window, q.device)
        for c0 in range(0, lq, chunk):
            c1 = min(lq, c0 + chunk)
            s = scaled_dot(q[q0 + c0 : q0 + c1], k[k0:k1], scale)
            if full is not None:
                s = s.masked_fill(~full[c0:c1], float("-inf"))
            lses.append(torch.logsumexp(s, dim=-1))
    return torch.cat(lses, dim=1) if lses else q.new_zeros((q.shape[1], 0), dtype=torch.float32)


def per_document(t: torch.Tensor, bounds: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Rows ``[a, b)`` of ``t`` for each bound. When the documents tile ``t`` from row 0 (packed
    rows, a padding tail allowed) one ``torch.split`` makes them: its backward is one ``cat``,
    where a slice per document would zero-fill a gradient of all of ``t`` for each document
    (hundreds per step for an audio tower's 100-frame chunks)."""
    tiles = bool(bounds) and bounds[0][0] == 0 and all(b[0] == a[1] for a, b in zip(bounds, bounds[1:]))
    rest = t.shape[0] - bounds[-1][1] if bounds else -1
    if not tiles or rest < 0:
        return [t[a:b] for a, b in bounds]
    sizes = [b - a for a, b in bounds]
    return list(torch.split(t, sizes + [rest] if rest else sizes))[: len(sizes)]


_CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class _TrailingCausal(torch.autograd.Function):
    """Causal attention of ``q [1, H, lq, D]`` over ``k, v [1, H, lk, D]`` with ``lq < lk``, aligned
    bottom-right (query ``i`` sees keys ``<= lk - lq + i``: a document's later chunk over its earlier
    ones), on CPU FlashAttention. SDPA itself needs an explicit mask for this alignment and saves it
    as ``[lq, lk]`` floats, memory that grows with the document; here two mask-free blocks (every
    query over the ``lk - lq`` earlier keys, causal over the last ``lq``) are merged by their
    log-sum-exps, and the backward runs each block's kernel from the merged out / lse, as ring
    attention does, so only q, k, v, out and lse are kept."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        cut = k.shape[2] - q.shape[2]
        o1, l1 = _CPU_FLASH(q, k[:, :, :cut], v[:, :, :cut], 0.0, False, scale=scale)
        o2, l2 = _CPU_FLASH(q, k[:, :, cut:], v[:, :, cut:], 0.0, True, scale=scale)
        acc = torch.promote_types(q.dtype, torch.float32)  # fp32 merge, fp64 for fp64 inputs (the kernel's lse dtype)
        lse = torch.logaddexp(l1.to(acc), l2.to(acc))
        out = (o1.to(acc) * (l1 - lse).exp()[..., None] + o2.to(acc) * (l2 - lse).exp()[..., None]).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale, ctx.cut = scale, cut
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cut, dout = ctx.cut, dout.contiguous()
        dq1, dk1, dv1 = _CPU_FLASH_BACKWARD(dout, q, k[:, :, :cut], v[:, :, :cut], out, lse, 0.0, False, scale=ctx.scale)
        dq2, dk2, dv2 = _CPU_FLASH_BACKWARD(dout, q, k[:, :, cut:], v[:, :, cut:], out, lse, 0.0, True, scale=ctx.scale)
        return dq1 + dq2, torch.cat([dk1, dk2], 2), torch.cat([dv1, dv2], 2), None


def sdpa_attn(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, window=None, scale=None, need_lse=True, **_):
    """``F.scaled_dot_product_attention`` per document; lse from :func:`chunked_lse` if asked."""
    h, hkv = q.shape[1], k.shape[1]
    bounds = doc_bounds(cu_seqlens_q, cu_seqlens_k)
    q_docs = per_document(q, [(q0, q1) for q0, q1, _, _ in bounds])
    k_bounds = [(k0, k1) for _, _, k0, k1 in bounds]
    outs = []
    for (q0, q1, k0, k1), qd, kd, vd in zip(bounds, q_docs, per_document(k, k_bounds), per_document(v, k_bounds)):
        lq, lk = q1 - q0, k1 - k0
        # [1, H, L, D]: 4-D inputs let SDPA pick its fused kernels (also on CPU)
        qd, kd, vd = (t.transpose(0, 1)[None] for t in (qd, kd, vd))
        if h != hkv:  # enable_gqa is not supported by every SDPA kernel; repeat explicitly
            kd, vd = kd.repeat_interleave(h // hkv, dim=1), vd.repeat_interleave(h // hkv, dim=1)
        if window is None and (not causal or lq == lk):
            o = F.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, scale=scale)
        elif window is None and 0 < lq < lk and q.device.type == "cpu":
            o = _TrailingCausal.apply(qd, kd, vd, scale)
        else:
            mask = visible_mask(lq, lk, causal, window, q.device)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
            o = o.masked_fill(~mask.any(-1)[:, None], 0.0)  # rows that see nothing: 0, not NaN
        outs.append(o[0].transpose(0, 1))
    out = torch.cat(outs) if outs else torch.zeros_like(q)
    lse = chunked_lse(q, k, cu_seqlens_q, cu_seqlens_k, causal, window, scale) if need_lse else None
    return out, lse


@fp32_math
def math_decode(q, k_cache, v_cache, slots, lengths, scale=None):
    """One query per sequence over its cache slot: ``q [B, H, D]`` attends to the first
    ``lengths[b]`` keys of ``k_cache[slots[b]]`` (``k_cache, v_cache [N, S, Hkv, D]``) ->
    ``(out fp32 [B, H, D], lse fp32 [H, B])``."""
    longest = int(lengths.max())
    k, v = k_cache[slots, :longest], v_cache[slots, :longest]  # [B, longest, Hkv, D]
    h, hkv = q.shape[1], k.shape[2]
    if h != hkv:
        k, v = k.repeat_interleave(h // hkv, dim=2), v.repeat_interleave(h // hkv, dim=2)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = torch.einsum("bhd,bthd->bht", q.float(), k.float()) * scale
    seen = torch.arange(k.shape[1], device=q.device)[None, :] < lengths.to(q.device)[:, None]  # [B, S]
    s = s.masked_fill(~seen[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.clamp_min(torch.finfo(torch.float32).min)[..., None])
    return torch.einsum("bht,bthd->bhd", p, v.float()), lse.T


def _repeat_heads(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.float().repeat_interleave(group, dim=1) if group > 1 else x.float()


def math_block_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """Partial ``(out fp32 [Tq, H, D], lse fp32 [H, Tq])`` of queries over this block's keys only
    (the segments of ``cu_q`` cover every query row); the reference kernel without its cast."""
    return math_attn_fp32(q, k, v, cu_q, cu_k, causal, None, scale)


@fp32_math
def math_block_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    """``(dq [Tq, H, D], dk, dv [Tk, Hkv, D])`` in fp32 of this block, from the global ``out``/``lse``."""
    hkv, group = k.shape[1], q.shape[1] // k.shape[1]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for q0, q1, k0, k1 in doc_bounds(cu_q, cu_k):
        s = masked_scores(q[q0:q1], k[k0:k1], causal, None, scale)
        p = torch.exp(s - lse[:, q0:q1, None])  # [H, lq, lk]; exp(-inf) = 0 where masked
        d_out = dout[q0:q1].float()
        delta = (d_out * out[q0:q1].float()).sum(-1).T  # [H, lq]
        dp = torch.einsum("qhd,khd->hqk", d_out, _repeat_heads(v[k0:k1], group))
        ds = p * (dp - delta[..., None])
        dq[q0:q1] = torch.einsum("hqk,khd->qhd", ds, _repeat_heads(k[k0:k1], group)) * scale
        lk = k1 - k0
        dk[k0:k1] = (torch.einsum("hqk,qhd->khd", ds, q[q0:q1].float()) * scale).view(lk, hkv, group, -1).sum(2)
        dv[k0:k1] = torch.einsum("hqk,qhd->khd", p, d_out).view(lk, hkv, group, -1).sum(2)
    return dq, dk, dv
