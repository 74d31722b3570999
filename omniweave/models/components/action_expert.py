"""The action expert: a Gemma-shaped transformer that denoises a chunk of actions (Pi0.5).

    x     = action_in_proj(x_t)                          [N·H, W]   one token per action step
    cond  = silu(time_mlp_out(silu(time_mlp_in(sin_emb(t)))))   [N, W]   per chunk, from the flow time
    layer: h, g = input_layernorm(x, cond);  x = x + g · attn(h)       (adaRMS norms, gated residuals)
           h, g = post_attention_layernorm(x, cond);  x = x + g · mlp(h)
    v     = action_out_proj(norm(x, cond))               [N, H, A]  the predicted velocity

Attention is the backbone's (components/prefix_attention.py): layer i's queries see the
backbone's layer-i keys and values of the chunk's prefix and the chunk's own, so the expert has
the backbone's depth, head_dim and key/value heads (the model checks) and takes its RoPE. It has
no token embedding and no LM head. Parameter names follow lerobot's ``gemma_expert.model`` (minus
that prefix) and its ``action_in_proj`` / ``action_out_proj`` / ``time_mlp_*`` heads, so a Pi0.5
checkpoint maps by renames.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omniweave.models.components.adarms import AdaRMSNorm, gated_residual
from omniweave.models.components.decoder import Attention, DecoderConfig
from omniweave.models.components.flow import sinusoidal_time_embedding
from omniweave.models.components.mlp import SwiGLU
from omniweave.models.registry import register


@dataclass
class ActionExpertConfig:
    """Defaults: Pi0.5's ``gemma_300m`` expert, 32-dim actions (zero-padded), chunks of 50."""

    hidden_size: int = 1024
    intermediate_size: int = 4096
    num_layers: int = 18
    num_heads: int = 8
    num_kv_heads: int = 1
    head_dim: int = 256
    hidden_act: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    attn_backend: str = "auto"
    initializer_range: float = 0.02
    action_dim: int = 32  # the model's (max) action width; a dataset's narrower actions are zero-padded
    horizon: int = 50  # actions per chunk (chunk_size)
    time_min_period: float = 4e-3  # the sinusoidal time embedding's periods (flow.sinusoidal_time_embedding)
    time_max_period: float = 4.0
    time_alpha: float = 1.5  # flow time ~ Beta(alpha, beta)·0.999 + 0.001 (flow.sample_flow_time)
    time_beta: float = 1.0
    num_steps: int = 10  # Euler steps at sampling time
    knowledge_insulation: bool = False  # the chunks read the backbone's keys / values detached

    def __post_init__(self):
        if self.horizon < 1 or self.action_dim < 1:
            raise ValueError(f"horizon ({self.horizon}) and action_dim ({self.action_dim}) must be >= 1")
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")

    def decoder_config(self) -> DecoderConfig:
        """The expert's layers as a (Gemma) decoder config: what Attention and the MLP read."""
        return DecoderConfig(vocab_size=1, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                             num_layers=self.num_layers, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                             head_dim=self.head_dim, family="gemma", hidden_act=self.hidden_act,
                             rms_norm_eps=self.rms_norm_eps, attn_backend=self.attn_backend,
                             initializer_range=self.initializer_range)


class ExpertLayer(nn.Module):
    """A Gemma decoder layer whose norms are adaptive (time-conditioned) and residuals gated."""

    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        self.input_layernorm = AdaRMSNorm(cfg.hidden_size, cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = AdaRMSNorm(cfg.hidden_size, cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=False, act=cfg.hidden_act)

    def forward(self, x: Tensor, cond: Tensor, cos: Tensor, sin: Tensor, cu_seqlens: Tensor, layout) -> Tensor:
        h, gate = self.input_layernorm(x, cond)
        x = gated_residual(x, self.self_attn(h, cos, sin, cu_seqlens, layout), gate)
        h, gate = self.post_attention_layernorm(x, cond)
        return gated_residual(x, self.mlp(h), gate)


@register("action_expert", "flow_expert", ActionExpertConfig)
class ActionExpert(nn.Module):
    def __init__(self, config: ActionExpertConfig):
        super().__init__()
        self.config = config
        layers = config.decoder_config()
        self.layers_config = layers
        w = config.hidden_size
        self.action_in_proj = nn.Linear(config.action_dim, w)
        self.time_mlp_in = nn.Linear(w, w)
        self.time_mlp_out = nn.Linear(w, w)
        self.layers = nn.ModuleList(ExpertLayer(layers, i) for i in range(config.num_layers))
        self.norm = AdaRMSNorm(w, w, config.rms_norm_eps)
        self.action_out_proj = nn.Linear(w, config.action_dim)
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Normal(0, initializer_range) Linears with zero biases, then the adaRMS modulations zeroed
        (identity norms and closed gates at step 0, as openpi initialises them)."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=self.config.initializer_range)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        for m in self.modules():
            if isinstance(m, AdaRMSNorm):
                m.reset_parameters()

    def time_condition(self, t: Tensor, dtype: torch.dtype) -> Tensor:
        """[N, W] adaRMS conditioning of the chunks' flow times ``t`` [N]."""
        c = self.config
        emb = sinusoidal_time_embedding(t, c.hidden_size, c.time_min_period, c.time_max_period, dtype=dtype)
        return F.silu(self.time_mlp_out(F.silu(self.time_mlp_in(emb))))

    def forward(self, noisy_actions: Tensor, t: Tensor, cos: Tensor, sin: Tensor, layout) -> Tensor:
        """The velocity [N, H, A] of noisy chunks ``noisy_actions`` [N, H, A] at times ``t`` [N];
        ``cos, sin`` the backbone's RoPE at the chunks' positions, ``layout`` a ChunkLayout."""
        n, horizon, _ = noisy_actions.shape
        x = self.action_in_proj(noisy_actions).reshape(n * horizon, -1)
        cond = self.time_condition(t, x.dtype).repeat_interleave(horizon, dim=0)  # [N·H, W]: each token its chunk's
        cu = layout.cu_q
        for layer in self.layers:
            x = layer(x, cond, cos, sin, cu, layout)
        h, _ = self.norm(x, cond)
        return self.action_out_proj(h).reshape(n, horizon, -1)
