"""DPO and GRPO over chunked rows (``parallel.seq_chunks``, parallel/seq_chunks.py) equal the
unchunked run, fp32, one process. GRPO's loss is a sum over tokens: each chunk takes its own.
DPO's is not: the forward sweep adds up each chunk's pair sums, the loss and its gradient with
respect to them are taken once, and each chunk's backward carries Σ g · sums of its tokens.
Loss, statistics (1e-6) and every gradient of the first update (1e-5 relative) match."""

from __future__ import annotations

import pytest

from tests.train_factory import run_named_grad_spy, worst_grad_error

pytestmark = [pytest.mark.slow]

LOSS_RTOL = 1e-6
# a reward is β times a difference of two log-prob sums of about -100, each exact to fp32's ~1e-5:
# after an update (step 2) the chunked and whole rows' rewards differ by up to 3.2e-8 (measured)
REWARD_ATOL = 1e-7
GRAD_RTOL = 1e-5  # per parameter, max |Δgrad| / max |grad|, of the first update (same weights)


def _run(recipe: str, overrides: list[str]):
    from omniweave.config import load_recipe
    from omniweave.rl.trainer import train_rl
    from omniweave.train.trainer import train
    from tests.train_factory import read_metrics

    cfg = load_recipe(recipe, overrides)
    _, grads = run_named_grad_spy(train_rl if recipe == "demo_grpo" else train, cfg)
    return read_metrics(cfg.output_dir), grads


def _check(recipe, overrides, keys, tmp_path, chunks, later_rtol=LOSS_RTOL):
    """Chunked rows against whole rows: the first step's metrics within 1e-6, the later steps'
    within ``later_rtol``, the first update's gradients within 1e-5; returns the chunked metrics."""
    want, want_grads = _run(recipe, overrides(tmp_path / "whole"))
    got, grads = _run(recipe, overrides(tmp_path / f"chunks{chunks}") + [f"parallel.seq_chunks={chunks}"])
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        for key in keys:
            rtol = LOSS_RTOL if step == 0 else later_rtol
            assert g[key] == pytest.approx(w[key], rel=rtol, abs=REWARD_ATOL), key
    worst = worst_grad_error(grads[0], want_grads[0])
    print(f"{recipe} seq_chunks={chunks}: loss {got[-1]['loss']:.7g} vs {want[-1]['loss']:.7g}, grads max rel {worst:.1e}")
    assert set(grads[0]) == set(want_grads[0]) and worst <= GRAD_RTOL
    return got


@pytest.mark.parametrize("phase, chunks", [("dpo", 2), ("dpo", 4), ("orpo", 3), ("simpo", 2)])
def test_pair_losses_with_chunked_rows_equal_whole_rows(tmp_path_factory, tmp_path, phase, chunks):
    from tests.dpo_factory import dpo_overrides, make_pairs

    pairs = make_pairs(tmp_path_factory.mktemp("pairs"))
    _check("demo_dpo", lambda out: dpo_overrides(pairs, out, steps=2, global_batch=2, train__phase=phase), (
        "loss", "pairs", "reward_chosen", "reward_rejected", "reward_accuracy", "grad_norm"), tmp_path, chunks)


def test_kto_with_chunked_rows_equals_whole_rows(tmp_path_factory, tmp_path):
    """KTO's per-completion sums carried across 3 chunks; z0's pre-pass runs each row whole (at lr
    1e-2 the third step's z0 is above its clamp at 0)."""
    from tests.dpo_factory import dpo_overrides, make_kto

    data = make_kto(tmp_path_factory.mktemp("kto"), completions=24)
    # at this lr two updates take the third step's rewards 3e-6 relative apart (fp32 sums in another
    # order, amplified by AdamW's normalised steps): its metrics within 1e-4
    got = _check("demo_kto", lambda out: dpo_overrides(data, out, steps=3, global_batch=2, train__lr=1e-2), (
        "loss", "completions", "reward_desirable", "reward_undesirable", "kl", "grad_norm"), tmp_path, 3, 1e-4)
    assert got[-1]["kl"] > 0.1


GSPO = {"rl__importance_sampling": "sequence", "rl__loss_agg": "seq-mean-token-mean"}


@pytest.mark.parametrize("chunks, extra", [(2, {}), (4, {}), (3, GSPO)], ids=["grpo-2", "grpo-4", "gspo-3"])
def test_grpo_with_chunked_rows_equals_whole_rows(tmp_path_factory, tmp_path, chunks, extra):
    """GRPO's token sums chunk by chunk; GSPO's per-sequence sums carried across the chunks."""
    from tests.rl_factory import make_rl_prompts, rl_overrides

    prompts = make_rl_prompts(tmp_path_factory.mktemp("prompts"))
    _check("demo_grpo", lambda out: rl_overrides(prompts, out, steps=1, rl__kl_coef=0.05, **extra), (
        "loss", "reward_mean", "samples", "kl", "clip_frac", "grad_norm"), tmp_path, chunks)
