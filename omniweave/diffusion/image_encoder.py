"""The frozen image encoder of Wan 2.1 image-to-video: CLIP ViT-H/14's vision tower (transformers'
``CLIPVisionModel``) and its ``CLIPImageProcessor``, giving each clip's image features, the states
the I2V DiT's image embedder reads (``WanDiT(..., image=, image_cu_seqlens=)``, wan_i2v.py).

    enc = WanImageEncoder.from_pretrained("Wan2.1-I2V-14B-480P-Diffusers", device="cuda")
    feats = enc.encode([first_frame])             # [1, 257, 1280]: what the pipeline gives the DiT
    clip = enc.clip_features(first, last)         # [514, 1280]: FLF2V, both images' tokens in a row

What :meth:`encode` computes is diffusers' ``WanImageToVideoPipeline.encode_image`` (0.42.1):
``image_processor(images=..., return_tensors="pt")`` (resize the short side to 224, bicubic;
centre crop 224 x 224; rescale to [0, 1]; normalise by CLIP's mean / std), then
``image_encoder(**pixels, output_hidden_states=True).hidden_states[-2]`` -- the penultimate layer's
states, all 1 + (224 / 14)² = 257 tokens (class token first), before the post-LayerNorm. It is
bit-identical to that call (tests/test_wan_image_encoder.py): the processor is transformers' own
``CLIPImageProcessor``, which is its torchvision backend where torchvision loads and its PIL one
where it does not (then, as for the pipeline in the same environment, resizing is PIL's). FLF2V
(first and last frame) encodes both images as a batch of 2; :meth:`clip_features` joins them
in that order, as diffusers' image embedder does.

Construction mirrors diffusion/text_encoder.py: :meth:`from_pretrained` reads a local directory (no
download): a diffusers Wan I2V pipeline root (``image_encoder/`` + ``image_processor/``), its
``image_encoder/`` folder (the processor then from the sibling ``image_processor/``), or one folder
holding both. :meth:`tiny` / :meth:`from_config` build a seeded random ``CLIPVisionModel`` with a
processor sized to its ``image_size`` for tests. The module is frozen, always in eval mode, and
runs under ``torch.no_grad`` in its dtype (float32 by default, as Wan's pipeline keeps CLIP).

Registered as the ``image_conditioner`` component ``clip_vision`` (registry.DIFFUSION_SECTIONS):
the registry's ``image_encoder`` kind is the vision tower of a multimodal LLM (a different
contract, and a section a diffusion recipe refuses). ``data pack`` and ``generate video --image``
read it through diffusion/data.py ``i2v_condition`` (docs/diffusion.md, "Image-to-video").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from omniweave.diffusion.frozen import FrozenCodec

_PROCESSOR_FILE = "preprocessor_config.json"


def _transformers():
    """transformers behind the torchvision guard (models/hf/torchvision_guard.py)."""
    from omniweave.models.hf.torchvision_guard import torchvision_loads

    torchvision_loads()
    import transformers

    return transformers


def _locate(path: Path) -> tuple[Path, Path]:
    """(encoder dir, processor dir) of a pipeline root, its ``image_encoder/``, or one folder with both."""
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a directory (a Wan I2V pipeline root or its image_encoder/ folder)")
    if (path / "image_encoder" / "config.json").is_file():
        model_dir = path / "image_encoder"
        proc_dir = path / "image_processor" if (path / "image_processor" / _PROCESSOR_FILE).is_file() else model_dir
    elif (path / "config.json").is_file():
        model_dir = path
        proc_dir = path if (path / _PROCESSOR_FILE).is_file() else path.parent / "image_processor"
    else:
        raise FileNotFoundError(f"{path}: no config.json and no image_encoder/config.json (a diffusers Wan I2V "
                                "pipeline root, its image_encoder/ folder, or an HF CLIP vision folder)")
    if not (proc_dir / _PROCESSOR_FILE).is_file():
        raise FileNotFoundError(f"{path}: no {_PROCESSOR_FILE} in {proc_dir} (the CLIP image processor)")
    return model_dir, proc_dir


class WanImageEncoder(FrozenCodec):
    """Frozen CLIP vision tower + image processor (see the module docstring)."""

    def __init__(self, model: nn.Module, processor):
        super().__init__()
        if getattr(model.config, "model_type", None) != "clip_vision_model":
            raise ValueError(f"WanImageEncoder wraps transformers' CLIPVisionModel, got {type(model).__name__} "
                             f"(model_type {getattr(model.config, 'model_type', None)!r})")
        self.model = model.eval().requires_grad_(False)
        self.processor = processor

    # ---- construction ----------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None,
                        device: torch.device | str | None = None) -> WanImageEncoder:
        """A local CLIP vision tower and its processor (no download); ``dtype`` None = float32."""
        tf = _transformers()
        model_dir, proc_dir = _locate(Path(path))
        model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
        if model_type not in ("clip_vision_model", "clip"):
            raise ValueError(f"{model_dir}: model_type {model_type!r}, not a CLIP vision model")
        model = tf.CLIPVisionModel.from_pretrained(str(model_dir), dtype=dtype or torch.float32)
        processor = tf.CLIPImageProcessor.from_pretrained(str(proc_dir))
        return cls(model.to(device) if device is not None else model, processor)

    @classmethod
    def from_config(cls, config: dict[str, Any] | Any, seed: int = 0, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None) -> WanImageEncoder:
        """A randomly initialised ``CLIPVisionModel`` of a ``CLIPVisionConfig`` (or its dict) and a
        CLIP processor sized to its ``image_size`` (short side resized to it, centre crop square).
        Seeded without touching the global RNG."""
        tf = _transformers()
        if isinstance(config, dict):
            config = tf.CLIPVisionConfig(**config)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = tf.CLIPVisionModel(config)
        s = int(config.image_size)
        processor = tf.CLIPImageProcessor(size={"shortest_edge": s}, crop_size={"height": s, "width": s})
        return cls(model.to(device=device, dtype=dtype or torch.float32), processor)

    @classmethod
    def tiny(cls, hidden_size: int = 32, num_hidden_layers: int = 3, num_attention_heads: int = 4,
             intermediate_size: int = 37, image_size: int = 30, patch_size: int = 6, seed: int = 0,
             **kwargs) -> WanImageEncoder:
        """A tiny random CLIP vision tower (tests): 1 + (30 / 6)² = 26 tokens of 32. ``kwargs``: dtype, device."""
        config = dict(hidden_size=hidden_size, num_hidden_layers=num_hidden_layers, intermediate_size=intermediate_size,
                      num_attention_heads=num_attention_heads, image_size=image_size, patch_size=patch_size,
                      projection_dim=hidden_size)
        return cls.from_config(config, seed=seed, **kwargs)

    def save_pretrained(self, path: str | Path) -> Path:
        """A diffusers-pipeline-like layout, ``path/image_encoder/`` + ``path/image_processor/``, which
        :meth:`from_pretrained` (and diffusers' pipelines) read back."""
        path = Path(path)
        self.model.save_pretrained(str(path / "image_encoder"))
        self.processor.save_pretrained(str(path / "image_processor"))
        return path

    # ---- state -----------------------------------------------------------------------------

    @property
    def dim(self) -> int:
        """Feature width: the I2V DiT's ``image_dim`` (1280 for ViT-H/14)."""
        return int(self.model.config.hidden_size)

    @property
    def num_tokens(self) -> int:
        """Tokens per image: 1 + (image_size / patch_size)² (257 for ViT-H/14 at 224)."""
        cfg = self.model.config
        return 1 + (int(cfg.image_size) // int(cfg.patch_size)) ** 2

    # ---- encoding --------------------------------------------------------------------------

    @torch.no_grad()
    def encode(self, images: list) -> Tensor:
        """``[B, num_tokens, dim]``: the penultimate hidden states of each image (PIL images, HWC uint8
        arrays or CHW tensors, as the processor takes them), in the encoder's dtype and device."""
        if not isinstance(images, (list, tuple)):
            raise TypeError("encode takes a list of images (a single image: [image])")
        if not images:
            raise ValueError("encode needs at least one image")
        pixels = self.processor(images=list(images), return_tensors="pt").to(self.device)
        return self.model(**pixels, output_hidden_states=True).hidden_states[-2]

    def clip_features(self, first, last=None) -> Tensor:
        """One clip's image features for the DiT, ``[num_tokens, dim]`` (I2V), or ``[2·num_tokens, dim]``
        for first + last frame (FLF2V: the first image's tokens, then the last's)."""
        return self.encode([first] if last is None else [first, last]).flatten(0, 1)

    def forward(self, images: list) -> Tensor:
        return self.encode(images)


@dataclass
class ImageEncoderConfig:
    """``model.image_conditioner`` (a recipe's frozen codec for image-to-video): a local CLIP vision
    folder (``path``: a diffusers Wan I2V pipeline root, its ``image_encoder/``, or an HF CLIP vision
    folder with its ``preprocessor_config.json``), or, without one, a seeded random tiny CLIP vision
    tower of the fields below (tests)."""

    path: str | None = None
    hidden_size: int = 32
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    intermediate_size: int = 37
    image_size: int = 30
    patch_size: int = 6
    seed: int = 0


def build_image_encoder(config: ImageEncoderConfig) -> WanImageEncoder:
    """The registered ``image_conditioner`` ``clip_vision``: :meth:`WanImageEncoder.from_pretrained`
    of ``config.path``, else :meth:`WanImageEncoder.tiny` of the other fields."""
    if config.path:
        return WanImageEncoder.from_pretrained(config.path)
    return WanImageEncoder.tiny(hidden_size=config.hidden_size, num_hidden_layers=config.num_hidden_layers,
                                num_attention_heads=config.num_attention_heads,
                                intermediate_size=config.intermediate_size, image_size=config.image_size,
                                patch_size=config.patch_size, seed=config.seed)


def _register() -> None:
    from omniweave.models.registry import register

    register("image_conditioner", "clip_vision", ImageEncoderConfig)(build_image_encoder)


_register()
