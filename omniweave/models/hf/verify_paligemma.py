"""``omniweave hf verify`` for PaliGemma (``model_type: paligemma``): two documents, each with its
own image and its own prefix, packed into one row through omniweave, against each alone through
transformers' ``PaliGemmaForConditionalGeneration`` (eager attention, fp32).

A document is laid out as ``PaliGemmaProcessor`` lays it out::

    <image> x num_image_tokens, bos, prompt, "\\n" | suffix, eos
    token_type_ids 0 (prefix: bidirectional)       | 1 (suffix: causal, sees the whole prefix)

With a ``tokenizer.json`` in the directory the prompt is ``--prompt`` + "\\n" and the suffix a
fixed caption, tokenized by transformers' tokenizer; without one (tiny test models) both are random
ids (``--seed``) outside the image token and 0 (Gemma's pad, which transformers' embedding keeps
gradient-free). Our side gets ``prefix_lens`` = image tokens + bos + prompt per document, so its
prefix-LM attention (components/prefix_attention.py) is compared with transformers' mask built
from ``token_type_ids``; then both run again without them (plain causal). Positions count from 1 in
each document, as transformers' default.

Images: the given ``--image`` files (document i takes image i mod n) or random ones, resized to the
tower's square ``image_size`` (PIL bicubic, /255, mean = std = 0.5): ours vs transformers'
``SiglipImageProcessorPil`` are compared, then both models get transformers' pixels (omniweave's
data pipeline has no PaliGemma resize mode yet). Compared: pixel_values, logits with and without
the prefix.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import torch

from omniweave.models.hf.paligemma import image_token_id, num_image_tokens

PROMPT_SUFFIX = ((5, 6), (8, 3))  # random prompt / suffix lengths of the two documents (tokenizer-less)
CAPTION = "A picture."


def _our_pixels(png: bytes, size: int) -> torch.Tensor:
    """[3, size, size]: RGB, PIL bicubic to size x size, /255, (x - 0.5) / 0.5."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB").resize((size, size), Image.BICUBIC)
    x = np.asarray(image, dtype=np.float32) / 255.0
    return torch.from_numpy((x - 0.5) / 0.5).permute(2, 0, 1)


def patches(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """[T, 3, S, S] images -> [T·(S/p)², 3·p·p] patch rows in raster order (siglip_vit's input)."""
    T, C, S, _ = pixels.shape
    n = S // patch
    return pixels.reshape(T, C, n, patch, n, patch).permute(0, 2, 4, 1, 3, 5).reshape(T * n * n, C * patch * patch)


def _texts(args, hf_dir: Path, hf_cfg: dict) -> tuple[list[tuple[list[int], list[int]]], str]:
    """Per document (prompt ids incl. "\\n", suffix ids incl. eos), and how they were made."""
    text = hf_cfg.get("text_config") or {}
    vocab, image = int(text.get("vocab_size", 257152)), image_token_id(hf_cfg)
    if (hf_dir / "tokenizer.json").exists():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(hf_dir))
        prompt = tok(args.prompt + "\n", add_special_tokens=False)["input_ids"]
        suffix = tok(CAPTION, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return [(prompt, suffix)] * len(PROMPT_SUFFIX), f"--prompt + '\\n' | {CAPTION!r} + eos, the directory's tokenizer"
    g = torch.Generator().manual_seed(args.seed)
    out = []
    for n_prompt, n_suffix in PROMPT_SUFFIX:
        ids = torch.randint(1, vocab - 1, (n_prompt + n_suffix,), generator=g)
        ids[ids >= image] += 1  # never the image token
        out.append((ids[:n_prompt].tolist(), ids[n_prompt:].tolist()))
    return out, f"random prompt | suffix ids {list(PROMPT_SUFFIX)} (no tokenizer.json)"


def verify_paligemma(args, hf_dir: Path, hf_cfg: dict, report) -> int:
    from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil

    from omniweave.models.hf import verify as V

    if args.video:
        print(f"error: {hf_dir} is a PaliGemma model: images only, no --video", file=sys.stderr)
        return 2
    vision = hf_cfg.get("vision_config") or {}
    size, patch = int(vision.get("image_size", 224)), int(vision.get("patch_size", 14))
    n_image, image = num_image_tokens(hf_cfg), image_token_id(hf_cfg)
    bos = int((hf_cfg.get("text_config") or {}).get("bos_token_id", 2))
    texts, how = _texts(args, hf_dir, hf_cfg)
    files = [Path(p).read_bytes() for p in args.image] or [V.random_media(args.seed + i)[0] for i in range(len(texts))]
    pngs = [files[i % len(files)] for i in range(len(texts))]
    from PIL import Image

    processor = SiglipImageProcessorPil(size={"height": size, "width": size}, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    hf_pixels = processor([Image.open(io.BytesIO(b)) for b in pngs], return_tensors="pt")["pixel_values"]
    ours_pixels = torch.stack([_our_pixels(b, size) for b in pngs])
    rows = [("pixel_values", (hf_pixels - ours_pixels).abs().max().item(),
             f"{len(pngs)} image(s) at {size} px: PIL bicubic + 0.5 normalisation vs SiglipImageProcessorPil; "
             "both models get HF's")]  # fmt: skip

    docs, prefix, token_types = [], [], []
    for prompt, suffix in texts:
        docs.append(torch.tensor([image] * n_image + [bos] + prompt + suffix))
        prefix.append(n_image + 1 + len(prompt))
        token_types.append(torch.tensor([0] * prefix[-1] + [1] * len(suffix)))
    lengths = [d.numel() for d in docs]
    side = size // patch
    batch = {"input_ids": torch.cat(docs), "position_ids": torch.cat([torch.arange(n) + 1 for n in lengths])[None],
             "cu_seqlens": torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32),
             "pixel_values": patches(hf_pixels, patch), "grid_thw": torch.tensor([[1, side, side]] * len(docs)),
             "media_spans": torch.tensor([[start, n_image] for start in [0, *np.cumsum(lengths)[:-1]]])}  # fmt: skip
    hf_model, ours = V.load_pair(args, hf_dir, hf_cfg)
    with torch.no_grad():
        for name, prefixed in (("logits", True), ("logits causal", False)):
            ref = torch.cat([hf_model(input_ids=d[None], pixel_values=hf_pixels[i:i + 1],
                                      **({"token_type_ids": token_types[i][None]} if prefixed else {})).logits[0]
                             for i, d in enumerate(docs)])  # fmt: skip
            got = ours.logits({**batch, "prefix_lens": torch.tensor(prefix)} if prefixed else batch)
            what = (f"prefix-LM: prefix_lens {prefix} vs token_type_ids" if prefixed
                    else "no token_type_ids / prefix_lens: causal")  # fmt: skip
            rows.append((name, (ref - got).abs().max().item(),
                         f"[{ref.shape[0]}, {ref.shape[1]}] fp32; documents {lengths} packed (omniweave) vs each alone "
                         f"(transformers); {what}"))  # fmt: skip
    print(f"text: {how}")
    return report(rows, args.atol)
