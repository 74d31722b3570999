"""Expert parallelism (``parallel.ep``, parallel/expert.py), gloo, CPU, fp32, against one process
on the same global batch:

- one MoE block, ep=2: routing forced so that rank 0 sends every row to its own experts (rank 1
  receives nothing from it) and rank 1 sends none to experts 0-1; the grouped-GEMM and loop
  backends; output rows and every gradient (experts gathered back to [E, ...]) within 1e-5;
- the ``qwen3_moe_tiny`` foundation as ``parallel_model.build`` parallelises it (EP -> FSDP2) at ep=2 on
  2 ranks and ep=2 x expert_dp 2 on 4 ranks, rows of uneven lengths (a 3-token row leaves most
  experts without its tokens), and at ep=2 with full activation checkpointing: loss and every
  parameter's gradient within 1e-5 relative;
- one optimizer step at ep=2 (AdamW over FSDP and EP DTensors, gradient clipping over both
  meshes) equals the one-rank step; its DCP checkpoint loads at ep=1 (2 FSDP ranks, model and
  optimizer), whose re-save loads back at ep=2, and into one plain process
  (``checkpoint.load_model``), all with identical weights and first moments;
- ``train.init_from`` a HF Qwen3-MoE directory (per-expert tensors) at ep=2: each rank's experts
  are its slice of the checkpoint (the full weights gathered equal a plain ``load_hf``);
- ``omniweave train demo`` with the ``qwen3_moe_tiny`` foundation (images, videos, MoE) at ep=2
  on 2 and 4 ranks: the 1-rank losses and grad norms per step and final weights (slow).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from omniweave.parallel.spawn import run_ranks

pytestmark = [pytest.mark.dist]

REPO = Path(__file__).resolve().parents[2]
RTOL = 1e-5  # per tensor: max |a - b| / max |b|


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------ one MoE block


def _block(backend: str):
    from omniweave.models.components.moe import MoE, MoEConfig

    torch.manual_seed(0)
    moe = MoE(MoEConfig(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                        norm_topk_prob=True, backend=backend))
    moe.reset_parameters(0.2)
    with torch.no_grad():  # x > 0 -> experts 0 and 1 (rank 0's); x < 0 -> never experts 0 and 1
        moe.gate.weight[:2] += 3.0
    return moe


def _block_inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.rand(7, 32, generator=g) + 0.1, -(torch.rand(5, 32, generator=g) + 0.1)]


def _block_body(rank: int, world: int, backend: str):
    from torch.distributed.device_mesh import init_device_mesh

    from omniweave.parallel.expert import apply_ep

    moe = _block(backend)
    apply_ep(moe, init_device_mesh("cpu", (world,)))
    x = _block_inputs()[rank]
    target = torch.linspace(-1, 1, x.numel()).view_as(x)
    out = moe(x)
    (out * target).sum().backward()
    grads = {n: _full(p.grad) for n, p in moe.named_parameters()}
    grads["gate.weight"] = grads["gate.weight"].clone()
    dist.all_reduce(grads["gate.weight"])  # replicated router: the ranks' contributions summed
    dist.barrier()
    return out.detach(), grads


@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
def test_moe_block_matches_one_rank_with_empty_sends(backend):
    moe = _block(backend)
    xs = _block_inputs()
    idx = [moe.gate(x)[2] for x in xs]
    assert bool((idx[0] < 2).all()) and bool((idx[1] >= 2).all())  # the forced routing holds
    outs = [moe(x) for x in xs]
    sum((o * torch.linspace(-1, 1, o.numel()).view_as(o)).sum() for o in outs).backward()
    ref = {n: p.grad for n, p in moe.named_parameters()}
    results = run_ranks(_block_body, 2, backend, quiet=True)
    for rank, (out, grads) in enumerate(results):
        assert _rel(out, outs[rank].detach()) < RTOL, rank
        for n, g in grads.items():
            assert g.shape == ref[n].shape, n
            assert _rel(g, ref[n]) < RTOL, (rank, n, _rel(g, ref[n]))


# ------------------------------------------------------------------ the foundation through parallel_model.build


# foundation YAML -> overrides: qwen3_moe_tiny as MoE, dense, MoE; deepseek_v3_tiny as shipped (dense,
# MoE, MoE: sigmoid router over 4 groups, a shared expert that stays a plain replicated MLP, MLA)
FOUNDATIONS = {"qwen3_moe_tiny": {"num_layers": 3, "mlp_only_layers": [1]}, "deepseek_v3_tiny": {}}


def _cfg(ep: int, ac: str = "none", name: str = "qwen3_moe_tiny"):
    import yaml
    from omegaconf import OmegaConf

    foundation = yaml.safe_load((REPO / f"omniweave/configs/models/foundation/{name}.yaml").read_text())
    foundation.update(FOUNDATIONS[name])
    return OmegaConf.create({"model": {"foundation": foundation}, "parallel": {"ep": ep},
                             "train": {"seed": 0, "precision": "fp32", "ac": ac, "lr": 1e-2,
                                       "weight_decay": 0.1, "eps": 1e-4}})


LENGTHS = (40, 3, 25, 17)  # one row per rank at world 4; ranks take LENGTHS[rank::world] at world 2


def _rows() -> list[dict]:
    g = torch.Generator().manual_seed(2)
    rows = []
    for n in LENGTHS:
        ids = torch.randint(0, 1024, (n + 1,), generator=g)
        labels = ids[1:].clone()
        labels[: n // 4] = -100  # a prompt without loss
        rows.append({"input_ids": ids[:-1], "labels": labels})
    return rows


def _n_loss_tokens(rows: list[dict]) -> int:
    return sum(int((r["labels"] != -100).sum()) for r in rows)


def _model_body(rank: int, world: int, ep: int, ac: str, name: str):
    from omniweave.parallel.dims import ParallelDims
    from omniweave.train.parallel_model import build

    cfg = _cfg(ep, ac, name)
    dims = ParallelDims.from_config(cfg.parallel, world, model=cfg.model)
    meshes = dims.build_meshes("cpu")
    model = build(cfg, torch.device("cpu"), dims, meshes)
    rows = _rows()
    n = _n_loss_tokens(rows)
    mine = rows[rank::world]
    loss = sum(model(r).loss_sum for r in mine) / n
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    named = [(n.replace("._checkpoint_wrapped_module", ""), p) for n, p in model.named_parameters()]  # ac=full
    grads = {n: _full(p.grad) for n, p in named}
    experts = {n: (type(p).__name__, tuple(p.to_local().shape) if hasattr(p, "to_local") else None)
               for n, p in named if ".mlp.experts." in n}
    dist.barrier()
    return float(total), grads, experts


def _ep2_vs_one_rank(world: int, ac: str, name: str) -> list[dict]:
    """Each rank's (type, local shape) of the expert weights, after checking loss and gradients."""
    from omniweave.config import to_dict
    from omniweave.models.registry import build_model

    cfg = _cfg(1, name=name)
    torch.manual_seed(0)
    model = build_model(to_dict(cfg.model))  # initialised as parallel_model.build does (same seed)
    if hasattr(model, "init_weights"):
        model.init_weights()
    rows = _rows()
    loss = sum(model(r).loss_sum for r in rows) / _n_loss_tokens(rows)
    loss.backward()
    loss = float(loss.detach())
    ref = {n: p.grad for n, p in model.named_parameters()}
    results = run_ranks(_model_body, world, 2, ac, name, quiet=True, timeout=300)
    for rank, (total, grads, experts) in enumerate(results):
        assert abs(total - loss) / abs(loss) < RTOL, (rank, total, loss)
        assert set(grads) == set(ref)
        for n, g in grads.items():
            assert _rel(g, ref[n]) < RTOL, (rank, n, _rel(g, ref[n]))
    return [experts for _, _, experts in results]


