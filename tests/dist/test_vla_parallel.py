"""A VLA model (models/vla.py) under tensor and context parallelism against the single-process run
(gloo, fp32).

Tiny Gemma backbone + action expert (widths 48 / 40, head_dim 12) on one packed row of three frames
whose documents hold a bidirectional prefix and a labelled causal tail (co-trained text), so the
backbone's prefix and tail attention calls, the chunks' attention over the kept prefix keys / values
and the text loss all run sharded. Loss = flow SSE + 0.5 · text CE sum. Each case compares the loss
(relative) and every parameter's full gradient (``||Δ|| / ||ref||``):

- tp 2, key/value heads split (2 KV heads: backbone 4 query heads, expert 2), and one key/value
  head replicated (backbone 4 query heads, expert 4); the expert's projections are sharded
  DTensors on the foundation's tp mesh;
- cp 2 under every CP attention mode (the prefix layout all-gathers the keys / values whatever the
  mode), the chunks shared over the ranks, on the three-frame row and on a one-frame row whose
  26-token prefix is longer than a rank's 16 rows (rank 1 runs a fully padded chunk).

Measured: tp loss rel. error <= 1.2e-7, gradients <= 2.8e-7; cp loss <= 5.8e-8, gradients <= 2.8e-7.
"""

from __future__ import annotations

import logging

import pytest
import torch

from omniweave.parallel.spawn import run_ranks

pytestmark = [pytest.mark.dist]

H, A = 3, 5  # horizon, expert action width
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-5


def vla_model(heads: int, kv_heads: int, expert_heads: int) -> torch.nn.Module:
    from omniweave.models.registry import build_model

    foundation = {"name": "decoder", "family": "gemma", "vocab_size": 256, "hidden_size": 48, "intermediate_size": 72,
                  "num_layers": 2, "num_heads": heads, "num_kv_heads": kv_heads, "head_dim": 12,
                  "tie_word_embeddings": True, "hidden_act": "gelu_pytorch_tanh", "norm_zero_centered": True,
                  "scale_embeddings": True, "attn_backend": "sdpa"}
    expert = {"name": "flow_expert", "hidden_size": 40, "intermediate_size": 56, "num_layers": 2,
              "num_heads": expert_heads, "num_kv_heads": kv_heads, "head_dim": 12, "action_dim": A, "horizon": H,
              "attn_backend": "sdpa"}
    torch.manual_seed(0)
    model = build_model({"foundation": foundation, "action_expert": expert})
    with torch.no_grad():  # open gates and non-trivial time conditioning instead of the zero init
        for name, p in model.action_expert.named_parameters():
            if ".dense." in name:
                p.normal_(0, 0.05)
    return model


def vla_row(seed: int = 1) -> dict:
    """Three frames: (prefix, tail) tokens (7, 3), (5, 4), (9, 2) -> 30 tokens; the tails labelled."""
    g = torch.Generator().manual_seed(seed)
    prefix, tail = torch.tensor([7, 5, 9]), torch.tensor([3, 4, 2])
    docs = prefix + tail
    L, n = int(docs.sum()), len(docs)
    labels = torch.full((L,), -100)
    start = 0
    for p, t in zip(prefix.tolist(), tail.tolist()):
        labels[start + p:start + p + t] = torch.randint(0, 256, (t,), generator=g)
        start += p + t
    return {
        "input_ids": torch.randint(1, 256, (L,), generator=g),
        "labels": labels,
        "position_ids": torch.cat([torch.arange(int(d)) for d in docs])[None],
        "cu_seqlens": torch.tensor([0, *docs.cumsum(0).tolist()], dtype=torch.int32),
        "prefix_lens": prefix,
        "action_docs": torch.tensor([0, 1, 2]),
        "actions": torch.randn(n, H, A, generator=g),
        "action_is_pad": torch.tensor([[False] * H, [False, False, True], [False] * H]),
        "action_dims": torch.tensor([3, 5, 4]),
        "action_noise": torch.randn(n, H, A, generator=g),
        "action_time": torch.rand(n, generator=g) * 0.999 + 0.001,
    }


