"""ShareGPT and OpenAI-messages rows -> ``Conversation``.

Two input formats (JSON array or JSONL, one conversation per row)::

    openai    {"messages": [{"role": "user", "content": "<image>What colour?"},
                            {"role": "assistant", "content": "red"}],
               "images": ["a.png"], "videos": []}
              content may also be a list of parts: {"type": "text", "text": ...},
              {"type": "image"[, "image": PATH]}, {"type": "image_url", "image_url": {"url": PATH}},
              {"type": "video"[, "video": PATH]}, {"type": "video_url", "video_url": {"url": PATH}}
    sharegpt  {"conversations": [{"from": "human", "value": "<image>What colour?"},
                                 {"from": "gpt", "value": "red"}], "images": ["a.png"]}

Column names and role keys can be remapped (``Mapping``, in ``mapping.py``: flags or a small
YAML in the style of LLaMA-Factory's ``dataset_info.json`` entries; format auto-detection).

Validation errors raise ``FormatError`` whose ``reason`` is the reject reason ``convert`` records.

Nothing a row carries is dropped silently. Media omniweave cannot store yet (audio, files: an
``audios`` column, ``<audio>`` placeholders, ``input_audio`` / ``audio_url`` / ``file`` parts) reject
the row as ``unsupported_modality:<kind>``; a content part of a type we do not know rejects it as
``unknown_content_part:<type>``; a column nobody mapped whose values look like media (file names
with a media extension, data URLs, objects with ``bytes`` / ``array`` or a media ``path`` / ``url``) rejects it as
``unknown_media_column:<column>``. Any other unmapped column is kept in ``meta["extra"]`` and
reported by ``unused_columns`` (``convert`` warns once per file).
"""

from __future__ import annotations

import difflib
import json
import re
from typing import Any

from omniweave.data.mapping import Mapping
from omniweave.data.sample import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, Conversation, Message

PLACEHOLDER_RE = re.compile(r"<image>|<video>")
# placeholders of modalities omniweave reads in the formats but cannot store yet
UNSUPPORTED_PLACEHOLDERS = {"<audio>": "audio"}
# content-part type -> what it is. Chat-Completions, HF processor and Responses-API spellings.
PART_KINDS = {
    "text": "text", "input_text": "text", "output_text": "text", "refusal": "text",
    "image": "image", "image_url": "image", "input_image": "image",
    "video": "video", "video_url": "video",
    "audio": "audio", "input_audio": "audio", "audio_url": "audio",
    "file": "file", "input_file": "file",
}
STORED_MODALITIES = ("image", "video")
MEDIA_SUFFIX_RE = re.compile(
    r"\.(png|jpe?g|gif|bmp|webp|tiff?|heic|mp4|avi|mov|mkv|webm|m4v|flv|mpe?g|wav|mp3|flac|ogg|oga|opus|m4a"
    r"|aac|wma|pdf|npy|npz)$", re.IGNORECASE,
)

# turns that ask (user side) and turns that answer (model side); they must alternate
PROMPT_ROLES = ("user", "observation")
RESPONSE_ROLES = ("assistant", "function")


class FormatError(ValueError):
    """A row that cannot become a Conversation; ``reason`` is a short machine-readable tag."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message


def _media_list(row: dict, key: str, kind: str) -> list[str]:
    value = row.get(key)
    if value is None:
        return []
    if isinstance(value, (str, dict)):
        value = [value]
    if not isinstance(value, list):
        raise FormatError("bad_schema", f"'{key}' must be a list of paths, got {type(value).__name__}")
    out = []
    for item in value:
        if isinstance(item, dict):
            item = item.get("path", item.get(kind, item.get("url")))
        if not isinstance(item, str) or not item:
            raise FormatError("bad_schema", f"'{key}' entries must be non-empty paths, got {item!r}")
        out.append(item)
    return out


def _part_ref(part: dict, kind: str) -> str | None:
    """The path a media part names, in any of the common spellings (``image``, ``image_url.url`` ...)."""
    for key in (part.get("type"), kind, f"{kind}_url", "url", "path"):
        ref = part.get(key) if key else None
        if isinstance(ref, dict):
            ref = ref.get("url", ref.get("path"))
        if isinstance(ref, str) and ref:
            return ref
    return None


def _content_text(content: Any, part_images: list[str], part_videos: list[str]) -> str:
    """A message's content as text with placeholders; media paths named in parts are collected."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise FormatError("bad_schema", f"content must be a string or a list of parts, got {type(content).__name__}")
    pieces = []
    for part in content:
        if isinstance(part, str):
            pieces.append(part)
            continue
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise FormatError("bad_schema", f"a content part must be a string or an object with a 'type', got {part!r}")
        kind = PART_KINDS.get(part["type"])
        if kind is None:
            raise FormatError(f"unknown_content_part:{part['type']}",
                              f"content part type {part['type']!r} is not one of {sorted(PART_KINDS)}")
        if kind not in ("text", *STORED_MODALITIES):
            raise FormatError(f"unsupported_modality:{kind}",
                              f"a {part['type']!r} part holds {kind}, which omniweave cannot store yet")
        if kind == "text":
            text = part.get("text", part.get(part["type"], ""))
            pieces.append(text if isinstance(text, str) else "")
            continue
        pieces.append(VIDEO_PLACEHOLDER if kind == "video" else IMAGE_PLACEHOLDER)
        ref = _part_ref(part, kind)
        if ref:
            (part_videos if kind == "video" else part_images).append(ref)
    return "".join(pieces)


