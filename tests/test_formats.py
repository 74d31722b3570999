"""ShareGPT / OpenAI-messages parsing: both formats, remapping, auto-detection, validation."""

from __future__ import annotations

import pytest

from omniweave.data.sources.formats import FormatError, parse_row
from omniweave.data.sources.mapping import Mapping, detect_format, mapping_from_yaml

OPENAI = Mapping().resolved("openai")
SHAREGPT = Mapping().resolved("sharegpt")


def roles(conv):
    return [m.role for m in conv.messages]


def test_openai_multi_turn_multi_image_and_video():
    row = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "<image> and <image>: which is red?"},
            {"role": "assistant", "content": "first"},
            {"role": "user", "content": "And this clip? <video>"},
            {"role": "assistant", "content": "left"},
        ],
        "images": ["a.png", "b.jpg"],
        "videos": ["c.mp4"],
    }
    conv = parse_row(row, OPENAI, row_id="r0")
    assert roles(conv) == ["system", "user", "assistant", "user", "assistant"]
    assert conv.images == ["a.png", "b.jpg"] and conv.videos == ["c.mp4"]
    assert conv.messages[3].content == "And this clip? <video>"
    assert conv.id == "r0"


def test_openai_content_parts_become_placeholders_and_media():
    row = {
        "id": "x7",
        "messages": [
            {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "What?"},
                                         {"type": "video", "video": "v.mp4"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "a dog"}]},
        ],
    }
    conv = parse_row(row, OPENAI, row_id="r0")
    assert conv.messages[0].content == "<image>What?<video>"
    assert conv.images == ["a.png"] and conv.videos == ["v.mp4"]
    assert conv.id == "x7"


def test_sharegpt_roles_including_tools_and_text_only():
    row = {
        "conversations": [
            {"from": "system", "value": "tools..."},
            {"from": "human", "value": "weather?"},
            {"from": "function_call", "value": '{"name": "w"}'},
            {"from": "observation", "value": "sunny"},
            {"from": "gpt", "value": "It is sunny."},
        ]
    }
    conv = parse_row(row, SHAREGPT, row_id="r1")
    assert roles(conv) == ["system", "user", "function", "observation", "assistant"]
    assert conv.images == [] and conv.videos == []


def test_remap_columns_and_tags_from_flags_and_yaml(tmp_path):
    row = {"dialog": [{"speaker": "Q", "text": "<image>hi"}, {"speaker": "A", "text": "yo"}], "pics": ["p.png"]}
    m = Mapping(format="sharegpt", messages="dialog", images="pics", role_tag="speaker", content_tag="text",
                user_tag="Q", assistant_tag="A").resolved("sharegpt")
    conv = parse_row(row, m, row_id="r")
    assert roles(conv) == ["user", "assistant"] and conv.images == ["p.png"]

    (tmp_path / "map.yaml").write_text(
        "formatting: sharegpt\ncolumns: {messages: dialog, images: pics}\n"
        "tags: {role_tag: speaker, content_tag: text, user_tag: Q, assistant_tag: A}\n"
    )
    m2 = mapping_from_yaml(tmp_path / "map.yaml")
    assert detect_format([row], m2) == "sharegpt"
    assert parse_row(row, m2.resolved("sharegpt"), row_id="r").to_json() == conv.to_json()


def test_yaml_dataset_info_entry_and_unknown_key(tmp_path):
    (tmp_path / "info.yaml").write_text("mydata:\n  formatting: sharegpt\n  columns: {messages: turns}\n")
    assert mapping_from_yaml(tmp_path / "info.yaml").messages == "turns"
    (tmp_path / "bad.yaml").write_text("columns: {mesages: turns}\n")
    with pytest.raises(ValueError, match="unknown columns key 'mesages'; columns takes messages, images, videos, "
                                         "audios, system, id, solution, chosen, rejected"):
        mapping_from_yaml(tmp_path / "bad.yaml")
    (tmp_path / "bad.yaml").write_text("columns: {role_tag: from}\n")  # a tag under columns: said where it goes
    with pytest.raises(ValueError, match="unknown columns key 'role_tag'; columns takes messages"):
        mapping_from_yaml(tmp_path / "bad.yaml")
    (tmp_path / "bad.yaml").write_text("tags: {user: human}\n")
    with pytest.raises(ValueError, match="unknown tags key 'user'; tags takes role_tag, content_tag, user_tag"):
        mapping_from_yaml(tmp_path / "bad.yaml")


