"""The rectified-flow objective over packed clips: its loss equals a per-clip dense reference (the
generator on each clip alone, the same draws), the draws depend only on (seed, step, clip), caption
dropout feeds the encoded empty prompt, and a generator recipe builds a DiffusionModel."""

from __future__ import annotations

import pytest
import torch

from omniweave.diffusion import schedule
from omniweave.diffusion.objective import DiffusionObjective, clip_draw
from omniweave.models.components.wan_dit import WanDiT, WanDiTConfig, patchify_clips
from omniweave.models.diffusion import DiffusionModel
from omniweave.models.registry import build_model

TINY = dict(in_channels=3, out_channels=3, num_attention_heads=2, attention_head_dim=12, text_dim=10, freq_dim=16,
            ffn_dim=20, num_layers=2)


def _model(seed=0):
    torch.manual_seed(seed)
    gen = WanDiT(WanDiTConfig(**TINY, attn_backend="math"))
    with torch.no_grad():  # the official init zeroes proj_out: randomise so the velocity depends on the input
        for p in gen.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return DiffusionModel(gen)


def _row(samples=(11, 5, 42), shapes=((3, 4, 6), (1, 6, 2), (2, 2, 4)), text_lens=(4, 7, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    latents = [torch.randn(3, *s, generator=g) for s in shapes]
    tokens, grid = patchify_clips(latents, (1, 2, 2))
    text = torch.randn(sum(text_lens), 10, generator=g)
    tcu = torch.tensor([0, *torch.tensor(text_lens).cumsum(0).tolist()], dtype=torch.int32)
    return {"latents": tokens, "grid": grid, "text": text, "text_cu_seqlens": tcu,
            "clip_samples": torch.tensor(samples), "empty_text": torch.randn(2, 10, generator=g)}


def _reference_loss(model, row, objective, step):
    """Each clip alone through the generator with its own draw; Σ w · Σ (v − (noise − x0))²."""
    total, start = torch.zeros((), dtype=torch.float64), 0
    tcu = row["text_cu_seqlens"]
    for m, sample in enumerate(row["clip_samples"].tolist()):
        n = int(row["grid"][m].prod())
        x0 = row["latents"][start:start + n]
        sigma, noise, drop = clip_draw(sample, objective.seed, step, n, x0.shape[1], shift=objective.shift,
                                       sampling=objective.sampling, caption_dropout=objective.caption_dropout)
        text = row["empty_text"] if drop else row["text"][int(tcu[m]):int(tcu[m + 1])]
        x_t = sigma * noise + (1 - sigma) * x0
        v = model.generator(x_t, row["grid"][m:m + 1], torch.tensor([sigma * 1000]), text,
                            torch.tensor([0, text.shape[0]], dtype=torch.int32))
        w = schedule.loss_weights(torch.tensor([sigma]), objective.weighting, shift=objective.shift)[0]
        total += float(w) * ((v - (noise - x0)) ** 2).sum().double()
        start += n
    return total


@pytest.mark.parametrize("weighting,dropout", [("none", 0.0), ("bell", 0.0), ("cosmap", 0.5)])
def test_packed_loss_equals_per_clip_reference(weighting, dropout):
    model, row = _model(), _row()
    objective = DiffusionObjective(seed=3, step=lambda: 7, shift=3.0, loss_weighting=weighting, caption_dropout=dropout)
    with torch.no_grad():
        loss, stats = model(row, head=objective.head(objective.row_inputs(model, row)))
        ref = _reference_loss(model, row, objective, step=7)
    assert stats["latent_values"] == row["latents"].numel() == objective.count([row])
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=0)
    assert loss > 0


def test_draws_follow_the_clip_not_its_place():
    model = _model()
    objective = DiffusionObjective(seed=1, step=lambda: 4, shift=5.0)
    row = _row()
    order = [2, 0, 1]
    shapes = ((3, 4, 6), (1, 6, 2), (2, 2, 4))
    reordered = _row(samples=[(11, 5, 42)[i] for i in order], shapes=[shapes[i] for i in order],
                     text_lens=[(4, 7, 3)[i] for i in order])
    # the same clip content in another order: rebuild from the original row's pieces
    starts = [0, *row["grid"].prod(1).cumsum(0).tolist()]
    tstarts = row["text_cu_seqlens"].tolist()
    reordered["latents"] = torch.cat([row["latents"][starts[i]:starts[i + 1]] for i in order])
    reordered["text"] = torch.cat([row["text"][tstarts[i]:tstarts[i + 1]] for i in order])
    with torch.no_grad():
        a, _ = model(row, head=objective.head(objective.row_inputs(model, row)))
        b, _ = model(reordered, head=objective.head(objective.row_inputs(model, reordered)))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=0)
    later = DiffusionObjective(seed=1, step=lambda: 5, shift=5.0)
    assert not torch.equal(objective.row_inputs(model, row)["noisy"], later.row_inputs(model, row)["noisy"])


