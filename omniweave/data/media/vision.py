"""Images and videos the Qwen2-VL way: header probing, smart resize, frame sampling, patchify.

Two paths that must always agree:

    plan_image(probe_image(data), cfg)   header only -> grid_thw, resize target   (packing time)
    process_image(data, cfg)             decode + resize + normalise + patchify   (train time)

and the same for videos, where the plan also fixes which source frames are used (decided from
the stream header alone: frame count, frame rate, size), so decoding reads exactly those frames.
With ``tiling: internvl`` images are cut into InternVL's dynamic tiles instead, and each sampled
video frame is one tile (media/tiling.py: ``InternVLVideoProcessor``'s rule); with ``tiling: anyres``
LLaVA-OneVision's (media/anyres_plan.py, the rules in media/anyres.py).

Images follow ``transformers.Qwen2VLImageProcessorPil`` exactly (RGB with alpha composited on
white, PIL bicubic resize of uint8 pixels, rescale in float64 then float32, normalise, patchify).
Videos follow one of three rules, ``VisionConfig.frame_sampling`` (a recipe's family sets it):

- ``qwen_vl_utils`` (default; Qwen2-VL / Qwen2.5-VL as Qwen trained them) and ``transformers``
  (``Qwen2VLVideoProcessor``, which Qwen2.5-VL uses too, with ``do_sample_frames``): ``fps``
  sampling clamped to [min_frames, max_frames] and rounded down to a multiple of the temporal patch,
  a per-frame pixel cap of ``video_max_pixels`` and the whole video's ``video_total_pixels`` share.
  qwen-vl-utils rounds ``linspace(0, n - 1, k)``, ceils ``min_frames`` to the temporal patch and
  divides the budget in floats; transformers truncates ``arange(0, n, n / k)`` and divides in
  integers (``total * tp // k``).
- ``qwen3_vl`` (``Qwen3VLVideoProcessor``): ``int(n / fps_src * fps)`` frames clamped to
  [min_frames, min(max_frames, n)], not rounded to the temporal patch, at rounded
  ``linspace(0, n - 1, k)``; one resize for the whole clip whose pixel limits
  ``video_min_pixels`` / ``video_max_pixels`` (its ``size`` dict) bound frames × height × width.

In every rule the last frame is repeated up to a multiple of ``temporal_patch_size``. All resize
the decoded uint8 frames with torchvision's bicubic antialiased resize, which on the CPU is torch's
uint8 ``interpolate`` (not PIL), and normalise in float32 as ``(x - 255·mean) / (255·std)``; so do
we, which makes our video pixels equal transformers' (tests/test_video_parity.py,
tests/test_video_sampling.py).
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Mapping

import numpy as np
from PIL import Image

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_ASPECT_RATIO = 200  # transformers' smart_resize refuses anything more elongated
# Pixels of one decoded image or video frame (its header size, checked before decoding): Pillow's own
# bomb limit is the ceiling, which training decodes up to; `data convert --max-image-pixels` rejects
# more than its default (8192 x 8192, 192 MiB as RGB) unless raised, at most to the ceiling.
IMAGE_PIXELS_CEILING = 178_956_970
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192


class MediaError(ValueError):
    """A media item that cannot be used; ``reason`` is a short machine-readable tag."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason, self.message = reason, message


