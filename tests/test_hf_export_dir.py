"""An export made with the recipe's ``data:`` section is a whole Hugging Face model directory:
transformers' Auto classes load it as it is, and its processor gives the token ids, grids and
pixels our data pipeline gives for the same conversation (so the model sees what it trained on).

transformers' Qwen2-VL processors cannot be built without torchvision (their video processor is
torchvision-only, and ``AutoProcessor`` and the processor class itself insist on one), which
omniweave does not depend on. So the first tests load the parts that need no torchvision —
AutoTokenizer (chat template), AutoImageProcessor (PIL backend), AutoModelForImageTextToText —
and do the processor's one step themselves (each ``<|image_pad|>`` repeated grid/merge² times);
``test_auto_processor_loads_the_export`` runs the real ``AutoProcessor`` where torchvision is
installed and is skipped otherwise.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from data_factory import png_bytes, video_bytes
from PIL import Image
from vl_factory import hf_class, save_tiny

from omniweave.data.media.vision import VisionConfig, video_settings_from_hf, vision_settings_from_hf
from omniweave.data.sample import Conversation, Message, RawSample
from omniweave.data.text.tokenize import SampleProcessor
from omniweave.models.hf import verify
from omniweave.models.hf.export import export_hf
from omniweave.models.hf.loading import load_hf
from omniweave.models.hf.processor_files import PROCESSOR_CLASSES

DEMO_RECIPE = Path(__file__).resolve().parents[1] / "omniweave" / "configs" / "recipes" / "demo.yaml"
ROPE = {"qwen2_5_vl": "mrope_qwen25", "qwen2_vl": "mrope"}
PROMPT = "Describe the picture."


@pytest.fixture(scope="module", params=sorted(ROPE))
def exported(request, tmp_path_factory):
    """(family, export dir, our model, data cfg): a tiny model exported with the demo's data section."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    ours, cfg = load_hf(save_tiny(family, root / "src"))
    data = {**yaml.safe_load(DEMO_RECIPE.read_text())["data"], "rope": ROPE[family]}
    return family, export_hf(ours, cfg, root / "hf", data_cfg=data), ours.eval(), data


def _ours(data: dict, image: bytes, video: bytes | None = None):
    """(SampleProcessor, RawSample, prompt sample): one user turn, image first, ready to generate."""
    conv = Conversation("x", [Message("user", "<image>" + PROMPT + ("<video>" if video else ""))],
                        images=["a.png"], videos=["v.mp4"] if video else [])  # fmt: skip
    raw = RawSample("x", conv, {"a.png": image} | ({"v.mp4": video} if video else {}))
    proc = SampleProcessor(data)
    return proc, raw, proc.tokenize_prompt(raw)


def _hf_messages(video: bool = False) -> list[dict]:
    parts = [{"type": "image"}, {"type": "text", "text": PROMPT}] + ([{"type": "video"}] if video else [])
    return [{"role": "user", "content": parts}]


def test_export_holds_config_weights_tokenizer_template_and_processor_configs(exported):
    family, out, _, data = exported
    assert sorted(p.name for p in out.iterdir()) == [
        "chat_template.jinja", "config.json", "model.safetensors", "preprocessor_config.json",
        "processor_config.json", "tokenizer.json", "tokenizer_config.json", "video_preprocessor_config.json"]  # fmt: skip
    assert json.loads((out / "processor_config.json").read_text()) == {"processor_class": PROCESSOR_CLASSES[family]}
    # the processor configs carry the recipe's data.vision back whole (not transformers' defaults)
    vision = VisionConfig.from_mapping(data["vision"])
    settings = vision_settings_from_hf(out) | video_settings_from_hf(out)
    assert VisionConfig.from_mapping(settings) == vision
    assert (vision.min_pixels, vision.max_pixels, vision.video_max_pixels, vision.max_frames) == (3136, 12544, 3136, 4)


def test_transformers_loads_the_export_and_matches_our_pipeline(exported):
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    family, out, ours, data = exported
    image = png_bytes(100, 70, seed=3)  # resized to 112 x 56 under the demo's pixel limits
    proc, raw, sample = _ours(data, image)
    tokenizer = AutoTokenizer.from_pretrained(out)
    image_processor = AutoImageProcessor.from_pretrained(out, backend="pil")  # the default where torchvision is absent
    hf_img = image_processor(images=[Image.open(io.BytesIO(image))], return_tensors="pt")
    text = tokenizer.apply_chat_template(_hf_messages(), tokenize=False, add_generation_prompt=True)
    # Qwen2VLProcessor's step: each image's pad token once per merged patch
    n_tokens = int(hf_img["image_grid_thw"][0].prod()) // proc.vision.merge_size**2
    ids = tokenizer(text.replace("<|image_pad|>", "<|image_pad|>" * n_tokens), return_tensors="pt").input_ids
    assert ids[0].tolist() == sample.input_ids.tolist()
    assert hf_img["image_grid_thw"].tolist() == [list(sample.media[0].grid_thw)] == [[1, 8, 4]]
    ours_pv = torch.from_numpy(proc.process_media(sample.media[0], image))
    assert torch.equal(torch.as_tensor(np.asarray(hf_img["pixel_values"])), ours_pv)

    model = AutoModelForImageTextToText.from_pretrained(out, attn_implementation="eager").eval()
    assert type(model) is hf_class(family) and model.dtype == torch.float32
    tt = (ids == proc.image_pad_id).long()
    batch = {"input_ids": ids[0], "position_ids": torch.from_numpy(sample.position_ids.astype(np.int64)),
             "pixel_values": ours_pv, "grid_thw": hf_img["image_grid_thw"],
             "media_spans": torch.tensor([[sample.media[0].start, sample.media[0].length]]),
             "cu_seqlens": torch.tensor([0, ids.shape[1]], dtype=torch.int32)}  # fmt: skip
    with torch.no_grad():
        ref = model(input_ids=ids, pixel_values=torch.as_tensor(np.asarray(hf_img["pixel_values"])),
                    image_grid_thw=hf_img["image_grid_thw"], mm_token_type_ids=tt).logits[0]  # fmt: skip
        got = ours.logits(batch)
    diff = (ref - got).abs().max().item()
    print(f"{family}: logits max |Δ| {diff:.1e} (transformers on its own processor's inputs vs omniweave)")
    assert diff <= 1e-4


