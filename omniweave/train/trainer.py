"""``omniweave train R.yaml [key=value …] [--nproc N] [--resume auto|CKPT]``: SFT / pretraining on packed data.

One step = one global batch of ``train.global_batch`` packs. Each data-parallel rank takes its
``global_batch / dp`` packs and runs them as successive micro-batches (one packed row each,
gradient accumulation), then all ranks take one optimizer step. The loss of every token is
divided by the number of loss tokens of the *global* batch (DESIGN.md), so 1, 2 or 4 ranks give
the same loss and the same gradients.

Order of setup (torchtitan's): device + process group -> meshes -> model (full on CPU or on meta)
-> vision split, TP, CP, activation checkpointing, FSDP2 -> optimizer, schedule -> loader ->
resume -> loop. With CP and TP the cp x tp ranks of a dp group take the same packs.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from omniweave.train import checkpoint
from omniweave.train.loss import PHASES, apply_phase
from omniweave.train.metrics import MetricsLogger, device_peak_flops, model_flop_counts, step_flops

META_INIT_PARAMS = 2_000_000_000  # above this, initialise on the meta device and shard before materialising


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe YAML path or built-in recipe name (configs/recipes/)")
    p.add_argument("overrides", nargs="*", help="key=value recipe overrides (Hydra syntax)")
    p.add_argument("--nproc", type=int, default=1, help="processes on this machine (runs itself under torchrun)")
    p.add_argument("--resume", default=None,
                   help="'auto': continue from the run's latest complete checkpoint, if any; or a checkpoint dir")


def run(args: argparse.Namespace) -> int:
    from omniweave.config import load_recipe

    cfg = load_recipe(args.recipe, args.overrides)  # user mistakes surface here, before any rank starts
    check_ready(cfg, args.resume)
    if args.nproc > 1 and "LOCAL_RANK" not in os.environ:
        return launch(args)
    result = train(cfg, resume=args.resume)
    if result["rank"] == 0:
        print(f"trained {result['steps']} steps in {result['seconds']:.1f} s, final loss {result['loss']:.4f}; "
              f"run dir {result['run_dir']}")
    return 0


def check_ready(cfg, resume: str | None) -> None:
    """What can be checked without a process group: required keys, the packed data, the checkpoint."""
    from omniweave.config import require
    from omniweave.data.packed import MANIFEST
    from omniweave.errors import UserError

    require(cfg, "data.path", "train.steps", "train.global_batch", "train.lr")
    if not (Path(cfg.data.path) / MANIFEST).is_file():
        raise UserError(f"data.path={cfg.data.path}: no packed dataset there (no {MANIFEST}); build it with "
                        f"`omniweave data pack --input RAW --output {cfg.data.path} --recipe RECIPE`")
    if resume and resume != "auto":
        try:
            checkpoint.resolve_checkpoint(resume)
        except FileNotFoundError as e:
            raise UserError(f"--resume {resume}: {e}; pass a step_N directory, a checkpoints/ directory, a run "
                            "directory, or 'auto'") from None


def launch(args: argparse.Namespace) -> int:
    """Re-run this command under torchrun on ``--nproc`` local ranks (omniweave/launch.py)."""
    from omniweave.launch import torchrun

    argv = ["train", args.recipe, *args.overrides, *(["--resume", args.resume] if args.resume else [])]
    code, error = torchrun(argv, args.nproc)
    if error:
        print(f"omniweave train: error: {error}", file=sys.stderr)
    return code


# ---------------------------------------------------------------------------- setup


def init_distributed(info) -> tuple[int, int, int]:
    """(rank, world_size, local_rank). A plain process gets a 1-rank group, so the code path
    (collectives, DCP) is the same with or without torchrun."""
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group(info.backend)
        else:
            dist.init_process_group(info.backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))


def build(cfg, device: torch.device, dims, meshes) -> nn.Module:
    """The model, parallelised from outside in DESIGN's order: (vision split) -> TP -> CP -> AC ->
    FSDP2 (foundation over dp x cp, a smaller-tp encoder over dp x cp x tp_rep; see parallel/dims.py)."""
    from omniweave.config import to_dict
    from omniweave.models.registry import build_model
    from omniweave.parallel.context import apply_cp, apply_vision_split
    from omniweave.parallel.fsdp import apply_ac, apply_fsdp
    from omniweave.parallel.tp import apply_tp

    model_cfg = to_dict(cfg.model)
    with torch.device("meta"):
        model = build_model(model_cfg)
    n_params = sum(p.numel() for p in model.parameters())
    meta_init = n_params > META_INIT_PARAMS and dims.world_size > 1
    if not meta_init:  # identical weights on every rank from the seed: sharding then keeps each rank's slice
        torch.manual_seed(int(cfg.train.seed))
        model = build_model(model_cfg)
        if hasattr(model, "init_weights"):
            model.init_weights()
        model.to(device)
    apply_vision_split(model, meshes.vision_split)  # before TP, which passes the split features on
    if dims.tp > 1:  # features' gradient partials: over the encoder's tp group, the split sums the rest
        apply_tp(model, meshes.tp, meshes.tp_encoder, features_mesh=meshes.tp_encoder if dims.tp_encoder < dims.tp
                 else meshes.tp)
    apply_cp(model, dims, meshes, head_groups=int(cfg.get("parallel", {}).get("cp_head_groups", 1) or 1))
    apply_ac(model, str(cfg.train.get("ac", "none")))
    if dims.world_size > 1:
        apply_fsdp(model, meshes.fsdp, str(cfg.train.get("precision", "fp32")),
                   encoder_mesh=meshes.encoder_fsdp if dims.tp_encoder < dims.tp else None)
    if meta_init:  # materialise each rank's shards only, then initialise them
        model.to_empty(device=device)
        model.init_weights()
    if cfg.train.get("init_from"):  # each rank reads only its own slices of the HF safetensors
        from omniweave.models.hf.loading import load_hf_into

        load_hf_into(model, cfg.train.init_from)
    return model


def _vision_pad_ids(data_cfg: dict) -> tuple[int, ...]:
    from omniweave.data.loader import _processor

    proc = _processor(data_cfg)
    return (proc.image_pad_id, proc.video_pad_id)


def tc_threads(cfg) -> int:
    """``train.cpu_threads``: intra-op threads per process on CPU (0/null: torch's default)."""
    return int(cfg.train.get("cpu_threads") or 0)


def _to_device(mb: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in mb.items()}


def _autocast(device: torch.device, precision: str, fsdp: bool):
    if precision == "bf16" and not fsdp:  # FSDP2 casts through its MixedPrecisionPolicy instead
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"train.precision={precision!r}; choose fp32 or bf16")
    return contextlib.nullcontext()


