"""``omniweave generate video``: clips from a trained video-diffusion run, for prompts.

    omniweave generate video RUN --prompt "a red disc moving left" [--prompt ...] [--prompts FILE.jsonl]
        [--frames 17] [--height 32] [--width 48] [--sampler unipc|euler] [--steps 30] [--guidance 5.0]
        [--shift 3.0] [--negative ""] [--seed 0] [--batch 16] [--output DIR] [--gif] [--image PATH [--image PATH ...]]

The run's checkpoint gives the generator; its recipe's ``model.vae`` and ``model.text_encoder``
(the codecs its packs were made with) encode the prompts and decode the latents. The sampler is
UniPC by default, order 2 (diffusion/unipc.py: diffusers' ``UniPCMultistepScheduler`` as the Wan 2.1
diffusers checkpoints configure it for WanPipeline), or ``--sampler euler``: diffusers' flow-matching
Euler schedule (diffusion/schedule.py: ``inference_sigmas(steps, shift)``). Either runs under
classifier-free guidance against the encoded negative prompt (default "", as training's
caption dropout fed the encoded empty prompt): ``v = v_neg + guidance · (v_text − v_neg)``;
``--guidance 1`` skips the negative branch. Up to ``--batch`` clips are packed in one row per
generator call (both guidance branches in it: attention never crosses a clip, as in training) and
decoded together. Each clip starts from its own noise (seed + its index), so a clip does not
depend on the others in the call (up to float rounding of the packed GEMMs). Writes ``DIR/NNN.mp4`` (and ``.gif``) and
``DIR/generate.json`` (prompts, settings, files).

An image-to-video run (its generator has ``image_dim``; its recipe a ``model.image_conditioner``)
needs ``--image PATH``: one image for every prompt, or one per prompt (repeated, in order). Each
image is resized (bicubic) to ``--height`` x ``--width`` -- as ``data pack`` resizes a clip's frames --
and conditions its clip as the packs did (diffusion/data.py ``i2v_condition``: the VAE latent of
[image, zero frames] and the first-frame mask after each token's noisy values, the image
conditioner's features beside the text), in both guidance branches, as diffusers'
``WanImageToVideoPipeline`` does. A text-to-video run refuses ``--image``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from omniweave.errors import UserError

SAMPLERS = ("unipc", "euler")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from omniweave.argtypes import integer, positive

    p.add_argument("run", help="a diffusion run directory (or one of its checkpoints)")
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts", help="JSONL of {\"prompt\": ...} rows (e.g. a demo's heldout_prompts.jsonl)")
    p.add_argument("--frames", type=integer(1), default=17, help="frames per clip, 4k + 1 (default 17)")
    p.add_argument("--height", type=integer(16), default=32, help="pixels, a multiple of 16 (default 32)")
    p.add_argument("--width", type=integer(16), default=48, help="pixels, a multiple of 16 (default 48)")
    p.add_argument("--sampler", choices=SAMPLERS, default="unipc",
                   help="unipc (order 2, WanPipeline's default) or euler (default unipc)")
    p.add_argument("--steps", type=integer(1), default=30, help="sampling steps, one model call each (default 30)")
    p.add_argument("--guidance", type=positive(), default=5.0, help="classifier-free guidance scale (default 5)")
    p.add_argument("--shift", type=positive(), default=None,
                   help="timestep shift (default: the run's train.diffusion.shift)")
    p.add_argument("--negative", default="", help="the negative prompt (default: empty, as caption dropout trained)")
    p.add_argument("--seed", type=integer(0), default=0)
    p.add_argument("--batch", type=integer(1), default=16,
                   help="clips packed in one row per generator call and decoded together (default 16)")
    p.add_argument("--output", help="output folder (default RUN/generated)")
    p.add_argument("--gif", action="store_true", help="also write each clip as a GIF")
    p.add_argument("--fps", type=positive(), default=None,
                   help="frames per second of the MP4 / GIF (default: the run's data.diffusion.fps, else 16, Wan's)")
    p.add_argument("--device", default="auto", help="where the models run (auto: cuda if any; default auto)")
    p.add_argument("--image", action="append", default=[],
                   help="image-to-video runs: the first frame (one for all prompts, or one per prompt, repeated)")


def read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts:
        for n, line in enumerate(Path(args.prompts).read_text().splitlines(), 1):
            if line.strip():
                row = json.loads(line)
                if not isinstance(row.get("prompt"), str):
                    raise UserError(f"{args.prompts}:{n}: a row needs a \"prompt\" string")
                prompts.append(row["prompt"])
    if not prompts:
        raise UserError("no prompt: give --prompt TEXT or --prompts FILE.jsonl")
    return prompts


class VideoGenerator:
    """A trained run's generator with its recipe's codecs on ``device`` (``auto``: CUDA when there is
    one), sampling clips for prompts. The noise is drawn on the CPU from each clip's seed, so a seed
    names the same starting noise on any device."""

    def __init__(self, run: str | Path, device: str = "auto"):
        import torch
        import yaml

        from omniweave.diffusion.data import check_recipe, codec_device
        from omniweave.models.registry import build_component
        from omniweave.train.checkpoint import load_model, resolve_checkpoint

        ckpt = resolve_checkpoint(run)
        cfg = yaml.safe_load((ckpt / "config.yaml").read_text())
        check_recipe(cfg["model"], (cfg.get("train") or {}).get("phase"))
        self.cfg = cfg
        self.device = torch.device(codec_device(device))
        model, _ = load_model(ckpt)
        self.generator = model.generator.eval().to(self.device)
        self.vae = build_component("vae", cfg["model"]["vae"]).eval().to(self.device)
        self.text_encoder = build_component("text_encoder", cfg["model"]["text_encoder"]).to(self.device)
        self.text_len = int(((cfg.get("data") or {}).get("diffusion") or {}).get("text_len", 512))
        conditioner = cfg["model"].get("image_conditioner")  # image-to-video (check_recipe: with image_dim)
        self.image_encoder = build_component("image_conditioner", conditioner).to(self.device) if conditioner else None
        self.shift = float(((cfg.get("train") or {}).get("diffusion") or {}).get("shift", 3.0))

    @property
    def i2v(self) -> bool:
        return self.generator.config.image_dim is not None

    def sample(self, prompts: list[str], frames: int, height: int, width: int, steps: int, guidance: float,
               shift: float | None = None, negative: str = "", seed: int = 0, sampler: str = "unipc",
               images: list[np.ndarray] | None = None, batch: int = 16) -> list[np.ndarray]:
        """uint8 [T, H, W, 3] clips, one per prompt (I2V: each starting from its image, :meth:`sample_latents`);
        ``batch`` clips per generator call and per VAE decode."""
        import torch

        latents = self.sample_latents(prompts, frames, height, width, steps, guidance, shift, negative, seed, sampler,
                                      images, batch)
        out = []
        for start in range(0, len(latents), batch):
            with torch.no_grad():
                videos = self.vae.decode(self.vae.denormalize(torch.stack(latents[start:start + batch])))
            for video in videos:  # [3, T, H, W] in [-1, 1]
                out.append(((video.permute(1, 2, 3, 0).clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu().numpy())
        return out

    def sample_latents(self, prompts: list[str], frames: int, height: int, width: int, steps: int, guidance: float,
                       shift: float | None = None, negative: str = "", seed: int = 0, sampler: str = "unipc",
                       images: list[np.ndarray] | None = None, batch: int = 16) -> list:
        """Normalised latents [z_dim, T', H/8, W/8], one per prompt (what :meth:`sample` decodes). An
        image-to-video run takes ``images``: uint8 [height, width, 3] first frames, one for all
        prompts or one per prompt (:func:`load_images` makes them)."""
        import torch

        from omniweave.diffusion.schedule import euler_sample, guided, inference_sigmas
        from omniweave.diffusion.unipc import unipc_sample, unipc_schedule
        from omniweave.models.components.wan_dit import patchify_clips, unpatchify_clips

        if (frames - 1) % 4 or height % 16 or width % 16:
            raise UserError(f"--frames {frames} must be 4k + 1 and --height {height} / --width {width} multiples of 16")
        if sampler not in SAMPLERS:
            raise UserError(f"--sampler {sampler}: choose from {', '.join(SAMPLERS)}")
        images = check_images(images, len(prompts), self.i2v)
        for image in images or ():
            if tuple(np.shape(image)) != (height, width, 3):
                raise ValueError(f"an image of shape {np.shape(image)}: sampling wants uint8 [{height}, {width}, 3]")
        z_dim, patch = self.vae.cfg.z_dim, self.generator.config.patch_size
        shape = (z_dim, 1 + (frames - 1) // 4, height // 8, width // 8)
        shift = self.shift if shift is None else shift

        def solve(velocity, tokens):
            if sampler == "euler":
                return euler_sample(velocity, tokens, inference_sigmas(steps, shift))
            sigmas, timesteps = unipc_schedule(steps, shift)  # its own spacing, and integer model timesteps
            return unipc_sample(velocity, tokens, sigmas, order=2, timesteps=timesteps)

        if batch < 1:
            raise UserError(f"--batch {batch}: clips per generator call, >= 1")
        texts = self.text_encoder.encode(prompts, max_sequence_length=self.text_len)
        neg = self.text_encoder.encode([negative], max_sequence_length=self.text_len)[0]
        conditions = [self._condition(image, frames, patch) for image in images or ()]  # each given image once
        out = []
        for start in range(0, len(prompts), batch):  # up to `batch` clips packed in one row per generator call
            ids = range(start, min(start + batch, len(prompts)))
            noises = [torch.randn(shape, generator=torch.Generator().manual_seed(seed + i)).to(self.device) for i in ids]
            tokens, grid = patchify_clips(noises, patch)
            # the row the generator sees: these clips with their prompts, then (guidance) the same clips
            # with the negative prompt -- one call per step for both branches
            branches = [[texts[i] for i in ids]] + ([[neg] * len(ids)] if guidance != 1.0 else [])
            row_texts = [t for branch in branches for t in branch]
            text = torch.cat(row_texts).float()
            text_cu = torch.tensor([0, *np.cumsum([len(t) for t in row_texts])], dtype=torch.int32, device=self.device)
            row_grid = grid.to(self.device).repeat(len(branches), 1)
            cond, image = self._row_condition([conditions[i % len(conditions)] for i in ids] if conditions else [],
                                              len(branches))

            def velocity(x, sigma, text=text, text_cu=text_cu, row_grid=row_grid, cond=cond, image=image):
                # float32 time; UniPC hands sigma in float64 so that this product is its integer timestep
                t = (sigma * 1000).float().reshape(1).expand(row_grid.shape[0])
                x = x.repeat(len(branches), 1)
                x = x if cond is None else torch.cat([x, cond.to(x.dtype)], dim=1)  # [noisy | mask | cond] per token
                v = self.generator(x, row_grid, t, text, text_cu, **image)
                if guidance == 1.0:
                    return v
                v_text, v_neg = v.chunk(2)
                return guided(v_text, v_neg, guidance)

            with torch.no_grad():
                out.extend(unpatchify_clips(solve(velocity, tokens), grid, z_dim, patch))
        return out

    @staticmethod
    def _row_condition(conditions: list[tuple], branches: int) -> tuple:
        """The I2V conditioning of a row of clips (``_condition`` of each), repeated per guidance branch:
        (cond tokens [T, 20·p] or None, the generator's image kwargs)."""
        import torch

        if not conditions:
            return None, {}
        conditions = conditions * branches
        features = [c[1]["image"] for c in conditions]
        cu = torch.tensor([0, *np.cumsum([len(f) for f in features])], dtype=torch.int32, device=features[0].device)
        return torch.cat([c[0] for c in conditions]), {"image": torch.cat(features), "image_cu_seqlens": cu}

    def _condition(self, image: np.ndarray, frames: int, patch) -> tuple:
        """(cond tokens, the generator's image kwargs) of one first frame, as ``data pack`` made them."""
        import torch

        from omniweave.diffusion.data import i2v_condition

        cond, features = i2v_condition(self.vae, self.image_encoder, image, frames, patch)
        cu = torch.tensor([0, len(features)], dtype=torch.int32, device=features.device)
        return cond, {"image": features, "image_cu_seqlens": cu}


def check_images(images: list | None, prompts: int, i2v: bool) -> list | None:
    """The first frames (or their paths) given for ``prompts`` prompts, checked against the run: none
    for a text-to-video run, one or one per prompt for an image-to-video run (one line otherwise)."""
    images = list(images or [])
    if not i2v:
        if images:
            raise UserError("--image: this run is text-to-video (its generator has no image_dim); "
                            "drop --image or sample an image-to-video run")
        return None
    if not images:
        raise UserError("this run is image-to-video: give --image PATH (one for all prompts, or one per prompt)")
    if len(images) not in (1, prompts):
        raise UserError(f"{len(images)} --image for {prompts} prompts: give one image for all, or one per prompt")
    return images


def load_images(paths: list[str], height: int, width: int) -> list[np.ndarray]:
    """Each ``--image`` as uint8 [height, width, 3], resized as ``data pack`` resizes frames."""
    from PIL import Image, UnidentifiedImageError

    from omniweave.diffusion.data import resized_frame

    out = []
    for path in paths:
        try:
            with Image.open(path) as im:
                out.append(resized_frame(im, height, width))
        except (OSError, UnidentifiedImageError) as e:
            raise UserError(f"--image {path}: cannot read it as an image ({e})") from None
    return out


def run(args) -> int:
    from omniweave.diffusion.demo_data import FPS, write_mp4

    prompts = read_prompts(args)
    t0 = time.time()
    gen = VideoGenerator(args.run, args.device)
    check_images(args.image, len(prompts), gen.i2v)  # before reading any image
    images = load_images(args.image, args.height, args.width) if args.image else None
    clips = gen.sample(prompts, args.frames, args.height, args.width, args.steps, args.guidance, args.shift,
                       args.negative, args.seed, args.sampler, images, args.batch)
    fps = args.fps or ((gen.cfg.get("data") or {}).get("diffusion") or {}).get("fps") or FPS  # what it learnt
    out = Path(args.output) if args.output else Path(args.run) / "generated"
    out.mkdir(parents=True, exist_ok=True)
    files = []
    for i, clip in enumerate(clips):
        path = out / f"{i:03d}.mp4"
        write_mp4(path, clip, fps=fps)
        files.append(path.name)
        if args.gif:
            from PIL import Image

            frames = [Image.fromarray(f) for f in clip]
            frames[0].save(out / f"{i:03d}.gif", save_all=True, append_images=frames[1:], duration=round(1000 / fps), loop=0)
    record = {"run": str(args.run), "prompts": prompts, "files": files, "frames": args.frames, "height": args.height,
              "width": args.width, "sampler": args.sampler, "steps": args.steps, "guidance": args.guidance,
              "shift": gen.shift if args.shift is None else args.shift, "negative": args.negative, "seed": args.seed,
              "images": list(args.image), "batch": args.batch, "device": str(gen.device), "fps": fps,
              "seconds": round(time.time() - t0, 2)}
    (out / "generate.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"generate video: {len(clips)} clip(s) of {args.frames} frames at {args.width}x{args.height} "
          f"({args.sampler}, {args.steps} steps, guidance {args.guidance:g}) in {record['seconds']:.1f}s -> {out}")
    return 0
