"""Every shipped VL recipe composes with Hydra; tiny ones build and run; real-size ones build on
the meta device with the parameter count of the published checkpoints."""

from __future__ import annotations

import pytest
import torch

from omniweave.config import load_recipe
from omniweave.models.registry import build_model

# published sizes (safetensors parameter totals of the HF checkpoints)
REAL = {
    "qwen2_vl_2b": 2.209e9,
    "qwen2_vl_7b": 8.291e9,
    "qwen2_5_vl_3b": 3.755e9,
    "qwen2_5_vl_7b": 8.292e9,
    "qwen2_5_vl_32b": 33.45e9,
    "qwen2_5_vl_72b": 73.41e9,
}
TINY = ["tiny_qwen2_vl", "tiny_qwen2_5_vl", "tiny_deepseek_v3_vl"]
# Qwen3-VL-8B-Instruct / Qwen3-VL-30B-A3B-Instruct safetensors parameter totals
REAL_QWEN3_VL = {"qwen3_vl_8b": (8_767_123_696, "qwen3_vl"), "qwen3_vl_30b_a3b": (31_070_754_032, "qwen3_vl_moe")}


def _params(model) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


@pytest.mark.parametrize("name", list(REAL))
def test_real_size_recipe_builds_on_meta_with_known_parameter_count(name):
    cfg = load_recipe(name)
    for key in ("data", "train", "parallel", "output_dir"):
        assert key in cfg, key
    with torch.device("meta"):
        model = build_model(cfg.model)
    n = _params(model)
    assert abs(n - REAL[name]) / REAL[name] < 0.01, f"{name}: {n / 1e9:.3f}B parameters, expected ≈{REAL[name] / 1e9:.3f}B"
    assert len(model.image_encoder.blocks) == 32
    assert model.projector.cfg.out_dim == cfg.model.foundation.hidden_size


@pytest.mark.parametrize("name", TINY)
def test_tiny_recipe_builds_and_trains_one_step(name):
    from vl_factory import MEDIA_CASES, make_sample

    cfg = load_recipe(name, ["train.steps=3", "model.image_encoder.freeze=true", "output_dir=/tmp/x"])
    assert cfg.train.steps == 3 and cfg.output_dir == "/tmp/x"
    model = build_model(cfg.model)
    assert not any(p.requires_grad for p in model.image_encoder.parameters())
    sample = make_sample(MEDIA_CASES["mixed"], seed=1)
    batch = {k: v for k, v in sample.items() if k != "kinds"}
    out = model(batch)
    out.loss_sum.backward()
    assert torch.isfinite(out.loss_sum) and int(out.num_tokens) > 0
    assert model.projector.mlp[0].weight.grad is not None


def test_qwen2_5_recipes_use_rmsnorm_merger_and_window_attention():
    cfg = load_recipe("qwen2_5_vl_7b")
    assert cfg.model.projector.norm == "rmsnorm" and cfg.data.rope == "mrope_qwen25"
    assert cfg.model.image_encoder.window_size == 112
    assert list(cfg.model.image_encoder.fullatt_block_indexes) == [7, 15, 23, 31]
    assert load_recipe("qwen2_vl_7b").model.projector.norm == "layernorm"


def test_tiny_model_from_meta_device_initialises_and_runs_in_bf16():
    from vl_factory import MEDIA_CASES, make_sample

    with torch.device("meta"):
        model = build_model(load_recipe("tiny_qwen2_5_vl").model)
    model.to_empty(device="cpu")
    model.init_weights()
    assert torch.equal(model.image_encoder.blocks[0].norm1.weight, torch.ones(32))
    assert abs(model.projector.mlp[0].weight.std().item() - 0.02) < 0.005
    model = model.to(torch.bfloat16)
    batch = {k: v for k, v in make_sample(MEDIA_CASES["mixed"], seed=2).items() if k != "kinds"}
    out = model(batch)
    out.loss_sum.backward()
    assert out.loss_sum.dtype == torch.float32 and torch.isfinite(out.loss_sum)
    assert model.image_encoder.patch_embed.proj.weight.grad.abs().sum() > 0


HUB_QWEN2_VL_7B = {  # config.json of Qwen/Qwen2-VL-7B-Instruct (transformers 4.x layout: flat text keys)
    "architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl", "bos_token_id": 151643,
    "eos_token_id": 151645, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_token_id": 151654, "image_token_id": 151655, "video_token_id": 151656, "hidden_act": "silu",
    "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 32768,
    "max_window_layers": 28, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064,
    "vision_config": {"depth": 32, "embed_dim": 1280, "mlp_ratio": 4, "num_heads": 16, "in_chans": 3,
                      "hidden_size": 3584, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2},
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
}  # fmt: skip


