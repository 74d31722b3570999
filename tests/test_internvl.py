"""InternVL (intern_vit + pixel_shuffle_mlp + a Qwen2 / Qwen3 decoder) against transformers'
InternVLForConditionalGeneration on tiny random models (fp32, shapes not round): logits and
every parameter gradient with tiles of several images in one packed row, tiles of a side the
position table was not trained for (bicubic resample), QK-norm / RMSNorm / final-LayerNorm
variants; export round trip."""

from __future__ import annotations

import pytest
import torch

from omniweave.models.hf.export import export_hf
from omniweave.models.hf.loading import adapter_for, load_hf

TILE_PATCHES = 4  # a 56 px tile of 14 px patches: 4 x 4 patches, 2 x 2 tokens after the pixel shuffle
IMAGE_TOKEN = 290


def _config(text: str, variant: str):
    from transformers import InternVLConfig, Qwen2Config, Qwen3Config

    text_cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}[text]
    text_cfg = text_cls(vocab_size=301, hidden_size=72, intermediate_size=136, num_hidden_layers=2,
                        num_attention_heads=6, num_key_value_heads=2, head_dim=12, max_position_embeddings=512,
                        rope_theta=10000.0, tie_word_embeddings=False)  # fmt: skip
    vision = dict(hidden_size=40, num_hidden_layers=2, num_attention_heads=4, intermediate_size=88,
                  image_size=56, patch_size=14, attention_bias=True, layer_scale_init_value=0.3)  # fmt: skip
    if variant == "6b_style":  # InternViT-6B's switches: RMSNorm blocks, QK-norm, no q/k/v bias, a final LayerNorm
        vision.update(norm_type="rms_norm", use_qk_norm=True, attention_bias=False, use_mean_pooling=False)
    return InternVLConfig(text_config=text_cfg.to_dict(), vision_config=vision, image_token_id=IMAGE_TOKEN,
                          image_seq_length=4, downsample_ratio=0.5, tie_word_embeddings=False)  # fmt: skip


CASES = {"internvl3_qwen2": ("qwen2", "300m_style"), "internvl3_5_qwen3": ("qwen3", "300m_style"),
         "qwen2_6b_style": ("qwen2", "6b_style")}  # fmt: skip


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    from transformers import InternVLForConditionalGeneration

    torch.manual_seed(0)
    hf = InternVLForConditionalGeneration(_config(*CASES[request.param])).eval()
    with torch.no_grad():  # random, not HF's init constants, so every parameter matters
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = tmp_path_factory.mktemp(request.param) / "hf"
    hf.save_pretrained(path)
    hf = InternVLForConditionalGeneration.from_pretrained(path, attn_implementation="eager").eval()
    ours, _ = load_hf(path)
    return path, hf, ours.eval()


def tile_patches(tiles: torch.Tensor, p: int = 14) -> torch.Tensor:
    """[T, 3, S, S] tiles -> [T·(S/p)², 3·p·p] patch rows in raster order (data/media/tiling.py's layout)."""
    T, C, S, _ = tiles.shape
    n = S // p
    return tiles.reshape(T, C, n, p, n, p).permute(0, 2, 4, 1, 3, 5).reshape(T * n * n, C * p * p)


def make_sample(tiles_per_image: list[int], side: int = 56, seed: int = 0):
    """Text, image 0's tokens, text, image 1's tokens, …: HF's inputs and our packed batch."""
    g = torch.Generator().manual_seed(seed)
    per_tile = (side // 14 // 2) ** 2
    ids, spans = [], []
    for n in tiles_per_image:
        ids += torch.randint(0, 280, (5,), generator=g).tolist()
        spans.append([len(ids), n * per_tile])
        ids += [IMAGE_TOKEN] * (n * per_tile)
    ids += torch.randint(0, 280, (7,), generator=g).tolist()
    tiles = torch.randn(sum(tiles_per_image), 3, side, side, generator=g)
    input_ids = torch.tensor(ids)
    labels = torch.cat([input_ids[1:], torch.tensor([-100])])
    labels[input_ids == IMAGE_TOKEN] = -100
    s = side // 14
    batch = {"input_ids": input_ids, "labels": labels, "position_ids": torch.arange(len(ids))[None],
             "cu_seqlens": torch.tensor([0, len(ids)], dtype=torch.int32), "pixel_values": tile_patches(tiles),
             "grid_thw": torch.tensor([[n, s, s] for n in tiles_per_image]), "media_spans": torch.tensor(spans)}  # fmt: skip
    return {"input_ids": input_ids[None], "pixel_values": tiles}, batch


def _grads_as_ours(hf) -> dict[str, torch.Tensor]:
    adapter = adapter_for("internvl")
    grads = {adapter.model_name_to_ours(n): p.grad for n, p in hf.named_parameters() if p.grad is not None}
    return adapter.model_tensors_to_ours(grads)


@pytest.mark.parametrize("tiles, side", [([3, 1], 56), ([2], 84)], ids=["two_images_56px", "resampled_positions_84px"])
def test_logits_and_grads_match_transformers(pair, tiles, side):
    _, hf, ours = pair
    theirs, batch = make_sample(tiles, side)
    hf.zero_grad(), ours.zero_grad()
    ref = hf(**theirs).logits[0]
    got = ours.logits(batch)
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() <= 1e-4
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    (ref * weights).sum().backward()
    (got * weights).sum().backward()
    ref_grads, checked = _grads_as_ours(hf), 0
    for name, p in ours.named_parameters():
        g = ref_grads.get(name)
        assert g is not None, f"{name}: no transformers counterpart"
        if g.norm() == 0:
            continue
        rel = ((p.grad - g).norm() / g.norm()).item()
        assert rel <= 1e-4, f"{name}: relative gradient error {rel:.2e}"
        checked += 1
    assert checked >= len(list(ours.parameters())) - 1  # all but the unused cls position-free rows, if any


def test_tiles_split_anywhere_give_the_same_features(pair):
    """Tiles are independent: encoding an item's tiles in two calls gives its feature rows in two
    pieces (what the context-parallel vision split relies on)."""
    _, _, ours = pair
    _, batch = make_sample([3], seed=2)
    pv, grid = batch["pixel_values"], batch["grid_thw"]
    with torch.no_grad():
        whole = ours.encode_media(pv, grid)
        first = ours.encode_media(pv[:16], torch.tensor([[1, 4, 4]]))
        rest = ours.encode_media(pv[16:], torch.tensor([[2, 4, 4]]))
    assert torch.allclose(whole, torch.cat([first, rest]), atol=1e-6)


def test_export_round_trip(pair, tmp_path):
    from transformers import InternVLForConditionalGeneration

    path, hf, ours = pair
    out = tmp_path / "export"
    export_hf(ours, None, out)
    again = InternVLForConditionalGeneration.from_pretrained(out, attn_implementation="eager").eval()
    theirs, _ = make_sample([2, 1], seed=4)
    with torch.no_grad():
        assert torch.equal(again(**theirs).logits, hf(**theirs).logits)
    reloaded, _ = load_hf(out)
    for (name, a), (_, b) in zip(sorted(ours.state_dict().items()), sorted(reloaded.state_dict().items())):
        assert torch.equal(a, b), name


def test_unsupported_config_is_a_clear_error():
    cfg = _config("qwen2", "300m_style").to_dict()
    cfg["vision_feature_layer"] = -2
    with pytest.raises(ValueError, match="vision_feature_layer"):
        adapter_for("internvl").model_config(cfg)
