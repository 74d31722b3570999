"""Raw shards round-trip: every sample's JSON and media bytes come back equal, through our
RawDataset, the webdataset library and megatron-energon; .tar.idx offsets point at samples."""

from __future__ import annotations

import argparse
import json
import tarfile
from pathlib import Path

import pytest

from omniweave.data.sources import convert
from omniweave.data.sources import shards
from omniweave.data.demo import generate
from omniweave.data.sample import Conversation, Message
from omniweave.data.sources.shards import RawDataset, ShardWriter, read_tar_index


def run_convert(*argv: str) -> int:
    p = argparse.ArgumentParser()
    convert.add_arguments(p)
    return convert.run(p.parse_args([*argv, "--no-progress"]))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("rt")
    generate(root / "demo", samples=45, eval_samples=0, seed=3)
    rc = run_convert("--input", str(root / "demo/train.jsonl"), "--media-dir", str(root / "demo/media"),
                     "--output", str(root / "raw"), "--maxcount", "12", "--workers", "2")
    assert rc == 0
    rows = [json.loads(line) for line in (root / "demo/train.jsonl").read_text().splitlines()]
    return root, rows


def expected_media(root: Path, row: dict) -> dict[str, bytes]:
    out = {}
    for i, p in enumerate(row["images"]):
        out[f"img{i}.png"] = (root / "demo/media" / p).read_bytes()
    for i, p in enumerate(row["videos"]):
        out[f"vid{i}.mp4"] = (root / "demo/media" / p).read_bytes()
    return out


def test_raw_dataset_round_trip(converted):
    root, rows = converted
    ds = RawDataset(root / "raw")
    assert len(ds) == len(rows) == 45
    assert [s.count for s in ds.shards] == [12, 12, 12, 9]
    assert all(s.bytes == (root / "raw" / s.name).stat().st_size for s in ds.shards)
    for i, (row, sample) in enumerate(zip(rows, ds)):
        assert sample.key == f"s{i:09d}"
        conv = sample.conversation
        assert conv.id == row["id"]
        assert [{"role": m.role, "content": m.content} for m in conv.messages] == row["messages"]
        assert conv.meta["source_images"] == row["images"] and conv.meta["source_videos"] == row["videos"]
        assert sample.media == expected_media(root, row)
    assert ds[-1].key == "s000000044" and ds[13].key == "s000000013"  # random access
    with pytest.raises(IndexError):
        ds[45]


def test_webdataset_library_reads_the_same_bytes(converted):
    webdataset = pytest.importorskip("webdataset")
    root, rows = converted
    urls = [str(root / "raw" / s.name) for s in RawDataset(root / "raw").shards]
    seen = 0
    for sample in webdataset.WebDataset(urls, shardshuffle=False, empty_check=False):
        i = int(sample["__key__"][1:])
        row = rows[i]
        obj = json.loads(sample["json"])
        assert obj["messages"] == row["messages"]
        media = {k: v for k, v in sample.items() if not k.startswith("__") and k != "json"}
        assert media == expected_media(root, row)
        seen += 1
    assert seen == len(rows)


def test_tar_idx_offsets_seek_to_each_sample(converted):
    root, _ = converted
    g = 0
    for shard in RawDataset(root / "raw").shards:
        path = root / "raw" / shard.name
        offsets = read_tar_index(path.with_name(shard.name + ".idx"))
        assert len(offsets) == shard.count + 1
        data = path.read_bytes()
        for off in offsets[:-1]:
            header = tarfile.TarInfo.frombuf(data[int(off):int(off) + 512], "utf-8", "surrogateescape")
            assert header.name == f"s{g:09d}.json"
            g += 1
        # the last entry is where the end-of-archive blocks start (Energon's convention)
        assert data[int(offsets[-1]):] == b"\0" * (len(data) - int(offsets[-1]))
    assert g == 45


