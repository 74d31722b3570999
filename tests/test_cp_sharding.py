"""Context-parallel zigzag sharding of a packed row (omniweave.parallel.context.sharding): every
row held exactly once, the inverse restores the row, pads only at document ends and unlabelled,
the documented local layout, equal causal work per rank, media features land on the same rows,
cp = 1 is the identity, clear errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omniweave.models.omni import OmniModel
from omniweave.parallel.context.sharding import plan_cp_shard, shard_batch, shard_rows, unshard_rows

DOC_LENS = [
    [37],  # one document
    [1],  # shorter than 2·cp for every cp > 0
    [5, 1, 3, 16, 2],  # several shorter than 2·cp, one multiple of 8
    [24, 7, 13],
]
CPS = [1, 2, 3, 4]


def _cu(doc_lens):
    return torch.tensor([0, *doc_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _row(doc_lens, seed=0):
    """A packed row: ids, shifted labels (-100 at document ends), [3, L] M-RoPE-like positions
    (per document, axes differing), two media spans."""
    g = torch.Generator().manual_seed(seed)
    L = sum(doc_lens)
    ids = torch.randint(10, 1000, (L,), generator=g)
    labels = ids.roll(-1).clone()
    labels[_cu(doc_lens)[1:].long() - 1] = -100
    pos = torch.cat([torch.arange(n) for n in doc_lens])
    position_ids = torch.stack([pos, pos + 3 * (pos // 4), pos * 2])  # [3, L], distinct axes
    spans = torch.tensor([[1, min(3, L - 1)], [L // 2, L - L // 2]])[: 1 + (L > 4)]
    return {"input_ids": ids, "labels": labels, "position_ids": position_ids, "cu_seqlens": _cu(doc_lens),
            "pixel_values": torch.randn(8, 12, generator=g), "grid_thw": torch.tensor([[1, 2, 4]] * spans.shape[0]),
            "media_spans": spans, "num_loss_tokens": int((labels != -100).sum())}  # fmt: skip


def _padded_docs(plan):
    """Rebuild each padded document in chunk order 0 … 2cp-1 from the ranks' local layouts
    ([chunk r | chunk 2cp-1-r] per document): list of int64 [2cp·c_d] original rows, -1 = pad."""
    cp, index = plan.cp, [plan.local_index(r) for r in range(plan.cp)]
    docs, base = [], 0
    for c, local_n in zip(plan.chunk_lens, plan.local_doc_lens):
        chunks = [None] * (2 * cp)
        for r in range(cp):
            chunks[r] = index[r][base:base + c]
            chunks[2 * cp - 1 - r] = index[r][base + c:base + local_n]
        docs.append(torch.cat(chunks))
        base += local_n
    return docs


def _check_plan(doc_lens, cp):
    plan = plan_cp_shard(_cu(doc_lens), cp)
    held = torch.cat([plan.local_index(r) for r in range(cp)])
    real = held[held >= 0]
    assert torch.equal(real.sort().values, torch.arange(sum(doc_lens))), "every row exactly once"
    start = 0
    for n, c, padded in zip(doc_lens, plan.chunk_lens, _padded_docs(plan)):
        n_pads = 0 if cp == 1 else 2 * cp * c - n  # cp = 1 needs no padding
        assert c == -(-n // (2 * cp)) and padded.numel() == n + n_pads
        # chunk order restores the document, then only pads: pads sit at the END of the document
        assert torch.equal(padded, torch.cat([torch.arange(start, start + n), torch.full((n_pads,), -1)]))
        start += n
    local_doc_lens = doc_lens if cp == 1 else [2 * c for c in plan.chunk_lens]
    assert plan.local_len == sum(local_doc_lens)
    assert plan.local_cu_seqlens().tolist() == torch.tensor([0, *local_doc_lens]).cumsum(0).tolist()
    return plan


@pytest.mark.parametrize("cp", CPS)
@pytest.mark.parametrize("doc_lens", DOC_LENS)
def test_rows_held_once_pads_at_document_ends_and_unshard_restores_the_row(doc_lens, cp):
    plan = _check_plan(doc_lens, cp)
    row = _row(doc_lens)
    shards = [shard_batch(row, plan, r, pad_id=7) for r in range(cp)]
    for key in ("input_ids", "labels"):
        assert torch.equal(unshard_rows([s[key] for s in shards], plan), row[key])
    assert torch.equal(unshard_rows([s["position_ids"] for s in shards], plan, dim=1), row["position_ids"])
    for r, s in enumerate(shards):
        pads = plan.local_index(r) < 0
        assert s["input_ids"].shape == (plan.local_len,) and s["position_ids"].shape == (3, plan.local_len)
        assert (s["input_ids"][pads] == 7).all() and (s["labels"][pads] == -100).all()
        assert torch.equal(s["cu_seqlens"], plan.local_cu_seqlens()) and s["cu_seqlens"].dtype == torch.int32


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("doc_lens", DOC_LENS)
def test_causal_work_is_equal_on_every_rank(doc_lens, cp):
    """Work of a rank = Σ over its chunks of (chunk index + 1) in the padded documents."""
    plan = plan_cp_shard(_cu(doc_lens), cp)
    work = []
    for r in range(cp):
        doc, offset = plan.local_offsets(r)
        chunk = offset // torch.tensor(plan.chunk_lens)[doc]
        index = plan.local_index(r)
        assert torch.equal(index >= 0, offset < torch.tensor(plan.doc_lens)[doc])
        assert torch.equal(index[index >= 0], (plan.doc_starts()[doc] + offset)[index >= 0])
        starts_chunk = offset % torch.tensor(plan.chunk_lens)[doc] == 0  # one row per chunk
        work.append(int((chunk[starts_chunk] + 1).sum()))
    assert work == [len(doc_lens) * (2 * cp + 1)] * cp


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_real_token_causal_work_is_exactly_equal_when_documents_divide_evenly(cp):
    """Without pads, Σ over a rank's tokens of (keys it attends to) is the same on every rank."""
    doc_lens = [2 * cp * 3, 2 * cp * 5]
    plan = plan_cp_shard(_cu(doc_lens), cp)
    starts = plan.doc_starts()
    work = []
    for r in range(cp):
        index = plan.local_index(r)
        assert (index >= 0).all()
        doc = torch.bucketize(index, starts, right=True) - 1
        work.append(int((index - starts[doc] + 1).sum()))
    assert len(set(work)) == 1, work


