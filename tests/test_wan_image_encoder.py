"""WanImageEncoder (omniweave/diffusion/image_encoder.py): the CLIP vision features of Wan 2.1 I2V,
bit-identical to diffusers' ``WanImageToVideoPipeline.encode_image`` (transformers' CLIPVisionModel +
CLIPImageProcessor) on a tiny random CLIP and non-square images; they feed an I2V WanDiT."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omniweave.diffusion.image_encoder import WanImageEncoder

diffusers = pytest.importorskip("diffusers")
Image = pytest.importorskip("PIL.Image")


def _images():
    rng = np.random.default_rng(0)
    wide = Image.fromarray(rng.integers(0, 256, (29, 47, 3), dtype=np.uint8))  # H 29 x W 47
    tall = Image.fromarray(rng.integers(0, 256, (53, 31, 3), dtype=np.uint8))
    return wide, tall


def _pipeline_encode(encoder: WanImageEncoder, images):
    """diffusers' own method, on a stand-in pipeline holding the same processor and CLIP model."""
    from diffusers import WanImageToVideoPipeline

    pipe = SimpleNamespace(image_processor=encoder.processor, image_encoder=encoder.model,
                           _execution_device=torch.device("cpu"))
    with torch.no_grad():
        return WanImageToVideoPipeline.encode_image(pipe, images, torch.device("cpu"))


def test_encode_is_the_pipelines_encode_image(tmp_path):
    enc = WanImageEncoder.tiny()
    wide, tall = _images()
    got = enc.encode([wide, tall])
    assert got.shape == (2, enc.num_tokens, enc.dim) == (2, 26, 32) and got.dtype == torch.float32
    assert torch.equal(got, _pipeline_encode(enc, [wide, tall]))
    assert torch.equal(enc.encode([tall])[0], got[1])  # batch-independent
    # FLF2V: first and last frame as a batch of 2, their tokens one after the other
    assert torch.equal(enc.clip_features(wide, tall), _pipeline_encode(enc, [wide, tall]).flatten(0, 1))
    assert torch.equal(enc.clip_features(wide), got[0])

    # a saved pipeline-like folder, read back by us and by transformers as diffusers' pipeline reads it
    from transformers import CLIPImageProcessor, CLIPVisionModel

    enc.save_pretrained(tmp_path / "pipe")
    for path in (tmp_path / "pipe", tmp_path / "pipe" / "image_encoder"):
        again = WanImageEncoder.from_pretrained(path)
        assert torch.equal(again.encode([wide, tall]), got)
    model = CLIPVisionModel.from_pretrained(str(tmp_path / "pipe" / "image_encoder")).eval()
    proc = CLIPImageProcessor.from_pretrained(str(tmp_path / "pipe" / "image_processor"))
    with torch.no_grad():
        want = model(**proc(images=[wide, tall], return_tensors="pt"), output_hidden_states=True).hidden_states[-2]
    assert torch.equal(got, want)
    assert not any(p.requires_grad for p in enc.parameters())
    enc.train()
    assert not enc.model.training


def test_registered_component_and_feeds_an_i2v_dit():
    import yaml
    from pathlib import Path

    from omniweave.models.components.wan_dit import WanDiT, WanDiTConfig, patchify_clips
    from omniweave.models.registry import build_component

    cfg = yaml.safe_load((Path(__file__).parents[1] / "omniweave/configs/models/image_conditioner/clip_tiny.yaml")
                         .read_text())
    enc = build_component("image_conditioner", cfg)
    assert isinstance(enc, WanImageEncoder) and enc.dim == 32
    wide, tall = _images()
    feats = [enc.clip_features(wide), enc.clip_features(tall)]
    dit = WanDiT(WanDiTConfig(num_attention_heads=2, attention_head_dim=12, in_channels=36, out_channels=16,
                              text_dim=8, freq_dim=16, ffn_dim=20, num_layers=1, image_dim=enc.dim,
                              added_kv_proj_dim=24))
    tokens, grid = patchify_clips([torch.randn(36, 1, 4, 6), torch.randn(36, 2, 2, 4)], (1, 2, 2))
    out = dit(tokens, grid, torch.tensor([500.0, 20.0]), torch.randn(7, 8), torch.tensor([0, 3, 7]),
              image=torch.cat(feats), image_cu_seqlens=torch.tensor([0, 26, 52]))
    assert out.shape == (tokens.shape[0], 64)
    with pytest.raises(FileNotFoundError, match="image_encoder"):
        WanImageEncoder.from_pretrained(Path(__file__).parent)
