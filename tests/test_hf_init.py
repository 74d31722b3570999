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
