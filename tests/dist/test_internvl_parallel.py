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
def test_tiny_internvl_trains_like_one_rank(tmp_path, nproc, parallel):
    """`omniweave train --nproc N` on tiny_internvl over the demo's data packed with the recipe
    (images tiled, videos one tile a frame): the 1-rank losses, grad norms and final weights."""
    from tests.train_factory import final_state, max_abs_diff, trains_like_one_rank

    one, many = trains_like_one_rank(tmp_path, "tiny_internvl", nproc, parallel)
    assert max_abs_diff(final_state(many), final_state(one)) <= 3e-5
