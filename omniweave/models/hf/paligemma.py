"""PaliGemma (HF ``model_type: paligemma``, ``PaliGemmaForConditionalGeneration``, the
``paligemma-3b-*`` checkpoints): config and tensor names, both directions.

Our model is ``OmniModel(foundation=Decoder (family gemma), image_encoder=siglip_vit
(post_layernorm: true), projector=linear)``. What transformers 5 computes, and what matches it here:

- image: SigLIP's ``last_hidden_state`` (all blocks, then ``post_layernorm``; no pooling head:
  ``vision_use_head`` must be false, as in the released configs) -> ``multi_modal_projector.linear``
  (with bias), one feature per patch, (image_size / patch_size)² per image, nothing merged;
- the features replace the ``<image>`` tokens' embeddings AFTER the Gemma embedding scaling
  (``GemmaTextScaledWordEmbedding`` multiplies looked-up rows by sqrt(hidden)); the projector
  output itself is not scaled (older transformers divided it by sqrt(hidden); 5.x does not);
- attention: with ``token_type_ids`` every type-0 token (image + bos + prompt + "\\n") attends
  bidirectionally to the whole prefix, type 1 (suffix) causally: our batch key ``prefix_lens``
  (components/prefix_attention.py). Without ``token_type_ids`` the mask is plainly causal (eager /
  any explicit mask; transformers' SDPA path then drops the mask and, because PaliGemma sets
  ``text_config.use_bidirectional_attention``, attends bidirectionally: hf verify runs eager);
- positions: transformers counts from 1 (``arange + 1``); RoPE depends only on differences, so
  0-based positions give the same logits up to rounding (tests feed 1-based ones).

``text_config.use_bidirectional_attention`` (set by PaliGemmaConfig itself) is dropped on load and
not written on export: the prefix-LM mask comes from the batch, not the config.

Names (in memory; the checkpoint layout, ``language_model.model.*`` …: llava_layout.py):

    model.vision_tower[.vision_model].embeddings.patch_embedding       image_encoder.patch_embed
    model.vision_tower[.vision_model].embeddings.position_embedding    image_encoder.position_embedding
    model.vision_tower[.vision_model].encoder.layers.N.*               image_encoder.blocks.N.* (siglip_hf_name)
    model.vision_tower[.vision_model].post_layernorm                   image_encoder.post_layernorm
    model.multi_modal_projector.linear                                 projector.linear
    model.language_model.* / lm_head                                   foundation.* (Gemma's names)

Any other tensor (a SigLIP ``head``) is an error that names it.
"""

from __future__ import annotations

import re
from typing import Any

from omniweave.models.components.projector import LinearProjectorConfig
from omniweave.models.components.siglip import siglip_hf_name
from omniweave.models.hf.llava_layout import LlavaLayoutAdapter, side
from omniweave.models.registry import register

VISION = "model.vision_tower."
PROJECTOR = "model.multi_modal_projector."
_HF_TOWER = re.compile(r"^model\.vision_tower\.(?:vision_model\.)?(.+)$")
_TOWER_TOP = ("patch_embed.weight", "patch_embed.bias", "position_embedding.weight", "post_layernorm.weight",
              "post_layernorm.bias")  # fmt: skip
_TOWER_BLOCK = ("norm1", "norm2", "attn.proj", "mlp.fc1", "mlp.fc2")
# transformers' SiglipVisionConfig defaults: what a config.json that leaves a key out means
SIGLIP_DEFAULTS = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                   "num_channels": 3, "image_size": 224, "patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
                   "layer_norm_eps": 1e-6}  # fmt: skip


def image_token_id(hf: dict[str, Any]) -> int:
    """The ``<image>`` id of a PaliGemma config (``image_token_index``; 5.x aliases ``image_token_id``)."""
    return int(hf.get("image_token_index", hf.get("image_token_id", 256000)))


