"""Chat templates equal the released ones (issue 32, item 6).

Each built-in family template renders the text of the family's released Jinja template (the files in
tests/assets/chat_templates, rendered by transformers' own renderer) for multi-turn, system, tools,
media, reasoning and generation-prompt conversations; its assistant loss spans equal a
prefix-rendering oracle on the released template wherever that template is prefix-stable.
``data.template: hf`` renders the tokenizer directory's own template: token ids and labels equal
the built-in's, masks by prefix rendering or by the template's ``{% generation %}`` blocks."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from omniweave.data.sample import Conversation, RawSample
from omniweave.data.sources.formats import parse_row
from omniweave.data.sources.mapping import Mapping
from omniweave.data.text.jinja_export import hf_chat_template
from omniweave.data.text.template import (IGNORE_INDEX, encode_conversation, load_template,
                                          loss_mask_from_offsets)
from omniweave.data.text.tokenize import SampleProcessor, SampleRejected
from omniweave.data.text.tokenizer import DEMO_TOKENIZER_DIR

ASSETS = Path(__file__).parent / "assets/chat_templates"
# built-in template -> (released template file, the special tokens transformers hands it)
RELEASED = {
    "chatml": ("qwen2_5_vl.jinja", {}),  # Qwen2-VL / Qwen2.5-VL (byte-identical templates)
    "qwen2_5": ("qwen2_5_instruct.jinja", {}),
    "qwen3": ("qwen3.jinja", {}),
    "qwen3_nothink": ("qwen3_instruct_2507.jinja", {}),
    "qwen3_vl": ("qwen3_vl.jinja", {}),
    "llama3": ("llama3.jinja", {"bos_token": "<|begin_of_text|>"}),
    "deepseek3": ("deepseekv3.jinja", {"bos_token": "<｜begin▁of▁sentence｜>"}),
    "qwen2_audio": (None, {}),  # the Hub's template, as transformers' Qwen2AudioProcessor.default_chat_template keeps it
    "internvl": ("internvl_hf.jinja", {}),  # + InternVLProcessor's framing of each image (PROCESSOR_STEP)
    "llava_onevision": ("llava_onevision_hf.jinja", {}),  # LlavaOnevisionProcessor adds nothing around <image>
}
# released templates that render only content parts (a string content renders nothing): every message as parts
PARTS_ONLY = {"llava_onevision"}
# what a family's processor does to the rendered text before tokenizing, where it adds tokens around the
# template's own (InternVLProcessor.replace_image_token, one pad per image here)
# (InternVL: the template writes "<video>" where our text keeps one <IMG_CONTEXT> for the frames to replace)
PROCESSOR_STEP = {"internvl": lambda text: text.replace("<IMG_CONTEXT>", "<img><IMG_CONTEXT></img>")
                                               .replace("<video>", "<IMG_CONTEXT>")}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
CASES = {
    "single": {"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]},
    "system_multi": {"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"}, {"role": "user", "content": "3+3?"},
        {"role": "assistant", "content": "6"}]},
    "media": {"messages": [
        {"role": "user", "content": "<image>What colour?"}, {"role": "assistant", "content": "Red."},
        {"role": "user", "content": "And <video> this one?"}, {"role": "assistant", "content": "Blue."}],
        "images": ["a.png"], "videos": ["b.mp4"]},
    "tools": {"tools": [WEATHER], "messages": [
        {"role": "user", "content": "Weather in Bern?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Bern\"}"}}]},
        {"role": "tool", "content": "{\"temp\": 19}"},
        {"role": "assistant", "content": "19 °C."}]},
    "think": {"messages": [
        {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd\n</think>\n\n4"},
        {"role": "user", "content": "3+3?"}, {"role": "assistant", "content": "<think>add again</think>6"}]},
    "whitespace": {"messages": [{"role": "user", "content": "  hi \n"}, {"role": "assistant", "content": " yo\n"}]},
    "audio": {"messages": [
        {"role": "user", "content": "<audio>What is this?"}, {"role": "assistant", "content": "A bell."},
        {"role": "user", "content": "And <audio><audio> these?"}, {"role": "assistant", "content": "Two dogs."}],
        "audios": ["a.wav", "b.wav", "c.wav"]},
    # placeholders inside a turn's text: LLaVA-OneVision's template renders the images, then the videos, first
    "media_inside": {"messages": [
        {"role": "user", "content": "<video>Compare <image> with <image>."}, {"role": "assistant", "content": "Alike."},
        {"role": "user", "content": "Now <image> and <video>"}, {"role": "assistant", "content": "Same."}],
        "images": ["a.png", "b.png", "c.png"], "videos": ["e.mp4", "f.mp4"]},
}
SUPPORTED = {  # the cases each released template can render (no tools in Qwen2-VL's / Llama 3's / ours for DeepSeek)
    "chatml": ["single", "system_multi", "media", "whitespace"],
    "qwen2_5": ["single", "system_multi", "tools", "whitespace"],
    "qwen3": ["single", "system_multi", "tools", "think"],
    "qwen3_nothink": ["single", "system_multi", "tools"],
    "qwen3_vl": ["single", "system_multi", "media", "tools"],
    "llama3": ["single", "system_multi", "whitespace"],
    "deepseek3": ["single", "system_multi", "think"],
    "qwen2_audio": ["single", "system_multi", "audio", "whitespace"],
    "internvl": ["single", "system_multi", "media", "whitespace"],
    "llava_onevision": ["single", "system_multi", "media", "whitespace", "media_inside"],
}
PARAMS = [(t, c, g) for t, cases in SUPPORTED.items() for c in cases for g in (False, True)]


def reference_messages(row: dict, name: str | None = None) -> list[dict]:
    """The row as apply_chat_template takes it: media placeholders as content parts (every content
    for the template ``name`` in PARTS_ONLY), call arguments as objects."""
    out = []
    for m in row["messages"]:
        m = dict(m)
        if m.get("content") is None:  # Qwen3-VL's template iterates a non-string content: "" as HF's docs write it
            m["content"] = ""
        if isinstance(m.get("content"), str) and (name in PARTS_ONLY or re.search("<image>|<video>|<audio>", m["content"])):
            m["content"] = [{"type": p[1:-1]} if p in ("<image>", "<video>", "<audio>") else {"type": "text", "text": p}
                            for p in re.split("(<image>|<video>|<audio>)", m["content"]) if p]
        if m.get("tool_calls"):
            m["tool_calls"] = [{"type": "function", "function": {**c["function"], "arguments": json.loads(
                c["function"]["arguments"])}} for c in m["tool_calls"]]
        out.append(m)
    return out


def released(name: str, messages: list[dict], tools=None, add_generation_prompt=False) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    file, special = RELEASED[name]
    if file is None:
        from transformers.models.qwen2_audio.processing_qwen2_audio import Qwen2AudioProcessor

        text = Qwen2AudioProcessor.default_chat_template.fget(None)
    else:
        text = (ASSETS / file).read_text()
    rendered, _ = render_jinja_template([messages], tools=tools, chat_template=text,
                                        add_generation_prompt=add_generation_prompt, **special)
    return rendered[0]


def case_row(case: str, generation: bool) -> dict:
    row = json.loads(json.dumps(CASES[case]))
    if generation:  # the prompt before the last answer
        row["messages"] = row["messages"][:-1]
    return row


def ours(proc: SampleProcessor, row: dict, generation: bool):
    full = dict(row, messages=row["messages"] + ([{"role": "assistant", "content": "x"}] if generation else []))
    conv = parse_row(full, Mapping().resolved("openai"), row_id="r")
    messages = proc.messages(conv)[:-1] if generation else proc.messages(conv)
    return encode_conversation(proc.template, proc.tokenizer, messages, generation, proc.mask_history,
                               proc.train_on_prompt, tools=proc.template_tools(conv))


@pytest.mark.parametrize("name,case,generation", PARAMS)
def test_builtin_renders_the_released_template(name, case, generation):
    row = case_row(case, generation)
    want = PROCESSOR_STEP.get(name, str)(released(name, reference_messages(row, name), row.get("tools"), generation))
    proc = SampleProcessor({"tokenizer": "demo", "template": name})
    ids, _, rendered, _ = ours(proc, row, generation)
    assert rendered.text == want
    assert ids.tolist() == proc.tokenizer.encode(want)


def prefix_oracle(name: str, row: dict) -> list[tuple[int, int]] | None:
    """Loss spans of the released template by rendering prefixes; None where it is not prefix-stable."""
    msgs, tools, step = reference_messages(row, name), row.get("tools"), PROCESSOR_STEP.get(name, str)
    full = step(released(name, msgs, tools))
    spans = []
    for k, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        start, end = step(released(name, msgs[:k], tools, True)), step(released(name, msgs[: k + 1], tools))
        if not (end.startswith(start) and full.startswith(end)):
            return None
        spans.append((len(start), len(end)))
    return spans


@pytest.mark.parametrize("name,case", [(t, c) for t, cases in SUPPORTED.items() for c in cases])
def test_builtin_loss_spans_equal_the_prefix_rendering_oracle(name, case):
    row = case_row(case, False)
    spans = prefix_oracle(name, row)
    unstable = (name == "qwen3" and case in ("system_multi", "tools", "think")) or name == "deepseek3"
    if unstable:  # earlier turns re-rendered once later ones follow / generation opens <think>: no oracle
        assert spans is None
        return
    proc = SampleProcessor({"tokenizer": "demo", "template": name})
    ids, labels, rendered, offsets = ours(proc, row, False)
    want = loss_mask_from_offsets(offsets, spans)
    assert np.array_equal(labels != IGNORE_INDEX, want)


def test_qwen3_think_blocks_follow_the_released_rules_and_carry_loss():
    proc = SampleProcessor({"tokenizer": "demo", "template": "qwen3"})
    _, labels, rendered, _ = ours(proc, case_row("think", False), False)
    assert "add\n</think>" not in rendered.text.split("3+3?")[0]  # dropped before the last query
    assert "<think>\nadd again\n</think>\n\n6<|im_end|>\n" in rendered.text
    _, labels, rendered, _ = ours(proc, case_row("single", False), False)
    assert rendered.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nHello!<|im_end|>\n")


def test_exported_jinja_of_each_builtin_renders_the_released_text():
    """An export's chat_template.jinja (jinja_export.hf_chat_template) renders what the released one does."""
    from transformers.utils.chat_template_utils import render_jinja_template

    for name, cases in SUPPORTED.items():
        jinja = hf_chat_template(load_template(name))
        for case in cases:  # tools too: the definitions, calls and results as the family's template writes them
            for generation in (False, True):
                row = case_row(case, generation)
                msgs, tools = reference_messages(row, name), row.get("tools")
                got, _ = render_jinja_template([msgs], tools=tools, chat_template=jinja, add_generation_prompt=generation)
                assert got[0] == released(name, msgs, tools, generation), (name, case, generation)


