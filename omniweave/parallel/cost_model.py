"""Predicted compute cost of a pack: a linear model over seven metadata features, FLOP-derived
then refitted to measured step times. Pure numpy (no scipy); the decoder is counted
from its config (dense, MoE with k of E experts active, DeepSeek-V3 MLA), equal to what the MFU
estimate counts on the built model (tests/test_qwen3_moe.py).

    features  [F=7]  (Σ len_d², Σ len_d, docs, Σ t·(h·w)², Σ t·h·w, Σ n_a², Σ n_a)   see balance.pack_features
    cost      = a·Σlen² + b·Σlen + c·docs + e·patches² + p·patches + f·audio² + q·audio

(n_a: an audio encoder item's frames after the stride-2 conv stem, 2 per audio token.)

Starting coefficients (``CostModel.from_model_config``), in FLOPs of forward + backward:

- ``b`` = passes · N_dec: every decoder token runs every decoder matmul once (N_dec = the
  non-embedding parameters plus the LM head's matmul, and a hybrid model's linear-attention scan
  in parameter-equivalents, ``linear_scan_equivalent``; passes = 6 when the decoder trains,
  4 when it is frozen but gradients flow through it to a trained encoder or projector, else 2).
- ``a`` = (2 + 4·grad) · layers · heads · head_dim: causal varlen attention (the full-attention
  layers only, where ``layer_types`` mixes in linear ones), QKᵀ and AV over
  len²/2 pairs per document, the same estimate as ``train.metrics.step_flops``; sliding windows
  are not modelled.
- ``c`` = a · 128² / 2: a per-document overhead, the half-filled 128×128 diagonal tile a flash
  kernel pays at every document boundary. The refit replaces it with what the hardware shows.
- ``e`` = (4 + 8·grad) · d_vit · full_layers: bidirectional attention within a frame, per
  (patches per frame)² (full_layers = every block, or only ``fullatt_block_indexes`` when the
  tower uses window attention).
- ``p`` = passes · (N_vit + N_proj / merge²) + (4 + 8·grad) · d_vit · window² · window_layers:
  the ViT's matmuls per patch (plus the projector's share) and window attention, which is linear
  in patches. It is kept as its own feature because it is the larger encoder term by far: in
  Qwen2.5-VL-7B at 400 patches per frame the per-patch terms cost ~160x the frame attention, and
  a vision token (merge² = 4 patches) costs ~37 % more than a text token.
- ``f`` = (4 + 8·grad) · d_audio · layers: the audio tower's bidirectional attention over an
  item's n_a frames (Qwen2-Audio attends over the whole <= 30 s window; Qwen2.5-Omni's windows
  are counted as if whole, an over-estimate for long clips).
- ``q`` = passes · (N_layers + N_conv / frame) + the projector per token / 2: the tower's matmuls
  per frame after the stem (conv1 runs 2 mel frames per frame, conv2 one), the projector on the
  pooled half.

``refit(features [n, F], seconds [n])``: non-negative least squares (Lawson-Hanson active set,
deterministic) on columns scaled to unit norm, with a free non-negative intercept (per-step
overhead every rank pays alike; it does not change an assignment, so it is dropped) and a weak
ridge pull (``RIDGE``) toward the FLOP model scaled to seconds, which keeps a coefficient the data
cannot separate (a feature that is always zero, two features that move together) at the FLOP
model's proportion. Too few samples (< F + 2) or no spread in the timings: the scaled FLOP model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

FEATURES = ("sum_len2", "tokens", "docs", "patches2", "patches", "audio2", "audio")
NUM_FEATURES = len(FEATURES)
DOC_TILE = 128  # flash-attention tile edge behind the per-document overhead ``c``
RIDGE = 1e-4  # pull toward the scaled FLOP model, relative to unit-norm columns
_NAMES = "abcepfq"  # the coefficients, in FEATURES order


def _passes(trains: bool, grads_flow: bool) -> int:
    """Matmul FLOPs per parameter per item: forward 2, input gradients 2, weight gradients 2."""
    return 2 + (2 if trains or grads_flow else 0) + (2 if trains else 0)


@dataclass(frozen=True)
class CostModel:
    a: float  # per Σ len² (decoder attention)
    b: float  # per token (decoder matmuls)
    c: float  # per document
    e: float  # per Σ t·(h·w)² (ViT full attention)
    p: float  # per patch (ViT + projector matmuls, window attention)
    f: float = 0.0  # per Σ n_a² (audio tower attention)
    q: float = 0.0  # per audio frame after the conv stem (audio tower + projector matmuls)

    def __post_init__(self):
        coef = self.coefficients
        if not np.all(np.isfinite(coef)) or np.any(coef < 0):
            raise ValueError(f"cost coefficients must be finite and >= 0, got {dict(zip(_NAMES, coef.tolist()))}")

    @property
    def coefficients(self) -> np.ndarray:
        return np.array([getattr(self, k) for k in _NAMES], dtype=np.float64)

    def cost(self, features) -> np.ndarray:
        """features [..., F] -> predicted cost [...] (float64)."""
        features = np.asarray(features, dtype=np.float64)
        if features.shape[-1:] != (NUM_FEATURES,):
            raise ValueError(f"features must end in {NUM_FEATURES} ({', '.join(FEATURES)}), got shape {features.shape}")
        return features @ self.coefficients

    def scaled(self, factor: float) -> CostModel:
        return CostModel(*(self.coefficients * factor).tolist())

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in _NAMES}

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        return cls(**{k: float(d[k]) for k in _NAMES if k in d})  # f, q: absent before audio

    @classmethod
    def default(cls) -> CostModel:
        """Without a model config: attention work only (decoder Σ len² + ViT Σ patches² per
        frame, equal weights), the rule packs were balanced by before this model existed."""
        return cls(a=1.0, b=0.0, c=0.0, e=1.0, p=0.0)

    @classmethod
    def from_model_config(cls, model_cfg: dict) -> CostModel:
        """FLOP model of ``model_cfg`` (the recipe's ``model`` section: ``foundation`` and
        optionally ``image_encoder`` / ``projector``, ``audio_encoder`` / ``audio_projector``),
        each component read through its registered config dataclass (the defaults its YAML
        leaves out are the model's); see the module docstring."""
        from omniweave.models.components.audio_projector import LinearAudioProjectorConfig
        from omniweave.models.registry import common_config

        if "foundation" not in model_cfg:
            raise ValueError(f"model config needs a 'foundation' section, got keys {sorted(model_cfg)}")
        sections = ("foundation", "image_encoder", "projector", "audio_encoder", "audio_projector")
        dec, vit, proj, audio, audio_proj = (component_config(k, model_cfg.get(k)) for k in sections)
        vit_trains, proj_trains, audio_trains, audio_proj_trains, dec_trains = (
            model_cfg.get(k) is not None and not common_config(model_cfg.get(k)).freeze
            for k in ("image_encoder", "projector", "audio_encoder", "audio_projector", "foundation"))
        # the Σ len² term is the full-attention layers' (a hybrid model's linear layers are in b)
        h, heads = dec.hidden_size, dec.num_heads
        layers = sum(not dec.is_linear_layer(i) for i in range(dec.num_layers))
        hd = dec.head_dim
        if dec.family == "deepseek_v3":  # MLA: q·k over qk dims, p·v over v dims
            hd = (dec.qk_nope_head_dim + dec.qk_rope_head_dim + dec.v_head_dim) // 2
        dec_grad = dec_trains or vit_trains or proj_trains or audio_trains or audio_proj_trains
        a = (2 + 4 * dec_grad) * layers * heads * hd
        b = _passes(dec_trains, vit_trains or proj_trains or audio_trains or audio_proj_trains) * decoder_params(dec)
        c = a * DOC_TILE**2 / 2
        e = p = 0.0
        if vit is not None:
            d, depth = vit.hidden_size, vit.depth
            window = getattr(vit, "window_size", None)  # Qwen2.5-VL's windows; InternViT / Qwen3-VL have none
            full = len(vit.fullatt_block_indexes or []) if window else depth
            win_patches = (int(window) // vit.patch_size) ** 2 if window else 0
            attn = 4 + 8 * vit_trains
            e = float(attn * d * full)
            p = _passes(vit_trains, False) * vit_params(vit) + attn * d * win_patches * (depth - full)
            if proj is not None:
                p += _passes(proj_trains, vit_trains) * projector_params_per_patch(proj, d, h, vit)
        f = q = 0.0
        if audio is not None:
            d, layers = audio.hidden_size, audio.num_layers
            f = float((4 + 8 * audio_trains) * d * layers)
            q = _passes(audio_trains, False) * audio_params_per_frame(audio)
            if isinstance(audio_proj, LinearAudioProjectorConfig):
                q += _passes(audio_proj_trains, audio_trains) * (d * h + h) / 2
        return cls(a=float(a), b=float(b), c=float(c), e=float(e), p=float(p), f=f, q=float(q))

    def refit(self, features, seconds) -> CostModel:
        """Coefficients (seconds per feature unit) fitted to measured ``seconds [n]`` of work
        with ``features [n, F]``; ``self`` is the prior. See the module docstring."""
        x = np.asarray(features, dtype=np.float64)
        y = np.asarray(seconds, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != NUM_FEATURES or y.shape != (x.shape[0],):
            raise ValueError(f"refit needs features [n, {NUM_FEATURES}] and seconds [n], got {x.shape} and {y.shape}")
        if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))) or np.any(x < 0) or np.any(y < 0):
            raise ValueError("refit needs finite, non-negative features and seconds")
        prior_cost = self.cost(x)
        scale = float(prior_cost @ y / (prior_cost @ prior_cost)) if prior_cost.any() else 0.0
        prior = self.scaled(max(scale, 0.0))
        n = len(y)
        if n < NUM_FEATURES + 2 or np.ptp(y) <= 1e-9 * np.max(y) or not prior_cost.any():
            return prior
        seen = np.flatnonzero(np.any(x > 0, axis=0))  # features the samples show; the rest keep the prior
        design = np.column_stack([x[:, seen], np.ones(n)])  # [n, S + 1], the last column the intercept
        norms = np.linalg.norm(design, axis=0)
        # unknowns u = coefficients * norms; ridge rows sqrt(RIDGE) * (u - u_prior), not on the intercept
        ridge = np.sqrt(RIDGE) * np.eye(len(seen), len(seen) + 1)
        u_prior = prior.coefficients[seen] * norms[:-1]
        u = nnls(np.vstack([design / norms, ridge]), np.concatenate([y, np.sqrt(RIDGE) * u_prior]))
        coefficients = prior.coefficients
        coefficients[seen] = (u / norms)[:-1]
        return CostModel(*coefficients.tolist())


