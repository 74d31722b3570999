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
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from omniweave.config import section
from omniweave.launch import add_arguments as launch_arguments, wants_launch
from omniweave.train import checkpoint
from omniweave.train.engine import Engine, with_process_group
from omniweave.train.parallel_model import check_attn_backends
from omniweave.train.loss import PHASES, apply_phase, drop_skipped_docs
from omniweave.train.metrics import step_flops


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", nargs="?", help="recipe YAML path or built-in recipe name (--list shows them)")
    p.add_argument("--list", action="store_true", help="list the built-in recipes and exit")
    p.add_argument("overrides", nargs="*", help="key=value recipe overrides (Hydra syntax)")
    launch_arguments(p)
    p.add_argument("--resume", default=None,
                   help="'auto': continue from the run's latest complete checkpoint, if any; or a checkpoint dir")


def run(args: argparse.Namespace) -> int:
    from omniweave.config import load_recipe

    if listed(args):
        return 0
    launching = wants_launch(args)
    cfg = load_recipe(args.recipe, args.overrides)  # user mistakes surface here, before any rank starts
    check_ready(cfg, args.resume, kind=phase_kind(cfg))
    if launching:
        return launch(args)
    result = train(cfg, resume=args.resume)
    if result["rank"] == 0:
        print(f"trained {result['steps']} steps in {result['seconds']:.1f} s, final loss {result['loss']:.4f}; "
              f"run dir {result['run_dir']}")
    return 0


def listed(args: argparse.Namespace) -> bool:
    """``--list``: the built-in recipes printed (True); without it a recipe must be named."""
    from omniweave.recipes import listing
    from omniweave.errors import UserError

    if args.list:
        if args.recipe or args.overrides:  # `train demo --list` would otherwise drop the recipe unseen
            raise UserError("--list takes no recipe or overrides: it only lists the built-in recipes")
        print(listing())
        return True
    if not args.recipe:
        raise UserError("name a recipe: a YAML path or a built-in recipe (--list shows them)")
    return False


def phase_kind(cfg) -> str:
    """The packed data a ``train.phase`` trains on (SFT packs, preference pairs, VLA frames…); its settings
    (``train.dpo.*``) checked before any rank starts."""
    from omniweave.data.packing.prompts import dataset_kind

    phase = section(cfg, "train").phase
    if phase not in PHASES:
        from omniweave.errors import UserError

        raise UserError(f"train.phase={phase!r}; `omniweave train` runs one of {PHASES} (grpo: `omniweave rl`)")
    if phase == "dpo":
        from omniweave.train.dpo import check_settings

        check_settings(cfg)
    elif phase in ("orpo", "simpo", "kto"):
        from omniweave.train.preference import check_settings

        check_settings(cfg)
    from omniweave.config import to_dict
    from omniweave.diffusion.data import check_recipe

    check_recipe(to_dict(cfg.model), phase)
    return dataset_kind(phase)


def check_ready(cfg, resume: str | None, kind: str = "sft") -> None:
    """What can be checked without a process group: required keys, the packed data (SFT packs or
    RL prompts, as ``kind`` says), the checkpoint to resume from."""
    import json

    from omniweave.config import require, to_dict
    from omniweave.data.loading.loader import check_kind
    from omniweave.data.loading.mix import check_mix_ready, data_source
    from omniweave.data.packing.packed import MANIFEST
    from omniweave.errors import UserError
    from omniweave.models.lora import check_lora
    from omniweave.train.optim import component_settings

    path, mix = data_source(cfg.data)  # data.path or data.mix
    require(cfg, "train.steps", "train.global_batch", "train.lr")
    check_attn_backends(to_dict(cfg.model))
    check_lora(to_dict(cfg.model))
    component_settings(to_dict(cfg.model))  # model.<component>.lr / lr_scale / weight_decay (train/optim.py)
    from omniweave.train.layouts import check

    check(cfg)  # the training mode under the recipe's layout (train/layouts.py)
    if mix is not None:
        check_mix_ready(mix, kind)
    elif not (Path(path) / MANIFEST).is_file():
        raise UserError(f"data.path={path}: no packed dataset there (no {MANIFEST}); build it with "
                        f"`omniweave data pack --input RAW --output {path} --recipe RECIPE`")
    else:
        check_kind(json.loads((Path(path) / MANIFEST).read_text()), kind, path)
    if resume and resume != "auto":
        try:
            checkpoint.resolve_checkpoint(resume)
        except FileNotFoundError as e:
            raise UserError(f"--resume {resume}: {e}; pass a step_N directory, a checkpoints/ directory, a run "
                            "directory, or 'auto'") from None


def launch(args: argparse.Namespace) -> int:
    """Re-run this command under torchrun on ``--nproc`` local ranks (omniweave/launch.py)."""
    from omniweave.launch import relaunch

    return relaunch("train", args)


# ---------------------------------------------------------------------------- the loop


def train(cfg, resume: str | None = None, fault_hook=None) -> dict:
    """Run ``cfg``; returns {rank, steps, seconds, loss, run_dir}. ``fault_hook(step, loss_sum)`` lets
    tests corrupt a micro-batch's loss (non-finite handling). A process group this call
    creates (plain process, no torchrun) is destroyed again at the end."""
    return with_process_group(lambda: _train(cfg, resume, fault_hook))


