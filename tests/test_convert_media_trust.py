"""Issue 31, items 2 and 3 at convert: a media path is resolved and must be a regular file inside
``--media-dir`` (a symlink out, a FIFO, a device: a counted reject, never a read), at most
``--max-media-size`` bytes; an image is decoded whole, so a truncated JPEG or a PNG whose pixels do
not decode is rejected here, and one over ``--max-image-pixels`` is rejected from its header."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from data_factory import blank_png, png_bytes, png_with_garbage_pixels, truncated_jpeg
from omniweave.data.sources.shards import RawDataset
from test_shards import run_convert

REPO = Path(__file__).resolve().parents[1]
SECRET = b"SECRET-OUTSIDE-BYTES-" * 8


def row(image: str) -> str:
    return json.dumps({"messages": [{"role": "user", "content": "<image>?"}, {"role": "assistant", "content": "ok"}],
                       "images": [image]})


def convert_subprocess(root: Path, *extra: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """convert in a child with a timeout: a regression that blocks (a FIFO) fails instead of hanging."""
    cmd = [sys.executable, "-m", "omniweave", "data", "convert", "--input", str(root / "in.jsonl"), "--media-dir",
           str(root / "media"), "--output", str(root / "raw"), "--workers", "1", "--no-progress", *extra]
    return subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=timeout)


def rejects_of(raw: Path) -> dict[int, dict]:
    return {r["row"]: r for r in map(json.loads, (raw / "rejects.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """One row per hostile media file, converted in a child process with a timeout."""
    root = tmp_path_factory.mktemp("hostile")
    media = root / "media"
    (media / "sub").mkdir(parents=True)
    (media / "ok.png").write_bytes(png_bytes(16, 16))
    (root / "secret.png").write_bytes(SECRET)
    (media / "escape.png").symlink_to(root / "secret.png")  # a symlink inside, pointing out
    (media / "sub/up.png").symlink_to("../../secret.png")  # relative, two levels out
    (media / "zero.png").symlink_to("/dev/zero")
    (media / "inside.png").symlink_to(media / "ok.png")  # a symlink that stays inside: fine
    os.mkfifo(media / "fifo.png")
    (media / "dir.png").mkdir()
    (media / "truncated.jpg").write_bytes(truncated_jpeg())
    (media / "garbage_pixels.png").write_bytes(png_with_garbage_pixels(png_bytes(20, 30)))
    (media / "huge.png").write_bytes(blank_png(12000))
    (media / "big.png").write_bytes(png_bytes(64, 64) + b"\0" * 300_000)  # over --max-media-size 200K
    cases = [("ok.png", None), ("escape.png", "media_path_escapes"), ("sub/up.png", "media_path_escapes"),
             ("zero.png", "media_path_escapes"), ("inside.png", None), ("fifo.png", "not_a_regular_file"),
             ("dir.png", "not_a_regular_file"), ("truncated.jpg", "undecodable_media"),
             ("garbage_pixels.png", "undecodable_media"), ("huge.png", "image_too_large"),
             ("big.png", "media_too_large")]
    (root / "in.jsonl").write_text("".join(row(name) + "\n" for name, _ in cases))
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    done = convert_subprocess(root, "--max-media-size", "200K")
    peak_kb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    assert done.returncode == 0, done.stderr
    return root, cases, rejects_of(root / "raw"), peak_kb if peak_kb > before else None


@pytest.mark.parametrize("name, reason", [
    ("escape.png", "media_path_escapes"), ("sub/up.png", "media_path_escapes"), ("zero.png", "media_path_escapes"),
    ("fifo.png", "not_a_regular_file"), ("dir.png", "not_a_regular_file"), ("truncated.jpg", "undecodable_media"),
    ("garbage_pixels.png", "undecodable_media"), ("huge.png", "image_too_large"), ("big.png", "media_too_large"),
])
def test_hostile_media_is_a_counted_reject_with_its_reason(hostile, name, reason):
    _, cases, rejects, _ = hostile
    i = [n for n, _ in cases].index(name)
    assert rejects[i]["reason"] == reason, rejects[i]
    assert name in rejects[i]["message"]


def test_no_byte_from_outside_the_media_dir_reaches_a_shard(hostile):
    root, cases, _, _ = hostile
    report = json.loads((root / "raw/convert_report.json").read_text())
    assert report["written"] == 2 and report["rejected"] == len(cases) - 2  # ok.png and inside.png
    for shard in (root / "raw").glob("shard-*.tar"):
        assert b"SECRET-OUTSIDE" not in shard.read_bytes()
    ds = RawDataset(root / "raw")
    assert [s.media["img0.png"] for s in ds] == [(root / "media/ok.png").read_bytes()] * 2


def test_a_huge_image_is_rejected_from_its_header_without_decoding(hostile):
    peak_kb = hostile[3]
    if peak_kb is None:
        pytest.skip("an earlier child process of this session already used more memory: no peak to read")
    assert peak_kb < 1_000_000, f"convert peaked at {peak_kb / 1e6:.1f} GB; 12000x12000 decoded is 2 GB"


def test_the_pixel_limit_is_a_flag(tmp_path):
    (tmp_path / "media").mkdir()
    (tmp_path / "media/a.png").write_bytes(png_bytes(40, 50))
    (tmp_path / "in.jsonl").write_text(row("a.png") + "\n")
    assert run_convert("--input", str(tmp_path / "in.jsonl"), "--media-dir", str(tmp_path / "media"), "--output",
                       str(tmp_path / "raw"), "--max-image-pixels", "1999") == 1  # its only row rejected
    assert rejects_of(tmp_path / "raw")[0]["reason"] == "image_too_large"
    assert run_convert("--input", str(tmp_path / "in.jsonl"), "--media-dir", str(tmp_path / "media"), "--output",
                       str(tmp_path / "raw"), "--max-image-pixels", "2000") == 0
    assert json.loads((tmp_path / "raw/convert_report.json").read_text())["written"] == 1


@pytest.mark.parametrize("flag, value", [("--max-image-pixels", "0"), ("--max-image-pixels", "178956971"),
                                         ("--max-media-size", "0")])
def test_limits_out_of_range_are_one_line_errors(tmp_path, capsys, flag, value):
    (tmp_path / "in.jsonl").write_text(row("a.png") + "\n")
    assert run_convert("--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "raw"), flag, value) == 2
    assert "--max-image-pixels must be in 1..178956970" in capsys.readouterr().err


def test_a_path_with_a_nul_character_is_missing_media(tmp_path):
    (tmp_path / "in.jsonl").write_text(row("a\0.png") + "\n")
    assert run_convert("--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "raw")) == 1  # every row rejected
    assert rejects_of(tmp_path / "raw")[0]["reason"] == "missing_media"
