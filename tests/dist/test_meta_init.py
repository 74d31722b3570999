"""Meta-device initialisation (``parallel_model.build`` for models above ``meta_init_params``) is seeded by
``train.seed``: two builds give the same weights, and the shards of different ranks differ (on
CPU each rank draws from its own generator, so an unseeded or equally seeded init would repeat)."""

from __future__ import annotations

import pytest
import torch

from omniweave.parallel.spawn import run_ranks

pytestmark = [pytest.mark.dist]


def _local_weights(rank: int, world: int, seed: int) -> dict[str, torch.Tensor]:
    from omniweave.config import load_recipe
    from omniweave.parallel.dims import ParallelDims
    from omniweave.train.parallel_model import build

    cfg = load_recipe("demo", [f"train.seed={seed}"])
    dims = ParallelDims.from_config(cfg.parallel, world, model=cfg.model)
    torch.manual_seed(1000 + rank)  # whatever state the process had before must not matter
    model = build(cfg, torch.device("cpu"), dims, dims.build_meshes("cpu"), meta_init_params=0)
    return {k: (v.to_local() if hasattr(v, "to_local") else v).detach().clone() for k, v in model.state_dict().items()}


def _two_builds(rank: int, world: int) -> tuple[dict, dict, dict]:
    return _local_weights(rank, world, 7), _local_weights(rank, world, 7), _local_weights(rank, world, 8)


def test_meta_init_is_seeded_and_shards_differ_across_ranks():
    (a0, b0, c0), (a1, _, _) = run_ranks(_two_builds, 2)
    w = "foundation.layers.0.mlp.up_proj.weight"
    assert all(torch.equal(a0[k], b0[k]) for k in a0)  # same seed: same weights
    assert not torch.equal(a0[w], c0[w])  # another seed: other weights
    assert a0[w].shape == a1[w].shape and not torch.equal(a0[w], a1[w])  # rank 0's shard is not rank 1's
    assert 0.015 < float(a0[w].std()) < 0.025  # initialised (std 0.02), not to_empty memory
