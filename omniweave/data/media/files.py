"""The media files a converted row names: where they are (inside ``--media-dir`` only, or inline as a
``data:`` URL) and whether they decode. A path is resolved (``realpath``) and must name a regular
file inside the media dir's real path; it is opened once (no symlink followed, never blocking) and
that descriptor is checked again before at most ``--max-media-size`` bytes are read. An image is
decoded whole (Pillow ``verify`` + ``load``, its header size within ``--max-image-pixels``); a video's
or audio's stream header is read. Each failure is a ``FormatError`` whose reason ``convert`` counts:
``missing_media``, ``unreadable_media``, ``not_a_regular_file``, ``media_too_large``,
``media_path_escapes`` (``..``, or a symlink out), ``absolute_path_outside``, ``undecodable_media``,
``image_too_large``, ``bad_data_url``, and for audio the ``MediaError`` reason of ``audio.probe_audio``:
``not_audio``, ``no_audio_stream``, ``empty_audio``, ``audio_truncated``, ``bad_audio``."""

from __future__ import annotations

import base64
import binascii
import os
import re
import stat
from dataclasses import dataclass

# the extension a data URL's media type is stored under (others: the subtype itself)
_MIME_EXT = {"mpeg": "mp3", "mp3": "mp3", "x-wav": "wav", "wave": "wav", "vnd.wave": "wav", "x-flac": "flac",
             "mp4": "m4a", "x-m4a": "m4a", "aac": "aac", "jpeg": "jpg", "svg+xml": "svg"}
_DATA_URL_RE = re.compile(r"data:(?P<type>\w+)/(?P<sub>[\w.+-]+)(?P<params>(;[^;,]*)*?)(?P<b64>;base64)?,", re.ASCII)

from omniweave.data.sources.formats import FormatError
from omniweave.data.media.vision import DEFAULT_MAX_IMAGE_PIXELS

DEFAULT_MAX_MEDIA_BYTES = 1 << 30  # --max-media-size: 1 GiB


@dataclass(frozen=True)
class MediaLimits:
    """What convert reads of one media item: at most ``max_bytes`` of file, at most ``max_image_pixels``
    per decoded image or video frame (``--max-media-size``, ``--max-image-pixels``)."""

    max_bytes: int = DEFAULT_MAX_MEDIA_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def _resolve_media(path: str, media_dir: str) -> tuple[str, str]:
    """(the media dir's real path, the real path ``path`` names): no ``..`` or absolute path outside
    the media dir, no symlink leading out of it."""
    if "\0" in path:
        raise FormatError("missing_media", f"{path!r} holds a NUL character, which no file name can")
    root, root_real = os.path.abspath(media_dir), os.path.realpath(media_dir)
    full = os.path.normpath(path if os.path.isabs(path) else os.path.join(root, path))
    if not os.path.isabs(path) and not _inside(full, root):
        raise FormatError("media_path_escapes", f"{path} leaves the media dir {media_dir}")
    real = os.path.realpath(full)
    if not _inside(real, root_real):
        if os.path.isabs(path) and not _inside(full, root):
            raise FormatError("absolute_path_outside", f"{path} is outside the media dir {media_dir}")
        raise FormatError("media_path_escapes", f"{path} resolves (through a symlink) to {real}, outside the media dir {media_dir}")
    return root_real, real


def _read_media_file(path: str, media_dir: str, max_bytes: int) -> bytes:
    """The bytes of a regular file inside ``media_dir``, read through one descriptor: the file is
    opened without following a symlink and without blocking (a FIFO), and what was opened is checked
    (a regular file, still inside the media dir, at most ``max_bytes``) before a byte is read."""
    root_real, real = _resolve_media(path, media_dir)
    try:
        if not stat.S_ISREG(os.lstat(real).st_mode):  # a directory, FIFO, socket or device: never opened
            raise FormatError("not_a_regular_file", f"{path} is not a regular file")
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FormatError("missing_media", f"{path} does not exist under {media_dir}") from None
    except OSError as e:  # ELOOP: the file became a symlink after it was resolved
        raise FormatError("unreadable_media", f"{path}: {e.strerror or e}") from e
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise FormatError("not_a_regular_file", f"{path} is not a regular file")
        opened = _opened_path(fd)
        if opened is not None and not _inside(opened, root_real):  # a folder on the way was swapped for a symlink
            raise FormatError("media_path_escapes", f"{path} opened {opened}, outside the media dir {media_dir}")
        if info.st_size > max_bytes:
            raise FormatError("media_too_large", f"{path} holds {info.st_size} bytes, over --max-media-size {max_bytes}")
        try:
            data = f.read(max_bytes + 1)
        except OSError as e:
            raise FormatError("unreadable_media", f"{path}: {e.strerror or e}") from e
    if len(data) > max_bytes:  # the file grew while it was read
        raise FormatError("media_too_large", f"{path} holds over --max-media-size {max_bytes} bytes")
    return data


def _opened_path(fd: int) -> str | None:
    """Where an open descriptor points (Linux ``/proc/self/fd``), None where the system does not say."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


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


def load_media(path: str, media_dir: str, kind: str, limits: MediaLimits = MediaLimits()) -> bytes:
    """The bytes of one media reference (a path under ``media_dir`` or a data URL), checked: an
    image fully decoded, a video's or audio's stream header read."""
    if is_data_url(path):
        name, data = source_name(path), _data_url_bytes(path)
        if len(data) > limits.max_bytes:
            raise FormatError("media_too_large", f"{name} holds {len(data)} bytes, over --max-media-size {limits.max_bytes}")
    else:
        name, data = path, _read_media_file(path, media_dir, limits.max_bytes)
    CHECKS[kind](name, data, limits)
    return data


def _check_image(path: str, data: bytes, limits: MediaLimits) -> None:
    """Every pixel decoded (``media.load_image``: the header size within the pixel limit first), then
    Pillow's ``verify`` (chunk CRCs for PNG)."""
    import io

    from PIL import Image

    from omniweave.data.media.vision import MediaError, load_image

    try:
        load_image(data, limits.max_image_pixels).close()
    except MediaError as e:
        raise FormatError(e.reason, f"{path}: {e.message}") from e
    try:
        with Image.open(io.BytesIO(data)) as img:
            img.verify()
    except Exception as e:  # noqa: BLE001 - any failure means the file is not a usable image
        raise FormatError("undecodable_media", f"{path}: not a readable image ({e})") from e


def _check_video(path: str, data: bytes, limits: MediaLimits) -> None:
    """The container / stream header (frame count, rate, size) as ``media.probe_video`` reads it."""
    from omniweave.data.media.vision import MediaError, check_pixels, probe_video

    try:
        info = probe_video(data)
        check_pixels(info.height, info.width, limits.max_image_pixels, "a video frame")
    except MediaError as e:
        raise FormatError("image_too_large" if e.reason == "image_too_large" else "undecodable_media",
                          f"{path}: {e}") from e
    if info.num_frames < 1 or info.height <= 0 or info.width <= 0:
        raise FormatError("undecodable_media", f"{path}: no frames ({info})")


def _check_audio(path: str, data: bytes, limits: MediaLimits) -> None:
    """The container / stream header as ``audio.probe_audio`` reads it (sample count, rate, channels);
    its reason (``empty_audio``, ``audio_truncated`` ...) is the reject reason."""
    from omniweave.data.media.audio import probe_audio
    from omniweave.data.media.vision import MediaError

    try:
        probe_audio(data)
    except MediaError as e:
        raise FormatError(e.reason, f"{path}: {e}") from e


CHECKS = {"image": _check_image, "video": _check_video, "audio": _check_audio}