def num_image_tokens(hf: dict[str, Any]) -> int:
    """Features per image: (image_size / patch_size)² patches of the tower."""
    v = {**SIGLIP_DEFAULTS, **(hf.get("vision_config") or {})}
    return (side(v["image_size"]) // side(v["patch_size"])) ** 2


@register("hf", "paligemma")
class PaliGemmaAdapter(LlavaLayoutAdapter):
    model_type = "paligemma"
    architecture = "PaliGemmaForConditionalGeneration"

    # ---- config ---------------------------------------------------------------------
    def model_config_to_ours(self, hf: dict[str, Any]) -> dict[str, Any]:
        text = dict(hf.get("text_config") or {})
        text.setdefault("model_type", "gemma")
        if text["model_type"] != "gemma":  # PaliGemma 2 (gemma2: soft-capping, sliding layers) is not supported
            raise ValueError(f"paligemma: text model {text['model_type']!r}: only gemma (PaliGemma 1) is supported")
        text.pop("use_bidirectional_attention", None)  # PaliGemmaConfig sets it; the mask comes from token_type_ids
        foundation = self.text_foundation({**hf, "text_config": text, "image_token_index": image_token_id(hf)},
                                          ("image_token_index",))  # fmt: skip
        v = {**SIGLIP_DEFAULTS, **(hf.get("vision_config") or {})}
        if v.get("model_type", "siglip_vision_model") != "siglip_vision_model":
            raise ValueError(f"paligemma: vision tower {v.get('model_type')!r}: only SigLIP is supported")
        if v.get("vision_use_head", True):  # SiglipVisionConfig's default is true; PaliGemma never reads the head
            raise ValueError("paligemma: vision_config.vision_use_head is true (or unset): PaliGemma reads the "
                             "tower's last_hidden_state, never its pooling head; set it false, as the released "
                             "configs do")  # fmt: skip
        projection = int(hf.get("projection_dim", v.get("projection_dim", 2048)))
        if projection != foundation["hidden_size"]:
            raise ValueError(f"paligemma: projection_dim {projection} is not the text hidden_size "
                             f"{foundation['hidden_size']} (the features replace token embeddings)")  # fmt: skip
        if image_token_id(hf) >= foundation["vocab_size"]:
            raise ValueError(f"paligemma: image_token_index {image_token_id(hf)} is outside the text vocabulary "
                             f"({foundation['vocab_size']}); transformers maps it to 0, omniweave does not")  # fmt: skip
        encoder = {"name": "siglip_vit", "depth": v["num_hidden_layers"], "hidden_size": v["hidden_size"],
                   "num_heads": v["num_attention_heads"], "intermediate_size": v["intermediate_size"],
                   "in_channels": v["num_channels"], "patch_size": side(v["patch_size"]),
                   "image_size": side(v["image_size"]), "norm_eps": v["layer_norm_eps"], "mlp": v["hidden_act"],
                   "feature_layer": -1, "post_layernorm": True}  # fmt: skip
        projector = {"name": "linear", "in_dim": v["hidden_size"], "out_dim": projection}
        return {"foundation": foundation, "image_encoder": encoder, "projector": projector}

    def _config_to_hf(self, foundation, enc, proj) -> dict[str, Any]:
        if not getattr(enc, "post_layernorm", False) or enc.feature_layer not in (-1, enc.depth):
            raise ValueError("a paligemma export needs a siglip_vit with post_layernorm true read at its last block")
        if not isinstance(proj, LinearProjectorConfig) or proj.out_dim != foundation.hidden_size:
            raise ValueError("a paligemma export needs the linear projector into the foundation's hidden size")
        text, vl = self.text_config_to_hf(foundation)
        image = int(vl.get("image_token_index", 256000))  # PaliGemmaConfig's default
        if image >= foundation.vocab_size:
            raise ValueError(f"a paligemma export needs the <image> id inside the vocabulary: image_token_index "
                             f"{image} >= vocab_size {foundation.vocab_size}; set the foundation's "
                             "extra_hf.vl.image_token_index (the recipes do)")  # fmt: skip
        vision = {"model_type": "siglip_vision_model", "hidden_size": enc.hidden_size, "num_hidden_layers": enc.depth,
                  "num_attention_heads": enc.num_heads, "intermediate_size": enc.intermediate_size,
                  "num_channels": enc.in_channels, "patch_size": enc.patch_size, "image_size": enc.image_size,
                  "layer_norm_eps": enc.norm_eps, "hidden_act": enc.mlp, "vision_use_head": False,
                  "projection_dim": foundation.hidden_size}  # fmt: skip
        return {
            "architectures": [self.architecture], "model_type": self.model_type,
            "text_config": text, "vision_config": vision,
            "image_token_index": image,
            "projection_dim": foundation.hidden_size, "hidden_size": foundation.hidden_size,
            "vocab_size": foundation.vocab_size, "tie_word_embeddings": foundation.tie_word_embeddings,
        }  # fmt: skip

    # ---- the tower's and projector's names ---------------------------------------------
    def qkv_names(self, layer: str, leaf: str) -> list[str]:
        return [f"{VISION}encoder.layers.{layer}.self_attn.{p}_proj.{leaf}" for p in "qkv"]

    def _in_memory(self, hf_name: str) -> str:  # transformers 4 checkpoints keep the tower under vision_model.
        return super()._in_memory(hf_name).replace("model.vision_tower.vision_model.", VISION, 1)

    def vision_to_ours(self, name: str) -> str:
        if name in (PROJECTOR + "linear.weight", PROJECTOR + "linear.bias"):
            return "projector." + name[len(PROJECTOR):]
        m = _HF_TOWER.match(name)
        if m is not None:
            block = re.match(r"^encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$", m[1])
            if block:
                for ours in _TOWER_BLOCK:
                    if siglip_hf_name(f"blocks.{block[1]}.{ours}.{block[3]}") == (m[1],):
                        return f"image_encoder.blocks.{block[1]}.{ours}.{block[3]}"
            for ours in _TOWER_TOP:
                if siglip_hf_name(ours) == (m[1],):
                    return f"image_encoder.{ours}"
        raise KeyError(f"{self.model_type}: unexpected tensor {name!r} in the checkpoint")

    def vision_to_hf(self, name: str) -> str:
        if name in ("projector.linear.weight", "projector.linear.bias"):
            return PROJECTOR + name[len("projector."):]
        if name.startswith("image_encoder."):
            (hf_name,) = siglip_hf_name(name[len("image_encoder."):])
            return VISION + hf_name
        raise KeyError(f"{self.model_type}: no HF name for {name!r}")


__all__ = ["PaliGemmaAdapter", "image_token_id", "num_image_tokens"]
