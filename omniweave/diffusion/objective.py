"""Rectified flow as a training objective: the loss of a row of packed video-diffusion clips.

    loss  = Σ_clips w(sigma_m) · Σ_tokens, values (v_pred − (noise − x0))²
    count = Σ_clips tokens · values per token                  (the global normaliser)

so a step's loss is the weighted mean squared velocity error over every latent value of the
global batch, whatever the layout and however the clips are packed (a long clip weighs as many
values as it has; DiffSynth's per-clip mean is the same for equal clips). Each clip's draw -- its
sigma (diffusion/schedule.py: the shifted table, uniform or SD3 densities), its noise, and whether
its caption is dropped for classifier-free guidance -- comes from a generator seeded by
(train.seed, step, the clip's sample index), as the VLA objective seeds its chunks: every layout,
rank count and resume draws the same numbers, and a clip seen again later gets a new draw. A
dropped caption is replaced by the encoded empty prompt the pack stores (``empty_text``), which
is what sampling's negative branch feeds (reach_anchors 4.5), not by zeros.

Row keys (what the loader puts in a row): ``latents [T, C·p]`` (patchified, normalised), ``grid
[M, 3]``, ``text [S, D]``, ``text_cu_seqlens [M+1]``, ``clip_samples [M]``, ``empty_text [E, D]``.

Image-to-video (an I2V generator: ``image_dim`` set) rows also hold ``cond [T, (4 + C)·p]`` (each
clip's first-frame mask and conditioning latent, diffusion/data.py ``i2v_condition``), ``image [N,
image_dim]`` and ``image_cu_seqlens [M+1]``. The DiT's input per token is then cat(noisy, cond) along
the feature dim -- the patch of diffusers' channel-concatenated [noisy 16 | mask 4 | cond 16] latent,
since a token's values are channel-major -- and the image features go beside the text; the target
stays the C-channel velocity. A dropped caption drops the text only: the image is always kept, as
Wan trains I2V. The draws are those of text-to-video (the same seeds, the same numbers).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from omniweave.diffusion import schedule
from omniweave.models.components.wan_dit import clip_index
from omniweave.train.objective import Objective, Target, draw_seed

ROW_KEYS = ("latents", "grid", "text", "text_cu_seqlens", "clip_samples", "empty_text")
I2V_ROW_KEYS = ("cond", "image", "image_cu_seqlens")


def clip_draw(sample: int, seed: int, step: int, tokens: int, width: int, *, shift: float, sampling: str,
              caption_dropout: float, logit_mean: float = 0.0, logit_std: float = 1.0) -> tuple[float, Tensor, bool]:
    """(sigma, noise float32 [tokens, width], drop the caption?) of one clip, from its own CPU
    generator: the same numbers on any device and layout."""
    g = torch.Generator().manual_seed(draw_seed(seed, step, sample))
    sigma = float(schedule.sample_train_sigmas(1, g, shift=shift, sampling=sampling, logit_mean=logit_mean,
                                               logit_std=logit_std)[0])
    noise = torch.randn(tokens, width, generator=g)
    drop = bool(torch.rand((), generator=g) < caption_dropout) if caption_dropout > 0 else False
    return sigma, noise, drop


def i2v_input(noisy: Tensor, cond: Tensor) -> Tensor:
    """The I2V DiT's input tokens ``[T, (2C + 4)·p]``: each token's noisy values, then its conditioning
    (mask, latent). Equal to patchifying the channel-concatenated latent (module docstring)."""
    if noisy.shape[0] != cond.shape[0]:
        raise ValueError(f"cond {tuple(cond.shape)} does not match the latents {tuple(noisy.shape)} token for token")
    return torch.cat([noisy, cond.to(noisy.dtype)], dim=1)


class DiffusionObjective(Objective):
    name = "rectified_flow"
    stat_keys = ("flow_sse", "latent_values", "captions_dropped")

    def __init__(self, seed: int = 0, step: Callable[[], int] = lambda: 0, *, shift: float = 3.0,
                 timestep_sampling: str = "uniform", logit_mean: float = 0.0, logit_std: float = 1.0,
                 loss_weighting: str = "none", caption_dropout: float = 0.0,
                 text_flops: Callable[..., float] | None = None):
        """``step()``: the optimizer step being computed (part of every draw's seed); ``text_flops(clip
        tokens, text tokens[, image tokens])``: the generator's FLOPs that scale with the text and the
        image features (``metrics.cross_attention_flops``)."""
        if not 0.0 <= caption_dropout <= 1.0:
            raise ValueError(f"caption_dropout must be in [0, 1], got {caption_dropout}")
        if loss_weighting not in schedule.LOSS_WEIGHTING:
            raise ValueError(f"loss weighting {loss_weighting!r}: choose from {', '.join(schedule.LOSS_WEIGHTING)}")
        if timestep_sampling not in schedule.TIMESTEP_SAMPLING:
            raise ValueError(f"timestep_sampling {timestep_sampling!r}: choose from "
                             f"{', '.join(schedule.TIMESTEP_SAMPLING)}")
        self.seed, self.step = int(seed), step
        self.shift, self.sampling, self.weighting = float(shift), timestep_sampling, loss_weighting
        self.logit_mean, self.logit_std, self.caption_dropout = float(logit_mean), float(logit_std), float(caption_dropout)
        self.text_flops = text_flops

    def count(self, packs: list[dict]) -> float:
        return float(sum(p["latents"].numel() for p in packs))

    def flops(self, packs: list[dict]) -> float:
        """The cross-attention's share (the per-token and self-attention FLOPs are the trainer's)."""
        if self.text_flops is None:
            return 0.0
        clips = [int(n) for p in packs for n in p["grid"].prod(dim=1)]
        texts = [int(n) for p in packs for n in p["text_cu_seqlens"].diff()]
        if not all("image_cu_seqlens" in p for p in packs):
            return self.text_flops(clips, texts)
        images = [int(n) for p in packs for n in p["image_cu_seqlens"].diff()]
        return self.text_flops(clips, texts, images)

    def row_inputs(self, model, mb: dict) -> dict[str, Tensor]:
        """The row's noisy latents (for I2V: with each token's conditioning after them), targets,
        timesteps, weights, (caption-dropped) text and, for I2V, image features."""
        missing = [k for k in ROW_KEYS if k not in mb]
        if missing:
            raise ValueError(f"train.phase=diffusion needs rows of packed clip latents; this row lacks "
                             f"{', '.join(missing)} (pack clips with a diffusion recipe: docs/diffusion.md)")
        i2v = any(k in mb for k in I2V_ROW_KEYS)
        if i2v and any(k not in mb for k in I2V_ROW_KEYS):
            raise ValueError(f"an image-to-video row needs {', '.join(I2V_ROW_KEYS)}; this one has "
                             f"{', '.join(k for k in I2V_ROW_KEYS if k in mb)}")
        config = getattr(getattr(model, "generator", None), "config", None)  # the model may be None (a pipeline's)
        if config is not None and (getattr(config, "image_dim", None) is not None) != i2v:
            raise ValueError("an image-to-video generator trains on packs made by an I2V recipe (cond / image "
                             "arrays), a text-to-video one on T2V packs; this row is "
                             f"{'I2V' if i2v else 'T2V'} (docs/diffusion.md)")
        x0, grid, text, tcu = mb["latents"], mb["grid"], mb["text"], mb["text_cu_seqlens"]
        sizes = grid.to(torch.long).prod(dim=1).tolist()
        sigmas, noises, texts, lengths, dropped = [], [], [], [], 0
        for m, (sample, n) in enumerate(zip(mb["clip_samples"].tolist(), sizes)):
            sigma, noise, drop = clip_draw(int(sample), self.seed, self.step(), n, x0.shape[1], shift=self.shift,
                                           sampling=self.sampling, caption_dropout=self.caption_dropout,
                                           logit_mean=self.logit_mean, logit_std=self.logit_std)
            sigmas.append(sigma)
            noises.append(noise)
            states = mb["empty_text"] if drop else text[int(tcu[m]):int(tcu[m + 1])]
            texts.append(states)
            lengths.append(states.shape[0])
            dropped += drop
        sigma = torch.tensor(sigmas, dtype=torch.float32, device=x0.device)
        noise = torch.cat(noises).to(x0.device, torch.float32) if noises else torch.zeros_like(x0, dtype=torch.float32)
        per_token = sigma[clip_index(grid).to(x0.device)][:, None]
        noisy, target = schedule.noisy_latents(x0.float(), noise, per_token)
        text_cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=x0.device)
        row = {"noisy": noisy.to(x0.dtype), "target": target, "timesteps": sigma * 1000, "grid": grid,
               "weights": schedule.loss_weights(sigma, self.weighting, shift=self.shift),
               "text": torch.cat(texts) if texts else text, "text_cu_seqlens": text_cu,
               "captions_dropped": torch.tensor(float(dropped), device=x0.device)}
        if i2v:  # [noisy C | mask 4 | cond C] per token (module docstring); the image kept even without the caption
            row["noisy"] = i2v_input(row["noisy"], mb["cond"])
            row["image"], row["image_cu_seqlens"] = mb["image"], mb["image_cu_seqlens"]
        return row

    def head(self, row: dict[str, Tensor]):
        """The row's (loss sum, stats); a diffusion row has no token labels, so no :class:`Target` of them."""
        return lambda model, _, batch: self.loss(model, None, Target(labels=torch.zeros(0, dtype=torch.long), row=row))

    def loss(self, model, _, target: Target) -> tuple[Tensor, dict[str, Tensor]]:
        flow = model.flow_loss(target.row)
        return flow.sum, {"flow_sse": flow.sum.detach(), "latent_values": flow.count.to(torch.float32),
                          "captions_dropped": target.row["captions_dropped"] * model.row_share()}

    def metrics(self, out: dict) -> dict:
        values = float(out.get("latent_values", 0.0))
        return {"flow_loss": float(out["flow_sse"]) / values if values else 0.0,
                "captions_dropped": int(out.get("captions_dropped", 0))}
