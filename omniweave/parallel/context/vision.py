"""Split the vision encoder's work over the ranks of a context-parallel group.

Under CP every rank of the group holds the same media (``pixel_values [P, C·t·p·p]``,
``grid_thw [M, 3]``, see ``sharding.shard_batch``) but only a shard of the tokens. Encoding all of
it on every rank would repeat the work ``cp`` times; instead each rank encodes a share and the
features are all-gathered.

The split is exact because nothing in the Qwen2-VL vision path crosses a frame: attention is per
frame (Qwen2.5-VL's windows lie inside a frame), rotary positions depend on (h, w) only, and the
merger works per merge unit. Encoding frames [t0, t1) of an item of grid (t, h, w) alone, as an
item of grid (t1-t0, h, w), gives exactly rows [t0·h·w/m², t1·h·w/m²) of that item's features.

Plan (pure, identical on every rank):
    units     one temporal index of an item (an image, t = 1, is one unit), p = h·w patches
    cost      p² + 6·D·p   (attention is quadratic in the patches of a frame; the linear layers
              cost ~6·D·p relative to it, D = ViT hidden size)
    assign    longest-processing-time first: units by cost descending (ties: item, frame), each
              to the least loaded rank (ties: lowest rank)
    regroup   units of equal cost are interchangeable: per cost, rank 0 takes the first k_0 of
              them in (item, frame) order, rank 1 the next k_1, … (k_r = what LPT gave rank r),
              so each video lands on ranks in contiguous runs; loads are unchanged
    slices    consecutive frames of one item on one rank merge into one (item, t0, t1)

Forward on rank r (``VisionSplit``, usable as ``OmniModel.media_split``):
    local_pixels [Σ (t1-t0)·h·w, C·t·p·p], local_grid [S_r, 3]  = rank r's slices
    local = encode(local_pixels, local_grid)                       [n_r, D_out]
            (no slices: encode the dummy input, local = [0, D_out] + 0·Σ dummy, so every rank
             runs the encoder once and FSDP collectives stay matched)
    gathered = all_gather_rows(local)                               [Σ n_r, D_out] rank order
    features = gathered rows put back in span order                 [N, D_out]
Backward of ``all_gather_rows``: a reduce-scatter (sum) of the gathered gradient; the gradient
every rank computed for rank r's features flows back into rank r's encoder.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from omniweave.parallel.context.allgather import gather_stacked

Slice = tuple[int, int, int]  # (item, t0, t1): frames [t0, t1) of media item `item`


def _grids(grid_thw) -> list[list[int]]:
    grids = torch.as_tensor(grid_thw).reshape(-1, 3).tolist() if len(grid_thw) else []
    for i, (t, h, w) in enumerate(grids):
        if min(t, h, w) < 1:
            raise ValueError(f"grid_thw item {i} is {(t, h, w)}: every entry must be >= 1")
    return grids


def unit_cost(patches: int, hidden_size: int) -> int:
    """Relative cost of encoding one frame of ``patches`` patches: p² + 6·D·p."""
    return patches * patches + 6 * hidden_size * patches


def plan_vision_split(grid_thw, cp: int, hidden_size: int = 1280) -> list[list[Slice]]:
    """Per rank, the (item, t0, t1) slices it encodes; every frame of every item exactly once."""
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"context-parallel size must be an integer >= 1, got {cp!r}")
    if hidden_size < 1:
        raise ValueError(f"hidden_size must be >= 1, got {hidden_size}")
    grids = _grids(grid_thw)
    units = [(item, frame, h * w) for item, (t, h, w) in enumerate(grids) for frame in range(t)]
    loads = [0] * cp
    taken: dict[int, list[int]] = {}  # patches per frame -> units of that cost each rank takes
    for item, frame, p in sorted(units, key=lambda u: (-u[2], u[0], u[1])):
        rank = min(range(cp), key=lambda r: (loads[r], r))
        loads[rank] += unit_cost(p, hidden_size)
        taken.setdefault(p, [0] * cp)[rank] += 1
    frames: list[list[tuple[int, int]]] = [[] for _ in range(cp)]
    for p, counts in taken.items():
        same_cost = [(item, frame) for item, frame, q in units if q == p]  # (item, frame) order
        start = 0
        for rank, k in enumerate(counts):
            frames[rank] += same_cost[start:start + k]
            start += k
    return [_merge_runs(sorted(own)) for own in frames]


def _merge_runs(frames: list[tuple[int, int]]) -> list[Slice]:
    """Sorted (item, frame) pairs -> (item, t0, t1) slices of consecutive frames."""
    slices: list[Slice] = []
    for item, frame in frames:
        if slices and slices[-1][0] == item and slices[-1][2] == frame:
            slices[-1] = (item, slices[-1][1], frame + 1)
        else:
            slices.append((item, frame, frame + 1))
    return slices


def split_costs(grid_thw, plan: list[list[Slice]], hidden_size: int = 1280) -> list[int]:
    """Per rank, the summed unit cost of its slices (max / mean is the split's imbalance)."""
    grids = _grids(grid_thw)
    return [sum((t1 - t0) * unit_cost(grids[i][1] * grids[i][2], hidden_size) for i, t0, t1 in own)
            for own in plan]  # fmt: skip


def gather_counts(n: int, group, device) -> list[int]:
    """Every rank's ``n``, in rank order."""
    return [int(c) for c in gather_stacked(torch.tensor([n], dtype=torch.int64, device=device), group).flatten()]


def all_gather_rows(x: torch.Tensor, group, counts: list[int] | None = None) -> torch.Tensor:
    """x [n_r, …] on every rank -> [Σ n_r, …] in rank order (n_r may differ; ``counts`` = all
    n_r if already known): padded to the largest n_r for the (differentiable) all-gather of
    ``allgather.gather_stacked``, whose backward reduce-scatters — the gradient of rank r's rows,
    summed over all ranks, flows back to rank r. Every rank must run the backward (a collective)."""
    if counts is None:
        counts = gather_counts(x.shape[0], group, x.device)
    padded = torch.cat([x, x.new_zeros((max(counts) - x.shape[0], *x.shape[1:]))])
    stacked = gather_stacked(padded, group)  # [ranks, max n_r, …]
    return torch.cat([stacked[r, :n] for r, n in enumerate(counts)])


class VisionSplit:
    """``media_split`` hook of ``OmniModel``: each rank of ``group`` encodes its share of the
    frames (``plan_vision_split``), features are all-gathered and returned in span order.

    ``dummy_input(device) -> (pixel_values, grid_thw)`` is the encoder's smallest input, encoded
    by ranks with no share; ``hidden_size`` is the ViT width used in the cost model."""

    def __init__(self, group, dummy_input: Callable, hidden_size: int):
        self.group, self.dummy_input, self.hidden_size = group, dummy_input, hidden_size

    def __call__(self, encode: Callable, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        grids = _grids(grid_thw)
        patches = [t * h * w for t, h, w in grids]
        if not grids:
            raise ValueError("VisionSplit needs at least one media item (grid_thw is empty)")
        if pixel_values.shape[0] != sum(patches):
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} patches but grid_thw {grids} "
                             f"needs {sum(patches)}")
        plan = plan_vision_split(grids, dist.get_world_size(self.group), self.hidden_size)
        mine = plan[dist.get_rank(self.group)]
        item_start = [sum(patches[:i]) for i in range(len(grids))]
        if mine:
            frame = [h * w for _, h, w in grids]
            rows = [pixel_values[item_start[i] + t0 * frame[i]:item_start[i] + t1 * frame[i]] for i, t0, t1 in mine]
            local_grid = torch.tensor([[t1 - t0, *grids[i][1:]] for i, t0, t1 in mine], dtype=grid_thw.dtype)
            local = encode(torch.cat(rows), local_grid.to(grid_thw.device))
        else:
            dummy = encode(*self.dummy_input(pixel_values.device))
            local = dummy.new_zeros(0, dummy.shape[-1]) + 0.0 * dummy.sum()
        counts = gather_counts(local.shape[0], self.group, local.device)
        source = self._span_order(grids, plan, counts)
        return all_gather_rows(local, self.group, counts).index_select(0, source.to(local.device))

    @staticmethod
    def _span_order(grids: list[list[int]], plan: list[list[Slice]], counts: list[int]) -> torch.Tensor:
        """int64 [N]: for each feature in span order, its row in the rank-order gathered rows.
        Features per frame = h·w·N/P (the projector's fixed patches-per-feature ratio)."""
        total_patches, total = sum(t * h * w for t, h, w in grids), sum(counts)
        per_frame = [h * w * total // total_patches for _, h, w in grids]
        first = torch.tensor([0, *(t * f for (t, _, _), f in zip(grids, per_frame))]).cumsum(0).tolist()
        expected = [sum((t1 - t0) * per_frame[i] for i, t0, t1 in own) for own in plan]
        if any(h * w * total % total_patches for _, h, w in grids) or expected != counts:
            raise ValueError(f"encoder features per rank {counts} are not proportional to the patches "
                             f"of each rank's frames (grid_thw {grids}, slices {plan})")  # fmt: skip
        source, row = torch.empty(total, dtype=torch.int64), 0
        for own in plan:
            for i, t0, t1 in own:
                n = (t1 - t0) * per_frame[i]
                start = first[i] + t0 * per_frame[i]
                source[start:start + n] = torch.arange(row, row + n)
                row += n
        return source
