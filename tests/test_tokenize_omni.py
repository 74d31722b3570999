"""``rope: mrope_omni`` (Qwen2.5-Omni's TMRoPE) and ``data.audio.use_audio_in_video``, from media
headers only, against transformers' own Qwen2.5-Omni code.

Positions: ``get_rope_index`` of transformers' Qwen2.5-Omni thinker, called on a stub holding a
``Qwen2_5OmniThinkerConfig`` (its defaults: 25 positions per second, 2-second chunks) with the demo
tokenizer's ids -- the method reads only the config, ``spatial_merge_size`` and its two helpers.
Tokens: ``Qwen2_5OmniProcessor`` needs torchvision for its video processor (not installable on this
CPU torch build), so it cannot run end to end; the expected text is the rendered template with each
placeholder replaced by the processor's own ``replace_image_token`` / ``replace_audio_token`` /
``replace_video_with_audio_token`` (run on a stub), the audio token counts taken from
``WhisperFeatureExtractor`` on the decoded audio as ``Qwen2_5OmniProcessor._process_audio`` does.
"""

from __future__ import annotations

import json
import re
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from audio_factory import encode, signal, video_with_audio_bytes
from data_factory import png_bytes, video_bytes

from omniweave.data.media.audio import load_audio, qwen2_5_omni_frames
from omniweave.data.loading.loader import media_batch
from omniweave.data.media.mel import log_mel
from omniweave.data.sample import Conversation, Message, RawSample
from omniweave.data.text.template import encode_conversation
from omniweave.data.text.tokenize import SampleProcessor, SampleRejected
from omniweave.data.text.tokenizer import load_tokenizer

VISION = {"min_pixels": 28 * 28 * 2, "max_pixels": 28 * 28 * 24, "video_min_pixels": 28 * 28 * 2,
          "video_max_pixels": 28 * 28 * 4, "video_total_pixels": 28 * 28 * 400, "max_frames": 64}
IMG = png_bytes(60, 90, seed=1)
WAV = encode(signal(1.3, 16000, 1, seed=2), 16000, "wav")
# 6 s at 4 fps with a 6 s sound track: 12 frames, 6 temporal patches, 3 two-second chunks
AV_6S = video_with_audio_bytes(24, 4.0, 6.0, seed=3)
# 7 frames at 3 fps (4 sampled: fractional time steps) with 2.6 s of sound: more audio chunks than video ones
AV_ODD = video_with_audio_bytes(7, 3.0, 2.6, sample_rate=16000, seed=4)
# 5.5 s of video, 0.7 s of sound: more video chunks than audio ones
AV_SHORT_SOUND = video_with_audio_bytes(22, 4.0, 0.7, sample_rate=44100, seed=5)
# 42 frames at 5 fps: 16 sampled, second_per_grid 1.05, whose float32 temporal ids (…, 104, 131, …) differ
# from int(i · (1.05 · 25)) (…, 105, …); 6.5 s of sound: the last chunk is audio, ending below the video's
AV_FRAC = video_with_audio_bytes(42, 5.0, 6.5, seed=7)
SILENT = video_bytes(8, fps=4.0, height=50, width=76, seed=6)


def processor(use_audio_in_video: bool) -> SampleProcessor:
    return SampleProcessor({"tokenizer": "demo", "template": "qwen2_5_omni", "rope": "mrope_omni", "max_len": 8192,
                            "vision": VISION, "audio": {"family": "qwen2_5_omni",
                                                        "use_audio_in_video": use_audio_in_video}})  # fmt: skip


@pytest.fixture(scope="module")
def plain():
    return processor(False)


@pytest.fixture(scope="module")
def av():
    return processor(True)


def sample(text: str, images=(), videos=(), audios=(), key="s") -> RawSample:
    media = ({f"img{i}.png": b for i, b in enumerate(images)} | {f"vid{i}.mp4": b for i, b in enumerate(videos)}
             | {f"aud{i}.wav": b for i, b in enumerate(audios)})  # fmt: skip
    conv = Conversation(id=key, messages=[Message("user", text), Message("assistant", "A tone and stripes.")],
                        images=[k for k in media if k.startswith("img")], videos=[k for k in media if k.startswith("vid")],
                        audios=[k for k in media if k.startswith("aud")])  # fmt: skip
    return RawSample(key=key, conversation=conv, media=media)


