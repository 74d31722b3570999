"""Wan 2.1 image-to-video in WanDiT (wan_dit.py + wan_i2v.py) against diffusers' WanTransformer3DModel
with ``image_dim`` / ``added_kv_proj_dim`` set, and the I2V side of hf/wan.py (load, save, verify).

Measured (fp32, CPU, tiny random non-square config, every weight random): 3 clips of different latent
sizes packed in one row, each with its own image features and text, vs diffusers per clip: max|dv|
6.7e-6 (|v| up to 9.7); FLF2V (``pos_embed_seq_len``) 5.7e-6; our model saved -> diffusers
``from_pretrained``: weights bit for bit, velocity 5.5e-6.
"""

import json

import pytest
import torch

from omniweave.models.components.wan_dit import WanDiT, WanDiTConfig, patchify_clips, unpatchify_clips
from omniweave.models.hf import wan
from tests.test_wan_dit import _randomise

diffusers = pytest.importorskip("diffusers")

PATCH = (1, 2, 2)
# 3 heads of 20 (width 60), CLIP width 24, 36 = 16 noisy + 4 mask + 16 conditioning channels in
TINY = dict(num_attention_heads=3, attention_head_dim=20, in_channels=36, out_channels=16, text_dim=20, freq_dim=32,
            ffn_dim=44, num_layers=2, patch_size=PATCH, image_dim=24, added_kv_proj_dim=60)
SIZES = [(3, 6, 10), (2, 8, 4), (1, 4, 6)]  # latent (F, H, W) per clip
TEXT_LENS = [7, 5, 9]  # then zero rows to 512: diffusers splits the image tokens off by a text length of 512
IMAGE_LENS = [11, 6, 9]
TIMESTEPS = [937.5, 412.0, 18.25]
TEXT_LEN = 512
ATOL = 1e-4


def _ref(**extra):
    model = diffusers.WanTransformer3DModel(**{**TINY, **extra}).eval()
    _randomise(model, 0)
    return model


def _clips(image_lens, seed=1):
    g = torch.Generator().manual_seed(seed)
    latents = [torch.randn(36, *s, generator=g) for s in SIZES]
    texts = [torch.cat([torch.randn(n, 20, generator=g), torch.zeros(TEXT_LEN - n, 20)]) for n in TEXT_LENS]
    images = [torch.randn(n, 24, generator=g) for n in image_lens]
    return latents, texts, images, torch.tensor(TIMESTEPS)


def _ours_from(ref) -> WanDiT:
    ours = WanDiT(wan.config_from_diffusers(dict(ref.config), attn_backend="math"))
    ours.load_state_dict(wan.diffusers_to_ours(ref.state_dict()), strict=True)
    return ours.eval()


def _cu(parts):
    return torch.tensor([0, *torch.tensor([p.shape[0] for p in parts]).cumsum(0).tolist()], dtype=torch.int32)


def _packed(model, clips, order):
    latents, texts, images, timesteps = clips
    tokens, grid = patchify_clips([latents[i] for i in order], PATCH)
    txt, img = [texts[i] for i in order], [images[i] for i in order]
    out = model(tokens, grid, timesteps[order], torch.cat(txt), _cu(txt), image=torch.cat(img), image_cu_seqlens=_cu(img))
    per = unpatchify_clips(out, grid, 16, PATCH)
    return {i: per[j] for j, i in enumerate(order)}


def _ref_alone(ref, clips, i, flf=False):
    latents, texts, images, timesteps = clips
    img = images[i].view(2, -1, 24) if flf else images[i][None]  # FLF2V: the clip's two images, a batch of 2
    return ref(latents[i][None], timesteps[i].reshape(1), texts[i][None], encoder_hidden_states_image=img,
               return_dict=False)[0][0]


