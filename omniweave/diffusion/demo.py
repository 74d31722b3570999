"""``omniweave demo --diffusion [--out DIR]``: a tiny text-to-video model learns to draw a coloured
shape moving the way its prompt says, and a fixed checker reads what it drew.

    synthetic clips (diffusion/demo_data.py; 4 colours x 4 directions, 4 combinations held out)
        -> DIR/clips
    the tiny Wan VAE fitted on such clips (diffusion/vae_fit.py; a random VAE decodes noise)
        -> DIR/vae (a diffusers folder: the recipe's model.vae.path)
    data convert --format clips -> data pack (demo_diffusion: VAE latents and umT5 states made
        offline) -> train (rectified flow over packed clips, DIR/run)
    -> omniweave generate video's sampler for three prompt sets -> the analytic checker
       (diffusion/checker.py: the shape's colour, the direction of its motion)
    -> DIR/diffusion_report.json, DIR/samples.png (frames of the first clips), DIR/samples.gif

The report's measures, each the share of clips whose colour *and* direction the checker reads
as the prompt asks (chance: 1 in 16):

- ``prompt_accuracy``: the held-out prompts, (colour, direction) pairs never trained on (every
  colour and every direction was, in other pairs): composition;
- ``seen_prompt_accuracy``: prompts of the trained pairs (new noise, shapes, places);
- ``control_prompt_accuracy``: the held-out prompts' clips sampled with the text dropped (the
  encoded empty prompt, guidance off: what caption dropout trained); a model that draws from the
  prompt scores near chance here.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from omniweave.demo import _cli, _recipe_threads, platform_info

RECIPE = "demo_diffusion"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags ``omniweave demo`` adds for ``--diffusion``."""
    p.add_argument("--diffusion-clips", type=int, default=512, help="--diffusion: training clips (default 512)")
    p.add_argument("--diffusion-vae-steps", type=int, default=1500,
                   help="--diffusion: steps fitting the tiny VAE on the clips (diffusion/vae_fit.py; default 1500)")
    p.add_argument("--diffusion-vae", default=None,
                   help="--diffusion: a fitted VAE folder to use instead of fitting one (e.g. an earlier run's DIR/vae)")
    p.add_argument("--diffusion-sample-steps", type=int, default=20, help="--diffusion: sampling steps (default 20)")
    p.add_argument("--diffusion-guidance", type=float, default=4.0,
                   help="--diffusion: classifier-free guidance at sampling (default 4)")
    p.add_argument("--diffusion-eval-per-pair", type=int, default=8,
                   help="--diffusion: prompts sampled per (colour, direction) pair for each measure (default 8: "
                        "32 held-out, 96 seen, 32 text-dropped clips)")


def seen_prompts(per_combination: int, seed: int) -> list[dict]:
    """Prompts of the trained (colour, direction) pairs, from seeds past the training clips'."""
    from omniweave.diffusion.demo_data import HELD_OUT, clip_spec, combination

    rows, s = [], seed
    counts: dict[tuple[str, str], int] = {}
    while len(rows) < per_combination * (16 - len(HELD_OUT)):
        pair = combination(s)
        if pair not in HELD_OUT and counts.get(pair, 0) < per_combination:
            spec = clip_spec(s)
            counts[pair] = counts.get(pair, 0) + 1
            rows.append({"prompt": spec["caption"], "colour": pair[0], "direction": pair[1], "seed": s})
        s += 1
    return rows


def frame_grid(clips: list[np.ndarray], captions: list[str], every: int = 4):
    """Rows of clips, every ``every``-th frame across, a caption above each row."""
    from PIL import Image, ImageDraw

    frames = [c[::every] for c in clips]
    t, h, w = frames[0].shape[0], frames[0].shape[1], frames[0].shape[2]
    label, gap = 12, 2
    grid = Image.new("RGB", (t * (w + gap), len(clips) * (h + label + gap)), (255, 255, 255))
    draw = ImageDraw.Draw(grid)
    for r, (clip, text) in enumerate(zip(frames, captions)):
        y = r * (h + label + gap)
        draw.text((1, y), text, fill=(0, 0, 0))
        for i, frame in enumerate(clip):
            grid.paste(Image.fromarray(frame), (i * (w + gap), y + label))
    return grid


