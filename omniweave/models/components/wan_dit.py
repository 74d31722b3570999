"""Wan 2.1 text-to-video diffusion transformer (DiT) over a packed row of clips (NaViT-style).

    forward(tokens [T, C·pt·ph·pw], grid [M, 3], timesteps [M], text [S, text_dim],
            text_cu_seqlens [M+1]) -> velocity [T, C_out·pt·ph·pw]

A row holds M clips of any latent size, patchified by :func:`patchify` and concatenated clip by
clip. Nothing crosses a clip: self-attention is varlen over each clip's tokens (``attention.attn``),
each clip's queries cross-attend only to its own text, and each clip has its own timestep.
Computation per block, as diffusers 0.42.1 ``WanTransformer3DModel`` (Wan 2.1 ``model.py``):

    (shift, scale, gate, c_shift, c_scale, c_gate) = scale_shift_table + time_proj(silu(temb))
    x = x + gate · attn1(LN(x)·(1+scale) + shift)          q/k RMSNorm across heads, 3-D RoPE
    x = x + attn2(LN_affine(x), text)                      no gate, no modulation
    x = x + c_gate · ffn(LN(x)·(1+c_scale) + c_shift)      gelu-tanh
    out = proj_out(LN(x)·(1+scale_h) + shift_h),  (shift_h, scale_h) = head table + temb

Layout choices (diffusers equivalence is what ``hf/wan.py`` maps and tests/test_wan_dit.py checks):

- Patch embedding: a Linear over the flattened patch in (C, pt, ph, pw) order, which is diffusers'
  Conv3d(kernel = stride = patch) with its weight flattened. ``proj_out`` rows are stored in the
  same (C, pt, ph, pw) order (diffusers emits (pt, ph, pw, C), channel last), so the output of a
  token is laid out exactly like :func:`patchify` lays out a target: the loss compares directly.
- Per-clip conditioning: the time embedding and its 6·D projection are computed once per clip
  ([M, ...], fp32, autocast off: M rows cost nothing) and gathered per token by clip index; no
  per-token GEMM. The gathered [T, D] modulations are fp32, like diffusers' ``_keep_in_fp32_modules``
  (LayerNorms, modulation and gated residual adds in fp32, the result cast to the stream's dtype).
  With one clip in the row the [1, D] rows broadcast and nothing is gathered.
- 3-D RoPE on interleaved pairs (x[2i], x[2i+1]); head_dim splits into h = w = 2·⌊Dh/6⌋ and
  t = Dh − 2h pairs-dims (44/42/42 for Dh = 128), each axis its own 1-D table (θ = 1e4), positions
  (f, h, w) restarting at 0 in every clip. Tables are built per call in float64 then cast to fp32
  as diffusers does, never stored: a non-persistent buffer would be cast to bf16 by ``model.to``
  and lost on meta-device init.

Sequence parallelism (``parallel.cp``) is applied from outside: ``sequence_split`` (set by
parallel/context/sequence.py) makes :meth:`WanDiT.forward` run this rank's piece of the row
(:func:`split_layout`) and return its rows' velocity (:meth:`WanDiT.local_slice`).

Image-to-video (Wan 2.1 I2V / FLF2V; ``image_dim`` and ``added_kv_proj_dim`` set, wan_i2v.py): each
clip also brings its own image features (``image [N, image_dim]``, ``image_cu_seqlens [M+1]``: CLIP
ViT-H/14 penultimate states, 257 per image, diffusion/image_encoder.py), embedded by
``condition_embedder.image_embedder``; ``attn2`` then adds a second attention of the clip's queries
to its image tokens (``add_k_proj`` / ``add_v_proj`` / ``norm_added_k``), summed with the text one
before ``to_out``. The input has ``in_channels`` 36: the caller concatenates along channels, as
diffusers' ``WanImageToVideoPipeline`` does, [noisy latent (16), mask (4), conditioning latent (16)]
-- the mask is 1 on the given frame (the first latent frame's 4 video frames), 0 elsewhere, and the
conditioning latent is the VAE encoding of the image followed by zero frames. Nothing else in the
DiT changes; the output stays 16 channels.

Init (:meth:`WanDiT.init_weights`, the official Wan 2.1 ``WanModel.init_weights``): every Linear
Xavier-uniform with zero bias (patch embedding included: fan_in C·pt·ph·pw, as the official
``xavier_uniform_(weight.flatten(1))``); text and time embedders Normal(0, 0.02); ``proj_out``
zero (the model predicts velocity 0 at step 0); modulation tables randn/√D; norms at identity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omniweave.models.components.attention import attn, check_backend
from omniweave.models.components.mlp import MLP
from omniweave.models.components.norm import RMSNorm
from omniweave.models.components.wan_i2v import (
    ImageEmbedder, WanI2VCrossAttention, check_i2v_config, check_image_inputs,
)
from omniweave.models.registry import register


@dataclass
class WanDiTConfig:
    """Defaults: Wan 2.1 T2V 1.3B (dim 1536 = 12 × 128). 14B: 40 heads, ffn 13824, 40 layers."""

    in_channels: int = 16
    out_channels: int = 16
    patch_size: tuple[int, int, int] = (1, 2, 2)  # (pt, ph, pw) latent cells per token
    num_attention_heads: int = 12
    attention_head_dim: int = 128
    text_dim: int = 4096  # umT5-XXL states
    freq_dim: int = 256  # sinusoidal timestep embedding width
    ffn_dim: int = 8960
    num_layers: int = 30
    eps: float = 1e-6
    rope_max_seq_len: int = 1024  # most patches along any of f, h, w
    rope_theta: float = 10000.0
    cross_attn_norm: bool = True  # affine LayerNorm before cross-attention (norm2)
    image_dim: int | None = None  # I2V: CLIP feature width (1280); None = text-to-video
    added_kv_proj_dim: int | None = None  # I2V: input of attn2's add_k/v_proj, = the model width
    pos_embed_seq_len: int | None = None  # FLF2V: image tokens per clip with a learned position table
    attn_backend: str = "auto"  # attention.BACKENDS name; auto = varlen on CUDA, else sdpa
    init_std: float = 0.02  # text / time embedders' Normal std (official init)

    def __post_init__(self):
        self.patch_size = tuple(int(p) for p in self.patch_size)
        if len(self.patch_size) != 3 or min(self.patch_size) < 1:
            raise ValueError(f"patch_size must be three positive ints (pt, ph, pw), got {self.patch_size}")
        check_i2v_config(self.image_dim, self.added_kv_proj_dim, self.pos_embed_seq_len,
                         self.num_attention_heads * self.attention_head_dim)
        for name in ("in_channels", "out_channels", "num_attention_heads", "text_dim", "ffn_dim", "num_layers",
                     "rope_max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        d = self.attention_head_dim
        if d < 6 or d % 2:
            raise ValueError(f"attention_head_dim {d}: the 3-D RoPE splits it into t/h/w parts (h = w = "
                             f"2·⌊{d}/6⌋, t = rest), each of whole rotary pairs: it must be even and >= 6")
        if self.freq_dim < 2:
            raise ValueError(f"freq_dim must be >= 2 (cos and sin halves), got {self.freq_dim}")
        if not self.eps > 0:
            raise ValueError(f"eps must be > 0, got {self.eps}")

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def patch_volume(self) -> int:
        return math.prod(self.patch_size)

    @property
    def rope_split(self) -> tuple[int, int, int]:
        """Head dims given to the (t, h, w) axes: diffusers' ``WanRotaryPosEmbed`` split."""
        hw = 2 * (self.attention_head_dim // 6)
        return self.attention_head_dim - 2 * hw, hw, hw


# ----------------------------------------------------------------------------- patches (pure)


def patchify(latent: Tensor, patch) -> Tensor:
    """``latent [C, F, H, W]`` -> tokens ``[f·h·w, C·pt·ph·pw]``, tokens in (f, h, w) order, each
    token's values in (C, pt, ph, pw) order (the Conv3d weight's flatten order)."""
    pt, ph, pw = patch
    c, fr, hh, ww = latent.shape
    if fr % pt or hh % ph or ww % pw:
        raise ValueError(f"latent of F, H, W = {fr}, {hh}, {ww} is not divisible by the patch {tuple(patch)}")
    f, h, w = fr // pt, hh // ph, ww // pw
    x = latent.reshape(c, f, pt, h, ph, w, pw).permute(1, 3, 5, 0, 2, 4, 6)
    return x.reshape(f * h * w, c * pt * ph * pw)


def unpatchify(tokens: Tensor, grid_row, channels: int, patch) -> Tensor:
    """The inverse of :func:`patchify`: ``tokens [f·h·w, C·pt·ph·pw]`` of one clip -> ``[C, F, H, W]``."""
    f, h, w = (int(g) for g in grid_row)
    pt, ph, pw = patch
    if tuple(tokens.shape) != (f * h * w, channels * pt * ph * pw):
        raise ValueError(f"tokens {tuple(tokens.shape)} do not match grid {(f, h, w)} x {channels} channels "
                         f"x patch {tuple(patch)}")
    x = tokens.reshape(f, h, w, channels, pt, ph, pw).permute(3, 0, 4, 1, 5, 2, 6)
    return x.reshape(channels, f * pt, h * ph, w * pw)


def patchify_clips(latents: list[Tensor], patch) -> tuple[Tensor, Tensor]:
    """A packed row from clips ``[C, F, H, W]``: (tokens [T, C·pt·ph·pw], grid int64 [M, 3])."""
    pt, ph, pw = patch
    grid = [(x.shape[1] // pt, x.shape[2] // ph, x.shape[3] // pw) for x in latents]
    return torch.cat([patchify(x, patch) for x in latents]), torch.tensor(grid, dtype=torch.long)


def unpatchify_clips(tokens: Tensor, grid: Tensor, channels: int, patch) -> list[Tensor]:
    """The row's clips back as ``[C, F, H, W]`` each."""
    rows = [tuple(g) for g in torch.as_tensor(grid).tolist()]
    parts = tokens.split([f * h * w for f, h, w in rows])
    return [unpatchify(t, g, channels, patch) for t, g in zip(parts, rows)]


# ----------------------------------------------------------------------------- embeddings (pure)


def timestep_embedding(t: Tensor, dim: int) -> Tensor:
    """diffusers ``Timesteps(dim, flip_sin_to_cos=True, downscale_freq_shift=0)``: [cos, sin] of
    t·10000^(−i/half), fp32 [M, dim] (a zero column appended when ``dim`` is odd)."""
    half = dim // 2
    exponent = -math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half
    arg = t.float()[:, None] * torch.exp(exponent)[None]
    emb = torch.cat([arg.cos(), arg.sin()], dim=-1)
    return F.pad(emb, (0, 1)) if dim % 2 else emb


def _axis_table(n: int, dim: int, theta: float, device) -> tuple[Tensor, Tensor]:
    """cos, sin fp32 [n, dim/2] of one axis (float64 angles, as diffusers computes them)."""
    f64 = torch.float32 if torch.device(device).type == "mps" else torch.float64
    inv = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=f64, device=device) / dim)
    ang = torch.outer(torch.arange(n, dtype=f64, device=device), inv)
    return ang.cos().float(), ang.sin().float()


def apply_rope_pairs(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate interleaved pairs (x[2i], x[2i+1]) of ``x [T, H, Dh]`` by ``cos, sin [T, Dh/2]``, in fp32."""
    x1, x2 = x.float().unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[:, None], sin[:, None]
    return torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2).to(x.dtype)


@dataclass
class RowLayout:
    """What every block needs about a packed row, computed once per forward."""

    cu_seqlens: Tensor  # int32 [M+1] clip boundaries in tokens
    text_cu_seqlens: Tensor  # int32 [M+1]
    clip_index: Tensor | None  # int64 [T] clip of each token; None when M == 1 (broadcast)
    cos: Tensor  # fp32 [T, Dh/2]
    sin: Tensor
    self_attn: object = None  # fn(q, k, v) over the row's clips, given under sequence parallelism

    def per_token(self, rows: Tensor) -> Tensor:
        """``rows [M, D]`` -> each token's row [T, D] (or the single [1, D] row, broadcast)."""
        return rows if self.clip_index is None else rows.index_select(0, self.clip_index)


def clip_index(grid: Tensor) -> Tensor:
    """int64 [T]: the clip each token of a packed row belongs to (tokens per clip = f·h·w)."""
    grid = torch.as_tensor(grid).to(torch.long)
    return torch.repeat_interleave(torch.arange(grid.shape[0], device=grid.device), grid.prod(dim=1))


def row_layout(grid: Tensor, text_cu_seqlens: Tensor, cfg: WanDiTConfig, device) -> RowLayout:
    grid = torch.as_tensor(grid).to(device=device, dtype=torch.long)
    if grid.dim() != 2 or grid.shape[1] != 3 or grid.shape[0] < 1 or bool((grid < 1).any()):
        raise ValueError(f"grid must be [M >= 1, 3] positive (f, h, w) patch counts, got {grid.tolist()}")
    if int(grid.max()) > cfg.rope_max_seq_len:
        raise ValueError(f"grid {grid.tolist()} exceeds rope_max_seq_len {cfg.rope_max_seq_len} patches on an axis")
    m = grid.shape[0]
    lens = grid.prod(-1)
    cu = F.pad(lens.cumsum(0), (1, 0))
    clip = clip_index(grid)
    local = torch.arange(clip.numel(), device=device) - cu[clip]  # token index within its clip
    hw = (grid[:, 1] * grid[:, 2])[clip]
    w = grid[clip, 2]
    pos = (local // hw, (local % hw) // w, local % w)  # (f, h, w), from 0 in every clip
    cos, sin = [], []
    for axis, dim in enumerate(cfg.rope_split):
        c, s = _axis_table(int(grid[:, axis].max()), dim, cfg.rope_theta, device)
        cos.append(c[pos[axis]])
        sin.append(s[pos[axis]])
    text_cu = torch.as_tensor(text_cu_seqlens).to(device=device, dtype=torch.int32)
    return RowLayout(cu.to(torch.int32), text_cu, None if m == 1 else clip, torch.cat(cos, -1), torch.cat(sin, -1))


def split_layout(layout: RowLayout, split, total: int) -> RowLayout:
    """This rank's rows of the whole row's layout under sequence parallelism (``split``: a
    parallel/context/sequence.SequenceSplit): its RoPE angles and clip indices (pad rows: angle 0,
    the last clip), its clips' query segments for cross-attention, and the self-attention kernel
    over the whole row's clips."""
    last = layout.cu_seqlens.numel() - 2
    clip = None if layout.clip_index is None else split.local_rows(layout.clip_index, fill=last)
    return RowLayout(split.local_segments(layout.cu_seqlens, total), layout.text_cu_seqlens, clip,
                     split.local_rows(layout.cos, fill=1.0), split.local_rows(layout.sin, fill=0.0),
                     split.attention_fn(layout.cu_seqlens, total))


def _layer_norm32(x: Tensor, eps: float, norm: nn.LayerNorm | None = None) -> Tensor:
    """LayerNorm in fp32 (diffusers' FP32LayerNorm), fp32 out; affine from ``norm`` when given."""
    w = b = None
    if norm is not None:
        w, b = norm.weight.float(), norm.bias.float()
    return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps)


def _linear32(x: Tensor, layer: nn.Linear) -> Tensor:
    return F.linear(x.float(), layer.weight.float(), None if layer.bias is None else layer.bias.float())


# ----------------------------------------------------------------------------- modules


class Projection(nn.Module):
    """linear_2(act(linear_1(x))): diffusers' TimestepEmbedding (silu) / PixArtAlphaTextProjection (gelu-tanh)."""

    def __init__(self, dim_in: int, dim: int, act: str):
        super().__init__()
        self.linear_1 = nn.Linear(dim_in, dim)
        self.linear_2 = nn.Linear(dim, dim)
        self.act = act

    def forward(self, x: Tensor, fp32: bool = False) -> Tensor:
        lin = _linear32 if fp32 else (lambda t, layer: layer(t))
        h = lin(x, self.linear_1)
        h = F.silu(h) if self.act == "silu" else F.gelu(h, approximate="tanh")
        return lin(h, self.linear_2)


class ConditionEmbedder(nn.Module):
    """Per clip: temb [M, D] and its modulation projection [M, 6·D] (fp32); per text token: [S, D]."""

    def __init__(self, cfg: WanDiTConfig):
        super().__init__()
        d = cfg.inner_dim
        self.freq_dim = cfg.freq_dim
        self.time_embedder = Projection(cfg.freq_dim, d, "silu")
        self.time_proj = nn.Linear(d, 6 * d)
        self.text_embedder = Projection(cfg.text_dim, d, "gelu_tanh")
        self.image_embedder = ImageEmbedder(cfg.image_dim, d, cfg.pos_embed_seq_len) if cfg.image_dim else None

    def time(self, timesteps: Tensor) -> tuple[Tensor, Tensor]:
        # M rows: fp32 whatever autocast says (diffusers keeps time_embedder in fp32)
        with torch.autocast(timesteps.device.type, enabled=False):
            temb = self.time_embedder(timestep_embedding(timesteps, self.freq_dim), fp32=True)
            return temb, _linear32(F.silu(temb), self.time_proj)


class WanAttention(nn.Module):
    """Self- (``rope`` given) or cross-attention, q/k RMSNorm over all heads together (inner dim)."""

    def __init__(self, cfg: WanDiTConfig):
        super().__init__()
        d = cfg.inner_dim
        self.heads, self.head_dim = cfg.num_attention_heads, cfg.attention_head_dim
        self.to_q, self.to_k, self.to_v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.to_out = nn.Linear(d, d)
        self.norm_q, self.norm_k = RMSNorm(d, cfg.eps), RMSNorm(d, cfg.eps)
        self.backend = cfg.attn_backend

    def forward(self, x: Tensor, ctx: Tensor, cu_q: Tensor, cu_k: Tensor, rope=None, attn_fn=None) -> Tensor:
        q = self.norm_q(self.to_q(x)).unflatten(-1, (-1, self.head_dim))
        k = self.norm_k(self.to_k(ctx)).unflatten(-1, (-1, self.head_dim))
        v = self.to_v(ctx).unflatten(-1, (-1, self.head_dim))
        if rope is not None:
            q, k = apply_rope_pairs(q, *rope), apply_rope_pairs(k, *rope)
        q, k = q.to(v.dtype), k.to(v.dtype)  # the norms' fp32 weights may have promoted q, k
        if attn_fn is not None:  # sequence parallelism's kernel (parallel/context/sequence.py)
            return self.to_out(attn_fn(q, k, v).flatten(1))
        out, _ = attn(q, k, v, cu_q, cu_k, causal=False, backend=self.backend, need_lse=False)
        return self.to_out(out.flatten(1))


class WanBlock(nn.Module):
    def __init__(self, cfg: WanDiTConfig):
        super().__init__()
        d = cfg.inner_dim
        self.eps = cfg.eps
        self.attn1 = WanAttention(cfg)
        self.attn2 = (WanI2VCrossAttention(cfg.num_attention_heads, cfg.attention_head_dim, cfg.eps, cfg.attn_backend)
                      if cfg.added_kv_proj_dim else WanAttention(cfg))
        self.norm2 = nn.LayerNorm(d, eps=cfg.eps) if cfg.cross_attn_norm else None
        self.ffn = MLP(d, cfg.ffn_dim, act="gelu_tanh")
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, d) / d**0.5)

    def forward(self, x: Tensor, ctx: Tensor, time_proj: Tensor, layout: RowLayout, image: tuple = ()) -> Tensor:
        mod = self.scale_shift_table.float() + time_proj.unflatten(1, (6, -1))  # [M, 6, D] fp32
        shift, scale, gate, c_shift, c_scale, c_gate = (layout.per_token(mod[:, i]) for i in range(6))
        dtype = x.dtype
        h = (_layer_norm32(x, self.eps) * (1 + scale) + shift).to(dtype)
        rope = (layout.cos, layout.sin)
        x = (x.float() + self.attn1(h, h, layout.cu_seqlens, layout.cu_seqlens, rope, layout.self_attn) * gate).to(dtype)
        h = _layer_norm32(x, self.eps, self.norm2).to(dtype) if self.norm2 is not None else x
        x = x + self.attn2(h, ctx, layout.cu_seqlens, layout.text_cu_seqlens, *image)  # I2V: (image, image_cu)
        h = (_layer_norm32(x, self.eps) * (1 + c_scale) + c_shift).to(dtype)
        return (x.float() + self.ffn(h).float() * c_gate).to(dtype)


