"""Closed-loop evaluation of a policy on ReachSim episodes, with the two controls that show what a
policy uses: blank images (can it succeed without seeing?) and a swapped instruction (does it
follow the text?). A policy that really uses vision and language scores high on the plain run and
low on both controls.

A policy is any callable ``policy(observation) -> actions [h, 2]`` with the observation
``{"images": {"observation.images.top": uint8 [S, S, 3]}, "state": float32 [2], "task": str}``
(``ReachSim.observation``). Its chunk is executed open loop for its first ``action_steps``
actions, then the policy is asked again (receding horizon), until success or ``max_steps``.
The episodes run in lockstep: a policy with a ``sample(observations) -> [chunks]`` method (the
trained VLA's ``vla/policy.Policy``) is asked once per round for every running episode, in one
batch; any other callable once per episode.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from omniweave.vla.sim import MAX_STEPS, ReachSim, instruction

EVAL_SEED = 1_000_000  # episode seeds from here on: apart from the dataset's (seed 0 upward)

Policy = Callable[[dict], np.ndarray]


def run_episodes(policy: Policy, episodes: int, seed: int = EVAL_SEED, *, blank_images: bool = False,
                 swap_instruction: bool = False, action_steps: int = 4, max_steps: int = MAX_STEPS,
                 image_size: int = 32, layout: str = "free") -> dict:
    """Run episodes with seeds ``seed .. seed + episodes - 1``. ``swap_instruction``: the policy is
    told to reach the other disc while success still means reaching the episode's own one.
    Returns success_rate, mean_steps (ticks per episode: to success, else max_steps), seconds,
    episodes, policy_calls and per-episode ``successes``."""
    if episodes < 1 or action_steps < 1:
        raise ValueError(f"episodes and action_steps must be >= 1, got {episodes}, {action_steps}")
    start = time.perf_counter()
    sims = [ReachSim(seed + i, image_size=image_size, max_steps=max_steps, layout=layout) for i in range(episodes)]
    tasks = [instruction(sim.other) if swap_instruction else sim.instruction for sim in sims]
    ask = getattr(policy, "sample", None) or (lambda observations: [policy(o) for o in observations])
    calls = 0
    while running := [i for i, sim in enumerate(sims) if not sim.done]:
        chunks = ask([sims[i].observation(task=tasks[i], blank_images=blank_images) for i in running])
        calls += len(running)
        for i, chunk in zip(running, chunks, strict=True):
            for action in _checked(chunk)[:action_steps]:
                sims[i].step(action)
                if sims[i].done:
                    break
    successes = [sim.success for sim in sims]
    return {"success_rate": float(np.mean(successes)), "mean_steps": float(np.mean([sim.steps for sim in sims])),
            "seconds": time.perf_counter() - start, "episodes": episodes, "policy_calls": calls,
            "successes": successes}


def _checked(chunk) -> np.ndarray:
    """The policy's answer as float32 [h, 2]; a wrong shape or a non-finite action is the policy's
    bug, said at once rather than turned into a strange trajectory."""
    chunk = np.asarray(chunk, np.float32)
    if chunk.ndim != 2 or chunk.shape[1] != 2 or len(chunk) < 1:
        raise ValueError(f"a policy must return actions [h, 2] with h >= 1, got shape {chunk.shape}")
    if not np.isfinite(chunk).all():
        raise ValueError("the policy returned non-finite actions")
    return chunk
