"""Position ids for a tokenized sample: M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) or plain 1-D RoPE.

M-RoPE gives every token three coordinates (temporal, height, width):
- text tokens: all three equal, counting up by one;
- a vision block with merged grid (t, h, w) starting at position ``s``: token (i, j, k) gets
  (s + i·interval, s + j, s + k); the text after it continues at ``s + max(h, w)``.
  ``interval`` is 1, except for Qwen2.5-VL videos: ``tokens_per_second · second_per_grid``,
  multiplied in float32 and truncated, as the model does with its float32 tensor.

Audio spans are not vision blocks: their pad tokens take text positions (all three coordinates
equal, counting on), as Qwen2-Audio does with 1-D positions.

Qwen2.5-Omni's TMRoPE (``mrope_omni``, ``omni_position_ids``) differs from the VL rules in three
ways: time is measured in ``position_id_per_seconds`` (25) positions per second -- an image's
temporal id is 0, a video's ``int(float32(i · second_per_grid) · 25)`` for temporal patch i; every
token after a block continues at the block's maximum (over all three axes) + 1; and a video whose
sound track is an audio input (``use_audio_in_video``) is one block whose video and audio parts
start at the same position and are cut into ``seconds_per_chunk`` chunks emitted alternately,
video chunk first, with its two bos tokens (``<|vision_bos|><|audio_bos|>``) sharing one position
and its two eos tokens too.

Qwen3-VL (``mrope_qwen3vl``) writes a timestamp before each temporal patch of a video, so each
run of its pad tokens (``MediaSpan.ranges()``) is a block of its own with grid (1, h, w): the
temporal coordinate restarts at the block's start, as transformers splits ``video_grid_thw``
per frame. Images are as in Qwen2-VL.

This reproduces ``get_rope_index`` of transformers 5.23's Qwen2-VL / Qwen2.5-VL / Qwen3-VL models
(tests/test_tokenize.py compares against them). Note that transformers 5 continues text at
``s + max(h, w)`` (not at max-position + 1 as 4.x did); the two differ only for videos whose
temporal extent exceeds their spatial one.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from omniweave.data.sample import MediaSpan

ROPE_KINDS = ("mrope", "mrope_qwen25", "mrope_qwen3vl", "mrope_omni", "rope1d")


def vision_block_positions(
    start: int, grid_thw: tuple[int, int, int], merge_size: int, time_interval: float = 1.0
) -> np.ndarray:
    """int64 [3, t*h*w/merge²] positions of one vision block whose first position is ``start``."""
    t, h, w = grid_thw[0], grid_thw[1] // merge_size, grid_thw[2] // merge_size
    temporal = (np.arange(t, dtype=np.float32) * np.float32(time_interval)).astype(np.int64)
    pos = np.empty((3, t, h, w), dtype=np.int64)
    pos[0] = temporal[:, None, None]
    pos[1] = np.arange(h)[None, :, None]
    pos[2] = np.arange(w)[None, None, :]
    return pos.reshape(3, -1) + start


def mrope_position_ids(
    length: int, media: list[MediaSpan], merge_size: int, tokens_per_second: float | None = None
) -> np.ndarray:
    """int32 [3, L]. ``tokens_per_second`` set = Qwen2.5-VL (temporal axis scaled for videos)."""
    pos = np.empty((3, length), dtype=np.int64)
    cursor = 0  # next text position
    text_from = 0  # first token index not yet assigned
    for span in sorted(media, key=lambda s: s.start):
        n_text = span.start - text_from
        pos[:, text_from : span.start] = np.arange(n_text) + cursor
        cursor += n_text
        interval = 1.0
        if tokens_per_second is not None and span.kind == "video":
            interval = np.float32(tokens_per_second) * np.float32(span.second_per_grid)
        block = vision_block_positions(cursor, span.grid_thw, merge_size, interval)
        if block.shape[1] != span.length:
            raise ValueError(f"media span of {span.length} tokens does not match grid {span.grid_thw}")
        pos[:, span.start : span.start + span.length] = block
        cursor += max(span.grid_thw[1], span.grid_thw[2]) // merge_size
        text_from = span.start + span.length
    pos[:, text_from:] = np.arange(length - text_from) + cursor
    return pos.astype(np.int32)


def split_pieces(media: list[MediaSpan]) -> list[MediaSpan]:
    """Each run of an item's pad tokens as an item of its own: a video of t temporal patches in t
    runs becomes t blocks of grid (1, h, w)."""
    out = []
    for span in media:
        runs = span.ranges()
        if len(runs) == 1:
            out.append(span)
            continue
        t, h, w = span.grid_thw
        if len(runs) != t:
            raise ValueError(f"a media item of grid {span.grid_thw} has {len(runs)} runs of pad tokens, expected {t}")
        out += [dataclasses.replace(span, grid_thw=(1, h, w), start=s, length=n, pieces=None) for s, n in runs]
    return out


def chunk_bounds(values: np.ndarray, tokens_per_chunk: int) -> list[tuple[int, int]]:
    """(start, end) slices of a non-decreasing sequence of temporal ids: a new chunk starts at the
    first id >= k · tokens_per_chunk, k = 1, 2, …, one k per token (so an id that jumps over several
    thresholds opens them on consecutive tokens) -- ``get_chunked_index`` of transformers' Qwen2.5-Omni
    model and processor, step for step."""
    bounds, start, chunk = [], 0, 1
    for i, value in enumerate(values.tolist()):
        if value >= chunk * tokens_per_chunk:
            bounds.append((start, i))
            start, chunk = i, chunk + 1
    return bounds + [(start, len(values))]


def omni_video_temporal(t: int, second_per_grid: float, position_id_per_seconds: int) -> np.ndarray:
    """int64 [t]: temporal ids of a video's patches as the thinker computes them (float32 product, truncated)."""
    scaled = np.arange(t, dtype=np.float32) * np.float32(second_per_grid) * np.float32(position_id_per_seconds)
    return scaled.astype(np.int64)


