"""The one registry: model components, and the reward functions of RL.

A component is a class plus a config dataclass, registered under ``(kind, name)``::

    @register("foundation", "decoder", DecoderConfig)
    class Decoder(nn.Module):
        def __init__(self, config: DecoderConfig): ...

Kinds: ``foundation``, the encoder / projector kinds of each modality in :data:`MODALITIES`
(``image_encoder`` + ``projector``, ``audio_encoder`` + ``audio_projector``; built from YAML by
name), ``hf`` (Hugging Face family adapters keyed by the HF ``model_type``; ``config_cls`` may be
None), and ``reward`` (functions ``fn(response, reference, **params) -> float``, registered
through ``omniweave.rl.rewards.reward``).

A component's YAML holds ``name:`` (the registered name), optional ``freeze: bool``, ``tp:``
(read by the trainer) and ``lora:`` (adapters, models/lora.py), and the fields of its config dataclass; any other key is an error that
names it. Modules that register components are listed in :data:`COMPONENT_MODULES` and
imported on first lookup.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

from torch import nn


@dataclasses.dataclass(frozen=True)
class Modality:
    """An input modality of ``OmniModel``: the recipe sections (= registry kinds = model attributes)
    of its encoder and projector, and the micro-batch keys its items ride in.

    ``inputs``  encoder input rows of all items of the row (pixel patches, mel frames)
    ``grid``    per-item sizes (``grid_thw [M, 3]``, ``audio_lengths [A]``); its first dim counts items
    ``spans``   (start, length) of each run of the items' placeholder tokens, in feature order
    ``rows``    per-token feature index (-1: none), replacing ``spans`` on shards of a row (CP, TP, RL)
    ``sizes``   optional per-item ``[M, 2]`` (height, width of the item as given) for a projector that
                lays its items' features out by their own size (``projector.uses_sizes``: LLaVA-OneVision's
                unpadding); rides with ``grid`` wherever the items go

    The encoder is called ``encoder(inputs, grid)``, the projector ``projector(hidden, grid)`` (per
    token, so any slice of an item's frames / tiles projects alone) and ``projector.num_tokens(grid)``
    (``num_tokens(grid, sizes)`` with ``uses_sizes``), then, for a projector that ``arranges``,
    ``projector(features, grid, sizes=sizes, arrange=True)`` on whole items (after any split of the
    items across ranks); ``encoder.dummy_input(device) -> (inputs, grid)`` is its smallest
    item. Adding a modality is an entry here, its components and YAML, and the data that fills
    its keys; ``OmniModel`` and ``parallel/`` loop over this table."""

    name: str
    encoder: str
    projector: str
    inputs: str
    grid: str
    spans: str
    rows: str
    kinds: tuple[str, ...] = ()  # the media kinds of the data (``span.kind``) whose items it encodes
    sizes: str | None = None


MODALITIES = (
    Modality("vision", "image_encoder", "projector", "pixel_values", "grid_thw", "media_spans", "feature_rows",
             ("image", "video"), "image_sizes"),
    Modality("audio", "audio_encoder", "audio_projector", "audio_features", "audio_lengths", "audio_spans",
             "audio_feature_rows", ("audio",)),
)


def modality_of(kind: str) -> Modality:
    """The modality that encodes media of ``kind`` (image, video, audio)."""
    for m in MODALITIES:
        if kind in m.kinds:
            return m
    raise ValueError(f"no modality encodes media of kind {kind!r}; known: {[k for m in MODALITIES for k in m.kinds]}")


ENCODER_SECTIONS = tuple(s for m in MODALITIES for s in (m.encoder, m.projector))
# video diffusion (models/diffusion.py): the generator (a DiT) is the trained model; the VAE and the
# text encoder around it are frozen codecs that run offline (`data pack`) and at sampling time, as is
# image-to-video's image encoder (CLIP, diffusion/image_encoder.py; not `image_encoder`: that kind is
# a multimodal LLM's vision tower)
DIFFUSION_SECTIONS = ("generator", "vae", "text_encoder", "image_conditioner")
# the action expert (vision-language-action models, models/vla.py) sits beside the encoders: it
# reads the backbone's keys and values instead of feeding it
MODEL_SECTIONS = ("foundation", *ENCODER_SECTIONS, "action_expert", *DIFFUSION_SECTIONS)

KINDS = (*MODEL_SECTIONS, "hf", "reward")


@dataclasses.dataclass(frozen=True)
class CommonConfig:
    """The keys every component config may carry that are not fields of its dataclass, with their
    defaults: read them through :func:`common_config`, never with a default of their own."""

    name: str | None = None  # the registered name
    freeze: bool = False  # no gradients for the component's weights
    tp: int = 1  # tensor-parallel ranks for the component (parallel/dims.py)
    lora: Any = None  # adapters (models/lora.py)
    lr: float | None = None  # train/optim.py: the component's own rate (None: train.lr x lr_scale)
    lr_scale: float = 1.0
    weight_decay: float | None = None  # None: train.weight_decay


COMMON_KEYS = tuple(f.name for f in dataclasses.fields(CommonConfig))

# Modules whose import registers components (add yours here).
COMPONENT_MODULES = [
    "omniweave.models.components.decoder",
    "omniweave.models.hf.qwen2",
    "omniweave.models.hf.llama",
    "omniweave.models.hf.qwen3",
    "omniweave.models.hf.qwen3_moe",
    "omniweave.models.hf.deepseek_v3",
    "omniweave.models.hf.gemma",
    "omniweave.models.components.vit",
    "omniweave.models.components.projector",
    "omniweave.models.hf.qwen2_vl",
    "omniweave.models.hf.qwen2_5_vl",
    "omniweave.models.components.qwen3_vit",
    "omniweave.models.hf.qwen3_vl",
    "omniweave.models.hf.qwen3_5",
    "omniweave.models.components.intern_vit",
    "omniweave.models.hf.internvl",
    "omniweave.models.components.siglip",
    "omniweave.models.components.llava_projector",
    "omniweave.models.hf.llava_onevision",
    "omniweave.models.hf.paligemma",
    "omniweave.models.hf.pi05",
    "omniweave.models.components.audio_encoder",
    "omniweave.models.components.audio_projector",
    "omniweave.models.hf.qwen2_audio",
    "omniweave.models.hf.qwen2_5_omni",
    "omniweave.models.components.action_expert",
    "omniweave.models.components.wan_dit",
    "omniweave.models.components.wan_vae",
    "omniweave.diffusion.text_encoder",
    "omniweave.diffusion.image_encoder",
    "omniweave.rl.rewards",
]

_REGISTRY: dict[str, dict[str, tuple[type, type | None]]] = {k: {} for k in KINDS}
_imported = False


def register(kind: str, name: str, config_cls: type | None = None) -> Callable[[type], type]:
    """Decorator: register ``cls`` (built as ``cls(config_cls(**fields))``; a function for
    ``reward``) as kind/name."""
    if kind not in KINDS:
        raise ValueError(f"unknown component kind {kind!r}; kinds: {', '.join(KINDS)}")

    def deco(cls: type) -> type:
        old = _REGISTRY[kind].get(name)
        if old is not None and old[0].__qualname__ != cls.__qualname__:
            raise ValueError(f"{kind} {name!r} is already registered to {old[0].__qualname__}")
        _REGISTRY[kind][name] = (cls, config_cls)
        return cls

    return deco


def _import_components() -> None:
    global _imported
    if not _imported:
        for mod in COMPONENT_MODULES:
            importlib.import_module(mod)
        _imported = True


def names(kind: str) -> list[str]:
    _import_components()
    return sorted(_REGISTRY[kind])


def lookup(kind: str, name: str) -> tuple[type, type | None]:
    """(class, config class) registered as kind/name; a clear error listing what exists."""
    _import_components()
    if kind not in KINDS:
        raise ValueError(f"unknown component kind {kind!r}; kinds: {', '.join(KINDS)}")
    if name not in _REGISTRY[kind]:
        known = ", ".join(sorted(_REGISTRY[kind])) or "none"
        raise KeyError(f"no {kind} named {name!r} is registered (registered: {known})")
    return _REGISTRY[kind][name]


def _as_dict(cfg: Any) -> dict[str, Any]:
    from omniweave.config import to_dict

    return to_dict(cfg)


def common_config(cfg: Any) -> CommonConfig:
    """The common keys (:class:`CommonConfig`) of a component's YAML mapping (None: no section),
    the dataclass's defaults for those it leaves out."""
    cfg = _as_dict(cfg)
    return CommonConfig(**{k: cfg[k] for k in COMMON_KEYS if k in cfg})


def field_defaults(config_cls: type) -> dict[str, Any]:
    """Field -> default of a config dataclass, for every field that has one (a default_factory's
    value made fresh); the required fields are left out."""
    out = {}
    for f in dataclasses.fields(config_cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def build_config(kind: str, cfg: Any):
    """The config dataclass of ``cfg['name']`` filled from ``cfg`` (common keys dropped)."""
    cfg = _as_dict(cfg)
    if "name" not in cfg:
        raise KeyError(f"{kind} config has no 'name:' (keys: {', '.join(cfg) or 'none'})")
    _, config_cls = lookup(kind, cfg["name"])
    fields = {f.name for f in dataclasses.fields(config_cls)}
    values = {k: v for k, v in cfg.items() if k not in COMMON_KEYS}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise KeyError(
            f"{kind} {cfg['name']!r}: unknown config key(s) {', '.join(map(repr, unknown))}; "
            f"valid keys: {', '.join(sorted(fields | set(COMMON_KEYS)))}"
        )
    try:
        return config_cls(**values)
    except TypeError as e:  # a required field missing
        raise KeyError(f"{kind} {cfg['name']!r}: {e}") from None


def build_component(kind: str, cfg: Any) -> nn.Module:
    """Instantiate a component from its YAML dict; ``freeze: true`` turns its gradients off."""
    cfg = _as_dict(cfg)
    config = build_config(kind, cfg)
    cls, _ = lookup(kind, cfg["name"])
    module = cls(config)
    if common_config(cfg).freeze:
        module.requires_grad_(False)
    return module


def component_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{section: module}`` of the components ``model`` holds: an OmniModel / CausalLM keeps each
    section's module as the attribute of that name (a pipeline stage's absent parts are None). The
    one mapping from recipe sections to modules: LoRA adds adapters by it, the optimizer groups
    parameters by it (train/optim.py)."""
    return {s: m for s in MODEL_SECTIONS if (m := getattr(model, s, None)) is not None}


def build_model(model_cfg: Any, adapters: bool = True) -> nn.Module:
    """The recipe's ``model:`` section -> a model implementing the trainer's model contract.

    With an ``action_expert`` it is a :class:`~omniweave.models.vla.VLAModel` (the encoders read
    the observation, the expert denoises action chunks); with any encoder (:data:`MODALITIES`)
    ``OmniModel(foundation, **encoders and their projectors)`` (``omniweave.models.omni``);
    otherwise a text-only :class:`~omniweave.models.text.CausalLM`; with a ``generator`` (video
    diffusion) a :class:`~omniweave.models.diffusion.DiffusionModel`. ``adapters``: add the components' ``lora:`` adapters
    (models/lora.py); the trainer passes False and adds them after tensor parallelism.
    """
    cfg = _as_dict(model_cfg)
    unknown = sorted(set(cfg) - set(MODEL_SECTIONS))
    if unknown:
        raise KeyError(f"model: unknown section(s) {', '.join(map(repr, unknown))}; "
                       f"expected {', '.join(MODEL_SECTIONS)}")  # fmt: skip
    model = _build_generator(cfg) if cfg.get("generator") else _build_language_model(cfg)
    if adapters:
        from omniweave.models.lora import apply_lora

        apply_lora(model, cfg)
    return model


def _build_language_model(cfg: dict) -> nn.Module:
    if "foundation" not in cfg:
        raise KeyError("model: a 'foundation' component is required (or a 'generator' for video diffusion)")
    foundation = build_component("foundation", cfg["foundation"])
    parts = {}
    for m in MODALITIES:
        if cfg.get(m.encoder):
            if not cfg.get(m.projector):
                raise KeyError(f"model: an {m.encoder} needs a '{m.projector}' component")
            parts[m.encoder] = build_component(m.encoder, cfg[m.encoder])
            parts[m.projector] = build_component(m.projector, cfg[m.projector])
        elif cfg.get(m.projector):
            raise KeyError(f"model: a '{m.projector}' without an '{m.encoder}' has nothing to project")
    if cfg.get("action_expert"):
        from omniweave.models.vla import VLAModel

        model = VLAModel(foundation, build_component("action_expert", cfg["action_expert"]), **parts)
    elif parts:
        from omniweave.models.omni import OmniModel

        model = OmniModel(foundation=foundation, **parts)
    else:
        from omniweave.models.text import CausalLM

        model = CausalLM(foundation)
    return model


def _build_generator(cfg: dict) -> nn.Module:
    """A video-diffusion model: the ``generator`` alone (the VAE and text encoder sections are read
    by ``data pack`` and ``generate``); a language-model section beside it is an error."""
    from omniweave.models.diffusion import DiffusionModel

    stray = [s for s in ("foundation", *ENCODER_SECTIONS, "action_expert") if cfg.get(s)]
    if stray:
        raise KeyError(f"model: a 'generator' (video diffusion) trains alone; remove {', '.join(map(repr, stray))}")
    return DiffusionModel(build_component("generator", cfg["generator"]))
