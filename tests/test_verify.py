"""``omniweave hf verify`` on tiny saved Qwen2-VL / Qwen2.5-VL directories: exit 0 when the two
implementations agree, exit 1 when our weights are perturbed."""

from __future__ import annotations

import argparse

import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from vl_factory import save_tiny

from omniweave.models.hf import verify

def _tiny_dir(tmp_path, family):
    path = save_tiny(family, tmp_path / family)
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 64).save_pretrained(path)
    return path


def _args(path, **kw):
    parser = argparse.ArgumentParser()
    verify.add_arguments(parser)
    return parser.parse_args([str(path), *[x for k, v in kw.items() for x in (f"--{k}", str(v))]])


def test_cli_exits_zero_and_prints_every_difference(tmp_path, capsys):
    """Through the real CLI entry point (in-process: same argv handling, no interpreter start)."""
    from omniweave.cli import main

    path = _tiny_dir(tmp_path, "qwen2_5_vl")
    assert main(["hf", "verify", str(path)]) == 0  # random image + random video
    out = capsys.readouterr().out
    for what in ("input_ids", "grid_thw", "pixel_values", "position_ids", "logits", "OK"):
        assert what in out


def test_given_image_file_and_perturbed_weights_fail(tmp_path, monkeypatch, capsys):
    from data_factory import png_bytes

    path = _tiny_dir(tmp_path, "qwen2_vl")
    image = tmp_path / "a.png"
    image.write_bytes(png_bytes(100, 70, seed=3))
    assert verify.run(_args(path, image=image)) == 0
    assert "pixel_values  max|Δ| = 0.000e+00" in capsys.readouterr().out

    real_load = verify.load_hf

    def perturbed(hf_dir):
        model, cfg = real_load(hf_dir)
        with torch.no_grad():
            model.projector.mlp[2].weight.mul_(1.5)  # vision features 1.5x too large
        return model, cfg

    monkeypatch.setattr(verify, "load_hf", perturbed)
    assert verify.run(_args(path, image=image)) == 1
    out = capsys.readouterr().out
    assert "FAIL: logits" in out


def test_token_id_mismatch_is_reported(tmp_path):
    import json

    path = _tiny_dir(tmp_path, "qwen2_vl")
    cfg = json.loads((path / "config.json").read_text())
    cfg["image_token_id"] = 7
    (path / "config.json").write_text(json.dumps(cfg))
    assert verify.run(_args(path)) == 2


def test_text_only_families_are_verified_on_packed_logits(tmp_path, monkeypatch, capsys):
    """`hf verify` on a text model (no vision_config): packed documents through omniweave equal each
    document alone through transformers; omniweave's weights perturbed fail; media flags are refused."""
    from hf_factory import save_tiny as save_text

    from omniweave.cli import main

    for family in ("qwen3", "qwen3_moe", "llama", "deepseek_v3", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next",
                   "gemma"):
        save_text(family, tmp_path / family)
        assert main(["hf", "verify", str(tmp_path / family)]) == 0, family
        out = capsys.readouterr().out
        assert "documents [7, 23, 12] of random tokens packed" in out and "OK" in out
    real_load = verify.load_hf

    def perturbed(hf_dir):
        model, cfg = real_load(hf_dir)
        with torch.no_grad():
            model.foundation.layers[2].mlp.experts.down_proj.mul_(1.5)  # the experts of the last layer
        return model, cfg

    monkeypatch.setattr(verify, "load_hf", perturbed)
    assert main(["hf", "verify", str(tmp_path / "qwen3_moe")]) == 1
    assert "FAIL: logits" in capsys.readouterr().out
    assert main(["hf", "verify", str(tmp_path / "llama"), "--image", "x.png"]) == 2
    assert "text-only model (llama)" in capsys.readouterr().err


def test_video_pixels_are_compared_with_the_video_processor(tmp_path, capsys):
    """With the export's video_preprocessor_config.json (do_sample_frames) and torchvision, HF's
    video processor picks, resizes and normalises the frames itself: grids and pixels equal ours."""
    import json

    import pytest

    pytest.importorskip("torchvision", reason="transformers' video processors need torchvision")
    from data_factory import video_bytes

    from omniweave.data.media.vision import VisionConfig
    from omniweave.models.hf.processor_files import video_processor_config

    path = _tiny_dir(tmp_path, "qwen2_5_vl")
    vision = VisionConfig(video_min_pixels=28 * 28 * 4, video_max_pixels=28 * 28 * 12, frame_sampling="transformers")
    (path / "video_preprocessor_config.json").write_text(json.dumps(video_processor_config(vision, "Qwen2_5_VLProcessor")))
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(video_bytes(30, fps=10.0, height=77, width=131, seed=3))
    assert verify.verify(_args(path, video=clip)) == 0
    out = capsys.readouterr().out
    assert "videos: omniweave.data.media.vision vs Qwen2VLVideoProcessor on its own frames (do_sample_frames)" in out
    video_pixels = next(line for line in out.splitlines() if "vs Qwen2VLVideoProcessor" in line)
    assert "max|Δ| = 0.000e+00" in video_pixels