def _looks_like_media(value: Any) -> bool:
    """A file name with a media extension, a data URL, or a media object ({path|bytes|url|array})."""
    if isinstance(value, list):
        return any(_looks_like_media(v) for v in value)
    if isinstance(value, str):
        value = value.strip()
        return bool(MEDIA_SUFFIX_RE.search(value)) or value.startswith(("data:image/", "data:video/", "data:audio/"))
    if isinstance(value, dict):  # HF datasets' Image / Audio features, {"path": "a.wav"}, {"url": "x.png"}
        return "bytes" in value or "array" in value or any(_looks_like_media(value.get(k)) for k in ("path", "url"))
    return False


def known_columns(m: Mapping) -> set[str]:
    return {c for c in (m.messages, m.images, m.videos, m.audios, m.system, m.id, m.solution) if c}


def _check_unmapped_media(row: dict, m: Mapping) -> None:
    """Reject rows whose audio or unmapped media columns would otherwise be lost."""
    audios = row.get(m.audios)
    if audios not in (None, [], "", {}):
        raise FormatError("unsupported_modality:audio",
                          f"column '{m.audios}' holds audio, which omniweave cannot store yet")
    known = known_columns(m)
    for column, value in row.items():
        if column not in known and _looks_like_media(value):
            close = difflib.get_close_matches(column, [m.images, m.videos, m.audios], n=1)
            hint = f"; did you mean '{close[0]}'? " if close else "; "
            raise FormatError(
                f"unknown_media_column:{column}",
                f"column '{column}' holds media but is not mapped{hint}map it with --images-key/--videos-key "
                "or --mapping, or drop it",
            )


def unused_columns(row: Any, m: Mapping) -> list[str]:
    """Columns of ``row`` that no mapping field reads (kept in ``meta['extra']``, warned about once per file)."""
    if not isinstance(row, dict):
        return []
    known = known_columns(m)
    return [c for c in row if c not in known]


