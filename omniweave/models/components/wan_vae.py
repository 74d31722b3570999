"""Wan 2.1's causal 3-D video VAE (diffusers' ``AutoencoderKLWan``, z_dim 16), frozen latent codec
for Wan video diffusion.

    encode(video [B, 3, 1+4k, H, W] in [-1, 1]) -> mu [B, z_dim, 1+k, H/8, W/8]   posterior mean
    normalize(mu) -> z = (mu - mean) / std        the diffusion model's latents (per channel)
    denormalize(z) -> mu
    decode(mu [B, z_dim, t, h, w]) -> video [B, 3, 1+4(t-1), 8h, 8w] clamped to [-1, 1]

``encode`` returns what diffusers' ``encode(x).latent_dist.mode()`` returns (the pipelines'
``sample_mode="argmax"``); ``decode`` what ``decode(z).sample`` returns, clamp included. Both are
checked against diffusers in tests/test_wan_vae.py (fp32, max abs error < 1e-4; measured <= 3.4e-6).

Chunking: like diffusers, the encoder reads frame 0 alone and then 4 frames at a time, the decoder one
latent frame at a time, each causal conv carrying its last input frames to the next chunk
(wan_vae_blocks.py explains the cache), so activations never hold more than one chunk: a long clip
costs its input, its output and one chunk. ``chunk_latents`` (latent frames per chunk after the first;
None = the whole clip in one pass) trades memory for fewer, larger convs; every choice gives the same
numbers (tested). diffusers' spatial tiling (``enable_tiling``, off by default) is not reproduced.

Normalisation follows the pipelines (``pipeline_wan.py``, ``pipeline_wan_i2v.py``): they cast ``std`` to
the latents' dtype, take ``inv_std = 1 / std`` in that dtype, and compute ``(mu - mean) * inv_std`` and
``z / inv_std + mean``; we do the same, so our latents equal the pipeline's bit for bit in any dtype
(in bf16 that differs from a true ``(mu - mean) / std`` by rounding).

Parameter names are diffusers' (``encoder.*``, ``quant_conv``, ``post_quant_conv``, ``decoder.*``):
an ``AutoencoderKLWan`` state dict (``vae/diffusion_pytorch_model.safetensors``) loads with
``load_state_dict(strict=True)`` and ours loads back into diffusers' model; no name mapping exists or
is needed. ``from_diffusers_dir`` reads a diffusers ``vae/`` folder, ``save_diffusers_dir`` writes one.

Only Wan 2.1's layout: Wan 2.2 TI2V-5B's VAE (``is_residual``, ``patch_size`` 2, z_dim 48) and
encoder attention (``attn_scales``: diffusers' encoder crashes on it, its decoder ignores it) are
refused with a clear error rather than half-supported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from omniweave.models.components.wan_vae_blocks import CausalConv3d, Decoder3d, Encoder3d, WanRMSNorm
from omniweave.models.registry import register

# diffusers' AutoencoderKLWan defaults = the Wan2.1 checkpoints' per-channel latent statistics
WAN21_LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                      0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
WAN21_LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                     3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]


@dataclass
class WanVAEConfig:
    """diffusers' ``AutoencoderKLWan`` config, field for field (its spelling ``temperal_*`` kept);
    defaults are diffusers' = Wan 2.1's VAE."""

    base_dim: int = 96
    decoder_base_dim: int | None = None  # None: base_dim
    z_dim: int = 16
    dim_mult: list[int] = field(default_factory=lambda: [1, 2, 4, 4])
    num_res_blocks: int = 2
    attn_scales: list[float] = field(default_factory=list)
    temperal_downsample: list[bool] = field(default_factory=lambda: [False, True, True])
    dropout: float = 0.0
    latents_mean: list[float] = field(default_factory=lambda: list(WAN21_LATENTS_MEAN))
    latents_std: list[float] = field(default_factory=lambda: list(WAN21_LATENTS_STD))
    is_residual: bool = False  # Wan 2.2 5B: refused
    in_channels: int = 3
    out_channels: int = 3
    patch_size: int | None = None  # Wan 2.2 5B: 2, refused
    scale_factor_temporal: int | None = 4
    scale_factor_spatial: int | None = 8

    def __post_init__(self):
        if self.is_residual or self.patch_size not in (None, 1):
            raise ValueError(f"wan_vae implements the Wan 2.1 VAE only; is_residual={self.is_residual}, "
                             f"patch_size={self.patch_size} is Wan 2.2's residual / patchified VAE")
        if self.attn_scales:
            raise ValueError(f"wan_vae: attn_scales must be [] (Wan 2.1 has none; diffusers' encoder fails on "
                             f"them and its decoder ignores them), got {self.attn_scales}")
        levels = len(self.dim_mult) - 1
        if levels < 0 or len(self.temperal_downsample) < levels:
            raise ValueError(f"wan_vae: temperal_downsample {self.temperal_downsample} needs one flag per "
                             f"downsampling level ({levels} for dim_mult {self.dim_mult})")
        if sum(map(bool, self.temperal_downsample[:levels])) != 2:
            raise ValueError(f"wan_vae: the encoder's chunking (frame 0, then 4 frames) needs exactly 2 temporal "
                             f"downsamplings, got temperal_downsample {self.temperal_downsample[:levels]}")
        if self.scale_factor_temporal not in (None, 4):
            raise ValueError(f"wan_vae: scale_factor_temporal {self.scale_factor_temporal} != 4")
        if self.scale_factor_spatial not in (None, self.spatial_factor):
            raise ValueError(f"wan_vae: scale_factor_spatial {self.scale_factor_spatial} != 2^(len(dim_mult)-1) "
                             f"= {self.spatial_factor}")
        if len(self.latents_mean) != self.z_dim or len(self.latents_std) != self.z_dim:
            raise ValueError(f"wan_vae: latents_mean / latents_std need z_dim={self.z_dim} values, got "
                             f"{len(self.latents_mean)} / {len(self.latents_std)}")

    @property
    def spatial_factor(self) -> int:
        return 2 ** (len(self.dim_mult) - 1)

    @property
    def temporal_factor(self) -> int:
        return 4


def config_from_diffusers(config: dict) -> WanVAEConfig:
    """Our config from an ``AutoencoderKLWan`` config (``vae/config.json`` or ``dict(model.config)``).
    Keys starting with ``_`` (``_class_name``, ``_diffusers_version``, ...) are dropped; any other key we
    do not know is an error, so a future variant is not silently read as Wan 2.1."""
    known = {f.name for f in fields(WanVAEConfig)}
    unknown = sorted(k for k in config if not k.startswith("_") and k not in known)
    if unknown:
        raise ValueError(f"wan_vae: unknown AutoencoderKLWan config keys {unknown}")
    cls = config.get("_class_name", "AutoencoderKLWan")
    if cls != "AutoencoderKLWan":
        raise ValueError(f"wan_vae: config is for {cls}, not AutoencoderKLWan")
    return WanVAEConfig(**{k: list(v) if isinstance(v, (list, tuple)) else v
                           for k, v in config.items() if k in known})


DIFFUSERS_VERSION = "0.42.1"  # save_diffusers_dir's layout is checked against this diffusers (tests/test_wan_vae.py)


def config_to_diffusers(cfg: WanVAEConfig) -> dict:
    """The inverse of :func:`config_from_diffusers`: an ``AutoencoderKLWan`` ``config.json`` dict
    (every field, ``_class_name`` and the diffusers version it was checked against included)."""
    return {"_class_name": "AutoencoderKLWan", "_diffusers_version": DIFFUSERS_VERSION,
            **{f.name: getattr(cfg, f.name) for f in fields(WanVAEConfig)}}


class WanVAE(nn.Module):
    def __init__(self, cfg: WanVAEConfig):
        super().__init__()
        self.cfg = cfg
        levels = len(cfg.dim_mult) - 1
        temporal = [bool(f) for f in cfg.temperal_downsample[:levels]]
        self.encoder = Encoder3d(cfg.in_channels, cfg.base_dim, 2 * cfg.z_dim, cfg.dim_mult, cfg.num_res_blocks,
                                 temporal, cfg.dropout)
        self.quant_conv = CausalConv3d(2 * cfg.z_dim, 2 * cfg.z_dim, 1)  # -> [mean, logvar]
        self.post_quant_conv = CausalConv3d(cfg.z_dim, cfg.z_dim, 1)
        self.decoder = Decoder3d(cfg.z_dim, cfg.decoder_base_dim or cfg.base_dim, cfg.out_channels, cfg.dim_mult,
                                 cfg.num_res_blocks, temporal[::-1], cfg.dropout)

    # ---- encode / decode -------------------------------------------------------------------

    def encode(self, video: torch.Tensor, chunk_latents: int | None = 1) -> torch.Tensor:
        """video [B, C, 1+4k, H, W] in [-1, 1] (cast to the weights' dtype) -> posterior mean
        [B, z_dim, 1+k, H/s, W/s]. Frame 0 is encoded alone, then ``4·chunk_latents`` frames at a time
        (diffusers: 1); ``chunk_latents=None`` encodes the whole clip in one pass."""
        s = self.cfg.spatial_factor
        if video.ndim != 5 or video.shape[1] != self.cfg.in_channels:
            raise ValueError(f"wan_vae.encode wants video [B, {self.cfg.in_channels}, T, H, W], got "
                             f"{tuple(video.shape)}")
        T, H, W = video.shape[2:]
        if T % 4 != 1:
            raise ValueError(f"wan_vae.encode: frame count must be 4k+1 (1, 5, 9, ...; frame 0 is encoded alone, "
                             f"then 4 at a time), got T={T}")
        if H % s or W % s or H == 0 or W == 0:
            raise ValueError(f"wan_vae.encode: height and width must be positive multiples of {s}, got {H}x{W}")
        video = video.to(self.quant_conv.weight.dtype)
        if chunk_latents is None:
            return self._mean(self.encoder(video))
        if chunk_latents < 1:
            raise ValueError(f"wan_vae.encode: chunk_latents must be >= 1 or None, got {chunk_latents}")
        state: dict = {}
        bounds = [0, *range(1, T, 4 * chunk_latents), T]
        return torch.cat([self._mean(self.encoder(video[:, :, a:b], state)) for a, b in zip(bounds, bounds[1:])], 2)

    def _mean(self, h: torch.Tensor) -> torch.Tensor:
        # quant_conv (1×1×1, per frame) makes [mean, logvar]; the posterior mean needs only its first z_dim rows
        z = self.cfg.z_dim
        return F.conv3d(h, self.quant_conv.weight[:z], self.quant_conv.bias[:z])

    def decode(self, z: torch.Tensor, chunk_latents: int | None = 1) -> torch.Tensor:
        """latents (un-normalised: ``denormalize`` first) [B, z_dim, t, h, w] -> video
        [B, C, 1+4(t-1), h·s, w·s] clamped to [-1, 1]. Decoded ``chunk_latents`` latent frames at a
        time (diffusers: 1); None decodes the whole clip in one pass."""
        if z.ndim != 5 or z.shape[1] != self.cfg.z_dim or 0 in z.shape[2:]:
            raise ValueError(f"wan_vae.decode wants latents [B, {self.cfg.z_dim}, t, h, w] (t, h, w >= 1), got "
                             f"{tuple(z.shape)}")
        z = z.to(self.post_quant_conv.weight.dtype)
        if chunk_latents is None:
            return self.decoder(self.post_quant_conv(z)).clamp(-1.0, 1.0)
        if chunk_latents < 1:
            raise ValueError(f"wan_vae.decode: chunk_latents must be >= 1 or None, got {chunk_latents}")
        state: dict = {}
        outs = [self.decoder(self.post_quant_conv(z[:, :, i:i + chunk_latents]), state).clamp(-1.0, 1.0)
                for i in range(0, z.shape[2], chunk_latents)]  # clamp per chunk: same numbers, one less full-size copy
        return torch.cat(outs, dim=2)

    # ---- latent normalisation (the pipelines' convention) -----------------------------------------

    def _stats(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (1, self.cfg.z_dim, 1, 1, 1)
        mean = torch.tensor(self.cfg.latents_mean).view(shape).to(like.device, like.dtype)
        # as the pipelines write it: std cast to the latents' dtype first, its reciprocal taken in that dtype
        inv_std = 1.0 / torch.tensor(self.cfg.latents_std).view(shape).to(like.device, like.dtype)
        return mean, inv_std

    def normalize(self, mu: torch.Tensor) -> torch.Tensor:
        """(mu - mean) / std per channel, computed as the pipelines do: (mu - mean) * (1/std)."""
        mean, inv_std = self._stats(mu)
        return (mu - mean) * inv_std

    def denormalize(self, z: torch.Tensor) -> torch.Tensor:
        """z · std + mean per channel, computed as the pipelines do: z / (1/std) + mean."""
        mean, inv_std = self._stats(z)
        return z / inv_std + mean

    # ---- shapes, weights ---------------------------------------------------------------------

    def latent_shape(self, frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """[z_dim, t, h, w] that ``encode`` gives for a clip of this size (no checks)."""
        s = self.cfg.spatial_factor
        return self.cfg.z_dim, 1 + (frames - 1) // 4, height // s, width // s

    @torch.no_grad()
    def init_weights(self) -> None:
        """PyTorch's default conv init and unit norm gains (after ``to_empty`` from the meta device).
        The VAE is meant to be loaded from a checkpoint; this only makes fresh weights well defined."""
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Conv3d)):
                m.reset_parameters()
            elif isinstance(m, WanRMSNorm):
                nn.init.ones_(m.gamma)

    @classmethod
    def from_diffusers_dir(cls, path: str | Path, dtype: torch.dtype | None = None,
                           device: torch.device | str | None = None) -> "WanVAE":
        """A diffusers VAE folder (``config.json`` + ``diffusion_pytorch_model.safetensors``, e.g. a
        Wan2.1 ``*-Diffusers`` repo's ``vae/``), loaded strictly."""
        from safetensors.torch import load_file

        path = Path(path)
        model = cls(config_from_diffusers(json.loads((path / "config.json").read_text())))
        model.load_state_dict(load_file(str(path / "diffusion_pytorch_model.safetensors")), strict=True)
        return model.to(device=device, dtype=dtype).eval()

    def save_diffusers_dir(self, path: str | Path) -> Path:
        """Write this VAE as a diffusers ``AutoencoderKLWan`` folder (``config.json`` +
        ``diffusion_pytorch_model.safetensors``, the names unchanged): the inverse of
        :meth:`from_diffusers_dir`, which reads it back bit for bit, as does diffusers'
        ``AutoencoderKLWan.from_pretrained``. ``latents_mean`` / ``latents_std`` travel in the config."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(config_to_diffusers(self.cfg), indent=2, sort_keys=True) + "\n")
        state = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(path / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
        return path


@dataclass
class VAEComponentConfig(WanVAEConfig):
    """``model.vae`` (a recipe's frozen codec: ``data pack`` encodes the clips with it, ``generate``
    decodes the samples): a diffusers ``AutoencoderKLWan`` folder (``path``: a Wan pipeline's
    ``vae/``, or its root), or, without one, a random VAE of the fields above seeded by ``seed``
    (tests; the same weights in every process, so packs and runs agree)."""

    path: str | None = None
    seed: int = 0


def build_vae(config: VAEComponentConfig) -> WanVAE:
    """The registered ``vae`` ``wan_vae`` (see :class:`VAEComponentConfig`)."""
    if config.path:
        path = Path(config.path)
        return WanVAE.from_diffusers_dir(path / "vae" if (path / "vae" / "config.json").is_file() else path)
    fields_ = {f.name: getattr(config, f.name) for f in fields(WanVAEConfig)}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = WanVAE(WanVAEConfig(**fields_))
    return model.eval()


register("vae", "wan_vae", VAEComponentConfig)(build_vae)
