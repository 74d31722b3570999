"""Gated DeltaNet, the linear-attention mixer of Qwen3.5 / Qwen3-Next, over a packed row.

Parameters under transformers 5.24's ``Qwen3_5GatedDeltaNet`` names (so HF weights load by
name): ``in_proj_qkv`` (H → 2·key_dim + value_dim, contiguous [q | k | v]), ``in_proj_z``
(the output gate), ``in_proj_b`` (β logits, one per value head), ``in_proj_a`` (the decay
input), the depthwise ``conv1d`` (kernel ``conv_kernel``, over the q|k|v channels only), ``dt_bias``
and ``A_log`` per value head, the gated RMSNorm ``norm`` over a value head (plain weight, init 1:
not zero-centred) and ``out_proj``. Per token:

    q, k, v = split(silu(conv(in_proj_qkv x)))       (the convolution reset per document)
    β = σ(in_proj_b x),   g = −exp(A_log) · softplus(in_proj_a x + dt_bias)      (fp32)
    o = gated delta rule(l2norm(q), l2norm(k), v, g, β)                         (gated_delta.py)
    y = out_proj(rmsnorm(o) · w · silu(z))

A packed row equals each document alone: the convolution window and the recurrent state start
from zero (or from ``state``: a :class:`LinearState` of an earlier piece of the same documents —
chunked rows, context parallelism, decoding) at every document.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omniweave.models.components.gated_delta import causal_conv1d_varlen, gated_delta_rule_chunked, gated_delta_rule_step


LINEAR_BACKENDS = ("auto", "torch", "fla")


@functools.lru_cache(maxsize=None)
def fla_missing() -> str | None:
    """Why flash-linear-attention's varlen Triton kernels cannot run here, or None when they can."""
    import importlib.util

    if importlib.util.find_spec("fla") is None:
        return "flash-linear-attention (the fla package) is not installed: pip install flash-linear-attention"
    if not torch.cuda.is_available():
        return "needs a CUDA device"
    return None


def check_linear_backend(name: str, field: str = "linear_backend") -> str:
    """``name`` when this machine can run it, else a one-line error naming ``field``."""
    from omniweave.models.components.attention import UnavailableBackend

    if name not in LINEAR_BACKENDS:
        raise UnavailableBackend(f"{field}: unknown linear-attention backend {name!r}; choose from {', '.join(LINEAR_BACKENDS)}")
    why = fla_missing() if name == "fla" else None
    if why is not None:
        raise UnavailableBackend(f"{field}: linear-attention backend 'fla' is not available on this machine: {why}; "
                         "use auto or torch")
    return name


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    hidden_size: int
    num_key_heads: int  # HF linear_num_key_heads
    num_value_heads: int  # HF linear_num_value_heads (a multiple of the key heads)
    key_head_dim: int  # HF linear_key_head_dim
    value_head_dim: int  # HF linear_value_head_dim
    conv_kernel: int = 4  # HF linear_conv_kernel_dim
    rms_norm_eps: float = 1e-6
    chunk_size: int = 64
    backend: str = "auto"  # auto | torch | fla: the gated delta rule's kernel (see rule())

    def __post_init__(self):
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(f"linear_num_value_heads={self.num_value_heads} must be a multiple of "
                             f"linear_num_key_heads={self.num_key_heads}")
        if self.conv_kernel < 1:
            raise ValueError(f"linear_conv_kernel_dim={self.conv_kernel} must be >= 1")
        if self.backend not in LINEAR_BACKENDS:
            raise ValueError(f"linear_backend {self.backend!r}: choose from {', '.join(LINEAR_BACKENDS)}")

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim


@dataclass
class LinearState:
    """Where each document of a piece stands: the convolution's last inputs [N, K−1, conv_dim]
    and the recurrent state [N, HV, dk, dv] (fp32)."""

    window: Tensor
    recurrent: Tensor