def hf_rope_stub(proc: SampleProcessor):
    """An object ``get_rope_index`` of transformers' Qwen2.5-Omni thinker runs on: its config with our ids."""
    from transformers import Qwen2_5OmniThinkerConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        Qwen2_5OmniPreTrainedModelForConditionalGeneration as Thinker)

    tok = proc.tokenizer
    cfg = Qwen2_5OmniThinkerConfig(
        image_token_index=tok.token_id("<|IMAGE|>"), video_token_index=tok.token_id("<|VIDEO|>"),
        audio_token_index=tok.token_id("<|AUDIO|>"), audio_start_token_id=tok.token_id("<|audio_bos|>"),
        audio_end_token_id=tok.token_id("<|audio_eos|>"), vision_start_token_id=tok.token_id("<|vision_bos|>"))
    stub = SimpleNamespace(config=cfg, spatial_merge_size=cfg.vision_config.spatial_merge_size)
    stub.get_llm_pos_ids_for_vision = partial(Thinker.get_llm_pos_ids_for_vision, stub)
    stub.get_chunked_index = partial(Thinker.get_chunked_index, stub)
    stub.get_rope_index = partial(Thinker.get_rope_index, stub)
    return stub


def hf_positions(proc: SampleProcessor, docs: list) -> list[np.ndarray]:
    """transformers' positions of each tokenized sample, run as one right-padded batch."""
    stub = hf_rope_stub(proc)
    width = max(len(d) for d in docs)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, d in enumerate(docs):
        ids[i, : len(d)], mask[i, : len(d)] = torch.from_numpy(d.input_ids.astype(np.int64)), 1
    media = [s for d in docs for s in d.media]
    grids = {k: torch.tensor([s.grid_thw for s in media if s.kind == k]).reshape(-1, 3) for k in ("image", "video")}
    pos, _ = stub.get_rope_index(
        ids, image_grid_thw=grids["image"] if len(grids["image"]) else None,
        video_grid_thw=grids["video"] if len(grids["video"]) else None, attention_mask=mask,
        use_audio_in_video=proc.audio.use_audio_in_video,
        audio_seqlens=torch.tensor([qwen2_5_omni_frames(s.num_samples) for s in media if s.kind == "audio"]),
        second_per_grids=torch.tensor([s.second_per_grid for s in media if s.kind == "video"]))
    return [pos[:, i, : len(d)].numpy() for i, d in enumerate(docs)]


CASES = {
    "text_only": (False, dict(text="Just words, no media.")),
    "text_audio": (False, dict(text="Listen: <audio> What tone?", audios=[WAV])),
    "image_audio": (False, dict(text="<image> and <audio>: same colour?", images=[IMG], audios=[WAV])),
    "videos_text": (False, dict(text="<video> then <video>, <video>: what moves?", videos=[AV_6S, AV_ODD, AV_FRAC])),
    "video_image_audio": (False, dict(text="<audio><video><image>", images=[IMG], videos=[SILENT], audios=[WAV])),
    "audio_in_video": (True, dict(text="<video> What is heard?", videos=[AV_6S])),
    "audio_in_video_fractional": (True, dict(text="Hear <video>.", videos=[AV_FRAC])),
    "audio_in_videos_and_audio": (True, dict(text="<audio> <video> <image> <video>!", images=[IMG],
                                             videos=[AV_ODD, AV_SHORT_SOUND], audios=[WAV])),
}


@pytest.mark.parametrize("name", CASES)
def test_positions_equal_transformers_get_rope_index(plain, av, name):
    use_av, kwargs = CASES[name]
    proc = av if use_av else plain
    got = proc.tokenize(sample(**kwargs))
    (want,) = hf_positions(proc, [got])
    np.testing.assert_array_equal(got.position_ids, want)


def test_several_documents_each_positioned_on_its_own(av):
    """Docs of one pack are tokenized separately: each equals its row of a padded transformers batch."""
    docs = [av.tokenize(sample(**CASES[n][1], key=n)) for n in ("audio_in_video", "audio_in_videos_and_audio")]
    for doc, want in zip(docs, hf_positions(av, docs)):
        np.testing.assert_array_equal(doc.position_ids, want)


def test_video_temporal_ids_scale_with_second_per_grid(plain):
    """Temporal id of patch i = int(i · second_per_grid · 25): 25 per second at 2 fps sampling;
    fractional steps are truncated after the model's float32 products."""
    got = plain.tokenize(sample("<video><video><video>", videos=[AV_6S, AV_ODD, AV_FRAC]))
    for span in got.media:
        t_ids = sorted(set(got.position_ids[0, span.start:span.end].tolist()))
        assert t_ids[0] == got.position_ids[0, span.start - 1] + 1  # bos, then the block
    six, odd, frac = got.media
    assert sorted(set(got.position_ids[0, frac.start:frac.end] - got.position_ids[0, frac.start])) == [
        0, 26, 52, 78, 104, 131, 157, 183]  # float32 (i · 1.05) · 25, truncated: not 105 at i = 4
    assert six.second_per_grid == 1.0 and six.grid_thw[0] == 6
    assert got.position_ids[0, six.start:six.end][::2].tolist() == [s + got.position_ids[0, six.start] for s in (0, 25, 50, 75, 100, 125)]
    assert abs(odd.second_per_grid - 2 / (4 / 7 * 3)) < 1e-9


