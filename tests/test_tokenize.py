"""SampleProcessor: placeholder expansion, M-RoPE parity with transformers' get_rope_index,
header counting == full processing per sample, assistant labels, media-aware truncation."""

from __future__ import annotations

import json
import pickle
from collections import Counter

import numpy as np
import pytest
import torch
from data_factory import png_bytes, to_hf_messages, video_bytes

from omniweave.data.sample import Conversation, Message, RawSample
from omniweave.data.text.template import IGNORE_INDEX
from omniweave.data.text.tokenize import SampleProcessor, SampleRejected

VISION = {"min_pixels": 28 * 28 * 2, "max_pixels": 28 * 28 * 24, "video_min_pixels": 28 * 28 * 2,
          "video_max_pixels": 28 * 28 * 12, "video_total_pixels": 28 * 28 * 60}
IMG_A, IMG_B = png_bytes(60, 90, seed=1), png_bytes(120, 40, seed=2)  # 2x3 and 4x1 merged tokens
VID = video_bytes(7, fps=3.0, height=50, width=76, seed=3)  # 4 sampled frames at 12/7 fps: fractional time steps


def raw(messages, images=(), videos=(), key="s0") -> RawSample:
    media = {name: data for name, data in (*images, *videos)}
    conv = Conversation(id=key, messages=[Message(r, c) for r, c in messages],
                        images=[n for n, _ in images], videos=[n for n, _ in videos])
    return RawSample(key=key, conversation=conv, media=media)


SAMPLES = {
    "text_only": raw([("user", "Hi"), ("assistant", "Hello!")]),
    "image": raw([("user", "<image>What is it?"), ("assistant", "Noise.")], images=[("img0.png", IMG_A)]),
    "multi_image": raw([("user", "<image> vs <image>"), ("assistant", "Left is wider.")],
                       images=[("img0.png", IMG_A), ("img1.png", IMG_B)]),
    "video": raw([("user", "<video>What moves?"), ("assistant", "Stripes.")], videos=[("vid0.mp4", VID)]),
    "mixed": raw([("user", "<image>Look."), ("assistant", "Seen."), ("user", "Now <video> and <image>?"),
                  ("assistant", "Both stripes.")],
                 images=[("img0.png", IMG_A), ("img1.png", IMG_B)], videos=[("vid0.mp4", VID)]),
}


@pytest.fixture(scope="module")
def proc():
    return SampleProcessor({"tokenizer": "demo", "template": "chatml", "max_len": 4096, "vision": VISION})


@pytest.fixture(scope="module")
def tiny_models(proc):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel, Qwen2VLConfig, Qwen2VLModel

    tok = proc.tokenizer
    text = dict(vocab_size=tok.vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=1, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 1, 1]})
    ids = dict(image_token_id=tok.token_id("<|image_pad|>"), video_token_id=tok.token_id("<|video_pad|>"),
               vision_start_token_id=tok.token_id("<|vision_start|>"))
    torch.manual_seed(0)
    qwen2 = Qwen2VLModel(Qwen2VLConfig(text_config=text, vision_config=dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2), **ids))
    qwen25 = Qwen2_5_VLModel(Qwen2_5_VLConfig(text_config=text, vision_config=dict(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=16, tokens_per_second=2), **ids))
    return {"mrope": qwen2, "mrope_qwen25": qwen25}


def reference_rope_index(model, sample, proc):
    ids = torch.as_tensor(sample.input_ids, dtype=torch.long)[None]
    token_type = torch.zeros_like(ids, dtype=torch.int32)
    token_type[ids == proc.image_pad_id] = 1
    token_type[ids == proc.video_pad_id] = 2
    grids = {k: [s.grid_thw for s in sample.media if s.kind == k] for k in ("image", "video")}
    kwargs = {}
    if "Qwen2_5" in type(model).__name__ and grids["video"]:
        kwargs["second_per_grid_ts"] = torch.tensor([s.second_per_grid for s in sample.media if s.kind == "video"])
    pos, _ = model.get_rope_index(
        ids, mm_token_type_ids=token_type,
        image_grid_thw=torch.tensor(grids["image"]) if grids["image"] else None,
        video_grid_thw=torch.tensor(grids["video"]) if grids["video"] else None, **kwargs)
    return pos[:, 0].numpy()


@pytest.mark.parametrize("rope", ["mrope", "mrope_qwen25"])
@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_position_ids_equal_transformers_get_rope_index(name, rope, tiny_models):
    proc = SampleProcessor({"tokenizer": "demo", "max_len": 4096, "rope": rope, "vision": VISION})
    sample = proc.tokenize(SAMPLES[name])
    assert sample.position_ids.shape == (3, len(sample)) and sample.position_ids.dtype == np.int32
    np.testing.assert_array_equal(sample.position_ids, reference_rope_index(tiny_models[rope], sample, proc))


