"""One GRPO step: rollout, reward, advantages, updates (see rl/trainer.py for the overview)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from omniweave.rl.batch import dummy_row, update_rows
from omniweave.rl.correction import STAT_KEYS, correct_row, max_weight
from omniweave.rl.correction import metrics as correction_metrics
from omniweave.rl.grpo import group_advantages, rloo_advantages, zero_std_groups
from omniweave.rl.objective import GRPOObjective
from omniweave.generation import Prompt, Rollout, sync_weights
from omniweave.train.engine import autocast, to_device

ANSWER_REWARDS = ("exact_match", "multiple_choice", "numeric")  # the first of these listed is "accuracy"


@dataclass
class Generated:
    """One batch's rollouts and the policy version (the GRPO step) whose weights sampled them."""

    prompts: list[Prompt]
    rollouts: list[Rollout]
    version: int
    seconds: float  # generating them


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of a step (prompt uid and sample index are mixed in per sample)."""
    return int(seed) * 1_000_003 + int(step)


class GRPOStep:
    def __init__(self, engine, settings, processor, stop_ids, rollout, rollout_model, reference=None):
        self.engine, self.s, self.processor, self.stop_ids = engine, settings, processor, stop_ids
        self.rollout, self.rollout_model, self.reference = rollout, rollout_model, reference
        self.sampling = settings.sampling
        # the log-probs the rollout reports: of logits / T, or of the logits themselves when greedy
        self.logp_temperature = settings.sampling.temperature or 1.0
        self.objective = GRPOObjective(settings.grpo, self.logp_temperature,
                                       engine.meshes.cp.get_group() if engine.dims.cp > 1 else None, engine.dims.cp)
        keys = settings.rewards.keys
        self.accuracy_key = next((k for k in keys if k.rsplit("_", 1)[0] in ANSWER_REWARDS or k in ANSWER_REWARDS),
                                 keys[0])

    # ------------------------------------------------------------------ the step

    def sync(self) -> None:
        """The policy's weights into the rollout copy (and into an engine holding its own, vLLM)."""
        e = self.engine
        sync_weights(e.model, self.rollout_model, e.pipeline.group if e.pipeline is not None else None)
        if hasattr(self.rollout, "sync"):
            self.rollout.sync()

    def generate(self, packs: list[dict], step: int, version: int) -> Generated:
        """Batch ``step``'s rollouts (seeded by it) from the rollout copy as last synced, which holds
        the weights of step ``version``. Touches neither the policy nor, where
        rl/trainer.samples_in_thread allows, a process group: rl/schedule.py then runs it in a
        thread while the previous batch updates."""
        t0 = time.perf_counter()
        prompts = [Prompt(p["prompt"]["uid"], p) for p in packs]
        rollouts = self.rollout.generate(prompts, self.s.group_size, self.sampling,
                                         step_seed(self.engine.cfg.train.seed, step))
        return Generated(prompts, rollouts, version, time.perf_counter() - t0)

    def __call__(self, generated: Generated, media_skips: list[dict] = ()) -> dict:
        """Reward, advantages and updates on ``generated`` (sampled by the policy of step
        ``generated.version``; this step's own or, one step off-policy, the one before).
        ``media_skips``: the loader's records of prompts whose media did not decode (their
        pixels are zeros): their groups are dropped like a failed reward's, counted and named.
        The record's ``step_s`` (the step's wall time) is the loop's to fill (rl/schedule.py)."""
        e, s, G = self.engine, self.s, self.s.group_size
        t1 = time.perf_counter()
        prompts, rollouts = generated.prompts, generated.rollouts
        answers = [p.batch["prompt"]["answer"] for p in prompts]
        texts = [self.processor.tokenizer.decode([t for t in r.tokens if t not in self.stop_ids]) for r in rollouts]
        scored = s.rewards.score(texts, [answers[k // G] for k in range(len(rollouts))])
        keep, advantages, counts = self._advantages(scored, len(prompts), {r["row"] for r in media_skips})
        mini_batches = []  # the kept groups split into rl.mini_batches parts, each packed into its rows
        for k in range(s.mini_batches):
            part = keep[k * len(keep) // s.mini_batches : (k + 1) * len(keep) // s.mini_batches]
            rows = update_rows(prompts, rollouts, advantages, part, G, s.update_max_len, s.grpo.loss_agg)
            mini_batches.append(self._aligned(rows, prompts))
        rows = [r for rows in mini_batches for r in rows]
        if self.reference is not None:
            for row in rows:
                row["token_data"]["ref_logp"] = self._full_row_logprobs(self.reference, row)
        corrected = self._correct(rows)
        staleness = e.step - generated.version
        updates = self._update(mini_batches)
        e.advance()
        update_s = time.perf_counter() - t1
        record = self._record(rollouts, scored, counts, updates, rows, generated.seconds, update_s, media_skips,
                              corrected)
        if s.rollout["off_policy"]:
            record["rollout/staleness"] = staleness
        return record

    def _advantages(self, scored, n: int, bad_media: set[int] = frozenset()):
        """(kept prompt indices, advantages [n·G] (0 for dropped groups), group counts); a prompt in
        ``bad_media`` (its media did not decode) is dropped, like a group whose reward failed."""
        G = self.s.group_size
        rewards = scored.total.view(n, G)
        media = torch.tensor([i in bad_media for i in range(n)], dtype=torch.bool)
        failed = scored.failed.view(n, G).any(1) & ~media  # counted once, as a media skip
        unusable = failed | media
        flat = torch.where(unusable[:, None], 0.0, rewards)
        zero = zero_std_groups(flat.reshape(-1), G) & ~unusable
        dropped = unusable | (zero if self.s.grpo.filter_zero_std else torch.zeros_like(zero))
        keep = [i for i in range(n) if not dropped[i]]
        advantages = torch.zeros(n * G)
        if keep:
            idx = torch.tensor(keep)
            kept = flat[idx].reshape(-1)
            adv = (rloo_advantages(kept, G) if self.s.grpo.advantage == "rloo"
                   else group_advantages(kept, G, scale=self.s.grpo.scale_rewards))
            advantages.view(n, G)[idx] = adv.view(len(keep), G)
        return keep, advantages, {"groups": n, "failed": int(failed.sum()), "zero_std": int(zero.sum()),
                                  "media_skipped": int(media.sum())}

    def _aligned(self, rows: list[dict], prompts: list[Prompt]) -> list[dict]:
        """Every rank the same number of rows in this mini-batch (dummy rows added)."""
        e = self.engine
        n = torch.tensor([len(rows)])
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        if e.pipeline is not None:  # a pipeline's schedule runs a fixed number of rows (rl/trainer.update_rows_of)
            if int(n) > e.pipeline.n_microbatches:
                raise RuntimeError(f"{int(n)} update rows exceed the pipeline's {e.pipeline.n_microbatches}")
            n = torch.tensor([e.pipeline.n_microbatches])
        axes = prompts[0].batch["position_ids"].shape[0] if prompts else 3
        return rows + [dummy_row(2 * e.dims.cp, axes) for _ in range(int(n) - len(rows))]

    @torch.no_grad()
    def _full_row_logprobs(self, model, row: dict) -> torch.Tensor:
        """Per-token log-probs [L] of a whole row (CP shards gathered back) under ``model``."""
        from omniweave.parallel.context import shard_micro_batch, unshard_micro_batch_rows

        e = self.engine
        mb = to_device(shard_micro_batch(row, e.dims.cp, e.meshes.cp_rank, e.dims.tp), e.device)
        with autocast(e.device, e.precision, e.fsdp):
            logp = model(mb, token_logprobs=True, temperature=self.logp_temperature).token_logp.float()
        parts = [logp]
        if e.dims.cp > 1:
            parts = [torch.empty_like(logp) for _ in range(e.dims.cp)]
            dist.all_gather(parts, logp.contiguous(), group=e.meshes.cp.get_group())
        return unshard_micro_batch_rows([p.cpu() for p in parts], row["cu_seqlens"], e.dims.cp, e.dims.tp)

    def _correct(self, rows: list[dict]) -> dict:
        """``rl.rollout.correction`` (rl/correction.py): π_old recomputed by the training forward,
        importance weights on the engine's samples; the step's engine-vs-trainer metrics."""
        mode = self.s.correction
        if mode == "none":
            return {}
        sums = torch.zeros(len(STAT_KEYS), dtype=torch.float64)
        for row in rows:
            sums += correct_row(row, self._full_row_logprobs(self.engine.model, row), mode, self.s.rollout["tis_cap"])
        top = torch.tensor([max_weight(rows)])
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        return correction_metrics(self.engine.global_sum(sums.tolist()), float(top))

    def _update(self, mini_batches: list[list[dict]]) -> list[dict]:
        """rl.ppo_epochs passes over the mini-batches, one optimizer step each, normalised by the
        mini-batch's global response-token (token-mean) or sequence count."""
        e, s = self.engine, self.s
        outs = []
        for _ in range(s.ppo_epochs):
            for part in mini_batches:
                (norm,) = e.global_sum([self.objective.count(part)])
                outs.append(e.optimizer_step(part, self.objective, normaliser=norm, count_step=False))
        return outs

    # ------------------------------------------------------------------ metrics

    def _record(self, rollouts, scored, counts, updates, rows, rollout_s, update_s, media_skips,
                corrected: dict) -> dict:
        e, G = self.engine, self.s.group_size
        from omniweave.device import peak_memory_bytes

        ok = ~scored.failed
        lens = torch.tensor([len(r.tokens) for r in rollouts], dtype=torch.float64)
        sampled_logp = sum(sum(r.logprobs) for r in rollouts)
        local = [float(ok.sum()), float(scored.total[ok].sum()), float((scored.total[ok] ** 2).sum()),
                 float(len(rollouts)), float(lens.sum()), float(sum(r.truncated for r in rollouts)), -sampled_logp,
                 float(counts["groups"]), float(counts["failed"]), float(counts["zero_std"]),
                 float(sum(r["input_ids"].shape[0] for r in rows if r["num_loss_tokens"])), float(counts["media_skipped"])]
        for key in scored.per_reward:
            values = scored.per_reward[key][ok]
            local.append(float(values.sum()))
        g = e.global_sum(local)
        n_ok, r_sum, r_sq, n, len_sum, trunc, nll, groups, failed, zero_std, row_tokens, media_skipped = g[:12]
        mean = r_sum / max(n_ok, 1)
        tokens = sum(u.get("tokens", 0.0) for u in updates)  # no rows at all: every group was dropped
        record = {
            "step": e.step, "loss": sum(u["loss"] for u in updates) / len(updates),
            "grad_norm": updates[-1]["grad_norm"], "lr": updates[-1]["lr"],
            **{k: v for k, v in updates[-1].items() if k.startswith("lr/")},
            "reward_mean": mean, "reward_std": max(r_sq / max(n_ok, 1) - mean * mean, 0.0) ** 0.5,
            **{f"reward/{k}": v / max(n_ok, 1) for k, v in zip(scored.per_reward, g[12:])},
            "response_len_mean": len_sum / max(n, 1), "response_clip_frac": trunc / max(n, 1),
            "kl": sum(u.get("kl_sum", 0.0) for u in updates) / max(tokens, 1),
            "clip_frac": sum(u.get("clipped", 0.0) for u in updates) / max(tokens, 1),
            "entropy": nll / max(len_sum, 1), "frac_zero_std": zero_std / max(groups, 1),
            "groups_failed": int(failed), "groups_media_skipped": int(media_skipped), "samples": int(n), "group_size": G,
            "rollout_s": round(rollout_s, 3), "update_s": round(update_s, 3),
            "tokens_per_s": row_tokens * self.s.ppo_epochs / max(update_s, 1e-9),
            "gen_tokens_per_s": len_sum / max(rollout_s, 1e-9),
            "memory_gb": peak_memory_bytes(e.info) / 2**30,
            "skipped": any(u["skipped"] for u in updates), "skipped_total": e.skipped,
            **{k: sum(u[k] for u in updates) / (1 if k == "moe_a2a_bytes" else len(updates))
               for k in updates[-1] if k.startswith("moe_")},  # MoE: losses per update, bytes per step
        }
        record.update(corrected)
        record["accuracy"] = record.get(f"reward/{self.accuracy_key}", mean)
        if media_skipped:  # every rank gathers the records; rank 0 names each prompt
            from omniweave.train.trainer import report_media_skips

            record["media_skips"] = report_media_skips(e, media_skips, "its group was dropped")
        if scored.errors and e.rank == 0:
            print(f"step {e.step}: reward failures {dict(scored.errors)} (their groups were dropped)", flush=True)
        return record