@pytest.mark.parametrize("cp", CPS)
def test_feature_rows_place_media_features_on_the_same_rows_as_media_spans(cp):
    doc_lens = [9, 30, 4]
    row = _row(doc_lens, seed=1)
    spans = row["media_spans"]
    plan = plan_cp_shard(row["cu_seqlens"], cp)
    g = torch.Generator().manual_seed(2)
    embeds = torch.randn(sum(doc_lens), 6, generator=g)
    features = torch.randn(int(spans[:, 1].sum()), 6, generator=g)
    span_rows = torch.cat([torch.arange(s, s + n) for s, n in spans.tolist()])
    full = embeds.index_put((span_rows,), features)  # what OmniModel does with media_spans
    for r in range(cp):
        rows = shard_batch(row, plan, r)["feature_rows"]
        assert rows.dtype == torch.int64 and rows.shape == (plan.local_len,)
        got = OmniModel._scatter_rows(shard_rows(embeds, plan, r), rows, features)
        assert torch.equal(got, shard_rows(full, plan, r))
    all_rows = torch.cat([shard_batch(row, plan, r)["feature_rows"] for r in range(cp)])
    assert torch.equal(all_rows[all_rows >= 0].sort().values, torch.arange(features.shape[0]))


def test_pad_positions_continue_the_document_on_every_axis():
    row = _row([5, 3])
    plan = plan_cp_shard(row["cu_seqlens"], 2)  # c = (2, 1): doc 0 padded to 8, doc 1 to 4
    pos = shard_batch(row, plan, 0)["position_ids"]  # rank 0: doc 0 chunks 0, 3; doc 1 chunks 0, 3
    last0, last1 = row["position_ids"][:, 4], row["position_ids"][:, 7]
    want = torch.stack([row["position_ids"][:, 0], row["position_ids"][:, 1], last0 + 2, last0 + 3,
                        row["position_ids"][:, 5], last1 + 1], dim=1)  # fmt: skip
    assert torch.equal(pos, want)


@pytest.mark.parametrize("shape", ["flat", "one_axis", "absent"])
def test_position_ids_keep_their_leading_axes(shape):
    row = _row([6, 11])
    L = row["input_ids"].numel()
    if shape == "absent":
        del row["position_ids"]
        full = torch.arange(L)
    else:
        full = torch.arange(L) * 3 if shape == "flat" else (torch.arange(L) * 3)[None]
        row["position_ids"] = full
    plan = plan_cp_shard(row["cu_seqlens"], 3)
    shards = [shard_batch(row, plan, r)["position_ids"] for r in range(3)]
    assert shards[0].shape[:-1] == full.shape[:-1]
    assert torch.equal(unshard_rows(shards, plan, dim=-1 if full.dim() == 1 else 1), full)


def test_cp_one_gives_back_the_row():
    row = _row([5, 1, 3, 16, 2])
    out = shard_batch(row, plan_cp_shard(row["cu_seqlens"], 1), 0)
    for key in ("input_ids", "labels", "position_ids", "cu_seqlens", "num_loss_tokens"):
        assert torch.equal(torch.as_tensor(out[key]), torch.as_tensor(row[key])), key
    assert out["pixel_values"] is row["pixel_values"] and out["grid_thw"] is row["grid_thw"]
    assert "media_spans" not in out and set(out) == set(row) - {"media_spans"} | {"feature_rows", "token_valid"}
    assert bool(out["token_valid"].all())  # no pads at cp=1


