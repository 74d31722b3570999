"""Gemma (HF ``model_type: gemma``, ``GemmaForCausalLM``): zero-centred RMSNorms (x̂ · (1 + w) in
float32, then cast), a gelu-tanh SwiGLU-shaped MLP, token embeddings × sqrt(hidden_size), free
``head_dim`` (GemmaConfig's default 256), tied embeddings by default, no biases.

The differences are decoder options (``norm_zero_centered``, ``scale_embeddings``, ``hidden_act``);
tensor names are the base's renames. Both sides store the embedding table unscaled.
"""

from omniweave.models.hf.adapter import DecoderAdapter
from omniweave.models.registry import register

GELU_TANH = "gelu_pytorch_tanh"


def gemma_activation(hf) -> str:
    """The MLP activation as transformers 5 reads it: ``hidden_act`` (4.x configs may carry only
    ``hidden_activation``), default gelu-tanh; the released configs' ``gelu`` means gelu-tanh
    (GemmaConfig.__post_init__ rewrites it)."""
    act = hf.get("hidden_act") or hf.get("hidden_activation") or GELU_TANH
    return GELU_TANH if act == "gelu" else act


@register("hf", "gemma")
class GemmaAdapter(DecoderAdapter):
    model_type, architecture, family = "gemma", "GemmaForCausalLM", "gemma"

    def family_config_to_ours(self, hf):
        if hf.get("attention_bias"):  # HF's bias would be on o_proj too, which our attention lacks
            raise NotImplementedError("gemma: attention_bias=true is not supported")
        if hf.get("use_bidirectional_attention"):
            raise NotImplementedError("gemma: use_bidirectional_attention=true is not supported (causal only)")
        return {
            "qkv_bias": False,
            "qk_norm": False,
            "norm_zero_centered": True,
            "scale_embeddings": True,
            "hidden_act": gemma_activation(hf),
            "head_dim": hf.get("head_dim") or 256,  # GemmaConfig's default, not hidden / heads
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", True)),
            "max_position_embeddings": hf.get("max_position_embeddings", 8192),
        }

    def family_config_to_hf(self, cfg):
        if cfg.qkv_bias or cfg.qk_norm or not (cfg.norm_zero_centered and cfg.scale_embeddings):
            raise ValueError("a gemma export needs norm_zero_centered=true, scale_embeddings=true, "
                             "qkv_bias=false and qk_norm=false")  # fmt: skip
        if cfg.num_experts or cfg.layer_types is not None or cfg.attn_output_gate or cfg.mrope_section:
            raise ValueError("a gemma export cannot carry experts, linear layers, an attention output gate or M-RoPE")
        # hidden_activation: what transformers 4.x's GemmaMLP reads (5.x reads hidden_act)
        return {"attention_bias": False, "hidden_activation": cfg.hidden_act}
