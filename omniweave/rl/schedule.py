"""Which rollouts a GRPO step updates on (``rl.rollout.off_policy``).

``off_policy: 0`` (on-policy, the default): step k syncs the policy θ_k into the rollout engine,
samples batch k and updates on it.

``off_policy: 1`` (one step off-policy): step k syncs θ_k, starts sampling batch k+1 with it, and
updates on batch k, sampled by θ_{k-1} during step k-1 (``rollout/staleness`` = 1). Step 0, and a
step whose rollouts were not saved, samples its own batch first (staleness 0). With
``rl.rollout.overlap`` and an engine that runs no collective (the native engine without CP or a
vision split, vLLM at tensor-parallel 1: rl/trainer.samples_in_thread) the sampling runs in a background
thread while the main thread updates, so a step costs max(rollout, update) rather than their sum;
``rollout_wait_s`` is what the update then waited for it. The thread's results do not depend on
its timing (each sample has its own seeded generator, the rollout copy is written only between
steps), so overlapped and sequential runs are identical (with vLLM: the same tokens, its log-probs
to the last bits, which its CPU kernels beside the update can change). The samples' behaviour policy is one step
old: ``rl.rollout.correction: auto`` recomputes π_old with the trainer and weighs the tokens by
min(π_old / μ, C) (token_tis) on either engine.

Exact resume: the checkpoint of step k holds the loader's position after batch k and every rank's
rollouts of batch k+1 (tokens, log-probs; gathered into the trainer state). Resumed, batch k+1's
prompts are read again and its saved rollouts used, so the run goes on as if it had not stopped.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch.distributed as dist

from omniweave.generation import Prompt, Rollout
from omniweave.rl.step import Generated


class RolloutSchedule:
    def __init__(self, step_fn, loader, engine, off_policy: int, threaded: bool):
        """``threaded``: sample the next batch in a thread during the update (off-policy only)."""
        self.step_fn, self.loader, self.engine, self.off_policy = step_fn, loader, engine, int(off_policy)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rollout") if off_policy and threaded else None
        self.it = None  # the loader's iterator, made at the first read (after a resume's load_state_dict)
        self.ahead: tuple | None = None  # the next batch: (Generated or its Future, media skips, loader position)
        self.saved: dict | None = None  # the next batch's rollouts from a checkpoint
        self.position: dict | None = None  # the loader's state after the batch being updated
        self.synced = -1  # the policy version the rollout engine holds
        self.started = 0.0

    # ------------------------------------------------------------------ the steps

    def next(self) -> tuple[Generated, list[dict]]:
        """This step's rollouts and media skips; one step off-policy, the next batch's sampling starts."""
        e = self.engine
        self.started = time.perf_counter()
        if self.ahead is None:
            packs, skips, self.position = self._read()
            generated = self._restored(packs)
            if generated is None:
                self._sync()
                generated = self.step_fn.generate(packs, e.step, e.step)
        else:
            generated, skips, self.position = self.ahead
            self.ahead = None
        if self.off_policy and e.step + 1 < e.total:
            packs, next_skips, position = self._read()
            self._sync()  # θ_k, before this step's update changes it
            args = (packs, e.step + 1, e.step)
            work = self.pool.submit(self.step_fn.generate, *args) if self.pool else self.step_fn.generate(*args)
            self.ahead = (work, next_skips, position)
        return generated, skips

    def finish(self, record: dict) -> dict:
        """After the update: the next batch's rollouts joined; the step's wall time (and wait) recorded."""
        if self.ahead is not None and isinstance(self.ahead[0], Future):
            t0 = time.perf_counter()
            self.ahead = (self.ahead[0].result(), *self.ahead[1:])
            record["rollout_wait_s"] = round(time.perf_counter() - t0, 3)
        elif self.off_policy:
            record["rollout_wait_s"] = 0.0
        record["step_s"] = round(time.perf_counter() - self.started, 4)
        return record

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def _read(self) -> tuple[list[dict], list[dict], dict]:
        if self.it is None:
            self.it = iter(self.loader)
        packs = next(self.it)
        return packs, self.loader.take_media_skips(), self.loader.state_dict()

    def _sync(self) -> None:
        if self.synced != self.engine.step:
            self.step_fn.sync()
            self.synced = self.engine.step

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """The loader's position after this step's batch and (one step off-policy) every rank's
        rollouts of the next batch, gathered (a collective: every rank calls it)."""
        state = {"loader": self.position}
        if self.off_policy:
            mine = None
            if self.ahead is not None:  # joined by finish(); the engine's step is already the next batch's
                work = self.ahead[0]
                mine = _rollouts_state(work.result() if isinstance(work, Future) else work, self.engine.step)
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, mine)
            if any(r is not None for r in ranks):
                state["rollouts_ahead"] = {str(rank): r for rank, r in enumerate(ranks)}
        return state

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state["loader"])
        self.position = state["loader"]
        ahead = state.get("rollouts_ahead") or {}
        if self.off_policy:
            self.saved = ahead.get(str(self.engine.rank))
        elif ahead and self.engine.rank == 0:
            print("the checkpoint holds the next batch's off-policy rollouts; rl.rollout.off_policy is 0 now, so "
                  "they are sampled again by this step's policy", flush=True)

    def _restored(self, packs: list[dict]) -> Generated | None:
        saved, self.saved = self.saved, None
        if saved is None:
            return None
        uids = [int(p["prompt"]["uid"]) for p in packs]
        if saved["step"] != self.engine.step or saved["uids"] != uids:
            if self.engine.rank == 0:
                print(f"step {self.engine.step}: the checkpoint's saved rollouts are of other prompts (another "
                      "layout?); this batch is sampled again by the current policy", flush=True)
            return None
        rollouts = [Rollout(int(u), int(j), list(t), list(lp), bool(tr)) for u, j, t, lp, tr in saved["rollouts"]]
        return Generated([Prompt(p["prompt"]["uid"], p) for p in packs], rollouts, int(saved["version"]),
                         float(saved["seconds"]))


def _rollouts_state(generated: Generated, step: int) -> dict:
    """One rank's next-batch rollouts as JSON values (Python floats round-trip exactly)."""
    return {"step": step, "version": generated.version, "seconds": generated.seconds,
            "uids": [int(p.uid) for p in generated.prompts],
            "rollouts": [[r.uid, r.sample, r.tokens, r.logprobs, r.truncated] for r in generated.rollouts]}