def _qwen3_vl_dir(tmp_path, vision):
    """A tiny Qwen3-VL directory with an image processor config (patch 16, mean/std 0.5) and the
    video processor config an export of ``vision`` writes (Qwen3VLVideoProcessor)."""
    import json

    from qwen3_vl_factory import save_tiny as save_tiny_qwen3

    from omniweave.models.hf.processor_files import video_processor_config

    path, _ = save_tiny_qwen3("qwen3_vl", tmp_path / "qwen3_vl")
    Qwen2VLImageProcessorPil(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3, min_pixels=32 * 32 * 2,
                             max_pixels=32 * 32 * 64).save_pretrained(path)  # fmt: skip
    (path / "video_preprocessor_config.json").write_text(json.dumps(video_processor_config(vision, "Qwen3VLProcessor")))
    return path


def test_qwen3_vl_video_is_compared_with_its_own_video_processor(tmp_path, monkeypatch, capsys):
    """Qwen3-VL (issue 32, item 7): transformers' Qwen3VLVideoProcessor samples, resizes and
    normalises the clip itself; its frames, grid and pixels, and the timestamps of its frames in
    the text, equal ours. With Qwen2-VL's frame placement on our side (the old bug) verify fails
    on the frames, before any model runs."""
    import pytest

    pytest.importorskip("torchvision", reason="transformers' video processors need torchvision")
    from data_factory import video_bytes

    from omniweave.data.media import vision as M

    vision = M.VisionConfig(patch_size=16, image_mean=(0.5,) * 3, image_std=(0.5,) * 3, frame_sampling="qwen3_vl",
                            video_min_pixels=32 * 32 * 4, video_max_pixels=32 * 32 * 24, fps=3.0)  # fmt: skip
    path = _qwen3_vl_dir(tmp_path, vision)
    clip = tmp_path / "clip.mp4"
    clip.write_bytes(video_bytes(13, fps=6.0, height=213, width=97, seed=13))  # the clip: 6 frames of 13
    assert verify.verify(_args(path, video=clip)) == 0
    out = capsys.readouterr().out
    assert "videos: omniweave.data.media.vision vs Qwen3VLVideoProcessor on its own frames (do_sample_frames)" in out
    assert "frame_indices max|Δ| = 0.000e+00" in out and "[0, 2, 5, 7, 10, 12]" in out
    assert "input_ids     max|Δ| = 0.000e+00" in out
    video_pixels = next(line for line in out.splitlines() if "vs Qwen3VLVideoProcessor" in line)
    assert "max|Δ| = 0.000e+00" in video_pixels

    monkeypatch.setitem(M.FRAME_SAMPLING, "qwen3_vl", M._arange_frames)  # transformers' Qwen2-VL placement
    monkeypatch.setattr(verify, "load_pair", lambda *a: pytest.fail("models run on inputs that differ"))
    assert verify.verify(_args(path, video=clip)) == 1
    out = capsys.readouterr().out
    assert "frame_indices max|Δ| = DIFFER" in out and "[0, 2, 4, 6, 8, 10]" in out


def test_qwen3_vl_random_video_through_the_video_processor(tmp_path, capsys):
    """No --video: the random clip (6 frames at 4 fps) goes through Qwen3VLVideoProcessor too, and
    the whole model comparison passes."""
    import pytest

    pytest.importorskip("torchvision", reason="transformers' video processors need torchvision")
    from omniweave.data.media.vision import VisionConfig

    vision = VisionConfig(patch_size=16, image_mean=(0.5,) * 3, image_std=(0.5,) * 3, frame_sampling="qwen3_vl",
                          video_min_pixels=32 * 32 * 4, video_max_pixels=32 * 32 * 24)  # fmt: skip
    assert verify.verify(_args(_qwen3_vl_dir(tmp_path, vision))) == 0
    out = capsys.readouterr().out
    assert "vs Qwen3VLVideoProcessor on its own frames" in out and "OK" in out
    for what in ("frame_indices", "grid_thw", "position_ids", "logits"):
        assert f"{what:<13} max|Δ| = " in out
