"""Chat templates: ChatML parity with Qwen2-VL's own template, assistant-only labels, YAML templates."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from data_factory import to_hf_messages

from omniweave.data.sample import Message
from omniweave.data.text.jinja_export import hf_chat_template
from omniweave.data.text.template import (
    BUILTIN_TEMPLATES,
    IGNORE_INDEX,
    encode_conversation,
    load_template,
    render,
)
from omniweave.data.text.tokenizer import DEMO_TOKENIZER_DIR, load_tokenizer

ASSETS = Path(__file__).parent / "assets"

MULTI_TURN = [
    Message("user", "<image>What colour is the circle?"),
    Message("assistant", "It is red."),
    Message("user", "And in this clip <video> what moves?\nAnswer briefly."),
    Message("assistant", "A blue square moves left."),
    Message("user", "Compare <image> with <image>."),
    Message("assistant", "  The first one is larger.\n"),
]
CONVERSATIONS = {
    "text_only": [Message("user", "Hello there"), Message("assistant", "Hi! 123")],
    "with_system": [Message("system", "Be terse."), Message("user", "<image>Describe."), Message("assistant", "A dog.")],
    "image_first": [Message("user", "<image>\nWhat is this?"), Message("assistant", "A cat.")],
    "multi_turn": MULTI_TURN,
}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("demo")


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(DEMO_TOKENIZER_DIR / "tokenizer.json"))
    hf.chat_template = (ASSETS / "qwen2_vl_chat_template.jinja").read_text()
    return hf


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_chatml_matches_qwen2_vl_chat_template(name, tok, hf_tokenizer):
    messages = CONVERSATIONS[name]
    hf_messages = to_hf_messages(messages)
    expected_text = hf_tokenizer.apply_chat_template(hf_messages, tokenize=False)
    expected_ids = hf_tokenizer.apply_chat_template(hf_messages, tokenize=True, return_dict=True)["input_ids"]
    ids, _, rendered, _ = encode_conversation(BUILTIN_TEMPLATES["chatml"], tok, messages)
    assert rendered.text == expected_text
    assert ids.tolist() == list(expected_ids)


def test_multi_turn_labels_decode_to_assistant_replies_with_end_tokens(tok):
    ids, labels, _, _ = encode_conversation(BUILTIN_TEMPLATES["chatml"], tok, MULTI_TURN)
    assert ids.dtype == np.int32 and labels.shape == ids.shape
    loss = labels != IGNORE_INDEX
    assert (labels[loss] == ids[loss]).all()
    # each maximal run of loss tokens is exactly one assistant reply + "<|im_end|>\n"
    runs = np.split(np.arange(len(ids)), np.flatnonzero(np.diff(loss.astype(int))) + 1)
    replies = [tok.decode(ids[r]) for r in runs if loss[r[0]]]
    assert replies == [m.content + "<|im_end|>\n" for m in MULTI_TURN if m.role == "assistant"]


def test_media_blocks_never_carry_loss_even_in_assistant_turns(tok):
    messages = [Message("user", "Draw."), Message("assistant", "Here: <image> done")]
    ids, labels, _, _ = encode_conversation(BUILTIN_TEMPLATES["chatml"], tok, messages)
    for special in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"):
        at = ids == tok.token_id(special)
        assert at.sum() == 1 and (labels[at] == IGNORE_INDEX).all()
    assert tok.decode(ids[labels != IGNORE_INDEX]) == "Here:  done<|im_end|>\n"


def test_llama3_rendering_and_labels(tok):
    messages = [Message("system", "S."), Message("user", "Q?"), Message("assistant", "A.")]
    ids, labels, rendered, _ = encode_conversation(BUILTIN_TEMPLATES["llama3"], tok, messages)
    assert rendered.text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nQ?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nA.<|eot_id|>"
    )
    assert tok.decode(ids[labels != IGNORE_INDEX]) == "A.<|eot_id|>"


def test_default_system_prompt_only_without_system_turn():
    chatml = BUILTIN_TEMPLATES["chatml"]
    assert render(chatml, [Message("user", "x")]).text.startswith("<|im_start|>system\nYou are a helpful assistant.")
    assert render(chatml, [Message("system", "Mine."), Message("user", "x")]).text.count("system") == 1


def test_yaml_template_overrides_a_builtin(tmp_path, tok):
    path = tmp_path / "terse.yaml"
    path.write_text('base: chatml\nname: terse\ndefault_system: null\nassistant: "<|im_start|>assistant\\n{content}<|im_end|>"\n')
    template = load_template(path)
    assert template.name == "terse" and template.default_system is None
    ids, labels, rendered, _ = encode_conversation(template, tok, [Message("user", "hi"), Message("assistant", "yo")])
    assert rendered.text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>"
    assert tok.decode(ids[labels != IGNORE_INDEX]) == "yo<|im_end|>"


def test_bad_templates_fail_clearly(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("usr: '{content}'\n")
    with pytest.raises(ValueError, match="unknown keys"):
        load_template(bad)
    bad.write_text("user: 'no placeholder'\n")
    with pytest.raises(ValueError, match="must hold"):
        load_template(bad)
    with pytest.raises(FileNotFoundError, match="not a built-in"):
        load_template("nonexistent_template")
    with pytest.raises(ValueError, match="unknown role"):
        render(BUILTIN_TEMPLATES["chatml"], [Message("narrator", "x")])


def test_demo_tokenizer_has_every_special_token_and_regenerates_identically(tmp_path, tok, monkeypatch):
    from omniweave.assets.tokenizers.make_demo_tokenizer import SPECIAL_TOKENS, build

    monkeypatch.setenv("RAYON_NUM_THREADS", "1")  # build() sets it; restored after the test

    for special in SPECIAL_TOKENS:
        assert tok.encode(special) == [tok.token_id(special)]
    build(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (DEMO_TOKENIZER_DIR / name).read_bytes()


def test_tokenizer_round_trips_arbitrary_text(tok):
    text = "Ünïcödé 🙂 tabs\tand\nnewlines  <|im_end|> 42"
    assert tok.decode(tok.encode(text)) == text
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_tokenizer("/nonexistent/dir")


def test_tool_turns_function_calls_carry_loss_observations_do_not(tok):
    messages = [Message("user", "Weather?"), Message("function", '{"name": "weather"}'),
                Message("observation", "sunny"), Message("assistant", "It is sunny.")]
    ids, labels, rendered, _ = encode_conversation(BUILTIN_TEMPLATES["chatml"], tok, messages)
    assert "<tool_response>\nsunny\n</tool_response>" in rendered.text
    assert tok.decode(ids[labels != IGNORE_INDEX]) == '{"name": "weather"}<|im_end|>\nIt is sunny.<|im_end|>\n'


@pytest.mark.parametrize("name", ["text_only", "with_system", "image_first"])
def test_generation_prompt_matches_apply_chat_template(name, tok, hf_tokenizer):
    prompt = CONVERSATIONS[name][:-1]  # drop the assistant reply
    expected = hf_tokenizer.apply_chat_template(to_hf_messages(prompt), tokenize=False, add_generation_prompt=True)
    rendered = render(BUILTIN_TEMPLATES["chatml"], prompt, add_generation_prompt=True)
    assert rendered.text == expected
    assert rendered.text.endswith("<|im_start|>assistant\n")


ODD_TEMPLATE = dataclasses.replace(  # Jinja-looking text, quotes, backslashes, non-ASCII, a BOS
    BUILTIN_TEMPLATES["chatml"], name="odd #}", bos="<|begin_of_text|>", default_system='Tu es là ✓ "{{x}}" \\ %}',
    user="«user» {% raw %} {content} -%}\t😀\n")  # fmt: skip


@pytest.mark.parametrize("template", [*BUILTIN_TEMPLATES.values(), ODD_TEMPLATE], ids=lambda t: t.name)
@pytest.mark.parametrize("name", sorted(CONVERSATIONS) + ["tools"])
def test_exported_jinja_template_renders_like_ours(template, name):
    """hf_chat_template (an export's chat_template.jinja) = render (after the processor's framing of
    images where the family's processor adds one: ``processor_image``), for string and content-part
    messages, with and without the generation prompt; for chatml also = Qwen2-VL's own template."""
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = CONVERSATIONS.get(name) or [Message("user", "Weather?"), Message("function", "{}"), Message("observation", "sunny")]
    jinja = hf_chat_template(template)
    for gen in (False, True):
        want = render(template, messages, add_generation_prompt=gen).text
        for hf_messages in ([{"role": m.role, "content": m.content} for m in messages], to_hf_messages(messages)):
            got, _ = render_jinja_template(conversations=[hf_messages], chat_template=jinja, add_generation_prompt=gen)
            if template.processor_image:  # the family's processor frames each image the template writes (InternVL)
                got = [g.replace(template.processor_image, template.image) for g in got]
            if template.processor_video:  # … and writes a video's frames where the template wrote its marker
                got = [g.replace(template.processor_video, template.video) for g in got]
            assert got[0] == want
        if template.name == "chatml" and name != "tools":
            qwen, _ = render_jinja_template(conversations=[to_hf_messages(messages)], add_generation_prompt=gen,
                                            chat_template=(ASSETS / "qwen2_vl_chat_template.jinja").read_text())  # fmt: skip
            assert qwen[0] == want
