"""Sequence and tensor parallelism of a Wan DiT, gloo, fp32, against the single process.

Sequence parallelism over the video tokens (parallel/context/sequence.py): a row of three clips
of different sizes (55 tokens: not a multiple of 2, 3 or 4, so the last piece is padded; pieces
start and end inside clips) through a 2-layer DiT with 6 heads, split over cp 2, 3 and 4 ranks
with ring attention and over 2 and 3 with Ulysses (6 heads divide by both): each rank's velocity
rows equal the single process's within 1e-5 (measured <= 1.2e-6, values of norm 48), and the
gradients of every parameter (summed over the ranks, as FSDP over dp x cp does) within 1e-5
relative to their norm (measured <= 1.1e-6). Ulysses over 4 ranks is refused in one line (6
heads do not split 4 ways).

Tensor parallelism (parallel/tp.py ``generator_plan``) at tp 2 and 3: q / k / v column-wise with
the all-heads RMSNorms sharded, to_out and fc2 row-wise; the velocity (replicated) and every
parameter's gradient (the sharded ones gathered) within the same 1e-5 (measured: velocity
2.4e-6, gradients 7.2e-7 relative). The same for an image-to-video DiT (tests/test_wan_i2v.py's
tiny I2V at 6 heads: 36-channel latents, each clip's image tokens), whose cross-attention's
add_k_proj / add_v_proj are column-wise and norm_added_k sharded too (measured: velocity 1.9e-6,
|v| up to 7.6; gradients 1.4e-6 relative, add_k / add_v / norm_added_k included).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from omniweave.parallel.spawn import run_ranks

pytestmark = pytest.mark.slow

GRID = [(2, 3, 4), (1, 5, 3), (1, 4, 4)]  # 24 + 15 + 16 = 55 tokens
TEXT = [7, 4, 9]


def _model(heads: int = 6, **over):
    from omniweave.models.components.wan_dit import WanDiT, WanDiTConfig

    torch.manual_seed(0)
    cfg = WanDiTConfig(**{**dict(in_channels=4, out_channels=4, patch_size=(1, 2, 2), num_attention_heads=heads,
                                 attention_head_dim=12, text_dim=10, freq_dim=16, ffn_dim=42, num_layers=2), **over,
                          "attn_backend": "math"})
    model = WanDiT(cfg)
    with torch.no_grad():  # proj_out starts at zero: give the output (and every gradient) something to carry
        model.proj_out.weight.normal_(std=0.2)
    return model


def _inputs():
    g = torch.Generator().manual_seed(1)
    total = sum(f * h * w for f, h, w in GRID)
    tokens = torch.randn(total, 16, generator=g)
    text = torch.randn(sum(TEXT), 10, generator=g)
    text_cu = torch.tensor([0, *torch.tensor(TEXT).cumsum(0).tolist()], dtype=torch.int32)
    target = torch.randn(total, 16, generator=g)
    return tokens, torch.tensor(GRID), torch.tensor([900.0, 20.0, 480.0]), text, text_cu, target


def _i2v_case():
    """An image-to-video DiT and its row, built from tests/test_wan_i2v.py's tiny I2V (36-channel
    latents, CLIP width 24, each clip its own image tokens) at 6 heads of 12 and ffn 42 (both split 2
    and 3 ways): (config overrides, (tokens, grid, timesteps, text, text_cu, target, image, image_cu))."""
    from omniweave.models.components.wan_dit import patchify_clips
    from tests.test_wan_i2v import IMAGE_LENS, TEXT_LENS, TINY, _clips, _cu

    cfg = {**TINY, "num_attention_heads": 6, "attention_head_dim": 12, "added_kv_proj_dim": 72, "ffn_dim": 42}
    latents, texts, images, timesteps = _clips(IMAGE_LENS)
    tokens, grid = patchify_clips(latents, cfg["patch_size"])
    texts = [t[:n] for t, n in zip(texts, TEXT_LENS)]  # our row needs no padding to 512
    target = torch.randn(tokens.shape[0], 16 * 4, generator=torch.Generator().manual_seed(2))
    return cfg, (tokens, grid, timesteps, torch.cat(texts), _cu(texts), target, torch.cat(images), _cu(images))


def _forward_backward(model, rows: slice, inputs=None):
    """``inputs``: an I2V case's row (``_i2v_case``); None = the T2V row of ``_inputs``."""
    tokens, grid, t, text, text_cu, target, *image = _inputs() if inputs is None else inputs
    v = model(tokens, grid, t, text, text_cu, *image)
    ((v - target[rows]) ** 2).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return v.detach(), grads


def _split_rank(rank, world, mode):
    from omniweave.parallel.context.sequence import apply_sequence_split

    model = _model()
    apply_sequence_split(model, dist.group.WORLD, mode, "math")
    total = sum(f * h * w for f, h, w in GRID)
    rows = model.local_slice(total)
    v, grads = _forward_backward(model, rows)
    for g in grads.values():
        dist.all_reduce(g)
    return rows, v, grads