def _all_finite(model: nn.Module) -> bool:
    ok = torch.tensor(1.0)
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if not torch.isfinite(local).all():
            ok.zero_()
            break
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def full_model_on_rank0(model: nn.Module, cfg) -> nn.Module | None:
    """Collective: an unsharded CPU copy of the model on rank 0 (None elsewhere), for eval/export."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from omniweave.config import to_dict
    from omniweave.models.hf.loading import assign_state_dict
    from omniweave.models.registry import build_model

    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    with torch.device("meta"):
        plain = build_model(to_dict(cfg.model))
    assign_state_dict(plain, sd, "training state")
    return plain.eval()


# ---------------------------------------------------------------------------- the loop


def train(cfg, resume: str | None = None, fault_hook=None) -> dict:
    """Run ``cfg``; returns {rank, steps, seconds, loss, run_dir}. ``fault_hook(step, out)`` lets
    tests corrupt a micro-batch's output (non-finite handling). A process group this call
    creates (plain process, no torchrun) is destroyed again at the end."""
    created = not dist.is_initialized()
    try:
        return _train(cfg, resume, fault_hook)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg, resume, fault_hook) -> dict:
    from omegaconf import OmegaConf

    from omniweave.data.loader import LOADER_ONLY_KEYS, PackedLoader
    from omniweave.parallel.context import shard_micro_batch
    from omniweave.device import detect, peak_memory_bytes
    from omniweave.parallel.dims import ParallelDims
    from omniweave.parallel.cost_model import Refitter
    from omniweave.train.optim import build_optimizer, clip_grad_norm
    from omniweave.train.schedule import build_scheduler

    info = detect()
    rank, world, local_rank = init_distributed(info)
    device = info.device(local_rank)
    if info.module is not None and hasattr(info.module, "set_device"):
        info.module.set_device(device)
    dims = ParallelDims.from_config(cfg.get("parallel"), world, model=cfg.model)
    meshes = dims.build_meshes(device.type)
    if device.type == "cpu" and tc_threads(cfg):
        torch.set_num_threads(tc_threads(cfg))
    tc = cfg.train
    total, gb, seed = int(tc.steps), int(tc.global_batch), int(tc.seed)
    precision, fsdp = str(tc.get("precision", "fp32")), world > 1
    run_dir = Path(cfg.output_dir)
    ckpt_root = run_dir / "checkpoints"
    config_yaml = OmegaConf.to_yaml(cfg)
    if rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(config_yaml)

    model = build(cfg, device, dims, meshes)
    optimizer = build_optimizer(model, tc)
    scheduler = build_scheduler(optimizer, tc)
    data_cfg = {k: v for k, v in OmegaConf.to_container(cfg.data, resolve=True).items() if k not in LOADER_ONLY_KEYS}
    balance = cfg.data.get("balance")
    loader = PackedLoader(cfg.data.path, gb, dp_rank=meshes.dp_rank, dp_size=dims.dp, seed=seed, data_cfg=data_cfg,
                          num_workers=int(cfg.data.get("num_workers", 0)), balance=balance,
                          model_cfg=OmegaConf.to_container(cfg.model, resolve=True) if balance == "cost" else None)
    refit_steps = int(cfg.data.get("balance_refit", 0) or 0) if balance == "cost" else 0
    refitter = Refitter(loader.cost_model, warmup=refit_steps) if refit_steps > 0 else None
    torch.manual_seed(seed + rank)
    phase = str(tc.get("phase", "sft"))
    if phase not in PHASES:
        raise ValueError(f"train.phase={phase!r}; choose one of {PHASES}")
    vision_pads = _vision_pad_ids(data_cfg)

    step, skipped, bad_in_row = 0, 0, 0
    ckpt = None
    if resume == "auto":
        ckpt = checkpoint.find_latest(ckpt_root)
    elif resume:
        ckpt = checkpoint.resolve_checkpoint(resume)
    if ckpt is not None:
        state = checkpoint.load(ckpt, model, optimizer)
        scheduler.load_state_dict(state["scheduler"])
        loader.load_state_dict(state["loader"])
        step, skipped = int(state["step"]), int(state.get("skipped", 0))
        if state.get("balance_refitted"):  # the refitted cost model came back with the loader state
            refitter = None
        if rank == 0:
            print(f"resumed from {ckpt} at step {step}", flush=True)

    counts = model_flop_counts(model)
    peak = device_peak_flops(device, precision) * world
    log = MetricsLogger(run_dir, total, step, enabled=rank == 0, log_interval=int(tc.get("log_interval", 1)))
    if rank == 0:
        n = sum(p.numel() for p in model.parameters() if p.requires_grad)
        print(f"{info.type} x{world} (dp={dims.dp}, cp={dims.cp} {dims.cp_attention}, tp={dims.tp}, "
              f"encoder tp={dims.tp_encoder}), {n / 1e6:.2f}M trainable parameters, {loader.num_packs} packs, "
              f"{loader.steps_per_epoch} steps/epoch, training steps {step}..{total}", flush=True)
    max_bad = int(tc.get("max_bad_steps", 5))
    clip = float(tc.get("grad_clip", 0.0) or 0.0)
    save_interval, keep_last = int(tc.get("save_interval", 0) or 0), int(tc.get("keep_last", 0) or 0)
    eval_interval = int(tc.get("eval_interval", 0) or 0)
    params = [p for p in model.parameters() if p.requires_grad]
    t_start, last = time.perf_counter(), {"loss": float("nan")}

    def save() -> None:
        if not _all_finite(model):
            raise RuntimeError(f"step {step}: weights are not finite; refusing to save a checkpoint")
        state = {"step": step, "skipped": skipped, "scheduler": scheduler.state_dict(), "loader": loader.state_dict(),
                 "balance_refitted": refitter is None or refitter.done}
        checkpoint.save(ckpt_root, step, model, optimizer, state, config_yaml, keep_last)

    it = iter(loader)
    while step < total:
        t0 = time.perf_counter()
        start = loader.position(loader.epoch, loader.cursor)
        packs = apply_phase(next(it), phase, vision_pads)
        stats = loader.take_balance_stats(start)  # recorded when the loader balanced this batch
        balance_log = {} if stats is None else {"imbalance_before": round(stats["round_robin"], 4),
                                                "imbalance_after": round(stats["cost"], 4)}
        local = torch.tensor([
            sum(p["num_loss_tokens"] for p in packs),
            sum(p["input_ids"].numel() for p in packs),
            sum(int((p["cu_seqlens"][1:] - p["cu_seqlens"][:-1]).pow(2).sum()) for p in packs),
        ], dtype=torch.float64)
        dist.all_reduce(local)  # the cp x tp ranks of a dp group hold the same packs: count them once
        loss_tokens, tokens, sum_len2 = (int(x) // (dims.cp * dims.tp) for x in local.tolist())
        # FSDP sums gradients over the ranks (divide factor 1), so each token's gradient is
        # divided by the global number of loss tokens exactly once.
        scale = 1.0 / max(loss_tokens, 1)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        t_compute = time.perf_counter()
        for i, mb in enumerate(packs):
            mb = _to_device(shard_micro_batch(mb, dims.cp, meshes.cp_rank, dims.tp), device)
            if fsdp:
                model.set_requires_gradient_sync(i == len(packs) - 1)
            with _autocast(device, precision, fsdp):
                out = model(mb)
            if fault_hook is not None:
                out = fault_hook(step, out)
            (out.loss_sum.float() * scale).backward()
            loss_sum += out.loss_sum.detach().double()
        if refitter is not None and not refitter.done:
            _refit(refitter, loader, packs, time.perf_counter() - t_compute, meshes.dp_rank, dims.dp, rank)
        dist.all_reduce(loss_sum)  # a tp foundation's loss is replicated on its tp ranks
        loss = float(loss_sum) / dims.tp / max(loss_tokens, 1)
        grad_norm = clip_grad_norm(params, clip)
        lr = scheduler.get_last_lr()[0]
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite:
            optimizer.step()
            bad_in_row = 0
        else:
            skipped, bad_in_row = skipped + 1, bad_in_row + 1
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        step += 1
        if info.module is not None and hasattr(info.module, "synchronize"):
            info.module.synchronize()
        dt = time.perf_counter() - t0
        last = {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": tokens,
                "loss_tokens": loss_tokens, "tokens_per_s": tokens / dt, "step_s": round(dt, 4),
                "mfu": step_flops(counts, tokens, sum_len2) / dt / peak,
                "memory_gb": peak_memory_bytes(info) / 2**30, "skipped": not finite, "skipped_total": skipped,
                **balance_log}
        log.log(last)
        if bad_in_row >= max_bad:  # after logging, so metrics.jsonl shows the step that stopped the run
            log.close()
            raise RuntimeError(f"step {step}: {bad_in_row} steps in a row had a non-finite loss or gradient "
                               f"(loss {loss}, grad_norm {grad_norm}); stopping. Lower train.lr or check the data.")
        if (save_interval and step % save_interval == 0) or step == total:
            save()
        if eval_interval and cfg.get("eval", {}).get("path") and (step % eval_interval == 0 or step == total):
            evaluate(model, cfg, step, log, fsdp)
    log.close()
    if tc.get("save_hf") and total > 0:
        export_final(model, cfg, run_dir / "hf")
    seconds = time.perf_counter() - t_start
    dist.barrier()
    return {"rank": rank, "steps": step, "seconds": seconds, "loss": last["loss"], "run_dir": str(run_dir)}


def _refit(refitter, loader, packs: list[dict], seconds: float, dp_rank: int, dp: int, rank: int) -> None:
    """Warm-up of ``data.balance_refit``: every dp rank's pack features and compute seconds are
    gathered; after the warm-up the loader switches to the refitted cost model (on every rank)."""
    from omniweave.parallel.balance import pack_features

    feats = sum(pack_features({
        "docs": [{"length": int(n)} for n in (mb["cu_seqlens"][1:] - mb["cu_seqlens"][:-1]).tolist()],
        "media": [{"grid_thw": g} for g in mb["grid_thw"].tolist()],
    }) for mb in packs)  # fmt: skip
    row = torch.tensor([dp_rank, *feats, seconds], dtype=torch.float64)
    rows = [torch.empty_like(row) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, row)
    by_dp = {int(r[0]): r for r in rows}  # one row per dp rank (its cp x tp ranks ran the same packs)
    table = torch.stack([by_dp[r] for r in range(dp)]).numpy()
    model = refitter.add(table[:, 1:-1], table[:, -1])
    if model is not None:
        loader.set_cost_model(model)
        if rank == 0:
            print(f"load balancing: cost model refitted from {refitter.warmup} steps: {model.to_dict()}", flush=True)


def evaluate(model: nn.Module, cfg, step: int, log: MetricsLogger, fsdp: bool) -> None:
    """Greedy-generation accuracy on ``cfg.eval`` (rank 0, on an unsharded copy under FSDP)."""
    from omniweave.train.evaluate import eval_fn

    target = full_model_on_rank0(model, cfg) if fsdp else model
    if target is not None:
        was_training = target.training
        target.eval()
        log.log_eval(step, eval_fn(target, cfg, step))
        target.train(was_training)
    dist.barrier()


def export_final(model: nn.Module, cfg, out: Path) -> None:
    """``train.save_hf: true``: the final weights as a HF directory ``RUN/hf`` (rank 0 writes)."""
    from omniweave.config import to_dict
    from omniweave.models.hf.export import export_hf

    plain = full_model_on_rank0(model, cfg)
    if plain is not None:
        export_hf(plain, to_dict(cfg.model), out, data_cfg=to_dict(cfg.data))
        print(f"exported the final model to {out}", flush=True)
    dist.barrier()


if __name__ == "__main__":  # pragma: no cover
    from omniweave.cli import main

    raise SystemExit(main(["train", *sys.argv[1:]]))
