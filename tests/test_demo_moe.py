"""omniweave/configs/recipes/demo_moe.yaml: the demo recipe with only its foundation swapped for a Qwen3-MoE
decoder of the same active size, training on the demo's packs (``make demo-moe``)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from omniweave.config import load_recipe, to_dict
from omniweave.models.registry import build_model
from tests.train_factory import final_state, losses, read_metrics, train_in_process


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def test_demo_moe_is_the_demo_recipe_with_only_the_foundation_and_run_dir_different():
    demo, moe = _flat(to_dict(load_recipe("demo"))), _flat(to_dict(load_recipe("demo_moe")))
    differ = {k for k in demo.keys() | moe.keys() if demo.get(k, "<unset>") != moe.get(k, "<unset>")}
    assert {k for k in differ if not k.startswith("model.foundation.")} == {"output_dir"}
    assert moe["output_dir"] == "runs/demo_moe/run"
    assert moe["model.foundation.family"] == "qwen3_moe" and moe["model.foundation.num_experts"] == 8
    # the packs' fingerprint covers data.*: equal data sections, so the demo's packs serve both
    assert not {k for k in differ if k.startswith("data.")}
    # M-RoPE like the demo's foundation (the packs carry [3, L] positions)
    assert moe["model.foundation.mrope_section"] == demo["model.foundation.mrope_section"] == [2, 3, 3]


def _params(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def test_demo_moe_has_the_demo_foundations_active_parameters():
    dense = build_model(load_recipe("demo").model).foundation
    moe = build_model(load_recipe("demo_moe").model).foundation
    for d_layer, m_layer in zip(dense.layers, moe.layers, strict=True):
        experts = m_layer.mlp.experts
        active = _params(experts) * m_layer.mlp.active_fraction()  # top-2 of 8
        assert active == _params(d_layer.mlp) == 3 * 64 * 128
        assert experts.gate_up_proj.shape == (8, 2 * 64, 64)
        # attention: the same projections; Qwen3's QK-norm (2 x head_dim) instead of the qkv bias
        bias = sum(b.numel() for n, b in d_layer.self_attn.named_parameters() if n.endswith("bias"))
        assert _params(m_layer.self_attn) == _params(d_layer.self_attn) - bias + 2 * 16
    total_active = _params(moe) - sum(_params(layer.mlp.experts) * (1 - layer.mlp.active_fraction())
                                      for layer in moe.layers)  # fmt: skip
    assert abs(total_active - _params(dense)) / _params(dense) < 0.005  # routers + QK-norm - biases


def test_demo_moe_trains_on_the_demo_packs(demo_packed, tmp_path):
    run = tmp_path / "run"
    result = train_in_process(demo_packed, run, name="demo_moe", steps=3)
    curve = losses(run)
    assert result["steps"] == 3 and len(curve) == 3 and all(math.isfinite(x) for x in curve)
    assert curve[-1] < curve[0], curve
    state = final_state(run)
    assert state["foundation.layers.1.mlp.experts.gate_up_proj"].shape == (8, 128, 64)
    assert not any(k.startswith("foundation.") and k.endswith("mlp.up_proj.weight") for k in state)
    rows = read_metrics(run)  # the router's metrics every step (docs/moe.md)
    assert all(1.0 < r["moe_aux_loss"] < 8.0 and r["moe_load_max_mean"] >= 1.0 for r in rows)  # k=2: 2 balanced
    assert all("moe_z_loss" not in r and "moe_a2a_bytes" not in r for r in rows)  # z-loss off, one process


def test_deepseek_v3_backbone_trains_on_the_demo_packs_with_the_bias_update(demo_packed, tmp_path):
    """The demo with its foundation swapped for DeepSeek-V3 (MLA, sigmoid group router, shared
    expert): after 3 steps the aux-loss-free selection bias moved by 0.001 per step per expert
    (each step: +0.001 below the mean load, -0.001 above, unchanged at it)."""
    run = tmp_path / "run"
    result = train_in_process(demo_packed, run, steps=3, **{"foundation@model__foundation": "deepseek_v3_tiny"})
    assert result["steps"] == 3 and all(math.isfinite(x) for x in losses(run))
    state = final_state(run)
    for layer in (1, 2):  # layer 0 is dense (first_k_dense_replace)
        bias = state[f"foundation.layers.{layer}.mlp.gate.e_score_correction_bias"]
        steps = bias / 1e-3
        assert torch.allclose(steps, steps.round(), atol=1e-4) and steps.abs().max() <= 3 and steps.abs().sum() > 0
        assert abs(float(bias.sum())) < float(bias.abs().sum())  # some experts up, some down
    assert all(r["moe_aux_loss"] > 0 for r in read_metrics(run))


@pytest.mark.slow
def test_demo_command_with_recipe_demo_moe_trains_and_evaluates_the_moe_model(tmp_path):
    """``make demo-moe`` = ``omniweave demo --recipe demo_moe``: the demo pipeline on the MoE recipe."""
    from omniweave.cli import main
    from omniweave.demo import load_trained_model

    out = tmp_path / "demo_moe"
    assert main(["demo", "--recipe", "demo_moe", "--out", str(out), "--samples", "60", "--eval-samples", "8",
                 "--steps", "2", "--workers", "1", "--no-control", "train.save_interval=0"]) == 0
    report = json.loads((out / "demo_report.json").read_text())
    assert report["run_dir"] == str(out / "run") and report["steps"] == 2 and report["eval_samples"] == 8
    assert 0.0 <= report["accuracy"] <= 1.0 and report["control_accuracy"] is None
    model = load_trained_model(out / "run", load_recipe("demo_moe"))
    assert all(type(layer.mlp).__name__ == "MoE" for layer in model.foundation.layers)
