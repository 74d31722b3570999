"""ShareGPT, OpenAI-messages and alpaca rows -> ``Conversation``.

Three input formats (JSON array or JSONL, one conversation per row)::

    openai    {"messages": [{"role": "user", "content": "<image>What colour?"},
                            {"role": "assistant", "content": "red"}],
               "images": ["a.png"], "videos": [], "audios": []}
              content may also be a list of parts: {"type": "text", "text": ...},
              {"type": "image"[, "image": PATH]}, {"type": "image_url", "image_url": {"url": PATH}},
              {"type": "video"[, "video": PATH]}, {"type": "video_url", "video_url": {"url": PATH}},
              {"type": "audio"[, "audio": PATH]}, {"type": "audio_url", "audio_url": {"url": PATH}},
              {"type": "input_audio", "input_audio": {"data": BASE64, "format": "wav"}}
    sharegpt  {"conversations": [{"from": "human", "value": "<audio>What is said?"},
                                 {"from": "gpt", "value": "hello"}], "audios": ["a.wav"]}
    alpaca    {"instruction": "Translate.", "input": "Bonjour", "output": "Hello", "system": "...",
               "history": [["earlier prompt", "earlier answer"]], "images": [...]}
              (LLaMA-Factory's: history pairs become earlier turns, input joins the instruction
              on a new line)

A media reference is a path relative to the media directory or a ``data:`` URL
(``data:audio/wav;base64,...``); an ``input_audio`` part becomes the ``data:`` URL of its bytes.

Column names and role keys can be remapped (``Mapping``, in ``mapping.py``: flags or a small
YAML in the style of LLaMA-Factory's ``dataset_info.json`` entries; format auto-detection).

Validation errors raise ``FormatError`` whose ``reason`` is the reject reason ``convert`` records.

Nothing a row carries is dropped silently. Media omniweave cannot store yet (``file`` /
``input_file`` parts) reject the row as ``unsupported_modality:<kind>``; a content part of a type we
do not know rejects it as ``unknown_content_part:<type>``; a column nobody mapped whose values look
like media (file names with a media extension, data URLs, objects with ``bytes`` / ``array`` or a
media ``path`` / ``url``) rejects it as ``unknown_media_column:<column>``. Any other unmapped column
is kept in ``meta["extra"]`` and reported by ``unused_columns`` (``convert`` warns once per file).
"""

from __future__ import annotations

import difflib
import json
import math
import re
from typing import Any

from omniweave.data.sources.mapping import Mapping
from omniweave.data.text.tools import parse_tools
from omniweave.data.sample import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, Conversation, Message

PLACEHOLDER_RE = re.compile(r"<image>|<video>|<audio>")
PLACEHOLDERS = {"image": IMAGE_PLACEHOLDER, "video": VIDEO_PLACEHOLDER, "audio": AUDIO_PLACEHOLDER}
# content-part type -> what it is. Chat-Completions, HF processor and Responses-API spellings.
PART_KINDS = {
    "text": "text", "input_text": "text", "output_text": "text", "refusal": "text",
    "image": "image", "image_url": "image", "input_image": "image",
    "video": "video", "video_url": "video",
    "audio": "audio", "input_audio": "audio", "audio_url": "audio",
    "file": "file", "input_file": "file",
}
STORED_MODALITIES = ("image", "video", "audio")
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


MAX_ROW_DEPTH = 100  # nesting of objects / lists in a row; deeper is bad_json (a chat row nests ~6 deep)


def decode_row(raw: Any) -> Any:
    """A row as convert reads it (a JSONL line's text, its bytes when not UTF-8, or an object of a
    JSON array) -> the parsed object, checked so everything after it may recurse into the row and
    encode its text: ``malformed_json`` (not UTF-8, not JSON, a number Python will not convert),
    ``bad_json`` (nested deeper than ``MAX_ROW_DEPTH``), ``bad_text`` (a string holding a lone UTF-16
    surrogate such as ``"\\ud800"``, which no UTF-8 file can hold)."""
    if isinstance(raw, bytes):
        raise FormatError("malformed_json", "the line is not valid UTF-8")
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except RecursionError:
            raise FormatError("bad_json", f"nested deeper than {MAX_ROW_DEPTH} levels") from None
        except ValueError as e:  # JSONDecodeError, or an integer literal past Python's digit limit
            raise FormatError("malformed_json", str(e)) from e
    _check_values(raw)
    return raw


