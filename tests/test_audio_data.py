"""Audio through the data pipeline (issue 19, data half): convert -> pack -> loader.

Convert stores wav / flac / mp3 / m4a / ogg byte-identical (``audios`` column + ``<audio>`` tags,
OpenAI ``input_audio`` / ``audio_url`` parts), rejecting unreadable audio with counted reasons; pack
plans audio spans from headers (span lengths = ``audio_tokens``), drops audio for a recipe without
an audio encoder (``no_audio_encoder``); the loader's audio tensors equal WhisperFeatureExtractor.
"""

from __future__ import annotations

import base64
import io
import json
import wave

import numpy as np
import pytest
import torch

from audio_factory import encode, signal
from omniweave.data.sources.shards import RawDataset
from test_shards import run_convert

FORMATS = ("wav", "flac", "mp3", "m4a", "ogg")


def sharegpt(human, gpt="ok", **columns):
    return {"conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}], **columns}


def openai(parts, answer="ok", **columns):
    return {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}], **columns}


def clip(fmt: str, seconds: float = 0.5, rate: int = 16000, seed: int = 0) -> bytes:
    channels = 2 if fmt == "ogg" else 1  # FFmpeg's vorbis encoder has no mono
    return encode(signal(seconds, rate, channels, seed), rate, fmt)