@dataclass(frozen=True)
class VisionConfig:
    """Vision processing parameters (Qwen2-VL / Qwen2.5-VL defaults)."""

    patch_size: int = 14
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    video_min_pixels: int = 128 * 28 * 28
    video_max_pixels: int = 768 * 28 * 28
    video_total_pixels: int = int(128000 * 28 * 28 * 0.9)
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    tokens_per_second: float = 2.0  # Qwen2.5-VL temporal position scale
    position_id_per_seconds: int = 25  # Qwen2.5-Omni (rope: mrope_omni): temporal positions per second
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    frame_sampling: str = "qwen_vl_utils"  # video rule: qwen_vl_utils | transformers | qwen3_vl (module doc)
    tiling: str = "none"  # images: none (smart resize) | internvl (dynamic tiles: media/tiling.py) | pad (one
    # tile_size square, aspect kept, centred on black: Pi0.5's resize_with_pad, media/pad_resize.py) | anyres
    tile_size: int = 448  # tiling only: side of one tile, a multiple of patch_size x merge_size
    min_tiles: int = 1
    max_tiles: int = 12
    use_thumbnail: bool = True  # tiling only: one more tile, the whole image, when the grid has several
    anyres_grid: int = 6  # anyres: pinpoints (i, j) x tile_size for 1 <= i, j <= anyres_grid (the released 384..2304)
    anyres_max: int = 9  # anyres: vision_aspect_ratio "anyres_max_N" (grids past N tiles' features shrink)

    def __post_init__(self):
        if self.frame_sampling not in FRAME_SAMPLING:
            raise ValueError(f"frame_sampling must be one of {sorted(FRAME_SAMPLING)}, got {self.frame_sampling!r}")
        if self.tiling not in TILING:
            raise ValueError(f"vision tiling must be one of {list(TILING)}, got {self.tiling!r}")
        if self.tiling == "anyres":
            from omniweave.data.media.anyres_plan import check_anyres_config

            check_anyres_config(self)
        elif self.tiling != "none":
            from omniweave.data.media.tiling import check_tiling_config

            check_tiling_config(self)

    @property
    def factor(self) -> int:  # resized sides are multiples of this
        return self.patch_size * self.merge_size

    @property
    def plans_by_image_count(self) -> bool:
        """An image's plan depends on how many images its conversation has (LLaVA-OneVision: one
        image is tiled anyres, several are one tile each): ``plan_image(..., images=n)``."""
        return self.tiling == "anyres"

    @classmethod
    def from_mapping(cls, cfg: Mapping | None) -> "VisionConfig":
        """From a recipe's ``data.vision``; ``preprocessor_config: DIR_OR_JSON`` reads a model's
        Hugging Face image processor config first, and the other keys override it."""
        cfg = {k: v for k, v in (cfg or {}).items() if v is not None}  # null: not set (the recipe schema's default)
        if "preprocessor_config" in cfg:
            cfg = {**vision_settings_from_hf(cfg.pop("preprocessor_config")), **cfg}
        known = {f.name for f in fields(cls)}
        unknown = set(cfg) - known
        if unknown:
            raise ValueError(f"unknown vision keys {sorted(unknown)}; allowed: {sorted(known)}")
        for key in ("image_mean", "image_std"):
            if key in cfg:
                cfg[key] = tuple(float(x) for x in cfg[key])
        return cls(**cfg)

    def spec(self) -> dict:  # untiled: no tile keys, so packs built before tiling existed still match
        skip = TILE_KEYS if self.tiling == "none" else ()
        skip += ANYRES_KEYS if self.tiling != "anyres" else ()  # nor those of packs built before anyres
        return {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v)
                for f in fields(self) if f.name not in skip}


TILING = ("none", "internvl", "anyres", "pad")
TILE_KEYS = ("tiling", "tile_size", "min_tiles", "max_tiles", "use_thumbnail")
ANYRES_KEYS = ("anyres_grid", "anyres_max")


def vision_settings_from_hf(path: str | Path) -> dict:
    """Patch sizes, pixel limits and normalisation constants of a Qwen2-VL-style
    ``preprocessor_config.json`` (a file, or the model directory holding it)."""
    path = Path(path)
    file = path / "preprocessor_config.json" if path.is_dir() else path
    hf = json.loads(file.read_text())
    if not hf.get("do_rescale", True) or not hf.get("do_normalize", True) or hf.get("resample", 3) != 3:
        raise ValueError(f"{file}: only rescale + normalise + bicubic (resample=3) processing is supported")
    if not math.isclose(hf.get("rescale_factor", 1 / 255), 1 / 255):
        raise ValueError(f"{file}: rescale_factor must be 1/255, got {hf['rescale_factor']}")
    out = {k: hf[k] for k in ("patch_size", "merge_size", "temporal_patch_size") if k in hf}
    out.update({k: tuple(float(x) for x in hf[k]) for k in ("image_mean", "image_std") if k in hf})
    return {**out, **_pixel_limits(hf, "min_pixels", "max_pixels")}


