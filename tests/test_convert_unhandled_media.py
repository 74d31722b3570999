"""Media omniweave cannot store is never dropped silently (issue 14).

A row that carries a file part, a content part of an unknown type, or an unmapped column holding
media is rejected with its own reason (audio is stored since issue 19, see tests/test_audio_data.py;
here an audio row naming a file that is not there is rejected as ``missing_media``); any other
unmapped column is warned about once per file and kept in ``meta.extra``. The good rows of the same
files convert exactly as they would alone.
"""

from __future__ import annotations

import json

import pytest

from audio_factory import encode, signal
from data_factory import png_bytes, video_bytes
from omniweave.data.sources.formats import FormatError, parse_row, unused_columns
from omniweave.data.sources.mapping import Mapping
from omniweave.data.sources.shards import RawDataset
from test_shards import run_convert

OPENAI = Mapping().resolved("openai")
SHAREGPT = Mapping().resolved("sharegpt")


def sharegpt(human, gpt="ok", **columns):
    return {"conversations": [{"from": "human", "value": human}, {"from": "gpt", "value": gpt}], **columns}


def openai(parts, answer="ok", **columns):
    return {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": answer}], **columns}


# LLaMA-Factory's audio layout: an ``audios`` column and ``<audio>`` tags
SHAREGPT_ROWS = [
    (None, sharegpt("<image>What colour?", images=["a.png"], audios=[])),  # empty audios column: fine
    (None, sharegpt("<audio>What is said?", audios=["s.wav"])),
    ("missing_media", sharegpt("<image><audio>Describe both.", images=["a.png"], audios=["speech.wav"])),
    ("placeholder_mismatch", sharegpt("Transcribe <audio> please")),  # tag without a column
    (None, sharegpt("2+2?", "4")),
    ("unknown_media_column:image", sharegpt("<image>typo'd column", image=["a.png"])),
]
OPENAI_ROWS = [
    (None, openai([{"type": "image_url", "image_url": {"url": "a.png"}}, {"type": "text", "text": "What?"}])),
    (None, openai([{"type": "video_url", "video_url": {"url": "v.mp4"}}, {"type": "text", "text": "Which way?"}])),
    ("not_audio",  # base64 of b"RIFF": no audio behind the header
     openai([{"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}, {"type": "text", "text": "?"}])),
    ("missing_media", openai([{"type": "audio_url", "audio_url": {"url": "s.mp3"}}])),
    ("unsupported_modality:file", openai([{"type": "file", "file": {"file_id": "file-1"}}, {"type": "text", "text": "sum"}])),
    ("unknown_content_part:point_cloud", openai([{"type": "point_cloud", "point_cloud": "scan.ply"}])),
    (None, openai("Repeat: apple", "apple", difficulty="easy", source="web")),  # extra non-media columns: warned
    ("unknown_media_column:thumbnail", openai("<image>hi", images=["a.png"], thumbnail={"bytes": "..."})),
]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("unhandled")
    (root / "a.png").write_bytes(png_bytes(20, 28))
    (root / "v.mp4").write_bytes(video_bytes(4, height=28, width=28))
    (root / "s.wav").write_bytes(encode(signal(0.2, 16000, 1), 16000, "wav"))
    out = {}
    for name, rows in (("sharegpt", SHAREGPT_ROWS), ("openai", OPENAI_ROWS)):
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for _, row in rows))
        good = root / f"{name}-good.jsonl"
        good.write_text("".join(json.dumps(row) + "\n" for reason, row in rows if reason is None))
        for tag, src in (("all", path), ("good", good)):
            rc = run_convert("--input", str(src), "--output", str(root / f"raw-{name}-{tag}"), "--workers", "1")
            assert rc == 0
        out[name] = (root, rows)
    return out


@pytest.mark.parametrize("fmt", ["sharegpt", "openai"])
def test_each_unhandled_row_is_rejected_with_its_own_reason(run, fmt):
    root, rows = run[fmt]
    rejects = [json.loads(x) for x in (root / f"raw-{fmt}-all/rejects.jsonl").read_text().splitlines()]
    assert {r["row"]: r["reason"] for r in rejects} == {i: reason for i, (reason, _) in enumerate(rows) if reason}
    assert all(r["message"] for r in rejects)
    report = json.loads((root / f"raw-{fmt}-all/convert_report.json").read_text())
    assert report["input"] == len(rows) == report["written"] + report["rejected"]
    expected = {}
    for reason, _ in rows:
        if reason:
            expected[reason] = expected.get(reason, 0) + 1
    assert report["rejected_by_reason"] == dict(sorted(expected.items()))


@pytest.mark.parametrize("fmt", ["sharegpt", "openai"])
def test_good_rows_convert_exactly_as_they_would_alone(run, fmt):
    root, rows = run[fmt]
    mixed, alone = RawDataset(root / f"raw-{fmt}-all"), RawDataset(root / f"raw-{fmt}-good")
    assert len(mixed) == len(alone) == sum(reason is None for reason, _ in rows)
    for a, b in zip(mixed, alone):
        ca, cb = a.conversation.to_json(), b.conversation.to_json()
        for c in (ca, cb):  # only the row's position and source file differ
            c.pop("id"), c["meta"].pop("index"), c["meta"].pop("source")
        assert ca == cb and a.media == b.media
    # a stored <audio> tag always has its clip
    assert all(sum(m.content.count("<audio>") for m in s.conversation.messages) == len(s.conversation.audios)
               for s in mixed)


def test_media_items_stored_per_modality_in_report_and_summary(run, capsys):
    root, _ = run["openai"]
    report = json.loads((root / "raw-openai-all/convert_report.json").read_text())
    assert report["media_items"] == {"image": 1, "video": 1, "audio": 0}
    report = json.loads((run["sharegpt"][0] / "raw-sharegpt-all/convert_report.json").read_text())
    assert report["media_items"] == {"image": 1, "video": 0, "audio": 1}
    rc = run_convert("--input", str(root / "openai.jsonl"), "--output", str(root / "raw-again"), "--workers", "1")
    out = capsys.readouterr()
    assert rc == 0
    assert "media: 1 image(s), 1 video(s), 0 audio(s)" in out.out
    assert "not_audio: 1" in out.out and "unknown_content_part:point_cloud: 1" in out.out


def test_unmapped_column_is_warned_once_per_file_and_kept(run, tmp_path, capsys):
    root, rows = run["openai"]
    twice = tmp_path / "twice.jsonl"  # the same extra columns on many rows: still one warning
    twice.write_text("".join(json.dumps(openai("Repeat: x", "x", difficulty="easy", source="web")) + "\n" for _ in range(5)))
    rc = run_convert("--input", str(twice), str(root / "openai.jsonl"), "--output", str(tmp_path / "raw"),
                     "--workers", "1")
    err = capsys.readouterr().err
    assert rc == 0
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 2  # one per input file
    assert "'difficulty' (5 rows)" in warnings[0] and "'source' (5 rows)" in warnings[0]
    assert "'difficulty' (1 rows)" in warnings[1]
    report = json.loads((tmp_path / "raw/convert_report.json").read_text())
    assert report["unused_columns"][str(twice)] == {"difficulty": 5, "source": 5}
    sample = RawDataset(tmp_path / "raw")[0]
    assert sample.conversation.meta["extra"] == {"difficulty": "easy", "source": "web"}


def test_mapped_columns_are_not_warned(tmp_path, capsys):
    (tmp_path / "a.png").write_bytes(png_bytes(16, 16))
    (tmp_path / "in.jsonl").write_text(json.dumps(sharegpt("<image>hi", pics=["a.png"], sys="Be brief.")) + "\n")
    rc = run_convert("--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "raw"), "--images-key", "pics",
                     "--system-key", "sys", "--workers", "1")
    assert rc == 0 and "warning" not in capsys.readouterr().err
    conv = RawDataset(tmp_path / "raw")[0].conversation
    assert conv.images == ["img0.png"] and conv.messages[0].content == "Be brief." and "extra" not in conv.meta


def test_strict_fails_on_unhandled_media(run, tmp_path):
    root, _ = run["sharegpt"]
    rc = run_convert("--input", str(root / "sharegpt.jsonl"), "--output", str(tmp_path / "raw"), "--strict",
                     "--workers", "1")
    assert rc == 1
    assert json.loads((tmp_path / "raw/convert_report.json").read_text())["rejected_by_reason"] == {
        "missing_media": 1, "placeholder_mismatch": 1, "unknown_media_column:image": 1}


def test_inspect_lists_reasons_media_and_unmapped_columns(run, capsys):
    from omniweave.cli import main

    root, _ = run["openai"]
    assert main(["data", "inspect", str(root / "raw-openai-all"), "--show", "0"]) == 0
    out = capsys.readouterr().out
    assert "media stored: image 1, video 1, audio 0" in out
    assert "unsupported_modality:file" in out and "unknown_media_column:thumbnail" in out
    assert "difficulty (1 rows)" in out


@pytest.mark.parametrize("value, rejected", [
    (["clip.WAV"], True), ("photo.jpeg", True), ({"path": "x.flac"}, True), ({"bytes": "..."}, True),
    ({"array": [0.1], "sampling_rate": 16000}, True), ("data:image/png;base64,AAAA", True),
    ("42", False), ({"url": "https://example.com/page"}, False), (["a", "b"], False), (None, False), (3.5, False),
])
def test_media_looking_values_in_unmapped_columns(value, rejected):
    row = openai("hello", extra_col=value)
    if rejected:
        with pytest.raises(FormatError) as e:
            parse_row(row, OPENAI, row_id="r")
        assert e.value.reason == "unknown_media_column:extra_col"
    else:
        assert parse_row(row, OPENAI, row_id="r").meta == {"extra": {"extra_col": value}}
        assert unused_columns(row, OPENAI) == ["extra_col"]


def test_typo_in_a_media_column_suggests_the_right_name():
    with pytest.raises(FormatError, match="did you mean 'images'"):
        parse_row(sharegpt("<image>hi", imagse=["a.png"]), SHAREGPT, row_id="r")


def test_audios_column_can_be_remapped():
    m = Mapping(audios="speech").resolved("sharegpt")
    assert parse_row(sharegpt("<audio>hi", speech=["a.wav"]), m, row_id="r").audios == ["a.wav"]
    with pytest.raises(FormatError) as e:  # the default column name, unmapped, is media nobody reads
        parse_row(sharegpt("<audio>hi", audios=["a.wav"]), m, row_id="r")
    assert e.value.reason == "unknown_media_column:audios"
