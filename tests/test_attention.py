"""Varlen attention kernels against a dense masked reference (block-diagonal L×L, tests only)."""

import dataclasses
import math

import pytest
import torch

from omniweave.models.components import attention, attention_cuda
from omniweave.models.components.attention import (
    BACKENDS, UnavailableBackend, attn, check_backend, default_backend, math_attn, resolve, sdpa_attn,
)


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
    out, lse = BACKENDS[backend].attn(q, k, v, CU, CU, causal, window)
    ref_out, ref_lse = dense_reference(q, k, v, CU.tolist(), CU.tolist(), causal, window)
    assert out.shape == q.shape and lse.shape == (heads[0], 32) and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_fewer_queries_than_keys_is_bottom_right_causal(backend):
    """KV-cache / ring layout: the queries are the last tokens of each document."""
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 7, 16], dtype=torch.int32)
    q, k, v = _qkv(5, 16)
    out, lse = BACKENDS[backend].attn(q, k, v, cu_q, cu_k, True)
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


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_sdpa_bottom_right_causal_gradients_equal_math_gradients(dtype, tol):
    """A chunk of each document over its earlier chunks' keys (the chunked-row layout): the mask-free
    two-block kernel's output and q/k/v gradients are the reference's; GQA and one-token docs too."""
    cu_q, cu_k = torch.tensor([0, 5, 42, 43, 107], dtype=torch.int32), torch.tensor([0, 9, 109, 110, 174], dtype=torch.int32)
    q, k, v = (t.to(dtype).requires_grad_() for t in _qkv(107, 174, h=6, hkv=2, d=16))
    g = torch.randn(107, 6, 16, generator=torch.Generator().manual_seed(1))
    results = []
    for fn in (math_attn, sdpa_attn):
        out, _ = fn(q, k, v, cu_q, cu_k, True)
        results.append([out.float(), *torch.autograd.grad((out.float() * g).sum(), (q, k, v))])
    for a, b in zip(*results):
        torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)


def test_sdpa_bottom_right_causal_keeps_no_query_by_key_tensor():
    """What autograd keeps for a 512-query chunk over 4096 keys is O((lq + lk)·H·D), not a
    ``[lq, lk]`` mask: chunked rows' peak memory must not grow with the document."""
    q, k, v = (t.requires_grad_() for t in _qkv(512, 4096, h=2, hkv=2, d=8))
    cu_q, cu_k = torch.tensor([0, 512], dtype=torch.int32), torch.tensor([0, 4096], dtype=torch.int32)
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.numel()) or t, lambda t: t):
        sdpa_attn(q, k, v, cu_q, cu_k, True, need_lse=False)
    assert kept and max(kept) <= 4096 * 2 * 8


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


def test_auto_is_sdpa_off_cuda_and_explicit_names_are_kept():
    assert default_backend("cpu") == "sdpa"
    assert check_backend("math") == "math"
    q, k, v = _qkv(32, 32)
    assert resolve("auto", q, k).name == "sdpa"
    out, _ = attn(q, k, v, CU, CU, True, backend="math")
    torch.testing.assert_close(out, dense_reference(q, k, v, CU.tolist(), CU.tolist(), True)[0], atol=1e-5, rtol=1e-5)


def test_unknown_backend_name_lists_every_backend_and_what_is_here():
    with pytest.raises(UnavailableBackend, match=r"unknown attention backend 'nope'; choose from auto, varlen, flash, "
                       r"sdpa, math \(available here: auto.*sdpa, math\)"):
        check_backend("nope")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_backend_this_machine_lacks_is_an_error_listing_what_it_has():
    """The recipe names varlen on a CPU-only machine: one line saying why, and what to pick instead."""
    with pytest.raises(UnavailableBackend, match=r"model.foundation.attn_backend: attention backend 'varlen' is not "
                       r"available on this machine: needs a CUDA device; available here: auto, .*sdpa, math"):
        check_backend("varlen", "model.foundation.attn_backend")


