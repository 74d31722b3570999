"""The model as the trainer builds it: parallelised from outside (``build``: vision split -> TP ->
LoRA -> CP -> EP -> AC -> FSDP2, meta-device initialisation for big models, ``train.init_from``),
and, the other way, its whole unsharded copy on rank 0 for evaluation and HF export
(``full_model_on_rank0``, also from a pipeline's stages). The training engine (train/engine.py)
calls these; ``omniweave check`` and the DPO reference build through ``build`` too."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from omniweave.config import section
from omniweave.errors import UserError
from omniweave.train import checkpoint

META_INIT_PARAMS = 2_000_000_000  # above this, initialise on the meta device and shard before materialising


def build(cfg, device: torch.device, dims, meshes, meta_init_params: int = META_INIT_PARAMS) -> nn.Module:
    """The model, parallelised from outside in DESIGN's order: (vision split) -> TP -> LoRA adapters
    -> CP -> EP -> AC -> FSDP2 (foundation over dp x cp, a smaller-tp encoder over dp x cp x tp_rep, MoE experts split
    over the EP group and sharded over the ranks holding the same ones; see parallel/dims.py and
    parallel/expert.py).
    A model of more than ``meta_init_params`` parameters on more than one rank is built on the
    meta device and each rank materialises and initialises only its shards (``omniweave check``
    passes 0 to take that path with a tiny model)."""
    from omniweave.config import to_dict
    from omniweave.models.lora import apply_lora, reset_adapters
    from omniweave.models.registry import build_model
    from omniweave.parallel.context import apply_cp, apply_vision_split
    from omniweave.parallel.expert import apply_ep, expert_modules, set_router_groups
    from omniweave.parallel.fsdp import apply_ac, apply_fsdp
    from omniweave.parallel.tp import apply_tp

    model_cfg = to_dict(cfg.model)
    check_attn_backends(model_cfg)
    with torch.device("meta"):
        model = build_model(model_cfg, adapters=False)
    n_params = sum(p.numel() for p in model.parameters())
    meta_init = n_params > meta_init_params and dims.world_size > 1
    if not meta_init:  # identical weights on every rank from the seed: sharding then keeps each rank's slice
        torch.manual_seed(int(cfg.train.seed))
        model = build_model(model_cfg, adapters=False)
        if hasattr(model, "init_weights"):
            model.init_weights()
        model.to(device)
    apply_vision_split(model, meshes.vision_split)  # before TP, which passes the split features on
    if dims.tp > 1:  # features' gradient partials: over the encoder's tp group, the split sums the rest
        apply_tp(model, meshes.tp, meshes.tp_encoder, features_mesh=meshes.tp_encoder if dims.tp_encoder < dims.tp
                 else meshes.tp)
    apply_lora(model, model_cfg)  # after TP: each adapter is placed after its base weight (models/lora.py)
    apply_cp(model, dims, meshes, head_groups=section(cfg, "parallel").cp_head_groups)
    if dims.ep > 1:
        apply_ep(model, meshes.ep)
    set_router_groups(model, meshes.dp_cp, meshes.cp)
    apply_ac(model, section(cfg, "train").ac)
    if dims.pp == 1 and uses_fsdp(cfg, dims.world_size):  # a pipeline shards its ranks' parts after the cut
        apply_fsdp(model, meshes.fsdp, section(cfg, "train").precision,
                   encoder_mesh=meshes.encoder_fsdp if dims.tp_encoder < dims.tp else None,
                   experts=expert_modules(model) if dims.ep > 1 else (), experts_mesh=meshes.expert_dp,
                   offload=offload_mode(cfg), pin_memory=device.type != "cpu")
    if meta_init:  # materialise each rank's shards only, then initialise them
        model.to_empty(device=device)
        seed_sharded_init(int(cfg.train.seed), device)
        model.init_weights()
        reset_adapters(model)  # init_weights drew the adapters' Linears like any other
    if section(cfg, "train").init_from:
        init_weights_from(model, str(cfg.train.init_from), cfg.model)
    return model


def frozen_reference(cfg, engine) -> nn.Module:
    """The frozen reference of a preference or RL objective (DPO's ``train.dpo.ref=model``, GRPO's
    ``rl.kl_coef`` > 0): the policy's initial weights (seed or ``train.init_from``), built and
    parallelised exactly like it, without gradients, in eval mode."""
    model = build(cfg, engine.device, engine.dims, engine.meshes)
    model.requires_grad_(False)
    return model.eval()


def offload_mode(cfg) -> str:
    return section(cfg, "train").offload or "none"


def uses_fsdp(cfg, world_size: int, pp: int = 1) -> bool:
    """FSDP2 wraps the model when there are more ranks than pipeline stages (a pipeline's ranks hold
    different stages, not shards: parallel/pipeline.py), and whenever it offloads, on one rank or
    one rank per stage too (its offload policy is what moves the master weights and optimizer
    state to host memory)."""
    return world_size > pp or offload_mode(cfg) != "none"


def seed_sharded_init(seed: int, device: torch.device) -> None:
    """Seed the initialisation of sharded (meta-device) weights so a run is reproducible. On CUDA-like
    devices DTensor draws every shard from one seeded stream at the shard's offset, so all ranks take
    ``seed`` (the weights do not depend on the layout). On CPU DTensor draws from each rank's own
    generator: one seed everywhere would give every rank the same shard values, so rank r takes
    ``seed + r`` (reproducible for a layout, distinct shards)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.manual_seed(seed + rank if device.type == "cpu" else seed)


