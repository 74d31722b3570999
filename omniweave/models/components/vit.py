"""Vision transformers of the Qwen2-VL family, run varlen over ALL media of a micro-batch at once.

    encoder(pixel_values [P, C·t·p·p], grid_thw [M, 3]) -> hidden [P, D]   (patch order kept)

``pixel_values`` holds every image / video of the row in span order, patches ordered as
``omniweave.data.media.vision.patchify`` writes them (each merge×merge block contiguous). Attention is
bidirectional and never crosses a frame: ``cu_seqlens`` has one segment per frame (t segments of
h·w patches per item), exactly like transformers' Qwen2-VL vision tower.

Two families share one class; the config picks the parts:

    qwen2_vit     LayerNorm, fc1 → quick_gelu → fc2, every block full (per-frame) attention
    qwen2_5_vit   RMSNorm, SwiGLU (gate/up/down with bias), window attention: patches are
                  reordered by ``window_index`` so that each window_size×window_size pixel window
                  (in merge units) is contiguous; blocks in ``fullatt_block_indexes`` attend over
                  the whole frame, the others within their window. The output is put back in the
                  original order (``argsort(window_index)``), so the projector never sees windows.

Rotary embedding is 2-D: the first half of each head's rotary frequencies encode the patch row,
the second half its column (same frequencies, base ``rope_theta``), rotate-half layout.

``qwen2_5_omni_vit`` is the Qwen2.5-Omni thinker's tower: ``qwen2_5_vit``'s computation (its HF
checkpoint keeps ``attn.q`` / ``attn.k`` / ``attn.v`` apart; ``hf/qwen2_5_omni.py`` fuses them),
exporting with the Omni thinker.

The patch embedding is transformers' Conv3d with kernel = stride = (t, p, p), i.e. a bias-free
linear map of the flattened patch, computed as a matmul. Parameter names equal transformers'
``visual.*`` names, so the HF adapters only change prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

from omniweave.models.components.attention import attn
from omniweave.models.components.mlp import MLP, SwiGLU
from omniweave.models.components.norm import RMSNorm
from omniweave.models.components.rope import VisionRotaryEmbedding, apply_rope
from omniweave.models.registry import register


@dataclass
class Qwen2ViTConfig:
    """Qwen2-VL vision tower (defaults: the real 675M tower shared by Qwen2-VL 2B/7B/72B)."""

    depth: int = 32
    hidden_size: int = 1280  # HF: embed_dim
    num_heads: int = 16
    intermediate_size: int = 5120  # HF: embed_dim * mlp_ratio
    in_channels: int = 3
    patch_size: int = 14
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    norm: str = "layernorm"  # layernorm | rmsnorm
    mlp: str = "quick_gelu"  # quick_gelu | gelu_tanh (fc1/fc2) | swiglu (gate/up/down)
    window_size: int | None = None  # pixels; None = no window attention
    fullatt_block_indexes: list[int] = field(default_factory=list)
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    patch_bias: bool = False  # the patch embedding's Conv3d has a bias (Qwen3-VL)
    attn_backend: str = "auto"  # attention.BACKENDS name; auto = varlen on CUDA, else sdpa

    @property
    def in_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


@dataclass
class Qwen25ViTConfig(Qwen2ViTConfig):
    """Qwen2.5-VL vision tower (defaults: the real tower of Qwen2.5-VL 3B/7B/32B/72B)."""

    intermediate_size: int = 3420
    norm: str = "rmsnorm"
    mlp: str = "swiglu"
    window_size: int | None = 112
    fullatt_block_indexes: list[int] = field(default_factory=lambda: [7, 15, 23, 31])


# ----------------------------------------------------------------------------- index helpers (pure)


def vision_cu_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
    """int32 [sum(t)+1]: one attention segment per frame (h·w patches)."""
    seqlens = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return F.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))


def check_patch_count(pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
    """grid_thw as int64 after checking that ``pixel_values`` holds exactly its patches."""
    grid_thw = grid_thw.to(torch.long)
    expected = int(grid_thw.prod(-1).sum()) if grid_thw.numel() else 0
    if pixel_values.shape[0] != expected:
        raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches but grid_thw {grid_thw.tolist()} needs {expected}")
    return grid_thw


def window_index(grid_thw: torch.Tensor, merge: int, window_merged: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2.5-VL window layout over merge units.

    Returns ``index`` int64 [P / merge²] (merge unit to place at each new slot; windows
    contiguous, frames contiguous, items in order) and ``cu_window_seqlens`` int32 [W+1] in
    patches (empty windows removed). ``window_merged`` = window_size // patch // merge.
    """
    index, cu, offset = [], [0], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        idx = torch.arange(t * gh * gw).view(t, gh, gw)
        pad_h, pad_w = -gh % window_merged, -gw % window_merged
        nh, nw = (gh + pad_h) // window_merged, (gw + pad_w) // window_merged
        idx = F.pad(idx, (0, pad_w, 0, pad_h), value=-1)
        idx = idx.view(t, nh, window_merged, nw, window_merged).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, -1)
        sizes = (idx >= 0).sum(-1).flatten()
        index.append(idx[idx >= 0] + offset)
        for s in sizes[sizes > 0].tolist():
            cu.append(cu[-1] + s * merge * merge)
        offset += t * gh * gw
    index_t = torch.cat(index) if index else torch.zeros(0, dtype=torch.long)
    return index_t.to(grid_thw.device), torch.tensor(cu, dtype=torch.int32, device=grid_thw.device)


