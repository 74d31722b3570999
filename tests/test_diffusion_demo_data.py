"""The diffusion demo's synthetic clips and its analytic checker: clips are deterministic, stay in the
frame and match their captions; the checker reads every rendered clip, still reads degraded ones
(blur, noise, colour shift: what a small generator makes), and says None rather than guessing; the
written dataset decodes back to readable clips and keeps the held-out combinations out of training."""

from __future__ import annotations

import json

import numpy as np
import pytest

from omniweave.diffusion.checker import read_clip, score
from omniweave.diffusion.demo_data import (
    BACKGROUND, COLOURS, DIRECTIONS, HELD_OUT, SHAPES, caption, clip_spec, combination, read_mp4, render_clip,
    write_clips_dataset, write_mp4,
)

SEEDS = range(64)


def blur(clip: np.ndarray, sigma: float) -> np.ndarray:
    """Separable gaussian blur over H and W (edge padding), float."""
    r = int(np.ceil(3 * sigma))
    k = np.exp(-0.5 * (np.arange(-r, r + 1) / sigma) ** 2)
    k /= k.sum()
    x = clip.astype(np.float64)
    for ax in (1, 2):
        pad = [(0, 0)] * 4
        pad[ax] = (r, r)
        xp = np.pad(x, pad, mode="edge")
        x = sum(k[i] * np.take(xp, range(i, i + x.shape[ax]), axis=ax) for i in range(len(k)))
    return x


def degrade(clip: np.ndarray, rng: np.random.Generator, sigma: float = 1.5, noise: float = 15.0,
            shift: float = 20.0) -> np.ndarray:
    """Blurred, plus gaussian noise, plus a +-``shift`` per-channel colour shift of the whole clip."""
    x = blur(clip, sigma) + rng.normal(0.0, noise, clip.shape) + rng.choice([-shift, shift], size=3)
    return np.clip(np.rint(x), 0, 255).astype(np.uint8)


def test_render_is_deterministic_and_the_shape_stays_in_frame():
    for seed in SEEDS:
        clip = render_clip(seed)
        assert clip.shape == (17, 32, 48, 3) and clip.dtype == np.uint8
        assert np.array_equal(clip, render_clip(seed))
        border = np.concatenate([clip[:, [0, -1]].reshape(-1, 3), clip[:, :, [0, -1]].reshape(-1, 3)])
        assert (border == BACKGROUND).all(), seed  # nothing touches the frame's edge
        area = (clip != BACKGROUND).any(-1).sum(axis=(1, 2))
        assert area.min() > 0.9 * area.max(), (seed, area)  # never cut off
        spec = clip_spec(seed)
        assert spec["speed"] * 16 >= 10.0, spec  # clearly visible motion
    assert not np.array_equal(render_clip(0), render_clip(16))  # same combination, other clip


def test_caption_matches_the_seeds_colour_and_direction():
    assert caption("red", "left", "disc") == "a red disc moving left"
    assert {combination(s) for s in range(16)} == {(c, d) for c in COLOURS for d in DIRECTIONS}
    shapes = set()
    for seed in SEEDS:
        spec = clip_spec(seed)
        colour, direction = combination(seed)
        assert (spec["colour"], spec["direction"]) == (colour, direction)
        assert spec["caption"] == f"a {colour} {spec['shape']} moving {direction}"
        inside = render_clip(seed)[0][(render_clip(seed)[0] != BACKGROUND).any(-1)]
        assert (inside == COLOURS[colour]).all(-1).any()  # the exact palette colour is drawn
        shapes.add(spec["shape"])
    assert shapes == set(SHAPES)


def test_checker_reads_every_rendered_clip():
    result = score([render_clip(s) for s in SEEDS], [combination(s) for s in SEEDS])
    assert result["prompt_accuracy"] == 1.0 and result["n"] == 64, result
    assert min(r["confidence"] for r in result["readings"]) > 0.9
    for frames, height, width in ((5, 16, 16), (33, 48, 80), (9, 64, 32)):  # other sizes, other aspect ratios
        other = score([render_clip(s, frames, height, width) for s in range(16)], [combination(s) for s in range(16)])
        assert other["prompt_accuracy"] == 1.0, (frames, height, width, other)


def test_checker_survives_blur_noise_and_colour_shift():
    rng = np.random.default_rng(0)
    result = score([degrade(render_clip(s), rng) for s in SEEDS], [{"colour": combination(s)[0],
                                                                    "direction": combination(s)[1]} for s in SEEDS])
    assert result["prompt_accuracy"] >= 0.95, {k: v for k, v in result.items() if k != "readings"}
    # a dimmer shape whose own colour is off by 20 levels per channel, then degraded
    dimmed = []
    for seed in SEEDS:
        clip = render_clip(seed).astype(np.float64)
        shape = (clip != BACKGROUND).any(-1, keepdims=True)
        bg = np.array(BACKGROUND, np.float64)
        dimmed.append(degrade(np.where(shape, bg + 0.7 * (clip - bg) + rng.choice([-20, 20], 3), clip), rng))
    assert score(dimmed, [combination(s) for s in SEEDS])["prompt_accuracy"] >= 0.95


def test_checker_says_none_instead_of_guessing():
    rng = np.random.default_rng(1)
    empty = np.full((17, 32, 48, 3), BACKGROUND, np.uint8)
    uniform = rng.integers(0, 256, empty.shape).astype(np.uint8)
    gaussian = np.clip(rng.normal(100, 20, empty.shape), 0, 255).astype(np.uint8)
    for clip in (empty, uniform, gaussian):
        reading = read_clip(clip)
        assert reading["colour"] is None and reading["direction"] is None and reading["confidence"] == 0.0, reading
    for seed in range(8):
        static = np.repeat(render_clip(seed)[:1], 17, axis=0)
        for clip in (static, degrade(static, rng)):
            reading = read_clip(clip)
            assert reading["direction"] is None and reading["colour"] == combination(seed)[0], reading
        shuffled = render_clip(seed)[rng.permutation(17)]  # the shape jumps about: no motion to read
        assert read_clip(shuffled)["direction"] is None
    vanishing = render_clip(2).copy()
    vanishing[::2] = BACKGROUND  # the shape is missing from 9 of 17 frames
    assert read_clip(vanishing)["direction"] is None
    none = score([empty], [("red", "left")])
    assert none["prompt_accuracy"] == 0.0 and none["colour_unread"] == 1 and none["direction_unread"] == 1


def test_written_dataset_decodes_to_clips_the_checker_reads(tmp_path):
    train = write_clips_dataset(tmp_path / "a", 24, seed=3, progress=False)
    assert train == tmp_path / "a" / "train.jsonl"
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    assert len(rows) == 24 and len({r["id"] for r in rows}) == 24
    held = {tuple(p) for p in HELD_OUT}
    for row in rows:
        assert set(row) == {"id", "video", "caption", "colour", "direction", "shape", "seed"}
        assert (row["colour"], row["direction"]) not in held
        assert row["caption"] == caption(row["colour"], row["direction"], row["shape"])
        frames = read_mp4(tmp_path / "a" / row["video"])  # PyAV
        assert frames.shape == (17, 32, 48, 3)
        assert np.abs(frames.astype(int) - render_clip(row["seed"])).max() <= 4  # lossless but YUV rounding
        reading = read_clip(frames)
        assert (reading["colour"], reading["direction"]) == (row["colour"], row["direction"]), (row, reading)
    assert {(r["colour"], r["direction"]) for r in rows} == {(c, d) for c in COLOURS for d in DIRECTIONS} - held

    prompts = [json.loads(line) for line in (tmp_path / "a" / "heldout_prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 4 * len(held)
    assert {(p["colour"], p["direction"]) for p in prompts} == held
    assert not {p["seed"] for p in prompts} & {r["seed"] for r in rows}
    for p in prompts:
        assert set(p) == {"id", "prompt", "colour", "direction", "shape", "seed"}
        assert p["prompt"] == clip_spec(p["seed"])["caption"] == caption(p["colour"], p["direction"], p["shape"])
    refs = score([render_clip(p["seed"]) for p in prompts], prompts)  # the reference clips of the prompts
    assert refs["prompt_accuracy"] == 1.0
    meta = json.loads((tmp_path / "a" / "demo.json").read_text())
    assert meta["train_clips"] == 24 and meta["frames"] == 17 and meta["codec"] in ("libx264", "mpeg4")

    again = write_clips_dataset(tmp_path / "b", 24, seed=3, progress=False)  # deterministic
    assert again.read_text() == train.read_text()
    held_a, held_b = (tmp_path / d / "heldout_prompts.jsonl" for d in "ab")
    assert held_a.read_text() == held_b.read_text()


def test_no_held_out_combinations_and_a_progress_bar(tmp_path, capsys):
    train = write_clips_dataset(tmp_path, 16, held_out=(), frames=5, height=16, width=32)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    assert len({(r["colour"], r["direction"]) for r in rows}) == 16
    assert (tmp_path / "heldout_prompts.jsonl").read_text() == ""
    assert "diffusion demo clips" in capsys.readouterr().err


def test_mpeg4_fallback_still_reads(tmp_path):
    for seed in range(8):
        write_mp4(tmp_path / "c.mp4", render_clip(seed), codec="mpeg4")
        reading = read_clip(read_mp4(tmp_path / "c.mp4"))
        assert (reading["colour"], reading["direction"]) == combination(seed)


def test_bad_arguments_are_clear_errors(tmp_path):
    for frames in (16, 4, 1, 18):
        with pytest.raises(ValueError, match=r"4k \+ 1"):
            render_clip(0, frames=frames)
    with pytest.raises(ValueError, match="height must be a positive multiple of 16"):
        render_clip(0, height=30)
    with pytest.raises(ValueError, match="width must be a positive multiple of 16"):
        render_clip(0, width=8)
    with pytest.raises(ValueError, match="seed"):
        render_clip(-1)
    with pytest.raises(ValueError, match=r"4k \+ 1"):
        write_clips_dataset(tmp_path / "x", 4, frames=16, progress=False)
    assert not (tmp_path / "x").exists()  # refused before anything was written
    with pytest.raises(ValueError, match="unknown combinations"):
        write_clips_dataset(tmp_path / "y", 4, held_out=[("purple", "left")], progress=False)
    with pytest.raises(ValueError, match="no combination"):
        write_clips_dataset(tmp_path / "y", 4, held_out=[(c, d) for c in COLOURS for d in DIRECTIONS], progress=False)
    with pytest.raises(ValueError, match="expected frames"):
        read_clip(np.zeros((17, 32, 48), np.uint8))
    with pytest.raises(ValueError, match="2 clips but 1"):
        score([render_clip(0), render_clip(1)], [("red", "left")])
