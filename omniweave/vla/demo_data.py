"""Expert demonstrations of ReachSim as a LeRobot v3.0 dataset, the training data of the VLA demo.

Episode i is the scripted expert (``expert_action``) on the episode of seed ``seed + i``; an
episode the expert fails (rare: its noise) is skipped and the next seed taken, so the dataset holds
only successes. Each frame records what the policy would see (the rendered top camera, the state,
the instruction) and the action the expert took from there; the episode ends at success.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from omniweave.data.sources.lerobot_write import consecutive_files, write_dataset
from omniweave.vla.sim import ReachSim, expert_action

CAMERA = "observation.images.top"
STATE_KEY = "observation.state"
ACTION_KEY = "action"
FPS = 10


def expert_episodes(episodes: int, seed: int = 0, image_size: int = 32, layout: str = "free") -> list[dict]:
    """``episodes`` successful expert episodes as the writer takes them (plus each one's ``seed``)."""
    out, episode_seed = [], seed
    while len(out) < episodes:
        if episode_seed - seed > 2 * episodes + 100:
            raise RuntimeError(f"the expert failed too often: {len(out)} successes in {episode_seed - seed} seeds")
        sim = ReachSim(episode_seed, image_size=image_size, layout=layout)
        images, states, actions = [], [], []
        while not sim.done:
            images.append(sim.render())
            states.append(sim.state())
            actions.append(expert_action(sim))
            sim.step(actions[-1])
        if sim.success:
            out.append({"task": sim.instruction, "seed": episode_seed, "state": np.stack(states),
                        "action": np.stack(actions), "images": {CAMERA: np.stack(images)}})
        episode_seed += 1
    return out


def write_reach_dataset(root: str | Path, episodes: int = 200, seed: int = 0, image_size: int = 32,
                        episodes_per_file: int = 50, layout: str = "free", pix_fmt: str = "yuv444p") -> Path:
    """Write ``expert_episodes(episodes, seed, image_size, layout)`` under ``root`` (``image_size``
    even: H.264 needs it); reads back with ``LeRobotDataset(root).frames(horizon)``. The videos keep
    full chroma (yuv444p) by default: the policy is evaluated on rendered images, and yuv420p's
    subsampled colour around the small discs would put it on other pixels than it trained on."""
    recorded = expert_episodes(episodes, seed, image_size, layout)
    return write_dataset(root, recorded, fps=FPS, state_key=STATE_KEY, action_key=ACTION_KEY,
                         files=consecutive_files(len(recorded), episodes_per_file), robot_type="reach_sim_2d",
                         names={STATE_KEY: ["x", "y"], ACTION_KEY: ["vx", "vy"]}, pix_fmt=pix_fmt)
