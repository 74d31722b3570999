"""Position ids for a tokenized sample: M-RoPE (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) or plain 1-D RoPE.

M-RoPE gives every token three coordinates (temporal, height, width):
- text tokens: all three equal, counting up by one;
- a vision block with merged grid (t, h, w) starting at position ``s``: token (i, j, k) gets
  (s + i·interval, s + j, s + k); the text after it continues at ``s + max(h, w)``.
  ``interval`` is 1, except for Qwen2.5-VL videos: ``tokens_per_second · second_per_grid``,
  multiplied in float32 and truncated, as the model does with its float32 tensor.

Audio spans are not vision blocks: their pad tokens take text positions (all three coordinates
equal, counting on), as Qwen2-Audio does with 1-D positions. (Qwen2.5-Omni's TMRoPE is not here.)

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

ROPE_KINDS = ("mrope", "mrope_qwen25", "mrope_qwen3vl", "rope1d")


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


def position_ids(
    rope: str, length: int, media: list[MediaSpan], merge_size: int, tokens_per_second: float
) -> np.ndarray:
    """int32 [3, L] for ``mrope`` / ``mrope_qwen25`` / ``mrope_qwen3vl``, int32 [1, L] for ``rope1d``."""
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
