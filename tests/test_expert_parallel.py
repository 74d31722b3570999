"""``parallel.ep`` validation (ParallelDims.from_config) and the MoE ``Experts.dispatch`` seam, one process.
The multi-rank equality checks are in tests/dist/test_ep.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from omniweave.parallel.dims import ParallelDims

REPO = Path(__file__).resolve().parents[1]


def _model(**foundation):
    f = yaml.safe_load((REPO / "omniweave/configs/models/foundation/qwen3_moe_tiny.yaml").read_text())
    f.update(foundation)
    return OmegaConf.create({"foundation": f})


def _dims(world: int, model=None, **parallel) -> ParallelDims:
    return ParallelDims.from_config(OmegaConf.create(parallel), world, model=model if model is not None else _model())


def test_ep_is_resolved():
    assert _dims(4, ep=2).ep == 2 and _dims(4).ep == 1 and _dims(2, ep=2).dp == 2


def test_ep_must_divide_the_experts():
    with pytest.raises(ValueError, match=r"parallel.ep=3 must divide model.foundation.num_experts=8"):
        _dims(3, ep=3)


def test_ep_must_divide_dp_times_cp():
    with pytest.raises(ValueError, match=r"parallel.ep=4 must divide parallel.dp x parallel.cp = 2 x 1"):
        _dims(2, ep=4)
    with pytest.raises(ValueError, match=r"parallel.ep=4 must divide parallel.dp x parallel.cp = 1 x 2"):
        _dims(2, ep=4, cp=2)
    assert _dims(4, ep=4, cp=2).dp == 2  # an EP group spans data- and context-parallel ranks


def test_ep_needs_moe_layers():
    with pytest.raises(ValueError, match=r"parallel.ep=2: the foundation has no MoE layers \(model.foundation.num_experts=0"):
        _dims(2, model=_model(num_experts=0), ep=2)
    with pytest.raises(ValueError, match="no MoE layers"):  # every layer dense
        _dims(2, model=_model(mlp_only_layers=[0, 1]), ep=2)
    dense = OmegaConf.create({"foundation": yaml.safe_load((REPO / "omniweave/configs/models/foundation/qwen3_tiny.yaml").read_text())})
    with pytest.raises(ValueError, match="no MoE layers"):
        _dims(2, model=dense, ep=2)


def test_ep_with_tp_groups_the_data_and_context_parallel_ranks():
    assert _dims(4, model=_model(tp=2), ep=2).dp == 2
    with pytest.raises(ValueError, match=r"parallel.ep=4 must divide parallel.dp x parallel.cp = 2 x 1"):
        _dims(4, model=_model(tp=2), ep=4)  # the tp ranks do not count


def test_experts_dispatch_seam_replaces_the_expert_computation():
    from omniweave.models.components.moe import MoE, MoEConfig

    torch.manual_seed(0)
    moe = MoE(MoEConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2))
    moe.reset_parameters()
    x = torch.randn(5, 16)
    ref = moe(x)
    seen = []

    def fn(experts, xs, counts):
        seen.append((xs.shape, counts.tolist()))
        return experts.run(xs, counts, experts.gate_up_proj, experts.down_proj)

    moe.experts.dispatch = fn
    assert torch.equal(moe(x), ref)
    assert seen[0][0] == (10, 16) and sum(seen[0][1]) == 10
