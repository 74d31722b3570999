"""The diffusion demo's VAE stage (omniweave/diffusion/vae_fit.py): a short fit of the tiny Wan VAE
on small synthetic clips (5 x 16 x 16, seconds) lowers the reconstruction error, is saved as a
diffusers folder that a recipe's ``model.vae.path`` loads into the same model (bit for bit), and
carries the measured latent statistics, which ``normalize`` then uses (unit-variance latents)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from omniweave.diffusion import vae_fit
from omniweave.diffusion.demo_data import HELD_OUT, combination, render_clip
from omniweave.models.components.wan_vae import WAN21_LATENTS_STD

SIZE = dict(frames=5, height=16, width=16)


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    out = tmp_path_factory.mktemp("vae_fit") / "vae"
    report = vae_fit.main(["--out", str(out), "--steps", "12", "--batch", "2", "--lr", "3e-3", "--eval-clips", "0",
                           "--frames", "5", "--height", "16", "--width", "16", "--no-progress"])
    return out, report


def clips(seeds):
    return vae_fit.to_video([render_clip(s, **SIZE) for s in seeds])


@pytest.mark.slow  # the shared 12-step fit: ~15 s alone, 40 s on a busy 2-core machine
def test_short_fit_lowers_the_reconstruction_error(fitted):
    _, report = fitted
    assert len(report["losses"]) == 12
    assert report["mse_last"] < 0.7 * report["mse_first"], (report["mse_first"], report["mse_last"])
    assert all(np.isfinite(report["losses"]))


def test_training_clips_skip_the_held_out_combinations():
    seeds = [s for s, _ in zip(vae_fit.train_seeds(), range(64))]
    assert seeds[0] >= vae_fit.FIT_SEED0 > vae_fit.EVAL_SEED0 + 64
    assert not {combination(s) for s in seeds} & set(HELD_OUT)
    assert len({combination(s) for s in seeds}) == 16 - len(HELD_OUT)


@pytest.mark.slow  # the shared 12-step fit: ~15 s alone, 40 s on a busy 2-core machine
def test_saved_vae_loads_through_the_recipe_and_matches_bit_for_bit(fitted):
    from omniweave.config import load_recipe, to_dict
    from omniweave.models.registry import build_component

    out, report = fitted
    assert (out / "config.json").is_file() and (out / "diffusion_pytorch_model.safetensors").is_file()
    assert json.loads((out / "vae_fit.json").read_text())["steps"] == 12
    cfg = load_recipe("tiny_diffusion", [f"model.vae.path={out}"])
    loaded = build_component("vae", to_dict(cfg.model)["vae"])
    ours = report["vae"]
    assert loaded.cfg == ours.cfg
    x = clips([7, 8])
    with torch.no_grad():
        z_ours, z_loaded = ours.normalize(ours.encode(x)), loaded.normalize(loaded.encode(x))
        assert torch.equal(z_ours, z_loaded)
        assert torch.equal(ours.decode(ours.denormalize(z_ours)), loaded.decode(loaded.denormalize(z_loaded)))


@pytest.mark.slow  # the shared 12-step fit: ~15 s alone, 40 s on a busy 2-core machine
def test_latent_statistics_are_written_and_normalise_to_unit_variance(fitted):
    out, report = fitted
    config = json.loads((out / "config.json").read_text())
    assert config["latents_mean"] == report["latents_mean"] and config["latents_std"] == report["latents_std"]
    assert config["latents_std"] != WAN21_LATENTS_STD  # measured, not Wan 2.1's
    vae = report["vae"]
    with torch.no_grad():  # on the clips they were measured on: exactly zero mean, unit std per channel
        z = vae.normalize(vae.encode(clips(report["stats_seeds"]))).transpose(0, 1).reshape(16, -1).double()
    assert z.mean(1).abs().max() < 1e-4
    assert (z.std(1) - 1).abs().max() < 1e-3


def test_evaluate_vae_reports_psnr_and_the_checker():
    vae = vae_fit.tiny_vae(0)  # random: its reconstructions are not read, the originals are
    e = vae_fit.evaluate_vae(vae, [vae_fit.EVAL_SEED0, vae_fit.EVAL_SEED0 + 1])
    assert e["clips"] == 2 and e["originals_prompt_accuracy"] == 1.0
    assert 0 < e["psnr"] < 30 and e["prompt_accuracy"] == 0.0