def parse_row(row: Any, mapping: Mapping, *, row_id: str, auto_placeholders: bool = False) -> Conversation:
    """Validate one row and normalise it. ``mapping`` must be ``resolved`` (format known)."""
    if not isinstance(row, dict):
        raise FormatError("bad_schema", f"a row must be a JSON object, got {type(row).__name__}")
    m = mapping
    turns = row.get(m.messages)
    if turns is None:
        raise FormatError("bad_schema", f"no '{m.messages}' column (keys: {sorted(row)})")
    if not isinstance(turns, list):
        raise FormatError("bad_schema", f"'{m.messages}' must be a list of turns")
    _check_unmapped_media(row, m)
    roles = m.roles()
    part_images: list[str] = []
    part_videos: list[str] = []
    messages = []
    if m.system and isinstance(row.get(m.system), str) and row[m.system]:
        messages.append(Message("system", row[m.system]))
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise FormatError("bad_schema", f"turn {i} is not an object")
        raw_role = turn.get(m.role_tag)
        if raw_role not in roles:
            raise FormatError("unknown_role", f"turn {i} has role {raw_role!r}; known: {sorted(roles, key=str)}")
        role = roles[raw_role]
        content = turn.get(m.content_tag)
        if role == "function" and content is None and "tool_calls" in turn:  # OpenAI tool calls
            content = json.dumps(turn["tool_calls"], ensure_ascii=False)
        elif role == "assistant" and content is None and turn.get("tool_calls"):
            role, content = "function", json.dumps(turn["tool_calls"], ensure_ascii=False)
        messages.append(Message(role, _content_text(content, part_images, part_videos)))
    if not messages or all(not msg.content.strip() for msg in messages if msg.role != "system"):
        raise FormatError("empty_conversation", "no turn has any content")
    images = _media_list(row, m.images, "image") or part_images
    videos = _media_list(row, m.videos, "video") or part_videos
    solution = row.get(m.solution)
    if solution is not None and not isinstance(solution, (str, int, float)):
        raise FormatError("bad_schema", f"'{m.solution}' must be a string or a number, got {type(solution).__name__}")
    solution = None if solution is None or not str(solution).strip() else str(solution).strip()
    _check_turn_order(messages, prompt_only=solution is not None)
    if auto_placeholders:
        _insert_missing_placeholders(messages, images, videos)
    _check_placeholders(messages, images, videos)
    extra = {c: row[c] for c in unused_columns(row, m)}
    meta = {**({"extra": extra} if extra else {}), **({"solution": solution} if solution is not None else {})}
    return Conversation(id=str(row.get(m.id, row_id)), messages=messages, images=images, videos=videos, meta=meta)


def _check_turn_order(messages: list[Message], prompt_only: bool = False) -> None:
    """After an optional system turn, prompt and response turns alternate, starting with a prompt
    and ending with a response — or, for an RL prompt carrying its ``solution``, with a prompt."""
    if not prompt_only and not any(msg.role in RESPONSE_ROLES for msg in messages):
        raise FormatError("no_assistant_turn", "the conversation has no assistant turn to learn from")
    body = messages[1:] if messages[0].role == "system" else messages
    if not body:
        raise FormatError("empty_conversation", "only a system turn")
    for i, msg in enumerate(body):
        expected = PROMPT_ROLES if i % 2 == 0 else RESPONSE_ROLES
        if msg.role not in expected:
            raise FormatError(
                "bad_turn_order",
                f"turn {i + len(messages) - len(body)} is {msg.role!r} but a {'/'.join(expected)} turn was expected "
                "(optional system first, then user/observation and assistant/function alternate)",
            )
    if body[-1].role not in RESPONSE_ROLES and not prompt_only:
        raise FormatError("bad_turn_order", f"the conversation ends with a {body[-1].role!r} turn")


def _insert_missing_placeholders(messages: list[Message], images: list[str], videos: list[str]) -> None:
    """Rows with media but no placeholders at all get them prepended to the first user turn."""
    text = "".join(msg.content for msg in messages)
    missing = ""
    if images and IMAGE_PLACEHOLDER not in text:
        missing += IMAGE_PLACEHOLDER * len(images)
    if videos and VIDEO_PLACEHOLDER not in text:
        missing += VIDEO_PLACEHOLDER * len(videos)
    if missing:
        first_user = next(msg for msg in messages if msg.role == "user")
        first_user.content = missing + first_user.content


def _check_placeholders(messages: list[Message], images: list[str], videos: list[str]) -> None:
    counts = {IMAGE_PLACEHOLDER: 0, VIDEO_PLACEHOLDER: 0}
    for i, msg in enumerate(messages):
        for tag, kind in UNSUPPORTED_PLACEHOLDERS.items():
            if tag in msg.content:
                raise FormatError(f"unsupported_modality:{kind}",
                                  f"turn {i} holds {tag}; omniweave cannot store {kind} yet")
        found = PLACEHOLDER_RE.findall(msg.content)
        if found and msg.role not in PROMPT_ROLES:
            raise FormatError("placeholder_mismatch", f"turn {i} ({msg.role}) holds {found[0]}; media belong in user turns")
        for tag in found:
            counts[tag] += 1
    for tag, media in ((IMAGE_PLACEHOLDER, images), (VIDEO_PLACEHOLDER, videos)):
        if counts[tag] != len(media):
            raise FormatError(
                "placeholder_mismatch", f"{counts[tag]} {tag} placeholder(s) but {len(media)} {tag[1:-1]} file(s)"
            )
