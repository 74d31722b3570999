"""The full-size Wan 2.1 recipes (wan2_1_t2v_1_3b, wan2_1_t2v_14b, wan2_1_i2v_14b) compose with their local
checkpoint paths overridden, wire exactly the shipped generator YAMLs (whose diffusers shapes
tests/test_diffusion_objective.py::test_generator_configs_match_diffusers_shapes and
tests/test_wan_i2v.py::test_i2v_14b_yaml_is_diffusers_config_and_parameter_count check) and build on the meta
device with diffusers' parameter counts (docs/diffusion.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from omniweave.config import load_recipe, to_dict
from omniweave.models.registry import build_model

REPO = Path(__file__).resolve().parents[1]

# recipe -> (generator YAML, diffusers' parameter count of that transformer, has an image conditioner)
WAN = {
    "wan2_1_t2v_1_3b": ("wan2_1_t2v_1_3b", 1_418_996_800, False),
    "wan2_1_t2v_14b": ("wan2_1_t2v_14b", 14_288_491_584, False),
    "wan2_1_i2v_14b": ("wan2_1_i2v_14b", 16_394_878_784, True),
}


def _load(name: str, root: Path = Path("/ckpt/Wan2.1-Diffusers")):
    overrides = [f"data.path={root}/packed", f"model.vae.path={root}", f"model.text_encoder.path={root}",
                 f"train.init_from={root}", f"output_dir={root}/run"]
    if WAN[name][2]:
        overrides.append(f"model.image_conditioner.path={root}")
    return load_recipe(name, overrides)


@pytest.mark.parametrize("name", list(WAN))
def test_wan_recipe_loads_with_its_paths_and_trains_as_wan(name):
    from omniweave.data.text.tokenize import SampleRejected
    from omniweave.diffusion.data import DiffusionSettings, check_recipe, clip_plan, codecs_of

    root = Path("/ckpt/Wan2.1-Diffusers")
    cfg = _load(name, root)
    model = to_dict(cfg.model)
    # the overrides reach every path the recipe reads
    assert (cfg.data.path, cfg.train.init_from) == (f"{root}/packed", str(root))
    assert model["vae"]["path"] == model["text_encoder"]["path"] == str(root)
    assert (model.get("image_conditioner") or {}).get("path") == (str(root) if WAN[name][2] else None)
    # the shipped defaults point at one local *-Diffusers folder, the data path is required
    raw = load_recipe(name)
    folders = {raw.model.vae.path, raw.model.text_encoder.path, raw.train.init_from}
    if WAN[name][2]:
        folders.add(raw.model.image_conditioner.path)
    assert len(folders) == 1 and next(iter(folders)).endswith("-Diffusers"), folders
    assert OmegaConf.is_missing(raw.data, "path")
    # Wan 2.1's training settings (480p, 81 frames at 16 fps, umT5's 512 text tokens)
    settings = DiffusionSettings.from_mapping(to_dict(cfg.data)["diffusion"])
    assert (settings.frames, settings.fps, settings.max_pixels, settings.text_len) == (81, 16, 832 * 480, 512)
    assert cfg.data.max_len == 21 * 30 * 52  # one 81-frame 832 x 480 clip's latent tokens
    # a 6 s 1920 x 1080 clip at 30 fps: 81 frames 16 fps apart, scaled to 832 x 464 (16:9 within 832 x 480),
    # one row or less; 4 s at 16 fps is 64 frames: too short
    plan = clip_plan({"frames": 180, "fps": 30, "height": 1080, "width": 1920}, settings)
    assert (len(plan.frames), plan.frames[-1], plan.height, plan.width) == (81, 150, 464, 832)
    assert plan.tokens(tuple(model["generator"]["patch_size"])) == 21 * 29 * 52 <= cfg.data.max_len
    with pytest.raises(SampleRejected, match="too_short"):
        clip_plan({"frames": 64, "fps": 16, "height": 480, "width": 832}, settings)
    assert (cfg.train.phase, cfg.train.precision, cfg.train.ac) == ("diffusion", "bf16", "full")
    assert (cfg.train.diffusion.shift, cfg.train.diffusion.caption_dropout) == (3.0, 0.1)
    check_recipe(model, "diffusion")  # generator + VAE + text encoder (+ the image conditioner an I2V DiT needs)
    codecs = codecs_of(model)
    assert codecs["vae"]["path"] == str(root) and ("image_conditioner" in codecs) == WAN[name][2]


@pytest.mark.parametrize("name", list(WAN))
def test_wan_recipe_generator_is_the_shipped_yaml_and_builds_on_meta(name):
    """The recipe's generator section is the component YAML the diffusers-shape tests check (module
    docstring), unchanged; the model builds on the meta device (nothing materialised) with diffusers'
    parameter count, and train.ac wraps every block."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from omniweave.models.diffusion import DiffusionModel
    from omniweave.parallel.fsdp import apply_ac

    component, count, _ = WAN[name]
    cfg = _load(name)
    shipped = yaml.safe_load((REPO / f"omniweave/configs/models/generator/{component}.yaml").read_text())
    assert to_dict(cfg.model.generator) == shipped
    with torch.device("meta"):
        model = build_model(to_dict(cfg.model))
    assert isinstance(model, DiffusionModel)
    n = sum(p.numel() for p in model.parameters())
    print(f"{name}: {n:,} parameters on meta")
    assert n == count
    apply_ac(model, cfg.train.ac)
    assert sum(isinstance(b, CheckpointWrapper) for b in model.generator.blocks) == shipped["num_layers"]
