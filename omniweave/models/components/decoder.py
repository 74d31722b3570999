"""The foundation decoder: Qwen2 / Qwen2.5 (qkv bias, M-RoPE), Llama-3 (llama3 rope scaling),
Qwen3 (QK-norm, free head_dim), Qwen3-MoE (Qwen3 with Mixture-of-Experts MLPs, components/moe.py),
DeepSeek-V3 (multi-head latent attention, components/mla.py; sigmoid-routed MoE with shared experts),
Gemma (zero-centred norms, gelu-tanh MLP, scaled embeddings). One class, the differences are config fields.

It works on one packed row: ``[L, D]`` activations, documents delimited by ``cu_seqlens``,
positions ``[1, L]`` (1-D RoPE) or ``[3, L]`` (M-RoPE). Parameter names equal the Hugging Face
ones minus the ``model.`` prefix, so the HF adapters are mostly renames.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from omniweave.models.components.attention import attn
from omniweave.models.components.deepstack import DeepStack
from omniweave.models.components.embedding import scale_embeddings
from omniweave.models.components.mla import MLAttention, check_mla_config
from omniweave.models.components.mlp import SwiGLU
from omniweave.models.components.moe import ROUTERS, MoE, MoEConfig
from omniweave.models.components.norm import RMSNorm, ZeroCenteredRMSNorm
from omniweave.models.components.rope import apply_rope, rope_cos_sin
from omniweave.models.registry import register


@dataclass
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int | None = None  # default hidden_size // num_heads (Qwen3 sets it)
    family: str = "qwen2"  # one of FAMILIES: which HF family exports it
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": "llama3", "factor": ..., ...}
    mrope_section: list[int] | None = None  # M-RoPE bands over (t, h, w); sums to head_dim/2
    mrope_interleaved: bool = False  # Qwen3-VL's interleaved band layout (rope.rope_cos_sin)
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    sliding_window: int | None = None
    attn_backend: str = "auto"  # auto | varlen | flash | sdpa | math (components/attention.py)
    initializer_range: float = 0.02
    hidden_act: str = "silu"
    # Multi-head latent attention (family deepseek_v3, components/mla.py; HF's field names):
    # head_dim is then qk_nope_head_dim + qk_rope_head_dim and RoPE covers the qk_rope_head_dim dims
    q_lora_rank: int | None = None  # None: a plain q_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True  # the rope dims hold interleaved pairs (DeepSeek's released weights)
    # Mixture of Experts (HF Qwen3-MoE's fields and rule): layer i's MLP is a MoE block when
    # num_experts > 0, i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0; other
    # layers keep the dense SwiGLU of intermediate_size. num_experts = 0: a dense model.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = False  # renormalise the top-k router weights (released Qwen3-MoE: true)
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    moe_backend: str = "auto"  # auto | grouped_mm | loop (components/moe.py)
    # DeepSeek-V3 MoE (components/moe.py): layers before first_k_dense_replace are dense too; the
    # router (default: sigmoid for deepseek_v3, else softmax), its groups and shared experts
    first_k_dense_replace: int = 0
    moe_router: str | None = None
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0  # a gated shared expert (Qwen3-Next / Qwen3.5-MoE, moe.py); 0: none
    # router training signals (components/router_loss.py, docs/moe.md); 0 turns each off
    router_aux_loss_coef: float = 0.0  # load-balancing loss (HF Qwen3-MoE's name; its checkpoints say 0.001)
    aux_loss_level: str = "global"  # global (data-parallel micro-step) | sequence (per document)
    router_z_loss_coef: float = 0.0
    bias_update_speed: float = 0.0  # aux-loss-free bias update (sigmoid router)
    # Hybrid linear attention (families qwen3_5 and qwen3_next; components/linear_attention.py)
    layer_types: list[str] | None = None  # per layer: full_attention | linear_attention (None: all full)
    partial_rotary_factor: float = 1.0  # RoPE rotates this share of head_dim
    attn_output_gate: bool = False  # a sigmoid gate on the attention output, from a doubled q_proj
    norm_zero_centered: bool = False  # the decoder's RMSNorms as x̂ · (1 + w) (weights stored as w − 1; Gemma too)
    scale_embeddings: bool = False  # token embeddings × sqrt(hidden_size) in their dtype (Gemma; embedding.py)
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4
    linear_chunk_size: int = 64  # the chunkwise gated delta rule's chunk (components/gated_delta.py)
    linear_backend: str = "auto"  # auto | torch | fla: the linear layers' kernel (fla on CUDA when installed)
    extra_hf: dict = field(default_factory=dict)  # HF config keys kept for export

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim if self.mla else self.hidden_size // self.num_heads
        if self.mla:
            check_mla_config(self)
        if self.moe_router is None:
            self.moe_router = "sigmoid" if self.family == "deepseek_v3" else "softmax"
        if self.moe_router not in ROUTERS:
            raise ValueError(f"moe_router {self.moe_router!r}: choose from {', '.join(ROUTERS)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.mrope_section is not None and sum(self.mrope_section) != self.rope_dim // 2:
            raise ValueError(f"mrope_section {self.mrope_section} must sum to {self.rope_dim // 2} "
                             f"(half the {'qk_rope_head_dim' if self.mla else 'head_dim'} {self.rope_dim})")  # fmt: skip
        if self.family not in FAMILIES:
            raise ValueError(f"family {self.family!r}: expected {', '.join(FAMILIES)}")
        check_layer_types(self)
        if self.num_experts and (not self.num_experts_per_tok or not self.moe_intermediate_size):
            raise ValueError("num_experts > 0 needs num_experts_per_tok and moe_intermediate_size")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step={self.decoder_sparse_step} must be >= 1")

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3) instead of GQA."""
        return self.family == "deepseek_v3"

    @property
    def rope_dim(self) -> int:
        """The dims of a q / k head that RoPE rotates."""
        return self.qk_rope_head_dim if self.mla else int(self.head_dim * self.partial_rotary_factor)

    def is_linear_layer(self, layer: int) -> bool:
        """Layer ``layer`` mixes tokens with Gated DeltaNet instead of attention."""
        return self.layer_types is not None and self.layer_types[layer] == "linear_attention"

    def moe_layers(self) -> list[int]:
        """The layers whose MLP is a MoE block (``moe_layer_indices``)."""
        return moe_layer_indices(vars(self))

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers()


