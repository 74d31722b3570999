"""The audio split plan (parallel/context/audio.py): every item encoded exactly once, by cost."""

import pytest

from omniweave.parallel.context.audio import item_cost, plan_audio_split


def test_every_item_is_encoded_once_and_the_longest_items_spread_first():
    lengths = [3000, 100, 2999, 1500, 7, 1500]
    plan = plan_audio_split(lengths, cp=3, hidden_size=64)
    assert sorted(i for own in plan for i in own) == list(range(len(lengths)))
    assert all(own == sorted(own) for own in plan)
    # LPT: the two 30 s windows each get a rank, everything shorter fits on the third
    assert plan == [[0], [2], [1, 3, 4, 5]]
    loads = [sum(item_cost(lengths[i], 64) for i in own) for own in plan]
    assert max(loads) == item_cost(3000, 64)  # the optimum: no rank waits longer than the longest item


def test_more_ranks_than_items_leaves_ranks_empty():
    assert plan_audio_split([10, 20], cp=4) == [[1], [0], [], []]


def test_cost_counts_frames_after_the_stride_2_conv():
    assert item_cost(3000, 0) == 1500**2 and item_cost(3001, 0) == 1501**2 and item_cost(1, 1) == 1 + 6


@pytest.mark.parametrize("bad", [[0], [5, -1]])
def test_an_item_without_frames_is_refused(bad):
    with pytest.raises(ValueError, match="needs >= 1 frame"):
        plan_audio_split(bad, cp=2)
