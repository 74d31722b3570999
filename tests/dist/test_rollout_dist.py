"""Rollouts under context parallelism (gloo, fp32): the prompt row zigzag-sharded over the CP
ranks, the vision split sharing the encoding, the prefill through the CP attention and each rank
keeping only its share of the prompt keys — the same tokens and log-probs as one process.
Also: the rollout copy gets the policy's weights from FSDP shards (``sync_weights``)."""

from __future__ import annotations

import copy

import pytest
import torch

from omniweave.parallel.spawn import run_ranks

pytestmark = [pytest.mark.dist]

LOGP_ATOL = 1e-5  # |Δ log-prob| vs one process (fp32)


def _body(rank: int, world: int, root: str, modes: list[str]) -> list[dict]:
    from pathlib import Path

    from omniweave.config import load_recipe
    from omniweave.parallel.dims import ParallelDims
    from omniweave.generation import SamplingParams, TorchRollout, build_rollout_model
    from tests.rl_factory import demo_model, demo_prompts, raise_stop_logits, stop_ids

    base, processor = demo_model()
    prompts = demo_prompts(Path(root), processor)
    raise_stop_logits(base, processor)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, stop_ids=stop_ids(processor))
    reference = {(r.uid, r.sample): r for r in TorchRollout(copy.deepcopy(base)).generate(prompts, 3, params, 9)}
    results = []
    for mode in modes:
        uly = 2 if mode == "hybrid" else 1
        cfg = load_recipe("demo", [f"parallel.cp={world}", f"parallel.cp_attention={mode}", f"parallel.cp_ulysses={uly}"])
        dims = ParallelDims.from_config(cfg.parallel, world, model=cfg.model)
        meshes = dims.build_meshes("cpu")
        model = build_rollout_model(cfg, dims, meshes, torch.device("cpu"))
        model.load_state_dict(base.state_dict())
        raise_stop_logits(model, processor)
        engine = TorchRollout(model, cp_group=meshes.cp.get_group(), cp=dims.cp, cp_rank=meshes.cp_rank)
        got = engine.generate(prompts, 3, params, 9)
        same = all(r.tokens == reference[(r.uid, r.sample)].tokens for r in got)
        worst = max(abs(a - b) for r in got for a, b in zip(r.logprobs, reference[(r.uid, r.sample)].logprobs))
        stopped = len({len(r.tokens) for r in got}) > 2
        results.append({"mode": mode, "same_tokens": same, "logp_diff": worst, "n": len(got), "stopped": stopped})
    return results


@pytest.mark.parametrize("world, modes", [(2, ["ring", "allgather", "ulysses"]), (4, ["ring", "hybrid"])],
                         ids=["cp2", "cp4"])
def test_cp_rollouts_equal_one_process(tmp_path, world, modes):
    from tests.rl_factory import demo_model, demo_prompts

    demo_prompts(tmp_path, demo_model()[1])  # the demo data, written once before the ranks read it
    results = run_ranks(_body, world, str(tmp_path), modes, timeout=600)
    for rank_results in results:
        for r in rank_results:
            assert r["same_tokens"] and r["logp_diff"] <= LOGP_ATOL and r["n"] == 21 and r["stopped"], r


def _sync_body(rank: int, world: int, layout: list[str]) -> float:
    from omniweave.config import load_recipe, to_dict
    from omniweave.models.registry import build_model
    from omniweave.parallel.dims import ParallelDims
    from omniweave.generation import build_rollout_model, sync_weights
    from omniweave.train.parallel_model import build

    cfg = load_recipe("demo", layout)
    dims = ParallelDims.from_config(cfg.parallel, world, model=cfg.model)
    meshes = dims.build_meshes("cpu")
    policy = build(cfg, torch.device("cpu"), dims, meshes)  # FSDP (and TP) shards, seeded init
    torch.manual_seed(int(cfg.train.seed))
    plain = build_model(to_dict(cfg.model))
    plain.init_weights()
    rollout_model = build_rollout_model(cfg, dims, meshes, torch.device("cpu"))
    sync_weights(policy, rollout_model)
    ref = plain.state_dict()
    return max((t - ref[k]).abs().max().item() for k, t in rollout_model.state_dict().items())


@pytest.mark.parametrize("layout", [[], ["model.foundation.tp=2", "model.image_encoder.tp=2"]], ids=["fsdp", "tp"])
def test_sync_weights_gathers_the_policy_shards(layout):
    assert max(run_ranks(_sync_body, 2, layout, timeout=300)) == 0.0
