"""The media files a converted row names: where they are (inside ``--media-dir`` only) and whether
their headers read, without decoding a pixel. Each failure is a ``FormatError`` whose reason
``convert`` counts (``missing_media``, ``unreadable_media``, ``undecodable_media``,
``media_path_escapes``, ``absolute_path_outside``)."""

from __future__ import annotations

import os

from omniweave.data.formats import FormatError


def _resolve_media(path: str, media_dir: str) -> str:
    root = os.path.abspath(media_dir)
    if os.path.isabs(path):
        full = os.path.normpath(path)
        if os.path.commonpath([full, root]) != root:
            raise FormatError("absolute_path_outside", f"{path} is outside the media dir {media_dir}")
        return full
    full = os.path.normpath(os.path.join(root, path))
    if os.path.commonpath([full, root]) != root:
        raise FormatError("media_path_escapes", f"{path} leaves the media dir {media_dir}")
    return full


def load_media(path: str, media_dir: str, kind: str) -> bytes:
    full = _resolve_media(path, media_dir)
    if not os.path.exists(full):
        raise FormatError("missing_media", f"{path} does not exist under {media_dir}")
    try:
        with open(full, "rb") as f:
            data = f.read()
    except OSError as e:
        raise FormatError("unreadable_media", f"{path}: {e.strerror or e}") from e
    (_check_image if kind == "image" else _check_video)(path, data)
    return data


def _check_image(path: str, data: bytes) -> None:
    """Header + Pillow's ``verify`` (chunk CRCs for PNG); no pixel decoding."""
    import io

    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            img.verify()
    except Exception as e:  # noqa: BLE001 - any failure means the file is not a usable image
        raise FormatError("undecodable_media", f"{path}: not a readable image ({e})") from e
    if width <= 0 or height <= 0:
        raise FormatError("undecodable_media", f"{path}: empty image {width}x{height}")


def _check_video(path: str, data: bytes) -> None:
    """The container / stream header (frame count, rate, size) as ``media.probe_video`` reads it."""
    from omniweave.data.media import MediaError, probe_video

    try:
        info = probe_video(data)
    except MediaError as e:
        raise FormatError("undecodable_media", f"{path}: {e}") from e
    if info.num_frames < 1 or info.height <= 0 or info.width <= 0:
        raise FormatError("undecodable_media", f"{path}: no frames ({info})")