@register("generator", "wan_dit", WanDiTConfig)
class WanDiT(nn.Module):
    """Wan 2.1 T2V transformer over a packed row; see the module docstring."""

    def __init__(self, config: WanDiTConfig):
        super().__init__()
        check_backend(config.attn_backend)
        self.config = cfg = config
        d = cfg.inner_dim
        self.patch_embedding = nn.Linear(cfg.in_channels * cfg.patch_volume, d)
        self.condition_embedder = ConditionEmbedder(cfg)
        self.blocks = nn.ModuleList(WanBlock(cfg) for _ in range(cfg.num_layers))
        self.proj_out = nn.Linear(d, cfg.out_channels * cfg.patch_volume)  # rows in (C, pt, ph, pw) order
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, d) / d**0.5)
        self.sequence_split = None  # set from outside (parallel/context/sequence.py): this rank's rows only
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """The official Wan 2.1 init (module docstring)."""
        d = self.config.inner_dim
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, (RMSNorm, nn.LayerNorm)):
                m.reset_parameters()
        for emb in (self.condition_embedder.time_embedder, self.condition_embedder.text_embedder):
            for layer in (emb.linear_1, emb.linear_2):
                nn.init.normal_(layer.weight, std=self.config.init_std)
        nn.init.zeros_(self.proj_out.weight)
        if self.condition_embedder.image_embedder is not None:
            self.condition_embedder.image_embedder.reset_parameters()
        for table in [self.scale_shift_table, *(b.scale_shift_table for b in self.blocks)]:
            table.copy_(torch.randn_like(table) / d**0.5)

    def forward(self, tokens: Tensor, grid: Tensor, timesteps: Tensor, text: Tensor,
                text_cu_seqlens: Tensor, image: Tensor | None = None, image_cu_seqlens: Tensor | None = None) -> Tensor:
        """Velocity tokens [T, out_channels·pt·ph·pw] of the packed clips (see the module docstring).
        I2V only (and then required): each clip's image features ``image [N, image_dim]``, segments
        ``image_cu_seqlens [M+1]``."""
        cfg = self.config
        layout = row_layout(grid, text_cu_seqlens, cfg, tokens.device)
        m, total = layout.cu_seqlens.numel() - 1, int(layout.cu_seqlens[-1])
        if tokens.dim() != 2 or tuple(tokens.shape) != (total, self.patch_embedding.in_features):
            raise ValueError(f"tokens {tuple(tokens.shape)}: grid {torch.as_tensor(grid).tolist()} needs "
                             f"[{total}, {self.patch_embedding.in_features}] (in_channels x patch volume)")
        if timesteps.shape != (m,):
            raise ValueError(f"timesteps {tuple(timesteps.shape)}: one per clip, [{m}]")
        tcu = layout.text_cu_seqlens
        if tcu.shape != (m + 1,) or int(tcu[0]) != 0 or int(tcu[-1]) != text.shape[0] or bool((tcu.diff() < 0).any()):
            raise ValueError(f"text_cu_seqlens {tcu.tolist()} must be [M+1 = {m + 1}] non-decreasing from 0 to "
                             f"text.shape[0] = {text.shape[0]}")
        image_cu = check_image_inputs(cfg.image_dim, cfg.pos_embed_seq_len, image, image_cu_seqlens, m, tokens.device)
        split = self.sequence_split
        if split is not None:  # this rank's piece of the row; the conditioning below stays whole
            tokens, layout = split.local_rows(tokens), split_layout(layout, split, total)
        dtype = self.patch_embedding.weight.dtype
        x = self.patch_embedding(tokens.to(dtype))
        temb, time_proj = self.condition_embedder.time(timesteps)  # [M, D], [M, 6·D] fp32
        ctx = self.condition_embedder.text_embedder(text.to(dtype))
        img = () if image_cu is None else (self.condition_embedder.image_embedder(image.to(dtype)), image_cu)
        for block in self.blocks:
            x = block(x, ctx, time_proj, layout, img)
        shift, scale = (self.scale_shift_table.float() + temb[:, None]).unbind(1)
        h = (_layer_norm32(x, cfg.eps) * (1 + layout.per_token(scale)) + layout.per_token(shift)).to(x.dtype)
        out = self.proj_out(h)
        return out if split is None else out[:len(range(total)[split.local_slice(total)])]  # pad rows dropped

    def local_slice(self, total: int) -> slice:
        """The rows of a ``total``-token row whose velocity :meth:`forward` returns (all, unless split)."""
        return slice(0, total) if self.sequence_split is None else self.sequence_split.local_slice(total)