def test_packed_i2v_matches_diffusers_per_clip():
    ref = _ref()
    ours = _ours_from(ref)
    clips = _clips(IMAGE_LENS)
    with torch.no_grad():
        want = {i: _ref_alone(ref, clips, i) for i in range(3)}
        forward = _packed(ours, clips, [0, 1, 2])
        reverse = _packed(ours, clips, [2, 1, 0])
        alone = _packed(ours, clips, [1])
    errors = [(forward[i] - want[i]).abs().max().item() for i in range(3)]
    scale = max(w.abs().max().item() for w in want.values())
    print(f"I2V max abs error vs diffusers per clip: {errors}; output scale {scale:.2f}")
    assert max(errors) < ATOL
    assert max((reverse[i] - forward[i]).abs().max().item() for i in range(3)) < 1e-5
    assert (alone[1] - want[1]).abs().max().item() < ATOL
    # the image matters: other image features change every clip's velocity
    other = (clips[0], clips[1], [x.roll(1, dims=1) for x in clips[2]], clips[3])  # (token order alone would not)
    with torch.no_grad():
        moved = _packed(ours, other, [0, 1, 2])
    assert min((moved[i] - forward[i]).abs().max().item() for i in range(3)) > 1e-3


def test_flf2v_pos_embed_matches_diffusers():
    ref = _ref(pos_embed_seq_len=8)  # two images of 4 tokens per clip
    ours = _ours_from(ref)
    assert ours.condition_embedder.image_embedder.pos_embed.shape == (1, 8, 24)
    clips = _clips([8, 8, 8], seed=2)
    with torch.no_grad():
        got = _packed(ours, clips, [0, 1, 2])
        errors = [(got[i] - _ref_alone(ref, clips, i, flf=True)).abs().max().item() for i in range(3)]
    print(f"FLF2V max abs error vs diffusers per clip: {errors}")
    assert max(errors) < ATOL
    with pytest.raises(ValueError, match="exactly 8 image tokens"):
        _packed(ours, _clips([8, 7, 8]), [0, 1, 2])


def test_i2v_inputs_are_checked():
    i2v, t2v = WanDiT(WanDiTConfig(**TINY)), WanDiT(WanDiTConfig(**{**TINY, "image_dim": None, "added_kv_proj_dim": None}))
    latents, texts, images, timesteps = _clips(IMAGE_LENS)
    tokens, grid = patchify_clips(latents[:2], PATCH)
    args = (tokens, grid, timesteps[:2], torch.cat(texts[:2]), _cu(texts[:2]))
    img, cu = torch.cat(images[:2]), _cu(images[:2])
    i2v(*args, image=img, image_cu_seqlens=cu)
    t2v(*args)
    with pytest.raises(ValueError, match="text-to-video WanDiT"):
        t2v(*args, image=img, image_cu_seqlens=cu)
    with pytest.raises(ValueError, match="is image-to-video"):
        i2v(*args)
    with pytest.raises(ValueError, match=r"\[N, image_dim = 24\]"):
        i2v(*args, image=img[:, :20], image_cu_seqlens=cu)
    with pytest.raises(ValueError, match="image_cu_seqlens"):
        i2v(*args, image=img, image_cu_seqlens=torch.tensor([0, 11, 16]))
    with pytest.raises(ValueError, match=">= 1 image token"):
        i2v(*args, image=img, image_cu_seqlens=torch.tensor([0, 17, 17]))


@pytest.mark.parametrize("kwargs, match", [
    (dict(added_kv_proj_dim=None), "set together"),
    (dict(image_dim=None), "set together"),
    (dict(added_kv_proj_dim=24), "must equal the model width"),
    (dict(image_dim=None, added_kv_proj_dim=None, pos_embed_seq_len=8), "needs image_dim"),
    (dict(pos_embed_seq_len=0), "pos_embed_seq_len"),
])
def test_i2v_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WanDiTConfig(**{**TINY, **kwargs})


