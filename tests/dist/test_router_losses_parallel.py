"""The MoE router losses (components/router_loss.py) under data, context and expert parallelism,
gloo, CPU, fp32, against one process on the same global batch.

The ``qwen3_moe_tiny`` foundation (layers MoE, dense, MoE) as ``parallel_model.build`` parallelises it,
four rows of two documents (one row of 3 tokens: context-parallel pads inside it), with the
load-balancing loss and the z-loss on. A ``global`` loss sums its statistics over the data x
context-parallel ranks of a micro-step, so the one-process reference packs the rows of a
micro-step (one per dp rank) into one row; the ``sequence`` loss and the z-loss do not depend on
the grouping. Compared: the LM loss, the aux and z metrics, the expert load, and every gradient,
within 1e-5 relative; the bytes moved by expert parallelism are counted.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from omniweave.parallel.spawn import run_ranks

pytestmark = [pytest.mark.dist]

REPO = Path(__file__).resolve().parents[2]
RTOL = 1e-5
LENGTHS = ((30, 10), (2, 1), (12, 13), (9, 8))  # documents per row


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _cfg(ep: int, cp: int, level: str, tp: int = 1):
    import yaml
    from omegaconf import OmegaConf

    f = yaml.safe_load((REPO / "omniweave/configs/models/foundation/qwen3_moe_tiny.yaml").read_text())
    f.update(num_layers=3, mlp_only_layers=[1], router_aux_loss_coef=0.05, aux_loss_level=level,
             router_z_loss_coef=0.01, tp=tp)
    return OmegaConf.create({"model": {"foundation": f}, "parallel": {"ep": ep, "cp": cp},
                             "train": {"seed": 0, "precision": "fp32", "ac": "none"}})


def _row(docs) -> dict:
    g = torch.Generator().manual_seed(sum(docs))
    n = sum(docs)
    ids = torch.randint(0, 1024, (n + 1,), generator=g)
    return {"input_ids": ids[:-1], "labels": ids[1:].clone(),
            "cu_seqlens": torch.tensor([0, *torch.tensor(docs).cumsum(0).tolist()], dtype=torch.int32),
            "position_ids": torch.cat([torch.arange(d) for d in docs])}


def _concat(rows: list[dict]) -> dict:
    cu = [0]
    for r in rows:
        cu += [cu[-1] + int(x) for x in r["cu_seqlens"][1:]]
    return {"input_ids": torch.cat([r["input_ids"] for r in rows]), "labels": torch.cat([r["labels"] for r in rows]),
            "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
            "position_ids": torch.cat([r["position_ids"] for r in rows])}


def _counts(rows):
    return (sum(r["input_ids"].numel() for r in rows), sum(r["cu_seqlens"].numel() - 1 for r in rows),
            sum(int((r["labels"] != -100).sum()) for r in rows))


def _body(rank: int, world: int, ep: int, cp: int, level: str, tp: int):
    from omniweave.models.components.router_loss import finish_router_step, start_router_step
    from omniweave.parallel.context import shard_micro_batch
    from omniweave.parallel.dims import ParallelDims
    from omniweave.parallel.expert import sum_over
    from omniweave.train.parallel_model import build

    cfg = _cfg(ep, cp, level, tp)
    dims = ParallelDims.from_config(cfg.parallel, world, model=cfg.model)
    meshes = dims.build_meshes("cpu")
    model = build(cfg, torch.device("cpu"), dims, meshes)
    rows = [_row(d) for d in LENGTHS]
    tokens, docs, n_loss = _counts(rows)
    mine = rows[meshes.dp_rank :: dims.dp]
    start_router_step(model, len(mine), tokens, docs)
    total = torch.zeros(())
    for r in mine:
        loss = model(shard_micro_batch(r, cp, meshes.cp_rank, tp)).loss_sum / n_loss
        loss.backward()
        total += loss.detach()
    dist.all_reduce(total)
    total /= tp  # replicated on the tp ranks
    metrics = finish_router_step(model, sum_over(), replicas=tp)
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    dist.barrier()
    return float(total), metrics, grads


@pytest.mark.parametrize("world,ep,cp,tp,level", [
    (2, 1, 1, 1, "global"),    # dp=2: the micro-step's two rows balance together
    (2, 1, 2, 1, "sequence"),  # cp=2: a document's shards summed first; pads count nowhere
    (2, 2, 1, 1, "global"),    # ep=2 (dp=2)
    (4, 2, 2, 1, "sequence"),  # ep=2 over dp=2 x cp=2: expert parallelism across context-parallel ranks
    (4, 4, 2, 1, "global"),    # ep=4 = every rank, dp=2 x cp=2
    (2, 1, 1, 2, "sequence"),  # attention tp=2 (sequence parallel; a tp pad document): MoE layers replicated
    (4, 2, 1, 2, "global"),    # ep=2 over dp=2, attention tp=2
])  # fmt: skip
def test_router_losses_match_one_process(world, ep, cp, tp, level):
    from omniweave.config import to_dict
    from omniweave.models.components.router_loss import finish_router_step, start_router_step
    from omniweave.models.registry import build_model

    cfg = _cfg(1, 1, level)
    torch.manual_seed(0)
    model = build_model(to_dict(cfg.model))  # initialised as parallel_model.build does (same seed)
    rows = [_row(d) for d in LENGTHS]
    tokens, docs, n_loss = _counts(rows)
    dp = world // (cp * tp)
    steps = [_concat(rows[j * dp : (j + 1) * dp]) for j in range(len(rows) // dp)]  # one row per micro-step
    start_router_step(model, len(steps), tokens, docs)
    loss = 0.0
    for row in steps:
        part = model(row).loss_sum / n_loss
        part.backward()
        loss += float(part.detach())
    ref_metrics = finish_router_step(model)
    assert ref_metrics["moe_aux_loss"] > 1.5 and ref_metrics["moe_z_loss"] > 0  # k = 2: uniform scores 2
    ref = {n: p.grad for n, p in model.named_parameters()}
    for rank, (total, metrics, grads) in enumerate(run_ranks(_body, world, ep, cp, level, tp, quiet=True, timeout=300)):
        assert abs(total - loss) / loss < RTOL, (rank, total, loss)
        for k in ("moe_aux_loss", "moe_z_loss", "moe_load_max_mean"):
            assert abs(metrics[k] - ref_metrics[k]) / ref_metrics[k] < RTOL, (rank, k, metrics[k], ref_metrics[k])
        assert (metrics.get("moe_a2a_bytes", 0) > 0) == (ep > 1)
        assert set(grads) == set(ref)
        for n, g in grads.items():
            assert _rel(g, ref[n]) < RTOL, (rank, n, _rel(g, ref[n]))
