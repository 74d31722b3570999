"""Tiny random Qwen3-VL / Qwen3-VL-MoE models built from transformers' config classes, and packed
rows laid out the Qwen3-VL way: an image is ``<start> pads <end>``; a video is, per temporal
patch, a few timestamp tokens then ``<start> pads <end>`` (one media span per temporal patch)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from omniweave.data.text.rope_index import mrope_position_ids
from omniweave.data.sample import MediaSpan
from tests.vl_factory import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, sample_row
from tests.vl_factory import hf_inputs as vl_hf_inputs

IN_DIM = 3 * 2 * 16 * 16
FAMILIES = ("qwen3_vl", "qwen3_vl_moe")

# non-square everywhere: q dim 80 != hidden 56; head_dim 20 -> 10 rotary bands, interleaved [4, 3, 3];
# MoE: 2·I = 72 != D = 56 (a transposed expert tensor cannot pass for the runtime one), layer 1 dense.
TEXT = dict(vocab_size=1024, hidden_size=56, intermediate_size=88, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=20, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [4, 3, 3],
                             "mrope_interleaved": True})  # fmt: skip
MOE = dict(moe_intermediate_size=36, num_experts=5, num_experts_per_tok=2, mlp_only_layers=[1])
# a 6x6 position table resampled up and down; DeepStack from blocks 0 and 1 of 3 -> decoder layers 0, 1
VISION = dict(depth=3, hidden_size=32, intermediate_size=40, num_heads=2, out_hidden_size=56, patch_size=16,
              num_position_embeddings=36, deepstack_visual_indexes=[0, 1])  # fmt: skip


# Qwen3.5 / Qwen3.5-MoE: the same tower without DeepStack over the hybrid decoder (linear, full, linear
# layers; 2 key heads of 10, 4 value heads of 14; gated attention with half of each 20-dim head
# rotated: 5 bands, interleaved [2, 2, 1]); MoE: 5 experts, top-2, a gated shared expert of 28.
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe")
HYBRID_TEXT = dict({k: v for k, v in TEXT.items() if k != "rope_parameters"},
                   layer_types=["linear_attention", "full_attention", "linear_attention"], linear_num_key_heads=2,
                   linear_num_value_heads=4, linear_key_head_dim=10, linear_value_head_dim=14,
                   rope_parameters={"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5,
                                    "mrope_section": [2, 2, 1], "mrope_interleaved": True})  # fmt: skip
HYBRID_MOE = dict(moe_intermediate_size=36, num_experts=5, num_experts_per_tok=2, shared_expert_intermediate_size=28)
HYBRID_VISION = {k: v for k, v in VISION.items() if k != "deepstack_visual_indexes"}


def tiny_hf_config(family: str, tie: bool = False):
    import transformers

    ids = dict(image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
               vision_end_token_id=VISION_END, tie_word_embeddings=tie)  # fmt: skip
    if family == "qwen3_vl":
        return transformers.Qwen3VLConfig(text_config=TEXT, vision_config=VISION, **ids)
    if family == "qwen3_5":
        return transformers.Qwen3_5Config(text_config=HYBRID_TEXT, vision_config=HYBRID_VISION, **ids)
    if family == "qwen3_5_moe":
        text = {k: v for k, v in HYBRID_TEXT.items() if k != "intermediate_size"}
        return transformers.Qwen3_5MoeConfig(text_config={**text, **HYBRID_MOE}, vision_config=HYBRID_VISION, **ids)
    return transformers.Qwen3VLMoeConfig(text_config={**TEXT, **MOE}, vision_config=VISION, **ids)


def hf_class(family: str):
    import transformers

    return {"qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
            "qwen3_vl_moe": transformers.Qwen3VLMoeForConditionalGeneration,
            "qwen3_5": transformers.Qwen3_5ForConditionalGeneration,
            "qwen3_5_moe": transformers.Qwen3_5MoeForConditionalGeneration}[family]  # fmt: skip


def save_tiny(family: str, path: Path, seed: int = 0, tie: bool = False):
    """A tiny random model saved in the layout of released checkpoints (MoE experts transposed to
    ``[E, D, 2I]`` / ``[E, I, D]``; transformers' save_pretrained keeps its runtime layout).
    Returns (path, the transformers model)."""
    from safetensors.torch import load_file, save_file

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(seed)
    model = hf_class(family)(tiny_hf_config(family, tie)).eval()
    with torch.no_grad():  # random, non-trivial norms, biases, routing, position table
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(std=0.5)
            elif "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("pos_embed.weight"):
                p.normal_(std=0.5)
    model.save_pretrained(path)
    if family == "qwen3_vl_moe":
        file = Path(path) / "model.safetensors"
        tensors = load_file(str(file))
        for name in tensors:
            if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                tensors[name] = tensors[name].transpose(1, 2).contiguous()
        save_file(tensors, str(file), metadata={"format": "pt"})
    return Path(path), model


def make_sample(media: list[tuple[str, tuple[int, int, int]]], seed: int = 0, text: int = 5) -> dict:
    """One document: ``text`` random tokens, then per media item its blocks + ``text`` tokens.
    Also returns ``spans`` (MediaSpan per block, for our position ids)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(10, 1024, (n,), generator=g)  # noqa: E731
    ids, spans, grids, kinds = [rand(text)], [], [], []
    for kind, (t, h, w) in media:
        blocks = [(1, h, w)] * t if kind == "video" else [(t, h, w)]
        for grid in blocks:
            if kind == "video":
                ids.append(rand(3))  # "<0.5 seconds>"
            n = grid[0] * h * w // 4
            ids.append(torch.tensor([VISION_START]))
            start = int(sum(x.numel() for x in ids))
            spans.append(MediaSpan(kind=kind, part="x", grid_thw=grid, resized_hw=(16 * h, 16 * w), start=start, length=n))
            ids += [torch.full((n,), IMAGE_PAD if kind == "image" else VIDEO_PAD), torch.tensor([VISION_END])]
        ids.append(rand(text))
        grids.append((t, h, w))
        kinds.append(kind)
    row = sample_row(ids, grids, [(s.start, s.length) for s in spans], kinds, g, IN_DIM)
    row["position_ids"] = torch.from_numpy(mrope_position_ids(row["input_ids"].numel(), spans, 2)).long()
    return row


def pack(samples: list[dict]) -> dict:
    """Documents packed into one row (spans shifted, cu_seqlens per document)."""
    offsets = [0]
    for s in samples:
        offsets.append(offsets[-1] + s["input_ids"].numel())
    return {
        "input_ids": torch.cat([s["input_ids"] for s in samples]),
        "labels": torch.cat([s["labels"] for s in samples]),
        "pixel_values": torch.cat([s["pixel_values"] for s in samples]),
        "grid_thw": torch.cat([s["grid_thw"] for s in samples]),
        "media_spans": torch.cat([s["media_spans"] + torch.tensor([o, 0]) for s, o in zip(samples, offsets)]),
        "position_ids": torch.cat([s["position_ids"] for s in samples], dim=1),
        "cu_seqlens": torch.tensor(offsets, dtype=torch.int32),
    }


def ours_batch(sample: dict) -> dict:
    return {k: v for k, v in sample.items() if k != "kinds"}


def hf_inputs(sample: dict) -> dict:
    """transformers kwargs for one document: vl_factory's (images and videos split), plus the
    attention mask and mm_token_type_ids that Qwen3-VL's get_rope_index always takes."""
    out = vl_hf_inputs(sample)
    ids = sample["input_ids"]
    out["attention_mask"] = torch.ones_like(ids)[None]
    out.setdefault("mm_token_type_ids", torch.zeros_like(ids)[None])
    return out


def hf_position_ids(hf_model, sample: dict) -> torch.Tensor:
    """[3, L] from transformers' get_rope_index."""
    inputs = hf_inputs(sample)
    kw = {k: inputs.get(k) for k in ("image_grid_thw", "video_grid_thw")}
    pos, _ = hf_model.model.get_rope_index(inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"],
                                           attention_mask=inputs["attention_mask"], **kw)  # fmt: skip
    return pos[:, 0]


MEDIA_CASES = {
    "text_only": [],
    "images": [("image", (1, 4, 6)), ("image", (1, 10, 8)), ("image", (1, 2, 2))],
    "video": [("video", (3, 4, 6))],
    "mixed": [("image", (1, 6, 4)), ("video", (2, 4, 4)), ("image", (1, 8, 14))],
}