def component_config(kind: str, cfg):
    """A component's registered config dataclass (``registry.build_config``) from its YAML
    mapping; a config already built is returned as it is, no section (None) stays None."""
    if cfg is None or dataclasses.is_dataclass(cfg):
        return cfg
    from omniweave.models.registry import build_config

    return build_config(kind, cfg)


def decoder_params(dec) -> int:
    """Non-embedding parameters a token of a ``decoder`` config (its YAML mapping or its
    DecoderConfig) computes with, the LM head counted even when tied (its matmul runs either way);
    a MoE layer counts its router and the k experts a token uses (plus shared experts), not all of them."""
    dec = component_config("foundation", dec)
    return sum(layer_params(dec)) + dec.hidden_size + dec.vocab_size * dec.hidden_size


def layer_params(dec) -> list[int]:
    """Per decoder layer (a DecoderConfig), the parameters a token computes with: its token mixer
    (attention with q/k norms, or a linear layer with its scan in parameter-equivalents), its
    MLP (dense, or a MoE block's router, k experts and shared experts) and its two norms."""
    h, heads, kv, hd = dec.hidden_size, dec.num_heads, dec.num_kv_heads, dec.head_dim
    if dec.family == "deepseek_v3":
        attention = _mla_params(dec)
    else:  # an output gate doubles q_proj (Qwen3.5)
        attention = (heads * (1 + dec.attn_output_gate) + 2 * kv) * hd * (h + dec.qkv_bias) + heads * hd * h
    attention += 2 * hd if dec.qk_norm else 0
    active = dec.num_experts_per_tok + dec.n_shared_experts
    moe_mlp = 3 * h * (dec.moe_intermediate_size or 0) * active + dec.num_experts * h
    if dec.shared_expert_intermediate_size:  # the gated shared expert and its [1, D] gate
        moe_mlp += 3 * h * dec.shared_expert_intermediate_size + h
    moe = set(dec.moe_layers())
    out = []
    for i in range(dec.num_layers):
        linear = dec.is_linear_layer(i)
        mixer = linear_layer_params(dec) + linear_scan_equivalent(dec) if linear else attention
        out.append(mixer + (moe_mlp if i in moe else 3 * h * dec.intermediate_size) + 2 * h)
    return out


