"""``omniweave demo [--recipe demo] [--out DIR]``: the whole pipeline on the built-in synthetic dataset.

    generate (DIR/data) -> convert (DIR/raw) -> pack (DIR/packed) -> train (DIR/run)
    -> greedy eval on the held-out split -> the same recipe with every image/video/audio clip blanked
    (DIR/control/...) -> DIR/demo_report.json

The demo dataset's questions can only be answered by looking at the media, so the gap between
``accuracy`` (model trained and evaluated with real media) and ``control_accuracy`` (same recipe,
media replaced by flat grey files of the same size and length) measures what the model learned to
see. Recipe: ``omniweave/configs/recipes/demo.yaml`` (a tiny Qwen2.5-VL-shaped model); ``--recipe demo_moe``
(``make demo-moe``) runs it with the Mixture-of-Experts decoder of ``omniweave/configs/recipes/demo_moe.yaml``,
``--recipe demo_omni`` (``make demo-omni``) with an audio tower added by YAML and the listening
tasks in the data (``demo.audio: true``), the audio silenced in the control.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import time
from pathlib import Path

RECIPE = "demo"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", default=None,
                   help="a recipe that trains on the demo's packs, e.g. demo_moe (default: demo; not with --rl, --dpo)")
    p.add_argument("--out", default=None, help="output folder (default: runs/<recipe>, with --rl runs/demo_rl)")
    p.add_argument("--rl", action="store_true", help="the GRPO demo instead (omniweave/demo_rl.py)")
    p.add_argument("--dpo", action="store_true", help="the DPO demo instead (omniweave/demo_dpo.py)")
    p.add_argument("--vla", action="store_true", help="the vision-language-action demo instead (omniweave/vla/demo.py)")
    p.add_argument("--diffusion", action="store_true",
                   help="the text-to-video diffusion demo instead (omniweave/diffusion/demo.py)")
    p.add_argument("--samples", type=int, default=None, help="training samples to generate (default: the recipe's demo.samples)")
    p.add_argument("--eval-samples", type=int, default=None, help="held-out eval samples (default: the recipe's demo.eval_samples)")
    p.add_argument("--steps", type=int, default=None, help="training (with --rl: GRPO) steps (default: the recipe's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2, help="worker processes for convert and pack")
    p.add_argument("--no-control", action="store_true", help="skip the blanked-media control run")
    p.add_argument("overrides", nargs="*", help="recipe overrides key=value, applied to both runs (--rl: the GRPO run)")
    from omniweave.demo_dpo import add_arguments as dpo_arguments
    from omniweave.demo_rl import add_arguments as rl_arguments
    from omniweave.diffusion.demo import add_arguments as diffusion_arguments
    from omniweave.vla.demo import add_arguments as vla_arguments

    rl_arguments(p)
    dpo_arguments(p)
    vla_arguments(p)
    diffusion_arguments(p)


# ----------------------------------------------------------------------------- blank media


def _blank_image(data: bytes, suffix: str) -> bytes:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as im:
        size = im.size
    buf = io.BytesIO()
    Image.new("RGB", size, (128, 128, 128)).save(buf, format="PNG" if suffix == ".png" else "JPEG")
    return buf.getvalue()


def _blank_video(data: bytes) -> bytes:
    """Same frame count, size and frame rate; every frame flat grey."""
    import av
    import numpy as np

    with av.open(io.BytesIO(data)) as src:
        stream = src.streams.video[0]
        rate, width, height = stream.average_rate, stream.codec_context.width, stream.codec_context.height
        n = sum(1 for _ in src.decode(stream))
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as dst:
        out = dst.add_stream("mpeg4", rate=rate)
        out.width, out.height, out.pix_fmt = width, height, "yuv420p"
        grey = np.full((height, width, 3), 128, np.uint8)
        for _ in range(n):
            for packet in out.encode(av.VideoFrame.from_ndarray(grey, format="rgb24")):
                dst.mux(packet)
        for packet in out.encode():
            dst.mux(packet)
    return buf.getvalue()


def _blank_audio(data: bytes) -> bytes:
    """Same sample count, rate and channels (so the same audio tokens); every sample silent."""
    import wave

    with wave.open(io.BytesIO(data)) as src:
        params, frames = src.getparams(), src.getnframes()
    buf = io.BytesIO()
    with wave.open(buf, "wb") as dst:
        dst.setparams(params)
        dst.writeframes(b"\x00" * frames * params.sampwidth * params.nchannels)
    return buf.getvalue()


def blank_media_copy(src: Path, dst: Path) -> int:
    """Copy a demo dataset folder, replacing every media file by a blank one of the same shape
    (grey images and video frames, silent audio)."""
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("media"))
    count = 0
    for f in sorted((src / "media").rglob("*")):
        if f.is_file():
            target = dst / "media" / f.relative_to(src / "media")
            target.parent.mkdir(parents=True, exist_ok=True)
            data = f.read_bytes()
            suffix = f.suffix.lower()
            if suffix in (".png", ".jpg", ".jpeg"):
                blank = _blank_image(data, suffix)
            else:
                blank = _blank_audio(data) if suffix == ".wav" else _blank_video(data)
            target.write_bytes(blank)
            count += 1
    return count


# ----------------------------------------------------------------------------- pipeline


def _cli(*argv: str) -> None:
    from omniweave.cli import main

    print(f"\n$ omniweave {' '.join(argv)}", flush=True)
    code = main(list(argv))
    if code:
        raise SystemExit(f"omniweave demo: step 'omniweave {' '.join(argv[:2])}' failed (exit {code})")


def pipeline(data_dir: Path, work: Path, recipe: Path, overrides: list[str], workers: int) -> dict:
    """convert -> pack -> train -> eval for one dataset folder; returns the eval report."""
    from omniweave.config import load_recipe
    from omniweave.train.evaluate import evaluate_file

    raw, packed, run_dir = work / "raw", work / "packed", work / "run"
    _cli("data", "convert", "--input", str(data_dir / "train.jsonl"), "--media-dir", str(data_dir / "media"),
         "--output", str(raw), "--workers", str(workers), "--strict")
    _cli("data", "pack", "--input", str(raw), "--output", str(packed), "--recipe", str(recipe), "--workers", str(workers),
         *overrides)  # the same recipe as the training run: a data.* override must reach the packs too
    train_overrides = [f"data.path={packed}", f"output_dir={run_dir}", *overrides]
    t0 = time.perf_counter()
    _cli("train", str(recipe), *train_overrides)
    train_seconds = time.perf_counter() - t0
    cfg = load_recipe(recipe, train_overrides)
    _recipe_threads(cfg)
    model = load_trained_model(run_dir, cfg)
    report = evaluate_file(model, _processor(cfg), data_dir / "eval.jsonl", data_dir / "media",
                           max_new_tokens=int(cfg.eval.max_new_tokens), batch_size=int(cfg.eval.batch_size))
    report.update(run_dir=str(run_dir), steps=int(cfg.train.steps), train_seconds=round(train_seconds, 1))
    per_task = ", ".join(f"{t} {a:.0%}" for t, a in sorted(report["by_task"].items()))
    print(f"eval: accuracy {report['accuracy']:.1%} on {report['n']} held-out questions ({per_task})", flush=True)
    return report


def _recipe_threads(cfg) -> None:
    """Evaluate on the recipe's ``train.cpu_threads`` too, set here rather than left over from the
    in-process training run, so the greedy answers never depend on torch's default thread count."""
    import torch

    from omniweave.train.engine import tc_threads

    if tc_threads(cfg):
        torch.set_num_threads(tc_threads(cfg))


