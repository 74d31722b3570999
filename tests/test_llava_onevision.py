"""LLaVA-OneVision (siglip_vit + llava_onevision_mlp + a Qwen2 decoder, 1-D positions) against
transformers' LlavaOnevisionForConditionalGeneration on tiny random models (fp32; 30 px tiles of
6 px patches: 5 x 5 patches, an odd side that the video pooling rounds up; pinpoints up to 3 x 3
tiles and anyres_max_2, so large grids are shrunk): logits and every parameter gradient for anyres
images of several aspect ratios in one packed row, the multi-image path (one tile each) and a
video; the layout rule on its own; export round trip."""

from __future__ import annotations

import pytest
import torch

from omniweave.data.media.anyres import AnyresConfig, anyres_grid
from omniweave.models.hf.export import export_hf
from omniweave.models.hf.loading import adapter_for, load_hf

TILE, PATCH, SIDE = 30, 6, 5
PINPOINTS = [[h, w] for h in (30, 60, 90) for w in (30, 60, 90)]
IMAGE, VIDEO = 290, 291
ANYRES = AnyresConfig(tile=TILE, patch=PATCH, pinpoints=tuple(map(tuple, PINPOINTS)), vision_aspect_ratio="anyres_max_2")


def _config():
    from transformers import LlavaOnevisionConfig, Qwen2Config

    text = Qwen2Config(vocab_size=301, hidden_size=72, intermediate_size=136, num_hidden_layers=2,
                       num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=2048,
                       tie_word_embeddings=False)  # fmt: skip
    vision = dict(model_type="siglip_vision_model", hidden_size=36, num_hidden_layers=3, num_attention_heads=3,
                  intermediate_size=50, image_size=TILE, patch_size=PATCH)  # fmt: skip
    return LlavaOnevisionConfig(text_config=text.to_dict(), vision_config=vision, image_token_id=IMAGE,
                                video_token_id=VIDEO, image_grid_pinpoints=PINPOINTS,
                                vision_aspect_ratio="anyres_max_2", tie_word_embeddings=False)  # fmt: skip


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from transformers import LlavaOnevisionForConditionalGeneration

    from tests.hf_factory import saved_perturbed_pair  # here: tests/dist ranks import this module without the torchvision shim

    path = tmp_path_factory.mktemp("llava_ov") / "hf"
    hf, ours = saved_perturbed_pair(LlavaOnevisionForConditionalGeneration, _config(), path)
    return path, hf, ours


def patches(tiles: torch.Tensor) -> torch.Tensor:
    """[T, 3, S, S] -> [T·(S/p)², 3·p·p] raster rows (anyres.tiles_to_patches' layout)."""
    T, C, S, _ = tiles.shape
    n = S // PATCH
    return tiles.reshape(T, C, n, PATCH, n, PATCH).permute(0, 2, 4, 1, 3, 5).reshape(T * n * n, C * PATCH * PATCH)


