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
    from transformers import InternVLConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    text_cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}[text]
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True,
               decoder_sparse_step=1) if text == "qwen3_moe" else {}  # fmt: skip
    text_cfg = text_cls(vocab_size=301, hidden_size=72, intermediate_size=136, num_hidden_layers=2,
                        num_attention_heads=6, num_key_value_heads=2, head_dim=12, max_position_embeddings=512,
                        rope_theta=10000.0, tie_word_embeddings=False, **moe)  # fmt: skip
    vision = dict(hidden_size=40, num_hidden_layers=2, num_attention_heads=4, intermediate_size=88,
                  image_size=56, patch_size=14, attention_bias=True, layer_scale_init_value=0.3)  # fmt: skip
    if variant == "6b_style":  # InternViT-6B's switches: RMSNorm blocks, QK-norm, no q/k/v bias, a final LayerNorm
        vision.update(norm_type="rms_norm", use_qk_norm=True, attention_bias=False, use_mean_pooling=False)
    return InternVLConfig(text_config=text_cfg.to_dict(), vision_config=vision, image_token_id=IMAGE_TOKEN,
                          image_seq_length=4, downsample_ratio=0.5, tie_word_embeddings=False)  # fmt: skip


CASES = {"internvl3_qwen2": ("qwen2", "300m_style"), "internvl3_5_qwen3": ("qwen3", "300m_style"),
         "qwen2_6b_style": ("qwen2", "6b_style"), "internvl3_5_moe": ("qwen3_moe", "300m_style")}  # fmt: skip


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
    from vl_factory import check_logits_and_grads

    _, hf, ours = pair
    theirs, batch = make_sample(tiles, side)
    checked = check_logits_and_grads(hf, ours, theirs, batch, _grads_as_ours)
    assert len(checked) >= len(list(ours.parameters())) - 1  # every parameter has a non-zero gradient


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
    with torch.no_grad():  # 1e-6, not bit-equal: a MoE's expert sums are not ordered across CPU threads
        assert (again(**theirs).logits - hf(**theirs).logits).abs().max().item() <= 1e-6
    reloaded, _ = load_hf(out)
    for (name, a), (_, b) in zip(sorted(ours.state_dict().items()), sorted(reloaded.state_dict().items())):
        assert torch.equal(a, b), name


def test_unsupported_config_is_a_clear_error():
    cfg = _config("qwen2", "300m_style").to_dict()
    cfg["vision_feature_layer"] = -2
    with pytest.raises(ValueError, match="vision_feature_layer"):
        adapter_for("internvl").model_config(cfg)


