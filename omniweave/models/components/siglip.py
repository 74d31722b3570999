"""SigLIP's vision tower (``siglip_vit``), the encoder of LLaVA-OneVision and PaliGemma, run varlen over all tiles.

    encoder(pixel_values [P, C·p·p], grid_thw [M, 3]) -> [P, D]

An item's ``t`` counts tiles (LLaVA-OneVision's base tile + anyres grid tiles: data/media/anyres.py;
a video's frames, one tile each), ``h × w`` the patches of one tile in raster order (row-major;
the order of a ``Conv2d(C, D, p, stride=p)`` patch embedding's output, whose ``padding="valid"``
ignores the last ``image_size % p`` pixels: ``anyres.tiles_to_patches`` drops them). Each tile is
one attention segment: patch embedding, the learned absolute position table (an ``nn.Embedding``
of ``(image_size // p)²`` rows) added as is, pre-norm blocks (LayerNorm -> attention -> residual,
LayerNorm -> fc1 -> gelu(tanh) -> fc2 -> residual).

``feature_layer`` picks the output as transformers' ``hidden_states[feature_layer]`` of
``SiglipVisionModel`` does (index 0 the embeddings, ``i`` the output of block ``i``; negative from
the end, ``-1`` the last block's output WITHOUT ``post_layernorm``, which is what LLaVA-OneVision's
``vision_feature_layer: -1`` reads). Only the blocks up to it run; blocks after it would get no
gradient, so build the tower with ``depth`` = the blocks the model uses (LLaVA-OneVision's 26).
``post_layernorm: true`` holds and applies transformers' ``post_layernorm`` (its
``last_hidden_state``; needs the last block's output): PaliGemma reads that (one 224 px image =
one tile, no pooling head), LLaVA-OneVision does not; the flag also picks the family a model with
this tower exports as.

Tiles of another size than the table's are an error: transformers' SigLIP adds the table without
interpolation unless asked (``interpolate_pos_encoding=False`` by default, and LLaVA-OneVision never
asks). Tiles are independent, so encoding tiles [t0, t1) of an item alone gives exactly its rows
[t0·h·w, t1·h·w): the context-parallel vision split cuts items at tiles unchanged.

Parameter names: the blocks are ``blocks.*`` (FSDP / activation checkpointing from outside) with a
fused ``attn.qkv`` and ``attn.proj`` (the ViT TP plan of parallel/tp.py applies) and ``mlp.fc1`` /
``mlp.fc2``; ``siglip_hf_name`` maps each to transformers' ``SiglipVisionModel`` names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omniweave.models.components.attention import attn
from omniweave.models.components.mlp import MLP
from omniweave.models.components.vit import _init, check_patch_count, vision_cu_seqlens
from omniweave.models.registry import register


@dataclass
class SiglipViTConfig:
    """SigLIP vision tower (defaults: LLaVA-OneVision's, siglip-so400m-patch14-384 less its last layer)."""

    depth: int = 26
    hidden_size: int = 1152
    num_heads: int = 16
    intermediate_size: int = 4304
    in_channels: int = 3
    patch_size: int = 14
    image_size: int = 384  # the tile side the position table was trained for (27 x 27 patches)
    norm_eps: float = 1e-6  # HF: layer_norm_eps
    mlp: str = "gelu_pytorch_tanh"  # HF: hidden_act
    feature_layer: int = -1  # transformers' hidden_states index (LLaVA-OneVision: vision_feature_layer)
    post_layernorm: bool = False  # apply HF's post_layernorm (last_hidden_state); LLaVA-OneVision: no
    attn_backend: str = "auto"

    def __post_init__(self):
        if self.image_size < self.patch_size:
            raise ValueError(f"siglip_vit image_size {self.image_size} is smaller than patch_size {self.patch_size}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"siglip_vit hidden_size {self.hidden_size} not divisible by num_heads {self.num_heads}")
        if not -(self.depth + 1) <= self.feature_layer <= self.depth:
            raise ValueError(f"siglip_vit feature_layer {self.feature_layer} is not a hidden_states index of a "
                             f"{self.depth}-block tower ({-(self.depth + 1)} .. {self.depth})")
        if self.post_layernorm and self.run_blocks != self.depth:
            raise ValueError("siglip_vit post_layernorm applies to the last block's output: feature_layer must be -1")

    @property
    def in_dim(self) -> int:
        return self.in_channels * self.patch_size**2

    @property
    def side(self) -> int:  # the position table is side × side patches
        return self.image_size // self.patch_size

    @property
    def run_blocks(self) -> int:  # blocks run to reach hidden_states[feature_layer]
        return self.feature_layer % (self.depth + 1)


class SiglipAttention(nn.Module):
    def __init__(self, cfg: SiglipViTConfig):
        super().__init__()
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=True)  # HF q_proj, k_proj, v_proj
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=True)  # HF out_proj
        self.backend = cfg.attn_backend

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:  # x [P, D]
        P = x.shape[0]
        # heads counted from qkv's output (-1), so tensor parallelism can give each rank its own heads
        q, k, v = self.qkv(x).view(P, 3, -1, self.head_dim).unbind(1)  # [P, H, Dh] each
        out, _ = attn(q, k, v, cu_seqlens, cu_seqlens, causal=False, backend=self.backend, need_lse=False)
        return self.proj(out.reshape(P, -1))


class SiglipBlock(nn.Module):
    def __init__(self, cfg: SiglipViTConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = SiglipAttention(cfg)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, act=cfg.mlp, bias=True)

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens)
        return x + self.mlp(self.norm2(x))


