"""LLaVA-OneVision's data side (``data.vision.tiling: anyres``, template ``llava_onevision``) against
transformers 5.24's ``LlavaOnevisionProcessor`` (+ ``LlavaOnevisionImageProcessorPil``,
``LlavaOnevisionVideoProcessor``) and the released chat template: token counts planned from headers
(the single-image and the multi-image path), pixels, frame sampling, whole conversations' ids; the
tiny recipe packs, collates (``image_sizes``) and trains through every part; bad input is a clear
error or a counted reject."""

from __future__ import annotations

import io
import json
import re

import numpy as np
import pytest
import torch
from PIL import Image

from omniweave.data.media import vision as M
from omniweave.data.media.anyres import square_pinpoints, tiles_to_patches
from omniweave.data.media.anyres_plan import anyres_config
from omniweave.data.sample import Conversation, Message, RawSample
from omniweave.data.text.tokenize import SampleProcessor, SampleRejected
from tests.data_factory import png_bytes, to_hf_messages, video_bytes

TEMPLATE = "tests/assets/chat_templates/llava_onevision_hf.jinja"
RELEASED = M.VisionConfig(tiling="anyres", tile_size=384, patch_size=14, merge_size=1, temporal_patch_size=1,
                          image_mean=(0.5,) * 3, image_std=(0.5,) * 3)  # fmt: skip
TINY = M.VisionConfig(tiling="anyres", tile_size=56, anyres_grid=3, anyres_max=4, patch_size=14, merge_size=1,
                      temporal_patch_size=1, image_mean=(0.5,) * 3, image_std=(0.5,) * 3)  # fmt: skip


def tiny_data() -> dict:
    from omniweave.config import load_recipe, to_dict

    data = to_dict(load_recipe("tiny_llava_onevision").data)
    return {k: v for k, v in data.items() if k in ("tokenizer", "template", "rope", "vision", "max_len", "truncation")}