# ----------------------------------------------------------------------------- modules


def _norm(cfg: Qwen2ViTConfig, dim: int) -> nn.Module:
    if cfg.norm == "layernorm":
        return nn.LayerNorm(dim, eps=cfg.norm_eps)
    if cfg.norm == "rmsnorm":
        return RMSNorm(dim, eps=cfg.norm_eps)
    raise ValueError(f"vision norm {cfg.norm!r}: choose layernorm or rmsnorm")


@torch.no_grad()
def _init(module: nn.Module, std: float) -> None:
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Conv3d)):
            nn.init.normal_(m.weight, std=std)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, (nn.LayerNorm, RMSNorm)):
            m.reset_parameters()


class VisionAttention(nn.Module):
    def __init__(self, cfg: Qwen2ViTConfig):
        super().__init__()
        if cfg.hidden_size % cfg.num_heads:
            raise ValueError(f"hidden_size {cfg.hidden_size} not divisible by num_heads {cfg.num_heads}")
        self.num_heads = cfg.num_heads
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)
        self.backend = cfg.attn_backend

    def forward(self, x, cu_seqlens, cos, sin):  # x [P, D]
        P = x.shape[0]
        # heads counted from qkv's output (-1), so tensor parallelism can give each rank its own heads
        q, k, v = self.qkv(x).view(P, 3, -1, self.head_dim).unbind(1)  # [P, H, Dh] each
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out, _ = attn(q, k, v, cu_seqlens, cu_seqlens, causal=False, backend=self.backend, need_lse=False)
        return self.proj(out.reshape(P, -1))


class VisionBlock(nn.Module):
    def __init__(self, cfg: Qwen2ViTConfig):
        super().__init__()
        self.norm1, self.norm2 = _norm(cfg, cfg.hidden_size), _norm(cfg, cfg.hidden_size)
        self.attn = VisionAttention(cfg)
        if cfg.mlp in ("quick_gelu", "gelu_tanh"):
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, act=cfg.mlp, bias=True)
        elif cfg.mlp == "swiglu":
            self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, bias=True, act="silu")
        else:
            raise ValueError(f"vision mlp {cfg.mlp!r}: choose quick_gelu, gelu_tanh or swiglu")

    def forward(self, x, cu_seqlens, cos, sin):
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """transformers' Conv3d(kernel = stride = (t, p, p)) over one patch = a linear map of the
    flattened patch. The weight keeps the Conv3d shape [D, C, t, p, p] (same tensor as HF's
    ``patch_embed.proj.weight``); the forward is a plain matmul. Bias: Qwen3-VL only."""

    def __init__(self, cfg: Qwen2ViTConfig, bias: bool = False):
        super().__init__()
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=k, stride=k, bias=bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [P, C·t·p·p] -> [P, D]
        w = self.proj.weight
        return F.linear(pixel_values.to(w.dtype), w.flatten(1), self.proj.bias)


