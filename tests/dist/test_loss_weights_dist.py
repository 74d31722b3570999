"""Fractional per-turn loss weights under the layouts that cut a row (issue 32, item 4): cp=2 (the
weights sharded like the labels), pp=2 (they ride with the row to the last stage) and dp=2 with
parallel.seq_chunks=2 give the single process's weighted losses and grad norms (fp32, gloo). That
the weights change the loss at all is tests/test_loss_weights.py's."""

from __future__ import annotations

import json

import pytest

from omniweave.parallel.spawn import run_ranks
from tests.train_factory import overrides, pack_jsonl, read_metrics

pytestmark = [pytest.mark.dist]

LOSS_RTOL = 1e-5
WEIGHTS = (0.5, 2.0, 1.0, 0.25)  # the demo rows' answers, in turn


def _train(ovr: list[str]) -> list[dict]:
    from omniweave.config import load_recipe
    from omniweave.train.trainer import train

    cfg = load_recipe("demo", ovr)
    result = train(cfg)
    return read_metrics(cfg.output_dir) if result["rank"] == 0 else []


def _body(rank: int, world: int, ovr: list[str]):
    return _train(ovr)


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    from omniweave.cli import main as cli

    root = tmp_path_factory.mktemp("weights")
    assert cli(["data", "demo", str(root / "demo"), "--samples", "64", "--eval-samples", "4"]) == 0
    rows = [json.loads(line) for line in (root / "demo" / "train.jsonl").read_text().splitlines()]
    for i, row in enumerate(rows):
        for m in row["messages"]:
            if m["role"] == "assistant":
                m["loss_weight"] = WEIGHTS[i % len(WEIGHTS)]
    weighted = root / "weighted.jsonl"
    weighted.write_text("".join(json.dumps(r) + "\n" for r in rows))
    packed = pack_jsonl(weighted, root / "demo" / "media", root / "w")
    return packed, _train(overrides(packed, root / "one", steps=2, global_batch=2))  # the single process


@pytest.mark.parametrize("layout", [["parallel.cp=2"], ["parallel.pp=2"], ["parallel.seq_chunks=2"]],
                         ids=["cp2", "pp2", "dp2-seq_chunks2"])
def test_weighted_losses_equal_the_single_process(packs, layout, tmp_path):
    weighted, want = packs
    got, *_ = run_ranks(_body, 2, overrides(weighted, tmp_path / "two", steps=2, global_batch=2) + layout, timeout=600)
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        for key in ("loss", "grad_norm"):
            assert abs(g[key] - w[key]) <= LOSS_RTOL * abs(w[key]), (key, g[key], w[key])
    print(f"{layout}: loss {got[-1]['loss']:.8g} vs {want[-1]['loss']:.8g}")