def test_hub_style_flat_config_maps_to_the_shipped_recipe():
    """A 4.x hub config.json (flat text keys, legacy rope_scaling type mrope, in_chans) gives the
    same encoder / projector / LLM sizes as the qwen2_vl_7b recipe."""
    from omniweave.models.hf.loading import adapter_for

    ours = adapter_for("qwen2_vl").model_config(HUB_QWEN2_VL_7B)
    assert ours["foundation"]["rope_scaling"] is None and ours["foundation"]["mrope_section"] == [16, 24, 24]
    assert ours["foundation"]["extra_hf"]["vl"]["image_token_id"] == 151655
    recipe = load_recipe("qwen2_vl_7b").model
    for part in ("image_encoder", "projector"):
        for key, value in ours[part].items():
            assert recipe[part][key] == value, (part, key)
    for key in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "vocab_size", "intermediate_size"):
        assert recipe.foundation[key] == ours["foundation"][key], key
    with torch.device("meta"):
        model = build_model(ours)
    assert abs(_params(model) - REAL["qwen2_vl_7b"]) / REAL["qwen2_vl_7b"] < 0.01


@pytest.mark.parametrize("name", list(REAL_QWEN3_VL))
def test_qwen3_vl_recipes_build_on_meta_with_the_published_parameter_count(name):
    cfg = load_recipe(name)
    with torch.device("meta"):
        model = build_model(cfg.model)
    count, family = REAL_QWEN3_VL[name]
    assert _params(model) == count
    assert model.hf_model_type() == family and cfg.data.rope == "mrope_qwen3vl"
    assert len(model.image_encoder.blocks) == 27 and len(model.projector.deepstack_merger_list) == 3
    assert model.foundation.config.mrope_interleaved and model.foundation.config.rope_theta == 5e6
    from omniweave.config import to_dict
    from omniweave.parallel.cost_model import CostModel

    model_cfg = to_dict(cfg.model)  # the DP balancer's FLOP model knows the merger and its DeepStack mergers
    with_deepstack = CostModel.from_model_config(model_cfg).p
    model_cfg["projector"]["deepstack_levels"] = 0
    assert with_deepstack > CostModel.from_model_config(model_cfg).p > 0


