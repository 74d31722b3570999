"""RoPE variants against transformers: 1-D, Llama-3 scaling, Qwen2-VL M-RoPE, vision 2-D RoPE."""

import pytest
import torch
from transformers import LlamaConfig, Qwen2VLConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen2_vl import modeling_qwen2_vl as hf_vl
from transformers.vision_utils import get_vision_position_ids

from omniweave.models.components.rope import (
    VisionRotaryEmbedding,
    apply_rope,
    rope_attention_factor,
    rope_cos_sin,
    rope_inv_freq,
    vision_position_ids,
)


def test_llama3_scaled_frequencies_equal_transformers():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
    cfg = LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
                      rope_parameters={"rope_theta": 500000.0, **scaling})  # fmt: skip
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg)
    torch.testing.assert_close(rope_inv_freq(128, 500000.0, scaling), ref, rtol=0, atol=0)


@pytest.mark.parametrize("extra", [{"mscale": 1.0, "mscale_all_dim": 1.0},  # DeepSeek-V3's released values
                                   {"mscale": 0.707, "mscale_all_dim": 1.0}, {}, {"truncate": False}])
def test_yarn_cos_sin_equal_transformers(extra):
    """YaRN frequencies and attention factor (cos/sin scaled) of the DeepSeek-V3 rotary embedding,
    on its 64 rope dims with a factor of 40 over 4096 original positions."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

    scaling = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
               "beta_slow": 1, **extra}  # fmt: skip
    cfg = DeepseekV3Config(qk_rope_head_dim=64, max_position_embeddings=163840,
                           rope_parameters={"rope_theta": 10000.0, **scaling})  # fmt: skip
    pos = torch.tensor([[0, 1, 7, 4095, 4096, 100000]])
    cos_ref, sin_ref = DeepseekV3RotaryEmbedding(cfg)(torch.zeros(1), pos)
    cos, sin = rope_cos_sin(pos, 64, 10000.0, None, scaling)
    assert rope_attention_factor(scaling) == pytest.approx(cos_ref[0, 0, 0].item(), abs=1e-6)  # cos(0)·factor
    torch.testing.assert_close(cos, cos_ref[0], rtol=0, atol=2e-6)
    torch.testing.assert_close(sin, sin_ref[0], rtol=0, atol=2e-6)


def test_mrope_equals_qwen2_vl_rotary_embedding():
    cfg = Qwen2VLConfig(
        text_config=dict(hidden_size=256, num_attention_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]})  # noqa: E501
    ).text_config
    rot = hf_vl.Qwen2VLRotaryEmbedding(cfg)
    g = torch.Generator().manual_seed(0)
    pos = torch.randint(0, 50, (3, 1, 40), generator=g)
    cos_ref, sin_ref = rot(torch.zeros(1, dtype=torch.float32), pos)  # [3?]-> [1, L, hd]
    cos, sin = rope_cos_sin(pos[:, 0], 128, 1e6, [16, 24, 24])
    torch.testing.assert_close(cos, cos_ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, sin_ref[0], rtol=1e-6, atol=1e-6)
    q = torch.randn(1, 2, 40, 128, generator=g)
    q_ref, _ = hf_vl.apply_rotary_pos_emb(q, q, cos_ref, sin_ref)
    torch.testing.assert_close(apply_rope(q[0].transpose(0, 1), cos, sin), q_ref[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_interleaved_mrope_equals_qwen3_vl_rotary_embedding():
    """Qwen3-VL: h on bands 1, 4, …, w on bands 2, 5, …; a non-default section [6, 5, 5]."""
    from transformers import Qwen3VLConfig
    from transformers.models.qwen3_vl import modeling_qwen3_vl as hf3

    rope = {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [6, 5, 5], "mrope_interleaved": True}
    cfg = Qwen3VLConfig(text_config=dict(hidden_size=96, num_attention_heads=3, head_dim=32, rope_parameters=rope)).text_config
    rot = hf3.Qwen3VLTextRotaryEmbedding(cfg)
    pos = torch.randint(0, 500, (3, 1, 40), generator=torch.Generator().manual_seed(0))
    cos_ref, sin_ref = rot(torch.zeros(1, dtype=torch.float32), pos)
    cos, sin = rope_cos_sin(pos[:, 0], 32, 5e6, [6, 5, 5], mrope_interleaved=True)
    torch.testing.assert_close(cos, cos_ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, sin_ref[0], rtol=1e-6, atol=1e-6)
    chunked, _ = rope_cos_sin(pos[:, 0], 32, 5e6, [6, 5, 5])
    assert (chunked - cos).abs().max() > 1e-2  # the layout matters


def test_mrope_with_equal_axes_is_plain_rope():
    pos = torch.arange(30)
    a = rope_cos_sin(pos.expand(3, -1), 16, 1e4, [2, 3, 3])
    b = rope_cos_sin(pos[None], 16, 1e4)
    torch.testing.assert_close(a, b)


def test_vision_rope_equals_qwen2_vl_vision_rotary_embedding():
    grid_thw = torch.tensor([[1, 4, 6], [2, 2, 2], [1, 8, 4]])
    vcfg = Qwen2VLConfig(vision_config=dict(embed_dim=80, num_heads=2)).vision_config  # head_dim 40
    rot = hf_vl.Qwen2VLVisionRotaryEmbedding(vcfg)
    ref_pos = get_vision_position_ids(grid_thw, 2)
    assert torch.equal(vision_position_ids(grid_thw, 2), ref_pos)
    cos_ref, sin_ref = rot(torch.zeros(1), ref_pos)
    cos, sin = VisionRotaryEmbedding(40 // 2, 10000.0)(grid_thw, 2)
    assert cos.shape == (4 * 6 + 2 * 4 + 32, 40)
    torch.testing.assert_close(cos, cos_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sin, sin_ref, rtol=1e-6, atol=1e-6)
