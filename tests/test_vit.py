"""Vision tower pieces: window layout and per-frame segments equal transformers' helpers; media
never attend to each other; projectors' shapes; clear errors."""

from __future__ import annotations

import pytest
import torch
from transformers.vision_utils import get_vision_cu_seqlens, get_vision_window_index

from omniweave.models.components.projector import MLPAdapter, MLPAdapterConfig, PatchMerger, PatchMergerConfig
from omniweave.models.components.vit import Qwen2ViTConfig, Qwen25ViTConfig, VisionTransformer, vision_cu_seqlens, window_index
from omniweave.models.registry import build_component

GRIDS = [[[1, 4, 6]], [[1, 10, 8], [3, 4, 4]], [[2, 16, 6], [1, 2, 2], [1, 14, 22]]]
IN_DIM = 3 * 2 * 14 * 14


@pytest.mark.parametrize("grids", GRIDS)
@pytest.mark.parametrize("window_px", [56, 112])
def test_window_index_equals_transformers(grids, window_px):
    grid = torch.tensor(grids)
    index, cu = window_index(grid, merge=2, window_merged=window_px // 14 // 2)
    ref_index, ref_cu = get_vision_window_index(grid, spatial_merge_size=2, window_size=window_px, patch_size=14)
    assert torch.equal(index, ref_index)
    assert torch.equal(cu, ref_cu)
    assert torch.equal(vision_cu_seqlens(grid), get_vision_cu_seqlens(grid))


def _tiny(cfg_cls, **kw):
    torch.manual_seed(0)
    base = dict(depth=2, hidden_size=32, num_heads=4, intermediate_size=48)
    if cfg_cls is Qwen25ViTConfig:
        base.update(window_size=56, fullatt_block_indexes=[1])
    return VisionTransformer(cfg_cls(**{**base, **kw})).eval()


@pytest.mark.parametrize("cfg_cls", [Qwen2ViTConfig, Qwen25ViTConfig])
def test_media_of_a_batch_do_not_see_each_other(cfg_cls):
    """One varlen call over all media == one call per media item (and per frame)."""
    enc = _tiny(cfg_cls)
    grid = torch.tensor([[1, 6, 8], [2, 4, 4], [1, 2, 2]])
    pv = torch.randn(int(grid.prod(-1).sum()), IN_DIM)
    with torch.no_grad():
        joint = enc(pv, grid)
        sizes = grid.prod(-1).tolist()
        alone = torch.cat([enc(p, g[None]) for p, g in zip(pv.split(sizes), grid)])
    assert torch.allclose(joint, alone, atol=1e-5)
    assert joint.shape == (pv.shape[0], 32)


def test_pixel_count_mismatch_raises():
    enc = _tiny(Qwen2ViTConfig)
    with pytest.raises(ValueError, match="patches but grid_thw"):
        enc(torch.randn(10, IN_DIM), torch.tensor([[1, 4, 4]]))


def test_dummy_input_is_one_merge_block():
    enc = _tiny(Qwen25ViTConfig)
    pv, grid = enc.dummy_input()
    assert grid.tolist() == [[1, 2, 2]] and pv.shape == (4, IN_DIM)
    assert enc(pv, grid).shape == (4, 32)


def test_projectors_shapes_and_token_counts():
    grid = torch.tensor([[1, 4, 6], [2, 2, 2]])
    hidden = torch.randn(int(grid.prod(-1).sum()), 32)
    merger = PatchMerger(PatchMergerConfig(in_dim=32, out_dim=64, norm="rmsnorm"))
    assert merger.num_tokens(grid).tolist() == [6, 2]
    assert merger(hidden, grid).shape == (8, 64)
    adapter = MLPAdapter(MLPAdapterConfig(in_dim=32, out_dim=64))
    assert adapter(hidden, grid).shape == (32, 64) and adapter.num_tokens(grid).tolist() == [24, 8]
    with pytest.raises(ValueError, match="multiple of merge_size"):
        merger(torch.randn(6, 32))


def test_registered_names_build_from_yaml_dicts():
    enc = build_component("image_encoder", {"name": "qwen2_5_vit", "depth": 1, "hidden_size": 32, "num_heads": 4,
                                            "intermediate_size": 48, "freeze": True})  # fmt: skip
    assert isinstance(enc, VisionTransformer) and enc.cfg.window_size == 112
    assert not any(p.requires_grad for p in enc.parameters())
    proj = build_component("projector", {"name": "patch_merger", "in_dim": 32, "out_dim": 64})
    assert isinstance(proj, PatchMerger)
    assert isinstance(build_component("projector", {"name": "mlp_adapter", "in_dim": 32, "out_dim": 64}), MLPAdapter)
    with pytest.raises(KeyError, match="unknown config key"):
        build_component("image_encoder", {"name": "qwen2_vit", "embed_dim": 32})


@pytest.mark.parametrize("cfg_cls", [Qwen2ViTConfig, Qwen25ViTConfig])
def test_encoder_output_owns_its_storage(cfg_cls):
    """Not a view (FSDP2 warns when a wrapped module returns one, issue 15); the window
    reorder and its inverse leave the values exactly as the per-item encoding gives them."""
    enc = _tiny(cfg_cls)
    grid = torch.tensor([[1, 6, 8], [2, 4, 4]])
    out = enc(torch.randn(int(grid.prod(-1).sum()), IN_DIM), grid)
    assert out._base is None and out.requires_grad
