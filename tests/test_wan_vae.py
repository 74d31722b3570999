"""omniweave's Wan 2.1 VAE (models/components/wan_vae.py) against diffusers' ``AutoencoderKLWan``.

A tiny random VAE (base_dim 8, z_dim 16, dim_mult [1, 2, 2, 2], one residual block per level) with
perturbed norm gains and biases, on non-square clips (24 x 40 pixels) of 1, 5, 9 and 13 frames:

    encode == vae.encode(x).latent_dist.mode()     measured max abs error ~3e-7 (|mu| up to ~0.7)
    decode == vae.decode(z).sample                 measured max abs error ~3e-6 (output std ~0.25,
                                                   latents scaled so the clamp to [-1, 1] bites)

for every chunking (diffusers' frame-0-then-4 / one latent frame, two latent frames per chunk, the
whole clip in one pass), which is the proof that our per-module causal cache equals diffusers'
``feat_cache``. The decode check fails (error ~0.6) if upsample3d's time conv is given frame 0 as
context, diffusers' "Rep" quirk.
"""

from __future__ import annotations

import pytest
import torch

from omniweave.models.components.wan_vae import WanVAE, WanVAEConfig, config_from_diffusers

diffusers = pytest.importorskip("diffusers")
AutoencoderKLWan = diffusers.AutoencoderKLWan

TOL = 1e-4
H, W = 24, 40