@pytest.mark.parametrize("world,ac", [(2, "none"), (4, "none"), (2, "full")])
def test_moe_foundation_ep2_matches_one_rank(world, ac):
    """ac=full: the blocks' recomputation in the backward repeats the token exchange."""
    for experts in _ep2_vs_one_rank(world, ac, "qwen3_moe_tiny"):
        # each EP rank owns 4 of the 8 experts of the MoE layers (0 and 2); at world 4 FSDP shards
        # those over the 2 ranks owning the same ones: gate_up [4|2, 64, 64], down [4|2, 64, 32]
        local = 4 // (world // 2)
        assert experts == {f"foundation.layers.{i}.mlp.experts.{w}": ("DTensor", shape) for i in (0, 2)
                           for w, shape in (("gate_up_proj", (local, 64, 64)), ("down_proj", (local, 64, 32)))}


def test_deepseek_v3_foundation_ep2_matches_one_rank():
    """DeepSeek-V3 (sigmoid group-limited router, shared experts, MLA) at ep=2 on 2 ranks."""
    for experts in _ep2_vs_one_rank(2, "none", "deepseek_v3_tiny"):
        # 4 of the 8 routed experts of layers 1 and 2 per rank; the shared experts are not experts here
        assert experts == {f"foundation.layers.{i}.mlp.experts.{w}": ("DTensor", shape) for i in (1, 2)
                           for w, shape in (("gate_up_proj", (4, 80, 72)), ("down_proj", (4, 72, 40)))}