def wav_bytes(samples: np.ndarray, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def convert(tmp_path, rows, name="in", **files) -> tuple[dict, list[dict], RawDataset]:
    for file, data in files.items():
        (tmp_path / file.replace("__", ".")).write_bytes(data)
    src = tmp_path / f"{name}.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / f"raw-{name}"
    assert run_convert("--input", str(src), "--output", str(out), "--workers", "1") == 0
    report = json.loads((out / "convert_report.json").read_text())
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert report["input"] == len(rows) == report["written"] + report["rejected"]
    return report, rejects, RawDataset(out)


# ---------------------------------------------------------------------------- convert


def test_every_format_converts_and_is_stored_byte_identical(tmp_path):
    files = {f"a__{fmt}": clip(fmt, seed=i) for i, fmt in enumerate(FORMATS)}
    rows = [sharegpt(f"<audio>What is it? ({fmt})", audios=[f"a.{fmt}"]) for fmt in FORMATS]
    rows.append(sharegpt("First <audio> then <audio>: same?", "no", audios=["a.wav", "a.mp3"]))
    report, rejects, ds = convert(tmp_path, rows, **files)
    assert rejects == [] and report["media_items"] == {"image": 0, "video": 0, "audio": 7}
    for sample, fmt in zip(ds, FORMATS):
        conv = sample.conversation
        assert conv.audios == [f"aud0.{fmt}"] and conv.meta["source_audios"] == [f"a.{fmt}"]
        assert sample.media[f"aud0.{fmt}"] == files[f"a__{fmt}"]  # byte-identical
    two = ds[len(FORMATS)].conversation
    assert two.audios == ["aud0.wav", "aud1.mp3"]  # the i-th <audio> is audios[i]
    assert ds[len(FORMATS)].media["aud1.mp3"] == files["a__mp3"]


def test_openai_input_audio_and_audio_url_parts(tmp_path):
    from data_factory import png_bytes

    data, png = clip("mp3", seed=3), png_bytes(16, 16)
    b64 = base64.b64encode(data).decode()
    rows = [
        openai([{"type": "input_audio", "input_audio": {"data": b64, "format": "mp3"}},
                {"type": "text", "text": "Say?"}]),
        openai([{"type": "text", "text": "Which? "}, {"type": "audio_url", "audio_url": {"url": "b.flac"}}]),
        openai([{"type": "audio_url", "audio_url": {"url": f"data:audio/mpeg;base64,{b64}"}}]),
        openai([{"type": "audio", "audio": "b.flac"}, {"type": "image_url", "image_url": {"url": "missing.png"}}]),
        openai([{"type": "input_audio", "input_audio": {"data": "%%%", "format": "mp3"}}]),
        openai([{"type": "input_file", "input_file": {"file_id": "f"}}]),
        openai([{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{base64.b64encode(png).decode()}"}}]),
    ]
    report, rejects, ds = convert(tmp_path, rows, b__flac=clip("flac", seed=4))
    assert {r["row"]: r["reason"] for r in rejects} == {3: "missing_media", 4: "bad_data_url",
                                                         5: "unsupported_modality:file"}
    inline, url, data_url, image = (s.conversation for s in ds)
    assert image.images == ["img0.png"] and ds[3].media["img0.png"] == png  # data: URLs work for any kind
    assert inline.messages[0].content == "<audio>Say?" and inline.audios == ["aud0.mp3"]
    assert ds[0].media["aud0.mp3"] == data and ds[2].media["aud0.mp3"] == data
    assert inline.meta["source_audios"] == [f"data:audio/mp3;base64,... ({len(b64)} characters)"]  # not the bytes
    assert url.messages[0].content == "Which? <audio>" and ds[1].media["aud0.flac"] == (tmp_path / "b.flac").read_bytes()
    assert data_url.audios == ["aud0.mp3"]


def test_bad_audio_is_rejected_with_its_reason_and_counted(tmp_path):
    good = clip("wav", 0.5)
    rows = [
        sharegpt("<audio>ok?", audios=["good.wav"]),
        sharegpt("<audio>cut?", audios=["cut.wav"]),  # data chunk declares more than is there
        sharegpt("<audio>noise?", audios=["noise.wav"]),  # not a container FFmpeg can open
        sharegpt("<audio>empty?", audios=["empty.wav"]),  # zero samples
        sharegpt("<audio><audio>two tags, one file", audios=["good.wav"]),
        sharegpt("<audio>one tag, two files", audios=["good.wav", "good.wav"]),
        sharegpt("<audio>silent video?", audios=["v.mp4"]),
        sharegpt("no tag", audios=["good.wav"]),
    ]
    from data_factory import video_bytes

    report, rejects, ds = convert(
        tmp_path, rows, good__wav=good, cut__wav=good[: len(good) // 2],
        noise__wav=np.random.default_rng(0).bytes(3000), empty__wav=wav_bytes(np.zeros(0)),
        v__mp4=video_bytes(4, height=28, width=28),
    )
    want = {1: "audio_truncated", 2: "not_audio", 3: "empty_audio", 4: "placeholder_mismatch",
            5: "placeholder_mismatch", 6: "no_audio_stream", 7: "placeholder_mismatch"}
    assert {r["row"]: r["reason"] for r in rejects} == want
    assert report["written"] == 1 and report["rejected_by_reason"] == {
        "audio_truncated": 1, "empty_audio": 1, "no_audio_stream": 1, "not_audio": 1, "placeholder_mismatch": 3}
    assert ds[0].media["aud0.wav"] == good


def test_auto_placeholders_prepend_audio_tags(tmp_path):
    (tmp_path / "a.wav").write_bytes(clip("wav", 0.2))
    (tmp_path / "in.jsonl").write_text(json.dumps(sharegpt("What is said?", audios=["a.wav", "a.wav"])) + "\n")
    assert run_convert("--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "raw"), "--workers", "1",
                       "--auto-placeholders") == 0
    conv = RawDataset(tmp_path / "raw")[0].conversation
    assert conv.messages[0].content == "<audio><audio>What is said?" and conv.audios == ["aud0.wav", "aud1.wav"]


# ---------------------------------------------------------------------------- pack + loader

DATA = """
data:
  tokenizer: demo
  template: chatml
  max_len: 2048
  rope: mrope
  audio: {family: %s}
  vision: {min_pixels: 3136, max_pixels: 12544, video_min_pixels: 3136, video_max_pixels: 12544}
"""
MODELS = {  # pack looks only at which sections exist; nothing is built
    "omni": "model:\n  image_encoder: {name: whatever}\n  audio_encoder: {name: whatever}\n  foundation: {name: x}\n",
    "vision": "model:\n  image_encoder: {name: whatever}\n  foundation: {name: x}\n",
    "text": "model:\n  foundation: {name: x}\n",
    "none": "",
}


@pytest.fixture(scope="module")
def raw(tmp_path_factory):
    from data_factory import png_bytes

    root = tmp_path_factory.mktemp("audio_pack")
    long = encode(signal(31.0, 16000, 1, seed=1), 16000, "wav")  # > 30 s: two Qwen2-Audio chunks
    files = {"short__mp3": clip("mp3", 1.0, rate=22050, seed=2), "long__wav": long, "a__png": png_bytes(28, 28),
             "mid__flac": clip("flac", 2.0, rate=8000, seed=3)}
    rows = [
        sharegpt("Compare <audio> and <audio>.", "same", id="two", audios=["short.mp3", "long.wav"]),
        sharegpt("<image>Colour?", "red", id="img", images=["a.png"]),
        sharegpt("<audio>Pitch?", "low", id="one", audios=["mid.flac"]),
        sharegpt("2+2?", "4", id="txt"),
        sharegpt("<image><audio>Both?", "yes", id="both", images=["a.png"], audios=["mid.flac"]),
    ]
    convert(root, rows, **files)
    return root


def pack(raw_root, tmp_path, model: str, family: str = "qwen2_audio") -> tuple[dict, "PackedDataset"]:  # noqa: F821
    from omniweave.cli import main
    from omniweave.data.packing.packed import PackedDataset

    recipe = tmp_path / f"{model}-{family}.yaml"
    recipe.write_text(DATA % family + MODELS[model])
    out = tmp_path / f"packed-{model}-{family}"
    assert main(["data", "pack", "--input", str(raw_root / "raw-in"), "--output", str(out), "--recipe", str(recipe),
                 "--workers", "1"]) == 0
    return json.loads((out / "stats.json").read_text()), PackedDataset(out)


def docs_by_id(ds) -> dict:
    return {doc["id"]: (k, d) for k in range(len(ds)) for d, doc in enumerate(ds.record(k)["docs"])}


@pytest.mark.parametrize("model, dropped, kept", [
    ("vision", {"no_audio_encoder": 3}, {"img", "txt"}),
    ("text", {"no_audio_encoder": 2, "no_image_encoder": 2}, {"txt"}),  # images are checked first: "both" is one
    ("none", {}, {"two", "img", "one", "txt", "both"}),  # a data-only recipe says nothing about the model
])
def test_pack_drops_media_the_model_cannot_consume_and_counts_it(raw, tmp_path, model, dropped, kept):
    stats, ds = pack(raw, tmp_path, model)
    assert stats["dropped"] == dropped and stats["samples_packed"] + stats["dropped_total"] == stats["samples"] == 5
    assert set(docs_by_id(ds)) == kept  # nothing else lost, nothing packed as bare text
    assert stats["modalities"]["audios"] == (4 if model == "none" else 0)


def test_pack_plans_audio_from_headers_and_loader_matches_whisper(raw, tmp_path):
    from transformers import WhisperFeatureExtractor

    from omniweave.data.media.audio import audio_tokens, encoder_tokens, load_audio, probe_audio, qwen2_audio_chunks
    from omniweave.data.loading.loader import collate_pack
    from omniweave.data.text.tokenizer import load_tokenizer

    stats, ds = pack(raw, tmp_path, "omni")
    assert stats["dropped"] == {} and stats["samples_packed"] == 5
    short, long, mid = ((raw / f).read_bytes() for f in ("short.mp3", "long.wav", "mid.flac"))
    mod = stats["modalities"]
    assert (mod["audio_samples"], mod["audios"], mod["text_only_samples"]) == (3, 4, 1)
    assert mod["audio_seconds"] == pytest.approx(1.0 + 31.0 + 2 * 2.0, abs=1e-3)
    assert mod["audio_bytes"] == len(short) + len(long) + 2 * len(mid)
    assert stats["audio_tokens"] == sum(audio_tokens(probe_audio(b), "qwen2_audio") for b in (short, long, mid, mid))

    k, d = docs_by_id(ds)["two"]
    rec = ds.record(k)
    clips = [m for m in rec["media"] if m["doc"] == d]
    assert [m["kind"] for m in clips] == ["audio", "audio"] and "grid_thw" not in clips[0]
    assert [m["num_samples"] for m in clips] == [16000, 31 * 16000]
    assert [m["length"] for m in clips] == [audio_tokens(probe_audio(b), "qwen2_audio") for b in (short, long)]
    assert "pieces" not in clips[0] and len(clips[1]["pieces"]) == 2  # one run per encoder item

    batch = collate_pack(ds[k], ds.manifest["data_cfg"])
    audio_pad = load_tokenizer("demo").token_id("<|AUDIO|>")
    # reference: each clip of the pack (row order) decoded, cut into its 30 s chunks, each chunk
    # through WhisperFeatureExtractor on its own (Qwen2AudioProcessor's features per chunk)
    chunks = []
    for m in ds[k]["media"]:
        if m["kind"] == "audio":
            samples = load_audio(m["bytes"])
            bounds = np.cumsum([0, *qwen2_audio_chunks(len(samples))])
            chunks += [samples[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    fe = WhisperFeatureExtractor(feature_size=128)
    A = len(chunks)
    feats, lengths, spans = batch["audio_features"], batch["audio_lengths"], batch["audio_spans"]
    assert feats.shape == (A, 128, 3000) and feats.dtype == torch.float32
    assert lengths.dtype == spans.dtype == torch.int64 and spans.shape == (A, 2)
    worst = 0.0
    for i, c in enumerate(chunks):
        ref = fe(c, sampling_rate=16000, padding="max_length", truncation=False, return_attention_mask=True,
                 return_tensors="np")
        worst = max(worst, float(np.abs(feats[i].numpy() - ref["input_features"][0]).max()))
        assert int(lengths[i]) == int(ref["attention_mask"].sum())
    print(f"max |ours - WhisperFeatureExtractor| = {worst:.2e}")
    assert worst <= 1e-4, worst
    # spans: item order, back to back within a clip, each as long as the encoder's output for its frames
    assert [int(n) for n in spans[:, 1]] == [encoder_tokens(int(n)) for n in lengths]
    ids = batch["input_ids"].numpy()
    covered = np.zeros(len(ids), bool)
    for start, n in spans.tolist():
        assert (ids[start:start + n] == audio_pad).all()
        covered[start:start + n] = True
    assert np.array_equal(covered, ids == audio_pad)
    # audio pads are positioned as text: within a doc without images every M-RoPE row counts up
    a, b = batch["cu_seqlens"][d].item(), batch["cu_seqlens"][d + 1].item()
    pos = batch["position_ids"][:, a:b].numpy()
    assert (pos == np.arange(b - a)[None]).all()



def test_qwen2_5_omni_one_item_per_clip_padded_to_its_own_length(raw, tmp_path):
    from transformers import WhisperFeatureExtractor

    from omniweave.data.media.audio import audio_tokens, load_audio, probe_audio
    from omniweave.data.loading.loader import collate_pack

    stats, ds = pack(raw, tmp_path, "omni", family="qwen2_5_omni")
    k, d = docs_by_id(ds)["two"]
    clips = [m for m in ds.record(k)["media"] if m["doc"] == d]
    long = (raw / "long.wav").read_bytes()
    assert "pieces" not in clips[1] and clips[1]["length"] == audio_tokens(probe_audio(long), "qwen2_5_omni")
    batch = collate_pack(ds[k], ds.manifest["data_cfg"])
    pack_clips = [m for m in ds[k]["media"] if m["kind"] == "audio"]
    feats, lengths = batch["audio_features"], batch["audio_lengths"]
    assert feats.shape == (len(pack_clips), 128, 3100)  # W: the 31 s clip's own padded length
    fe = WhisperFeatureExtractor(feature_size=128)
    worst = 0.0
    for i, m in enumerate(pack_clips):
        ref = fe(load_audio(m["bytes"]), sampling_rate=16000, padding="max_length", truncation=False,
                 return_attention_mask=True, return_tensors="np")
        width = ref["input_features"].shape[-1]
        worst = max(worst, float(np.abs(feats[i, :, :width].numpy() - ref["input_features"][0]).max()))
        assert (feats[i, :, width:] == 0).all() and int(lengths[i]) == int(ref["attention_mask"].sum())
    print(f"max |ours - WhisperFeatureExtractor| = {worst:.2e}")
    assert worst <= 1e-4, worst


def test_truncation_never_cuts_an_audio_span(raw):
    from omniweave.data.sources.shards import RawDataset
    from omniweave.data.text.tokenize import SampleProcessor, SampleRejected

    sample = RawDataset(raw / "raw-in")[0]  # "two": 25 + 2 * 387 audio tokens (31 s: two 15.5 s chunks)
    full = SampleProcessor({"max_len": 4096}).tokenize(sample)
    cut_inside = full.media[1].start + 10
    with pytest.raises(SampleRejected) as e:
        SampleProcessor({"max_len": cut_inside}).tokenize(sample)
    assert e.value.reason == "audio_span_exceeds_max_len"


def test_eval_prompt_batch_builds_the_same_audio_tensors(raw, tmp_path):
    from omniweave.data.loading.loader import media_batch
    from omniweave.data.text.tokenize import SampleProcessor
    from omniweave.train.evaluate import prompt_batch, row_to_raw

    proc = SampleProcessor({"max_len": 4096})
    row = {"messages": [{"role": "user", "content": "<audio>Pitch?"}], "audios": ["mid.flac"], "answer": "low"}
    raw_sample = row_to_raw(row, raw, 0)
    batch = prompt_batch(proc, raw_sample)
    sample = proc.tokenize_prompt(raw_sample)
    ref = media_batch(proc, [(s, raw_sample.media[s.part]) for s in sample.media])
    assert set(ref) >= {"audio_features", "audio_lengths", "audio_spans"} and batch["pixel_values"].shape[0] == 0
    for key in ("audio_features", "audio_lengths", "audio_spans"):
        assert torch.equal(batch[key], ref[key])
    start, n = batch["audio_spans"][0].tolist()
    assert (batch["input_ids"][start:start + n] == proc.audio_pad_id).all()
    assert n == (batch["input_ids"] == proc.audio_pad_id).sum()


def test_inspect_reports_audio_counts_durations_bytes_and_drops(raw, tmp_path, capsys):
    from omniweave.cli import main

    assert main(["data", "inspect", str(raw / "raw-in"), "--show", "1"]) == 0
    out = capsys.readouterr().out
    clip_bytes = sorted(len((raw / f).read_bytes()) for f in ("short.mp3", "long.wav", "mid.flac", "mid.flac"))
    assert out.strip().splitlines()[-1].endswith("text-only 1, image 1, video 0, audio 2, mixed 1")
    assert f"audios: 4; bytes min {clip_bytes[0]:,}" in out and "total 36.0 s" in out
    assert "sample rates 8000 Hz: 2, 16000 Hz: 1, 22050 Hz: 1; channels 1: 4" in out
    assert "media stored: image 2, video 0, audio 4" in out and "[aud1.wav:" in out
    stats, _ = pack(raw, tmp_path, "vision")
    assert main(["data", "inspect", str(tmp_path / "packed-vision-qwen2_audio")]) == 0
    out = capsys.readouterr().out
    assert "dropped 3 {'no_audio_encoder': 3}" in out
    stats, ds = pack(raw, tmp_path, "omni")
    assert main(["data", "inspect", str(tmp_path / "packed-omni-qwen2_audio")]) == 0
    out = capsys.readouterr().out
    assert (f"with audio 3 (4 clips, 36.0 s, {sum(clip_bytes):,} bytes, {stats['audio_tokens']} audio tokens)"
            in out)
    assert "<audio×25>" in out and "<audio×387><audio×387>" in out  # the 31 s clip: two 15.5 s chunks


# ---------------------------------------------------------------------------- data demo --audio


def test_demo_audio_tasks_hold_the_answer_and_pack(tmp_path):
    from omniweave.cli import main
    from omniweave.data.media.audio import load_audio, probe_audio
    from omniweave.data.demo import AUDIO_CLASSES, PITCHES, generate

    summary = generate(tmp_path / "demo", samples=66, eval_samples=36, seed=0, audio=True)
    assert summary["train_tasks"]["pitch"] == summary["train_tasks"]["beeps"] == 6
    rows = [json.loads(x) for x in (tmp_path / "demo/train.jsonl").read_text().splitlines()]
    evals = [json.loads(x) for x in (tmp_path / "demo/eval.jsonl").read_text().splitlines()]
    assert sorted(r["answer"] for r in evals if r["task"] == "beeps") == ["1", "1", "2", "3"]
    heard = 0
    for row in rows + [{**r, "messages": r["messages"] + [{"content": r["answer"]}]} for r in evals]:
        if not row.get("audios"):
            continue
        question, answer = row["messages"][0]["content"], row["messages"][1]["content"]
        assert question.startswith("<audio>") and ("beep" in question or "tone" in question)
        data = (tmp_path / "demo/media" / row["audios"][0]).read_bytes()
        info = probe_audio(data)
        assert (info.sample_rate, info.channels, info.codec) == (16000, 1, "pcm_s16le") and info.duration_s <= 1.5
        x = load_audio(data)
        if "tone" in question:  # the spectrum's peak is the named pitch
            peak = np.fft.rfftfreq(len(x), 1 / 16000)[np.abs(np.fft.rfft(x)).argmax()]
            assert min(PITCHES, key=lambda p: abs(np.log(PITCHES[p] / peak))) == answer
        else:  # bursts of energy above the noise floor, counted in 10 ms frames
            loud = np.abs(x[: len(x) // 160 * 160]).reshape(-1, 160).max(axis=1) > 0.2
            assert int((np.diff(loud.astype(int)) == 1).sum() + loud[0]) == int(answer)
        assert answer in AUDIO_CLASSES["pitch" if "tone" in question else "beeps"]
        heard += 1
    assert heard == 12 + 8
    assert main(["data", "convert", "--input", str(tmp_path / "demo/train.jsonl"), "--media-dir",
                 str(tmp_path / "demo/media"), "--output", str(tmp_path / "raw"), "--workers", "1",
                 "--no-progress"]) == 0
    (tmp_path / "omni.yaml").write_text(DATA % "qwen2_audio" + MODELS["omni"])
    assert main(["data", "pack", "--input", str(tmp_path / "raw"), "--output", str(tmp_path / "packed"),
                 "--recipe", str(tmp_path / "omni.yaml"), "data.max_len=1024", "--workers", "1"]) == 0
    stats = json.loads((tmp_path / "packed/stats.json").read_text())
    assert stats["dropped"] == {} and stats["modalities"]["audios"] == 12


# ---------------------------------------------------------------------------- template


def test_audio_placeholder_renders_and_exports_like_the_other_media():
    from transformers.utils.chat_template_utils import render_jinja_template

    from omniweave.data.sample import Message
    from omniweave.data.text.jinja_export import hf_chat_template
    from omniweave.data.text.template import BUILTIN_TEMPLATES, render

    t = BUILTIN_TEMPLATES["chatml"]
    messages = [Message("user", "<image>Look, then <audio>listen."), Message("assistant", "done")]
    r = render(t, messages)
    assert "<|vision_end|>Look, then <|audio_bos|><|AUDIO|><|audio_eos|>listen." in r.text
    assert r.media_kinds == ["image", "audio"]
    parts = [{"type": "image"}, {"type": "text", "text": "Look, then "}, {"type": "audio"},
             {"type": "text", "text": "listen."}]
    for content in (messages[0].content, parts):
        hf = [{"role": "user", "content": content}, {"role": "assistant", "content": "done"}]
        got, _ = render_jinja_template(conversations=[hf], chat_template=hf_chat_template(t))
        assert got[0] == r.text


def test_eval_prompts_packed_together_keep_each_prompts_audio(raw):
    from omniweave.data.text.tokenize import SampleProcessor
    from omniweave.generation import Prompt, pack_prompts
    from omniweave.train.evaluate import prompt_batch, row_to_raw

    proc = SampleProcessor({"max_len": 4096, "audio": {"family": "qwen2_5_omni"}})
    rows = [{"messages": [{"role": "user", "content": f"<audio>{q}"}], "audios": [f], "answer": "x"}
            for q, f in (("Pitch?", "mid.flac"), ("Long?", "long.wav"))]
    batches = [prompt_batch(proc, row_to_raw(r, raw, i)) for i, r in enumerate(rows)]
    assert [b["audio_features"].shape[-1] for b in batches] == [3000, 3100]
    row = pack_prompts([Prompt(uid=i, batch=b) for i, b in enumerate(batches)])
    n0 = batches[0]["input_ids"].shape[0]
    assert row["audio_features"].shape == (2, 128, 3100)
    assert torch.equal(row["audio_features"][0, :, :3000], batches[0]["audio_features"][0])
    assert (row["audio_features"][0, :, 3000:] == 0).all()
    assert torch.equal(row["audio_features"][1], batches[1]["audio_features"][0])
    (s0, l0), (s1, l1) = batches[0]["audio_spans"][0].tolist(), batches[1]["audio_spans"][0].tolist()
    assert row["audio_spans"].tolist() == [[s0, l0], [s1 + n0, l1]]
    assert torch.equal(row["audio_lengths"], torch.cat([b["audio_lengths"] for b in batches]))
    start, n = row["audio_spans"][1].tolist()
    assert (row["input_ids"][start:start + n] == proc.audio_pad_id).all()
