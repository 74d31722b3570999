"""The files that make an export a whole Hugging Face model directory, besides config + weights:
the tokenizer, the chat template, and (VL models) the image / video processor configs.

Everything comes from the recipe's ``data:`` section, because that is what the model was
trained on: the tokenizer files are copied, ``chat_template.jinja`` renders ``data.template``
(:func:`omniweave.data.text.jinja_export.hf_chat_template`), and the processor configs carry the resize
rules of ``data.vision`` (:class:`omniweave.data.media.vision.VisionConfig`), so that
``AutoProcessor.from_pretrained(export)`` gives the grids and pixels training saw.

    tokenizer.json, tokenizer_config.json, …  the recipe's tokenizer (its own chat_template key dropped)
    chat_template.jinja                         data.template as Jinja
    preprocessor_config.json                    Qwen2VLImageProcessor: min/max_pixels, patch, merge, mean/std
    video_preprocessor_config.json              Qwen2VLVideoProcessor / Qwen3VLVideoProcessor (data.vision.frame_sampling):
                                                video_min/max_pixels, fps, min/max_frames
    processor_config.json                       processor_class (Qwen2VLProcessor / Qwen2_5_VLProcessor / Qwen3VLProcessor)

Audio models (Qwen2-Audio) get ``preprocessor_config.json`` as ``WhisperFeatureExtractor`` (the
mel bins of the exported audio tower; 16 kHz, 30 s windows: ``data/media/mel.py``'s constants) and
``processor_config.json`` naming ``Qwen2AudioProcessor``.

The Qwen2.5-Omni thinker (``Qwen2_5OmniProcessor``: image processor, video processor, feature
extractor, tokenizer) gets one ``preprocessor_config.json`` holding both the image processor's and
the ``WhisperFeatureExtractor``'s fields (``AutoImageProcessor`` and ``AutoFeatureExtractor`` each
read it, as in the released checkpoints), the video config, and in ``tokenizer_config.json`` the
named media tokens its processor reads off the tokenizer (``image_token``, ``audio_bos_token`` …:
the recipe template's, :func:`media_tokens`).

The image and video configs are written as separate files with both the ``size`` dict
(transformers 5) and the ``min_pixels`` / ``max_pixels`` keys (transformers 4, serving engines);
``processor_config.json`` holds no nested copies, so each setting lives in one place.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from omniweave.config import section
from omniweave.data.media.vision import VisionConfig
from omniweave.data.media.mel import CHUNK_SAMPLES, HOP_LENGTH, N_FFT, SAMPLE_RATE

PROCESSOR_CLASSES = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor",
                     "qwen3_vl": "Qwen3VLProcessor", "qwen3_vl_moe": "Qwen3VLProcessor",
                     "qwen3_5": "Qwen3VLProcessor", "qwen3_5_moe": "Qwen3VLProcessor",
                     "qwen2_5_omni_thinker": "Qwen2_5OmniProcessor", "internvl": "InternVLProcessor",
                     "llava_onevision": "LlavaOnevisionProcessor"}  # fmt: skip
AUDIO_PROCESSOR_CLASSES = {"qwen2_audio": "Qwen2AudioProcessor"}
# Qwen3-VL's processor writes video timestamps and needs its own video processor (metadata)
VIDEO_PROCESSOR_TYPES = {"Qwen3VLProcessor": "Qwen3VLVideoProcessor"}


def _normalisation(vision: VisionConfig, processor_class: str) -> dict:
    """What images and video frames share: RGB, PIL bicubic (resample 3), /255, mean/std, patches."""
    return {
        "processor_class": processor_class,
        "do_convert_rgb": True,
        "do_resize": True,
        "resample": 3,
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(vision.image_mean),
        "image_std": list(vision.image_std),
        "patch_size": vision.patch_size,
        "temporal_patch_size": vision.temporal_patch_size,
        "merge_size": vision.merge_size,
    }


def image_processor_config(vision: VisionConfig, processor_class: str) -> dict:
    """``preprocessor_config.json``: smart_resize into [min_pixels, max_pixels], as ours."""
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        **_normalisation(vision, processor_class),
        "size": {"shortest_edge": vision.min_pixels, "longest_edge": vision.max_pixels},
        "min_pixels": vision.min_pixels,
        "max_pixels": vision.max_pixels,
    }


def video_processor_config(vision: VisionConfig, processor_class: str) -> dict:
    """``video_preprocessor_config.json``: the video processor of ``processor_class`` set to sample
    and resize as ``data.vision`` does (``frame_sampling``; ``ValueError`` when that rule is not the
    processor's own).

    Qwen3-VL (``qwen3_vl``): ``Qwen3VLVideoProcessor`` samples the frames itself
    (``do_sample_frames``), ``size`` = [video_min_pixels, video_max_pixels] bounding frames ×
    height × width, without its per-frame cap (``cap_pixels_per_frame: false``, as released).

    Qwen2-VL / Qwen2.5-VL / Qwen2.5-Omni (``Qwen2VLVideoProcessor``): ``fps`` sampling clamped to
    [min_frames, max_frames], frames resized into [video_min_pixels, video_max_pixels] with the
    whole-video pixel budget (``cap_pixels_per_frame``; transformers counts it in tokens of
    ``factor``² pixels × 0.9). transformers places the sampled frames only its own way
    (``arange(0, n, n / k)``), so the processor samples them itself (``do_sample_frames``) when the
    recipe trained on that placement (``frame_sampling: transformers``: then its pixels equal ours).
    With the default placement (qwen-vl-utils' rounded ``linspace``), as for Qwen's own
    checkpoints, the caller gives it the sampled frames (qwen-vl-utils does), and it keeps them.
    """
    video_type = VIDEO_PROCESSOR_TYPES.get(processor_class, "Qwen2VLVideoProcessor")
    own = "qwen3_vl" if video_type == "Qwen3VLVideoProcessor" else "qwen_vl_utils or transformers"
    if (vision.frame_sampling == "qwen3_vl") != (own == "qwen3_vl"):
        raise ValueError(f"data.vision.frame_sampling={vision.frame_sampling!r}, but {processor_class}'s "
                         f"{video_type} samples videos as {own}")  # fmt: skip
    common = {
        "video_processor_type": video_type,
        **_normalisation(vision, processor_class),
        "size": {"shortest_edge": vision.video_min_pixels, "longest_edge": vision.video_max_pixels},
        "fps": vision.fps,
        "min_frames": vision.min_frames,
        "max_frames": vision.max_frames,
    }
    if video_type == "Qwen3VLVideoProcessor":
        return {**common, "do_sample_frames": True, "cap_pixels_per_frame": False}
    budget_tokens = vision.video_total_pixels / (vision.factor**2 * 0.9)
    return {
        **common,
        "min_pixels": vision.video_min_pixels,
        "max_pixels": vision.video_max_pixels,
        "do_sample_frames": vision.frame_sampling == "transformers",
        "cap_pixels_per_frame": True,
        "max_video_tokens": round(budget_tokens) if abs(budget_tokens - round(budget_tokens)) < 1e-6 else budget_tokens,
    }


def check_vision_matches_model(vision: VisionConfig, hf_cfg: dict) -> None:
    """The recipe's patch / merge sizes must be the model's (training would have failed otherwise)."""
    v = hf_cfg.get("vision_config") or {}
    for ours, theirs in (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
                         ("merge_size", "spatial_merge_size")):  # fmt: skip
        if theirs in v and v[theirs] != getattr(vision, ours):
            raise ValueError(f"data.vision.{ours}={getattr(vision, ours)} but the model's vision_config.{theirs}={v[theirs]}")


def _framing(media: str, pad: str) -> tuple[str, str]:
    """The special tokens right before and after ``pad`` in a media format (Qwen2-Audio's
    ``Audio {index}: <|audio_bos|><|AUDIO|><|audio_eos|>\n`` frames its pad with audio_bos / audio_eos)."""
    before, after = media.split(pad)
    bos, eos = re.search(r"(<\|[^|]*\|>)?$", before).group(1), re.match(r"(<\|[^|]*\|>)?", after).group(1)
    return bos or "", eos or ""


def media_tokens(template) -> dict[str, str]:
    """A chat template's media tokens under transformers' names: the pads and the tokens framing
    them (``image`` = vision_bos + pad + vision_eos, ``audio`` = audio_bos + pad + audio_eos)."""
    vision_bos, vision_eos = _framing(template.image, template.image_pad)
    audio_bos, audio_eos = _framing(template.audio, template.audio_pad)
    return {"image_token": template.image_pad, "video_token": template.video_pad, "audio_token": template.audio_pad,
            "vision_bos_token": vision_bos, "vision_eos_token": vision_eos,
            "audio_bos_token": audio_bos, "audio_eos_token": audio_eos}  # fmt: skip


# processors that read the media tokens off the tokenizer (tokenizer.image_token …), not their own defaults
NAMED_TOKEN_PROCESSORS = ("Qwen2_5OmniProcessor",)


def write_tokenizer_files(tok_dir: Path, out_dir: Path, template_name: str, named_tokens: bool = False) -> list[str]:
    """Copy the tokenizer and write ``chat_template.jinja`` for the recipe's template. A chat
    template the tokenizer brought along (tokenizer_config.json's ``chat_template``, or files
    next to it) is not copied: the exported one is what the model was trained with.
    ``named_tokens``: tokenizer_config.json also names the template's media tokens
    (``image_token``: ``<|IMAGE|>`` …), which the tokenizer must hold."""
    from omniweave.data.text.hf_template import HFChatTemplate
    from omniweave.data.text.jinja_export import hf_chat_template
    from omniweave.data.text.template import load_template
    from omniweave.data.text.tokenizer import TOKENIZER_FILES, load_tokenizer

    template = load_template(template_name, tokenizer=tok_dir)
    names = media_tokens(template) if named_tokens else {}
    if names:  # a name the processor looks up must be a token of the tokenizer
        tok = load_tokenizer(str(tok_dir))
        missing = [t for t in names.values() if not tok.has_token(t)]
        if missing:
            raise ValueError(f"template {template_name!r}: the tokenizer in {tok_dir} has no {missing} token(s)")

    written = []
    for name in TOKENIZER_FILES:
        if not (tok_dir / name).is_file():
            continue
        if name == "tokenizer_config.json":
            tok_cfg = json.loads((tok_dir / name).read_text())
            tok_cfg.pop("chat_template", None)
            tok_cfg.update(names)
            (out_dir / name).write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
        else:
            shutil.copyfile(tok_dir / name, out_dir / name)
        written.append(name)
    # data.template=hf trained on the directory's own template: it is exported as it is
    jinja = template.source if isinstance(template, HFChatTemplate) else hf_chat_template(template)
    (out_dir / "chat_template.jinja").write_text(jinja)
    return written + ["chat_template.jinja"]


def internvl_processor_files(vision: VisionConfig, hf_cfg: dict) -> dict[str, dict]:
    """InternVL's processor (``InternVLProcessor``): ``GotOcr2ImageProcessor`` cropping to the
    recipe's tiles (``data.vision.tiling: internvl``: tile size, tile limits, mean / std; the
    thumbnail is always on there), the video processor resizing each frame to one tile, and the
    image tokens per tile."""
    if vision.tiling != "internvl" or not vision.use_thumbnail:
        raise ValueError("an internvl export needs data.vision.tiling: internvl with use_thumbnail: true "
                         "(what InternVLProcessor does)")  # fmt: skip
    side = {"height": vision.tile_size, "width": vision.tile_size}
    norm = {"do_convert_rgb": True, "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
            "do_normalize": True, "image_mean": list(vision.image_mean), "image_std": list(vision.image_std),
            "processor_class": "InternVLProcessor", "size": side}  # fmt: skip
    tokens = (vision.tile_size // vision.patch_size // vision.merge_size) ** 2
    return {"preprocessor_config.json": {"image_processor_type": "GotOcr2ImageProcessor", "crop_to_patches": True,
                                         "min_patches": vision.min_tiles, "max_patches": vision.max_tiles, **norm},
            "video_preprocessor_config.json": {"video_processor_type": "InternVLVideoProcessor", **norm},
            "processor_config.json": {"processor_class": "InternVLProcessor",
                                      "image_seq_length": hf_cfg.get("image_seq_length", tokens)}}  # fmt: skip


# the names InternVLProcessor reads off the tokenizer (tokenizer.start_image_token …; transformers 5
# makes tokenizer_config.json's extra_special_tokens attributes)
INTERNVL_TOKENS = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                   "video_token": "<video>"}  # fmt: skip


def name_internvl_tokens(out_dir: Path) -> None:
    """tokenizer_config.json's ``extra_special_tokens`` for InternVLProcessor (the tokenizer must hold them)."""
    from omniweave.data.text.tokenizer import load_tokenizer

    tok = load_tokenizer(str(out_dir))  # <video> is only text the processor replaces (not a token of InternVL's tokenizers)
    missing = [t for k, t in INTERNVL_TOKENS.items() if k != "video_token" and not tok.has_token(t)]
    if missing:
        raise ValueError(f"an internvl export needs the tokens {missing} in its tokenizer")
    file = out_dir / "tokenizer_config.json"
    cfg = json.loads(file.read_text())
    cfg["extra_special_tokens"] = {**(cfg.get("extra_special_tokens") or {}), **INTERNVL_TOKENS}
    file.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def llava_onevision_processor_files(vision: VisionConfig) -> dict[str, dict]:
    """LLaVA-OneVision's processor (``LlavaOnevisionProcessor``): its image processor tiling "anyres"
    over the recipe's pinpoints (``data.vision.tiling: anyres``: tile size, ``anyres_grid``,
    ``anyres_max``, mean / std), the video processor resizing each frame to one tile, and the
    features per tile the processor counts tokens with."""
    if vision.tiling != "anyres":
        raise ValueError("a llava_onevision export needs data.vision.tiling: anyres (what LlavaOnevisionProcessor does)")
    tile, grid = vision.tile_size, vision.anyres_grid
    side = range(tile, tile * grid + 1, tile)
    norm = {"do_convert_rgb": True, "do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255,
            "do_normalize": True, "image_mean": list(vision.image_mean), "image_std": list(vision.image_std),
            "processor_class": "LlavaOnevisionProcessor", "size": {"height": tile, "width": tile}}  # fmt: skip
    return {"preprocessor_config.json": {"image_processor_type": "LlavaOnevisionImageProcessor", "do_pad": True,
                                         "image_grid_pinpoints": [[h, w] for h in side for w in side], **norm},
            "video_preprocessor_config.json": {"video_processor_type": "LlavaOnevisionVideoProcessor", **norm},
            "processor_config.json": {"processor_class": "LlavaOnevisionProcessor",
                                      "num_image_tokens": (tile // vision.patch_size) ** 2,
                                      "vision_feature_select_strategy": "full",
                                      "vision_aspect_ratio": f"anyres_max_{vision.anyres_max}"}}  # fmt: skip


FAMILY_PROCESSOR_FILES = {"InternVLProcessor": lambda vision, hf_cfg: internvl_processor_files(vision, hf_cfg),
                          "LlavaOnevisionProcessor": lambda vision, hf_cfg: llava_onevision_processor_files(vision)}  # fmt: skip


def write_processor_files(out_dir: Path, data_cfg: dict, hf_cfg: dict, tok_dir: Path | None) -> list[str]:
    """Write the tokenizer, chat template and (VL model types) processor configs; returns the
    names written. ``hf_cfg`` is the exported config.json (its model_type picks the processor)."""
    written = []
    processor_class = PROCESSOR_CLASSES.get(hf_cfg.get("model_type"))
    if tok_dir is not None:
        written += write_tokenizer_files(tok_dir, out_dir, section({"data": data_cfg}, "data").template,
                                         named_tokens=processor_class in NAMED_TOKEN_PROCESSORS)  # fmt: skip
    if hf_cfg.get("model_type") in AUDIO_PROCESSOR_CLASSES:
        return written + write_audio_processor_files(out_dir, hf_cfg)
    if processor_class is None:  # a text-only model: the tokenizer is its processor
        return written
    vision = VisionConfig.from_mapping(data_cfg.get("vision"))
    if processor_class in FAMILY_PROCESSOR_FILES:  # processors of their own (tiles), not Qwen-VL's
        files = FAMILY_PROCESSOR_FILES[processor_class](vision, hf_cfg)
        if tok_dir is not None and processor_class == "InternVLProcessor":
            name_internvl_tokens(out_dir)
        for name, content in files.items():
            (out_dir / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
        return written + list(files)
    check_vision_matches_model(vision, hf_cfg)
    files = {"preprocessor_config.json": image_processor_config(vision, processor_class),
             "video_preprocessor_config.json": video_processor_config(vision, processor_class),
             "processor_config.json": {"processor_class": processor_class}}  # fmt: skip
    if "audio_config" in hf_cfg:  # Qwen2.5-Omni: the feature extractor reads the same file
        n_mels = hf_cfg["audio_config"]["num_mel_bins"]
        files["preprocessor_config.json"] |= audio_feature_extractor_config(n_mels, processor_class)
    for name, content in files.items():
        (out_dir / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    return written + list(files)


def audio_feature_extractor_config(n_mels: int, processor_class: str) -> dict:
    """``preprocessor_config.json``: transformers' ``WhisperFeatureExtractor`` computing what
    ``data/mel.log_mel`` computes (its tests compare the two)."""
    return {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "processor_class": processor_class,
        "feature_size": n_mels,
        "sampling_rate": SAMPLE_RATE,
        "hop_length": HOP_LENGTH,
        "n_fft": N_FFT,
        "chunk_length": CHUNK_SAMPLES // SAMPLE_RATE,
        "n_samples": CHUNK_SAMPLES,
        "nb_max_frames": CHUNK_SAMPLES // HOP_LENGTH,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": True,
    }


def write_audio_processor_files(out_dir: Path, hf_cfg: dict) -> list[str]:
    processor_class = AUDIO_PROCESSOR_CLASSES[hf_cfg["model_type"]]
    n_mels = hf_cfg["audio_config"]["num_mel_bins"]
    files = {"preprocessor_config.json": audio_feature_extractor_config(n_mels, processor_class),
             "processor_config.json": {"processor_class": processor_class}}  # fmt: skip
    for name, content in files.items():
        (out_dir / name).write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
    return list(files)
