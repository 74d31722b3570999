"""A tiny LeRobot v3.0 dataset written by hand, following the format line by line.

Three episodes of unequal length (7, 4, 9 frames at 10 fps). The data parquet files hold several
episodes each (episodes 0 and 1 in data/chunk-000/file-000, episode 2 in file-001), and so do the
videos: camera ``top`` stores episodes 0+1 in file-000 and episode 2 in file-001, camera ``wrist``
all three in one file. Values encode the global frame index g so tests can check slices:
state[g] = [g, g + 0.5], action[g] = [10g, 10g + 1, 10g + 2], and each video frame is a flat
grey of level ``colour(g)``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

FPS = 10
LENGTHS = (7, 4, 9)
EPISODE_TASKS = (0, 1, 0)
TASKS = ("pick up the red cube", "open the drawer")
DATA_FILES = ((0, 1), (2,))  # data file index -> its episodes
CAMERAS = {  # camera -> its video files' episodes
    "observation.images.top": ((0, 1), (2,)),
    "observation.images.wrist": ((0, 1, 2),),
}
SIZE = 16
DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
VIDEO_PATH = "videos/{video_key}/chunk-{chunk_index:03d}/file-{file_index:03d}.mp4"


def colour(g: int) -> int:
    return 16 + 8 * g  # distinct after lossy coding for the 20 frames here


def starts() -> list[int]:
    """The global index of each episode's first frame."""
    return [int(s) for s in np.cumsum((0,) + LENGTHS[:-1])]


def frame_rows() -> list[dict]:
    rows = []
    for ep, (length, start) in enumerate(zip(LENGTHS, starts())):
        for t in range(length):
            g = start + t
            rows.append({"observation.state": [float(g), g + 0.5], "action": [10.0 * g, 10.0 * g + 1, 10.0 * g + 2],
                         "timestamp": t / FPS, "frame_index": t, "episode_index": ep, "index": g,
                         "task_index": EPISODE_TASKS[ep]})
    return rows


def info() -> dict:
    video = {"dtype": "video", "shape": [SIZE, SIZE, 3], "names": ["height", "width", "channels"],
             "info": {"video.fps": FPS, "video.codec": "h264", "video.pix_fmt": "yuv420p"}}
    scalar = {"shape": [1], "names": None}
    return {
        "codebase_version": "v3.0", "robot_type": "toy", "total_episodes": len(LENGTHS),
        "total_frames": sum(LENGTHS), "total_tasks": len(TASKS), "chunks_size": 1000,
        "data_files_size_in_mb": 100, "video_files_size_in_mb": 200, "fps": FPS,
        "splits": {"train": f"0:{len(LENGTHS)}"}, "data_path": DATA_PATH, "video_path": VIDEO_PATH,
        "features": {
            **{key: video for key in CAMERAS},
            "observation.state": {"dtype": "float32", "shape": [2], "names": ["x", "y"]},
            "action": {"dtype": "float32", "shape": [3], "names": ["a", "b", "c"]},
            "timestamp": {"dtype": "float32", **scalar}, "frame_index": {"dtype": "int64", **scalar},
            "episode_index": {"dtype": "int64", **scalar}, "index": {"dtype": "int64", **scalar},
            "task_index": {"dtype": "int64", **scalar},
        },
    }


def episode_rows() -> list[dict]:
    rows = []
    for ep, (length, start) in enumerate(zip(LENGTHS, starts())):
        file = next(i for i, eps in enumerate(DATA_FILES) if ep in eps)
        row = {"episode_index": ep, "tasks": [TASKS[EPISODE_TASKS[ep]]], "length": length,
               "data/chunk_index": 0, "data/file_index": file,
               "dataset_from_index": start, "dataset_to_index": start + length}
        for key, files in CAMERAS.items():
            vfile = next(i for i, eps in enumerate(files) if ep in eps)
            before = sum(LENGTHS[e] for e in files[vfile] if e < ep)
            row.update({f"videos/{key}/chunk_index": 0, f"videos/{key}/file_index": vfile,
                        f"videos/{key}/from_timestamp": before / FPS,
                        f"videos/{key}/to_timestamp": (before + length) / FPS})
        row.update({"meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0})
        rows.append(row)
    return rows


def write_video(path: Path, global_indices: list[int]) -> None:
    """One frame per global index, pts = its position in the file (time base 1/fps)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w") as out:
        stream = out.add_stream("libx264", rate=FPS)
        stream.width = stream.height = SIZE
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "0", "g": "1"}
        for g in global_indices:
            frame = av.VideoFrame.from_ndarray(np.full((SIZE, SIZE, 3), colour(g), np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


def write_dataset(root: Path, *, edit_frames: Callable[[list[dict]], None] | None = None,
                  edit_episodes: Callable[[list[dict]], None] | None = None,
                  edit_info: Callable[[dict], None] | None = None, stats: dict | None = None,
                  videos: bool = True) -> Path:
    """Write the dataset under ``root``; the ``edit_*`` hooks change the rows / info in place first
    (to make bad inputs). ``stats``: written as meta/stats.json when given."""
    frames, episodes, meta = frame_rows(), episode_rows(), info()
    for hook, arg in ((edit_frames, frames), (edit_episodes, episodes), (edit_info, meta)):
        if hook:
            hook(arg)
    (root / "meta" / "episodes" / "chunk-000").mkdir(parents=True, exist_ok=True)
    (root / "meta" / "info.json").write_text(json.dumps(meta, indent=2))
    # lerobot writes pandas with the task text as the (named) index: a "task" column in the file
    pq.write_table(pa.table({"task_index": pa.array(range(len(TASKS)), pa.int64()), "task": list(TASKS)}),
                   root / "meta" / "tasks.parquet")
    pq.write_table(pa.Table.from_pylist(episodes), root / "meta" / "episodes" / "chunk-000" / "file-000.parquet")
    schema = pa.schema([("observation.state", pa.list_(pa.float32(), 2)), ("action", pa.list_(pa.float32())),
                        ("timestamp", pa.float32()), ("frame_index", pa.int64()), ("episode_index", pa.int64()),
                        ("index", pa.int64()), ("task_index", pa.int64())])
    for file, eps in enumerate(DATA_FILES):
        path = root / DATA_PATH.format(chunk_index=0, file_index=file)
        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist([r for r in frames if r["episode_index"] in eps], schema=schema), path)
    if stats is not None:
        (root / "meta" / "stats.json").write_text(json.dumps(stats))
    if videos:
        for key, files in CAMERAS.items():
            for file, eps in enumerate(files):
                indices = [starts()[e] + t for e in eps for t in range(LENGTHS[e])]
                write_video(root / VIDEO_PATH.format(video_key=key, chunk_index=0, file_index=file), indices)
    return root