def test_fresh_i2v_init_predicts_zero_and_grads_flow():
    torch.manual_seed(3)
    model = WanDiT(WanDiTConfig(**TINY, pos_embed_seq_len=8))
    assert model.condition_embedder.image_embedder.pos_embed.abs().max() == 0  # official emb_pos: zeros
    clips = _clips([8, 8, 8])
    with torch.no_grad():
        assert all(v.abs().max() == 0 for v in _packed(model, clips, [0, 1, 2]).values())  # proj_out zero
    _randomise(model, 4, std=0.1)
    sum(v.square().mean() for v in _packed(model, clips, [0, 1, 2]).values()).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_diffusers_i2v_folder_loads_and_save_round_trips(tmp_path, capsys):
    from omniweave.cli import main

    ref = _ref()
    ref.save_pretrained(tmp_path / "theirs")
    ours = wan.load_wan_dit(tmp_path / "theirs", attn_backend="math")
    want = wan.diffusers_to_ours(ref.state_dict())
    got = ours.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert main(["hf", "verify", str(tmp_path / "theirs")]) == 0
    out = capsys.readouterr().out
    assert "image tokens [257, 13]" in out and "text rows [512, 512]" in out, out

    mine = WanDiT(WanDiTConfig(**TINY, attn_backend="math")).eval()
    _randomise(mine, 5)
    path = wan.save_wan_dit(mine, tmp_path / "ours")
    config = json.loads((path / "config.json").read_text())
    assert (config["image_dim"], config["added_kv_proj_dim"], config["pos_embed_seq_len"]) == (24, 60, None)
    back = diffusers.WanTransformer3DModel.from_pretrained(str(path)).eval()
    mapped = wan.ours_to_diffusers(mine.state_dict(), PATCH)
    theirs = back.state_dict()
    assert theirs.keys() == mapped.keys() and all(torch.equal(theirs[k], mapped[k]) for k in mapped)  # bit for bit
    assert any("add_k_proj" in k for k in theirs) and any("image_embedder.ff.net.0.proj" in k for k in theirs)
    again = wan.load_wan_dit(path).state_dict()
    assert all(torch.equal(again[k], v) for k, v in mine.state_dict().items())
    clips = _clips(IMAGE_LENS)
    with torch.no_grad():
        got = _packed(mine, clips, [0, 1, 2])
        errors = [(got[i] - _ref_alone(back, clips, i)).abs().max().item() for i in range(3)]
    print(f"save_wan_dit (I2V) -> diffusers: max abs error per clip {errors}")
    assert max(errors) < ATOL


def test_i2v_14b_yaml_is_diffusers_config_and_parameter_count():
    """wan2_1_i2v_14b.yaml = diffusers' Wan2.1-I2V-14B transformer config; both models built on the meta
    device (nothing materialised) have the same parameter shapes and count."""
    from pathlib import Path

    import yaml

    from omniweave.models.registry import build_component

    cfg = yaml.safe_load((Path(__file__).parents[1] / "omniweave/configs/models/generator/wan2_1_i2v_14b.yaml").read_text())
    diffusers_cfg = dict(image_dim=1280, added_kv_proj_dim=5120, attention_head_dim=128, cross_attn_norm=True,
                         eps=1e-06, ffn_dim=13824, freq_dim=256, in_channels=36, num_attention_heads=40, num_layers=40,
                         out_channels=16, patch_size=[1, 2, 2], qk_norm="rms_norm_across_heads", text_dim=4096,
                         rope_max_seq_len=1024)  # scripts/convert_wan_to_diffusers.py "Wan-I2V-14B-480p"
    with torch.device("meta"):
        ours = build_component("generator", cfg)
        ref = diffusers.WanTransformer3DModel(**diffusers_cfg)
    for k, v in wan.config_to_diffusers(ours.config).items():
        assert v == (tuple(diffusers_cfg[k]) if k == "patch_size" else diffusers_cfg.get(k)), k
    mapped = wan.ours_to_diffusers(ours.state_dict())
    assert {k: tuple(v.shape) for k, v in mapped.items()} == {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    n_ours, n_ref = sum(p.numel() for p in ours.parameters()), sum(p.numel() for p in ref.parameters())
    print(f"Wan2.1-I2V-14B parameters: ours {n_ours:,}, diffusers {n_ref:,}")
    assert n_ours == n_ref == 16_394_878_784  # T2V 14B + 409,600 patch + 8,211,200 embedder + 40 x 52,444,160
