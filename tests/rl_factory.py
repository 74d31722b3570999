"""Shared pieces of the RL tests: the tiny demo model and real demo prompts (images, a video,
text only) as rollout ``Prompt``s."""

from __future__ import annotations

from pathlib import Path

import torch

from omniweave.config import load_recipe, to_dict
from omniweave.data.demo import generate
from omniweave.data.text.tokenize import SampleProcessor
from omniweave.models.registry import build_model
from omniweave.generation import Prompt
from omniweave.train.evaluate import prompt_batch, read_eval_rows, row_to_raw


def demo_model(seed: int = 0):
    """The demo recipe's tiny Qwen2.5-VL, random weights with non-trivial norms (fp32, eval mode)."""
    cfg = load_recipe("demo")
    torch.manual_seed(seed)
    model = build_model(to_dict(cfg.model))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model.eval(), SampleProcessor(cfg.data)


def demo_prompts(root: Path, processor: SampleProcessor, n: int = 7) -> list[Prompt]:
    """The first ``n`` held-out demo questions (every task: images, videos, text) as prompts."""
    if not (root / "eval.jsonl").exists():
        generate(root, samples=8, eval_samples=max(n, 14), seed=0)
    rows = read_eval_rows(root / "eval.jsonl")[:n]
    return [Prompt(uid=100 + i, batch=prompt_batch(processor, row_to_raw(r, root / "media", i)))
            for i, r in enumerate(rows)]


def stop_ids(processor: SampleProcessor) -> tuple[int, ...]:
    return tuple(processor.tokenizer.token_id(t) for t in processor.template.stop_tokens)


def raise_stop_logits(model, processor: SampleProcessor, bias: float = 5.0) -> None:
    """Add ``bias`` to the stop tokens' logits (P(stop) ~ 13 % per step at T = 1 on random weights
    for 5.0), so that samples end at different steps."""
    add = torch.zeros(model.foundation.config.vocab_size)
    add[list(stop_ids(processor))] = bias
    logits = model.foundation.logits
    model.foundation.logits = lambda hidden: logits(hidden) + add.to(hidden.dtype)


def stop_where_hidden_is_high(model, processor, threshold: float = -2.0) -> None:
    """Add 20 to the first stop token's logit where ``hidden @ r > threshold`` (r fixed, random):
    greedy decoding then stops at different steps for different prompts (a constant bias, as in
    :func:`raise_stop_logits`, makes every greedy sample stop at once or never)."""
    r = torch.randn(model.foundation.config.hidden_size, generator=torch.Generator().manual_seed(0))
    stop = torch.tensor(stop_ids(processor)[:1])
    logits = model.foundation.logits
    model.foundation.logits = lambda h: logits(h).index_add(
        1, stop.to(h.device), 20.0 * ((h.float() @ r.to(h.device)) > threshold).to(h.dtype)[:, None])


def make_rl_prompts(root: Path, samples: int = 48, recipe: str = "demo_grpo", overrides: tuple[str, ...] = ()) -> Path:
    """``data demo`` rl.jsonl -> convert -> pack with ``recipe`` (+ ``overrides``): one prompt per pack."""
    from omniweave.cli import main

    root = Path(root)
    assert main(["data", "demo", str(root / "demo"), "--samples", "4", "--eval-samples", "4",
                 "--rl-samples", str(samples)]) == 0
    assert main(["data", "convert", "--input", str(root / "demo/rl.jsonl"), "--media-dir", str(root / "demo/media"),
                 "--output", str(root / "rlraw"), "--workers", "1", "--no-progress"]) == 0
    assert main(["data", "pack", "--input", str(root / "rlraw"), "--output", str(root / "prompts"),
                 "--recipe", recipe, "--workers", "1", *overrides]) == 0
    return root / "prompts"


def rl_overrides(prompts: Path, out: Path, steps: int = 3, **kw) -> list[str]:
    """A short GRPO run on ``prompts`` from random weights with a reward that varies on random text."""
    ov = {"output_dir": out, "data.path": prompts, "train.steps": steps, "train.global_batch": 4,
          "train.save_interval": 0, "train.log_interval": 1, "rl.group_size": 4, "rl.max_new_tokens": 5,
          "rl.rewards": "[{name: 'tests.rl_user_rewards:vowel_fraction'}]"}
    ov.update({k.replace("__", "."): v for k, v in kw.items()})
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in ov.items()]
