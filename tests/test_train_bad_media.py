"""Issue 31, item 3 at train time: a sample whose media fails to decode anyway (a packed dataset
edited after pack) does not stop the run. Its media are zeros, its loss is dropped, the step runs,
the skip is counted in metrics.jsonl and logged naming the sample; a resumed run skips it again and
equals the uninterrupted one."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from data_factory import png_with_garbage_pixels
from omniweave.data.loading.loader import PackedLoader, collate_pack
from omniweave.data.media.vision import MediaError
from omniweave.data.packing.packed import PackedDataset
from omniweave.train.loss import drop_skipped_docs
from train_factory import make_demo_packed, read_metrics, recipe, train_in_process

STEPS, GB = 4, 2


def corrupt_first_image(packed: Path, pack: int) -> dict:
    """Garbage pixels (valid PNG chunks) over the first image of ``pack``, in place in its .bin."""
    rec = PackedDataset(packed).record(pack)
    m = next(m for m in rec["media"] if m["kind"] == "image" and m["size"])
    path = packed / f"{rec['shard']}.bin"
    with open(path, "r+b") as f:
        f.seek(m["offset"])
        bad = png_with_garbage_pixels(f.read(m["size"]))
        assert len(bad) == m["size"]
        f.seek(m["offset"])
        f.write(bad)
    return {"pack": pack, "shard": rec["shard"], "part": m["part"], "sample": rec["docs"][m["doc"]]["key"],
            "tokens": rec["cu_seqlens"][m["doc"]: m["doc"] + 2]}


@pytest.fixture(scope="module")
def damaged(tmp_path_factory):
    """A demo packed dataset whose pack consumed first in step 3 (after the step-2 checkpoint) holds a
    corrupt image."""
    root = tmp_path_factory.mktemp("bad_media")
    packed = make_demo_packed(root, samples=60)
    seed = int(recipe(packed, root / "unused").train.seed)
    order = PackedLoader(packed, GB, dp_rank=0, dp_size=1, seed=seed).order(0)
    return packed, corrupt_first_image(packed, int(order[GB * 2]))


def test_collate_names_the_sample_whose_media_does_not_decode(damaged):
    packed, bad = damaged
    ds = PackedDataset(packed)
    with pytest.raises(MediaError, match="does not decode") as e:  # not tolerated unless asked
        collate_pack(ds[bad["pack"]], ds.manifest["data_cfg"])
    assert e.value.reason == "undecodable_media"
    skips: list[dict] = []
    mb = collate_pack(ds[bad["pack"]], ds.manifest["data_cfg"], skips)
    assert [(s["sample"], s["part"], s["shard"], s["reason"]) for s in skips] == [
        (bad["sample"], bad["part"], bad["shard"], "undecodable_media")]
    assert skips[0]["tokens"] == bad["tokens"]
    assert mb["pixel_values"].shape[0] == int(mb["grid_thw"].prod(-1).sum())  # shapes as planned: zeros


def test_only_the_skipped_document_loses_its_loss(damaged):
    packed, bad = damaged
    ds = PackedDataset(packed)
    skips: list[dict] = []
    mb = collate_pack(ds[bad["pack"]], ds.manifest["data_cfg"], skips)
    (out,) = drop_skipped_docs([mb], [{"row": 0, **skips[0]}])
    start, end = bad["tokens"]
    assert (out["labels"][start:end] == -100).all()
    keep = np.r_[0:start, end:len(mb["labels"])]
    assert out["labels"][keep].tolist() == mb["labels"][keep].tolist()
    assert out["num_loss_tokens"] == mb["num_loss_tokens"] - int((mb["labels"][start:end] != -100).sum()) > 0


@pytest.fixture(scope="module")
def whole_run(damaged, tmp_path_factory):
    out = tmp_path_factory.mktemp("whole")
    train_in_process(damaged[0], out, steps=STEPS, global_batch=GB, train__save_interval=2, train__keep_last=0)
    return out


def test_a_corrupt_image_is_skipped_counted_and_named_and_the_run_finishes(damaged, whole_run):
    _, bad = damaged
    metrics = read_metrics(whole_run)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert [m["media_skipped"] for m in metrics] == [0, 0, 1, 0]
    assert [m["media_skipped_total"] for m in metrics] == [0, 0, 1, 1]
    (skip,) = metrics[2]["media_skips"]
    assert (skip["sample"], skip["part"], skip["pack"], skip["reason"]) == (
        bad["sample"], bad["part"], bad["pack"], "undecodable_media")
    assert all(np.isfinite(m["loss"]) for m in metrics)


def test_the_skip_is_logged_naming_sample_and_pack(damaged, tmp_path, capsys):
    _, bad = damaged
    train_in_process(damaged[0], tmp_path / "run", steps=3, global_batch=GB)
    out = capsys.readouterr().out
    assert f"step 3: skipped sample {bad['sample']} (pack {bad['pack']} of {bad['shard']}, {bad['part']}): " \
           "undecodable_media" in out


def test_resume_from_before_the_skip_equals_the_uninterrupted_run(damaged, whole_run, tmp_path):
    step2 = "checkpoints/step_000002"
    shutil.copytree(whole_run / step2, tmp_path / "cut" / step2)
    train_in_process(damaged[0], tmp_path / "cut", resume="auto", steps=STEPS, global_batch=GB, train__save_interval=2)
    keys = ("step", "loss", "grad_norm", "loss_tokens", "media_skipped", "media_skipped_total", "media_skips")
    resumed, whole = ([{k: m.get(k) for k in keys} for m in read_metrics(run)] for run in (tmp_path / "cut", whole_run))
    assert resumed == whole[2:]


def test_dropping_a_document_zeroes_its_per_token_data_too():
    import torch

    mb = {"labels": torch.tensor([5, 6, -100, 7, 8, -100]), "num_loss_tokens": 4,
          "token_data": {"pair_slot": torch.tensor([1, 1, 0, 2, 2, 0])}}
    (out,) = drop_skipped_docs([mb], [{"row": 0, "tokens": [3, 6]}])
    assert out["labels"].tolist() == [5, 6, -100, -100, -100, -100] and out["num_loss_tokens"] == 2
    assert out["token_data"]["pair_slot"].tolist() == [1, 1, 0, 0, 0, 0]
    assert mb["labels"].tolist() == [5, 6, -100, 7, 8, -100]  # the loader's batch is left as it was


def test_a_grpo_prompt_whose_image_does_not_decode_drops_its_group_counted_and_named(tmp_path, capsys):
    """RL reads the same loader: the prompt with the corrupt image is rolled out (zero pixels) but its
    group is left out of the update, counted in ``groups_media_skipped`` and named on the console."""
    from omniweave.config import load_recipe
    from omniweave.rl.trainer import train_rl
    from rl_factory import make_rl_prompts, rl_overrides

    prompts = make_rl_prompts(tmp_path / "rl", samples=12)
    cfg = load_recipe("demo_grpo", rl_overrides(prompts, tmp_path / "run", steps=2))
    order = PackedLoader(prompts, int(cfg.train.global_batch), dp_rank=0, dp_size=1, seed=int(cfg.train.seed),
                         kind="prompts").order(0)
    step2 = [int(i) for i in order[4:8]]
    with_image = next(i for i in step2 if any(m["kind"] == "image" for m in PackedDataset(prompts).record(i)["media"]))
    bad = corrupt_first_image(prompts, with_image)
    train_rl(cfg)
    rows = read_metrics(tmp_path / "run")
    assert [r["groups_media_skipped"] for r in rows] == [0, 1]
    assert [r["groups_failed"] for r in rows] == [0, 0]
    (skip,) = rows[1]["media_skips"]
    assert (skip["sample"], skip["pack"], skip["reason"]) == (bad["sample"], bad["pack"], "undecodable_media")
    out = capsys.readouterr().out
    assert f"step 2: skipped sample {bad['sample']} (pack {bad['pack']} of {bad['shard']}" in out
    assert "undecodable_media" in out and "its group was dropped" in out


def test_a_group_whose_media_failed_is_dropped_from_the_advantages():
    import torch

    from omniweave.rl.step import GRPOStep

    class Scored:
        total = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.9, 0.1])
        failed = torch.zeros(6, dtype=torch.bool)

    step = GRPOStep.__new__(GRPOStep)
    step.s = type("S", (), {"group_size": 2, "grpo": type("G", (), {"filter_zero_std": True, "scale_rewards": "group",
                                                                  "advantage": "grpo"})})
    keep, adv, counts = step._advantages(Scored, 3, {1})
    assert keep == [0, 2] and adv.view(3, 2)[1].tolist() == [0.0, 0.0]
    assert counts == {"groups": 3, "failed": 0, "zero_std": 0, "media_skipped": 1}
