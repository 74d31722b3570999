"""LeRobot v3.0 writer: in-memory episodes -> a dataset directory that ``lerobot.py`` reads.

The VLA demo writes its synthetic episodes with it, and the reader's tests build their hand-made
dataset with it, so the format is spelled out in one place. Writing happens in two steps:
``plan_dataset`` turns episodes into the rows and files that will be written (``LeRobotTables``:
info.json, data rows, meta/episodes rows, video frames per file, stats), ``write_tables`` writes
them. A caller may edit the tables in between (tests make broken datasets that way);
``write_dataset`` does both steps.

An episode is a dict: ``task`` (text), ``state`` float [T, d], ``action`` float [T, a] and
``images`` {camera key: uint8 [T, H, W, 3]}. Several episodes share a data file and a video file
(``files`` / ``video_files``: file index -> its episodes, in order); everything is chunk 0.
Videos are H.264 through PyAV, one key frame per frame by default (exact seeks, tiny files);
``crf`` 0 is lossless in luma; ``pix_fmt`` yuv420p (lerobot's default) subsamples the chroma,
yuv444p keeps it (H.264 High 4:4:4), so the decoded frames equal the images but for YUV rounding.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from omniweave.data.sources.lerobot import CODEBASE_VERSION

DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"
CHUNKS_SIZE = 1000  # lerobot's default files per chunk; we write chunk 0 only
SCALARS = {"timestamp": "float32", "frame_index": "int64", "episode_index": "int64", "index": "int64",
           "task_index": "int64"}  # the per-frame bookkeeping columns: info.json dtype, parquet type


@dataclass
class LeRobotTables:
    """Everything ``write_tables`` writes. ``frames`` / ``episodes`` are rows (dicts) of the data
    parquet files and of meta/episodes; ``videos`` maps a video path (relative to the root) to its
    frames uint8 [N, H, W, 3]; ``stats`` None writes no meta/stats.json."""

    info: dict
    tasks: list[str]
    frames: list[dict]
    episodes: list[dict]
    schema: pa.Schema
    data_files: list[list[int]]
    videos: dict[str, np.ndarray] = field(default_factory=dict)
    stats: dict | None = None
    crf: int = 0
    pix_fmt: str = "yuv420p"


def consecutive_files(n_episodes: int, per_file: int) -> list[list[int]]:
    """Episodes 0..n-1 grouped ``per_file`` to a file, in order."""
    return [list(range(i, min(i + per_file, n_episodes))) for i in range(0, n_episodes, per_file)]


def plan_dataset(episodes: Sequence[dict], *, fps: int, state_key: str = "observation.state",
                 action_key: str = "action", files: Sequence[Sequence[int]] | None = None,
                 video_files: Mapping[str, Sequence[Sequence[int]]] | None = None,
                 names: Mapping[str, list[str]] | None = None, robot_type: str = "synthetic",
                 crf: int = 0, pix_fmt: str = "yuv420p") -> LeRobotTables:
    """The tables of ``episodes``. ``files``: data file -> episodes (default: all in one file);
    ``video_files``: camera -> (video file -> episodes) (default: the data layout); ``names``:
    feature key -> its dimension names in info.json."""
    if not episodes:
        raise ValueError("no episodes to write")
    files = [list(f) for f in files] if files is not None else [list(range(len(episodes)))]
    cameras = list(episodes[0]["images"])
    video_files = {k: [list(f) for f in video_files[k]] if video_files else files for k in cameras}
    for layout in [files, *video_files.values()]:
        if sorted(e for f in layout for e in f) != list(range(len(episodes))) or len(layout) > CHUNKS_SIZE:
            raise ValueError(f"a file layout must hold every episode exactly once, got {layout}")
    lengths = [len(ep["state"]) for ep in episodes]
    starts = np.cumsum([0] + lengths[:-1]).tolist()
    tasks = list(dict.fromkeys(ep["task"] for ep in episodes))  # first appearance order
    frames = []
    for e, ep in enumerate(episodes):
        if len(ep["action"]) != lengths[e] or any(len(v) != lengths[e] for v in ep["images"].values()):
            raise ValueError(f"episode {e}: state, action and images differ in length")
        state, action = np.asarray(ep["state"], np.float32), np.asarray(ep["action"], np.float32)
        for t in range(lengths[e]):
            frames.append({state_key: state[t].tolist(), action_key: action[t].tolist(), "timestamp": t / fps,
                           "frame_index": t, "episode_index": e, "index": starts[e] + t,
                           "task_index": tasks.index(ep["task"])})
    rows = []
    for e, length in enumerate(lengths):
        row = {"episode_index": e, "tasks": [episodes[e]["task"]], "length": length, "data/chunk_index": 0,
               "data/file_index": _file_of(files, e),
               "dataset_from_index": starts[e], "dataset_to_index": starts[e] + length}
        for key, layout in video_files.items():
            vfile = _file_of(layout, e)
            before = sum(lengths[o] for o in layout[vfile][:layout[vfile].index(e)])
            row.update({f"videos/{key}/chunk_index": 0, f"videos/{key}/file_index": vfile,
                        f"videos/{key}/from_timestamp": before / fps,
                        f"videos/{key}/to_timestamp": (before + length) / fps})
        row.update({"meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0})
        rows.append(row)
    videos = {VIDEO_PATH.format(video_key=key, chunk_index=0, file_index=i):
              np.concatenate([episodes[e]["images"][key] for e in eps])
              for key, layout in video_files.items() for i, eps in enumerate(layout)}
    widths = {state_key: np.shape(episodes[0]["state"])[1], action_key: np.shape(episodes[0]["action"])[1]}
    schema = pa.schema([(k, pa.list_(pa.float32(), w)) for k, w in widths.items()] + [(k, pa.type_for_alias(t)) for k, t in SCALARS.items()])
    return LeRobotTables(
        info=_info(episodes, fps, widths, cameras, len(tasks), names or {}, robot_type, pix_fmt), tasks=tasks,
        frames=frames, episodes=rows, schema=schema, data_files=files, videos=videos,
        stats=_stats(episodes, frames, widths, cameras), crf=crf, pix_fmt=pix_fmt)


def write_tables(root: str | Path, tables: LeRobotTables, *, videos: bool = True) -> Path:
    """Write ``tables`` under ``root`` (created); ``videos`` False skips the mp4 files."""
    root = Path(root)
    (root / "meta" / "episodes" / "chunk-000").mkdir(parents=True, exist_ok=True)
    (root / "meta" / "info.json").write_text(json.dumps(tables.info, indent=2))
    # lerobot writes pandas with the task text as the (named) index: a "task" column in the file
    pq.write_table(pa.table({"task_index": pa.array(range(len(tables.tasks)), pa.int64()), "task": tables.tasks}),
                   root / "meta" / "tasks.parquet")
    pq.write_table(pa.Table.from_pylist(tables.episodes), root / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    for file, eps in enumerate(tables.data_files):
        path = root / tables.info["data_path"].format(chunk_index=0, file_index=file)
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = [r for r in tables.frames if r["episode_index"] in eps]
        pq.write_table(pa.Table.from_pylist(rows, schema=tables.schema), path)
    if tables.stats is not None:
        (root / "meta" / "stats.json").write_text(json.dumps(tables.stats))
    if videos:
        for rel, frames in tables.videos.items():
            write_video(root / rel, frames, fps=tables.info["fps"], crf=tables.crf, pix_fmt=tables.pix_fmt)
    return root


def write_dataset(root: str | Path, episodes: Sequence[dict], **plan) -> Path:
    """``plan_dataset(episodes, **plan)`` written under ``root``."""
    return write_tables(root, plan_dataset(episodes, **plan))


def write_video(path: Path, frames: np.ndarray, *, fps: int, crf: int = 0, gop: int = 1,
                pix_fmt: str = "yuv420p") -> None:
    """Frames uint8 [N, H, W, 3] (H, W even) as H.264; frame i at pts i (time base 1/fps)."""
    height, width = frames.shape[1:3]
    if height % 2 or width % 2:
        raise ValueError(f"H.264 needs an even frame size, got {height}x{width}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w") as out:
        stream = out.add_stream("libx264", rate=fps)
        stream.width, stream.height = width, height
        stream.pix_fmt = pix_fmt
        stream.options = {"crf": str(crf), "g": str(gop)}
        for image in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(image), format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def _file_of(layout: list[list[int]], episode: int) -> int:
    return next(i for i, eps in enumerate(layout) if episode in eps)


def _info(episodes, fps: int, widths: dict[str, int], cameras: list[str], n_tasks: int,
          names: Mapping[str, list[str]], robot_type: str, pix_fmt: str = "yuv420p") -> dict:
    height, width = episodes[0]["images"][cameras[0]].shape[1:3] if cameras else (0, 0)
    video = {"dtype": "video", "shape": [height, width, 3], "names": ["height", "width", "channels"],
             "info": {"video.fps": fps, "video.codec": "h264", "video.pix_fmt": pix_fmt}}
    total = sum(len(ep["state"]) for ep in episodes)
    scalar = {"shape": [1], "names": None}
    return {
        "codebase_version": CODEBASE_VERSION, "robot_type": robot_type, "total_episodes": len(episodes),
        "total_frames": total, "total_tasks": n_tasks, "chunks_size": CHUNKS_SIZE,
        "data_files_size_in_mb": 100, "video_files_size_in_mb": 200, "fps": fps,
        "splits": {"train": f"0:{len(episodes)}"}, "data_path": DATA_PATH, "video_path": VIDEO_PATH,
        "features": {
            **{key: video for key in cameras},
            **{key: {"dtype": "float32", "shape": [w], "names": names.get(key, [f"{key}.{i}" for i in range(w)])}
               for key, w in widths.items()},
            **{key: {"dtype": t, **scalar} for key, t in SCALARS.items()},
        },
    }


def _stats(episodes, frames: list[dict], widths: dict[str, int], cameras: list[str]) -> dict:
    """meta/stats.json as lerobot writes it: per feature min / max / mean / std / count / q01 / q99
    (lists); a camera's per channel over all pixels, scaled to [0, 1], shaped [3, 1, 1]."""
    out = {key: _summary(np.array([f[key] for f in frames], np.float64)) for key in widths}
    for key in SCALARS:
        out[key] = _summary(np.array([[f[key]] for f in frames], np.float64))
    for key in cameras:
        pixels = np.concatenate([ep["images"][key].reshape(-1, 3) for ep in episodes]).astype(np.float64) / 255
        out[key] = {k: (np.asarray(v).reshape(3, 1, 1).tolist() if k != "count" else v)
                    for k, v in _summary(pixels).items()}
    return out


def _summary(x: np.ndarray) -> dict:
    q01, q99 = np.quantile(x, [0.01, 0.99], axis=0)
    return {"min": x.min(0).tolist(), "max": x.max(0).tolist(), "mean": x.mean(0).tolist(),
            "std": x.std(0).tolist(), "count": [len(x)], "q01": q01.tolist(), "q99": q99.tolist()}