def check_attn_backends(model_cfg: dict) -> None:
    """Every ``model.<component>.attn_backend`` names a backend this machine has (else a UserError
    listing the ones it has); per-call fallbacks (dtype, head dim) are logged by the kernels. The
    same for a hybrid decoder's ``linear_backend`` (``fla``: the package and a CUDA device)."""
    from omniweave.models.components.attention import check_backend
    from omniweave.models.components.linear_attention import check_linear_backend

    for name, component in model_cfg.items():
        if isinstance(component, dict) and "attn_backend" in component:
            check_backend(str(component["attn_backend"]), f"model.{name}.attn_backend")
        if isinstance(component, dict) and "linear_backend" in component:
            check_linear_backend(str(component["linear_backend"]), f"model.{name}.linear_backend")


def init_weights_from(model: nn.Module, path: str, model_cfg=None) -> None:
    """``train.init_from``: a HF model directory (each rank reads only its own slices of the
    safetensors) or an omniweave training checkpoint (a run, checkpoints/ or step dir: its model
    weights through DCP, resharded to this layout; its optimizer and schedule are not taken).
    LoRA adapters the source lacks (a HF base, a run without them) keep their fresh initialisation.
    A video-diffusion model's generator initialises from a diffusers Wan transformer folder (or a
    pipeline root: its ``transformer/``)."""
    from omniweave.models.hf.wan import is_diffusers_dit_dir, load_wan_dit_into

    if hasattr(model, "generator") and is_diffusers_dit_dir(path) is not None:
        try:
            load_wan_dit_into(model.generator, path)
        except ValueError as e:
            raise UserError(str(e)) from None
        return
    if (Path(path) / "config.json").is_file():
        from omniweave.models.hf.loading import load_hf_into

        load_hf_into(model, path)
    else:
        checkpoint.load_weights(checkpoint.resolve_checkpoint(path), model, model_cfg)


def full_model_on_rank0(model: nn.Module, cfg, pp_group=None) -> nn.Module | None:
    """Collective: an unsharded CPU copy of the model on rank 0 (None elsewhere), for eval/export.
    ``pp_group`` (a pipelined run: ``model`` is this rank's stages' part, parallel/pipeline.py):
    the parts of rank 0's pipeline, each gathered whole over its own shards, then sent to rank 0."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from omniweave.config import to_dict
    from omniweave.models.hf.loading import assign_state_dict
    from omniweave.models.registry import build_model

    # cpu_offload keeps the gathered tensors on global rank 0 only, which holds one stage of a pipeline
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=pp_group is None))
    if pp_group is not None:
        sd = _gather_stage_parts({k: v.cpu() for k, v in sd.items()}, pp_group)
    if dist.get_rank() != 0:
        return None
    with torch.device("meta"):
        plain = build_model(to_dict(cfg.model))
    assign_state_dict(plain, sd, "training state")
    return plain.eval()


def _gather_stage_parts(part: dict, pp_group) -> dict:
    """Rank 0: the union of the state dicts of its pipeline's ranks (each one stage part, under the
    model's names); the other pipelines (dp, cp, tp copies of the same stages) send nothing."""
    first = [dist.get_process_group_ranks(pp_group) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(first, src=0)
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(part if dist.get_rank() in first[0] else {}, parts, dst=0)
    return {k: v for p in parts or [] for k, v in p.items()}
