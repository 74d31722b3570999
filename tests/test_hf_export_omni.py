"""An export of the Qwen2.5-Omni thinker made with its recipe's ``data:`` section is a directory
``Qwen2_5OmniProcessor`` loads: one ``preprocessor_config.json`` read both as the image processor
and as the ``WhisperFeatureExtractor``, ``video_preprocessor_config.json``, ``processor_config.json``
and a tokenizer naming the template's media tokens (``image_token`` = ``<|IMAGE|>`` …). Its parts
give the token ids, pixels and log-mel our data pipeline gives for the same conversation, and the
exported model's logits on transformers' own inputs equal ours.

As in test_hf_export_dir.py: the processor needs torchvision (its video processor), which
omniweave does not depend on, so the first test loads the parts that need none — AutoTokenizer
(chat template), AutoFeatureExtractor, AutoImageProcessor (PIL backend) — and does the processor's
one step itself (each pad repeated once per token); ``test_auto_processor_loads_the_export`` runs
the real ``AutoProcessor`` (a video with its own sound track, ``load_audio_from_video``) where
torchvision is installed and is skipped otherwise. transformers decodes audio files only through
torchcodec / librosa (not installed), so both sides are given our decoded samples (16 kHz mono,
``data/audio.load_audio``, checked against transformers' own decoding elsewhere in test_audio.py).
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from audio_factory import encode, signal, video_with_audio_bytes
from data_factory import png_bytes
from PIL import Image

from omniweave.data.media.audio import load_audio
from omniweave.data.loading.loader import media_batch
from omniweave.data.media.vision import VisionConfig, video_settings_from_hf, vision_settings_from_hf
from omniweave.data.sample import Conversation, Message, RawSample
from omniweave.data.text.tokenize import SampleProcessor

PROMPT = "What do you see and hear?"
MEDIA_TOKENS = {"image_token": "<|IMAGE|>", "video_token": "<|VIDEO|>", "audio_token": "<|AUDIO|>",
                "vision_bos_token": "<|vision_bos|>", "vision_eos_token": "<|vision_eos|>",
                "audio_bos_token": "<|audio_bos|>", "audio_eos_token": "<|audio_eos|>"}  # fmt: skip
IMAGE = png_bytes(100, 70, seed=3)  # 112 x 56 under the recipe's pixel limits: grid [1, 8, 4]
CLIP = encode(signal(2.5, 22050, 2, seed=4), 22050, "wav")  # resampled and mixed down: 250 frames, 62 tokens


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """(export dir, our model, the recipe's data section): omniweave/configs/recipes/tiny_qwen2_5_omni.yaml
    built at random and exported with its data section."""
    from omniweave.config import load_recipe, to_dict
    from omniweave.models.hf.export import export_hf
    from omniweave.models.registry import build_model

    cfg = to_dict(load_recipe("tiny_qwen2_5_omni"))
    torch.manual_seed(0)
    model = build_model(cfg["model"]).eval()
    return export_hf(model, cfg["model"], tmp_path_factory.mktemp("omni") / "hf", data_cfg=cfg["data"]), model, cfg["data"]


def _ours(data: dict, media: dict[str, bytes], content: str):
    """(SampleProcessor, RawSample, prompt sample) of one user turn, ready to generate."""
    kinds = {k: [name for name in media if name.startswith(k)] for k in ("image", "video", "audio")}
    raw = RawSample("x", Conversation("x", [Message("user", content)], images=kinds["image"], videos=kinds["video"],
                                      audios=kinds["audio"]), media)  # fmt: skip
    proc = SampleProcessor(data)
    return proc, raw, proc.tokenize_prompt(raw)


def test_export_holds_the_omni_processor_files(exported):
    out, _, data = exported
    assert sorted(p.name for p in out.iterdir()) == [
        "chat_template.jinja", "config.json", "model.safetensors", "preprocessor_config.json",
        "processor_config.json", "tokenizer.json", "tokenizer_config.json", "video_preprocessor_config.json"]  # fmt: skip
    assert json.loads((out / "processor_config.json").read_text()) == {"processor_class": "Qwen2_5OmniProcessor"}
    pre = json.loads((out / "preprocessor_config.json").read_text())
    assert pre["image_processor_type"] == "Qwen2VLImageProcessor" and pre["feature_extractor_type"] == "WhisperFeatureExtractor"
    assert (pre["feature_size"], pre["sampling_rate"], pre["n_fft"], pre["hop_length"]) == (128, 16000, 400, 160)
    settings = vision_settings_from_hf(out) | video_settings_from_hf(out)  # data.vision comes back whole
    assert VisionConfig.from_mapping(settings) == VisionConfig.from_mapping(data["vision"])
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert {k: tok_cfg[k] for k in MEDIA_TOKENS} == MEDIA_TOKENS


def test_tokenizer_feature_extractor_and_image_processor_match_our_pipeline(exported):
    """No torchvision needed: ids (chat template + the processor's pad expansion, counts from
    transformers' image grid and feature mask) equal ours, pixels equal ours exactly, log-mel
    within 1e-4 (measured ~1e-7), and the exported thinker on transformers' inputs gives our
    logits within 1e-4 (measured ~5e-7)."""
    from transformers import (AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer,
                              Qwen2_5OmniThinkerForConditionalGeneration)
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import _get_feat_extract_output_lengths

    out, model, data = exported
    proc, raw, sample = _ours(data, {"image.png": IMAGE, "audio.wav": CLIP}, "<image><audio>" + PROMPT)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert {k: getattr(tokenizer, k) for k in MEDIA_TOKENS} == MEDIA_TOKENS  # what Qwen2_5OmniProcessor reads
    config = json.loads((out / "config.json").read_text())
    assert (tokenizer.image_token_id, tokenizer.audio_token_id) == (config["image_token_index"], config["audio_token_index"])

    image_processor = AutoImageProcessor.from_pretrained(out, backend="pil")
    hf_img = image_processor(images=[Image.open(io.BytesIO(IMAGE))], return_tensors="pt")
    extractor = AutoFeatureExtractor.from_pretrained(out)
    # as Qwen2_5OmniProcessor._process_audio calls it (padding="max_length", its audio_kwargs)
    hf_audio = extractor([load_audio(CLIP)], sampling_rate=16000, padding="max_length", return_attention_mask=True,
                         return_tensors="pt")  # fmt: skip
    n_image = int(hf_img["image_grid_thw"][0].prod()) // image_processor.merge_size**2
    n_audio = int(_get_feat_extract_output_lengths(hf_audio["attention_mask"].sum(-1))[0])
    assert [s.length for s in sample.media] == [n_image, n_audio] == [8, 62]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "audio"}, {"type": "text", "text": PROMPT}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    text = text.replace(tokenizer.image_token, tokenizer.image_token * n_image)
    text = text.replace(tokenizer.audio_token, tokenizer.audio_token * n_audio)
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == sample.input_ids.tolist()

    ours = media_batch(proc, [(s, raw.media[s.part]) for s in sample.media])
    assert torch.equal(torch.as_tensor(np.asarray(hf_img["pixel_values"])), ours["pixel_values"])
    assert torch.equal(hf_audio["attention_mask"].sum(-1), ours["audio_lengths"])
    mel_diff = (hf_audio["input_features"] - ours["audio_features"]).abs().max().item()
    assert mel_diff <= 1e-4

    hf = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(out, attn_implementation="eager").eval()
    batch = {"input_ids": ids[0], "position_ids": torch.from_numpy(sample.position_ids.astype(np.int64)),
             "cu_seqlens": torch.tensor([0, ids.shape[1]], dtype=torch.int32), **ours}  # fmt: skip
    with torch.no_grad():  # transformers computes its own TMRoPE positions from the attention mask
        ref = hf(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=hf_img["pixel_values"],
                 image_grid_thw=hf_img["image_grid_thw"], input_features=hf_audio["input_features"],
                 feature_attention_mask=hf_audio["attention_mask"]).logits[0]  # fmt: skip
        got = model.logits(batch)
    diff = (ref - got).abs().max().item()
    print(f"omni export: log-mel max |Δ| {mel_diff:.1e}, logits max |Δ| {diff:.1e}")
    assert diff <= 1e-4


def test_hf_verify_passes_on_the_export_with_a_video_and_its_sound(exported, tmp_path, capsys):
    """``omniweave hf verify EXPORT --use-audio-in-video``: the export's own tokenizer and its chat
    template (``--template auto``: the recipe's qwen2_5_omni as exported) give the ids its config
    names; every stage agrees. With another template the token ids disagree: exit 2, saying so."""
    from omniweave.cli import main

    out, _, _ = exported
    (tmp_path / "v.mp4").write_bytes(video_with_audio_bytes(12, 4.0, 3.0, height=56, width=84, seed=1))
    (tmp_path / "a.wav").write_bytes(CLIP)
    args = ["--use-audio-in-video", "--video", str(tmp_path / "v.mp4"), "--audio", str(tmp_path / "a.wav")]
    assert main(["hf", "verify", str(out), *args]) == 0
    report = capsys.readouterr().out
    assert "per clip [62, 75] planned from headers (HF [62, 75])" in report and "OK: all differences" in report, report
    assert main(["hf", "verify", str(out), "--template", "chatml", *args]) == 2
    assert "config image_token_index=697 but the tokenizer's id is 5" in capsys.readouterr().err


def _our_frames(frames, metadata, frame_indices):
    """The frames we sampled (qwen-vl-utils' placement, the recipe's default), handed to the
    processor as qwen-vl-utils hands them: the export's video processor does not sample itself
    (``do_sample_frames: false``)."""
    picked = list(dict.fromkeys(frame_indices))
    metadata.frames_indices = picked
    return frames[picked]


def test_auto_processor_loads_the_export(exported, tmp_path):
    """The real AutoProcessor (needs torchvision): a Qwen2_5OmniProcessor whose ids equal ours for
    an image, a clip and a video with its own sound track (``load_audio_from_video``, the track
    given decoded, as an audio slot of that video); grids and audio frame counts equal ours.

    The video is 224 x 448 (100,352 pixels, multiples of 28): a frame size both our resize rules
    and transformers' leave as it is, since Qwen2_5OmniProcessor passes its own class default
    ``size`` (128·28² to 768·28² pixels) to the video processor over the exported config's. A
    480 x 640 video gets our grid when the caller passes the exported ``size`` (what docs/audio.md
    tells users to do; without it transformers' class default gives [3, 22, 30])."""
    pytest.importorskip("torchvision")
    from transformers import AutoProcessor
    from transformers.video_utils import load_video

    out, _, data = exported
    video = video_with_audio_bytes(12, 4.0, 3.0, height=224, width=448, seed=1)
    data = {**data, "audio": {**data["audio"], "use_audio_in_video": True}}
    proc, raw, sample = _ours(data, {"image.png": IMAGE, "audio.wav": CLIP, "video.mp4": video},
                              "<image><audio><video>" + PROMPT)  # fmt: skip
    processor = AutoProcessor.from_pretrained(out)
    assert type(processor).__name__ == "Qwen2_5OmniProcessor"
    (tmp_path / "v.mp4").write_bytes(video)
    frames, metadata = load_video(str(tmp_path / "v.mp4"), backend="pyav")  # torchcodec is not installed either
    frames = _our_frames(frames, metadata, sample.media[2].frame_indices)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "audio"}, {"type": "video"},
                                             {"type": "text", "text": PROMPT}]}]  # fmt: skip
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    hf = processor(text=text, images=[Image.open(io.BytesIO(IMAGE))], videos=[frames], video_metadata=[metadata],
                   audio=[load_audio(CLIP), load_audio(video)], audio_from_video_indices=[None, 0],
                   load_audio_from_video=True, return_tensors="pt")  # fmt: skip
    assert hf["input_ids"][0].tolist() == sample.input_ids.tolist()
    assert hf["image_grid_thw"].tolist() == [list(sample.media[0].grid_thw)]
    assert hf["video_grid_thw"].tolist() == [list(sample.media[2].grid_thw)] == [[3, 16, 32]]
    assert hf["feature_attention_mask"].sum(-1).tolist() == [250, 300]

    big = video_with_audio_bytes(12, 4.0, 3.0, height=480, width=640, seed=2)
    (tmp_path / "big.mp4").write_bytes(big)
    frames, metadata = load_video(str(tmp_path / "big.mp4"), backend="pyav")
    frames = _our_frames(frames, metadata, proc.plan_media("video", big).video.frame_indices)
    size = json.loads((out / "video_preprocessor_config.json").read_text())["size"]
    hf = processor(text="<|VIDEO|>", videos=[frames], video_metadata=[metadata], videos_kwargs={"size": size},
                   return_tensors="pt")  # fmt: skip
    assert hf["video_grid_thw"].tolist() == [list(proc.plan_media("video", big).video.grid_thw)] == [[3, 20, 26]]


def test_a_template_token_the_tokenizer_lacks_is_refused(exported, tmp_path):
    """The processor looks the media tokens up by name: one the tokenizer does not hold is an export
    error naming it, not a directory whose processor fails later."""
    from omniweave.data.text.tokenizer import load_tokenizer
    from omniweave.models.hf.processor_files import write_processor_files

    out, _, data = exported
    (tmp_path / "t.yaml").write_text('base: qwen2_5_omni\nimage: "<|vision_bos|><|PICTURE|><|vision_eos|>"\n'
                                     'image_pad: "<|PICTURE|>"\n')  # fmt: skip
    hf_cfg = json.loads((out / "config.json").read_text())
    with pytest.raises(ValueError, match=r"has no \['<\|PICTURE\|>'\] token"):
        write_processor_files(tmp_path, {**data, "template": str(tmp_path / "t.yaml")}, hf_cfg,
                              load_tokenizer(data["tokenizer"]).path)  # fmt: skip