def _head(model, prefix, batch):
    return model.flow_loss(prefix, batch).sum + 0.5 * model.loss_sum(prefix.hidden, batch["labels"])


def loss_and_grads(model, row: dict) -> tuple[float, dict]:
    model.zero_grad()
    loss = model(row, head=_head)
    loss.backward()
    full = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for n, p in model.named_parameters()}
    return float(loss.detach()), full


def compare(got, ref) -> dict:
    (loss, grads), (ref_loss, ref_grads) = got, ref
    assert grads.keys() == ref_grads.keys()
    rel = {n: float((grads[n] - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-30)) for n in grads}
    worst = max(rel, key=rel.get)
    return {"loss_rel": abs(loss - ref_loss) / abs(ref_loss), "grad_rel": rel[worst], "worst": worst,
            "zero_ref_grads": [n for n, g in ref_grads.items() if float(g.norm()) == 0.0]}


def _tp2(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from omniweave.parallel.tp import apply_tp

    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for case, shape in (("kv_split", (4, 2, 2)), ("kv_replicated", (4, 1, 4))):
        ref = loss_and_grads(vla_model(*shape), vla_row())
        model = apply_tp(vla_model(*shape), mesh)
        out[case] = compare(loss_and_grads(model, vla_row()), ref)
        q = model.action_expert.layers[0].self_attn.q_proj.weight
        out[case]["expert_q_sharded"] = isinstance(q, DTensor) and q.placements[0].is_shard(0)
    return out


def _cp_rank_loss(model, row: dict, cp: int, rank: int, group) -> tuple[float, dict]:
    """This CP rank's loss on its zigzag share of ``row`` (and its share of the chunks); the loss
    and gradients summed over the group, as FSDP over dp x cp sums them."""
    import torch.distributed as dist

    from omniweave.parallel.context import shard_micro_batch

    loss, grads = loss_and_grads(model, shard_micro_batch(row, cp, rank))
    total = torch.tensor(loss, dtype=torch.float64)
    dist.all_reduce(total, group=group)
    for g in grads.values():
        dist.all_reduce(g, group=group)
    return float(total), grads


def _cp2(rank, world):
    import torch.distributed as dist

    from omniweave.parallel.context.attention import CPContext

    one_frame = dict(vla_row(), cu_seqlens=torch.tensor([0, 30], dtype=torch.int32), prefix_lens=torch.tensor([26]),
                     position_ids=torch.arange(30)[None], action_docs=torch.tensor([0]))
    one_frame.update({k: one_frame[k][:1] for k in ("actions", "action_is_pad", "action_dims", "action_noise",
                                                    "action_time")})
    out = {}
    for mode in ("ring", "allgather", "ulysses"):
        for name, row in (("three_frames", vla_row()), ("one_frame", one_frame)):
            ref = loss_and_grads(vla_model(4, 2, 2), row)
            model = vla_model(4, 2, 2)
            for layer in model.foundation.layers:
                layer.self_attn.attn_fn = CPContext(group=dist.group.WORLD, mode=mode)
            out[f"{mode}/{name}"] = compare(_cp_rank_loss(model, row, world, rank, dist.group.WORLD), ref)
    return out


def test_context_parallel_vla_equals_one_process():
    """cp 2, ring / allgather / ulysses, on the three-frame row (chunks 2 + 1 over the ranks) and
    the one-frame row: loss and every gradient."""
    results = run_ranks(_cp2, 2)
    for case, r in results[0].items():
        assert r["loss_rel"] <= LOSS_RTOL, (case, r)
        assert r["grad_rel"] <= GRAD_RTOL, (case, r)
        assert not [n for n in r["zero_ref_grads"] if "action_expert" in n], (case, r)


def test_tensor_parallel_vla_equals_one_process():
    results = run_ranks(_tp2, 2)
    for case, r in results[0].items():
        assert r["expert_q_sharded"], case
        assert r["loss_rel"] <= LOSS_RTOL, (case, r)
        assert r["grad_rel"] <= GRAD_RTOL, (case, r)
        assert not [n for n in r["zero_ref_grads"] if "action_expert" in n], (case, r)
    assert results[0] == results[1]