def hf_media_text(proc: SampleProcessor, raw: RawSample, got) -> str:
    """The rendered template with each pad token replaced by Qwen2.5-Omni's processor string."""
    from transformers import WhisperFeatureExtractor
    from transformers.models.qwen2_5_omni.processing_qwen2_5_omni import (Qwen2_5OmniProcessor as P,
                                                                           _get_feat_extract_output_lengths)

    stub = SimpleNamespace(image_processor=SimpleNamespace(merge_size=2), video_processor=SimpleNamespace(merge_size=2),
                           image_token="<|IMAGE|>", video_token="<|VIDEO|>", audio_token="<|AUDIO|>",
                           audio_bos_token="<|audio_bos|>", audio_eos_token="<|audio_eos|>")  # fmt: skip
    stub.get_chunked_index = partial(P.get_chunked_index, stub)
    extractor = WhisperFeatureExtractor(feature_size=128)

    def audio_inputs(data: bytes) -> dict:  # Qwen2_5OmniProcessor._process_audio, without truncation
        mask = extractor(load_audio(data), sampling_rate=16000, padding="max_length", truncation=False,
                         return_attention_mask=True, return_tensors="pt")["attention_mask"]
        return {"num_audio_tokens": _get_feat_extract_output_lengths(mask.sum(-1))}

    _, _, rendered, _ = encode_conversation(proc.template, proc.tokenizer, raw.conversation.messages)
    spans, out = iter(got.media), []
    for piece in re.split(r"(<\|IMAGE\|>|<\|VIDEO\|>|<\|AUDIO\|>)", rendered.text):
        if piece not in ("<|IMAGE|>", "<|VIDEO|>", "<|AUDIO|>"):
            out.append(piece)
            continue
        span = next(spans)
        if span.kind == "image":
            out.append(P.replace_image_token(stub, {"image_grid_thw": torch.tensor([span.grid_thw])}, 0))
        elif span.kind == "audio":
            out.append(P.replace_audio_token(stub, audio_inputs(raw.media[span.part]), 0))
        else:  # a video and its sound track (the next span)
            sound = next(spans)
            video_inputs = {"video_grid_thw": torch.tensor([span.grid_thw]), "video_second_per_grid": [span.second_per_grid]}
            out.append(P.replace_video_with_audio_token(stub, video_inputs, 0, audio_inputs(raw.media[sound.part]), 0,
                                                        position_id_per_seconds=25, seconds_per_chunk=2.0))  # fmt: skip
    return "".join(out)


@pytest.mark.parametrize("name", ["image_audio", "audio_in_video", "audio_in_video_fractional",
                                  "audio_in_videos_and_audio"])
def test_tokens_equal_the_qwen2_5_omni_processor_text(plain, av, name):
    use_av, kwargs = CASES[name]
    proc = av if use_av else plain
    raw = sample(**kwargs)
    got = proc.tokenize(raw)
    text = hf_media_text(proc, raw, got)
    if use_av:
        assert "<|vision_bos|><|audio_bos|><|VIDEO|>" in text and "<|AUDIO|><|audio_eos|><|vision_eos|>" in text
    assert got.input_ids.tolist() == proc.tokenizer.encode(text)


def test_audio_in_video_spans_runs_and_loader_batch(av):
    raw = sample("<video> What is heard?", videos=[AV_ODD])
    got = av.tokenize(raw)
    video, sound = got.media
    assert (video.kind, sound.kind, video.part, sound.part) == ("video", "audio", "vid0.mp4", "vid0.mp4")
    assert len(video.ranges()) == 1 and len(sound.ranges()) == 2  # 1 video chunk (< 2 s), 2.6 s of sound: 2 chunks
    for span, pad in ((video, av.video_pad_id), (sound, av.audio_pad_id)):
        assert all((got.input_ids[s : s + n] == pad).all() for s, n in span.ranges())
        assert sum(n for _, n in span.ranges()) == span.length == (got.input_ids == pad).sum()
    batch = media_batch(av, [(s, raw.media[s.part]) for s in got.media])
    assert batch["audio_spans"].tolist() == [list(r) for r in sound.ranges()]
    samples = load_audio(AV_ODD)
    assert batch["audio_lengths"].tolist() == [qwen2_5_omni_frames(len(samples))] and len(samples) == sound.num_samples
    want = log_mel([torch.from_numpy(samples)], n_mels=128, padding="max_length", truncation=False).features
    assert torch.equal(batch["audio_features"], want)
    assert batch["grid_thw"].tolist() == [list(video.grid_thw)]