def test_qwen25_video_positions_are_scaled_by_seconds_per_grid(proc):
    q2 = SampleProcessor({"tokenizer": "demo", "rope": "mrope", "vision": VISION}).tokenize(SAMPLES["video"])
    q25 = SampleProcessor({"tokenizer": "demo", "rope": "mrope_qwen25", "vision": VISION}).tokenize(SAMPLES["video"])
    span = q25.media[0]
    t = span.grid_thw[0]
    block = slice(span.start, span.start + span.length)
    assert t == 2 and span.second_per_grid == pytest.approx(2 / (4 / 7 * 3))
    step = int(np.float32(2) * np.float32(span.second_per_grid))  # 2 tokens/s * 1.1667 s = 2.33 -> 2
    assert np.unique(q25.position_ids[0, block]).tolist() == [span.start, span.start + step]
    assert np.unique(q2.position_ids[0, block]).tolist() == [span.start, span.start + 1]


def test_rope1d_positions_are_a_range():
    sample = SampleProcessor({"tokenizer": "demo", "rope": "rope1d", "vision": VISION}).tokenize(SAMPLES["image"])
    np.testing.assert_array_equal(sample.position_ids, np.arange(len(sample))[None])


@pytest.mark.parametrize("name", ["multi_image", "mixed"])
def test_placeholders_expand_to_counted_tokens_and_counting_equals_processing(name, proc):
    sample = proc.tokenize(SAMPLES[name])
    r = SAMPLES[name]
    assert sample.input_ids.dtype == np.int32 and sample.labels.dtype == np.int32 and not sample.truncated
    conv = r.conversation
    assert [s.part for s in sample.media if s.kind == "image"] == conv.images  # reading order
    assert [s.part for s in sample.media if s.kind == "video"] == conv.videos
    start_id, end_id = proc.tokenizer.token_id("<|vision_start|>"), proc.tokenizer.token_id("<|vision_end|>")
    for span in sample.media:
        pad = proc.image_pad_id if span.kind == "image" else proc.video_pad_id
        block = sample.input_ids[span.start : span.start + span.length]
        assert (block == pad).all() and (sample.labels[span.start : span.start + span.length] == IGNORE_INDEX).all()
        assert sample.input_ids[span.start - 1] == start_id and sample.input_ids[span.start + span.length] == end_id
        pixel_values = proc.process_media(span, r.media[span.part])  # full decode
        t, h, w = span.grid_thw
        assert pixel_values.shape == (t * h * w, 3 * 2 * 14 * 14)
        assert span.length == t * h * w // 4
    assert (np.isin(sample.input_ids, [proc.image_pad_id, proc.video_pad_id])).sum() == sum(s.length for s in sample.media)


def test_sample_labels_decode_to_assistant_replies(proc):
    sample = proc.tokenize(SAMPLES["mixed"])
    loss = sample.labels != IGNORE_INDEX
    assert (sample.labels[loss] == sample.input_ids[loss]).all()
    runs = np.split(np.arange(len(sample)), np.flatnonzero(np.diff(loss.astype(int))) + 1)
    assert [proc.tokenizer.decode(sample.input_ids[r]) for r in runs if loss[r[0]]] == [
        "Seen.<|im_end|>\n", "Both stripes.<|im_end|>\n"]


# ---------------------------------------------------------------------------- truncation


def long_turns_sample(key: str) -> RawSample:
    """Turn 1 (text) fits max_len=45; turn 2 holds an image block at tokens [37, 53) that crosses it."""
    return raw([("user", "Hi"), ("assistant", "Hello there."), ("user", "And <image>?"), ("assistant", "Noise.")],
               images=[("img0.png", png_bytes(280, 280, seed=5))], key=key)


