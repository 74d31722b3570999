"""A tiny LeRobot v3.0 dataset with values tests can predict, written by the package's writer
(omniweave/data/sources/lerobot_write.py), whose file layout it pins down.

Three episodes of unequal length (7, 4, 9 frames at 10 fps). The data parquet files hold several
episodes each (episodes 0 and 1 in data/chunk-000/file-000, episode 2 in file-001), and so do the
videos: camera ``top`` stores episodes 0+1 in file-000 and episode 2 in file-001, camera ``wrist``
all three in one file. Values encode the global frame index g so tests can check slices:
state[g] = [g, g + 0.5], action[g] = [10g, 10g + 1, 10g + 2], and each video frame is a flat
grey of level ``colour(g)``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa

from omniweave.data.sources.lerobot_write import plan_dataset, write_tables

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


def colour(g: int) -> int:
    return 16 + 8 * g  # distinct after lossy coding for the 20 frames here


def starts() -> list[int]:
    """The global index of each episode's first frame."""
    return [int(s) for s in np.cumsum((0,) + LENGTHS[:-1])]


def episodes() -> list[dict]:
    out = []
    for ep, (length, start) in enumerate(zip(LENGTHS, starts())):
        g = np.arange(start, start + length, dtype=np.float32)
        grey = np.stack([np.full((SIZE, SIZE, 3), colour(int(x)), np.uint8) for x in g])
        out.append({"task": TASKS[EPISODE_TASKS[ep]], "state": np.stack([g, g + 0.5], 1),
                    "action": np.stack([10 * g, 10 * g + 1, 10 * g + 2], 1),
                    "images": {key: grey for key in CAMERAS}})
    return out


def write_dataset(root: Path, *, edit_frames: Callable[[list[dict]], None] | None = None,
                  edit_episodes: Callable[[list[dict]], None] | None = None,
                  edit_info: Callable[[dict], None] | None = None, stats: dict | None = None,
                  videos: bool = True) -> Path:
    """Write the dataset under ``root``; the ``edit_*`` hooks change the rows / info in place first
    (to make bad inputs). ``stats``: written as meta/stats.json when given."""
    tables = plan_dataset(episodes(), fps=FPS, files=DATA_FILES, video_files=CAMERAS, robot_type="toy",
                          names={"observation.state": ["x", "y"], "action": ["a", "b", "c"]})
    # action as a variable-length list (lerobot writes fixed-size ones): the reader's general path
    action = tables.schema.get_field_index("action")
    tables.schema = tables.schema.set(action, pa.field("action", pa.list_(pa.float32())))
    tables.stats = stats
    for hook, arg in ((edit_frames, tables.frames), (edit_episodes, tables.episodes), (edit_info, tables.info)):
        if hook:
            hook(arg)
    return write_tables(root, tables, videos=videos)