def _train(cfg, resume, fault_hook) -> dict:
    engine = Engine(cfg)
    # the output_dir's lock released however the run ends; a collective that fails: one line naming
    # the rank and the collective
    with engine.run_lock, engine.watchdog:
        return _train_loop(engine, cfg, resume, fault_hook)


def _train_loop(engine: Engine, cfg, resume, fault_hook) -> dict:
    from omegaconf import OmegaConf

    from omniweave.data.loading.loader import LOADER_ONLY_KEYS, PackedLoader
    from omniweave.data.loading.mix import MixCounts, batch_counts, data_source
    from omniweave.device import peak_memory_bytes
    from omniweave.parallel.cost_model import Refitter

    tc, dims = section(cfg, "train"), engine.dims
    gb, seed = int(tc.global_batch), int(tc.seed)
    data_cfg = {k: v for k, v in OmegaConf.to_container(cfg.data, resolve=True).items() if k not in LOADER_ONLY_KEYS}
    if phase_kind(cfg) == "diffusion":  # the packs' latents must come from this recipe's VAE / text encoder / patch
        from omniweave.config import to_dict
        from omniweave.diffusion.data import with_codecs

        data_cfg = with_codecs(data_cfg, to_dict(cfg.model))
    balance = cfg.data.get("balance")
    path, mix = data_source(cfg.data)
    loader = PackedLoader(path, gb, dp_rank=engine.meshes.dp_rank, dp_size=dims.dp, seed=seed,
                          data_cfg=data_cfg, num_workers=int(cfg.data.num_workers), balance=balance,
                          model_cfg=OmegaConf.to_container(cfg.model, resolve=True) if balance == "cost" else None,
                          kind=phase_kind(cfg), mix=mix)
    mix_counts = MixCounts(loader.mix.names) if loader.mix is not None else None  # packs, samples per dataset
    refit_steps = int(cfg.data.balance_refit or 0) if balance == "cost" else 0
    refitter = Refitter(loader.cost_model, warmup=refit_steps) if refit_steps > 0 else None
    phase = tc.phase
    objective = build_objective(cfg, engine, fault_hook)  # DPO's reference from the seed: before the per-rank seed
    torch.manual_seed(seed + engine.rank)
    vision_pads = _vision_pad_ids(data_cfg)

    state = engine.resume(resume)
    media_skipped_total = 0  # samples whose media did not decode, trained without loss (data.md)
    if state is not None:
        loader.load_state_dict(state["loader"])
        media_skipped_total = int(state.get("media_skipped_total", 0))
        if mix_counts is not None:
            mix_counts.load_state_dict(state.get("mix_counts"))
        if state.get("balance_refitted"):  # the refitted cost model came back with the loader state
            refitter = None
    engine.start_logging(*((objective.line,) if objective.line else ()))
    if engine.rank == 0:
        print(f"{engine.describe()}, {loader.describe()}, training steps {engine.step}..{engine.total}", flush=True)

    def loop_state() -> dict:
        return {"loader": loader.state_dict(), "balance_refitted": refitter is None or refitter.done,
                "media_skipped_total": media_skipped_total,
                **({"mix_counts": mix_counts.state_dict()} if mix_counts is not None else {})}

    last = {"loss": float("nan")}
    it = iter(loader)
    while engine.step < engine.total:
        t0 = time.perf_counter()
        start = loader.position(loader.epoch, loader.cursor)
        packs = apply_phase(next(it), phase, vision_pads)
        skips = loader.take_media_skips()
        packs = drop_skipped_docs(packs, skips)
        stats = loader.take_balance_stats(start)  # recorded when the loader balanced this batch
        balance_log = {} if stats is None else {"imbalance_before": round(stats["round_robin"], 4),
                                                "imbalance_after": round(stats["cost"], 4)}
        per_dataset = [] if mix_counts is None else batch_counts(len(mix_counts.names), loader.batch_sources, packs)
        sums = engine.global_sum([
            sum(p["num_loss_tokens"] for p in packs),
            sum(p["input_ids"].numel() for p in packs),
            sum(int((p["cu_seqlens"][1:] - p["cu_seqlens"][:-1]).pow(2).sum()) for p in packs),
            len(skips),
            objective.count(packs),
            objective.flops(packs),
            *per_dataset,
        ])
        loss_tokens, tokens, sum_len2, media_skipped = (int(x) for x in sums[:4])
        mix_log = mix_counts.add(sums[6:]) if mix_counts is not None else {}
        out = engine.optimizer_step(packs, objective, normaliser=sums[4])
        if refitter is not None and not refitter.done:
            _refit(refitter, loader, packs, out["compute_s"], engine.meshes.dp_rank, dims.dp, engine.rank)
        dt = time.perf_counter() - t0
        media_skipped_total += media_skipped
        skip_log = {"media_skipped": media_skipped, "media_skipped_total": media_skipped_total,
                    **({"media_skips": report_media_skips(engine, skips)} if media_skipped else {})}
        last = {"step": engine.step, "loss": out["loss"], "grad_norm": out["grad_norm"], "lr": out["lr"],
                "tokens": tokens, "loss_tokens": loss_tokens, "tokens_per_s": tokens / dt, "step_s": round(dt, 4),
                "mfu": (step_flops(engine.flop_counts, tokens, sum_len2) + sums[5]) / dt / engine.peak_flops,
                "memory_gb": peak_memory_bytes(engine.info) / 2**30, "skipped": out["skipped"],
                "skipped_total": out["skipped_total"], **skip_log, **balance_log, **mix_log,
                **{k: v for k, v in out.items() if k.startswith(("moe_", "lr/"))},
                **objective.metrics(out)}
        engine.finish_step(last, loop_state)
    seconds = engine.finish()
    return {"rank": engine.rank, "steps": engine.step, "seconds": seconds, "loss": last["loss"],
            "run_dir": str(engine.run_dir)}