def write_samples(out: Path, clips: list[np.ndarray], captions: list[str], fps: int) -> None:
    """DIR/samples.png (frames across) and DIR/samples.gif (the clips side by side, animated)."""
    from PIL import Image

    frame_grid(clips, captions).save(out / "samples.png")
    strip = np.concatenate(clips, axis=2)  # [T, H, n·W, 3]
    images = [Image.fromarray(f) for f in strip]
    images[0].save(out / "samples.gif", save_all=True, append_images=images[1:], duration=1000 // fps, loop=0)


def run(args: argparse.Namespace) -> int:
    from omniweave.config import load_recipe, recipe_path
    from omniweave.diffusion import checker
    from omniweave.diffusion.demo_data import FPS, FRAMES, HEIGHT, WIDTH, write_clips_dataset
    from omniweave.diffusion.generate import VideoGenerator
    from omniweave.diffusion.vae_fit import fit_vae

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    recipe = recipe_path(RECIPE)
    steps = [f"train.steps={args.steps}"] if args.steps else []
    cfg = load_recipe(recipe, [*args.overrides, *steps])
    t0 = time.perf_counter()
    print(f"writing {args.diffusion_clips} synthetic clips in {out / 'clips'}", flush=True)
    per_pair = args.diffusion_eval_per_pair
    jsonl = write_clips_dataset(out / "clips", num_clips=args.diffusion_clips, seed=args.seed,
                                heldout_per_combination=per_pair)
    if args.diffusion_vae:
        vae_dir = Path(args.diffusion_vae).resolve()
        fitted = vae_dir / "vae_fit.json"
        vae = json.loads(fitted.read_text()) if fitted.exists() else {}
        print(f"using the VAE in {vae_dir}", flush=True)
    else:
        vae_dir = out / "vae"
        print(f"fitting the tiny VAE: {args.diffusion_vae_steps} steps -> {vae_dir}", flush=True)
        vae = fit_vae(out=vae_dir, steps=args.diffusion_vae_steps, seed=args.seed)
    vae_eval = vae.get("eval", {})
    print(f"VAE: PSNR {vae_eval.get('psnr', float('nan')):.1f} dB on unseen clips, the checker reads "
          f"{vae_eval.get('prompt_accuracy', float('nan')):.0%} of its reconstructions", flush=True)
    codec = [f"model.vae.path={vae_dir}"]
    w = str(args.workers)
    _cli("data", "convert", "--format", "clips", "--input", str(jsonl), "--media-dir", str(out / "clips"),
         "--output", str(out / "raw"), "--no-progress")
    _cli("data", "pack", "--input", str(out / "raw"), "--output", str(out / "packed"), "--recipe", str(recipe),
         "--workers", w, *codec, *args.overrides)  # as the training run's: the packs' codecs / data settings
    run_dir = out / "run"
    t_train = time.perf_counter()
    _cli("train", str(recipe), f"data.path={out / 'packed'}", f"output_dir={run_dir}", *codec, *steps, *args.overrides)
    train_seconds = time.perf_counter() - t_train

    _recipe_threads(cfg)
    generator = VideoGenerator(run_dir)
    held = [json.loads(line) for line in (out / "clips" / "heldout_prompts.jsonl").read_text().splitlines() if line]
    seen = seen_prompts(per_pair, seed=10**6 + args.seed)
    sample = dict(frames=FRAMES, height=HEIGHT, width=WIDTH, steps=args.diffusion_sample_steps, seed=args.seed)
    print(f"sampling {len(held)} held-out, {len(seen)} seen and {len(held)} text-dropped prompts "
          f"({args.diffusion_sample_steps} UniPC steps, guidance {args.diffusion_guidance:g})", flush=True)
    t_sample = time.perf_counter()
    clips = {"held": generator.sample([p["prompt"] for p in held], guidance=args.diffusion_guidance, **sample),
             "seen": generator.sample([p["prompt"] for p in seen], guidance=args.diffusion_guidance, **sample),
             "control": generator.sample([""] * len(held), guidance=1.0, **sample)}
    sample_seconds = time.perf_counter() - t_sample
    scores = {"held": checker.score(clips["held"], held), "seen": checker.score(clips["seen"], seen),
              "control": checker.score(clips["control"], held)}
    write_samples(out, clips["held"][:8] + clips["control"][:4], [p["prompt"] for p in held[:8]] +
                  [f"(no text) {p['prompt']}" for p in held[:4]], FPS)
    report = {"recipe": RECIPE, "clips": args.diffusion_clips, "steps": args.steps or int(cfg.train.steps),
              "prompt_accuracy": scores["held"]["prompt_accuracy"],
              "seen_prompt_accuracy": scores["seen"]["prompt_accuracy"],
              "control_prompt_accuracy": scores["control"]["prompt_accuracy"],
              "colour_accuracy": scores["held"]["colour_accuracy"],
              "direction_accuracy": scores["held"]["direction_accuracy"],
              "sampling": {"sampler": "unipc", "steps": args.diffusion_sample_steps, "guidance": args.diffusion_guidance},
              "vae": {k: vae_eval.get(k) for k in ("psnr", "prompt_accuracy")} | {
                  "path": str(vae_dir), "steps": vae.get("steps"), "seconds": round(vae.get("seconds", 0.0), 1)},
              "train_seconds": round(train_seconds, 1), "sample_seconds": round(sample_seconds, 1),
              "seconds": round(time.perf_counter() - t0, 1), "run_dir": str(run_dir),
              "details": scores,  # per prompt set: counts, accuracies and each clip's reading
              "platform": platform_info()}
    (out / "diffusion_report.json").write_text(json.dumps(report, indent=2, default=float) + "\n")
    print(f"demo --diffusion: held-out prompts {report['prompt_accuracy']:.0%} right (colour and direction; seen "
          f"pairs {report['seen_prompt_accuracy']:.0%}, text dropped {report['control_prompt_accuracy']:.0%}, chance "
          f"6%) in {report['seconds']:.0f}s; report {out / 'diffusion_report.json'}, frames {out / 'samples.png'}")
    return 0
