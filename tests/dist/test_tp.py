"""Tensor parallelism (omniweave/parallel/tp.py) against the single-process run (DESIGN.md §4).

Tiny OmniModels (decoder: 4 query heads, 2 / 1 / 4 KV heads, M-RoPE, qkv bias; Qwen2.5 / Qwen2
ViT; PatchMerger) on packed rows of three documents with images and a video, fp32, gloo CPU.
Each case compares the loss (relative) and every parameter's full gradient
(``||Δ|| / ||ref||``, DTensor ``full_tensor()``) with the same model unsharded on the same rows:

- 2 ranks: KV heads split + ViT TP; encoder unsharded (TP=1) + decoder TP=2 with KV heads
  replicated, QK-norm and tied embeddings, on a media row, a text-only row and a row without
  loss tokens;
- 4 ranks: KV replicated (2 KV heads) + Qwen2.5 ViT; KV split (4 KV heads) + Qwen2 ViT
  (fc1/fc2); FSDP2 over dp=2 of a (dp=2, tp=2) mesh, a different row per dp rank, against the
  single process summing both rows;
- impossible layouts raise ValueError (naming the numbers) before anything is sharded;
- checkpoints: the TP model's state_dict full tensors equal the unsharded model's; a DCP
  checkpoint written under TP (and under FSDP x TP) after an optimizer step loads at TP=1
  into exactly the weights the sharded model held.

Measured: loss rel. error <= 9e-8, gradient rel. error <= 1.4e-6 (worst: a k_proj bias).
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from omniweave.parallel.spawn import run_ranks
from omniweave.parallel.tp import kv_head_layout, sequence_parallel_row
from tests.dist.tp_cases import build, compare, full, loss_and_grads, model_cfg, packed_row

pytestmark = [pytest.mark.dist]

LOSS_RTOL = 1e-5  # relative, measured <= 9e-8
GRAD_RTOL = 1e-5  # ||Δgrad|| / ||grad|| per parameter, measured <= 1.4e-6


def _quiet() -> None:  # full_tensor() of 2-D grads warns about two sequential all-gathers
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def _tp_case(cfg: dict, rows: list[dict], foundation_mesh, encoder_mesh) -> tuple[dict, torch.nn.Module]:
    from omniweave.parallel.tp import apply_tp

    ref = loss_and_grads(build(cfg), rows)
    model = apply_tp(build(cfg), foundation_mesh, encoder_mesh)
    return compare(*loss_and_grads(model, rows), *ref), model


def _raises(cfg: dict, foundation_mesh, encoder_mesh) -> str:
    """The ValueError of an impossible layout, and that the model was left unsharded."""
    from torch.distributed.tensor import DTensor

    from omniweave.parallel.tp import apply_tp

    model = build(cfg)
    with pytest.raises(ValueError) as err:
        apply_tp(model, foundation_mesh, encoder_mesh)
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    return str(err.value)


def _step_and_save(model, path: str) -> dict:
    """One SGD step on the TP gradients, DCP save; the full weights it saved (numpy: tensors
    would travel back through shared memory that dies with the rank)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    torch.optim.SGD(model.parameters(), lr=0.1).step()
    state = get_model_state_dict(model)
    dcp.save({"model": state}, checkpoint_id=path)
    return {k: full(v).detach().numpy() for k, v in state.items()}


def _world2(rank, world, ckpt):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    _quiet()
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    cfg = model_cfg(num_kv_heads=2)
    out["kv_split+vit"], model = _tp_case(cfg, [packed_row(0)], mesh, mesh)
    unsharded = build(cfg).state_dict()
    sharded = {k: full(v) for k, v in get_model_state_dict(model).items()}
    out["state_keys_equal"] = sharded.keys() == unsharded.keys()
    out["state_max_diff"] = max(float((sharded[k] - unsharded[k]).abs().max()) for k in unsharded)
    out["saved"] = _step_and_save(model, ckpt)
    mixed = model_cfg(num_kv_heads=1, qk_norm=True, tie=True)
    no_loss = dict(packed_row(7), labels=torch.full_like(packed_row(7)["labels"], -100))
    rows = [packed_row(1), packed_row(2, media=False), no_loss]
    out["enc_tp1+kv_replicated"], _ = _tp_case(mixed, rows, mesh, None)
    out["errors"] = [_raises(model_cfg(num_heads=3, num_kv_heads=3), mesh, None),
                     _raises(model_cfg(num_heads=6, num_kv_heads=3), mesh, mesh)]  # fmt: skip
    return out


def _world4(rank, world, ckpt):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from omniweave.parallel.fsdp import apply_fsdp
    from omniweave.parallel.tp import apply_tp

    _quiet()
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    out["kv_replicated+vit"], _ = _tp_case(model_cfg(num_kv_heads=2), [packed_row(3)], mesh, mesh)
    out["kv_split+vit_fc"], _ = _tp_case(model_cfg(num_kv_heads=4, vit="qwen2"), [packed_row(4)], mesh, mesh)
    out["errors"] = [_raises(model_cfg(vit_heads=2), None, mesh)]

    cfg, rows = model_cfg(num_kv_heads=2), [packed_row(5), packed_row(6)]
    ref = loss_and_grads(build(cfg), rows)
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = apply_fsdp(apply_tp(build(cfg), mesh2d["tp"], mesh2d["tp"]), mesh2d["dp"])
    loss, grads = loss_and_grads(model, [rows[mesh2d.get_local_rank("dp")]])  # apply_fsdp sums over dp
    total = torch.tensor(loss, dtype=torch.float64)
    dist.all_reduce(total, group=mesh2d["dp"].get_group())
    out["fsdp_dp2_tp2"] = compare(float(total), grads, *ref)
    out["saved"] = _step_and_save(model, ckpt)
    return out


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("tp2") / "ckpt"
    return run_ranks(_world2, 2, str(ckpt)), ckpt, model_cfg(num_kv_heads=2)


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("tp4") / "ckpt"
    return run_ranks(_world4, 4, str(ckpt)), ckpt, model_cfg(num_kv_heads=2)