def test_autodetect_each_format_and_ambiguity_error():
    oa = {"messages": [{"role": "user", "content": "a"}]}
    sg = {"conversations": [{"from": "human", "value": "a"}]}
    assert detect_format([oa]) == "openai"
    assert detect_format([sg]) == "sharegpt"
    with pytest.raises(ValueError, match="ambiguous"):
        detect_format([{**oa, **sg}])
    with pytest.raises(ValueError, match="ambiguous"):
        detect_format([oa, sg])
    with pytest.raises(ValueError, match="cannot detect"):
        detect_format([{"text": "x"}])
    assert detect_format([{"text": "x"}], Mapping(format="openai")) == "openai"  # explicit wins


@pytest.mark.parametrize(
    "turns, images, reason",
    [
        ([], [], "empty_conversation"),
        ([("user", "  "), ("assistant", "")], [], "empty_conversation"),
        ([("user", "hi")], [], "no_assistant_turn"),
        ([("user", "hi"), ("robot", "x")], [], "unknown_role"),
        ([("assistant", "a"), ("user", "b")], [], "bad_turn_order"),
        ([("user", "a"), ("user", "b"), ("assistant", "c")], [], "bad_turn_order"),
        ([("user", "a"), ("assistant", "b"), ("user", "c")], [], "bad_turn_order"),
        ([("user", "<image>"), ("assistant", "b")], [], "placeholder_mismatch"),
        ([("user", "a"), ("assistant", "b")], ["x.png"], "placeholder_mismatch"),
        ([("user", "a"), ("assistant", "<image>")], ["x.png"], "placeholder_mismatch"),
    ],
)
def test_validation_reasons(turns, images, reason):
    row = {"messages": [{"role": r, "content": c} for r, c in turns], "images": images}
    with pytest.raises(FormatError) as e:
        parse_row(row, OPENAI, row_id="r")
    assert e.value.reason == reason


def test_auto_placeholders_only_when_none_present():
    row = {"messages": [{"role": "user", "content": "what?"}, {"role": "assistant", "content": "x"}],
           "images": ["a.png", "b.png"]}
    conv = parse_row(row, OPENAI, row_id="r", auto_placeholders=True)
    assert conv.messages[0].content == "<image><image>what?"
    row["messages"][0]["content"] = "<image> what?"  # one present, two files: still a mismatch
    with pytest.raises(FormatError, match="placeholder_mismatch"):
        parse_row(row, OPENAI, row_id="r", auto_placeholders=True)


