"""The full-size Wan 2.1 recipes (wan2_1_t2v_1_3b, wan2_1_t2v_14b, wan2_1_i2v_14b) compose with their local
checkpoint paths overridden, wire exactly the shipped generator YAMLs (whose diffusers shapes
tests/test_diffusion_objective.py::test_generator_configs_match_diffusers_shapes and
tests/test_wan_i2v.py::test_i2v_14b_yaml_is_diffusers_config_and_parameter_count check) and build on the meta
device with diffusers' parameter counts; activation checkpointing of the DiT's blocks (train.ac full /
selective, parallel/fsdp.py apply_ac) changes neither the flow loss nor any gradient (docs/diffusion.md)."""

from __future__ import annotations

import copy
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


# ---------------------------------------------------------------------------- activation checkpointing


def _tiny(name: str) -> torch.nn.Module:
    """The tiny recipe's DiffusionModel, 3 blocks (selective AC then wraps blocks 0 and 2, not 1), with
    random weights everywhere (the official init zeroes proj_out and the gradients above it)."""
    from tests.test_wan_dit import _randomise

    torch.manual_seed(0)
    model = build_model(to_dict(load_recipe(name, ["model.generator.num_layers=3"]).model))
    _randomise(model, seed=0)
    return model


def _packed_row(generator, i2v: bool) -> dict:
    """One packed row of three clips of different sizes (latent frames x height x width in tokens), each
    with its own caption states; I2V rows add each token's conditioning and each clip's image features."""
    cfg = generator.config
    g = torch.Generator().manual_seed(1)
    grids, text_lens = [(3, 2, 3), (1, 4, 2), (2, 3, 1)], [5, 9, 3]
    p = cfg.patch_size[0] * cfg.patch_size[1] * cfg.patch_size[2]
    tokens = sum(t * h * w for t, h, w in grids)
    row = {"latents": torch.randn(tokens, cfg.out_channels * p, generator=g),
           "grid": torch.tensor(grids), "text": torch.randn(sum(text_lens), cfg.text_dim, generator=g),
           "text_cu_seqlens": torch.tensor([0, *torch.tensor(text_lens).cumsum(0).tolist()], dtype=torch.int32),
           "clip_samples": torch.tensor([4, 17, 9]), "empty_text": torch.randn(2, cfg.text_dim, generator=g)}
    if i2v:
        row["cond"] = torch.randn(tokens, (cfg.in_channels - cfg.out_channels) * p, generator=g)
        row["image"] = torch.randn(3 * 26, cfg.image_dim, generator=g)  # clip_tiny: 26 tokens an image
        row["image_cu_seqlens"] = torch.tensor([0, 26, 52, 78], dtype=torch.int32)
    return row


def _loss_and_grads(model, row) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from omniweave.diffusion.objective import DiffusionObjective

    objective = DiffusionObjective(seed=5, step=lambda: 3, shift=3.0, caption_dropout=0.4)
    model.zero_grad(set_to_none=True)
    loss, _ = model(row, head=objective.head(objective.row_inputs(model, row)))
    loss.backward()
    return loss.detach(), {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("recipe", ["tiny_diffusion", "tiny_diffusion_i2v"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_changes_neither_loss_nor_gradients(recipe, mode):
    """fp32: the same packed row through the tiny DiT with and without apply_ac(mode) -- the wrapped blocks
    really run again in the backward, the flow loss is bit-identical, every parameter's gradient within 1e-6
    (and none missing or all zero)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from omniweave.parallel.fsdp import apply_ac

    plain = _tiny(recipe)
    checkpointed = copy.deepcopy(plain)
    apply_ac(checkpointed, mode)
    wrapped = [isinstance(b, CheckpointWrapper) for b in checkpointed.generator.blocks]
    assert wrapped == ([True] * 3 if mode == "full" else [True, False, True])
    # each block's forward starts twice when checkpointed: again in the backward (a pre-hook: torch stops the
    # recompute as soon as it has the saved tensors, so a forward hook would not see it)
    calls = [0] * len(wrapped)
    for i, block in enumerate(checkpointed.generator.blocks):
        inner = block._checkpoint_wrapped_module if wrapped[i] else block
        inner.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    row = _packed_row(plain.generator, i2v=recipe.endswith("i2v"))
    loss, grads = _loss_and_grads(plain, row)
    loss_ac, grads_ac = _loss_and_grads(checkpointed, row)
    assert calls == [2 if w else 1 for w in wrapped]
    assert grads.keys() == grads_ac.keys()
    assert all(g is not None and g.abs().sum() > 0 for g in grads.values())
    worst = max((grads[k] - grads_ac[k]).abs().max().item() for k in grads)
    print(f"{recipe} ac={mode}: loss {loss.item():.6f} vs {loss_ac.item():.6f}, "
          f"max |grad difference| {worst:.3g} over {len(grads)} tensors")
    assert torch.equal(loss, loss_ac)
    assert worst <= 1e-6
