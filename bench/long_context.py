"""Benchmark: peak memory of one row's forward + backward vs row length, with chunked rows
(``parallel.seq_chunks``, omniweave/parallel/seq_chunks.py) and without, fp32.

Each point (row length L, chunked or not) runs in a fresh process: build a tiny text decoder, make
one packed row of L tokens (documents of 2K-4K tokens), run one forward + backward (no optimizer
step), and report the peak memory the step added:

- CPU: the growth of the process's peak RSS (``resource.getrusage(...).ru_maxrss``) over its RSS
  right before the step (after one warm-up step on a short row, so one-off allocations of kernels
  and thread pools do not count): activations, gradients, the K/V store and allocator slack (torch
  has no CPU allocator statistics). Every allocation over 64 KiB is its own mapping
  (``MALLOC_MMAP_THRESHOLD_``), so freed tensors leave the RSS.
- CUDA (``--device cuda``): ``torch.cuda.max_memory_allocated()`` minus the memory allocated before
  the step.

Chunked rows use a fixed chunk length (``--chunk-len``): ``seq_chunks = L / chunk_len``. The model
is chosen so that a chunk's activations dominate what stays linear in L (wide MLP, one KV head of
dim 8): the K/V store is 2 (k, v) x layers x kv_dim x L values in fp32 plus its fp32 gradient
accumulator, printed per point with its share of the chunked peak. The unchunked row runs only up to
``--max-unchunked`` tokens (its memory grows ~linearly; the default keeps it inside a 24 GiB box
shared with other jobs).

    python bench/long_context.py [--lengths 8192 16384 32768 65536 131072] [--chunk-len 8192]
                                 [--max-unchunked 32768] [--doc-lens 2048 4096] [--device cpu] [--threads 1]
                                 [--out bench/out] [--quick]

``--quick`` (bench/quick.py): rows of 1K-4K tokens, chunks of 1K; not meaningful figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: omniweave
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/
from figure import pyplot, save  # noqa: E402
from quick import HELP as QUICK_HELP, note  # noqa: E402

# the tiny decoder: activations ~ layers x (4 x intermediate + ~10 x hidden) x 4 bytes per token,
# K/V store + its gradient ~ 2 x layers x kv_dim x 8 bytes per token (kv_dim = heads_kv x head_dim = 8)
MODEL = dict(name="decoder", family="qwen2", vocab_size=1024, hidden_size=128, intermediate_size=1024,
             num_layers=2, num_heads=16, num_kv_heads=1, head_dim=8, attn_backend="sdpa")
DOC_LENS = (2048, 4096)  # documents drawn uniformly in this range
WARMUP = 512  # tokens of the row each point runs once before it measures
# glibc: every allocation over 64 KiB is its own mapping, returned to the OS when freed, so that
# the peak RSS follows the live tensors (a heap high-water mark would keep freed chunk buffers)
POINT_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}


def kv_bytes(length: int) -> int:
    """The K/V store (fp32) and its fp32 gradient accumulator of a row of ``length`` tokens."""
    kv_dim = MODEL["num_kv_heads"] * MODEL["head_dim"]
    return 2 * MODEL["num_layers"] * kv_dim * length * (4 + 4)


def make_row(length: int, seed: int = 0, doc_lens: tuple[int, int] | None = None) -> dict:
    """One packed text row: documents of doc_lens[0]..doc_lens[1] tokens (default DOC_LENS; the
    last one cut to fit), next-token labels inside each document."""
    doc_lens = DOC_LENS if doc_lens is None else doc_lens
    g = torch.Generator().manual_seed(seed)
    bounds = [0]
    while bounds[-1] < length:
        bounds.append(min(length, bounds[-1] + int(torch.randint(doc_lens[0], doc_lens[1] + 1, (1,), generator=g))))
    ids = torch.randint(10, MODEL["vocab_size"], (length,), generator=g)
    labels = torch.roll(ids, -1).clone()
    labels[torch.tensor(bounds[1:]) - 1] = -100
    pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])
    return {"input_ids": ids, "labels": labels, "position_ids": pos[None],
            "cu_seqlens": torch.tensor(bounds, dtype=torch.int32), "num_loss_tokens": int((labels != -100).sum())}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def run_point(length: int, chunks: int, device: str, threads: int, doc_lens: tuple[int, int] = DOC_LENS) -> dict:
    """One forward + backward of a row of ``length`` tokens in ``chunks`` chunks (0: unchunked)."""
    from omniweave.models.registry import build_model
    from omniweave.parallel.seq_chunks import chunked_forward_backward
    from omniweave.train.objective import TokenCrossEntropy

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = build_model({"foundation": MODEL}).to(device)
    row = {k: v.to(device) if torch.is_tensor(v) else v for k, v in make_row(length, doc_lens=doc_lens).items()}
    scale = 1.0 / row["num_loss_tokens"]

    def step(batch, n):
        if n:
            return chunked_forward_backward(model, batch, TokenCrossEntropy(), {}, n, scale)[0]
        loss = model(batch).loss_sum
        (loss * scale).backward()
        return loss

    warm = {k: v.to(device) if torch.is_tensor(v) else v for k, v in make_row(WARMUP).items()}
    step(warm, 2 if chunks else 0)  # one-off allocations (kernels, thread pools, autograd) not counted
    model.zero_grad(set_to_none=True)
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _rss_bytes()
    t0 = time.perf_counter()
    loss = step(row, chunks)
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {"length": length, "chunks": chunks, "peak_bytes": peak, "seconds": time.perf_counter() - t0,
            "loss": float(loss) / row["num_loss_tokens"], "kv_bytes": kv_bytes(length) if chunks else 0}


def point(length: int, chunks: int, args) -> dict:
    """``run_point`` in a fresh process (its peak memory is this point's alone)."""
    cmd = [sys.executable, __file__, "--point", str(length), str(chunks), "--device", args.device,
           "--threads", str(args.threads), "--doc-lens", *map(str, args.doc_lens)]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **POINT_ENV})
    if r.returncode != 0:
        raise RuntimeError(f"point L={length} chunks={chunks} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    mib = 2**20
    plain = {r["length"]: r for r in rows if not r["chunks"]}
    chunked = [r for r in rows if r["chunks"]]
    lines = ["| row tokens | chunks | peak, chunked (MiB) | K/V store + grad (MiB, share) | peak, unchunked (MiB) | "
             "unchunked / chunked | loss chunked / unchunked | s chunked | s unchunked |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in chunked:
        p = plain.get(r["length"])
        lines.append(
            f"| {r['length']} | {r['chunks']} | {r['peak_bytes'] / mib:.0f} | {r['kv_bytes'] / mib:.1f} "
            f"({r['kv_bytes'] / r['peak_bytes']:.1%}) | "
            + (f"{p['peak_bytes'] / mib:.0f} | {p['peak_bytes'] / r['peak_bytes']:.2f}x | "
               f"{r['loss']:.6f} / {p['loss']:.6f} | {r['seconds']:.1f} | {p['seconds']:.1f} |"
               if p else f"skipped (> --max-unchunked) | — | {r['loss']:.6f} / — | {r['seconds']:.1f} | — |"))
    peaks = [r["peak_bytes"] for r in chunked]
    lines.append(f"\nchunked peak, max / min over lengths: {max(peaks) / min(peaks):.3f}")
    return "\n".join(lines)


def plot(rows: list[dict], chunk_len: int, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for chunked, label in ((True, f"seq_chunks (chunks of {chunk_len} tokens)"), (False, "unchunked")):
        pts = [r for r in rows if bool(r["chunks"]) == chunked]
        ax.plot([r["length"] for r in pts], [r["peak_bytes"] / 2**20 for r in pts], "o-", label=label)
    kv = [r for r in rows if r["chunks"]]
    ax.plot([r["length"] for r in kv], [r["kv_bytes"] / 2**20 for r in kv], "k:", label="K/V store + its gradient")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("row length (tokens)")
    ax.set_ylabel("peak memory of forward + backward (MiB)")
    ax.set_title("One row's forward + backward: peak memory vs length")
    ax.legend()
    save(fig, path, grid=[ax])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536, 131072])
    p.add_argument("--chunk-len", type=int, default=8192, help="tokens per chunk (seq_chunks = length / chunk-len)")
    p.add_argument("--max-unchunked", type=int, default=32768, help="longest row run unchunked")
    p.add_argument("--doc-lens", type=int, nargs=2, default=list(DOC_LENS),
                   help="documents of the rows: lengths drawn uniformly in [MIN, MAX]")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (CPU)")
    p.add_argument("--out", type=Path, default=Path("bench/out"), help="every result file goes here (and only here)")
    p.add_argument("--quick", action="store_true", help=QUICK_HELP + ": rows of 1K-4K tokens, chunks of 1K")
    p.add_argument("--point", type=int, nargs=2, help=argparse.SUPPRESS)  # internal: one point, JSON on stdout
    args = p.parse_args()
    if args.point:
        print(json.dumps(run_point(*args.point, args.device, args.threads, tuple(args.doc_lens))))
        return
    if args.quick:
        note("rows of 1K-4K tokens, chunks of 1K, documents of 2K-4K tokens")
        args.lengths, args.chunk_len, args.max_unchunked = [1024, 4096], 1024, 4096
    t0 = time.perf_counter()
    rows = []
    for length in args.lengths:
        rows.append(point(length, max(1, -(-length // args.chunk_len)), args))
        if length <= args.max_unchunked:
            rows.append(point(length, 0, args))
        print(f"  L={length}: done ({time.perf_counter() - t0:.0f} s)", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "long_context.json").write_text(json.dumps({"model": MODEL, "chunk_len": args.chunk_len,
                                                            "doc_lens": args.doc_lens,
                                                            "device": args.device, "rows": rows}, indent=1))
    plot(rows, args.chunk_len, args.out / "long_context.png")
    print(f"model {MODEL}; K/V store + gradient = 2 x {MODEL['num_layers']} layers x kv_dim "
          f"{MODEL['num_kv_heads'] * MODEL['head_dim']} x L x 8 bytes; peak = "
          f"{'max_memory_allocated growth' if args.device.startswith('cuda') else 'peak RSS growth'} over the step")
    print(table(rows))
    print(f"wrote {args.out / 'long_context.png'}, {args.out / 'long_context.json'}; total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