def _assert_matches(results: list[dict], case: str) -> None:
    for rank, res in enumerate(results):
        m = res[case]
        print(f"{case} rank {rank}: loss rel {m['loss_rel']:.1e}, grad rel {m['grad_rel']:.1e} ({m['worst']}), "
              f"{m['params']} params")  # fmt: skip
        assert m["loss_rel"] <= LOSS_RTOL, m
        assert m["grad_rel"] <= GRAD_RTOL, m
        assert m["params"] >= 58 and not m["zero_ref_grads"], m


# ----------------------------------------------------------------------------- 2 ranks


def test_tp2_kv_heads_split_and_vit_match_single_process(world2):
    _assert_matches(world2[0], "kv_split+vit")


def test_encoder_tp1_into_decoder_tp2_kv_replicated_qk_norm_tied(world2):
    """The hand-off of replicated encoder features into the sequence-parallel decoder: the
    encoder's gradients are complete (all-reduced over the decoder's tp ranks)."""
    _assert_matches(world2[0], "enc_tp1+kv_replicated")


def test_impossible_decoder_layouts_raise_with_the_numbers(world2):
    heads, kv = world2[0][0]["errors"]
    assert "num_heads=3 is not divisible by tp=2" in heads
    assert "num_kv_heads=3 and tp=2" in kv


def test_tp_state_dict_full_tensors_equal_the_unsharded_model(world2):
    for res in world2[0]:
        assert res["state_keys_equal"] and res["state_max_diff"] == 0.0


def _load_at_tp1(cfg: dict, ckpt) -> dict:
    import torch.distributed.checkpoint as dcp

    state = {"model": build(cfg, seed=99).state_dict()}  # other weights: the load must replace them all
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process")
        dcp.load(state, checkpoint_id=str(ckpt))
    return state["model"]


@pytest.mark.parametrize("world", ["world2", "world4"], ids=["tp2", "fsdp_dp2_tp2"])
def test_checkpoint_saved_under_tp_loads_at_tp1_identically(world, request):
    results, ckpt, cfg = request.getfixturevalue(world)
    saved, loaded = results[0]["saved"], _load_at_tp1(cfg, ckpt)
    assert saved.keys() == loaded.keys()
    for name, array in saved.items():
        assert torch.equal(loaded[name], torch.from_numpy(array)), name
        assert (results[-1]["saved"][name] == array).all(), name  # every rank saw the same full tensor
    assert "image_encoder.blocks.0.attn.qkv.weight" in loaded


# ----------------------------------------------------------------------------- 4 ranks


@pytest.mark.parametrize("case", ["kv_replicated+vit", "kv_split+vit_fc"])
def test_tp4_matches_single_process(world4, case):
    _assert_matches(world4[0], case)


def test_fsdp_dp2_tp2_matches_single_process_summing_both_rows(world4):
    _assert_matches(world4[0], "fsdp_dp2_tp2")


def test_impossible_vit_layout_raises_with_the_numbers(world4):
    assert "vision num_heads=2 is not divisible by tp=4" in world4[0][0]["errors"][0]


# ----------------------------------------------------------------------------- pure


def test_kv_head_layout_split_replicate_or_value_error():
    assert kv_head_layout(4, 2, 2) == "split" and kv_head_layout(8, 4, 4) == "split"
    assert kv_head_layout(4, 2, 4) == "replicate" and kv_head_layout(4, 1, 2) == "replicate"
    with pytest.raises(ValueError, match="num_heads=6 is not divisible by tp=4"):
        kv_head_layout(6, 2, 4)
    with pytest.raises(ValueError, match="num_kv_heads=6 and tp=4"):
        kv_head_layout(12, 6, 4)


def test_sequence_parallel_row_places_each_ranks_own_features():
    """Concatenating the ranks' feature_rows gives the full row's map (span order, -1 = text),
    so scattering the replicated features into each shard equals scattering into the row."""
    from omniweave.models.omni import OmniModel

    row, tp = packed_row(0), 4
    L = row["input_ids"].shape[0]
    features = torch.randn(int(row["media_spans"][:, 1].sum()), 8)
    embeds = torch.randn(L, 8)
    index = torch.cat([torch.arange(s, s + n) for s, n in row["media_spans"].tolist()])
    whole = embeds.index_put((index,), features)
    parts = []
    for r in range(tp):
        local = sequence_parallel_row(row, r, tp)
        assert local["input_ids"] is row["input_ids"] and local["position_ids"].shape == (3, L)
        parts.append(OmniModel._scatter_rows(embeds[r * L // tp : (r + 1) * L // tp], local["feature_rows"], features))
    assert torch.equal(torch.cat(parts), whole)


def test_sequence_parallel_row_rejects_a_row_not_divisible_by_tp():
    row = packed_row(0)
    row["input_ids"] = row["input_ids"][:-2]
    L = row["input_ids"].shape[0]
    assert L % 4
    with pytest.raises(ValueError, match=f"packed row of {L} tokens is not divisible by the foundation's tp=4"):
        sequence_parallel_row(row, 0, 4)
