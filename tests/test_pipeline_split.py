"""Pipeline stage splits and the pipeline's input checks (omniweave/parallel/pipeline.py), without
processes: explicit ``parallel.pp_layers``, the uniform split, the cost-balanced split with the
encoders on stage 0 (optimal against every split, exhaustively on small cases), and the errors
naming the recipe keys."""

from __future__ import annotations

import itertools

import pytest
import torch

from omniweave.parallel.pipeline import check_microbatches
from omniweave.parallel.pipeline_split import check_model, encoder_cost_in_layers, split_layers, stage_ranges


def test_explicit_pp_layers_are_used_as_given():
    assert split_layers(6, 2, pp_layers=[1, 5]) == [1, 5]
    assert split_layers(6, 2, virtual=2, pp_layers=[2, 1, 2, 1]) == [2, 1, 2, 1]
    assert stage_ranges([2, 1, 3]) == [range(0, 2), range(2, 3), range(3, 6)]


def test_uniform_split():
    assert split_layers(8, 4, first_stage_cost=None) == [2, 2, 2, 2]
    assert split_layers(8, 2, virtual=2, first_stage_cost=None) == [2, 2, 2, 2]


@pytest.mark.parametrize("layers, stages, cost", [(4, 2, 0.0), (10, 4, 0.0), (8, 2, 2.0), (9, 3, 1.5), (12, 4, 5.0),
                                                  (7, 3, 0.4), (5, 5, 0.0)])
def test_cost_split_minimises_the_largest_stage(layers, stages, cost):
    """Stage 0 costs its layers plus the encoders' ``cost``; no split of the layers into ``stages``
    contiguous non-empty stages has a smaller largest stage cost."""
    sizes = split_layers(layers, stages, first_stage_cost=cost)
    assert len(sizes) == stages and sum(sizes) == layers and min(sizes) >= 1
    best = min(max(s[0] + cost, *s[1:]) for s in _compositions(layers, stages))
    assert max(sizes[0] + cost, *sizes[1:]) == best


def test_heavy_encoder_moves_layers_off_stage_0():
    assert split_layers(8, 2, first_stage_cost=0.0) == [4, 4]
    assert split_layers(8, 2, first_stage_cost=2.0) == [3, 5]
    assert split_layers(8, 2, first_stage_cost=100.0) == [1, 7]  # at least one layer per stage


def test_encoder_cost_from_the_flop_model():
    """The demo recipe's ViT + merger per row in decoder-layer units: proportional to the patches
    per token, positive, and 0 without media."""
    from omniweave.config import load_recipe, to_dict

    model_cfg = to_dict(load_recipe("demo", []).model)
    one = encoder_cost_in_layers(model_cfg, 1.0)
    assert one > 0 and encoder_cost_in_layers(model_cfg, 0.0) == 0.0
    assert encoder_cost_in_layers(model_cfg, 0.5) == pytest.approx(one / 2)


@pytest.mark.parametrize("kwargs, keys", [
    ({"num_layers": 6, "pp": 2, "pp_layers": [2, 2]}, ["parallel.pp_layers", "model.foundation.num_layers"]),
    ({"num_layers": 6, "pp": 2, "pp_layers": [6, 0]}, ["parallel.pp_layers", ">= 1"]),
    ({"num_layers": 6, "pp": 2, "virtual": 2, "pp_layers": [3, 3]}, ["parallel.pp_layers", "parallel.pp_virtual"]),
    ({"num_layers": 3, "pp": 2, "virtual": 2}, ["parallel.pp=2", "parallel.pp_virtual=2", "at least one layer"]),
    ({"num_layers": 6, "pp": 4, "first_stage_cost": None}, ["parallel.pp=4", "does not divide", "parallel.pp_layers"]),
    ({"num_layers": 6, "pp": 0}, ["parallel.pp=0"]),
])
def test_split_errors_name_the_keys(kwargs, keys):
    with pytest.raises(ValueError) as err:
        split_layers(**kwargs)
    assert all(k in str(err.value) for k in keys), str(err.value)


def test_microbatch_errors_name_the_keys():
    check_microbatches(2, 2, "1f1b")
    check_microbatches(4, 2, "interleaved_1f1b")
    with pytest.raises(ValueError, match=r"train.global_batch.*parallel.pp=4"):
        check_microbatches(3, 4, "1f1b")
    with pytest.raises(ValueError, match=r"parallel.pp_schedule=interleaved_1f1b.*multiple of 2"):
        check_microbatches(5, 2, "interleaved_1f1b")


def _model(recipe: str, *overrides: str):
    from omniweave.config import load_recipe, to_dict
    from omniweave.models.registry import build_model

    return build_model(to_dict(load_recipe(recipe, list(overrides)).model))