LAYER_TYPES = ("full_attention", "linear_attention")
# the HF families a decoder exports as (hf/export.py: the text model type of the hybrid ones)
FAMILIES = ("qwen2", "llama", "qwen3", "qwen3_moe", "deepseek_v3", "qwen3_5", "qwen3_next", "gemma")


def check_layer_types(cfg: DecoderConfig) -> None:
    """``layer_types`` one known type per layer, and the linear layers' head settings."""
    if cfg.layer_types is None:
        return
    types = list(cfg.layer_types)
    if len(types) != cfg.num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for num_layers={cfg.num_layers}")
    unknown = sorted({t for t in types if t not in LAYER_TYPES})
    if unknown:
        raise ValueError(f"layer_types: unknown layer type(s) {unknown}; expected {' or '.join(LAYER_TYPES)}")
    if "linear_attention" in types:
        heads = {k: getattr(cfg, k) for k in ("linear_num_key_heads", "linear_num_value_heads",
                                              "linear_key_head_dim", "linear_value_head_dim")}
        missing = [k for k, v in heads.items() if v < 1]
        if missing:
            raise ValueError(f"layer_types has linear_attention layers: set {', '.join(missing)} (>= 1)")


def linear_attention_config(cfg: DecoderConfig):
    """The Gated DeltaNet settings of a decoder's linear layers."""
    from omniweave.models.components.linear_attention import GatedDeltaNetConfig

    return GatedDeltaNetConfig(cfg.hidden_size, cfg.linear_num_key_heads, cfg.linear_num_value_heads,
                               cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim,
                               cfg.rms_norm_eps, cfg.linear_chunk_size, cfg.linear_backend)


def norm_class(cfg: DecoderConfig):
    """The decoder's RMSNorm: zero-centred (Qwen3.5, Gemma) or plain."""
    return ZeroCenteredRMSNorm if cfg.norm_zero_centered else RMSNorm


def decoder_fields(cfg) -> dict:
    """A decoder's YAML mapping (or DecoderConfig's ``vars``) over DecoderConfig's defaults: every
    field with a default present, as a dict, without building (or checking) the config."""
    from omniweave.config import to_dict
    from omniweave.models.registry import field_defaults

    return {**field_defaults(DecoderConfig), **to_dict(cfg)}


def moe_layer_indices(cfg) -> list[int]:
    """The layers whose MLP is a MoE block, from a decoder config (dataclass fields or its YAML
    mapping): HF's rule (Qwen3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``, DeepSeek-V3's
    ``first_k_dense_replace``), see DecoderConfig."""
    c = decoder_fields(cfg)
    if not c["num_experts"]:
        return []
    skip, step, first = set(c["mlp_only_layers"] or []), int(c["decoder_sparse_step"]), int(c["first_k_dense_replace"])
    return [i for i in range(first, int(c["num_layers"])) if i not in skip and (i + 1) % step == 0]


