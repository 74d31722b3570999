"""Tensor parallelism (DTensor ``parallelize_module`` plans) applied from outside the model.

Each component gets its own 1-D tp mesh (``model.foundation.tp``, ``model.image_encoder.tp`` =
``model.audio_encoder.tp`` in a recipe: the encoders share theirs); ``None`` (or a mesh of one rank) leaves it unsharded. Order in a run: TP -> CP ->
AC -> FSDP (``fully_shard`` over the dp mesh of a 2-D ``(dp, tp)`` mesh takes TP's DTensors).

Decoder (Megatron TP + sequence parallelism on our one packed row, sequence dim 0):

    input_ids [L]  --embed_tokens: vocab-sharded rows, reduce-scatter-->  x [L/tp, D]   (Shard(0))
    per layer:  norm on [L/tp, D] -> all-gather [L, D] -> q,k,v on local heads
                [L, H/tp, Dh] (+ [L, Hkv/tp, Dh] or one replicated KV head) -> attention ->
                o_proj -> reduce-scatter [L/tp, D];  same for the MLP (gate/up | down)
    final norm [L/tp, D] -> vocab-parallel loss (``tp_loss``): LM head sharded over the vocab,
                no [L, V] logits anywhere

GQA: KV heads are split when ``num_kv_heads % tp == 0``; when ``tp % num_kv_heads == 0`` k/v
projections stay replicated and each rank keeps the KV head its query heads use
(``tp_styles.ReplicatedKVHeads``); anything else is a ValueError with the numbers. Tied
embeddings share the one vocab-sharded weight (embedding rows = LM head rows).

ViT (Megatron TP, activations ``[P, D]`` replicated): fused ``qkv`` sharded over its input dim
and reduce-scattered over heads (``tp_styles.FusedHeadsParallel``: each rank gets its heads'
q, k and v; names and full tensors unchanged, DCP-safe), ``proj`` row-wise, MLP fc1 | gate, up
column-wise and fc2 | down row-wise, attention and MLP each ending in an all-reduce. Norms, the patch embedding and the projector
(PatchMerger) stay replicated plain tensors: every rank computes them on the same inputs with
the same full gradients, so their parameters and gradients are identical across tp ranks.

Action expert (VLA, ``model.action_expert``): sharded over the foundation's tp mesh with the
backbone's head split (its chunk queries read the backbone's local keys / values; ``expert_plan``),
activations replicated like the ViT's.

Hand-off encoder -> decoder (``OmniModel``): the projected features ``[N, D]`` are replicated
plain tensors, but each rank's embeddings are only its rows ``[r·L/tp, (r+1)·L/tp)``. A forward
pre-hook gives the batch ``feature_rows`` for those rows (``sequence_parallel_row``) so each
rank places the features of its own rows, and each modality's ``media_handoffs`` hook wraps the features as
Replicate -> local with a Partial gradient: identity forward, all-reduce of the per-rank
feature gradients backward, so the encoder sees the complete gradient. The packed row length
must be a multiple of the foundation's tp.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput, RowwiseParallel, SequenceParallel,
    parallelize_module,
)

from omniweave.models.registry import MODALITIES
from omniweave.parallel.context.sharding import feature_rows_from_spans
from omniweave.parallel.tp_loss import vocab_parallel_ce_sum, vocab_parallel_ce_tokens
from omniweave.parallel.tp_linear import apply_linear_tp, linear_layer_plan
from omniweave.parallel.tp_styles import FusedHeadsParallel, ReplicatedKVHeads, ShardedRMSNorm

# ----------------------------------------------------------------------------- layouts (pure)


def kv_head_layout(num_heads: int, num_kv_heads: int, tp: int) -> str:
    """``"split"`` (KV heads sharded like the query heads) or ``"replicate"`` (each rank keeps
    the one KV head its queries need); ValueError for layouts that cannot work."""
    if num_heads % tp:
        raise ValueError(f"num_heads={num_heads} is not divisible by tp={tp}")
    if num_kv_heads % tp == 0:
        return "split"
    if tp % num_kv_heads == 0:
        return "replicate"
    raise ValueError(f"num_kv_heads={num_kv_heads} and tp={tp}: tensor parallelism needs num_kv_heads % tp == 0 "
                     f"(split the KV heads) or tp % num_kv_heads == 0 (replicate them)")  # fmt: skip


def _divisible(what: str, n: int, tp: int) -> None:
    if n % tp:
        raise ValueError(f"{what}={n} is not divisible by tp={tp}")


def check_decoder_tp(cfg, tp: int) -> str:
    """Validate a DecoderConfig for tp ranks; returns the KV head layout."""
    if tp > 1 and getattr(cfg, "mla", False):
        raise ValueError(f"foundation tp={tp}: tensor parallelism of multi-head latent attention (family "
                         f"{cfg.family}) is not supported yet; use tp: 1")  # fmt: skip
    if "linear_attention" in (cfg.layer_types or ()):  # Gated DeltaNet heads split like attention heads
        _divisible("linear_num_key_heads", cfg.linear_num_key_heads, tp)
        _divisible("linear_num_value_heads", cfg.linear_num_value_heads, tp)
    layout = kv_head_layout(cfg.num_heads, cfg.num_kv_heads, tp)
    _divisible("vocab_size", cfg.vocab_size, tp)
    if len(cfg.moe_layers()) < cfg.num_layers:  # some dense MLPs to shard
        _divisible("intermediate_size", cfg.intermediate_size, tp)
    return layout


# A MoE layer under TP: its input is gathered over the sequence like a dense MLP's, every tp
# rank routes the whole row through the (unsharded) router and experts -- the same tokens, so
# the same weight gradients on every tp rank, like any replicated weight -- and keeps its own
# sequence shard of the output. Expert parallelism still splits the experts, over dp x cp.
MOE_UNDER_TP = PrepareModuleInputOutput(
    input_layouts=(Shard(0), None, None), desired_input_layouts=(Replicate(), None, None), use_local_input=True,
    output_layouts=(Replicate(),), desired_output_layouts=(Shard(0),), use_local_output=True,
)


def check_vit_tp(cfg, tp: int) -> None:
    _divisible("vision num_heads", cfg.num_heads, tp)
    _divisible("vision intermediate_size", cfg.intermediate_size, tp)
    if tp > 1 and getattr(cfg, "qk_norm", False):  # InternViT-6B: one RMSNorm over all heads' channels
        raise ValueError("image_encoder tp > 1 with qk_norm (a norm over all heads at once) is not supported; "
                         "set model.image_encoder.tp=1")


def sequence_parallel_row(batch: dict, tp_rank: int, tp: int) -> dict:
    """The batch as tp rank ``tp_rank`` feeds it to a sequence-parallel foundation: full-length
    ``position_ids`` / ``cu_seqlens`` (defaults made explicit) and, per modality with items, its
    feature rows (``feature_rows``, ``audio_feature_rows``) for its rows
    ``[tp_rank·L/tp, (tp_rank+1)·L/tp)`` only. Other keys unchanged."""
    ids = batch["input_ids"]
    length = ids.shape[0]
    if length % tp:
        raise ValueError(f"packed row of {length} tokens is not divisible by the foundation's tp={tp} "
                         "(sequence parallelism splits the row evenly; pack to a multiple of tp)")  # fmt: skip
    out = dict(batch)
    if out.get("position_ids") is None:
        out["position_ids"] = torch.arange(length, device=ids.device)[None]
    if out.get("cu_seqlens") is None:
        out["cu_seqlens"] = torch.tensor([0, length], dtype=torch.int32, device=ids.device)
    shard = length // tp
    for m in MODALITIES:
        grid = batch.get(m.grid)
        if grid is not None and grid.shape[0] > 0:
            rows = batch.get(m.rows)
            if rows is None:
                if batch.get(m.spans) is None:
                    raise ValueError(f"batch has {m.grid} but no {m.spans} to place the features")
                rows = feature_rows_from_spans(batch[m.spans], length)
            out[m.rows] = rows[tp_rank * shard : (tp_rank + 1) * shard]
    return out


# ----------------------------------------------------------------------------- plans


def decoder_plan(cfg, tp: int) -> dict:
    """The Decoder's ``parallelize_module`` plan for tp ranks (sequence dim 0); validates the layout."""
    if check_decoder_tp(cfg, tp) == "split":
        kv = ColwiseParallel()
    else:
        kv = ReplicatedKVHeads(cfg.num_kv_heads, cfg.head_dim)
    layer = {
        "input_layernorm": SequenceParallel(sequence_dim=0),
        # Attention.forward(x, cos, sin, cu_seqlens, kv_cache): gather x over the sequence
        "self_attn": PrepareModuleInput(input_layouts=(Shard(0), None, None, None, None),
                                        desired_input_layouts=(Replicate(), None, None, None, None)),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": kv,
        "self_attn.v_proj": kv,
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(0)),
        "post_attention_layernorm": SequenceParallel(sequence_dim=0),
    }  # fmt: skip
    dense_mlp = {
        "mlp": PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(0)),
    }
    moe = set(cfg.moe_layers())
    mlps = {f"layers.{i}.{name}": style for i in range(cfg.num_layers) if i not in moe for name, style in dense_mlp.items()}
    mlps.update({f"layers.{i}.mlp": MOE_UNDER_TP for i in moe})
    if cfg.qk_norm:  # per-head norms over local heads [L, h, Dh]: heads play the sharded dim
        layer["self_attn.q_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
        layer["self_attn.k_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
    linear = linear_layer_plan()
    mixers = {f"layers.{i}.{name}": style for i in range(cfg.num_layers)
              for name, style in (linear if cfg.is_linear_layer(i) else layer).items()}
    mixers.update({f"layers.{i}.{name}": layer[name] for i in range(cfg.num_layers)
                   for name in ("input_layernorm", "post_attention_layernorm")})
    return {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        **mixers,
        **mlps,
        "norm": SequenceParallel(sequence_dim=0),
        # used by logits() only (eval / tests: gathers [L, V]); the loss reads the weight itself
        "lm_head": ColwiseParallel(input_layouts=Shard(0), output_layouts=Replicate()),
    }


def vit_plan(cfg, tp: int) -> dict:
    """The VisionTransformer's plan for tp ranks; validates the layout."""
    check_vit_tp(cfg, tp)
    block = {"attn.qkv": FusedHeadsParallel(3, cfg.hidden_size // cfg.num_heads), "attn.proj": RowwiseParallel()}
    if cfg.mlp == "swiglu":
        block.update({"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                      "mlp.down_proj": RowwiseParallel()})  # fmt: skip
    else:
        block.update({"mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()})
    return {f"blocks.*.{name}": style for name, style in block.items()}


def check_audio_tp(cfg, tp: int) -> None:
    _divisible("audio num_heads", cfg.num_heads, tp)
    _divisible("audio intermediate_size", cfg.intermediate_size, tp)


def audio_plan(cfg, tp: int) -> dict:
    """A Whisper-style audio tower's plan (components/audio_encoder.py), like the ViT's:
    q / k / v column-wise (each rank its heads), out_proj row-wise, fc1 column-wise, fc2 row-wise;
    the conv stem, norms, pooling and output projection stay replicated."""
    check_audio_tp(cfg, tp)
    layer = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
             "self_attn.v_proj": ColwiseParallel(), "self_attn.out_proj": RowwiseParallel(),
             "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}  # fmt: skip
    return {f"layers.*.{name}": style for name, style in layer.items()}


def check_expert_tp(cfg, tp: int) -> None:
    """An action expert (components/action_expert.py) is sharded over the foundation's tp mesh:
    its queries attend with the backbone's local key/value heads, so its heads split the same way."""
    kv_head_layout(cfg.num_heads, cfg.num_kv_heads, tp)
    _divisible("action_expert intermediate_size", cfg.intermediate_size, tp)


def expert_plan(cfg, tp: int) -> dict:
    """The action expert's plan (Megatron TP, its activations ``[N·H, W]`` replicated as the ViT's):
    q column-wise, k / v as the backbone's (split or each rank's own replicated KV head, so a rank's
    chunk queries meet the prefix keys of the same heads), o_proj row-wise; gate / up column-wise,
    down row-wise. adaRMS norms, time MLP and action projections stay replicated plain tensors."""
    check_expert_tp(cfg, tp)
    kv = ColwiseParallel() if kv_head_layout(cfg.num_heads, cfg.num_kv_heads, tp) == "split" \
        else ReplicatedKVHeads(cfg.num_kv_heads, cfg.head_dim)
    layer = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": kv, "self_attn.v_proj": kv,
             "self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
             "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}  # fmt: skip
    return {f"layers.*.{name}": style for name, style in layer.items()}


def check_generator_tp(cfg, tp: int) -> None:
    """A video-diffusion DiT (components/wan_dit.py): its heads and FFN split over tp (an I2V DiT's
    added image keys / values split with the heads, so they need nothing more)."""
    _divisible("generator num_attention_heads", cfg.num_attention_heads, tp)
    _divisible("generator ffn_dim", cfg.ffn_dim, tp)


def generator_plan(cfg, tp: int) -> dict:
    """A Wan DiT's plan (Megatron TP, its activations ``[T, D]`` replicated as the ViT's): in both
    attentions q / k / v column-wise (each rank its heads), their RMSNorms over all heads sharded
    (``ShardedRMSNorm``: one all-reduce of the sums of squares), to_out row-wise; the FFN's fc1
    column-wise, fc2 row-wise. Image-to-video (``image_dim`` set): the cross-attention's added image
    keys / values (``attn2.add_k_proj`` / ``add_v_proj``) column-wise too and their all-heads norm
    ``attn2.norm_added_k`` sharded, so each rank attends its heads' queries to its heads of the image
    tokens as of the text (wan_i2v.py: heads from the local width). The patch embedding, the time /
    text / image embedders, the modulation tables, the cross-attention LayerNorm and proj_out stay
    replicated plain tensors."""
    check_generator_tp(cfg, tp)
    block = {"ffn.fc1": ColwiseParallel(), "ffn.fc2": RowwiseParallel()}
    for attn in ("attn1", "attn2"):
        block.update({f"{attn}.{p}": ColwiseParallel() for p in ("to_q", "to_k", "to_v")})
        block.update({f"{attn}.to_out": RowwiseParallel(), f"{attn}.norm_q": ShardedRMSNorm(),
                      f"{attn}.norm_k": ShardedRMSNorm()})
    if getattr(cfg, "image_dim", None):  # I2V: attn2 is a WanI2VCrossAttention
        block.update({"attn2.add_k_proj": ColwiseParallel(), "attn2.add_v_proj": ColwiseParallel(),
                      "attn2.norm_added_k": ShardedRMSNorm()})
    return {f"blocks.*.{name}": style for name, style in block.items()}


# per modality (registry.MODALITIES): (layout check, parallelize_module plan) of its encoder
ENCODER_TP = {"vision": (check_vit_tp, vit_plan), "audio": (check_audio_tp, audio_plan)}


# ----------------------------------------------------------------------------- apply


def parallelize_decoder(decoder: nn.Module, mesh) -> None:
    parallelize_module(decoder, mesh, decoder_plan(decoder.config, mesh.size()))
    apply_linear_tp(decoder, mesh)  # the linear-attention layers' own parameters and head regrouping
    if decoder.config.tie_word_embeddings:  # both are Shard(0) of [V, D]: share the embedding's DTensor
        decoder.tie_weights()


def _features_into_tp(mesh, features: torch.Tensor) -> torch.Tensor:
    """A modality's hand-off to a tp foundation (``OmniModel.media_handoffs``): replicated features
    [N, D] whose gradient is the sum of every tp rank's (each rank's rows use some of them)."""
    placed = DTensor.from_local(features, mesh, [Replicate()], run_check=False)
    return placed.to_local(grad_placements=[Partial()])


def sequence_parallel_batch(mesh, model, batch: dict) -> dict:
    """``batch`` as this rank of the foundation's tp ``mesh`` feeds it to ``model`` (what the
    model's forward pre-hook does; a pipeline's first stage, which calls no forward, calls it)."""
    batch = sequence_parallel_row(batch, mesh.get_local_rank(), mesh.size())
    for m in getattr(model, "modalities", ()):  # the model's own span checks (its forward sees only this rank's rows)
        if m.rows in batch and batch.get(m.spans) is not None:
            model.check_media_spans(batch[m.spans], batch[m.grid], batch["input_ids"].shape[0], m.name,
                                    batch.get(m.sizes) if m.sizes else None)
    return batch


def _sequence_parallel_hook(mesh, model, args):
    return (sequence_parallel_batch(mesh, model, args[0]), *args[1:])


def _mesh_or_none(mesh, what: str):
    if mesh is None or mesh.size() == 1:
        return None
    if mesh.ndim != 1:
        raise ValueError(f"{what} needs a 1-D tp mesh (slice it: mesh['tp']), got {mesh.ndim}-D")
    return mesh


def apply_tp(model: nn.Module, foundation_mesh=None, encoder_mesh=None, features_mesh="foundation") -> nn.Module:
    """Shard ``model.foundation`` over ``foundation_mesh`` and every encoder (``image_encoder``,
    ``audio_encoder``: ``ENCODER_TP``) over ``encoder_mesh`` (1-D meshes; None or size 1 = that
    component unsharded), in place.

    Every rank must hold the same weights beforehand (same seed or checkpoint). Under a tp
    foundation the model's loss is the vocab-parallel one and its forward takes each batch
    through :func:`sequence_parallel_row`; the loss is replicated on the foundation's tp ranks.
    Layouts are checked before anything changes. Training forwards only: KV-cache generation
    needs the unsharded model, and ``logits(batch)`` of an OmniModel row with media (which
    skips the forward hook) takes ``sequence_parallel_row(batch, tp_rank, tp)``.

    ``features_mesh``: the ranks over which the media features' gradient partials are summed
    (default: the foundation's tp mesh). When the encoders' tp is smaller than the foundation's,
    the media are split over the foundation's tp replicas of the encoders (``VisionSplit``,
    ``AudioSplit``, whose backward sums over them), so only the encoders' own tp group is left:
    pass that mesh."""
    foundation_mesh = _mesh_or_none(foundation_mesh, "the foundation")
    encoder_mesh = _mesh_or_none(encoder_mesh, "the encoders")
    generator = getattr(model, "generator", None)
    if generator is not None:  # a video-diffusion model: its generator over the trunk's tp mesh
        if foundation_mesh is not None:
            parallelize_module(generator, foundation_mesh, generator_plan(generator.config, foundation_mesh.size()))
        return model
    modalities = getattr(model, "modalities", ())
    if encoder_mesh is not None and not modalities:
        raise ValueError("encoder_mesh given but the model has no encoder")
    expert = getattr(model, "action_expert", None)
    if foundation_mesh is not None:
        check_decoder_tp(model.foundation.config, foundation_mesh.size())
        if expert is not None:
            check_expert_tp(expert.config, foundation_mesh.size())
    if encoder_mesh is not None:
        for m in modalities:
            ENCODER_TP[m.name][0](getattr(model, m.encoder).cfg, encoder_mesh.size())
        for m in modalities:
            encoder = getattr(model, m.encoder)
            parallelize_module(encoder, encoder_mesh, ENCODER_TP[m.name][1](encoder.cfg, encoder_mesh.size()))
    if foundation_mesh is not None:
        parallelize_decoder(model.foundation, foundation_mesh)
        if expert is not None:  # the same mesh: its attention reads the foundation's local heads
            parallelize_module(expert, foundation_mesh, expert_plan(expert.config, foundation_mesh.size()))
        model.ce_sum = partial(vocab_parallel_ce_sum, mesh=foundation_mesh)
        model.ce_tokens = partial(vocab_parallel_ce_tokens, mesh=foundation_mesh)
        model.register_forward_pre_hook(partial(_sequence_parallel_hook, foundation_mesh))
        features_mesh = foundation_mesh if features_mesh == "foundation" else _mesh_or_none(features_mesh, "features")
        if features_mesh is not None:
            for m in modalities:
                model.media_handoffs[m.name] = partial(_features_into_tp, features_mesh)
    return model
