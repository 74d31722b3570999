"""Tiny models, packed rows and gradient measurements for tests/dist/test_tp.py (run inside the
spawned ranks, so everything here is module-level and picklable)."""

from __future__ import annotations

import numpy as np
import torch

from omniweave.data.text.rope_index import mrope_position_ids
from omniweave.data.sample import MediaSpan

IN_DIM = 3 * 2 * 14 * 14  # patch vector of the real Qwen2-VL patchify (C·t·p·p)
VOCAB = 256
PAD, IMAGE, VIDEO, START, END = 0, 5, 6, 3, 4

VITS = {
    "qwen2_5": dict(name="qwen2_5_vit", depth=3, hidden_size=32, num_heads=4, intermediate_size=48, norm="rmsnorm",
                    mlp="swiglu", window_size=56, fullatt_block_indexes=[1]),
    "qwen2": dict(name="qwen2_vit", depth=2, hidden_size=32, num_heads=4, intermediate_size=64, norm="layernorm",
                  mlp="quick_gelu", window_size=None, fullatt_block_indexes=[]),
}  # fmt: skip


def model_cfg(num_kv_heads: int = 2, qk_norm: bool = False, tie: bool = False, vit: str = "qwen2_5",
              num_heads: int = 4, vit_heads: int = 4) -> dict:  # fmt: skip
    """The recipe's ``model:`` section of a tiny Qwen2.5-VL-like model (M-RoPE, qkv bias)."""
    foundation = dict(name="decoder", vocab_size=VOCAB, hidden_size=16 * num_heads, intermediate_size=128,
                      num_layers=2, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=16, qkv_bias=True,
                      mrope_section=[2, 3, 3], rope_theta=1e6, qk_norm=qk_norm, tie_word_embeddings=tie,
                      attn_backend="math")  # fmt: skip
    encoder = dict(VITS[vit], num_heads=vit_heads, attn_backend="math")
    projector = dict(name="patch_merger", in_dim=32, out_dim=16 * num_heads, merge_size=2,
                     norm=VITS[vit]["norm"])  # fmt: skip
    return {"foundation": foundation, "image_encoder": encoder, "projector": projector}


def build(cfg: dict, seed: int = 0) -> torch.nn.Module:
    """The same random model on every rank: registry init, then every parameter (biases and
    norms included) moved off its trivial init, so a mis-sharded tensor changes the result."""
    from omniweave.models.registry import build_model

    torch.manual_seed(seed)
    model = build_model(cfg)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


def packed_row(seed: int, media: bool = True, multiple: int = 4) -> dict:
    """One packed row of three documents (image + text, video + image + text, text only; with
    ``media=False`` three text documents), M-RoPE positions per document, labels shifted within
    each document, padded to ``multiple`` tokens with a loss-free document."""
    g = torch.Generator().manual_seed(seed)
    docs = [[("image", (1, 4, 6))], [("video", (2, 4, 4)), ("image", (1, 2, 2))], []] if media else [[], [], []]
    ids, labels, pos, spans, grids, cu = [], [], [], [], [], [0]
    for media in docs:
        doc, doc_spans = [torch.randint(10, VOCAB, (5,), generator=g)], []
        for kind, grid in media:
            n = grid[0] * grid[1] * grid[2] // 4
            doc.append(torch.tensor([START]))
            start = int(sum(t.numel() for t in doc))
            doc_spans.append(MediaSpan(kind=kind, part="x", grid_thw=grid, resized_hw=(grid[1] * 14, grid[2] * 14),
                                       start=start, length=n, second_per_grid=1.0))  # fmt: skip
            doc += [torch.full((n,), IMAGE if kind == "image" else VIDEO), torch.tensor([END]),
                    torch.randint(10, VOCAB, (4,), generator=g)]  # fmt: skip
            grids.append(grid)
        doc_ids = torch.cat(doc)
        doc_labels = torch.roll(doc_ids, -1)
        doc_labels[-1] = -100
        doc_labels[(doc_ids == IMAGE) | (doc_ids == VIDEO)] = -100
        offset = cu[-1]
        spans += [(offset + s.start, s.length) for s in doc_spans]
        doc_pos = mrope_position_ids(len(doc_ids), doc_spans, 2, tokens_per_second=2.0)  # [3, len]
        pos.append(torch.from_numpy(doc_pos.astype(np.int64)))
        ids.append(doc_ids), labels.append(doc_labels)
        cu.append(offset + len(doc_ids))
    pad = -cu[-1] % multiple
    if pad:  # a last document of pads without loss, as a pack's tail
        ids.append(torch.full((pad,), PAD)), labels.append(torch.full((pad,), -100))
        pos.append(torch.arange(pad)[None].expand(3, -1))
        cu.append(cu[-1] + pad)
    patches = sum(t * h * w for t, h, w in grids)
    return {
        "input_ids": torch.cat(ids), "labels": torch.cat(labels), "position_ids": torch.cat(pos, 1),
        "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
        "pixel_values": torch.randn(patches, IN_DIM, generator=g),
        "grid_thw": torch.tensor(grids, dtype=torch.long).reshape(-1, 3),
        "media_spans": torch.tensor(spans, dtype=torch.long).reshape(-1, 2),
    }  # fmt: skip


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def loss_and_grads(model, rows: list[dict], scale: float = 1.0) -> tuple[float, dict]:
    """(Σ loss_sum over rows, {name: full gradient}); ``scale`` multiplies what is backpropagated
    (FSDP averages over dp: scale = dp gives sums)."""
    model.zero_grad()
    total = 0.0
    for row in rows:
        out = model(row)
        (out.loss_sum * scale).backward()
        total += float(out.loss_sum.detach())
    return total, {n: full(p.grad) for n, p in model.named_parameters()}


def compare(loss: float, grads: dict, ref_loss: float, ref_grads: dict) -> dict:
    """Measured errors: loss relative, and per parameter ||Δgrad|| / ||ref grad||."""
    assert grads.keys() == ref_grads.keys(), sorted(set(grads) ^ set(ref_grads))
    rel = {n: float((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-30)) for n in grads}
    worst = max(rel, key=rel.get)
    zero = [n for n, g in ref_grads.items() if float(g.norm()) == 0.0]
    return {"loss_rel": abs(loss - ref_loss) / abs(ref_loss), "grad_rel": rel[worst], "worst": worst,
            "params": len(rel), "zero_ref_grads": zero}  # fmt: skip
