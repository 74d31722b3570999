"""``omniweave demo --dpo [--out DIR]``: DPO makes a model prefer the right answers it never saw.

    generate (DIR/data: dpo.jsonl pairs, dpo_eval.jsonl held-out pairs) -> convert both -> pack
    both with the demo_dpo recipe (DIR/pairs, DIR/eval_pairs) -> held-out preference accuracy of
    the initial model -> DPO (DIR/run) -> the same measure -> DIR/dpo_report.json

A pair is a demo question (colour, shape, position, count, motion, which-red, addition) with its
correct answer chosen and a wrong answer of the same task rejected. The measure is the share of
held-out pairs whose chosen answer gets the higher log-prob: chance (~50%) for the initial model,
so its rise is what DPO taught. The reference is the initial model (``train.dpo.ref: model``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from omniweave.demo import _cli, _recipe_threads, load_trained_model, platform_info

RECIPE = "demo_dpo"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags ``omniweave demo`` adds for ``--dpo``."""
    p.add_argument("--dpo-samples", type=int, default=2000, help="--dpo: preference pairs to generate (default 2000)")


def initial_model(cfg):
    """The model a run of ``cfg`` starts from (seeded initialisation, no ``init_from``), on CPU."""
    import torch

    from omniweave.config import to_dict
    from omniweave.models.registry import build_model

    torch.manual_seed(int(cfg.train.seed))
    model = build_model(to_dict(cfg.model))
    model.init_weights()
    return model.eval()


def run(args: argparse.Namespace) -> int:
    from omniweave.config import load_recipe, recipe_path
    from omniweave.data.demo import generate
    from omniweave.train.dpo import preference_accuracy

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    recipe = recipe_path(RECIPE)
    cfg = load_recipe(recipe, args.overrides)
    t0 = time.perf_counter()
    data = out / "data"
    eval_samples = args.eval_samples or 200
    print(f"generating {args.dpo_samples} preference pairs and {eval_samples} held-out ones in {data}", flush=True)
    generate(data, samples=0, eval_samples=eval_samples, seed=args.seed, dpo_samples=args.dpo_samples)
    w = str(args.workers)
    for split, packed in (("dpo", out / "pairs"), ("dpo_eval", out / "eval_pairs")):
        _cli("data", "convert", "--input", str(data / f"{split}.jsonl"), "--media-dir", str(data / "media"),
             "--output", str(out / f"raw_{split}"), "--workers", w, "--strict", "--no-progress")
        _cli("data", "pack", "--input", str(out / f"raw_{split}"), "--output", str(packed), "--recipe", str(recipe),
             "--workers", w)
    _recipe_threads(cfg)
    before = preference_accuracy(initial_model(cfg), out / "eval_pairs")
    print(f"held-out pairs before DPO: chosen preferred in {before['accuracy']:.1%} of {before['n']}", flush=True)
    run_dir = out / "run"
    steps = [f"train.steps={args.steps}"] if args.steps else []
    _cli("train", str(recipe), f"data.path={out / 'pairs'}", f"output_dir={run_dir}", *steps, *args.overrides)
    _recipe_threads(cfg)
    after = preference_accuracy(load_trained_model(run_dir, cfg), out / "eval_pairs")
    print(f"held-out pairs after DPO: chosen preferred in {after['accuracy']:.1%} of {after['n']} "
          f"(before {before['accuracy']:.1%}); mean log-prob margin {before['margin']:.3f} -> {after['margin']:.3f}",
          flush=True)
    report = {"recipe": RECIPE, "pairs": args.dpo_samples, "steps": args.steps or int(cfg.train.steps),
              "before": before, "after": after, "seconds": round(time.perf_counter() - t0, 1), "platform": platform_info()}
    (out / "dpo_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"demo --dpo: held-out preference accuracy {before['accuracy']:.1%} -> {after['accuracy']:.1%} in "
          f"{report['seconds']:.0f}s; report {out / 'dpo_report.json'}")
    return 0
