"""Qwen3-VL's DeepStack under parallel layouts, built as the trainer builds them (``parallel_model.build``),
gloo, CPU, fp32, against the single process on the same packed row (images and a timestamped
video: several media spans per video): context parallelism (ring with the vision split, ulysses
without) and a tensor-parallel foundation + encoder. The DeepStack levels travel with the media
features and are placed by each rank's feature rows; loss and every gradient must match."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from omniweave.parallel.spawn import run_ranks
from tests.train_factory import worst_layout_grad

pytestmark = [pytest.mark.dist]

RTOL = 1e-5  # loss relative; per parameter max |g - g_1| / max |g_1| (measured <= 1.4e-6)
LAYOUTS = [  # (recipe, cp, cp_attention, vision_split, foundation tp, encoder tp)
    ("tiny_qwen3_vl", 2, "ring", True, 1, 1),
    ("tiny_qwen3_vl_moe", 2, "ulysses", False, 1, 1),
    ("tiny_qwen3_vl", 1, "ring", True, 2, 2),
]


def _row() -> dict:
    from tests.qwen3_vl_factory import MEDIA_CASES, make_sample, ours_batch, pack

    docs = [make_sample(MEDIA_CASES["mixed"], seed=1), make_sample([], seed=2), make_sample(MEDIA_CASES["video"], seed=3)]
    row = ours_batch(pack(docs))
    row["num_loss_tokens"] = int((row["labels"] != -100).sum())
    return row


def _body(rank: int, world: int) -> list[dict]:
    from omniweave.config import load_recipe, to_dict
    from omniweave.models.registry import build_model
    from omniweave.parallel.context import shard_micro_batch
    from omniweave.parallel.dims import ParallelDims
    from omniweave.train.parallel_model import build

    row, out = _row(), []
    for recipe, cp, mode, vs, tp, tp_enc in LAYOUTS:
        cfg = load_recipe(recipe, [f"parallel.cp={cp}", f"parallel.cp_attention={mode}",
                                   f"parallel.vision_split={str(vs).lower()}", f"model.foundation.tp={tp}",
                                   f"model.image_encoder.tp={tp_enc}"])  # fmt: skip
        torch.manual_seed(int(cfg.train.seed))  # what build() does on one process
        base = build_model(to_dict(cfg.model))
        base.init_weights()
        ref = copy.deepcopy(base)
        ref_loss = ref(row).loss_sum / row["num_loss_tokens"]
        ref_loss.backward()
        ref_loss = float(ref_loss.detach())
        dims = ParallelDims.from_config(cfg.parallel, world, model=cfg.model)
        meshes = dims.build_meshes("cpu")
        model = build(cfg, torch.device("cpu"), dims, meshes)
        res = model(shard_micro_batch(row, dims.cp, meshes.cp_rank, dims.tp))
        (res.loss_sum / row["num_loss_tokens"]).backward()
        loss = res.loss_sum.detach().double()
        dist.all_reduce(loss)
        loss = float(loss) / dims.tp / row["num_loss_tokens"]
        worst, name_worst = worst_layout_grad(model, ref)
        grads = dict(ref.named_parameters())
        out.append({"layout": (recipe, cp, mode, vs, tp, tp_enc), "loss_rel": abs(loss - ref_loss) / ref_loss,
                    "grad_rel": worst, "worst": name_worst,
                    "deepstack_grad": float(grads["projector.deepstack_merger_list.1.linear_fc2.weight"].grad.abs().sum())})
    return out


def test_deepstack_layouts_match_single_process():
    results = run_ranks(_body, 2, timeout=600)
    for rank_results in results:
        for r in rank_results:
            print(r)
            assert r["deepstack_grad"] > 0, r
            assert r["loss_rel"] <= RTOL and r["grad_rel"] <= RTOL, r