class SiglipViT(nn.Module):
    def __init__(self, cfg: SiglipViTConfig):
        super().__init__()
        self.cfg = cfg
        # the family it exports as: PaliGemma reads last_hidden_state (post_layernorm applied,
        # hf/paligemma.py), LLaVA-OneVision the last block's output without it (hf/llava_onevision.py)
        self.hf_model_type = "paligemma" if cfg.post_layernorm else "llava_onevision"
        self.out_dim = cfg.hidden_size
        self.merge_size = 1  # the projector maps each patch row on its own
        self.patch_embed = nn.Conv2d(cfg.in_channels, cfg.hidden_size, cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Embedding(cfg.side**2, cfg.hidden_size)
        self.blocks = nn.ModuleList(SiglipBlock(cfg) for _ in range(cfg.depth))
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps) if cfg.post_layernorm else None

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values [P, C·p·p] (tiles' patches, raster order), grid_thw int [M, 3] -> [P, D]."""
        grid_thw = check_patch_count(pixel_values, grid_thw)
        side = self.cfg.side
        if grid_thw.numel() and not bool(((grid_thw[:, 1] == side) & (grid_thw[:, 2] == side)).all()):
            raise ValueError(f"siglip_vit tiles must be {side} x {side} patches (image_size {self.cfg.image_size} / "
                             f"patch_size {self.cfg.patch_size}; SigLIP does not interpolate its positions), "
                             f"got grid_thw {grid_thw.tolist()}")
        w = self.patch_embed.weight
        x = F.linear(pixel_values.to(w.dtype), w.flatten(1), self.patch_embed.bias)  # [P, D]
        x = (x.view(-1, side * side, x.shape[-1]) + self.position_embedding.weight.to(x.dtype)).view(x.shape)
        cu_seqlens = vision_cu_seqlens(grid_thw).to(x.device)  # one segment per tile
        for block in self.blocks[:self.cfg.run_blocks]:
            x = block(x, cu_seqlens)
        if self.post_layernorm is not None:
            x = self.post_layernorm(x)
        return x

    @torch.no_grad()
    def init_weights(self, std: float = 0.02) -> None:
        """Fresh weights (after ``to_empty`` from the meta device), as transformers' SigLIP draws
        them (``SiglipPreTrainedModel._init_weights``): LeCun-normal patch embedding, position
        embeddings N(0, 1/width) -- large enough that a tower trained from scratch tells its patches'
        places apart --, Xavier-uniform attention and MLP weights (q, k, v each on its own), MLP
        biases N(0, 1e-6), the rest zero / LayerNorm identity. ``std`` is kept for callers that
        pass the family's initializer range; the draws follow transformers' rules instead."""
        _init(self, std)
        fan_in = self.patch_embed.weight[0].numel()  # in_channels x p x p
        nn.init.trunc_normal_(self.patch_embed.weight, std=(1.0 / fan_in) ** 0.5 / 0.87962566103423978)
        nn.init.zeros_(self.patch_embed.bias)
        nn.init.normal_(self.position_embedding.weight, std=self.cfg.hidden_size ** -0.5)
        for block in self.blocks:
            for part in block.attn.qkv.weight.chunk(3, dim=0):
                nn.init.xavier_uniform_(part)
            nn.init.xavier_uniform_(block.attn.proj.weight)
            for fc in (block.mlp.fc1, block.mlp.fc2):
                nn.init.xavier_uniform_(fc.weight)
                nn.init.normal_(fc.bias, std=1e-6)

    def dummy_input(self, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The smallest valid item (one tile of the table's size, zero pixels), for rows without media."""
        s = self.cfg.side
        return torch.zeros(s * s, self.cfg.in_dim, device=device), torch.tensor([[1, s, s]], device=device)


_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")
_BLOCK_NAMES = {"norm1": "layer_norm1", "norm2": "layer_norm2", "attn.proj": "self_attn.out_proj",
                "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
_TOP_NAMES = {"patch_embed": "embeddings.patch_embedding", "position_embedding": "embeddings.position_embedding",
              "post_layernorm": "post_layernorm"}


def siglip_hf_name(ours: str) -> tuple[str, ...]:
    """transformers' ``SiglipVisionModel`` names of one of our parameters: one name, or for the fused
    ``attn.qkv`` the q, k, v projections whose tensors, concatenated on dim 0, are ours."""
    module, _, leaf = ours.rpartition(".")
    m = _BLOCK.fullmatch(module)
    if m is not None:
        layer, part = m.groups()
        prefix = f"encoder.layers.{layer}."
        if part == "attn.qkv":
            return tuple(f"{prefix}self_attn.{x}_proj.{leaf}" for x in "qkv")
        if part in _BLOCK_NAMES:
            return (f"{prefix}{_BLOCK_NAMES[part]}.{leaf}",)
    elif module in _TOP_NAMES:
        return (f"{_TOP_NAMES[module]}.{leaf}",)
    raise KeyError(f"siglip_vit has no parameter {ours!r}")


def siglip_state_from_hf(model: SiglipViT, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict from a ``SiglipVisionModel`` one (its names without a prefix); HF tensors we do
    not hold (``post_layernorm`` unless configured, ``head``, blocks past ``depth``) are left out."""
    return {name: torch.cat([hf_state[n] for n in hf]) if len(hf := siglip_hf_name(name)) > 1 else hf_state[hf[0]]
            for name in model.state_dict()}


register("image_encoder", "siglip_vit", SiglipViTConfig)(SiglipViT)