def layer_mlp(cfg: DecoderConfig, layer: int) -> nn.Module:
    """Layer ``layer``'s feed-forward block: a MoE block or the dense SwiGLU (see DecoderConfig)."""
    if cfg.is_moe_layer(layer):
        return MoE(MoEConfig(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                             router=cfg.moe_router, norm_topk_prob=cfg.norm_topk_prob, n_group=cfg.n_group,
                             topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor,
                             n_shared_experts=cfg.n_shared_experts, hidden_act=cfg.hidden_act,
                             shared_expert_intermediate_size=cfg.shared_expert_intermediate_size,
                             backend=cfg.moe_backend, aux_loss_coef=cfg.router_aux_loss_coef,
                             aux_loss_level=cfg.aux_loss_level, z_loss_coef=cfg.router_z_loss_coef,
                             bias_update_speed=cfg.bias_update_speed))  # fmt: skip
    return SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=False, act=cfg.hidden_act)


class KVCache:
    """Per-layer keys/values of one sequence, grown as tokens are generated.

    A cache owns the attention over what it holds: ``Attention`` hands it the new tokens' q, k, v
    (``attend``), so other caches plug in without the model knowing. Generation (eval, RL) runs on
    ``omniweave.generation.GroupKVCache`` (many prompts in one row, a prompt prefix shared by a
    group of samples); this one-sequence cache is the simple reference it is checked against
    (``NaiveRollout``: every sample alone, in tests and bench/rl.py's baseline)."""

    def __init__(self, num_layers: int):
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.linear: dict = {}  # a linear-attention layer's LinearState (conv window, recurrent state)
        self.seen = 0  # tokens through the first layer so far

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.k[layer] is not None:
            k, v = torch.cat([self.k[layer], k]), torch.cat([self.v[layer], v])
        self.k[layer], self.v[layer] = k, v
        return k, v

    def attend(self, layer: int, q, k, v, cu_seqlens, window: int | None, backend: str, attn_fn=None) -> torch.Tensor:
        """out [L, H, Dh] of the new queries over every cached key (they precede the queries)."""
        if cu_seqlens.numel() != 2:
            raise ValueError("generation with a KVCache takes a single sequence (cu_seqlens of 2 entries)")
        k, v = self.update(layer, k, v)
        cu_k = torch.tensor([0, k.shape[0]], dtype=torch.int32, device=q.device)
        out, _ = attn(q, k, v, cu_seqlens, cu_k, True, window, backend=backend, need_lse=False)
        return out

    def mix_linear(self, layer: int, mixer, h, cu_seqlens) -> torch.Tensor:
        """A linear-attention layer's output for the new tokens, from (and into) its state: O(1)
        per token, whatever the length decoded so far."""
        y, self.linear[layer] = mixer(h, cu_seqlens, self.linear.get(layer))
        return y

    @property
    def length(self) -> int:
        """Tokens the cache holds (the positions of new tokens start here)."""
        return self.seen


