"""Qwen3-VL (HF ``model_type: qwen3_vl``) and Qwen3-VL-MoE (``qwen3_vl_moe``): config and tensor
names, both directions.

Our model is ``OmniModel(foundation=Decoder, image_encoder=qwen3_vit, projector=qwen3_merger)``
(components/qwen3_vit.py); the decoder is Qwen3 (QK-norm) with interleaved M-RoPE, or Qwen3-MoE
with the router always renormalised (``norm_topk_prob: true``: Qwen3-VL-MoE has no such switch).

    HF (checkpoint = transformers 5 in-memory names)     ours
    model.language_model.*                               foundation.*
    lm_head.weight                                        foundation.lm_head.weight
    model.visual.{patch_embed, pos_embed, blocks}.*       image_encoder.*   (mlp.linear_fc1/2 -> mlp.fc1/2)
    model.visual.merger.*                                 projector.merger.*
    model.visual.deepstack_merger_list.*                  projector.deepstack_merger_list.*

MoE expert tensors (``…mlp.experts.gate_up_proj`` / ``down_proj``): released Qwen3-VL-MoE
checkpoints store them transposed, ``[E, D, 2·I]`` / ``[E, I, D]``, against transformers' (and
our) runtime ``[E, 2·I, D]`` / ``[E, D, I]``. Loading transposes and export writes the released
layout; the model_type decides, never the shape: with ``2·I == D`` both layouts have the same
shape (transformers' shape check then skips the transpose, #47031). Note that transformers' own
``save_pretrained`` (5.x) writes the runtime layout; such a file loads here only where the
shapes differ, and then fails with the tensor's name and both shapes rather than loading wrong.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from omniweave.models.hf.experts import FUSED_EXPERT
from omniweave.models.hf.qwen2_vl import Qwen2VLAdapter
from omniweave.models.hf.qwen3 import Qwen3Adapter
from omniweave.models.hf.qwen3_moe import Qwen3MoeAdapter
from omniweave.models.registry import register

_VISION_MLP = (".mlp.linear_fc1.", ".mlp.fc1."), (".mlp.linear_fc2.", ".mlp.fc2.")
_PREFIXES = (("model.visual.merger.", "projector.merger."),
             ("model.visual.deepstack_merger_list.", "projector.deepstack_merger_list."),
             ("model.visual.", "image_encoder."), ("model.language_model.", "foundation."))  # fmt: skip


class Qwen3VLMoeTextAdapter(Qwen3MoeAdapter):
    """The Qwen3-MoE decoder as Qwen3-VL-MoE configures it: the top-k weights always renormalised."""

    def family_config_to_ours(self, hf):
        return {**super().family_config_to_ours(hf), "norm_topk_prob": True}

    def family_config_to_hf(self, cfg):
        if not cfg.norm_topk_prob:
            raise ValueError("a qwen3_vl_moe export needs norm_topk_prob=true (its router always renormalises)")
        out = super().family_config_to_hf(cfg)
        out.pop("norm_topk_prob")
        return out


@register("hf", "qwen3_vl")
class Qwen3VLAdapter(Qwen2VLAdapter):
    model_type = "qwen3_vl"
    architecture = "Qwen3VLForConditionalGeneration"
    text_model_type = "qwen3_vl_text"
    vision_model_type = "qwen3_vl_vision"
    text = Qwen3Adapter()

    # ---- config ---------------------------------------------------------------------
    def model_config_to_ours(self, hf: dict[str, Any]) -> dict[str, Any]:
        out = super().model_config_to_ours(hf)
        out["foundation"]["mrope_interleaved"] = True  # transformers' Qwen3-VL rotary always interleaves
        return out

    def vision_config_to_ours(self, v: dict[str, Any]) -> tuple[dict, dict]:
        if v.get("hidden_act", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"{self.model_type} vision hidden_act {v['hidden_act']!r}: only gelu_pytorch_tanh is supported")
        hidden, merge = v.get("hidden_size", 1152), v.get("spatial_merge_size", 2)
        deepstack = list(v.get("deepstack_visual_indexes", [8, 16, 24]))
        encoder = {
            "name": "qwen3_vit",
            "depth": v.get("depth", 27),
            "hidden_size": hidden,
            "num_heads": v.get("num_heads", 16),
            "intermediate_size": v.get("intermediate_size", 4304),
            "patch_size": v.get("patch_size", 16),
            "temporal_patch_size": v.get("temporal_patch_size", 2),
            "spatial_merge_size": merge,
            "in_channels": v.get("in_channels", 3),
            "num_position_embeddings": v.get("num_position_embeddings", 2304),
            "deepstack_visual_indexes": deepstack,
            "rope_theta": float((v.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        }
        projector = {"name": "qwen3_merger", "in_dim": hidden, "out_dim": v.get("out_hidden_size", 3584),
                     "merge_size": merge, "deepstack_levels": len(deepstack)}  # fmt: skip
        return encoder, projector

    def vision_config_to_hf(self, enc, proj) -> dict[str, Any]:
        if not hasattr(enc, "deepstack_visual_indexes") or not hasattr(proj, "deepstack_levels"):
            raise ValueError(f"a {self.model_type} export needs a qwen3_vit encoder and a qwen3_merger projector")
        return {
            "depth": enc.depth, "hidden_size": enc.hidden_size, "out_hidden_size": proj.out_dim,
            "hidden_act": "gelu_pytorch_tanh", "intermediate_size": enc.intermediate_size,
            "num_heads": enc.num_heads, "in_channels": enc.in_channels, "patch_size": enc.patch_size,
            "spatial_merge_size": enc.spatial_merge_size, "temporal_patch_size": enc.temporal_patch_size,
            "num_position_embeddings": enc.num_position_embeddings,
            "deepstack_visual_indexes": list(enc.deepstack_visual_indexes),
            "initializer_range": 0.02, "rope_parameters": {"rope_theta": enc.rope_theta, "rope_type": "axial"},
        }  # fmt: skip

    def _config_to_hf(self, foundation, image_encoder, projector) -> dict[str, Any]:
        if not foundation.mrope_interleaved:
            raise ValueError(f"a {self.model_type} export needs mrope_interleaved=true in the foundation")
        out = super()._config_to_hf(foundation, image_encoder, projector)
        out["text_config"]["rope_parameters"]["mrope_interleaved"] = True
        return out

    # ---- tensor names ---------------------------------------------------------------
    def name_to_ours(self, hf_name: str) -> str | None:
        if hf_name.endswith("inv_freq"):
            return None
        if hf_name == "lm_head.weight":
            return "foundation.lm_head.weight"
        for theirs, ours in _PREFIXES:
            if hf_name.startswith(theirs):
                name = ours + hf_name[len(theirs):]
                for a, b in _VISION_MLP if ours == "image_encoder." else ():
                    name = name.replace(a, b)
                return name
        raise KeyError(f"{self.model_type}: unexpected tensor {hf_name!r} in the checkpoint")

    def name_to_hf(self, name: str) -> str:
        if name == "foundation.lm_head.weight":
            return "lm_head.weight"
        for theirs, ours in _PREFIXES:
            if name.startswith(ours):
                hf_name = theirs + name[len(ours):]
                for a, b in _VISION_MLP if ours == "image_encoder." else ():
                    hf_name = hf_name.replace(b, a)
                return hf_name
        raise KeyError(f"{self.model_type}: no HF name for {name!r}")


@register("hf", "qwen3_vl_moe")
class Qwen3VLMoeAdapter(Qwen3VLAdapter):
    model_type = "qwen3_vl_moe"
    architecture = "Qwen3VLMoeForConditionalGeneration"
    text_model_type = "qwen3_vl_moe_text"
    vision_model_type = "qwen3_vl_moe_vision"
    text = Qwen3VLMoeTextAdapter()

    # ---- expert tensors: [E, D, 2I] / [E, I, D] on disk <-> [E, 2I, D] / [E, D, I] here -------
    def _to_ours(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if t.dim() != 3:
            raise ValueError(f"{self.model_type}: expert tensor {name!r} has shape {tuple(t.shape)}, expected 3-D")
        return t.transpose(1, 2).contiguous()

    def model_tensors_to_ours(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: self._to_ours(n, t) if FUSED_EXPERT.match(n) else t for n, t in tensors.items()}

    def model_tensors_to_hf(self, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if FUSED_EXPERT.match(name):
            return [(self.name_to_hf(name), t.transpose(1, 2).contiguous())]
        hf_name = self.model_name_to_hf(name)
        return [] if hf_name is None else [(hf_name, t)]

    def assemble(self, name: str, has: Callable[[str], bool], read: Callable[[str], torch.Tensor]) -> torch.Tensor | None:
        """Our expert tensor ``name`` read transposed (``load_hf_into``); None for other tensors."""
        if not FUSED_EXPERT.match(name):
            return None
        hf_name = self.name_to_hf(name)
        if not has(hf_name):
            raise KeyError(f"{self.model_type}: missing tensor {hf_name}")
        return self._to_ours(hf_name, read(hf_name))


__all__ = ["Qwen3VLAdapter", "Qwen3VLMoeAdapter"]
