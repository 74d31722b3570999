"""Benchmark: video-diffusion training throughput of packed rows vs padded batches vs same-size
buckets, ``WanDiT`` forward + backward + an AdamW step, CPU fp32.

Data: --clips seeded clips of mixed latent sizes, (f, h, w) in patches (patch 1 x 2 x 2 of 16
latent channels: 64 values a token): f from ``FRAMES`` (1 = an image), (h, w) from ``SIZES`` (2 x 2
up to 6 x 10: squares, landscapes, portraits), each with its own random text states (--text-min to
--text-max tokens of ``text_dim``), sigma, noise and latents. The model: a small random-init
``WanDiT`` (--layers blocks, 4 heads x 32, ffn 512, text_dim 64), fp32, attention backend
``auto`` (on CPU: SDPA per clip). The same clips go through three ways of batching, each step one
``WanDiT.forward`` over a row of clips, the rectified-flow MSE on the real tokens, backward, AdamW:

    packed    best-fit decreasing by tokens (``data/packing/bins.bfd``, what ``data pack`` plans)
              into rows of at most --max-tokens; varlen attention keeps the clips apart: no padding
    padded    batches of B = --max-tokens // mean clip tokens clips in dataset order, every clip
              padded with zero latents to the batch's longest clip and run as a clip of that
              length (its grid): the padding goes through every layer and its self-attention is
              full over the padded length (the official Wan code pads to ``seq_len`` and masks only
              the keys, so it computes every padded query; see docs/benchmarks.md); the loss masks
              the padding out
    bucketed  clips grouped by identical (f, h, w) (Open-Sora-style buckets), each bucket cut into
              batches of max(1, --max-tokens // clip tokens) clips: no padding, but a bucket's
              last batch is short and a rare size runs alone

Figures per mode: the median over --repeats epochs (all clips once; modes interleaved, their
order rotating; the first --warmup steps of each mode run once untimed before), useful tokens/s =
real latent tokens / epoch seconds (padding does not count), padding fraction = padded / computed
tokens, steps per epoch, the ratio of useful tokens/s to padded's, and a FLOP count per epoch
(``step_macs``: GEMMs per computed token and per text token, self- and cross-attention per clip;
for padded also with the padded keys skipped, the official Wan's masking, which is not timed).

    python bench/diffusion.py [--quick] [--clips 128] [--max-tokens 1024] [--layers 3] [--repeats 5]
        [--warmup 2] [--threads 1] [--seed 0] [--out bench/out]

Prints a markdown table and writes diffusion.png / .json / .md under --out.
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from collections import defaultdict
from pathlib import Path
from statistics import median

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: omniweave, bench
from bench.figure import pyplot, save, write_results  # noqa: E402
from bench.quick import HELP as QUICK_HELP, note  # noqa: E402

MODES = ("packed", "padded", "bucketed")
FRAMES = (1, 2, 3, 4, 5)  # latent frames (Wan: 1 + 4k video frames -> 1 + k latent frames)
SIZES = ((2, 2), (3, 4), (4, 3), (4, 4), (4, 6), (6, 4), (4, 7), (5, 8), (8, 5), (6, 10))  # (h, w) patches
CHANNELS, PATCH, TEXT_DIM = 16, (1, 2, 2), 64


def make_clips(n: int, seed: int, text_min: int, text_max: int) -> list[dict]:
    """``n`` clips of random (f, h, w) from FRAMES x SIZES; per clip its noisy tokens, velocity
    target, timestep and text states (all drawn here, outside the timing)."""
    from omniweave.diffusion.schedule import noisy_latents
    from omniweave.models.components.wan_dit import patchify

    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    clips = []
    for _ in range(n):
        f = int(rng.choice(FRAMES))
        h, w = SIZES[int(rng.integers(len(SIZES)))]
        x0 = patchify(torch.randn(CHANNELS, f * PATCH[0], h * PATCH[1], w * PATCH[2], generator=g), PATCH)
        sigma = float(rng.uniform(0.02, 1.0))
        noisy, target = noisy_latents(x0, torch.randn(x0.shape, generator=g), torch.tensor(sigma))
        clips.append({"grid": (f, h, w), "tokens": f * h * w, "noisy": noisy, "target": target,
                      "timestep": sigma * 1000,
                      "text": torch.randn(int(rng.integers(text_min, text_max + 1)), TEXT_DIM, generator=g)})
    return clips


# ----------------------------------------------------------------------------- the three plans


def plan(mode: str, clips: list[dict], max_tokens: int) -> list[list[int]]:
    """Each step's clip indices."""
    lengths = np.array([c["tokens"] for c in clips], dtype=np.int64)
    if mode == "packed":
        from omniweave.data.packing.bins import bfd

        p = bfd(lengths, max_tokens)
        if len(p.dropped):
            raise SystemExit(f"--max-tokens {max_tokens} is below the longest clip ({lengths.max()} tokens)")
        return [[int(i) for i in pack] for pack in p.packs()]
    if mode == "padded":
        b = max(1, int(max_tokens // lengths.mean()))
        return [list(range(i, min(i + b, len(clips)))) for i in range(0, len(clips), b)]
    buckets = defaultdict(list)
    for i, c in enumerate(clips):
        buckets[c["grid"]].append(i)
    steps = []
    for grid, ids in sorted(buckets.items()):
        b = max(1, max_tokens // (grid[0] * grid[1] * grid[2]))
        steps += [ids[i:i + b] for i in range(0, len(ids), b)]
    return steps


def build_step(mode: str, clips: list[dict], ids: list[int]) -> dict:
    """One row's tensors. padded: each clip's tokens followed by zero latents up to the longest
    clip's length, its grid that clip's (so RoPE, self-attention and every layer see the full
    padded clip), loss weight 0 on the padding."""
    chosen = [clips[i] for i in ids]
    longest = max(chosen, key=lambda c: c["tokens"])
    tokens, targets, weights, grids = [], [], [], []
    for c in chosen:
        n = c["tokens"]
        pad = longest["tokens"] - n if mode == "padded" else 0
        tokens.append(torch.cat([c["noisy"], c["noisy"].new_zeros(pad, c["noisy"].shape[1])]))
        targets.append(torch.cat([c["target"], c["target"].new_zeros(pad, c["target"].shape[1])]))
        weights.append(torch.cat([torch.ones(n), torch.zeros(pad)]))
        grids.append(longest["grid"] if mode == "padded" else c["grid"])
    texts = [c["text"] for c in chosen]
    real = sum(c["tokens"] for c in chosen)
    return {"tokens": torch.cat(tokens), "grid": torch.tensor(grids, dtype=torch.long),
            "timesteps": torch.tensor([c["timestep"] for c in chosen], dtype=torch.float32),
            "text": torch.cat(texts),
            "text_cu_seqlens": torch.tensor([0, *np.cumsum([t.shape[0] for t in texts])], dtype=torch.int32),
            "target": torch.cat(targets), "weight": torch.cat(weights)[:, None], "real": real,
            "real_lengths": [c["tokens"] for c in chosen],
            "values": real * chosen[0]["target"].shape[1]}


def step_macs(cfg, s: dict, key_mask: bool = False) -> float:
    """Multiply-adds of one forward over the row ``s`` (backward ~2x): the per-token GEMMs of every
    computed token (padding included), the text GEMMs, and per clip self-attention L_q x L_k and
    cross-attention L_q x S. ``key_mask``: padded keys skipped (the official Wan's ``k_lens``)."""
    d, ffn, layers = cfg.inner_dim, cfg.ffn_dim, cfg.num_layers
    io = CHANNELS * PATCH[0] * PATCH[1] * PATCH[2]
    computed, text = s["tokens"].shape[0], s["text"].shape[0]
    macs = computed * (2 * io * d + layers * (6 * d * d + 2 * d * ffn)) + text * (TEXT_DIM * d + d * d + layers * 2 * d * d)
    lq = (s["grid"].prod(dim=1)).tolist()
    lk = s["real_lengths"] if key_mask else lq
    texts = s["text_cu_seqlens"].diff().tolist()
    return macs + layers * sum(2 * q * k * d + 2 * q * t * d for q, k, t in zip(lq, lk, texts))


def train_step(model, opt, s: dict) -> None:
    opt.zero_grad(set_to_none=True)
    v = model(s["tokens"], s["grid"], s["timesteps"], s["text"], s["text_cu_seqlens"])
    loss = (((v - s["target"]) ** 2) * s["weight"]).sum() / s["values"]
    loss.backward()
    opt.step()


def epoch(model, opt, steps: list[dict]) -> float:
    t0 = time.perf_counter()
    for s in steps:
        train_step(model, opt, s)
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- report


def table(result: dict) -> str:
    lines = ["| mode | steps / epoch | clips / step | largest step (tokens) | padding | GFLOP / epoch | "
             "epoch s (median) | useful tokens/s | vs padded |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in MODES:
        r = result["modes"][name]
        lines.append(f"| {name} | {r['steps']} | {r['clips_per_step']:.1f} | {r['largest_step']} | "
                     f"{100 * r['padding']:.1f} % | {r['gflop']:.2f} | {r['seconds']:.2f} | {r['tokens_s']:.0f} | "
                     f"{r['vs_padded']:.2f}x |")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    modes = result["modes"]
    colors = {"packed": "tab:blue", "padded": "tab:gray", "bucketed": "tab:orange"}
    xs = range(len(MODES))
    ax.bar(xs, [modes[m]["tokens_s"] for m in MODES], 0.6, color=[colors[m] for m in MODES])
    top = max(modes[m]["tokens_s"] for m in MODES)
    for i, m in zip(xs, MODES):
        r = modes[m]
        ax.text(i, r["tokens_s"] + 0.02 * top, f"{r['vs_padded']:.2f}x\n{100 * r['padding']:.0f} % pad", ha="center",
                fontsize=8)
    ax.set_xticks(list(xs), [f"{m}\n{modes[m]['steps']} steps" for m in MODES])
    ax.set_ylim(0, top * 1.25)
    ax.set_ylabel("useful latent tokens/s (median)")
    s = result["settings"]
    ax.set_title(f"WanDiT {s['layers']} layers, {result['clips']} clips ({result['tokens']} tokens), "
                 f"rows <= {s['max_tokens']}", fontsize=9)
    save(fig, path, grid=(ax,))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=QUICK_HELP)
    p.add_argument("--clips", type=int, default=128, help="clips in the epoch")
    p.add_argument("--max-tokens", type=int, default=1024, help="packed row capacity; sets the batch sizes")
    p.add_argument("--layers", type=int, default=3, help="WanDiT blocks")
    p.add_argument("--text-min", type=int, default=8, help="fewest text tokens of a clip")
    p.add_argument("--text-max", type=int, default=48, help="most text tokens of a clip")
    p.add_argument("--repeats", type=int, default=5, help="timed epochs per mode")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per mode first")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("bench/out"), help="result files go here")
    args = p.parse_args(argv)
    if args.quick:
        note("24 clips, rows of 512 tokens, 1 layer, 1 repeat")
        args.clips, args.max_tokens, args.layers, args.repeats, args.warmup = 24, 512, 1, 1, 1
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from omniweave.models.components.wan_dit import WanDiT, WanDiTConfig

    clips = make_clips(args.clips, args.seed, args.text_min, args.text_max)
    total = sum(c["tokens"] for c in clips)
    cfg = WanDiTConfig(in_channels=CHANNELS, out_channels=CHANNELS, patch_size=PATCH, num_attention_heads=4,
                       attention_head_dim=32, text_dim=TEXT_DIM, freq_dim=64, ffn_dim=512, num_layers=args.layers)
    base = WanDiT(cfg)
    runs, models, opts, steps, result = {}, {}, {}, {}, {"modes": {}}
    for m in MODES:
        ids = plan(m, clips, args.max_tokens)
        assert sorted(i for s in ids for i in s) == list(range(len(clips))), m  # every clip exactly once
        steps[m] = [build_step(m, clips, s) for s in ids]
        models[m] = copy.deepcopy(base)
        opts[m] = torch.optim.AdamW(models[m].parameters(), lr=1e-4)
        computed = sum(s["tokens"].shape[0] for s in steps[m])
        result["modes"][m] = {"steps": len(ids), "clips_per_step": len(clips) / len(ids), "computed": computed,
                              "padding": 1 - total / computed, "largest_step": max(s["tokens"].shape[0] for s in steps[m]),
                              "gflop": 6 * sum(step_macs(cfg, s) for s in steps[m]) / 1e9}
        for s in steps[m][:args.warmup]:
            train_step(models[m], opts[m], s)
        runs[m] = []
    print(f"{len(clips)} clips, {total} latent tokens ({total / len(clips):.1f} a clip, {len(set(c['grid'] for c in clips))} "
          f"distinct sizes); WanDiT {sum(x.numel() for x in base.parameters()) / 1e6:.2f}M parameters, "
          f"{args.threads} thread(s)", flush=True)
    for r in range(args.repeats):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        for m in order:
            runs[m].append(epoch(models[m], opts[m], steps[m]))
        print(f"repeat {r + 1}: " + ", ".join(f"{m} {runs[m][-1]:.2f} s" for m in MODES), flush=True)
    for m in MODES:
        sec = median(runs[m])
        result["modes"][m].update(seconds=sec, runs=runs[m], tokens_s=total / sec)
    pad = result["modes"]["padded"]
    pad["gflop_key_mask"] = 6 * sum(step_macs(cfg, s, key_mask=True) for s in steps["padded"]) / 1e9
    for m in MODES:
        result["modes"][m]["vs_padded"] = result["modes"][m]["tokens_s"] / result["modes"]["padded"]["tokens_s"]
    result.update(settings={k: v for k, v in vars(args).items() if k != "out"}, clips=len(clips), tokens=total,
                  sizes=len(set(c["grid"] for c in clips)))
    text = table(result)
    print(text)
    print(f"padded with its padded keys masked (the official Wan's k_lens; padded queries still computed): "
          f"{pad['gflop_key_mask']:.2f} GFLOP an epoch, {100 * (1 - pad['gflop_key_mask'] / pad['gflop']):.1f} % "
          f"below the emulation's {pad['gflop']:.2f}")
    write_results(args.out, "diffusion", text, result, lambda path: plot(result, path),
                  f"{len(clips)} clips, {total} latent tokens, rows <= {args.max_tokens} tokens, {args.layers} layers, "
                  f"{args.repeats} repeats, {args.threads} thread(s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