def test_a_stage_copy_that_would_compute_with_the_original_modules_is_refused():
    """``slice_model`` deep-copies the parallelised model; a function stored on it that closes over
    (or defaults to) one of its modules would survive the copy pointing at the original (as expert
    parallelism's dispatch once did): refused, naming the holder. An object holding the module, or a
    bound method, is copied with it and passes."""
    from omniweave.parallel.pipeline_split import slice_model

    model = _model("demo", "model.foundation.num_layers=2")
    mlp = model.foundation.layers[1].mlp
    mlp.scale_fn = lambda x, m=mlp: m(x)  # a default argument keeps the original module
    with pytest.raises(TypeError, match=r"foundation.layers.1.mlp holds .*reaches a module of the original model"):
        slice_model(model, range(2), True, True)
    mlp.scale_fn = mlp.forward  # a bound method: copied with its module
    part = slice_model(model, range(2), True, True)
    assert part.foundation.layers[1].mlp.scale_fn.__self__ is part.foundation.layers[1].mlp


def test_model_errors_name_the_keys():
    """Checked on every rank before a stage runs: tied embeddings (embedding and LM head would sit
    in different stages), DeepStack levels beyond stage 0's layers, a model without the OmniModel
    parts the stages are built from."""
    from omniweave.models.components.decoder import Decoder, DecoderConfig
    from omniweave.models.text import CausalLM

    check_model(_model("demo"), [1, 1])
    with pytest.raises(ValueError, match="model.foundation.tie_word_embeddings"):
        check_model(_model("demo", "model.foundation.tie_word_embeddings=true"), [1, 1])
    qwen3_vl = _model("tiny_qwen3_vl")  # 2 DeepStack levels, 3 layers
    check_model(qwen3_vl, [2, 1])
    with pytest.raises(ValueError, match=r"stage 0 holds 1 layers.*2 levels.*parallel.pp_layers"):
        check_model(qwen3_vl, [1, 2])
    with pytest.raises(TypeError, match="OmniModel"):
        check_model(CausalLM(Decoder(DecoderConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2,
                                                   num_heads=2, num_kv_heads=1))), [1, 1])


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("overrides, world, keys", [
    (["parallel.pp=2", "parallel.ep=3", "foundation@model.foundation=qwen3_moe_tiny"], 4,
     ["parallel.ep=3 must divide parallel.dp x parallel.cp = 2 x 1"]),
    (["parallel.pp=2", "parallel.cp=2", "parallel.pp_schedule=zero_bubble", "parallel.pp_virtual=2"], 4,
     ["parallel.pp_schedule=zero_bubble", "1 x 2 x 1", "interleaved_1f1b"]),
    (["parallel.pp=2", "parallel.pp_schedule=dualpipe"], 2, ["parallel.pp_schedule='dualpipe'"]),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"], 2, ["parallel.pp_virtual=1", "interleaved_1f1b"]),
    (["parallel.pp=2", "parallel.pp_layers=[1,2]"], 2, ["parallel.pp_layers [1, 2]", "model.foundation.num_layers"]),
    (["parallel.pp=4"], 2, ["pp*cp*tp = 4"]),
    (["parallel.pp=0"], 2, ["parallel.pp=0"]),
])
def test_recipe_pp_errors_name_the_keys(overrides, world, keys):
    """``parallel.pp`` and its keys are checked with the layout, before any rank builds a model."""
    from omniweave.config import load_recipe
    from omniweave.parallel.dims import ParallelDims

    cfg = load_recipe("demo", overrides)  # the demo foundation has 2 layers
    with pytest.raises(ValueError) as err:
        ParallelDims.from_config(cfg.parallel, world, model=cfg.model)
    assert all(k in str(err.value) for k in keys), str(err.value)


def test_recipe_pp_layout():
    from omniweave.config import load_recipe
    from omniweave.parallel.dims import ParallelDims

    cfg = load_recipe("demo", ["parallel.pp=2", "parallel.pp_layers=[1,1]"])
    dims = ParallelDims.from_config(cfg.parallel, 2, model=cfg.model)
    assert (dims.pp, dims.dp, dims.cp, dims.tp) == (2, 1, 1, 1)
    cfg = load_recipe("demo", ["parallel.pp=2", "parallel.cp=2", "model.foundation.tp=2"])  # pp x dp x cp x tp
    dims = ParallelDims.from_config(cfg.parallel, 16, model=cfg.model)
    assert (dims.pp, dims.dp, dims.cp, dims.tp) == (2, 2, 2, 2)


@pytest.mark.parametrize("command, expected", [
    (["rl", "demo_grpo", "rl.kl_coef=0.05"], "rl.kl_coef > 0 under parallel.pp=2: the frozen reference's forward"),
    (["train", "demo_dpo"], "train.dpo.ref=model under parallel.pp=2: the frozen reference's forward"),
    (["train", "demo_dpo", "train.dpo.ref=none", "parallel.cp=2"], "(train.dpo.ref=none) under parallel.pp=2 with "
                                                                  "parallel.cp=2: its per-row log-prob sums"),
    (["train", "demo_kto"], "train.phase=kto under parallel.pp=2: the frozen reference's forward"),
])
def test_training_modes_pipelines_cannot_run_yet_are_refused(capsys, command, expected):
    """A frozen reference's forward per row (GRPO's KL, DPO's reference model) and DPO with CP under
    `parallel.pp=2`: one line naming the keys and why, exit 2, before any rank starts (the rest
    runs: tests/dist/test_dpo_dist.py, tests/dist/test_objective_layouts.py)."""
    from omniweave.cli import main

    assert main([*command, "parallel.pp=2", "--nproc", "2"]) == 2
    assert expected in capsys.readouterr().err


