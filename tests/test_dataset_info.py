"""``omniweave data convert --dataset-info PATH --dataset A,B``: a LLaMA-Factory dataset_info.json read
as it is (issue 32, item 2): each entry's files with its own formatting / columns / tags / ranking /
kto_tag, several datasets into one raw output, per-dataset counts, clear errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from data_factory import png_bytes
from omniweave.cli import main
from omniweave.data.sources import convert
from omniweave.data.sources.dataset_info import entry_mapping
from omniweave.data.sources.mapping import Mapping
from omniweave.data.sources.shards import RawDataset

WEATHER = {"name": "get_weather", "description": "Current weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}

# name -> (entry, file name, rows); every column each row holds is one its entry maps
DATASETS = {
    "alpaca_hist": ({"file_name": "alpaca_hist.json",
                     "columns": {"prompt": "q", "query": "ctx", "response": "a", "history": "past", "system": "sys",
                                 "images": "pictures"}}, "alpaca_hist.json", [
        {"q": "Translate to English.", "ctx": "Bonjour", "a": "Hello", "sys": "You translate.",
         "past": [["Hi", "Hello! How can I help?"], ["Who are you?", "A translator."]]},
        {"q": "<image>What colour is it?", "a": "red", "pictures": ["pics/red.png"]},
    ]),
    "glaive_tools": ({"file_name": "glaive", "formatting": "sharegpt",  # a folder of files
                      "columns": {"messages": "conversations", "tools": "tools", "system": "system"}},
                     "glaive", [
        {"conversations": [{"from": "human", "value": "Weather in Paris?"},
                           {"from": "function_call", "value": json.dumps({"name": "get_weather",
                                                                          "arguments": {"city": "Paris"}})},
                           {"from": "observation", "value": "{\"temp\": 21}"},
                           {"from": "gpt", "value": "It is 21 degrees in Paris."}],
         "tools": json.dumps([WEATHER]), "system": "You call tools."},
        {"conversations": [{"from": "human", "value": "Hello"}, {"from": "gpt", "value": "Hi! Ask me the weather."}],
         "tools": json.dumps([WEATHER]), "system": ""},
    ]),
    "mllm_demo": ({"file_name": "mllm.json", "formatting": "sharegpt",  # LLaMA-Factory's own OpenAI-style entry
                   "columns": {"messages": "messages", "images": "images"},
                   "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                            "assistant_tag": "assistant"}}, "mllm.json", [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "<image>Who is this?"},
                      {"role": "assistant", "content": "A red square."},
                      {"role": "user", "content": "<image>And this?"}, {"role": "assistant", "content": "Blue."}],
         "images": ["mllm/1.png", "mllm/2.png"]},
    ]),
    "dpo_sharegpt": ({"file_name": "dpo.json", "formatting": "sharegpt", "ranking": True,
                      "columns": {"messages": "conversations", "chosen": "chosen", "rejected": "rejected"}},
                     "dpo.json", [
        {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"},
                           {"from": "human", "value": "And 3+3?"}],
         "chosen": {"from": "gpt", "value": "6"}, "rejected": {"from": "gpt", "value": "7"}},
    ]),
    "dpo_alpaca": ({"file_name": "dpo_alpaca.jsonl", "ranking": True,
                    "columns": {"prompt": "instruction", "query": "input", "chosen": "chosen", "rejected": "rejected"}},
                   "dpo_alpaca.jsonl", [
        {"instruction": "Name a colour.", "input": "One word.", "chosen": "Red", "rejected": "Table"},
    ]),
    "kto_demo": ({"file_name": "kto.json", "formatting": "sharegpt",  # LLaMA-Factory's kto_en_demo entry
                  "columns": {"messages": "messages", "kto_tag": "label"},
                  "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user",
                           "assistant_tag": "assistant"}}, "kto.json", [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}], "label": True},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Go away."}], "label": False},
    ]),
}
# what each row must become: (messages as (role, content), source image paths, extra meta)
EXPECTED = {
    ("alpaca_hist", 0): ([("system", "You translate."), ("user", "Hi"), ("assistant", "Hello! How can I help?"),
                          ("user", "Who are you?"), ("assistant", "A translator."),
                          ("user", "Translate to English.\nBonjour"), ("assistant", "Hello")], [], {}),
    ("alpaca_hist", 1): ([("user", "<image>What colour is it?"), ("assistant", "red")], ["pics/red.png"], {}),
    ("glaive_tools", 0): ([("system", "You call tools."), ("user", "Weather in Paris?"),
                           ("function", json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})),
                           ("observation", "{\"temp\": 21}"), ("assistant", "It is 21 degrees in Paris.")],
                          [], {"tools": [WEATHER]}),
    ("glaive_tools", 1): ([("user", "Hello"), ("assistant", "Hi! Ask me the weather.")], [], {"tools": [WEATHER]}),
    ("mllm_demo", 0): ([("system", "Be brief."), ("user", "<image>Who is this?"), ("assistant", "A red square."),
                        ("user", "<image>And this?"), ("assistant", "Blue.")], ["mllm/1.png", "mllm/2.png"], {}),
    ("dpo_sharegpt", 0): ([("user", "2+2?"), ("assistant", "4"), ("user", "And 3+3?"), ("assistant", "6")], [],
                          {"rejected": "7"}),
    ("dpo_alpaca", 0): ([("user", "Name a colour.\nOne word."), ("assistant", "Red")], [], {"rejected": "Table"}),
    ("kto_demo", 0): ([("user", "Hi"), ("assistant", "Hello!")], [], {"kto_tag": True}),
    ("kto_demo", 1): ([("user", "Hi"), ("assistant", "Go away.")], [], {"kto_tag": False}),
}
IMAGES = {"pics/red.png": png_bytes(16, 24, seed=1), "mllm/1.png": png_bytes(20, 20, seed=2),
          "mllm/2.png": png_bytes(12, 28, seed=3)}


def write_registry(root: Path, extra: dict | None = None) -> Path:
    """``root/data``: a dataset_info.json with DATASETS (+ ``extra`` entries), their files and images."""
    data = root / "data"
    for rel, blob in IMAGES.items():
        (data / rel).parent.mkdir(parents=True, exist_ok=True)
        (data / rel).write_bytes(blob)
    for name, (entry, file_name, rows) in DATASETS.items():
        if name == "glaive_tools":  # a folder: one row per JSONL file, read in name order
            (data / file_name).mkdir(parents=True, exist_ok=True)
            for i, row in enumerate(rows):
                (data / file_name / f"part-{i}.jsonl").write_text(json.dumps(row) + "\n")
        elif file_name.endswith(".jsonl"):
            (data / file_name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        else:
            (data / file_name).write_text(json.dumps(rows, indent=1))
    info = {name: entry for name, (entry, _, _) in DATASETS.items()} | (extra or {})
    (data / "dataset_info.json").write_text(json.dumps(info, indent=2))
    return data / "dataset_info.json"


def convert_cli(*argv: str) -> int:
    return main(["data", "convert", *argv, "--no-progress"])


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("registry")
    info = write_registry(root)
    names = ",".join(DATASETS)
    # three rows a job, two workers: jobs cut across datasets, each row still read with its own entry
    rc = convert_cli("--dataset-info", str(info), "--dataset", names, "--output", str(root / "raw"),
                     "--maxcount", "3", "--workers", "2")
    return root, rc


def test_every_dataset_converts_without_a_reject_and_keeps_every_field(converted):
    root, rc = converted
    assert rc == 0
    report = json.loads((root / "raw/convert_report.json").read_text())
    n = sum(len(rows) for _, _, rows in DATASETS.values())
    assert (report["input"], report["written"], report["rejected"]) == (n, n, 0)
    assert report["unused_columns"] == {}  # every column a row holds is read
    assert (root / "raw/rejects.jsonl").read_text() == ""
    samples = list(RawDataset(root / "raw"))
    assert [s.key for s in samples] == [f"s{g:09d}" for g in range(n)]  # keys follow --dataset order
    seen = []
    for s in samples:
        conv, meta = s.conversation, s.conversation.meta
        key = (meta["dataset"], meta["index"] if meta["dataset"] != "glaive_tools" else int(meta["source"][5]))
        seen.append(key)
        messages, images, extra = EXPECTED[key]
        assert [(m.role, m.content) for m in conv.messages] == messages, key
        assert meta["source_images"] == images and conv.videos == [] and conv.audios == []
        assert conv.images == [f"img{i}.png" for i in range(len(images))]
        assert [s.media[name] for name in conv.images] == [IMAGES[p] for p in images]  # the files' own bytes
        ours = {k: v for k, v in meta.items() if k not in ("dataset", "source", "index", "source_images",
                                                           "source_videos")}
        assert ours == extra, key  # no meta.extra: nothing left unread
    assert seen == list(EXPECTED)


def test_the_report_counts_rows_per_dataset(converted):
    root, _ = converted
    report = json.loads((root / "raw/convert_report.json").read_text())
    data = root / "data"
    assert report["dataset_info"] == str(data / "dataset_info.json")
    assert list(report["datasets"]) == list(DATASETS)
    assert report["datasets"]["glaive_tools"] == {
        "files": [str(data / "glaive/part-0.jsonl"), str(data / "glaive/part-1.jsonl")],
        "input": 2, "written": 2, "rejected": 0, "rejected_by_reason": {}}
    assert {k: (d["input"], d["written"]) for k, d in report["datasets"].items()} == {
        "alpaca_hist": (2, 2), "glaive_tools": (2, 2), "mllm_demo": (1, 1), "dpo_sharegpt": (1, 1),
        "dpo_alpaca": (1, 1), "kto_demo": (2, 2)}
    assert report["inputs"] == [f for d in report["datasets"].values() for f in d["files"]]


def test_rejects_name_their_dataset_and_media_dir_overrides_the_registry_folder(tmp_path, capsys):
    info = write_registry(tmp_path)
    rows = DATASETS["dpo_sharegpt"][2] + [  # a ranking row without its rejected answer
        {"conversations": [{"from": "human", "value": "q"}], "chosen": {"from": "gpt", "value": "a"}}]
    (tmp_path / "data/dpo.json").write_text(json.dumps(rows))
    media = tmp_path / "elsewhere"
    (media / "pics").mkdir(parents=True)
    (media / "pics/red.png").write_bytes(png_bytes(8, 8, seed=9))
    assert convert_cli("--dataset-info", str(info), "--dataset", "alpaca_hist,dpo_sharegpt", "--media-dir", str(media),
                       "--output", str(tmp_path / "raw"), "--workers", "1") == 0
    (reject,) = [json.loads(x) for x in (tmp_path / "raw/rejects.jsonl").read_text().splitlines()]
    assert (reject["dataset"], reject["index"], reject["reason"]) == ("dpo_sharegpt", 1, "preference_missing_side")
    report = json.loads((tmp_path / "raw/convert_report.json").read_text())
    assert report["datasets"]["dpo_sharegpt"]["rejected_by_reason"] == {"preference_missing_side": 1}
    assert (report["datasets"]["alpaca_hist"]["written"], report["datasets"]["dpo_sharegpt"]["written"]) == (2, 1)
    image_sample = next(s for s in RawDataset(tmp_path / "raw") if s.conversation.images)
    assert image_sample.media["img0.png"] == png_bytes(8, 8, seed=9)  # read from --media-dir
    assert "per dataset: alpaca_hist 2 -> 2, dpo_sharegpt 2 -> 1" in capsys.readouterr().out
    assert main(["data", "inspect", str(tmp_path / "raw"), "--show", "0"]) == 0
    out = capsys.readouterr().out
    assert "dataset alpaca_hist: 2 rows, written 2, rejected 0" in out
    assert "dataset dpo_sharegpt: 2 rows, written 1, rejected 1" in out


def test_llama_factory_column_keys_map_onto_ours():
    m = entry_mapping({"columns": {"prompt": "p", "query": "q", "response": "r", "history": "h", "kto_tag": "k"},
                       "tags": {"role_tag": "from"}})  # alpaca: the default formatting; tags mean nothing there
    assert (m.format, m.instruction, m.input, m.output, m.history, m.kto_tag, m.role_tag, m.ranking) == (
        "alpaca", "p", "q", "r", "h", "k", "role", False)
    m = entry_mapping({"formatting": "sharegpt", "ranking": True, "columns": {"messages": "messages", "images": None},
                       "tags": {"role_tag": "role", "content_tag": "content", "user_tag": "user"}})
    assert (m.messages, m.images, m.role_tag, m.content_tag, m.user_tag, m.assistant_tag, m.ranking) == (
        "messages", "images", "role", "content", "user", "gpt", True)
    assert Mapping().ranking is False


def test_alpaca_preference_pairs_also_read_from_plain_input():
    """``--input`` alpaca rows with chosen / rejected (no registry): the same split as ``ranking: true``."""
    from omniweave.data.sources.formats import FormatError, parse_row
    from omniweave.data.sources.preference import is_preference_row, split_preference_row

    m = Mapping().resolved("alpaca")
    row = {"instruction": "Name a colour.", "input": "One word.", "system": "Be terse.", "history": [["Hi", "Hey"]],
           "chosen": "Red", "rejected": "Table"}
    assert is_preference_row(row, m)
    plain, rejected = split_preference_row(row, m)
    assert rejected == "Table" and plain["output"] == "Red" and "chosen" not in plain
    assert [(x.role, x.content) for x in parse_row(plain, m, row_id="r").messages] == [
        ("system", "Be terse."), ("user", "Hi"), ("assistant", "Hey"), ("user", "Name a colour.\nOne word."),
        ("assistant", "Red")]
    for bad, reason in (({**row, "output": "Blue"}, "bad_schema"), ({**row, "rejected": "Red"}, "preference_identical"),
                        ({k: v for k, v in row.items() if k != "rejected"}, "preference_missing_side")):
        with pytest.raises(FormatError) as e:
            split_preference_row(bad, m)
        assert e.value.reason == reason
    ranking = entry_mapping({"ranking": True})  # a ranking entry: a row without both sides is no plain SFT row
    assert is_preference_row({"instruction": "q", "output": "a"}, ranking)
    assert not is_preference_row({"instruction": "q", "output": "a"}, m)


@pytest.mark.parametrize("extra, argv, expected", [
    ({}, ["--dataset", "alpaca_hist,nope"],
     "has no dataset 'nope'; it has: alpaca_hist, dpo_alpaca, dpo_sharegpt, glaive_tools, kto_demo, mllm_demo"),
    ({"hub": {"hf_hub_url": "llamafactory/alpaca_en", "file_name": "x.json"}}, ["--dataset", "hub"],
     ("dataset 'hub' is loaded from the Hugging Face hub (hf_hub_url: 'llamafactory/alpaca_en'), which convert "
      "cannot read: it converts local files only")),
    ({"ms": {"ms_hub_url": "llamafactory/alpaca_en"}}, ["--dataset", "ms"], "dataset 'ms' is loaded from the ModelScope hub"),
    ({"s3": {"cloud_file_name": "s3://bucket/x.json"}}, ["--dataset", "s3"],
     "dataset 's3' is loaded from cloud storage (s3 / gcs) (cloud_file_name: 's3://bucket/x.json')"),
    ({"script": {"script_url": "my_loader"}}, ["--dataset", "script"], "dataset 'script' is loaded from a dataset loading script"),
    ({"wiki": {"file_name": "wiki.txt", "columns": {"prompt": "text"}}}, ["--dataset", "wiki"],
     "dataset 'wiki': convert reads JSON / JSONL files; wiki.txt is not one"),
    ({"gone": {"file_name": "missing.json"}}, ["--dataset", "gone"], "dataset 'gone': file_name 'missing.json' not found"),
    ({"typo": {"file_name": "kto.json", "colums": {}}}, ["--dataset", "typo"], "dataset 'typo': unknown key(s) colums"),
    ({"badcol": {"file_name": "kto.json", "columns": {"instruction": "q"}}}, ["--dataset", "badcol"],
     "unknown columns key 'instruction'; columns takes prompt, query, response"),
    ({"sampled": {"file_name": "kto.json", "num_samples": 10}}, ["--dataset", "sampled"], "num_samples"),
    ({}, ["--dataset", "kto_demo", "--input", "x.jsonl"], "it cannot be combined with --input"),
    ({}, ["--dataset", "kto_demo", "--format", "sharegpt", "--role-tag", "role", "--messages-key", "m"],
     "it cannot be combined with --format sharegpt, --messages-key, --role-tag"),
    ({}, [], "needs --dataset NAME[,NAME...]: the entries to convert"),
])
def test_registry_mistakes_are_one_line_errors(tmp_path, capsys, extra, argv, expected):
    info = write_registry(tmp_path, extra)
    (tmp_path / "data/wiki.txt").write_text("a document\n")
    assert convert_cli("--dataset-info", str(info), *argv, "--output", str(tmp_path / "raw")) == 2
    err = capsys.readouterr().err.strip()
    assert expected in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "raw").exists()


def test_dataset_without_registry_and_no_input_at_all_are_errors(tmp_path, capsys):
    assert convert_cli("--dataset", "a", "--output", str(tmp_path / "raw")) == 2
    assert "--dataset names entries of a LLaMA-Factory dataset_info.json: pass --dataset-info" in capsys.readouterr().err
    assert convert_cli("--output", str(tmp_path / "raw")) == 2
    assert "pass --input FILE [FILE ...] or --dataset-info PATH --dataset NAME" in capsys.readouterr().err


def test_the_resume_fingerprint_follows_the_registry(tmp_path):
    info = write_registry(tmp_path)
    p = argparse.ArgumentParser()
    convert.add_arguments(p)
    args = p.parse_args(["--dataset-info", str(info), "--dataset", "kto_demo,dpo_alpaca", "--output", "raw"])
    files = [str(tmp_path / "data/kto.json"), str(tmp_path / "data/dpo_alpaca.jsonl")]
    before = convert._fingerprint(args, files)
    assert convert._fingerprint(args, files) == before
    entries = json.loads(info.read_text())
    entries["kto_demo"]["columns"]["kto_tag"] = "good"  # same files, another reading of them
    info.write_text(json.dumps(entries))
    assert convert._fingerprint(args, files) != before
    other = p.parse_args(["--dataset-info", str(info), "--dataset", "dpo_alpaca,kto_demo", "--output", "raw"])
    assert convert._fingerprint(other, files[::-1]) != convert._fingerprint(args, files)  # another row order


def test_help_shows_the_registry_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["data", "convert", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    out = " ".join(out.split())  # argparse wraps the help text
    assert "--dataset-info PATH" in out and "--dataset NAME[,NAME...]" in out and "LLaMA-Factory dataset_info.json" in out
