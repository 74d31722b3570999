"""Qwen3.5 and Qwen3-Next (HF ``model_type``: ``qwen3_5`` / ``qwen3_5_moe`` with vision,
``qwen3_5_text`` / ``qwen3_5_moe_text`` without, ``qwen3_next``): hybrid decoders whose layers are
Gated DeltaNet linear attention or gated full attention (``layer_types``; components/
linear_attention.py), partial rotary, zero-centred RMSNorms, and for the MoE ones experts plus a
gated shared expert (components/moe.py). Our decoder family is ``qwen3_5`` (export as ``qwen3_5*``)
or ``qwen3_next``; the architecture is one, its settings are fields.

    HF                                                     ours
    model.layers.N.linear_attn.{in_proj_qkv, in_proj_z,    foundation.layers.N.linear_attn.*  (same names)
      in_proj_b, in_proj_a, conv1d, dt_bias, A_log, norm, out_proj}
    model.layers.N.mlp.shared_expert{,_gate}.*             foundation.layers.N.mlp.shared_expert{,_gate}.*
    mtp.*  (multi-token prediction)                         not kept (transformers drops it too; logged)

Qwen3-Next stores the linear layers' input projections grouped per key head:
``in_proj_qkvz`` rows ``[q_g, k_g, v_g, z_g]`` for each key head g (v_g / z_g: that head's
``nv / nk`` value heads) and ``in_proj_ba`` rows ``[b_g, a_g]``; Qwen3.5's ``in_proj_qkv`` holds
all q heads, then all k, then all v (the convolution's channel order in both). Loading regroups,
export writes the grouped layout back; the sizes come from the config the adapter read
(``config_to_ours`` / ``config_to_hf``), so it is stateful like the DeepSeek-V3 adapter.

The VL models are Qwen3-VL's (components/qwen3_vit.py, its merger, interleaved M-RoPE, video
timestamps) without DeepStack.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from omniweave.models.hf.adapter import DecoderAdapter
from omniweave.models.hf.experts import PerExpertTensors
from omniweave.models.hf.qwen3_vl import Qwen3VLAdapter
from omniweave.models.registry import register

log = logging.getLogger("omniweave.hf")
MTP_PREFIX = "mtp."
_LINEAR = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
           "linear_conv_kernel_dim")


def hf_layer_types(hf: dict[str, Any]) -> list[str]:
    """``layer_types`` of a config, or transformers' default: every ``full_attention_interval``-th
    layer (4) full attention, the others linear."""
    if hf.get("layer_types"):
        return list(hf["layer_types"])
    every = int(hf.get("full_attention_interval", 4))
    return ["linear_attention" if (i + 1) % every else "full_attention" for i in range(hf["num_hidden_layers"])]


class HybridTextAdapter(DecoderAdapter):
    """The Qwen3.5 text decoder (``qwen3_5_text``): what every adapter of this module shares."""

    model_type, architecture, family = "qwen3_5_text", "Qwen3_5ForCausalLM", "qwen3_5"

    def __init__(self, text_only: bool = True):
        self.text_only = text_only  # False: the decoder of a VL model (M-RoPE kept)

    def family_config_to_ours(self, hf):
        rope = dict(hf.get("rope_parameters") or {})
        return {
            "qkv_bias": bool(hf.get("attention_bias", False)), "qk_norm": True, "attn_output_gate": True,
            "norm_zero_centered": True, "layer_types": hf_layer_types(hf),
            "partial_rotary_factor": float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))),
            **{k: hf[k] for k in _LINEAR if k in hf},
            # text-only positions: M-RoPE's three equal rows are plain RoPE
            **({"mrope_section": None} if self.text_only else {}),
            **self.moe_config_to_ours(hf),
        }  # fmt: skip

    def moe_config_to_ours(self, hf) -> dict:
        return {}

    def family_config_to_hf(self, cfg):
        if not (cfg.qk_norm and cfg.attn_output_gate and cfg.norm_zero_centered) or cfg.layer_types is None:
            raise ValueError(f"a {self.model_type} export needs qk_norm, attn_output_gate and norm_zero_centered "
                             "true and layer_types set")  # fmt: skip
        return {
            "attention_bias": cfg.qkv_bias, "layer_types": list(cfg.layer_types),
            **{k: getattr(cfg, k) for k in _LINEAR}, **self.moe_config_to_hf(cfg),
        }  # fmt: skip

    def moe_config_to_hf(self, cfg) -> dict:
        if cfg.num_experts:
            raise ValueError(f"a {self.model_type} export is dense: this decoder has num_experts={cfg.num_experts}")
        return {}

    def config_to_hf(self, cfg) -> dict[str, Any]:
        out = super().config_to_hf(cfg)
        out["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor
        return out

    def name_to_ours(self, hf_name: str) -> str | None:
        return None if hf_name.startswith(MTP_PREFIX) else super().name_to_ours(hf_name)


class HybridMoeTextAdapter(PerExpertTensors, HybridTextAdapter):
    """Qwen3.5-MoE's decoder (``qwen3_5_moe_text``): every layer MoE, the top-k always
    renormalised, a gated shared expert; experts one tensor per expert on disk (hf/experts.py)."""

    model_type, architecture = "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"

    def config_to_ours(self, hf):
        # no dense layers: intermediate_size (absent from the config) is only a placeholder
        return super().config_to_ours({"intermediate_size": hf["moe_intermediate_size"], **hf})

    def moe_config_to_ours(self, hf) -> dict:
        return {
            "num_experts": hf["num_experts"], "num_experts_per_tok": hf["num_experts_per_tok"],
            "moe_intermediate_size": hf["moe_intermediate_size"],
            "shared_expert_intermediate_size": hf["shared_expert_intermediate_size"], "norm_topk_prob": True,
            "router_aux_loss_coef": float(hf.get("router_aux_loss_coef") or 0.0) if hf.get("output_router_logits") else 0.0,
        }  # fmt: skip

    def moe_config_to_hf(self, cfg) -> dict:
        dense = sorted(set(range(cfg.num_layers)) - set(cfg.moe_layers()))
        if not cfg.num_experts or dense or not cfg.norm_topk_prob or cfg.moe_router != "softmax" \
                or cfg.n_shared_experts or not cfg.shared_expert_intermediate_size:  # fmt: skip
            raise ValueError(f"a {self.model_type} export needs every layer MoE (dense: {dense}), the softmax "
                             "router with norm_topk_prob, and a gated shared expert (shared_expert_intermediate_size)")
        return {
            "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
            "output_router_logits": cfg.router_aux_loss_coef > 0, "router_aux_loss_coef": cfg.router_aux_loss_coef or 0.001,
        }  # fmt: skip

    def config_to_hf(self, cfg) -> dict[str, Any]:
        out = super().config_to_hf(cfg)
        out.pop("intermediate_size")
        return out


# ---------------------------------------------------------------------------- Qwen3-Next


def grouped_to_ours(qkvz: torch.Tensor, ba: torch.Tensor, nk: int, dk: int, nv: int, dv: int):
    """Qwen3-Next's per-key-head ``in_proj_qkvz`` / ``in_proj_ba`` -> our (in_proj_qkv, z, b, a)."""
    r, D = nv // nk, qkvz.shape[-1]
    g = qkvz.reshape(nk, 2 * dk + 2 * r * dv, D)
    q, k, v, z = g.split([dk, dk, r * dv, r * dv], dim=1)
    b, a = ba.reshape(nk, 2 * r, D).split([r, r], dim=1)
    flat = lambda t: t.reshape(-1, D)
    return torch.cat([flat(q), flat(k), flat(v)]), flat(z), flat(b), flat(a)


