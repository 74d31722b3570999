"""DiffusionModel: a video-diffusion generator (a DiT, ``model.generator``) behind the trainer's
model contract (``model(batch, head=...)``), as VLAModel puts an action expert behind it.

A row holds M clips' latent tokens (patchified, normalised VAE latents, clip after clip) with
their text states; the objective (diffusion/objective.py) draws each clip's sigma and noise and
hands the noisy row here:

    row_inputs:  noisy [T, C_in·p]   target [T, C·p]   timesteps [M]   weights [M]
                 grid [M, 3]      text [S, D_text]  text_cu_seqlens [M+1]
                 image-to-video: image [N, image_dim]  image_cu_seqlens [M+1]
                 (noisy then holds each token's conditioning after its noisy values: C_in = 2C + 4)
    flow_loss:   Σ_clips weight_m · Σ_tokens of m, values (generator(noisy) − target)²,  count = T·C·p

The VAE and the text encoder are not part of this module: they run offline when packing and at
sampling time (registry.DIFFUSION_SECTIONS).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from omniweave.models.components.flow import FlowLoss
from omniweave.models.components.wan_dit import clip_index


class DiffusionModel(nn.Module):
    def __init__(self, generator: nn.Module):
        super().__init__()
        self.generator = generator

    def init_weights(self) -> None:
        self.generator.init_weights()

    def forward(self, batch: dict, head=None):
        """``head(model, None, batch)``: the objective's loss (it calls :meth:`flow_loss` with its
        row inputs); without a head, the velocity of ``batch`` (keys of :meth:`velocity`)."""
        if head is None:
            return self.velocity(batch["noisy"], batch["grid"], batch["timesteps"], batch["text"],
                                 batch["text_cu_seqlens"], batch.get("image"), batch.get("image_cu_seqlens"))
        return head(self, None, batch)

    def velocity(self, noisy: Tensor, grid: Tensor, timesteps: Tensor, text: Tensor, text_cu_seqlens: Tensor,
                 image: Tensor | None = None, image_cu_seqlens: Tensor | None = None) -> Tensor:
        if image is None and image_cu_seqlens is None:  # text-to-video: the generator's call as it always was
            return self.generator(noisy, grid, timesteps, text, text_cu_seqlens)
        return self.generator(noisy, grid, timesteps, text, text_cu_seqlens, image=image,
                              image_cu_seqlens=image_cu_seqlens)

    def flow_loss(self, row: dict) -> FlowLoss:
        """The row's weighted squared velocity error (module docstring), summed in float32. Under
        sequence parallelism (``parallel.cp``) the generator returns its rank's rows only, and the
        sum and count are those rows' (the ranks' add up to the row's)."""
        v = self.velocity(row["noisy"], row["grid"], row["timesteps"], row["text"], row["text_cu_seqlens"],
                          row.get("image"), row.get("image_cu_seqlens"))
        mine = self.generator.local_slice(row["target"].shape[0])
        target = row["target"][mine]
        sq = (v.float() - target.float()).pow(2).sum(dim=1)  # [T] (this rank's rows)
        total = (sq * row["weights"].float()[clip_index(row["grid"])[mine]]).sum()
        count = torch.tensor(target.numel(), device=total.device)
        return FlowLoss(total / count.clamp_min(1), total, count)

    def row_share(self) -> float:
        """1 on the rank that counts a row's per-row statistics (captions dropped), 0 on the other
        ranks of its sequence-parallel group, which hold the same row."""
        split = self.generator.sequence_split
        return 1.0 if split is None or split.rank == 0 else 0.0
