"""Issue 31, item 8: whatever one row holds, ``data convert`` counts it as written or rejected with
a reason; no row fails the job, and a rerun gives the same result."""

from __future__ import annotations

import json

import pytest

from omniweave.data.sources.formats import MAX_ROW_DEPTH, FormatError, decode_row
from test_shards import run_convert

CHAT = '[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]'
GOOD = '{"messages": ' + CHAT + '}'
# (reason, JSONL line): rows that used to raise past the reject machinery
BAD_LINES = [
    ("bad_text", '{"messages": [{"role": "user", "content": "\\ud800"}, {"role": "assistant", "content": "yo"}]}'),
    ("bad_text", '{"messages": ' + CHAT + ', "\\udfff": 1}'),  # a key
    ("bad_json", "[" * 100_000 + "]" * 100_000),  # past Python's recursion limit
    ("bad_json", '{"messages": ' + CHAT + ', "x": ' + "[" * (MAX_ROW_DEPTH + 5) + "]" * (MAX_ROW_DEPTH + 5) + "}"),
    ("malformed_json", '{"messages": ' + CHAT + ', "n": ' + "1" * 5000 + "}"),  # past the int digit limit
    ("bad_schema", '{"messages": [{"role": ["user"], "content": "hi"}, {"role": "assistant", "content": "yo"}]}'),
]


def convert_lines(tmp_path, name: str):
    (tmp_path / "in.jsonl").write_text("\n".join([GOOD, *(line for _, line in BAD_LINES), GOOD]) + "\n")
    rc = run_convert("--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / name), "--workers", "1")
    rejects = [json.loads(x) for x in (tmp_path / name / "rejects.jsonl").read_text().splitlines()]
    return rc, rejects, json.loads((tmp_path / name / "convert_report.json").read_text())


def test_rows_that_crashed_convert_are_counted_rejects_and_a_rerun_agrees(tmp_path):
    rc, rejects, report = convert_lines(tmp_path, "raw")
    assert rc == 0
    assert [r["reason"] for r in rejects] == [reason for reason, _ in BAD_LINES]
    assert [r["row"] for r in rejects] == list(range(1, len(BAD_LINES) + 1))
    assert report["input"] == len(BAD_LINES) + 2 and report["written"] == 2
    again = convert_lines(tmp_path, "raw")  # the same command again: the same counts, not a crash
    assert again[0] == 0 and again[1] == rejects


@pytest.mark.parametrize("raw, reason", [
    ({"messages": [{"role": "user", "content": "a\ud800b"}]}, "bad_text"),  # a JSON array's object
    (b"\xff{}", "malformed_json"),
    ("[" * (MAX_ROW_DEPTH + 1) + "]" * (MAX_ROW_DEPTH + 1), "bad_json"),
])
def test_decode_row_names_the_reason(raw, reason):
    with pytest.raises(FormatError) as e:
        decode_row(raw)
    assert e.value.reason == reason


def test_decode_row_accepts_nesting_up_to_the_limit():
    text = "[" * MAX_ROW_DEPTH + "]" * MAX_ROW_DEPTH
    assert decode_row(text) is not None


def test_a_json_array_nested_too_deep_is_one_line_not_a_traceback(tmp_path, capsys):
    rows = '[{"messages": ' + CHAT + "}, " + "[" * 100_000 + "]" * 100_000 + "]"
    (tmp_path / "in.json").write_text(rows)
    assert run_convert("--input", str(tmp_path / "in.json"), "--output", str(tmp_path / "raw")) == 2
    err = capsys.readouterr().err
    assert "in.json is not valid JSON" in err and "Traceback" not in err