def test_truncation_policies_with_counts():
    batch = [long_turns_sample("a"), long_turns_sample("b"), SAMPLES["text_only"],
             raw([("user", "word " * 80), ("assistant", "ok")], key="long_text"),
             raw([("user", "word " * 20 + "<image>"), ("assistant", "big")], images=[("i.png", png_bytes(280, 280))],
                 key="first_turn_crosses")]
    outcomes = {}
    for policy in ("drop", "drop_turns"):
        proc = SampleProcessor({"tokenizer": "demo", "max_len": 45, "truncation": policy, "vision": VISION})
        counts, kept = Counter(), []
        for r in batch:
            try:
                sample = proc.tokenize(r)
            except SampleRejected as e:
                counts[e.reason] += 1
            else:
                counts["truncated" if sample.truncated else "kept"] += 1
                kept.append(sample)
        for sample in kept:  # whatever is kept fits and never holds a cut vision span
            assert len(sample) <= 45
            assert all(s.start + s.length < len(sample) for s in sample.media)
        outcomes[policy] = (counts, kept)
    assert outcomes["drop"][0] == Counter(vision_span_exceeds_max_len=3, too_long=1, kept=1)
    assert outcomes["drop_turns"][0] == Counter(truncated=2, vision_span_exceeds_max_len=1, too_long=1, kept=1)
    truncated = [s for s in outcomes["drop_turns"][1] if s.truncated][0]
    proc = SampleProcessor({"tokenizer": "demo", "max_len": 45, "vision": VISION})
    assert truncated.media == []
    loss = truncated.labels != IGNORE_INDEX
    assert proc.tokenizer.decode(truncated.input_ids[loss]) == "Hello there.<|im_end|>\n"
    assert proc.tokenizer.decode(truncated.input_ids).endswith("<|im_start|>assistant\nHello there.<|im_end|>\n")


# ---------------------------------------------------------------------------- rejects and identity


@pytest.mark.parametrize("sample,reason", [
    (raw([("user", "<image>"), ("assistant", "x")]), "media_count_mismatch"),
    (raw([("user", "<image>"), ("assistant", "x")], images=[("a.png", b"junk")]), "bad_image"),
    (raw([("user", "<image>"), ("assistant", "x")], images=[("a.png", png_bytes(2, 500))]), "aspect_ratio_too_extreme"),
    (raw([("user", "only a question")]), "no_assistant_turn"),
    (raw([("user", "<|image_pad|> <image>"), ("assistant", "x")], images=[("a.png", IMG_A)]), "special_token_in_text"),
])
def test_rejects_carry_a_reason(sample, reason, proc):
    with pytest.raises(SampleRejected) as err:
        proc.tokenize(sample)
    assert err.value.reason == reason


def test_missing_media_part_is_rejected(proc):
    r = raw([("user", "<image>"), ("assistant", "x")], images=[("a.png", IMG_A)])
    r.media.clear()
    with pytest.raises(SampleRejected, match="missing_media"):
        proc.tokenize(r)


def test_fingerprint_is_stable_json_and_tracks_settings():
    from omegaconf import OmegaConf

    a = SampleProcessor({"tokenizer": "demo", "max_len": 128, "vision": VISION})
    b = SampleProcessor(OmegaConf.create({"tokenizer": "demo", "max_len": 128, "vision": VISION}))
    c = SampleProcessor({"tokenizer": "demo", "max_len": 256, "vision": VISION})
    assert json.dumps(a.fingerprint(), sort_keys=True) == json.dumps(b.fingerprint(), sort_keys=True)
    assert a.fingerprint()["max_len"] != c.fingerprint()["max_len"]
    assert len(a.fingerprint()["tokenizer_sha256"]) == 64 and a.fingerprint()["template"]["name"] == "chatml"
    clone = pickle.loads(pickle.dumps(a))  # packer workers receive the processor by pickle
    assert clone.fingerprint() == a.fingerprint()
    np.testing.assert_array_equal(clone.tokenize(SAMPLES["mixed"]).input_ids, a.tokenize(SAMPLES["mixed"]).input_ids)
    with pytest.raises(ValueError, match="truncation"):
        SampleProcessor({"truncation": "cut"})


