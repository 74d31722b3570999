"""Bin-packing of sample lengths into fixed-capacity packs. Pure functions over numpy arrays.

    plan = pack(lengths, capacity, algorithm="bfd")        # -> PackPlan
    for items in plan.packs(): ...                           # sample indices of one pack

Algorithms (all keep every sample whole; a sample longer than ``capacity`` is dropped with
reason ``longer_than_capacity`` — the tokenizer's truncation policy normally guarantees none is):

- ``bfd`` (default): best-fit decreasing. Open packs live in buckets by remaining capacity; a
  segment tree over the L+1 buckets finds the fullest pack that still fits in O(log L). Items of
  equal length are placed as a batch (numpy), which is *exactly* sequential BFD: the best-fit
  pack for an item of length l absorbs ``remaining // l`` items before another pack becomes the
  best fit. 1M lengths take well under a second. Then (``refine=True``, default) ``gap_closing.close_gaps``
  dissolves least-full packs while the count is above ceil(sum / capacity), by moves and 1-for-1
  swaps that close the gaps short samples leave (bounded work; never adds a pack).
- ``balanced``: the ``bfd`` packs (same number, same capacity), then pairwise re-partitioning of
  the most and least expensive packs so that attention cost (sum of len**2 per pack) evens out.
- ``sequential``: order-preserving next-fit.
- ``single``: one sample per pack, in order (RL prompts: each is a unit the loader hands out).

Optional caps per pack: ``max_media`` items and ``max_vision`` tokens (needs ``media`` /
``vision`` per sample). With caps, ``bfd`` places items one by one (still best fit via the tree,
scanning the fitting bucket for a pack whose caps allow the item).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

ALGORITHMS = ("bfd", "balanced", "sequential", "single")


@dataclass
class PackPlan:
    """CSR layout: pack k holds sample indices ``items[offsets[k]:offsets[k+1]]`` (ascending)."""

    items: np.ndarray  # int64 [n_packed]
    offsets: np.ndarray  # int64 [K+1]
    dropped: np.ndarray  # int64 [n_dropped] samples longer than capacity (or than a cap)
    capacity: int

    @property
    def num_packs(self) -> int:
        return len(self.offsets) - 1

    def packs(self) -> list[np.ndarray]:
        return [self.items[a:b] for a, b in zip(self.offsets[:-1], self.offsets[1:])]

    def fills(self, lengths: np.ndarray) -> np.ndarray:
        """Real tokens per pack, int64 [K]."""
        return np.add.reduceat(lengths[self.items], self.offsets[:-1]) if self.num_packs else np.zeros(0, np.int64)

    def costs(self, lengths: np.ndarray) -> np.ndarray:
        """Attention cost per pack: sum of len**2, float64 [K]."""
        sq = lengths[self.items].astype(np.float64) ** 2
        return np.add.reduceat(sq, self.offsets[:-1]) if self.num_packs else np.zeros(0)

    def efficiency(self, lengths: np.ndarray) -> float:
        return float(self.fills(lengths).sum() / max(1, self.num_packs * self.capacity))


def cost_spread(costs: np.ndarray) -> dict:
    """How unevenly the attention cost is spread over packs (max / mean, coefficient of variation)."""
    if len(costs) == 0:
        return {"max_over_mean": 0.0, "cv": 0.0}
    mean = float(costs.mean())
    return {"max_over_mean": float(costs.max() / mean), "cv": float(costs.std() / mean)}


def _from_assignment(bin_of: np.ndarray, n_bins: int, dropped: np.ndarray, capacity: int) -> PackPlan:
    """bin_of[i] = pack of sample i (-1 = dropped) -> PackPlan with ascending items per pack."""
    kept = np.flatnonzero(bin_of >= 0)
    order = kept[np.lexsort((kept, bin_of[kept]))]  # by pack, then sample index
    counts = np.bincount(bin_of[kept], minlength=n_bins)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return PackPlan(order.astype(np.int64), offsets, np.sort(dropped).astype(np.int64), int(capacity))


class _NonEmptyTree:
    """Segment tree over buckets 0..n-1 answering 'smallest non-empty bucket >= i' in O(log n).

    A flat Python list (faster than numpy scalar indexing for the per-query walk); leaves start at
    ``size``; a node holds the number of non-empty buckets under it."""

    def __init__(self, n: int):
        self.size = 1 << max(1, (n - 1).bit_length())
        self.tree = [0] * (2 * self.size)

    def set(self, i: int, nonempty: bool) -> None:
        node = self.size + i
        delta = int(nonempty) - self.tree[node]
        if delta:
            while node:
                self.tree[node] += delta
                node >>= 1

    def next_at_least(self, i: int) -> int:
        tree, node = self.tree, self.size + i
        if tree[node]:
            return i
        while node > 1:
            if not node & 1 and tree[node + 1]:  # a left child whose right sibling has something
                node += 1
                break
            node >>= 1
        else:
            return -1
        while node < self.size:
            node = 2 * node if tree[2 * node] else 2 * node + 1
        return node - self.size


def _check(lengths, capacity: int) -> np.ndarray:
    lengths = np.asarray(lengths, dtype=np.int64)
    if capacity < 1:
        raise ValueError(f"capacity must be positive, got {capacity}")
    if lengths.ndim != 1 or (lengths < 1).any():
        raise ValueError("lengths must be a 1-D array of positive integers")
    return lengths


def bfd(lengths, capacity: int, refine: bool = True) -> PackPlan:
    """Best-fit decreasing without caps: batched per distinct length, O(n log n + D·B·log L).

    With ``refine`` (default) the BFD plan then goes through :func:`close_gaps`, which dissolves
    least-full packs while the pack count is above ``ceil(sum(lengths) / capacity)``; ``refine=False``
    returns plain best-fit decreasing (what ``bfd_capped`` computes with caps)."""
    from omniweave.data.packing.gap_closing import close_gaps

    plan = _bfd(lengths, capacity)
    return close_gaps(plan, lengths) if refine else plan


def _bfd(lengths, capacity: int) -> PackPlan:
    lengths = _check(lengths, capacity)
    n = len(lengths)
    bin_of = np.full(n, -1, dtype=np.int64)
    too_long = np.flatnonzero(lengths > capacity)
    fit = np.flatnonzero(lengths <= capacity)
    order = fit[np.lexsort((fit, -lengths[fit]))]  # decreasing length, then index (deterministic)
    if len(order) == 0:
        return _from_assignment(bin_of, 0, too_long, capacity)
    sorted_len = lengths[order]
    starts = np.flatnonzero(np.r_[True, sorted_len[1:] != sorted_len[:-1]])
    ends = np.r_[starts[1:], len(order)]
    tree = _NonEmptyTree(capacity + 1)
    buckets: dict[int, list[np.ndarray]] = {}  # remaining capacity -> arrays of pack ids
    n_bins = 0

    def push(rem: int, ids: np.ndarray) -> None:
        buckets.setdefault(rem, []).append(ids)
        tree.set(rem, True)

    for s, e in zip(starts, ends):
        length = int(sorted_len[s])
        pending = order[s:e]  # items of this length still to place
        while len(pending):
            rem = tree.next_at_least(length)
            if rem < 0:  # open new packs: each takes capacity // length items
                per = capacity // length
                k = -(-len(pending) // per)
                ids = np.arange(n_bins, n_bins + k)
                n_bins += k
                bin_of[pending] = np.repeat(ids, per)[: len(pending)]
                full, last = divmod(len(pending), per)
                if full:
                    push(capacity - per * length, ids[:full])
                if last:
                    push(capacity - last * length, ids[full:])
                break
            ids = np.concatenate(buckets.pop(rem))
            tree.set(rem, False)
            per = rem // length  # the best-fit pack takes this many before another is best
            take = min(len(pending), per * len(ids))
            full, last = divmod(take, per)
            bin_of[pending[:take]] = np.repeat(ids[: full + (last > 0)], per)[:take]
            if full:
                push(rem - per * length, ids[:full])
            if last:
                push(rem - last * length, ids[full : full + 1])
            if full + (last > 0) < len(ids):
                push(rem, ids[full + (last > 0) :])
            pending = pending[take:]
    return _from_assignment(bin_of, n_bins, too_long, capacity)


class _OpenPacks:
    """Packs being filled item by item: remaining capacity buckets + the segment tree + cap counters."""

    def __init__(self, capacity: int, max_media=None, max_vision=None, scan_limit: int = 32):
        self.capacity, self.max_media, self.max_vision, self.scan_limit = capacity, max_media, max_vision, scan_limit
        self.tree = _NonEmptyTree(capacity + 1)
        self.buckets: dict[int, dict[int, None]] = {}  # remaining -> packs (ordered set)
        self.rem: list[int] = []
        self.media: list[int] = []
        self.vision: list[int] = []
        self.cost: list[float] = []

    def fits(self, k: int, length: int, m: int, v: int) -> bool:
        return (self.rem[k] >= length and (self.max_media is None or self.media[k] + m <= self.max_media)
                and (self.max_vision is None or self.vision[k] + v <= self.max_vision))

    def new(self) -> int:
        self.rem.append(self.capacity)
        self.media.append(0)
        self.vision.append(0)
        self.cost.append(0.0)
        return len(self.rem) - 1

    def take_best_fit(self, length: int, m: int, v: int) -> int:
        """Remove and return the fullest open pack that takes the item, or -1. Caps are checked on
        at most ``scan_limit`` packs, so a cap-blocked bucket cannot make this slow."""
        checked, rem = 0, self.tree.next_at_least(length)
        while rem >= 0 and checked < self.scan_limit:
            bucket = self.buckets[rem]
            for k in reversed(bucket):
                checked += 1
                if self.fits(k, length, m, v):
                    return self.take(k)
                if checked >= self.scan_limit:
                    break
            rem = self.tree.next_at_least(rem + 1) if rem < self.capacity else -1
        return -1

    def take(self, k: int) -> int:
        """Remove pack k from its bucket (before adding to it)."""
        bucket = self.buckets[self.rem[k]]
        del bucket[k]
        if not bucket:
            self.tree.set(self.rem[k], False)
        return k

    def add(self, k: int, length: int, m: int, v: int) -> None:
        """Put item into pack k (already taken out of its bucket, or new) and re-file the pack."""
        self.rem[k] -= length
        self.media[k] += m
        self.vision[k] += v
        self.cost[k] += float(length) ** 2
        self.buckets.setdefault(self.rem[k], {})[k] = None
        self.tree.set(self.rem[k], True)


def _counts(n, media, vision):
    media = np.zeros(n, np.int64) if media is None else np.asarray(media, np.int64)
    vision = np.zeros(n, np.int64) if vision is None else np.asarray(vision, np.int64)
    return media, vision


def _over_caps(lengths, capacity, media, vision, max_media, max_vision) -> np.ndarray:
    too_big = lengths > capacity
    if max_media is not None:
        too_big |= media > max_media
    if max_vision is not None:
        too_big |= vision > max_vision
    return too_big


def bfd_capped(lengths, capacity: int, media=None, vision=None, max_media=None, max_vision=None) -> PackPlan:
    """Best-fit decreasing with per-pack caps on media items and vision tokens (item by item).

    Plain BFD: no gap-closing refinement (``gap_closing.close_gaps`` does not check the caps)."""
    lengths = _check(lengths, capacity)
    n = len(lengths)
    media, vision = _counts(n, media, vision)
    too_big = _over_caps(lengths, capacity, media, vision, max_media, max_vision)
    bin_of = np.full(n, -1, dtype=np.int64)
    fit = np.flatnonzero(~too_big)
    order = fit[np.lexsort((fit, -lengths[fit]))]
    packs = _OpenPacks(capacity, max_media, max_vision)
    L, Mm, V = lengths.tolist(), media.tolist(), vision.tolist()
    for i in order.tolist():
        k = packs.take_best_fit(L[i], Mm[i], V[i])
        if k < 0:
            k = packs.new()
        packs.add(k, L[i], Mm[i], V[i])
        bin_of[i] = k
    return _from_assignment(bin_of, len(packs.rem), np.flatnonzero(too_big), capacity)


def sequential(lengths, capacity: int, media=None, vision=None, max_media=None, max_vision=None) -> PackPlan:
    """Order-preserving next-fit: a new pack starts whenever the next sample does not fit."""
    lengths = _check(lengths, capacity)
    n = len(lengths)
    media = np.zeros(n, np.int64) if media is None else np.asarray(media, np.int64)
    vision = np.zeros(n, np.int64) if vision is None else np.asarray(vision, np.int64)
    big_m = float("inf") if max_media is None else max_media
    big_v = float("inf") if max_vision is None else max_vision
    bin_of = np.full(n, -1, dtype=np.int64)
    dropped = []
    k, fill, fm, fv = -1, capacity + 1, 0, 0
    for i, (length, m, v) in enumerate(zip(lengths.tolist(), media.tolist(), vision.tolist())):
        if length > capacity or m > big_m or v > big_v:
            dropped.append(i)
            continue
        if fill + length > capacity or fm + m > big_m or fv + v > big_v:
            k, fill, fm, fv = k + 1, 0, 0, 0
        bin_of[i] = k
        fill, fm, fv = fill + length, fm + m, fv + v
    return _from_assignment(bin_of, k + 1, np.asarray(dropped, np.int64), capacity)


def balanced(lengths, capacity: int, media=None, vision=None, max_media=None, max_vision=None,
             big_fraction: float = 1 / 32, scan_limit: int = 32) -> PackPlan:
    """Cost-balanced packing into (about) as many packs as BFD needs.

    Samples longer than ``capacity * big_fraction`` (they carry nearly all attention cost) go, in
    decreasing order, to the cheapest pack that still has room (a min-heap on cost); the short rest
    fills the gaps best-fit decreasing. A pack is opened only when nothing fits."""
    lengths = _check(lengths, capacity)
    n = len(lengths)
    media, vision = _counts(n, media, vision)
    capped = max_media is not None or max_vision is not None
    caps = dict(media=media, vision=vision, max_media=max_media, max_vision=max_vision)
    base = bfd_capped(lengths, capacity, **caps) if capped else bfd(lengths, capacity)
    packs = _OpenPacks(capacity, max_media, max_vision, scan_limit)
    heap = []
    for _ in range(base.num_packs):
        k = packs.new()
        packs.add(k, 0, 0, 0)
        heap.append((0.0, k))
    bin_of = np.full(n, -1, dtype=np.int64)
    keep = np.setdiff1d(np.arange(n), base.dropped)
    order = keep[np.lexsort((keep, -lengths[keep]))]
    L, Mm, V = lengths.tolist(), media.tolist(), vision.tolist()
    big = capacity * big_fraction
    for i in order.tolist():
        length, m, v = L[i], Mm[i], V[i]
        k = -1
        if length > big:
            stash = []
            while heap and len(stash) < scan_limit:
                cost, j = heapq.heappop(heap)
                if cost != packs.cost[j]:
                    continue  # stale entry
                if packs.fits(j, length, m, v):
                    k = packs.take(j)
                    break
                stash.append((cost, j))
            for entry in stash:
                heapq.heappush(heap, entry)
        if k < 0:
            k = packs.take_best_fit(length, m, v)
        if k < 0:
            k = packs.new()
        packs.add(k, length, m, v)
        heapq.heappush(heap, (packs.cost[k], k))
        bin_of[i] = k
    return _from_assignment(bin_of, len(packs.rem), base.dropped, capacity)


def single(lengths, capacity: int, media=None, vision=None, max_media: int | None = None,
           max_vision: int | None = None) -> PackPlan:
    """One sample per pack, in order; a sample over the capacity or a cap is dropped."""
    lengths = np.asarray(lengths, dtype=np.int64)
    fits = lengths <= capacity
    if max_media is not None:
        fits &= np.asarray(media, dtype=np.int64) <= max_media
    if max_vision is not None:
        fits &= np.asarray(vision, dtype=np.int64) <= max_vision
    return _from_assignment(np.where(fits, np.cumsum(fits) - 1, -1), int(fits.sum()), np.flatnonzero(~fits), capacity)


def pack(lengths, capacity: int, algorithm: str = "bfd", media=None, vision=None,
         max_media: int | None = None, max_vision: int | None = None) -> PackPlan:
    """Dispatch to one algorithm; ``media`` / ``vision`` are per-sample counts used by the caps."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown packing algorithm {algorithm!r}; choose one of {ALGORITHMS}")
    caps = dict(media=media, vision=vision, max_media=max_media, max_vision=max_vision)
    if algorithm == "single":
        return single(lengths, capacity, **caps)
    if algorithm == "sequential":
        return sequential(lengths, capacity, **caps)
    if algorithm == "balanced":
        return balanced(lengths, capacity, **caps)
    if max_media is None and max_vision is None:
        return bfd(lengths, capacity)
    return bfd_capped(lengths, capacity, **caps)
