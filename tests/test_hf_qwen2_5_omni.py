"""Qwen2.5-Omni thinker HF adapter: a tiny random ``Qwen2_5OmniThinkerForConditionalGeneration``
(non-round shapes) loads into OmniModel (foundation + qwen2_5_omni_vit + patch_merger +
qwen2_5_omni audio tower + identity projector) with exactly its tensors, gives the same logits and
gradients on a row of text, an image, a video and two audio clips (positions: transformers' own
``get_rope_index``, fed to both), and exports to a directory transformers loads back identically.
A full ``qwen2_5_omni`` directory (``thinker.`` prefix, talker tensors) loads its thinker."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen2_5OmniThinkerConfig, Qwen2_5OmniThinkerForConditionalGeneration

from omniweave.models.hf.loading import adapter_for, load_hf, load_hf_into
from omniweave.models.registry import build_model
from tests.hf_factory import perturb_norms_and_biases

# the demo tokenizer's ids (data/text/tokenizer.py), so the tiny recipe's exports agree with the tests
IDS = dict(audio_token_index=693, audio_start_token_id=692, audio_end_token_id=694, image_token_index=5,
           video_token_index=6, vision_start_token_id=3, vision_end_token_id=4)  # fmt: skip
AUDIO = dict(num_mel_bins=128, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=72, d_model=40,
             output_dim=48, n_window=50)  # fmt: skip
VISION = dict(depth=3, hidden_size=40, num_heads=2, intermediate_size=44, out_hidden_size=48, window_size=56,
              fullatt_block_indexes=[1], spatial_merge_size=2, patch_size=14, temporal_patch_size=2)  # fmt: skip
TEXT = dict(vocab_size=1024, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 2, 2]})  # fmt: skip
IMAGE_GRID, VIDEO_GRID = [1, 4, 6], [2, 4, 4]  # (t, h, w) patches: 6 and 8 tokens after the 2x2 merge
AUDIO_FRAMES = (237, 61)  # 237 frames: three 100-frame chunks (n_window 50), the last partial


def tiny_thinker(seed: int = 0) -> Qwen2_5OmniThinkerForConditionalGeneration:
    """Random tiny thinker with non-unit norms and non-zero biases, so every tensor matters."""
    torch.manual_seed(seed)
    cfg = Qwen2_5OmniThinkerConfig(audio_config=AUDIO, vision_config=VISION, text_config=TEXT, **IDS)
    model = Qwen2_5OmniThinkerForConditionalGeneration(cfg).float().eval()
    perturb_norms_and_biases(model, norms=("norm.weight", "ln_q.weight", "norm1.weight", "norm2.weight", "ln_post.weight"))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2_5_omni_thinker")
    model = tiny_thinker()
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def ours(saved):
    model, model_cfg = load_hf(saved[1])
    return model.eval(), model_cfg


def test_saved_tensors_map_onto_our_parameters_and_back(saved):
    """HF -> ours covers exactly our state dict (q/k/v fused into qkv); ours -> HF gives back
    the identical tensors under the identical names."""
    model, path = saved
    adapter = adapter_for("qwen2_5_omni_thinker")
    hf = load_file(str(path / "model.safetensors"))
    assert "visual.blocks.0.attn.q.weight" in hf and "audio_tower.proj.weight" in hf and "model.norm.weight" in hf
    ours = adapter.model_tensors_to_ours({adapter.model_name_to_ours(n): t for n, t in hf.items()})
    with torch.device("meta"):
        ref = build_model(adapter.model_config(model.config.to_dict()))
    assert {n: tuple(t.shape) for n, t in ours.items()} == {n: tuple(t.shape) for n, t in ref.state_dict().items()}
    back = dict(pair for n, t in ours.items() for pair in adapter.model_tensors_to_hf(n, t))
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[n], hf[n]) for n in hf)


def test_config_round_trips_and_carries_the_token_ids(saved, ours):
    """The exported config.json equals the original's token ids, time scale and the text /
    vision / audio keys the tiny model sets."""
    model, _ = ours
    adapter = adapter_for("qwen2_5_omni_thinker")
    out = adapter.model_config_to_hf(model)
    original = saved[0].config.to_dict()
    for key in (*IDS, "position_id_per_seconds", "seconds_per_chunk", "tie_word_embeddings"):
        assert out[key] == original[key], key
    for section, keys in (("text_config", TEXT), ("vision_config", VISION), ("audio_config", AUDIO)):
        assert {k: out[section][k] for k in keys} == {k: original[section][k] for k in keys}, section
    assert model.hf_model_type() == "qwen2_5_omni_thinker"


def omni_row(seed: int = 0, text: int = 5, token_ids: dict = IDS) -> tuple[dict, dict]:
    """(our batch, transformers' inputs) of one row: text, an image, an audio clip, a video, a
    second clip, each framed by its start / end tokens (``token_ids``: IDS's keys);
    positions from transformers' get_rope_index."""
    from omniweave.data.media.audio import encoder_tokens

    g = torch.Generator().manual_seed(seed)
    rand = lambda n: torch.randint(10, 600, (n,), generator=g)  # noqa: E731
    ids, vision_spans, audio_spans = [rand(text)], [], []

    def span(start: int, token: int, n: int, end: int, spans: list):
        ids.append(torch.tensor([start]))
        spans.append((sum(x.numel() for x in ids), n))
        ids.extend([torch.full((n,), token), torch.tensor([end]), rand(text)])

    vision = token_ids["vision_start_token_id"], token_ids["vision_end_token_id"]
    audio = token_ids["audio_start_token_id"], token_ids["audio_end_token_id"]
    span(vision[0], token_ids["image_token_index"], IMAGE_GRID[0] * IMAGE_GRID[1] * IMAGE_GRID[2] // 4, vision[1], vision_spans)
    audio_tokens = [encoder_tokens(f) for f in AUDIO_FRAMES]
    span(audio[0], token_ids["audio_token_index"], audio_tokens[0], audio[1], audio_spans)
    span(vision[0], token_ids["video_token_index"], VIDEO_GRID[0] * VIDEO_GRID[1] * VIDEO_GRID[2] // 4, vision[1], vision_spans)
    span(audio[0], token_ids["audio_token_index"], audio_tokens[1], audio[1], audio_spans)
    input_ids = torch.cat(ids)
    image = torch.randn(IMAGE_GRID[0] * IMAGE_GRID[1] * IMAGE_GRID[2], 3 * 2 * 14 * 14, generator=g)
    video = torch.randn(VIDEO_GRID[0] * VIDEO_GRID[1] * VIDEO_GRID[2], 3 * 2 * 14 * 14, generator=g)
    width = max(AUDIO_FRAMES) + 13  # padded past the longest clip, as the processor pads a batch
    features = torch.randn(len(AUDIO_FRAMES), 128, width, generator=g)
    mask = (torch.arange(width)[None] < torch.tensor(AUDIO_FRAMES)[:, None]).long()
    theirs = {"input_ids": input_ids[None], "pixel_values": image, "image_grid_thw": torch.tensor([IMAGE_GRID]),
              "pixel_values_videos": video, "video_grid_thw": torch.tensor([VIDEO_GRID]),
              "input_features": features, "feature_attention_mask": mask, "video_second_per_grid": torch.tensor([1.0])}  # fmt: skip
    return {"input_ids": input_ids, "pixel_values": torch.cat([image, video]), "grid_thw": torch.tensor([IMAGE_GRID, VIDEO_GRID]),
            "media_spans": torch.tensor(vision_spans), "audio_features": features,
            "audio_lengths": torch.tensor(AUDIO_FRAMES), "audio_spans": torch.tensor(audio_spans)}, theirs  # fmt: skip


def hf_positions(hf, theirs: dict) -> torch.Tensor:
    """transformers' TMRoPE positions [3, 1, L] of the row (get_rope_index)."""
    pos, _ = hf.model.get_rope_index(theirs["input_ids"], theirs["image_grid_thw"], theirs["video_grid_thw"],
                                     torch.ones_like(theirs["input_ids"]), False,
                                     theirs["feature_attention_mask"].sum(-1), theirs["video_second_per_grid"])  # fmt: skip
    return pos


def test_logits_and_grads_equal_transformers_on_text_image_video_and_audio(saved, ours):
    """fp32, one row with every modality: max|Δ logits| <= 1e-5, gradient rel. error <= 1e-4 for
    every parameter (vision q/k/v gradients fused like the weights)."""
    hf, _ = saved
    model, _ = ours
    batch, theirs = omni_row()
    pos = hf_positions(hf, theirs)
    assert int(pos[0, 0].diff().max()) == 25  # real TMRoPE: the video's 2nd frame is 1 s (25 positions) on
    hf.zero_grad(), model.zero_grad()
    ref = hf(**theirs, position_ids=pos).logits[0]
    got = model.logits({**batch, "position_ids": pos[:, 0]})
    assert got.shape == ref.shape
    assert (got - ref).abs().max() <= 1e-5
    weights = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
    (ref * weights).sum().backward()
    (got * weights).sum().backward()
    adapter = adapter_for("qwen2_5_omni_thinker")
    hf_grads = adapter.model_tensors_to_ours({adapter.model_name_to_ours(n): p.grad for n, p in hf.named_parameters()
                                              if p.grad is not None})  # fmt: skip
    worst, checked = 0.0, set()
    for name, p in model.named_parameters():
        g_ref = hf_grads.get(name)
        if g_ref is None or g_ref.norm() == 0:
            continue
        worst = max(worst, float((p.grad - g_ref).norm() / g_ref.norm()))
        checked.add(name.split(".")[0])
    assert worst <= 1e-4
    assert checked == {"foundation", "image_encoder", "projector", "audio_encoder"}  # identity projector: no params


def test_export_writes_the_thinker_transformers_loads_back_identically(saved, ours, tmp_path):
    from omniweave.models.hf.export import export_hf

    hf, path = saved
    model, model_cfg = ours
    export_hf(model, model_cfg, tmp_path)
    original, exported = load_file(str(path / "model.safetensors")), load_file(str(tmp_path / "model.safetensors"))
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[n], original[n]) for n in original)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "qwen2_5_omni_thinker"
    again = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(tmp_path).eval()
    _, theirs = omni_row(seed=1)
    pos = hf_positions(hf, theirs)
    assert torch.equal(hf_positions(again, theirs), pos)  # the token ids and time scale came back
    with torch.no_grad():
        assert torch.equal(again(**theirs, position_ids=pos).logits, hf(**theirs, position_ids=pos).logits)


def test_a_full_qwen2_5_omni_directory_loads_its_thinker_only(saved, ours, tmp_path, capsys):
    """A ``qwen2_5_omni`` directory (thinker_config; ``thinker.`` tensors beside talker /
    token2wav ones) loads the thinker, whole (load_hf) and into a built model (load_hf_into)."""
    hf, path = saved
    model, _ = ours
    _full_dir(path, tmp_path)
    full, _ = load_hf(tmp_path)
    assert "talker and token2wav are not loaded" in capsys.readouterr().err
    expected = model.state_dict()
    assert full.state_dict().keys() == expected.keys()
    assert all(torch.equal(t, expected[n]) for n, t in full.state_dict().items())
    with torch.no_grad():
        for p in full.parameters():
            p.zero_()
    load_hf_into(full, tmp_path)
    assert all(torch.equal(t, expected[n]) for n, t in full.state_dict().items())


def test_7b_recipe_builds_on_meta_with_the_thinker_parameter_count():
    """omniweave/configs/recipes/qwen2_5_omni_7b.yaml = the Qwen2.5-Omni-7B thinker: 8,931,813,888 tensors
    (transformers' thinker state dict on its released config; the 10.7B of the full checkpoint
    add the talker and token2wav), rope mrope_omni (the data side's TMRoPE kind)."""
    from omniweave.config import load_recipe

    cfg = load_recipe("qwen2_5_omni_7b")
    with torch.device("meta"):
        model = build_model(cfg.model)
    assert sum(t.numel() for t in model.state_dict().values()) == 8_931_813_888
    assert model.hf_model_type() == "qwen2_5_omni_thinker"
    assert cfg.data.rope == "mrope_omni" and cfg.data.audio.family == "qwen2_5_omni"


# the demo tokenizer's ids of the qwen2_5_omni template's media tokens (<|IMAGE|>, <|vision_bos|> …)
TEMPLATE_IDS = IDS | dict(image_token_index=697, video_token_index=698, vision_start_token_id=695, vision_end_token_id=696)


def test_tiny_recipe_trains_and_exports_as_a_thinker_with_its_template_token_ids(tmp_path):
    """omniweave/configs/recipes/tiny_qwen2_5_omni.yaml builds, a row with every modality back-propagates
    into both towers, and the export (with the recipe's data section) is a thinker directory
    transformers loads with the ids of the media tokens the recipe's template writes and equal
    logits (≤ 1e-5)."""
    from omniweave.config import load_recipe, to_dict
    from omniweave.models.hf.export import export_hf

    cfg = to_dict(load_recipe("tiny_qwen2_5_omni"))
    assert cfg["data"]["rope"] == "mrope_omni"
    torch.manual_seed(0)
    model = build_model(cfg["model"])
    batch, theirs = omni_row(seed=2, token_ids=TEMPLATE_IDS)
    labels = batch["input_ids"].roll(-1)
    out = model({**batch, "labels": labels})
    out.loss_sum.backward()
    assert torch.isfinite(out.loss_sum)
    assert model.audio_encoder.conv1.weight.grad.abs().sum() > 0
    assert model.image_encoder.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
    export_hf(model, cfg["model"], tmp_path, data_cfg=cfg["data"])
    exported = json.loads((tmp_path / "config.json").read_text())
    assert {k: exported[k] for k in IDS} == TEMPLATE_IDS  # the qwen2_5_omni template's tokens, also under *_index names
    hf = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(tmp_path).eval()
    pos = hf_positions(hf, theirs)
    with torch.no_grad():
        ref = hf(**theirs, position_ids=pos).logits[0]
        got = model.logits({**batch, "position_ids": pos[:, 0]})
    assert (got - ref).abs().max() <= 1e-5


def _full_dir(path, out):
    """A full ``qwen2_5_omni`` directory around the thinker saved at ``path``: ``thinker.``
    tensors beside talker / token2wav ones, the thinker config as ``thinker_config`` (audio output
    off, so transformers builds the thinker alone too)."""
    tensors = {f"thinker.{n}": t for n, t in load_file(str(path / "model.safetensors")).items()}
    tensors["talker.codec_head.weight"] = torch.zeros(3, 2)
    tensors["token2wav.code2wav_dit_model.proj_out.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(out / "model.safetensors"))
    torch.save({}, out / "spk_dict.pt")  # released full directories carry their talker's speakers
    thinker = json.loads((path / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({"model_type": "qwen2_5_omni", "architectures": ["Qwen2_5OmniModel"],
                                                 "thinker_config": thinker, "enable_audio_output": False}))  # fmt: skip
    return out


def test_hf_verify_omni_with_image_video_and_audio_files(saved, tmp_path, monkeypatch, capsys):
    """``omniweave hf verify DIR --image --video --audio``: our pipeline's audio token counts (from
    headers) and log-mel (a 31 s clip kept whole: truncation=False) equal transformers', logits
    agree with transformers' positions fed to both; the full-directory layout verifies too; a
    perturbed audio tower fails."""
    from omniweave.cli import main
    from omniweave.models.hf import verify_omni
    from omniweave.models.hf.verify import random_media
    from tests.audio_factory import encode, signal

    _, path = saved
    image, video = random_media(3)
    (tmp_path / "a.png").write_bytes(image), (tmp_path / "v.mp4").write_bytes(video)
    (tmp_path / "short.wav").write_bytes(encode(signal(2.5, 16000, 1), 16000, "wav"))
    (tmp_path / "long.flac").write_bytes(encode(signal(31.0, 22050, 2, seed=1), 22050, "flac"))
    args = ["--image", str(tmp_path / "a.png"), "--video", str(tmp_path / "v.mp4"),
            "--audio", str(tmp_path / "short.wav"), "--audio", str(tmp_path / "long.flac")]  # fmt: skip
    assert main(["hf", "verify", str(path), *args]) == 0
    out = capsys.readouterr().out
    assert "planned from headers" in out and "frames [250, 3100]" in out and "OK: all differences" in out
    (tmp_path / "full").mkdir()
    assert main(["hf", "verify", str(_full_dir(path, tmp_path / "full")), "--audio", str(tmp_path / "short.wav")]) == 0
    assert "OK: all differences" in capsys.readouterr().out

    real_load = verify_omni.load_hf

    def perturbed(hf_dir):
        model, cfg = real_load(hf_dir)
        with torch.no_grad():
            model.audio_encoder.proj.weight.mul_(1.5)
        return model, cfg

    monkeypatch.setattr(verify_omni, "load_hf", perturbed)
    assert main(["hf", "verify", str(path), "--audio", str(tmp_path / "short.wav")]) == 1
    assert "FAIL: logits" in capsys.readouterr().out


def test_hf_verify_use_audio_in_video_on_real_mp4s_with_their_own_sound(saved, tmp_path, capsys):
    """``omniweave hf verify DIR --video F --use-audio-in-video`` on real mp4s (MPEG-4 video + AAC
    sound muxed by PyAV): the sound track's token count (from the header) and log-mel equal
    transformers' (WhisperFeatureExtractor on the same decoded track), our interleaved TMRoPE
    positions equal get_rope_index(use_audio_in_video=True) exactly, logits ≤ 1e-4 (measured ~3e-7).
    Sound as long as the video, longer (4.3 s under a 2.5 s video) and shorter (1.2 s under 4.5 s),
    and beside a separate clip; a silent video is refused (exit 2), as is the flag on a non-Omni dir."""
    from audio_factory import encode, signal, video_with_audio_bytes

    from omniweave.cli import main

    _, path = saved
    clips = {"same": (12, 3.0), "sound_longer": (10, 4.3), "sound_shorter": (18, 1.2)}  # frames at 4 fps, sound s
    for i, (name, (frames, seconds)) in enumerate(clips.items()):
        (tmp_path / f"{name}.mp4").write_bytes(video_with_audio_bytes(frames, 4.0, seconds, height=56, width=84, seed=i))
    # (sound tokens, its interleaved runs: 2 s = 50 tokens per chunk, cut where the video's chunks are)
    expected = {"same": ("[75]", "[50, 25]"), "sound_longer": ("[107]", "[50, 50, 7]"), "sound_shorter": ("[30]", "[30]")}
    for name, (tokens, runs) in expected.items():
        assert main(["hf", "verify", str(path), "--use-audio-in-video", "--video", str(tmp_path / f"{name}.mp4")]) == 0
        out = capsys.readouterr().out
        assert f"audio tokens  max|Δ| = 0.000e+00  per clip {tokens} planned from headers (HF {tokens})" in out, out
        assert f"a video's sound track in runs {runs}" in out, out
        assert "positions     max|Δ| = 0.000e+00" in out and "OK: all differences" in out, out
    (tmp_path / "s.wav").write_bytes(encode(signal(2.5, 16000, 1), 16000, "wav"))
    assert main(["hf", "verify", str(path), "--use-audio-in-video", "--audio", str(tmp_path / "s.wav"),
                 "--video", str(tmp_path / "sound_shorter.mp4")]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "per clip [62, 30]" in out and "frames [250, 120]" in out and "OK: all differences" in out, out

    (tmp_path / "silent.mp4").write_bytes(video_with_audio_bytes(12, 4.0, 0.0, height=56, width=84, audio=False))
    assert main(["hf", "verify", str(path), "--use-audio-in-video", "--video", str(tmp_path / "silent.mp4")]) == 2
    assert "no_audio_stream" in capsys.readouterr().err
    assert main(["hf", "verify", str(path), "--use-audio-in-video"]) == 2
    assert "--use-audio-in-video needs --video" in capsys.readouterr().err
    (tmp_path / "vl").mkdir()
    (tmp_path / "vl" / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl"}))
    assert main(["hf", "verify", str(tmp_path / "vl"), "--use-audio-in-video", "--video", str(tmp_path / "same.mp4")]) == 2
    assert "--use-audio-in-video is Qwen2.5-Omni's" in capsys.readouterr().err
