"""``omniweave data convert --format lerobot`` (omniweave/data/sources/lerobot_convert.py) through the CLI
entry on the hand-written dataset of tests/lerobot_factory.py: every sample equals what
LeRobotDataset.frames(H, S) yields, the referenced videos are copied byte for byte, every dropped
frame is counted and listed with its reason, bad flags are one-line errors, a crash leaves no
shard in place, and ``data inspect`` summarises the result."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from omniweave.cli import main
from omniweave.data.sources import lerobot_convert
from omniweave.data.sources.lerobot import LeRobotDataset
from omniweave.data.sources.shards import RawDataset, parse_sample_bytes
from tests import lerobot_factory as F
from tests.test_lerobot_reader import TOP, set_frame


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return F.write_dataset(tmp_path_factory.mktemp("lerobot"))


def convert(src: Path, out: Path, *flags: str) -> int:
    return main(["data", "convert", "--format", "lerobot", "--input", str(src), "--output", str(out),
                 "--no-progress", *flags])


def samples(raw: Path) -> list[dict]:
    ds = RawDataset(raw)
    out = []
    for i in range(len(ds)):
        key, parts = parse_sample_bytes(ds.read_bytes(i))
        assert key == f"s{i:09d}" and list(parts) == ["vla.json"]
        out.append(json.loads(parts["vla.json"]))
    return out


def report(raw: Path) -> dict:
    return json.loads((raw / "convert_report.json").read_text())


def rejects(raw: Path) -> list[tuple]:
    return [tuple(json.loads(x).values()) for x in (raw / "rejects.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("horizon, stride", [(5, 1), (5, 2)])
def test_every_sample_is_what_the_reader_yields(clean, tmp_path, horizon, stride):
    raw = tmp_path / "raw"
    assert convert(clean, raw, "--horizon", str(horizon), "--stride", str(stride), "--maxcount", "4") == 0
    expected = list(LeRobotDataset(clean).frames(horizon, stride))
    got = samples(raw)
    assert len(got) == len(expected) == sum(-(-n // stride) for n in F.LENGTHS)
    assert any(any(ex["action_is_pad"]) for ex in expected)  # horizon 5 > episode 1's 4 frames: padding covered
    for s, ex in zip(got, expected):
        for k in ("episode_index", "frame_index", "index", "task", "timestamp"):
            assert s[k] == ex[k], k
        np.testing.assert_array_equal(np.asarray(s["state"], np.float32), ex["state"])
        np.testing.assert_array_equal(np.asarray(s["actions"], np.float32), ex["actions"])
        assert s["action_is_pad"] == ex["action_is_pad"].tolist()
        assert s["cameras"] == {k: {"file": p, "timestamp": ts} for k, (p, ts) in ex["cameras"].items()}
    referenced = {c["file"] for s in got for c in s["cameras"].values()}
    assert {str(p.relative_to(raw)) for p in (raw / "videos").rglob("*") if p.is_file()} == referenced
    for rel in referenced:
        assert (raw / rel).read_bytes() == (clean / rel).read_bytes()
    rep = report(raw)
    assert rep["kind"] == "vla" and rep["input"] == rep["written"] + rep["rejected"] == len(expected)
    assert rep["rejected"] == 0 and (raw / "rejects.jsonl").read_text() == ""
    assert rep["short_episodes"] == {"episodes": 1, "frames": 4}  # episode 1: 4 frames < 5, padded
    assert (rep["horizon"], rep["stride"]) == (horizon, stride) and [s["count"] for s in rep["shards"]][0] == 4
    assert "sample_type: omniweave_vla" in (raw / ".nv-meta/dataset.yaml").read_text()
    assert not (raw / ".work").exists()
    stats = json.loads((raw / "lerobot_stats.json").read_text())
    q = LeRobotDataset(clean).quantile_stats()
    for name in ("state", "action"):
        for f in ("q01", "q99", "mean", "std"):
            np.testing.assert_array_equal(np.asarray(stats[name][f], np.float32), q[name][f])
    assert (stats["fps"], stats["horizon"], stats["stride"], stats["state_dim"], stats["action_dim"]) == \
        (F.FPS, horizon, stride, 2, 3)
    assert stats["cameras"] == list(F.CAMERAS) and stats["codebase_version"] == "v3.0"


def test_only_referenced_videos_are_copied_and_short_episodes_drop_when_asked(clean, tmp_path, capsys):
    """Horizon 8: episodes 0 (7 frames) and 1 (4) are short. By default their chunks are padded (no
    drop) and the report and summary still count them; --drop-short-episodes drops their 11 frames
    with the reason, and only the videos the kept episode references are copied."""
    padded = tmp_path / "padded"
    assert convert(clean, padded, "--horizon", "8") == 0
    rep = report(padded)
    assert rep["short_episodes"] == {"episodes": 2, "frames": 11} and rep["rejected"] == 0
    assert rep["written"] == sum(F.LENGTHS) and rep["drop_short_episodes"] is False
    assert "2 episode(s) shorter than H=8 (11 frames): their action chunks padded" in capsys.readouterr().out

    raw = tmp_path / "raw"
    assert convert(clean, raw, "--horizon", "8", "--drop-short-episodes") == 0  # episodes 0 (7) and 1 (4) short
    assert "2 episode(s) shorter than H=8 (11 frames): dropped" in capsys.readouterr().out
    assert {s["episode_index"] for s in samples(raw)} == {2}
    assert sorted(str(p.relative_to(raw)) for p in (raw / "videos").rglob("*.mp4")) == [
        f"videos/{TOP}/chunk-000/file-001.mp4", "videos/observation.images.wrist/chunk-000/file-000.mp4"]
    rep = report(raw)
    assert rep["rejected_by_reason"] == {"episode_shorter_than_horizon": 11} and rep["written"] == 9
    assert rep["short_episodes"] == {"episodes": 2, "frames": 11}
    assert sorted(rejects(raw)) == sorted([(0, t, "episode_shorter_than_horizon") for t in range(7)]
                                          + [(1, t, "episode_shorter_than_horizon") for t in range(4)])
    assert convert(clean, tmp_path / "strict", "--horizon", "8", "--drop-short-episodes", "--strict") == 1


def test_bad_frames_are_counted_and_listed_with_their_reasons(tmp_path):
    def edits(rows):
        set_frame(0, 2, "observation.state", [float("nan"), 1.0])(rows)
        set_frame(0, 6, "action", [0.0, float("nan"), 0.0])(rows)  # in the chunks of frames 5 and 6
        for r in rows:
            if r["episode_index"] == 1:
                r["task_index"] = 5  # no text in meta/tasks.parquet
    root = F.write_dataset(tmp_path / "ds", edit_frames=edits)
    (root / f"videos/{TOP}/chunk-000/file-001.mp4").unlink()  # episode 2's top view
    raw = tmp_path / "raw"
    assert convert(root, raw, "--horizon", "2") == 0
    assert convert(root, tmp_path / "strict", "--horizon", "2", "--strict") == 1
    rep = report(raw)
    assert rep["rejected_by_reason"] == {"missing_camera": 9, "nan_action": 2, "nan_state": 1, "unknown_task": 4}
    assert rep["input"] == sum(F.LENGTHS) == rep["written"] + rep["rejected"] and rep["written"] == 4
    assert [(s["episode_index"], s["frame_index"]) for s in samples(raw)] == [(0, 0), (0, 1), (0, 3), (0, 4)]
    assert sorted(rejects(raw)) == sorted([(0, 2, "nan_state"), (0, 5, "nan_action"), (0, 6, "nan_action")]
                                          + [(1, t, "unknown_task") for t in range(4)]
                                          + [(2, t, "missing_camera") for t in range(9)])
    assert not (raw / f"videos/{TOP}/chunk-000/file-001.mp4").exists()


def test_every_frame_dropped_exits_1(tmp_path, capsys):
    root = F.write_dataset(tmp_path / "ds")
    for f in (root / "videos").rglob("*.mp4"):
        f.unlink()
    assert convert(root, tmp_path / "raw", "--horizon", "2") == 1
    assert report(tmp_path / "raw")["rejected_by_reason"] == {"missing_camera": sum(F.LENGTHS)}
    capsys.readouterr()
    assert main(["data", "inspect", str(tmp_path / "raw")]) == 2
    assert f"every one of its {sum(F.LENGTHS)} frame(s) was rejected (missing_camera" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [
    (["--media-dir", "."], "--media-dir only apply to conversations"),
    (["--mapping", "m.yaml"], "--mapping only apply to conversations"),
    (["--role-tag", "who"], "--role-tag only apply to conversations"),
    (["--max-media-size", "10M"], "--max-media-size only apply"),
])
def test_conversation_flags_are_refused_with_lerobot(clean, tmp_path, capsys, flags, message):
    assert convert(clean, tmp_path / "raw", *flags) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "raw").exists()


@pytest.mark.parametrize("flag", [["--horizon", "5"], ["--stride", "2"], ["--drop-short-episodes"]])
def test_lerobot_flags_are_refused_without_it(tmp_path, capsys, flag):
    (tmp_path / "in.jsonl").write_text('{"messages": [{"role": "user", "content": "a"}]}\n')
    assert main(["data", "convert", "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "raw"),
                 "--no-progress", *flag]) == 2
    err = capsys.readouterr().err
    assert f"{flag[0]} only apply to --format lerobot" in err and err.count("\n") == 1


def test_bad_inputs_are_one_line_errors(clean, tmp_path, capsys):
    old = F.write_dataset(tmp_path / "v21", edit_info=lambda i: i.update(codebase_version="v2.1"), videos=False)
    cases = [(old, "only 'v3.0' is read"), (tmp_path / "nowhere", "not a directory"),
             (clean, "must lie outside the dataset")]
    for src, message in cases:
        out = clean / "raw" if message.startswith("must") else tmp_path / "raw"
        assert convert(src, out) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert main(["data", "convert", "--format", "lerobot", "--input", str(clean), str(clean), "--output",
                 str(tmp_path / "raw")]) == 2
    assert "one LeRobot v3.0 dataset directory" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: below the least value
        convert(clean, tmp_path / "raw", "--horizon", "0")
    assert "--horizon: 0 is below 1" in capsys.readouterr().err


def test_a_crash_leaves_no_shard_in_place_and_a_rerun_completes(clean, tmp_path, monkeypatch):
    raw = tmp_path / "raw"

    def crash(*a, **k):
        raise OSError("disk on fire")
    monkeypatch.setattr(lerobot_convert.shutil, "copyfile", crash)  # after the shards are written into .work
    with pytest.raises(OSError, match="disk on fire"):
        convert(clean, raw, "--horizon", "3", "--maxcount", "5")
    assert list((raw / ".work").glob("part-*.tar"))  # finished parts exist, but only under .work
    assert not list(raw.glob("shard-*")) and not (raw / "videos").exists() and not (raw / ".nv-meta").exists()
    assert not (raw / "convert_report.json").exists()
    monkeypatch.undo()
    assert convert(clean, raw, "--horizon", "3", "--maxcount", "5") == 0
    assert len(RawDataset(raw)) == sum(F.LENGTHS) and not (raw / ".work").exists()
    # converting again into the same RAW replaces the previous output (its videos too)
    assert convert(clean, raw, "--horizon", "8", "--drop-short-episodes") == 0
    assert len(RawDataset(raw)) == 9 and not (raw / f"videos/{TOP}/chunk-000/file-000.mp4").exists()


def test_inspect_summarises_vla_shards(clean, tmp_path, capsys):
    raw = tmp_path / "raw"
    assert convert(clean, raw, "--horizon", "5", "--stride", "2") == 0
    capsys.readouterr()
    assert main(["data", "inspect", str(raw)]) == 0
    out = capsys.readouterr().out
    assert "11 VLA samples, 1 shard(s), 3 episode(s), 2 task(s), 2 camera(s)" in out
    assert "horizon 5: 11; stride 2" in out and "pick up the red cube" in out and f"{TOP}: videos/" in out