def decoder_layer_costs(dec, doc_len: float) -> list[float]:
    """Each decoder layer's forward + backward work per token (FLOPs, trained), for a pipeline's
    stage split where layers differ (a hybrid model's linear and full-attention layers): 6 per
    parameter a token computes with (:func:`layer_params`), plus a full-attention layer's score
    work over documents of ``doc_len`` tokens (6·heads·head_dim·doc_len per token, the ``a``
    term of the FLOP model)."""
    dec = component_config("foundation", dec)
    scores = 6.0 * dec.num_heads * dec.head_dim * doc_len
    return [6.0 * n + (0.0 if dec.is_linear_layer(i) else scores) for i, n in enumerate(layer_params(dec))]


def linear_layer_params(dec) -> int:
    """A Gated DeltaNet layer's parameters (components/linear_attention.py): in_proj_qkv / z / b / a,
    the depthwise convolution over q|k|v, dt_bias and A_log per value head, the gated norm, out_proj."""
    h, nk, nv = dec.hidden_size, dec.linear_num_key_heads, dec.linear_num_value_heads
    key, value = nk * dec.linear_key_head_dim, nv * dec.linear_value_head_dim
    conv = (2 * key + value) * dec.linear_conv_kernel_dim
    return h * (2 * key + value) + h * value + 2 * h * nv + conv + 2 * nv + dec.linear_value_head_dim + value * h


