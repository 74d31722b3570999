"""Qwen2.5-Omni thinker (HF ``model_type: qwen2_5_omni_thinker``; the full ``qwen2_5_omni``
directory holds it under ``thinker.``): config and tensor names, both directions.

Our model is ``OmniModel(foundation=Decoder (Qwen2, M-RoPE), image_encoder=VisionTransformer
(``qwen2_5_omni_vit``), projector=PatchMerger (rmsnorm), audio_encoder=Qwen25OmniAudioEncoder,
audio_projector=identity)``:

    HF (saved thinker; transformers 5 in-memory names in brackets)      ours
    model.*   [model.language_model.*]                                 foundation.*
    lm_head.weight                                                     foundation.lm_head.weight
    audio_tower.*   [model.audio_tower.*]                              audio_encoder.*
    visual.merger.{ln_q, mlp.0, mlp.2}   [model.visual.merger.*]       projector.*
    visual.blocks.N.attn.{q, k, v}   [model.visual.…]                  image_encoder.blocks.N.attn.qkv (fused)
    visual.*   [model.visual.*]                                        image_encoder.*

The vision tower is Qwen2.5-VL's except that its attention keeps separate ``q`` / ``k`` / ``v``
linears; ours is one fused ``qkv`` (rows q, then k, then v), so loading concatenates them
(``model_tensors_to_ours``, ``assemble``) and export splits them (``model_tensors_to_hf``).

A full ``qwen2_5_omni`` directory (thinker + talker + token2wav) loads its thinker only: the
``thinker.`` prefix is dropped, ``talker.*`` / ``token2wav.*`` are skipped (said once on load).
An export always writes the thinker alone (``Qwen2_5OmniThinkerForConditionalGeneration``).

Token ids and the TMRoPE time scale (``audio_token_index``, ``image_token_index``,
``video_token_index``, ``audio_start_token_id``, ``vision_start_token_id``,
``position_id_per_seconds``, ``seconds_per_chunk`` … every scalar key of the thinker config)
are not model parameters; they ride in ``foundation.extra_hf["omni"]`` and export writes them back.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Callable
from typing import Any

import torch

from omniweave.models.hf.adapter import MultimodalAdapter, renamed
from omniweave.models.hf.qwen2 import Qwen2Adapter
from omniweave.models.hf.qwen2_5_vl import Qwen25VLAdapter
from omniweave.models.hf.qwen2_audio import Qwen2AudioAdapter
from omniweave.models.registry import register

THINKER = "qwen2_5_omni_thinker"
# transformers' thinker defaults, plus the vision start / end ids its get_rope_index reads from
# the config although Qwen2_5OmniThinkerConfig does not declare them (released configs carry them)
OMNI_DEFAULTS = {"audio_token_index": 151646, "image_token_index": 151655, "video_token_index": 151656,
                 "audio_start_token_id": 151647, "audio_end_token_id": 151648, "vision_start_token_id": 151652,
                 "vision_end_token_id": 151653, "user_token_id": 872, "position_id_per_seconds": 25,
                 "seconds_per_chunk": 2}  # fmt: skip
# top-level keys that are not carried in extra_hf["omni"] (written from our configs, or transformers' own)
_NOT_CARRIED = {"architectures", "model_type", "tie_word_embeddings", "dtype", "torch_dtype", "transformers_version",
                "_name_or_path", "initializer_range"}  # fmt: skip
_QKV = re.compile(r"^(image_encoder\.blocks\.\d+\.attn)\.(qkv|q|k|v)\.(weight|bias)$")
# HF prefixes (saved thinker, then transformers 5 in-memory) -> ours; order: most specific first
_TO_OURS = (
    ("model.visual.merger.", "projector."),
    ("visual.merger.", "projector."),
    ("model.visual.", "image_encoder."),
    ("visual.", "image_encoder."),
    ("model.audio_tower.", "audio_encoder."),
    ("audio_tower.", "audio_encoder."),
    ("model.language_model.", "foundation."),
    ("model.", "foundation."),
    ("lm_head.", "foundation.lm_head."),
)
_TO_HF = (
    ("projector.", "visual.merger."),
    ("image_encoder.", "visual."),
    ("audio_encoder.", "audio_tower."),
    ("foundation.lm_head.", "lm_head."),
    ("foundation.", "model."),
)


class Qwen25OmniThinkerAdapter(MultimodalAdapter):
    """HF ⇄ omniweave for the Qwen2.5-Omni thinker (text output; see the module doc)."""

    config_sections = ("image_encoder", "projector", "audio_encoder")
    model_type = THINKER
    architecture = "Qwen2_5OmniThinkerForConditionalGeneration"
    multimodal = True
    text = Qwen2Adapter()
    vision = Qwen25VLAdapter()  # same vision config keys and checks as Qwen2.5-VL's tower
    audio = Qwen2AudioAdapter()  # same Whisper-style audio config keys

    # ---- config ---------------------------------------------------------------------
    def thinker_config(self, hf: dict[str, Any]) -> dict[str, Any]:
        """The thinker's config of a thinker or a full ``qwen2_5_omni`` config.json."""
        if hf.get("model_type") != "qwen2_5_omni":
            return hf
        if not hf.get("thinker_config"):
            raise ValueError("qwen2_5_omni: config.json has no thinker_config")
        print("qwen2_5_omni: loading the thinker (text output) only; talker and token2wav are not loaded", file=sys.stderr)
        return hf["thinker_config"]

    def model_config_to_ours(self, hf: dict[str, Any]) -> dict[str, Any]:
        """The recipe ``model:`` section (foundation, image_encoder, projector, audio_encoder,
        audio_projector) of a thinker or full Qwen2.5-Omni config."""
        hf = self.thinker_config(hf)
        text = dict(hf.get("text_config") or {})
        if not text:
            raise ValueError(f"{self.model_type}: config.json has no text_config")
        text["tie_word_embeddings"] = bool(hf.get("tie_word_embeddings", False))  # the thinker's own key decides
        foundation = self.text.config_to_ours(text)
        if not foundation.get("mrope_section"):
            raise ValueError(f"{self.model_type}: the text config has no mrope_section (rope_parameters)")
        omni = {**OMNI_DEFAULTS, **{k: v for k, v in hf.items() if k not in _NOT_CARRIED and not isinstance(v, dict)}}
        foundation["extra_hf"] = {**foundation.get("extra_hf", {}), "omni": omni}
        image_encoder, projector = self.vision.vision_config_to_ours(dict(hf.get("vision_config") or {}))
        image_encoder["name"] = "qwen2_5_omni_vit"
        a = dict(hf.get("audio_config") or {})
        audio_encoder = {**self.audio.encoder_config_to_ours(a), "name": "qwen2_5_omni",
                         "n_window": a.get("n_window", 100), "output_dim": a.get("output_dim", 3584)}  # fmt: skip
        for what, width in (("vision merger", projector["out_dim"]), ("audio tower", audio_encoder["output_dim"])):
            if width != foundation["hidden_size"]:
                raise ValueError(f"{self.model_type}: {what} output {width} != text hidden size {foundation['hidden_size']}")
        return {"foundation": foundation, "image_encoder": image_encoder, "projector": projector,
                "audio_encoder": audio_encoder, "audio_projector": {"name": "identity", "dim": foundation["hidden_size"]}}  # fmt: skip

    def _config_to_hf(self, foundation, image_encoder, projector, audio_encoder) -> dict[str, Any]:
        """HF thinker config.json of our component configs (dataclasses)."""
        extra = dict(foundation.extra_hf)
        omni = {**OMNI_DEFAULTS, **extra.pop("omni", {})}
        if not hasattr(audio_encoder, "n_window"):
            raise ValueError(f"a {self.model_type} export needs a qwen2_5_omni audio_encoder")
        text = self.text.config_to_hf(dataclasses.replace(foundation, extra_hf=extra))
        text.pop("architectures", None)
        text.pop("rope_scaling", None)
        text.update(model_type="qwen2_5_omni_text")
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_section": list(foundation.mrope_section)}
        vision = self.vision.vision_config_to_hf(image_encoder, projector)
        vision.update(model_type="qwen2_5_omni_vision_encoder")
        audio = {
            "model_type": "qwen2_5_omni_audio_encoder",
            "num_mel_bins": audio_encoder.num_mel_bins, "encoder_layers": audio_encoder.num_layers,
            "d_model": audio_encoder.hidden_size, "encoder_attention_heads": audio_encoder.num_heads,
            "encoder_ffn_dim": audio_encoder.intermediate_size, "max_source_positions": audio_encoder.max_source_positions,
            "activation_function": audio_encoder.activation, "n_window": audio_encoder.n_window,
            "output_dim": audio_encoder.output_dim,
        }  # fmt: skip
        return {"architectures": [self.architecture], "model_type": self.model_type, "text_config": text,
                "vision_config": vision, "audio_config": audio, "tie_word_embeddings": foundation.tie_word_embeddings,
                **omni}  # fmt: skip

    # ---- tensor names ---------------------------------------------------------------
    def name_to_ours(self, hf_name: str) -> str | None:
        """Our name of a HF tensor; None for tensors we do not keep (rotary buffers, the talker
        and token2wav of a full directory). Vision q / k / v keep their own names here
        (``…attn.q.weight``); ``model_tensors_to_ours`` fuses them."""
        if hf_name.endswith("inv_freq") or hf_name.startswith(("talker.", "token2wav.")):
            return None
        hf_name = hf_name.removeprefix("thinker.")
        ours = renamed(hf_name, _TO_OURS)
        if ours is None:
            raise KeyError(f"{self.model_type}: unexpected tensor {hf_name!r} in the checkpoint")
        return ours

    def name_to_hf(self, name: str) -> str:
        """Our name -> the name the thinker's ``save_pretrained`` writes (for the fused vision
        ``qkv``, the name of its ``q`` part; ``model_tensors_to_hf`` writes all three)."""
        m = _QKV.match(name)
        if m is not None and m.group(2) == "qkv":
            name = f"{m.group(1)}.q.{m.group(3)}"
        hf = renamed(name, _TO_HF)
        if hf is None:
            raise KeyError(f"{self.model_type}: no HF name for {name!r}")
        return hf

    def model_tensors_to_ours(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Vision attention ``q`` / ``k`` / ``v`` (our prefixes) concatenated into ``qkv``."""
        out, parts = {}, {}
        for name, t in tensors.items():
            m = _QKV.match(name)
            if m is None or m.group(2) == "qkv":
                out[name] = t
            else:
                parts.setdefault((m.group(1), m.group(3)), {})[m.group(2)] = t
        for (prefix, kind), qkv in parts.items():
            if set(qkv) != {"q", "k", "v"}:
                raise KeyError(f"{self.model_type}: {prefix} has {sorted(qkv)} {kind} tensors, needs q, k and v")
            out[f"{prefix}.qkv.{kind}"] = torch.cat([qkv["q"], qkv["k"], qkv["v"]])
        return out

    def hf_names(self, name: str) -> list[str]:
        """The HF tensors one of ours is stored as: three for a vision ``qkv`` (q, k, v), else one."""
        m = _QKV.match(name)
        if m is None:
            return [self.name_to_hf(name)]
        prefix = self.name_to_hf(f"{m.group(1)}.q.{m.group(3)}").removesuffix(f".q.{m.group(3)}")
        return [f"{prefix}.{p}.{m.group(3)}" for p in "qkv"]

    def model_tensors_to_hf(self, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """HF (name, tensor) pairs of one of our tensors: a vision ``qkv`` split in three."""
        names = self.hf_names(name)
        return list(zip(names, t.chunk(3) if len(names) == 3 else [t]))

    def assemble(self, name: str, has: Callable[[str], bool], read: Callable[[str], torch.Tensor]) -> torch.Tensor | None:
        """Our tensor ``name`` read whole from the checkpoint (``load_hf_into``) where it is not one
        HF tensor under the thinker's name: a fused vision ``qkv``, or any tensor of a full
        directory (``thinker.`` prefix); None otherwise."""
        thinker_names = self.hf_names(name)
        names = [n if has(n) else f"thinker.{n}" for n in thinker_names]
        if names == thinker_names[:1]:
            return None
        missing = [n for n in names if not has(n)]
        if missing:
            raise KeyError(f"{self.model_type}: the checkpoint has no {missing}")
        return torch.cat([read(n) for n in names])

    def skip_on_export(self, model) -> set[str]:
        return {"foundation.lm_head.weight"} if model.foundation.config.tie_word_embeddings else set()


register("hf", THINKER)(Qwen25OmniThinkerAdapter)
register("hf", "qwen2_5_omni")(Qwen25OmniThinkerAdapter)