class VisionTransformer(nn.Module):
    """Qwen2-VL / Qwen2.5-VL ViT without its merger (that is ``projector.PatchMerger``)."""

    def __init__(self, cfg: Qwen2ViTConfig):
        super().__init__()
        self.cfg = cfg
        self.hf_model_type = "qwen2_5_vl" if cfg.window_size else "qwen2_vl"  # the HF family it exports as
        self.out_dim = cfg.hidden_size
        self.merge_size = cfg.spatial_merge_size
        self.patch_embed = PatchEmbed(cfg, bias=cfg.patch_bias)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.rotary = VisionRotaryEmbedding((cfg.hidden_size // cfg.num_heads) // 2, cfg.rope_theta)  # no buffers

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [P, C·t·p·p], grid_thw int [M, 3] -> hidden [P, D] (original patch order)."""
        grid_thw = check_patch_count(pixel_values, grid_thw)
        x = self.patch_embed(pixel_values)  # [P, D]
        cos, sin = self.rotary(grid_thw.to(x.device), self.merge_size)  # fp32 [P, Dh]
        cu_seqlens = vision_cu_seqlens(grid_thw).to(x.device)
        cu_window, index = cu_seqlens, None
        if self.cfg.window_size:
            window_merged = self.cfg.window_size // self.cfg.patch_size // self.merge_size
            index, cu_window = window_index(grid_thw.cpu(), self.merge_size, window_merged)
            index, cu_window = index.to(x.device), cu_window.to(x.device)
            x, cos, sin = (self._by_unit(t, index) for t in (x, cos, sin))
        for i, block in enumerate(self.blocks):
            full = index is None or i in self.cfg.fullatt_block_indexes
            x = block(x, cu_seqlens if full else cu_window, cos, sin)
        if index is not None:
            x = self._by_unit(x, torch.argsort(index))
        return x

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Fresh weights (after ``to_empty`` from the meta device): normal(std) linears, unit norms."""
        _init(self, std)

    def dummy_input(self, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The smallest valid input (one merge block of zero pixels, one frame), for rows
        without media that must still run the encoder (see ``OmniModel``)."""
        m = self.merge_size
        grid_thw = torch.tensor([[1, m, m]], dtype=torch.long, device=device)
        return torch.zeros(m * m, self.cfg.in_dim, device=device), grid_thw

    def _by_unit(self, t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Reorder rows in groups of merge² (one merge unit) by ``index``.

        One gather of whole rows (unit index -> its merge² row indices), not a gather of
        ``[P/merge², merge², D]`` reshaped back to ``[P, D]``: that reshape is a view, and as the
        encoder's output a view makes FSDP2's hooks (an FSDP-wrapped encoder, e.g. encoder tp <
        foundation tp) warn that an in-place op on it would skip the pre-backward all-gather.
        Same copy, same values; the result owns its storage."""
        unit = self.merge_size**2
        rows = (index[:, None] * unit + torch.arange(unit, device=index.device)).flatten()
        return t.index_select(0, rows)


class Qwen25OmniVisionTransformer(VisionTransformer):
    """Qwen2.5-Omni's vision tower: Qwen2.5-VL's computation (its checkpoint splits ``qkv`` into
    ``q`` / ``k`` / ``v``, which the HF adapter fuses); it exports with the Omni thinker."""

    def __init__(self, cfg: Qwen25ViTConfig):
        super().__init__(cfg)
        self.hf_model_type = "qwen2_5_omni_thinker"


register("image_encoder", "qwen2_vit", Qwen2ViTConfig)(VisionTransformer)
register("image_encoder", "qwen2_5_vit", Qwen25ViTConfig)(VisionTransformer)
register("image_encoder", "qwen2_5_omni_vit", Qwen25ViTConfig)(Qwen25OmniVisionTransformer)