def hf_processor(v: M.VisionConfig, tokenizer: str | None = None):
    """LlavaOnevisionProcessor as an -ov-hf checkpoint's, at ``v``'s tile, pinpoints and anyres_max, on the
    demo tokenizer, with the released chat template."""
    from transformers import AutoTokenizer
    from transformers.models.llava_onevision.image_processing_pil_llava_onevision import (
        LlavaOnevisionImageProcessorPil,
    )
    from transformers.models.llava_onevision.processing_llava_onevision import LlavaOnevisionProcessor
    from transformers.models.llava_onevision.video_processing_llava_onevision import LlavaOnevisionVideoProcessor

    from omniweave.data.text.tokenizer import DEMO_TOKENIZER_DIR

    size = {"height": v.tile_size, "width": v.tile_size}
    norm = {"image_mean": list(v.image_mean), "image_std": list(v.image_std)}
    images = LlavaOnevisionImageProcessorPil(size=size, image_grid_pinpoints=[list(p) for p in square_pinpoints(
        v.tile_size, v.anyres_grid)], **norm)  # fmt: skip
    return LlavaOnevisionProcessor(
        image_processor=images, tokenizer=AutoTokenizer.from_pretrained(tokenizer or str(DEMO_TOKENIZER_DIR)),
        video_processor=LlavaOnevisionVideoProcessor(size=size, **norm),
        num_image_tokens=(v.tile_size // v.patch_size) ** 2, vision_feature_select_strategy="full",
        chat_template=open(TEMPLATE).read(), vision_aspect_ratio=f"anyres_max_{v.anyres_max}")  # fmt: skip


def hf_image_tokens(proc, sizes: list[tuple[int, int]], tile: int) -> list[int]:
    """``LlavaOnevisionProcessor.replace_image_token`` for one conversation holding images of ``sizes``
    (``batch_num_images == [len(sizes)]``, as ``apply_chat_template`` passes them): tokens per image."""
    inputs = {"batch_num_images": [len(sizes)], "image_sizes": [list(s) for s in sizes],
              "pixel_values": [[np.zeros((3, tile, tile), np.float32)]]}  # fmt: skip
    return [proc.replace_image_token(inputs, i).count(proc.image_token) for i in range(len(sizes))]


def random_sizes(n: int, seed: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    sides = np.exp(rng.uniform(0, np.log(5000), size=(n, 2))).astype(int) + 1
    return [(1, 1), (1, 3000), (3000, 1), (384, 384), (2304, 384)] + [(int(h), int(w)) for h, w in sides]


# ---------------------------------------------------------------------------- header-only plans


@pytest.mark.parametrize("v", [RELEASED, TINY], ids=["released", "tiny"])
def test_token_counts_and_grids_from_headers_equal_the_processor(v):
    """200 random sizes: one image in the conversation (anyres: base + grid tiles, the processor's
    feature count) and the same sizes in twos (one tile each, s² + 1); resized_hw is the image's own size."""
    from transformers.models.llava_onevision.modeling_llava_onevision import image_size_to_num_patches

    proc = hf_processor(v)
    pins, side = [list(p) for p in square_pinpoints(v.tile_size, v.anyres_grid)], v.tile_size // v.patch_size
    sizes = random_sizes(200, seed=v.tile_size)
    for h, w in sizes:
        plan = M.plan_image(M.ImageInfo(h, w), v)
        assert plan.num_tokens(1) == hf_image_tokens(proc, [(h, w)], v.tile_size)[0], (h, w)
        assert plan.grid_thw == (image_size_to_num_patches((h, w), pins, v.tile_size), side, side)
        assert plan.resized_hw == (h, w) and plan.grid_thw[0] > 1
    for a, b in zip(sizes[::2], sizes[1::2]):
        plans = [M.plan_image(M.ImageInfo(*s), v, images=2) for s in (a, b)]
        assert [p.num_tokens(1) for p in plans] == hf_image_tokens(proc, [a, b], v.tile_size) == [side**2 + 1] * 2
        assert [p.grid_thw for p in plans] == [(1, side, side)] * 2 and [p.resized_hw for p in plans] == [a, b]


def test_video_frames_equal_sample_frames_where_its_count_is_within_the_limits():
    """``BaseVideoProcessor.sample_frames`` with ``fps`` (``int(N / fps_src · fps)`` frames at ``arange(n)·N//n``)
    and with ``num_frames`` (our min_frames = max_frames = K) on 60 (frames, fps) cases; outside the limits we
    clamp (transformers raises past N)."""
    from transformers.models.llava_onevision.video_processing_llava_onevision import LlavaOnevisionVideoProcessor
    from transformers.video_utils import VideoMetadata

    hf = LlavaOnevisionVideoProcessor()
    rng = np.random.default_rng(0)
    within, side = 0, 27
    for n_src, fps_src in [(int(n), float(f)) for n, f in zip(rng.integers(1, 400, 60), rng.choice([2, 6, 23.976, 30], 60))]:
        meta = VideoMetadata(total_num_frames=n_src, fps=fps_src, width=64, height=48)
        for fps, lo, hi in ((2.0, 4, 32), (0.5, 1, 768)):
            v = M.VisionConfig(**{**RELEASED.__dict__, "fps": fps, "min_frames": lo, "max_frames": hi})
            plan = M.plan_video(M.VideoInfo(n_src, fps_src, 48, 64), v)
            n = len(plan.frame_indices)
            assert plan.grid_thw == (n, side, side) and plan.resized_hw == (384, 384)
            assert plan.num_tokens(1) == n * 14 * 14 + 1  # ceil(27 / 2)² per frame + one newline
            wanted = max(1, int(n_src / fps_src * fps))
            if lo <= wanted <= min(hi, n_src):
                within += 1
                assert list(plan.frame_indices) == hf.sample_frames(meta, fps=fps).tolist(), (n_src, fps_src, fps)
            assert list(plan.frame_indices) == hf.sample_frames(meta, num_frames=n).tolist()  # its num_frames=K
    assert within > 40


# ---------------------------------------------------------------------------- pixels


@pytest.mark.parametrize("h,w,mode", [(300, 500, "RGB"), (37, 1100, "RGB"), (900, 120, "L"), (384, 384, "RGB"),
                                      (61, 97, "RGBA")])
def test_pixels_equal_the_image_processor(h, w, mode):
    """Decoded tiles of the single-image path and of the multi-image path (a pair with itself) equal
    LlavaOnevisionImageProcessorPil's, max |Δ| 0; the header plan equals the decoded one."""
    proc = hf_processor(RELEASED)
    data = png_bytes(h, w, mode=mode, seed=h)
    img = Image.open(io.BytesIO(data))
    for images, batch in ((1, [img]), (2, [[img, img]])):
        plan = M.plan_image(M.probe_image(data), RELEASED, images)
        ours, got = M.process_image(data, RELEASED, plan=plan)
        assert got == plan
        theirs = proc.image_processor(batch, return_tensors="np")["pixel_values"][0][:plan.grid_thw[0]]
        assert np.abs(ours - tiles_to_patches(theirs.astype(np.float32), 14)).max() == 0.0


# ---------------------------------------------------------------------------- whole conversations


def _hf_ids_and_pixels(proc, msgs, media: dict, tmp_path, fps: float):
    """What LlavaOnevisionProcessor makes of the conversation: the released template's text, the
    conversation's images as one nested list (apply_chat_template's batch_num_images), the videos read
    with PyAV and sampled at ``fps`` by the video processor."""
    from transformers.utils.chat_template_utils import render_jinja_template
    from transformers.video_utils import load_video

    text = render_jinja_template([to_hf_messages(msgs)], chat_template=proc.chat_template)[0][0]
    kw = {}
    images = [Image.open(io.BytesIO(b)) for k, b in media.items() if k.endswith(".png")]
    if images:
        kw["images"] = [images]
    videos = [k for k in media if k.endswith(".mp4")]
    if videos:
        loaded = []
        for k in videos:
            (tmp_path / k).write_bytes(media[k])
            loaded.append(load_video(str(tmp_path / k), backend="pyav",
                                     sample_indices_fn=lambda metadata, **_: np.arange(metadata.total_num_frames)))
        kw["videos"] = [f for f, _ in loaded]
        kw["videos_kwargs"] = {"video_metadata": [m for _, m in loaded], "do_sample_frames": True, "fps": fps}
    return proc(text=[text], return_tensors="np", **kw)


CONVERSATIONS = {
    "one_image": ([Message("user", "<image>What is it?"), Message("assistant", "A cat.")], [(60, 300)], []),
    "two_images": ([Message("user", "<image>Compare it with <image>"), Message("assistant", "Same.")],
                   [(60, 300), (130, 41)], []),
    "video": ([Message("user", "<video>What happens?"), Message("assistant", "Noise.")], [], [(21, 7.0, 90, 64)]),
    "image_and_video": ([Message("user", "Look: <video> and <image>"), Message("assistant", "Both red."),
                         Message("user", "Sure?"), Message("assistant", "Yes.")], [(200, 75)], [(13, 6.0, 48, 80)]),
}


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_sample_processor_equals_llava_onevision_processor(name, tmp_path):
    """The tiny recipe's SampleProcessor on a conversation == the released template rendered by
    transformers + LlavaOnevisionProcessor: input ids (every <image> / <video> expanded), each item's
    pixels (max |Δ| 0; videos through LlavaOnevisionVideoProcessor's torchvision resize), and the
    image_sizes it hands the model."""
    msgs, image_sizes, videos = CONVERSATIONS[name]
    media = {f"i{k}.png": png_bytes(h, w, seed=k) for k, (h, w) in enumerate(image_sizes)}
    media.update({f"v{k}.mp4": video_bytes(n, fps=f, height=h, width=w, seed=k) for k, (n, f, h, w) in enumerate(videos)})
    conv = Conversation("c", msgs, images=[k for k in media if k.endswith(".png")],
                        videos=[k for k in media if k.endswith(".mp4")])  # fmt: skip
    ours = SampleProcessor(tiny_data())
    sample = ours.tokenize(RawSample("c", conv, media))
    hf = _hf_ids_and_pixels(hf_processor(ours.vision), msgs, media, tmp_path, ours.vision.fps)
    assert hf["input_ids"][0].tolist() == sample.input_ids.tolist()
    images = [s for s in sample.media if s.kind == "image"]
    for k, span in enumerate(images):
        assert tuple(span.resized_hw) == tuple(hf["image_sizes"][k].tolist()) == image_sizes[k]
        theirs = tiles_to_patches(hf["pixel_values"][k][:span.grid_thw[0]].astype(np.float32), 14)
        assert np.abs(ours.process_media(span, media[span.part]) - theirs).max() == 0.0
    for k, span in enumerate(s for s in sample.media if s.kind == "video"):
        theirs = tiles_to_patches(np.asarray(hf["pixel_values_videos"][k], np.float32), 14)
        assert span.grid_thw[0] == theirs.shape[0] // 16
        assert np.abs(ours.process_media(span, media[span.part]) - theirs).max() == 0.0
    if name == "two_images":
        assert [s.grid_thw for s in images] == [(1, 4, 4)] * 2 and [s.length for s in images] == [17, 17]


def test_truncation_replans_the_kept_images_for_their_count(tmp_path):
    """Two turns with an image each: both one tile (the multi-image path). When drop_turns keeps the
    first turn only, its image is the conversation's one image and is planned anyres -- what
    LlavaOnevisionProcessor does with the kept text (it decides from the images it is given)."""
    msgs = [Message("user", "<image>First?"), Message("assistant", "One."), Message("user", "<image>Second?"),
            Message("assistant", "Two " * 40)]  # fmt: skip
    media = {"a.png": png_bytes(150, 170, seed=1), "b.png": png_bytes(80, 40, seed=2)}
    raw = RawSample("c", Conversation("c", msgs, images=["a.png", "b.png"]), media)
    whole = SampleProcessor(tiny_data()).tokenize(raw)
    assert [s.grid_thw for s in whole.media] == [(1, 4, 4)] * 2
    ours = SampleProcessor({**tiny_data(), "max_len": len(whole) - 10})
    cut = ours.tokenize(raw)
    assert cut.truncated and len(cut.media) == 1 and cut.media[0].grid_thw[0] > 1  # anyres: base + grid
    hf = _hf_ids_and_pixels(hf_processor(ours.vision), msgs[:2], {"a.png": media["a.png"]}, tmp_path, 2.0)
    assert hf["input_ids"][0].tolist() == cut.input_ids.tolist()
    theirs = tiles_to_patches(hf["pixel_values"][0].astype(np.float32), 14)
    assert np.abs(ours.process_media(cut.media[0], media["a.png"]) - theirs).max() == 0.0


# ---------------------------------------------------------------------------- pack, collate, train


def test_tiny_recipe_packs_collates_and_trains_through_every_part(tmp_path):
    """``data pack --recipe tiny_llava_onevision`` on single- and multi-image samples and videos (nothing
    dropped); a collated row holds image_sizes (each image's own size, (0, 0) for a video), pads of
    <image> / <video> exactly where its spans are; the model's projector counts the spans' tokens; forward
    + backward reach the tower, the projector (image_newline too) and the decoder."""
    from omniweave.models.registry import build_model
    from tests.train_factory import pack_fakes

    cfg, batches, stats = pack_fakes(tmp_path, "tiny_llava_onevision", n_text=2, n_image=4, n_video=2)
    assert stats["dropped"] == {}
    grids = torch.cat([b["grid_thw"] for b in batches])
    sizes = torch.cat([b["image_sizes"] for b in batches])
    videos = (sizes == 0).all(1)
    assert int(videos.sum()) == 2 and (grids[videos, 0] == 4).all()  # 8 frames at 4 fps sampled at 2 fps
    assert (grids[~videos, 0] == 1).any() and (grids[~videos, 0] > 1).any()  # multi- and single-image samples
    torch.manual_seed(0)
    model = build_model(cfg.model)
    for b in batches:
        ids = b["input_ids"]
        want = model.projector.num_tokens(b["grid_thw"], b["image_sizes"])
        assert b["media_spans"][:, 1].tolist() == want.tolist()
        for (start, n), (h, w) in zip(b["media_spans"].tolist(), b["image_sizes"].tolist()):
            assert (ids[start:start + n] == (702 if h == w == 0 else 703)).all()
        assert int(torch.isin(ids, torch.tensor([702, 703])).sum()) == int(want.sum())
    batch = max(batches, key=lambda b: int(b["grid_thw"].shape[0]))
    out = model(batch)
    out.loss_sum.backward()
    assert torch.isfinite(out.loss_sum) and int(out.num_tokens) > 0
    for part in ("image_encoder.patch_embed.weight", "image_encoder.position_embedding.weight", "image_encoder.blocks.1.mlp.fc2.weight",
                 "projector.linear_1.weight", "projector.image_newline", "foundation.layers.0.self_attn.q_proj.weight",
                 "foundation.embed_tokens.weight"):  # fmt: skip
        assert model.get_parameter(part).grad.abs().sum() > 0, part


def test_tiny_recipe_trains_on_the_demo_data(tmp_path):
    """The trainer on the demo's images and videos packed with tiny_llava_onevision: 4 steps, the loss falls."""
    from tests.train_factory import losses, make_demo_packed, train_in_process

    packed = make_demo_packed(tmp_path / "data", samples=24, recipe="tiny_llava_onevision")
    stats = json.loads((packed / "stats.json").read_text())
    assert stats["dropped"] == {}, stats["dropped"]
    train_in_process(packed, tmp_path / "run", name="tiny_llava_onevision", steps=4, global_batch=2, train__lr=3e-3)
    got = losses(tmp_path / "run")
    assert len(got) == 4 and got[-1] < got[0], got


def test_llava_onevision_qwen2_7b_recipe_builds_on_meta_with_the_published_size():
    """SigLIP-so400m (26 blocks) + projector + Qwen2-7B on meta: 8.0303B, the card's 8.03B; the projector's
    tiling is the data's (interpolated)."""
    from omniweave.config import load_recipe, to_dict
    from omniweave.models.registry import build_model

    cfg = load_recipe("llava_onevision_qwen2_7b")
    with torch.device("meta"):
        model = build_model(cfg.model)
    assert abs(sum(p.numel() for p in model.parameters()) - 8.0303e9) < 1e5
    proj = to_dict(cfg.model)["projector"]
    assert (proj["image_size"], proj["anyres_grid"], proj["anyres_max"]) == (384, 6, 9)
    tiny = to_dict(load_recipe("tiny_llava_onevision", ["data.vision.anyres_grid=2"]).model)
    assert tiny["projector"]["anyres_grid"] == 2 and tiny["image_encoder"]["image_size"] == 56


# ---------------------------------------------------------------------------- bad input


def test_bad_config_and_bad_images_are_clear():
    """anyres_grid 0 (or a merge) is a config error naming the key; an image with a zero side is a
    counted reject (empty_media), undecodable bytes too (bad_image); the fingerprint of untiled and
    InternVL packs does not carry the anyres keys."""
    from omniweave.config import RecipeError, load_recipe  # noqa: F401

    for bad, key in (({"anyres_grid": 0}, "anyres_grid"), ({"anyres_max": 0}, "anyres_max"),
                     ({"merge_size": 2}, "merge_size"), ({"tile_size": 10}, "tile_size")):  # fmt: skip
        with pytest.raises(ValueError, match=f"vision {key}"):
            SampleProcessor({**tiny_data(), "vision": {**tiny_data()["vision"], **bad}})
    with pytest.raises(M.MediaError, match="empty_media"):
        M.plan_image(M.ImageInfo(0, 50), TINY)
    ours = SampleProcessor(tiny_data())
    conv = Conversation("c", [Message("user", "<image>hi"), Message("assistant", "yo")], images=["a.png"])
    with pytest.raises(SampleRejected) as e:
        ours.tokenize(RawSample("c", conv, {"a.png": b"not an image"}))
    assert e.value.reason == "bad_image"
    real_probe = M.probe_image
    try:
        M.probe_image = lambda data: M.ImageInfo(height=0, width=30)
        with pytest.raises(SampleRejected) as e:
            ours.tokenize(RawSample("c", conv, {"a.png": png_bytes(4, 4)}))
    finally:
        M.probe_image = real_probe
    assert e.value.reason == "empty_media"
    assert not {"anyres_grid", "anyres_max"} & set(M.VisionConfig().spec())
    assert not {"anyres_grid", "anyres_max"} & set(M.VisionConfig(tiling="internvl", merge_size=2, temporal_patch_size=1).spec())
    assert ours.fingerprint()["vision"]["anyres_grid"] == 3 and anyres_config(ours.vision).max_tiles == 4
    assert re.fullmatch(r"\d+", str(ours.fingerprint()["vision"]["anyres_max"]))
