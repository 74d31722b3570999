"""The one registry: names, config keys, freeze, and swapping a recipe's foundation."""

import shutil
import textwrap
from pathlib import Path

import pytest
import torch

from omniweave import config
from omniweave.models.registry import build_component, build_config, build_model, lookup, names
from omniweave.models.text import CausalLM

TINY = dict(name="decoder", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2)
REPO_CONFIGS = Path(__file__).resolve().parents[1] / "omniweave" / "configs"


def test_hf_adapters_live_in_the_same_registry():
    assert {"qwen2", "llama", "qwen3"} <= set(names("hf"))
    assert "decoder" in names("foundation")


def test_unknown_name_lists_registered_names():
    with pytest.raises(KeyError, match=r"no foundation named 'gpt9' is registered \(registered: .*decoder"):
        build_component("foundation", {**TINY, "name": "gpt9"})


def test_unknown_key_is_named():
    with pytest.raises(KeyError, match="unknown config key\\(s\\) 'hiden_size'"):
        build_config("foundation", {**TINY, "hiden_size": 3})


def test_missing_name_and_missing_field_are_clear():
    with pytest.raises(KeyError, match="has no 'name:'"):
        build_config("foundation", {k: v for k, v in TINY.items() if k != "name"})
    with pytest.raises(KeyError, match="vocab_size"):
        build_config("foundation", {k: v for k, v in TINY.items() if k != "vocab_size"})


def test_freeze_turns_off_gradients_and_tp_is_accepted():
    frozen = build_component("foundation", {**TINY, "freeze": True, "tp": 2})
    assert not any(p.requires_grad for p in frozen.parameters())
    assert all(p.requires_grad for p in build_component("foundation", TINY).parameters())


def test_build_model_text_only_is_a_causal_lm_and_rejects_unknown_sections():
    m = build_model({"foundation": TINY})
    assert isinstance(m, CausalLM) and len(m.foundation.layers) == 2
    with pytest.raises(KeyError, match="'decoder_x'"):
        build_model({"foundation": TINY, "decoder_x": {}})
    with pytest.raises(ValueError, match="unknown component kind"):
        lookup("widget", "x")


@pytest.mark.parametrize("foundation", ["qwen2_5_tiny", "llama3_tiny", "qwen3_tiny", "qwen2_tiny"])
def test_swapping_the_foundation_of_a_recipe_builds_and_runs(tmp_path, monkeypatch, foundation):
    shutil.copytree(REPO_CONFIGS / "models", tmp_path / "models")
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes/text.yaml").write_text(textwrap.dedent("""\
        defaults:
          - foundation@model.foundation: qwen2_5_tiny
          - _self_
        train:
          steps: 1
        """))
    monkeypatch.setattr(config, "CONFIGS_DIR", tmp_path)
    cfg = config.load_recipe("text", [f"foundation@model.foundation={foundation}", "model.foundation.freeze=true"])
    model = build_model(cfg.model)
    ids = torch.randint(0, 1024, (12,))
    out = model({"input_ids": ids, "labels": ids.roll(-1), "position_ids": torch.arange(12).expand(3, -1)})
    assert out.loss_sum.item() > 0 and int(out.num_tokens) == 12
    assert not any(p.requires_grad for p in model.parameters())
    family = {"qwen2_5_tiny": "qwen2", "qwen2_tiny": "qwen2", "llama3_tiny": "llama", "qwen3_tiny": "qwen3"}[foundation]
    assert model.foundation.config.family == family


def test_every_media_kind_has_exactly_one_modality():
    """Media kinds map to the modality whose encoder takes them (data/loading/loader.py reads it); an unknown
    kind is an error naming the known ones."""
    from omniweave.models.registry import MODALITIES, modality_of

    assert {k: modality_of(k).name for k in ("image", "video", "audio")} == {"image": "vision", "video": "vision",
                                                                            "audio": "audio"}
    kinds = [k for m in MODALITIES for k in m.kinds]
    assert len(kinds) == len(set(kinds))
    with pytest.raises(ValueError, match=r"kind 'smell'.*'image', 'video', 'audio'"):
        modality_of("smell")
