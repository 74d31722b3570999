"""``omniweave data convert --format clips`` (omniweave/data/sources/clips_convert.py) through the CLI on
the diffusion demo's real MP4s plus hand-made rows: every row written or rejected with its reason,
``ClipRawDataset`` reads back the source bytes and PyAV's probe, --strict names the first bad row,
flags of other formats are refused, --maxcount cuts shards, a rerun replaces the output, and a
conversation RAW is refused by the reader."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image

from omniweave.cli import main
from omniweave.data.sources.clips_convert import ClipRawDataset, ClipSample, NotClipsError
from omniweave.diffusion.demo_data import write_clips_dataset

NUM_CLIPS = 12
# (reason or None for a written row, row): the extra rows after the demo's clips, media under the demo folder
EXTRA = [
    (None, {"id": "pic", "image": "images/pic.png", "caption": "a still picture"}),
    (None, {"video": "ABS_VIDEO", "caption": "an absolute path, no id"}),
    ("no_caption", {"id": "nocap", "video": "videos/clip_000000.mp4"}),
    ("no_caption", {"id": "blank", "video": "videos/clip_000000.mp4", "caption": "   "}),
    ("no_caption", {"id": "numcap", "video": "videos/clip_000000.mp4", "caption": 7}),
    ("media_missing", {"id": "gone", "video": "videos/nope.mp4", "caption": "missing"}),
    ("media_unreadable", {"id": "garbage", "video": "videos/garbage.mp4", "caption": "garbage bytes"}),
    ("media_unreadable", {"id": "badpng", "image": "images/garbage.png", "caption": "not an image"}),
    ("media_unreadable", {"id": "folder", "video": "videos", "caption": "a directory"}),
    ("no_frames", {"id": "empty", "video": "videos/empty.avi", "caption": "a video stream, no frames"}),
    ("both_media", {"id": "both", "video": "videos/clip_000001.mp4", "image": "images/pic.png", "caption": "two"}),
    ("no_media", {"id": "neither", "caption": "nothing to show"}),
    ("bad_row", {"id": ["x"], "video": "videos/clip_000001.mp4", "caption": "list id"}),
    ("bad_row", [1, 2]),
    ("bad_json", '{"caption": "oops'),
]


def convert(inputs, out: Path, *flags: str, media_dir: Path | None = None) -> int:
    argv = ["data", "convert", "--format", "clips", "--input", *map(str, inputs), "--output", str(out), "--no-progress"]
    return main([*argv, *(["--media-dir", str(media_dir)] if media_dir else []), *flags])


def pyav_probe(path: Path) -> tuple[int, float, int, int]:
    with av.open(str(path)) as c:
        s = c.streams.video[0]
        decoded = sum(1 for _ in c.decode(s))
        assert s.frames in (0, decoded)
        return decoded, float(s.average_rate), s.codec_context.width, s.codec_context.height


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("clips")
    train = write_clips_dataset(root / "demo", num_clips=NUM_CLIPS, progress=False)
    d = train.parent
    (d / "images").mkdir()
    Image.fromarray(np.arange(20 * 30 * 3, dtype=np.uint8).reshape(20, 30, 3)).save(d / "images/pic.png")
    (d / "images/garbage.png").write_bytes(b"not an image at all")
    (d / "videos/garbage.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 broken" * 8)
    with av.open(str(d / "videos/empty.avi"), "w", format="avi") as out:  # a video stream, 0 frames
        st = out.add_stream("mpeg4", rate=Fraction(16))
        st.width, st.height, st.pix_fmt = 32, 32, "yuv420p"
        out.start_encoding()
    absolute = str((d / "videos/clip_000002.mp4").resolve())
    lines = [r if isinstance(r, str) else json.dumps(r).replace("ABS_VIDEO", absolute) for _, r in EXTRA]
    extra = root / "extra.jsonl"
    extra.write_text("\n".join(lines) + "\n\n")  # a blank line is not a row
    return root, train, extra


@pytest.fixture(scope="module")
def converted(demo):
    root, train, extra = demo
    raw = root / "raw"
    assert convert([train, extra], raw, media_dir=train.parent) == 0
    return raw


def test_report_counts_every_row(demo, converted):
    rep = json.loads((converted / "convert_report.json").read_text())
    expected = {}
    for reason, _ in EXTRA:
        if reason:
            expected[reason] = expected.get(reason, 0) + 1
    written = NUM_CLIPS + sum(1 for reason, _ in EXTRA if reason is None)
    assert rep["kind"] == "clips"
    assert rep["input"] == NUM_CLIPS + len(EXTRA) == rep["written"] + rep["rejected"]
    assert rep["written"] == written and rep["rejected"] == sum(expected.values())
    assert rep["rejected_by_reason"] == dict(sorted(expected.items()))
    assert rep["media_items"] == {"video": NUM_CLIPS + 1, "image": 1}
    rejects = [json.loads(x) for x in (converted / "rejects.jsonl").read_text().splitlines()]
    extra = str(demo[2])
    want = [(extra, i + 1, r) for i, (r, _) in enumerate(EXTRA) if r]
    assert [(x["input"], x["line"], x["reason"]) for x in rejects] == want
    assert all(set(x) == {"input", "line", "id", "reason", "detail"} and x["detail"] for x in rejects)
    assert {x["id"] for x in rejects if x["reason"] == "no_caption"} == {"nocap", "blank", "numcap"}
    assert "sample_type: omniweave_clips" in (converted / ".nv-meta/dataset.yaml").read_text()
    assert not (converted / ".work").exists()


def test_reader_returns_source_bytes_and_probe(demo, converted):
    root, train, extra = demo
    rows = [json.loads(x) for x in train.read_text().splitlines()]
    ds = ClipRawDataset(converted)
    assert len(ds) == NUM_CLIPS + 2
    samples = list(ds)
    assert [s.key for s in samples] == [ds[i].key for i in range(len(ds))]
    for i, row in enumerate(rows):
        s = ds[i]
        assert isinstance(s, ClipSample) and s.key == f"s{i:09d}"
        src = train.parent / row["video"]
        assert s.data == src.read_bytes()
        assert s.meta["id"] == row["id"] and s.meta["caption"] == row["caption"] and s.meta["media"] == "video"
        assert s.meta["file"] == "clip.mp4" and s.meta["source"] == f"{train}:{i + 1}"
        assert (s.meta["frames"], s.meta["fps"], s.meta["width"], s.meta["height"]) == pyav_probe(src) == (17, 16.0, 48, 32)
    pic, absolute = ds[NUM_CLIPS], ds[NUM_CLIPS + 1]
    assert pic.key == f"s{NUM_CLIPS:09d}" and pic.data == (train.parent / "images/pic.png").read_bytes()
    assert {k: pic.meta[k] for k in ("id", "media", "file", "frames", "fps", "width", "height")} == \
        {"id": "pic", "media": "image", "file": "clip.png", "frames": 1, "fps": None, "width": 30, "height": 20}
    assert absolute.meta["id"] == str(NUM_CLIPS + 1)  # no id: the row's position across the inputs
    assert absolute.meta["source"] == f"{extra}:2"
    assert absolute.data == (train.parent / "videos/clip_000002.mp4").read_bytes()


def test_strict_names_the_first_bad_row(demo, tmp_path, capsys):
    root, train, extra = demo
    assert convert([train, extra], tmp_path / "raw", "--strict", media_dir=train.parent) == 2
    err = capsys.readouterr().err
    assert f"{extra}:3" in err and "'nocap'" in err and "no_caption" in err and err.count("\n") == 1
    assert not list((tmp_path / "raw").glob("shard-*")) and not (tmp_path / "raw/.work").exists()
    assert convert([train], tmp_path / "ok", "--strict", media_dir=train.parent) == 0  # a clean input passes


@pytest.mark.parametrize("flags, named", [(["--horizon", "4"], "--horizon"), (["--stride", "2"], "--stride"),
                                          (["--mapping", "m.yaml"], "--mapping"), (["--dataset", "a"], "--dataset"),
                                          (["--messages-key", "conv"], "--messages-key")])
def test_flags_of_other_formats_are_refused(demo, tmp_path, capsys, flags, named):
    assert convert([demo[1]], tmp_path / "raw", *flags) == 2
    err = capsys.readouterr().err
    assert named in err and "--format clips" in err and err.count("\n") == 1
    assert not (tmp_path / "raw").exists()


def test_maxcount_cuts_shards_and_a_rerun_replaces_the_output(demo, tmp_path):
    root, train, extra = demo
    raw = tmp_path / "raw"
    assert convert([train, extra], raw, "--maxcount", "5", media_dir=train.parent) == 0
    rep = json.loads((raw / "convert_report.json").read_text())
    assert [s["count"] for s in rep["shards"]] == [5, 5, 4]
    assert sorted(p.name for p in raw.glob("shard-*.tar")) == [f"shard-{i:06d}.tar" for i in range(3)]
    first = [(s.key, s.meta, s.data) for s in ClipRawDataset(raw)]
    assert convert([train], raw, "--maxcount", "100", media_dir=train.parent) == 0  # fewer shards, no stale one
    assert sorted(p.name for p in raw.glob("shard-*")) == ["shard-000000.tar", "shard-000000.tar.idx"]
    assert (raw / "rejects.jsonl").read_text() == ""
    again = [(s.key, s.meta, s.data) for s in ClipRawDataset(raw)]
    assert again == first[:NUM_CLIPS]


def test_json_array_input_and_default_media_dir(demo, tmp_path):
    root, train, extra = demo
    rows = [{"id": "a", "video": "videos/clip_000003.mp4", "caption": "x"}, {"image": "images/pic.png"}]
    src = train.parent / "rows.json"
    src.write_text(json.dumps(rows, indent=1))
    try:
        assert convert([src], tmp_path / "raw") == 0  # media relative to the input's folder
    finally:
        src.unlink()
    ds = ClipRawDataset(tmp_path / "raw")
    assert len(ds) == 1 and ds[0].meta["source"] == f"{src}:1"
    rejects = [json.loads(x) for x in (tmp_path / "raw/rejects.jsonl").read_text().splitlines()]
    assert [(r["line"], r["id"], r["reason"]) for r in rejects] == [(2, "1", "no_caption")]


def test_every_row_rejected_exits_1(demo, tmp_path, capsys):
    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps({"video": "nope.mp4", "caption": "x"}) + "\n")
    assert convert([src], tmp_path / "raw") == 1
    assert "every row was rejected (media_missing: 1)" in capsys.readouterr().err


def test_reader_refuses_a_conversation_raw(tmp_path):
    src = tmp_path / "conv.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "2+2?"},
                                            {"role": "assistant", "content": "4"}]}) + "\n")
    raw = tmp_path / "raw"
    assert main(["data", "convert", "--input", str(src), "--output", str(raw), "--no-progress", "--workers", "1"]) == 0
    with pytest.raises(NotClipsError, match="RAW holds conversations; convert clips with --format clips"):
        ClipRawDataset(raw)


def test_frames_counted_by_decoding_when_the_container_has_no_count(tmp_path, capsys):
    with av.open(str(tmp_path / "V.MKV"), "w", format="matroska") as out:  # Matroska stores no frame count
        st = out.add_stream("mpeg4", rate=Fraction(10))
        st.width, st.height, st.pix_fmt = 32, 16, "yuv420p"
        for i in range(7):
            out.mux(st.encode(av.VideoFrame.from_ndarray(np.full((16, 32, 3), 20 * i, np.uint8), format="rgb24")))
        out.mux(st.encode())
    src = tmp_path / "rows.jsonl"
    src.write_text(json.dumps({"id": "m", "video": "V.MKV", "caption": "grey"}) + "\n")
    assert convert([src], tmp_path / "raw") == 0
    assert "convert: 1 rows -> 1 clips (1 video(s), 0 image(s), 7 frames) in 1 shard(s)" in capsys.readouterr().out
    meta = ClipRawDataset(tmp_path / "raw")[0].meta
    assert (meta["frames"], meta["fps"], meta["width"], meta["height"], meta["file"]) == (7, 10.0, 32, 16, "clip.mkv")