# ------------------------------------------------------------------ optimizer step and checkpoint


def _step_body(rank: int, world: int, ep: int, load_from: str | None, save_to: str | None):
    """One step then save (``load_from`` None), or load; then save to ``save_to`` if given."""
    from omniweave.parallel.dims import ParallelDims
    from omniweave.train import checkpoint
    from omniweave.train.parallel_model import build
    from omniweave.train.optim import build_optimizer, clip_grad_norm

    cfg = _cfg(ep)
    dims = ParallelDims.from_config(cfg.parallel, world, model=cfg.model)
    meshes = dims.build_meshes("cpu")
    model = build(cfg, torch.device("cpu"), dims, meshes)
    optimizer = build_optimizer(model, cfg)
    if load_from is None:
        rows = _rows()
        n = _n_loss_tokens(rows)
        (sum(model(r).loss_sum for r in rows[rank::world]) / n).backward()
        norm = clip_grad_norm([p for p in model.parameters()], 0.5)
        optimizer.step()
    else:
        norm = None
        checkpoint.load(checkpoint.resolve_checkpoint(load_from), model, optimizer)
    if save_to:
        checkpoint.save(save_to, 1, model, optimizer, {"step": 1}, "model: {}\n")
    weights = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    moments = {}
    for n, p in model.named_parameters():  # Adam's first moments
        moments[n] = _full(optimizer.state[p]["exp_avg"]).clone()
    dist.barrier()
    return norm, weights, moments


def test_step_and_checkpoint_ep2_match_one_rank_and_load_at_ep1(tmp_path):
    from omniweave.config import to_dict
    from omniweave.models.registry import build_model
    from omniweave.train import checkpoint
    from omniweave.train.optim import build_optimizer, clip_grad_norm

    cfg = _cfg(1)
    torch.manual_seed(0)
    model = build_model(to_dict(cfg.model))
    if hasattr(model, "init_weights"):
        model.init_weights()
    optimizer = build_optimizer(model, cfg)
    rows = _rows()
    (sum(model(r).loss_sum for r in rows) / _n_loss_tokens(rows)).backward()
    norm = clip_grad_norm(list(model.parameters()), 0.5)
    optimizer.step()
    ref = {n: p.detach() for n, p in model.named_parameters()}
    ref_m = {n: optimizer.state[p]["exp_avg"] for n, p in model.named_parameters()}

    root, root1 = str(tmp_path / "ep2"), str(tmp_path / "ep1")
    saved = run_ranks(_step_body, 2, 2, None, root, quiet=True, timeout=300)
    for rank, (n2, weights, moments) in enumerate(saved):
        assert abs(n2 - norm) / norm < RTOL, (rank, n2, norm)
        for n, m in moments.items():  # linear in the clipped gradient
            assert _rel(m, ref_m[n]) < RTOL, (rank, n, _rel(m, ref_m[n]))
        for n, w in weights.items():  # Adam: lr * m / (sqrt(v) + eps), eps 1e-4 so that g ~ 0 is no sign flip
            assert float((w - ref[n]).abs().max()) < 1e-3 * float(cfg.train.lr), (rank, n)
    loaded = run_ranks(_step_body, 2, 1, root, root1, quiet=True, timeout=300)  # ep 2 -> 1, saved again
    back = run_ranks(_step_body, 2, 2, root1, None, quiet=True, timeout=300)  # ep 1 -> 2
    for _, weights, moments in loaded + back:
        for n, w in weights.items():
            assert torch.equal(w, saved[0][1][n]), n
        for n, m in moments.items():
            assert torch.equal(m, saved[0][2][n]), n
    plain, _ = checkpoint.load_model(root, cfg.model)
    for n, p in plain.named_parameters():
        assert torch.equal(p.detach(), saved[0][1][n]), n


