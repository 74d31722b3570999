"""The VLA demo's vision pretraining: the backbone's image encoder and projector learn where the
two discs are in the simulator's scenes before the VLA trains (``omniweave demo --vla``).

Pi0.5 starts from PaliGemma, whose SigLIP tower was pretrained on billions of images; the demo's
tiny tower starts from nothing, and neither the flow loss nor a language-model loss teaches it to
see a 4-pixel disc in this budget (docs/vla.md, "The demo": from scratch, success stays at chance
and blanking the camera changes nothing). So the demo pretrains the tower the way vision towers
are pretrained: supervised, on images of its own domain. A ring scene mid-episode (the same
renders the robot data has) goes through the recipe's own image processing, tower and projector;
the mean of the projected image tokens feeds two 8-way linear heads -- the red disc's ring slot
and the blue one's -- trained with cross-entropy. The heads are thrown away; the backbone (tower,
projector and a fresh foundation) is exported as a HF directory for ``train.init_from``.

Measured (docs/vla.md): held-out slot accuracy after pretraining, and the VLA's closed-loop success
with and without it.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import torch

from omniweave.vla.sim import COLOURS, RING_SLOTS, ReachSim, expert_action


def slot_of(point: np.ndarray) -> int:
    """The ring slot (0..7) nearest to a point's direction from the arena's centre."""
    d = np.asarray(point, np.float64) - 0.5
    return int(round(np.arctan2(d[1], d[0]) / (2 * np.pi / RING_SLOTS))) % RING_SLOTS


def scene(seed: int, image_size: int, moves: int) -> tuple[np.ndarray, list[int]]:
    """A ring scene after ``moves`` expert steps (fewer if it ends) and its discs' slots (red, blue)."""
    sim = ReachSim(seed, image_size=image_size, layout="ring")
    for _ in range(moves):
        if sim.done:
            break
        sim.step(expert_action(sim))
    return sim.render(), [slot_of(sim.targets[c]) for c in COLOURS]


def scene_batch(proc, seeds: list[int], image_size: int, rng: np.random.Generator) -> tuple[torch.Tensor, ...]:
    """(pixel_values, grid_thw, slots [N, 2]) of scenes ``seeds`` through the recipe's image processing."""
    from PIL import Image

    from omniweave.data.sample import MediaSpan

    pixels, grids, labels = [], [], []
    for seed in seeds:
        image, slots = scene(seed, image_size, int(rng.integers(0, 5)))
        buf = io.BytesIO()
        Image.fromarray(image).save(buf, format="PNG")
        plan = proc.plan_media("image", buf.getvalue())
        span = MediaSpan(kind="image", part="image", grid_thw=tuple(plan.grid_thw), resized_hw=tuple(plan.resized_hw),
                         start=0, length=plan.num_tokens(proc.vision.merge_size))
        pixels.append(proc.process_media(span, buf.getvalue()))
        grids.append(plan.grid_thw)
        labels.append(slots)
    return (torch.from_numpy(np.concatenate(pixels)), torch.tensor(grids, dtype=torch.long),
            torch.tensor(labels, dtype=torch.long))


def pretrain_vision(out: Path, recipe: str, steps: int, seed: int = 0, batch: int = 32, lr: float = 1e-3,
                    image_size: int = 56, eval_scenes: int = 256) -> tuple[Path, float]:
    """Train ``recipe``'s (a VLM recipe: the VLA's backbone) image encoder and projector on scene
    slots for ``steps`` steps of ``batch`` scenes; export the backbone to ``out/hf``. Returns the
    HF directory and the held-out accuracy (both discs' slots right, over ``eval_scenes`` scenes)."""
    from omniweave.config import load_recipe, recipe_path, to_dict
    from omniweave.data.text.tokenize import SampleProcessor
    from omniweave.models.hf.export import export_hf
    from omniweave.models.registry import build_model

    cfg = load_recipe(recipe_path(recipe), [])
    model_cfg, data_cfg = to_dict(cfg.model), to_dict(cfg.data)
    torch.manual_seed(seed)
    model = build_model(model_cfg)
    model.init_weights()
    proc = SampleProcessor(data_cfg)
    width = model.foundation.config.hidden_size
    heads = torch.nn.Linear(width, len(COLOURS) * RING_SLOTS)
    params = [*model.image_encoder.parameters(), *model.projector.parameters(), *heads.parameters()]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    rng = np.random.default_rng([seed, 11])

    def logits(pixel_values, grid):
        tokens = model.encode_media(pixel_values, grid)  # [N * tokens per image, D] in image order
        per_image = tokens.reshape(len(grid), -1, tokens.shape[-1]).mean(1)
        return heads(per_image).reshape(len(grid), len(COLOURS), RING_SLOTS)

    first_seed = 5_000_000  # apart from the robot dataset's episodes (0 up) and the evaluation's (1e6 up)
    for step in range(steps):
        seeds = list(range(first_seed + step * batch, first_seed + (step + 1) * batch))
        pixel_values, grid, slots = scene_batch(proc, seeds, image_size, rng)
        loss = torch.nn.functional.cross_entropy(logits(pixel_values, grid).flatten(0, 1), slots.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if (step + 1) % 50 == 0 or step + 1 == steps:
            print(f"vision pretraining step {step + 1}/{steps} | loss {loss.item():.4f}", flush=True)
    with torch.no_grad():
        held_out = list(range(first_seed - eval_scenes, first_seed))
        pixel_values, grid, slots = scene_batch(proc, held_out, image_size, rng)
        accuracy = float((logits(pixel_values, grid).argmax(-1) == slots).all(-1).float().mean())
    hf = export_hf(model, model_cfg, out / "hf", data_cfg=data_cfg) or out / "hf"
    return Path(hf), accuracy