def platform_info() -> dict:
    """What the demo's numbers depend on besides the recipe and seed: the same software on the
    same CPU gives bit-identical runs, another CPU or SIMD path (ATen's, MKL's, oneDNN's) gives
    slightly different floats and so a few different answers (docs/benchmarks.md#the-demo)."""
    import platform

    import torch

    cpu = platform.processor()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines() if ln.startswith("model name")]
        cpu = names[0] if names else cpu
    return {"torch": torch.__version__, "cpu": cpu or platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}


def _processor(cfg):
    from omniweave.data.text.tokenize import SampleProcessor

    return SampleProcessor(cfg.data)


def load_trained_model(run_dir: Path, cfg):
    """The model of the run's final checkpoint, on CPU, in eval mode."""
    from omniweave.train.checkpoint import load_model_for_eval

    return load_model_for_eval(run_dir, cfg).eval()


def run(args: argparse.Namespace) -> int:
    from omniweave.config import load_recipe, recipe_path
    from omniweave.data.demo import generate
    from omniweave.errors import UserError

    chosen = [flag for flag in ("rl", "dpo", "vla", "diffusion") if getattr(args, flag)]
    if len(chosen) > 1:
        raise UserError(f"choose one demo: {' and '.join('--' + f for f in chosen)} were both given")
    if args.recipe and chosen:  # those demos run their own recipes; say so, don't drop it
        raise UserError(f"--recipe is for the SFT demo; --{chosen[0]} runs its own recipes")
    if args.diffusion:
        from omniweave.diffusion import demo as demo_diffusion

        args.out = args.out or "runs/demo_diffusion"
        return demo_diffusion.run(args)
    if args.vla:
        from omniweave.vla import demo as demo_vla

        args.out = args.out or "runs/demo_vla"
        return demo_vla.run(args)
    if args.dpo:
        from omniweave import demo_dpo

        args.out = args.out or "runs/demo_dpo"
        return demo_dpo.run(args)
    if args.rl:
        from omniweave import demo_rl

        args.out = args.out or "runs/demo_rl"
        return demo_rl.run(args)
    recipe = recipe_path(args.recipe or RECIPE)
    args.out = args.out or f"runs/{recipe.stem}"
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    overrides = list(args.overrides) + ([f"train.steps={args.steps}"] if args.steps else [])
    cfg = load_recipe(recipe, overrides)
    samples = args.samples or int(cfg.demo.samples)
    eval_samples = args.eval_samples or int(cfg.demo.eval_samples)
    t0 = time.perf_counter()

    data_dir = out / "data"
    print(f"generating {samples} training + {eval_samples} eval samples in {data_dir}", flush=True)
    generate(data_dir, samples=samples, eval_samples=eval_samples, seed=args.seed, audio=bool(cfg.demo.audio))
    main = pipeline(data_dir, out, recipe, overrides, args.workers)

    report = {
        "accuracy": main["accuracy"],
        "control_accuracy": None,
        "steps": main["steps"],
        "seconds": None,
        "run_dir": main["run_dir"],
        "eval_samples": main["n"],
        "accuracy_by_task": main["by_task"],
        "examples": main["examples"],
        "platform": platform_info(),
    }
    if not args.no_control:
        control_data = out / "control" / "data"
        n = blank_media_copy(data_dir, control_data)
        print(f"\ncontrol: {n} media files blanked in {control_data}", flush=True)
        control = pipeline(control_data, out / "control", recipe, overrides, args.workers)
        report.update(control_accuracy=control["accuracy"], control_by_task=control["by_task"],
                      control_run_dir=control["run_dir"])
    report["seconds"] = round(time.perf_counter() - t0, 1)
    (out / "demo_report.json").write_text(json.dumps(report, indent=2) + "\n")

    control = "skipped" if report["control_accuracy"] is None else f"{report['control_accuracy']:.1%}"
    print(f"\ndemo: accuracy {report['accuracy']:.1%} with media vs {control} with media blanked "
          f"({report['steps']} steps, {report['seconds']:.0f} s) -> {out / 'demo_report.json'}")
    return 0