def test_pads_are_marked_invalid_for_the_router_statistics():
    row = _row([5, 1, 3])
    plan = plan_cp_shard(row["cu_seqlens"], 2)
    for r in range(2):
        out = shard_batch(row, plan, r)
        assert torch.equal(out["token_valid"], plan.local_index(r) >= 0)
    assert sum(int(shard_batch(row, plan, r)["token_valid"].sum()) for r in range(2)) == 9


def test_shard_rows_is_differentiable_along_any_dim():
    plan = plan_cp_shard(_cu([7, 2, 10]), 2)
    x = torch.randn(3, 19, requires_grad=True)
    shards = [shard_rows(x, plan, r, fill=0.0, dim=1) for r in range(2)]
    weights = [torch.randn_like(s) for s in shards]
    sum((s * w).sum() for s, w in zip(shards, weights)).backward()
    assert torch.equal(x.grad, unshard_rows(weights, plan, dim=1))  # each row's weight, pads dropped


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="integer >= 1, got 0"):
        plan_cp_shard(_cu([4]), 0)
    with pytest.raises(ValueError, match="start at 0"):
        plan_cp_shard([2, 5, 9], 2)
    with pytest.raises(ValueError, match=r"strictly increasing; document 1 spans \[5, 5\)"):
        plan_cp_shard([0, 5, 5, 9], 2)
    with pytest.raises(ValueError, match=r"strictly increasing; document 1 spans \[5, 3\)"):
        plan_cp_shard([0, 5, 3], 2)
    plan = plan_cp_shard(_cu([4, 4]), 2)
    with pytest.raises(ValueError, match="outside the CP group of size 2"):
        plan.local_index(2)
    with pytest.raises(ValueError, match="has 7 rows along dim 0, the plan's row has 8"):
        shard_rows(torch.zeros(7), plan, 0)
    with pytest.raises(ValueError, match=r"batch key\(s\) \['kinds'\]"):
        shard_batch({**_row([4, 4]), "kinds": ["image"]}, plan, 0)


@settings(max_examples=60, deadline=None)
@given(doc_lens=st.lists(st.integers(1, 40), min_size=1, max_size=6), cp=st.integers(1, 5))
def test_property_any_document_lengths(doc_lens, cp):
    plan = _check_plan(doc_lens, cp)
    row = _row(doc_lens, seed=len(doc_lens))
    shards = [shard_batch(row, plan, r) for r in range(cp)]
    assert torch.equal(unshard_rows([s["position_ids"] for s in shards], plan, dim=1), row["position_ids"])
    assert sum(int((s["labels"] != -100).sum()) for s in shards) == row["num_loss_tokens"]


def test_vla_rows_keep_their_prefixes_and_share_their_action_chunks():
    """A VLA row (models/vla.py) under CP: ``prefix_lens`` passes through (pads sit at document
    ends, after every prefix), the tp pad document gets prefix 0, and the action chunks are shared
    contiguously over the ranks; a rank left without one runs chunk 0 with every step padded."""
    from omniweave.parallel.context import shard_micro_batch

    row = {"input_ids": torch.arange(1, 12), "labels": torch.full((11,), -100),
           "cu_seqlens": torch.tensor([0, 6, 11], dtype=torch.int32), "prefix_lens": torch.tensor([4, 5]),
           "action_docs": torch.tensor([0, 1, 1]), "actions": torch.arange(3.0)[:, None, None].expand(3, 2, 1),
           "action_is_pad": torch.zeros(3, 2, dtype=torch.bool), "action_dims": torch.ones(3, dtype=torch.long),
           "action_samples": torch.tensor([7, 8, 9]), "num_action_values": 6}  # fmt: skip
    shards = [shard_micro_batch(row, 2, r) for r in range(2)]
    assert [s["prefix_lens"].tolist() for s in shards] == [[4, 5], [4, 5]]
    assert [s["action_samples"].tolist() for s in shards] == [[7, 8], [9]]
    assert [s["action_docs"].tolist() for s in shards] == [[0, 1], [1]]
    assert all(s["num_action_values"] == 6 for s in shards)
    one = {**row, **{k: row[k][:1] for k in ("action_docs", "actions", "action_is_pad", "action_dims", "action_samples")}}
    lonely = [shard_micro_batch(one, 2, r) for r in range(2)]
    assert lonely[0]["action_is_pad"].tolist() == [[False, False]]
    assert lonely[1]["action_samples"].tolist() == [7] and lonely[1]["action_is_pad"].tolist() == [[True, True]]
    padded = shard_micro_batch(row, 1, 0, tp=2)  # 11 tokens -> a pad document of 1 for tp 2
    assert padded["cu_seqlens"].tolist() == [0, 6, 11, 12] and padded["prefix_lens"].tolist() == [4, 5, 0]