def test_both_formats_parse_to_the_same_conversation_property():
    """Any valid conversation written as OpenAI messages or as ShareGPT parses to the same thing."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    text = st.text(alphabet="abc xyz?!", max_size=12)
    pair = st.tuples(text, st.integers(0, 2), st.integers(0, 1), text)  # user text, #images, #videos, answer

    @settings(max_examples=60, deadline=None)
    @given(system=st.one_of(st.none(), text), pairs=st.lists(pair, min_size=1, max_size=4))
    def check(system, pairs):
        turns, images, videos = [], [], []
        if system:
            turns.append(("system", system))
        for user, n_img, n_vid, answer in pairs:
            turns.append(("user", "<image>" * n_img + user + "<video>" * n_vid + "."))
            turns.append(("assistant", answer + "."))
            images += [f"i{len(images) + k}.png" for k in range(n_img)]
            videos += [f"v{len(videos) + k}.mp4" for k in range(n_vid)]
        oa = {"messages": [{"role": r, "content": c} for r, c in turns], "images": images, "videos": videos}
        names = {"system": "system", "user": "human", "assistant": "gpt"}
        sg = {"conversations": [{"from": names[r], "value": c} for r, c in turns], "images": images, "videos": videos}
        a = parse_row(oa, OPENAI, row_id="r")
        b = parse_row(sg, SHAREGPT, row_id="r")
        assert a.to_json() == b.to_json()
        assert [(m.role, m.content) for m in a.messages] == turns
        assert a.images == images and a.videos == videos

    check()


def test_a_mapping_without_formatting_is_detected_not_called_ambiguous(tmp_path):
    """docs/data.md's mapping example with ``formatting`` omitted ("omit to auto-detect")."""
    (tmp_path / "map.yaml").write_text(
        "columns: {messages: dialog, images: pics, videos: clips, system: system_prompt}\n"
        "tags: {role_tag: speaker, content_tag: text, user_tag: Q, assistant_tag: A}\n"
    )
    m = mapping_from_yaml(tmp_path / "map.yaml")
    row = {"dialog": [{"speaker": "Q", "text": "<image>hi"}, {"speaker": "A", "text": "yo"}], "pics": ["p.png"],
           "system_prompt": "Be brief."}
    fmt = detect_format([row], m)
    conv = parse_row(row, m.resolved(fmt), row_id="r")
    assert [msg.role for msg in conv.messages] == ["system", "user", "assistant"] and conv.images == ["p.png"]
    # role names only one format knows decide it
    row2 = {"dialog": [{"speaker": "human", "text": "hi"}, {"speaker": "gpt", "text": "yo"}]}
    m2 = Mapping(messages="dialog", role_tag="speaker", content_tag="text")
    assert detect_format([row2], m2) == "sharegpt"
    # when it really is ambiguous, the error does not ask for the mapping the user already gave
    row3 = {"dialog": [{"speaker": "x", "text": "hi"}, {"speaker": "y", "text": "yo"}]}
    with pytest.raises(ValueError, match="ambiguous") as e:
        detect_format([row3], m2)
    assert "--mapping" not in str(e.value) and "formatting:" in str(e.value)


# ---------------------------------------------------------------------------- alpaca (issue 32, item 1)

ALPACA = {"instruction": "Translate to English.", "input": "Bonjour", "output": "Hello", "system": "You translate.",
          "history": [["Hi", "Hello! How can I help?"], ["Who are you?", "A translator."]]}


def test_alpaca_rows_become_the_turns_llama_factory_builds():
    conv = parse_row(ALPACA, Mapping().resolved("alpaca"), row_id="r")
    assert [(m.role, m.content) for m in conv.messages] == [
        ("system", "You translate."), ("user", "Hi"), ("assistant", "Hello! How can I help?"),
        ("user", "Who are you?"), ("assistant", "A translator."),
        ("user", "Translate to English.\nBonjour"), ("assistant", "Hello")]
    plain = parse_row({"instruction": "<image>Colour?", "input": "", "output": "red", "images": ["a.png"]},
                      Mapping().resolved("alpaca"), row_id="r")
    assert [(m.role, m.content) for m in plain.messages] == [("user", "<image>Colour?"), ("assistant", "red")]
    assert plain.images == ["a.png"] and "extra" not in plain.meta  # every column read, none left over


