"""Parallel layouts end to end through the model as the trainer builds it (``parallel_model.build``:
vision split -> TP -> CP -> AC -> FSDP), gloo, CPU, fp32, against the single-process run of the
same packed rows (DESIGN.md §4):

every CP attention mode with and without the vision split at CP = 2 and 4; CP = 2 inside dp = 2;
per-component TP (foundation tp 2 with the encoder at tp 2, or at tp 1 so that its tp replicas
split the media); CP x TP; dp x TP — on real demo packs that mix text-only, image and video
documents of uneven lengths. The loss equals the single-process loss and every parameter's
gradient equals the single-process gradient within 1e-5 relative, and no FSDP2-wrapped module
returns a view (FSDP2's "returned a view tensor" warning: an in-place op on such an output would
skip its pre-backward all-gather; a smaller-tp encoder is FSDP-wrapped on its own, issue 15).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist

from omniweave.parallel.spawn import run_ranks

pytestmark = [pytest.mark.dist]

LOSS_RTOL = 1e-5  # |loss_cp - loss_1| / |loss_1|
GRAD_RTOL = 1e-5  # per parameter: max |g_cp - g_1| / max |g_1|


def _rows(packed: str, n: int) -> list[dict]:
    """The n packs with the most kinds of media, then the most items (text-only, image, video and
    audio documents mixed; the demo_omni packs have no row with all three)."""
    from omniweave.data.loading.loader import collate_pack
    from omniweave.data.packing.packed import PackedDataset

    ds = PackedDataset(packed)
    kinds = [{m["kind"] for m in ds.record(i)["media"]} for i in range(len(ds))]
    # audio first among equals: the demo packs audio with images only, and dp 1 layouts take row 0
    order = sorted(range(len(ds)), key=lambda i: (-len(kinds[i]), "audio" not in kinds[i], -len(ds.record(i)["media"]), i))[:n]
    return [collate_pack(ds[i], ds.manifest["data_cfg"]) for i in order]


def _model(recipe: str = "demo"):
    from omniweave.config import load_recipe, to_dict
    from omniweave.models.registry import build_model

    torch.manual_seed(0)
    model = build_model(to_dict(load_recipe(recipe, []).model))
    model.init_weights()
    return model


def _reference(model, rows: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss (sum over rows / loss tokens) and gradients of the plain single-process model."""
    n = sum(r["num_loss_tokens"] for r in rows)
    model.zero_grad()
    loss = sum(model(r).loss_sum for r in rows) / n
    loss.backward()
    return float(loss.detach()), {k: p.grad.clone() for k, p in model.named_parameters()}


# dp, cp, cp_attention, cp_ulysses, vision_split, tp, tp_encoder[, dp_replicate (HSDP; default 1)]
Layout = tuple


def _layouts(world: int) -> list[Layout]:
    if world == 2:
        cases = [(1, 2, m, 1, vs, 1, 1) for m in ("ring", "allgather", "ulysses") for vs in (True, False)]
        return cases + [(1, 1, "ring", 1, True, 2, 2), (1, 1, "ring", 1, True, 2, 1)]
    cases = [(1, 4, m, u, vs, 1, 1) for m, u in (("ring", 1), ("allgather", 1), ("ulysses", 1), ("hybrid", 2))
             for vs in (True, False)]
    return cases + [(2, 2, "ring", 1, True, 1, 1), (2, 2, "ulysses", 1, False, 1, 1),  # dp x cp
                    (1, 2, "ring", 1, True, 2, 2), (1, 2, "allgather", 1, True, 2, 1),  # cp x tp
                    (2, 1, "ring", 1, True, 2, 1)]  # dp x tp


def _cfg(layout: Layout, recipe: str = "demo"):
    from omniweave.config import load_recipe

    dp, cp, mode, uly, vs, tp, tp_enc, *hsdp = layout
    encoders = ["image_encoder", "audio_encoder"] if recipe == "demo_omni" else ["image_encoder"]
    return load_recipe(recipe, [f"parallel.dp_replicate={hsdp[0] if hsdp else 1}",
                                f"parallel.cp={cp}", f"parallel.cp_attention={mode}", f"parallel.cp_ulysses={uly}",
                                f"parallel.vision_split={str(vs).lower()}", f"model.foundation.tp={tp}",
                                *(f"model.{e}.tp={tp_enc}" for e in encoders)])