def _pixel_limits(hf: dict, min_key: str, max_key: str) -> dict:
    """{min_key, max_key} of a HF processor config: its ``min_pixels`` / ``max_pixels`` (transformers
    4), else ``size.shortest_edge`` / ``size.longest_edge`` (transformers 5, also pixel counts)."""
    size = hf.get("size") or {}
    out = {}
    for ours, legacy, size_key in ((min_key, "min_pixels", "shortest_edge"), (max_key, "max_pixels", "longest_edge")):
        value = hf.get(legacy, size.get(size_key))
        if value is not None:
            out[ours] = int(value)
    return out


def video_settings_from_hf(path: str | Path) -> dict:
    """Pixel limits, fps sampling and frame limits of a Qwen-VL ``video_preprocessor_config.json``
    (a file, or the model directory holding it), and the rule it samples by (``frame_sampling``):
    ``Qwen3VLVideoProcessor`` means ``qwen3_vl`` (its ``size`` bounds frames × height × width);
    ``Qwen2VLVideoProcessor`` with ``do_sample_frames`` means ``transformers``, whose whole-video
    pixel budget is ``max_video_tokens`` × factor² × 0.9 (``cap_pixels_per_frame``). ``ValueError``
    for settings no rule here reproduces: sampling without ``fps``, Qwen3-VL's per-frame cap."""
    path = Path(path)
    file = path / "video_preprocessor_config.json" if path.is_dir() else path
    hf = json.loads(file.read_text())
    qwen3 = hf.get("video_processor_type") == "Qwen3VLVideoProcessor"
    if hf.get("num_frames") is not None or ("fps" in hf and hf["fps"] is None):
        raise ValueError(f"{file}: sampling without fps (num_frames, or fps: null) is not supported")
    if qwen3 and hf.get("cap_pixels_per_frame"):
        raise ValueError(f"{file}: Qwen3VLVideoProcessor's cap_pixels_per_frame is not supported")
    if qwen3:  # its size dict alone (no min_pixels / max_pixels keys), else its class defaults
        size = hf.get("size") or {"shortest_edge": 128 * 32 * 32, "longest_edge": 32 * 32 * 768}
        out = {"video_min_pixels": int(size["shortest_edge"]), "video_max_pixels": int(size["longest_edge"])}
    else:
        out = _pixel_limits(hf, "video_min_pixels", "video_max_pixels")
    for key, kind in (("fps", float), ("min_frames", int), ("max_frames", int)):
        if hf.get(key) is not None:
            out[key] = kind(hf[key])
    if qwen3:  # samples its own way whether it samples itself or is handed frames sampled its way
        out["frame_sampling"] = "qwen3_vl"
    elif hf.get("do_sample_frames"):  # the processor picks the frames itself, its own way
        out["frame_sampling"] = "transformers"
    if not qwen3 and hf.get("cap_pixels_per_frame") and hf.get("max_video_tokens") is not None:
        factor = hf.get("patch_size", VisionConfig.patch_size) * hf.get("merge_size", VisionConfig.merge_size)
        out["video_total_pixels"] = int(hf["max_video_tokens"] * factor * factor * 0.9)
    return out


@dataclass(frozen=True)
class ImageInfo:
    height: int
    width: int


@dataclass(frozen=True)
class VideoInfo:
    num_frames: int
    fps: float
    height: int
    width: int

    @property
    def duration(self) -> float:
        return self.num_frames / self.fps


@dataclass(frozen=True)
class MediaPlan:
    """What metadata decides about one media item; full processing must reproduce it."""

    kind: str  # "image" | "video"
    grid_thw: tuple[int, int, int]  # patch grid before merging
    resized_hw: tuple[int, int]
    frame_indices: tuple[int, ...] | None = None  # videos: source frames, padded
    second_per_grid: float | None = None  # videos: seconds per temporal grid step
    source_fps: float | None = None  # videos: the stream's frame rate (Qwen3-VL timestamps)
    tokens: int | None = None  # the item's pad tokens where they are not t·h·w / merge² (LLaVA-OneVision's layout)

    def num_tokens(self, merge_size: int) -> int:
        if self.tokens is not None:
            return self.tokens
        t, h, w = self.grid_thw
        return t * h * w // merge_size**2