def test_llama_factory_names_are_aliases():
    assert load_template("qwen2_vl") is load_template("chatml")
    assert load_template("qwen").default_system == "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    assert load_template("qwen3_vl_nothink").name == "qwen3_vl" and load_template("qwen3_vl").default_system is None
    with pytest.raises(FileNotFoundError, match="LLaMA-Factory's names"):
        load_template("no_such_template")


def test_packs_built_before_the_new_template_fields_keep_their_fingerprint():
    spec = load_template("chatml").spec()
    assert not {"generation_prompt", "think_style", "trim_content", "processor_image", "media_first"} & set(spec)
    assert load_template("qwen3").spec()["think_style"] == "qwen3"


# ---------------------------------------------------------------- data.template: hf


def tokenizer_dir(tmp_path: Path, template_file: str, how: str = "jinja") -> Path:
    out = tmp_path / f"tok_{Path(template_file).stem}_{how}"
    shutil.copytree(DEMO_TOKENIZER_DIR, out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    text = (ASSETS / template_file).read_text()
    if how == "jinja":
        (out / "chat_template.jinja").write_text(text)
    elif how == "processor_json":
        (out / "chat_template.json").write_text(json.dumps({"chat_template": text}))
    else:  # tokenizer_config.json's chat_template
        config = json.loads((out / "tokenizer_config.json").read_text())
        (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": text}))
    return out


@pytest.mark.parametrize("name", ["chatml", "qwen2_5", "qwen3_nothink", "qwen3_vl", "qwen3"])
def test_hf_template_equals_the_builtin_ids_and_labels(tmp_path, name):
    hf = SampleProcessor({"tokenizer": str(tokenizer_dir(tmp_path, RELEASED[name][0])), "template": "hf"})
    builtin = SampleProcessor({"tokenizer": "demo", "template": name})
    for case in SUPPORTED[name]:
        row = case_row(case, False)
        if name == "qwen3" and case != "single":  # earlier turns re-rendered: counted reject (next test)
            continue
        for generation in (False, True):
            got, want = ours(hf, case_row(case, generation), generation), ours(builtin, case_row(case, generation), generation)
            assert got[2].text == want[2].text, (case, generation)
            assert got[0].tolist() == want[0].tolist() and got[1].tolist() == want[1].tolist(), (case, generation)
            assert got[2].media_kinds == want[2].media_kinds
        del row


def test_hf_template_rejects_samples_it_cannot_mask_exactly(tmp_path):
    proc = SampleProcessor({"tokenizer": str(tokenizer_dir(tmp_path, "qwen3.jinja")), "template": "hf"})
    conv = parse_row(case_row("system_multi", False), Mapping().resolved("openai"), row_id="r")
    with pytest.raises(SampleRejected, match="template_not_prefix_stable.*data.template=qwen3"):
        proc.tokenize(RawSample("s", conv, {}))


def test_hf_template_uses_generation_blocks_where_the_template_has_them(tmp_path):
    hf = SampleProcessor({"tokenizer": str(tokenizer_dir(tmp_path, "qwen3_vl_training.jinja")), "template": "hf"})
    builtin = SampleProcessor({"tokenizer": "demo", "template": "qwen3_vl"})
    for case in ("single", "system_multi", "tools"):
        got, want = ours(hf, case_row(case, False), False), ours(builtin, case_row(case, False), False)
        assert got[2].text == want[2].text and got[1].tolist() == want[1].tolist(), case
    hf_history = SampleProcessor({"tokenizer": hf.tokenizer.path, "template": "hf", "mask_history": True})
    _, labels, _, _ = ours(hf_history, case_row("system_multi", False), False)
    assert hf.tokenizer.decode(labels[labels != IGNORE_INDEX]) == "6<|im_end|>\n"


@pytest.mark.parametrize("how", ["jinja", "processor_json", "tokenizer_config"])
def test_hf_template_is_read_where_hugging_face_keeps_it(tmp_path, how):
    proc = SampleProcessor({"tokenizer": str(tokenizer_dir(tmp_path, "qwen3_vl.jinja", how)), "template": "hf"})
    assert proc.template.source == (ASSETS / "qwen3_vl.jinja").read_text()
    other = SampleProcessor({"tokenizer": str(tokenizer_dir(tmp_path, "qwen2_5_vl.jinja")), "template": "hf"})
    assert proc.fingerprint()["template"] != other.fingerprint()["template"]  # a changed template is a new pack


def test_hf_template_without_one_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="has no chat template"):
        SampleProcessor({"tokenizer": "demo", "template": "hf"})


@pytest.mark.parametrize("released, family", [("internvl_hf.jinja", "internvl"), ("llava_onevision_hf.jinja", "llava_onevision")])
def test_hf_template_of_a_family_with_its_own_framing_names_the_builtin(tmp_path, released, family):
    """data.template=hf on InternVL's / LLaVA-OneVision's released templates (their processors frame or
    reorder the media; the built-ins render them exactly): one error naming the built-in."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(DEMO_TOKENIZER_DIR / name, tmp_path / name)
    (tmp_path / "chat_template.jinja").write_text((ASSETS / released).read_text())
    with pytest.raises(FileNotFoundError, match=f"use the built-in template: {family}"):
        SampleProcessor({"tokenizer": str(tmp_path), "template": "hf"})


def _png(w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 30, 30)).save(buf, "PNG")
    return buf.getvalue()


def test_hf_template_sample_with_media_tools_and_loss_weights(tmp_path):
    """A whole sample through tokenize(): pads expanded per image token, tools rendered by the
    template, a turn with loss_weight 0 carries no loss; equal to the built-in."""
    row = {"tools": [WEATHER], "images": ["a.png"], "messages": [
        {"role": "user", "content": "<image>Which city is this?"}, {"role": "assistant", "content": "Bern.", "loss_weight": 0},
        {"role": "user", "content": "Its weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Bern\"}"}}]},
        {"role": "tool", "content": "{\"temp\": 19}"}, {"role": "assistant", "content": "19 °C."}]}
    conv = parse_row(row, Mapping().resolved("openai"), row_id="r")
    conv = Conversation(conv.id, conv.messages, images=["img0.png"], meta=conv.meta)
    raw = RawSample("s", conv, {"img0.png": _png(97, 61)})
    hf = SampleProcessor({"tokenizer": str(tokenizer_dir(tmp_path, "qwen3_vl.jinja")), "template": "hf"}).tokenize(raw)
    builtin = SampleProcessor({"tokenizer": "demo", "template": "qwen3_vl"}).tokenize(raw)
    assert hf.input_ids.tolist() == builtin.input_ids.tolist() and hf.labels.tolist() == builtin.labels.tolist()
    assert [m.grid_thw for m in hf.media] == [m.grid_thw for m in builtin.media]
    tok = SampleProcessor({"tokenizer": "demo"}).tokenizer
    loss = tok.decode(hf.labels[hf.labels != IGNORE_INDEX])
    assert "Bern." not in loss and loss.startswith('<tool_call>\n{"name": "get_weather"') and loss.endswith("19 °C.<|im_end|>\n")
    assert "# Tools" in tok.decode(hf.input_ids)


def test_export_of_an_hf_template_recipe_writes_the_template_itself(tmp_path):
    from omniweave.models.hf.processor_files import write_tokenizer_files

    tok = tokenizer_dir(tmp_path, "qwen3_vl.jinja")
    out = tmp_path / "export"
    out.mkdir()
    write_tokenizer_files(tok, out, "hf")
    assert (out / "chat_template.jinja").read_text() == (ASSETS / "qwen3_vl.jinja").read_text()


@pytest.mark.parametrize("name", ["chatml", "qwen3_vl"])
def test_hf_template_train_on_prompt_labels_every_turn_as_the_builtin_does(tmp_path, name):
    tok = str(tokenizer_dir(tmp_path, RELEASED[name][0]))
    hf = SampleProcessor({"tokenizer": tok, "template": "hf", "train_on_prompt": True})
    builtin = SampleProcessor({"tokenizer": "demo", "template": name, "train_on_prompt": True})
    got, want = ours(hf, case_row("system_multi", False), False), ours(builtin, case_row("system_multi", False), False)
    assert got[1].tolist() == want[1].tolist() and (got[1] != IGNORE_INDEX).all()


def test_hf_verify_on_a_qwen3_vl_directory_renders_with_its_own_template(tmp_path, capsys):
    """A Qwen3-VL directory whose (released) template has no default system prompt passes ``hf verify``
    by default (``--template auto``: the directory's own); our chatml, which adds one, fails on input_ids."""
    from qwen3_vl_factory import save_tiny

    from omniweave.cli import main

    path, _ = save_tiny("qwen3_vl", tmp_path / "q3")
    tok = tokenizer_dir(tmp_path, "qwen3_vl.jinja")
    for file in tok.iterdir():
        shutil.copy(file, path / file.name)
    assert main(["hf", "verify", str(path)]) == 0
    out = capsys.readouterr().out
    assert "HF renders the directory's chat template, ours template 'hf'" in out
    assert main(["hf", "verify", str(path), "--template", "chatml"]) == 1
    assert "FAIL: input_ids" in capsys.readouterr().out


def test_llava_onevision_media_tags_are_placeholders_and_its_pads():
    """``<image>`` / ``<video>`` are both our placeholders and LLaVA-OneVision's pad tokens (special
    tokens of the demo tokenizer): typed in a text they are placeholders (not rejected as typed
    special tokens; counted against the media list), each becomes one pad run; a turn's media render
    first, images then videos (media_kinds in that order); string contents export as parts do."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from omniweave.data.sample import Message

    proc = SampleProcessor({"tokenizer": "demo", "template": "llava_onevision", "rope": "rope1d"})
    assert (proc.image_pad_id, proc.video_pad_id) == (703, 702)
    messages = [Message("user", "<video>Compare <image> with <image>."), Message("assistant", "Alike.")]
    proc.check_text(messages)  # placeholders, not typed special tokens
    ids, labels, rendered, _ = encode_conversation(proc.template, proc.tokenizer, messages)
    assert rendered.text == "<|im_start|>user\n<image>\n<image>\n<video>\nCompare  with .<|im_end|>\n<|im_start|>assistant\nAlike.<|im_end|>\n"
    assert rendered.media_kinds == ["image", "image", "video"]
    assert [int(i) for i in ids if i in (702, 703)] == [703, 703, 702]
    assert proc.tokenizer.decode(labels[labels != IGNORE_INDEX]) == "Alike.<|im_end|>\n"
    conv = Conversation("c", [Message("user", "<image>x"), Message("assistant", "y")])  # an <image> without an image
    with pytest.raises(SampleRejected, match="media_count_mismatch"):
        proc.tokenize(RawSample("s", conv, {}))
    jinja = hf_chat_template(proc.template)
    as_strings = [{"role": m.role, "content": m.content} for m in messages]
    got, _ = render_jinja_template([as_strings], chat_template=jinja)
    assert got[0] == rendered.text
