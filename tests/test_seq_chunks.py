"""Chunked rows (omniweave.parallel.seq_chunks, ``parallel.seq_chunks``) against the unchunked row:

- the plan: per chunk, queries = document ∩ chunk, keys = document ∩ [0, chunk end), trimmed to the
  sliding window; empty documents skipped;
- the chunk attention (K/V of earlier chunks from the store, the kernel's causal bottom-right
  alignment per document) gives each chunk's rows of the full row's attention, with and without a
  window;
- chunked forward + backward of a packed row (4 documents crossing chunk boundaries, an image
  inside a chunk, one spanning a boundary) gives the unchunked loss and EVERY parameter gradient
  (encoders included) within GRAD_RTOL: Qwen2.5-VL, the same with a sliding window and with
  activation checkpointing, Qwen3-VL (DeepStack), a dense MLA (DeepSeek-V3 attention) decoder;
  1, 2, 5 and 7 chunks;
- the trainer with parallel.seq_chunks=4 logs the losses of the unchunked run;
- what it cannot do is refused by key, before any rank starts.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from omniweave.config import CONFIGS_DIR
from omniweave.errors import UserError
from omniweave.models.components.attention import attn
from omniweave.models.registry import build_model
from omniweave.train.objective import TokenCrossEntropy
from omniweave.parallel.seq_chunks import (
    ChunkKV, chunk_bounds, chunked_forward_backward, plan_chunks,
)

LOSS_RTOL = 1e-6  # |Δloss| / loss, fp32 (measured <= 1.3e-7)
GRAD_RTOL = 1e-5  # per parameter ‖Δgrad‖ / ‖grad‖, fp32 (measured <= 1.7e-6, sliding window, 7 chunks)
IMAGE_PAD = 5
# (text tokens, image grids) per document: 22 + 30 + 25 + 21 = 98 rows; with 7 chunks of 14 rows
# image A (rows 13..18) spans the boundary at 14, images B (61..66) and C (70..73) sit inside chunks
DOCS = [(13, [(1, 4, 6)]), (30, []), (9, [(1, 6, 4), (1, 4, 4)]), (21, [])]


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


def _model(foundation: str, encoder: str | None = None, projector: str | None = None, seed: int = 0,
           projector_fields: dict | None = None, **fields):
    """A tiny model from omniweave/configs/models (``fields`` override the foundation's, ``projector_fields``
    the projector's), non-trivial norms and biases."""
    models = CONFIGS_DIR / "models"
    spec = {"foundation": OmegaConf.merge(OmegaConf.load(models / f"foundation/{foundation}.yaml"), fields)}
    if encoder:
        spec["image_encoder"] = OmegaConf.load(models / f"image_encoder/{encoder}.yaml")
        spec["projector"] = OmegaConf.merge(OmegaConf.load(models / f"projector/{projector}.yaml"),
                                            projector_fields or {})
    cfg = OmegaConf.create({"model": spec})
    OmegaConf.resolve(cfg)
    torch.manual_seed(seed)
    model = build_model(cfg.model)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _row(in_dim: int | None, merge: int = 4, seed: int = 1) -> dict:
    """A packed row of DOCS: random text, image pads (label -100), next-token labels inside each
    document, M-RoPE positions [3, L] that differ per axis; no media keys when ``in_dim`` is None."""
    g = torch.Generator().manual_seed(seed)
    ids, spans, grids, pos, cu = [], [], [], [], [0]
    for n, doc_grids in DOCS:
        doc = [torch.randint(10, 1024, (n,), generator=g)]
        for grid in doc_grids if in_dim else ():
            k = grid[0] * grid[1] * grid[2] // merge
            spans.append((cu[-1] + sum(x.numel() for x in doc), k))
            grids.append(grid)
            doc += [torch.full((k,), IMAGE_PAD), torch.randint(10, 1024, (3,), generator=g)]
        doc = torch.cat(doc)
        ids.append(doc)
        cu.append(cu[-1] + doc.numel())
        pos.append(torch.arange(doc.numel())[None].expand(3, -1) + torch.randint(0, 4, (3, 1), generator=g))
    ids = torch.cat(ids)
    labels = torch.roll(ids, -1).clone()
    labels[ids == IMAGE_PAD] = -100
    labels[torch.tensor(cu[1:]) - 1] = -100
    batch = {"input_ids": ids, "labels": labels, "position_ids": torch.cat(pos, 1),
             "cu_seqlens": torch.tensor(cu, dtype=torch.int32), "num_loss_tokens": int((labels != -100).sum())}
    if in_dim:
        P = sum(t * h * w for t, h, w in grids)
        batch.update(pixel_values=torch.randn(P, in_dim, generator=g), grid_thw=torch.tensor(grids),
                     media_spans=torch.tensor(spans))
    return batch


CE = TokenCrossEntropy()  # SFT's objective (train/objective.py)


def _grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


# A Gated DeltaNet's decay parameters (A_log, dt_bias, in_proj_a) sum gradients of both signs over
# every token, so a chunked run's other summation order moves them by fp32 cancellation: measured
# 8.0e-5 at 5 chunks, where the same comparison with the model in fp64 (its norms still fp32) is 4.9e-7
DECAY = ("linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.in_proj_a.weight")
DECAY_RTOL = 2e-4


def _worst(grads: dict, ref: dict) -> float:
    """The largest relative gradient error, the decay parameters' measured against DECAY_RTOL as
    if against GRAD_RTOL."""
    assert grads.keys() == ref.keys()
    err = lambda n: ((grads[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)).item()  # noqa: E731
    return max(err(n) * (GRAD_RTOL / DECAY_RTOL if n.endswith(DECAY) else 1.0) for n in ref)


# ---------------------------------------------------------------------------- the plan


def test_chunk_bounds_equal_chunks_last_shorter():
    assert chunk_bounds(98, 7) == [(i, i + 14) for i in range(0, 98, 14)]
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert chunk_bounds(3, 5) == [(0, 1), (1, 2), (2, 3)]  # fewer chunks than asked for a short row
    with pytest.raises(ValueError, match="parallel.seq_chunks=0"):
        chunk_bounds(10, 0)


def test_plan_queries_are_document_and_chunk_keys_reach_back_to_document_start():
    # documents [0, 5) [5, 5) (empty) [5, 12) [12, 20); chunks of 7 rows
    plans = plan_chunks([0, 5, 5, 12, 20], 3)
    assert [(p.start, p.end, p.key_start) for p in plans] == [(0, 7, 0), (7, 14, 5), (14, 20, 12)]
    assert plans[0].cu_q == (0, 5, 7) and plans[0].cu_k == (0, 5, 7)
    assert plans[1].cu_q == (0, 5, 7) and plans[1].cu_k == (0, 7, 9)  # doc [5, 12): 5 queries, 7 keys
    assert plans[2].cu_q == (0, 6) and plans[2].cu_k == (0, 8)


def test_plan_trims_keys_to_the_sliding_window():
    plans = plan_chunks([0, 20], 2, window=3)  # chunk [10, 20): the query at row 10 sees rows 8..10
    assert (plans[1].key_start, plans[1].cu_q, plans[1].cu_k) == (8, (0, 10), (0, 12))
    with pytest.raises(ValueError, match="cu_seqlens must rise"):
        plan_chunks([0, 7, 5], 2)


@pytest.mark.parametrize("window", [None, 4])
def test_chunk_attention_equals_the_rows_of_full_attention(window):
    """Each chunk's queries over the store's earlier K/V + its own: the full row's output at its
    rows, for documents that start before, inside and after chunk boundaries (math kernel, fp32)."""
    g = torch.Generator().manual_seed(0)
    cu = torch.tensor([0, 9, 10, 27, 40], dtype=torch.int32)
    q, k, v = (torch.randn(40, h, 8, generator=g) for h in (4, 2, 2))
    full, _ = attn(q, k, v, cu, cu, True, window, backend="math")
    store = ChunkKV(40)
    for plan in plan_chunks(cu, 6, window):
        store.begin(plan, grad=False)
        s, e = plan.start, plan.end
        out = store.attend(0, q[s:e], k[s:e], v[s:e], window, "math")
        torch.testing.assert_close(out, full[s:e], rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------- parity


CASES = {
    "qwen2_5_vl": (dict(foundation="qwen2_5_tiny", encoder="qwen2_5_vit_tiny", projector="patch_merger_tiny"), 3 * 2 * 14 * 14),
    "sliding_window": (dict(foundation="qwen2_5_tiny", encoder="qwen2_5_vit_tiny", projector="patch_merger_tiny",
                            sliding_window=9), 3 * 2 * 14 * 14),
    "qwen3_vl_deepstack": (dict(foundation="qwen3_vl_tiny", encoder="qwen3_vit_tiny", projector="qwen3_merger",
                                projector_fields={"deepstack_levels": 2}),
                           3 * 2 * 16 * 16),
    "mla_text": (dict(foundation="deepseek_v3_tiny", num_experts=0), None),
    # Qwen3.5's hybrid layers (Gated DeltaNet at 0 and 2): a document crossing a boundary carries its
    # conv window and recurrent state (parallel/chunk_state.py); kernel chunks of 8 rows cut inside chunks
    "qwen3_5_hybrid": (dict(foundation="qwen3_5_tiny", linear_chunk_size=8), None),
}


def _build(case: str):
    spec, in_dim = CASES[case]
    model = _model(**spec)
    if case == "qwen3_vl_deepstack":  # the tiny encoder's deepstack_visual_indexes [0, 1]
        assert model.deepstack_levels == 2
    return model, _row(in_dim)


@pytest.mark.parametrize("case", list(CASES))
def test_chunked_loss_and_every_gradient_equal_the_unchunked_row(case):
    model, batch = _build(case)
    if "media_spans" in batch:  # the layout DOCS promises: A spans a 7-chunk boundary, B and C inside chunks
        assert batch["media_spans"].tolist() == [[13, 6], [61, 6], [70, 4]]
    scale = 1.0 / batch["num_loss_tokens"]
    ref_loss = model(batch).loss_sum
    (ref_loss * scale).backward()
    ref = _grads(model)
    for n in (1, 2, 5, 7):
        loss, _ = chunked_forward_backward(model, batch, CE, {}, n, scale)
        assert abs(loss.item() - ref_loss.item()) <= LOSS_RTOL * ref_loss.item(), (n, loss.item(), ref_loss.item())
        assert _worst(_grads(model), ref) <= GRAD_RTOL, n


@pytest.mark.parametrize("case", ["qwen2_5_vl", "qwen3_5_hybrid"])
def test_chunked_under_activation_checkpointing(case):
    """train.ac=full recomputes each layer inside a chunk's backward: the chunk's K/V leaves and
    own k, v (a linear layer's carried-state leaves) are the ones the first forward recorded, so
    the gradients stay exact."""
    from omniweave.parallel.fsdp import apply_ac

    model, batch = _build(case)
    ref_loss = model(batch).loss_sum
    ref_loss.backward()
    ref = _grads(model)
    apply_ac(model, "full")
    loss, _ = chunked_forward_backward(model, batch, CE, {}, 5, 1.0)
    assert abs(loss.item() - ref_loss.item()) <= LOSS_RTOL * ref_loss.item()
    grads = {n.replace("._checkpoint_wrapped_module", ""): g for n, g in _grads(model).items()}
    assert _worst(grads, ref) <= GRAD_RTOL
    assert all(layer.linear_attn.carry is None if layer.linear else layer.self_attn.attn_fn is None
               for layer in model.foundation.layers)


def test_hooks_are_restored_after_the_row():
    model, batch = _build("qwen2_5_vl")
    chunked_forward_backward(model, batch, CE, {}, 3, 1.0)
    assert all(layer.self_attn.attn_fn is None for layer in model.foundation.layers)
    assert model.media_splits == {}


def test_an_attention_already_swapped_is_refused():
    """Context parallelism installs its own attn_fn: chunking on top of it is an error naming the key."""
    model, batch = _build("mla_text")
    model.foundation.layers[1].self_attn.attn_fn = lambda q, k, v, cu, window: q
    with pytest.raises(ValueError, match="parallel.cp = 1"):
        chunked_forward_backward(model, batch, CE, {}, 2, 1.0)


def test_moe_model_is_refused_by_key():
    model = _model("qwen3_moe_tiny")
    with pytest.raises(ValueError, match="model.foundation.num_experts"):
        chunked_forward_backward(model, _row(None), CE, {}, 2, 1.0)


# ---------------------------------------------------------------------------- the recipe


def test_cli_refuses_before_any_rank_starts(demo_packed, tmp_path):
    from omniweave.train.trainer import check_ready
    from tests.train_factory import recipe

    with pytest.raises(UserError, match="parallel.seq_chunks=3 with parallel.cp=2: chunked rows and context parallelism"):
        check_ready(recipe(demo_packed, tmp_path, parallel__seq_chunks=3, parallel__cp=2), None)


@pytest.mark.slow
def test_trainer_with_seq_chunks_logs_the_unchunked_losses(demo_packed, tmp_path):
    """``omniweave train demo parallel.seq_chunks=4``: 3 steps of 4 packs give the losses and
    gradient norms of the unchunked run (fp32; measured |Δloss| <= 5e-7)."""
    from tests.train_factory import read_metrics, train_in_process

    plain = train_in_process(demo_packed, tmp_path / "plain", steps=3)
    chunked = train_in_process(demo_packed, tmp_path / "chunked", steps=3, parallel__seq_chunks=4)
    a, b = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "chunked")
    assert plain["steps"] == chunked["steps"] == 3
    for x, y in zip(a, b):
        assert abs(x["loss"] - y["loss"]) <= 1e-5 * abs(x["loss"]), (x["loss"], y["loss"])
        assert abs(x["grad_norm"] - y["grad_norm"]) <= 1e-4 * x["grad_norm"], (x["grad_norm"], y["grad_norm"])


def test_every_row_runs_the_encoder_as_often_with_or_without_media():
    """A text-only row encodes the encoder's dummy input (``run_encoder_always``) through the same
    per-row hook as a row's media, so data-parallel ranks whose rows differ in media still run the
    encoder's FSDP collectives in step: one forward per sweep, whatever the chunks."""
    from omniweave.parallel.seq_chunks import chunked_forward_backward

    spec, in_dim = CASES["qwen2_5_vl"]
    model = _model(**spec)
    calls = []
    model.image_encoder.register_forward_hook(lambda *_: calls.append(torch.is_grad_enabled()))
    counts = []
    for row in (_row(in_dim), _row(None)):
        calls.clear()
        chunked_forward_backward(model, row, CE, {}, 5, 1.0)
        counts.append(list(calls))
    assert counts[0] == counts[1] == [False, True]  # the forward sweep's once (no grad), chunk 0's recompute
