"""ReachSim: reach the red or the blue disc, as the instruction says, in a 2-D arena [0, 1]^2.

The smallest task on which a vision-language-action model has to use all three inputs: where the
targets are is only in the image, which one to reach is only in the text, and where the effector
is comes in the state (and the image). Each episode is one integer seed: it fixes the two disc
positions, the effector's start and which colour is instructed, so any policy can be scored on the
same episodes again.

Two layouts (``layout=``): ``free`` samples the discs and the start anywhere, so that a policy
cannot succeed by accident: the discs are ``MIN_SEPARATION`` apart and from the start, and the
instructed disc stays ``PATH_CLEARANCE`` away from the straight path to the other one (heading for
the wrong disc never brushes the right one). ``ring`` puts the discs on two of ``RING_SLOTS``
slots of a circle of radius ``RING_RADIUS`` around the centre and the start near the centre
(within ``RING_JITTER``): which way to go is then one of eight, read from the image by the colour
the text names -- the layout a tiny model learns from a few hundred demonstrations on a CPU (the
VLA demo's), with the same guarantees (heading for the wrong slot never passes the right one).

Image convention: column j shows x = (j + 0.5) / S, row i shows y = (i + 0.5) / S.
"""

from __future__ import annotations

import numpy as np

COLOURS = {"red": (220, 40, 40), "blue": (40, 80, 230)}  # target name -> RGB
EFFECTOR_RGB = (240, 240, 240)
BACKGROUND_RGB = (20, 20, 20)
MAX_STEP = 0.08  # the longest move one control tick may make (the action's norm is clipped to it)
MAX_STEPS = 40  # control ticks per episode
SUCCESS_RADIUS = 0.07  # the effector this close to the instructed disc's centre: success
DISC_RADIUS = 0.07  # drawn
EFFECTOR_HALF_SIZE = 0.04  # drawn: a square of side 2 x this
MARGIN = 0.1  # discs and start stay this far inside the arena
MIN_SEPARATION = 0.35
PATH_CLEARANCE = 0.15
LAYOUTS = ("free", "ring")
RING_SLOTS, RING_RADIUS, RING_JITTER = 8, 0.36, 0.04


def instruction(colour: str) -> str:
    return f"reach the {colour} target"


def named_colour(text: str) -> str | None:
    """The target colour an instruction names (None when it names none or both)."""
    named = [c for c in COLOURS if c in text.lower().split()]
    return named[0] if len(named) == 1 else None


def clip_step(action: np.ndarray, max_step: float = MAX_STEP) -> np.ndarray:
    """The action scaled down to norm ``max_step`` when longer (direction kept), as float32."""
    action = np.asarray(action, np.float64).reshape(2)
    norm = float(np.hypot(*action))
    return (action * (max_step / norm) if norm > max_step else action).astype(np.float32)


class ReachSim:
    """One episode. ``step(action)`` moves the effector by the clipped action (a velocity command
    in arena units per tick), ``success`` becomes True the first tick the effector is within
    ``success_radius`` of the instructed disc and stays True; ``done`` at success or ``max_steps``."""

    def __init__(self, seed: int, *, image_size: int = 32, max_steps: int = MAX_STEPS, max_step: float = MAX_STEP,
                 success_radius: float = SUCCESS_RADIUS, layout: str = "free"):
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r}: choose from {', '.join(LAYOUTS)}")
        self.seed, self.image_size, self.layout = int(seed), int(image_size), layout
        self.max_steps, self.max_step, self.success_radius = max_steps, max_step, success_radius
        rng = np.random.default_rng(self.seed)
        self.goal = ("red", "blue")[int(rng.integers(2))]
        self.other = "blue" if self.goal == "red" else "red"
        self.targets, start = (_ring_layout if layout == "ring" else _layout)(rng, self.goal, self.other)
        self.effector = start
        self.noise_rng = np.random.default_rng([self.seed, 1])  # the expert's noise: its own stream
        self.steps, self.success = 0, False

    @property
    def instruction(self) -> str:
        return instruction(self.goal)

    @property
    def done(self) -> bool:
        return self.success or self.steps >= self.max_steps

    def state(self) -> np.ndarray:
        return self.effector.astype(np.float32)

    def distance_to(self, colour: str) -> float:
        return float(np.hypot(*(self.effector - self.targets[colour])))

    def step(self, action: np.ndarray) -> None:
        if self.done:
            raise RuntimeError("step() after the episode ended")
        self.effector = np.clip(self.effector + clip_step(action, self.max_step), 0.0, 1.0)
        self.steps += 1
        self.success = self.success or self.distance_to(self.goal) <= self.success_radius

    def render(self) -> np.ndarray:
        """uint8 [S, S, 3]: both discs in their colours, the effector as a square drawn on top."""
        s = self.image_size
        centres = (np.arange(s) + 0.5) / s
        x, y = centres[None, :], centres[:, None]
        image = np.empty((s, s, 3), np.uint8)
        image[:] = BACKGROUND_RGB
        for colour, (cx, cy) in self.targets.items():
            image[(x - cx) ** 2 + (y - cy) ** 2 <= DISC_RADIUS ** 2] = COLOURS[colour]
        ex, ey = self.effector
        half = max(EFFECTOR_HALF_SIZE, 0.5 / s)  # at least one pixel at any size
        image[(np.abs(x - ex) <= half) & (np.abs(y - ey) <= half)] = EFFECTOR_RGB
        return image

    def observation(self, *, task: str | None = None, blank_images: bool = False,
                    camera: str = "observation.images.top") -> dict:
        """What a policy sees: {"images": {camera: uint8 [S, S, 3]}, "state": float32 [2], "task"}.
        ``task`` replaces the instruction; ``blank_images`` gives all-zero pixels."""
        image = np.zeros((self.image_size,) * 2 + (3,), np.uint8) if blank_images else self.render()
        return {"images": {camera: image}, "state": self.state(), "task": self.instruction if task is None else task}


