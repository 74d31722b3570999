"""The training engine: what every training mode (SFT / pretraining, GRPO, …) shares.

A mode's loop owns its data (packs, rollouts) and its loss; the engine owns the rest:

    engine = Engine(cfg)                       device, process group, the output_dir's lock
                                               (train/run_lock.py; `with engine.run_lock`), meshes,
                                               the model parallelised
                                               (train/parallel_model.py: vision split -> TP -> LoRA ->
                                               CP -> EP -> AC -> FSDP2; parallel.pp: this rank's
                                               stages), optimizer, schedule, run dir with config.yaml
    state = engine.resume(resume)              model / optimizer / schedule back; the mode's own
                                               state (loader, RNG, …) is returned to it
    engine.start_logging(line)                 metrics.jsonl, TensorBoard, console line, ETA
    out = engine.optimizer_step(micro_batches, objective, normaliser)
                                               each micro-batch CP-sharded, forward, the objective's
                                               loss sum (train/objective.py)
                                               scaled by 1 / normaliser (a global count: loss
                                               tokens, response tokens or sequences over all ranks
                                               and micro-batches) and backpropagated; FSDP sums
                                               gradients, so every layout gives the same update;
                                               (parallel.seq_chunks: each row in chunks,
                                               parallel/seq_chunks.py); clip, non-finite skip,
                                               step, schedule
    engine.finish_step(record, state_fn)       log, stop after too many bad steps, checkpoint at
                                               the interval (DCP, atomic), evaluate at the interval
    engine.finish()                            close the logs, HF export (train.save_hf)
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from omniweave.config import section, to_dict
from omniweave.errors import UserError
from omniweave.train import checkpoint, checkpoint_io, watchdog
from omniweave.train.resume_keys import check_resume_keys, describe_applied
from omniweave.train.metrics import SFT_LINE, MetricsLogger, device_peak_flops, model_flop_counts
from omniweave.train.parallel_model import build, full_model_on_rank0, offload_mode, uses_fsdp
from omniweave.train.run_lock import RunLock

def init_distributed(info, timeout=None) -> tuple[int, int, int]:
    """(rank, world_size, local_rank). A plain process gets a 1-rank group, so the code path
    (collectives, DCP) is the same with or without torchrun. ``timeout``: every collective's
    (train.collective_timeout, train/watchdog.py)."""
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group(info.backend, timeout=timeout)
        else:
            dist.init_process_group(info.backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0))


def with_process_group(fn: Callable[[], Any]) -> Any:
    """Run ``fn``; a process group created meanwhile (a torchrun rank's, or a plain process's) is
    torn down after it (:func:`shutdown_distributed`)."""
    created = not dist.is_initialized()
    try:
        return fn()
    finally:
        if created and dist.is_initialized():
            shutdown_distributed()


def shutdown_distributed() -> None:
    """The end of a run, in order: ``fn`` above has drained its own work (``Engine.finish``: the
    pending asynchronous save published, the logs closed, the export written, a last barrier);
    then the finished engine's reference cycles (model, optimizer, meshes, checkpointer) are
    collected; then every process group is shut down and unregistered.

    torch's own caches (DTensor sharding propagation, redistribution plans) still hold device
    meshes afterwards, and through them the groups' gloo threads (``pt_gloo_runloop``,
    ``gloo_tcp_loop``: 24 in a tp 2 rank). A torchrun rank therefore leaves without tearing the
    interpreter down (``launch.leave``), which those threads would race (issue 31, item 10)."""
    import gc

    gc.collect()
    dist.destroy_process_group()


def tc_threads(cfg) -> int:
    """``train.cpu_threads``: intra-op threads per process on CPU (0/null: torch's default)."""
    return int(section(cfg, "train").cpu_threads or 0)


def to_device(mb: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else to_device(v, device) if isinstance(v, dict)
            else v for k, v in mb.items()}


def autocast(device: torch.device, precision: str, fsdp: bool):
    if precision == "bf16" and not fsdp:  # FSDP2 casts through its MixedPrecisionPolicy instead
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    if precision not in ("fp32", "bf16"):
        raise ValueError(f"train.precision={precision!r}; choose fp32 or bf16")
    return contextlib.nullcontext()


def all_finite(model: nn.Module) -> bool:
    ok = torch.tensor(1.0)
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if not torch.isfinite(local).all():
            ok.zero_()
            break
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok.item())


def join_process(cfg, timeout=None):
    """This process's part of a run, before anything else: the device (``omniweave/device.py``),
    the process group (``timeout``: every collective's), the device bound, ``train.cpu_threads``.
    Returns (device info, rank, world size, device). The engine starts with it, and so does every
    command that runs the model outside a training run (``omniweave dpo precompute-ref``)."""
    from omniweave.device import detect

    info = detect()
    rank, world, local_rank = init_distributed(info, timeout)
    device = info.device(local_rank)
    if info.module is not None and hasattr(info.module, "set_device"):
        info.module.set_device(device)
    if device.type == "cpu" and tc_threads(cfg):
        torch.set_num_threads(tc_threads(cfg))
    return info, rank, world, device


class Engine:
    """Set-up and the optimizer step shared by the training modes (see the module docstring)."""

    def __init__(self, cfg, pipeline_rows=None):
        """``pipeline_rows(cfg, dims) -> PipelineRows`` (parallel.pp): the mode's rows
        (train/pipeline_setup.py) when they are not the packs of ``data.path``."""
        self.cfg, self.run_dir = cfg, Path(cfg.output_dir)
        timeout = watchdog.timeout_of(cfg)
        watchdog.prepare_environment(self.run_dir)  # the flight recorder, before the process group
        self.info, self.rank, self.world, self.device = join_process(cfg, timeout)
        self.run_lock = RunLock(self.run_dir, self.rank)  # before anything is written there; `with` it
        try:
            self._set_up(cfg, timeout, pipeline_rows)
        except BaseException:
            self.run_lock.release()
            raise

    def _set_up(self, cfg, timeout, pipeline_rows) -> None:
        from omegaconf import OmegaConf

        from omniweave.parallel.dims import ParallelDims
        from omniweave.train.optim import build_optimizer
        from omniweave.train.schedule import build_scheduler

        self.watchdog = watchdog.Watchdog(self.run_dir, self.rank, timeout)
        try:
            self.dims = ParallelDims.from_config(cfg.get("parallel"), self.world, model=cfg.model)
        except ValueError as e:  # a layout that does not fit the ranks, e.g. parallel.cp=3 on 2: the user's to fix
            raise UserError(str(e)) from None
        from omniweave.train.layouts import check, seq_chunks_of

        check(cfg)  # the mode under this layout (the CLI said so before any rank started: trainer.check_ready)
        self.seq_chunks = seq_chunks_of(cfg)
        self.run_row = self._chunked_row if self.seq_chunks > 1 else self._whole_row  # (a pipeline: _pipeline_step)
        self.meshes = self.dims.build_meshes(self.device.type)
        tc = section(cfg, "train")  # the typed section: every key present, the schema's defaults
        self.total = int(tc.steps)
        self.precision, self.fsdp = tc.precision, uses_fsdp(cfg, self.world, self.dims.pp)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.config_yaml = OmegaConf.to_yaml(cfg)
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(self.config_yaml)
        self.model = build(cfg, self.device, self.dims, self.meshes)
        self.trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)  # global shapes
        self.pipeline = None
        from omniweave.models.components.router_loss import router_layers

        self.moe_layers = len(router_layers(self.model))  # the whole model's (a pipeline rank holds some)
        if self.dims.pp > 1:  # this rank's stages; self.model becomes its part of the model
            self.flop_counts = model_flop_counts(self.model)  # the whole model's, before it is cut
            self.model = self._pipeline(cfg, pipeline_rows)
        self.optimizer = build_optimizer(self.model, cfg)
        self.scheduler = build_scheduler(self.optimizer, cfg.train)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.step, self.skipped, self.bad_in_row = 0, 0, 0
        self.max_bad, self.clip, self.save_interval = tc.max_bad_steps, tc.grad_clip, tc.save_interval
        self.checkpointer = checkpoint.Checkpointer(self.ckpt_root, tc.keep_last, tc.async_save, timeout, self.device)
        self.eval_interval = tc.eval_interval
        self.save_hf, self.eval_path = tc.save_hf, section(cfg, "eval").path
        if self.save_hf and self.pipeline is None:  # refuse now what the export would refuse after the run
            from omniweave.models.hf.export import check_exportable

            try:
                check_exportable(self.model)
            except ValueError as e:
                raise UserError(f"train.save_hf=true: the final model cannot be exported: {e}; set "
                                "train.save_hf=false (the run's checkpoints hold the weights)") from None
        self.log: MetricsLogger | None = None

    def _pipeline(self, cfg, rows_of) -> nn.Module:
        """``parallel.pp``: the pipeline over the built model (train/pipeline_setup.py; ``rows_of``:
        the mode's rows, the packs' by default); returns this rank's part of the model."""
        from omniweave.train.pipeline_setup import PipelineRows, build_pipeline

        rows = (rows_of or PipelineRows.of)(cfg, self.dims)
        self.pipeline = build_pipeline(self.model, cfg, self.dims, self.meshes, self.device, rows)
        if self.fsdp:  # the ranks holding the same stages (dp x cp; x tp_rep for a smaller-tp encoder) shard them
            from omniweave.parallel.expert import expert_modules
            from omniweave.parallel.fsdp import apply_fsdp_to_stage_parts

            apply_fsdp_to_stage_parts(self.pipeline.local, self.pipeline.modules, self.meshes.fsdp, self.precision,
                                      encoder_mesh=self.meshes.encoder_fsdp if self.dims.tp_encoder < self.dims.tp
                                      else None, offload=offload_mode(cfg), pin_memory=self.device.type != "cpu",
                                      experts=expert_modules(self.pipeline.local) if self.dims.ep > 1 else (),
                                      experts_mesh=self.meshes.expert_dp)
        return self.pipeline.local

    # ------------------------------------------------------------------ resume and logs

    def resume(self, resume: str | None) -> dict | None:
        """``--resume auto|PATH``: model, optimizer and schedule restored; the checkpoint's trainer
        state (the mode's loader / RNG / … entries included) returned, None when starting fresh."""
        say = (lambda msg: print(msg, flush=True)) if self.rank == 0 else (lambda msg: None)
        ckpt = checkpoint.newest_undamaged(self.ckpt_root, say) if resume == "auto" else (
            checkpoint.resolve_checkpoint(resume) if resume else None)
        if ckpt is None:
            return None
        if resume != "auto":  # newest_undamaged has verified the automatic choice
            checkpoint_io.verify(ckpt)
        changes = check_resume_keys(ckpt, self.cfg)  # before loading: a refused change loads nothing
        state = checkpoint.load(ckpt, self.model, self.optimizer, verified=True, model_cfg=self.cfg.model)
        self.scheduler.load_state_dict(state["scheduler"])
        self.apply_schedule()
        self.step, self.skipped = int(state["step"]), int(state.get("skipped", 0))
        if self.rank == 0:
            print(f"resumed from {ckpt} at step {self.step}", flush=True)
            if describe_applied(changes):
                print(describe_applied(changes), flush=True)
        return state

    def apply_schedule(self) -> None:
        """The recipe's learning rates, schedule and AdamW hyperparameters on the restored optimizer
        (a resume may change them: resume_keys.py; each group's own base rate: optim.apply_recipe)."""
        from omniweave.train.optim import apply_recipe

        apply_recipe(self.optimizer, self.scheduler, self.model, section(self.cfg, "train"), to_dict(self.cfg.model))

    def start_logging(self, line=SFT_LINE) -> None:
        """Metrics from the current step on; ``line``: the console fields (metrics.SFT_LINE format)."""
        self.t_start = time.perf_counter()
        if self.pipeline is None:  # a pipeline counted its whole model before it was cut
            self.flop_counts = model_flop_counts(self.model)
        self.peak_flops = device_peak_flops(self.device, self.precision) * self.world
        self.log = MetricsLogger(self.run_dir, self.total, self.step, enabled=self.rank == 0,
                                 log_interval=section(self.cfg, "train").log_interval, line=line)

    def describe(self) -> str:
        d = self.dims
        n = self.trainable
        hsdp = f" (HSDP: {d.dp_replicate} replicas x {d.dp_shard} shards)" if d.dp_replicate > 1 else ""
        return (f"{self.info.type} x{self.world} ({f'pp={d.pp}, ' if d.pp > 1 else ''}dp={d.dp}{hsdp}, cp={d.cp} {d.cp_attention}, tp={d.tp}, "
                f"encoder tp={d.tp_encoder}{f', ep={d.ep}' if d.ep > 1 else ''}), {n / 1e6:.2f}M trainable parameters"
                + (", weights + optimizer state offloaded to host memory" if offload_mode(self.cfg) != "none" else ""))

    # ------------------------------------------------------------------ one step

    def global_sum(self, values: list[float]) -> list[float]:
        """Per-dp-group counts summed over all ranks: the pp x cp x tp ranks of a dp group hold the
        same micro-batches, so each count is taken once per dp group."""
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return [x / (self.dims.pp * self.dims.cp * self.dims.tp) for x in t.tolist()]

    def optimizer_step(self, micro_batches: list[dict], objective, normaliser: float,
                       count_step: bool = True) -> dict[str, Any]:
        """One optimizer step over this rank's micro-batches (see the module docstring). Every
        rank must pass the same number of micro-batches (FSDP's collectives run per micro-batch).
        ``count_step=False``: one of several updates of a training step (RL's PPO epochs and
        mini-batches); the step counter and the schedule then advance with :meth:`advance`.

        ``objective`` (train/objective.py): each micro-batch's loss SUM and statistics from its
        final hidden states, run by the executor of the run's layout: each row whole, in
        ``parallel.seq_chunks`` chunks, or through the pipeline's stages (``parallel.pp``).
        Returned: ``loss`` (global, divided by ``normaliser``), ``grad_norm``, ``lr``,
        ``skipped``, ``skipped_total``, ``compute_s`` (forward + backward of the micro-batches)
        and each of the objective's statistics summed over the micro-batches and ranks (a tp
        group's replicated values counted once)."""
        from omniweave.parallel.context import shard_micro_batch

        if self.pipeline is not None:  # the executors, one per layout (chosen at set-up): pipeline stages
            return self._pipeline_step(micro_batches, objective, normaliser, count_step)
        scale = 1.0 / max(normaliser, 1)
        self.start_router_step(micro_batches)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        stats: dict[str, torch.Tensor] = {k: torch.zeros((), dtype=torch.float64, device=self.device)
                                          for k in objective.stat_keys}
        t0 = time.perf_counter()

        # this rank's CP shard of each micro-batch, on the device: one at a time, unless the objective
        # needs a no-grad pass over all of the step's rows first (KTO's reference point)
        placed = (to_device(shard_micro_batch(mb, self.dims.cp, self.meshes.cp_rank, self.dims.tp), self.device)
                  for mb in micro_batches)
        if objective.step_pre_pass:
            placed = list(placed)
            with autocast(self.device, self.precision, self.fsdp):
                objective.prepare_step(self.model, placed)
        for i, mb in enumerate(placed):
            last = i == len(micro_batches) - 1
            if self.fsdp:
                self.model.set_requires_gradient_sync(last)
            with autocast(self.device, self.precision, self.fsdp):
                row = objective.row_inputs(self.model, mb)
            loss, extra = self.run_row(mb, objective, row, scale, last)
            loss_sum += loss.detach().double()
            for k, v in extra.items():
                stats[k] = stats[k] + v.detach().double()
        compute_s = time.perf_counter() - t0
        return self._apply_update(loss_sum, stats, normaliser, compute_s, count_step)

    def _whole_row(self, mb: dict, objective, row: dict, scale: float, last: bool):
        """One row's forward + backward: (loss_sum, stats)."""
        with autocast(self.device, self.precision, self.fsdp):
            loss, extra = self.model(mb, head=objective.head(row))
        (loss.float() * scale).backward()
        return loss, extra

    def _chunked_row(self, mb: dict, objective, row: dict, scale: float, last: bool):
        """One row's forward + backward in ``parallel.seq_chunks`` chunks (parallel/seq_chunks.py):
        (loss_sum, stats); under FSDP the gradients sync on the last backward of the step only."""
        from functools import partial

        from omniweave.parallel.seq_chunks import chunked_forward_backward

        sync = (lambda on: self.model.set_requires_gradient_sync(on and last)) if self.fsdp else None
        return chunked_forward_backward(self.model, mb, objective, row, self.seq_chunks, scale,
                                        partial(autocast, self.device, self.precision, self.fsdp), sync)

    def _pipeline_step(self, micro_batches: list[dict], objective, normaliser: float,
                       count_step: bool) -> dict[str, Any]:
        """``optimizer_step`` through the pipeline schedule: the rows, CP-sharded at the run's
        static length (parallel/pipeline_rows.py), are its micro-batches; the last stage scores
        each with ``objective``, its loss sum divided by ``normaliser`` inside the schedule."""
        self.start_router_step(micro_batches)
        rows = [to_device(mb, self.device) for mb in self.pipeline.prepare_rows(micro_batches)]
        t0 = time.perf_counter()
        with autocast(self.device, self.precision, self.fsdp):
            loss = self.pipeline.step(rows, max(normaliser, 1), objective)
        compute_s = time.perf_counter() - t0
        stats = self.pipeline.last_stats
        totals = torch.tensor([loss * max(normaliser, 1), *stats.values()], dtype=torch.float64, device=self.device)
        if self.meshes.dp_cp.size() > 1:  # each pipeline has its dp share of the rows, its CP share of their tokens
            dist.all_reduce(totals, group=self.meshes.dp_cp.get_group())
        return self._apply_update(totals[0], dict(zip(stats, totals[1:])), normaliser, compute_s, count_step,
                                  reduce=False)

    def _apply_update(self, loss_sum: torch.Tensor, stats: dict, normaliser: float, compute_s: float,
                      count_step: bool, reduce: bool = True) -> dict[str, Any]:
        """The step after the backward: global loss and stats (``reduce``: summed over the ranks,
        a tp group's replicated values once), clipping, the update or a skip, router statistics."""
        from omniweave.models.components.router_loss import finish_router_step
        from omniweave.train.optim import clip_grad_norm, group_lrs

        totals = torch.stack([loss_sum, *(torch.as_tensor(v, dtype=torch.float64, device=self.device)
                                          for v in stats.values())])
        if reduce:
            dist.all_reduce(totals)  # a tp foundation's values are replicated on its tp ranks
        totals = (totals / (self.dims.tp if reduce else 1)).tolist()
        loss = totals[0] / max(normaliser, 1)
        grad_norm = clip_grad_norm(self.params, self.clip, group=self.pipeline.group if self.pipeline else None)
        rates = group_lrs(self.optimizer)  # per-component groups' rates (optim.py), logged as lr/<component>
        lr = rates.get("lr/foundation", self.scheduler.get_last_lr()[0])
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if finite:
            self.optimizer.step()
            self.bad_in_row = 0
        else:
            self.skipped, self.bad_in_row = self.skipped + 1, self.bad_in_row + 1
        self.optimizer.zero_grad(set_to_none=True)
        router = finish_router_step(self.model, update_bias=finite, **self._router_reduce()) if self.moe_layers else {}
        if count_step:
            self.advance()
        if self.info.module is not None and hasattr(self.info.module, "synchronize"):
            self.info.module.synchronize()
        return {"loss": loss, "grad_norm": grad_norm, "lr": lr, "skipped": not finite, "skipped_total": self.skipped,
                "compute_s": compute_s, **dict(zip(stats, totals[1:])), **router, **rates}

    def start_router_step(self, micro_batches: list[dict]) -> None:
        """MoE models: the step's token and document counts over all ranks, which the router
        losses divide by (components/router_loss.py)."""
        from omniweave.models.components.router_loss import start_router_step

        if not self.moe_layers:
            return
        tokens, docs = self.global_sum([sum(mb["input_ids"].numel() for mb in micro_batches),
                                        sum(mb["cu_seqlens"].numel() - 1 if "cu_seqlens" in mb else 1
                                            for mb in micro_batches)])
        start_router_step(self.model, len(micro_batches), tokens, docs, total_layers=self.moe_layers)

    def _router_reduce(self) -> dict:
        """``finish_router_step``'s reductions: over every rank (a tp group's copies counted tp
        times); under ``parallel.pp`` over the ranks holding this rank's stages, then every stage's
        layer totals gathered over the pipeline."""
        from omniweave.parallel.expert import sum_over

        if self.pipeline is None:
            return {"reduce": sum_over(), "replicas": self.dims.tp}
        over_dp_cp, over_tp = sum_over(self.meshes.dp_cp.get_group()), sum_over(self.meshes.tp.get_group())

        def reduce(t: torch.Tensor) -> torch.Tensor:  # the ranks holding this rank's stages
            return over_tp(over_dp_cp(t))

        def combine(part: dict | None) -> list:
            parts = [None] * dist.get_world_size(self.pipeline.group)
            dist.all_gather_object(parts, part, group=self.pipeline.group)
            return parts

        return {"reduce": reduce, "replicas": self.dims.tp, "combine": combine}

    def advance(self) -> None:
        """The training step is done: schedule and step counter move on."""
        self.scheduler.step()
        self.step += 1

    def finish_step(self, record: dict[str, Any], state_fn: Callable[[], dict]) -> None:
        """Log ``record``; stop after ``train.max_bad_steps`` non-finite steps in a row; checkpoint
        (with the mode's ``state_fn()`` entries) and evaluate at their intervals and at the end."""
        self.log.log(record)
        if self.bad_in_row >= self.max_bad:  # after logging, so metrics.jsonl shows the step that stopped the run
            self.log.close()
            raise RuntimeError(f"step {self.step}: {self.bad_in_row} steps in a row had a non-finite loss or gradient "
                               f"(loss {record['loss']}, grad_norm {record['grad_norm']}); stopping. Lower train.lr "
                               "or check the data.")
        self.checkpointer.poll()  # publishes an asynchronous save once every rank has written it
        if (self.save_interval and self.step % self.save_interval == 0) or self.step == self.total:
            self.save(state_fn())
        if self.eval_interval and self.eval_path and (self.step % self.eval_interval == 0 or self.step == self.total):
            self.evaluate()
        watchdog.maybe_hang(self.rank, self.step + 1)

    def save(self, extra: dict) -> None:
        if not all_finite(self.model):
            raise RuntimeError(f"step {self.step}: weights are not finite; refusing to save a checkpoint")
        state = {"step": self.step, "skipped": self.skipped, "scheduler": self.scheduler.state_dict(), **extra}
        self.checkpointer.save(self.step, self.model, self.optimizer, state, self.config_yaml)

    def evaluate(self) -> None:
        """Greedy-generation accuracy on ``cfg.eval`` (rank 0, on an unsharded copy under FSDP)."""
        from omniweave.train.evaluate import eval_fn

        pp_group = self.pipeline.group if self.pipeline is not None else None
        whole = self.fsdp or pp_group is not None
        target = full_model_on_rank0(self.model, self.cfg, pp_group) if whole else self.model
        if target is not None:
            was_training = target.training
            target.eval()
            self.log.log_eval(self.step, eval_fn(target, self.cfg, self.step))
            target.train(was_training)
        dist.barrier()

    def finish(self) -> float:
        """Publish a save still being written, close the logs, export (``train.save_hf``); returns the
        seconds since logging started."""
        self.checkpointer.wait()
        self.log.close()
        if self.save_hf and self.total > 0:
            self.export_hf(self.run_dir / "hf")
        seconds = time.perf_counter() - self.t_start
        dist.barrier()
        self.watchdog.close()
        return seconds

    def export_hf(self, out: Path) -> None:
        """The current weights as a HF directory (rank 0 writes)."""
        from omniweave.config import to_dict
        from omniweave.models.hf.export import export_hf

        from omniweave.models.lora import merge_adapters

        plain = full_model_on_rank0(self.model, self.cfg, self.pipeline.group if self.pipeline is not None else None)
        if plain is not None and hasattr(plain, "generator"):  # video diffusion: a diffusers transformer folder
            from omniweave.models.hf.wan import save_wan_dit

            save_wan_dit(plain.generator, out)
            print(f"exported the final generator to {out} (diffusers WanTransformer3DModel)", flush=True)
        elif plain is not None:
            merge_adapters(plain)  # LoRA: the merged model (hf export --adapter writes a PEFT adapter)
            export_hf(plain, to_dict(self.cfg.model), out, data_cfg=to_dict(self.cfg.data))
            print(f"exported the final model to {out}", flush=True)
        dist.barrier()
