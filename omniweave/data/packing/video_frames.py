"""Camera frames of LeRobot videos at their timestamps, read by a forward-moving cursor per file.

lerobot's rule (``decode_video_frames``): the decoded frame nearest in time to the query, which
must lie within ``tolerance`` (it raises ``FrameTimestampError`` otherwise). A LeRobot video file
holds many episodes back to back, and packing asks for its frames in order, twice (the length
scan, then the write): seeking for each frame would decode from the previous keyframe every time
(a GOP's worth of frames per frame asked). A :class:`FrameReader` keeps each recently used file
open with its decoder where the last query left it and decodes forward from there when the next
query lies ahead within ``FORWARD_S``; otherwise (a jump back, or far ahead) it seeks. Both paths
look at the same frames around the query, so the answer is the one a fresh seek would give.
"""

from __future__ import annotations

import io
from collections import OrderedDict, deque
from pathlib import Path

from omniweave.data.sources.lerobot import TOLERANCE_S
from omniweave.data.text.tokenize import SampleRejected

FORWARD_S = 2.0  # decode forward rather than seek when the next query is at most this far ahead
OPEN_FILES = 4  # per reader (per packing worker): files kept open, least recently used closed first


class _Cursor:
    """One open video: its decoder, the last frames it produced (time, frame) and the last query."""

    def __init__(self, path: Path):
        import av

        self.container = av.open(str(path))
        self.stream = self.container.streams.video[0]
        self.frames = None  # the decode iterator, None until the first seek
        self.recent: deque = deque(maxlen=4)  # the newest decoded frames, oldest first
        self.query = float("-inf")

    def seek(self, timestamp: float) -> None:
        self.container.seek(max(int(timestamp / self.stream.time_base), 0), stream=self.stream, backward=True,
                            any_frame=False)
        self.frames = self.container.decode(self.stream)
        self.recent.clear()

    def nearest(self, timestamp: float, tolerance: float):
        """(frame, gap) of the decoded frame nearest to ``timestamp`` (None if the stream ends first)."""
        ahead = self.recent and timestamp >= self.query and timestamp - self.recent[-1][0] <= FORWARD_S
        if self.frames is None or not ahead:
            self.seek(timestamp)
        self.query = timestamp
        best, best_gap = None, float("inf")
        for time, frame in self.recent:  # frames already decoded past the previous query
            if abs(time - timestamp) < best_gap:
                best, best_gap = frame, abs(time - timestamp)
        if self.recent and self.recent[-1][0] > timestamp + tolerance:
            return best, best_gap
        for frame in self.frames:
            time = float(frame.time)
            self.recent.append((time, frame))
            if abs(time - timestamp) < best_gap:
                best, best_gap = frame, abs(time - timestamp)
            if time > timestamp + tolerance:
                break
        return best, best_gap

    def close(self) -> None:
        self.container.close()


class FrameReader:
    """``reader.png(path, timestamp)``: the frame as PNG bytes (see the module doc)."""

    def __init__(self, tolerance: float = TOLERANCE_S):
        self.tolerance = tolerance
        self.cursors: OrderedDict[Path, _Cursor] = OrderedDict()

    def _cursor(self, path: Path) -> _Cursor:
        cursor = self.cursors.pop(path, None) or _Cursor(path)
        self.cursors[path] = cursor  # most recently used last
        while len(self.cursors) > OPEN_FILES:
            self.cursors.popitem(last=False)[1].close()
        return cursor

    def png(self, path: Path, timestamp: float) -> bytes:
        from PIL import Image

        best, gap = self._cursor(Path(path)).nearest(timestamp, self.tolerance)
        if best is None or gap >= self.tolerance:
            raise SampleRejected("frame_timestamp_mismatch", f"{Path(path).name}: no frame within {self.tolerance}s of "
                                 f"{timestamp}s (nearest {gap:.6f}s away)")
        out = io.BytesIO()
        Image.fromarray(best.to_ndarray(format="rgb24")).save(out, format="PNG")
        return out.getvalue()

    def close(self) -> None:
        for cursor in self.cursors.values():
            cursor.close()
        self.cursors.clear()


def decode_frame_png(path: Path, timestamp: float, tolerance: float = TOLERANCE_S) -> bytes:
    """One frame with a fresh seek: the reference the cursor agrees with (tests, bench/vla_frames.py)."""
    reader = FrameReader(tolerance)
    try:
        return reader.png(path, timestamp)
    finally:
        reader.close()
