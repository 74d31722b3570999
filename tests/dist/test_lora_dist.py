"""LoRA under the trainer's parallel layouts (``parallel_model.build``: TP -> adapters -> CP -> AC -> FSDP2),
gloo, CPU, fp32, against the single-process run of the same demo packs (DESIGN.md §4).

Adapters on every Linear of the foundation and of the vision tower (the ViT's fused ``qkv`` under
``FusedHeadsParallel``, its row-wise ``proj`` / ``down_proj``; the decoder's column- and row-wise
layers), the projector trained in full: dp 2 (FSDP), foundation + encoder tp 2, cp 2. Every
rank's model takes the reference's weights (adapters with non-zero B, so A gets gradients too);
the loss and every trainable parameter's gradient equal 1 rank within 1e-5 relative, and the
frozen base weights get none. Built on the meta device (each rank materialising its shards), the
adapters start as PEFT's (B zero, A drawn): the loss is the base model's."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from omniweave.parallel.spawn import run_ranks
from tests.dist.test_layout_parity import _cfg, _rows

pytestmark = [pytest.mark.dist]

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5  # per parameter: max |g - g_1| / max |g_1|
LORA = {"foundation": {"r": 4, "alpha": 8, "targets": "all-linear"},
        "image_encoder": {"r": 2, "alpha": 4, "targets": "all-linear"}}
LAYOUTS = {"dp2": (2, 1, "ring", 1, True, 1, 1), "tp2": (1, 1, "ring", 1, True, 2, 2), "cp2": (1, 2, "ring", 1, True, 1, 1)}


def _lora_cfg(layout):
    cfg = _cfg(layout)
    for section, spec in LORA.items():
        cfg.model[section].lora = spec
    return cfg


def _reference(cfg, rows: list[dict]):
    """The plain adapted model (random non-zero B: ``init_weights`` draws every Linear), its loss
    over ``rows`` and its trainable parameters' gradients."""
    from omniweave.config import to_dict
    from omniweave.models.registry import build_model

    torch.manual_seed(0)
    model = build_model(to_dict(cfg.model))
    model.init_weights()
    n = sum(r["num_loss_tokens"] for r in rows)
    loss = sum(model(r).loss_sum for r in rows) / n
    loss.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.requires_grad}
    return model, float(loss.detach()), grads


def _body(rank: int, world: int, packed: str, names: list[str]) -> list[dict]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from omniweave.models.lora import is_adapter_name
    from omniweave.parallel.context import shard_micro_batch
    from omniweave.parallel.dims import ParallelDims
    from omniweave.train.parallel_model import build

    rows = _rows(packed, 2)
    results = []
    for name in names:
        cfg = _lora_cfg(LAYOUTS[name])
        dims = ParallelDims.from_config(cfg.parallel, world, model=cfg.model)
        meshes = dims.build_meshes("cpu")
        batch = rows[: dims.dp]
        ref, ref_loss, ref_grads = _reference(cfg, batch)
        model = build(cfg, torch.device("cpu"), dims, meshes)
        set_model_state_dict(model, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
        row, n = batch[meshes.dp_rank], sum(r["num_loss_tokens"] for r in batch)
        out = model(shard_micro_batch(row, dims.cp, meshes.cp_rank, dims.tp))
        (out.loss_sum / n).backward()
        loss = out.loss_sum.detach().double()
        dist.all_reduce(loss)
        loss = float(loss) / dims.tp / n
        worst, with_grad = 0.0, set()
        for pname, p in model.named_parameters():
            if p.grad is None:
                continue
            with_grad.add(pname)
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            worst = max(worst, float((g - ref_grads[pname]).abs().max() / ref_grads[pname].abs().max().clamp_min(1e-12)))
        adapters = {k for k in ref_grads if is_adapter_name(k)}
        results.append({"layout": name, "loss_rel": abs(loss - ref_loss) / abs(ref_loss), "grad_rel": worst,
                        "same_trainable": with_grad == set(ref_grads),
                        "adapters_only_in_adapted": all(is_adapter_name(k) for k in ref_grads
                                                        if k.startswith(("foundation.", "image_encoder."))),
                        "adapter_A_grads": min(float(ref_grads[k].abs().max()) for k in adapters if ".lora_A." in k),
                        "n_adapters": len(adapters)})
    results.append(_meta_init(world, rows[0]))
    return results


def _meta_init(world: int, row: dict) -> dict:
    """The meta-device path (``meta_init_params=0``: each rank materialises only its shards): every
    adapter's B is zero and its A drawn, so the loss equals the same model's with the adapters off."""
    from omniweave.models.lora import adapted_linears, adapters_disabled
    from omniweave.parallel.dims import ParallelDims
    from omniweave.train.parallel_model import build

    cfg = _lora_cfg(LAYOUTS["dp2"])
    dims = ParallelDims.from_config(cfg.parallel, world, model=cfg.model)
    model = build(cfg, torch.device("cpu"), dims, dims.build_meshes("cpu"), meta_init_params=0)
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t  # noqa: E731
    linears = [m for _, m in adapted_linears(model)]
    with torch.no_grad():
        loss = model(row).loss_sum
        with adapters_disabled(model):
            base = model(row).loss_sum
    return {"layout": "meta-init", "b_zero": all(float(full(m.lora_B.weight.detach()).abs().max()) == 0 for m in linears),
            "a_drawn": all(float(full(m.lora_A.weight.detach()).abs().min()) > 0 for m in linears),
            "loss_equals_base": bool(torch.equal(loss, base)), "n_adapters": len(linears)}


def test_lora_layouts_match_single_process(demo_packed):
    """dp 2, tp 2 (foundation and ViT), cp 2 with adapters on the foundation and the vision tower:
    loss and every adapter's (and the projector's) gradient equal 1 rank within 1e-5; nothing else
    has a gradient."""
    results = run_ranks(_body, 2, str(demo_packed), list(LAYOUTS), timeout=600)
    for r in results[0]:
        print(r)
    for rank_results in results:
        meta = rank_results.pop()
        assert meta["b_zero"] and meta["a_drawn"] and meta["loss_equals_base"] and meta["n_adapters"] == 2 * 7 + 3 * 5, meta
        for r in rank_results:
            assert r["loss_rel"] <= LOSS_RTOL, r
            assert r["grad_rel"] <= GRAD_RTOL, r
            assert r["same_trainable"] and r["adapters_only_in_adapted"], r
            assert r["adapter_A_grads"] > 0 and r["n_adapters"] > 0, r
