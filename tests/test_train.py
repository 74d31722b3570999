"""The trainer in-process on 1 rank: a short run learns and writes its metrics, checkpoints and
plots, and evaluates at its eval interval; lr schedules, parameter groups and parallel dims as
pure functions; non-finite steps are skipped and too many stop the run; frozen components stay
put; bf16 trains; a recipe that does not match the packed data is refused; an exported checkpoint
gives transformers the same logits."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from omniweave.cli import main as cli
from omniweave.parallel.dims import ParallelDims
from omniweave.train.optim import param_groups
from omniweave.train.schedule import lr_factor
from tests.train_factory import final_state, losses, max_abs_diff, read_metrics, recipe, train_in_process

STEPS = 6


pytestmark = pytest.mark.usefixtures("one_intra_op_thread")


@pytest.fixture(scope="module")
def short_run(demo_packed, tmp_path_factory):
    """6 steps, global batch 4, a checkpoint every 2 steps keeping the last 2."""
    out = tmp_path_factory.mktemp("short") / "run"
    result = train_in_process(demo_packed, out, steps=STEPS, train__save_interval=2, train__keep_last=2)
    return out, result


# ---------------------------------------------------------------------------- end to end


def test_short_run_loss_decreases(short_run):
    run, result = short_run
    loss = losses(run)
    assert len(loss) == STEPS and all(math.isfinite(x) for x in loss)
    assert sum(loss[-3:]) / 3 < loss[0] - 0.5, loss  # ~6.99 -> ~5.7 on the demo data
    assert result["steps"] == STEPS and result["loss"] == loss[-1]


def test_metrics_jsonl_has_every_field_for_every_step(short_run):
    run, _ = short_run
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:
        for key in ("loss", "grad_norm", "lr", "tokens", "tokens_per_s", "mfu", "memory_gb", "eta_s"):
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]), (key, r)
        assert r["tokens"] == 4 * 512 or 0 < r["tokens"] <= 4 * 512  # 4 packs of at most 512 tokens
        assert r["tokens_per_s"] > 0 and r["grad_norm"] > 0 and 0 < r["mfu"] < 1 and r["memory_gb"] > 0
        assert r["skipped"] is False
    assert rows[-1]["eta_s"] == 0
    # warmup 1, then cosine from the peak 3e-3 down towards min_lr_ratio 0.1
    lrs = [r["lr"] for r in rows]
    assert lrs[0] == pytest.approx(3e-3) and all(a >= b for a, b in zip(lrs, lrs[1:])) and lrs[-1] > 3e-4


def test_checkpoints_latest_points_at_newest_and_keep_last_prunes(short_run):
    run, _ = short_run
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000004", "step_000006"]
    assert (ckpts / "latest").is_symlink() and (ckpts / "latest").resolve() == (ckpts / "step_000006").resolve()
    for name in ("step_000004", "step_000006"):
        d = ckpts / name
        assert (d / ".metadata").exists() and (d / "trainer_state.json").exists() and (d / "config.yaml").exists()
    assert not list(ckpts.glob(".tmp-*"))


def test_loss_plot_and_tensorboard_events_are_written(short_run):
    run, _ = short_run
    assert (run / "loss.png").stat().st_size > 1000
    events = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


# ---------------------------------------------------------------------------- schedule


def test_eval_hook_logs_greedy_accuracy_at_the_interval_and_the_end(demo_packed, tmp_path):
    """``train.eval_interval`` with ``eval.path``: Engine.evaluate -> eval_fn, prompts decoded in
    batches of ``eval.batch_size`` (here 3 for the 8 held-out rows: batches of 3, 3, 2)."""
    import json

    run = tmp_path / "run"
    train_in_process(demo_packed, run, steps=3, train__eval_interval=2,
                     eval__path=demo_packed.parent / "demo" / "eval.jsonl", eval__batch_size=3)
    records = [json.loads(line) for line in (run / "eval.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 3]
    assert all(r["eval_n"] == 8 and 0.0 <= r["eval_accuracy"] <= 1.0 for r in records)
    assert any(k.startswith("eval_accuracy/") for k in records[0])


def test_lr_warmup_is_linear_up_to_the_peak():
    assert [lr_factor(s, 100, warmup=4) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_lr_cosine_endpoints_and_floor():
    assert lr_factor(10, 110, warmup=10, schedule="cosine") == pytest.approx(1.0)
    assert lr_factor(60, 110, warmup=10, schedule="cosine") == pytest.approx(0.5)
    assert lr_factor(110, 110, warmup=10, schedule="cosine") == pytest.approx(0.0, abs=1e-12)
    assert lr_factor(110, 110, warmup=10, schedule="cosine", min_lr_ratio=0.1) == pytest.approx(0.1)
    assert lr_factor(500, 110, warmup=10, schedule="cosine", min_lr_ratio=0.1) == pytest.approx(0.1)  # past the end
    assert min(lr_factor(s, 50, 5, "cosine", 0.2) for s in range(60)) == pytest.approx(0.2)


def test_lr_linear_and_constant():
    assert [lr_factor(s, 4, schedule="linear") for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    assert lr_factor(2, 4, schedule="linear", min_lr_ratio=0.2) == pytest.approx(0.6)
    assert [lr_factor(s, 10, warmup=2, schedule="constant") for s in (0, 1, 2, 9, 20)] == [0.5, 1.0, 1.0, 1.0, 1.0]


def test_lr_unknown_schedule_is_a_clear_error():
    with pytest.raises(ValueError, match=r"train\.schedule='cosin'.*cosine"):
        lr_factor(0, 10, schedule="cosin")


# ---------------------------------------------------------------------------- optimizer groups


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.layer_norm = nn.LayerNorm(4)
        self.scale = nn.Parameter(torch.ones(4))  # 1-D, no "norm" in the name
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)


def test_param_groups_no_decay_for_norms_biases_and_1d_and_skip_frozen():
    m = _Tiny()
    groups = param_groups(m, 0.1)
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    decay = next(g for g in groups if g["weight_decay"] == 0.1)
    no_decay = next(g for g in groups if g["weight_decay"] == 0.0)
    assert ids(decay["params"]) == {id(m.proj.weight)}
    assert ids(no_decay["params"]) == ids([m.proj.bias, m.layer_norm.weight, m.layer_norm.bias, m.scale])
    assert not ids(m.frozen.parameters()) & ids(decay["params"] + no_decay["params"])


def test_param_groups_all_frozen_is_an_error():
    m = _Tiny().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        param_groups(m, 0.1)


# ---------------------------------------------------------------------------- parallel dims


def test_parallel_dims_dp_minus_one_takes_the_world():
    assert ParallelDims.from_config({"dp": -1, "cp": 1, "tp": 1}, 8) == ParallelDims(dp=8, cp=1, tp=1, world_size=8)
    assert ParallelDims.from_config(None, 2).dp == 2
    assert ParallelDims.from_config({"dp": 4}, 4).dp == 4


def test_parallel_dims_mismatch_names_the_sizes():
    with pytest.raises(ValueError, match=r"dp=2 x cp=1 x tp=1 = 2 != world size 4"):
        ParallelDims.from_config({"dp": 2}, 4)


def test_parallel_dims_cp_takes_ranks_from_dp():
    dims = ParallelDims.from_config({"dp": -1, "cp": 2, "cp_attention": "ulysses"}, 8)
    assert (dims.dp, dims.cp, dims.shard_ranks, dims.cp_attention) == (4, 2, 8, "ulysses")
    assert ParallelDims.from_config({"cp": 4, "cp_attention": "hybrid", "cp_ulysses": 2}, 4).cp_ulysses == 2


@pytest.mark.parametrize("parallel,match", [
    ({"cp": 2, "cp_attention": "star"}, r"cp_attention='star'; choose one of ring, allgather, ulysses, hybrid"),
    ({"cp": 4, "cp_attention": "hybrid"}, r"hybrid needs parallel.cp_ulysses .* cp=4 .*; got 1"),
    ({"cp": 4, "cp_attention": "hybrid", "cp_ulysses": 3}, r"got 3"),
    ({"cp": 3}, r"world size 4 is not divisible by cp\*tp = 3"),
])
def test_parallel_dims_bad_cp_layouts_name_the_problem(parallel, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims.from_config(parallel, 4)


def test_parallel_dims_hsdp_splits_dp_into_replicas_and_shards():
    """parallel.dp_replicate x parallel.dp_shard (torchtitan's names): dp is their product, given
    by either factor or by both; the rest of the layout is unchanged."""
    dims = ParallelDims.from_config({"dp_replicate": 2}, 8)
    assert (dims.dp, dims.dp_replicate, dims.dp_shard) == (8, 2, 4)
    dims = ParallelDims.from_config({"dp_replicate": 2, "dp_shard": 2, "cp": 2}, 8)
    assert (dims.dp, dims.dp_shard, dims.cp, dims.shard_ranks) == (4, 2, 2, 8)
    assert ParallelDims.from_config({"dp": 4, "dp_replicate": 4, "dp_shard": 1}, 4).dp_shard == 1
    assert ParallelDims.from_config({}, 4).dp_replicate == 1


@pytest.mark.parametrize("parallel,match", [
    ({"dp_replicate": 3}, r"parallel.dp_replicate=3 must be >= 1 and divide the data-parallel size dp=4"),
    ({"dp_replicate": 2, "dp_shard": 4}, r"dp=8\(dp_replicate=2 x dp_shard=4\) x cp=1 x tp=1 = 8 != world size 4"),
    ({"dp": 4, "dp_replicate": 2, "dp_shard": 1}, r"dp_replicate=2 x parallel.dp_shard=1 = 2 != the data-parallel size dp=4"),
])
def test_parallel_dims_bad_hsdp_names_the_keys(parallel, match):
    with pytest.raises(ValueError, match=match):
        ParallelDims.from_config(parallel, 4)


def test_parallel_dims_global_tp_points_to_per_component_tp():
    with pytest.raises(NotImplementedError, match=r"parallel.tp=2: set tensor parallelism per component"):
        ParallelDims.from_config({"tp": 2}, 4)


# ---------------------------------------------------------------------------- non-finite steps


def _nan_at(bad_steps):
    def hook(step, loss_sum):
        return loss_sum * float("nan") if step in bad_steps else loss_sum
    return hook


def test_nan_step_is_skipped_weights_unchanged_and_training_continues(demo_packed, tmp_path):
    run = tmp_path / "run"
    train_in_process(demo_packed, run, fault_hook=_nan_at({2}), steps=4, train__save_interval=1, train__keep_last=0)
    rows = read_metrics(run)
    assert [r["skipped"] for r in rows] == [False, False, True, False]
    assert [r["skipped_total"] for r in rows] == [0, 0, 1, 1]
    assert math.isnan(rows[2]["loss"]) and math.isfinite(rows[3]["loss"])
    ck = run / "checkpoints"
    before, at, after = (final_state(ck / f"step_00000{s}") for s in (2, 3, 4))
    assert max_abs_diff(before, at) == 0.0  # the skipped step changed nothing
    assert max_abs_diff(at, after) > 0.0  # the next step trained again
    assert all(torch.isfinite(t).all() for t in after.values())


def test_too_many_nan_steps_in_a_row_stop_the_run(demo_packed, tmp_path):
    with pytest.raises(RuntimeError, match=r"step 3: 2 steps in a row had a non-finite loss"):
        train_in_process(demo_packed, tmp_path / "run", fault_hook=_nan_at({1, 2, 3, 4}), steps=6,
                         train__max_bad_steps=2)
    assert [r["skipped"] for r in read_metrics(tmp_path / "run")] == [False, True, True]


# ---------------------------------------------------------------------------- freeze, bf16, fingerprint


def test_frozen_image_encoder_keeps_its_initial_weights(demo_packed, tmp_path):
    from omniweave.config import to_dict
    from omniweave.models.registry import build_model

    cfg = recipe(demo_packed, tmp_path / "run", steps=3, model__image_encoder__freeze=True)
    torch.manual_seed(int(cfg.train.seed))  # the trainer's initialisation of the same recipe
    init = build_model(to_dict(cfg.model))
    init.init_weights()
    init = {k: v.detach().clone() for k, v in init.state_dict().items()}
    from omniweave.train.trainer import train

    train(cfg)
    final = final_state(tmp_path / "run")
    enc = [k for k in final if k.startswith("image_encoder.")]
    assert len(enc) > 10
    assert max(float((final[k] - init[k]).abs().max()) for k in enc) == 0.0
    assert max(float((final[k] - init[k]).abs().max()) for k in final if k.startswith("foundation.")) > 1e-4


def test_bf16_precision_trains_with_finite_loss_close_to_fp32(demo_packed, short_run, tmp_path):
    train_in_process(demo_packed, tmp_path / "run", steps=2, train__precision="bf16")
    rows = read_metrics(tmp_path / "run")
    fp32_first = read_metrics(short_run[0])[0]["loss"]
    assert all(math.isfinite(r["loss"]) and not r["skipped"] for r in rows)
    assert abs(rows[0]["loss"] - fp32_first) <= 0.02 * fp32_first  # same batch, bf16 matmuls
    assert rows[0]["loss"] != fp32_first  # autocast did something


def test_recipe_that_does_not_match_the_packed_data_names_the_field(demo_packed, tmp_path):
    from omniweave.train.trainer import train

    cfg = recipe(demo_packed, tmp_path / "run", steps=1, data__max_len=2048)
    with pytest.raises(ValueError, match=r"data\.max_len: packed with 512, now 2048"):
        train(cfg)


# ---------------------------------------------------------------------------- HF export


def _doc(batch: dict, kinds: list[str], j: int) -> tuple[dict, list[str]]:
    """Document ``j`` of a packed micro-batch, alone, with its media only."""
    a, b = int(batch["cu_seqlens"][j]), int(batch["cu_seqlens"][j + 1])
    keep = [m for m in range(len(kinds)) if a <= int(batch["media_spans"][m, 0]) < b]
    sizes = batch["grid_thw"].prod(-1).tolist()
    chunks = torch.split(batch["pixel_values"], sizes) if sizes else []
    spans = batch["media_spans"][keep].clone()
    spans[:, 0] -= a
    out = {"input_ids": batch["input_ids"][a:b], "labels": batch["labels"][a:b],
           "position_ids": batch["position_ids"][:, a:b], "cu_seqlens": torch.tensor([0, b - a], dtype=torch.int32),
           "grid_thw": batch["grid_thw"][keep], "media_spans": spans,
           "pixel_values": torch.cat([chunks[m] for m in keep]) if keep else batch["pixel_values"][:0]}
    return out, [kinds[m] for m in keep]


def _hf_kwargs(sample: dict, kinds: list[str], config) -> dict:
    ids = sample["input_ids"]
    out = {"input_ids": ids[None]}
    sizes = sample["grid_thw"].prod(-1).tolist()
    chunks = torch.split(sample["pixel_values"], sizes) if sizes else []
    for kind, pv, grid in (("image", "pixel_values", "image_grid_thw"), ("video", "pixel_values_videos", "video_grid_thw")):
        sel = [j for j, k in enumerate(kinds) if k == kind]
        if sel:
            out[pv] = torch.cat([chunks[j] for j in sel])
            out[grid] = sample["grid_thw"][sel]
    if kinds:
        tt = torch.zeros_like(ids)
        tt[ids == config.image_token_id], tt[ids == config.video_token_id] = 1, 2
        out["mm_token_type_ids"] = tt[None]
    return out


def test_exported_checkpoint_gives_transformers_the_trained_logits(short_run, demo_packed, tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    from omniweave.data.loading.loader import collate_pack
    from omniweave.data.packing.packed import PackedDataset
    from omniweave.data.text.tokenizer import load_tokenizer
    from omniweave.train.checkpoint import load_model

    run, _ = short_run
    hf_dir = tmp_path / "hf"
    assert cli(["hf", "export", str(run), "--output", str(hf_dir)]) == 0
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, attn_implementation="eager").eval()
    ours, _ = load_model(run / "checkpoints" / "latest")
    ours.eval()
    ds = PackedDataset(demo_packed)
    rows, seen = [], set()
    for i in range(len(ds)):  # one document with an image, one with a video, each alone
        pack = ds[i]
        kinds = [m["kind"] for m in pack["media"]]
        batch = collate_pack(pack, ds.manifest["data_cfg"])
        for j in range(len(pack["docs"])):
            sample, doc_kinds = _doc(batch, kinds, j)
            key = tuple(sorted(set(doc_kinds)))
            if key and key not in seen:
                seen.add(key)
                rows.append((sample, doc_kinds))
    assert {("image",), ("video",)} <= seen
    tok = load_tokenizer("demo")
    ids = torch.tensor(tok.encode("<|im_start|>user\nWhich colour is the sky?<|im_end|>\n<|im_start|>assistant\n"))
    rows.append(({"input_ids": ids, "labels": torch.full_like(ids, -100), "position_ids": torch.arange(len(ids))[None].expand(3, -1),
                  "cu_seqlens": torch.tensor([0, len(ids)], dtype=torch.int32), "grid_thw": torch.zeros(0, 3, dtype=torch.long),
                  "media_spans": torch.zeros(0, 2, dtype=torch.long), "pixel_values": torch.zeros(0, 3 * 2 * 14 * 14)}, []))
    with torch.no_grad():
        for sample, kinds in rows:
            ref = hf(**_hf_kwargs(sample, kinds, hf.config)).logits[0]
            got = ours.logits(sample)
            assert got.shape == ref.shape
            diff = (got - ref).abs().max().item()
            print(f"{kinds or 'text'}: max |Δlogits| {diff:.1e}")
            assert diff <= 1e-4, kinds


@pytest.mark.parametrize("recipe,overrides,world,dp", [
    ("qwen2_5_vl_7b", ["parallel.cp=2", "parallel.cp_attention=ulysses", "model.foundation.tp=2",
                       "model.image_encoder.tp=1"], 8, 2),
    ("qwen2_5_vl_72b", ["model.foundation.tp=8", "parallel.cp=2"], 16, 1),
], ids=["7b-dp2-cp2-tp2", "72b-tp8-cp2"])
def test_documented_layouts_validate_on_the_real_recipes(recipe, overrides, world, dp):
    """The layouts docs/parallelism.md shows resolve and pass the TP head / vocab checks."""
    from omniweave.config import load_recipe, to_dict
    from omniweave.models.components.decoder import DecoderConfig
    from omniweave.models.components.vit import Qwen25ViTConfig
    from omniweave.models.registry import COMMON_KEYS
    from omniweave.parallel.tp import check_decoder_tp, check_vit_tp

    cfg = load_recipe(recipe, overrides)
    dims = ParallelDims.from_config(cfg.parallel, world, model=cfg.model)
    assert dims.dp == dp and dims.dp * dims.cp * dims.tp == world
    model = to_dict(cfg.model)
    dec = DecoderConfig(**{k: v for k, v in model["foundation"].items() if k not in COMMON_KEYS})
    check_decoder_tp(dec, dims.tp)
    if dims.cp_attention == "ulysses":  # each tp rank's heads must split over the CP ranks
        assert (dec.num_heads // dims.tp) % dims.cp == 0
    check_vit_tp(Qwen25ViTConfig(**{k: v for k, v in model["image_encoder"].items() if k not in COMMON_KEYS}),
                 dims.tp_encoder)
