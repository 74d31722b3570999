"""Pure pieces of context-parallel attention, without processes: the fp32 block kernels against
autograd through ``math_attn``, the log-sum-exp merge, and the zigzag plans (which (query, key)
pairs each ring step computes, and how the rows are reordered)."""

import itertools

import pytest
import torch

from omniweave.models.components.attention import BACKENDS, math_attn, math_block_backward, math_block_forward, resolve
from omniweave.parallel.context.attention import CPContext
from omniweave.parallel.context.kernels import merge_partials
from omniweave.parallel.context.ulysses import kv_replication
from omniweave.parallel.context.zigzag import chunk_lengths, chunk_rows, plan_block, zigzag_chunks
from tests.cp_factory import cu_of, local_cu_seqlens, padded_lengths, zigzag_shard

ATOL = 1e-5  # fp32, max |Δ| (measured ~1e-6 or below)


def _qkv(tq, tk, h=4, hkv=2, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tq, h, d, generator=g), torch.randn(tk, hkv, d, generator=g),
            torch.randn(tk, hkv, d, generator=g))


CU_Q, CU_K = cu_of([3, 5, 1]), cu_of([7, 5, 4])  # fewer queries than keys: bottom-right causal
SCALE = 8 ** -0.5


@pytest.mark.parametrize("causal", [True, False])
def test_math_block_forward_equals_math_attn(causal):
    q, k, v = _qkv(9, 16)
    out, lse = math_block_forward(q, k, v, CU_Q, CU_K, 5, 7, causal, SCALE)
    ref_out, ref_lse = math_attn(q, k, v, CU_Q, CU_K, causal)
    assert out.dtype == lse.dtype == torch.float32 and lse.shape == (4, 9)
    assert (out - ref_out).abs().max() <= 1e-6 and (lse - ref_lse).abs().max() <= 1e-6


@pytest.mark.parametrize("causal", [True, False])
def test_math_block_backward_equals_autograd_through_math_attn(causal):
    """dq, dk, dv recomputed from (out, lse) — GQA dk/dv summed over each group's query heads."""
    q, k, v = (t.requires_grad_() for t in _qkv(9, 16))
    out, lse = math_attn(q, k, v, CU_Q, CU_K, causal)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    (out * grad_out).sum().backward()
    dq, dk, dv = math_block_backward(grad_out, q.detach(), k.detach(), v.detach(), out.detach(), lse.detach(),
                                     CU_Q, CU_K, 5, 7, causal, SCALE)
    for got, want in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        assert got.shape == want.shape and (got - want).abs().max() <= ATOL


def _key_halves(lens):
    """Each document's keys split in a first and second half: (rows A, cu A, rows B, cu B)."""
    first = [n // 2 for n in lens]
    second = [n - f for n, f in zip(lens, first)]
    starts = cu_of(lens)[:-1].tolist()
    rows_a = torch.cat([torch.arange(s, s + f) for s, f in zip(starts, first)])
    rows_b = torch.cat([torch.arange(s + f, s + n) for s, f, n in zip(starts, first, lens)])
    return rows_a, cu_of(first), rows_b, cu_of(second)


def test_merge_of_two_key_halves_equals_attention_over_all_keys():
    q, k, v = _qkv(9, 16)
    rows_a, cu_a, rows_b, cu_b = _key_halves([7, 5, 4])
    out_a, lse_a = math_block_forward(q, k[rows_a], v[rows_a], CU_Q, cu_a, 5, 4, False, SCALE)
    out_b, lse_b = math_block_forward(q, k[rows_b], v[rows_b], CU_Q, cu_b, 5, 4, False, SCALE)
    out, lse = merge_partials(out_a, lse_a, out_b, lse_b)
    ref_out, ref_lse = math_attn(q, k, v, CU_Q, CU_K, False)
    assert (out - ref_out).abs().max() <= 1e-6 and (lse - ref_lse).abs().max() <= 1e-6
    # a block with no visible key (lse = -inf) leaves the result as it is; two such give 0, not NaN
    none = torch.full_like(lse, float("-inf"))
    same_out, same_lse = merge_partials(out, lse, torch.zeros_like(out), none)
    assert torch.equal(same_out, out) and torch.equal(same_lse, lse)
    empty_out, empty_lse = merge_partials(torch.zeros_like(out), none, torch.zeros_like(out), none)
    assert torch.equal(empty_out, torch.zeros_like(out)) and torch.isneginf(empty_lse).all()


def test_block_backwards_from_the_global_lse_add_up_to_the_full_gradient():
    """The ring backward's premise: per-block gradients from the global (out, lse) are exact."""
    q, k, v = (t.requires_grad_() for t in _qkv(9, 16))
    out, lse = math_attn(q, k, v, CU_Q, CU_K, False)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * grad_out).sum().backward()
    rows_a, cu_a, rows_b, cu_b = _key_halves([7, 5, 4])
    args = (grad_out, q.detach())
    dq_a, dk_a, dv_a = math_block_backward(*args, k.detach()[rows_a], v.detach()[rows_a], out.detach(), lse.detach(),
                                           CU_Q, cu_a, 5, 4, False, SCALE)
    dq_b, dk_b, dv_b = math_block_backward(*args, k.detach()[rows_b], v.detach()[rows_b], out.detach(), lse.detach(),
                                           CU_Q, cu_b, 5, 4, False, SCALE)
    assert (dq_a + dq_b - q.grad).abs().max() <= ATOL
    assert (dk_a - k.grad[rows_a]).abs().max() <= ATOL and (dk_b - k.grad[rows_b]).abs().max() <= ATOL
    assert (dv_a - v.grad[rows_a]).abs().max() <= ATOL and (dv_b - v.grad[rows_b]).abs().max() <= ATOL


