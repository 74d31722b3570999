"""The SigLIP vision tower (components/siglip.py) against transformers' SiglipVisionModel on a tiny
random config with shapes that are not round (fp32): several tiles of several items in one varlen
call vs HF over the batch of tiles, hidden_states[feature_layer] <= 1e-5, every gradient <= 1e-4
relative, the HF name map, and the tile rules."""

from __future__ import annotations

import pytest
import torch

from omniweave.data.media.anyres import tiles_to_patches
from omniweave.models.components.siglip import (
    SiglipViT,
    SiglipViTConfig,
    siglip_hf_name,
    siglip_state_from_hf,
)

TINY = {"hidden_size": 36, "num_heads": 3, "intermediate_size": 50, "depth": 3,
        "patch_size": 5, "image_size": 27}  # tiles 5 x 5 patches, 2 px unread
GRID = [[2, 5, 5], [1, 5, 5], [3, 5, 5]]  # three items, six tiles


def hf_tower(seed: int = 0):
    from transformers import SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(seed)
    cfg = SiglipVisionConfig(hidden_size=36, num_attention_heads=3, intermediate_size=50, num_hidden_layers=3,
                             patch_size=5, image_size=27, layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh",
                             vision_use_head=False)
    model = SiglipVisionModel._from_config(cfg, attn_implementation="eager").float()
    with torch.no_grad():  # HF's init leaves biases ~1e-6 and norms at 1: move every tensor off it
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def ours_like(hf, **kw) -> SiglipViT:
    model = SiglipViT(SiglipViTConfig(**{**TINY, **kw}))
    model.load_state_dict(siglip_state_from_hf(model, hf.state_dict()))
    return model


def tiles(n: int = 6, side: int = 27, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, side, side, generator=torch.Generator().manual_seed(seed))


def encode(model: SiglipViT, pixels: torch.Tensor, grid=GRID) -> torch.Tensor:
    return model(torch.from_numpy(tiles_to_patches(pixels.numpy(), 5)), torch.tensor(grid))


@pytest.mark.parametrize("feature_layer", [-1, -2, 1, 0])
def test_hidden_states_equal_transformers(feature_layer):
    hf = hf_tower()
    pixels = tiles()
    with torch.no_grad():
        ref = hf(pixel_values=pixels, output_hidden_states=True).hidden_states
        got = encode(ours_like(hf, feature_layer=feature_layer), pixels)
    assert len(ref) == TINY["depth"] + 1
    want = ref[feature_layer].reshape(-1, TINY["hidden_size"])
    assert got.shape == want.shape == (6 * 25, 36)
    assert (got - want).abs().max().item() <= 1e-5


def test_post_layernorm_gives_the_last_hidden_state():
    hf = hf_tower()
    pixels = tiles()
    with torch.no_grad():
        ref = hf(pixel_values=pixels).last_hidden_state.reshape(-1, 36)
        got = encode(ours_like(hf, post_layernorm=True), pixels)
    assert (got - ref).abs().max().item() <= 1e-5
    with pytest.raises(ValueError, match="feature_layer must be -1"):
        SiglipViTConfig(**TINY, post_layernorm=True, feature_layer=-2)


@pytest.mark.parametrize("feature_layer", [-1, -2])
def test_every_gradient_equals_transformers(feature_layer):
    hf = hf_tower(seed=2)
    ours = ours_like(hf, depth=3 + 1 + feature_layer)  # only the blocks it runs: hidden_states[-2] is block 2 of 3
    pixels = tiles(seed=3)
    weight = torch.randn(6 * 25, 36, generator=torch.Generator().manual_seed(4))
    (encode(ours, pixels) * weight).sum().backward()
    ref = hf(pixel_values=pixels, output_hidden_states=True).hidden_states[feature_layer]
    (ref.reshape(-1, 36) * weight).sum().backward()
    hf_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        g = torch.cat([hf_params[n].grad for n in siglip_hf_name(name)])
        rel = ((p.grad - g).norm() / g.norm()).item()
        assert rel <= 1e-4, f"{name}: relative gradient error {rel:.2e}"


def test_name_map_covers_transformers_state_dict():
    hf = hf_tower()
    for post, skip in [(False, {"post_layernorm.weight", "post_layernorm.bias"}), (True, set())]:
        ours = SiglipViT(SiglipViTConfig(**TINY, post_layernorm=post))
        mapped = [n for name in ours.state_dict() for n in siglip_hf_name(name)]
        assert sorted(mapped) == sorted(set(hf.state_dict()) - skip)
    assert siglip_hf_name("blocks.2.attn.qkv.bias") == tuple(f"encoder.layers.2.self_attn.{x}_proj.bias" for x in "qkv")
    assert siglip_hf_name("position_embedding.weight") == ("embeddings.position_embedding.weight",)
    with pytest.raises(KeyError):
        siglip_hf_name("blocks.0.attn.q_norm.weight")


def test_tiles_are_independent_and_the_dummy_runs():
    torch.manual_seed(0)
    model = SiglipViT(SiglipViTConfig(**TINY))
    model.init_weights()
    pixels = tiles()
    with torch.no_grad():
        whole = encode(model, pixels)
        first = encode(model, pixels[:2], [[2, 5, 5]])
        rest = encode(model, pixels[2:], [[4, 5, 5]])
        assert torch.allclose(whole, torch.cat([first, rest]), atol=1e-6)
        x, grid = model.dummy_input()
        assert model(x, grid).shape == (25, 36) and grid.tolist() == [[1, 5, 5]]
    assert model.out_dim == 36 and model.merge_size == 1


def test_tile_and_config_errors():
    model = SiglipViT(SiglipViTConfig(**TINY))
    with pytest.raises(ValueError, match="5 x 5 patches"):
        model(torch.zeros(24, 75), torch.tensor([[1, 4, 6]]))
    with pytest.raises(ValueError, match="needs 25"):
        model(torch.zeros(24, 75), torch.tensor([[1, 5, 5]]))
    with pytest.raises(ValueError, match="feature_layer"):
        SiglipViTConfig(**TINY, feature_layer=-5)
    with pytest.raises(ValueError, match="divisible"):
        SiglipViTConfig(**{**TINY, "num_heads": 5})


def test_registered_as_an_image_encoder():
    from omniweave.models.registry import _REGISTRY

    assert _REGISTRY["image_encoder"]["siglip_vit"] == (SiglipViT, SiglipViTConfig)
