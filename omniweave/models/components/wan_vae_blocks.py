"""The layers of the Wan 2.1 causal video VAE (``wan_vae.py`` holds the config and the model).

Every temporal mixing in this VAE is a causal convolution over frames; everything else (RMS norm
over channels, SiLU, the mid-block attention) works on one frame at a time. So a clip can be cut in
chunks along time and run chunk by chunk, if each causal conv keeps the last frames of its input
from the chunk before. That cache is ``state``, one dict per encode / decode call, keyed by module:

    state is None   the input is the whole clip: causal zero padding, no cache
    state = {}      a stream: each layer takes its left context from ``state`` and leaves its own
                    last input frames there for the next chunk (zeros before the first chunk)

Both give the same numbers for any chunking the model allows (tests/test_wan_vae.py checks it);
diffusers keeps an index-addressed list (``feat_cache`` / ``feat_idx``) instead, with the same
meaning. Two layers treat the clip's first frame on its own, which is where the ``1 + 4k`` frame
count comes from:

    downsample3d    frame 0 passes alone; frame j >= 1 of the output is a stride-2 conv over input
                    frames (2j-2, 2j-1, 2j), so 1 + 2k frames -> 1 + k
    upsample3d      frame 0 passes alone (one frame); every later frame becomes two, by a causal
                    conv over the frames AFTER frame 0 (frame 0 is never their context: diffusers
                    marks it "Rep" and pads zeros), so 1 + k frames -> 1 + 2k

Module and parameter names are diffusers' ``AutoencoderKLWan`` names, so its state dict loads as is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

StreamState = dict  # nn.Module -> its cached tensor (or a marker); see the module doc


class CausalConv3d(nn.Conv3d):
    """Conv3d padded on the left in time only (2·padding_t frames), so output frame t sees input
    frames <= t. ``padding`` is given like a centred conv's; the spatial part stays symmetric."""

    def __init__(self, in_dim: int, out_dim: int, kernel_size, stride=1, padding=0):
        super().__init__(in_dim, out_dim, kernel_size, stride=stride, padding=padding)
        pt, ph, pw = self.padding
        self.left = 2 * pt  # frames of left context this conv needs
        self.spatial_pad = (pw, pw, ph, ph)
        self.padding = (0, 0, 0)  # padding is done by hand in forward

    def forward(self, x: torch.Tensor, state: StreamState | None = None) -> torch.Tensor:
        left = self.left
        if state is not None and left:
            prev = state.get(self)
            if prev is None:  # first chunk: the context is the causal zero padding
                prev = x.new_zeros(*x.shape[:2], left, *x.shape[3:])
            x = torch.cat([prev, x], dim=2)
            # clone: a view would keep the whole chunk alive until the next one
            state[self] = x[:, :, -left:].clone()
            left = 0
        return super().forward(F.pad(x, (*self.spatial_pad, left, 0)))


