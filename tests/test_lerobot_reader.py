"""The LeRobot v3.0 reader (omniweave/data/sources/lerobot.py) on a hand-written dataset
(tests/lerobot_factory.py): examples, action chunks and their padding, camera references (checked by
decoding), counted drops, normalisation statistics."""

from __future__ import annotations

import json

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from omniweave.data.sources.lerobot import LeRobotDataset, normalize, unnormalize
from omniweave.errors import UserError
from tests import lerobot_factory as F

TOP, WRIST = "observation.images.top", "observation.images.wrist"


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return F.write_dataset(tmp_path_factory.mktemp("lerobot"))


def expected_actions(ep: int, t: int, horizon: int):
    start, n = F.starts()[ep], F.LENGTHS[ep]
    g = [start + min(t + i, n - 1) for i in range(horizon)]
    actions = np.array([[10.0 * x, 10.0 * x + 1, 10.0 * x + 2] for x in g], np.float32)
    return actions, np.array([t + i >= n for i in range(horizon)])


def test_every_frame_with_its_chunk_state_task_and_cameras(clean):
    ds = LeRobotDataset(clean)
    assert ds.camera_keys == [TOP, WRIST] and ds.fps == F.FPS
    horizon = 5  # longer than episode 1 (4 frames): a chunk entirely past its end
    examples = list(ds.frames(horizon))
    assert len(examples) == sum(F.LENGTHS) and not ds.dropped
    wrist_start = {0: 0.0, 1: 0.7, 2: 1.1}  # one file: episodes back to back
    top = {0: ("file-000", 0.0), 1: ("file-000", 0.7), 2: ("file-001", 0.0)}
    for ex in examples:
        ep, t = ex["episode_index"], ex["frame_index"]
        g = F.starts()[ep] + t
        assert ex["index"] == g
        actions, pad = expected_actions(ep, t, horizon)
        np.testing.assert_array_equal(ex["actions"], actions)
        np.testing.assert_array_equal(ex["action_is_pad"], pad)
        assert ex["actions"].dtype == np.float32 and ex["actions"].shape == (horizon, 3)
        np.testing.assert_array_equal(ex["state"], np.array([g, g + 0.5], np.float32))
        assert ex["task"] == F.TASKS[F.EPISODE_TASKS[ep]]
        path, ts = ex["cameras"][WRIST]
        assert path == f"videos/{WRIST}/chunk-000/file-000.mp4" and ts == pytest.approx(wrist_start[ep] + t / 10)
        path, ts = ex["cameras"][TOP]
        assert path == f"videos/{TOP}/chunk-000/{top[ep][0]}.mp4" and ts == pytest.approx(top[ep][1] + t / 10)


def test_episode_end_repeats_the_last_action_and_pads(clean):
    ex = next(e for e in LeRobotDataset(clean).frames(6) if e["episode_index"] == 1 and e["frame_index"] == 2)
    last = np.array([100.0, 101.0, 102.0], np.float32)  # episode 1 ends at global frame 10
    np.testing.assert_array_equal(ex["actions"][1:], np.tile(last, (5, 1)))
    assert ex["action_is_pad"].tolist() == [False, False, True, True, True, True]


def test_stride_takes_every_stride_th_frame_of_each_episode(clean):
    got = [(e["episode_index"], e["frame_index"]) for e in LeRobotDataset(clean).frames(2, stride=3)]
    assert got == [(0, 0), (0, 3), (0, 6), (1, 0), (1, 3), (2, 0), (2, 3), (2, 6)]


def nearest_frame_colour(path, ts: float) -> float:
    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = [(float(f.pts * stream.time_base), f.to_ndarray(format="rgb24").mean()) for f in container.decode(stream)]
    when, level = min(frames, key=lambda f: abs(f[0] - ts))
    assert abs(when - ts) < 1e-4, f"no frame within 1e-4 s of {ts} in {path}"
    return level


def test_camera_references_decode_to_the_frame_they_name(clean):
    examples = {(e["episode_index"], e["frame_index"]): e for e in LeRobotDataset(clean).frames(1)}
    for ep, t in [(0, 0), (1, 0), (1, 3), (2, 0), (2, 8)]:
        for key in (TOP, WRIST):
            path, ts = examples[(ep, t)]["cameras"][key]
            assert nearest_frame_colour(clean / path, ts) == pytest.approx(F.colour(F.starts()[ep] + t), abs=2)


def reader(tmp_path, **kw):
    return LeRobotDataset(F.write_dataset(tmp_path, **kw))


