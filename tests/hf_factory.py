"""Tiny random Hugging Face text models built from real config classes (no hub access)."""

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

TINY = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)  # fmt: skip
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}  # fmt: skip

# Qwen3-MoE: non-square, non-round shapes; 2·moe_intermediate == hidden (a transposed gate_up has the
# right shape); layer 1 dense (mlp_only_layers) with its own intermediate_size; 7 experts, top-3.
QWEN3_MOE = dict(vocab_size=1024, hidden_size=40, intermediate_size=56, moe_intermediate_size=20, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=7, num_experts_per_tok=3,
                 norm_topk_prob=True, mlp_only_layers=[1], max_position_embeddings=4096)  # fmt: skip

FAMILIES = {
    "qwen2": lambda tied: Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=tied, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),  # noqa: E501
    "llama": lambda tied: LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=tied, rope_parameters=LLAMA3_ROPE)),
    "qwen3": lambda tied: Qwen3ForCausalLM(Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=tied)),
    "qwen3_moe": lambda tied: Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN3_MOE, tie_word_embeddings=tied)),
}


def tiny_hf_model(family: str, tied: bool = False, seed: int = 0):
    torch.manual_seed(seed)
    model = FAMILIES[family](tied).float().eval()
    with torch.no_grad():  # random (non-unit) norm weights and biases so every tensor matters
        for n, p in model.named_parameters():
            if n.endswith("mlp.gate.weight"):  # decisive routing: no near-ties in the top-k between implementations
                p.normal_(std=0.5)
            elif n.endswith("norm.weight") or n.endswith("bias"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p) if n.endswith("norm.weight") else 0.1 * torch.randn_like(p))
    return model


def save_tiny(family: str, path, tied: bool = False, seed: int = 0, max_shard_size=None):
    model = tiny_hf_model(family, tied, seed)
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kw)
    return model
