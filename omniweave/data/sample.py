"""The data types that the pipeline stages hand to each other.

    sources/formats.py -> Conversation    (parsed, validated user input)
    sources/shards.py  -> RawSample       (one sample read back from a raw shard)
    text/tokenize.py   -> TokenizedSample (ids, loss mask, M-RoPE positions, media spans)
    packing/packed.py  -> packs of TokenizedSamples + media bytes

Roles are normalised to: system, user, assistant, observation, function.
Media placeholders inside message text are exactly ``<image>``, ``<video>`` and ``<audio>``; the
i-th ``<image>`` in reading order refers to ``images[i]`` (same for videos and audios).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

ROLES = ("system", "user", "assistant", "observation", "function")
IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
AUDIO_PLACEHOLDER = "<audio>"
MediaKind = Literal["image", "video", "audio"]


@dataclass
class Message:
    role: str  # one of ROLES
    content: str  # text with <image> / <video> / <audio> placeholders
    loss_weight: float = 1.0  # 0: this turn carries no loss even where its role would (0 or 1 for now)


@dataclass
class Conversation:
    """One normalised training sample.

    ``images`` / ``videos`` / ``audios`` are paths (or ``data:`` URLs) relative to the media directory
    while converting, and the names of the media parts in the shard once written (e.g. ``img0.png``,
    ``vid0.mp4``, ``aud0.wav``).
    """

    id: str
    messages: list[Message]
    images: list[str] = field(default_factory=list)
    videos: list[str] = field(default_factory=list)
    audios: list[str] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)  # e.g. {"source": "f.jsonl", "index": 12}

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "messages": [{"role": m.role, "content": m.content, **({"loss_weight": m.loss_weight}
                                                                    if m.loss_weight != 1.0 else {})}
                         for m in self.messages],
            "images": list(self.images),
            "videos": list(self.videos),
            "audios": list(self.audios),
            "meta": dict(self.meta),
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> "Conversation":
        return cls(
            id=str(obj["id"]),
            messages=[Message(m["role"], m["content"], float(m.get("loss_weight", 1.0))) for m in obj["messages"]],
            images=list(obj.get("images", [])),
            videos=list(obj.get("videos", [])),
            audios=list(obj.get("audios", [])),
            meta=dict(obj.get("meta", {})),
        )


@dataclass
class RawSample:
    """A sample read back from a raw shard: the conversation plus its media parts' bytes."""

    key: str  # the WebDataset key (no dots)
    conversation: Conversation  # images/videos name parts in ``media``
    media: dict[str, bytes]  # part name -> original file bytes


@dataclass
class MediaSpan:
    """Where one media item sits in a tokenized sample and how to turn its bytes into patches.

    Everything here is computed from the file's header / stream metadata alone, and equals what
    full decoding + processing produces later (``media/vision.py`` / ``media/audio.py`` guarantee it).

    Audio items have no patch grid: ``grid_thw`` / ``resized_hw`` are zeros, ``num_samples`` is the
    clip's length at 16 kHz and ``pieces`` holds one run of pad tokens per encoder item (Qwen2-Audio
    splits audio over 30 s into chunks; each chunk is one item of the audio encoder).

    A video's own sound track (``data.audio.use_audio_in_video``) is an audio span with the video's
    ``part``; the two are interleaved in time chunks, so both spans hold one run per chunk.
    """

    kind: MediaKind
    part: str  # media part name in the raw sample (key into RawSample.media)
    grid_thw: tuple[int, int, int]  # patch grid before merging: (t, h, w)
    resized_hw: tuple[int, int]  # resize target in pixels (height, width)
    start: int  # index of the first vision pad token in input_ids
    length: int  # number of pad tokens = t*h*w // merge_size**2
    frame_indices: list[int] | None = None  # videos: source frames sampled, after padding
    second_per_grid: float | None = None  # videos: seconds covered by one temporal grid step
    # where text sits between the item's pad tokens (Qwen3-VL videos: a timestamp before each
    # temporal patch), the (start, length) of each run of pads; ``start`` is then the first run's
    # start and ``length`` the sum. None: one run, (start, length).
    pieces: list[tuple[int, int]] | None = None
    num_samples: int | None = None  # audio: samples at 16 kHz (``AudioInfo.num_samples()``)

    def ranges(self) -> list[tuple[int, int]]:
        """(start, length) of every run of this item's pad tokens, in order."""
        return [tuple(p) for p in self.pieces] if self.pieces else [(self.start, self.length)]

    @property
    def end(self) -> int:
        """One past the item's last pad token."""
        start, length = self.ranges()[-1]
        return start + length


@dataclass
class TokenizedSample:
    """One conversation rendered with a chat template and expanded media placeholders.

    ``labels`` are *unshifted*: ``labels[i] == input_ids[i]`` where token i carries loss
    (assistant content and its end token) and -100 elsewhere. The packer shifts per document.
    """

    id: str
    input_ids: np.ndarray  # int32 [L]
    labels: np.ndarray  # int32 [L]
    position_ids: np.ndarray  # int32 [3, L] for M-RoPE families, [1, L] for 1-D RoPE
    media: list[MediaSpan] = field(default_factory=list)
    truncated: bool = False  # trailing turns were dropped to fit max_len
    # runs [start, end) of loss tokens whose turn weighs other than 1 (a fractional loss_weight), with
    # that weight; None when every loss token weighs 1
    loss_weights: list[tuple[int, int, float]] | None = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])
