"""Clips -> offline latents -> packed rows: the data side of video diffusion (``data pack`` with a
recipe of ``train.phase: diffusion``; docs/diffusion.md).

The offline-packing idea applied to diffusion: the VAE and the text encoder run once, when packing,
never in training. ``data pack`` runs its usual phases over a clips conversion (``data convert
--format clips``):

- scan (cheap, no model): each clip's frames and size from its ``clip.json`` -> the frames it
  takes and the size it is resized to (:func:`clip_plan`) -> its latent tokens (the pack length);
- plan: clips packed into rows of ``data.max_len`` latent tokens (best-fit-decreasing, as text);
- write: each clip decoded, resized, encoded by the VAE (posterior mean, normalised), patchified
  at the generator's patch size, its caption encoded by the text encoder; stored per document
  (clip) as arrays: ``latents [tokens, C·p]``, ``grid [3]``, ``text [len, D]`` and the encoded
  empty prompt ``empty_text [E, D]`` (caption dropout feeds it). An image-to-video recipe (the
  generator's ``image_dim`` set, a ``model.image_conditioner``) adds the clip's first-frame
  conditioning (:func:`i2v_condition`): ``cond [tokens, (4 + C)·p]`` (the 4-channel first-frame mask,
  then the VAE latent of [first frame, zero frames], patchified as the latents) and the image
  conditioner's features of the first frame ``image [N, image_dim]``.

A pack's token arrays are the clip tokens' slots: ids 0 without labels, so the loader's epoch
order, balancing, resume and DP sharding run unchanged; :func:`diffusion_rows` gives the loader's
row keys. Dropped clips, each counted with its reason: ``too_short`` (fewer frames than the recipe
asks, or than one VAE step), ``too_small`` (a side under 16 px or the area under ``min_pixels``
after resizing: nothing is upscaled) and whatever the decoder refuses (``unreadable:...``).

Frames: ``data.diffusion.frames`` (4k + 1) from the clip's start, ``fps`` apart (null: every
frame); ``frames: null`` takes each clip's native length, the longest 4k + 1 up to ``max_frames``.
Size: the clip's own aspect ratio at most ``max_pixels`` (never upscaled), each side rounded down
to a multiple of 16 (the VAE's 8 x the patch's 2); the frames are resized to cover that size and
centre-cropped to it, so rounding crops a few pixels instead of squashing the picture; an image is
a one-frame clip.
"""

from __future__ import annotations

import io
import math
from dataclasses import asdict, dataclass, fields

import numpy as np

from omniweave.data.text.tokenize import SampleRejected

SIDE_MULTIPLE = 16  # VAE 8 x DiT patch 2: latent tokens tile the frame exactly
LATENT_DTYPES = ("float32", "float16")


