"""The fixed analytic checker of the diffusion demo: which colour is the shape, which way does it move.

It reads a clip (uint8 [T, H, W, 3]) without any model, so the demo's prompt accuracy measures the
generator alone. Steps:

1. Background = the per-channel median of the whole clip (the shape covers a few % of it), so a
   global colour shift or a greyish background moves it along.
2. Foreground mask = pixels whose RGB distance to the background exceeds ``threshold``. A frame
   *holds the shape* when its mask covers at least ``min_fraction`` and at most ``max_fraction`` of
   it (more is not a small shape: noise, a flash); both readings are None when fewer than half
   the frames hold it.
3. Colour: blur, a dark halo or a fading shape mix the colour with the background, which scales
   ``pixel - background`` but keeps its direction. So each mask pixel votes for the palette colour
   whose ``colour - background`` direction is closest (cosine), its vote weighted by its squared
   distance (the solid inside outvotes the noisy rim); the winner must hold ``min_agreement`` of
   the votes, else None (noise votes all over the palette).
4. Direction: the mask's centroid (weighted by distance) in each frame that holds the shape, the
   least-squares slope of x and of y over time; the larger axis decides if the fitted displacement
   over the clip is at least ``min_motion`` x min(H, W) px, at least ``min_ratio`` x the other
   axis', and the fit explains ``min_r2`` of the centroid's variance along that axis, else None.
   None as well when more than ``max_missing`` of the frames do not hold the shape.

``confidence`` is the smaller of the colour's vote share and the direction fit's R^2 (0 when either
reading is None). Defaults read every rendered demo clip and survive blur, noise and colour shifts
(tests/test_diffusion_demo_data.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from omniweave.diffusion.demo_data import COLOURS

THRESHOLD = 60.0
MIN_FRACTION, MAX_FRACTION = 0.01, 0.3
MIN_AGREEMENT = 0.5
MIN_MOTION, MIN_RATIO, MIN_R2 = 0.1, 1.5, 0.5
MAX_MISSING = 0.25


def read_clip(frames: np.ndarray, *, threshold: float = THRESHOLD, min_fraction: float = MIN_FRACTION,
              max_fraction: float = MAX_FRACTION, min_agreement: float = MIN_AGREEMENT,
              min_motion: float = MIN_MOTION, min_ratio: float = MIN_RATIO, min_r2: float = MIN_R2,
              max_missing: float = MAX_MISSING) -> dict:
    """{"colour", "direction", "confidence", "colour_confidence", "direction_confidence",
    "displacement" (dx, dy) px over the clip or None}; a reading it cannot make is None."""
    clip = np.asarray(frames)
    if clip.ndim != 4 or clip.shape[-1] != 3 or clip.shape[0] < 2:
        raise ValueError(f"expected frames [T >= 2, H, W, 3], got shape {clip.shape}")
    clip = clip.astype(np.float64)
    t, h, w = clip.shape[:3]
    background = np.median(clip.reshape(-1, 3), axis=0)
    diff = clip - background
    dist = np.linalg.norm(diff, axis=-1)
    mask = dist > threshold
    fraction = mask.reshape(t, -1).mean(axis=1)
    holds = (fraction >= min_fraction) & (fraction <= max_fraction)
    result = {"colour": None, "direction": None, "confidence": 0.0, "colour_confidence": 0.0,
              "direction_confidence": 0.0, "displacement": None}
    if not holds.any() or holds.mean() < 0.5:
        return result

    names = list(COLOURS)
    palette = np.array([COLOURS[n] for n in names], np.float64) - background
    palette /= np.maximum(np.linalg.norm(palette, axis=1, keepdims=True), 1e-9)
    pixels, weights = diff[holds][mask[holds]], dist[holds][mask[holds]] ** 2
    votes = np.argmax(pixels @ palette.T, axis=1)
    share = np.bincount(votes, weights=weights, minlength=len(names)) / weights.sum()
    best = int(np.argmax(share))
    result["colour_confidence"] = min(float(share[best]), 1.0)
    if share[best] >= min_agreement:
        result["colour"] = names[best]

    if holds.mean() >= 1.0 - max_missing:
        ys, xs = np.mgrid[0:h, 0:w] + 0.5
        weight = np.where(mask, dist, 0.0)[holds]
        total = weight.sum(axis=(1, 2))
        centre = np.stack([(weight * xs).sum(axis=(1, 2)) / total, (weight * ys).sum(axis=(1, 2)) / total], axis=1)
        time = np.nonzero(holds)[0].astype(np.float64)
        time_c = time - time.mean()
        slope = time_c @ (centre - centre.mean(axis=0)) / (time_c @ time_c)  # (dx, dy) px per frame
        moved = slope * (t - 1)
        axis = int(np.argmax(np.abs(moved)))
        residual = centre[:, axis] - centre[:, axis].mean() - slope[axis] * time_c
        spread = ((centre[:, axis] - centre[:, axis].mean()) ** 2).sum()
        r2 = float(1.0 - (residual ** 2).sum() / spread) if spread > 0 else 0.0
        result["displacement"] = (float(moved[0]), float(moved[1]))
        result["direction_confidence"] = max(r2, 0.0)
        if (abs(moved[axis]) >= min_motion * min(h, w) and abs(moved[axis]) >= min_ratio * abs(moved[1 - axis])
                and r2 >= min_r2):
            result["direction"] = (("left", "right"), ("up", "down"))[axis][int(moved[axis] > 0)]
    if result["colour"] is not None and result["direction"] is not None:
        result["confidence"] = min(result["colour_confidence"], result["direction_confidence"])
    return result


def score(clips: Sequence[np.ndarray], expected: Sequence[Mapping | Sequence[str]]) -> dict:
    """Accuracy of ``read_clip`` over ``clips`` against ``expected`` (rows with "colour" and
    "direction", e.g. ``heldout_prompts.jsonl``'s, or (colour, direction) pairs). A reading of None
    counts as wrong. Returns the accuracies, the counts and each clip's reading ("readings")."""
    if len(clips) != len(expected):
        raise ValueError(f"{len(clips)} clips but {len(expected)} expected readings")
    pairs = [(e["colour"], e["direction"]) if isinstance(e, Mapping) else tuple(e) for e in expected]
    readings = [read_clip(c) for c in clips]
    colour_ok = [r["colour"] == c for r, (c, _) in zip(readings, pairs)]
    direction_ok = [r["direction"] == d for r, (_, d) in zip(readings, pairs)]
    both = [a and b for a, b in zip(colour_ok, direction_ok)]
    n = len(clips)
    rate = (lambda k: k / n) if n else (lambda k: 0.0)
    return {"prompt_accuracy": rate(sum(both)), "colour_accuracy": rate(sum(colour_ok)),
            "direction_accuracy": rate(sum(direction_ok)), "n": n, "correct": sum(both),
            "colour_correct": sum(colour_ok), "direction_correct": sum(direction_ok),
            "colour_unread": sum(r["colour"] is None for r in readings),
            "direction_unread": sum(r["direction"] is None for r in readings), "readings": readings}