def _omni_block(span: MediaSpan, start: int, merge_size: int, position_id_per_seconds: int) -> np.ndarray:
    """int64 [3, n]: one image / video block of TMRoPE starting at ``start``."""
    t, h, w = span.grid_thw[0], span.grid_thw[1] // merge_size, span.grid_thw[2] // merge_size
    if span.kind == "video":
        temporal = omni_video_temporal(t, span.second_per_grid, position_id_per_seconds)
    else:
        temporal = np.arange(t, dtype=np.int64) * position_id_per_seconds
    pos = np.empty((3, t, h, w), dtype=np.int64)
    pos[0], pos[1], pos[2] = temporal[:, None, None], np.arange(h)[None, :, None], np.arange(w)[None, None, :]
    if t * h * w != span.length:
        raise ValueError(f"media span of {span.length} tokens does not match grid {span.grid_thw}")
    return pos.reshape(3, -1) + start


def omni_position_ids(length: int, media: list[MediaSpan], merge_size: int, position_id_per_seconds: int = 25,
                      seconds_per_chunk: int = 2) -> np.ndarray:
    """int32 [3, L]: Qwen2.5-Omni thinker's ``get_rope_index`` (TMRoPE) from the spans alone.

    A video's sound track is the audio span with the video's ``part``; the two together fill the
    block from the first run of either to the last. Audio on its own is text-like (1-D, counting on).
    Inside that block positions follow the thinker's own chunking (float32, truncated temporal ids)
    in token order, as transformers does without looking at which pad sits where; the processor's
    layout (float64 ids, ``tokenize``) agrees with it unless an id lies within float32 rounding of
    a chunk boundary.
    """
    pos = np.empty((3, length), dtype=np.int64)
    state = {"next": 0, "text_from": 0}  # next position; first token not yet positioned

    def text(upto: int) -> None:
        n = upto - state["text_from"]
        pos[:, state["text_from"]:upto] = np.arange(n) + state["next"]
        state["next"] += n
        state["text_from"] = upto

    sound = {s.part: s for s in media if s.kind == "audio"}
    for span in sorted((s for s in media if s.kind != "audio"), key=lambda s: s.start):
        audio = sound.get(span.part) if span.kind == "video" else None
        start = min(span.start, audio.start) if audio else span.start
        text(start)
        if audio is None:
            block = _omni_block(span, state["next"], merge_size, position_id_per_seconds)
            pos[:, span.start:span.end] = block
            state["next"], state["text_from"] = int(block.max()) + 1, span.end
            continue
        # <|vision_bos|><|audio_bos|>: one position; video and audio both start right after it
        pos[:, start - 1] = pos[:, start - 2]
        first = state["next"] - 1
        block = _omni_block(span, first, merge_size, position_id_per_seconds)
        sound_pos = np.broadcast_to(np.arange(audio.length) + first, (3, audio.length))
        per_chunk = int(position_id_per_seconds * seconds_per_chunk)
        video_chunks = chunk_bounds(block[0] - first, per_chunk)
        audio_chunks = chunk_bounds(sound_pos[0] - first, per_chunk)
        pieces = []
        for j in range(max(len(video_chunks), len(audio_chunks))):
            pieces += [block[:, a:b] for a, b in video_chunks[j:j + 1]]
            pieces += [sound_pos[:, a:b] for a, b in audio_chunks[j:j + 1]]
        end = max(span.end, audio.end)
        if end - start != span.length + audio.length:
            raise ValueError(f"video {span.part!r} and its audio do not fill one block ({start}..{end})")
        pos[:, start:end] = np.concatenate(pieces, axis=1)
        # <|audio_eos|><|vision_eos|>: one position, after the last chunk's maximum (as transformers does)
        pos[:, end:end + 2] = int(pieces[-1].max()) + 1
        state["next"], state["text_from"] = int(pieces[-1].max()) + 2, end + 2
    text(length)
    return pos.astype(np.int32)


def position_ids(
    rope: str, length: int, media: list[MediaSpan], merge_size: int, tokens_per_second: float,
    position_id_per_seconds: int = 25, seconds_per_chunk: int = 2,
) -> np.ndarray:
    """int32 [3, L] for ``mrope`` / ``mrope_qwen25`` / ``mrope_qwen3vl`` / ``mrope_omni``, int32 [1, L]
    for ``rope1d``."""
    if rope == "mrope_omni":
        return omni_position_ids(length, media, merge_size, position_id_per_seconds, seconds_per_chunk)
    media = [s for s in media if s.kind != "audio"]  # audio pads are positioned as text
    if rope == "mrope":
        return mrope_position_ids(length, media, merge_size)
    if rope == "mrope_qwen25":
        return mrope_position_ids(length, media, merge_size, tokens_per_second)
    if rope == "mrope_qwen3vl":
        return mrope_position_ids(length, split_pieces(media), merge_size)
    if rope == "rope1d":
        return np.arange(length, dtype=np.int32)[None, :]
    raise ValueError(f"unknown rope {rope!r}; choose one of {ROPE_KINDS}")
