"""Tiny random Qwen2-VL / Qwen2.5-VL models built from transformers' config classes, and
matching inputs for transformers and omniweave (media in span order, M-RoPE positions)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = 5, 6, 3, 4
IN_DIM = 3 * 2 * 14 * 14


def tiny_hf_config(family: str, tie: bool = False):
    import transformers

    text = dict(vocab_size=1024, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})  # fmt: skip
    ids = dict(image_token_id=IMAGE_PAD, video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
               vision_end_token_id=VISION_END, tie_word_embeddings=tie)  # fmt: skip
    if family == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2)
        return transformers.Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
    vision = dict(depth=3, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=4,
                  window_size=56, fullatt_block_indexes=[1], tokens_per_second=2)  # fmt: skip
    return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)


def hf_class(family: str):
    import transformers

    return {"qwen2_vl": transformers.Qwen2VLForConditionalGeneration,
            "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration}[family]  # fmt: skip


def save_tiny(family: str, path: Path, seed: int = 0, tie: bool = False) -> Path:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(seed)
    model = hf_class(family)(tiny_hf_config(family, tie))
    with torch.no_grad():  # random, non-trivial norms and biases
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    return Path(path)


def make_sample(media: list[tuple[str, tuple[int, int, int]]], seed: int = 0, text: int = 5) -> dict:
    """A packed row: ``text`` random tokens, then per media item <start> pads <end> + text."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(10, 1024, (n,), generator=g)  # noqa: E731
    ids, spans, grids, kinds = [rand(text)], [], [], []
    for kind, grid in media:
        n = grid[0] * grid[1] * grid[2] // 4
        ids.append(torch.tensor([VISION_START]))
        spans.append((int(sum(x.numel() for x in ids)), n))
        ids += [torch.full((n,), IMAGE_PAD if kind == "image" else VIDEO_PAD), torch.tensor([VISION_END]), rand(text)]
        grids.append(grid)
        kinds.append(kind)
    return sample_row(ids, grids, spans, kinds, g)


def sample_row(ids: list[torch.Tensor], grids: list, spans: list[tuple[int, int]], kinds: list[str],
               g: torch.Generator, in_dim: int = IN_DIM) -> dict:
    """The batch dict of one document: its token pieces, media grids and (start, length) spans;
    labels = next token, -100 at media pads and the end; random patches."""
    input_ids = torch.cat(ids)
    P = sum(t * h * w for t, h, w in grids)
    labels = torch.roll(input_ids, -1).clone()
    labels[-1] = -100
    labels[(input_ids == IMAGE_PAD) | (input_ids == VIDEO_PAD)] = -100
    return {
        "input_ids": input_ids,
        "labels": labels,
        "pixel_values": torch.randn(P, in_dim, generator=g),
        "grid_thw": torch.tensor(grids, dtype=torch.long).reshape(-1, 3),
        "media_spans": torch.tensor(spans, dtype=torch.long).reshape(-1, 2),
        "cu_seqlens": torch.tensor([0, input_ids.numel()], dtype=torch.int32),
        "kinds": kinds,
    }


def hf_inputs(sample: dict) -> dict:
    """transformers kwargs for the same row: images and videos split, mm_token_type_ids."""
    ids = sample["input_ids"]
    sizes = sample["grid_thw"].prod(-1).tolist()
    chunks = torch.split(sample["pixel_values"], sizes) if sizes else []
    out = {"input_ids": ids[None]}
    for kind, pv_key, grid_key in (("image", "pixel_values", "image_grid_thw"), ("video", "pixel_values_videos", "video_grid_thw")):
        sel = [i for i, k in enumerate(sample["kinds"]) if k == kind]
        if sel:
            out[pv_key] = torch.cat([chunks[i] for i in sel])
            out[grid_key] = sample["grid_thw"][sel]
    if sample["kinds"]:
        tt = torch.zeros_like(ids)
        tt[ids == IMAGE_PAD], tt[ids == VIDEO_PAD] = 1, 2
        out["mm_token_type_ids"] = tt[None]
    return out


def hf_position_ids(hf_model, sample: dict) -> torch.Tensor:
    """[3, L] M-RoPE positions from transformers' get_rope_index."""
    inputs = hf_inputs(sample)
    L = sample["input_ids"].numel()
    if not sample["kinds"]:
        return torch.arange(L)[None].expand(3, -1).clone()
    kw = {k: inputs.get(k) for k in ("image_grid_thw", "video_grid_thw")}
    pos, _ = hf_model.model.get_rope_index(inputs["input_ids"], mm_token_type_ids=inputs["mm_token_type_ids"], **kw)
    return pos[:, 0]


MEDIA_CASES = {
    "text_only": [],
    "one_image": [("image", (1, 4, 6))],
    "several_images": [("image", (1, 4, 4)), ("image", (1, 6, 2)), ("image", (1, 10, 8))],
    "video": [("video", (3, 4, 6))],
    "mixed": [("image", (1, 6, 4)), ("video", (2, 4, 4)), ("image", (1, 2, 2))],
}


def check_logits_and_grads(hf, ours, hf_inputs: dict, batch: dict, hf_grads_as_ours, require_all: bool = True,
                           atol: float = 1e-4, rtol: float = 1e-4) -> dict:
    """One row through transformers' ``hf`` and our ``ours``: logits within ``atol``; then the same
    random-weighted sum of the logits backpropagated through both and every parameter's gradient
    within ``rtol`` relative (``hf_grads_as_ours(hf)``: HF's gradients under our names). A
    parameter without a counterpart fails with ``require_all``, else is skipped. Returns
    {name: HF gradient} of the checked parameters."""
    hf.zero_grad(), ours.zero_grad()
    ref = hf(**hf_inputs).logits[0]
    got = ours.logits(batch)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= atol
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    (ref * weights).sum().backward()
    (got * weights).sum().backward()
    ref_grads, checked = hf_grads_as_ours(hf), {}
    for name, p in ours.named_parameters():
        g = ref_grads.get(name)
        assert g is not None or not require_all, f"{name}: no transformers counterpart"
        if g is None or g.norm() == 0:
            continue
        rel = ((p.grad - g).norm() / g.norm()).item()
        assert rel <= rtol, f"{name}: relative gradient error {rel:.2e}"
        checked[name] = g
    return checked


def check_generation_equals_hf(hf, ours, hf_inputs: dict, batch: dict, other: dict, new_tokens: int = 6) -> None:
    """The generation engine (eval, GRPO rollouts) decoding ``batch`` beside ``other`` in one packed
    row: greedy tokens equal transformers' ``generate`` on ``hf_inputs``."""
    from omniweave.generation import Prompt, SamplingParams, TorchRollout

    batch, other = ({k: v for k, v in b.items() if k != "labels"} for b in (batch, other))
    params = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    got = TorchRollout(ours).generate([Prompt(0, other), Prompt(1, batch)], 1, params, seed=0)[1].tokens
    with torch.no_grad():
        want = hf.generate(**hf_inputs, max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert got == want[0, batch["input_ids"].numel():].tolist()
