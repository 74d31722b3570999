"""Qwen2-Audio (HF ``model_type: qwen2_audio``): config and tensor names, both directions.

Our model is ``OmniModel(foundation=Decoder, audio_encoder=Qwen2AudioEncoder, audio_projector=
LinearAudioProjector)``; parameter names only differ from transformers' by prefix:

    HF (saved; transformers 5 in-memory names in brackets)                    ours
    language_model.model.*   [model.language_model.*]                         foundation.*
    language_model.lm_head.weight   [lm_head.weight]                          foundation.lm_head.weight
    audio_tower.*   [model.audio_tower.*]                                     audio_encoder.*
    multi_modal_projector.linear.*   [model.multi_modal_projector.linear.*]   audio_projector.linear.*

The language model is a plain Qwen2 decoder (1-D positions). ``Qwen2AudioForConditionalGeneration``
never ties its head (transformers 5: no tied-weights keys, whatever ``tie_word_embeddings`` says;
released checkpoints carry their own ``lm_head``), so the foundation is always untied on import and
an export always writes the head, also for a foundation trained tied.

The audio token ids are not model parameters; they ride in ``foundation.extra_hf["audio"]``:
``audio_token_id`` (HF ``audio_token_index``, written back on export) and the processor's
``audio_bos_token_id`` / ``audio_eos_token_id`` (not HF config keys: the defaults of the Qwen2
tokenizer unless the config names them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omniweave.models.components.audio_encoder import Qwen25OmniAudioEncoderConfig
from omniweave.models.components.audio_projector import LinearAudioProjectorConfig
from omniweave.models.hf.adapter import MultimodalAdapter, renamed
from omniweave.models.hf.qwen2 import Qwen2Adapter
from omniweave.models.registry import register

QWEN2_AUDIO_TOKEN_IDS = {"audio_token_id": 151646, "audio_bos_token_id": 151647, "audio_eos_token_id": 151648}
# HF text-model prefixes (saved, then transformers 5 in-memory) -> ours; order: longest first
_TO_OURS = (
    ("language_model.lm_head.", "foundation.lm_head."),
    ("language_model.model.", "foundation."),
    ("model.language_model.", "foundation."),
    ("lm_head.", "foundation.lm_head."),
    ("model.audio_tower.", "audio_encoder."),
    ("audio_tower.", "audio_encoder."),
    ("model.multi_modal_projector.", "audio_projector."),
    ("multi_modal_projector.", "audio_projector."),
)
_TO_HF = (
    ("foundation.lm_head.", "language_model.lm_head."),
    ("foundation.", "language_model.model."),
    ("audio_encoder.", "audio_tower."),
    ("audio_projector.", "multi_modal_projector."),
)


class Qwen2AudioAdapter(MultimodalAdapter):
    """HF ⇄ omniweave for Qwen2-Audio (``Qwen2AudioForConditionalGeneration``)."""

    config_sections = ("audio_encoder", "audio_projector")
    model_type = "qwen2_audio"
    architecture = "Qwen2AudioForConditionalGeneration"
    encoder_model_type = "qwen2_audio_encoder"
    multimodal = True
    text = Qwen2Adapter()

    # ---- config ---------------------------------------------------------------------
    def model_config_to_ours(self, hf: dict[str, Any]) -> dict[str, Any]:
        """The recipe ``model:`` section (foundation, audio_encoder, audio_projector) of a HF config."""
        text = dict(hf.get("text_config") or {})
        if not text:
            raise ValueError(f"{self.model_type}: config.json has no text_config")
        text.setdefault("model_type", "qwen2")
        if text["model_type"] != "qwen2":
            raise ValueError(f"{self.model_type}: text model {text['model_type']!r} is not supported (qwen2 only)")
        text["tie_word_embeddings"] = False  # see the module doc: this class never ties its head
        foundation = self.text.config_to_ours(text)
        audio = {"audio_token_id": hf.get("audio_token_index", hf.get("audio_token_id", QWEN2_AUDIO_TOKEN_IDS["audio_token_id"]))}
        for key in ("audio_bos_token_id", "audio_eos_token_id"):
            audio[key] = hf.get(key, QWEN2_AUDIO_TOKEN_IDS[key])
        foundation["extra_hf"] = {**foundation.get("extra_hf", {}), "audio": audio}
        encoder = self.encoder_config_to_ours(dict(hf.get("audio_config") or {}))
        projector = {"name": "linear", "in_dim": encoder["hidden_size"], "out_dim": foundation["hidden_size"]}
        return {"foundation": foundation, "audio_encoder": encoder, "audio_projector": projector}

    def encoder_config_to_ours(self, a: dict[str, Any]) -> dict[str, Any]:
        """Dropout / layerdrop are training-time knobs of transformers we do not implement (our
        towers train without them); ``scale_embedding`` is unused by HF's forward."""
        return {
            "name": "qwen2_audio",
            "num_mel_bins": a.get("num_mel_bins", 128),
            "num_layers": a.get("encoder_layers", 32),
            "hidden_size": a.get("d_model", 1280),
            "num_heads": a.get("encoder_attention_heads", 20),
            "intermediate_size": a.get("encoder_ffn_dim", 5120),
            "max_source_positions": a.get("max_source_positions", 1500),
            "activation": a.get("activation_function", "gelu"),
        }

    def _config_to_hf(self, foundation, encoder, projector) -> dict[str, Any]:
        """HF config.json of our three component configs (dataclasses)."""
        extra = dict(foundation.extra_hf)
        audio = {**QWEN2_AUDIO_TOKEN_IDS, **extra.pop("audio", {})}
        if isinstance(encoder, Qwen25OmniAudioEncoderConfig) or not isinstance(projector, LinearAudioProjectorConfig):
            raise ValueError("a qwen2_audio export needs a qwen2_audio audio_encoder and a linear audio_projector")
        text = self.text.config_to_hf(dataclasses.replace(foundation, extra_hf=extra, tie_word_embeddings=False))
        text.pop("architectures", None)
        text.pop("rope_scaling", None)
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "text_config": text,
            "audio_config": {
                "model_type": self.encoder_model_type,
                "num_mel_bins": encoder.num_mel_bins,
                "encoder_layers": encoder.num_layers,
                "d_model": encoder.hidden_size,
                "encoder_attention_heads": encoder.num_heads,
                "encoder_ffn_dim": encoder.intermediate_size,
                "max_source_positions": encoder.max_source_positions,
                "activation_function": encoder.activation,
            },
            "audio_token_index": audio["audio_token_id"],
        }

    # ---- tensor names ---------------------------------------------------------------
    def name_to_ours(self, hf_name: str) -> str | None:
        if hf_name.endswith("inv_freq"):
            return None
        ours = renamed(hf_name, _TO_OURS)
        if ours is None:
            raise KeyError(f"{self.model_type}: unexpected tensor {hf_name!r} in the checkpoint")
        return ours

    def name_to_hf(self, name: str) -> str:
        """Our name -> the name transformers' ``save_pretrained`` writes (checkpoint layout)."""
        hf = renamed(name, _TO_HF)
        if hf is None:
            raise KeyError(f"{self.model_type}: no HF name for {name!r}")
        return hf

    def skip_on_export(self, model) -> set[str]:
        return set()  # the head is always written: transformers' class never ties it


register("hf", "qwen2_audio")(Qwen2AudioAdapter)