def _verify_dir(tmp_path, max_patches: int = 6):
    """A tiny InternVL directory on the demo tokenizer (<IMG_CONTEXT> = 701) with a GotOcr2 image
    processor config of 56 px tiles."""
    import json

    from transformers import InternVLForConditionalGeneration

    cfg = _config("qwen3", "300m_style")
    cfg.text_config.vocab_size = 720
    cfg.image_token_id = 701
    torch.manual_seed(1)
    path = tmp_path / "internvl"
    InternVLForConditionalGeneration(cfg).save_pretrained(path)
    (path / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "GotOcr2ImageProcessor", "crop_to_patches": True, "min_patches": 1,
        "max_patches": max_patches, "size": {"height": 56, "width": 56}, "resample": 3,
        "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}))  # fmt: skip
    return path


def _png(path, h: int, w: int, seed: int) -> str:
    import numpy as np
    from PIL import Image

    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    return str(path)


def test_hf_verify_compares_tiles_ids_and_logits(tmp_path, capsys):
    from omniweave.cli import main

    path = _verify_dir(tmp_path)
    wide, tall = _png(tmp_path / "wide.png", 40, 250, 0), _png(tmp_path / "tall.png", 300, 70, 1)
    assert main(["hf", "verify", str(path), "--image", wide, "--image", tall]) == 0
    out = capsys.readouterr().out
    assert "tiles         max|Δ| = 0.000e+00  per image: ours [7, 5], HF [7, 5]" in out
    assert "pixel_values  max|Δ| = 0.000e+00" in out and "OK: all differences" in out
    assert main(["hf", "verify", str(path)]) == 0  # a random image


def test_hf_verify_reports_a_token_id_mismatch(tmp_path, capsys):
    import json

    from omniweave.cli import main

    path = _verify_dir(tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["image_token_id"] = 700
    (path / "config.json").write_text(json.dumps(cfg))
    assert main(["hf", "verify", str(path)]) == 2
    assert "image_token_id=700" in capsys.readouterr().err


# ---------------------------------------------------------------------------- recipes

def test_internvl3_5_8b_recipe_builds_on_meta_with_the_published_size():
    """InternVL3.5-8B: InternViT-300M (0.30B) + projector (34M) + Qwen3-8B (8.19B) = 8.53B, the
    model card's 8.5B; exports as internvl."""
    from omniweave.config import load_recipe
    from omniweave.models.hf.export import hf_model_type
    from omniweave.models.registry import build_model

    cfg = load_recipe("internvl3_5_8b")
    with torch.device("meta"):
        model = build_model(cfg.model)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert abs(count(model.image_encoder) - 0.304e9) / 0.304e9 < 0.01
    assert abs(count(model) - 8.53e9) / 8.53e9 < 0.01, count(model)
    assert hf_model_type(model) == "internvl"
    assert model.projector.num_tokens(torch.tensor([[3, 32, 32]])).item() == 3 * 256  # 256 tokens per 448 px tile


def test_tiny_internvl_recipe_trains_on_packed_tiles(tmp_path):
    """Pack images with the recipe (tiled as InternVL does) and a video (a tile per frame);
    collate a pack; forward + backward through every part; the DP balancer's cost model
    knows the tower and projector."""
    from omniweave.config import to_dict
    from omniweave.models.registry import build_model
    from omniweave.parallel.cost_model import CostModel
    from tests.train_factory import pack_fakes

    cfg, batches, stats = pack_fakes(tmp_path, "tiny_internvl", n_text=2, n_image=4, n_video=1)
    assert stats["dropped"] == {}  # the video too (its frames: test_tiny_internvl_packs_and_trains_videos_a_span_per_frame)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    batch = next(b for b in batches if b["grid_thw"].shape[0] > 0)
    assert batch["pixel_values"].shape[1] == 3 * 14 * 14 and (batch["grid_thw"][:, 1:] == 8).all()
    out = model(batch)
    out.loss_sum.backward()
    assert torch.isfinite(out.loss_sum) and int(out.num_tokens) > 0
    for part in ("image_encoder.cls_token", "image_encoder.position_embeddings", "image_encoder.blocks.1.lambda_2",
                 "projector.linear_1.weight", "foundation.layers.0.self_attn.q_proj.weight"):  # fmt: skip
        assert model.get_parameter(part).grad.abs().sum() > 0, part
    assert CostModel.from_model_config(to_dict(cfg.model)).p > 0


def test_kv_cache_generation_equals_transformers_generate(pair):
    """The generation engine (eval, GRPO rollouts) on tiled images, decoded beside another prompt:
    greedy tokens equal transformers' ``generate`` (1-D positions continue at max + 1)."""
    from vl_factory import check_generation_equals_hf

    _, hf, ours = pair
    theirs, batch = make_sample([3, 1], seed=8)
    check_generation_equals_hf(hf, ours, theirs, batch, make_sample([2], seed=5)[1])


def test_recipe_export_is_a_whole_internvl_directory_that_hf_verify_passes(tmp_path, capsys):
    """tiny_internvl exported with its data section: config, weights, the demo tokenizer naming
    InternVLProcessor's tokens, the chat template as the -hf checkpoints write it (<IMG_CONTEXT>\\n),
    GotOcr2 / InternVL processor configs of the recipe's tiles; transformers' tokenizer and image
    processor load it, and hf verify (HF rendering the exported template + InternVLProcessor's
    expansion, its image processor) equals our pipeline."""
    import json

    from transformers import AutoImageProcessor, AutoTokenizer

    from omniweave.cli import main
    from omniweave.config import load_recipe, to_dict
    from omniweave.models.registry import build_model

    cfg = load_recipe("tiny_internvl")
    torch.manual_seed(0)
    model = build_model(to_dict(cfg.model))
    model.init_weights()
    out = export_hf(model, to_dict(cfg.model), tmp_path / "hf", data_cfg=to_dict(cfg.data))
    assert json.loads((out / "processor_config.json").read_text())["processor_class"] == "InternVLProcessor"
    tok = AutoTokenizer.from_pretrained(out)
    assert (tok.start_image_token, tok.context_image_token_id) == ("<img>", 701)
    image_processor = AutoImageProcessor.from_pretrained(out)
    assert (image_processor.size.height, image_processor.max_patches, image_processor.crop_to_patches) == (112, 6, True)
    wide = _png(tmp_path / "wide.png", 60, 300, 3)
    assert main(["hf", "verify", str(out), "--image", wide]) == 0
    printed = capsys.readouterr().out
    assert "HF renders the directory's chat template" in printed and "OK: all differences" in printed
    assert main(["hf", "verify", str(out)]) == 0  # a random image and video: <video> in the exported template
    printed = capsys.readouterr().out
    assert "video_pixels" in printed and "OK: all differences" in printed, printed
    from omniweave.data.text.tokenize import SampleProcessor

    with pytest.raises(FileNotFoundError, match="use the built-in template: internvl"):  # data.template=hf on it
        SampleProcessor({"tokenizer": str(out), "template": "hf"})


# ---------------------------------------------------------------------------- videos: a tile per frame


def test_tiny_internvl_packs_and_trains_videos_a_span_per_frame(tmp_path):
    """``data pack --recipe tiny_internvl`` on samples with videos: each video is one item of
    ``frames`` tiles (grid (4, 8, 8) for 8 frames at 4 fps sampled at 2 fps), written
    ``Frame{i}: <img>`` + 16 <IMG_CONTEXT> + ``</img>`` per frame, one media span per frame; a
    collated row with a video goes forward and backward through every part."""
    from omniweave.data.text.tokenizer import load_tokenizer
    from omniweave.models.registry import build_model
    from tests.train_factory import pack_fakes

    cfg, batches, stats = pack_fakes(tmp_path, "tiny_internvl", n_text=2, n_image=2, n_video=3)
    assert stats["dropped"] == {}
    batch = next(b for b in batches if (b["grid_thw"][:, 0] == 4).any() and b["grid_thw"].shape[0] > 1)
    tok, ids = load_tokenizer("demo"), batch["input_ids"]
    spans = batch["media_spans"].tolist()
    assert len(spans) > batch["grid_thw"].shape[0]  # several spans per video item
    videos = 0
    for start, n in spans:
        assert (ids[start:start + n] == 701).all() and n % 16 == 0  # 112 px tiles: 16 tokens each
        before = tok.decode(ids[start - 5:start])
        if "Frame" in before:  # a frame: one tile, its own span
            videos += before.endswith("Frame1: <img>")
            assert n == 16 and tok.decode(ids[start + n:start + n + 1]) == "</img>"
    assert videos == int((batch["grid_thw"][:, 0] == 4).sum())
    assert batch["pixel_values"].shape == (int(batch["grid_thw"].prod(1).sum()), 3 * 14 * 14)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    out = model(batch)
    out.loss_sum.backward()
    assert torch.isfinite(out.loss_sum) and int(out.num_tokens) > 0
    for part in ("image_encoder.cls_token", "image_encoder.blocks.1.lambda_2", "projector.linear_1.weight"):
        assert model.get_parameter(part).grad.abs().sum() > 0, part


def test_hf_verify_compares_video_frames_pixels_ids_and_logits(tmp_path, capsys):
    """hf verify with an image and a video: InternVLVideoProcessor (the directory's config, fps 1)
    samples the frames itself; frames, pixels and ids equal, logits within 1e-4. A video config
    whose frames are not the image tiles is refused (exit 2)."""
    import json

    from omniweave.cli import main
    from tests.data_factory import video_bytes

    path = _verify_dir(tmp_path)
    video = {"video_processor_type": "InternVLVideoProcessor", "size": {"height": 56, "width": 56}, "fps": 1.0,
             "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}  # fmt: skip
    (path / "video_preprocessor_config.json").write_text(json.dumps(video))
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(video_bytes(30, fps=10.0, height=77, width=131, seed=3))
    wide = _png(tmp_path / "wide.png", 40, 250, 0)
    assert main(["hf", "verify", str(path), "--image", wide, "--video", str(clip)]) == 0
    out = capsys.readouterr().out
    assert "frames        max|Δ| = 0.000e+00  per video: ours [[5, 15, 25]], HF [[5, 15, 25]]" in out
    assert "video_pixels  max|Δ| = 0.000e+00  frames [3, 3, 56, 56]" in out
    assert "input_ids     max|Δ| = 0.000e+00" in out and "OK: all differences" in out
    assert main(["hf", "verify", str(path)]) == 0  # a random image and a random clip: 1.5 s at 1 fps, one frame
    out = capsys.readouterr().out
    assert "per video: ours [[3]], HF [[3]]" in out and "given our one frame" in out  # transformers cannot sample 1
    (path / "video_preprocessor_config.json").write_text(json.dumps({**video, "size": {"height": 84, "width": 84}}))
    assert main(["hf", "verify", str(path), "--video", str(clip)]) == 2
    assert "resizes every frame to one tile" in capsys.readouterr().err


def test_exported_internvl_processor_gives_our_ids_and_video_pixels(tmp_path):
    """transformers' whole InternVLProcessor (AutoProcessor of a tiny_internvl export: the exported
    chat template, replace_video_token, InternVLVideoProcessor sampling at the recipe's fps) on a
    conversation with an image and a video == our SampleProcessor: input ids equal; the video's
    frames bit-equal (the image tiles come from the torchvision GotOcr2ImageProcessor there, which
    the Pil one we follow differs from by a uint8 level: compared in tests/test_tiling.py instead)."""
    import io

    import numpy as np
    from PIL import Image
    from transformers import AutoProcessor
    from transformers.video_utils import load_video

    from omniweave.config import load_recipe, to_dict
    from omniweave.data.sample import Conversation, Message, RawSample
    from omniweave.data.text.tokenize import SampleProcessor
    from omniweave.models.hf.verify_internvl import _tiles
    from omniweave.models.registry import build_model
    from tests.data_factory import png_bytes, to_hf_messages, video_bytes

    cfg = load_recipe("tiny_internvl")
    torch.manual_seed(0)
    out = export_hf(build_model(to_dict(cfg.model)), to_dict(cfg.model), tmp_path / "hf", data_cfg=to_dict(cfg.data))
    hf = AutoProcessor.from_pretrained(out)
    data = {k: v for k, v in to_dict(cfg.data).items() if k in ("tokenizer", "template", "rope", "vision")}
    ours = SampleProcessor(data)
    msgs = [Message("user", "<image><video>What happens?"), Message("assistant", "Noise.")]
    raw = RawSample(key="x", conversation=Conversation("x", msgs, images=["a.png"], videos=["v.mp4"]),
                    media={"a.png": png_bytes(60, 300, seed=3), "v.mp4": video_bytes(21, fps=7.0, height=90, width=64)})
    sample = ours.tokenize(raw)
    (tmp_path / "v.mp4").write_bytes(raw.media["v.mp4"])
    frames, meta = load_video(str(tmp_path / "v.mp4"), backend="pyav",
                              sample_indices_fn=lambda metadata, **_: np.arange(metadata.total_num_frames))  # fmt: skip
    text = hf.apply_chat_template(to_hf_messages(msgs), tokenize=False)
    got = hf(text=[text], images=[Image.open(io.BytesIO(raw.media["a.png"]))], videos=[frames], return_tensors="pt",
             videos_kwargs={"video_metadata": [meta], "do_sample_frames": True, "fps": ours.vision.fps})  # fmt: skip
    assert got["input_ids"][0].tolist() == sample.input_ids.tolist()
    image, video = sample.media
    assert video.kind == "video" and tuple(video.grid_thw) == (6, 8, 8) and len(video.ranges()) == 6
    ours_frames = _tiles(torch.from_numpy(ours.process_media(video, raw.media["v.mp4"])), 6, 14)
    assert got["pixel_values"].shape[0] == image.grid_thw[0] + 6
    assert (got["pixel_values"][image.grid_thw[0]:] - ours_frames).abs().max().item() == 0.0


def test_a_tokenizer_without_the_video_marker_serves_images_and_counts_videos_as_rejects(tmp_path):
    """A template whose video pad the tokenizer lacks still serves images, and a video is a counted
    reject naming the missing token (the built-in internvl marks a video's place with <IMG_CONTEXT>,
    because InternVL's released tokenizers hold no <video> token: its processor replaces the text)."""
    from omniweave.data.sample import Conversation, Message, RawSample
    from omniweave.data.text.tokenize import SampleProcessor, SampleRejected
    from tests.data_factory import png_bytes, video_bytes

    (tmp_path / "t.yaml").write_text("name: no_video_token\nbase: internvl\nvideo: \"<vid_marker>\\n\"\n"
                                     "video_pad: \"<vid_marker>\"\n")  # fmt: skip
    proc = SampleProcessor({"tokenizer": "demo", "template": str(tmp_path / "t.yaml"), "rope": "rope1d",
                            "vision": {"tiling": "internvl", "tile_size": 56, "patch_size": 14, "merge_size": 2,
                                       "temporal_patch_size": 1}})  # fmt: skip
    assert proc.video_pad_id is None
    image = RawSample("a", Conversation("a", [Message("user", "<image>Hi"), Message("assistant", "Yo")], images=["a.png"]),
                      {"a.png": png_bytes(56, 84, seed=0)})  # fmt: skip
    assert proc.tokenize(image).media[0].grid_thw[0] == 7  # 3 x 2 tiles (aspect 1.5) + the thumbnail
    video = RawSample("v", Conversation("v", [Message("user", "<video>Hi"), Message("assistant", "Yo")], videos=["v.mp4"]),
                      {"v.mp4": video_bytes(4)})  # fmt: skip
    with pytest.raises(SampleRejected, match="no_video_token"):
        proc.tokenize(video)


def test_hf_verify_refuses_an_image_processor_it_does_not_implement(tmp_path, capsys):
    import json

    from omniweave.cli import main

    path = _verify_dir(tmp_path)
    cfg = json.loads((path / "preprocessor_config.json").read_text())
    (path / "preprocessor_config.json").write_text(json.dumps({**cfg, "image_processor_type": "Phi4MultimodalImageProcessorFast"}))
    assert main(["hf", "verify", str(path)]) == 2
    assert "only GotOcr2ImageProcessor's tiling is implemented" in capsys.readouterr().err
