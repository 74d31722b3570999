"""Context parallelism (CP): one packed row split across the ranks of a CP group.

    apply_vision_split(model, meshes.vision_split)   # once, before TP (TP wraps the split features)
    apply_cp(model, dims, meshes)                    # once, after TP, before AC and FSDP
    local_mb = shard_micro_batch(mb, dims.cp, meshes.cp_rank)   # every micro-batch, on every CP rank

What happens to a micro-batch (a packed row of text, image and video documents):

1. ``sharding``: positions are already computed on the whole row (offline, by the packer); each
   document is padded to a multiple of 2·cp and cut into 2·cp chunks, rank r keeps chunks r and
   2·cp−1−r (the causal work is then equal on every rank). ids, labels, positions and document
   boundaries are sharded with the same indices; ``feature_rows`` says which media feature each
   local row takes.
2. ``vision`` / ``audio`` (``parallel.vision_split``): the media of the row are divided over the
   CP ranks by encoder cost — whole images and audio items, or temporal slices of videos (Qwen2-VL's vision attention never
   crosses a frame, so a video splits by frames exactly); each rank encodes its share and the
   features are all-gathered with an autograd-correct gather. Without the split every CP rank
   encodes every item. (A foundation with a larger tp than the encoder's also splits the media
   over its tp replicas of the encoder: ``Meshes.vision_split`` is the group that shares them.)
A video-diffusion generator's rows are split differently (contiguous pieces, bidirectional
attention per clip): ``sequence``.

3. ``attention``: the decoder's attention kernel is swapped (``Attention.attn_fn``) for one that
   exchanges keys/values across the group: ``ring``, ``allgather``, ``ulysses`` or ``hybrid``;
   a linear-attention layer's scan (``GatedDeltaNet.cp_fn``) for one that passes each piece's
   convolution window and recurrent state down the ranks (``linear``).

The model never learns about any of this: both hooks are attributes ``parallel/`` sets.
"""

from __future__ import annotations

import torch
from torch import nn


def apply_vision_split(model: nn.Module, mesh) -> None:
    """Share the encoding of each row's media over the ranks of ``mesh`` (None: no split): every
    encoder of the model (images / videos: ``VisionSplit``, audio: ``AudioSplit``)."""
    if mesh is None or mesh.size() == 1:
        return
    from omniweave.parallel.context.audio import AudioSplit
    from omniweave.parallel.context.vision import VisionSplit

    for m in getattr(model, "modalities", ()):
        encoder, projector = getattr(model, m.encoder), getattr(model, m.projector)
        if m.name == "vision":
            model.media_splits[m.name] = VisionSplit(mesh.get_group(), encoder.dummy_input, encoder.cfg.hidden_size)
        elif m.name == "audio":
            model.media_splits[m.name] = AudioSplit(mesh.get_group(), encoder.dummy_input, projector.num_tokens,
                                                    encoder.cfg.hidden_size)


def apply_cp(model: nn.Module, dims, meshes, head_groups: int = 1) -> None:
    """Swap every decoder layer's attention for the CP one. A no-op when ``dims.cp == 1``."""
    if dims.cp == 1:
        return
    if hasattr(model, "generator"):  # a video-diffusion generator: its tokens split in pieces (sequence.py)
        from omniweave.parallel.context.sequence import apply_sequence_split

        apply_sequence_split(model.generator, meshes.cp.get_group(), dims.cp_attention,
                             model.generator.config.attn_backend)
        return
    from omniweave.parallel.context.attention import CPContext

    from omniweave.parallel.context.linear import apply_linear_cp

    layers = model.foundation.layers
    ctx = CPContext(group=meshes.cp.get_group(), mode=dims.cp_attention, ulysses_group=meshes.ulysses_group,
                    ring_group=meshes.ring_group, head_groups=head_groups, backend=model.foundation.config.attn_backend)
    for layer in layers:
        if not layer.linear:
            layer.self_attn.attn_fn = ctx  # a CPContext is an attn_fn: ctx(q, k, v, cu_seqlens, window)
    apply_linear_cp(layers, ctx)  # linear-attention layers pass their states down the ranks (linear.py)


def shard_micro_batch(mb: dict, cp: int, cp_rank: int, tp: int = 1, pad_id: int = 0) -> dict:
    """This CP rank's share of a micro-batch (unchanged when cp == tp == 1). With a tensor-parallel
    foundation (``tp`` > 1) a pad document is appended first, so that the local row splits
    evenly over the tp ranks' sequence-parallel shards."""
    from omniweave.parallel.context.sharding import append_pad_document, pad_rows_for, plan_cp_shard, shard_batch

    if "latents" in mb:  # a row of diffusion clips: whole on every rank, the generator takes its piece
        return mb
    if tp > 1:
        mb = append_pad_document(mb, pad_rows_for(mb["cu_seqlens"], cp, tp), pad_id)
    if cp == 1:
        return mb
    return shard_batch(mb, plan_cp_shard(mb["cu_seqlens"], cp), cp_rank, pad_id)


def unshard_micro_batch_rows(shards: list, cu_seqlens, cp: int, tp: int = 1):
    """The inverse of :func:`shard_micro_batch` for per-row values: every CP rank's local rows
    ([local_len, …] each, in rank order) -> the original row's [L, …] (the tp pad document and the
    CP pads dropped). With cp == 1 the single shard is cut back to L."""
    from omniweave.parallel.context.sharding import pad_rows_for, plan_cp_shard, unshard_rows

    length = int(cu_seqlens[-1])
    if cp == 1:
        return shards[0][:length]
    pad = pad_rows_for(cu_seqlens, cp, tp)
    cu = torch.cat([cu_seqlens, cu_seqlens.new_tensor([length + pad])]) if pad else cu_seqlens
    return unshard_rows(shards, plan_cp_shard(cu, cp))[:length]


__all__ = ["apply_cp", "apply_vision_split", "shard_micro_batch", "unshard_micro_batch_rows"]