def test_a_call_the_backend_cannot_serve_falls_back_with_one_line_saying_why(monkeypatch, caplog):
    varlen = attention.BACKENDS["varlen"]
    monkeypatch.setitem(attention.BACKENDS, "varlen", dataclasses.replace(varlen, missing=lambda: None))
    attention._warn_once.cache_clear()
    q, k, v = _qkv(32, 32)
    with caplog.at_level("WARNING", logger="omniweave.attention"):
        for _ in range(3):  # one line, not one per call
            assert resolve("varlen", q, k).name == "sdpa"
            out, _ = attn(q, k, v, CU, CU, True, backend="varlen")
    attention._warn_once.cache_clear()
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["attention: varlen cannot serve this call (tensors on cpu, not cuda); using sdpa"]
    torch.testing.assert_close(out, math_attn(q, k, v, CU, CU, True)[0], atol=1e-5, rtol=1e-5)


def test_flash_attention_refusals_name_the_reason():
    q = torch.zeros(4, 2, 8)
    assert attention_cuda.fa2_refuses(q, q) == "tensors on cpu, not cuda"
    meta = torch.zeros(4, 2, 8, device="meta")
    assert attention_cuda.fa2_refuses(meta, meta) == "tensors on meta, not cuda"


@pytest.mark.parametrize("causal,window,expected", [
    (True, None, (-1, 0)), (False, None, (-1, -1)), (True, 4, (3, 0)), (False, 4, (3, 3)),
])  # fmt: skip
def test_flash_window_convention(causal, window, expected):
    assert attention_cuda.fa_window(causal, window) == expected


def _flash_semantics(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
                     enable_gqa=False, seqused_k=None, **_):
    """torch.nn.attention.varlen.varlen_attn as documented (FlashAttention-2 semantics: bottom-right
    aligned window (left, right), lse [H, Tq] with +inf for a query that sees no key), in float64."""
    assert cu_q.dtype == cu_k.dtype == torch.int32 and (enable_gqa or q.shape[1] == k.shape[1])
    h, hkv = q.shape[1], k.shape[1]
    kk, vv = k.double().repeat_interleave(h // hkv, 1), v.double().repeat_interleave(h // hkv, 1)
    out, lse = torch.zeros(q.shape, dtype=torch.float64), torch.full((h, q.shape[0]), float("inf"))
    left, right = window_size
    for d, ((q0, q1), (k0, k1)) in enumerate(zip(zip(cu_q[:-1].tolist(), cu_q[1:].tolist()),
                                                 zip(cu_k[:-1].tolist(), cu_k[1:].tolist()))):
        lk = k1 - k0 if seqused_k is None else int(seqused_k[d])
        assert q1 - q0 <= max_q and lk <= max_k
        i = torch.arange(q1 - q0)[:, None] + lk - (q1 - q0)
        j = torch.arange(lk)[None, :]
        ok = torch.ones(q1 - q0, lk, dtype=torch.bool)
        ok &= (j >= i - left) if left >= 0 else ok
        ok &= (j <= i + right) if right >= 0 else ok
        s = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), kk[k0:k0 + lk]) * (scale or q.shape[-1] ** -0.5)
        s = s.masked_fill(~ok, float("-inf"))
        m = torch.logsumexp(s, -1)
        p = torch.nan_to_num(torch.exp(s - m[..., None]))
        out[q0:q1] = torch.einsum("hqk,khd->qhd", p, vv[k0:k0 + lk])
        lse[:, q0:q1] = torch.where(torch.isinf(m), float("inf"), m).float()
    out = out.to(q.dtype)
    return (out, lse) if return_aux is not None and return_aux.lse else out


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
def test_varlen_backend_translates_the_interface_to_flash_attention(monkeypatch, causal, window, heads):
    """Our side of the varlen backend (window pair, causal, GQA flag, int32 boundaries, max lengths,
    +inf -> -inf lse) against FlashAttention's documented semantics; the kernel itself is checked
    on a GPU by `omniweave check --device cuda`."""
    import torch.nn.attention.varlen as tv

    monkeypatch.setattr(tv, "varlen_attn", _flash_semantics)
    cu_q, cu_k = torch.tensor([0, 1, 3, 9], dtype=torch.int64), torch.tensor([0, 4, 6, 15], dtype=torch.int64)
    q, k, v = _qkv(9, 15, *heads)
    out, lse = attention_cuda.varlen_attn(q, k, v, cu_q, cu_k, causal, window)
    ref_out, ref_lse = math_attn(q, k, v, cu_q, cu_k, causal, window)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_flash_lse_of_a_query_that_sees_nothing_becomes_minus_inf(monkeypatch):
    import torch.nn.attention.varlen as tv

    monkeypatch.setattr(tv, "varlen_attn", _flash_semantics)
    cu_q, cu_k = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    q, k, v = _qkv(3, 1)
    _, lse = attention_cuda.varlen_attn(q, k, v, cu_q, cu_k, True, None)
    # bottom-right causal: query 2 sees key 0, queries 0 and 1 see nothing
    assert torch.isneginf(lse[:, :2]).all() and torch.isfinite(lse[:, 2]).all()