class WanRMSNorm(nn.Module):
    """L2-normalise over channels (dim 1), times sqrt(C) and a per-channel gain: RMS norm without
    eps inside the root (F.normalize's 1e-12 floor). Half precision is normalised in fp32, as diffusers
    does. ``images`` picks the gain's shape: [C, 1, 1] for per-frame 2-D input, [C, 1, 1, 1] for video."""

    def __init__(self, dim: int, images: bool = False):
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim, 1, 1) if images else torch.ones(dim, 1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low = x.dtype in (torch.float16, torch.bfloat16)
        return F.normalize(x.float() if low else x, dim=1).to(x.dtype) * self.scale * self.gamma


class ResidualBlock(nn.Module):
    """norm -> SiLU -> causal conv 3³, twice (dropout before the second conv), plus a 1×1×1 conv
    shortcut when the width changes."""

    def __init__(self, in_dim: int, out_dim: int, dropout: float = 0.0):
        super().__init__()
        self.norm1 = WanRMSNorm(in_dim)
        self.conv1 = CausalConv3d(in_dim, out_dim, 3, padding=1)
        self.norm2 = WanRMSNorm(out_dim)
        self.dropout = nn.Dropout(dropout)
        self.conv2 = CausalConv3d(out_dim, out_dim, 3, padding=1)
        self.conv_shortcut = CausalConv3d(in_dim, out_dim, 1) if in_dim != out_dim else None

    def forward(self, x: torch.Tensor, state: StreamState | None = None) -> torch.Tensor:
        h = x if self.conv_shortcut is None else self.conv_shortcut(x)
        x = self.conv1(F.silu(self.norm1(x)), state)
        x = self.conv2(self.dropout(F.silu(self.norm2(x))), state)
        return x + h


class AttentionBlock(nn.Module):
    """Single-head self-attention over the pixels of each frame (no temporal mixing), residual."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm = WanRMSNorm(dim, images=True)
        self.to_qkv = nn.Conv2d(dim, 3 * dim, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, t, h, w = x.shape
        frames = x.transpose(1, 2).reshape(b * t, c, h, w)
        qkv = self.to_qkv(self.norm(frames)).view(b * t, 3 * c, h * w).transpose(1, 2)  # [BT, HW, 3C]
        q, k, v = qkv.unsqueeze(1).chunk(3, dim=-1)  # [BT, 1, HW, C] each: one head
        out = F.scaled_dot_product_attention(q, k, v).squeeze(1).transpose(1, 2).reshape(b * t, c, h, w)
        return self.proj(out).view(b, t, c, h, w).transpose(1, 2) + x


class Resample(nn.Module):
    """×2 spatial down/upsampling per frame, and for the ``3d`` modes also ×2 in time (see the module
    doc for how frame 0 is kept apart). ``resample.1`` is the conv (index 0 the pad / upsample) to
    keep diffusers' names; upsampling halves the width (Wan 2.1's ``upsample_out_dim = dim // 2``)."""

    MODES = ("downsample2d", "downsample3d", "upsample2d", "upsample3d")

    def __init__(self, dim: int, mode: str):
        super().__init__()
        if mode not in self.MODES:
            raise ValueError(f"wan_vae Resample mode {mode!r} is not one of {self.MODES}")
        self.mode = mode
        if mode.startswith("up"):
            # nearest-exact runs in fp32, as diffusers' WanUpsample (some backends lack half kernels for it)
            self.resample = nn.Sequential(nn.Upsample(scale_factor=(2.0, 2.0), mode="nearest-exact"),
                                          nn.Conv2d(dim, dim // 2, 3, padding=1))
        else:  # pad right / bottom by one so a stride-2 3×3 conv halves even sizes exactly
            self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=2))
        if mode == "upsample3d":  # one conv makes both output frames: channels [0, C) and [C, 2C)
            self.time_conv = CausalConv3d(dim, 2 * dim, (3, 1, 1), padding=(1, 0, 0))
        elif mode == "downsample3d":  # no padding: the left context is the previous input frame
            self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1))

    def forward(self, x: torch.Tensor, state: StreamState | None = None) -> torch.Tensor:
        if self.mode == "upsample3d":
            x = self._double_frames(x, state)
        b, c, t, h, w = x.shape
        frames = x.transpose(1, 2).reshape(b * t, c, h, w)
        if self.mode.startswith("up"):
            out = self.resample[1](self.resample[0](frames.float()).to(frames.dtype))
        else:
            out = self.resample(frames)
        x = out.view(b, t, *out.shape[1:]).transpose(1, 2)
        if self.mode == "downsample3d":
            x = self._halve_frames(x, state)
        return x

    def _double_frames(self, x: torch.Tensor, state: StreamState | None) -> torch.Tensor:
        first = state is None or self not in state  # this chunk holds the clip's frame 0
        if state is not None:
            state[self] = True
        head, tail = (x[:, :, :1], x[:, :, 1:]) if first else (x[:, :, :0], x)
        if tail.shape[2] == 0:
            return head
        b, c, t, h, w = tail.shape
        # the time conv's cache starts from zeros at frame 1: frame 0 is never context
        tail = self.time_conv(tail, state).view(b, 2, c, t, h, w)
        tail = tail.permute(0, 2, 3, 1, 4, 5).reshape(b, c, 2 * t, h, w)  # frame j -> 2j, 2j+1
        return torch.cat([head, tail], dim=2) if head.shape[2] else tail

    def _halve_frames(self, x: torch.Tensor, state: StreamState | None) -> torch.Tensor:
        prev = None if state is None else state.get(self)
        if prev is None:  # this chunk holds frame 0: it passes alone and is the first stride window's start
            head, frames = x[:, :, :1], x
        else:  # the previous chunk's last frame starts this chunk's first window
            head, frames = x[:, :, :0], torch.cat([prev, x], dim=2)
        if state is not None:
            state[self] = x[:, :, -1:].clone()
        if frames.shape[2] < 3:  # frame 0 alone: no window yet
            return head
        out = self.time_conv(frames)
        return torch.cat([head, out], dim=2) if head.shape[2] else out


