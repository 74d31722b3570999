"""Pipeline parallelism (omniweave/parallel/pipeline.py) against the single-process OmniModel,
gloo, CPU, fp32 (DESIGN.md §4).

The demo model (Qwen2.5-VL-shaped: ViT + patch merger + M-RoPE decoder) with its foundation at 4
layers, on the 4 demo packs with the most kinds of media (images and videos in the same rows),
each padded with a loss-free document to the packs' 512 tokens (the run's static row length).
The reference is the plain model on the unpadded rows: Σ loss_sum / loss tokens, backward.
Every case takes one pipeline step of its rows (4 demo packs, 2 Qwen3-VL rows), one micro-batch each; the loss and
every gradient (each parameter on the rank holding it, compared by name; together the ranks
hold each parameter of the model exactly once) equal the reference within 1e-5 relative:

- pp 2, 1f1b, the layers split 2 + 2;
- pp 2, gpipe, non-uniform ``pp_layers`` 1 + 3;
- pp 2 x virtual 2, interleaved 1f1b (stages 0, 2 on rank 0 and 1, 3 on rank 1);
- pp 2 x virtual 2, interleaved zero bubble (input and weight gradients split);
- Qwen3-VL (DeepStack levels after layers 0 and 1, so stage 0 holds 2 of 3 layers), 1f1b;
- pp 4 on 4 ranks (one layer each), 1f1b;
- chunked rows (``parallel.seq_chunks``, parallel/pipeline_chunks.py): pp 2, each row in 4 chunks
  (the demo) and 3 (Qwen3-VL), the rows at their own length so that chunk boundaries cut documents
  and media: the chunks are the micro-batches, backwards in reverse.

Rows of another length than the run's, within a step or in a later one, raise ValueError on
every rank before anything is sent (torch's pipelining would abort inside gloo), as do rows
that do not split into equal chunks.

Composed with TP and CP on 4 ranks (``LAYOUTS``: the pipeline the trainer's Engine builds, its
stage parts FSDP-sharded; the rows as the trainer feeds them, ``Pipeline.prepare_rows``), the
same 4 rows, loss and every gradient against the same reference:

- pp 2 x foundation tp 2 over encoder tp 1 (the encoder's tp replicas split the media, its FSDP
  mesh is dp x cp x tp_rep), 1f1b;
- pp 2 x virtual 2 x tp 2 (encoder tp 2 too), interleaved 1f1b;
- pp 2 x cp 2, ring attention, the media split over the CP ranks, 1f1b;
- pp 2 x cp 2, Ulysses, every CP rank encoding all media, gpipe.

Measured: loss rel. error <= 6.9e-8, gradient rel. error <= 1.7e-7 (one step each, 49 s for the file
on 2 busy cores; chunked: <= 6.6e-7, the Qwen3-VL encoder); with TP / CP: loss <= 1.8e-8, gradients <= 8.0e-7 (one 4-rank run, ~20 s).
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist

from omniweave.parallel.pipeline_rows import static_row_length
from omniweave.parallel.spawn import run_ranks
from tests.dist.test_layout_parity import _reference, _rows
from omniweave.train.objective import TokenCrossEntropy

CE = TokenCrossEntropy()  # the token loss every case scores its rows with (train/objective.py)

pytestmark = [pytest.mark.dist, pytest.mark.slow]

LOSS_RTOL = 1e-5  # |loss_pp - loss_1| / |loss_1|
GRAD_RTOL = 1e-5  # per parameter: max |g_pp - g_1| / max |g_1|
CAPACITY = 512  # the demo packs' max_len (tests/train_factory.py)
CASES = [  # (recipe, layers, schedule, virtual, pp_layers)
    ("demo", 4, "1f1b", 1, None),
    ("demo", 4, "gpipe", 1, [1, 3]),
    ("demo", 4, "interleaved_1f1b", 2, None),
    ("demo", 4, "zero_bubble", 2, None),
    ("tiny_qwen3_vl", 3, "1f1b", 1, [2, 1]),
    ("demo", 4, "gpipe", 1, None, 4),  # parallel.seq_chunks: each row in 4 chunks (parallel/pipeline_chunks.py)
    ("tiny_qwen3_vl", 3, "gpipe", 1, [2, 1], 3),
    # Qwen3.5's hybrid layers: stages of mixed layer types; with chunks, the linear layers' carried states
    ("tiny_qwen3_5", 4, "1f1b", 1, [1, 3]),
    ("tiny_qwen3_5", 4, "gpipe", 1, [3, 1], 3),
]
# A Gated DeltaNet's decay parameters (A_log, dt_bias, and in_proj_a, the decay's input) sum gradients
# of both signs over every token: on these rows the single process's own fp32 gradient of layer 2's
# A_log / dt_bias is 1.2e-3 (max-abs relative) off the same model in fp64, 3 chunks' 1.3e-3, the two
# fp32 runs 2.7e-4 apart; compared at 2e-3
DECAY = ("linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.in_proj_a.weight")
DECAY_RTOL = 2e-3


def _model(recipe: str, layers: int):
    from omniweave.config import load_recipe, to_dict
    from omniweave.models.registry import build_model

    torch.manual_seed(0)
    model = build_model(to_dict(load_recipe(recipe, [f"model.foundation.num_layers={layers}"]).model))
    model.init_weights()
    return model


def _qwen3_vl_rows() -> list[dict]:
    """Two Qwen3-VL rows (images, a timestamped video, text), of the Qwen3-VL processor."""
    from tests.qwen3_vl_factory import MEDIA_CASES, make_sample, ours_batch, pack

    rows = []
    for seed, media in ((1, ["mixed", "video"]), (4, ["video", "mixed"])):
        docs = [make_sample(MEDIA_CASES[media[0]], seed=seed), make_sample([], seed=seed + 1),
                make_sample(MEDIA_CASES[media[1]], seed=seed + 2)]
        row = ours_batch(pack(docs))
        rows.append({**row, "num_loss_tokens": int((row["labels"] != -100).sum())})
    return rows


def _body(rank: int, world: int, packed: str, cases: list) -> list[dict]:
    from omniweave.parallel.pipeline import Pipeline, pad_rows
    from omniweave.parallel.pipeline_split import split_layers

    results = []
    for recipe, layers, schedule, virtual, pp_layers, *chunks in cases:
        chunks = chunks[0] if chunks else 1
        base = _model(recipe, layers)
        rows = _rows(packed, 4) if recipe == "demo" else _qwen3_vl_rows()
        longest = max(r["input_ids"].shape[0] for r in rows)
        # chunked: the rows' own length (rounded to the chunks), so that chunk boundaries cut documents and media
        capacity = max(CAPACITY, longest) if chunks == 1 else -(-longest // chunks) * chunks
        ref_loss, ref_grads = _reference(copy.deepcopy(base), rows)
        sizes = split_layers(layers, world, virtual, pp_layers)
        pipe = Pipeline(base, sizes, dist.group.WORLD, torch.device("cpu"), schedule, len(rows), seq_chunks=chunks)
        loss = pipe.step(pad_rows(rows, capacity), normaliser=sum(r["num_loss_tokens"] for r in rows), objective=CE)
        grads = {k: p.grad for k, p in pipe.named_parameters()}
        rel = {k: float((g - ref_grads[k]).abs().max() / ref_grads[k].abs().max().clamp_min(1e-12))
               * (GRAD_RTOL / DECAY_RTOL if k.endswith(DECAY) else 1.0) for k, g in grads.items()}
        results.append({"case": (recipe, schedule, sizes, chunks), "loss_rel": abs(loss - ref_loss) / abs(ref_loss),
                        "grad_rel": max(rel.values()), "worst": max(rel, key=rel.get), "names": sorted(grads), "all_names": sorted(ref_grads),
                        "encoder_grad": max(float(g.abs().max()) for k, g in grads.items()
                                            if k.startswith("image_encoder.")) if rank == 0 else None})
    return results


def _shape_change(rank: int, world: int, packed: str) -> list[str]:
    from omniweave.parallel.pipeline import Pipeline, pad_rows
    from omniweave.parallel.pipeline_split import split_layers

    rows = _rows(packed, 2)
    pipe = Pipeline(_model("demo", 2), split_layers(2, world), dist.group.WORLD, torch.device("cpu"), "1f1b", 2)
    errors = []
    with pytest.raises(ValueError) as err:  # rows of two lengths in one step
        pipe.step([*pad_rows(rows[:1], CAPACITY), *pad_rows(rows[1:], CAPACITY - 4)], normaliser=1, objective=CE)
    errors.append(str(err.value))
    pipe.step(pad_rows(rows, CAPACITY), normaliser=1, objective=CE)
    with pytest.raises(ValueError) as err:  # the next step's rows shorter than the first step's
        pipe.step(pad_rows(rows, CAPACITY - 12), normaliser=1, objective=CE)
    errors.append(str(err.value))
    chunked = Pipeline(_model("demo", 2), split_layers(2, world), dist.group.WORLD, torch.device("cpu"), "gpipe", 2,
                       seq_chunks=3)
    with pytest.raises(ValueError) as err:  # rows that do not split into equal chunks
        chunked.step(pad_rows(rows, CAPACITY), normaliser=1, objective=CE)
    errors.append(str(err.value))
    dist.barrier()  # both ranks are still alive and in step
    return errors


def _both(rank: int, world: int, packed: str, cases: list) -> tuple[list[dict], list[str]]:
    return _body(rank, world, packed, cases), _shape_change(rank, world, packed)


@pytest.fixture(scope="module")
def ranks(demo_packed):
    """Both checks in one 2-rank run (starting ranks costs more than the checks)."""
    return run_ranks(_both, 2, str(demo_packed), CASES, timeout=300)


def test_pipeline_schedules_match_single_process(ranks):
    """Every case of ``CASES`` on 2 ranks: loss and all gradients equal to 1 process."""
    results = [r[0] for r in ranks]
    for i, case in enumerate(results[0]):
        print(case["case"], "loss rel", case["loss_rel"], "grad rel", max(r[i]["grad_rel"] for r in results),
              [r[i]["worst"] for r in results])
        held = [name for rank_results in results for name in rank_results[i]["names"]]
        assert sorted(held) == case["all_names"], "the ranks must hold every parameter exactly once"
        assert case["encoder_grad"] > 0, "the media reach the encoder"
        for rank_results in results:
            assert rank_results[i]["loss_rel"] <= LOSS_RTOL, rank_results[i]["case"]
            assert rank_results[i]["grad_rel"] <= GRAD_RTOL, rank_results[i]["case"]


def test_four_stages_match_single_process(demo_packed):
    """pp 4 (one layer per rank, the encoders on rank 0, the loss on rank 3), 1f1b."""
    results = run_ranks(_body, 4, str(demo_packed), [("demo", 4, "1f1b", 1, None)], timeout=300)
    print("pp 4 loss rel", results[0][0]["loss_rel"], "grad rel", max(r[0]["grad_rel"] for r in results))
    assert sorted(n for r in results for n in r[0]["names"]) == results[0][0]["all_names"]
    assert all(r[0]["loss_rel"] <= LOSS_RTOL and r[0]["grad_rel"] <= GRAD_RTOL for r in results)


def test_row_length_change_is_a_python_error(ranks):
    """A row whose length differs from the run's raises ValueError before any send, on every rank
    (torch's pipelining fixes its receive buffers at the first step and would abort in gloo)."""
    for _, errors in ranks:
        assert f"lengths [{CAPACITY}, {CAPACITY - 4}]" in errors[0] and "pad_rows" in errors[0]
        assert f"length {CAPACITY}" in errors[1] and str(CAPACITY - 12) in errors[1]
        assert f"parallel.seq_chunks=3: the pipeline's rows of {CAPACITY} tokens do not split" in errors[2]


# ---------------------------------------------------------------------------- with TP and CP

LAYOUTS = [  # recipe overrides (4 ranks, parallel.pp=2, the demo foundation at 4 layers)
    ["model.foundation.tp=2", "model.image_encoder.tp=1"],
    ["model.foundation.tp=2", "model.image_encoder.tp=2", "parallel.pp_schedule=interleaved_1f1b",
     "parallel.pp_virtual=2"],
    ["parallel.cp=2", "parallel.cp_attention=ring"],
    ["parallel.cp=2", "parallel.cp_attention=ulysses", "parallel.vision_split=false", "parallel.pp_schedule=gpipe"],
]


def _engine_body(rank: int, world: int, packed: str, out: str, layouts: list[list[str]]) -> list[dict]:
    """Per layout: the step's loss (summed over the pipelines' CP shards) and this rank's gradients."""
    from omniweave.config import load_recipe
    from omniweave.train.engine import Engine

    rows = _rows(packed, 4)
    results = []
    for i, layout in enumerate(layouts):
        cfg = load_recipe("demo", [f"data.path={packed}", f"data.max_len={CAPACITY}", "model.foundation.num_layers=4",
                                   "train.global_batch=4", f"output_dir={out}/{i}", "parallel.pp=2", *layout])
        engine = Engine(cfg)
        pipe, dp_cp = engine.pipeline, engine.meshes.dp_cp
        loss = torch.tensor(pipe.step(pipe.prepare_rows(rows), normaliser=sum(r["num_loss_tokens"] for r in rows), objective=CE),
                            dtype=torch.float64)
        dist.all_reduce(loss, group=dp_cp.get_group())  # each CP rank's pipeline has its shards' loss
        grads = {k: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for k, p in pipe.named_parameters()}
        results.append({"loss": float(loss), "grads": grads, "pipeline": dist.get_process_group_ranks(pipe.group),
                        "row_length": pipe.capacity})
    return results


def test_pipeline_with_tp_and_cp_matches_single_process(demo_packed, tmp_path):
    """``LAYOUTS`` on 4 ranks (each (dp, cp, tp) coordinate its own pipeline of the 2 stages): the
    loss and every gradient of the stages' TP / FSDP-sharded parameters equal one process's."""
    results = run_ranks(_engine_body, 4, str(demo_packed), str(tmp_path), LAYOUTS, timeout=300, quiet=True)
    ref_loss, ref = _reference(_model("demo", 4), _rows(str(demo_packed), 4))
    assert max(float(ref[k].abs().max()) for k in ref if k.startswith("image_encoder.")) > 0  # the media reach it
    for i, layout in enumerate(LAYOUTS):
        cases = [r[i] for r in results]
        loss_rel = max(abs(c["loss"] - ref_loss) / abs(ref_loss) for c in cases)
        grad_rel = max(float((g - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-12))
                       for c in cases for k, g in c["grads"].items())
        print(layout, "row length", cases[0]["row_length"], "loss rel", loss_rel, "grad rel", grad_rel)
        assert loss_rel <= LOSS_RTOL and grad_rel <= GRAD_RTOL, layout
        for rank, case in enumerate(cases):  # the 2 stages of each pipeline hold every parameter once
            assert case["pipeline"] == [rank % 2, rank % 2 + 2]
            assert sorted([*cases[rank % 2]["grads"], *cases[rank % 2 + 2]["grads"]]) == sorted(ref)
    cp_lengths = {r[i]["row_length"] for r in results for i, layout in enumerate(LAYOUTS) if "parallel.cp=2" in layout}
    docs = json.loads((demo_packed / "stats.json").read_text())["docs_per_pack"]["max"]
    assert cp_lengths == {static_row_length(CAPACITY, 2, 1, docs)} and max(cp_lengths) < CAPACITY // 2 + 2 * docs