def build_objective(cfg, engine: Engine, fault_hook=None):
    """The objective of ``train.phase`` (train/objective.py): token cross-entropy (sft, pretrain),
    DPO's pair loss, ORPO's / SimPO's (train/preference.py), KTO's (train/kto.py) or flow matching
    (vla/objective.py) or rectified flow over packed clips (diffusion/objective.py);
    ``fault_hook(step, loss_sum)`` (tests) corrupts its losses."""
    from omniweave.train.objective import TokenCrossEntropy, WithFault

    phase = section(cfg, "train").phase
    if phase == "dpo":
        from omniweave.train.dpo import DPOObjective

        objective = DPOObjective(cfg, engine)
    elif phase in ("orpo", "simpo"):
        from omniweave.train.preference import OBJECTIVES

        objective = OBJECTIVES[phase](cfg, engine)
    elif phase == "kto":
        from omniweave.train.kto import KTOObjective

        objective = KTOObjective(cfg, engine)
    elif phase == "vla":
        from omniweave.train.metrics import expert_flop_counts
        from omniweave.vla.objective import FlowMatchingObjective

        tc, expert = section(cfg, "train"), engine.model.action_expert
        objective = FlowMatchingObjective(int(tc.seed), lambda: engine.step, float(tc.vla.text_weight),
                                          expert_flop_counts(expert), expert.config.horizon)
    elif phase == "diffusion":
        from functools import partial

        from omniweave.diffusion.objective import DiffusionObjective
        from omniweave.train.metrics import cross_attention_flops

        tc = section(cfg, "train")
        d = tc.diffusion
        objective = DiffusionObjective(int(tc.seed), lambda: engine.step, shift=float(d.shift),
                                       timestep_sampling=str(d.timestep_sampling), logit_mean=float(d.logit_mean),
                                       logit_std=float(d.logit_std), loss_weighting=str(d.loss_weighting),
                                       caption_dropout=float(d.caption_dropout),
                                       text_flops=partial(cross_attention_flops, engine.model.generator))
    else:
        objective = TokenCrossEntropy()
    if fault_hook is not None:
        objective = WithFault(objective, lambda loss: fault_hook(engine.step, loss))
    return objective


def report_media_skips(engine: Engine, skips: list[dict], outcome: str = "trained without loss on it") -> list[dict]:
    """Every rank's skipped samples of this step (gathered: called only on a step that has some),
    once each (the cp x tp ranks of a dp group hold the same packs); rank 0 prints a line per sample."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, [{k: s[k] for k in ("sample", "pack", "shard", "part", "reason", "message")}
                                      for s in skips])
    unique = list({(s["pack"], s["sample"], s["part"]): s for rank in gathered for s in rank}.values())
    if engine.rank == 0:
        for s in unique:
            print(f"step {engine.step}: skipped sample {s['sample']} (pack {s['pack']} of {s['shard']}, {s['part']}): "
                  f"{s['reason']}: {s['message']}; {outcome}", flush=True)
    return unique


def _vision_pad_ids(data_cfg: dict) -> tuple[int, ...]:
    from omniweave.data.loading.loader import _processor

    proc = _processor(data_cfg)
    return tuple(i for i in (proc.image_pad_id, proc.video_pad_id) if i is not None)


def _refit(refitter, loader, packs: list[dict], seconds: float, dp_rank: int, dp: int, rank: int) -> None:
    """Warm-up of ``data.balance_refit``: every dp rank's pack features and compute seconds are
    gathered; after the warm-up the loader switches to the refitted cost model (on every rank)."""
    from omniweave.parallel.balance import pack_features

    feats = sum(pack_features({
        "docs": [{"length": int(n)} for n in (mb["cu_seqlens"][1:] - mb["cu_seqlens"][:-1]).tolist()],
        "media": [{"grid_thw": g} for g in mb.get("grid_thw", torch.zeros(0, 3)).tolist()]
        + [{"kind": "audio", "start": s, "length": n} for s, n in mb.get("audio_spans", torch.zeros(0, 2)).tolist()],
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


if __name__ == "__main__":  # pragma: no cover
    from omniweave.cli import main

    raise SystemExit(main(["train", *sys.argv[1:]]))