class MidBlock(nn.Module):
    """residual -> attention -> residual, at the lowest resolution."""

    def __init__(self, dim: int, dropout: float = 0.0):
        super().__init__()
        self.attentions = nn.ModuleList([AttentionBlock(dim)])
        self.resnets = nn.ModuleList([ResidualBlock(dim, dim, dropout), ResidualBlock(dim, dim, dropout)])

    def forward(self, x: torch.Tensor, state: StreamState | None = None) -> torch.Tensor:
        x = self.resnets[0](x, state)
        return self.resnets[1](self.attentions[0](x), state)


class Encoder3d(nn.Module):
    """video [B, C, 1+4k, H, W] -> [B, out_dim, 1+k, H/s, W/s] (s = 2^(levels-1)). ``down_blocks`` is
    flat, as in diffusers: per level ``num_res_blocks`` residual blocks, then a Resample except at
    the last level."""

    def __init__(self, in_channels: int, dim: int, out_dim: int, dim_mult: list[int], num_res_blocks: int,
                 temporal_down: list[bool], dropout: float = 0.0):
        super().__init__()
        dims = [dim * m for m in [1, *dim_mult]]
        self.conv_in = CausalConv3d(in_channels, dims[0], 3, padding=1)
        blocks: list[nn.Module] = []
        for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
            for _ in range(num_res_blocks):
                blocks.append(ResidualBlock(d_in, d_out, dropout))
                d_in = d_out
            if i != len(dim_mult) - 1:
                blocks.append(Resample(d_out, "downsample3d" if temporal_down[i] else "downsample2d"))
        self.down_blocks = nn.ModuleList(blocks)
        self.mid_block = MidBlock(dims[-1], dropout)
        self.norm_out = WanRMSNorm(dims[-1])
        self.conv_out = CausalConv3d(dims[-1], out_dim, 3, padding=1)

    def forward(self, x: torch.Tensor, state: StreamState | None = None) -> torch.Tensor:
        x = self.conv_in(x, state)
        for block in self.down_blocks:
            x = block(x, state)
        x = self.mid_block(x, state)
        return self.conv_out(F.silu(self.norm_out(x)), state)


class UpBlock(nn.Module):
    """``num_res_blocks + 1`` residual blocks, then an optional Resample (``upsamplers.0``)."""

    def __init__(self, in_dim: int, out_dim: int, num_res_blocks: int, dropout: float, mode: str | None):
        super().__init__()
        self.resnets = nn.ModuleList(ResidualBlock(in_dim if j == 0 else out_dim, out_dim, dropout)
                                     for j in range(num_res_blocks + 1))
        self.upsamplers = nn.ModuleList([Resample(out_dim, mode)]) if mode is not None else None

    def forward(self, x: torch.Tensor, state: StreamState | None = None) -> torch.Tensor:
        for resnet in self.resnets:
            x = resnet(x, state)
        return x if self.upsamplers is None else self.upsamplers[0](x, state)


class Decoder3d(nn.Module):
    """latent [B, z_dim, 1+k, h, w] -> video [B, out_channels, 1+4k, h·s, w·s], unclamped. Widths
    mirror the encoder's; every block after the first takes half its predecessor's width, as the
    upsampling conv halves it."""

    def __init__(self, z_dim: int, dim: int, out_channels: int, dim_mult: list[int], num_res_blocks: int,
                 temporal_up: list[bool], dropout: float = 0.0):
        super().__init__()
        dims = [dim * m for m in [dim_mult[-1], *dim_mult[::-1]]]
        self.conv_in = CausalConv3d(z_dim, dims[0], 3, padding=1)
        self.mid_block = MidBlock(dims[0], dropout)
        blocks = []
        for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:])):
            mode = None
            if i != len(dim_mult) - 1:
                mode = "upsample3d" if temporal_up[i] else "upsample2d"
            blocks.append(UpBlock(d_in // 2 if i > 0 else d_in, d_out, num_res_blocks, dropout, mode))
        self.up_blocks = nn.ModuleList(blocks)
        self.norm_out = WanRMSNorm(dims[-1])
        self.conv_out = CausalConv3d(dims[-1], out_channels, 3, padding=1)

    def forward(self, x: torch.Tensor, state: StreamState | None = None) -> torch.Tensor:
        x = self.mid_block(self.conv_in(x, state), state)
        for block in self.up_blocks:
            x = block(x, state)
        return self.conv_out(F.silu(self.norm_out(x)), state)
