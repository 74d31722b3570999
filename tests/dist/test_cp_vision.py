"""The context-parallel vision split (omniweave.parallel.context.vision) on gloo ranks against the
single process (tiny Qwen2.5-VL ViT + PatchMerger + decoder from omniweave/configs/, fp32):

- VisionSplit on 2 and 4 ranks: features equal ``encode(pixel_values, grid_thw)``; the parameter
  gradients of sum(features · W) (each rank's loss takes a disjoint share of the features),
  all-reduced over ranks, equal the single-process gradients. Cases: images mixed with videos of
  t = 4 and 6 (videos cut across ranks) and a single image (ranks with no share encode the dummy
  input). Every rank calls the encoder exactly once (FSDP collectives stay matched).
- OmniModel with ``media_split = VisionSplit`` on each rank's ``shard_batch`` (3 ranks) gives the
  shard of the full row's embeddings and, all-reduced, its gradients (media row, text-only row).
- all_gather_rows: uneven row counts (a rank with none), gradients summed back to their owner.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from omniweave.config import CONFIGS_DIR
from omniweave.models.registry import build_model
from omniweave.parallel.context.sharding import plan_cp_shard, shard_batch, shard_rows
from omniweave.parallel.context.vision import VisionSplit, all_gather_rows, plan_vision_split
from omniweave.parallel.spawn import run_ranks
from tests.vl_factory import make_sample

pytestmark = [pytest.mark.dist]

FEATURE_ATOL = 1e-6  # max |Δ feature| (fp32; measured 0: the split is bit-exact on CPU)
GRAD_RTOL = 1e-5  # per parameter, ‖Δgrad‖ / ‖grad‖ (measured <= 3.8e-7)
CASES = {
    "images_and_videos": [[1, 8, 4], [4, 4, 8], [1, 2, 2], [6, 8, 8], [1, 6, 4]],
    "single_image": [[1, 6, 8]],
}


def _tiny_model():
    """Tiny OmniModel (qwen2_5_vit + patch_merger + qwen2_5 decoder) from the debug configs,
    identical init on every rank (seed 0)."""
    models = CONFIGS_DIR / "models"
    cfg = OmegaConf.create({"model": {
        "image_encoder": OmegaConf.load(models / "image_encoder/qwen2_5_vit_tiny.yaml"),
        "projector": OmegaConf.load(models / "projector/patch_merger_tiny.yaml"),
        "foundation": OmegaConf.load(models / "foundation/qwen2_5_tiny.yaml"),
    }})  # fmt: skip
    OmegaConf.resolve(cfg)
    torch.manual_seed(0)
    model = build_model(cfg.model)
    with torch.no_grad():  # non-trivial norms and biases
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _tiny_vision():
    model = _tiny_model()
    return model.image_encoder, model.projector


def _inputs(grids, out_dim, in_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    grid_thw = torch.tensor(grids)
    pixel_values = torch.randn(int(grid_thw.prod(-1).sum()), in_dim, generator=g)
    weights = torch.randn(int(grid_thw.prod(-1).sum()) // 4, out_dim, generator=g)
    return pixel_values, grid_thw, weights


def _split_run(rank, world, cases):
    encoder, projector = _tiny_vision()
    params = dict([*encoder.named_parameters("encoder"), *projector.named_parameters("projector")])
    calls = []

    def encode(pixel_values, grid_thw):
        calls.append(grid_thw.tolist())
        return projector(encoder(pixel_values, grid_thw), grid_thw)

    split = VisionSplit(dist.group.WORLD, encoder.dummy_input, encoder.cfg.hidden_size)
    results = {}
    for name, grids in cases.items():
        pixel_values, grid_thw, weights = _inputs(grids, projector.out_dim, encoder.cfg.in_dim)
        for p in params.values():
            p.grad = None
        calls.clear()
        features = split(encode, pixel_values, grid_thw)
        mine = slice(rank, None, world)  # this rank's loss: a disjoint share of the features
        (features[mine] * weights[mine]).sum().backward()
        grads = {}
        for key, p in params.items():
            grad = p.grad.clone()
            dist.all_reduce(grad)
            grads[key] = grad.numpy()
        results[name] = {"features": features.detach().numpy(), "grads": grads, "calls": list(calls)}
    return results  # numpy, not tensors: torch's queue shares tensor storage with the exiting rank


def _reference(grids):
    encoder, projector = _tiny_vision()
    pixel_values, grid_thw, weights = _inputs(grids, projector.out_dim, encoder.cfg.in_dim)
    features = projector(encoder(pixel_values, grid_thw), grid_thw)
    (features * weights).sum().backward()
    grads = {f"encoder.{n}": p.grad for n, p in encoder.named_parameters()}
    grads.update({f"projector.{n}": p.grad for n, p in projector.named_parameters()})
    return features.detach(), grads, encoder.cfg.hidden_size


@pytest.mark.parametrize("world", [2, 4])
def test_split_features_and_gradients_equal_the_single_process_encoder(world):
    results = run_ranks(_split_run, world, CASES)
    for name, grids in CASES.items():
        ref_features, ref_grads, hidden = _reference(grids)
        plan = plan_vision_split(grids, world, hidden)
        if name == "images_and_videos":  # both videos are cut across ranks
            for video in (1, 3):
                assert sum(any(i == video for i, _, _ in own) for own in plan) > 1, plan
        for rank, got in enumerate(results):
            res = got[name]
            assert len(res["calls"]) == 1, f"rank {rank} called the encoder {len(res['calls'])} times"
            if not plan[rank]:  # nothing to encode: the dummy input (one merge block)
                assert res["calls"] == [[[1, 2, 2]]]
            err = (torch.from_numpy(res["features"]) - ref_features).abs().max().item()
            assert err <= FEATURE_ATOL, f"{name}, rank {rank}: max |Δ feature| {err:.2e}"
            for key, ref in ref_grads.items():
                rel = ((torch.from_numpy(res["grads"][key]) - ref).norm() / ref.norm()).item()
                assert rel <= GRAD_RTOL, f"{name}, rank {rank}, {key}: relative gradient error {rel:.2e}"
        if name == "single_image":
            assert sum(1 for own in plan if own) == 1


def _packed_rows():
    """Two packed rows of two documents each (one with an image and a video, one text-only)."""
    rows = []
    for docs in ([[("image", (1, 4, 6))], [("video", (4, 4, 4)), ("image", (1, 2, 2))]], [[], []]):
        samples = [make_sample(media, seed=i, text=7) for i, media in enumerate(docs)]
        lens = [s["input_ids"].numel() for s in samples]
        starts = [0, lens[0]]
        rows.append({
            "input_ids": torch.cat([s["input_ids"] for s in samples]),
            "labels": torch.cat([s["labels"] for s in samples]),
            "position_ids": torch.cat([torch.arange(n) for n in lens]).expand(3, -1),
            "cu_seqlens": torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32),
            "pixel_values": torch.cat([s["pixel_values"] for s in samples]),
            "grid_thw": torch.cat([s["grid_thw"] for s in samples]),
            "media_spans": torch.cat([s["media_spans"] + torch.tensor([start, 0])
                                      for s, start in zip(samples, starts)]),
        })  # fmt: skip
    return rows


def _embeds_weights(row, width):
    return torch.randn(row["input_ids"].numel(), width, generator=torch.Generator().manual_seed(7))


def _omni_run(rank, world):
    model = _tiny_model()
    encoder = model.image_encoder
    model.media_splits["vision"] = VisionSplit(dist.group.WORLD, encoder.dummy_input, encoder.cfg.hidden_size)
    results = []
    for row in _packed_rows():
        model.zero_grad()
        plan = plan_cp_shard(row["cu_seqlens"], world)
        embeds = model.inputs_embeds(shard_batch(row, plan, rank))
        (embeds * shard_rows(_embeds_weights(row, embeds.shape[1]), plan, rank)).sum().backward()
        grads = {}
        for name, p in model.named_parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                grads[name] = p.grad.numpy()
        results.append((embeds.detach().numpy(), grads))
    return results


def test_omni_model_with_sharded_rows_and_vision_split_gives_the_full_row_embeddings():
    """OmniModel.inputs_embeds on each rank's shard_batch (feature_rows + VisionSplit) equals the
    shard of the single-process embeddings; gradients of sum(embeds · W) all-reduced equal the
    single-process gradients (a row with media, and a text-only row: the dummy encoder path)."""
    world = 3
    results = run_ranks(_omni_run, world)
    model = _tiny_model()
    for i, row in enumerate(_packed_rows()):
        model.zero_grad()
        embeds = model.inputs_embeds(row)
        (embeds * _embeds_weights(row, embeds.shape[1])).sum().backward()
        plan = plan_cp_shard(row["cu_seqlens"], world)
        for rank in range(world):
            got, grads = results[rank][i]
            real = plan.local_index(rank) >= 0
            err = (torch.from_numpy(got)[real] - shard_rows(embeds.detach(), plan, rank)[real]).abs().max().item()
            assert err <= FEATURE_ATOL, f"row {i}, rank {rank}: max |Δ embedding| {err:.2e}"
            for name, p in model.named_parameters():
                ref = p.grad
                if ref is None or ref.norm() == 0:
                    assert name not in grads or not grads[name].any(), f"{name}: gradient where there is none"
                    continue
                rel = ((torch.from_numpy(grads[name]) - ref).norm() / ref.norm()).item()
                assert rel <= GRAD_RTOL, f"row {i}, rank {rank}, {name}: relative gradient error {rel:.2e}"


def _gather_run(rank, world):
    x = torch.full((rank, 3), float(rank + 1), requires_grad=True)  # rank r has r rows
    gathered = all_gather_rows(x, dist.group.WORLD)
    weight = torch.arange(gathered.shape[0], dtype=torch.float32)[:, None] * (rank + 1)
    (gathered * weight).sum().backward()
    return gathered.detach().numpy(), x.grad.numpy()


def test_all_gather_rows_gathers_uneven_rows_and_sums_their_gradients():
    world = 3
    results = run_ranks(_gather_run, world)
    want = torch.cat([torch.full((r, 3), float(r + 1)) for r in range(world)])
    sum_of_rank_factors = sum(r + 1 for r in range(world))  # every rank weighted row i by i·(rank+1)
    for rank, (gathered, grad) in enumerate(results):
        assert torch.equal(torch.from_numpy(gathered), want)
        start = sum(range(rank))
        rows = torch.arange(start, start + rank, dtype=torch.float32)[:, None].expand(-1, 3)
        assert torch.equal(torch.from_numpy(grad), rows * sum_of_rank_factors)