def make_sample(images: list[tuple[int, int]], frames: int = 0, single_tile: bool = False, seed: int = 0):
    """Text, each image's tokens, text[, a video's]: HF's inputs and our packed batch. ``images``
    are (height, width); ``single_tile``: the multi-image path (one tile each, batch_num_images)."""
    from omniweave.models.registry import build_model  # noqa: F401  (registers the components)
    from omniweave.models.components.llava_projector import LlavaOnevisionProjector, LlavaOnevisionProjectorConfig

    proj = LlavaOnevisionProjector(LlavaOnevisionProjectorConfig(in_dim=4, out_dim=4, image_size=TILE, patch_size=PATCH,
                                                                 anyres_grid=3, anyres_max=2))  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    ids, spans, grids, sizes, tiles = [], [], [], [], []
    for h, w in images:
        rows, cols = anyres_grid(h, w, TILE, ANYRES.pinpoints)
        t = 1 if single_tile else 1 + rows * cols
        grids.append([t, SIDE, SIDE])
        sizes.append([h, w])
        n = int(proj.num_tokens(torch.tensor([grids[-1]]), torch.tensor([sizes[-1]]))[0])
        ids += torch.randint(0, 280, (4,), generator=g).tolist()
        spans.append([len(ids), n])
        ids += [IMAGE] * n
        tiles.append(torch.randn(t, 3, TILE, TILE, generator=g))
    hf = {}
    if frames:
        ids += torch.randint(0, 280, (3,), generator=g).tolist()
        grids.append([frames, SIDE, SIDE])
        sizes.append([0, 0])
        n = int(proj.num_tokens(torch.tensor([grids[-1]]), torch.tensor([sizes[-1]]))[0])
        spans.append([len(ids), n])
        ids += [VIDEO] * n
        video = torch.randn(frames, 3, TILE, TILE, generator=g)
        hf["pixel_values_videos"] = video[None]
        tiles.append(video)
    ids += torch.randint(0, 280, (6,), generator=g).tolist()
    if images:
        most = max(t.shape[0] for t in tiles[:len(images)])
        hf["pixel_values"] = torch.stack([torch.cat([t, t.new_zeros(most - t.shape[0], *t.shape[1:])]) for t in tiles[:len(images)]])
        hf["image_sizes"] = torch.tensor([list(s) for s in images])
        if single_tile:
            hf["batch_num_images"] = torch.tensor([len(images)])
    input_ids = torch.tensor(ids)
    labels = torch.cat([input_ids[1:], torch.tensor([-100])])
    labels[(input_ids == IMAGE) | (input_ids == VIDEO)] = -100
    batch = {"input_ids": input_ids, "labels": labels, "position_ids": torch.arange(len(ids))[None],
             "cu_seqlens": torch.tensor([0, len(ids)], dtype=torch.int32), "pixel_values": patches(torch.cat(tiles)),
             "grid_thw": torch.tensor(grids), "image_sizes": torch.tensor(sizes), "media_spans": torch.tensor(spans)}  # fmt: skip
    return {"input_ids": input_ids[None], **hf}, batch


CASES = {
    "anyres_three_shapes": dict(images=[(40, 100), (95, 20), (200, 210)]),  # wide, tall, shrunk (anyres_max_2)
    "multi_image_single_tiles": dict(images=[(40, 100), (50, 50)], single_tile=True),
    "image_and_video": dict(images=[(70, 33)], frames=3),
}


def _grads_as_ours(hf) -> dict[str, torch.Tensor]:
    adapter = adapter_for("llava_onevision")
    grads = {}
    for n, p in hf.named_parameters():
        ours = adapter.model_name_to_ours(n)
        if ours is not None and p.grad is not None:
            grads[ours] = p.grad
    return adapter.model_tensors_to_ours(grads)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_grads_match_transformers(pair, case):
    from vl_factory import check_logits_and_grads

    _, hf, ours = pair
    theirs, batch = make_sample(**CASES[case])
    checked = check_logits_and_grads(hf, ours, theirs, batch, _grads_as_ours)
    assert "projector.image_newline" in checked and len(checked) > 20


def test_export_round_trip(pair, tmp_path):
    from transformers import LlavaOnevisionForConditionalGeneration

    _, hf, ours = pair
    out = tmp_path / "export"
    export_hf(ours, None, out)
    again = LlavaOnevisionForConditionalGeneration.from_pretrained(out, attn_implementation="eager").eval()
    theirs, _ = make_sample(**CASES["image_and_video"], seed=3)
    with torch.no_grad():
        assert (again(**theirs).logits - hf(**theirs).logits).abs().max().item() <= 1e-6
    reloaded, _ = load_hf(out)
    for (name, a), (_, b) in zip(sorted(ours.state_dict().items()), sorted(reloaded.state_dict().items())):
        assert torch.equal(a, b), name


def test_missing_image_sizes_is_a_clear_error(pair):
    _, _, ours = pair
    _, batch = make_sample(**CASES["anyres_three_shapes"])
    batch.pop("image_sizes")
    with pytest.raises(ValueError, match="image_sizes"):
        ours.logits(batch)