def grouped_to_hf(qkv: torch.Tensor, z, b, a, nk: int, dk: int, nv: int, dv: int):
    """Our (in_proj_qkv, z, b, a) -> Qwen3-Next's (in_proj_qkvz, in_proj_ba)."""
    D = qkv.shape[-1]
    q, k, v = qkv.split([nk * dk, nk * dk, nv * dv])
    per_head = lambda t: t.reshape(nk, -1, D)
    qkvz = torch.cat([per_head(q), per_head(k), per_head(v), per_head(z)], dim=1).reshape(-1, D)
    return qkvz, torch.cat([per_head(b), per_head(a)], dim=1).reshape(-1, D)


_OURS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
_DIMS = ("linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads", "linear_value_head_dim")


@register("hf", "qwen3_next")
class Qwen3NextAdapter(PerExpertTensors, HybridTextAdapter):
    """Qwen3-Next (text): MoE with a gated shared expert under Qwen3-MoE's layer rule
    (``mlp_only_layers``, ``decoder_sparse_step``), 1-D RoPE, grouped linear-layer projections."""

    model_type, architecture, family = "qwen3_next", "Qwen3NextForCausalLM", "qwen3_next"
    dims: tuple[int, int, int, int] | None = None  # (nk, dk, nv, dv) of the config read last

    def config_to_ours(self, hf):
        out = super().config_to_ours(hf)
        self.dims = tuple(out[k] for k in _DIMS)
        return out

    def config_to_hf(self, cfg) -> dict[str, Any]:
        self.dims = tuple(getattr(cfg, k) for k in _DIMS)
        return super().config_to_hf(cfg)

    def moe_config_to_ours(self, hf) -> dict:
        return {
            "num_experts": hf["num_experts"], "num_experts_per_tok": hf["num_experts_per_tok"],
            "moe_intermediate_size": hf["moe_intermediate_size"],
            "shared_expert_intermediate_size": hf["shared_expert_intermediate_size"],
            "norm_topk_prob": bool(hf.get("norm_topk_prob", True)), "decoder_sparse_step": hf.get("decoder_sparse_step", 1),
            "mlp_only_layers": list(hf.get("mlp_only_layers") or []),
            "router_aux_loss_coef": float(hf.get("router_aux_loss_coef") or 0.0) if hf.get("output_router_logits") else 0.0,
        }  # fmt: skip

    def moe_config_to_hf(self, cfg) -> dict:
        if not cfg.num_experts or cfg.moe_router != "softmax" or cfg.n_shared_experts or not cfg.shared_expert_intermediate_size:
            raise ValueError("a qwen3_next export needs num_experts > 0, the softmax router and a gated shared "
                             "expert (shared_expert_intermediate_size)")  # fmt: skip
        return {
            "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": cfg.norm_topk_prob,
            "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size,
            "decoder_sparse_step": cfg.decoder_sparse_step, "mlp_only_layers": sorted({*cfg.mlp_only_layers, *range(cfg.first_k_dense_replace)}),
            "output_router_logits": cfg.router_aux_loss_coef > 0, "router_aux_loss_coef": cfg.router_aux_loss_coef or 0.001,
        }  # fmt: skip

    def _sizes(self) -> tuple[int, int, int, int]:
        if self.dims is None:
            raise RuntimeError("qwen3_next: the adapter converts the linear layers' projections only after reading a config")
        return self.dims

    def model_tensors_to_ours(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = super().model_tensors_to_ours(tensors)
        for name in [n for n in out if n.endswith(".linear_attn.in_proj_qkvz.weight")]:
            prefix = name[: -len("in_proj_qkvz.weight")]
            parts = grouped_to_ours(out.pop(name), out.pop(prefix + "in_proj_ba.weight"), *self._sizes())
            out.update({f"{prefix}{p}.weight": t for p, t in zip(_OURS, parts)})
        return out

    def assemble(self, name: str, has: Callable[[str], bool], read: Callable[[str], torch.Tensor]) -> torch.Tensor | None:
        head, _, proj = name.rpartition(".linear_attn.")
        if proj not in (f"{p}.weight" for p in _OURS):
            return super().assemble(name, has, read)
        hf = f"{self.model_name_to_hf(head + '.linear_attn')}"
        parts = grouped_to_ours(read(f"{hf}.in_proj_qkvz.weight"), read(f"{hf}.in_proj_ba.weight"), *self._sizes())
        return dict(zip((f"{p}.weight" for p in _OURS), parts))[proj]

    def tensors_to_hf(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The export's whole-dict pass: our four projections of each linear layer grouped."""
        for name in [n for n in tensors if n.endswith(".linear_attn.in_proj_qkv.weight")]:
            prefix = name[: -len("in_proj_qkv.weight")]
            qkv, z, b, a = (tensors.pop(f"{prefix}{p}.weight") for p in _OURS)
            tensors[prefix + "in_proj_qkvz.weight"], tensors[prefix + "in_proj_ba.weight"] = grouped_to_hf(
                qkv, z, b, a, *self._sizes())
        return tensors


# ---------------------------------------------------------------------------- with vision


@register("hf", "qwen3_5")
class Qwen3_5Adapter(Qwen3VLAdapter):
    """Qwen3.5 (``Qwen3_5ForConditionalGeneration``): Qwen3-VL's vision tower and merger without
    DeepStack over the hybrid decoder with interleaved M-RoPE."""

    model_type = "qwen3_5"
    architecture = "Qwen3_5ForConditionalGeneration"
    text_model_type = "qwen3_5_text"
    vision_model_type = "qwen3_5_vision"
    text = HybridTextAdapter(text_only=False)

    def model_config_to_ours(self, hf: dict[str, Any]) -> dict[str, Any]:
        text = dict(hf.get("text_config") or {})
        # transformers' default bands when the config names none
        text["rope_parameters"] = {"mrope_section": [11, 11, 10], **(text.get("rope_parameters") or {})}
        vision = {**(hf.get("vision_config") or {}), "deepstack_visual_indexes": []}
        return super().model_config_to_ours({**hf, "vision_config": vision, "text_config": text})

    def vision_config_to_hf(self, enc, proj) -> dict[str, Any]:
        if list(enc.deepstack_visual_indexes) or proj.deepstack_levels:
            raise ValueError(f"a {self.model_type} export has no DeepStack: set deepstack_visual_indexes: [] "
                             "and deepstack_levels: 0")  # fmt: skip
        out = super().vision_config_to_hf(enc, proj)
        out.pop("deepstack_visual_indexes")
        return out

    def name_to_ours(self, hf_name: str) -> str | None:
        return None if hf_name.startswith(MTP_PREFIX) else super().name_to_ours(hf_name)


@register("hf", "qwen3_5_moe")
class Qwen3_5MoeAdapter(PerExpertTensors, Qwen3_5Adapter):
    model_type = "qwen3_5_moe"
    architecture = "Qwen3_5MoeForConditionalGeneration"
    text_model_type = "qwen3_5_moe_text"
    vision_model_type = "qwen3_5_moe_vision"
    text = HybridMoeTextAdapter(text_only=False)  # (it fills in and drops the placeholder intermediate_size)


register("hf", "qwen3_5_text")(HybridTextAdapter)
register("hf", "qwen3_5_moe_text")(HybridMoeTextAdapter)

__all__ = ["HybridMoeTextAdapter", "HybridTextAdapter", "Qwen3NextAdapter", "Qwen3_5Adapter", "Qwen3_5MoeAdapter",
           "grouped_to_hf", "grouped_to_ours", "hf_layer_types"]
