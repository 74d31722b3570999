"""train.init_from: a HF directory copied into a materialised model in place (slices per rank)."""

import pytest
import torch

from omniweave.config import load_recipe, to_dict
from omniweave.models.hf.export import export_hf
from omniweave.models.hf.loading import load_hf_into
from omniweave.models.registry import build_model


def _model(seed: int):
    torch.manual_seed(seed)
    cfg = to_dict(load_recipe("demo").model)
    model = build_model(cfg)
    model.init_weights()
    return model, cfg


def test_init_from_hf_dir_reproduces_every_exported_weight(tmp_path):
    src, cfg = _model(0)
    export_hf(src, cfg, tmp_path / "hf")
    dst, _ = _model(1)
    assert not torch.equal(dst.foundation.embed_tokens.weight, src.foundation.embed_tokens.weight)
    n = load_hf_into(dst, tmp_path / "hf")
    assert n == len(dict(dst.named_parameters()))
    for (name, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(a, b), name


def test_init_from_a_different_architecture_names_the_tensor(tmp_path):
    src, cfg = _model(0)
    export_hf(src, cfg, tmp_path / "hf")
    bigger = to_dict(load_recipe("demo", ["model.foundation.intermediate_size=256"]).model)
    with pytest.raises(ValueError, match=r"mlp.*shape"):
        load_hf_into(build_model(bigger), tmp_path / "hf")


@pytest.mark.parametrize("recipe", ["tiny_qwen3_next", "tiny_qwen3_5_moe"])
def test_init_from_a_hybrid_export_reproduces_every_weight(tmp_path, recipe):
    """Qwen3-Next's grouped in_proj_qkvz / in_proj_ba (regrouped per key head on the way in, by the
    adapter's ``assemble``) and Qwen3.5-MoE's per-expert tensors, read into a materialised model."""
    torch.manual_seed(0)
    cfg = to_dict(load_recipe(recipe).model)
    src = build_model(cfg)
    export_hf(src, cfg, tmp_path / "hf")
    torch.manual_seed(1)
    dst = build_model(cfg)
    assert load_hf_into(dst, tmp_path / "hf") == len(dict(dst.named_parameters()))
    for (name, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(a, b), name
