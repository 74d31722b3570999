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
TINY = ["tiny_qwen2_vl", "tiny_qwen2_5_vl"]


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