# ---------------------------------------------------------------------------- pure rules


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int,
                 frames: int = 1, temporal_factor: int = 1) -> tuple[int, int]:  # fmt: skip
    """Qwen2-VL resize target: sides multiples of ``factor``, area within [min, max], aspect kept.
    With ``frames`` (Qwen3-VL videos: transformers' ``qwen3_vl`` ``smart_resize``) the bounds are on
    frames × area, the frames rounded to a multiple of ``temporal_factor``."""
    if min(height, width) <= 0:
        raise MediaError("empty_media", f"size {height}x{width}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise MediaError(
            "aspect_ratio_too_extreme",
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got {max(height, width) / min(height, width)}",
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def video_frame_count(num_frames: int, fps: float, cfg: VisionConfig) -> int:
    """Frames to sample (before padding), by ``cfg.frame_sampling`` (see the module doc)."""
    tp = cfg.temporal_patch_size
    wanted = num_frames / fps * cfg.fps
    if cfg.frame_sampling == "qwen3_vl":  # Qwen3VLVideoProcessor.sample_frames
        return min(max(int(wanted), cfg.min_frames), cfg.max_frames, num_frames)
    # qwen-vl-utils' smart_nframes ceils min_frames to the temporal patch; Qwen2VLVideoProcessor does not
    min_frames = cfg.min_frames if cfg.frame_sampling == "transformers" else math.ceil(cfg.min_frames / tp) * tp
    max_frames = math.floor(min(cfg.max_frames, num_frames) / tp) * tp
    n = math.floor(min(max(wanted, min_frames), max_frames, num_frames) / tp) * tp
    return max(n, min(num_frames, tp))  # a 1-frame video still yields one frame (padded later)


def _linspace_frames(num_frames: int, n: int) -> list[int]:  # qwen-vl-utils' fetch_video, Qwen3VLVideoProcessor
    return np.linspace(0, num_frames - 1, n).round().astype(np.int64).tolist()


def _arange_frames(num_frames: int, n: int) -> list[int]:  # transformers' Qwen2VLVideoProcessor.sample_frames
    import torch

    return torch.arange(0, num_frames, num_frames / n).int().tolist()


FRAME_SAMPLING = {"qwen_vl_utils": _linspace_frames, "transformers": _arange_frames, "qwen3_vl": _linspace_frames}


def video_frame_indices(num_frames: int, n: int, temporal_patch_size: int,
                        sampling: str = "qwen_vl_utils") -> tuple[int, ...]:  # fmt: skip
    """``n`` evenly spaced source frames (placed by ``sampling``: see the module doc), the last
    repeated up to a multiple of the temporal patch."""
    idx = FRAME_SAMPLING[sampling](num_frames, n)
    idx += [idx[-1]] * (-len(idx) % temporal_patch_size)
    return tuple(idx)


def video_resize(info: VideoInfo, n: int, cfg: VisionConfig) -> tuple[int, int]:
    """Resize target of every frame of a video sampled to ``n`` frames (before padding)."""
    tp, factor = cfg.temporal_patch_size, cfg.factor
    if cfg.frame_sampling == "qwen3_vl":  # Qwen3VLVideoProcessor.resize (its smart_resize) over n frames
        if n < tp:
            raise MediaError("video_too_short", f"{n} sampled frame(s); Qwen3-VL's video processor needs {tp}")
        height, width = info.height, info.width
        if min(height, width) > 0 and (height < factor or width < factor):  # small sides scaled up first
            scale = max(factor / height, factor / width)
            height, width = int(height * scale), int(width * scale)
        return smart_resize(height, width, factor, cfg.video_min_pixels, cfg.video_max_pixels, n, tp)
    if cfg.frame_sampling == "transformers":  # Qwen2VLVideoProcessor.resize, cap_pixels_per_frame
        share = cfg.video_total_pixels * tp // n
    else:  # qwen-vl-utils' fetch_video
        share = cfg.video_total_pixels / n * tp
    max_pixels = max(min(cfg.video_max_pixels, share), int(cfg.video_min_pixels * 1.05))
    return smart_resize(info.height, info.width, factor, cfg.video_min_pixels, max_pixels)


def plan_image(info: ImageInfo, cfg: VisionConfig, images: int = 1) -> MediaPlan:
    """``images``: how many images the conversation has (read where ``cfg.plans_by_image_count``)."""
    if cfg.tiling == "anyres":
        from omniweave.data.media.anyres_plan import plan_anyres_image

        return plan_anyres_image(info, cfg, images)
    if cfg.tiling == "internvl":
        from omniweave.data.media.tiling import plan_tiled_image

        return plan_tiled_image(info, cfg)
    if cfg.tiling == "pad":
        from omniweave.data.media.pad_resize import plan_padded_image

        return plan_padded_image(info, cfg)
    h, w = smart_resize(info.height, info.width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    return MediaPlan("image", (1, h // cfg.patch_size, w // cfg.patch_size), (h, w))


def plan_video(info: VideoInfo, cfg: VisionConfig) -> MediaPlan:
    if cfg.tiling == "anyres":  # every frame one tile, pooled
        from omniweave.data.media.anyres_plan import plan_anyres_video

        return plan_anyres_video(info, cfg)
    if cfg.tiling == "internvl":  # every frame one tile
        from omniweave.data.media.tiling import plan_tiled_video

        return plan_tiled_video(info, cfg)
    if cfg.tiling == "pad":
        from omniweave.data.media.pad_resize import refuse_video

        refuse_video()
    tp = cfg.temporal_patch_size
    if info.num_frames < 1:
        raise MediaError("video_no_frames", "the stream has no frames")
    n = video_frame_count(info.num_frames, info.fps, cfg)
    h, w = video_resize(info, n, cfg)
    indices = video_frame_indices(info.num_frames, n, tp, cfg.frame_sampling)
    sample_fps = n / info.num_frames * info.fps  # transformers' VideoMetadata.sampled_fps
    grid = (len(indices) // tp, h // cfg.patch_size, w // cfg.patch_size)
    return MediaPlan("video", grid, (h, w), indices, tp / sample_fps, info.fps)


def video_timestamps(frame_indices: tuple[int, ...], fps: float, temporal_patch_size: int) -> list[float]:
    """Seconds of each temporal patch (Qwen3-VL's ``<t seconds>``): the mean of its first and last
    frame's time, frames padded with the last to a multiple of the temporal patch (transformers'
    ``Qwen3VLProcessor._calculate_timestamps``)."""
    idx = list(frame_indices)
    idx += [idx[-1]] * (-len(idx) % temporal_patch_size)
    times = [i / fps for i in idx]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


def patchify(frames: np.ndarray, cfg: VisionConfig) -> np.ndarray:
    """float32 [T, C, H, W] (T a multiple of the temporal patch) -> [t*h*w, C*tp*p*p].

    Rows are ordered (t, h/merge, w/merge, merge, merge) so that each merge×merge block of patches
    is contiguous, as the Qwen2-VL vision tower expects.
    """
    T, C, H, W = frames.shape
    p, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gt, gh, gw = T // tp, H // p, W // p
    x = frames.reshape(gt, tp, C, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (gt, gh/m, gw/m, m, m, C, tp, p, p)
    return np.ascontiguousarray(x).reshape(gt * gh * gw, C * tp * p * p)


# ---------------------------------------------------------------------------- probing (header only)


def probe_image(data: bytes) -> ImageInfo:
    """Image size from the file header (Pillow opens lazily; no pixel is decoded)."""
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
    except Exception as e:  # noqa: BLE001 - any undecodable header is a bad image
        raise MediaError("bad_image", f"cannot read image header: {e}") from e
    return ImageInfo(height=height, width=width)


def probe_video(data: bytes) -> VideoInfo:
    """Frame count, frame rate and size from the container / stream header (no decoding).

    Containers that do not store a frame count (e.g. Matroska) are demuxed to count packets,
    which reads compressed data but decodes nothing.
    """
    import av

    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise MediaError("bad_video", "no video stream")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            num_frames = stream.frames
            if num_frames <= 0:
                num_frames = sum(1 for pkt in container.demux(stream) if pkt.size > 0)
            height, width = stream.codec_context.height, stream.codec_context.width
    except MediaError:
        raise
    except Exception as e:  # noqa: BLE001
        raise MediaError("bad_video", f"cannot read video header: {e}") from e
    if not rate or float(rate) <= 0:
        raise MediaError("bad_video", "the stream has no frame rate")
    return VideoInfo(num_frames=int(num_frames), fps=float(rate), height=int(height), width=int(width))


# ---------------------------------------------------------------------------- full processing


def check_pixels(height: int, width: int, max_pixels: int, what: str = "image") -> None:
    """``MediaError("image_too_large")`` when a ``height`` x ``width`` header asks for more than ``max_pixels``."""
    if height * width > max_pixels:
        raise MediaError("image_too_large", f"{what} of {width}x{height} = {height * width} pixels is over the "
                         f"limit of {max_pixels} (data convert --max-image-pixels)")


def load_image(data: bytes, max_pixels: int = IMAGE_PIXELS_CEILING) -> Image.Image:
    """The image with every pixel decoded (``Image.load``), its header size checked first:
    ``MediaError`` ``image_too_large`` (nothing decoded) or ``undecodable_media`` (a header Pillow
    cannot read, a truncated file, image data that does not decompress)."""
    import warnings

    try:
        with warnings.catch_warnings():  # max_pixels is the limit here: no bomb warning below Pillow's error
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise MediaError("image_too_large", str(e)) from e
    except Exception as e:  # noqa: BLE001 - Pillow's failures on foreign bytes have no common type
        raise MediaError("undecodable_media", f"not a readable image ({e})") from e
    width, height = img.size
    try:
        check_pixels(height, width, max_pixels)
        if width <= 0 or height <= 0:
            raise MediaError("undecodable_media", f"empty image {width}x{height}")
        img.load()
    except MediaError:
        img.close()
        raise
    except Exception as e:  # noqa: BLE001 - as above (OSError, SyntaxError, ValueError, ...)
        img.close()
        raise MediaError("undecodable_media", f"the image data does not decode ({e})") from e
    return img


def decode_image(data: bytes) -> np.ndarray:
    """uint8 [H, W, 3] RGB; transparency is composited onto white (as transformers does).
    ``MediaError`` when the bytes do not decode (``load_image``)."""
    with load_image(data) as img:
        if "A" in img.getbands() or img.info.get("transparency") is not None:
            rgba = img.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            rgb = Image.alpha_composite(white, rgba).convert("RGB")
        else:
            rgb = img.convert("RGB")
        return np.asarray(rgb)


def decode_video_frames(data: bytes, indices: tuple[int, ...]) -> list[np.ndarray]:
    """uint8 [H, W, 3] RGB frames at ``indices`` (may repeat); stops after the last one needed."""
    import av

    wanted = set(indices)
    last = max(indices)
    frames: dict[int, np.ndarray] = {}
    try:
        with av.open(io.BytesIO(data), mode="r") as container:
            if not container.streams.video:
                raise MediaError("undecodable_media", "no video stream")
            stream = container.streams.video[0]
            check_pixels(stream.codec_context.height, stream.codec_context.width, IMAGE_PIXELS_CEILING, "a video frame")
            stream.thread_type = "AUTO"
            for i, frame in enumerate(container.decode(stream)):
                if i in wanted:
                    frames[i] = frame.to_ndarray(format="rgb24")
                if i >= last:
                    break
    except av.FFmpegError as e:
        raise MediaError("undecodable_media", f"the video does not decode ({e})") from e
    missing = sorted(wanted - set(frames))
    if missing:
        raise MediaError("video_truncated", f"frames {missing[:5]} promised by the header could not be decoded")
    return [frames[i] for i in indices]


def resize_normalize_frames(frames: np.ndarray, resized_hw: tuple[int, int], cfg: VisionConfig) -> np.ndarray:
    """uint8 [T, H, W, 3] video frames -> float32 [T, 3, h, w] as torchvision and transformers'
    video processors do it on the CPU: torch's uint8 bicubic antialiased ``interpolate`` (rounded,
    clamped), then ``(x - 255·mean) / (255·std)`` in float32."""
    import torch
    import torch.nn.functional as F

    x = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
    if tuple(x.shape[-2:]) != tuple(resized_hw):
        x = F.interpolate(x.contiguous(), size=list(resized_hw), mode="bicubic", align_corners=False, antialias=True)
    mean = torch.tensor(cfg.image_mean) * 255.0  # float32, as transformers fuses rescale into normalise
    std = torch.tensor(cfg.image_std) * 255.0
    return ((x.float() - mean[:, None, None]) / std[:, None, None]).numpy()


def resize_normalize(rgb: np.ndarray, resized_hw: tuple[int, int], cfg: VisionConfig) -> np.ndarray:
    """uint8 [H, W, 3] -> float32 [3, h, w]: PIL bicubic resize, /255, (x - mean) / std."""
    h, w = resized_hw
    if rgb.shape[:2] != (h, w):
        rgb = np.asarray(Image.fromarray(rgb).resize((w, h), resample=Image.BICUBIC))
    x = (rgb.astype(np.float64) * (1 / 255)).astype(np.float32)
    x = (x - np.asarray(cfg.image_mean, dtype=np.float32)) / np.asarray(cfg.image_std, dtype=np.float32)
    return x.transpose(2, 0, 1)


def process_image(data: bytes, cfg: VisionConfig, plan: MediaPlan | None = None) -> tuple[np.ndarray, MediaPlan]:
    """Full decode: pixel_values float32 [h*w, 3*tp*p*p] and the plan (grid) it matches; with
    ``tiling: internvl``, [tiles*(tile/p)^2, 3*p*p] (``tiling.process_tiled_image``); with ``tiling:
    anyres`` the packed ``plan`` says which path (``anyres_plan.process_anyres_item``)."""
    if cfg.tiling == "anyres":
        from omniweave.data.media.anyres_plan import process_anyres_item

        return process_anyres_item(data, cfg, plan)
    if cfg.tiling == "internvl":
        from omniweave.data.media.tiling import process_tiled_image

        return process_tiled_image(data, cfg)
    if cfg.tiling == "pad":
        from omniweave.data.media.pad_resize import process_padded_image

        return process_padded_image(data, cfg)
    rgb = decode_image(data)
    plan = plan_image(ImageInfo(height=rgb.shape[0], width=rgb.shape[1]), cfg)
    frame = resize_normalize(rgb, plan.resized_hw, cfg)
    frames = np.broadcast_to(frame, (cfg.temporal_patch_size, *frame.shape))  # an image is a still clip
    return patchify(frames, cfg), plan


def process_video(data: bytes, cfg: VisionConfig, plan: MediaPlan | None = None) -> tuple[np.ndarray, MediaPlan]:
    """Full decode of the planned frames: pixel_values float32 [t*h*w, 3*tp*p*p] and the plan; with
    ``tiling: internvl`` or ``anyres``, [frames*(tile/p)^2, 3*p*p] (a tile per frame)."""
    if cfg.tiling == "anyres":
        from omniweave.data.media.anyres_plan import process_anyres_video

        return process_anyres_video(data, cfg, plan)
    if cfg.tiling == "internvl":
        from omniweave.data.media.tiling import process_tiled_video

        return process_tiled_video(data, cfg, plan)
    if cfg.tiling == "pad":
        from omniweave.data.media.pad_resize import refuse_video

        refuse_video()
    plan = plan or plan_video(probe_video(data), cfg)
    unique = tuple(sorted(set(plan.frame_indices)))
    resized = resize_normalize_frames(np.stack(decode_video_frames(data, unique)), plan.resized_hw, cfg)
    frames = resized[[unique.index(i) for i in plan.frame_indices]]  # [T, 3, h, w], padding repeats the last
    return patchify(frames, cfg), plan