def _check_values(row: Any) -> None:
    """Depth and text of every value (keys included), iteratively: a deep row cannot recurse here."""
    todo = [(row, 1)]
    while todo:
        value, depth = todo.pop()
        if isinstance(value, str):
            _check_text(value)
        elif isinstance(value, (dict, list)):
            if depth > MAX_ROW_DEPTH:
                raise FormatError("bad_json", f"nested deeper than {MAX_ROW_DEPTH} levels")
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str):
                    _check_text(key)
                todo.append((item, depth + 1))


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise FormatError("bad_text", f"a string holds {text[e.start:e.end]!r} (a lone UTF-16 surrogate), which "
                          f"is not text; near {text[max(0, e.start - 20):e.start]!r}") from None


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
    """The path a media part names, in any of the common spellings (``image``, ``image_url.url`` ...);
    an ``input_audio`` part's base64 ``data`` as a ``data:audio/<format>;base64,`` URL."""
    if part.get("type") == "input_audio":
        audio = part.get("input_audio")
        if not isinstance(audio, dict) or not isinstance(audio.get("data"), str) or not audio["data"]:
            raise FormatError("bad_schema", "an input_audio part needs {'data': BASE64, 'format': 'wav'|'mp3'|...}")
        fmt = audio.get("format") or "wav"
        if not isinstance(fmt, str) or not fmt.isalnum():
            raise FormatError("bad_schema", f"input_audio format must be a short name like 'wav', got {fmt!r}")
        return f"data:audio/{fmt.lower()};base64,{audio['data']}"
    for key in (part.get("type"), kind, f"{kind}_url", "url", "path", "value"):  # value: LLaMA-Factory's newer format
        ref = part.get(key) if key else None
        if isinstance(ref, dict):
            ref = ref.get("url", ref.get("path"))
        if isinstance(ref, str) and ref:
            return ref
    return None


def _content_text(content: Any, part_media: dict[str, list[str]]) -> str:
    """A message's content as text with placeholders; media named in parts are collected per kind."""
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
        if kind == "text":  # OpenAI's `text`, LLaMA-Factory's newer format's `value`, Responses' own type key
            key = next((k for k in ("text", "value", part["type"]) if k in part), None)
            if key is None or not isinstance(part[key], str):
                raise FormatError("bad_schema", f"a {part['type']!r} part needs its text as a string in 'text' "
                                  f"(or 'value'), got {part!r}")
            pieces.append(part[key])
            continue
        pieces.append(PLACEHOLDERS[kind])
        ref = _part_ref(part, kind)
        if ref:
            part_media[kind].append(ref)
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


def known_columns(m: Mapping, row: dict | None = None) -> set[str]:
    kto = kto_column(row, m) if row is not None else m.kto_tag
    return {c for c in (m.messages, m.images, m.videos, m.audios, m.system, m.id, m.solution, m.chosen, m.rejected,
                        m.instruction, m.input, m.output, m.history, kto, m.tools) if c}


def kto_column(row: dict, m: Mapping) -> str | None:
    """The column holding a KTO row's desirability: the mapped one, else ``kto_tag``, else ``label``
    when it holds a bool (LLaMA-Factory's KTO data: ``"columns": {"kto_tag": "label"}``; a ``label``
    of another kind is left to ``meta.extra``)."""
    if m.kto_tag:
        return m.kto_tag
    if "kto_tag" in row:
        return "kto_tag"
    return "label" if isinstance(row.get("label"), bool) else None


def _kto_tag(row: dict, m: Mapping) -> bool | None:
    column = kto_column(row, m)
    if column is None or column not in row:
        return None
    value = row[column]
    if isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if not isinstance(value, bool):
        raise FormatError("bad_schema", f"'{column}' (KTO desirability) must be true or false, got {value!r}")
    return value


