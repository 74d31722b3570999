"""Where a row keeps its parts and how its roles are spelled: ``Mapping``, from flags or a small
YAML in the style of LLaMA-Factory's ``dataset_info.json`` entries, and format auto-detection::

    formatting: sharegpt            # or openai; omitted = auto-detect
    columns: {messages: conversations, images: images, videos: videos, audios: audios, system: system}
    tags: {role_tag: from, content_tag: value, user_tag: human, assistant_tag: gpt,
           system_tag: system, observation_tag: observation, function_tag: function_call}
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

FORMATS = ("openai", "sharegpt", "alpaca")
# Mapping fields settable from flags / YAML (``--messages-key``, ``--role-tag`` ...)
COLUMN_FIELDS = ("messages", "images", "videos", "audios", "system", "id", "solution", "chosen", "rejected",
                 "instruction", "input", "output", "history", "kto_tag", "tools")
TAG_FIELDS = ("role_tag", "content_tag", "user_tag", "assistant_tag", "system_tag", "observation_tag", "function_tag")


@dataclass(frozen=True)
class Mapping:
    """Where a row keeps its parts and how its roles are spelled. ``None`` = the format's default."""

    format: str | None = None  # "openai" | "sharegpt" | None (auto-detect)
    messages: str | None = None  # column holding the turns
    images: str = "images"
    videos: str = "videos"
    audios: str = "audios"
    system: str | None = None  # optional column holding a system prompt
    id: str = "id"
    solution: str = "solution"  # RL: the reference answer (then the row may end with the user's turn)
    chosen: str = "chosen"  # DPO: the preferred answer (data/sources/preference.py)
    rejected: str = "rejected"  # DPO: the dispreferred answer
    instruction: str | None = None  # alpaca: the prompt (+ the input column's text on a new line)
    input: str | None = None  # alpaca: optional text appended to the instruction
    output: str | None = None  # alpaca: the answer
    history: str | None = None  # alpaca: earlier [prompt, answer] pairs, as earlier turns
    kto_tag: str | None = None  # KTO: a bool, the answer is desirable (default: a bool `kto_tag` or `label`)
    tools: str = "tools"  # tool definitions (a list, or LLaMA-Factory's JSON string of one): data/text/tools.py
    role_tag: str | None = None
    content_tag: str | None = None
    user_tag: str | None = None
    assistant_tag: str | None = None
    system_tag: str | None = None
    observation_tag: str | None = None
    function_tag: str | None = None
    ranking: bool = False  # every row is a preference pair (LLaMA-Factory's `ranking: true`): data/sources/preference.py

    def resolved(self, fmt: str) -> "Mapping":
        """Fill the format's defaults into every field left ``None``."""
        defaults = _DEFAULTS[fmt]
        return replace(self, format=fmt, **{k: v for k, v in defaults.items() if getattr(self, k) is None})

    def roles(self) -> dict[str, str]:
        """Input role spelling -> normalised role."""
        table = {
            self.user_tag: "user",
            self.assistant_tag: "assistant",
            self.system_tag: "system",
            self.observation_tag: "observation",
            self.function_tag: "function",
        }
        table.update({alias: role for alias, role in _ALIASES[self.format].items() if alias not in table})
        return table


_DEFAULTS = {
    "openai": dict(
        messages="messages", role_tag="role", content_tag="content", user_tag="user",
        assistant_tag="assistant", system_tag="system", observation_tag="tool", function_tag="function",
    ),
    "sharegpt": dict(
        messages="conversations", role_tag="from", content_tag="value", user_tag="human",
        assistant_tag="gpt", system_tag="system", observation_tag="observation", function_tag="function_call",
    ),
    # LLaMA-Factory's alpaca: the row's columns become openai-style turns (formats.alpaca_turns)
    "alpaca": dict(
        instruction="instruction", input="input", output="output", history="history", system="system",
        role_tag="role", content_tag="content", user_tag="user", assistant_tag="assistant", system_tag="system",
        observation_tag="tool", function_tag="function",
    ),
}
# extra spellings accepted on top of the tags (never overriding an explicit tag)
_ALIASES = {
    "openai": {"observation": "observation", "ipython": "observation", "function_call": "function"},
    "sharegpt": {"user": "user", "assistant": "assistant", "function": "function", "tool": "observation"},
    "alpaca": {},
}