def set_frame(ep: int, t: int, key: str, value):
    def edit(rows):
        row = next(r for r in rows if r["episode_index"] == ep and r["frame_index"] == t)
        row[key] = value(row[key]) if callable(value) else value
    return edit


def test_nan_state_is_a_counted_drop(tmp_path):
    ds = reader(tmp_path, edit_frames=set_frame(1, 2, "observation.state", [float("nan"), 1.0]))
    assert len(list(ds.frames(3))) == sum(F.LENGTHS) - 1 and ds.dropped == {"nan_state": 1}


def test_nan_action_drops_every_frame_whose_chunk_holds_it(tmp_path):
    ds = reader(tmp_path, edit_frames=set_frame(1, 2, "action", [0.0, float("nan"), 0.0]))
    examples = list(ds.frames(2))  # frames 1 and 2 of episode 1 reach it
    assert ds.dropped == {"nan_action": 2} and len(examples) == sum(F.LENGTHS) - 2
    ds = reader(tmp_path / "last", edit_frames=set_frame(1, 3, "action", [float("nan")] * 3))
    list(ds.frames(2))  # the last action, repeated as padding: frames 2 and 3
    assert ds.dropped == {"nan_action": 2}


def test_missing_camera_file_or_columns_drop_the_episode(tmp_path):
    root = F.write_dataset(tmp_path / "file")
    (root / f"videos/{TOP}/chunk-000/file-001.mp4").unlink()  # episode 2's top view
    ds = LeRobotDataset(root)
    assert {e["episode_index"] for e in ds.frames(2)} == {0, 1} and ds.dropped == {"missing_camera": 9}

    def no_wrist(rows):
        for c in ("chunk_index", "file_index", "from_timestamp", "to_timestamp"):
            rows[0][f"videos/{WRIST}/{c}"] = None
    ds = reader(tmp_path / "columns", edit_episodes=no_wrist)
    assert {e["episode_index"] for e in ds.frames(2)} == {1, 2} and ds.dropped == {"missing_camera": 7}


def test_unknown_task_index_is_a_counted_drop(tmp_path):
    def task_5(rows):
        for r in rows:
            if r["episode_index"] == 1:
                r["task_index"] = 5
    ds = reader(tmp_path, edit_frames=task_5)
    assert len(list(ds.frames(2))) == sum(F.LENGTHS) - 4 and ds.dropped == {"unknown_task": 4}


def test_timestamp_off_by_more_than_the_tolerance_is_dropped(tmp_path):
    ds = reader(tmp_path / "off", edit_frames=set_frame(2, 3, "timestamp", lambda ts: ts + 3e-4))
    assert len(list(ds.frames(2))) == sum(F.LENGTHS) - 1 and ds.dropped == {"timestamp_mismatch": 1}
    ds = reader(tmp_path / "within", edit_frames=set_frame(2, 3, "timestamp", lambda ts: ts + 5e-5))
    assert len(list(ds.frames(2))) == sum(F.LENGTHS) and not ds.dropped


def test_episode_rows_not_matching_its_length_drop_the_episode(tmp_path):
    def longer(rows):
        rows[0]["length"] = 8  # the data file holds 7 frames of episode 0
    ds = reader(tmp_path, edit_episodes=longer, videos=False)
    ds.camera_keys = []  # no videos written: only the frame check speaks
    assert {e["episode_index"] for e in ds.frames(2)} == {1, 2} and ds.dropped == {"episode_frames_mismatch": 8}


def test_short_episodes_pad_by_default_or_drop_when_asked(clean):
    ds = LeRobotDataset(clean, drop_short_episodes=True)
    assert {e["episode_index"] for e in ds.frames(5)} == {0, 2}
    assert ds.dropped == {"episode_shorter_than_horizon": 4}
    assert len(list(LeRobotDataset(clean).frames(5))) == sum(F.LENGTHS)


def test_wrong_codebase_version_is_a_one_line_error(tmp_path):
    with pytest.raises(UserError) as e:
        reader(tmp_path, edit_info=lambda i: i.update(codebase_version="v2.1"), videos=False)
    assert "'v2.1'" in str(e.value) and "\n" not in str(e.value)


