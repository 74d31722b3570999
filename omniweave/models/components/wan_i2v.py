"""Wan 2.1 image-to-video (I2V) parts of :class:`~omniweave.models.components.wan_dit.WanDiT`, as
diffusers 0.42.1 ``WanTransformer3DModel`` with ``image_dim`` / ``added_kv_proj_dim`` set:

- :class:`ImageEmbedder` (diffusers ``WanImageEmbedding``, official ``MLPProj``): each clip's image
  features (CLIP ViT-H/14 penultimate states, 257 x 1280 per image in Wan) -> ``[N, D]`` by
  LayerNorm (fp32, affine, eps 1e-5) -> Linear(image_dim, image_dim) -> GELU (exact) ->
  Linear(image_dim, D) -> LayerNorm (fp32, affine, eps 1e-5). With ``pos_embed_seq_len`` (Wan 2.1
  FLF2V: the first and last frame's features, 2 x 257 tokens per clip) a learned position table is
  added to each clip's image tokens first (zero init), so every clip has exactly that many.
- :class:`WanI2VCrossAttention`: the block's ``attn2`` with added K/V. The clip's queries (one
  ``to_q`` + RMSNorm) attend to its text (``to_k`` / ``to_v``, ``norm_k``) and, separately, to its
  image tokens (``add_k_proj`` / ``add_v_proj``, ``norm_added_k``: RMSNorm across heads); the two
  attention results are summed before ``to_out``. diffusers prepends the image tokens to the text
  and splits them off again by a hard-coded text length of 512; here they travel on their own
  (``image [N, D]`` + ``image_cu_seqlens [M+1]``), so a clip's text may have any length. Under
  tensor parallelism (parallel/tp.py ``generator_plan``) ``add_k_proj`` / ``add_v_proj`` are
  column-wise like ``to_k`` / ``to_v`` and ``norm_added_k`` sharded (``ShardedRMSNorm``): each rank
  holds its heads of every projection, and the head count is taken from the local width.

Kept out of wan_dit.py so the self-attention path there stays as it is; wan_dit.py builds these
when its config has ``image_dim`` set.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from omniweave.models.components.attention import attn
from omniweave.models.components.norm import RMSNorm

IMAGE_LN_EPS = 1e-5  # diffusers' FP32LayerNorm default in WanImageEmbedding (not the config's eps)


def check_i2v_config(image_dim, added_kv_proj_dim, pos_embed_seq_len, inner_dim: int) -> None:
    """The I2V fields of a ``WanDiTConfig``: all unset (T2V), or ``image_dim`` and ``added_kv_proj_dim``
    together, the latter equal to the model width (the image embedder's output feeds ``add_k_proj``)."""
    if (image_dim is None) != (added_kv_proj_dim is None):
        raise ValueError(f"I2V: image_dim ({image_dim}) and added_kv_proj_dim ({added_kv_proj_dim}) are set together "
                         "(image-to-video) or both left unset (text-to-video)")
    if pos_embed_seq_len is not None and image_dim is None:
        raise ValueError(f"pos_embed_seq_len {pos_embed_seq_len}: the image position table needs image_dim (I2V)")
    if image_dim is None:
        return
    if image_dim < 1:
        raise ValueError(f"image_dim must be >= 1, got {image_dim}")
    if added_kv_proj_dim != inner_dim:
        raise ValueError(f"I2V: added_kv_proj_dim {added_kv_proj_dim} must equal the model width "
                         f"num_attention_heads x attention_head_dim = {inner_dim} (the image embedder's output)")
    if pos_embed_seq_len is not None and pos_embed_seq_len < 1:
        raise ValueError(f"pos_embed_seq_len must be >= 1, got {pos_embed_seq_len}")


def check_image_inputs(image_dim, pos_embed_seq_len, image, image_cu_seqlens, m: int, device) -> Tensor | None:
    """``image_cu_seqlens`` as int32 on ``device`` after checking the I2V inputs against the config
    (None for a T2V model given none); a clear ValueError for anything else."""
    given = image is not None or image_cu_seqlens is not None
    if image_dim is None:
        if given:
            raise ValueError("image / image_cu_seqlens given to a text-to-video WanDiT (config image_dim is None): "
                             "image conditioning needs an I2V config (image_dim, added_kv_proj_dim)")
        return None
    if image is None or image_cu_seqlens is None:
        raise ValueError(f"this WanDiT is image-to-video (image_dim {image_dim}): forward needs image "
                         f"[N, {image_dim}] (each clip's image features) and image_cu_seqlens [M+1]")
    if image.dim() != 2 or image.shape[1] != image_dim:
        raise ValueError(f"image {tuple(image.shape)}: must be [N, image_dim = {image_dim}]")
    cu = torch.as_tensor(image_cu_seqlens).to(device=device, dtype=torch.int32)
    lens = cu.diff()
    if cu.shape != (m + 1,) or int(cu[0]) != 0 or int(cu[-1]) != image.shape[0] or bool((lens < 1).any()):
        raise ValueError(f"image_cu_seqlens {cu.tolist()} must be [M+1 = {m + 1}] increasing from 0 to "
                         f"image.shape[0] = {image.shape[0]}: every clip has >= 1 image token")
    if pos_embed_seq_len is not None and bool((lens != pos_embed_seq_len).any()):
        raise ValueError(f"image_cu_seqlens {cu.tolist()}: with pos_embed_seq_len {pos_embed_seq_len} every clip "
                         f"has exactly {pos_embed_seq_len} image tokens")
    return cu


class _FeedForward(nn.Module):
    """fc2(gelu(fc1(x))): diffusers ``FeedForward(image_dim, D, mult=1, activation_fn="gelu")``."""

    def __init__(self, dim_in: int, dim_out: int):
        super().__init__()
        self.fc1 = nn.Linear(dim_in, dim_in)
        self.fc2 = nn.Linear(dim_in, dim_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class ImageEmbedder(nn.Module):
    """Image features ``[N, image_dim]`` -> ``[N, D]`` (module docstring); diffusers' names
    (``norm1``, ``ff``, ``norm2``, ``pos_embed``) but for ``ff.fc1`` / ``ff.fc2`` (hf/wan.py)."""

    def __init__(self, image_dim: int, dim: int, pos_embed_seq_len: int | None = None):
        super().__init__()
        self.norm1 = nn.LayerNorm(image_dim, eps=IMAGE_LN_EPS)
        self.ff = _FeedForward(image_dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=IMAGE_LN_EPS)
        self.pos_embed = None if pos_embed_seq_len is None else nn.Parameter(torch.zeros(1, pos_embed_seq_len, image_dim))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The position table at zero (the official ``emb_pos``); the Linears / norms are the DiT's init."""
        if self.pos_embed is not None:
            self.pos_embed.zero_()

    @staticmethod
    def _norm32(x: Tensor, norm: nn.LayerNorm) -> Tensor:  # diffusers' FP32LayerNorm: fp32 in, input dtype out
        return F.layer_norm(x.float(), norm.normalized_shape, norm.weight.float(), norm.bias.float(), norm.eps).to(x.dtype)

    def forward(self, image: Tensor) -> Tensor:
        if self.pos_embed is not None:  # every clip has exactly pos_embed_seq_len tokens (checked)
            n = self.pos_embed.shape[1]
            image = (image.unflatten(0, (-1, n)) + self.pos_embed.to(image.dtype)).flatten(0, 1)
        return self._norm32(self.ff(self._norm32(image, self.norm1)), self.norm2)


class WanI2VCrossAttention(nn.Module):
    """Cross-attention to the clip's text and, separately, its image tokens (module docstring).
    Same parameters as the T2V ``WanAttention`` plus ``add_k_proj``, ``add_v_proj``, ``norm_added_k``."""

    def __init__(self, heads: int, head_dim: int, eps: float, backend: str):
        super().__init__()
        d = heads * head_dim
        self.heads, self.head_dim = heads, head_dim
        self.to_q, self.to_k, self.to_v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.to_out = nn.Linear(d, d)
        self.norm_q, self.norm_k = RMSNorm(d, eps), RMSNorm(d, eps)
        self.add_k_proj, self.add_v_proj = nn.Linear(d, d), nn.Linear(d, d)
        self.norm_added_k = RMSNorm(d, eps)
        self.backend = backend

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor) -> Tensor:
        k = k.unflatten(-1, (-1, self.head_dim)).to(v.dtype)
        out, _ = attn(q.to(v.dtype), k, v.unflatten(-1, (-1, self.head_dim)), cu_q, cu_k, causal=False,
                      backend=self.backend, need_lse=False)
        return out.flatten(1)

    def forward(self, x: Tensor, ctx: Tensor, cu_q: Tensor, cu_k: Tensor, image: Tensor, image_cu: Tensor) -> Tensor:
        """``x [T, D]`` queries, ``ctx [S, D]`` text, ``image [N, D]`` embedded image tokens; the
        clips' segments ``cu_q`` / ``cu_k`` / ``image_cu`` [M+1]."""
        q = self.norm_q(self.to_q(x)).unflatten(-1, (-1, self.head_dim))
        text = self._attend(q, self.norm_k(self.to_k(ctx)), self.to_v(ctx), cu_q, cu_k)
        img = self._attend(q, self.norm_added_k(self.add_k_proj(image)), self.add_v_proj(image), cu_q, image_cu)
        return self.to_out(text + img)