def test_caption_dropout_feeds_the_empty_prompt():
    model, row = _model(), _row()
    always = DiffusionObjective(caption_dropout=1.0).row_inputs(model, row)
    assert torch.equal(always["text"], row["empty_text"].repeat(3, 1))
    assert always["text_cu_seqlens"].tolist() == [0, 2, 4, 6] and always["captions_dropped"] == 3
    never = DiffusionObjective(caption_dropout=0.0).row_inputs(model, row)
    assert torch.equal(never["text"], row["text"]) and never["captions_dropped"] == 0
    drops = [clip_draw(s, 0, 0, 1, 1, shift=3.0, sampling="uniform", caption_dropout=0.2)[2] for s in range(2000)]
    assert 0.17 < sum(drops) / len(drops) < 0.23


def test_gradients_reach_every_generator_weight():
    model, row = _model(), _row()
    objective = DiffusionObjective(seed=0, shift=3.0)
    loss, _ = model(row, head=objective.head(objective.row_inputs(model, row)))
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing


def test_rows_without_latents_and_bad_settings_are_clear_errors():
    model = _model()
    with pytest.raises(ValueError, match="lacks latents"):
        DiffusionObjective().row_inputs(model, {k: v for k, v in _row().items() if k != "latents"})
    with pytest.raises(ValueError, match="caption_dropout"):
        DiffusionObjective(caption_dropout=1.5)
    with pytest.raises(ValueError, match="loss weighting 'snr'"):
        DiffusionObjective(loss_weighting="snr")
    with pytest.raises(ValueError, match="timestep_sampling"):
        DiffusionObjective(timestep_sampling="beta")


def test_generator_recipe_builds_a_diffusion_model():
    model = build_model({"generator": {"name": "wan_dit", **TINY}})
    assert isinstance(model, DiffusionModel) and isinstance(model.generator, WanDiT)
    with pytest.raises(KeyError, match="trains alone"):
        build_model({"generator": {"name": "wan_dit", **TINY}, "foundation": {"name": "decoder"}})


@pytest.mark.parametrize("name", ["wan2_1_t2v_1_3b", "wan2_1_t2v_14b", "wan_dit_tiny"])
def test_generator_configs_match_diffusers_shapes(name):
    """Each shipped generator YAML builds (on the meta device) a DiT with exactly the parameter
    shapes of diffusers' WanTransformer3DModel of the same config (names through hf/wan.py)."""
    from pathlib import Path

    import yaml
    from diffusers import WanTransformer3DModel

    from omniweave.models.hf.wan import config_to_diffusers, ours_to_diffusers
    from omniweave.models.registry import build_component

    cfg = yaml.safe_load((Path(__file__).parents[1] / f"omniweave/configs/models/generator/{name}.yaml").read_text())
    with torch.device("meta"):
        ours = build_component("generator", cfg)
        ref = WanTransformer3DModel(**{k: v for k, v in config_to_diffusers(ours.config).items()
                                       if not k.startswith("_")})
    mapped = ours_to_diffusers(ours.state_dict())
    assert {k: tuple(v.shape) for k, v in mapped.items()} == {k: tuple(v.shape) for k, v in ref.state_dict().items()}
