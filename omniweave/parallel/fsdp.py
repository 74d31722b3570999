"""Apply activation checkpointing and FSDP2 from outside the model (torchtitan's order: AC, then FSDP).

The blocks are the foundation's decoder layers (``model.foundation.layers``; a video-diffusion
model's generator blocks, ``model.generator.blocks``), each encoder's
repeated blocks (the ViT's ``blocks``, the audio tower's ``layers``) and a VLA model's action
expert layers (``model.action_expert.layers``); the root ``fully_shard``
wraps the whole model, so the embeddings, final norm, LM head (the chunked loss reads
``foundation.lm_head.weight`` directly) and the projectors are sharded with the root.
"""

from __future__ import annotations

import torch
from torch import nn


def _encoders(model: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(encoder, projector) of every modality the model encodes."""
    return [(getattr(model, m.encoder), getattr(model, m.projector)) for m in getattr(model, "modalities", ())]


def _encoder_blocks(encoder: nn.Module) -> nn.ModuleList:
    blocks = getattr(encoder, "blocks", None)
    return blocks if blocks is not None else encoder.layers


def _expert_layers(model: nn.Module) -> list[nn.ModuleList]:
    """A VLA model's action expert layers (models/vla.py), or none."""
    expert = getattr(model, "action_expert", None)
    return [expert.layers] if expert is not None else []


def _trunk_layers(model: nn.Module) -> list[nn.ModuleList]:
    """The model's own repeated blocks: the foundation's decoder layers, or a video-diffusion
    model's generator blocks (models/diffusion.py)."""
    generator = getattr(model, "generator", None)
    return [generator.blocks] if generator is not None else [model.foundation.layers]


def _block_lists(model: nn.Module) -> list[nn.ModuleList]:
    """The repeated blocks AC and FSDP wrap one by one: decoder layers (or a generator's blocks),
    each encoder's blocks, the action expert's layers."""
    return [*_trunk_layers(model), *(_encoder_blocks(e) for e, _ in _encoders(model)), *_expert_layers(model)]


def _replace_blocks(model: nn.Module, wrap) -> None:
    for parent in _block_lists(model):
        for i, block in enumerate(list(parent)):
            parent[i] = wrap(block, i)


def apply_ac(model: nn.Module, mode: str = "none", every: int = 2) -> None:
    """Activation checkpointing: ``none``; ``full`` (every block); ``selective`` (every
    ``every``-th block, trading some of full's memory saving for less recompute)."""
    if mode in (None, "none", False):
        return
    if mode not in ("full", "selective"):
        raise ValueError(f"train.ac={mode!r}; choose none, full or selective")
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    def wrap(block: nn.Module, i: int) -> nn.Module:
        if mode == "full" or i % every == 0:
            return checkpoint_wrapper(block, preserve_rng_state=False)
        return block

    _replace_blocks(model, wrap)


OFFLOAD = ("none", "optimizer")


def apply_fsdp(model: nn.Module, mesh, precision: str = "fp32", encoder_mesh=None,
               experts: list[nn.Module] = (), experts_mesh=None, offload: str = "none",
               pin_memory: bool = False) -> nn.Module:
    """``fully_shard`` every block and then the root over ``mesh``; with ``encoder_mesh`` (the
    encoders' own data-parallel mesh, see ``dims.Meshes``) the encoders' blocks, the rest of
    each encoder and its projector shard over that one instead.

    Gradients are SUMMED over the ranks (divide factor 1), not averaged: the trainer divides
    every token's loss by the global number of loss tokens, whatever the layout.
    bf16: parameters are all-gathered and computed in bf16, gradients reduced in fp32, the
    sharded master weights stay fp32 (FSDP2 ``MixedPrecisionPolicy``). ``experts`` (the MoE
    layers' routed experts, already split by expert parallelism, parallel/expert.py) shard over
    their own ``experts_mesh`` (the ranks holding the same experts) on their expert dim (the
    next dim when there are fewer local experts than ranks), or, without one, are left alone.
    ``offload="optimizer"``: FSDP2's ``CPUOffloadPolicy`` — the sharded fp32 master weights, their
    gradients and so the optimizer state live in host memory and the optimizer steps there; the
    device holds a block's gathered weights while it runs (``pin_memory`` where there is an
    accelerator: pinned host buffers copy asynchronously)."""
    from torch.distributed.fsdp import fully_shard

    extra = _shard_experts(experts, experts_mesh, _policies(precision, offload, pin_memory))
    for block in (b for layers in (*_trunk_layers(model), *_expert_layers(model)) for b in layers):
        fully_shard(block, mesh=mesh, **extra)
    for encoder, projector in _encoders(model):
        for block in _encoder_blocks(encoder):
            fully_shard(block, mesh=mesh if encoder_mesh is None else encoder_mesh, **extra)
        if encoder_mesh is not None:
            fully_shard(encoder, mesh=encoder_mesh, **extra)
            fully_shard(projector, mesh=encoder_mesh, **extra)
    fully_shard(model, mesh=mesh, **extra)
    _sum_gradients(model)
    return model


def _shard_experts(experts: list[nn.Module], experts_mesh, extra: dict) -> dict:
    """FSDP2 for the routed experts (see ``apply_fsdp``); the keyword arguments for the other units
    (without an experts mesh the experts' parameters are left alone: ignored)."""
    from torch.distributed.fsdp import fully_shard

    if experts and (experts_mesh is None or experts_mesh.size() == 1):
        return {**extra, "ignored_params": {p for m in experts for p in m.parameters()}}
    if experts:
        from torch.distributed.tensor import Shard

        def placement(p, n=experts_mesh.size(experts_mesh.ndim - 1)):  # HSDP: its shard dim
            return Shard(0) if (p.to_local() if hasattr(p, "to_local") else p).shape[0] >= n else Shard(1)

        for m in experts:
            fully_shard(m, mesh=experts_mesh, shard_placement_fn=placement, **extra)
    return extra


def apply_fsdp_to_stage_parts(part: nn.Module, stages: list[nn.Module], mesh, precision: str = "fp32",
                              encoder_mesh=None, offload: str = "none", pin_memory: bool = False,
                              experts: list[nn.Module] = (), experts_mesh=None) -> nn.Module:
    """FSDP2 for a pipeline rank's part of the model (``parallel/pipeline_split.slice_model``; parts it
    does not hold are None) over ``mesh``, the data-parallel ranks holding the same stages: every
    decoder layer, encoder block, encoder and projector is its own FSDP unit; the embedding is the
    first stage's module's, the final norm and LM head the last stage's (``stages``: this rank's
    ``pipeline.StageModule``s; a tp embedding's output is a view, which FSDP2 warns about at the
    output of a unit). The part itself is no unit: the stages call its pieces, never its
    forward, so its own parameters would never be gathered. ``encoder_mesh``: the encoders' and
    projectors' own mesh, ``offload`` (``train.offload``) and ``experts`` (the part's routed
    experts under expert parallelism) over ``experts_mesh``, as in ``apply_fsdp``. Gradients are
    summed, as ``apply_fsdp``'s."""
    from torch.distributed.fsdp import fully_shard

    extra = _shard_experts(experts, experts_mesh, _policies(precision, offload, pin_memory))
    foundation = part.foundation
    units = [(b, mesh) for b in foundation.layers if b is not None]
    for encoder, projector in _encoders(part):
        if encoder is not None:
            units += [(m, encoder_mesh or mesh) for m in (*_encoder_blocks(encoder), encoder)]
        units += [(projector, encoder_mesh or mesh)] if projector is not None else []
    for unit, unit_mesh in units:
        fully_shard(unit, mesh=unit_mesh, **extra)
    for stage in stages:  # the final norm and LM head (the loss reads lm_head.weight without calling
        if stage.is_first or stage.is_last:  # lm_head) go with the last stage's module, whose forward
            fully_shard(stage, mesh=mesh, **extra)  # gathers them; the embedding with the first's
    _sum_gradients(part)
    for stage in stages:
        _sum_gradients(stage)
    return part


def _policies(precision: str, offload: str, pin_memory: bool) -> dict:
    """``fully_shard`` keyword arguments: bf16 compute with fp32 reduction and master weights; the
    offload policy for ``train.offload``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    if offload not in OFFLOAD:
        raise ValueError(f"train.offload={offload!r}; choose one of {', '.join(OFFLOAD)}")
    extra = {}
    if precision == "bf16":
        extra["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if offload == "optimizer":
        extra["offload_policy"] = CPUOffloadPolicy(pin_memory=pin_memory)
    return extra


def _sum_gradients(model: nn.Module) -> None:
    """Gradients SUMMED over the ranks (the trainer divides by the global loss-token count)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # plain SUM (gloo has no PREMUL_SUM)
