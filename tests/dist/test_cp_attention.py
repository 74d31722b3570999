"""Context-parallel attention (ring, allgather, ulysses, hybrid) on 2 and 4 gloo ranks against the
single-process causal varlen attention (``math_attn``) over the full padded documents (DESIGN §4).

Every rank builds the same random row (documents of uneven lengths, including length 1 and shorter
than 2·cp), shards it zigzag (tests/cp_factory.py), runs ``cp_attention`` and compares, on the rows
it holds, ``out`` and the gradients of ``sum(out * G)`` (G fixed random) w.r.t. q, k, v with the
reference's. All cases of one CP size share one spawned world (process start-up dominates).
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from omniweave.models.components.attention import math_attn
from omniweave.parallel.context.attention import CPContext, cp_attention, make_hybrid_groups
from omniweave.parallel.spawn import run_ranks
from tests.cp_factory import cu_of, local_cu_seqlens, padded_lengths, zigzag_shard

pytestmark = [pytest.mark.dist]

ATOL = 1e-5  # fp32, max |Δ| of out, dq, dk, dv on every rank (measured <= 2e-6)
DIM = 8

# name -> (mode, H, Hkv, extra CPContext fields, window)
CASES = {
    "ring": ("ring", 4, 2, {}, None),
    "ring-mha": ("ring", 2, 2, {}, None),
    "allgather": ("allgather", 4, 2, {}, None),
    "allgather-head_groups2": ("allgather", 4, 2, {"head_groups": 2}, None),
    "allgather-window5": ("allgather", 4, 2, {"backend": "math"}, 5),
    "allgather-window5-head_groups2-sdpa": ("allgather", 4, 2, {"head_groups": 2, "backend": "sdpa"}, 5),
    "ulysses": ("ulysses", 4, 2, {}, None),  # cp=2: K/V heads split; cp=4: replicated x2
    "ulysses-window7": ("ulysses", 4, 2, {"backend": "math"}, 7),
}
CASES_CP4 = {
    "ulysses-hkv1": ("ulysses", 4, 1, {}, None),  # one K/V head replicated x4
    "hybrid-u2": ("hybrid", 4, 2, {}, None),
    "hybrid-u2-hkv1": ("hybrid", 4, 1, {}, None),
}
WORLDS = {2: dict(CASES), 4: {**CASES, **CASES_CP4}}


def _row(cp: int, heads: int, kv_heads: int, seed: int = 0):
    """Random padded documents (natural order) and their full-row reference."""
    g = torch.Generator().manual_seed(seed)
    doc_lens = [1, 2 * cp - 1] + torch.randint(2, 41, (4,), generator=g).tolist()
    padded = padded_lengths(doc_lens, cp)
    rows = sum(padded)
    q = torch.randn(rows, heads, DIM, generator=g)
    k, v = (torch.randn(rows, kv_heads, DIM, generator=g) for _ in range(2))
    grad_out = torch.randn(rows, heads, DIM, generator=g)
    return padded, q, k, v, grad_out


def _reference(q, k, v, grad_out, padded, window):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    cu = cu_of(padded)
    out, _ = math_attn(q, k, v, cu, cu, True, window)
    (out * grad_out).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _run_cases(rank: int, world: int, cases: dict) -> dict:
    """Max |Δ| of out, dq, dk, dv per case on this rank, and the messages of the rejected setups."""
    inner, ring = make_hybrid_groups(list(range(world)), 2)
    results = {}
    for name, (mode, heads, kv_heads, extra, window) in cases.items():
        padded, q, k, v, grad_out = _row(world, heads, kv_heads)
        want = _reference(q, k, v, grad_out, padded, window)
        ctx = CPContext(dist.group.WORLD, mode, ulysses_group=inner, ring_group=ring, **extra)
        local = [zigzag_shard(t, padded, world, rank) for t in (q, k, v)]
        q_l, k_l, v_l = (t.clone().requires_grad_() for t in local)
        out = cp_attention(q_l, k_l, v_l, local_cu_seqlens(padded, world), ctx, window)
        (out * zigzag_shard(grad_out, padded, world, rank)).sum().backward()
        got = (out.detach(), q_l.grad, k_l.grad, v_l.grad)
        results[name] = {key: (g - zigzag_shard(w, padded, world, rank)).abs().max().item()
                         for key, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
    results["decoder hook"] = _decoder_hook_error(rank, world)
    results["errors"] = _rejections(world, inner, ring)
    return results


def _decoder_hook_error(rank: int, world: int) -> float:
    """A CPContext called like the decoder's attn_fn(q, k, v, cu_seqlens, window) gives cp_attention."""
    padded, q, k, v, _ = _row(world, 4, 2, seed=3)
    local = [zigzag_shard(t, padded, world, rank) for t in (q, k, v)]
    cu = local_cu_seqlens(padded, world)
    ctx = CPContext(dist.group.WORLD, "allgather")
    return (ctx(*local, cu, 3) - cp_attention(*local, cu, ctx, window=3)).abs().max().item()


def _rejections(world: int, inner, ring) -> dict:
    padded, q, k, v, _ = _row(world, 6, 2)
    local = [zigzag_shard(t, padded, world, 0) for t in (q, k, v)]
    cu = local_cu_seqlens(padded, world)
    messages = {}
    for name, mode, window, extra in (("ulysses H=6", "ulysses", None, {}), ("ring window", "ring", 4, {}),
                                      ("hybrid window", "hybrid", 4, {}),
                                      ("allgather head_groups=3", "allgather", None, {"head_groups": 3})):
        ctx = CPContext(dist.group.WORLD, mode, ulysses_group=inner, ring_group=ring, **extra)
        try:
            cp_attention(*local, cu, ctx, window)
            messages[name] = None
        except ValueError as e:
            messages[name] = str(e)
    return messages


@functools.lru_cache(maxsize=None)
def _world(cp: int) -> tuple[dict, ...]:
    return tuple(run_ranks(_run_cases, cp, WORLDS[cp]))


@pytest.mark.parametrize("cp,case", [(cp, name) for cp, cases in WORLDS.items() for name in cases])
def test_cp_attention_equals_single_process_attention(cp, case):
    """out and dq, dk, dv on every rank's rows within 1e-5 of the full-row math_attn (fp32)."""
    errors = {key: max(r[case][key] for r in _world(cp)) for key in ("out", "dq", "dk", "dv")}
    assert max(errors.values()) <= ATOL, errors


@pytest.mark.parametrize("cp", sorted(WORLDS))
def test_cp_context_is_the_decoder_attn_fn(cp):
    assert max(r["decoder hook"] for r in _world(cp)) == 0.0


@pytest.mark.parametrize("cp", sorted(WORLDS))
def test_unsupported_setups_raise_clear_errors(cp):
    """Ulysses with H % cp != 0 names H and cp; ring and hybrid refuse a sliding window; K/V head
    groups must divide the K/V heads."""
    messages = _world(cp)[0]["errors"]
    if cp == 4:
        assert "H=6 is not divisible by cp=4" in messages["ulysses H=6"]
    else:
        assert messages["ulysses H=6"] is None  # 6 heads split fine over 2 ranks
    for name in ("ring window", "hybrid window"):
        assert "sliding window (4)" in messages[name] and "'allgather' or 'ulysses'" in messages[name]
    assert "head_groups=3 must divide the 2 key/value heads" in messages["allgather head_groups=3"]
