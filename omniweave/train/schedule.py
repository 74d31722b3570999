"""Learning-rate schedules: linear warmup, then cosine / linear decay to ``min_lr_ratio``, or constant.

Pure functions of the step, so a resumed run recomputes the same rate from the step alone.
"""

from __future__ import annotations

import math

SCHEDULES = ("cosine", "linear", "constant")


def lr_factor(step: int, total_steps: int, warmup: int = 0, schedule: str = "cosine", min_lr_ratio: float = 0.0) -> float:
    """Multiplier of the peak lr for optimizer step ``step`` (0-based) of ``total_steps``."""
    if schedule not in SCHEDULES:
        raise ValueError(f"train.schedule={schedule!r}; choose one of {SCHEDULES}")
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    span = max(1, total_steps - warmup)
    progress = min(1.0, max(0.0, (step - warmup) / span))
    if schedule == "cosine":
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        decay = 1.0 - progress
    return min_lr_ratio + (1.0 - min_lr_ratio) * decay


def build_scheduler(optimizer, train_cfg):
    """LambdaLR of the recipe's ``train:`` section (read through TrainSchema: its defaults)."""
    import torch

    from omniweave.config import section

    tc = section({"train": train_cfg}, "train")
    total, warmup, schedule, floor = int(tc.steps), int(tc.warmup), str(tc.schedule), float(tc.min_lr_ratio)
    lr_factor(0, total, warmup, schedule, floor)  # validate now, not at the first step
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: lr_factor(s, total, warmup, schedule, floor))