@pytest.fixture(scope="module")
def pair():
    """(diffusers' tiny VAE, ours with its weights), both eval fp32."""
    torch.manual_seed(0)
    ref = AutoencoderKLWan(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
                           temperal_downsample=[False, True, True]).eval()
    with torch.no_grad():  # the default init leaves gains at 1: perturb them, and the biases
        for name, p in ref.named_parameters():
            if name.endswith("gamma"):
                p.mul_(1 + 0.5 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    ours = WanVAE(config_from_diffusers(dict(ref.config))).eval()
    ours.load_state_dict(ref.state_dict(), strict=True)
    return ref, ours


@pytest.mark.parametrize("frames", [1, 5, 9, 13])
def test_encode_matches_diffusers(pair, frames):
    ref, ours = pair
    torch.manual_seed(frames)
    x = torch.rand(2, 3, frames, H, W) * 2 - 1
    with torch.no_grad():
        want = ref.encode(x).latent_dist.mode()
        assert want.shape == (2, 16, 1 + (frames - 1) // 4, H // 8, W // 8)
        assert ours.latent_shape(frames, H, W) == want.shape[1:]
        for chunk in (1, 2, None):
            got = ours.encode(x, chunk_latents=chunk)
            err = (got - want).abs().max().item()
            print(f"encode T={frames} chunk_latents={chunk}: max abs err {err:.2e} (|mu| max {want.abs().max():.2f})")
            assert got.shape == want.shape and err < TOL


@pytest.mark.parametrize("t", [1, 3])
def test_decode_matches_diffusers(pair, t):
    ref, ours = pair
    torch.manual_seed(100 + t)
    z = torch.randn(2, 16, t, 3, 5) * 3  # large enough that some outputs reach the clamp
    with torch.no_grad():
        want = ref.decode(z).sample
        assert want.shape == (2, 3, 1 + 4 * (t - 1), 24, 40)
        for chunk in (1, 2, None):
            got = ours.decode(z, chunk_latents=chunk)
            err = (got - want).abs().max().item()
            print(f"decode t={t} chunk_latents={chunk}: max abs err {err:.2e} (output std {want.std():.2f})")
            assert got.shape == want.shape and err < TOL
    assert t == 1 or bool((want.abs() == 1).any())  # the clamp is exercised


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_normalize_is_the_pipelines_convention(dtype):
    vae = WanVAE(WanVAEConfig(base_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=0))
    torch.manual_seed(0)
    mu = (torch.randn(2, 16, 3, 2, 4) * 2).to(dtype)
    # pipeline_wan.py / pipeline_wan_i2v.py: latents_std stored as 1/std, cast to the latents' dtype
    mean = torch.tensor(vae.cfg.latents_mean).view(1, 16, 1, 1, 1).to(mu.device, mu.dtype)
    inv_std = 1.0 / torch.tensor(vae.cfg.latents_std).view(1, 16, 1, 1, 1).to(mu.device, mu.dtype)
    z = vae.normalize(mu)
    assert torch.equal(z, (mu - mean) * inv_std)
    assert torch.equal(vae.denormalize(z), z / inv_std + mean)
    if dtype == torch.float32:
        std = torch.tensor(vae.cfg.latents_std).view(1, 16, 1, 1, 1)
        assert (z - (mu - mean) / std).abs().max() < 1e-6
        assert (vae.denormalize(z) - mu).abs().max() < 1e-5
        assert abs(vae.cfg.latents_mean[0] + 0.7571) < 1e-9 and abs(vae.cfg.latents_std[0] - 2.8184) < 1e-9


def test_bad_shapes_are_clear_errors(pair):
    _, ours = pair
    for shape in [(1, 3, 4, H, W), (1, 3, 8, H, W), (1, 3, 0, H, W)]:
        with pytest.raises(ValueError, match="4k\\+1"):
            ours.encode(torch.zeros(shape))
    for shape in [(1, 3, 5, 20, W), (1, 3, 5, H, 36), (1, 3, 5, 0, W)]:
        with pytest.raises(ValueError, match="multiples of 8"):
            ours.encode(torch.zeros(shape))
    for shape in [(3, 5, H, W), (1, 4, 5, H, W)]:
        with pytest.raises(ValueError, match="wants video"):
            ours.encode(torch.zeros(shape))
    for shape in [(1, 16, 2, 3), (1, 4, 2, 3, 5), (1, 16, 0, 3, 5)]:
        with pytest.raises(ValueError, match="wants latents"):
            ours.decode(torch.zeros(shape))
    with pytest.raises(ValueError, match="chunk_latents"):
        ours.encode(torch.zeros(1, 3, 5, H, W), chunk_latents=0)


def test_config_matches_diffusers_and_refuses_other_variants():
    with torch.device("meta"):  # full size, no memory: Wan 2.1's real layout, 127M parameters
        ref = AutoencoderKLWan()
        ours = WanVAE(config_from_diffusers(dict(ref.config)))
    assert config_from_diffusers(dict(ref.config)) == WanVAEConfig()
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}
    wan22 = dict(_class_name="AutoencoderKLWan", base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True,
                 patch_size=2, scale_factor_spatial=16, latents_mean=[0.0] * 48, latents_std=[1.0] * 48)
    with pytest.raises(ValueError, match="Wan 2.1 VAE only"):
        config_from_diffusers(wan22)
    with pytest.raises(ValueError, match="attn_scales"):
        WanVAEConfig(attn_scales=[1.0])
    with pytest.raises(ValueError, match="unknown"):
        config_from_diffusers({"z_dim": 16, "clip_output": True})
    with pytest.raises(ValueError, match="z_dim=4"):
        WanVAEConfig(z_dim=4)  # diffusers' 16-value stats kept
    with pytest.raises(ValueError, match="2 temporal"):
        WanVAEConfig(temperal_downsample=[True, True, True])


def test_state_dict_loads_both_ways(pair, tmp_path):
    ref, ours = pair
    assert list(ours.state_dict()) == list(ref.state_dict())  # same names, same order
    back = AutoencoderKLWan(**{k: v for k, v in ref.config.items() if not k.startswith("_")}).eval()
    back.load_state_dict(ours.state_dict(), strict=True)
    for k, v in ref.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    ref.save_pretrained(tmp_path)  # config.json + diffusion_pytorch_model.safetensors
    loaded = WanVAE.from_diffusers_dir(tmp_path)
    x = torch.rand(1, 3, 5, H, W) * 2 - 1
    with torch.no_grad():
        assert torch.equal(loaded.encode(x), ours.encode(x))
        assert (back.encode(x).latent_dist.mode() - ours.encode(x)).abs().max() < TOL


def test_save_diffusers_dir_round_trips(pair, tmp_path):
    """save_diffusers_dir is the inverse of from_diffusers_dir (bit for bit, config and statistics
    included), and diffusers' own from_pretrained reads the folder into the same model."""
    _, ours = pair
    ours.cfg.latents_mean = [0.01 * i for i in range(16)]  # a fitted VAE's own statistics must travel
    ours.cfg.latents_std = [1.0 + 0.1 * i for i in range(16)]
    try:
        ours.save_diffusers_dir(tmp_path / "vae")
        loaded = WanVAE.from_diffusers_dir(tmp_path / "vae")
        assert loaded.cfg == ours.cfg
        for k, v in ours.state_dict().items():
            assert torch.equal(loaded.state_dict()[k], v), k
        x = torch.rand(1, 3, 5, H, W) * 2 - 1
        with torch.no_grad():
            assert torch.equal(loaded.normalize(loaded.encode(x)), ours.normalize(ours.encode(x)))
        theirs = AutoencoderKLWan.from_pretrained(tmp_path / "vae").eval()
        assert list(theirs.config.latents_mean) == ours.cfg.latents_mean
        assert list(theirs.config.latents_std) == ours.cfg.latents_std
        for k, v in ours.state_dict().items():
            assert torch.equal(theirs.state_dict()[k], v), k
    finally:
        ours.cfg.latents_mean, ours.cfg.latents_std = WanVAEConfig().latents_mean, WanVAEConfig().latents_std
