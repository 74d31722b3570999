"""WanDiT (omniweave/models/components/wan_dit.py) against diffusers' WanTransformer3DModel, and the
state-dict map of omniweave/models/hf/wan.py."""

import pytest
import torch

from omniweave.models.components.wan_dit import (
    WanDiT, WanDiTConfig, patchify, patchify_clips, unpatchify, unpatchify_clips,
)
from omniweave.models.hf.wan import config_from_diffusers, config_to_diffusers, diffusers_to_ours, ours_to_diffusers

PATCH = (1, 2, 2)
# deliberately not square / round: 3 heads of 20 (RoPE t/h/w = 8/6/6), 5 -> 3 channels, ffn 44
TINY = dict(num_attention_heads=3, attention_head_dim=20, in_channels=5, out_channels=3, text_dim=20, freq_dim=32,
            ffn_dim=44, num_layers=2, patch_size=PATCH)
SIZES = [(3, 6, 10), (2, 8, 4), (1, 4, 6)]  # latent (F, H, W) per clip
TEXT_LENS = [7, 5, 9]
TIMESTEPS = [937.5, 412.0, 18.25]


def _randomise(model: torch.nn.Module, seed: int, std: float = 0.2) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # every parameter: tables, norms, biases included
            p.copy_(torch.randn(p.shape, generator=g) * std)


@pytest.fixture(scope="module")
def ref():
    from diffusers import WanTransformer3DModel

    model = WanTransformer3DModel(**TINY).eval()
    _randomise(model, 0)
    return model


@pytest.fixture(scope="module")
def clips():
    g = torch.Generator().manual_seed(1)
    latents = [torch.randn(5, *s, generator=g) for s in SIZES]
    texts = [torch.randn(n, 20, generator=g) for n in TEXT_LENS]
    return latents, texts, torch.tensor(TIMESTEPS)


def _ours_from(ref) -> WanDiT:
    ours = WanDiT(config_from_diffusers(dict(ref.config), attn_backend="math"))
    ours.load_state_dict(diffusers_to_ours(ref.state_dict()), strict=True)
    return ours.eval()


def _packed(model, latents, texts, timesteps, order):
    """Run ``model`` on the clips in ``order`` packed in one row; per-clip [C, F, H, W] in original order."""
    tokens, grid = patchify_clips([latents[i] for i in order], PATCH)
    lens = torch.tensor([0] + [texts[i].shape[0] for i in order])
    out = model(tokens, grid, timesteps[order], torch.cat([texts[i] for i in order]),
                lens.cumsum(0).to(torch.int32))
    assert out.shape == (tokens.shape[0], model.config.out_channels * 4)
    per = unpatchify_clips(out, grid, model.config.out_channels, PATCH)
    return {i: per[j] for j, i in enumerate(order)}


def _ref_alone(ref, latent, text, t):
    return ref(latent[None], t.reshape(1), text[None], return_dict=False)[0][0]


def test_packed_forward_matches_diffusers_per_clip(ref, clips):
    latents, texts, timesteps = clips
    ours = _ours_from(ref)
    with torch.no_grad():
        want = {i: _ref_alone(ref, latents[i], texts[i], timesteps[i]) for i in range(3)}
        forward = _packed(ours, latents, texts, timesteps, [0, 1, 2])
        reverse = _packed(ours, latents, texts, timesteps, [2, 1, 0])
        alone = _packed(ours, latents, texts, timesteps, [1])  # one clip: the broadcast (no gather) path
    errors = [(forward[i] - want[i]).abs().max().item() for i in range(3)]
    scale = max(w.abs().max().item() for w in want.values())
    print(f"max abs error vs diffusers per clip: {errors}; output scale {scale:.2f}")
    assert max(errors) < 1e-4
    for i in range(3):
        assert (reverse[i] - forward[i]).abs().max().item() < 1e-5  # packing order does not matter
    assert (alone[1] - want[1]).abs().max().item() < 1e-4


