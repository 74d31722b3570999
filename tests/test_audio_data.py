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

from audio_factory import encode, signal
from omniweave.data.shards import RawDataset
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
    data = clip("mp3", seed=3)
    b64 = base64.b64encode(data).decode()
    rows = [
        openai([{"type": "input_audio", "input_audio": {"data": b64, "format": "mp3"}}, {"type": "text", "text": "Say?"}]),
        openai([{"type": "text", "text": "Which? "}, {"type": "audio_url", "audio_url": {"url": "b.flac"}}]),
        openai([{"type": "audio_url", "audio_url": {"url": f"data:audio/mpeg;base64,{b64}"}}]),
        openai([{"type": "audio", "audio": "b.flac"}, {"type": "image_url", "image_url": {"url": "missing.png"}}]),
        openai([{"type": "input_audio", "input_audio": {"data": "%%%", "format": "mp3"}}]),
        openai([{"type": "input_file", "input_file": {"file_id": "f"}}]),
    ]
    report, rejects, ds = convert(tmp_path, rows, b__flac=clip("flac", seed=4))
    assert {r["row"]: r["reason"] for r in rejects} == {3: "missing_media", 4: "bad_data_url",
                                                         5: "unsupported_modality:file"}
    inline, url, data_url = (s.conversation for s in ds)
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
