"""Qwen3-MoE (HF ``model_type: qwen3_moe``): Qwen3 attention (QK-norm) with Mixture-of-Experts MLPs.

Expert tensors: one per expert on disk, 3-D in the model (``hf/experts.py``).

The router is ``mlp.gate.weight [E, D]``; layers outside the MoE rule (``mlp_only_layers``,
``decoder_sparse_step``) keep the dense ``mlp.{gate,up,down}_proj``.
"""

from __future__ import annotations

from omniweave.models.hf.adapter import DecoderAdapter
from omniweave.models.hf.experts import PerExpertTensors
from omniweave.models.registry import register


@register("hf", "qwen3_moe")
class Qwen3MoeAdapter(PerExpertTensors, DecoderAdapter):
    model_type, architecture, family = "qwen3_moe", "Qwen3MoeForCausalLM", "qwen3_moe"

    def family_config_to_ours(self, hf):
        return {
            "qkv_bias": bool(hf.get("attention_bias", False)),
            "qk_norm": True,
            # transformers writes num_experts as num_local_experts (attribute_map); older configs num_experts
            "num_experts": hf.get("num_experts", hf.get("num_local_experts")),
            "num_experts_per_tok": hf["num_experts_per_tok"],
            "moe_intermediate_size": hf["moe_intermediate_size"],
            "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
            "decoder_sparse_step": hf.get("decoder_sparse_step", 1),
            "mlp_only_layers": list(hf.get("mlp_only_layers") or []),
            # transformers adds the aux loss only with output_router_logits (off in released configs)
            "router_aux_loss_coef": float(hf.get("router_aux_loss_coef") or 0.0) if hf.get("output_router_logits") else 0.0,
        }

    def family_config_to_hf(self, cfg):
        if not cfg.qk_norm or not cfg.num_experts or cfg.moe_router != "softmax" or cfg.n_shared_experts:
            raise ValueError("a qwen3_moe export needs qk_norm=true, num_experts > 0, the softmax router and "
                             "no shared experts")
        return {
            "attention_bias": cfg.qkv_bias, "use_sliding_window": False, "sliding_window": None,
            "num_experts": cfg.num_experts, "num_experts_per_tok": cfg.num_experts_per_tok,
            "moe_intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": cfg.norm_topk_prob,
            # (HF Qwen3-MoE has no first_k_dense_replace: the first dense layers are mlp_only_layers)
            "decoder_sparse_step": cfg.decoder_sparse_step, "mlp_only_layers": sorted({*cfg.mlp_only_layers, *range(cfg.first_k_dense_replace)}),
            "output_router_logits": cfg.router_aux_loss_coef > 0, "router_aux_loss_coef": cfg.router_aux_loss_coef or 0.001,
        }  # fmt: skip