def linear_scan_equivalent(dec) -> int:
    """The chunked gated delta rule's work per token of one linear layer, in parameter-equivalents
    (forward FLOPs / 2, as a weight's matmul costs 2 per parameter): per value head, the causal
    intra-chunk scores and values (half a chunk of keys on average: C/2 · (dk + dv)) and the state
    read and update (2 · dk · dv). Linear in length, unlike attention's Σ len² term."""
    dk, dv, c = dec.linear_key_head_dim, dec.linear_value_head_dim, dec.linear_chunk_size
    return dec.linear_num_value_heads * (c * (dk + dv) // 2 + 2 * dk * dv)


def _mla_params(dec) -> int:
    """DeepSeek-V3's multi-head latent attention (components/mla.py): low-rank q (or a plain
    q_proj), the joint kv latent + rope key, its up-projection, the output."""
    h, heads, bias = dec.hidden_size, dec.num_heads, int(dec.qkv_bias)
    nope, rope, v = dec.qk_nope_head_dim, dec.qk_rope_head_dim, dec.v_head_dim
    q_rank, kv_rank = dec.q_lora_rank, dec.kv_lora_rank
    q = h * heads * (nope + rope) if q_rank is None else (h + bias + 1) * q_rank + q_rank * heads * (nope + rope)
    kv = (h + bias) * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + v)
    return q + kv + heads * v * h + bias * h