class Attention(nn.Module):
    """GQA self-attention over a packed row.

    ``attn_fn`` is the hook through which ``parallel/`` swaps the local kernel for a
    context-parallel one (``attn_fn(q, k, v, cu_seqlens, window) -> out [L, H, Dh]``); the model
    itself never sets it. Head counts are read from the projections' outputs (``view(L, -1, hd)``)
    so that tensor parallelism can shard the heads without the model knowing."""

    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.attn_fn = None
        hd = cfg.head_dim
        # with an output gate each head's q_proj rows are [q | gate] (HF Qwen3_5Attention)
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * hd * (2 if cfg.attn_output_gate else 1),
                                bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * hd, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = norm_class(cfg)(hd, cfg.rms_norm_eps)
            self.k_norm = norm_class(cfg)(hd, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cu_seqlens, kv_cache: KVCache | None = None):
        L, hd = x.shape[0], self.cfg.head_dim
        gate = None
        if self.cfg.attn_output_gate:
            q, gate = self.q_proj(x).view(L, -1, 2 * hd).chunk(2, dim=-1)
            gate = gate.reshape(L, -1)
        else:
            q = self.q_proj(x).view(L, -1, hd)
        k = self.k_proj(x).view(L, -1, hd)
        v = self.v_proj(x).view(L, -1, hd)
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        backend = self.cfg.attn_backend  # resolved per call against q (components/attention.py)
        if kv_cache is not None:  # generation: the cache attends over what it holds (see KVCache)
            out = kv_cache.attend(self.layer, q, k, v, cu_seqlens, self.cfg.sliding_window, backend, self.attn_fn)
        elif self.attn_fn is not None:
            out = self.attn_fn(q, k, v, cu_seqlens, self.cfg.sliding_window)
        else:
            out, _ = attn(q, k, v, cu_seqlens, cu_seqlens, True, self.cfg.sliding_window, backend=backend,
                          need_lse=False)
        out = out.reshape(L, -1)
        return self.o_proj(out if gate is None else out * torch.sigmoid(gate))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        norm = norm_class(cfg)
        self.input_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.index = layer
        self.linear = cfg.is_linear_layer(layer)  # a Gated DeltaNet layer (its HF name: linear_attn)
        if self.linear:
            from omniweave.models.components.linear_attention import GatedDeltaNet

            self.linear_attn = GatedDeltaNet(linear_attention_config(cfg))
        else:
            self.self_attn = MLAttention(cfg, layer) if cfg.mla else Attention(cfg, layer)
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = layer_mlp(cfg, layer)
        self.routed = isinstance(self.mlp, MoE)

    def mix(self, h, cos, sin, cu_seqlens, kv_cache=None):
        """The token mixer: attention, or the linear layer's (state from zero at every document)."""
        if not self.linear:
            return self.self_attn(h, cos, sin, cu_seqlens, kv_cache)
        if kv_cache is not None:  # generation: the cache keeps the layer's state (KVCache.mix_linear)
            return kv_cache.mix_linear(self.index, self.linear_attn, h, cu_seqlens)
        return self.linear_attn(h, cu_seqlens)[0]

    def forward(self, x, cos, sin, cu_seqlens, kv_cache=None, token_valid=None):
        x = x + self.mix(self.input_layernorm(x), cos, sin, cu_seqlens, kv_cache)
        h = self.post_attention_layernorm(x)
        return x + (self.mlp(h, cu_seqlens, token_valid) if self.routed else self.mlp(h))


@register("foundation", "decoder", DecoderConfig)
class Decoder(nn.Module):
    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = norm_class(config)(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.init_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self) -> None:
        std = self.config.initializer_range
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, RMSNorm):
                m.reset_parameters()
            elif isinstance(m, MoE):
                m.reset_parameters(std)
        self.tie_weights()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[L] -> [L, D] (× sqrt(hidden_size) with ``scale_embeddings``; ``inputs_embeds`` are taken as given)."""
        x = self.embed_tokens(input_ids)
        return scale_embeddings(x, self.config.hidden_size) if self.config.scale_embeddings else x

    def rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.config
        return rope_cos_sin(position_ids, c.rope_dim, c.rope_theta, c.mrope_section, c.rope_scaling,
                            c.mrope_interleaved)

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        deepstack: DeepStack | None = None,
        token_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states [L, D] of a packed row (or new tokens, with ``kv_cache``).
        ``deepstack``: per-level vision features added at the media rows after the first layers.
        ``token_valid`` bool [L]: False at padding rows (context-parallel shards); the MoE
        layers' router statistics skip them."""
        x = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        L = x.shape[0]
        if position_ids is None:
            start = 0 if kv_cache is None else getattr(kv_cache, "length", 0)
            position_ids = torch.arange(start, start + L, device=x.device)[None]
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        if cu_seqlens is None:
            cu_seqlens = torch.tensor([0, L], dtype=torch.int32, device=x.device)
        cos, sin = self.rope(position_ids)
        if kv_cache is not None and hasattr(kv_cache, "seen"):
            kv_cache.seen += L
        x = self.run_layers(x, cos, sin, cu_seqlens, enumerate(self.layers), kv_cache, deepstack, token_valid)
        return self.norm(x)

    @staticmethod
    def run_layers(x, cos, sin, cu_seqlens, layers, kv_cache=None, deepstack: DeepStack | None = None,
                   token_valid=None) -> torch.Tensor:
        """x [L, D] through ``layers`` (pairs (layer index, layer), in order), DeepStack level i added
        after layer i. A pipeline stage (parallel/pipeline.py) runs its own slice of the layers."""
        for i, layer in layers:
            x = layer(x, cos, sin, cu_seqlens, kv_cache, token_valid)
            if deepstack is not None and i < deepstack.num_levels:
                x = deepstack.add(x, i)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


def param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


__all__ = ["Decoder", "DecoderConfig", "KVCache", "param_count"]