def _row(doc_lens: list[int]) -> dict:
    """A text row of documents of ``doc_lens`` tokens, every token a loss token."""
    n = sum(doc_lens)
    cu = torch.tensor([0, *doc_lens]).cumsum(0).to(torch.int32)
    return {"input_ids": torch.arange(1, n + 1), "labels": torch.arange(1, n + 1), "cu_seqlens": cu,
            "position_ids": torch.cat([torch.arange(k) for k in doc_lens])[None], "num_loss_tokens": n}


@pytest.mark.parametrize("cp, tp", [(1, 1), (1, 4), (2, 1), (2, 2), (4, 2)])
def test_static_rows_give_every_row_the_run_length(cp, tp):
    """Rows of any length and document count (up to data.max_len and the packs' most documents)
    reach every rank of a pipeline at one static length, a multiple of tp: a loss-free pad document
    is appended so that the CP shard (each document padded to a multiple of 2·cp) has it, and every
    rank's shard keeps the row's loss tokens."""
    from omniweave.parallel.pipeline_rows import static_row_length, static_rows

    max_len, max_docs = 60, 7
    length = static_row_length(max_len, cp, tp, max_docs)
    assert length % tp == 0 and (cp == 1 and length - max_len < tp or cp > 1 and length % 2 == 0)
    rows = [_row([60]), _row([1] * 7), _row([13, 1, 1, 9, 2]), _row([5]), _row([30, 30])]
    labels = [sum(int((r["labels"] != -100).sum()) for r in static_rows([row], max_len, length, cp, rank, tp))
              for row in rows for rank in range(cp)]
    for rank in range(cp):
        shards = static_rows(rows, max_len, length, cp, rank, tp)
        assert [s["input_ids"].shape[0] for s in shards] == [length] * len(rows)
        assert all(s["position_ids"].shape[-1] == length and int(s["cu_seqlens"][-1]) == length for s in shards)
    per_row = [sum(labels[i * cp:(i + 1) * cp]) for i in range(len(rows))]
    assert per_row == [int(r["num_loss_tokens"]) for r in rows]  # the pads carry no loss
    assert cp == 1 or length <= (max_len + max_docs * (2 * cp - 1)) // cp + 2 * tp  # the bound, not more


def test_static_rows_errors_name_the_limits():
    from omniweave.parallel.pipeline_rows import static_row_length, static_rows

    length = static_row_length(16, 2, 1, max_docs=2)
    with pytest.raises(ValueError, match=r"16 tokens in 16 documents shards to 32 tokens per CP rank.*have 12"):
        static_rows([_row([1] * 16)], 16, length, cp=2)
    with pytest.raises(ValueError, match=r"rows of \[17\] tokens exceed the pipeline capacity of 16 \(data.max_len\)"):
        static_rows([_row([17])], 16, static_row_length(16), cp=1)


def test_layers_of_different_costs_split_by_their_sum():
    """A hybrid model's layers cost differently (cost_model.decoder_layer_costs): the split
    minimises the largest stage's sum, stage 0 also carrying the encoders."""
    from omniweave.parallel.pipeline_split import split_layers

    assert split_layers(4, 2, layer_costs=[1, 1, 1, 3]) == [3, 1]
    assert split_layers(4, 2, first_stage_cost=2.0, layer_costs=[1, 1, 1, 3]) == [2, 2]
    assert split_layers(8, 4, layer_costs=[1.0] * 8) == [2, 2, 2, 2]  # alike: the even split
    assert split_layers(6, 3, layer_costs=[0.5, 0.5, 0.5, 0.5, 3, 3]) == [4, 1, 1]
    assert split_layers(6, 3, layer_costs=[0.5, 0.5, 2, 0.5, 0.5, 2]) == [2, 2, 2]  # sums 1, 2.5, 2.5
    with pytest.raises(ValueError, match="layer_costs needs 4 non-negative entries"):
        split_layers(4, 2, layer_costs=[1, 1, 1])


def test_hybrid_layer_costs_separate_linear_and_attention_layers():
    """qwen3_5_tiny (linear, full, linear, full): a full-attention layer's cost grows with the
    documents' length, a linear layer's does not; MoE layers count k experts and the shared one."""
    import yaml

    from omniweave.parallel.cost_model import decoder_layer_costs, decoder_params

    f = yaml.safe_load(open("omniweave/configs/models/foundation/qwen3_5_tiny.yaml"))
    short, long = decoder_layer_costs(f, 16), decoder_layer_costs(f, 4096)
    assert short[0] == long[0] == short[2] and short[1] == short[3] < long[1]
    assert long[1] - short[1] == 6 * f["num_heads"] * f["head_dim"] * (4096 - 16)
    # at zero length the layers' sum is 6 x the parameters decoder_params counts, less the embedding row / head
    total = sum(decoder_layer_costs(f, 0))
    assert total == 6 * (decoder_params(f) - f["hidden_size"] - f["vocab_size"] * f["hidden_size"])