def vit_params(vit) -> int:
    """Parameters of a vision tower config (Qwen-VL, InternViT: each patch runs all of them)."""
    d, inter = vit.hidden_size, vit.intermediate_size
    patch_in = vit.in_channels * getattr(vit, "temporal_patch_size", 1) * vit.patch_size**2
    mlp = 3 * d * inter + 2 * inter + d if vit.mlp == "swiglu" else 2 * d * inter + inter + d
    return patch_in * d + vit.depth * (4 * d * d + 4 * d + mlp + 2 * d)


def audio_params_per_frame(audio) -> int:
    """Audio tower matmul parameters per frame after the conv stem (Whisper-style: conv1 k3 over
    2 mel frames per frame, conv2 k3, layers of attention + MLP, Qwen2.5-Omni's output proj on the
    pooled half; Qwen2-Audio's tower has none)."""
    d, ffn, mels = audio.hidden_size, audio.intermediate_size, audio.num_mel_bins
    conv = 2 * 3 * mels * d + 3 * d * d
    layer = 4 * d * d + 2 * d * ffn
    out = audio.output_dim * d // 2 if hasattr(audio, "output_dim") else 0
    return conv + audio.num_layers * layer + out


def projector_params_per_patch(proj, vit_dim: int, dec_dim: int, vit) -> float:
    """Projector parameters a patch runs through: a patch merger's per merged token / merge²."""
    from omniweave.models.components.intern_vit import PixelShuffleMLPConfig
    from omniweave.models.components.llava_projector import LlavaOnevisionProjectorConfig
    from omniweave.models.components.projector import MLPAdapterConfig, PatchMergerConfig
    from omniweave.models.components.qwen3_vit import Qwen3MergerConfig

    if isinstance(proj, PatchMergerConfig):
        merge = proj.merge_size
        merged = vit_dim * merge**2
        return (vit_dim + merged * merged + merged + merged * dec_dim + dec_dim) / merge**2
    if isinstance(proj, Qwen3MergerConfig):  # the merger and one DeepStack merger per level, each fc1 -> fc2 on merged tokens
        merge = proj.merge_size
        merged = vit_dim * merge**2
        one = merged * merged + merged + merged * dec_dim + dec_dim
        return (1 + proj.deepstack_levels) * one / merge**2
    if isinstance(proj, PixelShuffleMLPConfig):  # LayerNorm, Linear(merged -> D), Linear(D -> D) per merged token
        merged = vit_dim * proj.merge_size**2
        return (2 * merged + merged * dec_dim + dec_dim + dec_dim * dec_dim + dec_dim) / proj.merge_size**2
    if isinstance(proj, LlavaOnevisionProjectorConfig):  # Linear(vit -> D), Linear(D -> D) per patch (the layout is free)
        return vit_dim * dec_dim + dec_dim + dec_dim * dec_dim + dec_dim
    if isinstance(proj, MLPAdapterConfig):
        hidden = proj.hidden_dim or dec_dim
        return vit_dim * hidden + hidden + hidden * dec_dim + dec_dim
    raise ValueError(f"projector {type(proj).__name__}: the cost model knows patch_merger, qwen3_merger, pixel_shuffle_mlp, llava_onevision_mlp and mlp_adapter")


