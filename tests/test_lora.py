"""LoRA adapters (omniweave/models/lora.py) on a tiny Qwen2-VL built from transformers' config:
a fresh adapter (B = 0) leaves the logits exactly unchanged, only adapters (and unfrozen
components) get gradients and optimizer state, disabling the adapters gives the base logits,
merging equals the adapted model, and bad recipes fail naming their keys."""

from __future__ import annotations

import copy

import pytest
import torch

from omniweave.errors import UserError
from omniweave.models import lora
from omniweave.models.hf.loading import load_hf
from tests.vl_factory import make_sample, save_tiny

SAMPLE = [("image", (1, 4, 6)), ("video", (2, 4, 4))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, model_cfg) of a tiny random Qwen2-VL, and a row with an image and a video."""
    path = save_tiny("qwen2_vl", tmp_path_factory.mktemp("qwen2_vl"))
    model, cfg = load_hf(path)
    return model.eval(), cfg, make_sample(SAMPLE, seed=1)


def _with_lora(tiny, **sections) -> tuple[torch.nn.Module, dict]:
    model, cfg, _ = tiny
    model, cfg = copy.deepcopy(model), copy.deepcopy(cfg)
    for section, spec in sections.items():
        cfg[section]["lora"] = spec
    lora.apply_lora(model, cfg)
    return model, cfg


def _randomise_b(model) -> None:
    torch.manual_seed(3)
    with torch.no_grad():
        for _, m in lora.adapted_linears(model):
            m.lora_B.weight.normal_(std=0.05)


def test_fresh_adapter_gives_the_base_logits_exactly(tiny):
    base, _, row = tiny
    model, _ = _with_lora(tiny, foundation={"r": 4, "alpha": 8, "targets": "all-linear"},
                          image_encoder={"r": 2, "targets": ["qkv", "fc1"]}, projector={"r": 2, "targets": ["mlp.0"]})
    assert all(float(m.lora_B.weight.detach().abs().max()) == 0 for _, m in lora.adapted_linears(model))
    assert all(float(m.lora_A.weight.detach().abs().max()) > 0 for _, m in lora.adapted_linears(model))
    with torch.no_grad():
        assert torch.equal(model.logits(row), base.logits(row))


def test_adapter_names_keep_the_base_names(tiny):
    model, _ = _with_lora(tiny, foundation={"r": 4, "targets": ["q_proj", "v_proj"]})
    names = set(model.state_dict())
    base_names = set(tiny[0].state_dict())
    assert base_names <= names  # every base tensor keeps its name
    added = sorted(names - base_names)
    assert added[:2] == ["foundation.layers.0.self_attn.q_proj.lora_A.weight",
                         "foundation.layers.0.self_attn.q_proj.lora_B.weight"]
    assert len(added) == 2 * 2 * 2  # 2 layers x (q, v) x (A, B)
    assert model.foundation.layers[0].self_attn.q_proj.lora_A.weight.shape == (4, 64)
    assert model.foundation.layers[0].self_attn.q_proj.lora_B.weight.shape == (64, 4)


def test_only_adapters_get_gradients_and_optimizer_state(tiny):
    from omegaconf import OmegaConf

    from omniweave.train.optim import build_optimizer

    row = tiny[2]
    model, _ = _with_lora(tiny, foundation={"r": 4, "targets": "all-linear"})
    model.train()
    _randomise_b(model)
    model(row).loss_sum.backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    foundation_adapters = {n for n in trainable if n.startswith("foundation.")}
    assert foundation_adapters and all(lora.is_adapter_name(n) for n in foundation_adapters)
    # the encoders have no lora and no freeze: they train fully
    assert any(n.startswith("image_encoder.") for n in trainable) and any(n.startswith("projector.") for n in trainable)
    assert with_grad == trainable
    assert all(float(model.get_parameter(n).grad.abs().max()) > 0 for n in foundation_adapters)
    opt = build_optimizer(model, OmegaConf.create({"train": {"lr": 1e-3, "steps": 1, "global_batch": 1}, "model": {}}))
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    assert in_opt == {id(p) for p in model.parameters() if p.requires_grad}


def test_lora_combines_with_freeze(tiny):
    model, cfg, row = tiny
    cfg = copy.deepcopy(cfg)
    cfg["image_encoder"]["freeze"] = True
    cfg["foundation"]["lora"] = {"r": 2, "targets": ["o_proj"]}
    cfg["projector"]["lora"] = {"r": 2, "targets": "all-linear"}
    from omniweave.models.registry import build_model

    with torch.device("meta"):
        built = build_model(cfg)
    trainable = {n for n, p in built.named_parameters() if p.requires_grad}
    assert trainable and all(lora.is_adapter_name(n) for n in trainable)  # encoder frozen, the rest adapters only
    assert {n.split(".")[0] for n in trainable} == {"foundation", "projector"}
    assert len([n for n in trainable if n.startswith("projector.")]) == 2 * 2  # mlp.0, mlp.2 x (A, B)


def test_disabled_adapters_and_merge(tiny):
    base, _, row = tiny
    model, _ = _with_lora(tiny, foundation={"r": 4, "alpha": 16, "targets": "all-linear"},
                          image_encoder={"r": 2, "targets": "all-linear"})
    _randomise_b(model)
    with torch.no_grad():
        adapted = model.logits(row)
        assert float((adapted - base.logits(row)).abs().max()) > 1e-3  # the adapters change something
        with lora.adapters_disabled(model):
            assert torch.equal(model.logits(row), base.logits(row))
        assert torch.equal(model.logits(row), adapted)  # enabled again after the block
        assert lora.merge_adapters(model) == 2 * 7 + 2 * 4  # decoder: q k v o gate up down; ViT: qkv proj fc1 fc2
        assert not any(lora.is_adapter_name(n) for n in model.state_dict())
        merged = model.logits(row)
    torch.testing.assert_close(merged, adapted, atol=1e-5, rtol=0)


def test_unknown_target_lists_the_valid_ones(tiny):
    with pytest.raises(UserError, match=r"model.foundation.lora.targets: unknown 'qkv_proj'; valid: down_proj, "
                                        r"gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"):
        _with_lora(tiny, foundation={"r": 4, "targets": ["q_proj", "qkv_proj"]})
    with pytest.raises(UserError, match=r"model.projector.lora.targets: unknown 'fc1'; valid: mlp.0, mlp.2"):
        _with_lora(tiny, projector={"r": 4, "targets": ["fc1"]})


@pytest.mark.parametrize("spec,message", [
    ({"rank": 4}, r"model.foundation.lora: unknown key\(s\) 'rank'; valid keys: r, alpha, dropout, targets"),
    ({"alpha": 4}, r"model.foundation.lora.r is required"),
    ({"r": 0}, r"model.foundation.lora.r=0: the rank must be an integer >= 1"),
    ({"r": 4, "dropout": 1.0}, r"model.foundation.lora.dropout=1.0: must be in \[0, 1\)"),
    ({"r": 4, "targets": []}, r"model.foundation.lora.targets=\[\]"),
    (16, r"model.foundation.lora must be a mapping"),
])
def test_bad_lora_settings_name_the_key(tiny, spec, message):
    with pytest.raises(UserError, match=message):
        _with_lora(tiny, foundation=spec)


def test_recipe_override_adds_adapters():
    """The override docs/lora.md shows composes, and the recipe check validates its targets."""
    from omniweave.config import load_recipe, to_dict

    cfg = load_recipe("demo", ["+model.foundation.lora={r: 8, alpha: 16, targets: [q_proj, v_proj]}"])
    assert to_dict(cfg.model)["foundation"]["lora"] == {"r": 8, "alpha": 16, "targets": ["q_proj", "v_proj"]}
    lora.check_lora(to_dict(cfg.model))
    bad = load_recipe("demo", ["+model.foundation.lora={r: 8, targets: [wq]}"])
    with pytest.raises(UserError, match="model.foundation.lora.targets: unknown 'wq'"):
        lora.check_lora(to_dict(bad.model))