def alpaca_turns(row: dict, m: Mapping) -> list[dict]:
    """LLaMA-Factory's alpaca row as turns, as its converter builds them: each ``history`` pair
    ``[prompt, answer]`` first, then the instruction (and, on a new line, the input) and the output."""
    def text(column: str | None, what: str) -> str:
        value = row.get(column) if column else None
        if value is not None and not isinstance(value, str):
            raise FormatError("bad_schema", f"'{column}' ({what}) must be a string, got {type(value).__name__}")
        return value or ""

    instruction, extra, output = text(m.instruction, "instruction"), text(m.input, "input"), text(m.output, "output")
    history = row.get(m.history) if m.history else None
    if history is not None and not (isinstance(history, list) and all(
            isinstance(h, list) and len(h) == 2 and all(isinstance(t, str) for t in h) for h in history)):
        raise FormatError("bad_schema", f"'{m.history}' must be a list of [prompt, answer] string pairs")
    turns = [{"role": role, "content": t} for prompt, answer in history or [] for role, t in
             (("user", prompt), ("assistant", answer))]
    turns.append({"role": "user", "content": "\n".join(t for t in (instruction, extra) if t)})
    if output:
        turns.append({"role": "assistant", "content": output})
    return turns


def _check_unmapped_media(row: dict, m: Mapping) -> None:
    """Reject rows whose unmapped media columns would otherwise be lost."""
    known = known_columns(m, row)
    for column, value in row.items():
        if column not in known and _looks_like_media(value):
            close = difflib.get_close_matches(column, [m.images, m.videos, m.audios], n=1)
            hint = f"; did you mean '{close[0]}'? " if close else "; "
            raise FormatError(
                f"unknown_media_column:{column}",
                f"column '{column}' holds media but is not mapped{hint}map it with --images-key/--videos-key "
                "--audios-key or --mapping, or drop it",
            )


def unused_columns(row: Any, m: Mapping) -> list[str]:
    """Columns of ``row`` that no mapping field reads (kept in ``meta['extra']``, warned about once per file)."""
    if not isinstance(row, dict):
        return []
    known = known_columns(m, row)
    return [c for c in row if c not in known]


def parse_row(row: Any, mapping: Mapping, *, row_id: str, auto_placeholders: bool = False) -> Conversation:
    """Validate one row and normalise it. ``mapping`` must be ``resolved`` (format known)."""
    if not isinstance(row, dict):
        raise FormatError("bad_schema", f"a row must be a JSON object, got {type(row).__name__}")
    m = mapping
    turns = alpaca_turns(row, m) if m.format == "alpaca" else row.get(m.messages)
    if turns is None:
        raise FormatError("bad_schema", f"no '{m.messages}' column (keys: {sorted(row)})")
    if not isinstance(turns, list):
        raise FormatError("bad_schema", f"'{m.messages}' must be a list of turns")
    _check_unmapped_media(row, m)
    roles = m.roles()
    part_media: dict[str, list[str]] = {kind: [] for kind in STORED_MODALITIES}
    messages = []
    if m.system and isinstance(row.get(m.system), str) and row[m.system]:
        messages.append(Message("system", row[m.system]))
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise FormatError("bad_schema", f"turn {i} is not an object")
        raw_role = turn.get(m.role_tag)
        if raw_role is not None and not isinstance(raw_role, str):
            raise FormatError("bad_schema", f"turn {i}: '{m.role_tag}' must be a string, got {type(raw_role).__name__}")
        if raw_role not in roles:
            raise FormatError("unknown_role", f"turn {i} has role {raw_role!r}; known: {sorted(roles, key=str)}")
        role = roles[raw_role]
        content = turn.get(m.content_tag)
        if role == "function" and content is None and "tool_calls" in turn:  # OpenAI tool calls
            content = json.dumps(turn["tool_calls"], ensure_ascii=False)
        elif role == "assistant" and turn.get("tool_calls"):  # its text (if any) and its calls: one turn
            text, calls = _content_text(content, part_media), turn["tool_calls"]
            role, content = "function", json.dumps({"content": text, "tool_calls": calls} if text else calls,
                                                   ensure_ascii=False)
        messages.append(Message(role, _content_text(content, part_media), _loss_weight(turn, i)))
    if not messages or all(not msg.content.strip() for msg in messages if msg.role != "system"):
        raise FormatError("empty_conversation", "no turn has any content")
    media = {kind: _media_list(row, getattr(m, f"{kind}s"), kind) or part_media[kind] for kind in STORED_MODALITIES}
    solution = row.get(m.solution)
    if solution is not None and not isinstance(solution, (str, int, float)):
        raise FormatError("bad_schema", f"'{m.solution}' must be a string or a number, got {type(solution).__name__}")
    solution = None if solution is None or not str(solution).strip() else str(solution).strip()
    _check_turn_order(messages, prompt_only=solution is not None)
    if auto_placeholders:
        _insert_missing_placeholders(messages, media)
    _check_placeholders(messages, media)
    extra = {c: row[c] for c in unused_columns(row, m)}
    kto = _kto_tag(row, m)
    try:
        tools = parse_tools(row.get(m.tools))
    except ValueError as e:
        raise FormatError("bad_schema", str(e)) from None
    meta = {**({"extra": extra} if extra else {}), **({"solution": solution} if solution is not None else {}),
            **({"kto_tag": kto} if kto is not None else {}), **({"tools": tools} if tools else {})}
    return Conversation(id=str(row.get(m.id, row_id)), messages=messages, images=media["image"], videos=media["video"],
                        audios=media["audio"], meta=meta)


