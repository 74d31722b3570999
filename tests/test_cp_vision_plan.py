"""The vision split plan (omniweave.parallel.context.vision.plan_vision_split): every frame of every
item encoded exactly once, balanced cost, videos on ranks in contiguous runs, deterministic,
ranks without a share when there are fewer units than ranks, clear errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omniweave.parallel.context.vision import plan_vision_split, split_costs, unit_cost


def _frames(plan):
    return sorted((i, f) for own in plan for i, t0, t1 in own for f in range(t0, t1))


def _check_cover(grids, plan, cp):
    assert len(plan) == cp
    want = sorted((i, f) for i, (t, _, _) in enumerate(grids) for f in range(t))
    assert _frames(plan) == want, "every frame exactly once"
    for own in plan:
        assert all(t0 < t1 for _, t0, t1 in own) and own == sorted(own)
        # slices on one rank are maximal runs: no two of them touch
        assert all(not (a[0] == b[0] and a[2] == b[1]) for a, b in zip(own, own[1:]))


def test_many_equal_frames_are_balanced_and_each_video_is_one_run_per_rank():
    grids = [[6, 8, 8], [4, 8, 8], [6, 8, 8], [8, 8, 8]]  # 24 frames of equal cost
    for cp in (2, 3, 4, 8):
        plan = plan_vision_split(grids, cp, hidden_size=32)
        _check_cover(grids, plan, cp)
        costs = split_costs(grids, plan, 32)
        assert max(costs) / (sum(costs) / cp) == 1.0  # 24 frames divide evenly
        slices = sum(len(own) for own in plan)
        assert slices <= len(grids) + cp - 1, plan  # contiguous runs: at most one cut per rank boundary
    assert plan_vision_split(grids, 2, 32) == [[(0, 0, 6), (1, 0, 4), (2, 0, 2)], [(2, 2, 6), (3, 0, 8)]]


def test_mixed_sizes_stay_close_to_balanced():
    grids = [[1, 40, 36], [9, 16, 20], [1, 8, 8], [5, 24, 24], [1, 12, 16], [3, 30, 20], [1, 4, 4]]
    for cp in (2, 3, 4):
        plan = plan_vision_split(grids, cp, hidden_size=1280)
        _check_cover(grids, plan, cp)
        costs = split_costs(grids, plan, 1280)
        biggest = max(unit_cost(h * w, 1280) for _, h, w in grids)
        assert max(costs) - sum(costs) / cp <= biggest  # LPT bound: above the mean by < one unit
        assert max(costs) / (sum(costs) / cp) < 1.1, costs


def test_a_single_huge_image_goes_to_one_rank_and_the_rest_get_nothing():
    plan = plan_vision_split(torch.tensor([[1, 100, 120]]), 4)
    assert plan == [[(0, 0, 1)], [], [], []]


def test_fewer_units_than_ranks():
    plan = plan_vision_split([[1, 4, 4], [2, 8, 4]], 5, hidden_size=16)
    _check_cover([[1, 4, 4], [2, 8, 4]], plan, 5)
    assert sorted(len(own) for own in plan) == [0, 0, 1, 1, 1]


def test_large_units_go_first_and_equal_frames_go_to_the_least_loaded_ranks():
    # costs (D = 1): image 64 patches -> 4480, video frames 16 patches -> 352 each
    plan = plan_vision_split([[4, 4, 4], [1, 8, 8]], 2, hidden_size=1)
    assert plan == [[(1, 0, 1)], [(0, 0, 4)]]
    plan = plan_vision_split([[30, 4, 4], [1, 8, 8]], 2, hidden_size=1)  # 30·352 = 10560 > 4480
    costs = split_costs([[30, 4, 4], [1, 8, 8]], plan, 1)
    assert plan == [[(0, 0, 9), (1, 0, 1)], [(0, 9, 30)]] and costs == [7648, 7392]


def test_plan_is_deterministic_and_independent_of_the_grid_container():
    grids = [[3, 6, 8], [1, 14, 10], [5, 6, 8], [1, 6, 8]]
    plans = [plan_vision_split(grids, 3, 64), plan_vision_split(torch.tensor(grids), 3, 64),
             plan_vision_split(torch.tensor(grids, dtype=torch.int32), 3, 64)]  # fmt: skip
    assert plans[0] == plans[1] == plans[2]


def test_cp_one_encodes_everything_in_one_rank():
    grids = [[3, 6, 8], [1, 14, 10]]
    assert plan_vision_split(grids, 1) == [[(0, 0, 3), (1, 0, 1)]]


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="integer >= 1, got 0"):
        plan_vision_split([[1, 4, 4]], 0)
    with pytest.raises(ValueError, match=r"item 1 is \(0, 4, 4\)"):
        plan_vision_split([[1, 4, 4], [0, 4, 4]], 2)
    with pytest.raises(ValueError, match="hidden_size must be >= 1"):
        plan_vision_split([[1, 4, 4]], 2, hidden_size=0)


@settings(max_examples=60, deadline=None)
@given(grids=st.lists(st.tuples(st.integers(1, 12), st.sampled_from([2, 4, 6, 10]), st.sampled_from([2, 4, 8])),
                      min_size=1, max_size=6),
       cp=st.integers(1, 6))  # fmt: skip
def test_property_cover_and_lpt_bound(grids, cp):
    grids = [list(g) for g in grids]
    plan = plan_vision_split(grids, cp, hidden_size=32)
    _check_cover(grids, plan, cp)
    costs = split_costs(grids, plan, 32)
    biggest = max(unit_cost(h * w, 32) for _, h, w in grids)
    assert max(costs) - sum(costs) / cp <= biggest