def test_video_without_audio_track_is_rejected_with_its_reason(av, plain):
    with pytest.raises(SampleRejected) as e:
        av.tokenize(sample("<video>?", videos=[SILENT]))
    assert e.value.reason == "no_audio_stream"
    assert plain.tokenize(sample("<video>?", videos=[SILENT])).media[0].kind == "video"  # fine without the flag


def test_use_audio_in_video_needs_omni_positions_and_family():
    with pytest.raises(ValueError, match="mrope_omni"):
        SampleProcessor({"tokenizer": "demo", "template": "qwen2_5_omni", "rope": "mrope_qwen25",
                         "audio": {"family": "qwen2_5_omni", "use_audio_in_video": True}})
    with pytest.raises(ValueError, match="qwen2_5_omni"):
        SampleProcessor({"tokenizer": "demo", "template": "qwen2_5_omni", "rope": "mrope_omni",
                         "audio": {"family": "qwen2_audio", "use_audio_in_video": True}})


OMNI_RECIPE = """
data:
  tokenizer: demo
  template: qwen2_5_omni
  max_len: 4096
  rope: mrope_omni
  audio: {family: qwen2_5_omni, use_audio_in_video: true}
  vision: {min_pixels: 1568, max_pixels: 18816, video_min_pixels: 1568, video_max_pixels: 3136, max_frames: 64}
model:
  image_encoder: {name: whatever}
  %s
  foundation: {name: x}
"""


def test_pack_counts_silent_videos_and_loads_the_sound_track(tmp_path):
    """Convert -> pack -> loader: a silent video is a counted ``no_audio_stream`` drop, a model
    without an audio encoder drops every video (``no_audio_encoder``), and the packed row's
    audio_spans are the sound track's runs."""
    from test_audio_data import convert, sharegpt

    from omniweave.cli import main
    from omniweave.data.loading.loader import collate_pack
    from omniweave.data.packing.packed import PackedDataset

    rows = [sharegpt("<video>Heard?", "a tone", id="av", videos=["av.mp4"]),
            sharegpt("<video>Heard?", "nothing", id="silent", videos=["silent.mp4"]),
            sharegpt("2+2?", "4", id="txt")]  # fmt: skip
    convert(tmp_path, rows, av__mp4=AV_ODD, silent__mp4=SILENT)
    got = {}
    for name, audio_section in (("omni", "audio_encoder: {name: whatever}"), ("vision", "")):
        (tmp_path / f"{name}.yaml").write_text(OMNI_RECIPE % audio_section)
        out = tmp_path / f"packed-{name}"
        assert main(["data", "pack", "--input", str(tmp_path / "raw-in"), "--output", str(out),
                     "--recipe", str(tmp_path / f"{name}.yaml"), "--workers", "1"]) == 0  # fmt: skip
        got[name] = json.loads((out / "stats.json").read_text()), PackedDataset(out)
    assert got["omni"][0]["dropped"] == {"no_audio_stream": 1} and got["omni"][0]["samples_packed"] == 2
    assert got["vision"][0]["dropped"] == {"no_audio_encoder": 2} and got["vision"][0]["samples_packed"] == 1
    stats, ds = got["omni"]
    (pack,) = [ds[k] for k in range(len(ds)) if any(m["kind"] == "audio" for m in ds[k]["media"])]
    (sound,) = [m for m in pack["media"] if m["kind"] == "audio"]
    batch = collate_pack(pack, ds.manifest["data_cfg"])
    assert batch["audio_spans"].tolist() == [list(p) for p in sound["pieces"]] and len(sound["pieces"]) == 2
    assert batch["audio_lengths"].tolist() == [qwen2_5_omni_frames(sound["num_samples"])]
    audio_pad = load_tokenizer("demo").token_id("<|AUDIO|>")
    assert all((batch["input_ids"][s : s + n] == audio_pad).all() for s, n in sound["pieces"])
    assert int((batch["input_ids"] == audio_pad).sum()) == int(batch["audio_spans"][:, 1].sum()) == sound["length"]
