"""Training modes on the families added by registered components (issue 35: InternVL; the same
building blocks as every other family): GRPO (rollouts through the KV-cache engine on tiled
images, the update on prompt + response rows with the prompt's media once) and DPO (a pair's
two answers sharing the prompt's media in one pack), a few steps each on the demo's data packed
with the family's tiny recipe."""

from __future__ import annotations

import math

import pytest

from tests.dpo_factory import dpo_overrides, make_pairs
from tests.rl_factory import make_rl_prompts, rl_overrides
from tests.train_factory import read_metrics

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")
RECIPES = ["tiny_internvl"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_grpo_runs_on_the_family(recipe, tmp_path):
    from omniweave.config import load_recipe
    from omniweave.rl.trainer import train_rl

    prompts = make_rl_prompts(tmp_path / "data", samples=16, recipe=recipe, overrides=("train.phase=grpo",))
    cfg = load_recipe(recipe, ["train.phase=grpo", "train.lr=1e-3", *rl_overrides(prompts, tmp_path / "run", steps=2, rl__kl_coef=0.05)])
    train_rl(cfg)
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["samples"] == 16 and 0 < r["response_len_mean"] <= 5 and math.isfinite(r["loss"]), r
    assert rows[0]["kl"] == 0.0 and rows[-1]["kl"] > 0  # the policy moved off the reference after one update


@pytest.mark.parametrize("recipe", RECIPES)
def test_dpo_runs_on_the_family(recipe, tmp_path):
    from omniweave.config import load_recipe
    from omniweave.train.trainer import train

    pairs = make_pairs(tmp_path / "data", pairs=8, recipe=recipe, overrides=("train.phase=dpo",))
    train(load_recipe(recipe, ["train.phase=dpo", *dpo_overrides(pairs, tmp_path / "run", steps=2)]))
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in rows) and abs(rows[0]["loss"] - math.log(2)) < 1e-4  # policy = ref at step 1
