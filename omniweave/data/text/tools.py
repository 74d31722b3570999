"""Tools (function calling) as the family's own chat template renders them.

A sample's tool definitions ride in ``meta["tools"]`` (a row's ``tools`` column: a list of
definitions, or LLaMA-Factory's JSON string of one). A tool call is a ``function`` turn whose
content is the JSON of its calls (OpenAI ``tool_calls``, or ShareGPT's ``function_call`` value
``{"name", "arguments"}``), optionally ``{"content": text, "tool_calls": [...]}`` when the turn also
says something; a tool's result is an ``observation`` turn.

``apply_tool_style(template, messages, tools)`` rewrites the messages so the template's plain
role formats render exactly what the family's Jinja template renders. One style so far, ``qwen``
(Qwen2 / Qwen2.5 / Qwen2.5-VL / Qwen3, Hermes-style; chatml and qwen2_5_omni use it):

- the definitions join the system prompt (the template's default one when there is none):
  ``SYSTEM\\n\\n# Tools ... <tools>\\n{tool json}\\n...</tools> ... </tool_call>``, each definition
  ``json.dumps``-ed as transformers' ``tojson`` filter does;
- each call becomes ``<tool_call>\\n{"name": "NAME", "arguments": ARGS_JSON}\\n</tool_call>``, calls
  joined by ``\\n`` after the turn's text; an OpenAI call's ``arguments`` string is parsed first
  (the template ``tojson``s a dict);
- consecutive tool results share one user turn, each in ``<tool_response>`` tags.

The whole call carries loss, wrappers included (it is the assistant's output). A template without
a tool style (llama3, plain) renders calls and results with its own function / observation formats
and rejects a sample that has tool definitions (``tools_unsupported``) rather than drop them.
"""

from __future__ import annotations

import json
from typing import Any

from omniweave.data.sample import Message

TOOL_STYLES = ("qwen",)
QWEN_TOOLS = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
              "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
              "For each function call, return a json object with function name and arguments within "
              "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
              "<args-json-object>}\n</tool_call>")


class ToolError(ValueError):
    """A sample whose tools or calls cannot be rendered; ``reason`` is the counted reject reason."""

    def __init__(self, reason: str, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason = reason


def parse_tools(value: Any) -> list[dict] | None:
    """A row's ``tools`` value -> a list of definitions (None when absent or empty); ValueError
    when it is neither a list of objects nor the JSON text of one."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"'tools' is a string but not JSON ({e})") from None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise ValueError(f"'tools' must be a list of tool definitions (objects), got {type(value).__name__}")
    return value or None


def parse_calls(content: str) -> tuple[str, list[dict]]:
    """A function turn's (text, [{"name", "arguments"}])."""
    try:
        value = json.loads(content)
    except ValueError:
        raise ToolError("bad_tool_call", f"a tool-call turn must hold the JSON of its calls, got {content[:80]!r}") from None
    text = ""
    if isinstance(value, dict) and "tool_calls" in value:
        text, value = value.get("content") or "", value["tool_calls"]
    calls = value if isinstance(value, list) else [value]
    out = []
    for call in calls:
        call = call.get("function", call) if isinstance(call, dict) else call  # OpenAI: {"type", "function"}
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ToolError("bad_tool_call", f"a tool call needs a string 'name', got {call!r}")
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass  # rendered as the string it is, as the template would
        out.append({"name": call["name"], "arguments": arguments})
    return text, out


def _tojson(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)  # transformers' chat-template tojson


def apply_tool_style(style: str | None, default_system: str | None, messages: list[Message],
                     tools: list[dict] | None) -> list[Message]:
    """The messages rewritten so plain role formats render the style's tool text (module doc)."""
    if not tools and not any(m.role in ("function", "observation") for m in messages):
        return messages
    if style is None:  # calls and results keep the template's own function / observation formats
        if tools:
            raise ToolError("tools_unsupported", "this template has no way to show tool definitions; use chatml "
                                                 "(Qwen) or a template with a tool_style")
        return messages
    out: list[Message] = []  # the one style so far: qwen (ChatTemplate checks the name)
    if tools:
        has_system = messages and messages[0].role == "system"
        system = messages[0].content if has_system else (default_system or "")
        section = QWEN_TOOLS.replace("{tools}", "".join("\n" + _tojson(t) for t in tools))
        out.append(Message("system", f"{system}\n\n{section}" if system else section,
                           messages[0].loss_weight if has_system else 1.0))
        messages = messages[1:] if has_system else messages
    for m in messages:
        if m.role == "function":
            text, calls = parse_calls(m.content)
            wrapped = [f'<tool_call>\n{{"name": "{c["name"]}", "arguments": {_tojson(c["arguments"])}}}\n</tool_call>'
                       for c in calls]
            out.append(Message("function", "\n".join(([text] if text else []) + wrapped), m.loss_weight))
        elif m.role == "observation" and out and out[-1].role == "observation":  # one user turn for a run
            out[-1] = Message("observation", f"{out[-1].content}\n</tool_response>\n<tool_response>\n{m.content}",
                              out[-1].loss_weight)
        else:
            out.append(m)
    return out
