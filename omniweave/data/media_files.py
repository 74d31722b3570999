"""The media files a converted row names: where they are (inside ``--media-dir`` only, or inline as a
``data:`` URL) and whether their headers read, without decoding a pixel or a sample. Each failure
is a ``FormatError`` whose reason ``convert`` counts (``missing_media``, ``unreadable_media``,
``undecodable_media``, ``bad_data_url``, ``media_path_escapes``, ``absolute_path_outside``, and for
audio the ``MediaError`` reason of ``audio.probe_audio``: ``not_audio``, ``no_audio_stream``,
``empty_audio``, ``audio_truncated``, ``bad_audio``)."""

from __future__ import annotations

import base64
import binascii
import os
import re

# the extension a data URL's media type is stored under (others: the subtype itself)
_MIME_EXT = {"mpeg": "mp3", "mp3": "mp3", "x-wav": "wav", "wave": "wav", "vnd.wave": "wav", "x-flac": "flac",
             "mp4": "m4a", "x-m4a": "m4a", "aac": "aac", "jpeg": "jpg", "svg+xml": "svg"}
_DATA_URL_RE = re.compile(r"data:(?P<type>\w+)/(?P<sub>[\w.+-]+)(?P<params>(;[^;,]*)*?)(?P<b64>;base64)?,", re.ASCII)

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


def is_data_url(ref: str) -> bool:
    return ref.startswith("data:")


def media_extension(ref: str) -> str:
    """The extension a media part is stored under: the path's, or the data URL's media subtype."""
    if is_data_url(ref):
        m = _DATA_URL_RE.match(ref)
        sub = m["sub"].lower() if m else "bin"
        return _MIME_EXT.get(sub, sub)
    _, ext = os.path.splitext(ref)
    return ext.lower().lstrip(".") or "bin"


def source_name(ref: str) -> str:
    """How ``meta.source_*`` records a reference: the path, or a data URL's type and size (not its bytes)."""
    if not is_data_url(ref):
        return ref
    return f"{ref[:ref.index(',')]},... ({len(ref) - ref.index(',') - 1} characters)"


def _data_url_bytes(ref: str) -> bytes:
    m = _DATA_URL_RE.match(ref)
    if m is None:
        raise FormatError("bad_data_url", f"{source_name(ref)} is not a data:TYPE/SUBTYPE[;base64],DATA URL")
    payload = ref[m.end():]
    if not m["b64"]:
        from urllib.parse import unquote_to_bytes

        return unquote_to_bytes(payload)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise FormatError("bad_data_url", f"{source_name(ref)}: not valid base64 ({e})") from e


def load_media(path: str, media_dir: str, kind: str) -> bytes:
    """The bytes of one media reference (a path under ``media_dir`` or a data URL), header-checked."""
    if is_data_url(path):
        data = _data_url_bytes(path)
        CHECKS[kind](source_name(path), data)
        return data
    full = _resolve_media(path, media_dir)
    if not os.path.exists(full):
        raise FormatError("missing_media", f"{path} does not exist under {media_dir}")
    try:
        with open(full, "rb") as f:
            data = f.read()
    except OSError as e:
        raise FormatError("unreadable_media", f"{path}: {e.strerror or e}") from e
    CHECKS[kind](path, data)
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


def _check_audio(path: str, data: bytes) -> None:
    """The container / stream header as ``audio.probe_audio`` reads it (sample count, rate, channels);
    its reason (``empty_audio``, ``audio_truncated`` ...) is the reject reason."""
    from omniweave.data.audio import probe_audio
    from omniweave.data.media import MediaError

    try:
        probe_audio(data)
    except MediaError as e:
        raise FormatError(e.reason, f"{path}: {e}") from e


CHECKS = {"image": _check_image, "video": _check_video, "audio": _check_audio}