def _loss_weight(turn: dict, i: int) -> float:
    """A turn's ``loss_weight`` (LLaMA-Factory's messages format) or ``loss`` (ms-swift: true / false);
    1 when absent. A fractional weight scales the turn's token losses (carried through packing as
    per-token weights); a negative or non-finite one is a counted reject (``bad_loss_weight``)."""
    key = "loss_weight" if "loss_weight" in turn else "loss" if "loss" in turn else None
    if key is None or turn[key] is None:
        return 1.0
    value = turn[key]
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise FormatError("bad_loss_weight", f"turn {i}: {key} {value} (a weight is finite and >= 0)")
        return float(value)
    raise FormatError("bad_schema", f"turn {i}: '{key}' must be a number or true / false, got {value!r}")


def _check_turn_order(messages: list[Message], prompt_only: bool = False) -> None:
    """After an optional system turn, prompt and response turns alternate, starting with a prompt
    and ending with a response — or, for an RL prompt carrying its ``solution``, with a prompt."""
    if not prompt_only and not any(msg.role in RESPONSE_ROLES for msg in messages):
        raise FormatError("no_assistant_turn", "the conversation has no assistant turn to learn from")
    body = messages[1:] if messages[0].role == "system" else messages
    if not body:
        raise FormatError("empty_conversation", "only a system turn")
    # the results of parallel tool calls (consecutive observation turns) answer as one prompt
    body = [m for k, m in enumerate(body) if not (m.role == "observation" and k and body[k - 1].role == "observation")]
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


def _insert_missing_placeholders(messages: list[Message], media: dict[str, list[str]]) -> None:
    """Rows with media but no placeholders at all get them prepended to the first user turn."""
    text = "".join(msg.content for msg in messages)
    missing = "".join(PLACEHOLDERS[kind] * len(items) for kind, items in media.items()
                      if items and PLACEHOLDERS[kind] not in text)
    if missing:
        first_user = next(msg for msg in messages if msg.role == "user")
        first_user.content = missing + first_user.content


def _check_placeholders(messages: list[Message], media: dict[str, list[str]]) -> None:
    """Media tags only in prompt turns, and the i-th tag of a kind for the i-th file of that kind."""
    counts = {tag: 0 for tag in PLACEHOLDERS.values()}
    for i, msg in enumerate(messages):
        found = PLACEHOLDER_RE.findall(msg.content)
        if found and msg.role not in PROMPT_ROLES:
            raise FormatError("placeholder_mismatch", f"turn {i} ({msg.role}) holds {found[0]}; media belong in user turns")
        for tag in found:
            counts[tag] += 1
    for kind, tag in PLACEHOLDERS.items():
        if counts[tag] != len(media[kind]):
            raise FormatError(
                "placeholder_mismatch", f"{counts[tag]} {tag} placeholder(s) but {len(media[kind])} {kind} file(s)"
            )