def test_alpaca_columns_remap_and_bad_values_are_counted_reasons(tmp_path):
    row = {"q": "Name a colour.", "ctx": "one word", "a": "Red", "past": [["x", "y"]]}
    m = Mapping(instruction="q", input="ctx", output="a", history="past").resolved("alpaca")
    assert [msg.content for msg in parse_row(row, m, row_id="r").messages] == ["x", "y", "Name a colour.\none word", "Red"]
    for bad, what in (({**ALPACA, "output": 5}, "'output' (output) must be a string"),
                      ({**ALPACA, "history": [["only one"]]}, "'history' must be a list of [prompt, answer]"),
                      ({**ALPACA, "instruction": ["x"]}, "'instruction' (instruction) must be a string")):
        with pytest.raises(FormatError, match=what.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")) as e:
            parse_row(bad, Mapping().resolved("alpaca"), row_id="r")
        assert e.value.reason == "bad_schema"
    with pytest.raises(FormatError) as e:  # no output: nothing to learn from
        parse_row({"instruction": "q"}, Mapping().resolved("alpaca"), row_id="r")
    assert e.value.reason == "no_assistant_turn"


def test_alpaca_is_detected_and_a_row_with_turns_too_is_ambiguous():
    assert detect_format([ALPACA]) == "alpaca"
    with pytest.raises(ValueError, match="fits both formats"):
        detect_format([{**ALPACA, "messages": [{"role": "user", "content": "a"}]}])


def test_convert_reads_alpaca_with_column_flags(tmp_path):
    """``--input-key`` remaps alpaca's input column without touching ``--input`` (the files)."""
    import json

    from omniweave.cli import main
    from omniweave.data.sources.shards import RawDataset

    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "Add.", "numbers": "2 3", "answer": "5", "sys": "Be exact."}) + "\n")
    assert main(["data", "convert", "--input", str(rows), "--output", str(tmp_path / "raw"), "--format", "alpaca",
                 "--instruction-key", "prompt", "--input-key", "numbers", "--output-key", "answer", "--system-key", "sys",
                 "--workers", "1", "--no-progress"]) == 0
    (sample,) = list(RawDataset(tmp_path / "raw"))
    assert [(m.role, m.content) for m in sample.conversation.messages] == [
        ("system", "Be exact."), ("user", "Add.\n2 3"), ("assistant", "5")]


# ---------------------------------------------------------------------------- KTO labels (issue 32, item 5)


def test_a_kto_label_is_carried_as_the_samples_desirability():
    turns = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    m = Mapping().resolved("openai")
    assert parse_row({**turns, "label": False}, m, row_id="r").meta == {"kto_tag": False}
    assert parse_row({**turns, "kto_tag": "true"}, m, row_id="r").meta == {"kto_tag": True}
    assert parse_row({**turns, "label": "positive"}, m, row_id="r").meta == {"extra": {"label": "positive"}}  # not KTO
    assert parse_row({**turns, "good": 0 == 1}, Mapping(kto_tag="good").resolved("openai"), row_id="r").meta == {
        "kto_tag": False}
    with pytest.raises(FormatError, match="'kto_tag' \\(KTO desirability\\) must be true or false"):
        parse_row({**turns, "kto_tag": "maybe"}, m, row_id="r")


def test_llama_factory_newer_messages_format_with_value_parts_and_loss_weights():
    """Issue 32, items 4-5: content parts carry ``value`` (text, or a media path under an ``*_url``
    type) and turns a ``loss_weight``; nothing is dropped."""
    row = {"messages": [
        {"role": "user", "content": [{"type": "image_url", "value": "a.png"}, {"type": "text", "value": "What is it?"},
                                     {"type": "video_url", "value": "v.mp4"}, {"type": "audio_url", "value": "s.wav"}]},
        {"role": "assistant", "content": [{"type": "text", "value": "A cat."}], "loss_weight": 0.0},
        {"role": "user", "content": [{"type": "text", "value": "Sure?"}, {"type": "text", "text": " Really?"}]},
        {"role": "assistant", "content": [{"type": "text", "value": "Yes."}], "loss_weight": 1.0}]}
    conv = parse_row(row, Mapping().resolved(detect_format([row])), row_id="r")
    assert [(m.role, m.content, m.loss_weight) for m in conv.messages] == [
        ("user", "<image>What is it?<video><audio>", 1.0), ("assistant", "A cat.", 0.0),
        ("user", "Sure? Really?", 1.0), ("assistant", "Yes.", 1.0)]
    assert (conv.images, conv.videos, conv.audios) == (["a.png"], ["v.mp4"], ["s.wav"])
    with pytest.raises(FormatError, match="needs its text as a string") as e:
        parse_row({"messages": [{"role": "user", "content": [{"type": "text", "value": 3}]},
                                {"role": "assistant", "content": "x"}]}, Mapping().resolved("openai"), row_id="r")
    assert e.value.reason == "bad_schema"
