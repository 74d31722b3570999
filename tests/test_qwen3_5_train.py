"""The trainer on the tiny Qwen3.5 recipe (hybrid layers, Qwen3-VL's tower without DeepStack) end
to end: the demo's data packed with the recipe (images, videos with timestamps), a few steps whose
loss falls; chunked rows (``parallel.seq_chunks=2``, the linear layers' states carried across the
chunk boundary) log the unchunked run's losses; the trainer's MFU and balancing read the hybrid
FLOP model."""

from __future__ import annotations

import math

import pytest

from tests.train_factory import losses, make_demo_packed, read_metrics, train_in_process

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    return make_demo_packed(tmp_path_factory.mktemp("qwen3_5"), samples=48, recipe="tiny_qwen3_5")


def test_tiny_qwen3_5_trains_and_chunked_rows_log_the_same_losses(packed, tmp_path):
    train_in_process(packed, tmp_path / "whole", name="tiny_qwen3_5", steps=4, global_batch=2, train__lr=3e-3)
    whole = losses(tmp_path / "whole")
    assert len(whole) == 4 and all(math.isfinite(x) for x in whole) and whole[-1] < whole[0]
    metrics = read_metrics(tmp_path / "whole")[-1]
    assert metrics["mfu"] > 0 and metrics["tokens_per_s"] > 0
    train_in_process(packed, tmp_path / "chunked", name="tiny_qwen3_5", steps=4, global_batch=2, train__lr=3e-3,
                     parallel__seq_chunks=2)
    assert losses(tmp_path / "chunked") == pytest.approx(whole, rel=1e-5)
