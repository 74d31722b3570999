"""``omniweave demo --vla [--out DIR]``: a tiny VLA learns to reach the target its instruction names.

    the backbone's image encoder and projector pretrained on the simulator's scenes (where each
    disc is: vla/pretrain.py) -> DIR/vision/hf, as Pi0.5 starts from a pretrained vision tower
    expert episodes in ReachSim (vla/sim.py) -> DIR/dataset (LeRobot v3.0: camera video, state,
    action, task) -> data convert --format lerobot -> data pack (demo_vla) -> train (DIR/run,
    train.init_from = that backbone: tower, projector and foundation from it, the tower and
    projector frozen, the action expert fresh)
    -> closed-loop episodes in the same simulator -> DIR/vla_report.json

``--vla-vision-steps 0`` trains the VLA from scratch instead: the tiny tower then does not learn
to see the discs through the flow loss alone in this budget (docs/vla.md, "The demo").

The report's measures, each over the same held-out episodes (seeds never in the dataset):

- ``success_rate``: the policy sees the camera image, the state and the instruction;
- ``control_success_rate``: the images are blanked (all zeros): the target's place is only in
  the image, so a policy that looks scores well above this;
- ``wrong_instruction_success_rate``: the instruction names the *other* target, success still
  means reaching the episode's own: a policy that follows the text scores low here;
- ``random_success_rate``: uniformly random actions, the floor.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from omniweave.demo import _cli, _recipe_threads, platform_info

RECIPE = "demo_vla"
VISION_RECIPE = "demo"  # the VLM recipe of demo_vla's backbone (same components): pretrained, then its init
LAYOUT, IMAGE_SIZE = "ring", 56  # the simulator's layout and camera size (vla/sim.py), for data and evaluation alike


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags ``omniweave demo`` adds for ``--vla``."""
    p.add_argument("--vla-episodes", type=int, default=1500, help="--vla: expert episodes to record (default 1500)")
    p.add_argument("--vla-eval-episodes", type=int, default=100,
                   help="--vla: closed-loop episodes per measure (default 100)")
    p.add_argument("--vla-vision-steps", type=int, default=300,
                   help="--vla: vision pretraining steps of the backbone the VLA starts from (vla/pretrain.py; "
                        "default 300; 0: from scratch)")


def random_policy(seed: int, horizon: int):
    import numpy as np

    from omniweave.vla.sim import MAX_STEP

    rng = np.random.default_rng(seed)
    return lambda obs: rng.uniform(-MAX_STEP, MAX_STEP, size=(horizon, 2))


def closed_loop(policy, episodes: int, action_steps: int, horizon: int, seed: int) -> dict:
    """The four measures of the module docstring (each a ``run_episodes`` report)."""
    from omniweave.vla.evaluate import run_episodes

    runs = {"success_rate": {}, "control_success_rate": {"blank_images": True},
            "wrong_instruction_success_rate": {"swap_instruction": True}}
    common = {"action_steps": action_steps, "layout": LAYOUT, "image_size": IMAGE_SIZE}
    out = {name: run_episodes(policy, episodes, **common, **kw) for name, kw in runs.items()}
    out["random_success_rate"] = run_episodes(random_policy(seed, horizon), episodes, **common)
    return out


def run(args: argparse.Namespace) -> int:
    from omniweave.config import load_recipe, recipe_path
    from omniweave.vla.demo_data import write_reach_dataset
    from omniweave.vla.policy import Policy

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    recipe = recipe_path(RECIPE)
    cfg = load_recipe(recipe, args.overrides)
    horizon = int(cfg.model.action_expert.horizon)
    t0 = time.perf_counter()
    print(f"recording {args.vla_episodes} expert episodes in {out / 'dataset'}", flush=True)
    write_reach_dataset(out / "dataset", episodes=args.vla_episodes, seed=args.seed, layout=LAYOUT, image_size=IMAGE_SIZE)
    w = str(args.workers)
    _cli("data", "convert", "--format", "lerobot", "--input", str(out / "dataset"), "--output", str(out / "raw"),
         "--horizon", str(horizon), "--strict", "--no-progress")
    _cli("data", "pack", "--input", str(out / "raw"), "--output", str(out / "packed"), "--recipe", str(recipe),
         "--workers", w, *args.overrides)  # as the training run's: a data.* override must reach the packs too
    run_dir = out / "run"
    steps = [f"train.steps={args.steps}"] if args.steps else []
    t_train = time.perf_counter()
    init, vision_accuracy = [], None
    if args.vla_vision_steps > 0:
        from omniweave.vla.pretrain import pretrain_vision

        print(f"pretraining the backbone's vision: {args.vla_vision_steps} steps on scene slots in {out / 'vision'}",
              flush=True)
        backbone, vision_accuracy = pretrain_vision(out / "vision", VISION_RECIPE, args.vla_vision_steps, args.seed,
                                                    image_size=IMAGE_SIZE)
        print(f"vision pretraining: both discs' slots right on {vision_accuracy:.1%} of held-out scenes", flush=True)
        # the tower and projector stay as pretrained: trained further through the flow loss, their
        # features drift and the expert never binds the instruction's colour to them (docs/vla.md)
        init = [f"train.init_from={backbone}", "model.image_encoder.freeze=true", "model.projector.freeze=true"]
    _cli("train", str(recipe), f"data.path={out / 'packed'}", f"output_dir={run_dir}", *init, *steps, *args.overrides)
    train_seconds = time.perf_counter() - t_train
    _recipe_threads(cfg)
    policy = Policy.load(run_dir, seed=args.seed)
    action_steps = max(1, horizon // 2)
    print(f"closed loop: {args.vla_eval_episodes} held-out episodes per measure, {action_steps} of each chunk's "
          f"{horizon} actions executed before the next query", flush=True)
    measures = closed_loop(policy, args.vla_eval_episodes, action_steps, horizon, args.seed)
    report = {"recipe": RECIPE, "episodes": args.vla_episodes, "eval_episodes": args.vla_eval_episodes,
              "vision_steps": args.vla_vision_steps, "vision_slot_accuracy": vision_accuracy,
              "steps": args.steps or int(cfg.train.steps), "train_seconds": round(train_seconds, 1),
              **{name: m["success_rate"] for name, m in measures.items()},
              "mean_steps": measures["success_rate"]["mean_steps"],
              "details": measures, "seconds": round(time.perf_counter() - t0, 1), "platform": platform_info()}
    (out / "vla_report.json").write_text(json.dumps(report, indent=2, default=float) + "\n")
    print(f"demo --vla: success {report['success_rate']:.0%} (images blanked {report['control_success_rate']:.0%}, "
          f"wrong instruction {report['wrong_instruction_success_rate']:.0%}, random actions "
          f"{report['random_success_rate']:.0%}) in {report['seconds']:.0f}s; report {out / 'vla_report.json'}")
    return 0
