"""Benchmark: context parallelism on one long packed row (a long video + text), CP = 1, 2, 4.

For each CP size, row length and vision split on/off, a fresh group of ``cp`` gloo (CPU) or NCCL
(GPU) processes builds the same model (FSDP over the CP ranks, as the trainer does), shards the
row and runs forward + backward. Per rank it records:

- activation memory: bytes of the tensors autograd saves for backward (distinct storages, via
  ``torch.autograd.graph.saved_tensors_hooks``), split into the vision encoder + projector part and
  the rest (decoder, loss). Exact and noise-free; on CPU this is what grows with the sequence;
- peak memory: CUDA ``max_memory_allocated`` on a GPU; on CPU the process's peak RSS growth over
  its size before the first step (noisy: the allocator keeps freed pages);
- step time: forward + backward, median over ``--repeats`` (slowest rank per step).

Then, for a fixed per-rank activation budget (CP = 1's activation memory at ``--budget-length``),
the longest row that fits is read off a straight-line fit of activation bytes vs length for each
CP size; the issue's target is CP = 4 fitting >= 3.5x CP = 1's length.

The row: one document holding a video of ``t`` temporal patches of 16x16 patches (64 tokens each
after the 2x2 merge) between a text prompt and a text answer (the answer carries the loss), and
a second, text-only document; ~90% of the tokens are video. Positions are 1-D (identical on the
three M-RoPE axes): they do not change memory or time.

    python bench/context_parallel.py [--lengths 2048 4096 8192] [--cp 1 2 4] [--mode ring]
                                     [--repeats 3] [--budget-length 4096] [--out bench/out] [--quick]

``--quick`` (bench/quick.py): 128 and 256 tokens, CP = 1 and 2 (with the vision split only), 1 repeat,
budget at 128 tokens; not meaningful figures.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: omniweave
from omniweave.parallel.spawn import run_ranks  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/
from figure import pyplot, save, write_results  # noqa: E402
from quick import HELP as QUICK_HELP, note  # noqa: E402

GRID_HW = 16  # patches per frame side: 256 patches, 64 merged tokens per temporal patch
MODEL = [  # a small Qwen2.5-VL-shaped model (hidden 256, 4 layers, head_dim 64, GQA 2:1)
    "model.foundation.hidden_size=256", "model.foundation.intermediate_size=768", "model.foundation.num_layers=4",
    "model.foundation.num_heads=4", "model.foundation.num_kv_heads=2", "model.foundation.mrope_section=[8,12,12]",
    "model.foundation.vocab_size=4096", "model.image_encoder.hidden_size=128", "model.image_encoder.num_heads=4",
    "model.image_encoder.intermediate_size=256", "model.image_encoder.depth=4", "model.image_encoder.window_size=112",
    "model.projector.in_dim=128", "model.projector.out_dim=256",
]  # fmt: skip


def make_row(length: int, seed: int = 0) -> dict:
    """One packed row of ~``length`` tokens: [prompt | video | answer] + a text document."""
    g = torch.Generator().manual_seed(seed)
    per_t = (GRID_HW // 2) ** 2
    t = max(1, int(0.9 * length) // per_t)
    video = t * per_t
    prompt, answer = 32, 64
    doc0 = prompt + video + answer
    doc1 = max(16, length - doc0)
    L = doc0 + doc1
    ids = torch.randint(10, 4000, (L,), generator=g)
    labels = torch.full((L,), -100)
    labels[prompt + video : doc0 - 1] = ids[prompt + video + 1 : doc0]
    labels[doc0 : L - 1] = ids[doc0 + 1 : L]
    pos = torch.cat([torch.arange(doc0), torch.arange(doc1)])
    in_dim = 3 * 2 * 14 * 14
    return {
        "input_ids": ids, "labels": labels, "position_ids": pos[None].expand(3, L).clone(),
        "cu_seqlens": torch.tensor([0, doc0, L], dtype=torch.int32),
        "pixel_values": torch.randn(t * GRID_HW * GRID_HW, in_dim, generator=g),
        "grid_thw": torch.tensor([[t, GRID_HW, GRID_HW]]), "media_spans": torch.tensor([[prompt, video]]),
        "num_loss_tokens": int((labels != -100).sum()),
    }  # fmt: skip


class SavedBytes:
    """Bytes of distinct storages autograd saves, split into vision (encoder + projector) and rest."""

    def __init__(self, model):
        self.seen: set[int] = set()
        self.vision = self.rest = 0
        self._in_vision = 0
        for part in (model.image_encoder, model.projector):
            part.register_forward_pre_hook(lambda *_: self._enter())
            part.register_forward_hook(lambda *_: self._leave())

    def _enter(self):
        self._in_vision += 1

    def _leave(self):
        self._in_vision -= 1

    def pack(self, t: torch.Tensor):
        st = t.untyped_storage()
        key = st.data_ptr()
        if key not in self.seen:
            self.seen.add(key)
            if self._in_vision:
                self.vision += st.nbytes()
            else:
                self.rest += st.nbytes()
        return t

    def hooks(self):
        self.seen.clear()
        self.vision = self.rest = 0
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _rank(rank: int, world: int, length: int, mode: str, vision_split: bool, repeats: int, device: str) -> dict:
    from omniweave.config import load_recipe, to_dict
    from omniweave.models.registry import build_model
    from omniweave.parallel.context import apply_cp, apply_vision_split, shard_micro_batch
    from omniweave.parallel.dims import ParallelDims
    from omniweave.parallel.fsdp import apply_fsdp

    dev = torch.device(device if device == "cpu" else f"cuda:{rank}")
    torch.manual_seed(0)
    model = build_model(to_dict(load_recipe("demo", MODEL).model))
    model.init_weights()
    model.to(dev)
    dims = ParallelDims(dp=1, cp=world, tp=1, world_size=world, cp_attention=mode,
                        cp_ulysses=2 if mode == "hybrid" else 1, vision_split=vision_split)
    meshes = dims.build_meshes(dev.type)
    apply_vision_split(model, meshes.vision_split)
    apply_cp(model, dims, meshes)
    if world > 1:
        apply_fsdp(model, meshes.fsdp)
    saved = SavedBytes(model)
    row = make_row(length)
    mb = {k: v.to(dev) if torch.is_tensor(v) else v for k, v in shard_micro_batch(row, world, meshes.cp_rank).items()}
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for i in range(repeats + 1):  # the first step warms up
        dist.barrier()
        t0 = time.perf_counter()
        with saved.hooks():
            out = model(mb)
        out.loss_sum.backward()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        dt = torch.tensor(time.perf_counter() - t0)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if i:
            times.append(float(dt))
        model.zero_grad(set_to_none=True)
    peak = (torch.cuda.max_memory_allocated() if dev.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0)
    return {"rank": rank, "tokens": int(mb["input_ids"].numel()), "vision_bytes": saved.vision,
            "rest_bytes": saved.rest, "peak_bytes": int(peak), "step_s": statistics.median(times)}


def measure(cp: int, length: int, mode: str, vision_split: bool, repeats: int, device: str) -> dict:
    per_rank = run_ranks(_rank, cp, length, mode if cp > 1 else "ring", vision_split, repeats, device, timeout=1800,
                         device=device)  # gloo on CPU, NCCL with rank r on cuda:r
    worst = max(per_rank, key=lambda r: r["vision_bytes"] + r["rest_bytes"])
    return {"cp": cp, "length": length, "mode": mode, "vision_split": vision_split,
            "act_mb": (worst["vision_bytes"] + worst["rest_bytes"]) / 2**20, "vision_mb": worst["vision_bytes"] / 2**20,
            "decoder_mb": worst["rest_bytes"] / 2**20, "peak_mb": max(r["peak_bytes"] for r in per_rank) / 2**20,
            "step_s": per_rank[0]["step_s"], "tokens_per_rank": worst["tokens"]}


def longest_fitting(rows: list[dict], budget_mb: float) -> float:
    """Length at which the straight-line fit of activation MB vs length reaches ``budget_mb``."""
    xs, ys = [r["length"] for r in rows], [r["act_mb"] for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return (budget_mb - (my - slope * mx)) / slope


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    for cp in sorted({r["cp"] for r in rows}):
        for vs, style in ((True, "-o"), (False, "--x")):
            sel = sorted((r for r in rows if r["cp"] == cp and r["vision_split"] == vs), key=lambda r: r["length"])
            if sel and not (cp == 1 and not vs):
                label = f"CP={cp}" + ("" if cp == 1 else (" vision split" if vs else " no vision split"))
                ax.plot([r["length"] for r in sel], [r["act_mb"] for r in sel], style, label=label)
                bx.plot([r["length"] for r in sel], [r["vision_mb"] for r in sel], style, label=label)
    ax.set(xlabel="row length (tokens)", ylabel="activation MB per rank", title="activation memory per rank")
    bx.set(xlabel="row length (tokens)", ylabel="vision encoder MB per rank", title="vision encoder activations")
    for a in (ax, bx):
        a.legend(fontsize=8)
    save(fig, path, grid=(ax, bx))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--mode", default="ring", choices=["ring", "allgather", "ulysses", "hybrid"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--budget-length", type=int, default=4096, help="CP=1 length whose activation memory is the budget")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=Path("bench/out"), help="every result file goes here (and only here)")
    p.add_argument("--quick", action="store_true", help=QUICK_HELP + ": 128 and 256 tokens, CP = 1 and 2, vision split on")
    args = p.parse_args()
    if args.quick:
        args.lengths, args.cp, args.repeats, args.budget_length = [128, 256], [1, 2], 1, 128
        note("128 and 256 tokens, CP = 1 and 2 with the vision split, 1 repeat")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    rows = []
    for length in args.lengths:
        for cp in args.cp:
            for vs in ((True,) if cp == 1 or args.quick else (True, False)):
                r = measure(cp, length, args.mode, vs, args.repeats, args.device)
                rows.append(r)
                print(f"cp={cp} L={length} vision_split={vs}: act {r['act_mb']:.1f} MB/rank "
                      f"(vision {r['vision_mb']:.1f}), step {r['step_s']:.2f} s", flush=True)

    base = {r["length"]: r for r in rows if r["cp"] == 1}
    header = ("| CP | length | vision split | tokens/rank | activations MB/rank | x CP=1 | vision MB/rank | "
              "decoder MB/rank | peak MB/rank | step s (median) |")
    lines = [header, "|" + "---|" * 10]
    for r in rows:
        b = base.get(r["length"])
        ratio = f"{r['act_mb'] / b['act_mb']:.2f}" if b else "-"
        lines.append(f"| {r['cp']} | {r['length']} | {'yes' if r['vision_split'] else 'no'} | {r['tokens_per_rank']} | "
                     f"{r['act_mb']:.1f} | {ratio} | {r['vision_mb']:.1f} | {r['decoder_mb']:.1f} | "
                     f"{r['peak_mb']:.0f} | {r['step_s']:.2f} |")
    budget = base[args.budget_length]["act_mb"] if args.budget_length in base else None
    fit_lines = []
    if budget is not None:
        fits = {}
        for cp in args.cp:
            for vs in (True, False):
                sel = [r for r in rows if r["cp"] == cp and (r["vision_split"] == vs or cp == 1)]
                if len({r["length"] for r in sel}) >= 2 and (cp > 1 or vs):
                    fits[(cp, vs)] = longest_fitting(sel, budget)
        ref = fits.get((1, True))
        fit_lines = [f"Budget: {budget:.1f} MB of activations per rank (CP=1 at {args.budget_length} tokens).", "",
                     "| CP | vision split | longest row in budget (tokens) | x CP=1 |", "|---|---|---|---|"]
        for (cp, vs), n in sorted(fits.items()):
            fit_lines.append(f"| {cp} | {'yes' if vs else 'no'} | {n:,.0f} | {n / ref:.2f} |")
    table = "\n".join(lines + [""] + fit_lines)
    print(table)
    write_results(args.out, "context_parallel", table, rows, lambda path: plot(rows, path), f"{args.mode}, {args.device}")


if __name__ == "__main__":
    main()
