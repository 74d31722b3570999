"""Tools and tool calls (issue 32, item 3): a row's ``tools`` column and its calls / results reach
the sample and render exactly as Qwen2.5's released chat template renders them (transformers'
own renderer on the template text in tests/assets/chat_templates), with the whole call carrying loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omniweave.data.sources.formats import FormatError, parse_row
from omniweave.data.sources.mapping import Mapping
from omniweave.data.sample import Conversation, RawSample
from omniweave.data.text.template import IGNORE_INDEX, load_template, render
from omniweave.data.text.tokenize import SampleProcessor, SampleRejected
from omniweave.data.text.tools import apply_tool_style

QWEN2_5 = (Path(__file__).parent / "assets/chat_templates/qwen2_5.jinja").read_text()
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city, °C",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time",
                                         "parameters": {"type": "object", "properties": {}}}}
OPENAI_ROW = {
    "tools": [WEATHER, TIME],
    "messages": [
        {"role": "user", "content": "Weather and time in Zürich?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\"}"}},
            {"type": "function", "function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "content": "{\"temp\": 21}"},
        {"role": "tool", "content": "14:05"},
        {"role": "assistant", "content": "21 °C at 14:05."},
        {"role": "user", "content": "And Bern?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Bern"}}}]},
        {"role": "tool", "content": "{\"temp\": 19}"},
        {"role": "assistant", "content": "19 °C."}],
}


def hf_messages(row: dict) -> list[dict]:
    """The row as transformers' apply_chat_template takes it (arguments as objects, as it asks)."""
    out = []
    for m in row["messages"]:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{"type": "function", "function": {**c["function"], "arguments": (
                json.loads(c["function"]["arguments"]) if isinstance(c["function"]["arguments"], str)
                else c["function"]["arguments"])}} for c in m["tool_calls"]]
        out.append(m)
    return out


def qwen_reference(messages: list[dict], tools=None, add_generation_prompt=False) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template([messages], tools=tools, chat_template=QWEN2_5,
                                        add_generation_prompt=add_generation_prompt)
    return rendered[0]


def ours(row: dict, add_generation_prompt=False) -> str:
    """Our rendering; with ``add_generation_prompt`` the prompt before the row's last (assistant) turn."""
    conv = parse_row(row, Mapping().resolved("openai"), row_id="r")
    chatml = load_template("chatml")
    messages = apply_tool_style(chatml.tool_style, chatml.default_system, conv.messages, conv.meta.get("tools"))
    return render(chatml, messages[:-1] if add_generation_prompt else messages, add_generation_prompt).text


@pytest.mark.parametrize("case", ["tools_calls_results", "system_and_tools", "tools_no_calls", "calls_without_tools",
                                  "generation_prompt"])
def test_rendering_equals_qwen2_5s_released_template(case):
    row = json.loads(json.dumps(OPENAI_ROW))
    kwargs = {}
    if case == "system_and_tools":
        row["messages"].insert(0, {"role": "system", "content": "You are a weather bot."})
    elif case == "tools_no_calls":
        row["messages"] = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]
    elif case == "calls_without_tools":
        del row["tools"]
    elif case == "generation_prompt":  # the prompt after two parallel results
        row["messages"] = row["messages"][:5]
        kwargs["add_generation_prompt"] = True
    want = hf_messages(row)[:-1] if kwargs else hf_messages(row)
    assert ours(row, **kwargs) == qwen_reference(want, row.get("tools"), **kwargs)


def test_the_whole_call_carries_loss_and_results_do_not():
    proc = SampleProcessor({"tokenizer": "demo", "max_len": 4096})
    conv = parse_row(OPENAI_ROW, Mapping().resolved("openai"), row_id="r")
    sample = proc.tokenize(RawSample("s", conv, {}))
    loss = proc.tokenizer.decode(sample.input_ids[sample.labels != IGNORE_INDEX])
    assert loss.startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>\n'
                           '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call><|im_end|>\n')
    assert "Let me check.\n<tool_call>" in loss and "temp" not in loss and "# Tools" not in loss


def test_sharegpt_tools_column_and_function_call_turns():
    """LLaMA-Factory's ShareGPT tool data: ``tools`` is a JSON string, ``function_call`` values are
    ``{"name", "arguments"}`` JSON; the tools land in the sample (not ``meta.extra``)."""
    row = {"conversations": [{"from": "human", "value": "Weather in Bern?"},
                             {"from": "function_call", "value": json.dumps({"name": "get_weather",
                                                                            "arguments": {"city": "Bern"}})},
                             {"from": "observation", "value": "{\"temp\": 19}"},
                             {"from": "gpt", "value": "19 °C."}],
           "tools": json.dumps([WEATHER])}
    conv = parse_row(row, Mapping().resolved("sharegpt"), row_id="r")
    assert conv.meta == {"tools": [WEATHER]}
    assert Conversation.from_json(json.loads(json.dumps(conv.to_json()))).meta["tools"] == [WEATHER]
    chatml = load_template("chatml")
    text = render(chatml, apply_tool_style("qwen", chatml.default_system, conv.messages, conv.meta["tools"])).text
    reference = qwen_reference([{"role": "user", "content": "Weather in Bern?"},
                                {"role": "assistant", "content": None, "tool_calls": [
                                    {"function": {"name": "get_weather", "arguments": {"city": "Bern"}}}]},
                                {"role": "tool", "content": "{\"temp\": 19}"},
                                {"role": "assistant", "content": "19 °C."}], [WEATHER])
    assert text == reference


def test_bad_tools_and_calls_and_templates_without_tools_are_counted_rejects():
    with pytest.raises(FormatError, match="'tools' is a string but not JSON") as e:
        parse_row({**OPENAI_ROW, "tools": "[{oops"}, Mapping().resolved("openai"), row_id="r")
    assert e.value.reason == "bad_schema"
    proc = SampleProcessor({"tokenizer": "demo", "max_len": 4096})
    bad_call = parse_row({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "not json"},
                                            {"from": "observation", "value": "r"}, {"from": "gpt", "value": "a"}]},
                         Mapping().resolved("sharegpt"), row_id="r")
    with pytest.raises(SampleRejected) as e:
        proc.tokenize(RawSample("s", bad_call, {}))
    assert e.value.reason == "bad_tool_call"
    llama = SampleProcessor({"tokenizer": "demo", "template": "llama3", "max_len": 4096})
    with pytest.raises(SampleRejected) as e:
        llama.tokenize(RawSample("s", parse_row(OPENAI_ROW, Mapping().resolved("openai"), row_id="r"), {}))
    assert e.value.reason == "tools_unsupported"