# ---------------------------------------------------------------------------- zigzag plans


def _pairs(calls, rows_q, rows_k):
    """How many times each (local query row, block key row) pair is computed by the calls."""
    count = torch.zeros(rows_q, rows_k, dtype=torch.int64)
    for call in calls:
        q_rows = torch.arange(rows_q) if call.q_rows is None else call.q_rows
        k_rows = torch.arange(rows_k) if call.k_rows is None else call.k_rows
        cq, ck = call.cu_q.tolist(), call.cu_k.tolist()
        for q0, q1, k0, k1 in zip(cq[:-1], cq[1:], ck[:-1], ck[1:]):
            lq, lk = q1 - q0, k1 - k0
            seen = torch.ones(lq, lk, dtype=torch.bool)
            if call.causal:
                seen = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
            for i, j in seen.nonzero().tolist():
                count[q_rows[q0 + i], k_rows[k0 + j]] += 1
    return count


def _positions(chunk_lens, chunks):
    """(document, padded position) of every row of a block holding ``chunks`` of each document."""
    return [(d, j * c + o) for d, c in enumerate(chunk_lens) for j in chunks for o in range(c)]


def _visible(chunk_lens, q_chunks, kv_chunks):
    pos_q, pos_k = _positions(chunk_lens, q_chunks), _positions(chunk_lens, kv_chunks)
    return torch.tensor([[dq == dk and pk <= pq for dk, pk in pos_k] for dq, pq in pos_q], dtype=torch.int64)


CHUNK_LENS = [1, 3, 0, 2]  # includes an empty document and a one-row chunk


