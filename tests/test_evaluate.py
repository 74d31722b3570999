"""Generation eval (omniweave/train/evaluate.py) on the tiny demo model (random weights, fp32) and
real demo eval rows: images, multi-image, videos and text-only prompts of 32-51 tokens.

- Greedy predictions decoded batched over prompts (``TorchRollout``: one packed prefill, lockstep
  decoding) equal the sequential path (each prompt alone on its own one-sequence KV cache:
  ``NaiveRollout``), whatever the batch size (1; 5: batches that split the rows unevenly; 32: all
  rows in one batch), for the ``OmniModel`` and for a text-only ``CausalLM``;
- a row the processor rejects is counted under its reason and the others still are scored;
- the trainer hook reads ``eval.*`` from the recipe.

A random model rarely emits a stop token at temperature 0, so the stop token's logit is raised
wherever a fixed random projection of the hidden state is high (``stop_where_hidden_is_high``):
predictions then stop after 2 to 7 tokens or run to ``max_new_tokens``, which exercises the
shrinking set of decoding prompts.
"""

from __future__ import annotations

import pytest

from omniweave.config import load_recipe
from omniweave.data.demo import generate
from omniweave.models.text import CausalLM
from omniweave.generation import NaiveRollout, Prompt, SamplingParams
from omniweave.train.evaluate import (
    eval_fn,
    evaluate_rows,
    prompt_batch,
    read_eval_rows,
    row_to_raw,
)
from tests.rl_factory import demo_model, stop_ids, stop_where_hidden_is_high

MAX_NEW = 8
REJECTED = {"messages": [{"role": "assistant", "content": "no prompt"}], "answer": "x", "task": "broken"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval_demo")
    generate(root, samples=8, eval_samples=14, seed=0)
    rows = read_eval_rows(root / "eval.jsonl")
    rows.insert(5, REJECTED)
    model, processor = demo_model()
    stop_where_hidden_is_high(model, processor)
    return model, processor, rows, root / "media"


def sequential_predictions(model, processor, rows, media_dir) -> list[list[int]]:
    """The reference: each accepted row decoded alone, one token at a time on its own one-sequence
    KV cache (``NaiveRollout`` at temperature 0: what ``model.generate`` computed before eval was
    batched)."""
    prompts = [Prompt(i, prompt_batch(processor, row_to_raw(row, media_dir, i)))
               for i, row in enumerate(rows) if row is not REJECTED]
    params = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, stop_ids=stop_ids(processor))
    return [r.tokens for r in NaiveRollout(model).generate(prompts, 1, params, seed=0)]


def _texts(processor, token_lists) -> list[str]:
    stops = stop_ids(processor)
    return [processor.tokenizer.decode([t for t in tokens if t not in stops]) for tokens in token_lists]


@pytest.mark.parametrize("kind", ["omni", "causal_lm"])
def test_batched_greedy_predictions_equal_the_sequential_path(setup, kind):
    model, processor, rows, media_dir = setup
    if kind == "causal_lm":  # the same decoder alone; media rows are then plain token sequences
        model = CausalLM(model.foundation).eval()
    reference = sequential_predictions(model, processor, rows, media_dir)
    stops = stop_ids(processor)
    lengths = [len(t) for t in reference]
    assert len(set(lengths)) >= 3 and min(lengths) < MAX_NEW and max(lengths) == MAX_NEW, lengths
    assert any(t[-1] not in stops for t in reference) and any(t[-1] in stops for t in reference)
    want = _texts(processor, reference)
    for batch_size in (1, 5, 32):
        report = evaluate_rows(model, processor, rows, media_dir, max_new_tokens=MAX_NEW,
                               batch_size=batch_size, examples=len(rows))
        assert [e["prediction"] for e in report["examples"]] == want, batch_size
        assert report["n"] == len(rows) - 1 and report["skipped"] == {"empty_conversation": 1}
        assert set(report["by_task"]) == {r["task"] for r in rows if r is not REJECTED}
        assert [e["task"] for e in report["examples"]] == [r["task"] for r in rows if r is not REJECTED]


def test_eval_fn_reads_the_recipe_eval_section(setup, tmp_path):
    model, _, _, media_dir = setup
    cfg = load_recipe("demo", [f"eval.path={media_dir.parent / 'eval.jsonl'}", "eval.max_samples=6",
                               "eval.batch_size=4", f"eval.max_new_tokens={MAX_NEW}"])
    out = eval_fn(model, cfg, step=0)
    assert out["eval_n"] == 6 and 0.0 <= out["eval_accuracy"] <= 1.0
    assert {k for k in out if k.startswith("eval_accuracy/")}


def test_bad_batch_size_is_refused(setup):
    model, processor, rows, media_dir = setup
    with pytest.raises(ValueError, match="batch_size"):
        evaluate_rows(model, processor, rows, media_dir, batch_size=0)
