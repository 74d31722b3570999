"""A GRPO step on every parallel layout equals the single process (gloo, fp32): dp=2, cp=2 with
the vision split, foundation tp=2 — same rewards, loss and gradients (before clipping) for the
same global batch of prompts. Rollouts are seeded per (step, prompt, sample), so every layout
samples the same responses; the update's normaliser is the global response-token count."""

from __future__ import annotations

import pytest
import torch

from omniweave.parallel.spawn import run_ranks
from tests.rl_factory import make_rl_prompts, rl_overrides

pytestmark = [pytest.mark.dist]

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-5  # per parameter, max |Δgrad| / max |grad|


def _run(overrides: list[str]) -> tuple[dict, list]:
    """One GRPO step; (rank 0's metrics, the gradients the engine clipped, as full tensors)."""
    from omniweave.config import load_recipe
    from omniweave.rl.trainer import train_rl
    from tests.train_factory import read_metrics, run_clipping_spy

    cfg = load_recipe("demo_grpo", overrides)
    result, grads = run_clipping_spy(train_rl, cfg)
    return read_metrics(cfg.output_dir)[0] if result["rank"] == 0 else {}, grads[0]


def _body(rank: int, world: int, base: list[str], layout: list[str]):
    return _run([*base, *layout])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl_dist")
    prompts = make_rl_prompts(root)
    base = rl_overrides(prompts, root / "ref", steps=1, train__cpu_threads=1)
    import torch.distributed as dist

    ref = _run(base)
    assert not dist.is_initialized()
    return root, prompts, ref


@pytest.mark.parametrize("layout", [
    [],  # dp = 2
    ["parallel.cp=2", "parallel.vision_split=true"],
    ["model.foundation.tp=2", "model.image_encoder.tp=2"],
], ids=["dp2", "cp2_vision_split", "tp2"])
def test_a_grpo_step_equals_one_rank(setup, layout, tmp_path):
    root, prompts, (ref_metrics, ref_grads) = setup
    base = rl_overrides(prompts, tmp_path / "run", steps=1, train__cpu_threads=1)
    (metrics, grads), *_ = run_ranks(_body, 2, base, layout, timeout=600)
    for key in ("reward_mean", "reward_std", "response_len_mean", "samples"):
        assert metrics[key] == pytest.approx(ref_metrics[key], rel=1e-6), key  # fp32 rewards summed in another order
    assert abs(metrics["loss"] - ref_metrics["loss"]) <= LOSS_RTOL * abs(ref_metrics["loss"])
    assert len(grads) == len(ref_grads)
    worst = max(float((g - r).abs().max() / r.abs().max().clamp_min(1e-12)) for g, r in zip(grads, ref_grads))
    print(f"{layout or 'dp2'}: loss {metrics['loss']:.6g} vs {ref_metrics['loss']:.6g}, grads max rel {worst:.2e}")
    assert worst <= GRAD_RTOL


def _text_rank_body(rank: int, world: int, overrides: list[str]) -> int:
    from omniweave.config import load_recipe
    from omniweave.rl.trainer import train_rl

    return train_rl(load_recipe("demo_grpo", overrides))["steps"]


def test_a_rank_whose_prompts_have_no_media_does_not_hang(tmp_path):
    """Two prompts, one with an image and one text-only, one per rank each step: the text-only rank
    runs the encoder on its dummy input, in the rollout and in the update, and the run finishes."""
    import json

    from omniweave.cli import main
    from tests.data_factory import png_bytes

    (tmp_path / "a.png").write_bytes(png_bytes(56, 56))
    rows = [{"messages": [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "red"}],
             "images": ["a.png"]},
            {"messages": [{"role": "user", "content": "2 plus 3?"}, {"role": "assistant", "content": "5"}]}]
    (tmp_path / "rl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert main(["data", "convert", "--input", str(tmp_path / "rl.jsonl"), "--output", str(tmp_path / "raw"),
                 "--workers", "1", "--no-progress"]) == 0
    assert main(["data", "pack", "--input", str(tmp_path / "raw"), "--output", str(tmp_path / "prompts"),
                 "--recipe", "demo_grpo", "--workers", "1"]) == 0
    overrides = rl_overrides(tmp_path / "prompts", tmp_path / "run", steps=3, train__global_batch=2,
                             train__cpu_threads=1)
    assert run_ranks(_text_rank_body, 2, overrides, timeout=300) == [3, 3]


def test_the_reference_logprobs_gathered_over_cp_equal_one_rank(setup, tmp_path):
    """rl.kl_coef > 0: the reference's log-probs come back from the CP shards (with the tp pad
    layout of shard_micro_batch undone); two PPO epochs make the KL term move the gradient."""
    root, prompts, _ = setup
    kl = ["rl.kl_coef=0.05", "rl.ppo_epochs=2"]
    ref_metrics, ref_grads = _run(rl_overrides(prompts, tmp_path / "ref", steps=1, train__cpu_threads=1) + kl)
    base = rl_overrides(prompts, tmp_path / "run", steps=1, train__cpu_threads=1) + kl
    (metrics, grads), *_ = run_ranks(_body, 2, base, ["parallel.cp=2"], timeout=600)
    assert ref_metrics["kl"] > 0
    assert metrics["kl"] == pytest.approx(ref_metrics["kl"], rel=1e-4)
    assert abs(metrics["loss"] - ref_metrics["loss"]) <= LOSS_RTOL * abs(ref_metrics["loss"])
    worst = max(float((g - r).abs().max() / r.abs().max().clamp_min(1e-12)) for g, r in zip(grads, ref_grads))
    assert worst <= GRAD_RTOL