# ------------------------------------------------------------------ init_from a HF checkpoint


def _init_from_body(rank: int, world: int, hf_dir: str, model_cfg: dict):
    from omegaconf import OmegaConf

    from omniweave.parallel.dims import ParallelDims
    from omniweave.train.parallel_model import build

    cfg = OmegaConf.create({"model": model_cfg, "parallel": {"ep": 2},
                            "train": {"seed": 0, "precision": "fp32", "ac": "none", "init_from": hf_dir}})
    dims = ParallelDims.from_config(cfg.parallel, world, model=cfg.model)
    model = build(cfg, torch.device("cpu"), dims, dims.build_meshes("cpu"))
    weights = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    dist.barrier()
    return weights


def test_init_from_hf_at_ep2(tmp_path, monkeypatch):
    from omniweave.models.hf.loading import load_hf
    from tests import hf_factory

    monkeypatch.setitem(hf_factory.QWEN3_MOE, "num_experts", 8)  # the factory's 7 do not split over 2
    hf_factory.save_tiny("qwen3_moe", tmp_path / "src")
    plain, model_cfg = load_hf(tmp_path / "src")
    ref = dict(plain.named_parameters())
    assert ref["foundation.layers.0.mlp.experts.gate_up_proj"].shape[0] == 8
    for weights in run_ranks(_init_from_body, 2, str(tmp_path / "src"), model_cfg, quiet=True, timeout=300):
        assert set(weights) == set(ref)
        for n, w in weights.items():
            assert torch.equal(w, ref[n].detach()), n


# ------------------------------------------------------------------ the trainer end to end


@pytest.mark.slow
def test_train_demo_moe_ep2_like_single_process(demo_packed, tmp_path):
    from tests.train_factory import (
        final_state,
        max_abs_diff,
        read_metrics,
        train_subprocess,
    )

    kw = {"foundation@model__foundation": "qwen3_moe_tiny", "steps": 4, "global_batch": 4}
    runs = {}
    for nproc, extra in ((1, {}), (2, {"parallel__ep": 2}), (4, {"parallel__ep": 2})):
        runs[nproc] = tmp_path / f"n{nproc}"
        res = train_subprocess(demo_packed, runs[nproc], nproc=nproc, **kw, **extra)
        assert res.returncode == 0, res.stdout[-4000:]
    ref = read_metrics(runs[1])
    for nproc in (2, 4):
        rows = read_metrics(runs[nproc])
        assert len(rows) == len(ref) == 4
        assert max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(rows, ref)) < RTOL  # measured 3e-8
        assert max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(rows, ref)) < 1e-4  # 6e-6
        # the router metrics (sequence-level balancing in qwen3_moe_tiny: layout independent)
        assert max(abs(a["moe_aux_loss"] - b["moe_aux_loss"]) / b["moe_aux_loss"] for a, b in zip(rows, ref)) < RTOL
        assert all(a["moe_load_max_mean"] == pytest.approx(b["moe_load_max_mean"], rel=RTOL) for a, b in zip(rows, ref))
        assert all(a["moe_a2a_bytes"] > 0 for a in rows) and all("moe_a2a_bytes" not in b for b in ref)
        assert max_abs_diff(final_state(runs[nproc]), final_state(runs[1])) < 3e-5  # 2e-6; AdamW, see test_train_dist