def mapping_from_yaml(path: str | Path, base: Mapping | None = None) -> Mapping:
    """A LLaMA-Factory-style entry: ``formatting``, ``columns``, ``tags`` (one dataset)."""
    import yaml

    obj = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a mapping with formatting/columns/tags")
    if not ({"formatting", "format", "columns", "tags"} & set(obj)) and len(obj) == 1:
        obj = next(iter(obj.values()))  # a dataset_info file with a single dataset entry
    unknown = set(obj) - {"formatting", "format", "columns", "tags", "file_name"}
    if unknown:
        raise ValueError(f"{path}: unknown keys {sorted(unknown)}; allowed: formatting, columns, tags")
    updates: dict[str, Any] = {}
    fmt = obj.get("formatting", obj.get("format"))
    if fmt is not None:
        updates["format"] = _check_format(fmt)
    for section in ("columns", "tags"):
        for key, value in (obj.get(section) or {}).items():
            valid = COLUMN_FIELDS if section == "columns" else TAG_FIELDS
            if key not in valid:
                raise ValueError(f"{path}: unknown {section} key {key!r}; {section} takes {', '.join(valid)}")
            updates[key] = value
    return replace(base or Mapping(), **updates)


def _check_format(fmt: str) -> str:
    fmt = {"openai_messages": "openai", "messages": "openai"}.get(fmt, fmt)
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {FORMATS}")
    return fmt


def detect_format(rows: list[dict], mapping: Mapping = Mapping()) -> str:
    """``openai`` or ``sharegpt`` from the first rows; a clear error when both or neither fit.

    A mapping that sets the messages column and the role/content tags can make a row fit both
    formats; then what is left to tell them apart is how the roles are spelled, so the format whose
    role names cover every turn wins (both covering every turn parse the row alike: openai)."""
    if mapping.format:
        return _check_format(mapping.format)
    mapped = any(getattr(mapping, f) is not None for f in ("messages", "role_tag", "content_tag", "user_tag"))
    votes = set()
    for row in rows[:32]:
        if not isinstance(row, dict):
            continue
        fits = [fmt for fmt in FORMATS if _fits(row, mapping.resolved(fmt))]
        if len(fits) > 1:
            fits = _by_roles(row, mapping, fits)
        if len(fits) > 1:
            how = ("set `formatting: openai|sharegpt|alpaca` in the mapping YAML or pass --format" if mapped
                   else "pass --format openai|sharegpt|alpaca or a --mapping YAML")
            raise ValueError(f"ambiguous input: a row fits both formats {fits} (keys {sorted(row)}); {how}")
        votes.update(fits)
    if len(votes) == 1:
        return votes.pop()
    if not votes:
        keys = sorted({k for r in rows[:32] if isinstance(r, dict) for k in r})
        raise ValueError(
            f"cannot detect the format: no row has 'messages' (role/content), 'conversations' "
            f"(from/value) or 'instruction' (alpaca); keys seen: {keys}. Pass --format and the column flags or --mapping"
        )
    raise ValueError(f"ambiguous input: rows of both formats {sorted(votes)}; pass --format")


def _by_roles(row: dict, mapping: Mapping, fits: list[str]) -> list[str]:
    """Of the formats a row fits, those whose role names cover all its turns; equivalent ones collapse."""
    covering = []
    for fmt in fits:
        m = mapping.resolved(fmt)
        if fmt == "alpaca":  # no turns to judge by: a row with an instruction and turns stays ambiguous
            covering.append(fmt)
        elif all(isinstance(t, dict) and t.get(m.role_tag) in m.roles() for t in row[m.messages]):
            covering.append(fmt)
    if len(covering) > 1 and len({mapping.resolved(f).messages for f in covering}) == 1:
        return covering[:1]  # same column, same tags, every role known to both: they parse alike
    return covering or fits


def _fits(row: dict, m: Mapping) -> bool:
    if m.format == "alpaca":
        return isinstance(row.get(m.instruction), str)
    turns = row.get(m.messages)
    if not isinstance(turns, list) or not turns or not isinstance(turns[0], dict):
        return False
    return m.role_tag in turns[0] and m.content_tag in turns[0]
