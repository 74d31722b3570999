"""Preference pairs (DPO): rows with a preferred and a dispreferred answer to one prompt.

Input layouts, read by ``omniweave data convert`` beside plain conversations::

    sharegpt  {"conversations": [{"from": "human", "value": "<image>What colour?"}],
               "chosen": {"from": "gpt", "value": "red"},
               "rejected": {"from": "gpt", "value": "blue"}, "images": ["a.png"]}
    openai    {"messages": [{"role": "user", "content": "<image>What colour?"},
                            {"role": "assistant", "content": "red"}],          <- the chosen answer
               "rejected": {"role": "assistant", "content": "blue"}, "images": ["a.png"]}
    alpaca    {"instruction": "<image>What colour?", "chosen": "red", "rejected": "blue", "images": ["a.png"]}

and LLaMA-Factory's newer ``{"chosen_messages": [...], "rejected_messages": [...]}`` (two whole
conversations that differ in their last assistant turn: ``from_conversation_pair``).
ShareGPT is LLaMA-Factory's ranking layout (the turns end with the prompt); OpenAI messages end
with the chosen answer and ``rejected`` holds the other last turn (an ``chosen`` column may hold
it instead, then the messages end with the prompt). Each side may be a message object, a string,
or a one-message list; its content may be text parts. The columns are remapped like the others
(``--chosen-key`` / ``--rejected-key`` or ``columns: {chosen: …, rejected: …}``).

A pair is stored as the conversation prompt + chosen answer (so the same raw shards also serve
SFT on the preferred answers) with the rejected answer's text in ``meta["rejected"]``. Bad pairs
are rejected with a counted reason: ``preference_missing_side`` (one side absent or empty) and
``preference_identical`` (both answers the same text: no preference to learn).
"""

from __future__ import annotations

from typing import Any

from omniweave.data.sources.formats import FormatError, _content_text
from omniweave.data.sources.mapping import Mapping

REJECT_REASONS = ("preference_missing_side", "preference_identical", "preference_sides_diverge")
PAIR_CONVERSATIONS = ("chosen_messages", "rejected_messages")  # LLaMA-Factory's newer (v1) preference rows


def from_conversation_pair(row: Any) -> Any:
    """A row holding two whole conversations (``chosen_messages``, ``rejected_messages``) -> the
    openai layout above: their shared turns + the chosen answer as ``messages``, the rejected answer
    as ``rejected``. The two must differ in their final assistant turn only
    (``preference_sides_diverge`` otherwise: one stored prompt could not hold both). Other rows pass."""
    if not isinstance(row, dict) or not any(k in row for k in PAIR_CONVERSATIONS):
        return row
    chosen, rejected = (row.get(k) for k in PAIR_CONVERSATIONS)
    if not isinstance(chosen, list) or not isinstance(rejected, list) or not chosen or not rejected:
        raise FormatError("preference_missing_side", f"a pair of conversations needs both {PAIR_CONVERSATIONS} "
                          "as non-empty lists of turns")
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if not (len(chosen) == len(rejected) == shared + 1):
        raise FormatError("preference_sides_diverge", f"the two conversations differ from turn {shared} on, not in "
                          "their last (assistant) turn only")
    rest = {k: v for k, v in row.items() if k not in PAIR_CONVERSATIONS}
    return {**rest, "messages": chosen, "rejected": rejected[-1]}


def is_preference_row(row: Any, m: Mapping) -> bool:
    """A row carrying either side of a pair, or any row of a ``ranking`` dataset (a missing side is
    then a counted reject)."""
    return isinstance(row, dict) and (m.ranking or m.chosen in row or m.rejected in row)


def _answer_text(value: Any, side: str, m: Mapping) -> str:
    """One side of a pair as the answer's text (message object, string or one-message list)."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, dict):
        role = value.get(m.role_tag)
        if role is not None and m.roles().get(role) != "assistant":
            raise FormatError("bad_schema", f"'{side}' must be an assistant turn, got role {role!r}")
        value = value.get(m.content_tag)
    media: dict[str, list[str]] = {"image": [], "video": [], "audio": []}
    text = _content_text(value, media) if isinstance(value, (str, list)) else None
    if any(media.values()) or (text and any(t in text for t in ("<image>", "<video>", "<audio>"))):
        raise FormatError("placeholder_mismatch", f"the '{side}' answer holds media; media belong in user turns")
    if not text or not text.strip():
        raise FormatError("preference_missing_side", f"the pair has no '{side}' answer (column '{getattr(m, side)}')")
    return text


def split_preference_row(row: dict, m: Mapping) -> tuple[dict, str]:
    """(the row as a plain conversation: prompt + chosen answer, the rejected answer's text)."""
    if m.format == "alpaca":
        return _split_alpaca(row, m)
    turns = row.get(m.messages)
    if not isinstance(turns, list):
        raise FormatError("bad_schema", f"'{m.messages}' must be a list of turns")
    rejected = _answer_text(row.get(m.rejected), "rejected", m)
    if m.chosen in row:
        chosen = _answer_text(row[m.chosen], "chosen", m)
        turns = [*turns, {m.role_tag: m.assistant_tag, m.content_tag: chosen}]
    else:
        last = turns[-1] if turns else None
        if not isinstance(last, dict) or m.roles().get(last.get(m.role_tag)) != "assistant":
            raise FormatError("preference_missing_side", f"no '{m.chosen}' column and the turns do not end with "
                              "the chosen assistant answer")
        chosen = _answer_text(last, "chosen", m)
    if chosen.strip() == rejected.strip():
        raise FormatError("preference_identical", "the chosen and rejected answers are the same text")
    plain = {k: v for k, v in row.items() if k not in (m.chosen, m.rejected)}
    plain[m.messages] = turns
    return plain, rejected


def _split_alpaca(row: dict, m: Mapping) -> tuple[dict, str]:
    """LLaMA-Factory's alpaca pair: the instruction (+ input, history, system) is the prompt and the
    ``chosen`` / ``rejected`` columns the two answers; the chosen one becomes the row's output."""
    rejected = _answer_text(row.get(m.rejected), "rejected", m)
    chosen = _answer_text(row.get(m.chosen), "chosen", m)
    if row.get(m.output):
        raise FormatError("bad_schema", f"a preference pair with an '{m.output}' column too: which answer is the "
                          f"preferred one, '{m.output}' or '{m.chosen}'?")
    if chosen.strip() == rejected.strip():
        raise FormatError("preference_identical", "the chosen and rejected answers are the same text")
    plain = {k: v for k, v in row.items() if k not in (m.chosen, m.rejected)}
    plain[m.output] = chosen
    return plain, rejected