def test_hf_verify_compares_images_with_transformers_processor(exported, capsys):
    _, out, _, _ = exported
    parser = argparse.ArgumentParser()
    verify.add_arguments(parser)
    assert verify.run(parser.parse_args([str(out)])) == 0
    report = capsys.readouterr().out
    assert "pixel_values  max|Δ| = 0.000e+00  images: omniweave.data.media.vision vs Qwen2VLImageProcessorPil" in report
    assert "HF renders the directory's chat template" in report and "images: no preprocessor_config" not in report


def test_text_model_export_renders_its_recipe_template(tmp_path):
    from transformers import AutoTokenizer

    from omniweave.data.text.template import load_template, render
    from tests.hf_factory import save_tiny as save_tiny_text

    save_tiny_text("qwen2", tmp_path / "src")
    ours, cfg = load_hf(tmp_path / "src")
    out = export_hf(ours, cfg, tmp_path / "hf", data_cfg={"tokenizer": "demo", "template": "llama3"})
    assert not (out / "preprocessor_config.json").exists()
    messages = [Message("system", "Be brief."), Message("user", "Hi"), Message("assistant", "Hello")]
    hf = AutoTokenizer.from_pretrained(out).apply_chat_template(
        [{"role": m.role, "content": m.content} for m in messages], tokenize=False, add_generation_prompt=True)  # fmt: skip
    assert hf == render(load_template("llama3"), messages, add_generation_prompt=True).text


def test_auto_processor_loads_the_export(exported, tmp_path):
    """The real AutoProcessor (needs torchvision): ids and grids equal ours for an image and a
    video; image pixels equal ours with the PIL backend (the torchvision one resizes differently);
    video pixels equal ours. The recipe keeps qwen-vl-utils' frame placement, so the export's
    video processor does not sample (``do_sample_frames: false``) and is given our frames, as
    qwen-vl-utils gives them; tests/test_video_parity.py covers the processor sampling itself."""
    pytest.importorskip("torchvision")
    from transformers import AutoImageProcessor, AutoProcessor
    from transformers.video_utils import load_video

    family, out, _, data = exported
    image, video = png_bytes(100, 70, seed=3), video_bytes(9, fps=4.0, height=64, width=96)
    proc, raw, sample = _ours(data, image, video)
    processor = AutoProcessor.from_pretrained(out)
    assert type(processor).__name__ == PROCESSOR_CLASSES[family]
    (tmp_path / "v.mp4").write_bytes(video)
    frames, metadata = load_video(str(tmp_path / "v.mp4"), backend="pyav")  # torchcodec is not installed either
    picked = list(dict.fromkeys(sample.media[1].frame_indices))
    assert processor.video_processor.do_sample_frames is False
    frames, metadata.frames_indices = frames[picked], picked  # what qwen-vl-utils hands the processor
    text = processor.apply_chat_template(_hf_messages(video=True), tokenize=False, add_generation_prompt=True)
    pil = Image.open(io.BytesIO(image))
    hf = processor(text=text, images=[pil], videos=[frames], video_metadata=[metadata], return_tensors="pt")
    assert hf["input_ids"][0].tolist() == sample.input_ids.tolist()
    assert hf["image_grid_thw"].tolist() == [list(sample.media[0].grid_thw)]
    assert hf["video_grid_thw"].tolist() == [list(sample.media[1].grid_thw)]
    if family == "qwen2_5_vl":
        assert hf["second_per_grid_ts"].tolist() == [sample.media[1].second_per_grid]
    ours_pv = torch.from_numpy(proc.process_media(sample.media[0], image))
    assert (hf["pixel_values"] - ours_pv).abs().max().item() < 0.05  # torchvision bicubic vs PIL bicubic
    assert (hf["pixel_values_videos"] - torch.from_numpy(proc.process_media(sample.media[1], video))).abs().max().item() == 0.0
    processor.image_processor = AutoImageProcessor.from_pretrained(out, backend="pil")
    assert torch.equal(processor(text=text, images=[pil], videos=[frames], video_metadata=[metadata],
                                 return_tensors="pt")["pixel_values"], ours_pv)  # fmt: skip
