"""``omniweave hf verify`` for InternVL (``model_type: internvl``): one conversation with images
and videos through transformers and through omniweave's data pipeline + model.

Ours: ``SampleProcessor`` with ``data.vision.tiling: internvl`` (tile size, tile limits and
normalisation from the directory's ``preprocessor_config.json``, else the model's ``image_size``
and the processor's defaults; frame sampling from its ``video_preprocessor_config.json``: ``fps``,
or ``num_frames`` as ``min_frames = max_frames``, ``min_frames`` 1 so our clamp never moves
transformers' count), the template ``--template`` (``auto``: the built-in ``internvl``, which
renders the released Jinja's text plus InternVLProcessor's framing), 1-D positions. Theirs:
``GotOcr2ImageProcessorPil`` with ``crop_to_patches`` (what ``InternVLProcessor`` runs) for the
tiles; ``InternVLVideoProcessor`` (the directory's, else one built with our tile side and
normalisation) on the file decoded by transformers' PyAV reader, sampling the frames itself
(``do_sample_frames``, our ``fps``; our frame count where transformers' own would fall outside
our limits, said in the row); and — when the directory has a chat template — transformers'
tokenizer rendering it, each ``<IMG_CONTEXT>`` replaced by ``<img>`` + ``<IMG_CONTEXT>`` ×
256·tiles + ``</img>`` and each ``<video>`` by ``InternVLProcessor.replace_video_token``'s
frames (``Frame1: <img>…</img>\n…``) as ``InternVLProcessor`` does; without one, our rendered
text with the same replacements. Compared: input ids, tile counts, frames, pixel values (tiles,
frames), logits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

from omniweave.errors import UserError

from omniweave.data.media.vision import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

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
        kind = hf.get("image_processor_type", "GotOcr2ImageProcessor")
        if not kind.startswith("GotOcr2ImageProcessor"):  # the tiling rule here is GotOcr2's (InternVL3's -hf)
            raise UserError(f"{file}: image_processor_type {kind!r}; only GotOcr2ImageProcessor's tiling is implemented")
        if not hf.get("crop_to_patches", False):
            out["max_tiles"] = 1  # InternVLProcessor turns cropping on by default; a config that turns it off
        size = hf.get("size") or {}
        if size:
            if size.get("height") != size.get("width"):
                raise UserError(f"{file}: only square tiles are supported, got size {size}")
            out["tile_size"] = int(size["height"])
        out |= {k: v for k, v in (("min_tiles", hf.get("min_patches")), ("max_tiles", hf.get("max_patches"))) if v}
        out |= {k: [float(x) for x in hf[k]] for k in ("image_mean", "image_std") if k in hf}
    return out | video_settings(hf_dir, out)


def video_settings(hf_dir: Path, vision: dict) -> dict:
    """Frame sampling for ``vision`` from the directory's ``InternVLVideoProcessor`` config:
    ``num_frames`` as min = max frames, else its ``fps`` (else ours); ``min_frames`` 1, so our clamp
    equals transformers wherever it samples at all. ``UserError`` when its frames would not be
    tiles of ``vision`` (another side, other mean / std)."""
    out = {"min_frames": 1}
    file = hf_dir / "video_preprocessor_config.json"
    if not file.exists():
        return out
    hf = json.loads(file.read_text())
    side = (hf.get("size") or {"height": 384, "width": 384})  # InternVLVideoProcessor's class default
    if (side.get("height"), side.get("width")) != (vision["tile_size"], vision["tile_size"]):
        raise UserError(f"{file}: frames resized to {side}, but tiles are {vision['tile_size']} px: omniweave "
                        "resizes every frame to one tile")  # fmt: skip
    for key, default in (("image_mean", OPENAI_CLIP_MEAN), ("image_std", OPENAI_CLIP_STD)):
        if [float(x) for x in hf.get(key, default)] != [float(x) for x in vision[key]]:
            raise UserError(f"{file}: {key} {hf.get(key, default)} differs from the images' {vision[key]}; "
                            "omniweave normalises images and frames alike")  # fmt: skip
    if hf.get("num_frames"):
        return {"min_frames": int(hf["num_frames"]), "max_frames": int(hf["num_frames"])}
    return out | ({"fps": float(hf["fps"])} if hf.get("fps") else {})


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


def _hf_video_processor(hf_dir: Path, vision):
    """(InternVLVideoProcessor, where it came from): the directory's, else one of our tile side and
    normalisation."""
    from transformers.models.internvl.video_processing_internvl import InternVLVideoProcessor

    if (hf_dir / "video_preprocessor_config.json").exists():
        return InternVLVideoProcessor.from_pretrained(str(hf_dir)), "the directory's InternVLVideoProcessor"
    side = {"height": vision.tile_size, "width": vision.tile_size}
    return (InternVLVideoProcessor(size=side, image_mean=list(vision.image_mean), image_std=list(vision.image_std)),
            "InternVLVideoProcessor of our tile side and mean / std (no video_preprocessor_config.json)")  # fmt: skip


def _hf_videos(hf_dir: Path, raw, spans, vision) -> tuple[list | None, str]:
    """Per video span (frame indices, frames [F, 3, S, S]) from ``InternVLVideoProcessor`` on the file
    decoded by transformers' PyAV reader, sampling itself (``do_sample_frames``); None and why
    when torchvision (its resize) does not load here."""
    import tempfile

    from transformers.video_utils import load_video

    from omniweave.models.hf.torchvision_guard import torchvision_loads, why_not

    if not spans:
        return [], ""
    if not torchvision_loads():
        return None, f"HF given our frames (InternVLVideoProcessor needs torchvision; {why_not()})"
    processor, origin = _hf_video_processor(hf_dir, vision)
    out, notes = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i, span in enumerate(spans):
            path = Path(tmp) / f"video{i}"
            path.write_bytes(raw.media[span.part])
            try:
                frames, meta = load_video(str(path), backend="pyav",
                                          sample_indices_fn=lambda metadata, **_: np.arange(metadata.total_num_frames))  # fmt: skip
            except IndexError:  # its reader takes the header's frame count, which Matroska does not store
                frames, meta = _our_decode(raw.media[span.part])
                notes.append(f"video {i}: decoded by omniweave (transformers' PyAV reader finds no frame count)")
            if len(span.frame_indices) == 1:  # its sample_frames' one index, a 1-element tensor, is a scalar
                got = processor(videos=[frames[list(span.frame_indices)]], do_sample_frames=False, return_tensors="pt")
                notes.append(f"video {i}: given our one frame (transformers cannot sample a single frame from an "
                             "array: NumPy takes its 1-element index tensor as a scalar)")  # fmt: skip
                out.append((list(span.frame_indices), got["pixel_values_videos"][0]))
                continue
            kw = {}
            if processor.num_frames is None:  # its fps count where our limits keep it, else our count
                wanted = int(meta.total_num_frames / meta.fps * vision.fps)
                if vision.min_frames <= wanted <= min(vision.max_frames, meta.total_num_frames):
                    kw["fps"] = vision.fps
                else:
                    kw["num_frames"] = len(span.frame_indices)
                    notes.append(f"video {i}: num_frames={kw['num_frames']} (its fps count {wanted} is outside "
                                 f"[{vision.min_frames}, {vision.max_frames}] or over {meta.total_num_frames} frames)")
            got = processor(videos=[frames], video_metadata=[meta], do_sample_frames=True, return_metadata=True,
                            return_tensors="pt", **kw)  # fmt: skip
            out.append(([int(j) for j in got["video_metadata"][0].frames_indices], got["pixel_values_videos"][0]))
    how = f"its num_frames={processor.num_frames}" if processor.num_frames is not None else f"fps={vision.fps:g}"
    return out, "; ".join([f"{origin} sampling itself (do_sample_frames, {how})", *notes])


def _our_decode(data: bytes):
    """Every frame [N, H, W, 3] of a video and transformers' ``VideoMetadata`` of it, by our decoder."""
    from transformers.video_utils import VideoMetadata

    from omniweave.data.media.vision import decode_video_frames, probe_video

    info = probe_video(data)
    frames = np.stack(decode_video_frames(data, tuple(range(info.num_frames))))
    return frames, VideoMetadata(total_num_frames=info.num_frames, fps=info.fps, height=info.height, width=info.width)