def _body(rank: int, world: int, packed: str, layouts: list[Layout] | None = None, recipe: str = "demo") -> list[dict]:
    from torch.distributed.fsdp import FSDPModule

    import omniweave
    from omniweave.parallel.context import shard_micro_batch
    from omniweave.parallel.dims import ParallelDims
    from omniweave.train.parallel_model import build

    base = _model(recipe)
    rows = _rows(packed, max((layout[0] for layout in layouts or ()), default=2))
    refs: dict[int, tuple] = {}  # dp -> reference over the global batch (dp group g takes row g)
    results = []
    for layout in layouts or _layouts(world):
        cfg = _cfg(layout, recipe)
        dims = ParallelDims.from_config(cfg.parallel, world, model=cfg.model)
        batch = rows[: dims.dp]
        if dims.dp not in refs:
            refs[dims.dp] = _reference(copy.deepcopy(base), batch)
        ref_loss, ref_grads = refs[dims.dp]
        meshes = dims.build_meshes("cpu")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # every occurrence, not once per call site
            model = build(cfg, torch.device("cpu"), dims, meshes)
            row, n = batch[meshes.dp_rank], sum(r["num_loss_tokens"] for r in batch)
            out = model(shard_micro_batch(row, dims.cp, meshes.cp_rank, dims.tp))
            (out.loss_sum / n).backward()  # FSDP sums gradients over the ranks
        loss = out.loss_sum.detach().double()
        dist.all_reduce(loss)  # a tp foundation's loss is replicated on its tp ranks
        loss = float(loss) / dims.tp / n
        worst = 0.0
        for name, p in model.named_parameters():
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            worst = max(worst, float((g - ref_grads[name]).abs().max() / ref_grads[name].abs().max().clamp_min(1e-12)))
        weight = model.foundation.layers[0].mlp.down_proj.weight  # FSDP's placement of a decoder weight
        results.append({"layout": layout, "loss_rel": abs(loss - ref_loss) / abs(ref_loss), "grad_rel": worst,
                        "placements": [str(x) for x in getattr(weight, "placements", ())],
                        "shard_ranks": dist.get_process_group_ranks(weight.device_mesh.get_group(-1))
                        if hasattr(weight, "device_mesh") else [],
                        "view_warnings": [str(w.message) for w in caught if "returned a view" in str(w.message)],
                        "encoder_fsdp": isinstance(model.image_encoder, FSDPModule),
                        "audio_items": int(row["audio_lengths"].numel()) if "audio_lengths" in row else 0,
                        "audio_grad": max((float(g.abs().max()) for k, g in ref_grads.items() if k.startswith("audio_encoder.")),
                                          default=0.0),
                        "imported_from": omniweave.__file__})
    return results


def _check(results: list[list[dict]]) -> None:
    for r in results[0]:
        print(r)
    for rank_results in results:
        for r in rank_results:
            assert r["loss_rel"] <= LOSS_RTOL, r
            assert r["grad_rel"] <= GRAD_RTOL, r
            assert not r["view_warnings"], r


@pytest.mark.parametrize("world", [2, 4], ids=["2ranks", "4ranks"])
def test_parallel_layouts_match_single_process(demo_packed, world):
    """Every layout of ``_layouts``: loss and all gradients equal to 1 rank on the same rows."""
    _check(run_ranks(_body, world, str(demo_packed), timeout=600))


def test_hsdp_layouts_match_single_process(demo_packed):
    """HSDP (parallel.dp_replicate = 2) on 4 ranks: 2 replicas x 2 shards; 2 replicas each sharded
    over its 2 CP ranks; 2 replicas of a foundation at tp 2 over an encoder at tp 1 (the encoder's
    own mesh is (replicate, tp_rep)). Decoder weights are Replicate x Shard(0) on a (2, 2) mesh
    whose shard groups are consecutive ranks (one node's), and loss and every gradient equal one
    process within 1e-5."""
    layouts = [(4, 1, "ring", 1, True, 1, 1, 2), (2, 2, "ring", 1, True, 1, 1, 2), (2, 1, "ring", 1, True, 2, 1, 2)]
    results = run_ranks(_body, 4, str(demo_packed), layouts, timeout=600)
    _check(results)
    for rank, rank_results in enumerate(results):
        hsdp_2x2, hsdp_cp, hsdp_tp = rank_results
        assert hsdp_2x2["placements"] == ["R", "S(0)"], hsdp_2x2
        assert hsdp_2x2["shard_ranks"] == ([0, 1] if rank < 2 else [2, 3])  # the shards of a replica on one node
        assert hsdp_cp["placements"] == ["R", "S(0)"] and hsdp_cp["shard_ranks"] == hsdp_2x2["shard_ranks"]
        assert hsdp_tp["placements"][0] == "R" and hsdp_tp["encoder_fsdp"]


def test_fsdp_wrapped_encoder_returns_no_view(demo_packed):
    """Foundation tp 2 over an encoder at tp 1 (the layout that FSDP-wraps the encoder itself):
    the Qwen2.5 ViT's output (windows put back in order) is not a view, so FSDP2 does not warn,
    and the gradients still equal the single process's."""
    results = run_ranks(_body, 2, str(demo_packed), [(1, 1, "ring", 1, True, 2, 1)], timeout=300)
    assert all(r["encoder_fsdp"] for rank_results in results for r in rank_results)  # the case that warned
    _check(results)


def test_mla_foundation_in_every_cp_mode(demo_packed):
    """The DeepSeek-V3 backbone (multi-head latent attention: the CP kernels get its v padded to the
    qk head dim and the softmax scale folded into q; MoE layers) in the ring, all-gather and
    Ulysses modes at CP = 2 on the demo packs (M-RoPE rows reach the rope dims as row 0)."""
    layouts = [(1, 2, m, 1, False, 1, 1) for m in ("ring", "allgather", "ulysses")]
    _check(run_ranks(_body, 2, str(demo_packed), layouts, "tiny_deepseek_v3_vl", timeout=300))


def test_audio_tower_layouts_match_single_process(omni_packed):
    """demo_omni (the demo model + a Qwen2-Audio tower, rows with images, videos and audio clips):
    dp 2, CP 2 with the audio split (each rank encodes its clips, features all-gathered) and
    without, foundation + encoders at tp 2 (the audio tower's TP plan), foundation tp 2 over
    encoders at tp 1 (the encoders' tp replicas split the media): loss and every gradient equal
    to one process within 1e-5."""
    layouts = [(2, 1, "ring", 1, True, 1, 1), (1, 2, "ring", 1, True, 1, 1), (1, 2, "allgather", 1, False, 1, 1),
               (1, 1, "ring", 1, True, 2, 2), (1, 1, "ring", 1, True, 2, 1)]
    results = run_ranks(_body, 2, str(omni_packed), layouts, "demo_omni", timeout=600)
    assert all(r["audio_items"] and r["audio_grad"] > 0 for rank_results in results for r in rank_results)
    _check(results)
