"""Feed-forward blocks: SwiGLU (LLM decoders, Qwen2.5-VL ViT) and a plain two-layer MLP (Qwen2-VL ViT).

Parameter names follow Hugging Face (``gate_proj/up_proj/down_proj``, ``fc1/fc2``) so that
state-dict adapters are mostly prefix changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": quick_gelu,
}


def activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; choose from {', '.join(ACTIVATIONS)}")
    return ACTIVATIONS[name]


class SwiGLU(nn.Module):
    """down(act(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int, bias: bool = False, act: str = "silu"):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class MLP(nn.Module):
    """fc2(act(fc1(x))); ``act="quick_gelu"`` for the Qwen2-VL ViT."""

    def __init__(self, dim: int, hidden: int, act: str = "quick_gelu", bias: bool = True):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, bias=bias)
        self.fc2 = nn.Linear(hidden, dim, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))
