"""LLaVA-OneVision (HF ``model_type: llava_onevision``, the ``llava-onevision-qwen2-*-ov-hf``
checkpoints): config and tensor names, both directions.

Our model is ``OmniModel(foundation=Decoder, image_encoder=siglip_vit, projector=llava_onevision_mlp)``
(components/siglip.py, components/llava_projector.py) over any registered text family (Qwen2 in the
released ones), 1-D positions. Names (in memory; the checkpoint layout: llava_layout.py):

    model.vision_tower[.vision_model].embeddings.patch_embedding       image_encoder.patch_embed
    model.vision_tower[.vision_model].embeddings.position_embedding    image_encoder.position_embedding
    model.vision_tower[.vision_model].encoder.layers.N.*               image_encoder.blocks.N.* (siglip_hf_name)
    model.vision_tower[.vision_model].post_layernorm / head            not kept (LLaVA-OneVision reads the
                                                                       last block's output); written on export
                                                                       as an identity LayerNorm, no head
    model.multi_modal_projector.linear_1 / linear_2                    projector.linear_1 / linear_2
    model.image_newline                                                projector.image_newline
"""

from __future__ import annotations

import re
from typing import Any

import torch

from omniweave.models.components.siglip import siglip_hf_name
from omniweave.models.hf.llava_layout import SAVED, LlavaLayoutAdapter, side
from omniweave.models.registry import register

VISION = "model.vision_tower."
VL_KEYS = ("image_token_index", "video_token_index")  # what its config.json calls them
_HF_TOWER = re.compile(r"^model\.vision_tower\.(?:vision_model\.)?(.+)$")
_UNUSED = ("post_layernorm.", "head.")  # SigLIP parts LLaVA-OneVision never reads


