"""``omniweave hf verify`` for LLaVA-OneVision (``model_type: llava_onevision``): one conversation
with images (and a video) through transformers and through omniweave's data pipeline + model.

Ours: ``SampleProcessor`` with ``data.vision.tiling: anyres`` (tile size, pinpoint grid and
normalisation from the directory's ``preprocessor_config.json``, else the model's config), the
template ``--template`` (``auto``: the built-in ``llava_onevision``, the released template's text),
1-D positions. Theirs: ``LlavaOnevisionImageProcessorPil`` for the tiles and image sizes (a
conversation with several images takes its multi-image path: one padded square tile each), and,
when the directory has a chat template, transformers' tokenizer rendering it with each
``<image>`` repeated as ``LlavaOnevisionProcessor`` counts (its own ``_get_number_of_features``).
A video's frames reach transformers as our pixels (its video processor is a torchvision class;
the frames' pixels are compared with it in tests/test_llava_onevision_data.py). Compared: image
sizes, input ids, tiles, logits.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from omniweave.models.hf.llava_onevision import _anyres_max, _square_grid


def vision_settings(hf_dir: Path, hf_cfg: dict) -> dict:
    """``data.vision`` for a LLaVA-OneVision directory (its image processor config if it has one)."""
    vc = hf_cfg.get("vision_config") or {}
    tile, patch = int(vc.get("image_size", 384)), int(vc.get("patch_size", 14))
    pinpoints = hf_cfg.get("image_grid_pinpoints")
    out = {"tiling": "anyres", "tile_size": tile, "patch_size": patch, "merge_size": 1, "temporal_patch_size": 1,
           "anyres_max": _anyres_max(hf_cfg.get("vision_aspect_ratio", "anyres_max_9")),
           "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}  # fmt: skip
    file = hf_dir / "preprocessor_config.json"
    if file.exists():
        hf = json.loads(file.read_text())
        size = hf.get("size") or {}
        if size.get("height") != size.get("width") or (size and int(size["height"]) != tile):
            raise ValueError(f"{file}: size {size} is not the tower's {tile} x {tile} tile")
        pinpoints = hf.get("image_grid_pinpoints", pinpoints)
        out |= {k: [float(x) for x in hf[k]] for k in ("image_mean", "image_std") if k in hf}
    out["anyres_grid"] = _square_grid(pinpoints, tile)
    return out


def _hf_token_counts(sample, hf_sizes: list[list[int]], multi: bool, vision, pinpoints) -> list[int]:
    """The ``<image>`` / ``<video>`` tokens LlavaOnevisionProcessor writes per item (its own code)."""
    from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor

    side = vision.tile_size // vision.patch_size
    me = SimpleNamespace(image_processor=SimpleNamespace(image_grid_pinpoints=pinpoints), num_image_tokens=side * side,
                         vision_aspect_ratio=f"anyres_max_{vision.anyres_max}")  # fmt: skip
    me._get_unpadded_features = lambda *a: LlavaOnevisionProcessor._get_unpadded_features(me, *a)
    counts, images = [], iter(hf_sizes)
    for span in sample.media:
        if span.kind == "video":
            counts.append(span.grid_thw[0] * math.ceil(side / 2) ** 2 + 1)
        elif multi:
            counts.append(side * side + 1)
        else:
            h, w = next(images)
            counts.append(LlavaOnevisionProcessor._get_number_of_features(me, h, w, vision.tile_size, vision.tile_size))
    return counts


def verify_llava_onevision(args, hf_dir: Path, hf_cfg: dict, report) -> int:
    from PIL import Image
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil

    from omniweave.models.hf import verify as V

    if args.template in ("auto", "hf"):  # the built-in renders the released template's text
        args.template = "llava_onevision"
    proc, raw, sample = V._sample(args, hf_dir, hf_cfg, vision=vision_settings(hf_dir, hf_cfg), rope="rope1d",
                                  default_template="llava_onevision")  # fmt: skip
    for key, pad in (("image_token_index", proc.image_pad_id), ("video_token_index", proc.video_pad_id)):
        if hf_cfg.get(key) != pad:
            print(f"error: config {key}={hf_cfg.get(key)} but the tokenizer's pad token id is {pad}")
            return 2
    vision = proc.vision
    side, tile = vision.tile_size // vision.patch_size, vision.tile_size
    pinpoints = [[h, w] for h in range(tile, tile * vision.anyres_grid + 1, tile)
                 for w in range(tile, tile * vision.anyres_grid + 1, tile)]  # fmt: skip
    images = [s for s in sample.media if s.kind == "image"]
    videos = [s for s in sample.media if s.kind == "video"]
    ours_pv = [torch.from_numpy(proc.process_media(s, raw.media[s.part])) for s in sample.media]
    rows, hf_kw = [], {}
    if images:
        processor = LlavaOnevisionImageProcessorPil(size={"height": tile, "width": tile}, image_grid_pinpoints=pinpoints,
                                                    image_mean=list(vision.image_mean), image_std=list(vision.image_std))  # fmt: skip
        out = processor([[Image.open(io.BytesIO(raw.media[s.part])) for s in images]], return_tensors="pt")
        hf_sizes = out["image_sizes"].tolist()
        ours_sizes = [list(s.resized_hw) for s in images]
        rows.append(("image_sizes", 0.0 if hf_sizes == ours_sizes else None, f"ours {ours_sizes}, HF {hf_sizes}"))
        hf_kw |= {"pixel_values": out["pixel_values"], "image_sizes": out["image_sizes"],
                  "batch_num_images": torch.as_tensor(out["batch_num_images"])}  # fmt: skip
        worst = 0.0
        for k, s in enumerate(images):
            t, p = s.grid_thw[0], vision.patch_size
            ours = ours_pv[sample.media.index(s)].reshape(t, side, side, 3, p, p).permute(0, 3, 1, 4, 2, 5)
            theirs = out["pixel_values"][k, :t, :, :side * p, :side * p]  # SigLIP never reads past the last whole patch
            worst = max(worst, (ours.reshape(theirs.shape) - theirs).abs().max().item())
        rows.append(("pixel_values", worst, f"{len(images)} image(s): omniweave.data.media.anyres vs "
                                            "LlavaOnevisionImageProcessorPil"))  # fmt: skip
    else:
        hf_sizes = []
    if videos:
        frames = [ours_pv[sample.media.index(s)] for s in videos]
        p = vision.patch_size
        hf_kw["pixel_values_videos"] = torch.stack([f.reshape(-1, side, side, 3, p, p).permute(0, 3, 1, 4, 2, 5)
                                                    .reshape(-1, 3, side * p, side * p) for f in frames])  # fmt: skip
        rows.append(("pixel_values", 0.0, "videos: HF given ours (its video processor is a torchvision class)"))
    counts = _hf_token_counts(sample, hf_sizes, len(images) > 1, vision, pinpoints)
    ids = torch.from_numpy(sample.input_ids.astype(np.int64))
    pads = {"image": proc.template.image_pad, "video": proc.template.video_pad}
    hf_ids = V._hf_rendered_ids(hf_dir, raw, proc, [pads[s.kind] * n for s, n in zip(sample.media, counts)])
    how = "HF renders the directory's chat template" if hf_ids is not None else "HF given our text"
    if hf_ids is None:
        hf_ids = V.ids_at_hf_counts(ids, sample.media, counts)
    same = hf_ids.shape[1] == ids.numel() and torch.equal(hf_ids[0], ids)
    rows.insert(0, ("input_ids", 0.0 if same else None, f"L={ids.numel()} (HF {hf_ids.shape[1]}); {how}, "
                                                         f"ours template {proc.template.name!r}"))  # fmt: skip
    if any(d is None for _, d, _ in rows):
        return report(rows, args.atol)
    hf_model, ours = V.load_pair(args, hf_dir, hf_cfg)
    batch = {"input_ids": ids, "position_ids": torch.arange(ids.numel())[None],
             "grid_thw": torch.tensor([s.grid_thw for s in sample.media], dtype=torch.long),
             "image_sizes": torch.tensor([list(s.resized_hw) if s.kind == "image" else [0, 0] for s in sample.media]),
             "pixel_values": torch.cat(ours_pv), "media_spans": torch.tensor([r for s in sample.media for r in s.ranges()]),
             "cu_seqlens": torch.tensor([0, ids.numel()], dtype=torch.int32)}  # fmt: skip
    with torch.no_grad():
        ref = hf_model(input_ids=hf_ids, **hf_kw).logits[0]
        got = ours.logits(batch)
    rows.append(("logits", (ref - got).abs().max().item(), f"[{ref.shape[0]}, {ref.shape[1]}] fp32, 1-D positions"))
    return report(rows, args.atol)
