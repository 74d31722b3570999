"""Benchmark: ``train.offload: optimizer`` (FSDP2's CPU offload) against no offload, same run otherwise.

Each arm builds the trainer's Engine on ``--ranks`` processes (FSDP over dp = ranks; at 1 rank
the offloaded arm is FSDP-wrapped too, as the trainer does) for a small Qwen2.5-VL-shaped model
and takes ``--steps`` optimizer steps on packed text rows. Per rank it reports:

- **state bytes by placement**: the rank's sharded fp32 master weights, their gradients and the
  AdamW state, counted from the tensors, grouped by the device they live on. Offloaded, they sit
  in host memory; otherwise on the compute device. This is the device memory the offload frees
  (16 bytes per parameter per rank in fp32: weight, gradient, two AdamW moments), less nothing:
  the unsharded weights FSDP gathers for compute are transient in both arms.
- **peak device memory**: ``max_memory_allocated`` on an accelerator; on a CPU-only machine the
  compute device *is* host memory, so this column is the peak RSS and the two arms cannot differ
  by the offloaded bytes (they only move within the same memory).
- **step time** (median of the steps after the first): the cost of the host-side optimizer step
  and the copies.

    python bench/offload.py [--ranks 1 2] [--steps 6] [--length 2048] [--out bench/out] [--quick]

``--quick`` (bench/quick.py): 1 rank, 3 steps, 256-token rows; not meaningful figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: omniweave
from omniweave.parallel.spawn import run_ranks  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/
from context_parallel import MODEL  # noqa: E402
from figure import pyplot, save, write_results  # noqa: E402
from pipeline import text_row  # noqa: E402
from quick import HELP as QUICK_HELP, note  # noqa: E402

ARMS = ("none", "optimizer")


def _placement_bytes(engine) -> dict[str, int]:
    """Bytes of this rank's master weights + gradients + optimizer state, by device type."""
    out: dict[str, int] = {}

    def add(t):
        if torch.is_tensor(t):
            t = t.to_local() if hasattr(t, "to_local") else t
            out[t.device.type] = out.get(t.device.type, 0) + t.numel() * t.element_size()

    for p in engine.model.parameters():
        add(p)
        add(p.grad)
    for state in engine.optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.dim() > 0:  # the step counters are scalars
                add(v)
    return out


def _arm_rank(rank: int, world: int, offload: str, steps: int, length: int, work: str) -> dict:
    from omniweave.config import load_recipe
    from omniweave.device import detect, peak_memory_bytes
    from omniweave.train.engine import Engine
    from omniweave.train.objective import TokenCrossEntropy

    cfg = load_recipe("demo", [*MODEL, f"train.offload={offload}", f"train.steps={steps}", "train.global_batch=2",
                               f"data.max_len={length}", f"output_dir={work}/{offload}_{world}"])
    engine = Engine(cfg)
    rows = [text_row(length, int(cfg.model.foundation.vocab_size), seed=rank * 100 + i) for i in range(2)]
    normaliser = engine.global_sum([sum(r["num_loss_tokens"] for r in rows)])[0]
    times, placement = [], {}
    step = engine.optimizer.step

    def step_and_count(*a, **k):  # after the update (AdamW's state exists), before zero_grad frees the grads
        out = step(*a, **k)
        if not placement:
            placement.update(_placement_bytes(engine))
        return out

    engine.optimizer.step = step_and_count
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.optimizer_step(rows, TokenCrossEntropy(), normaliser)
        times.append(time.perf_counter() - t0)
    info = detect()
    return {"rank": rank, "ranks": world, "offload": offload, "placement": placement,
            "peak_b": peak_memory_bytes(info), "step_s": statistics.median(times[1:] or times),
            "device": engine.device.type}


def run_arm(offload: str, world: int, steps: int, length: int, work: str) -> list[dict]:
    return run_ranks(_arm_rank, world, offload, steps, length, work, timeout=1800, quiet=True)


def table(rows: list[dict]) -> str:
    lines = ["| ranks | train.offload | rank | state on compute device MB | state in host memory MB | "
             "peak device memory MB | step s (median) | x no offload |", "|" + "---|" * 8]
    base = {(r["ranks"], r["rank"]): r["step_s"] for r in rows if r["offload"] == "none"}
    for r in rows:
        dev, host = r["device"], "cpu"
        on_device = 0 if dev == host and r["offload"] != "none" else r["placement"].get(dev, 0)
        in_host = sum(r["placement"].values()) - on_device
        lines.append(f"| {r['ranks']} | {r['offload']} | {r['rank']} | {on_device / 2**20:.1f} | {in_host / 2**20:.1f} | "
                     f"{r['peak_b'] / 2**20:.0f} | {r['step_s']:.3f} | {r['step_s'] / base[(r['ranks'], r['rank'])]:.2f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    labels = [f"{r['ranks']} rank(s) r{r['rank']}\n{r['offload']}" for r in rows]
    xs = range(len(rows))
    total = [sum(r["placement"].values()) / 2**20 for r in rows]
    on_dev = [0 if r["offload"] != "none" else t for r, t in zip(rows, total)]
    ax.bar(xs, on_dev, label="weights + grads + AdamW on the compute device")
    ax.bar(xs, [t - d for t, d in zip(total, on_dev)], bottom=on_dev, label="... in host memory")
    ax.set_xticks(list(xs), labels, fontsize=7)
    ax.set(ylabel="MB per rank", title="where the training state lives")
    ax.legend(fontsize=7)
    bx.bar(xs, [r["step_s"] for r in rows])
    bx.set_xticks(list(xs), labels, fontsize=7)
    bx.set(ylabel="step s (median)", title="step time")
    save(fig, path, grid=(ax, bx))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="world sizes (FSDP over dp = ranks)")
    p.add_argument("--steps", type=int, default=6, help="optimizer steps per arm (the first is not timed)")
    p.add_argument("--length", type=int, default=2048, help="tokens per packed row (2 rows per rank per step)")
    p.add_argument("--out", type=Path, default=Path("bench/out"), help="every result file goes here (and only here)")
    p.add_argument("--quick", action="store_true", help=QUICK_HELP + ": 1 rank, 3 steps, 256-token rows")
    args = p.parse_args()
    if args.quick:
        args.ranks, args.steps, args.length = [1], 3, 256
        note("1 rank, 3 steps, 256-token rows")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        rows = [r for world in args.ranks for arm in ARMS for r in run_arm(arm, world, args.steps, args.length, work)]
    text = table(rows)
    print(text)
    print(f"total {time.perf_counter() - t0:.0f} s", flush=True)
    write_results(args.out, "offload", text, rows, lambda path: plot(rows, path), f"{rows[0]['device']}, fp32")


if __name__ == "__main__":
    main()
