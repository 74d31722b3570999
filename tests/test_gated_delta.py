"""The gated delta rule kernels on packed rows (models/components/gated_delta.py): the chunkwise
form against the step-by-step recurrence in fp64 (documents of 1, C−1, C, C+1 and 2C+3 tokens in
one row, GVA heads, odd head sizes), gradients too; a packed row equals each document alone; a
document split in two with the state carried equals it whole; transformers 5.24's own chunked
kernel on one document; the short convolution reset per document and carried across pieces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from omniweave.models.components.gated_delta import (
    causal_conv1d_varlen,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
)

C = 8  # the chunk size of these tests
LENGTHS = [1, C - 1, C, C + 1, 2 * C + 3]


def _inputs(lengths, hk=2, hv=6, dk=5, dv=7, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    L = sum(lengths)
    q = torch.randn(L, hk, dk, generator=g, dtype=dtype)
    k = torch.randn(L, hk, dk, generator=g, dtype=dtype)
    v = torch.randn(L, hv, dv, generator=g, dtype=dtype)
    gate = F.logsigmoid(torch.randn(L, hv, generator=g, dtype=dtype) + 2)  # log-decay <= 0
    beta = torch.sigmoid(torch.randn(L, hv, generator=g, dtype=dtype))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, gate, beta, cu


def test_chunked_equals_the_recurrence_in_fp64():
    q, k, v, g, b, cu = _inputs(LENGTHS)
    h0 = torch.randn(len(LENGTHS), 6, 5, 7, dtype=torch.float64)
    want, want_s = gated_delta_rule_recurrent(q, k, v, g, b, cu, initial_state=h0, qk_l2norm=True)
    got, got_s = gated_delta_rule_chunked(q, k, v, g, b, cu, chunk_size=C, initial_state=h0, qk_l2norm=True)
    assert (got - want).abs().max() < 1e-10 and (got_s - want_s).abs().max() < 1e-10
    assert want.abs().max() > 0.1


def test_chunked_gradients_equal_the_recurrences():
    inputs = _inputs(LENGTHS, seed=1)
    h0 = torch.randn(len(LENGTHS), 6, 5, 7, dtype=torch.float64)
    grads = []
    for fn, kw in ((gated_delta_rule_recurrent, {}), (gated_delta_rule_chunked, {"chunk_size": C})):
        leaves = [x.clone().requires_grad_() for x in (*inputs[:5], h0)]
        o, s = fn(*leaves[:5], inputs[5], initial_state=leaves[5], qk_l2norm=True, **kw)
        w = torch.randn_like(o, generator=torch.Generator().manual_seed(2))
        ((o * w).sum() + s.square().sum()).backward()
        grads.append([x.grad for x in leaves])
    for name, a, b in zip(("q", "k", "v", "g", "beta", "h0"), *grads):
        assert (a - b).abs().max() < 1e-9 * max(1.0, float(b.abs().max())), name


def test_a_packed_row_equals_each_document_alone():
    q, k, v, g, b, cu = _inputs(LENGTHS, dtype=torch.float32, seed=3)
    row, states = gated_delta_rule_chunked(q, k, v, g, b, cu, chunk_size=C)
    for d, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone, state = gated_delta_rule_chunked(q[s:e], k[s:e], v[s:e], g[s:e], b[s:e],
                                                torch.tensor([0, e - s]), chunk_size=C)
        assert torch.equal(row[s:e], alone) and torch.equal(states[d], state[0])


def test_a_document_split_with_its_state_carried_equals_it_whole():
    q, k, v, g, b, cu = _inputs([3 * C + 5], dtype=torch.float64, seed=4)
    whole, last = gated_delta_rule_chunked(q, k, v, g, b, cu, chunk_size=C)
    t = C + 3  # mid-chunk
    first, s1 = gated_delta_rule_chunked(q[:t], k[:t], v[:t], g[:t], b[:t], torch.tensor([0, t]), chunk_size=C)
    rest, s2 = gated_delta_rule_chunked(q[t:], k[t:], v[t:], g[t:], b[t:], torch.tensor([0, len(q) - t]),
                                        chunk_size=C, initial_state=s1)
    assert (torch.cat([first, rest]) - whole).abs().max() < 1e-12 and (s2 - last).abs().max() < 1e-12


def test_chunked_equals_transformers_on_one_document():
    """transformers 5.24's torch_chunk_gated_delta_rule (Qwen3.5's fallback kernel, chunk 64) on
    one document of 150 tokens, fp32: within 2e-6."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    q, k, v, g, b, cu = _inputs([150], dtype=torch.float32, seed=5)
    h0 = torch.randn(1, 6, 5, 7)
    want, want_s = torch_chunk_gated_delta_rule(q[None], k[None], v[None], g[None], b[None], chunk_size=64,
                                                initial_state=h0, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)
    got, got_s = gated_delta_rule_chunked(q, k, v, g, b, cu, chunk_size=64, initial_state=h0, qk_l2norm=True)
    assert (got - want[0]).abs().max() < 2e-6 and (got_s - want_s).abs().max() < 2e-6


@pytest.mark.parametrize("K", [4, 3])
def test_the_short_convolution_resets_per_document_and_carries_across_pieces(K):
    g = torch.Generator().manual_seed(6)
    lengths = [1, 2, K, 9]
    x = torch.randn(sum(lengths), 5, generator=g, dtype=torch.float64)
    w = torch.randn(5, K, generator=g, dtype=torch.float64)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    got, tails = causal_conv1d_varlen(x, w, cu)
    for d, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        want = F.silu(F.conv1d(x[s:e].T[None], w[:, None, :], padding=K - 1, groups=5)[0, :, : e - s].T)
        assert (got[s:e] - want).abs().max() < 1e-12
        assert torch.equal(tails[d], torch.cat([torch.zeros(K - 1, 5, dtype=x.dtype), x[s:e]])[-(K - 1):])
    doc = x[-9:]  # the last document in two pieces, the window carried
    whole, _ = causal_conv1d_varlen(doc, w, torch.tensor([0, 9]))
    a, tail = causal_conv1d_varlen(doc[:2], w, torch.tensor([0, 2]))
    b, _ = causal_conv1d_varlen(doc[2:], w, torch.tensor([0, 7]), initial_window=tail)
    assert (torch.cat([a, b]) - whole).abs().max() < 1e-12


def test_bad_shapes_are_refused_in_one_line():
    q, k, v, g, b, cu = _inputs([4, 5])
    with pytest.raises(ValueError, match=r"value heads 6 must be a multiple of key heads 4"):
        gated_delta_rule_chunked(torch.randn(9, 4, 5, dtype=torch.float64), torch.randn(9, 4, 5, dtype=torch.float64),
                                 v, g, b, cu)
    with pytest.raises(ValueError, match=r"cu_seqlens must run from 0 to the row length 9"):
        gated_delta_rule_chunked(q, k, v, g, b, torch.tensor([0, 4, 8]))
