"""Chunked rows (``parallel.seq_chunks``) under FSDP2: ``omniweave train demo --nproc 2
parallel.seq_chunks=4`` (2 micro-batches per rank, each row in 4 chunks: 8 backward calls per
micro-batch, the gradient reduce-scatter on the very last one only) gives the losses, grad norms
and final weights of the single-process unchunked run."""

from __future__ import annotations

import pytest

from tests.train_factory import final_state, max_abs_diff, read_metrics, train_subprocess

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 3
LOSS_RTOL = 1e-5  # per-step loss and grad norm, relative (measured: loss 6e-8, grad norm 2.7e-6)
WEIGHT_ATOL = 1e-5  # every tensor of the final checkpoint, max |Δ| (measured 2.3e-6)


def test_dp2_with_seq_chunks_equals_single_process_unchunked(demo_packed, tmp_path):
    runs = {}
    for name, nproc, extra in (("plain", 1, {}), ("chunked", 2, {"parallel__seq_chunks": 4})):
        out = tmp_path / name
        res = train_subprocess(demo_packed, out, nproc=nproc, steps=STEPS, global_batch=4, **extra)
        assert res.returncode == 0, res.stdout[-4000:]
        runs[name] = out
    want, got = read_metrics(runs["plain"]), read_metrics(runs["chunked"])
    assert len(got) == len(want) == STEPS
    for a, b in zip(got, want):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= LOSS_RTOL * abs(b[key]), (key, a[key], b[key])
    assert max_abs_diff(final_state(runs["chunked"]), final_state(runs["plain"])) <= WEIGHT_ATOL
