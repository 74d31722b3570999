"""``omniweave data convert``: every row written or rejected with a reason, --strict, parallel
workers give identical shards, a killed run leaves no half shard and a rerun completes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from data_factory import png_bytes, video_bytes
from omniweave.data.sources.shards import RawDataset
from test_shards import run_convert

REPO = Path(__file__).resolve().parents[1]


def turn(role, content):
    return {"role": role, "content": content}


GOOD = {"messages": [turn("user", "<image>hi <video>"), turn("assistant", "ok")], "images": ["a.png"], "videos": ["v.mp4"]}
TEXT = {"messages": [turn("user", "2+2?"), turn("assistant", "4")]}
# (reason, JSONL line) - one bad row per reject reason
BAD_ROWS = [
    ("malformed_json", '{"messages": [ oops'),
    ("malformed_json", '{"messages": "NOT_UTF8"}'),
    ("bad_schema", "[1, 2]"),
    ("missing_media", json.dumps({**GOOD, "images": ["nope.png"]})),
    ("not_a_regular_file", json.dumps({**GOOD, "images": ["folder.png"]})),
    ("undecodable_media", json.dumps({**GOOD, "images": ["garbage.png"]})),
    ("undecodable_media", json.dumps({**GOOD, "videos": ["garbage.mp4"]})),
    ("placeholder_mismatch", json.dumps({**GOOD, "images": ["a.png", "a.png"]})),
    ("empty_conversation", json.dumps({"messages": []})),
    ("no_assistant_turn", json.dumps({"messages": [turn("user", "hello")]})),
    ("unknown_role", json.dumps({"messages": [turn("user", "a"), turn("narrator", "b")]})),
    ("bad_turn_order", json.dumps({"messages": [turn("assistant", "a"), turn("user", "b")]})),
    ("media_path_escapes", json.dumps({**GOOD, "images": ["../outside.png"]})),
    ("absolute_path_outside", json.dumps({**GOOD, "images": ["ABS_OUTSIDE"]})),
]


@pytest.fixture(scope="module")
def bad_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    media = root / "media"
    media.mkdir()
    (media / "a.png").write_bytes(png_bytes(20, 30))
    (media / "v.mp4").write_bytes(video_bytes(4, height=32, width=32))
    (media / "folder.png").mkdir()
    (media / "garbage.png").write_bytes(b"not an image at all")
    (media / "garbage.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 broken")
    (root / "outside.png").write_bytes(png_bytes(8, 8))
    lines = [json.dumps(GOOD), json.dumps(TEXT)]
    lines += [line.replace("ABS_OUTSIDE", str(root / "outside.png")) for _, line in BAD_ROWS]
    lines.append(json.dumps({**GOOD, "images": [str(media / "a.png")]}))  # absolute but inside: fine
    (root / "in.jsonl").write_bytes(("\n".join(lines) + "\n").replace("NOT_UTF8", "\udcff").encode("utf-8", "surrogateescape"))
    rc = run_convert("--input", str(root / "in.jsonl"), "--media-dir", str(media), "--output", str(root / "raw"),
                     "--workers", "1")
    rejects = [json.loads(x) for x in (root / "raw/rejects.jsonl").read_text().splitlines()]
    report = json.loads((root / "raw/convert_report.json").read_text())
    return root, rc, rejects, report


@pytest.mark.parametrize("k", range(len(BAD_ROWS)), ids=[f"{r}-{i}" for i, (r, _) in enumerate(BAD_ROWS)])
def test_each_bad_row_is_rejected_with_its_reason(bad_run, k):
    root, _, rejects, _ = bad_run
    by_row = {r["row"]: r for r in rejects}
    reject = by_row[k + 2]  # rows 0, 1 are good
    assert reject["reason"] == BAD_ROWS[k][0], reject
    assert reject["line"] == k + 3 and reject["index"] == k + 2 and reject["file"].endswith("in.jsonl")
    assert reject["message"]


def test_counts_add_up_and_good_rows_are_written(bad_run):
    root, rc, rejects, report = bad_run
    assert rc == 0  # not --strict
    n_bad = len(BAD_ROWS)
    assert report["input"] == n_bad + 3 == report["written"] + report["rejected"]
    assert report["written"] == 3 and report["rejected"] == n_bad == len(rejects)
    assert report["rejected_by_reason"]["undecodable_media"] == 2
    assert sum(report["rejected_by_reason"].values()) == n_bad
    ds = RawDataset(root / "raw")
    assert [s.key for s in ds] == ["s000000000", "s000000001", f"s{n_bad + 2:09d}"]  # keys = input rows
    assert ds[0].media["img0.png"] == (root / "media/a.png").read_bytes()
    assert ds[0].media["vid0.mp4"] == (root / "media/v.mp4").read_bytes()
    assert ds[1].conversation.images == [] and ds[1].media == {}


def test_strict_exits_nonzero_on_any_reject(bad_run, tmp_path):
    root = bad_run[0]
    rc = run_convert("--input", str(root / "in.jsonl"), "--media-dir", str(root / "media"),
                     "--output", str(tmp_path / "raw"), "--strict", "--workers", "1")
    assert rc == 1
    assert json.loads((tmp_path / "raw/convert_report.json").read_text())["written"] == 3


def test_json_array_sharegpt_input_with_mapping_flags(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m/a.png").write_bytes(png_bytes(10, 10))
    rows = [{"chat": [{"who": "Q", "says": "<image>?"}, {"who": "A", "says": "!"}], "pics": ["a.png"]}] * 3
    (tmp_path / "in.json").write_text(json.dumps(rows))
    rc = run_convert("--input", str(tmp_path / "in.json"), "--output", str(tmp_path / "raw"), "--media-dir",
                     str(tmp_path / "m"), "--format", "sharegpt", "--messages-key", "chat", "--images-key", "pics",
                     "--role-tag", "who", "--content-tag", "says", "--user-tag", "Q", "--assistant-tag", "A")
    assert rc == 0
    ds = RawDataset(tmp_path / "raw")
    assert len(ds) == 3 and [m.role for m in ds[2].conversation.messages] == ["user", "assistant"]
    assert ds[2].conversation.meta["index"] == 2


def test_undetectable_format_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text('{"text": "x"}\n')
    assert run_convert("--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "raw")) == 2
    assert "cannot detect the format" in capsys.readouterr().err


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from omniweave.data.demo import generate

    root = tmp_path_factory.mktemp("demo")
    generate(root, samples=60, eval_samples=0, seed=1)
    return root


def convert_demo(demo, out, *extra, env=None):
    cmd = [sys.executable, "-m", "omniweave", "data", "convert", "--input", str(demo / "train.jsonl"),
           "--media-dir", str(demo / "media"), "--output", str(out), "--maxcount", "10", "--no-progress", *extra]
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def shard_bytes(raw: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(raw.glob("shard-*"))}


def test_workers_do_not_change_the_result(demo, tmp_path):
    one = tmp_path / "one"
    two = tmp_path / "two"
    assert run_convert("--input", str(demo / "train.jsonl"), "--media-dir", str(demo / "media"), "--output",
                       str(one), "--maxcount", "10", "--workers", "1") == 0
    assert run_convert("--input", str(demo / "train.jsonl"), "--media-dir", str(demo / "media"), "--output",
                       str(two), "--maxcount", "10", "--workers", "2") == 0
    assert len(shard_bytes(one)) == 12  # 6 shards + 6 indices
    assert shard_bytes(one) == shard_bytes(two)
    assert not (one / ".work").exists()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_killed_run_leaves_no_partial_shard_and_rerun_completes(demo, tmp_path, workers):
    raw = tmp_path / "raw"
    killed = convert_demo(demo, raw, "--workers", workers, env={"OMNIWEAVE_TEST_KILL_AFTER_ROWS": "25"})
    assert killed.returncode != 0
    assert not list(raw.glob("shard-*.tar")), "a killed run must not leave shards that look complete"
    assert not (raw / "convert_report.json").exists() and not (raw / ".nv-meta").exists()
    assert list((raw / ".work").glob("job-*.done.json"))  # finished jobs are kept for the rerun
    rerun = convert_demo(demo, raw, "--workers", workers)
    assert rerun.returncode == 0, rerun.stderr
    assert "60 rows -> 60 samples" in rerun.stdout
    reference = tmp_path / "ref"
    assert run_convert("--input", str(demo / "train.jsonl"), "--media-dir", str(demo / "media"), "--output",
                       str(reference), "--maxcount", "10", "--workers", "1") == 0
    assert shard_bytes(raw) == shard_bytes(reference)
    ds = RawDataset(raw)
    assert len(ds) == 60 and [s.key for s in ds] == [f"s{i:09d}" for i in range(60)]


def test_inspect_summarises_raw_output_and_rejects(bad_run, capsys):
    import argparse

    from omniweave.data import inspect

    root = bad_run[0]
    p = argparse.ArgumentParser()
    inspect.add_arguments(p)
    assert inspect.run(p.parse_args([str(root / "raw"), "--show", "1"])) == 0
    out = capsys.readouterr().out
    assert "3 samples in 1 shard(s)" in out
    assert "text-only         1" in out and "mixed             2" in out
    assert f"rejected {len(BAD_ROWS)}" in out and "undecodable_media" in out
    assert "height min 20" in out and "width  min 30" in out  # from the PNG header
    assert out.strip().splitlines()[-1].startswith("inspect: 3 samples")


def test_maxsize_starts_new_shards(demo, tmp_path):
    raw = tmp_path / "raw"
    assert run_convert("--input", str(demo / "train.jsonl"), "--media-dir", str(demo / "media"), "--output",
                       str(raw), "--maxcount", "60", "--maxsize", "16K", "--workers", "1") == 0
    ds = RawDataset(raw)
    assert len(ds) == 60 and len(ds.shards) > 2
    sizes = [s.bytes for s in ds.shards]
    biggest_sample = max(len(ds.read_bytes(i)) for i in range(len(ds)))
    # a shard closes at the first sample boundary past maxsize (+ the end-of-archive record)
    assert all(size <= 16 * 1024 + biggest_sample + 10240 for size in sizes), sizes


def test_every_row_rejected_fails_in_one_line_and_pack_and_train_say_why(tmp_path, capsys):
    """A mapping or media-dir mistake rejects every row: convert exits 1 naming the reasons and
    rejects.jsonl, and pack refuses its empty output. Rows that convert but all drop at pack: pack exits
    2 naming the reasons and stats.json, and training on those packs of nothing exits 2 saying so; each
    in one line (issue 32, item 9)."""
    from omniweave.cli import main

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": "<image>hi"},
                                                     {"role": "assistant", "content": "x"}],
                                        "images": [f"missing{i}.png"]}) + "\n" for i in range(3)))
    assert main(["data", "convert", "--input", str(rows), "--output", str(tmp_path / "raw"), "--workers", "1",
                 "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"omniweave data convert: error: every row was rejected (missing_media: 3); the first few "
                       f"reasons with their rows are in {tmp_path / 'raw' / 'rejects.jsonl'}")
    assert main(["data", "inspect", str(tmp_path / "raw")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"omniweave data inspect: {tmp_path / 'raw'}: convert kept no sample: every one of its 3 row(s) was rejected "
        f"(missing_media: 3); each row and its reason is in {tmp_path / 'raw' / 'rejects.jsonl'}")
    assert main(["data", "pack", "--input", str(tmp_path / "raw"), "--output", str(tmp_path / "p0"),
                 "--recipe", "demo", "--workers", "1"]) == 2
    assert "no raw shards" in capsys.readouterr().err.strip().splitlines()[-1]
    # rows that convert but all drop at pack (too long for --max-len 8)
    rows.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                                     {"role": "assistant", "content": "a long answer"}]}) + "\n"
                            for i in range(3)))
    assert main(["data", "convert", "--input", str(rows), "--output", str(tmp_path / "raw2"), "--workers", "1",
                 "--no-progress"]) == 0
    assert main(["data", "pack", "--input", str(tmp_path / "raw2"), "--output", str(tmp_path / "packed"),
                 "--recipe", "demo", "--max-len", "8", "--workers", "1"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (f"omniweave data pack: error: no sample could be packed (too_long: 3); the counts "
                    f"are in {tmp_path / 'packed' / 'stats.json'}")
    assert main(["train", "demo", f"data.path={tmp_path / 'packed'}", "data.max_len=8",
                 f"output_dir={tmp_path / 'run'}"]) == 2
    assert "the packed dataset holds no packs" in capsys.readouterr().err
