"""``omniweave demo --rl [--out DIR]``: GRPO raises what a briefly trained model sees.

    generate (DIR/data: train, eval and RL prompt splits) -> convert + pack the SFT data (demo
    recipe) and the RL prompts (demo_grpo recipe) -> a brief SFT run (DIR/sft; or reuse
    ``--sft-checkpoint``) -> greedy eval on the held-out visual questions -> GRPO from the SFT
    weights (DIR/rl) -> the same eval -> DIR/rl_report.json

The held-out questions are the eval split's visual tasks (colour, shape, position, count, motion,
which-red): answerable only by looking, never seen in training or RL. The reward is exact match
of the one-word answer, so the rise from ``accuracy_sft`` to ``accuracy_rl`` is what GRPO taught
the model to see better.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from omniweave.demo import _cli, _processor, _recipe_threads, load_trained_model, platform_info

# the recipes of each rollout engine: vLLM's CPU attention needs the decoder's head dim >= 32
RECIPES = {"native": ("demo", "demo_grpo"), "vllm": ("demo_vllm", "demo_grpo_vllm")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags ``omniweave demo`` adds for ``--rl``."""
    p.add_argument("--sft-steps", type=int, default=150, help="--rl: SFT steps before GRPO (default 150)")
    p.add_argument("--sft-checkpoint", default=None, help="--rl: start GRPO from this SFT run / checkpoint instead")
    p.add_argument("--rl-samples", type=int, default=2000, help="--rl: RL prompts to generate (default 2000)")
    p.add_argument("--engine", choices=sorted(RECIPES), default="native",
                   help="--rl: the rollout engine (vllm: recipes demo_vllm + demo_grpo_vllm, in the vLLM venv: "
                        "make demo-rl-vllm)")


def held_out(data_dir: Path) -> list[dict]:
    from omniweave.data.demo import RL_TASKS
    from omniweave.train.evaluate import read_eval_rows

    return [r for r in read_eval_rows(data_dir / "eval.jsonl") if r["task"] in RL_TASKS]


def evaluate(run_dir: Path, cfg, data_dir: Path) -> dict:
    from omniweave.train.evaluate import evaluate_rows

    _recipe_threads(cfg)
    model = load_trained_model(run_dir, cfg)
    report = evaluate_rows(model, _processor(cfg), held_out(data_dir), data_dir / "media",
                           max_new_tokens=int(cfg.eval.max_new_tokens), batch_size=int(cfg.eval.batch_size))
    per_task = ", ".join(f"{t} {a:.0%}" for t, a in sorted(report["by_task"].items()))
    print(f"eval {run_dir.name}: accuracy {report['accuracy']:.1%} on {report['n']} held-out visual questions "
          f"({per_task})", flush=True)
    return report


def run(args: argparse.Namespace) -> int:
    from omniweave.config import load_recipe, recipe_path
    from omniweave.data.demo import generate

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    sft_recipe, rl_recipe = (recipe_path(name) for name in RECIPES[args.engine])
    if args.engine != "native":  # the engine's checks (vLLM installed, the model) before any run
        from omniweave.rl.trainer import settings

        settings(load_recipe(rl_recipe, list(args.overrides)))
    sft_cfg = load_recipe(sft_recipe)
    t0 = time.perf_counter()
    data = out / "data"
    samples = args.samples or int(sft_cfg.demo.samples)
    eval_samples = args.eval_samples or int(sft_cfg.demo.eval_samples)
    print(f"generating {samples} training, {eval_samples} eval and {args.rl_samples} RL samples in {data}", flush=True)
    generate(data, samples=samples, eval_samples=eval_samples, seed=args.seed, rl_samples=args.rl_samples)
    w = str(args.workers)

    sft_run = Path(args.sft_checkpoint).resolve() if args.sft_checkpoint else out / "sft" / "run"
    if not args.sft_checkpoint:
        raw, packed = out / "sft" / "raw", out / "sft" / "packed"
        _cli("data", "convert", "--input", str(data / "train.jsonl"), "--media-dir", str(data / "media"),
             "--output", str(raw), "--workers", w, "--strict")
        _cli("data", "pack", "--input", str(raw), "--output", str(packed), "--recipe", str(sft_recipe), "--workers", w)
        _cli("train", str(sft_recipe), f"data.path={packed}", f"output_dir={sft_run}", f"train.steps={args.sft_steps}",
             "train.save_interval=0")
    before = evaluate(sft_run, sft_cfg, data)

    rl_raw, prompts, rl_run = out / "rl" / "raw", out / "rl" / "prompts", out / "rl" / "run"
    _cli("data", "convert", "--input", str(data / "rl.jsonl"), "--media-dir", str(data / "media"),
         "--output", str(rl_raw), "--workers", w, "--strict")
    _cli("data", "pack", "--input", str(rl_raw), "--output", str(prompts), "--recipe", str(rl_recipe), "--workers", w)
    rl_overrides = [f"data.path={prompts}", f"output_dir={rl_run}", f"train.init_from={sft_run}",
                    *([f"train.steps={args.steps}"] if args.steps else []), *args.overrides]
    t_rl = time.perf_counter()
    _cli("rl", str(rl_recipe), *rl_overrides)
    rl_seconds = time.perf_counter() - t_rl
    rl_cfg = load_recipe(rl_recipe, rl_overrides)
    after = evaluate(rl_run, rl_cfg, data)

    report = {
        "accuracy_sft": before["accuracy"], "accuracy_rl": after["accuracy"],
        "gain_points": round(100 * (after["accuracy"] - before["accuracy"]), 1),
        "engine": str(rl_cfg.rl.rollout.engine), "steps": int(rl_cfg.train.steps),
        "sft_steps": None if args.sft_checkpoint else args.sft_steps,
        "seconds": round(time.perf_counter() - t0, 1), "rl_seconds": round(rl_seconds, 1),
        "eval_samples": after["n"], "accuracy_by_task_sft": before["by_task"], "accuracy_by_task_rl": after["by_task"],
        "sft_run": str(sft_run), "rl_run": str(rl_run), "platform": platform_info(),
    }
    (out / "rl_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nRL demo: held-out visual accuracy {before['accuracy']:.1%} after SFT -> {after['accuracy']:.1%} after "
          f"{report['steps']} GRPO steps ({report['gain_points']:+.1f} points) in {report['seconds']:.0f} s; "
          f"report {out / 'rl_report.json'}", flush=True)
    return 0
