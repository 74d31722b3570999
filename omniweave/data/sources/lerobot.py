"""LeRobot dataset v3.0 reader: per-frame training examples for vision-language-action training.

Layout read (lerobot ``CODEBASE_VERSION = "v3.0"``; the paths come from ``meta/info.json``)::

    meta/info.json                      codebase_version, fps, features, data_path / video_path templates
    meta/tasks.parquet                  task text (the pandas index: column ``task`` or
                                        ``__index_level_0__``) -> task_index
    meta/episodes/chunk-*/file-*.parquet  one row per episode: length, data/{chunk,file}_index,
                                        videos/<key>/{chunk_index,file_index,from_timestamp,to_timestamp}
    meta/stats.json                     optional: per feature mean/std/min/max/q01/q99...
    data/chunk-*/file-*.parquet         many episodes per file: one row per frame
    videos/<key>/chunk-*/file-*.mp4     many episodes per file, concatenated in time

``frames(horizon)`` yields one example per frame: its state, the action chunk of frames
t..t+H-1 of the same episode, the task text and, per camera, a *reference* (video file, time in
that file) -- pixels are decoded later, by whoever needs them. Past the episode end the last action
is repeated and ``action_is_pad`` is True there, as lerobot's reader does (``lerobot_dataset.py``
clamps the query indices and flags them ``{key}_is_pad``); the loss is meant to mask those steps.

Every frame that is not yielded is counted in ``dropped`` with its reason (``DROP_REASONS``) and listed
in ``drops`` as (episode, frame, reason).
Not read yet: ``image``-dtype features (stored inside the data parquet; listed in ``image_keys``),
v2.1 datasets (one file per episode), per-episode ``stats/...`` columns.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from omniweave.errors import UserError, first_few

CODEBASE_VERSION = "v3.0"
TOLERANCE_S = 1e-4  # lerobot's default tolerance_s: a frame's timestamp vs frame_index / fps
NORM_EPS = 1e-8  # where q99 == q01 the denominator would be 0 (lerobot normalize_processor's eps)
DROP_REASONS = (
    "nan_state",  # the frame's state holds NaN (or is missing / of the wrong width)
    "nan_action",  # an action in the frame's chunk holds NaN (the repeated last one included)
    "missing_camera",  # the episode lacks a camera's video columns, or its video file is absent
    "unknown_task",  # the frame's task_index has no text in meta/tasks.parquet
    "timestamp_mismatch",  # |timestamp - frame_index / fps| > tolerance_s
    "episode_frames_mismatch",  # the data file's rows of the episode are not frames 0..length-1
    "episode_shorter_than_horizon",  # only with drop_short_episodes=True
)
STATS_FIELDS = ("mean", "std", "q01", "q99")


class LeRobotDataset:
    """A LeRobot v3.0 dataset directory, read lazily one data file at a time.

    ``drop_short_episodes``: False (default, lerobot's behaviour) pads the action chunk of an episode
    shorter than the horizon; True drops all its frames as ``episode_shorter_than_horizon``.
    """

    def __init__(self, root: str | Path, *, state_key: str = "observation.state", action_key: str = "action",
                 drop_short_episodes: bool = False, tolerance_s: float = TOLERANCE_S):
        self.root = Path(root)
        self.state_key, self.action_key = state_key, action_key
        self.drop_short_episodes = drop_short_episodes
        self.tolerance_s = tolerance_s
        self.dropped: Counter = Counter()  # reason -> frames not yielded, of the latest frames() pass
        self.drops: list[tuple[int, int, str]] = []  # (episode, frame, reason) of each of those frames
        self.stats_source: str | None = None  # set by quantile_stats()
        self.info = self._read_info()
        self.fps = float(self.info["fps"])
        self.features: dict[str, dict] = self.info["features"]
        self.data_path: str = self.info["data_path"]
        self.video_path: str | None = self.info.get("video_path")
        self.camera_keys = [k for k, f in self.features.items() if f.get("dtype") == "video"]
        self.image_keys = [k for k, f in self.features.items() if f.get("dtype") == "image"]
        for key in (state_key, action_key):
            if key not in self.features:
                raise UserError(f"LeRobot dataset {self.root}: no feature {key!r} in meta/info.json "
                                f"(features: {first_few(self.features, 8)})")
        if self.camera_keys and not self.video_path:
            raise UserError(f"LeRobot dataset {self.root}: video features but no video_path in meta/info.json")
        self.tasks = self._read_tasks()
        self.episodes = self._read_episodes()

    # ---- metadata ---------------------------------------------------------------------------------

    def _read_info(self) -> dict:
        path = self.root / "meta" / "info.json"
        if not path.is_file():
            raise UserError(f"{self.root} is not a LeRobot dataset: no meta/info.json")
        try:
            info = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"{path}: not valid JSON ({e})") from None
        version = info.get("codebase_version")
        if version != CODEBASE_VERSION:
            raise UserError(f"LeRobot dataset {self.root} has codebase_version {version!r}; only "
                            f"{CODEBASE_VERSION!r} is read (lerobot's v30 converter upgrades older ones)")
        missing = [k for k in ("fps", "features", "data_path") if k not in info]
        if missing:
            raise UserError(f"{path}: missing {', '.join(missing)}")
        return info

    def _read_tasks(self) -> dict[int, str]:
        """task_index -> text. The text is the pandas index lerobot writes: a ``task`` column when the
        index is named, ``__index_level_0__`` when not."""
        path = self.root / "meta" / "tasks.parquet"
        if not path.is_file():
            raise UserError(f"LeRobot dataset {self.root}: no meta/tasks.parquet")
        table = pq.read_table(path)
        names = [n for n in ("task", "__index_level_0__") if n in table.column_names]
        if "task_index" not in table.column_names or not names:
            raise UserError(f"{path}: expected columns task_index and task (or the pandas index), "
                            f"found {', '.join(table.column_names)}")
        texts, indices = table.column(names[0]).to_pylist(), table.column("task_index").to_pylist()
        return {int(i): str(t) for t, i in zip(texts, indices)}

    def _read_episodes(self) -> list[dict]:
        files = sorted((self.root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
        if not files:
            raise UserError(f"LeRobot dataset {self.root}: no meta/episodes/chunk-*/file-*.parquet")
        rows = [row for f in files for row in pq.read_table(f).to_pylist()]
        need = ("episode_index", "length", "data/chunk_index", "data/file_index")
        for row in rows:
            missing = [k for k in need if k not in row]
            if missing:
                raise UserError(f"LeRobot dataset {self.root}: episode rows lack {', '.join(missing)}")
        return sorted(rows, key=lambda r: r["episode_index"])

    # ---- examples -----------------------------------------------------------------------------------

    def frames(self, horizon: int, stride: int = 1) -> Iterator[dict[str, Any]]:
        """One example per ``stride``-th frame of each episode (frame_index % stride == 0); the
        arguments are checked, and ``dropped`` emptied, here rather than at the first ``next``."""
        if horizon < 1 or stride < 1:
            raise UserError(f"horizon and stride must be >= 1, got horizon={horizon}, stride={stride}")
        self.dropped.clear()
        self.drops.clear()
        return self._frames(horizon, stride)

    def _frames(self, horizon: int, stride: int) -> Iterator[dict[str, Any]]:
        by_file: dict[tuple[int, int], list[dict]] = {}
        for ep in self.episodes:
            by_file.setdefault((ep["data/chunk_index"], ep["data/file_index"]), []).append(ep)
        for (chunk, file), eps in sorted(by_file.items()):
            columns = self._read_data_file(chunk, file)
            for ep in eps:
                yield from self._episode_frames(ep, columns, horizon, stride)

    def _read_data_file(self, chunk: int, file: int) -> dict[str, np.ndarray]:
        rel = self.data_path.format(chunk_index=chunk, file_index=file)
        path = self.root / rel
        if not path.is_file():
            raise UserError(f"LeRobot dataset {self.root}: data file {rel} named by meta/episodes is absent")
        names = ["episode_index", "frame_index", "index", "timestamp", "task_index", self.state_key, self.action_key]
        missing = [n for n in names if n not in pq.read_schema(path).names]
        if missing:
            raise UserError(f"LeRobot dataset {self.root}: data file {rel} lacks column(s) {', '.join(missing)}")
        table = pq.read_table(path, columns=names)
        out = {n: table.column(n).to_numpy() for n in names[:5]}
        out["state"] = _matrix(table.column(self.state_key), _width(self.features[self.state_key]))
        out["action"] = _matrix(table.column(self.action_key), _width(self.features[self.action_key]))
        return out

    def _episode_frames(self, ep: dict, cols: dict[str, np.ndarray], horizon: int, stride: int):
        rows = np.flatnonzero(cols["episode_index"] == ep["episode_index"])
        rows = rows[np.argsort(cols["frame_index"][rows], kind="stable")]
        n = len(rows)
        if n != ep["length"] or not np.array_equal(cols["frame_index"][rows], np.arange(n)):
            # action chunks are slices by position: frames missing or doubled would shift them
            self._drop("episode_frames_mismatch", ep, range(0, max(n, ep["length"]), stride))
            return
        if self.drop_short_episodes and n < horizon:
            self._drop("episode_shorter_than_horizon", ep, range(0, n, stride))
            return
        videos = self._episode_videos(ep)
        if videos is None:
            self._drop("missing_camera", ep, range(0, n, stride))
            return
        state, action = cols["state"][rows], cols["action"][rows]
        bad_action = np.isnan(action).any(axis=1)
        for t in range(0, n, stride):
            r = rows[t]
            reason = self._frame_problem(cols, r, state[t], bad_action[t:t + horizon])
            if reason:
                self._drop(reason, ep, (t,))
                continue
            idx = np.minimum(np.arange(t, t + horizon), n - 1)  # past the end: the last action again
            ts = float(cols["timestamp"][r])
            yield {
                "episode_index": int(ep["episode_index"]),
                "frame_index": t,
                "index": int(cols["index"][r]),
                "timestamp": ts,
                "task": self.tasks[int(cols["task_index"][r])],
                "state": state[t].copy(),
                "actions": action[idx],
                "action_is_pad": np.arange(t, t + horizon) >= n,
                "cameras": {k: (path, start + ts) for k, (path, start) in videos.items()},
            }

    def _drop(self, reason: str, ep: dict, frames) -> None:
        frames = list(frames)
        self.dropped[reason] += len(frames)
        self.drops.extend((int(ep["episode_index"]), int(t), reason) for t in frames)

    def _frame_problem(self, cols, r: int, state: np.ndarray, bad_actions: np.ndarray) -> str | None:
        """The drop reason of data row ``r`` (None: keep). ``bad_actions`` covers the real (unpadded)
        steps of its chunk; the last of them is the one a padded chunk repeats."""
        if abs(float(cols["timestamp"][r]) - int(cols["frame_index"][r]) / self.fps) > self.tolerance_s:
            return "timestamp_mismatch"
        if int(cols["task_index"][r]) not in self.tasks:
            return "unknown_task"
        if np.isnan(state).any():
            return "nan_state"
        if bad_actions.any():
            return "nan_action"
        return None

    def _episode_videos(self, ep: dict) -> dict[str, tuple[str, float]] | None:
        """camera -> (video file relative to root, the episode's start time in it); None when a camera's
        columns or file are missing (the whole episode then lacks that view)."""
        out = {}
        for key in self.camera_keys:
            cols = [f"videos/{key}/{c}" for c in ("chunk_index", "file_index", "from_timestamp")]
            if any(ep.get(c) is None for c in cols):
                return None
            rel = self.video_path.format(video_key=key, chunk_index=ep[cols[0]], file_index=ep[cols[1]])
            if not (self.root / rel).is_file():
                return None
            out[key] = (rel, float(ep[cols[2]]))
        return out

    # ---- normalisation statistics -------------------------------------------------------------------

    def quantile_stats(self) -> dict[str, dict[str, np.ndarray]]:
        """{"state": {...}, "action": {...}} with mean / std / q01 / q99 each (float32 [dim]): from
        ``meta/stats.json`` when it has all four for both features, else computed from the data;
        ``stats_source`` then says which ("meta/stats.json" or "computed")."""
        stats = self._stats_json()
        self.stats_source = "meta/stats.json" if stats is not None else "computed"
        return stats if stats is not None else self.compute_stats()

    def _stats_json(self) -> dict[str, dict[str, np.ndarray]] | None:
        path = self.root / "meta" / "stats.json"
        if not path.is_file():
            return None
        raw = json.loads(path.read_text())
        out = {}
        for name, key in (("state", self.state_key), ("action", self.action_key)):
            entry = raw.get(key, {})
            width = _width(self.features[key])
            if not all(np.asarray(entry.get(f, [])).size == width for f in STATS_FIELDS):
                return None  # incomplete (lerobot#2105: no quantiles before augmentation): compute
            out[name] = {f: np.asarray(entry[f], dtype=np.float32).reshape(width) for f in STATS_FIELDS}
        return out

    def compute_stats(self) -> dict[str, dict[str, np.ndarray]]:
        """mean / std / q01 / q99 over every frame of every data file (rows holding NaN skipped)."""
        parts: dict[str, list[np.ndarray]] = {"state": [], "action": []}
        files = {(ep["data/chunk_index"], ep["data/file_index"]) for ep in self.episodes}
        for chunk, file in sorted(files):
            cols = self._read_data_file(chunk, file)
            for name, kept in parts.items():
                x = cols[name]
                kept.append(x[~np.isnan(x).any(axis=1)])
        out = {}
        for name, xs in parts.items():
            x = np.concatenate(xs).astype(np.float64)
            if not len(x):
                raise UserError(f"LeRobot dataset {self.root}: no {name} rows without NaN to compute stats from")
            q01, q99 = np.quantile(x, [0.01, 0.99], axis=0)
            out[name] = {"mean": x.mean(0), "std": x.std(0), "q01": q01, "q99": q99}
            out[name] = {k: v.astype(np.float32) for k, v in out[name].items()}
        return out


def normalize(x: np.ndarray, stats: dict[str, np.ndarray]) -> np.ndarray:
    """Pi0.5's QUANTILES mode: 2(x - q01)/(q99 - q01) - 1, not clipped (lerobot does not clip)."""
    q01, q99 = stats["q01"], stats["q99"]
    return 2 * (x - q01) / np.maximum(q99 - q01, NORM_EPS) - 1


def unnormalize(y: np.ndarray, stats: dict[str, np.ndarray]) -> np.ndarray:
    """The inverse of ``normalize`` (model actions back to the robot's units)."""
    q01, q99 = stats["q01"], stats["q99"]
    return (y + 1) / 2 * np.maximum(q99 - q01, NORM_EPS) + q01


def _width(feature: dict) -> int:
    return int(math.prod(feature.get("shape") or [1]))


def _matrix(column: pa.ChunkedArray, width: int) -> np.ndarray:
    """A list column (or a scalar one, for shape [1]) -> float32 [rows, width]; a null or
    wrong-width row becomes NaN, so it is dropped with the NaN reason rather than misread."""
    arr = column.combine_chunks()
    n = len(arr)
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type) or pa.types.is_fixed_size_list(arr.type)):
        return arr.to_numpy(zero_copy_only=False).astype(np.float32).reshape(n, 1)
    flat = arr.flatten()
    same = pa.types.is_fixed_size_list(arr.type) or pc.all(pc.equal(pc.list_value_length(arr), width)).as_py()
    if arr.null_count == 0 and same and len(flat) == n * width:
        return flat.to_numpy(zero_copy_only=False).astype(np.float32).reshape(n, width)
    rows = [v if v is not None and len(v) == width else [math.nan] * width for v in arr.to_pylist()]
    return np.asarray(rows, dtype=np.float32).reshape(n, width)