class GatedRMSNorm(nn.Module):
    """rmsnorm(x) · weight · silu(gate) over the last dim, in fp32 (HF Qwen3_5RMSNormGated; fp64
    inputs in fp64)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        dtype = x.dtype
        wide = torch.promote_types(dtype, torch.float32)  # fp32 (fp64 stays fp64)
        h = x.to(wide)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.to(wide))).to(dtype)


class GatedDeltaNet(nn.Module):
    """The linear-attention mixer: ``forward(x [L, H], cu_seqlens, state=None) -> (y [L, H],
    LinearState)``. Head counts are read from the projections' outputs, so tensor parallelism can
    shard the heads without the module knowing.

    Hooks ``parallel/`` sets from outside (the model never does), like ``Attention.attn_fn``:
    ``tp_heads`` (tensor parallelism, parallel/tp_linear.py), and
    ``carry`` (chunked rows, parallel/chunk_state.py: ``carry.initial(...)`` gives the state the
    row's earlier chunks left, ``carry.final(y, state)`` hands this chunk's on) and ``cp_fn``
    (context parallelism, parallel/context/linear.py: ``cp_fn(self, pre, g, beta, cu_seqlens) -> o``
    runs :meth:`conv` and :meth:`rule` over the rank's pieces with the states the other ranks'
    pieces pass down)."""

    def __init__(self, cfg: GatedDeltaNetConfig):
        super().__init__()
        self.cfg = cfg
        conv_dim = 2 * cfg.key_dim + cfg.value_dim
        self.in_proj_qkv = nn.Linear(cfg.hidden_size, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.hidden_size, cfg.value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.hidden_size, cfg.num_value_heads, bias=False)
        self.in_proj_a = nn.Linear(cfg.hidden_size, cfg.num_value_heads, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, cfg.conv_kernel, groups=conv_dim, bias=False,
                                padding=cfg.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(cfg.num_value_heads))
        self.A_log = nn.Parameter(torch.empty(cfg.num_value_heads).uniform_(0.01, 16).log())
        self.norm = GatedRMSNorm(cfg.value_head_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(cfg.value_dim, cfg.hidden_size, bias=False)
        self.carry = None
        self.cp_fn = None
        self.tp_heads = None  # parallel/tp_linear.py: after the convolution, this rank's channels -> its heads

    def forward(self, x: Tensor, cu_seqlens: Tensor, state: LinearState | None = None) -> tuple[Tensor, LinearState | None]:
        L, dv = x.shape[0], self.cfg.value_head_dim
        pre = self.in_proj_qkv(x)
        beta = self.in_proj_b(x).sigmoid()
        wide = torch.promote_types(x.dtype, torch.float32)  # the decay in fp32 at least (HF: .float())
        g = -self.A_log.to(wide).exp() * F.softplus(self.in_proj_a(x).to(wide) + self.dt_bias)
        if self.cp_fn is not None:
            o, final = self.cp_fn(self, pre, g, beta, cu_seqlens), None
        else:
            if self.carry is not None:
                state = self.carry.initial(pre, cu_seqlens, beta.shape[-1], self.cfg.key_head_dim, dv)
            q, k, v, window = self.conv(pre, cu_seqlens, None if state is None else state.window)
            o, recurrent = self.rule(q, k, v, g, beta, cu_seqlens, None if state is None else state.recurrent)
            final = LinearState(window, recurrent)
        z = self.in_proj_z(x).reshape(L, -1, dv)
        y = self.out_proj(self.norm(o, z).reshape(L, -1))
        if self.carry is not None:
            y = self.carry.final(y, final)
        return y, final

    def conv(self, pre: Tensor, cu_seqlens: Tensor, window: Tensor | None = None):
        """(q, k [L, Hk, dk], v [L, HV, dv], each document's last K−1 inputs) of the projected
        ``pre`` [L, conv_dim], each document's convolution starting from ``window`` (zeros)."""
        dk, dv = self.cfg.key_head_dim, self.cfg.value_head_dim
        mixed, last = causal_conv1d_varlen(pre, self.conv1d.weight[:, 0], cu_seqlens, window)
        if self.tp_heads is not None:  # tensor parallelism: this rank's channels -> its heads
            mixed = self.tp_heads(mixed)
        ratio = self.cfg.num_value_heads // self.cfg.num_key_heads
        hk = mixed.shape[-1] // (2 * dk + ratio * dv)  # this rank's key heads
        q, k, v = mixed.split([hk * dk, hk * dk, mixed.shape[-1] - 2 * hk * dk], dim=-1)
        L = pre.shape[0]
        return q.reshape(L, -1, dk), k.reshape(L, -1, dk), v.reshape(L, -1, dv), last

    def rule(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
             initial: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(o [L, HV, dv], each document's final state) of the gated delta rule (q, k L2-normalised);
        one token per document from given states (decoding) takes the recurrence's single step."""
        if initial is not None and q.shape[0] == len(cu_seqlens) - 1:
            return gated_delta_rule_step(q, k, v, g, beta, initial, qk_l2norm=True)
        backend = self.cfg.backend
        if backend == "fla" or (backend == "auto" and q.is_cuda and fla_missing() is None):
            return fla_gated_delta_rule(q, k, v, g, beta, cu_seqlens, initial)
        return gated_delta_rule_chunked(q, k, v, g, beta, cu_seqlens, chunk_size=self.cfg.chunk_size,
                                        initial_state=initial, qk_l2norm=True)


def fla_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
                         initial: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:meth:`GatedDeltaNet.rule` on flash-linear-attention's varlen chunked kernel (CUDA, Triton):
    one batch row of the packed documents, ``cu_seqlens`` int64, the value heads a multiple of the
    key heads (fla's GVA, as transformers calls it), q and k L2-normalised in the kernel, the
    states [N, HV, dk, dv] in and out (fp32)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    o, final = chunk_gated_delta_rule(q[None], k[None], v[None], g[None].float(), beta[None].to(v.dtype),
                                      initial_state=None if initial is None else initial.float(),
                                      output_final_state=True, cu_seqlens=cu_seqlens.to(torch.long),
                                      use_qk_l2norm_in_kernel=True)
    return o[0], final