def nnls(a: np.ndarray, y: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """argmin_{x >= 0} ||a x - y||₂ by Lawson & Hanson's active-set method. a [n, k], y [n] -> x [k].

    Deterministic: the entering column is the first of the largest gradient, the leaving one the
    first to hit zero. Columns should be of comparable scale (callers normalise them)."""
    n, k = a.shape
    x, passive = np.zeros(k), np.zeros(k, dtype=bool)
    scale = np.abs(a).sum(axis=0).max(initial=1.0) * np.abs(y).max(initial=1.0)
    tol = 10 * np.finfo(np.float64).eps * max(n, k) * scale
    grad = a.T @ y
    for _ in range(max_iter or 3 * k):
        free = ~passive & (grad > tol)
        if not free.any():
            break
        passive[int(np.argmax(np.where(free, grad, -np.inf)))] = True
        while True:
            z = np.zeros(k)
            z[passive] = np.linalg.lstsq(a[:, passive], y, rcond=None)[0]
            if np.all(z[passive] > 0):
                x = z
                break
            blocked = np.flatnonzero(passive & (z <= 0))
            gap = x[blocked] - z[blocked]  # >= 0; 0 only where x and z are both 0
            ratios = np.divide(x[blocked], gap, out=np.zeros_like(gap), where=gap > 0)
            x = x + ratios.min() * (z - x)
            passive[blocked[int(np.argmin(ratios))]] = False  # the first variable to reach zero leaves
            passive &= x > 0
            x[~passive] = 0.0
        grad = a.T @ (y - a @ x)
    return x


class Refitter:
    """Collects (features, measured seconds) over the first steps; ``add`` returns the refitted
    CostModel exactly once (at the ``warmup``-th collected step), None before and after.

    Per step every rank passes the same arrays: ``rank_features [dp, F]`` (row r: Σ of
    ``pack_features`` over the packs rank r ran) and ``rank_seconds [dp]`` (rank r's compute time
    of those packs: forward + backward of its micro-batches), both all-gathered over the dp ranks.
    Each rank is one sample. The time must be the rank's own work: where collectives synchronise
    the ranks inside the step (FSDP all-gathers parameters in every layer), a fast rank's wall
    time includes waiting for the slowest, so take kernel time (CUDA events around compute
    kernels, a profiler), or calibrate in steps without sharding. The first ``skip`` steps
    (allocator warm-up, lazy initialisation, compilation) are ignored.

    The trainer's loop, with ``loader`` balancing by cost::

        refitter = Refitter(loader.cost_model, warmup=20)
        ...after each step:
            row = torch.tensor([*features_of_my_packs, my_compute_seconds], dtype=torch.float64)
            rows = all_gather(row)                                  # [dp, F + 1], same on every rank
            model = refitter.add(rows[:, :F].numpy(), rows[:, F].numpy())
            if model is not None:
                loader.set_cost_model(model)  # every rank, same step: same assignments on all ranks

    The loader's ``state_dict`` carries the model, so a run resumed after the refit makes the same
    assignments as an uninterrupted one (keep ``refitter.done`` in the trainer's checkpoint state
    and do not refit again); one resumed before it refits from its own timings, which no run
    reproduces exactly."""

    def __init__(self, prior: CostModel, warmup: int = 20, skip: int = 1):
        if warmup < 1 or skip < 0:
            raise ValueError(f"warmup={warmup} must be >= 1 and skip={skip} >= 0")
        self.prior, self.warmup, self.skip = prior, warmup, skip
        self.features: list[np.ndarray] = []  # per collected step [dp, F]
        self.seconds: list[np.ndarray] = []  # per collected step [dp]
        self.seen, self.result = 0, None

    @property
    def done(self) -> bool:
        return self.result is not None

    def add(self, rank_features, rank_seconds) -> CostModel | None:
        self.seen += 1
        if self.done or self.seen <= self.skip:
            return None
        feats = np.asarray(rank_features, dtype=np.float64).reshape(-1, NUM_FEATURES)
        secs = np.asarray(rank_seconds, dtype=np.float64).reshape(-1)
        if len(secs) != len(feats):
            raise ValueError(f"{len(feats)} ranks' features but {len(secs)} times; pass one time per rank")
        self.features.append(feats)
        self.seconds.append(secs)
        if len(self.features) < self.warmup:
            return None
        self.result = self.prior.refit(np.concatenate(self.features), np.concatenate(self.seconds))
        return self.result
