"""Accelerator abstraction: which device type to use and which distributed backend goes with it.

``OMNIWEAVE_DEVICE`` (cpu | cuda | xpu | npu) overrides the automatic choice. Nothing here holds
global state: callers ask, get a value, and pass it on.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "xpu": "xccl", "npu": "hccl"}


@dataclass(frozen=True)
class DeviceInfo:
    type: str  # "cpu" | "cuda" | "xpu" | "npu"
    backend: str  # torch.distributed backend for this device type

    def device(self, local_rank: int = 0) -> torch.device:
        if self.type == "cpu":
            return torch.device("cpu")
        return torch.device(self.type, local_rank)

    @property
    def module(self):
        """The ``torch.<type>`` module (``torch.cuda`` …), or None on CPU."""
        return None if self.type == "cpu" else getattr(torch, self.type)


def _available(kind: str) -> bool:
    if kind == "cpu":
        return True
    mod = getattr(torch, kind, None)
    return bool(mod is not None and hasattr(mod, "is_available") and mod.is_available())


def detect(override: str | None = None) -> DeviceInfo:
    """Pick the accelerator: ``override`` > ``$OMNIWEAVE_DEVICE`` > cuda > xpu > npu > cpu."""
    choice = override or os.environ.get("OMNIWEAVE_DEVICE")
    if choice:
        choice = choice.lower()
        if choice not in _BACKENDS:
            raise ValueError(f"OMNIWEAVE_DEVICE={choice!r}: expected one of {sorted(_BACKENDS)}")
        if not _available(choice):
            raise RuntimeError(f"device {choice!r} was requested but torch reports it unavailable")
        return DeviceInfo(choice, _BACKENDS[choice])
    for kind in ("cuda", "xpu", "npu"):
        if _available(kind):
            return DeviceInfo(kind, _BACKENDS[kind])
    return DeviceInfo("cpu", "gloo")


def peak_memory_bytes(info: DeviceInfo) -> int:
    """Peak allocated memory on the current accelerator; on CPU the process's max RSS."""
    if info.module is not None and hasattr(info.module, "max_memory_allocated"):
        return int(info.module.max_memory_allocated())
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
