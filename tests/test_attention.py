"""Varlen attention kernels against a dense masked reference (block-diagonal L×L, tests only)."""

import math

import pytest
import torch

from omniweave.models.components.attention import BACKENDS, attn, math_attn, sdpa_attn, select_backend


def dense_reference(q, k, v, cu_q, cu_k, causal, window=None):
    """Dense [H, Tq, Tk] scores masked to each document's block (bottom-right causal)."""
    h, hkv = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(h // hkv, 1).double(), v.repeat_interleave(h // hkv, 1).double()
    s = torch.einsum("qhd,khd->hqk", q.double(), k) / math.sqrt(q.shape[-1])
    allowed = torch.zeros(q.shape[0], k.shape[0], dtype=torch.bool)
    for (q0, q1), (k0, k1) in zip(zip(cu_q[:-1], cu_q[1:]), zip(cu_k[:-1], cu_k[1:])):
        for i in range(q0, q1):
            ip = (i - q0) + (k1 - k0) - (q1 - q0)
            for j in range(k0, k1):
                jj = j - k0
                ok = (not causal or jj <= ip) and (window is None or (ip - jj < window and (causal or jj - ip < window)))
                allowed[i, j] = ok
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.nan_to_num(torch.exp(s - lse[..., None]))
    return torch.einsum("hqk,khd->qhd", p, v).float(), lse.float()


def _qkv(tq, tk, h=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tq, h, d, generator=g), torch.randn(tk, hkv, d, generator=g), torch.randn(tk, hkv, d, generator=g))


CU = torch.tensor([0, 5, 6, 19, 32], dtype=torch.int32)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_kernel_matches_dense_masked_reference(causal, window, heads, backend):
    q, k, v = _qkv(32, 32, *heads)
    out, lse = BACKENDS[backend](q, k, v, CU, CU, causal, window)
    ref_out, ref_lse = dense_reference(q, k, v, CU.tolist(), CU.tolist(), causal, window)
    assert out.shape == q.shape and lse.shape == (heads[0], 32) and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_fewer_queries_than_keys_is_bottom_right_causal(backend):
    """KV-cache / ring layout: the queries are the last tokens of each document."""
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 7, 16], dtype=torch.int32)
    q, k, v = _qkv(5, 16)
    out, lse = BACKENDS[backend](q, k, v, cu_q, cu_k, True)
    ref_out, ref_lse = dense_reference(q, k, v, cu_q.tolist(), cu_k.tolist(), True)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_lse_merges_two_key_halves_into_the_full_result():
    """What ring attention relies on: softmax over [k1; k2] = lse-weighted merge of the halves."""
    q, k, v = _qkv(6, 12)
    one = torch.tensor([0, 6], dtype=torch.int32)
    half = torch.tensor([0, 6], dtype=torch.int32)
    o1, l1 = math_attn(q, k[:6], v[:6], one, half, False)
    o2, l2 = math_attn(q, k[6:], v[6:], one, half, False)
    full, lse = math_attn(q, k, v, one, torch.tensor([0, 12], dtype=torch.int32), False)
    merged_lse = torch.logaddexp(l1, l2)
    w1, w2 = torch.exp(l1 - merged_lse).T[..., None], torch.exp(l2 - merged_lse).T[..., None]
    torch.testing.assert_close(merged_lse, lse)
    torch.testing.assert_close(w1 * o1 + w2 * o2, full, atol=1e-6, rtol=1e-5)


def test_sdpa_gradients_equal_math_gradients():
    q, k, v = (t.requires_grad_() for t in _qkv(32, 32))
    grads = []
    for fn in (math_attn, sdpa_attn):
        out, lse = fn(q, k, v, CU, CU, True)
        (out.square().sum() + lse.sum()).backward()
        grads.append([t.grad.clone() for t in (q, k, v)])
        for t in (q, k, v):
            t.grad = None
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_math_kernel_memory_is_per_document_not_dense():
    """A 4096-token row of 64-token documents: the kernel never builds a 4096² score matrix."""
    cu = torch.arange(0, 4097, 64, dtype=torch.int32)
    q, k, v = _qkv(4096, 4096, h=2, hkv=1, d=8)
    seen = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            r = func(*args, **(kwargs or {}))
            if isinstance(r, torch.Tensor):
                seen.append(r.numel())
            return r

    with Spy():
        math_attn(q, k, v, cu, cu, True)
    assert max(seen) <= 2 * 4096 * 8  # largest tensor is O(T·H·D), not O(T²)


def test_backend_selection():
    assert select_backend("auto", "cpu") == "sdpa"
    assert select_backend("math") == "math"
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        select_backend("nope")
    q, k, v = _qkv(32, 32)
    out, _ = attn(q, k, v, CU, CU, True, backend="math")
    torch.testing.assert_close(out, dense_reference(q, k, v, CU.tolist(), CU.tolist(), True)[0], atol=1e-5, rtol=1e-5)
