"""``omniweave hf verify`` for InternVL (``model_type: internvl``): one conversation with images
through transformers and through omniweave's data pipeline + model.

Ours: ``SampleProcessor`` with ``data.vision.tiling: internvl`` (tile size, tile limits and
normalisation from the directory's ``preprocessor_config.json``, else the model's ``image_size``
and the processor's defaults), the template ``--template`` (``auto``: the built-in ``internvl``,
which renders the released Jinja's text plus InternVLProcessor's framing), 1-D positions. Theirs: ``GotOcr2ImageProcessorPil`` with
``crop_to_patches`` (what ``InternVLProcessor`` runs) for the tiles, and — when the directory has a
chat template — transformers' tokenizer rendering it, each ``<IMG_CONTEXT>`` replaced by
``<img>`` + ``<IMG_CONTEXT>`` × 256·tiles + ``</img>`` as ``InternVLProcessor`` does. Compared:
input ids, tile counts, pixel values (tiles), logits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

IMAGENET = {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}


def vision_settings(hf_dir: Path, hf_cfg: dict) -> dict:
    """``data.vision`` for an InternVL directory: its GotOcr2 image processor config if it has
    one, else the tower's ``image_size`` with the processor's defaults (1-12 tiles, thumbnail)."""
    vc = hf_cfg.get("vision_config") or {}
    side = vc.get("image_size", 448)
    side = side[0] if isinstance(side, (list, tuple)) else side
    patch = vc.get("patch_size", 14)
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    out = {"tiling": "internvl", "patch_size": int(patch), "merge_size": round(1 / float(hf_cfg.get("downsample_ratio", 0.5))),
           "temporal_patch_size": 1, "tile_size": int(side), **IMAGENET}  # fmt: skip
    file = hf_dir / "preprocessor_config.json"
    if file.exists():
        hf = json.loads(file.read_text())
        if not hf.get("crop_to_patches", False):
            out["max_tiles"] = 1  # InternVLProcessor turns cropping on by default; a config that turns it off
        size = hf.get("size") or {}
        if size:
            if size.get("height") != size.get("width"):
                raise ValueError(f"{file}: only square tiles are supported, got size {size}")
            out["tile_size"] = int(size["height"])
        out |= {k: v for k, v in (("min_tiles", hf.get("min_patches")), ("max_tiles", hf.get("max_patches"))) if v}
        out |= {k: [float(x) for x in hf[k]] for k in ("image_mean", "image_std") if k in hf}
    return out


def _hf_image_processor(vision):
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    s = vision.tile_size
    return GotOcr2ImageProcessorPil(crop_to_patches=vision.max_tiles > 1, min_patches=vision.min_tiles,
                                    max_patches=vision.max_tiles, size={"height": s, "width": s},
                                    image_mean=list(vision.image_mean), image_std=list(vision.image_std))  # fmt: skip


def _tiles(patches: torch.Tensor, tiles: int, p: int) -> torch.Tensor:
    """Our patch rows [T·n², 3·p·p] (raster per tile) back to tiles [T, 3, n·p, n·p]."""
    n = round((patches.shape[0] // tiles) ** 0.5)
    return patches.reshape(tiles, n, n, 3, p, p).permute(0, 3, 1, 4, 2, 5).reshape(tiles, 3, n * p, n * p)


def verify_internvl(args, hf_dir: Path, hf_cfg: dict, report) -> int:
    from PIL import Image

    from omniweave.models.hf import verify as V

    if args.video:
        print(f"error: {hf_dir} is InternVL; its videos (frames as single tiles) are not supported by hf verify yet",
              file=sys.stderr)  # fmt: skip
        return 2
    args.video = []
    if args.template in ("auto", "hf"):  # InternVL's own Jinja leaves the image framing to its processor
        args.template = "internvl"
    proc, raw, sample = V._sample(args, hf_dir, hf_cfg, vision=vision_settings(hf_dir, hf_cfg), rope="rope1d",
                                  default_template="internvl", with_video=False)  # fmt: skip
    if hf_cfg.get("image_token_id") != proc.image_pad_id:
        print(f"error: config image_token_id={hf_cfg.get('image_token_id')} but the tokenizer's "
              f"{proc.template.image_pad} id is {proc.image_pad_id}", file=sys.stderr)  # fmt: skip
        return 2
    vision, p = proc.vision, proc.vision.patch_size
    ours_pv = [torch.from_numpy(proc.process_media(s, raw.media[s.part])) for s in sample.media]
    ours_tiles = [s.grid_thw[0] for s in sample.media]
    hf_proc = _hf_image_processor(vision)
    hf_out = hf_proc([Image.open(__import__("io").BytesIO(raw.media[s.part])) for s in sample.media],
                     return_tensors="pt")  # fmt: skip
    hf_tiles = [int(n) for n in hf_out["num_patches"]]
    per_tile = (vision.tile_size // p // vision.merge_size) ** 2
    ids = torch.from_numpy(sample.input_ids.astype(np.int64))
    img_ctx = proc.template.image_pad
    replacements = [img_ctx * (per_tile * n) for n in hf_tiles]  # inside the template's own <img> … </img>
    hf_ids = V._hf_rendered_ids(hf_dir, raw, proc, [f"<img>{r}</img>" for r in replacements])
    how = (f"HF renders the directory's chat template, ours template {proc.template.name!r}" if hf_ids is not None
           else "HF given our text")
    if hf_ids is None:  # our ids, each image's run of pads at HF's count
        pieces, cursor = [], 0
        for s, n in zip(sample.media, hf_tiles):
            pieces += [ids[cursor:s.start], ids[s.start:s.start + 1].repeat(n * per_tile)]
            cursor = s.end
        hf_ids = torch.cat(pieces + [ids[cursor:]])[None]
    rows = []
    same_ids = hf_ids.shape[1] == ids.numel() and torch.equal(hf_ids[0], ids)
    rows.append(("input_ids", 0.0 if same_ids else None, f"L={ids.numel()} (HF {hf_ids.shape[1]}); {how}"))
    rows.append(("tiles", 0.0 if hf_tiles == ours_tiles else None, f"per image: ours {ours_tiles}, HF {hf_tiles}"))
    if hf_tiles == ours_tiles:
        ours_px = torch.cat([_tiles(pv, n, p) for pv, n in zip(ours_pv, ours_tiles)])
        rows.append(("pixel_values", (ours_px - hf_out["pixel_values"]).abs().max().item(),
                     f"tiles {list(ours_px.shape)}: omniweave.data.media.tiling vs GotOcr2ImageProcessorPil"))  # fmt: skip
    if any(d is None for _, d, _ in rows):
        return report(rows, args.atol)
    hf_model, ours = V.load_pair(args, hf_dir, hf_cfg)
    batch = {"input_ids": ids, "position_ids": torch.arange(ids.numel())[None],
             "grid_thw": torch.tensor([s.grid_thw for s in sample.media], dtype=torch.long),
             "pixel_values": torch.cat(ours_pv), "media_spans": torch.tensor([r for s in sample.media for r in s.ranges()]),
             "cu_seqlens": torch.tensor([0, ids.numel()], dtype=torch.int32)}  # fmt: skip
    with torch.no_grad():
        ref = hf_model(input_ids=hf_ids, pixel_values=hf_out["pixel_values"]).logits[0]
        got = ours.logits(batch)
    rows.append(("logits", (ref - got).abs().max().item(), f"[{ref.shape[0]}, {ref.shape[1]}] fp32, 1-D positions"))
    return report(rows, args.atol)