@pytest.mark.parametrize("mode,world", [("ring", 2), ("ring", 3), ("ring", 4), ("ulysses", 2), ("ulysses", 3)])
def test_split_dit_equals_the_whole_row(mode, world):
    model = _model()
    total = sum(f * h * w for f, h, w in GRID)
    v_ref, g_ref = _forward_backward(model, slice(0, total))
    results = run_ranks(_split_rank, world, mode)
    assert sum(r[0].stop - r[0].start for r in results) == total
    for rows, v, _ in results:
        assert (v - v_ref[rows]).abs().max().item() <= 1e-5
    grads = results[0][2]
    for name, ref in g_ref.items():
        err = (grads[name] - ref).norm().item() / max(ref.norm().item(), 1e-12)
        assert err <= 1e-5, (name, err)


def test_ulysses_refuses_heads_that_do_not_split():
    with pytest.raises(Exception, match="must divide evenly"):
        run_ranks(_split_rank, 4, "ulysses")


def _tp_rank(rank, world, case=None):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from omniweave.parallel.tp import generator_plan

    over, inputs = case or ({}, None)
    model = _model(**over)
    parallelize_module(model, init_device_mesh("cpu", (world,)), generator_plan(model.config, world))
    v, grads = _forward_backward(model, slice(None), inputs)
    sharded = sum(isinstance(p, DTensor) for p in model.parameters())
    return v, {n: g.full_tensor() if isinstance(g, DTensor) else g for n, g in grads.items()}, sharded


@pytest.mark.parametrize("kind", ["t2v", "i2v"])
@pytest.mark.parametrize("world", [2, 3])
def test_tensor_parallel_dit_equals_one_process(world, kind):
    """T2V, and I2V (``_i2v_case``: attn2's add_k_proj / add_v_proj column-wise and norm_added_k
    sharded too, the image embedder replicated) at tp 2 and 3."""
    case = _i2v_case() if kind == "i2v" else None
    over, inputs = case or ({}, None)
    model = _model(**over)
    v_ref, g_ref = _forward_backward(model, slice(None), inputs)
    # per block: 2 attentions x (q, k, v, out: weight + bias; 2 norms) + ffn; I2V adds add_k/v (weight + bias), norm_added_k
    per_block = 2 * 10 + 2 * 2 + (5 if kind == "i2v" else 0)
    if kind == "i2v":  # the added image keys / values are among the gradients compared
        assert {f"blocks.{i}.attn2.{p}" for i in (0, 1) for p in ("add_k_proj.weight", "add_k_proj.bias",
                "add_v_proj.weight", "add_v_proj.bias", "norm_added_k.weight")} <= set(g_ref)
    v_err = g_err = 0.0
    for v, grads, sharded in run_ranks(_tp_rank, world, case):
        assert sharded == 2 * per_block
        v_err = max(v_err, (v - v_ref).abs().max().item())
        for name, ref in g_ref.items():
            assert ref.norm() > 0, name  # every gradient carries something to compare
            err = (grads[name] - ref).norm().item() / max(ref.norm().item(), 1e-12)
            assert err <= 1e-5, (name, err)
            g_err = max(g_err, err)
    print(f"{kind} tp {world}: velocity max abs {v_err:.2e} (|v| max {v_ref.abs().max().item():.1f}), "
          f"gradients max rel {g_err:.2e}")
    assert v_err <= 1e-5


def _cp_tp_rank(rank, world, mode):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    from omniweave.parallel.context.sequence import apply_sequence_split
    from omniweave.parallel.tp import generator_plan

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
    model = _model(heads=4)  # Ulysses splits each tp rank's 2 heads over the 2 cp ranks
    parallelize_module(model, mesh["tp"], generator_plan(model.config, 2))
    apply_sequence_split(model, mesh["cp"].get_group(), mode, "math")
    rows = model.local_slice(sum(f * h * w for f, h, w in GRID))
    v, grads = _forward_backward(model, rows)
    out = {}
    for name, g in grads.items():
        local = g.to_local() if isinstance(g, DTensor) else g
        dist.all_reduce(local, group=mesh["cp"].get_group())  # each cp rank's rows' share, as FSDP sums them
        out[name] = g.full_tensor() if isinstance(g, DTensor) else local
    return rows, v, out


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_sequence_and_tensor_parallel_together_equal_one_process(mode):
    """cp 2 x tp 2 (4 ranks, tp innermost): each rank's velocity rows and every gradient (summed over
    the cp ranks, the tp-sharded ones gathered) as the single process's, within 1e-5."""
    model = _model(heads=4)
    total = sum(f * h * w for f, h, w in GRID)
    v_ref, g_ref = _forward_backward(model, slice(0, total))
    for rows, v, grads in run_ranks(_cp_tp_rank, 4, mode):
        assert (v - v_ref[rows]).abs().max().item() <= 1e-5
        for name, ref in g_ref.items():
            err = (grads[name] - ref).norm().item() / max(ref.norm().item(), 1e-12)
            assert err <= 1e-5, (name, err)
