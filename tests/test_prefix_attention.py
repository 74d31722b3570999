"""The prefix-LM row layout and action chunks over it (components/prefix_attention.py) against
dense attention with an explicit mask (float64 inputs), for the math and sdpa backends: outputs
within 2e-6 (the math kernel computes in fp32), gradients of q, k, v likewise. Documents mix an all-bidirectional
prefix, a prefix with a causal tail, and a plain causal document; heads are grouped (4 q over 2 kv)."""

from __future__ import annotations

import pytest
import torch

from omniweave.errors import UserError
from omniweave.models.components.flow import prefix_suffix_mask
from omniweave.models.components.prefix_attention import ChunkLayout, PrefixLayout

DOCS = [(5, 3), (4, 0), (0, 6), (7, 2)]  # (prefix, tail) per document
H, HKV, D = 4, 2, 8
TOL = {"math": 2e-6, "sdpa": 2e-6}  # the math kernel computes in fp32 (measured ~6e-7)


def _row(docs, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    L = sum(p + t for p, t in docs)
    q = torch.randn(L, H, D, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(L, HKV, D, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(L, HKV, D, generator=g, dtype=dtype, requires_grad=True)
    cu = torch.tensor([0, *torch.tensor([p + t for p, t in docs]).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu, torch.tensor([p for p, _ in docs])


def dense(q, k, v, mask):
    """softmax(q k^T / sqrt(D) masked) v with the kv heads repeated; rows that see nothing give 0."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / D**0.5
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1).nan_to_num(0.0), v)


def prefix_lm_mask(docs):
    """PaliGemma's prefix-LM: same document and (both in the prefix, or key at or before the query)."""
    doc, in_prefix = [], []
    for d, (p, t) in enumerate(docs):
        doc += [d] * (p + t)
        in_prefix += [True] * p + [False] * t
    doc, in_prefix = torch.tensor(doc), torch.tensor(in_prefix)
    pos = torch.arange(len(doc))
    return (doc[:, None] == doc[None]) & ((in_prefix[:, None] & in_prefix[None]) | (pos[None] <= pos[:, None]))


def _grads(out, *xs):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)  # not randn_like: it follows strides
    return torch.autograd.grad((out * w).sum(), xs)


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("docs", [DOCS, [(5, 0), (3, 0)], [(0, 4), (0, 5)]], ids=["mixed", "all-prefix", "all-causal"])
def test_prefix_layout_equals_dense_prefix_lm_mask(backend, docs):
    """Outputs and q/k/v gradients of PrefixLayout.attend equal dense attention under the
    prefix-LM mask (the two-call path, and the one-call paths when every document is all prefix
    or all causal)."""
    q, k, v, cu, prefix = _row(docs)
    got = PrefixLayout(cu, prefix).attend(0, q, k, v, cu, None, backend)
    ref = dense(q, k, v, prefix_lm_mask(docs))
    assert (got - ref).abs().max().item() <= TOL[backend]
    g_got, g_ref = _grads(got, q, k, v), _grads(ref, q, k, v)
    for a, b in zip(g_got, g_ref):
        assert (a - b).abs().max().item() <= TOL[backend]


@pytest.mark.parametrize("backend", ["math", "sdpa"])
@pytest.mark.parametrize("insulate", [False, True])
def test_chunks_equal_dense_prefix_suffix_mask(backend, insulate):
    """Action chunks (H = 3) of documents 0, 3 and 3 again (two draws for one frame) over the kept
    prefix keys equal dense attention on each sample laid out as [prefix, chunk] under
    flow.prefix_suffix_mask: the chunk sees its document's prefix (not its causal tail) and itself.
    With ``insulate`` the values are unchanged and no gradient reaches the prefix keys / values."""
    docs, horizon, chunk_docs = DOCS, 3, [0, 3, 3]
    q, k, v, cu, prefix = _row(docs)
    layout = PrefixLayout(cu, prefix, keep_kv=True)
    layout.attend(0, q, k, v, cu, None, backend)
    g = torch.Generator().manual_seed(7)
    n = len(chunk_docs)
    cq = torch.randn(n * horizon, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    ck = torch.randn(n * horizon, HKV, D, generator=g, dtype=torch.float64, requires_grad=True)
    cv = torch.randn(n * horizon, HKV, D, generator=g, dtype=torch.float64, requires_grad=True)
    chunks = ChunkLayout(layout, torch.tensor(chunk_docs), horizon, insulate)
    got = chunks.attend(0, cq, ck, cv, chunks.cu_q, None, backend)
    refs = []
    for i, d in enumerate(chunk_docs):
        start, p = int(cu[d]), docs[d][0]
        rows = slice(i * horizon, (i + 1) * horizon)
        seq = [torch.cat([x[start:start + p], c[rows]]) for x, c in ((q, cq), (k, ck), (v, cv))]
        mask = prefix_suffix_mask([p], [horizon])
        refs.append(dense(*seq, mask)[p:])
    ref = torch.cat(refs)
    assert (got - ref).abs().max().item() <= TOL[backend]
    grads = torch.autograd.grad(got.sum(), (k, v, ck), allow_unused=True)
    ref_grads = torch.autograd.grad(ref.sum(), (k, v, ck))
    if insulate:
        assert grads[0] is None and grads[1] is None
    else:
        assert (grads[0] - ref_grads[0]).abs().max().item() <= TOL[backend]
        assert (grads[1] - ref_grads[1]).abs().max().item() <= TOL[backend]
        assert ref_grads[0].abs().max() > 0
    assert (grads[2] - ref_grads[2]).abs().max().item() <= TOL[backend]


def test_chunk_positions_continue_after_each_prefix():
    """Chunk positions start one past the largest prefix position of their document, on every
    M-RoPE axis, ignoring the document's causal tail."""
    docs = [(3, 2), (4, 0)]
    cu = torch.tensor([0, 5, 9], dtype=torch.int32)
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3], [0, 5, 1, 3, 4, 0, 7, 2, 3], [0, 1, 2, 3, 4, 0, 1, 2, 3]])
    layout = PrefixLayout(cu, torch.tensor([p for p, _ in docs]), keep_kv=True)
    got = layout.chunk_positions(pos, torch.tensor([1, 0]), 2)
    assert got.tolist() == [[8, 9, 6, 7]] * 3
    assert layout.chunk_positions(pos[:1], torch.tensor([0]), 3).tolist() == [[3, 4, 5]]


def test_bad_layouts_are_refused():
    """Prefix lengths that do not fit the documents (at the first layer: under context parallelism
    only the hook knows the whole row), chunks of a document without a prefix or before the
    backbone ran, a layout without kept keys, an attention hook that is not context parallelism's
    (chunked rows) and linear-attention layers: clear errors."""
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    q = torch.zeros(9, 2, 4)
    with pytest.raises(ValueError, match="within the documents"):
        PrefixLayout(cu, torch.tensor([5, 1])).attend(0, q, q, q, cu, None, "math")
    with pytest.raises(ValueError, match="2 documents"):
        PrefixLayout(cu, torch.tensor([1]))
    layout = PrefixLayout(cu, torch.tensor([4, 0]), keep_kv=True)
    with pytest.raises(ValueError, match="has not run yet"):
        ChunkLayout(layout, torch.tensor([0]), 2)
    layout.attend(0, q, q, q, cu, None, "math")
    with pytest.raises(ValueError, match="without a prefix"):
        ChunkLayout(layout, torch.tensor([1]), 2)
    with pytest.raises(ValueError, match="keep_kv"):
        ChunkLayout(PrefixLayout(cu, torch.tensor([4, 0])), torch.tensor([0]), 2)
    with pytest.raises(UserError, match="chunked rows"):
        PrefixLayout(cu, torch.tensor([4, 0])).attend(0, q, q, q, cu, None, "math", attn_fn=lambda *a: None)
    with pytest.raises(UserError, match="linear-attention"):
        layout.mix_linear(0, None, q, cu)
