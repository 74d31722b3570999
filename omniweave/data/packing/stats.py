"""stats.json and lengths.png of a packed dataset, from the scan arrays and the packing plan."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

from omniweave.data.media.mel import SAMPLE_RATE
from omniweave.data.packing.bins import PackPlan, cost_spread


def build_stats(scan: dict, plan: PackPlan, rejects: Counter, pack_drops: Counter, algorithm: str) -> dict:
    """scan: per-sample arrays over accepted samples (length, images, videos, vision, audios,
    audio_tokens, audio_samples, audio_bytes, truncated, loss); plan indexes into those arrays."""
    lengths = scan["length"]
    packed = plan.items
    fills = plan.fills(lengths)
    real = int(fills.sum())
    capacity_tokens = plan.num_packs * plan.capacity
    img, vid, aud = scan["images"][packed], scan["videos"][packed], scan["audios"][packed]
    dropped = dict(rejects)
    for reason, n in pack_drops.items():
        dropped[reason] = dropped.get(reason, 0) + n
    return {
        "samples": int(scan["total"]),
        "samples_packed": int(len(packed)),
        "packs": plan.num_packs,
        "capacity": plan.capacity,
        "algorithm": algorithm,
        "real_tokens": real,
        "capacity_tokens": int(capacity_tokens),
        "efficiency": real / capacity_tokens if capacity_tokens else 0.0,
        "loss_tokens": int(scan["loss"][packed].sum()),
        "vision_tokens": int(scan["vision"][packed].sum()),
        "audio_tokens": int(scan["audio_tokens"][packed].sum()),
        "modalities": {
            "text_only_samples": int(((img == 0) & (vid == 0) & (aud == 0)).sum()),
            "image_samples": int((img > 0).sum()),
            "video_samples": int((vid > 0).sum()),
            "audio_samples": int((aud > 0).sum()),
            "images": int(img.sum()),
            "videos": int(vid.sum()),
            "audios": int(aud.sum()),
            "audio_seconds": round(float(scan["audio_samples"][packed].sum()) / SAMPLE_RATE, 3),
            "audio_bytes": int(scan["audio_bytes"][packed].sum()),
        },
        "truncated": int(scan["truncated"][packed].sum()),
        "dropped": dict(sorted(dropped.items())),
        "dropped_total": int(sum(dropped.values())),
        "sample_length": _percentiles(lengths[packed]),
        "pack_fill": _percentiles(fills),
        "docs_per_pack": _percentiles(np.diff(plan.offsets)),
        "attention_cost_spread": cost_spread(plan.costs(lengths)),
    }


def _percentiles(x: np.ndarray) -> dict:
    if len(x) == 0:
        return {}
    p = np.percentile(x, [0, 10, 50, 90, 100])
    return {"min": float(p[0]), "p10": float(p[1]), "p50": float(p[2]), "p90": float(p[3]), "max": float(p[4]),
            "mean": float(np.mean(x))}


def plot_lengths(path: Path, lengths: np.ndarray, fills: np.ndarray, capacity: int, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.hist(lengths, bins=60, color="#4477aa")
    a.set(title="sample length (tokens)", xlabel="tokens", ylabel="samples")
    b.hist(fills / capacity * 100, bins=np.linspace(0, 100, 51), color="#cc6677")
    b.set(title=f"pack fill (capacity {capacity})", xlabel="% of capacity", ylabel="packs")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def text_histogram(values: np.ndarray, lo: float, hi: float, bins: int = 10, width: int = 40, unit: str = "") -> list[str]:
    """Rows like ' 90-100%  ████████  1234' for a terminal."""
    counts, edges = np.histogram(values, bins=np.linspace(lo, hi, bins + 1))
    top = max(1, counts.max()) if len(counts) else 1
    return [f"{edges[k]:6.0f}-{edges[k + 1]:<4.0f}{unit} {'█' * int(round(width * c / top)):<{width}} {c}"
            for k, c in enumerate(counts)]