def _model_and_video_pack(name: str, tmp_path):
    """Recipe ``name``'s model (seed 0) and a collated pack holding a video, packed with the recipe
    from a few fake samples (images, videos; Qwen3-VL's timestamped videos: several spans each)."""
    from omniweave.cli import main
    from omniweave.config import to_dict
    from omniweave.data.loading.loader import LOADER_ONLY_KEYS, collate_pack
    from omniweave.data.packing.packed import PackedDataset
    from tests.fakes_data import make_samples, write_raw

    raw = write_raw(tmp_path / "raw", make_samples(n_text=2, n_image=3, n_video=2, rejects=False))
    assert main(["data", "pack", "--input", str(raw), "--output", str(tmp_path / "packed"), "--recipe", name,
                 "--workers", "1", "data.max_len=2048"]) == 0  # fmt: skip
    cfg = load_recipe(name, [f"data.path={tmp_path / 'packed'}", "data.max_len=2048"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    data_cfg = {k: v for k, v in to_dict(cfg.data).items() if k not in LOADER_ONLY_KEYS}
    packs = [collate_pack(p, data_cfg) for p in PackedDataset(tmp_path / "packed")]
    return model, next(b for b in packs if b["media_spans"].shape[0] > b["grid_thw"].shape[0])  # holds a video


@pytest.mark.parametrize("name", ["tiny_qwen3_vl", "tiny_qwen3_vl_moe"])
def test_tiny_qwen3_vl_recipe_trains_on_packed_data(name, tmp_path):
    """Pack images + videos with the recipe (timestamped videos: several media spans per video),
    load a pack through the loader's collate, forward + backward through every part."""
    model, batch = _model_and_video_pack(name, tmp_path)
    assert batch["pixel_values"].shape[1] == 3 * 2 * 16 * 16
    out = model(batch)
    out.loss_sum.backward()
    assert torch.isfinite(out.loss_sum) and int(out.num_tokens) > 0
    for part in ("image_encoder.pos_embed.weight", "projector.deepstack_merger_list.1.linear_fc1.weight",
                 "foundation.layers.0.self_attn.q_proj.weight"):  # fmt: skip
        assert model.get_parameter(part).grad.abs().sum() > 0, part


# Qwen3.5 / Qwen3-Next (issue 34): parameters of the LLM + tower as built here, checked against the
# published sizes' names (9B, 35B total / 3B active, 80B total / 3B active) within the rounding of a name
HYBRID = {"qwen3_5_9b": (9.4e9, "qwen3_5", 27), "qwen3_5_35b_a3b": (35.1e9, "qwen3_5_moe", 27),
          "qwen3_next_80b_a3b": (79.7e9, "qwen3_next", 0)}


@pytest.mark.parametrize("name", list(HYBRID))
def test_hybrid_recipes_build_on_meta_with_the_named_sizes(name):
    from omniweave.models.hf.export import hf_model_type
    from omniweave.train.metrics import foundation_flop_counts

    cfg = load_recipe(name)
    with torch.device("meta"):
        model = build_model(cfg.model)
    size, family, vit_depth = HYBRID[name]
    assert abs(_params(model) - size) / size < 0.01, f"{name}: {_params(model) / 1e9:.3f}B"
    assert hf_model_type(model) == family
    f = model.foundation.config
    assert f.layer_types.count("full_attention") * 4 == f.num_layers and f.partial_rotary_factor == 0.25
    if vit_depth:
        assert len(model.image_encoder.blocks) == vit_depth and model.projector.cfg.deepstack_levels == 0
        assert f.mrope_section == [11, 11, 10] and f.mrope_interleaved
    if f.num_experts:  # "A3B": about 3B parameters per token through the layers and the LM head
        assert 2.5e9 < foundation_flop_counts(model.foundation)[0] < 4e9


@pytest.mark.parametrize("name", ["tiny_qwen3_5", "tiny_qwen3_5_moe"])
def test_tiny_qwen3_5_recipes_train_on_packed_images_and_videos(name, tmp_path):
    """Pack with the recipe (timestamped videos), collate, forward + backward through the tower,
    the merger, a linear layer, a full-attention layer (and the MoE's shared expert)."""
    model, batch = _model_and_video_pack(name, tmp_path)
    out = model(batch)
    out.loss_sum.backward()
    assert torch.isfinite(out.loss_sum) and int(out.num_tokens) > 0
    parts = ["image_encoder.pos_embed.weight", "projector.merger.linear_fc1.weight",
             "foundation.layers.0.linear_attn.in_proj_qkv.weight", "foundation.layers.1.self_attn.q_proj.weight"]
    if name.endswith("moe"):
        parts.append("foundation.layers.0.mlp.shared_expert_gate.weight")
    for part in parts:
        assert model.get_parameter(part).grad.abs().sum() > 0, part


def test_tiny_qwen3_next_recipe_trains_on_packed_text(tmp_path):
    """A text-only hybrid MoE recipe: packs of text (1-D positions), forward + backward through a
    linear layer, a full-attention layer, a MoE layer's shared expert and the dense layer 1."""
    from omniweave.cli import main
    from omniweave.config import to_dict
    from omniweave.data.loading.loader import LOADER_ONLY_KEYS, collate_pack
    from omniweave.data.packing.packed import PackedDataset
    from tests.fakes_data import make_samples, write_raw

    raw = write_raw(tmp_path / "raw", make_samples(n_text=6, n_image=0, n_video=0, rejects=False))
    assert main(["data", "pack", "--input", str(raw), "--output", str(tmp_path / "packed"), "--recipe",
                 "tiny_qwen3_next", "--workers", "1"]) == 0  # fmt: skip
    cfg = load_recipe("tiny_qwen3_next", [f"data.path={tmp_path / 'packed'}"])
    model = build_model(cfg.model)
    data_cfg = {k: v for k, v in to_dict(cfg.data).items() if k not in LOADER_ONLY_KEYS}
    batch = collate_pack(next(iter(PackedDataset(tmp_path / "packed"))), data_cfg)
    assert batch["position_ids"].shape[0] == 1 and batch["cu_seqlens"].numel() > 2
    out = model(batch)
    out.loss_sum.backward()
    assert torch.isfinite(out.loss_sum) and int(out.num_tokens) > 0
    for part in ("foundation.layers.0.linear_attn.A_log", "foundation.layers.1.self_attn.q_proj.weight",
                 "foundation.layers.2.mlp.shared_expert.up_proj.weight", "foundation.layers.1.mlp.up_proj.weight"):
        assert model.get_parameter(part).grad.abs().sum() > 0, part
