"""Data-parallel compute balancing: which rank runs which pack of a global batch.

Packs hold (nearly) the same number of tokens, but not the same work: decoder attention is
quadratic in each document's length, and the vision encoder's cost follows its patches. With
data parallelism every rank waits for the slowest at each step, so before a step the G packs of
the global batch are split into dp groups of exactly G / dp packs (every rank runs the same number
of micro-batches, so FSDP's collectives stay matched) with near-equal predicted cost.

    features = np.stack([pack_features(dataset.record(i)) for i in ids])   # [G, F] metadata only
    costs = cost_model.cost(features)                                       # [G]  (cost_model.py)
    groups = assign(costs, dp)          # dp lists of G / dp positions into ids, each sorted
    share = [ids[j] for j in groups[rank]]

``assign``: longest processing time first under the cardinality constraint (packs by decreasing
cost, ties by position, each to the least loaded rank that has a free slot, ties by rank), then
swap refinement: while some pack i of the most loaded rank M and pack j of another rank r with
c_i > c_j can trade places so that max(L_M - d, L_r + d) < L_M (d = c_i - c_j), make the swap
that minimises that pair maximum (first in (rank, slot) order on ties; slots hold a rank's packs
by decreasing cost), up to ``max_swaps``. Every rank's load only depends on the sorted cost
values, so permuting the input permutes the positions but not the loads. LPT can lose to the
contiguous split on small, unlucky batches; the contiguous split refined by the same swaps is then
taken instead, so the result is never worse than ``round_robin``.

Cost: O(G log dp) for LPT, O(dp · (G/dp)²) numpy work per swap.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from omniweave.parallel.cost_model import FEATURES, NUM_FEATURES, CostModel, Refitter, nnls

__all__ = ["FEATURES", "NUM_FEATURES", "CostModel", "Refitter", "assign", "imbalance", "nnls", "pack_features",
           "round_robin"]


def pack_features(record: dict) -> np.ndarray:
    """A packed-dataset record (``PackedDataset.record``: ``docs`` with ``length``, ``media`` with
    ``grid_thw`` [t, h, w] in patches, or ``kind: audio`` with a run of audio tokens per encoder
    item in ``pieces`` / ``length``) -> float64 [F]: (Σ len², Σ len, docs, Σ t·(h·w)², Σ t·h·w,
    Σ n_a², Σ n_a), n_a = 2 · an audio item's tokens (its frames after the stride-2 conv stem).
    An item reusing another's features (``same_as``: a preference pair's 2nd side) costs no encoding."""
    lengths = np.array([d["length"] for d in record["docs"]], dtype=np.float64)
    media = [m for m in record.get("media", []) if "same_as" not in m]
    grid = np.array([m["grid_thw"] for m in media if m.get("kind") != "audio"], dtype=np.float64).reshape(-1, 3)
    frame = grid[:, 1] * grid[:, 2]  # patches per frame [M]
    audio = 2 * np.array([n for m in media if m.get("kind") == "audio"
                          for _, n in (m.get("pieces") or [[m["start"], m["length"]]])], dtype=np.float64)
    return np.array([lengths @ lengths, lengths.sum(), len(lengths), grid[:, 0] @ frame**2, grid[:, 0] @ frame,
                     audio @ audio, audio.sum()])


def round_robin(num_packs: int, dp: int) -> list[list[int]]:
    """The split without balancing: rank r takes positions [r·m, (r+1)·m), m = num_packs / dp."""
    m = _per_rank(num_packs, dp)
    return [list(range(r * m, (r + 1) * m)) for r in range(dp)]


def imbalance(costs: Sequence[float], groups: list[list[int]]) -> float:
    """max / mean of the groups' summed costs (1.0 = perfect balance; 1.0 when all costs are 0)."""
    costs = np.asarray(costs, dtype=np.float64)
    loads = np.array([costs[g].sum() for g in groups])
    mean = loads.mean()
    return float(loads.max() / mean) if mean > 0 else 1.0


def assign(costs: Sequence[float], dp: int, max_swaps: int | None = None) -> list[list[int]]:
    """Positions 0..G-1 into ``dp`` groups of exactly G / dp with near-equal cost sums; each
    group sorted, group r for rank r. Deterministic; never worse than ``round_robin``."""
    costs = np.asarray(costs, dtype=np.float64)
    m = _per_rank(len(costs), dp)
    if costs.ndim != 1 or not np.all(np.isfinite(costs)) or np.any(costs < 0):
        raise ValueError(f"costs must be a 1-D sequence of finite values >= 0, got {costs[:8]}...")
    cap = 4 * len(costs) if max_swaps is None else max_swaps
    slots = _refine(costs, _lpt(costs, dp, m), cap)
    loads = costs[slots].sum(axis=1)
    contiguous = np.arange(len(costs)).reshape(dp, m)
    if costs[contiguous].sum(axis=1).max() < loads.max():
        slots = _refine(costs, _by_cost(costs, contiguous), cap)
    return [sorted(row) for row in slots.tolist()]


def _per_rank(num_packs: int, dp: int) -> int:
    if dp < 1 or num_packs < 1 or num_packs % dp:
        raise ValueError(f"{num_packs} packs cannot be split into {dp} equal groups (need a positive multiple of dp)")
    return num_packs // dp


def _by_cost(costs: np.ndarray, slots: np.ndarray) -> np.ndarray:
    """Each rank's positions ordered by (decreasing cost, position)."""
    order = np.lexsort((slots, -costs[slots]), axis=1)
    return np.take_along_axis(slots, order, axis=1)


def _lpt(costs: np.ndarray, dp: int, m: int) -> np.ndarray:
    """Longest processing time first with at most m packs per rank -> slots int64 [dp, m]."""
    heap = [(0.0, r) for r in range(dp)]  # (load, rank) of ranks with a free slot
    slots = np.empty((dp, m), dtype=np.int64)
    filled = [0] * dp
    for j in np.lexsort((np.arange(len(costs)), -costs)).tolist():
        load, r = heapq.heappop(heap)
        slots[r, filled[r]] = j
        filled[r] += 1
        if filled[r] < m:
            heapq.heappush(heap, (load + costs[j], r))
    return _by_cost(costs, slots)


def _refine(costs: np.ndarray, slots: np.ndarray, max_swaps: int) -> np.ndarray:
    """Swap refinement (module docstring). slots [dp, m] -> slots [dp, m], rows ordered by cost."""
    dp, m = slots.shape
    slots = slots.copy()
    loads = costs[slots].sum(axis=1)
    for _ in range(max_swaps):
        top = int(np.argmax(loads))
        c = costs[slots]  # [dp, m]
        d = c[top][None, :, None] - c[:, None, :]  # d[r, i, j] = c[top, i] - c[r, j]   [dp, m, m]
        pair_max = np.maximum(loads[top] - d, loads[:, None, None] + d)
        pair_max[top] = np.inf
        pair_max[d <= 0] = np.inf
        best = int(np.argmin(pair_max))
        if not pair_max.flat[best] < loads[top] * (1 - 1e-12):
            break
        r, i, j = np.unravel_index(best, pair_max.shape)
        slots[top, i], slots[r, j] = slots[r, j], slots[top, i]
        delta = d[r, i, j]
        loads[top] -= delta
        loads[r] += delta
        slots[[top, r]] = _by_cost(costs, slots[[top, r]])
    return slots