def test_image_sample_ids_equal_the_qwen2vl_processor_recipe(proc):
    """What Qwen2VLProcessor does: render the chat template, replace each <|image_pad|> by
    grid.prod() // merge² pads (grid from the image processor), tokenize the text."""
    import io
    from pathlib import Path

    from PIL import Image
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    hf_tok = PreTrainedTokenizerFast(tokenizer_file=str(proc.tokenizer.path / "tokenizer.json"))
    hf_tok.chat_template = (Path(__file__).parent / "assets" / "qwen2_vl_chat_template.jinja").read_text()
    hf_images = Qwen2VLImageProcessorPil(min_pixels=VISION["min_pixels"], max_pixels=VISION["max_pixels"])
    r = SAMPLES["multi_image"]
    grids = hf_images(images=[Image.open(io.BytesIO(r.media[p])) for p in r.conversation.images])["image_grid_thw"]
    text = hf_tok.apply_chat_template(to_hf_messages(r.conversation.messages), tokenize=False)
    for grid in grids.tolist():
        text = text.replace("<|image_pad|>", "<|placeholder|>" * (grid[0] * grid[1] * grid[2] // 4), 1)
    expected = hf_tok(text.replace("<|placeholder|>", "<|image_pad|>"))["input_ids"]
    assert proc.tokenize(r).input_ids.tolist() == list(expected)


def test_tokenize_prompt_drops_the_reply_and_keeps_media_positions():
    """The eval prompt equals the training sample cut right after the assistant header."""
    proc = SampleProcessor({"tokenizer": "demo", "template": "chatml", "max_len": 4096})
    png = png_bytes(56, 84)
    conv = Conversation("p", [Message("user", "<image>What colour?"), Message("assistant", "red")], images=["img0.png"])
    raw = RawSample("p", conv, {"img0.png": png})
    full, prompt = proc.tokenize(raw), proc.tokenize_prompt(raw)
    header = proc.tokenizer.encode("<|im_start|>assistant\n")
    n = len(prompt)
    assert (prompt.labels == -100).all()
    assert list(prompt.input_ids[-len(header):]) == header
    assert np.array_equal(full.input_ids[:n], prompt.input_ids)
    assert np.array_equal(full.position_ids[:, :n], prompt.position_ids)
    assert [(s.start, s.length) for s in prompt.media] == [(s.start, s.length) for s in full.media]


# ---------------------------------------------------------------------------- loss per turn (issue 32, item 4)

TURNS = [("user", "first question"), ("assistant", "first answer"), ("user", "second"), ("assistant", "last answer")]


def _loss_text(p: SampleProcessor, sample) -> str:
    return p.tokenizer.decode(sample.input_ids[sample.labels != IGNORE_INDEX])


def _weighted(weights):
    r = raw(TURNS)
    r.conversation.messages = [Message(m.role, m.content, w) for m, w in zip(r.conversation.messages, weights)]
    return r


def test_a_turn_with_loss_weight_0_has_no_loss_tokens():
    p = SampleProcessor({"tokenizer": "demo", "max_len": 512})
    both = _loss_text(p, p.tokenize(raw(TURNS)))
    assert both == "first answer<|im_end|>\nlast answer<|im_end|>\n"
    assert _loss_text(p, p.tokenize(_weighted([1, 0, 1, 1]))) == "last answer<|im_end|>\n"
    with pytest.raises(SampleRejected, match="no_assistant_turn"):  # nothing left to learn from
        p.tokenize(_weighted([1, 0, 1, 0]))


def test_mask_history_keeps_the_last_answer_and_train_on_prompt_adds_the_prompts():
    last = SampleProcessor({"tokenizer": "demo", "max_len": 512, "mask_history": True})
    assert _loss_text(last, last.tokenize(raw(TURNS))) == "last answer<|im_end|>\n"
    every = SampleProcessor({"tokenizer": "demo", "max_len": 512, "train_on_prompt": True})
    sample = every.tokenize(raw(TURNS))
    assert (sample.labels == sample.input_ids).all()  # the whole conversation (chatml has no BOS)
    assert _loss_text(every, every.tokenize(_weighted([0, 1, 1, 1]))).startswith("<|im_start|>system")
    assert "first question" not in _loss_text(every, every.tokenize(_weighted([0, 1, 1, 1])))
    assert every.fingerprint()["loss"] == {"mask_history": False, "train_on_prompt": True} != last.fingerprint()["loss"]


def test_loss_weights_are_read_from_rows_and_kept_in_the_shard_json():
    from omniweave.data.sources.formats import FormatError, parse_row
    from omniweave.data.sources.mapping import Mapping
    from omniweave.data.sample import Conversation

    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "loss_weight": 0},
                        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "b", "loss": True}]}
    conv = parse_row(row, Mapping().resolved("openai"), row_id="r")
    assert [m.loss_weight for m in conv.messages] == [1.0, 0.0, 1.0, 1.0]
    assert Conversation.from_json(json.loads(json.dumps(conv.to_json()))).messages == conv.messages
    assert conv.to_json()["messages"][1] == {"role": "assistant", "content": "a", "loss_weight": 0.0}
    row["messages"][1]["loss_weight"] = 0.5
    assert parse_row(row, Mapping().resolved("openai"), row_id="r").messages[1].loss_weight == 0.5
    for bad in (-1, float("nan")):
        row["messages"][1]["loss_weight"] = bad
        with pytest.raises(FormatError) as e:
            parse_row(row, Mapping().resolved("openai"), row_id="r")
        assert e.value.reason == "bad_loss_weight"