@dataclass(frozen=True)
class DiffusionSettings:
    frames: int | None = 17  # frames per clip (4k + 1); None: native length up to max_frames
    max_frames: int = 81
    fps: float | None = None  # sample the clip at this rate (None: every frame)
    max_pixels: int = 832 * 480  # H x W cap (aspect kept, never upscaled)
    min_pixels: int = 256  # smaller (after resizing): dropped as too_small
    latents_dtype: str = "float32"  # what the packs store (float16 halves them)
    text_len: int = 512  # the text encoder's max_sequence_length (Wan's text_len)

    def __post_init__(self):
        for name in ("frames", "max_frames"):
            value = getattr(self, name)
            if value is not None and (value < 1 or (value - 1) % 4):
                raise ValueError(f"data.diffusion.{name}={value}: the VAE takes 4k + 1 frames (1, 5, 9, ...)")
        if self.latents_dtype not in LATENT_DTYPES:
            raise ValueError(f"data.diffusion.latents_dtype={self.latents_dtype!r}: one of {LATENT_DTYPES}")
        if self.max_pixels < SIDE_MULTIPLE ** 2 or self.min_pixels < 1:
            raise ValueError(f"data.diffusion.max_pixels must be >= {SIDE_MULTIPLE ** 2} and min_pixels >= 1")
        if self.fps is not None and self.fps <= 0:
            raise ValueError(f"data.diffusion.fps must be positive, got {self.fps}")

    @classmethod
    def from_mapping(cls, cfg) -> "DiffusionSettings":
        cfg = dict(cfg or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(cfg) - known - {"codecs"})
        if unknown:
            raise ValueError(f"data.diffusion: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**{k: v for k, v in cfg.items() if k in known})

    def spec(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ClipPlan:
    frames: tuple[int, ...]  # source frame indices
    height: int
    width: int

    def latent_grid(self, patch: tuple[int, int, int]) -> tuple[int, int, int]:
        """(f, h, w) tokens: 1 + (T - 1) / 4 latent frames, H / 8, W / 8 cells, over the patch."""
        t = 1 + (len(self.frames) - 1) // 4
        return t // patch[0], self.height // 8 // patch[1], self.width // 8 // patch[2]

    def tokens(self, patch: tuple[int, int, int]) -> int:
        return math.prod(self.latent_grid(patch))


def resized_size(height: int, width: int, settings: DiffusionSettings) -> tuple[int, int]:
    """The clip's aspect at most ``max_pixels`` (never upscaled), each side rounded down to a
    multiple of 16 -- 0 for a side under 16 px after scaling (:func:`clip_plan` drops the clip)."""
    scale = min(1.0, math.sqrt(settings.max_pixels / (height * width)))
    h = int(height * scale) // SIDE_MULTIPLE * SIDE_MULTIPLE
    w = int(width * scale) // SIDE_MULTIPLE * SIDE_MULTIPLE
    return h, w


def clip_plan(meta: dict, settings: DiffusionSettings) -> ClipPlan:
    """Which frames of a clip (``clip.json``: frames, fps, height, width, media) and at what size;
    :class:`SampleRejected` when it cannot give them."""
    total, source_fps = int(meta["frames"]), meta.get("fps")
    if meta.get("media") == "image" or total == 1:
        wanted = [0]
        if settings.frames not in (None, 1):
            raise SampleRejected("too_short", f"an image (1 frame); the recipe asks for {settings.frames} frames")
    else:
        step = 1.0 if settings.fps is None or not source_fps else float(source_fps) / settings.fps
        available = int((total - 1) // step) + 1  # frames at the sampling rate
        n = settings.frames
        if n is None:
            n = min(available, settings.max_frames)
            n = (n - 1) // 4 * 4 + 1
        needed = n if settings.frames is not None else 5  # native: at least one step of the VAE's 4x time
        if available < needed:
            raise SampleRejected("too_short", f"{total} frames ({available} at the sampling rate); {needed} needed")
        wanted = [min(total - 1, int(round(k * step))) for k in range(n)]
    h, w = resized_size(int(meta["height"]), int(meta["width"]), settings)
    if min(h, w) < SIDE_MULTIPLE:
        raise SampleRejected("too_small", f"{meta['width']}x{meta['height']}: a side under {SIDE_MULTIPLE} px at "
                             f"max_pixels {settings.max_pixels} (frames are never upscaled)")
    if h * w < settings.min_pixels:
        raise SampleRejected("too_small", f"{meta['width']}x{meta['height']} -> {w}x{h}, under min_pixels "
                             f"{settings.min_pixels}")
    return ClipPlan(tuple(wanted), h, w)


def decode_clip(data: bytes, meta: dict, plan: ClipPlan) -> np.ndarray:
    """uint8 [T, H, W, 3]: the plan's frames, resized (bicubic) to its size."""
    from PIL import Image

    if meta.get("media") == "image":
        images = [Image.open(io.BytesIO(data)).convert("RGB")]
    else:
        import av

        wanted, images = set(plan.frames), {}
        with av.open(io.BytesIO(data)) as container:
            for i, frame in enumerate(container.decode(video=0)):
                if i in wanted:
                    images[i] = frame.to_image()
                if i >= plan.frames[-1]:
                    break
        missing = sorted(wanted - set(images))
        if missing:
            raise SampleRejected("too_short", f"frames {missing[:3]}... did not decode (the clip has fewer)")
        images = [images[i] for i in plan.frames]
    return np.stack([resized_frame(im, plan.height, plan.width) for im in images])


def resized_frame(image, height: int, width: int) -> np.ndarray:
    """uint8 [H, W, 3] of a PIL image resized (bicubic) to cover ``height`` x ``width`` with its own
    aspect, then centre-cropped to it (an image of that aspect is just resized): how every frame a
    clip is encoded from is made, and the image ``generate video --image`` starts a clip from."""
    from PIL import Image

    image = image.convert("RGB")
    scale = max(height / image.height, width / image.width)
    cover_w, cover_h = max(width, round(image.width * scale)), max(height, round(image.height * scale))
    image = image.resize((cover_w, cover_h), Image.BICUBIC)
    if (cover_w, cover_h) != (width, height):
        left, top = (cover_w - width) // 2, (cover_h - height) // 2
        image = image.crop((left, top, left + width, top + height))
    return np.asarray(image)


# ----------------------------------------------------------------------------- image-to-video

VAE_TIME_FACTOR = 4  # video frames per latent frame (after the first): the mask's channels


def first_frame_mask(frames: int, t: int, h: int, w: int):
    """float32 ``[4, t, h, w]``: diffusers' ``WanImageToVideoPipeline.prepare_latents`` mask for a
    clip of ``frames`` video frames whose first frame is given: the per-frame mask (1 on frame 0, 0
    after) with frame 0 repeated 4 times, viewed as ``[t, 4]`` and put channel first -- 1 on all
    4 channels of latent frame 0, 0 elsewhere."""
    import torch

    if frames != VAE_TIME_FACTOR * (t - 1) + 1:
        raise ValueError(f"{frames} frames do not make {t} latent frames (4k + 1 frames -> k + 1)")
    per_frame = torch.zeros(frames)
    per_frame[0] = 1.0
    per_frame = torch.cat([per_frame[:1].repeat(VAE_TIME_FACTOR), per_frame[1:]])  # [4t]
    return per_frame.view(t, VAE_TIME_FACTOR).T[:, :, None, None].expand(VAE_TIME_FACTOR, t, h, w).contiguous()


def i2v_condition(vae, image_encoder, first_frame: np.ndarray, frames: int, patch):
    """A clip's image-to-video conditioning from its first frame (uint8 ``[H, W, 3]``, the clip's
    size): ``(cond [tokens, (4 + z_dim)·p], image [N, image_dim])``, float32 on the VAE's device.
    The one function ``data pack`` (:class:`ClipEncoder`) and ``generate video --image`` use.

    As diffusers' ``WanImageToVideoPipeline`` (0.42.1): the conditioning video is the frame (in
    [-1, 1]) followed by ``frames - 1`` zero frames, VAE-encoded (the posterior mean) and normalised
    by the VAE's statistics; the mask is :func:`first_frame_mask`; the condition is [mask 4 |
    latent z_dim] along channels, patchified at the generator's ``patch``. The DiT's input is then
    [noisy z_dim | mask 4 | latent z_dim] channels (``latent_model_input = cat([latents, condition])``):
    :func:`~omniweave.models.components.wan_dit.patchify` lays each token out channel-major, so a
    token's [noisy tokens | cond tokens] is exactly the patch of that channel-concatenated latent.
    ``image`` is ``image_encoder.clip_features`` of the same frame (CLIP's penultimate states)."""
    import torch

    from omniweave.models.components.wan_dit import patchify

    device = next(vae.parameters()).device
    first_frame = np.array(first_frame)  # a writable copy (decoded frames are read-only views)
    image = torch.from_numpy(first_frame).to(device).permute(2, 0, 1).float() / 127.5 - 1.0
    video = torch.cat([image[:, None], image.new_zeros(3, frames - 1, *image.shape[1:])], dim=1)[None]
    with torch.no_grad():
        z = vae.normalize(vae.encode(video))[0].float()  # [z_dim, t, h, w]
        features = image_encoder.clip_features(first_frame).float().to(device)
    mask = first_frame_mask(frames, *z.shape[1:]).to(z)
    return patchify(torch.cat([mask, z]), patch), features


def placeholder_sample(sample_id: str, tokens: int):
    """A clip's document in a pack: ``tokens`` slots (ids 0, no labels, positions 0)."""
    from omniweave.data.sample import TokenizedSample

    return TokenizedSample(id=sample_id, input_ids=np.zeros(tokens, np.int32), labels=np.full(tokens, -100, np.int32),
                           position_ids=np.zeros((1, tokens), np.int32))


def codec_device(device: str = "auto", worker: int = 0) -> str:
    """Where write worker ``worker`` runs the codecs: ``auto`` is CUDA when there is one; on CUDA
    worker k takes GPU k mod the GPU count, so ``--workers`` processes spread over a machine's GPUs
    (an explicit ``cuda:N`` or ``cpu`` is kept). Called in the worker, after the fork."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and torch.cuda.device_count() > 1:
        device = f"cuda:{worker % torch.cuda.device_count()}"
    return device


class ClipEncoder:
    """The write phase's models: the recipe's VAE and text encoder on ``device``, the generator's
    patch; for an image-to-video recipe its image conditioner too (``codecs["image_conditioner"]``)."""

    def __init__(self, codecs: dict, settings: DiffusionSettings, device: str = "auto"):
        import torch

        from omniweave.models.registry import build_component

        self.device, self.settings = torch.device(codec_device(device)), settings
        self.patch = tuple(codecs["patch_size"])
        self.vae = build_component("vae", codecs["vae"]).to(self.device).eval()
        self.text_encoder = build_component("text_encoder", codecs["text_encoder"]).to(self.device)
        self.empty = self.text_encoder.empty_states().float().cpu().numpy()
        conditioner = codecs.get("image_conditioner")
        self.image_encoder = None if not conditioner else build_component("image_conditioner", conditioner).to(self.device)

    def encode(self, frames: np.ndarray, caption: str) -> dict[str, np.ndarray]:
        """A clip's document arrays (module docstring)."""
        import torch

        from omniweave.models.components.wan_dit import patchify

        video = torch.from_numpy(frames).to(self.device).permute(3, 0, 1, 2)[None].float() / 127.5 - 1.0
        with torch.no_grad():
            z = self.vae.normalize(self.vae.encode(video))[0]  # [C, t, h, w]
            text = self.text_encoder.encode([caption], max_sequence_length=self.settings.text_len)[0]
        tokens = patchify(z.float(), self.patch)
        dtype = np.dtype(self.settings.latents_dtype)
        grid = [z.shape[1] // self.patch[0], z.shape[2] // self.patch[1], z.shape[3] // self.patch[2]]
        arrays = {"latents": tokens.cpu().numpy().astype(dtype), "grid": np.asarray(grid, np.int32),
                  "text": text.float().cpu().numpy().astype(dtype), "empty_text": self.empty.astype(dtype)}
        if self.image_encoder is not None:  # image-to-video: the first frame's conditioning
            cond, image = i2v_condition(self.vae, self.image_encoder, frames[0], len(frames), self.patch)
            arrays["cond"], arrays["image"] = cond.cpu().numpy().astype(dtype), image.cpu().numpy().astype(dtype)
        return arrays


def tokenize_clip(raw, settings: DiffusionSettings, patch: tuple[int, int, int], encoder: ClipEncoder | None) -> list:
    """``data pack``'s one document of a raw clip (``ClipSample``: key, meta, data): its planned
    tokens at scan time; with the write phase's ``encoder``, its arrays too. The frames are decoded
    in both phases, so a clip that does not decode is a counted reject at scan, never a failed write."""
    caption = raw.meta.get("caption")
    if not isinstance(caption, str) or not caption.strip():
        raise SampleRejected("no_caption", "the clip has no caption")
    plan = clip_plan(raw.meta, settings)
    frames = decode_clip(raw.data, raw.meta, plan)
    tokens = plan.tokens(patch)
    info = {"clip": {"frames": len(plan.frames), "height": plan.height, "width": plan.width}}
    if encoder is not None:
        info["arrays"] = encoder.encode(frames, caption)
        if len(info["arrays"]["latents"]) != tokens:
            raise RuntimeError(f"clip {raw.key}: {len(info['arrays']['latents'])} latent tokens, planned {tokens}")
    return [(placeholder_sample(str(raw.meta.get("id") or raw.key), tokens), info)]


def diffusion_rows(pack: dict) -> dict:
    """A pack's diffusion row keys (diffusion/objective.py), its documents' arrays concatenated:
    ``latents [T, C·p]``, ``grid [M, 3]``, ``text [S, D]``, ``text_cu_seqlens [M+1]``,
    ``clip_samples [M]`` (raw sample indices: they seed each clip's draw), ``empty_text [E, D]``;
    image-to-video packs add ``cond [T, (4 + C)·p]``, ``image [N, image_dim]``, ``image_cu_seqlens [M+1]``."""
    import torch

    arrays = pack["doc_arrays"]
    if not arrays or any("latents" not in a for a in arrays):
        return {}
    lengths = [len(a["text"]) for a in arrays]
    rows = {"latents": torch.from_numpy(np.concatenate([a["latents"] for a in arrays]).astype(np.float32)),
            "grid": torch.from_numpy(np.stack([a["grid"] for a in arrays]).astype(np.int64)),
            "text": torch.from_numpy(np.concatenate([a["text"] for a in arrays]).astype(np.float32)),
            "text_cu_seqlens": torch.tensor(np.r_[0, np.cumsum(lengths)], dtype=torch.int32),
            "clip_samples": torch.tensor([int(d["index"]) for d in pack["docs"]]),
            "empty_text": torch.from_numpy(np.array(arrays[0]["empty_text"], np.float32))}  # a copy: packs are read-only
    if "cond" in arrays[0]:  # image-to-video (i2v_condition)
        images = [len(a["image"]) for a in arrays]
        rows.update(cond=torch.from_numpy(np.concatenate([a["cond"] for a in arrays]).astype(np.float32)),
                    image=torch.from_numpy(np.concatenate([a["image"] for a in arrays]).astype(np.float32)),
                    image_cu_seqlens=torch.tensor(np.r_[0, np.cumsum(images)], dtype=torch.int32))
    return rows


def check_recipe(model_cfg: dict, phase: str) -> None:
    """A diffusion phase needs a generator, a VAE and a text encoder (and, for an image-to-video
    generator, an image conditioner: :func:`check_i2v`); a generator trains on nothing else."""
    from omniweave.errors import UserError

    has_generator = bool(model_cfg.get("generator"))
    if phase == "diffusion":
        missing = [s for s in ("generator", "vae", "text_encoder") if not model_cfg.get(s)]
        if missing:
            raise UserError(f"train.phase=diffusion needs model.{', model.'.join(missing)} (recipe demo_diffusion "
                            "shows all three)")
        check_i2v(model_cfg)
    elif has_generator:
        raise UserError(f"model.generator (video diffusion) trains with train.phase=diffusion, not {phase!r}")


def check_i2v(model_cfg: dict) -> None:
    """An image-to-video generator (``image_dim`` set) comes with a ``model.image_conditioner`` and
    takes 4 + 2 x its output channels in ([noisy | mask 4 | conditioning latent]); a text-to-video one
    has no image conditioner. One line naming the key otherwise."""
    from omniweave.errors import UserError

    gen, conditioner = model_cfg["generator"], model_cfg.get("image_conditioner")
    image_dim = gen.get("image_dim")
    if image_dim and not conditioner:
        raise UserError(f"model.generator.image_dim={image_dim} (image-to-video) needs model.image_conditioner "
                        "(the first frame's features: recipe tiny_diffusion_i2v shows one)")
    if conditioner and not image_dim:
        raise UserError("model.image_conditioner is set but model.generator has no image_dim (a text-to-video "
                        "generator): set model.generator.image_dim / added_kv_proj_dim or remove the conditioner")
    if image_dim:
        out = int(gen.get("out_channels", 16))
        if int(gen.get("in_channels", 16)) != 2 * out + VAE_TIME_FACTOR:
            raise UserError(f"model.generator.in_channels={gen.get('in_channels', 16)}: an image-to-video generator "
                            f"takes {2 * out + VAE_TIME_FACTOR} ({out} noisy + {VAE_TIME_FACTOR} mask + {out} "
                            "conditioning latent channels)")


def codecs_of(model_cfg: dict) -> dict:
    """What a pack's latents and text states were made with: the recipe's VAE and text encoder
    (their settings, without the training-only keys) and the generator's patch size; an
    image-to-video recipe's image conditioner too (a text-to-video recipe's codecs have no such key,
    so its packs' fingerprint is what it was)."""
    from omniweave.models.registry import COMMON_KEYS

    def settings(section: dict) -> dict:
        return {k: v for k, v in section.items() if k == "name" or k not in COMMON_KEYS}

    patch = model_cfg["generator"].get("patch_size", [1, 2, 2])
    codecs = {"vae": settings(model_cfg["vae"]), "text_encoder": settings(model_cfg["text_encoder"]),
              "patch_size": [int(p) for p in patch]}
    if model_cfg.get("image_conditioner"):
        codecs["image_conditioner"] = settings(model_cfg["image_conditioner"])
    return codecs


def with_codecs(data_cfg: dict, model_cfg: dict) -> dict:
    """``data_cfg`` with ``diffusion.codecs`` set from the recipe's model (:func:`codecs_of`): part of
    the packs' fingerprint, so a run whose VAE, text encoder, image conditioner or patch differs
    from its packs' is refused (the trainer checks it as any data setting)."""
    return {**data_cfg, "diffusion": {**dict(data_cfg.get("diffusion") or {}), "codecs": codecs_of(model_cfg)}}
