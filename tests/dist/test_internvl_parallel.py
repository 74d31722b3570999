"""InternVL (intern_vit + pixel_shuffle_mlp + Qwen3, 1-D positions) under parallel layouts built as
the trainer builds them (``parallel_model.build``), gloo, CPU, fp32, against the single process on
the same packed row: two documents, the first with two tiled images (3 tiles and 1 tile of 112 px),
the second text. Context parallelism with the vision split (tiles as the units: each rank encodes
its share of the tiles), without it (Ulysses), tensor parallelism of the tower and the decoder, and
dp 2 (FSDP2). Loss and every gradient within 1e-5 relative; the pipeline (tower in stage 0) and
dp 2 through ``omniweave train`` against one rank."""

from __future__ import annotations

import pytest
import torch

from omniweave.parallel.spawn import run_ranks
from tests.train_factory import layout_against_one_process

pytestmark = [pytest.mark.dist]

RTOL = 1e-5
LAYOUTS = {
    2: [["parallel.cp=2", "parallel.cp_attention=ring", "parallel.vision_split=true"],
        ["parallel.cp=2", "parallel.cp_attention=ulysses", "parallel.vision_split=false"],
        [],  # dp 2
        ["model.foundation.tp=2", "model.image_encoder.tp=2"]],
    4: [["parallel.cp=4", "parallel.cp_attention=allgather", "parallel.vision_split=true"],
        ["parallel.cp=2", "model.foundation.tp=2", "model.image_encoder.tp=2"]],
}


def _row() -> dict:
    from tests.test_internvl import make_sample

    _, first = make_sample([3, 1], side=112, seed=1)
    _, second = make_sample([], side=112, seed=2)
    n = first["input_ids"].shape[0]
    row = {k: torch.cat([first[k], second[k]], dim=-1) for k in ("input_ids", "labels", "position_ids")}
    row |= {"pixel_values": first["pixel_values"], "grid_thw": first["grid_thw"], "media_spans": first["media_spans"],
            "cu_seqlens": torch.tensor([0, n, n + second["input_ids"].shape[0]], dtype=torch.int32)}  # fmt: skip
    row["num_loss_tokens"] = int((row["labels"] != -100).sum())
    return row


def _body(rank: int, world: int) -> list[dict]:
    from omniweave.config import load_recipe

    row, out = _row(), []
    for overrides in LAYOUTS[world]:
        r = layout_against_one_process(load_recipe("tiny_internvl", overrides), row, world)
        grads = dict(r["reference"].named_parameters())
        qkv = r["model"].image_encoder.blocks[0].attn.qkv.weight
        out.append({"layout": overrides, "loss_rel": r["loss_rel"], "grad_rel": r["grad_rel"], "worst": r["worst"],
                    "placed": str(getattr(qkv, "placements", None)),
                    "tower_grad": float(grads["image_encoder.cls_token"].grad.abs().sum())})  # fmt: skip
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_internvl_layouts_match_single_process(world):
    for rank_results in run_ranks(_body, world, timeout=600):
        for r in rank_results:
            print(r)
            assert r["tower_grad"] > 0, r
            if "model.image_encoder.tp=2" in r["layout"]:  # the tower's heads really split
                assert "Shard(dim=0)" in r["placed"], r
            assert r["loss_rel"] <= RTOL and r["grad_rel"] <= RTOL, r


@pytest.mark.slow
@pytest.mark.parametrize("nproc,parallel", [(2, {}), (2, {"parallel__pp": 2})], ids=["dp2", "pp2"])
def test_tiny_internvl_trains_like_one_rank(tmp_path_factory, nproc, parallel):
    """`omniweave train --nproc N` on tiny_internvl over the demo's data packed with the recipe
    (images tiled, the demo's videos counted drops): the 1-rank losses, grad norms and final weights."""
    from tests.train_factory import final_state, losses, make_demo_packed, max_abs_diff, read_metrics, train_subprocess

    packed = make_demo_packed(tmp_path_factory.mktemp("internvl"), samples=48, recipe="tiny_internvl")
    runs = []
    for n, kw in ((1, {}), (nproc, parallel)):
        out = tmp_path_factory.mktemp(f"n{n}") / "run"
        res = train_subprocess(packed, out, nproc=n, steps=3, global_batch=4, recipe="tiny_internvl", **kw)
        assert res.returncode == 0, res.stdout[-4000:]
        runs.append(out)
    ref, run = (read_metrics(r) for r in runs)
    assert [r["loss"] for r in run] == pytest.approx([r["loss"] for r in ref], rel=1e-5)
    assert [r["grad_norm"] for r in run] == pytest.approx([r["grad_norm"] for r in ref], rel=1e-5)
    assert losses(runs[0])[-1] < losses(runs[0])[0]
    assert max_abs_diff(final_state(runs[1]), final_state(runs[0])) <= 3e-5
