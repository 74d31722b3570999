"""omniweave leaves torch and torchvision alone: importing it patches nothing (a GPU user's healthy
torch + torchvision must import in any order), and a torchvision that does not load beside this
torch (our dev venv: PyPI's CUDA build of torchvision next to the CPU build of torch) costs one
warning where transformers is used, and the image path keeps working without it
(omniweave/models/hf/torchvision_guard.py). The GPU user's environment itself is the second CI
leg (.ci/cuda_env.sh)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.train_factory import REPO, child_env


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), cwd=REPO,
                          timeout=300)


def test_import_omniweave_patches_nothing():
    """No import hook, no operator library, not even torch: ``import omniweave`` is inert."""
    r = _python("import sys; hooks = list(sys.meta_path); import omniweave, omniweave.config, omniweave.cli; "
                "assert sys.meta_path == hooks, sys.meta_path; "
                "assert not {'torch', 'torchvision'} & set(sys.modules), sorted(m for m in sys.modules if 'torch' in m)")
    assert r.returncode == 0, r.stderr


@pytest.fixture(scope="module")
def torchvision_broken() -> str:
    """The error a plain ``import torchvision`` gives here (skip where it imports or is absent)."""
    r = _python("import torchvision")
    if r.returncode == 0 or "No module named 'torchvision'" in r.stderr:
        pytest.skip("torchvision imports here (or is absent): nothing broken to guard against")
    return r.stderr.strip().splitlines()[-1]


def test_broken_torchvision_gives_one_warning_and_verify_still_compares_images(torchvision_broken, tmp_path):
    """``omniweave hf verify`` in a fresh process (no test shim) on a tiny Qwen2.5-VL directory with
    an image and a video: exit 0, one warning line on stderr naming the error, images compared
    with transformers' PIL processor, the video fed to both sides as our pixels, saying why."""
    from data_factory import png_bytes, video_bytes
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from vl_factory import save_tiny

    from omniweave.data.media.vision import VisionConfig
    from omniweave.models.hf.processor_files import video_processor_config

    path = save_tiny("qwen2_5_vl", tmp_path / "hf")
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=28 * 28 * 64).save_pretrained(path)
    vision = VisionConfig(video_min_pixels=28 * 28 * 4, video_max_pixels=28 * 28 * 12, frame_sampling="transformers")
    (path / "video_preprocessor_config.json").write_text(json.dumps(video_processor_config(vision, "Qwen2_5_VLProcessor")))
    (tmp_path / "a.png").write_bytes(png_bytes(100, 70, seed=3))
    (tmp_path / "clip.mp4").write_bytes(video_bytes(12, fps=6.0, height=56, width=84, seed=1))
    r = subprocess.run([sys.executable, "-m", "omniweave", "hf", "verify", str(path), "--image", str(tmp_path / "a.png"),
                        "--video", str(tmp_path / "clip.mp4")], capture_output=True, text=True, env=child_env(),
                       cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:] + r.stdout[-3000:]
    warnings = [ln for ln in r.stderr.splitlines() if "warning" in ln.lower() or "torchvision" in ln]  # not progress bars
    assert len(warnings) == 1 and "torchvision is installed but does not load beside this torch" in warnings[0], r.stderr
    assert "operator torchvision::nms does not exist" in warnings[0]
    assert "images: omniweave.data.media.vision vs Qwen2VLImageProcessorPil" in r.stdout
    assert "HF given ours (its video processor needs torchvision; torchvision does not load here:" in r.stdout
    assert "OK: all differences within atol" in r.stdout