@pytest.mark.filterwarnings("ignore:'pin_memory' argument")
def test_energon_metadata_and_reading(converted):
    energon = pytest.importorskip("megatron.energon")
    root, rows = converted
    meta = root / "raw/.nv-meta"
    assert "CrudeWebdataset" in (meta / "dataset.yaml").read_text()
    info = json.loads((meta / ".info.json").read_text())
    assert sum(info["shard_counts"].values()) == 45

    @energon.stateless
    def cook(sample: dict) -> dict:
        return sample

    class Encoder(energon.DefaultTaskEncoder):
        decoder = None  # raw bytes, no image decoding
        cookers = [energon.Cooker(cook, has_subflavors={"sample_type": shards.SAMPLE_TYPE})]

        def encode_sample(self, sample):
            return sample

        def batch(self, samples):
            return samples

    wc = energon.WorkerConfig(rank=0, world_size=1, num_workers=0)
    ds = energon.get_train_dataset(str(root / "raw"), batch_size=None, worker_config=wc, task_encoder=Encoder(),
                                   shuffle_buffer_size=None, max_samples_per_sequence=None, repeat=False)
    got = {}
    for sample in energon.get_loader(ds):
        got[sample["__key__"]] = sample
    assert sorted(got) == [f"s{i:09d}" for i in range(45)]
    s7 = got["s000000007"]
    assert json.loads(s7["json"])["messages"] == rows[7]["messages"]
    assert {k: v for k, v in s7.items() if k[:3] in ("img", "vid")} == expected_media(root, rows[7])


def test_writer_uses_temp_name_until_finalized(tmp_path):
    w = ShardWriter(tmp_path / ".shard.tar.tmp")
    conv = Conversation(id="a", messages=[Message("user", "<image>"), Message("assistant", "x")], images=["img0.png"])
    shards.write_conversation_sample(w, "s000000000", conv, {"img0.png": b"\x89PNG fake"})
    assert not list(tmp_path.glob("shard-*.tar"))
    rec = shards.finalize_shard(w, tmp_path / shards.shard_name(0))
    assert rec["count"] == 1 and (tmp_path / "shard-000000.tar.idx").is_file()
    assert not (tmp_path / ".shard.tar.tmp").exists()
    with pytest.raises(ValueError, match="must not contain"):
        ShardWriter(tmp_path / "x.tmp").write("a.b", {"json": b"{}"})


def test_indices_equal_what_energon_prepare_builds(converted, tmp_path):
    """Energon's own indexer over our tars yields byte-identical .tar.idx and the same sqlite rows."""
    pytest.importorskip("megatron.energon")
    import shutil
    import sqlite3

    from megatron.energon.flavors.webdataset.prepare import WebdatasetPreparator

    root, _ = converted
    ours, theirs = root / "raw", tmp_path / "raw"
    shutil.copytree(ours, theirs)
    names = [s.name for s in RawDataset(ours).shards]
    WebdatasetPreparator.prepare_dataset(theirs, names, split_parts_ratio=[("train", 1.0)], workers=1, shuffle_seed=None)
    for name in names:
        assert (ours / f"{name}.idx").read_bytes() == (theirs / f"{name}.idx").read_bytes()

    def rows(path, table, order):
        db = sqlite3.connect(path / ".nv-meta/index.sqlite")
        try:
            return db.execute(f"SELECT * FROM {table} ORDER BY {order}").fetchall()
        finally:
            db.close()

    for table, order in (("samples", "tar_file_id, sample_index"),
                         ("sample_parts", "tar_file_id, sample_index, content_byte_offset")):
        assert rows(ours, table, order) == rows(theirs, table, order)
    assert json.loads((ours / ".nv-meta/.info.json").read_text())["shard_counts"] == \
        json.loads((theirs / ".nv-meta/.info.json").read_text())["shard_counts"]


def test_raw_samples_feed_the_sample_processor(converted):
    """The contract with packing: RawSample media parts resolve and the demo's 56-px media become
    4 tokens (image) / 8 tokens (4-frame video) with min_pixels lowered to 56*56."""
    from omniweave.data.text.tokenize import SampleProcessor

    root, _ = converted
    proc = SampleProcessor({"tokenizer": "demo", "template": "chatml", "max_len": 512,
                            "vision": {"min_pixels": 3136, "video_min_pixels": 3136}})
    spans = set()
    for raw in RawDataset(root / "raw"):
        sample = proc.tokenize(raw)
        spans.update((s.kind, s.grid_thw, s.length) for s in sample.media)
        for span in sample.media:
            assert span.part in raw.media
    assert spans == {("image", (1, 4, 4), 4), ("video", (2, 4, 4), 8)}