@pytest.mark.parametrize("kernel", ["math", "varlen"])
def test_decode_reads_each_sequences_slot_up_to_its_length(monkeypatch, kernel):
    """KV-cache decoding: query b over the first lengths[b] keys of slot slots[b] (slots not
    contiguous) equals a varlen call on those keys copied out; varlen reads them in place
    (seqused_k) under FlashAttention's documented semantics."""
    import torch.nn.attention.varlen as tv

    monkeypatch.setattr(tv, "varlen_attn", _flash_semantics)
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(5, 7, 2, 8, generator=g), torch.randn(5, 7, 2, 8, generator=g)
    slots, lengths = torch.tensor([0, 2, 3]), torch.tensor([4, 1, 7])
    q = torch.randn(3, 6, 8, generator=g)
    fn = attention.math_decode if kernel == "math" else attention_cuda.varlen_decode
    out, lse = fn(q, k_cache, v_cache, slots, lengths)
    k = torch.cat([k_cache[s, :n] for s, n in zip(slots.tolist(), lengths.tolist())])
    v = torch.cat([v_cache[s, :n] for s, n in zip(slots.tolist(), lengths.tolist())])
    cu_k = torch.tensor([0, *lengths.cumsum(0).tolist()], dtype=torch.int32)
    ref_out, ref_lse = math_attn(q, k, v, torch.arange(4, dtype=torch.int32), cu_k, False)
    torch.testing.assert_close(out.float(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_under_autocast_attention_gets_one_half_precision_dtype(monkeypatch):
    """Qwen3's qk-norm (fp32 weights) promotes q, k to fp32 under autocast while v is bf16; the
    kernel must see one dtype (FlashAttention refuses mixed ones), as autocast does for SDPA."""
    seen = []

    def spy(q, k, v, *a, **kw):
        seen.append((q.dtype, k.dtype, v.dtype))
        return math_attn(q, k, v, *a, **kw)

    monkeypatch.setitem(attention.BACKENDS, "math", attention.Backend("math", spy, lambda: None, lambda *_: None, None))
    q, k, v = _qkv(32, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attn(q, k, v.bfloat16(), CU, CU, True, backend="math")
    attn(q, k, v, CU, CU, True, backend="math")
    assert seen == [(torch.bfloat16,) * 3, (torch.float32,) * 3]


def test_longest_segment_is_remembered_per_tensor_and_never_stale():
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    assert attention_cuda.max_len(cu) == 7
    cu[2] = 4  # in place: a new version
    assert attention_cuda.max_len(cu) == 3
    other = torch.tensor([0, 5], dtype=torch.int32)
    assert attention_cuda.max_len(other) == 5 and attention_cuda.max_len(torch.tensor([0], dtype=torch.int32)) == 0