def expert_action(sim: ReachSim, *, noise: float = 0.01, target: str | None = None) -> np.ndarray:
    """The scripted demonstrator: a proportional step (gain 1) toward the instructed disc (or
    ``target``) plus Gaussian noise from the episode's own stream, clipped; float32 [2]."""
    toward = sim.targets[target or sim.goal] - sim.effector
    return clip_step(toward + sim.noise_rng.normal(0.0, noise, 2), sim.max_step)


def pixel_expert(observation: dict, horizon: int = 8, camera: str = "observation.images.top") -> np.ndarray:
    """The expert as a policy of the observation alone: it finds the disc the text names by its
    colour in the image and plans ``horizon`` clipped steps to its centre. A swapped instruction
    sends it to the other disc; blank images (or text naming no colour) leave it still (zeros).
    A reference for learned policies: what the observation allows, and what the controls remove."""
    colour = named_colour(observation["task"])
    plan = np.zeros((horizon, 2), np.float32)
    if colour is None:
        return plan
    image = observation["images"][camera].astype(np.int32)
    rows, cols = np.nonzero(np.abs(image - COLOURS[colour]).sum(-1) < 60)
    if not len(rows):
        return plan
    s = image.shape[0]
    goal = np.array([cols.mean() + 0.5, rows.mean() + 0.5]) / s
    position = observation["state"].astype(np.float64)
    for i in range(horizon):
        plan[i] = clip_step(goal - position)
        position = position + plan[i]
    return plan


def _layout(rng: np.random.Generator, goal: str, other: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Disc centres and the start, redrawn until they keep the distances the module doc names."""
    while True:
        start, g, o = rng.uniform(MARGIN, 1 - MARGIN, (3, 2))
        far_apart = min(np.hypot(*(g - o)), np.hypot(*(g - start)), np.hypot(*(o - start))) >= MIN_SEPARATION
        if far_apart and _segment_distance(g, start, o) >= PATH_CLEARANCE:
            return {c: (g if c == goal else o) for c in COLOURS}, start


def _ring_layout(rng: np.random.Generator, goal: str, other: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Two different slots of the ring for the discs, the start near the centre."""
    slots = rng.choice(RING_SLOTS, size=2, replace=False)
    angles = 2 * np.pi * slots / RING_SLOTS
    g, o = (0.5 + RING_RADIUS * np.array([np.cos(a), np.sin(a)]) for a in angles)
    start = 0.5 + rng.uniform(-RING_JITTER, RING_JITTER, 2)
    return {c: (g if c == goal else o) for c in COLOURS}, start


def _segment_distance(p: np.ndarray, a: np.ndarray, b: np.ndarray) -> float:
    """Distance from point p to the segment a-b."""
    ab = b - a
    t = np.clip(np.dot(p - a, ab) / max(np.dot(ab, ab), 1e-12), 0.0, 1.0)
    return float(np.hypot(*(p - (a + t * ab))))