def _verify_dir(tmp_path):
    """A tiny LLaVA-OneVision directory on the demo tokenizer (<image> = 703, <video> = 702), 56 px
    tiles of 14 px patches, pinpoints to 3 x 3 tiles, anyres_max_2, and its image processor config."""
    import json

    from transformers import LlavaOnevisionForConditionalGeneration

    cfg = _config()
    cfg.text_config.vocab_size = 720
    cfg.vision_config.image_size, cfg.vision_config.patch_size = 56, 14
    cfg.image_token_index, cfg.video_token_index = 703, 702
    cfg.image_grid_pinpoints = [[h, w] for h in (56, 112, 168) for w in (56, 112, 168)]
    torch.manual_seed(1)
    path = tmp_path / "llava_ov"
    LlavaOnevisionForConditionalGeneration(cfg).save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "LlavaOnevisionImageProcessor", "size": {"height": 56, "width": 56},
        "image_grid_pinpoints": cfg.image_grid_pinpoints, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
        "do_pad": True, "resample": 3}))  # fmt: skip
    return path


def _png(path, h: int, w: int, seed: int) -> str:
    import numpy as np
    from PIL import Image

    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    return str(path)


@pytest.mark.parametrize("shapes", [[(40, 250)], [(300, 70), (90, 90)], [(500, 520)]],
                         ids=["one_wide_image", "two_images_multi_image_path", "large_image_shrunk"])
def test_hf_verify_compares_sizes_ids_tiles_and_logits(tmp_path, capsys, shapes):
    from omniweave.cli import main

    path = _verify_dir(tmp_path)
    args = [a for i, (h, w) in enumerate(shapes) for a in ("--image", _png(tmp_path / f"{i}.png", h, w, i))]
    assert main(["hf", "verify", str(path), *args]) == 0
    out = capsys.readouterr().out
    assert "pixel_values  max|Δ| = 0.000e+00" in out and "OK: all differences" in out, out


def test_hf_verify_with_a_random_image_and_video(tmp_path, capsys):
    from omniweave.cli import main

    assert main(["hf", "verify", str(_verify_dir(tmp_path))]) == 0  # a random image and a 6-frame clip
    out = capsys.readouterr().out
    assert "videos: HF given ours" in out and "OK: all differences" in out, out


def test_recipe_export_is_a_whole_directory_that_hf_verify_passes(tmp_path, capsys):
    """tiny_llava_onevision exported with its data section: config, weights, tokenizer, the chat
    template, LlavaOnevisionProcessor's configs over the recipe's pinpoints; transformers' image
    processor loads it and hf verify (HF rendering the exported template) equals our pipeline."""
    import json

    from transformers import AutoImageProcessor

    from omniweave.cli import main
    from omniweave.config import load_recipe, to_dict
    from omniweave.models.registry import build_model

    cfg = load_recipe("tiny_llava_onevision")
    torch.manual_seed(0)
    model = build_model(to_dict(cfg.model))
    model.init_weights()
    out = export_hf(model, to_dict(cfg.model), tmp_path / "hf", data_cfg=to_dict(cfg.data))
    processor_cfg = json.loads((out / "processor_config.json").read_text())
    assert processor_cfg["processor_class"] == "LlavaOnevisionProcessor" and processor_cfg["num_image_tokens"] == 16
    image_processor = AutoImageProcessor.from_pretrained(out)
    assert len(image_processor.image_grid_pinpoints) == cfg.data.vision.anyres_grid ** 2
    image = _png(tmp_path / "a.png", 60, 300, 3)
    assert main(["hf", "verify", str(out), "--image", image]) == 0
    printed = capsys.readouterr().out
    assert "HF renders the directory's chat template" in printed and "OK: all differences" in printed, printed
    from omniweave.data.text.tokenize import SampleProcessor

    with pytest.raises(FileNotFoundError, match="use the built-in template: llava_onevision"):  # data.template=hf on it
        SampleProcessor({"tokenizer": str(out), "template": "hf"})


def test_kv_cache_generation_equals_transformers_generate(pair):
    """The generation engine (eval, GRPO rollouts) on an anyres image and a video, decoded beside
    another prompt (the two prompts' image_sizes packed together): greedy tokens equal transformers'
    ``generate``."""
    from vl_factory import check_generation_equals_hf

    _, hf, ours = pair
    theirs, batch = make_sample(**CASES["image_and_video"], seed=8)
    check_generation_equals_hf(hf, ours, theirs, batch, make_sample([(95, 20)], seed=5)[1])
