"""RMSNorm, computed in float32 like the Hugging Face Qwen2 / Llama implementations."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm whose weight is stored as w − 1: x̂ · (1 + w), in float32 then cast (Qwen3.5 /
    Qwen3-Next's decoder norms, HF Qwen3_5RMSNorm; Gemma's, HF GemmaRMSNorm); weight init zeros."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.weight)
