"""``omniweave data inspect`` on video-diffusion data: a clips conversion (``convert --format clips``)
and a packed diffusion dataset (manifest kind ``diffusion``) are summarised as clips, never as
conversations or token text."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from omniweave.cli import main
from omniweave.diffusion.demo_data import write_clips_dataset


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """6 demo video clips + 1 image (dropped as too_short by the 17-frame recipe) + 1 row whose video
    is missing (rejected by convert) -> RAW -> packed with tiny_diffusion (built once: ~10-40 s)."""
    tmp = tmp_path_factory.mktemp("inspect_diffusion")
    write_clips_dataset(tmp / "clips", num_clips=6, progress=False)
    Image.fromarray(np.full((32, 48, 3), 200, np.uint8)).save(tmp / "clips" / "still.png")
    with open(tmp / "clips" / "train.jsonl", "a") as f:
        f.write(json.dumps({"id": "still", "image": "still.png", "caption": "a grey still frame"}) + "\n")
        f.write(json.dumps({"id": "gone", "video": "videos/nope.mp4", "caption": "a missing clip"}) + "\n")
    assert main(["data", "convert", "--format", "clips", "--input", str(tmp / "clips/train.jsonl"),
                 "--media-dir", str(tmp / "clips"), "--output", str(tmp / "raw"), "--no-progress"]) == 0
    assert main(["data", "pack", "--input", str(tmp / "raw"), "--output", str(tmp / "packed"),
                 "--recipe", "tiny_diffusion", "--workers", "1"]) == 0
    rows = [json.loads(line) for line in (tmp / "clips/train.jsonl").read_text().splitlines()]
    return tmp, rows


def test_inspect_clips_raw(data, capsys):
    tmp, rows = data
    capsys.readouterr()
    assert main(["data", "inspect", str(tmp / "raw"), "--show", "100"]) == 0
    out = capsys.readouterr().out
    assert "inspect: 7 clips, 1 shard(s), 6 video(s), 1 image(s), 103 frames" in out
    assert "videos 6, images 1" in out
    assert "frames min 1  median 17  max 17  (n=7), total 103" in out
    assert "fps    min 16.00" in out and "unknown 1" in out
    assert "48x32" in out
    for row in rows[:7]:  # every written clip shown: its id and caption
        assert f"id={row['id']}" in out and f"caption: {row['caption']}" in out
    assert "video clip.mp4:" in out and "17 frame(s) @ 16 fps, 48x32" in out
    assert "image clip.png:" in out and "1 frame(s), 48x32" in out
    assert "input 8 rows: written 7, rejected 1" in out and "media_missing" in out
    assert "rejects.jsonl" in out


def test_inspect_clips_raw_show_0(data, capsys):
    tmp, rows = data
    capsys.readouterr()
    assert main(["data", "inspect", str(tmp / "raw"), "--show", "0"]) == 0
    out = capsys.readouterr().out
    assert "inspect: 7 clips" in out and "caption:" not in out and rows[0]["caption"] not in out


def test_inspect_packed_diffusion(data, capsys):
    tmp, rows = data
    capsys.readouterr()
    assert main(["data", "inspect", str(tmp / "packed")]) == 0
    out = capsys.readouterr().out
    assert "<|endoftext|>" not in out and "text-only" not in out
    assert "packed diffusion dataset" in out
    assert "inspect: 1 packs, 6 clips, 180/256 tokens" in out
    assert "6 clips in 1 packs" in out and "fill 180/256 (70.31%)" in out
    assert "float32 x 64: 6" in out and "text states width 32: 6" in out
    assert "clips packed 6/7, dropped 1" in out and "too_short" in out
    assert "pack 0: 180/256 tokens, 6 clips" in out
    shown = [line for line in out.splitlines() if line.startswith("  clip ")]
    assert len(shown) == 6
    for line, row in zip(shown, rows):
        assert row["id"] in line and "grid 5x2x3  30 tokens  17 frames  32x48  text " in line


def test_inspect_packed_diffusion_show_0(data, capsys):
    tmp, _ = data
    capsys.readouterr()
    assert main(["data", "inspect", str(tmp / "packed"), "--show", "0"]) == 0
    out = capsys.readouterr().out
    assert "inspect: 1 packs, 6 clips" in out and "grid 5x2x3" not in out and "pack 0:" not in out
    assert "<|endoftext|>" not in out
