"""Benchmark: memory per rank of sequence parallelism over one long clip's video tokens (the
``WanDiT`` split by parallel/context/sequence.py), sp 1 / 2 / 4, ring and Ulysses, CPU fp32, gloo.

One clip of --frames x --height x --width patches (default 8 x 16 x 24 = 3072 tokens: a 29-frame
256 x 384 video at Wan's 4 x 8 x 8 VAE and 1 x 2 x 2 patches) through a random-init ``WanDiT``
(--layers blocks, 8 heads x 32, ffn 1024), one forward + backward of the rectified-flow MSE per
measurement. Each layout runs in fresh processes (``parallel/spawn.run_ranks``, one thread each);
per rank:

    saved MB      the bytes autograd keeps for the backward (``saved_tensors_hooks``, each storage
                  once): the activation memory, exact and noise-free; the quantity sp divides
    peak MB       the rise of the process's peak resident memory over the forward + backward
                  (``ru_maxrss`` after minus before): saved activations plus the transients of
                  the attention kernel and the messages; noisier (the allocator, the OS)
    step s        the median forward + backward time of --repeats more (on a 2-core machine
                  several ranks share the cores: a memory benchmark, not a speed one)

sp 1 is the baseline of the same run; the table gives each layout's ratio to it. Attention on the
CPU: SDPA per clip for sp 1 and Ulysses, the ``math`` block kernel for the ring's blocks (the
backend ``auto`` resolves so; on GPUs both are FlashAttention).

    python bench/diffusion_sp.py [--quick] [--frames 8] [--height 16] [--width 24] [--layers 4]
        [--repeats 2] [--out bench/out]

Prints a markdown table and writes diffusion_sp.png / .json / .md under --out.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: omniweave, bench
from bench.figure import pyplot, save, write_results  # noqa: E402
from bench.quick import HELP as QUICK_HELP, note  # noqa: E402

LAYOUTS = (("sp 1", 1, "ring"), ("ring 2", 2, "ring"), ("ulysses 2", 2, "ulysses"), ("ring 4", 4, "ring"),
           ("ulysses 4", 4, "ulysses"))
CHANNELS, TEXT_DIM, TEXT_TOKENS = 16, 64, 32


def _model(layers: int):
    from omniweave.models.components.wan_dit import WanDiT, WanDiTConfig

    torch.manual_seed(0)
    cfg = WanDiTConfig(in_channels=CHANNELS, out_channels=CHANNELS, num_attention_heads=8, attention_head_dim=32,
                       text_dim=TEXT_DIM, freq_dim=64, ffn_dim=1024, num_layers=layers)
    return WanDiT(cfg)


def _inputs(grid: tuple[int, int, int]):
    g = torch.Generator().manual_seed(1)
    tokens = grid[0] * grid[1] * grid[2]
    return (torch.randn(tokens, CHANNELS * 4, generator=g), torch.tensor([grid]), torch.tensor([500.0]),
            torch.randn(TEXT_TOKENS, TEXT_DIM, generator=g), torch.tensor([0, TEXT_TOKENS], dtype=torch.int32),
            torch.randn(tokens, CHANNELS * 4, generator=g))


def _step(model, inputs) -> int:
    """One forward + backward; returns the bytes saved for the backward (each storage once)."""
    tokens, grid, t, text, text_cu, target = inputs
    storages: dict[int, int] = {}
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}  # saved weights (and views): no activations

    def pack(x):
        s = x.untyped_storage()
        if s.data_ptr() not in weights:
            storages[s.data_ptr()] = s.nbytes()
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        v = model(tokens, grid, t, text, text_cu)
        loss = ((v - target[model.local_slice(tokens.shape[0])]) ** 2).sum()
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def _rank(rank, world, mode, layers, grid, repeats):
    import torch.distributed as dist

    from omniweave.parallel.context.sequence import apply_sequence_split

    model = _model(layers)
    if world > 1:
        apply_sequence_split(model, dist.group.WORLD, mode, "auto")
    inputs = _inputs(grid)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    saved = _step(model, inputs)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before  # KiB on Linux
    times = []
    for _ in range(repeats):
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        _step(model, inputs)
        times.append(time.perf_counter() - t0)
    return {"saved_mb": saved / 2**20, "peak_mb": peak / 1024, "step_s": median(times) if times else 0.0}


def table(result: dict) -> str:
    lines = ["| layout | rows / rank | saved MB / rank (max) | vs sp 1 | peak MB / rank (max) | vs sp 1 | step s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, r in result["layouts"].items():
        lines.append(f"| {name} | {r['rows']} | {r['saved_mb']:.1f} | {r['saved_vs_sp1']:.2f}x | {r['peak_mb']:.1f} | "
                     f"{r['peak_vs_sp1']:.2f}x | {r['step_s']:.2f} |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    names = list(result["layouts"])
    xs = range(len(names))
    rows = result["layouts"]
    ax.bar([x - 0.2 for x in xs], [rows[n]["saved_mb"] for n in names], 0.4, label="saved for backward")
    ax.bar([x + 0.2 for x in xs], [rows[n]["peak_mb"] for n in names], 0.4, label="peak RSS rise")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("MB per rank (max over ranks)")
    ax.set_title(f"WanDiT {result['settings']['layers']} layers, one clip of {result['tokens']} tokens", fontsize=9)
    ax.legend(fontsize=8)
    save(fig, path, grid=(ax,))


def main(argv: list[str] | None = None) -> int:
    from omniweave.parallel.spawn import run_ranks

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=QUICK_HELP)
    p.add_argument("--frames", type=int, default=8, help="latent frames of the clip (patches)")
    p.add_argument("--height", type=int, default=16, help="patches down")
    p.add_argument("--width", type=int, default=24, help="patches across")
    p.add_argument("--layers", type=int, default=4, help="WanDiT blocks")
    p.add_argument("--repeats", type=int, default=2, help="timed forward + backward per layout after the measured one")
    p.add_argument("--out", type=Path, default=Path("bench/out"), help="result files go here")
    args = p.parse_args(argv)
    if args.quick:
        note("a 2 x 4 x 6 clip, 1 layer, no timed repeat")
        args.frames, args.height, args.width, args.layers, args.repeats = 2, 4, 6, 1, 0
    grid = (args.frames, args.height, args.width)
    tokens = grid[0] * grid[1] * grid[2]
    result = {"layouts": {}, "tokens": tokens, "settings": {k: v for k, v in vars(args).items() if k != "out"}}
    for name, world, mode in LAYOUTS:
        ranks = run_ranks(_rank, world, mode, args.layers, grid, args.repeats)
        result["layouts"][name] = {"rows": -(-tokens // world), **{k: max(r[k] for r in ranks) for k in ranks[0]},
                                   "per_rank": ranks}
        print(f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in result["layouts"][name].items()
                                      if isinstance(v, float)), flush=True)
    base = result["layouts"]["sp 1"]
    for r in result["layouts"].values():
        r["saved_vs_sp1"] = r["saved_mb"] / base["saved_mb"]
        r["peak_vs_sp1"] = r["peak_mb"] / base["peak_mb"] if base["peak_mb"] > 0 else float("nan")
    text = table(result)
    print(text)
    write_results(args.out, "diffusion_sp", text, result, lambda path: plot(result, path),
                  f"one clip of {grid[0]} x {grid[1]} x {grid[2]} = {tokens} tokens, {args.layers} layers, fp32, gloo, "
                  "one thread per rank")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