def _hybrid_chunks(cp, u):
    return [tuple(sorted(c for r in range(g * u, (g + 1) * u) for c in zigzag_chunks(cp, r))) for g in range(cp // u)]


BLOCK_CASES = (
    [(zigzag_chunks(cp, r), zigzag_chunks(cp, s)) for cp in (1, 2, 3, 4) for r in range(cp) for s in range(cp)]
    + [(a, b) for cp, u in ((4, 2), (6, 3), (6, 2)) for a, b in itertools.product(_hybrid_chunks(cp, u), repeat=2)]
    + [((0, 3, 5), (1, 2, 5)), ((4, 1), (0, 4, 2))]  # chunk sets in no particular order
)


@pytest.mark.parametrize("q_chunks,kv_chunks", BLOCK_CASES)
def test_plan_block_computes_each_visible_pair_exactly_once(q_chunks, kv_chunks):
    calls = plan_block(CHUNK_LENS, q_chunks, kv_chunks)
    n = sum(CHUNK_LENS)
    count = _pairs(calls, len(q_chunks) * n, len(kv_chunks) * n)
    assert torch.equal(count, _visible(CHUNK_LENS, q_chunks, kv_chunks))
    assert len(calls) <= 2 and len({c.causal for c in calls}) == len(calls)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_zigzag_ring_steps_are_one_call_each_and_balanced(cp):
    """Step 0 (own K/V): one causal call over the rows as they lie; every other step: one full call
    of 2·c_d² pairs per document on every rank."""
    lens = [3, 1, 5]
    for r in range(cp):
        (own,) = plan_block(lens, zigzag_chunks(cp, r), zigzag_chunks(cp, r))
        assert own.causal and own.q_rows is None and own.k_rows is None
        for s in set(range(cp)) - {r}:
            (call,) = plan_block(lens, zigzag_chunks(cp, r), zigzag_chunks(cp, s))
            assert not call.causal
            assert int(_pairs([call], 2 * 9, 2 * 9).sum()) == sum(2 * c * c for c in lens)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_chunk_rows_puts_gathered_zigzag_rows_back_in_document_order(cp):
    padded = padded_lengths([1, 7, 2 * cp + 1, 40], cp)
    positions = torch.arange(sum(padded))
    gathered = torch.cat([zigzag_shard(positions, padded, cp, r) for r in range(cp)])
    rows = gathered.shape[0] // cp
    chunk_lens = chunk_lengths(local_cu_seqlens(padded, cp), 2, rows)
    natural = chunk_rows(chunk_lens, rows, list(range(cp)), cp, [list(range(2 * cp))] * len(padded))
    assert torch.equal(gathered[natural], positions)


@pytest.mark.parametrize("heads,kv_heads,n,factor", [(4, 2, 2, 1), (4, 2, 4, 2), (4, 1, 4, 4), (8, 4, 4, 1),
                                                     (12, 2, 4, 2), (6, 3, 2, 2), (8, 1, 2, 2)])
def test_kv_replication_is_the_smallest_factor_that_splits_kv_heads_evenly(heads, kv_heads, n, factor):
    assert kv_replication(heads, kv_heads, n) == factor


def test_bad_inputs_raise_with_the_numbers():
    with pytest.raises(ValueError, match="H=6 is not divisible by cp=4"):
        kv_replication(6, 2, 4)
    with pytest.raises(ValueError, match=r"\[3\] are not multiples of 2"):
        chunk_lengths(cu_of([4, 3]), 2, 7)
    with pytest.raises(ValueError, match="from 0 to the 9 local rows"):
        chunk_lengths(cu_of([4, 4]), 2, 9)


def test_ring_block_kernel_choice():
    """Off CUDA, auto resolves to sdpa, which has no backward from a given lse: ring blocks run
    math, and the log says so once."""
    q = torch.zeros(4, 2, 8, dtype=torch.bfloat16)
    assert resolve("auto", q, q, block=True).block is BACKENDS["math"].block
    assert resolve("sdpa", q, q, block=True).block is BACKENDS["math"].block
    assert resolve("math", q, q, block=True).block is BACKENDS["math"].block
    assert resolve("sdpa", q, q).name == "sdpa"  # the plain call keeps sdpa


def test_cp_context_rejects_bad_settings():
    with pytest.raises(ValueError, match="unknown context-parallel attention mode 'zigzag'"):
        CPContext(group=None, mode="zigzag")
    with pytest.raises(ValueError, match="needs ulysses_group and ring_group"):
        CPContext(group=None, mode="hybrid")
    with pytest.raises(ValueError, match="head_groups must be >= 1, got 0"):
        CPContext(group=None, mode="allgather", head_groups=0)


def test_cp_context_builds_index_plans_once_per_micro_batch():
    """Every decoder layer gets the same cu_seqlens tensor: its plans are built once, and again
    only for the next micro-batch's (another tensor, even with equal values)."""
    from omniweave.parallel.context.attention import CPContext

    ctx, builds = CPContext(group=None, mode="ring"), []
    first, second = torch.tensor([0, 8, 12]), torch.tensor([0, 8, 12])
    got = [ctx.memo(first, "ring", lambda: builds.append("first") or len(builds)) for _ in range(4)]
    got.append(ctx.memo(second, "ring", lambda: builds.append("second") or len(builds)))
    assert builds == ["first", "second"] and got == [1, 1, 1, 1, 2]
