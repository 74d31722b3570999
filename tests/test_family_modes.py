"""Training modes on the families added by registered components (issue 35: InternVL,
LLaVA-OneVision; the same building blocks as every other family): SFT with and without LoRA on
the tower and the decoder, GRPO (rollouts through the KV-cache engine on tiled images, the update
on prompt + response rows with the prompt's media once) and DPO (a pair's two answers sharing the
prompt's media in one pack), a few steps each on the demo's data packed with the family's tiny recipe."""

from __future__ import annotations

import math

import pytest
import torch

from tests.dpo_factory import dpo_overrides, make_pairs
from tests.rl_factory import make_rl_prompts, rl_overrides
from tests.train_factory import read_metrics

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
RECIPES = ["tiny_internvl", "tiny_llava_onevision"]
TOWER_QKV = {"tiny_internvl": "image_encoder.blocks.0.attn.qkv", "tiny_llava_onevision": "image_encoder.blocks.0.attn.qkv"}


@pytest.mark.parametrize("recipe", RECIPES)
def test_sft_loss_falls_and_lora_trains_on_tower_and_decoder(recipe, tmp_path):
    """The trainer on the demo's data packed with the family's recipe: the loss falls; LoRA adapters
    (``targets: all-linear``) land on the tower's fused qkv and the decoder's projections and train."""
    from tests.train_factory import final_state, losses, make_demo_packed, train_in_process

    packed = make_demo_packed(tmp_path / "data", samples=24, recipe=recipe)
    train_in_process(packed, tmp_path / "full", name=recipe, steps=4, global_batch=2, train__lr=3e-3)
    full = losses(tmp_path / "full")
    assert len(full) == 4 and full[-1] < full[0]
    lora = "{r: 4, alpha: 8, targets: all-linear}"
    train_in_process(packed, tmp_path / "lora", name=recipe, steps=2, global_batch=2,
                     **{"+model.foundation.lora": lora, "+model.image_encoder.lora": lora})  # fmt: skip
    adapters = [k for k in final_state(tmp_path / "lora") if "lora" in k]
    assert any(k.startswith(TOWER_QKV[recipe]) for k in adapters), adapters[:5]
    assert any(k.startswith("foundation.layers.0") for k in adapters)


@pytest.mark.parametrize("recipe", RECIPES)
def test_grpo_runs_on_the_family(recipe, tmp_path):
    from omniweave.config import load_recipe
    from omniweave.rl.trainer import train_rl

    prompts = make_rl_prompts(tmp_path / "data", samples=16, recipe=recipe, overrides=("train.phase=grpo",))
    cfg = load_recipe(recipe, ["train.phase=grpo", "train.lr=1e-3", *rl_overrides(prompts, tmp_path / "run", steps=2, rl__kl_coef=0.05)])
    train_rl(cfg)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["samples"] == 16 and 0 < r["response_len_mean"] <= 5 and math.isfinite(r["loss"]), r
    assert rows[0]["kl"] == 0.0 and rows[-1]["kl"] > 0  # the policy moved off the reference after one update


@pytest.mark.parametrize("recipe", RECIPES)
def test_dpo_runs_on_the_family(recipe, tmp_path):
    from omniweave.config import load_recipe
    from omniweave.train.trainer import train

    pairs = make_pairs(tmp_path / "data", pairs=8, recipe=recipe, overrides=("train.phase=dpo",))
    train(load_recipe(recipe, ["train.phase=dpo", *dpo_overrides(pairs, tmp_path / "run", steps=2)]))
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in rows) and abs(rows[0]["loss"] - math.log(2)) < 1e-4  # policy = ref at step 1


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_balancer_and_pipeline_split_know_the_family(recipe, tmp_path):
    """The DP balancer's FLOP model counts the tower and projector per patch; the pipeline's stage
    split reads the packed data's patches per token (data.balance: cost, parallel.pp need both)."""
    from omniweave.config import load_recipe, to_dict
    from omniweave.parallel.cost_model import CostModel
    from omniweave.train.pipeline_setup import _patches_per_token
    from tests.train_factory import make_demo_packed

    model_cfg = to_dict(load_recipe(recipe).model)
    cost = CostModel.from_model_config(model_cfg)
    assert cost.p > 0 and cost.e > 0
    packed = make_demo_packed(tmp_path, samples=8, recipe=recipe)
    assert 0 < _patches_per_token(str(packed), model_cfg) < 4


@pytest.mark.parametrize("recipe, foundation", [("tiny_internvl", "qwen3_moe_tiny"), ("tiny_llava_onevision", "llama3_tiny"),
                                                ("tiny_llava_onevision", "gemma_tiny")],
                         ids=["internvit+qwen3_moe", "siglip+llama3", "siglip+gemma"])
def test_the_towers_combine_with_any_foundation(recipe, foundation, tmp_path):
    """The component promise: a family's tower and projector over another decoder (YAML only),
    packed data through forward + backward, every part with a gradient."""
    from omniweave.config import load_recipe, to_dict
    from omniweave.data.loading.loader import LOADER_ONLY_KEYS, collate_pack
    from omniweave.data.packing.packed import PackedDataset
    from omniweave.models.registry import build_model
    from tests.train_factory import make_demo_packed

    packed = make_demo_packed(tmp_path, samples=8, recipe=recipe)
    cfg = load_recipe(recipe, [f"foundation@model.foundation={foundation}", f"data.path={packed}"])
    model = build_model(to_dict(cfg.model))
    data_cfg = {k: v for k, v in to_dict(cfg.data).items() if k not in LOADER_ONLY_KEYS}
    batch = next(b for b in (collate_pack(p, data_cfg) for p in PackedDataset(packed)) if b["grid_thw"].shape[0])
    out = model(batch)
    out.loss_sum.backward()
    assert torch.isfinite(out.loss_sum)
    for part in (model.image_encoder, model.projector, model.foundation.layers[-1]):
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in part.parameters()), type(part).__name__
