"""Adaptive RMSNorm (adaRMS): the time-conditioned norms of Pi0.5's action expert.

Every norm of the expert (``input_layernorm``, ``post_attention_layernorm``, the final ``norm``)
is an :class:`AdaRMSNorm`: the flow-matching time's conditioning vector ``cond`` sets a per-sample
scale, shift and residual gate (openpi's patched ``GemmaRMSNorm``; lerobot 0.4.4
``policies/pi05``). The backbone's norms stay plain, and its residuals ungated.

Initialisation: the modulation ``dense`` has its weight *and* bias zero-initialised, as openpi's
JAX code does, so at step 0 the norm is a plain RMS norm (scale 1, shift 0) and the gate is 0. The
PyTorch port in lerobot zeroes only the weight and leaves the bias at ``nn.Linear``'s default; that
is harmless when loading ``pi05_base`` but means step 0 of a run from scratch is not identity.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class AdaRMSNorm(nn.Module):
    """RMS norm whose scale, shift and residual gate come from ``cond``; no ``weight`` parameter.

    ``forward(x, cond) -> (y, gate)`` with ``(scale, shift, gate) = dense(cond).chunk(3, -1)`` and
    ``y = rms(x) · (1 + scale) + shift``. The variance and the modulation are computed in float32
    (as openpi does), then ``y`` and ``gate`` are cast to ``x``'s dtype.

    ``cond`` is per sample: ``x`` [B, T, D] takes ``cond`` [B, cond_dim] (broadcast over T); a
    packed row ``x`` [L, D] takes a per-token ``cond`` [L, cond_dim], each token carrying its own
    sample's conditioning.
    """

    def __init__(self, dim: int, cond_dim: int, eps: float = 1e-6):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.dense = nn.Linear(cond_dim, 3 * dim, bias=True)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Zero the modulation (weight and bias): identity scale, zero shift, zero gate. A model's
        ``init_weights`` that draws every ``nn.Linear`` must call this after that pass."""
        nn.init.zeros_(self.dense.weight)
        nn.init.zeros_(self.dense.bias)

    def forward(self, x: Tensor, cond: Tensor) -> tuple[Tensor, Tensor]:
        modulation = self.dense(cond)  # [B or L, 3·D]
        # [B, 3·D] against x [B, T, D]: one modulation per sample, broadcast over its tokens.
        extra = x.dim() - modulation.dim()
        if extra < 0:
            raise ValueError(f"cond {tuple(cond.shape)} has more dims than x {tuple(x.shape)}")
        modulation = modulation.reshape(modulation.shape[0], *([1] * extra), modulation.shape[-1])
        acc = torch.promote_types(x.dtype, torch.float32)  # fp32 (fp64 for fp64 inputs: tests)
        scale, shift, gate = modulation.to(acc).chunk(3, dim=-1)
        xf = x.to(acc)
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = normed * (1.0 + scale) + shift
        return y.to(x.dtype), gate.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, cond_dim={self.dense.in_features}, eps={self.eps}"


def gated_residual(x: Tensor, y: Tensor, gate: Tensor | None) -> Tensor:
    """The residual ``x + y · gate`` of an adaRMS layer; plain ``x + y`` where ``gate`` is None
    (the backbone's layers, whose norms are not adaptive)."""
    if gate is None:
        return x + y
    return x + y * gate