def test_templates_come_from_info_json(tmp_path):
    """The converter's docstring spells file_000: whatever info.json says is what is read."""
    root = F.write_dataset(tmp_path, videos=False)
    info = json.loads((root / "meta/info.json").read_text())
    info["data_path"] = "data/chunk-{chunk_index:03d}/file_{file_index:03d}.parquet"
    (root / "meta/info.json").write_text(json.dumps(info))
    for i in range(2):
        (root / f"data/chunk-000/file-{i:03d}.parquet").rename(root / f"data/chunk-000/file_{i:03d}.parquet")
    ds = LeRobotDataset(root)
    ds.camera_keys = []
    assert len(list(ds.frames(1))) == sum(F.LENGTHS)


def test_tasks_from_an_unnamed_pandas_index(tmp_path):
    root = F.write_dataset(tmp_path, videos=False)
    pq.write_table(pa.table({"task_index": [0, 1], "__index_level_0__": list(F.TASKS)}), root / "meta/tasks.parquet")
    assert LeRobotDataset(root).tasks == {0: F.TASKS[0], 1: F.TASKS[1]}


def test_computed_stats_and_the_quantile_normalisation(clean):
    stats = LeRobotDataset(clean).quantile_stats()  # no stats.json: from the data
    g = np.arange(sum(F.LENGTHS), dtype=np.float64)
    states = np.stack([g, g + 0.5], 1)
    actions = np.stack([10 * g, 10 * g + 1, 10 * g + 2], 1)
    for name, x in (("state", states), ("action", actions)):
        np.testing.assert_allclose(stats[name]["q01"], np.quantile(x, 0.01, axis=0), rtol=1e-6)
        np.testing.assert_allclose(stats[name]["q99"], np.quantile(x, 0.99, axis=0), rtol=1e-6)
        np.testing.assert_allclose(stats[name]["mean"], x.mean(0), rtol=1e-6)
        np.testing.assert_allclose(stats[name]["std"], x.std(0), rtol=1e-6)
    s = stats["action"]
    y = normalize(actions.astype(np.float32), s)
    np.testing.assert_allclose(y, 2 * (actions - s["q01"]) / (s["q99"] - s["q01"]) - 1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(normalize(np.stack([s["q01"], s["q99"]]), s), [[-1] * 3, [1] * 3], atol=1e-6)
    np.testing.assert_allclose(unnormalize(y, s), actions, rtol=1e-5, atol=1e-4)
    flat = {"q01": np.array([2.0]), "q99": np.array([2.0])}  # a constant dimension: eps, not inf / nan
    assert np.isfinite(normalize(np.array([2.0, 3.0]), flat)).all()
    assert unnormalize(normalize(np.array([2.0]), flat), flat) == pytest.approx(2.0)


def test_stats_json_used_when_complete_else_computed(tmp_path):
    full = {"observation.state": {"mean": [1, 2], "std": [1, 1], "q01": [0, 0], "q99": [4, 4], "min": [0, 0]},
            "action": {"mean": [1, 2, 3], "std": [1, 1, 1], "q01": [0, 0, 0], "q99": [9, 9, 9]}}
    ds = reader(tmp_path / "full", stats=full, videos=False)
    np.testing.assert_array_equal(ds.quantile_stats()["state"]["q99"], [4, 4])
    assert ds.stats_source == "meta/stats.json"
    del full["action"]["q01"]  # before lerobot's quantile augmentation (lerobot#2105)
    ds = reader(tmp_path / "partial", stats=full, videos=False)
    q99 = np.quantile(np.arange(20.0), 0.99)
    np.testing.assert_allclose(ds.quantile_stats()["state"]["q99"], [q99, q99 + 0.5], rtol=1e-6)
    assert ds.stats_source == "computed"


def test_bad_arguments_and_missing_columns_are_one_line_errors(clean, tmp_path):
    with pytest.raises(UserError, match="horizon and stride"):
        LeRobotDataset(clean).frames(0)
    with pytest.raises(UserError, match="no feature 'observation.joints'"):
        LeRobotDataset(clean, state_key="observation.joints")
    root = F.write_dataset(tmp_path, videos=False)
    path = root / "data/chunk-000/file-001.parquet"
    pq.write_table(pq.read_table(path).drop_columns(["action"]), path)
    with pytest.raises(UserError, match=r"file-001.parquet lacks column\(s\) action") as e:
        list(LeRobotDataset(root).frames(1))
    assert "\n" not in str(e.value)


def test_dropped_counts_one_pass(tmp_path):
    ds = reader(tmp_path, edit_frames=set_frame(0, 0, "observation.state", [float("nan"), 0.0]))
    for _ in range(2):
        list(ds.frames(1))
        assert ds.dropped == {"nan_state": 1}