@register("hf", "llava_onevision")
class LlavaOnevisionAdapter(LlavaLayoutAdapter):
    model_type = "llava_onevision"
    architecture = "LlavaOnevisionForConditionalGeneration"
    saved = (*SAVED, ("image_newline", "model.image_newline"))

    # ---- config ---------------------------------------------------------------------
    def model_config_to_ours(self, hf: dict[str, Any]) -> dict[str, Any]:
        foundation = self.text_foundation(hf, VL_KEYS)
        layer, strategy = hf.get("vision_feature_layer", -1), hf.get("vision_feature_select_strategy", "full")
        if not isinstance(layer, int) or strategy != "full":
            raise ValueError(f"llava_onevision: vision_feature_layer {layer!r} with select strategy {strategy!r}: "
                             "only one layer with strategy 'full' is supported")  # fmt: skip
        if not hf.get("multimodal_projector_bias", True):
            raise ValueError("llava_onevision: multimodal_projector_bias false is not supported")
        v = dict(hf.get("vision_config") or {})
        if v.get("model_type", "siglip_vision_model") != "siglip_vision_model":
            raise ValueError(f"llava_onevision: vision tower {v.get('model_type')!r}: only SigLIP is supported")
        depth = v.get("num_hidden_layers", 27)
        if layer < 0:  # hidden_states[layer]: the tower runs depth + 1 + layer blocks
            depth, layer = depth + 1 + layer, -1
        image_size, patch = side(v.get("image_size", 384)), side(v.get("patch_size", 14))
        encoder = {"name": "siglip_vit", "depth": depth, "hidden_size": v.get("hidden_size", 1152),
                   "num_heads": v.get("num_attention_heads", 16), "intermediate_size": v.get("intermediate_size", 4304),
                   "in_channels": v.get("num_channels", 3), "patch_size": patch, "image_size": image_size,
                   "norm_eps": v.get("layer_norm_eps", 1e-6), "mlp": v.get("hidden_act", "gelu_pytorch_tanh"),
                   "feature_layer": layer}  # fmt: skip
        projector = {"name": "llava_onevision_mlp", "in_dim": encoder["hidden_size"], "out_dim": foundation["hidden_size"],
                     "act": hf.get("projector_hidden_act", "gelu"), "image_size": image_size, "patch_size": patch,
                     "anyres_grid": _square_grid(hf.get("image_grid_pinpoints"), image_size),
                     "anyres_max": _anyres_max(hf.get("vision_aspect_ratio", "anyres_max_9"))}  # fmt: skip
        return {"foundation": foundation, "image_encoder": encoder, "projector": projector}

    def _config_to_hf(self, foundation, enc, proj) -> dict[str, Any]:
        if not hasattr(enc, "feature_layer") or not hasattr(proj, "anyres_grid"):
            raise ValueError("a llava_onevision export needs a siglip_vit encoder and a llava_onevision_mlp projector")
        if enc.feature_layer not in (-1, enc.depth) or enc.post_layernorm:
            raise ValueError("a llava_onevision export needs a siglip_vit read at its last block (feature_layer -1, "
                             "post_layernorm false): build the tower with the blocks it uses")  # fmt: skip
        text, vl = self.text_config_to_hf(foundation)
        vision = {"model_type": "siglip_vision_model", "hidden_size": enc.hidden_size, "num_hidden_layers": enc.depth,
                  "num_attention_heads": enc.num_heads, "intermediate_size": enc.intermediate_size,
                  "num_channels": enc.in_channels, "patch_size": enc.patch_size, "image_size": enc.image_size,
                  "layer_norm_eps": enc.norm_eps, "hidden_act": enc.mlp, "vision_use_head": False}  # fmt: skip
        return {
            "architectures": [self.architecture], "model_type": self.model_type,
            "text_config": text, "vision_config": vision,
            "image_token_index": vl.get("image_token_index", 151646), "video_token_index": vl.get("video_token_index", 151647),
            "projector_hidden_act": proj.act, "multimodal_projector_bias": True,
            "vision_feature_layer": -1, "vision_feature_select_strategy": "full",
            "vision_aspect_ratio": f"anyres_max_{proj.anyres_max}",
            "image_grid_pinpoints": [list(p) for p in proj.pinpoints()],
            "tie_word_embeddings": foundation.tie_word_embeddings,
        }  # fmt: skip

    # ---- the tower's names ------------------------------------------------------------
    def qkv_names(self, layer: str, leaf: str) -> list[str]:
        return [f"{VISION}encoder.layers.{layer}.self_attn.{p}_proj.{leaf}" for p in "qkv"]

    def _in_memory(self, hf_name: str) -> str:  # the transformers 4 layout keeps the tower under vision_model.
        name = super()._in_memory(hf_name)
        return name.replace("model.vision_tower.vision_model.", VISION, 1)

    def vision_to_ours(self, name: str) -> str | None:
        if name.startswith("model.multi_modal_projector."):
            return "projector." + name[len("model.multi_modal_projector."):]
        if name == "model.image_newline":
            return "projector.image_newline"
        m = _HF_TOWER.match(name)
        if m is None:
            raise KeyError(f"{self.model_type}: unexpected tensor {name!r} in the checkpoint")
        if m[1].startswith(_UNUSED):
            return None
        block = re.match(r"^encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$", m[1])
        if block:
            for ours in ("norm1", "norm2", "attn.proj", "mlp.fc1", "mlp.fc2"):
                if siglip_hf_name(f"blocks.{block[1]}.{ours}.{block[3]}") == (m[1],):
                    return f"image_encoder.blocks.{block[1]}.{ours}.{block[3]}"
        for ours in ("patch_embed.weight", "patch_embed.bias", "position_embedding.weight"):
            if siglip_hf_name(ours) == (m[1],):
                return f"image_encoder.{ours}"
        raise KeyError(f"{self.model_type}: unexpected tensor {name!r} in the checkpoint")

    def vision_to_hf(self, name: str) -> str:
        if name == "projector.image_newline":
            return "model.image_newline"
        if name.startswith("projector."):
            return "model.multi_modal_projector." + name[len("projector."):]
        if name.startswith("image_encoder."):
            (hf_name,) = siglip_hf_name(name[len("image_encoder."):])
            return VISION + hf_name
        raise KeyError(f"{self.model_type}: no HF name for {name!r}")

    def tensors_to_hf(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The export's whole-dict pass: SigLIP's post_layernorm, which transformers' tower holds
        and LLaVA-OneVision never applies, written as an identity LayerNorm."""
        weight = tensors[self._saved(VISION + "embeddings.patch_embedding.weight")]
        width = weight.shape[0]
        tensors[self._saved(VISION + "post_layernorm.weight")] = torch.ones(width, dtype=weight.dtype)
        tensors[self._saved(VISION + "post_layernorm.bias")] = torch.zeros(width, dtype=weight.dtype)
        return tensors


def _square_grid(pinpoints, tile: int) -> int:
    """n of a pinpoint list that is every (i, j) x tile for 1 <= i, j <= n, height-major (the released
    configs' 384..2304); other lists are an error."""
    if not pinpoints:
        return 6
    n = round(len(pinpoints) ** 0.5)
    side = range(tile, tile * n + 1, tile)
    if [list(p) for p in pinpoints] != [[h, w] for h in side for w in side]:
        raise ValueError(f"llava_onevision: image_grid_pinpoints {pinpoints} are not every (i, j) x {tile}, "
                         "1 <= i, j <= n: only such square sets are supported")  # fmt: skip
    return n


def _anyres_max(aspect: str) -> int:
    head, _, n = str(aspect).rpartition("_")
    if head != "anyres_max" or not n.isdigit():
        raise ValueError(f"llava_onevision: vision_aspect_ratio {aspect!r}: only anyres_max_N is supported")
    return int(n)


__all__ = ["LlavaOnevisionAdapter"]
