"""Diffusion packs of clips that differ in length, size and aspect (``data.diffusion.frames: null``:
each clip at its native length), and what is dropped or cropped on the way.

Checked: each kept clip's latent grid is (1 + (T - 1) / 4, H / 16, W / 16) of its own length and
size, rounded down to what the VAE and the patch take; its latents and text states equal the
recipe's codecs on the same decoded frames; a clip shorter than one VAE step (< 5 frames) is a
counted ``too_short``, one with a side under 16 px a counted ``too_small`` (nothing is upscaled);
an odd-sized image is resized to cover its rounded size and centre-cropped, not squashed."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from omniweave.cli import main as cli
from omniweave.data.packing.packed import PackedDataset
from omniweave.diffusion.data import DiffusionSettings, SampleRejected, clip_plan, resized_frame

NATIVE = ["data.diffusion.frames=null", "data.diffusion.max_pixels=4096", "data.diffusion.min_pixels=256"]


def _frames(t: int, h: int, w: int, seed: int) -> np.ndarray:
    """A smooth moving gradient (H.264 keeps it close), uint8 [t, h, w, 3]."""
    ys, xs = np.mgrid[0:h, 0:w]
    rng = np.random.default_rng(seed)
    base = rng.uniform(40, 200, size=3)
    out = [np.stack([base[c] + 40 * np.sin((xs + 2 * k) / 7 + c) + 20 * np.cos(ys / 5) for c in range(3)], -1)
           for k in range(t)]
    return np.clip(np.stack(out), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> dict:
    from omniweave.diffusion.demo_data import write_mp4

    root = tmp_path_factory.mktemp("sizes")
    media = root / "media"
    media.mkdir()
    rows = []
    for name, (t, h, w) in {"v9_32x48": (9, 32, 48), "v21_32x80": (21, 32, 80), "v4_32x48": (4, 32, 48),
                            "v9_12x12": (9, 12, 12)}.items():
        write_mp4(media / f"{name}.mp4", _frames(t, h, w, len(rows)), fps=16)
        rows.append({"id": name, "video": f"{name}.mp4", "caption": f"clip {name}"})
    for name, (h, w) in {"i_48x64": (48, 64), "i_33x47": (33, 47)}.items():
        Image.fromarray(_frames(1, h, w, len(rows))[0]).save(media / f"{name}.png")
        rows.append({"id": name, "image": f"{name}.png", "caption": f"image {name}"})
    jsonl = root / "rows.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cli(["data", "convert", "--format", "clips", "--input", str(jsonl), "--media-dir", str(media),
                "--output", str(root / "raw"), "--no-progress"]) == 0
    assert cli(["data", "pack", "--input", str(root / "raw"), "--output", str(root / "packed"),
                "--recipe", "tiny_diffusion", "--workers", "1", *NATIVE]) == 0
    return {"raw": root / "raw", "packed": root / "packed"}


def test_native_lengths_and_sizes_pack_with_their_own_grids_and_the_unusable_are_counted(mixed):
    from omniweave.config import load_recipe, recipe_path, to_dict
    from omniweave.data.sources.clips_convert import ClipRawDataset
    from omniweave.diffusion.data import ClipEncoder, codecs_of, decode_clip

    stats = json.loads((mixed["packed"] / "stats.json").read_text())
    assert stats["samples_packed"] == 4 and stats["dropped"] == {"too_short": 1, "too_small": 1}
    cfg = to_dict(load_recipe(recipe_path("tiny_diffusion"), NATIVE))
    settings = DiffusionSettings.from_mapping(cfg["data"]["diffusion"])
    encoder = ClipEncoder(codecs_of(cfg["model"]), settings, "cpu")
    ds, raw = PackedDataset(mixed["packed"]), ClipRawDataset(mixed["raw"])
    # (latent frames, H / 16, W / 16): 9 frames -> 3, 21 -> 6; the 33 x 47 image -> 32 x 32
    expected = {"v9_32x48": [3, 2, 3], "v21_32x80": [6, 2, 5], "i_48x64": [1, 3, 4], "i_33x47": [1, 2, 2]}
    grids = {}
    for i in range(len(ds)):
        pack = ds[i]
        for doc, arrays in zip(pack["docs"], pack["doc_arrays"]):
            clip = raw[doc["index"]]
            name = clip.meta["caption"].split()[-1]
            grids[name] = [int(g) for g in arrays["grid"]]
            tokens = int(np.prod(grids[name]))
            assert doc["length"] == tokens and arrays["latents"].shape == (tokens, 64)
            ref = encoder.encode(decode_clip(clip.data, clip.meta, clip_plan(clip.meta, settings)), clip.meta["caption"])
            for key in ("latents", "text"):
                np.testing.assert_allclose(arrays[key], ref[key], rtol=0, atol=1e-6)
    assert grids == expected


def test_a_side_under_16_px_is_too_small_rather_than_upscaled():
    settings = DiffusionSettings(frames=None, max_pixels=4096, min_pixels=1)
    with pytest.raises(SampleRejected) as e:
        clip_plan({"frames": 9, "fps": 16, "height": 15, "width": 64}, settings)
    assert e.value.reason == "too_small" and "never upscaled" in str(e.value)
    plan = clip_plan({"frames": 9, "fps": 16, "height": 33, "width": 47}, settings)
    assert (plan.height, plan.width) == (32, 32)


def test_frames_are_resized_to_cover_and_centre_cropped_not_squashed():
    # a 40 x 80 picture whose middle 40 x 40 is red: cropped to 32 x 32 it is all red; squashed, half
    picture = np.zeros((40, 80, 3), np.uint8)
    picture[:, 20:60] = (255, 0, 0)
    out = resized_frame(Image.fromarray(picture), 32, 32)
    assert out.shape == (32, 32, 3)
    assert (out[:, 2:-2, 0] > 200).all() and (out[:, 2:-2, 1:] < 40).all()
    # an image of the asked aspect is only resized: the same pixels as PIL's resize
    same = Image.fromarray(_frames(1, 64, 96, 0)[0])
    np.testing.assert_array_equal(resized_frame(same, 32, 48), np.asarray(same.resize((48, 32), Image.BICUBIC)))


def test_each_write_worker_runs_the_codecs_on_its_own_gpu(monkeypatch):
    import torch

    from omniweave.data.packing import pack
    from omniweave.diffusion.data import codec_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert [codec_device("auto", k) for k in range(6)] == ["cuda:0", "cuda:1", "cuda:2", "cuda:3", "cuda:0", "cuda:1"]
    assert codec_device("cuda", 5) == "cuda:1" and codec_device("cuda:2", 5) == "cuda:2" and codec_device("cpu", 5) == "cpu"
    # --workers not given: one per GPU for a diffusion write; the CPU default otherwise
    cpus = min(8, __import__("os").cpu_count() or 1)
    assert pack._default_workers("diffusion", "auto") == 4 and pack._default_workers("diffusion", "cuda:1") == 1
    assert pack._default_workers("sft", "auto") == cpus and pack._default_workers("diffusion", "cpu") == cpus
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert codec_device("auto", 3) == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert codec_device("auto", 3) == "cpu" and pack._default_workers("diffusion", "auto") == cpus


def _worker_index(_):
    import os
    import time

    from omniweave.data.packing.pack import _W

    time.sleep(0.2)  # every worker gets tasks
    return os.getpid(), _W["worker_index"]


def test_pool_workers_take_the_indices_0_to_n_minus_1(monkeypatch):
    from omniweave.data.packing import pack

    monkeypatch.setattr(pack, "_init_worker", lambda *a: None)  # forked workers inherit the stub
    seen = dict(pack._pool_map(_worker_index, list(range(6)), 2, (), "workers"))
    assert sorted(set(seen.values())) == [0, 1] and len(seen) == 2  # two processes, one index each