def test_attention_backends_agree(ref, clips):
    latents, texts, timesteps = clips
    ours = _ours_from(ref)
    with torch.no_grad():
        a = _packed(ours, latents, texts, timesteps, [0, 1, 2])
        for block in ours.blocks:
            block.attn1.backend = block.attn2.backend = "sdpa"
        b = _packed(ours, latents, texts, timesteps, [0, 1, 2])
    assert max((a[i] - b[i]).abs().max().item() for i in range(3)) < 1e-4


def test_state_dict_round_trip(ref, clips):
    sd = ref.state_dict()
    back = ours_to_diffusers(diffusers_to_ours(sd), patch_size=PATCH)
    assert back.keys() == sd.keys()
    assert all(torch.equal(back[k], sd[k]) for k in sd)

    from diffusers import WanTransformer3DModel

    cfg = WanDiTConfig(**TINY, attn_backend="math")
    ours = WanDiT(cfg).eval()
    _randomise(ours, 2)
    again = WanTransformer3DModel(**config_to_diffusers(cfg)).eval()
    again.load_state_dict(ours_to_diffusers(ours.state_dict(), patch_size=PATCH), strict=True)
    latents, texts, timesteps = clips
    with torch.no_grad():
        got = _packed(ours, latents, texts, timesteps, [0, 1, 2])
        errors = [(got[i] - _ref_alone(again, latents[i], texts[i], timesteps[i])).abs().max().item() for i in range(3)]
    print(f"ours -> diffusers max abs error per clip: {errors}")
    assert max(errors) < 1e-4


def test_config_from_diffusers_reads_and_refuses():
    cfg = config_from_diffusers({"_class_name": "WanTransformer3DModel", "patch_size": [1, 2, 2], "in_channels": 16,
                                 "out_channels": None, "num_attention_heads": 12, "qk_norm": None})
    assert cfg.patch_size == (1, 2, 2) and cfg.out_channels == 16 and cfg.num_attention_heads == 12
    i2v = config_from_diffusers({"image_dim": 1280, "added_kv_proj_dim": 1536})  # I2V: tests/test_wan_i2v.py
    assert (i2v.image_dim, i2v.added_kv_proj_dim, i2v.pos_embed_seq_len) == (1280, 1536, None)
    with pytest.raises(ValueError, match="must equal the model width"):
        config_from_diffusers({"image_dim": 1280, "added_kv_proj_dim": 5120})  # 12 x 128 = 1536 wide
    with pytest.raises(ValueError, match="does not know"):
        config_from_diffusers({"some_new_field": 1})
    sd = {"patch_embedding.weight": torch.zeros(4, 2, 1, 2, 2), "blocks.0.attn2.add_k_proj.weight": torch.zeros(1)}
    assert set(diffusers_to_ours(sd)) == set(sd)  # I2V's added K/V: same name (strict against the model on load)
    sd["blocks.0.attn1.add_k_proj.weight"] = torch.zeros(1)  # self-attention has none
    with pytest.raises(KeyError, match="I2V"):
        diffusers_to_ours(sd)
    with pytest.raises(KeyError, match="no counterpart"):
        ours_to_diffusers({"blocks.0.mystery.weight": torch.zeros(1)})


def test_fresh_init_predicts_zero_and_grads_flow(clips):
    torch.manual_seed(3)
    model = WanDiT(WanDiTConfig(**TINY))
    latents, texts, timesteps = clips
    with torch.no_grad():
        zero = _packed(model, latents, texts, timesteps, [0, 1, 2])
    assert all(z.abs().max().item() == 0 for z in zero.values())  # proj_out zero-initialised
    _randomise(model, 4, std=0.1)  # zero proj_out would stop every gradient but its own
    tokens, grid = patchify_clips(latents, PATCH)
    out = model(tokens, grid, timesteps, torch.cat(texts), torch.tensor([0, 7, 12, 21], dtype=torch.int32))
    out.square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_autocast_bf16_runs_close(ref, clips):
    latents, texts, timesteps = clips
    ours = _ours_from(ref)
    for block in ours.blocks:
        block.attn1.backend = block.attn2.backend = "sdpa"
    with torch.no_grad():
        full = _packed(ours, latents, texts, timesteps, [0, 1, 2])
        with torch.autocast("cpu", dtype=torch.bfloat16):
            half = _packed(ours, latents, texts, timesteps, [0, 1, 2])
    for i in range(3):
        assert half[i].dtype == torch.bfloat16
        rel = (half[i].float() - full[i]).norm() / full[i].norm()
        assert rel < 0.05, rel


