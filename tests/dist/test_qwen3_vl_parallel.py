"""Qwen3-VL's DeepStack under parallel layouts, built as the trainer builds them (``parallel_model.build``),
gloo, CPU, fp32, against the single process on the same packed row (images and a timestamped
video: several media spans per video): context parallelism (ring with the vision split, ulysses
without) and a tensor-parallel foundation + encoder. The DeepStack levels travel with the media
features and are placed by each rank's feature rows; loss and every gradient must match."""

from __future__ import annotations


import pytest

from omniweave.parallel.spawn import run_ranks
from tests.train_factory import layout_against_one_process

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
    from omniweave.config import load_recipe

    row, out = _row(), []
    for recipe, cp, mode, vs, tp, tp_enc in LAYOUTS:
        cfg = load_recipe(recipe, [f"parallel.cp={cp}", f"parallel.cp_attention={mode}",
                                   f"parallel.vision_split={str(vs).lower()}", f"model.foundation.tp={tp}",
                                   f"model.image_encoder.tp={tp_enc}"])  # fmt: skip
        r = layout_against_one_process(cfg, row, world)
        grads = dict(r["reference"].named_parameters())
        out.append({"layout": (recipe, cp, mode, vs, tp, tp_enc), "loss_rel": r["loss_rel"],
                    "grad_rel": r["grad_rel"], "worst": r["worst"],
                    "deepstack_grad": float(grads["projector.deepstack_merger_list.1.linear_fc2.weight"].grad.abs().sum())})
    return out


def test_deepstack_layouts_match_single_process():
    results = run_ranks(_body, 2, timeout=600)
    for rank_results in results:
        for r in rank_results:
            print(r)
            assert r["deepstack_grad"] > 0, r
            assert r["loss_rel"] <= RTOL and r["grad_rel"] <= RTOL, r
