"""The diffusion demo's VAE stage: fit a tiny Wan VAE on the synthetic clips, so that its latents
carry the clips (a random VAE's decodes are noise, and no DiT can learn through that).

    fit_vae(out=DIR)  ->  DIR/config.json + diffusion_pytorch_model.safetensors   (AutoencoderKLWan)
                          DIR/vae_fit.json                                        (the report)

A recipe uses it with ``model.vae.path=DIR`` (``build_vae`` reads the folder). Steps:

1. **Fit.** Encoder and decoder train together on clips rendered on the fly (``demo_data.render_clip``;
   a fresh clip every time, so there is no overfitting to watch): each step takes ``batch`` clips,
   encodes them to the posterior ``[mean, logvar]`` (``quant_conv``'s two halves), decodes the mean
   and minimises the pixels' mean squared error in [-1, 1] plus ``kl_weight`` x the KL to N(0, I) per
   latent value. Why these and nothing more: the checker reads flat colours and positions, which MSE
   reconstructs (no perceptual or adversarial loss at this size); the mean is what ``data pack``
   stores and ``generate`` decodes; the small KL keeps the means from drifting far. Decoding a
   posterior *sample* (``sample=True``, the textbook VAE) was measured worse here: a fresh VAE's
   posterior std is ~1 against means of ~0.1, so samples are noise, the decoder learns to paint the
   background and Adam pushes the logvar back to 0 whatever the KL weight (no shape after 250 steps,
   even with the logvar started at -6). Training decodes the whole clip in one pass, unclamped (the
   clamp has no gradient outside [-1, 1]); ``encode`` / ``decode`` give the same numbers chunk by
   chunk (tests/test_wan_vae.py).
   Training clips skip the demo's held-out (colour, direction) combinations (``demo_data.HELD_OUT``),
   as the DiT's do: the VAE never sees a held-out combination either.
2. **Latent statistics.** ``data pack`` stores ``vae.normalize(vae.encode(clip))`` = (mean - latents_mean)
   / latents_std per channel, and ``generate`` decodes ``vae.denormalize(z)``. The DiT learns best on
   latents of about unit variance, so the fitted VAE's per-channel mean and std of the posterior mean,
   measured over ``stats_clips`` fresh training-distribution clips, become its ``latents_mean`` /
   ``latents_std`` (written in config.json, where diffusers keeps them).
3. **Check.** ``evaluate_vae``: ``decode(denormalize(normalize(encode(clip))))`` (the pack -> generate
   path) of ``eval_clips`` seeds never trained on (all 16 combinations): PSNR and the analytic
   checker's accuracy on the reconstructions (colour and direction both right).

``python -m omniweave.diffusion.vae_fit --out DIR [--steps N]`` runs the stage alone.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from omniweave.diffusion import checker
from omniweave.diffusion.demo_data import FRAMES, HEIGHT, WIDTH, _held_out, combination, render_clip
from omniweave.models.components.wan_vae import VAEComponentConfig, WanVAE, build_vae

TINY_VAE = Path(__file__).resolve().parents[1] / "configs" / "models" / "vae" / "wan_vae_tiny.yaml"
FIT_SEED0 = 1_000_000  # training clips: seeds from here up (apart from the demo dataset's, 0 up)
EVAL_SEED0 = 900_000  # evaluation clips: EVAL_SEED0 .. + eval_clips - 1, below every training seed
LOGVAR_RANGE = (-30.0, 20.0)  # diffusers' DiagonalGaussianDistribution clamps logvar to this


def tiny_vae(seed: int = 0) -> WanVAE:
    """A random VAE of ``configs/models/vae/wan_vae_tiny.yaml`` (seeded): what the demo fits."""
    import yaml

    cfg = {k: v for k, v in yaml.safe_load(TINY_VAE.read_text()).items() if k not in ("name", "freeze", "path")}
    return build_vae(VAEComponentConfig(**{**cfg, "seed": seed}))


def train_seeds(start: int = FIT_SEED0, held_out: Sequence[Sequence[str]] | None = None):
    """Clip seeds from ``start`` up whose combination is not held out (``None``: ``HELD_OUT``)."""
    held, s = _held_out(held_out), start
    while True:
        if combination(s) not in held:
            yield s
        s += 1


def to_video(clips: Sequence[np.ndarray]) -> torch.Tensor:
    """uint8 [T, H, W, 3] clips -> [B, 3, T, H, W] in [-1, 1] (``data pack``'s conversion)."""
    return torch.from_numpy(np.stack(clips)).permute(0, 4, 1, 2, 3).float() / 127.5 - 1.0


def to_uint8(video: torch.Tensor) -> list[np.ndarray]:
    """[B, 3, T, H, W] in [-1, 1] -> uint8 [T, H, W, 3] clips (``generate``'s conversion)."""
    return list(((video.permute(0, 2, 3, 4, 1).clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).numpy())


def vae_loss(vae: WanVAE, video: torch.Tensor, kl_weight: float, noise: torch.Generator | None = None,
             sample: bool = False):
    """(total, reconstruction MSE, KL per latent value) of one batch, decoding the posterior mean
    (``sample``: a posterior sample)."""
    mean, logvar = vae.quant_conv(vae.encoder(video)).chunk(2, dim=1)
    logvar = logvar.clamp(*LOGVAR_RANGE)
    z = mean
    if sample:
        z = mean + torch.exp(0.5 * logvar) * torch.randn(mean.shape, generator=noise, dtype=mean.dtype)
    mse = (vae.decoder(vae.post_quant_conv(z)) - video).pow(2).mean()
    kl = 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).mean()
    return mse + kl_weight * kl, mse, kl


@torch.no_grad()
def latent_stats(vae: WanVAE, seeds: Sequence[int], render: Callable[[int], np.ndarray], batch: int = 8):
    """Per-channel mean and std of the posterior means of clips ``seeds`` (over clips, frames, pixels)."""
    mus = [vae.encode(to_video([render(s) for s in seeds[i:i + batch]])) for i in range(0, len(seeds), batch)]
    mu = torch.cat(mus).transpose(0, 1).reshape(vae.cfg.z_dim, -1).double()
    return mu.mean(1).tolist(), mu.std(1).tolist()


@torch.no_grad()
def evaluate_vae(vae: WanVAE, seeds: Sequence[int], render: Callable[[int], np.ndarray] | None = None,
                 batch: int = 8) -> dict:
    """PSNR (dB, over all pixels in [0, 255]) and the checker's accuracy on
    ``decode(denormalize(normalize(encode(clip))))`` of clips ``seeds``; the originals' accuracy too."""
    render = render or render_clip
    vae.eval()
    originals, recons = [], []
    for i in range(0, len(seeds), batch):
        clips = [render(s) for s in seeds[i:i + batch]]
        z = vae.normalize(vae.encode(to_video(clips)))
        originals += clips
        recons += to_uint8(vae.decode(vae.denormalize(z)))
    err = np.mean([np.mean((a.astype(np.float64) - b) ** 2) for a, b in zip(originals, recons)])
    expected = [combination(s) for s in seeds]
    got, ref = checker.score(recons, expected), checker.score(originals, expected)
    return {"clips": len(seeds), "psnr": float(10 * math.log10(255.0**2 / max(err, 1e-12))),
            "prompt_accuracy": got["prompt_accuracy"], "colour_accuracy": got["colour_accuracy"],
            "direction_accuracy": got["direction_accuracy"], "originals_prompt_accuracy": ref["prompt_accuracy"]}


def fit_vae(vae: WanVAE | VAEComponentConfig | None = None, out: str | Path | None = None, *, steps: int = 1500,
            lr: float = 2e-3, batch: int = 2, seed: int = 0, kl_weight: float = 1e-4, warmup: int = 20,
            frames: int = FRAMES, height: int = HEIGHT, width: int = WIDTH,
            render: Callable[[int], np.ndarray] | None = None, held_out: Sequence[Sequence[str]] | None = None,
            stats_clips: int = 64, eval_clips: int = 64, sample: bool = False, progress: bool = True) -> dict:
    """Fit ``vae`` (a model, trained in place; a ``VAEComponentConfig``; None: ``tiny_vae(seed)``) on
    synthetic clips (``render(seed)`` -> uint8 [T, H, W, 3]; default ``render_clip`` at frames x height
    x width) for ``steps`` AdamW steps of ``batch`` clips (lr warmed up linearly over ``warmup`` steps,
    then cosine to lr / 10), set its latent statistics, evaluate it on ``eval_clips`` unseen clips
    (0: skip) and, given ``out``, save it there as a diffusers folder with ``vae_fit.json``.
    Returns the report (the losses, the statistics, the evaluation, seconds); ``report["vae"]`` is
    the fitted model."""
    if steps < 1 or batch < 1 or stats_clips < 2:
        raise ValueError(f"steps >= 1, batch >= 1, stats_clips >= 2; got {steps}, {batch}, {stats_clips}")
    if vae is None:
        vae = tiny_vae(seed)
    elif not isinstance(vae, WanVAE):
        vae = build_vae(vae)
    render = render or (lambda s: render_clip(s, frames, height, width))
    vae.train().requires_grad_(True)  # a recipe's VAE is built frozen
    optimizer = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)

    def lr_at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        progress_ = (step - warmup) / max(steps - warmup, 1)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress_)))

    noise = torch.Generator().manual_seed(seed)
    stream = train_seeds(FIT_SEED0, held_out)
    losses, mses, kls = [], [], []
    start = time.perf_counter()
    bar = tqdm(range(steps), desc="fit demo VAE", unit="step", disable=not progress)
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        video = to_video([render(next(stream)) for _ in range(batch)])
        loss, mse, kl = vae_loss(vae, video, kl_weight, noise, sample)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        mses.append(mse.item())
        kls.append(kl.item())
        bar.set_postfix(mse=f"{mse.item():.4f}", kl=f"{kl.item():.2f}")
    fit_seconds = time.perf_counter() - start
    vae.eval().requires_grad_(False)

    stats_seeds = [next(stream) for _ in range(stats_clips)]  # fresh clips of the training distribution
    mean, std = latent_stats(vae, stats_seeds, render)
    vae.cfg.latents_mean, vae.cfg.latents_std = mean, [max(s, 1e-6) for s in std]  # a dead channel: no 1/0
    window = max(1, min(20, steps // 5))
    report = {"steps": steps, "batch": batch, "lr": lr, "kl_weight": kl_weight, "sample": sample, "seed": seed,
              "clip": [frames, height, width], "fit_seconds": fit_seconds,
              "mse_first": float(np.mean(mses[:window])), "mse_last": float(np.mean(mses[-window:])),
              "kl_last": float(np.mean(kls[-window:])), "losses": losses, "latents_mean": vae.cfg.latents_mean,
              "latents_std": vae.cfg.latents_std, "stats_seeds": stats_seeds,
              "held_out": sorted(_held_out(held_out)), "fit_seeds_from": FIT_SEED0}
    if eval_clips:
        report["eval"] = evaluate_vae(vae, list(range(EVAL_SEED0, EVAL_SEED0 + eval_clips)), render)
        report["eval"]["seeds"] = [EVAL_SEED0, EVAL_SEED0 + eval_clips - 1]
    report["seconds"] = time.perf_counter() - start
    if out is not None:
        out = Path(out)
        vae.save_diffusers_dir(out)
        (out / "vae_fit.json").write_text(json.dumps(report, indent=1) + "\n")
        report["path"] = str(out)
    report["vae"] = vae
    return report


def main(argv: Sequence[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m omniweave.diffusion.vae_fit", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for the fitted VAE (a diffusers AutoencoderKLWan folder)")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=2, help="clips per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--kl-weight", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--frames", type=int, default=FRAMES, help="clip size: 4k + 1 frames")
    p.add_argument("--height", type=int, default=HEIGHT, help="multiple of 16")
    p.add_argument("--width", type=int, default=WIDTH, help="multiple of 16")
    p.add_argument("--eval-clips", type=int, default=64, help="unseen clips to evaluate on (0: skip)")
    p.add_argument("--no-progress", action="store_true")
    args = p.parse_args(argv)
    report = fit_vae(out=args.out, steps=args.steps, lr=args.lr, batch=args.batch, seed=args.seed,
                     kl_weight=args.kl_weight, frames=args.frames, height=args.height, width=args.width,
                     eval_clips=args.eval_clips, progress=not args.no_progress)
    line = f"VAE fitted in {report['fit_seconds']:.0f} s: mse {report['mse_first']:.4f} -> {report['mse_last']:.4f}"
    if "eval" in report:
        e = report["eval"]
        line += (f"; {e['clips']} unseen clips: PSNR {e['psnr']:.1f} dB, checker {e['prompt_accuracy']:.1%} "
                 f"(originals {e['originals_prompt_accuracy']:.1%})")
    print(f"{line}; saved to {report['path']}", flush=True)
    return report


if __name__ == "__main__":
    main()
