"""Context parallelism (CP): one packed row split across the ranks of a CP group.

    apply_cp(model, dims, meshes)                    # once, before AC and FSDP (DESIGN: TP -> CP -> AC -> FSDP)
    local_mb = shard_micro_batch(mb, dims.cp, meshes.cp_rank)   # every micro-batch, on every CP rank

What happens to a micro-batch (a packed row of text, image and video documents):

1. ``sharding``: positions are already computed on the whole row (offline, by the packer); each
   document is padded to a multiple of 2·cp and cut into 2·cp chunks, rank r keeps chunks r and
   2·cp−1−r (the causal work is then equal on every rank). ids, labels, positions and document
   boundaries are sharded with the same indices; ``feature_rows`` says which media feature each
   local row takes.
2. ``vision`` (``parallel.vision_split``): the media of the row are divided over the CP ranks by
   encoder cost — whole images, or temporal slices of videos (Qwen2-VL's vision attention never
   crosses a frame, so a video splits by frames exactly); each rank encodes its share and the
   features are all-gathered with an autograd-correct gather. Without the split every CP rank
   encodes every item.
3. ``attention``: the decoder's attention kernel is swapped (``Attention.attn_fn``) for one that
   exchanges keys/values across the group: ``ring``, ``allgather``, ``ulysses`` or ``hybrid``.

The model never learns about any of this: both hooks are attributes ``parallel/`` sets.
"""

from __future__ import annotations

from torch import nn


def apply_cp(model: nn.Module, dims, meshes, head_groups: int = 1) -> None:
    """Swap every decoder layer's attention for the CP one and, with ``dims.vision_split``,
    install the vision split on an ``OmniModel``. A no-op when ``dims.cp == 1``."""
    if dims.cp == 1:
        return
    from omniweave.parallel.context.attention import CPContext

    layers = model.foundation.layers
    backend = layers[0].self_attn.cfg.attn_backend if len(layers) else "auto"
    if dims.cp_attention in ("ring", "hybrid") and backend == "sdpa":
        backend = "auto"  # ring blocks need a kernel with a backward from a given lse: math or flash
    ctx = CPContext(group=meshes.cp.get_group(), mode=dims.cp_attention, ulysses_group=meshes.ulysses_group,
                    ring_group=meshes.ring_group, head_groups=head_groups, backend=backend)
    for layer in layers:
        layer.self_attn.attn_fn = ctx  # a CPContext is an attn_fn: ctx(q, k, v, cu_seqlens, window)
    encoder = getattr(model, "image_encoder", None)
    if dims.vision_split and encoder is not None:
        from omniweave.parallel.context.vision import VisionSplit

        model.media_split = VisionSplit(meshes.cp.get_group(), encoder.dummy_input, encoder.cfg.hidden_size)


def shard_micro_batch(mb: dict, cp: int, cp_rank: int, pad_id: int = 0) -> dict:
    """This CP rank's share of a micro-batch (unchanged when cp == 1)."""
    if cp == 1:
        return mb
    from omniweave.parallel.context.sharding import plan_cp_shard, shard_batch

    return shard_batch(mb, plan_cp_shard(mb["cu_seqlens"], cp), cp_rank, pad_id)


__all__ = ["apply_cp", "shard_micro_batch"]
