"""Packed shards: round trip to the source samples, shifted labels, boundaries, media, stats."""

import json

import pytest

from omniweave.data.packing.packed import PackedDataset
from omniweave.data.sources.shards import RawDataset
from omniweave.data.text.template import IGNORE_INDEX, render
from omniweave.data.text.tokenize import SampleProcessor
from tests.fakes_data import DATA_CFG, build_packed


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    raw, out = build_packed(tmp_path_factory.mktemp("packed"))
    return RawDataset(raw), PackedDataset(out), out


def test_pack_tokens_decode_to_source_samples_rendered_text_in_order(packed):
    raw, ds, _ = packed
    proc = SampleProcessor(DATA_CFG)
    pads = {proc.image_pad_id, proc.video_pad_id}
    seen = []
    for k in range(len(ds)):
        p = ds[k]
        idx = [d["index"] for d in p["docs"]]
        assert idx == sorted(idx)
        for d, doc in enumerate(p["docs"]):
            ids = p["input_ids"][p["cu_seqlens"][d] : p["cu_seqlens"][d + 1]].tolist()
            collapsed = [t for j, t in enumerate(ids) if not (t in pads and j > 0 and ids[j - 1] == t)]
            sample = raw[doc["index"]]
            assert proc.tokenizer.decode(collapsed) == render(proc.template, sample.conversation.messages).text
            assert doc["key"] == sample.key
            seen.append(doc["index"])
    assert len(seen) == len(set(seen))


def test_labels_are_shifted_within_documents_and_never_cross_a_boundary(packed):
    raw, ds, _ = packed
    proc = SampleProcessor(DATA_CFG)
    for k in range(len(ds)):
        p = ds[k]
        cu = p["cu_seqlens"]
        assert cu[0] == 0 and cu[-1] == len(p["input_ids"]) == p["position_ids"].shape[1]
        assert p["position_ids"].shape[0] == 3
        for d, doc in enumerate(p["docs"]):
            a, b = int(cu[d]), int(cu[d + 1])
            assert b - a == doc["length"]
            s = proc.tokenize(raw[doc["index"]])
            assert (p["labels"][a : b - 1] == s.labels[1:]).all()
            assert p["labels"][b - 1] == IGNORE_INDEX, "the last token of a document predicts nothing"
            assert (p["position_ids"][:, a] == 0).all(), "positions restart in every document"
            target = p["labels"][a:b] != IGNORE_INDEX
            assert (p["labels"][a:b][target] == p["input_ids"][a + 1 : b][target[:-1]]).all()
        assert p["num_loss_tokens"] == int((p["labels"] != IGNORE_INDEX).sum())


def test_media_descriptors_point_at_pad_spans_and_keep_original_bytes(packed):
    raw, ds, _ = packed
    proc = SampleProcessor(DATA_CFG)
    n_media = 0
    for k in range(len(ds)):
        p = ds[k]
        for m in p["media"]:
            pad = proc.image_pad_id if m["kind"] == "image" else proc.video_pad_id
            span = p["input_ids"][m["start"] : m["start"] + m["length"]]
            assert (span == pad).all() and p["input_ids"][m["start"] - 1] != pad
            t, h, w = m["grid_thw"]
            assert m["length"] == t * h * w // 4
            assert m["bytes"] == raw[m["sample"]].media[m["part"]]
            if m["kind"] == "video":
                assert m["frame_indices"] and m["second_per_grid"] > 0
            n_media += 1
    assert n_media == 10 + 5 + 4  # 10 image samples (1 or 2 images each) + 4 videos


def test_stats_account_for_every_sample_and_manifest_records_the_build(packed):
    _, ds, out = packed
    stats = json.loads((out / "stats.json").read_text())
    assert stats["samples"] == 40
    assert stats["samples_packed"] + stats["dropped_total"] == 40
    assert stats["dropped"] == {"no_assistant_turn": 1, "too_long": 1}
    assert stats["modalities"] == {"text_only_samples": 24, "image_samples": 10, "video_samples": 4,
                                   "images": 15, "videos": 4, "audio_samples": 0, "audios": 0,
                                   "audio_seconds": 0.0, "audio_bytes": 0}
    real = sum(ds.record(k)["length"] for k in range(len(ds)))
    assert stats["real_tokens"] == real and stats["packs"] == len(ds)
    assert stats["efficiency"] == pytest.approx(real / (len(ds) * 512))
    assert len(ds) == -(-real // 512), "BFD reaches the lower bound on pack count here"
    m = ds.manifest
    assert m["fingerprint"] == SampleProcessor(DATA_CFG).fingerprint()
    assert m["algorithm"] == "bfd" and m["capacity"] == 512
    assert [s["name"] for s in m["source"]] == [f"shard-{i:06d}.tar" for i in range(4)]
    assert all(s["bytes"] > 0 for s in m["source"])
    assert (out / "lengths.png").stat().st_size > 1000


def test_random_access_reads_any_pack_directly(packed):
    _, ds, _ = packed
    last = ds[len(ds) - 1]
    assert len(last["input_ids"]) == ds.record(len(ds) - 1)["length"]
    with pytest.raises(IndexError):
        ds[len(ds)]


def copy_packed(out, tmp_path):
    import shutil

    dst = tmp_path / "packed"
    shutil.copytree(out, dst)
    return dst


def test_a_shard_cut_short_is_named_when_the_dataset_opens(packed, tmp_path):
    """Issue 31, item 11: not at the step that reads the damaged pack."""
    import os

    from omniweave.data.packing.packed import PackedDamaged

    dst = copy_packed(packed[2], tmp_path)
    shard = sorted(dst.glob("packs-*.bin"))[0]
    size = shard.stat().st_size
    os.truncate(shard, size - 10)
    with pytest.raises(PackedDamaged, match=f"{shard.name} has {size - 10} bytes, {size} when it was written"):
        PackedDataset(dst)
    shard.unlink()
    with pytest.raises(PackedDamaged, match=f"{shard.name} is missing"):
        PackedDataset(dst)


def test_a_pack_with_impossible_tokens_or_labels_is_named_when_read(packed, tmp_path):
    import numpy as np

    from omniweave.data.packing.packed import PackedDamaged

    dst = copy_packed(packed[2], tmp_path)
    ds = PackedDataset(dst)
    rec = ds.record(1)
    with open(dst / f"{rec['shard']}.bin", "r+b") as f:  # token 3 of pack 1 becomes -7
        f.seek(rec["offset"] + 4 * 3)
        f.write(np.asarray([-7], "<i4").tobytes())
    ds[0]  # the others still read
    with pytest.raises(PackedDamaged, match=r"pack 1 \(packs-000000.bin at byte \d+\) has a negative token id \(-7\)"):
        ds[1]
    with open(dst / f"{rec['shard']}.bin", "r+b") as f:  # back, and label 2 becomes -5
        f.seek(rec["offset"] + 4 * 3)
        f.write(np.asarray([ds.record(1)["length"] and 5], "<i4").tobytes())
        f.seek(rec["offset"] + 4 * (rec["length"] + 2))
        f.write(np.asarray([-5], "<i4").tobytes())
    with pytest.raises(PackedDamaged, match="has a label that is neither a token id nor -100"):
        ds[1]
