"""Tiny random Hugging Face text models built from real config classes (no hub access)."""

import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)  # fmt: skip
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}  # fmt: skip

# Qwen3-MoE: non-square, non-round shapes; 2·moe_intermediate == hidden (a transposed gate_up has the
# right shape); layer 1 dense (mlp_only_layers) with its own intermediate_size; 7 experts, top-3.
QWEN3_MOE = dict(vocab_size=1024, hidden_size=40, intermediate_size=56, moe_intermediate_size=20, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=7, num_experts_per_tok=3,
                 norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=4096)  # fmt: skip

# DeepSeek-V3: MLA (q_lora_rank 24, kv_lora_rank 20, qk dims 12 + 8 = 20 != v 16), 5 heads; yarn rope
# with mscale_all_dim (softmax scale and cos/sin scaled); 8 experts in 4 groups of which 2 are
# eligible, top-3, 2 shared experts; layer 0 dense (first_k_dense_replace 1).
DEEPSEEK_V3 = dict(vocab_size=1024, hidden_size=48, intermediate_size=72, moe_intermediate_size=24, num_hidden_layers=3,
                   num_attention_heads=5, num_key_value_heads=5, q_lora_rank=24, kv_lora_rank=20, qk_nope_head_dim=12,
                   qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
                   n_shared_experts=2, routed_scaling_factor=2.5, first_k_dense_replace=1, norm_topk_prob=True,
                   max_position_embeddings=64, rms_norm_eps=1e-5,
                   rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.9,
                                    "mscale_all_dim": 0.8, "original_max_position_embeddings": 16, "beta_fast": 32,
                                    "beta_slow": 1})  # fmt: skip

# Qwen3.5 / Qwen3-Next hybrids: Gated DeltaNet layers (2 key heads of 10, 4 value heads of 14: two value
# heads per key head, so Qwen3-Next's per-key-head grouping of in_proj_qkvz matters) around gated full
# attention (6 heads of 12, 2 kv heads, half of each head rotated); MoE: 5 experts, top-2,
# a gated shared expert of width 28; Qwen3-Next keeps layer 1 dense (mlp_only_layers).
HYBRID = dict(vocab_size=1024, hidden_size=40, intermediate_size=56, num_hidden_layers=4, num_attention_heads=6,
              num_key_value_heads=2, head_dim=12, max_position_embeddings=4096,
              layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
              linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=10, linear_value_head_dim=14,
              linear_conv_kernel_dim=4)  # fmt: skip
HYBRID_MOE = dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=20, shared_expert_intermediate_size=28)

# Gemma: head_dim 20 != hidden / heads = 16, a single kv head, intermediate 72 (gelu-tanh), 3 layers;
# zero-centred norms and embeddings × sqrt(48) (rounded to the dtype: 6.928 in fp32, 6.9375 in bf16).
GEMMA = dict(vocab_size=1024, hidden_size=48, intermediate_size=72, num_hidden_layers=3, num_attention_heads=3,
             num_key_value_heads=1, head_dim=20, max_position_embeddings=4096)  # fmt: skip


def _hybrid_rope(mrope: bool = False) -> dict:
    return {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5,
            **({"mrope_section": [2, 1, 0], "mrope_interleaved": True} if mrope else {})}  # fmt: skip


def _qwen3_5_moe_text(tied):
    kw = {k: v for k, v in HYBRID.items() if k != "intermediate_size"}
    return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**kw, **HYBRID_MOE, tie_word_embeddings=tied,
                                                      rope_parameters=_hybrid_rope()))


FAMILIES = {
    "qwen2": lambda tied: Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=tied, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),  # noqa: E501
    "llama": lambda tied: LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=tied, rope_parameters=LLAMA3_ROPE)),
    "qwen3": lambda tied: Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=tied)),
    "qwen3_moe": lambda tied: Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN3_MOE, tie_word_embeddings=tied)),
    "deepseek_v3": lambda tied, **kw: DeepseekV3ForCausalLM(DeepseekV3Config(**{**DEEPSEEK_V3, **kw}, tie_word_embeddings=tied)),
    "qwen3_5_text": lambda tied: Qwen3_5ForCausalLM(Qwen3_5TextConfig(**HYBRID, tie_word_embeddings=tied,
                                                                      rope_parameters=_hybrid_rope())),
    "qwen3_5_moe_text": _qwen3_5_moe_text,
    "gemma": lambda tied, **kw: GemmaForCausalLM(GemmaConfig(**{**GEMMA, **kw}, tie_word_embeddings=tied)),
    "qwen3_next": lambda tied: Qwen3NextForCausalLM(Qwen3NextConfig(**HYBRID, **HYBRID_MOE, mlp_only_layers=[1],
                                                                    tie_word_embeddings=tied,
                                                                    rope_parameters=_hybrid_rope())),
}


def tiny_hf_model(family: str, tied: bool = False, seed: int = 0, **config):
    """``config``: overrides of the family's config keys (deepseek_v3, gemma)."""
    torch.manual_seed(seed)
    model = FAMILIES[family](tied, **config).float().eval()
    with torch.no_grad():  # random (non-unit) norm weights and biases so every tensor matters
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):  # selection-only bias: must change the routing
                b.copy_(0.3 * torch.randn_like(b))
        for n, p in model.named_parameters():
            if n.endswith("mlp.gate.weight"):  # decisive routing: no near-ties in the top-k between implementations
                p.normal_(std=0.5)
            else:
                perturb_norm_or_bias(n, p)
    return model


def perturb_norm_or_bias(name: str, p: torch.Tensor, norms: tuple[str, ...] = ("norm.weight",)) -> None:
    """A norm weight (its name ends with one of ``norms``) becomes 1 + 0.1·N(0, 1) and a bias
    0.1·N(0, 1), so that a tiny random model's every tensor matters; other parameters are kept."""
    if name.endswith(norms):
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
    elif name.endswith("bias"):
        p.copy_(0.1 * torch.randn_like(p))


def perturb_norms_and_biases(model: torch.nn.Module, norms: tuple[str, ...] = ("norm.weight",)) -> None:
    """``perturb_norm_or_bias`` over every parameter of ``model``, in order."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            perturb_norm_or_bias(name, p, norms)


def save_tiny(family: str, path, tied: bool = False, seed: int = 0, max_shard_size=None, **config):
    model = tiny_hf_model(family, tied, seed, **config)
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kw)
    return model


def saved_perturbed_pair(model_cls, config, path, scale: float = 0.05):
    """A random ``model_cls(config)`` with every weight nudged by ``scale`` noise (so norms and
    biases are not at their init), saved to ``path`` and read back eagerly, and our model loaded
    from the same directory: ``(hf, ours)``, both in eval mode (the VLM families' parity pairs)."""
    from omniweave.models.hf.loading import load_hf

    torch.manual_seed(0)
    hf = model_cls(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * scale)
    hf.save_pretrained(path)
    hf = model_cls.from_pretrained(path, attn_implementation="eager").eval()
    ours, _ = load_hf(path)
    return hf, ours.eval()
