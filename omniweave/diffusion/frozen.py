"""The base of the diffusion codecs that wrap a transformers model (the umT5 text encoder, the CLIP
image conditioner): frozen -- always in eval mode, whatever a parent's ``train()`` asks -- with the
device and dtype of the wrapped ``self.model`` (transformers' dtype: its first floating parameter's,
as the diffusers pipelines read it)."""

from __future__ import annotations

import torch
from torch import nn


class FrozenCodec(nn.Module):
    model: nn.Module

    def train(self, mode: bool = True) -> FrozenCodec:
        return super().train(False)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype
