"""``omniweave rl RECIPE [key=value …] [--nproc N] [--resume auto|CKPT]``: GRPO on packed RL prompts.

A step (``train.global_batch`` prompts over all data-parallel ranks, each rank its share):

    rollout   the policy's weights synced into the rollout copy; G samples per prompt with one
              vision encoding and one prefill per prompt (generation.py; sequence-parallel under CP)
    reward    responses decoded and scored (rl/rewards.py); a group whose reward failed is dropped
              and counted, a group whose rewards are all equal is filtered (``rl.filter_zero_std``)
    advantage group-normalised (rl/grpo.py), per sample
    update    prompt + response rows packed (rl/batch.py), the reference's log-probs once
              (``rl.kl_coef`` > 0), then ``rl.ppo_epochs`` × ``rl.mini_batches`` optimizer steps of
              the engine, each normalised by the global token or sequence count of its mini-batch

It reuses the training engine (train/engine.py): the same set-up, FSDP / TP / CP, optimizer step,
checkpoints and exact resume (the loader position; sampling is seeded by step, prompt and sample,
so nothing else needs saving, but the next batch's rollouts one step off-policy), metrics and
evaluation. Which batch a step updates on, and when it is sampled: rl/schedule.py
(``rl.rollout.off_policy``). docs/rl.md has every ``rl.*`` key.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from omniweave.errors import UserError
from omniweave.rl.schedule import RolloutSchedule
from omniweave.rl.step import GRPOStep
from omniweave.train.engine import Engine, with_process_group

RL_LINE = (("reward", "reward_mean", ".3f"), ("acc", "accuracy", ".3f"), ("loss", "loss", ".4f"), ("kl", "kl", ".4f"),
           ("len", "response_len_mean", ".1f"), ("rollout", "rollout_s", ".1f"), ("update", "update_s", ".1f"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    from omniweave.train.trainer import add_arguments as train_arguments

    train_arguments(p)


def run(args: argparse.Namespace) -> int:
    from omniweave.config import load_recipe
    from omniweave.launch import relaunch, wants_launch
    from omniweave.train.trainer import check_ready, listed

    if listed(args):
        return 0
    launching = wants_launch(args)
    cfg = load_recipe(args.recipe, args.overrides)
    check_ready(cfg, args.resume, kind="prompts")
    settings(cfg)  # bad rl.* values and unknown rewards fail here, before any rank starts
    if launching:
        return relaunch("rl", args)
    result = train_rl(cfg, resume=args.resume)
    if result["rank"] == 0:
        print(f"trained {result['steps']} GRPO steps in {result['seconds']:.1f} s, final reward "
              f"{result['reward']:.3f}; run dir {result['run_dir']}")
    return 0


@dataclass
class Settings:
    grpo: object  # GRPOConfig
    sampling: object  # SamplingParams (stop ids filled in by the loop)
    group_size: int
    ppo_epochs: int
    mini_batches: int
    update_max_len: int
    rewards: object  # Rewards
    rollout: dict  # rl.rollout (engine options)
    correction: str  # rl.rollout.correction resolved (rl/correction.py)


def settings(cfg, stop_ids: tuple[int, ...] = ()) -> Settings:
    from omniweave.config import to_dict
    from omniweave.rl.grpo import GRPOConfig
    from omniweave.rl.rewards import build_rewards
    from omniweave.generation import SamplingParams

    rl = to_dict(cfg.rl)
    if str(cfg.train.phase) != "grpo":
        raise UserError(f"omniweave rl needs train.phase=grpo (the recipe has {cfg.train.phase!r})")
    grpo = GRPOConfig(scale_rewards=rl["scale_rewards"], clip_low=rl["clip_low"], clip_high=rl["clip_high"],
                      dual_clip=rl["dual_clip"], kl_coef=rl["kl_coef"], loss_agg=rl["loss_agg"],
                      filter_zero_std=rl["filter_zero_std"], advantage=rl["advantage"],
                      importance_sampling=rl["importance_sampling"])
    grpo.validate()
    sampling = SamplingParams(rl["temperature"], rl["top_p"], rl["top_k"], rl["max_new_tokens"], tuple(stop_ids))
    try:
        sampling.validate()
    except ValueError as e:
        raise UserError(f"rl.temperature / top_p / top_k / max_new_tokens: {e}") from None
    for key in ("group_size", "ppo_epochs", "mini_batches"):
        if rl[key] < 1 or (key == "group_size" and rl[key] < 2):
            raise UserError(f"rl.{key} must be >= {2 if key == 'group_size' else 1}, got {rl[key]}")
    capacity = rl["update_max_len"] or int(cfg.data.max_len) + rl["max_new_tokens"]
    rollout = rl["rollout"]
    correction = rollout_settings(cfg, rollout, grpo)
    return Settings(grpo, sampling, rl["group_size"], rl["ppo_epochs"], rl["mini_batches"], capacity,
                    build_rewards(rl["rewards"]), rollout, correction)


def rollout_settings(cfg, rollout: dict, grpo) -> str:
    """The resolved ``rl.rollout.correction``; a bad engine, correction or layout for the engine
    is one line here, before any rank starts."""
    from omniweave.rl.correction import resolve

    engine = rollout["engine"]
    if engine not in ("native", "vllm"):
        raise UserError(f"rl.rollout.engine must be native or vllm; got {engine!r}")
    if rollout["off_policy"] not in (0, 1):
        raise UserError(f"rl.rollout.off_policy must be 0 (on-policy) or 1 (one step off-policy); got "
                        f"{rollout['off_policy']!r}")
    try:
        correction = resolve(rollout["correction"], engine, rollout["off_policy"])
    except ValueError as e:
        raise UserError(str(e)) from None
    if correction in ("token_tis", "seq_tis") and grpo.importance_sampling == "sequence":
        raise UserError(f"rl.rollout.correction={correction} weighs tokens of the token-level objective; with "
                        "rl.importance_sampling=sequence (GSPO) use rl.rollout.correction=recompute or none")
    if engine == "vllm":
        from omniweave.rl.vllm_engine import check_vllm_recipe

        check_vllm_recipe(cfg, rollout)
    return correction


def rollout_engine(cfg, engine: Engine, rollout_model, s: Settings):
    """The engine that samples (``rl.rollout.engine``) over the full-weight rollout copy."""
    if s.rollout["engine"] == "vllm":
        from omniweave.rl.vllm_engine import VLLMRollout

        max_len = s.rollout["max_model_len"] or int(cfg.data.max_len) + s.sampling.max_new_tokens
        return VLLMRollout(rollout_model, cfg, engine.run_dir / "rollout_engine" / f"rank{engine.rank}", s.rollout,
                           max_len, seed=int(cfg.train.seed), tp=engine.dims.tp)
    from omniweave.generation import TorchRollout

    return TorchRollout(rollout_model, cp_group=engine.meshes.cp.get_group() if engine.dims.cp > 1 else None,
                        cp=engine.dims.cp, cp_rank=engine.meshes.cp_rank)


def samples_in_thread(engine: Engine, s: Settings) -> bool:
    """One step off-policy with ``rl.rollout.overlap``: whether the next batch may be sampled in a
    thread during the update, i.e. the rollout runs no collective (which would interleave with the
    update's): no CP merges, no vision encoder shared across ranks, no tensor-parallel vLLM engine."""
    collectives = engine.dims.cp > 1 or engine.meshes.vision_split is not None or (
        s.rollout["engine"] == "vllm" and engine.dims.tp > 1)
    return bool(s.rollout["off_policy"] and s.rollout["overlap"] and not collectives)


def update_rows_of(cfg, dims):
    """Under ``parallel.pp``: the update rows as the pipeline takes them (train/pipeline_setup.py):
    prompt + responses of ``rl.update_max_len`` tokens, as many per mini-batch as it can hold at
    worst (each sample in a row of its own: rl/batch.py), the rest padded with loss-free rows."""
    from omniweave.train.pipeline_setup import PipelineRows

    s = settings(cfg)
    prompts = -(-(int(cfg.train.global_batch) // dims.dp) // s.mini_batches)
    return PipelineRows(s.update_max_len, prompts * s.group_size, None)


def train_rl(cfg, resume: str | None = None) -> dict:
    return with_process_group(lambda: _train_rl(cfg, resume))


def _train_rl(cfg, resume) -> dict:
    engine = Engine(cfg, pipeline_rows=update_rows_of)
    # the output_dir's lock released however the run ends; a collective that fails: one line naming
    # the rank and the collective
    with engine.run_lock, engine.watchdog:
        return _rl_loop(engine, cfg, resume)


def _rl_loop(engine: Engine, cfg, resume) -> dict:
    from omniweave.data.loading.loader import PackedLoader
    from omniweave.data.loading.mix import data_source
    from omniweave.data.text.tokenize import SampleProcessor
    from omniweave.generation import build_rollout_model
    from omniweave.train.parallel_model import frozen_reference

    path, mix = data_source(cfg.data)  # one packed dataset of prompts, or a mix (data/loading/mix.py)
    loader = PackedLoader(path, int(cfg.train.global_batch), dp_rank=engine.meshes.dp_rank,
                          dp_size=engine.dims.dp, seed=int(cfg.train.seed), num_workers=int(cfg.data.num_workers),
                          kind="prompts", mix=mix)
    processor = SampleProcessor(loader.data_cfg)
    stops = tuple(processor.tokenizer.token_id(t) for t in processor.template.stop_tokens)
    s = settings(cfg, stops)
    reference = frozen_reference(cfg, engine) if s.grpo.kl_coef > 0 else None
    rollout_model = build_rollout_model(cfg, engine.dims, engine.meshes, engine.device)
    rollout = rollout_engine(cfg, engine, rollout_model, s)
    step_fn = GRPOStep(engine, s, processor, stops, rollout, rollout_model, reference)
    schedule = RolloutSchedule(step_fn, loader, engine, s.rollout["off_policy"], samples_in_thread(engine, s))
    state = engine.resume(resume)
    if state is not None:
        schedule.load_state_dict(state)
    engine.start_logging(RL_LINE)
    if engine.rank == 0:
        print(f"{engine.describe()}, {loader.num_packs} prompts, {int(cfg.train.global_batch)} per step x "
              f"{s.group_size} samples, GRPO steps {engine.step}..{engine.total}"
              + (f", one step off-policy{' (rollouts overlapped with updates)' if schedule.pool else ''}"
                 if s.rollout["off_policy"] else ""), flush=True)
    last = {"reward_mean": float("nan")}
    try:
        while engine.step < engine.total:
            generated, skips = schedule.next()
            last = schedule.finish(step_fn(generated, skips))
            engine.finish_step(last, schedule.state_dict)
        seconds = engine.finish()
    finally:
        schedule.close()
        if hasattr(rollout, "close"):  # an engine with its own resources (vLLM), released while the groups live
            rollout.close()
    return {"rank": engine.rank, "steps": engine.step, "seconds": seconds, "reward": last["reward_mean"],
            "run_dir": str(engine.run_dir)}
