"""Gap-closing refinement of a bin-packing plan (``packing.bfd`` runs it by default).

Short samples leave every best-fit-decreasing pack a gap no remaining sample fits; summed over
many packs, those gaps cost whole packs. :func:`close_gaps` dissolves least-full packs into the
other packs' gaps (moves, then 1-for-1 swaps that concentrate gaps), never adding a pack.
"""

from __future__ import annotations

import numpy as np

from omniweave.data.packing.bins import PackPlan, _from_assignment


def _best_swap(first_b: dict[int, int], first_a: dict[int, int], limit: int) -> tuple[int, int, int]:
    """Best swap between packs B and A given each pack's {length: position of its first item of that
    length} (insertion-ordered by length): positions (i in B, j in A) maximising d = len_i - len_j with
    0 < d <= limit, ties to the shortest length of A; (-1, -1, 0) if none."""
    if limit <= len(first_b) * len(first_a) // 4:  # few differences to try: largest first
        for d in range(limit, 0, -1):
            for x, j in first_a.items():
                i = first_b.get(x + d)
                if i is not None:
                    return i, j, d
        return -1, -1, 0
    best = (-1, -1, 0)
    for x, j in first_a.items():  # few pairs: all of them
        for y, i in first_b.items():
            if best[2] < y - x <= limit:
                best = (i, j, y - x)
    return best


def close_gaps(plan: PackPlan, lengths, max_victims: int = 16, max_ops: int = 4000,
               max_donors: int = 512, max_collectors: int = 8) -> PackPlan:
    """Gap-closing refinement: fewer packs, towards the lower bound ``ceil(sum(lengths) / capacity)``.

    While the plan has more packs than that bound, the least-full pack (the *victim*) is dissolved:
    each of its items moves, largest first, into the fullest other pack whose gap still takes it.
    When no gap is large enough, the gaps of other packs are concentrated into one *collector*
    (the pack with the widest gap whose items allow a swap; ``max_collectors`` are tried): a swap of item b of the collector with a shorter item a of a
    donor pack A, b - a <= gap(A), fills A by b - a and widens the collector's gap by as much. Every
    step keeps every pack within capacity and every sample in exactly one pack; the victim is
    dropped from the plan once empty. The work is bounded (``max_victims`` victims, ``max_ops``
    moves and swaps in all, ``max_donors`` donors per collecting pass), so the refinement may stop
    early; it never increases the pack count. Packs keep their order (the victim's slot vanishes)
    and list their samples in ascending order. Pure and deterministic."""
    lengths = np.asarray(lengths, np.int64)
    C, K = plan.capacity, plan.num_packs
    if K < 2:
        return plan
    fills = plan.fills(lengths)
    if K <= -(-int(fills.sum()) // C):
        return plan
    gaps = C - fills  # int64 [K], updated in place
    alive = np.ones(K, bool)
    members: dict[int, list[int]] = {}  # packs touched so far -> their sample indices

    def get(k: int) -> list[int]:
        if k not in members:
            members[k] = plan.items[plan.offsets[k]:plan.offsets[k + 1]].tolist()
        return members[k]

    firsts: dict[int, dict[int, int]] = {}  # cache: pack -> {length: first position}, by length

    def first(k: int) -> dict[int, int]:
        if k not in firsts:
            f: dict[int, int] = {}
            for pos, length in enumerate(lengths[get(k)].tolist()):
                f.setdefault(length, pos)
            firsts[k] = dict(sorted(f.items()))
        return firsts[k]

    ops = 0

    def dissolve(v: int) -> bool:
        nonlocal ops
        others = alive.copy()
        others[v] = False
        vic = get(v)
        while vic:
            if ops >= max_ops:
                return False
            g = np.where(others, gaps, -1)
            vl = lengths[vic]
            biggest_gap = int(g.max())
            if biggest_gap < 0:
                return False
            fitting = vl <= biggest_gap
            if fitting.any():  # direct move: largest victim item that fits, into the fullest pack it fits
                t = int(np.argmax(np.where(fitting, vl, 0)))
                y = int(vl[t])
                cand = np.flatnonzero(g >= y)
                a = int(cand[np.argmin(g[cand])])
                get(a).append(vic.pop(t))
                firsts.pop(a, None)
                firsts.pop(v, None)
                gaps[a] -= y
                gaps[v] += y
                ops += 1
                continue
            y = int(vl.min())  # collect a gap of y into a collector B
            progress = False
            cand = np.flatnonzero(others & (gaps > 0))
            cand = cand[np.lexsort((cand, -gaps[cand]))]  # widest gap first, ties: lower pack id
            for c, b in enumerate(cand[:max_collectors].tolist()):
                # donors: narrower-or-equal gaps only (sum of gap**2 grows with every swap: no cycles)
                for a in cand[c + 1:c + 1 + max_donors].tolist():
                    i, j, d = _best_swap(first(b), first(a), int(gaps[a]))
                    if d == 0:
                        continue
                    mb, ma = get(b), get(a)
                    mb[i], ma[j] = ma[j], mb[i]
                    firsts.pop(a, None)
                    firsts.pop(b, None)
                    gaps[a] -= d
                    gaps[b] += d
                    ops += 1
                    progress = True
                    if gaps[b] >= y or ops >= max_ops:
                        break
                if progress:
                    break
            if not progress:
                return False
        return True

    for _ in range(max_victims):
        if alive.sum() <= -(-int(fills.sum()) // C):
            break
        g = np.where(alive, gaps, -1)
        v = int(K - 1 - np.argmax(g[::-1]))  # the least-full pack; the last one on ties
        if not dissolve(v):
            break
        alive[v] = False
    if not members:
        return plan
    bin_of = np.full(len(lengths), -1, np.int64)
    bin_of[plan.items] = np.repeat(np.arange(K), np.diff(plan.offsets))
    for k, its in members.items():
        bin_of[its] = k
    new_id = np.cumsum(alive) - 1
    kept = bin_of >= 0
    bin_of[kept] = new_id[bin_of[kept]]
    return _from_assignment(bin_of, int(alive.sum()), plan.dropped, C)