def _hf_video_text(frames: torch.Tensor, img_ctx: str, per_tile: int) -> str:
    """What ``InternVLProcessor.replace_video_token`` writes for a video of these frames [F, 3, S, S]."""
    from types import SimpleNamespace

    from transformers.models.internvl.processing_internvl import InternVLProcessor

    tokens = SimpleNamespace(start_image_token="<img>", end_image_token="</img>", image_token=img_ctx,
                             image_seq_length=per_tile)  # fmt: skip
    return InternVLProcessor.replace_video_token(tokens, {"pixel_values_videos": [frames]}, 0)


def _our_text_ids(proc, raw, replacements: list[str]) -> torch.Tensor:
    """[1, L]: our template's text, each media marker (an image's pad inside ``<img> … </img>``, the
    pad marking a video's place) replaced by ``replacements[i]``, in our tokenizer (a directory
    without a chat template)."""
    from omniweave.models.hf.verify import replace_markers

    text = proc.template.render(proc.messages(raw.conversation)).text
    pads = (proc.template.image_pad, proc.template.video_pad)
    return torch.tensor([proc.tokenizer.encode(replace_markers(text, pads, replacements))])


def verify_internvl(args, hf_dir: Path, hf_cfg: dict, report) -> int:
    from PIL import Image

    from omniweave.models.hf import verify as V

    if args.template in ("auto", "hf"):  # InternVL's own Jinja leaves the image framing to its processor
        args.template = "internvl"
    proc, raw, sample = V._sample(args, hf_dir, hf_cfg, vision=vision_settings(hf_dir, hf_cfg), rope="rope1d",
                                  default_template="internvl")  # fmt: skip
    if hf_cfg.get("image_token_id") != proc.image_pad_id:
        print(f"error: config image_token_id={hf_cfg.get('image_token_id')} but the tokenizer's "
              f"{proc.template.image_pad} id is {proc.image_pad_id}", file=sys.stderr)  # fmt: skip
        return 2
    vision, p = proc.vision, proc.vision.patch_size
    images = [s for s in sample.media if s.kind == "image"]
    videos = [s for s in sample.media if s.kind == "video"]
    ours_pv = [torch.from_numpy(proc.process_media(s, raw.media[s.part])) for s in sample.media]
    ours_tiles = [s.grid_thw[0] for s in images]
    hf_out = {"pixel_values": torch.zeros(0, 3, vision.tile_size, vision.tile_size), "num_patches": []}
    if images:
        hf_out = _hf_image_processor(vision)([Image.open(__import__("io").BytesIO(raw.media[s.part])) for s in images],
                                             return_tensors="pt")  # fmt: skip
    hf_tiles = [int(n) for n in hf_out["num_patches"]]
    hf_videos, video_note = _hf_videos(hf_dir, raw, videos, vision)
    if hf_videos is None:  # no torchvision: our frames
        hf_videos = [(list(s.frame_indices), _tiles(pv, s.grid_thw[0], p))
                     for s, pv in zip(sample.media, ours_pv) if s.kind == "video"]  # fmt: skip
    per_tile = (vision.tile_size // p // vision.merge_size) ** 2
    ids = torch.from_numpy(sample.input_ids.astype(np.int64))
    img_ctx = proc.template.image_pad
    image_pads = iter([img_ctx * (per_tile * n) for n in hf_tiles])
    video_texts = iter([_hf_video_text(frames, img_ctx, per_tile) for _, frames in hf_videos])
    markers = [("image", next(image_pads)) if s.kind == "image" else ("video", next(video_texts)) for s in sample.media]
    # what InternVLProcessor replaces in the rendered template: each <IMG_CONTEXT> (an image) and <video>
    hf_markers = tuple(m.rstrip("\n") for m in (proc.template.processor_image, proc.template.processor_video) if m)
    hf_ids = V._hf_rendered_ids(hf_dir, raw, proc, [f"<img>{r}</img>" if kind == "image" else r for kind, r in markers],
                                hf_markers or None)  # fmt: skip
    how = f"HF renders the directory's chat template, ours template {proc.template.name!r}"
    if hf_ids is None:  # our text: the images' pads inside the template's own <img> … </img>
        hf_ids = _our_text_ids(proc, raw, [r for _, r in markers])
        how = "HF given our text, each marker replaced as InternVLProcessor does"
    rows = []
    same_ids = hf_ids.shape[1] == ids.numel() and torch.equal(hf_ids[0], ids)
    rows.append(("input_ids", 0.0 if same_ids else None, f"L={ids.numel()} (HF {hf_ids.shape[1]}); {how}"))
    if images:
        rows.append(("tiles", 0.0 if hf_tiles == ours_tiles else None, f"per image: ours {ours_tiles}, HF {hf_tiles}"))
    if images and hf_tiles == ours_tiles:
        ours_px = torch.cat([_tiles(pv, s.grid_thw[0], p) for s, pv in zip(sample.media, ours_pv) if s.kind == "image"])
        rows.append(("pixel_values", (ours_px - hf_out["pixel_values"]).abs().max().item(),
                     f"tiles {list(ours_px.shape)}: omniweave.data.media.tiling vs GotOcr2ImageProcessorPil"))  # fmt: skip
    if videos:
        ours_idx, hf_idx = [list(s.frame_indices) for s in videos], [idx for idx, _ in hf_videos]
        rows.append(("frames", 0.0 if ours_idx == hf_idx else None, f"per video: ours {ours_idx}, HF {hf_idx}; {video_note}"))
    if videos and ours_idx == hf_idx:
        ours_fr = torch.cat([_tiles(pv, s.grid_thw[0], p) for s, pv in zip(sample.media, ours_pv) if s.kind == "video"])
        note = f"frames {list(ours_fr.shape)}, each one tile: omniweave.data.media.tiling vs InternVLVideoProcessor"
        rows.append(("video_pixels", (ours_fr - torch.cat([f for _, f in hf_videos])).abs().max().item(), note))
    if any(d is None for _, d, _ in rows):
        return report(rows, args.atol)
    image_tiles = iter(torch.split(hf_out["pixel_values"], hf_tiles) if images else [])
    video_frames = iter([frames for _, frames in hf_videos])
    # InternVLProcessor's order: each item's tiles or frames where it sits in the text
    hf_pixels = [next(image_tiles) if s.kind == "image" else next(video_frames) for s in sample.media]
    hf_model, ours = V.load_pair(args, hf_dir, hf_cfg)
    batch = {"input_ids": ids, "position_ids": torch.arange(ids.numel())[None],
             "grid_thw": torch.tensor([s.grid_thw for s in sample.media], dtype=torch.long),
             "pixel_values": torch.cat(ours_pv), "media_spans": torch.tensor([r for s in sample.media for r in s.ranges()]),
             "cu_seqlens": torch.tensor([0, ids.numel()], dtype=torch.int32)}  # fmt: skip
    with torch.no_grad():
        ref = hf_model(input_ids=hf_ids, pixel_values=torch.cat(hf_pixels)).logits[0]
        got = ours.logits(batch)
    rows.append(("logits", (ref - got).abs().max().item(), f"[{ref.shape[0]}, {ref.shape[1]}] fp32, 1-D positions"))
    return report(rows, args.atol)