@pytest.mark.parametrize("shape", [(3, 5, 6, 10), (1, 1, 2, 2), (4, 7, 14, 6)])
def test_patchify_unpatchify_inverse(shape):
    latent = torch.randn(shape)
    for patch in [(1, 2, 2), (shape[1], 2, 1)]:
        tokens = patchify(latent, patch)
        f, h, w = shape[1] // patch[0], shape[2] // patch[1], shape[3] // patch[2]
        assert tokens.shape == (f * h * w, shape[0] * patch[0] * patch[1] * patch[2])
        assert torch.equal(unpatchify(tokens, (f, h, w), shape[0], patch), latent)


def test_patchify_layout():
    # tokens in (f, h, w) order, each token's values in (C, pt, ph, pw) order
    latent = torch.randn(3, 2, 4, 6)
    tokens = patchify(latent, (1, 2, 2))  # grid (2, 2, 3)
    f, h, w = 1, 1, 2
    token = tokens[(f * 2 + h) * 3 + w].view(3, 1, 2, 2)
    assert torch.equal(token, latent[:, f:f + 1, 2 * h:2 * h + 2, 2 * w:2 * w + 2])


def test_patchify_errors():
    with pytest.raises(ValueError, match="not divisible"):
        patchify(torch.zeros(4, 2, 5, 6), (1, 2, 2))
    with pytest.raises(ValueError, match="not divisible"):
        patchify(torch.zeros(4, 2, 6, 7), (1, 2, 2))
    with pytest.raises(ValueError, match="do not match"):
        unpatchify(torch.zeros(5, 16), (1, 2, 2), 4, (1, 2, 2))


@pytest.mark.parametrize("kwargs, match", [
    (dict(attention_head_dim=21), "even and >= 6"),
    (dict(attention_head_dim=4), "even and >= 6"),
    (dict(image_dim=1280), "I2V"),
    (dict(patch_size=(1, 2)), "three positive"),
    (dict(patch_size=(1, 0, 2)), "three positive"),
    (dict(freq_dim=1), "freq_dim"),
    (dict(num_layers=0), "num_layers"),
    (dict(eps=0.0), "eps"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WanDiTConfig(**kwargs)


def test_forward_input_errors(clips):
    model = WanDiT(WanDiTConfig(**{**TINY, "rope_max_seq_len": 4}))
    latents, texts, timesteps = clips
    tokens, grid = patchify_clips(latents[1:], PATCH)  # grids (2,4,2), (1,2,3): within 4
    text, cu = torch.cat(texts[1:]), torch.tensor([0, 5, 14], dtype=torch.int32)
    model(tokens, grid, timesteps[1:], text, cu)
    with pytest.raises(ValueError, match="tokens"):
        model(tokens[:-1], grid, timesteps[1:], text, cu)
    with pytest.raises(ValueError, match="one per clip"):
        model(tokens, grid, timesteps, text, cu)
    with pytest.raises(ValueError, match="text_cu_seqlens"):
        model(tokens, grid, timesteps[1:], text[:-1], cu)
    big, big_grid = patchify_clips(latents[:1], PATCH)  # w = 5 patches > 4
    with pytest.raises(ValueError, match="rope_max_seq_len"):
        model(big, big_grid, timesteps[:1], texts[0], torch.tensor([0, 7], dtype=torch.int32))
