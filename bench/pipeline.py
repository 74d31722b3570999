"""Benchmark: pipeline parallelism (omniweave/parallel/pipeline.py) on gloo CPU ranks, fp32.

Three measurements, each in fresh groups of gloo processes (one intra-op thread per rank):

1. **Bubble fraction** per schedule (1f1b, gpipe, interleaved_1f1b and zero_bubble at virtual 2)
   at pp = 2 and 4 with M micro-batches (text-only rows, uniform stages, so the stages cost
   alike). Each stage's ``forward_one_chunk`` / ``backward_one_chunk`` /
   ``backward_weight_one_chunk`` is timed (the schedules wait for their receives outside them), so
   a rank's idle fraction is 1 - (its compute time) / (its step wall time); shown next to the
   schedule's theoretical bubble (p-1)/(v·m + p-1) (v = 1 for 1f1b and gpipe; zero bubble is shown against the interleaved bound, the
   ideal zero-bubble schedule's being ~0). On a box with
   fewer cores than ranks the ranks' compute overlaps on the same cores and stretches, so the
   measured fractions are indicative only.
2. **Cost-model split vs uniform split** on a VLM whose encoder is heavy (the demo recipe with a
   6-block ViT over video rows, ~90 % of the tokens video, and an 8-layer decoder) at pp = 2,
   1f1b: the step time (slowest rank, median over ``--split-repeats``; the two splits alternate
   step by step) of the split that ``split_layers`` picks from the FLOP cost model (the encoders'
   work in decoder-layer units, ``encoder_cost_in_layers``) and of the uniform split, their ratio,
   and each rank's stage compute time (the balance the split achieved).
3. **Per-rank memory** at pp = 1, 2, 4 (that VLM, the cost-model split, 1f1b, one step + one AdamW
   step), without and with activation checkpointing of every decoder layer and encoder block
   (``train.ac=full``, ``--memory-ac``): parameter, gradient and optimizer-state bytes of each
   rank's stages, exact (counted from the tensors); and the peak RSS growth over the RSS before
   the step (activations, gradients, optimizer state and allocator slack; noisy: torch has no CPU
   allocator statistics).

    python bench/pipeline.py [--pp 2 4] [--microbatches 4 8] [--repeats 3] [--split-repeats 7]
                             [--out bench/out] [--quick]

``--quick`` (bench/quick.py): pp = 2 only, 2 micro-batches, short rows, 1 repeat; not meaningful figures.
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
from omniweave.train.objective import TokenCrossEntropy  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/
from context_parallel import MODEL as CP_MODEL, make_row  # noqa: E402
from figure import pyplot, save, write_results  # noqa: E402
from quick import HELP as QUICK_HELP, note  # noqa: E402

LAYERS = 8  # decoder layers: 4 / 2 per stage at pp 2 / 4, 2 per virtual stage at pp 2 x 2
TEXT_MODEL = [*CP_MODEL, f"model.foundation.num_layers={LAYERS}", "model.foundation.vocab_size=512"]
VLM_MODEL = [*CP_MODEL, f"model.foundation.num_layers={LAYERS}", "model.image_encoder.depth=6"]  # the heavy encoder
SCHEDULES = [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2), ("zero_bubble", 2)]  # (schedule, virtual)


def _model(overrides: list[str]):
    from omniweave.config import load_recipe, to_dict
    from omniweave.models.registry import build_model

    torch.manual_seed(0)
    model = build_model(to_dict(load_recipe("demo", overrides).model))
    model.init_weights()
    return model


def text_row(length: int, vocab: int, seed: int) -> dict:
    """A packed text-only row of two documents (loss on every next token of each)."""
    g = torch.Generator().manual_seed(seed)
    half = length // 2
    ids = torch.randint(10, vocab, (length,), generator=g)
    labels = torch.cat([ids[1:half], torch.tensor([-100]), ids[half + 1:], torch.tensor([-100])])
    pos = torch.cat([torch.arange(half), torch.arange(length - half)])
    return {"input_ids": ids, "labels": labels, "position_ids": pos[None].expand(3, length).clone(),
            "cu_seqlens": torch.tensor([0, half, length], dtype=torch.int32),
            "num_loss_tokens": int((labels != -100).sum())}


def theoretical_bubble(pp: int, m: int, virtual: int) -> float:
    """Idle fraction of a 1F1B / GPipe pipeline, (p-1)/(m+p-1); the interleaved schedule's ramp is
    1/v as long: (p-1)/(v·m + p-1) (Narayanan et al. 2021)."""
    return (pp - 1) / (virtual * m + pp - 1)


class ComputeTimer:
    """Seconds this rank's stages spend computing: their forward / backward calls, timed from outside
    (the schedules wait for receives before calling them)."""

    METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self, stages):
        self.seconds = 0.0
        for stage in stages:
            for name in self.METHODS:
                setattr(stage, name, self._timed(getattr(stage, name)))

    def _timed(self, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
        return run


class TimedPipeline:
    """A pipeline and its padded rows, stepped with this rank's wall and compute time recorded."""

    def __init__(self, pipe, rows: list[dict]):
        from omniweave.parallel.pipeline import pad_rows

        self.pipe, self.rows = pipe, pad_rows(rows, max(r["input_ids"].shape[0] for r in rows))
        self.normaliser = sum(r["num_loss_tokens"] for r in rows)
        self.timer = ComputeTimer(pipe.stages)
        self.walls: list[float] = []
        self.computes: list[float] = []
        self.slowest: list[float] = []  # the slowest rank's wall time

    def step(self, record: bool = True) -> None:
        dist.barrier()
        self.timer.seconds = 0.0
        t0 = time.perf_counter()
        self.pipe.step(self.rows, self.normaliser, TokenCrossEntropy())
        wall = time.perf_counter() - t0
        worst = torch.tensor(wall)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        if record:
            self.walls.append(wall)
            self.computes.append(self.timer.seconds)
            self.slowest.append(float(worst))
        self.pipe.local.zero_grad(set_to_none=True)


def _bubble_rank(rank: int, world: int, cases: list, length: int, repeats: int) -> list[dict]:
    from omniweave.parallel.pipeline import Pipeline
    from omniweave.parallel.pipeline_split import split_layers

    out = []
    for schedule, virtual, m in cases:
        sizes = split_layers(LAYERS, world, virtual, first_stage_cost=None)
        pipe = Pipeline(_model(TEXT_MODEL), sizes, dist.group.WORLD, torch.device("cpu"), schedule, m)
        rows = [text_row(length, 512, seed) for seed in range(m)]
        timed = TimedPipeline(pipe, rows)
        for i in range(repeats + 1):
            timed.step(record=i > 0)  # the first step warms up
        idle = [1 - c / w for c, w in zip(timed.computes, timed.walls)]
        out.append({"schedule": schedule, "virtual": virtual, "m": m, "idle": statistics.median(idle),
                    "step_s": statistics.median(timed.slowest), "compute_s": statistics.median(timed.computes)})
    return out


def bubbles(pp: int, microbatches: list[int], length: int, repeats: int) -> list[dict]:
    cases = [(s, v, m) for s, v in SCHEDULES for m in microbatches if LAYERS % (pp * v) == 0]
    per_rank = run_ranks(_bubble_rank, pp, cases, length, repeats, timeout=1800)
    rows = []
    for i, (schedule, virtual, m) in enumerate(cases):
        idle = [r[i]["idle"] for r in per_rank]
        rows.append({"pp": pp, "schedule": schedule, "virtual": virtual, "m": m, "idle_per_rank": idle,
                     "measured": statistics.fmean(idle), "theory": theoretical_bubble(pp, m, virtual),
                     "step_s": per_rank[0][i]["step_s"]})
    return rows


def vlm_rows(m: int, length: int) -> tuple[list[dict], float]:
    """``m`` video rows and their encoder patches per decoder token (as ``build_pipeline`` reads
    them from the packed data's stats: vision tokens x merge² over the capacity tokens)."""
    rows = [make_row(length, seed) for seed in range(m)]
    patches = sum(r["pixel_values"].shape[0] for r in rows)
    return rows, patches / sum(r["input_ids"].shape[0] for r in rows)


def cost_split(pp: int, length: int) -> tuple[list[int], float]:
    """The cost-model split of the VLM's layers over ``pp`` stages, and the encoders' cost in layers."""
    from omniweave.config import load_recipe, to_dict
    from omniweave.parallel.pipeline_split import encoder_cost_in_layers, split_layers

    _, patches_per_token = vlm_rows(1, length)
    cost = encoder_cost_in_layers(to_dict(load_recipe("demo", VLM_MODEL).model), patches_per_token)
    return split_layers(LAYERS, pp, first_stage_cost=cost), cost


def _split_rank(rank: int, world: int, splits: list[list[int]], m: int, length: int, repeats: int) -> list[dict]:
    from omniweave.parallel.pipeline import Pipeline

    rows, _ = vlm_rows(m, length)
    runs = [TimedPipeline(Pipeline(_model(VLM_MODEL), sizes, dist.group.WORLD, torch.device("cpu"), "1f1b", m), rows)
            for sizes in splits]
    for i in range(repeats + 1):  # the splits alternate step by step, so that both see the box's load alike
        for run in runs:
            run.step(record=i > 0)  # the first round warms up
    return [{"sizes": sizes, "step_s": statistics.median(run.slowest), "compute_s": statistics.median(run.computes),
             "steps_s": run.slowest} for sizes, run in zip(splits, runs)]


def _rss_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * int(Path("/proc/self/statm").read_text().split()[1])


def _memory_rank(rank: int, world: int, sizes: list[int], m: int, length: int, ac: str) -> dict:
    import gc

    from omniweave.parallel.fsdp import apply_ac
    from omniweave.parallel.pipeline import Pipeline, pad_rows

    rows, _ = vlm_rows(m, length)
    rows = pad_rows(rows, max(r["input_ids"].shape[0] for r in rows))
    base = _model(VLM_MODEL)
    apply_ac(base, ac)  # before the cut, as the trainer does
    pipe = Pipeline(base, sizes, dist.group.WORLD, torch.device("cpu"), "1f1b", m)
    del base
    gc.collect()
    optimizer = torch.optim.AdamW(pipe.local.parameters(), lr=1e-4)
    dist.barrier()
    rss0 = _rss_bytes()
    pipe.step(rows, sum(r["num_loss_tokens"] for r in rows), TokenCrossEntropy())
    optimizer.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0

    def nbytes(tensors):
        return sum(t.numel() * t.element_size() for t in tensors if torch.is_tensor(t))

    params = list(pipe.local.parameters())
    return {"rank": rank, "ac": ac, "params_b": nbytes(params), "grads_b": nbytes(p.grad for p in params),
            "optim_b": nbytes(v for s in optimizer.state.values() for v in s.values()), "rss_growth_b": peak,
            "layers": sum(sizes[s] for s in range(rank, len(sizes), world)), "encoder": rank == 0}


def memory(pp: int, m: int, length: int, ac: str) -> list[dict]:
    sizes, _ = cost_split(pp, length)
    return [{"pp": pp, **r} for r in run_ranks(_memory_rank, pp, sizes, m, length, ac, timeout=1800)]


def plot(bubble_rows: list[dict], split_rows: list[dict], mem_rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(15, 4))
    labels = [f"{r['schedule']}\npp{r['pp']} m{r['m']}" for r in bubble_rows]
    xs = range(len(bubble_rows))
    ax.bar([x - 0.2 for x in xs], [r["measured"] for r in bubble_rows], 0.4, label="measured (mean idle per rank)")
    ax.bar([x + 0.2 for x in xs], [r["theory"] for r in bubble_rows], 0.4, label="theory (p-1)/(v·m+p-1)")
    ax.set_xticks(list(xs), labels, fontsize=6, rotation=90)
    ax.set(ylabel="bubble fraction", title="pipeline bubble")
    ax.legend(fontsize=7)
    bx.bar([str(r["sizes"]) + "\n" + r["name"] for r in split_rows], [r["step_s"] for r in split_rows])
    bx.set(ylabel="step s (median, slowest rank)", title="heavy-encoder VLM, pp 2: stage split")
    modes = list(dict.fromkeys(r["ac"] for r in mem_rows))
    for i, pp in enumerate(sorted({r["pp"] for r in mem_rows})):
        sel = [r for r in mem_rows if r["pp"] == pp and r["ac"] == modes[0]]
        cx.plot([r["rank"] for r in sel], [(r["params_b"] + r["grads_b"] + r["optim_b"]) / 2**20 for r in sel], "-o",
                color=f"C{i}", label=f"pp={pp} params+grads+AdamW")
        for ac, style in zip(modes, ("--x", ":+", "-.s")):
            sel = [r for r in mem_rows if r["pp"] == pp and r["ac"] == ac]
            cx.plot([r["rank"] for r in sel], [r["rss_growth_b"] / 2**20 for r in sel], style, color=f"C{i}",
                    label=f"pp={pp} peak RSS growth, ac={ac}")
    cx.set_xticks(sorted({r["rank"] for r in mem_rows}))
    cx.set(xlabel="rank (stage 0 holds the encoder)", ylabel="MB", title="memory per rank")
    cx.legend(fontsize=7)
    save(fig, path, grid=(ax, bx, cx))


def tables(bubble_rows: list[dict], split_rows: list[dict], split_info: dict, mem_rows: list[dict]) -> str:
    lines = ["| pp | schedule | virtual | micro-batches | measured idle (mean of ranks) | per rank | theory | "
             "step s |", "|" + "---|" * 8]
    for r in bubble_rows:
        per = " / ".join(f"{x:.2f}" for x in r["idle_per_rank"])
        lines.append(f"| {r['pp']} | {r['schedule']} | {r['virtual']} | {r['m']} | {r['measured']:.3f} | {per} | "
                     f"{r['theory']:.3f} | {r['step_s']:.3f} |")
    uniform = split_rows[0]
    lines += ["", f"Encoder cost {split_info['cost']:.2f} decoder layers ({split_info['patches_per_token']:.2f} "
              f"patches per token); {split_info['m']} rows of {split_info['tokens']} tokens, 1f1b:", "",
              "| split | layers per stage | step s (median, slowest rank) | x uniform | stage compute s per rank |",
              "|---|---|---|---|---|"]
    for r in split_rows:
        per = " / ".join(f"{x:.2f}" for x in r["compute_per_rank"])
        lines.append(f"| {r['name']} | {r['sizes']} | {r['step_s']:.3f} | {uniform['step_s'] / r['step_s']:.2f} | {per} |")
    lines += ["", "| pp | train.ac | rank | decoder layers | encoder | params MB | grads MB | AdamW state MB | sum MB | "
              "peak RSS growth MB |", "|" + "---|" * 10]
    for r in mem_rows:
        total = (r["params_b"] + r["grads_b"] + r["optim_b"]) / 2**20
        lines.append(f"| {r['pp']} | {r['ac']} | {r['rank']} | {r['layers']} | {'yes' if r['encoder'] else 'no'} | "
                     f"{r['params_b'] / 2**20:.2f} | {r['grads_b'] / 2**20:.2f} | {r['optim_b'] / 2**20:.2f} | "
                     f"{total:.2f} | {r['rss_growth_b'] / 2**20:.0f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4], help="pipeline sizes of the bubble measurement")
    p.add_argument("--microbatches", type=int, nargs="+", default=[4, 8], help="micro-batches (rows) per step")
    p.add_argument("--text-length", type=int, default=256, help="tokens per text row (bubble measurement)")
    p.add_argument("--vlm-length", type=int, default=512, help="~tokens per video row (split and memory)")
    p.add_argument("--memory-pp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--memory-ac", nargs="+", default=["none", "full"], choices=["none", "selective", "full"],
                   help="train.ac modes of the memory measurement")
    p.add_argument("--repeats", type=int, default=3, help="measured steps per bubble case (after a warm-up step)")
    p.add_argument("--split-repeats", type=int, default=7, help="measured steps per split (they alternate)")
    p.add_argument("--out", type=Path, default=Path("bench/out"), help="every result file goes here (and only here)")
    p.add_argument("--quick", action="store_true", help=QUICK_HELP + ": pp 2, 2 micro-batches, short rows")
    args = p.parse_args()
    if args.quick:
        args.pp, args.microbatches, args.text_length, args.vlm_length = [2], [2], 64, 128
        args.memory_pp, args.repeats, args.split_repeats = [1, 2], 1, 1
        note("pp 2, 2 micro-batches, 64 / 128-token rows, memory at pp 1 and 2, 1 repeat")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()

    bubble_rows = [r for pp in args.pp for r in bubbles(pp, args.microbatches, args.text_length, args.repeats)]
    m = max(2, min(args.microbatches))
    chosen, cost = cost_split(2, args.vlm_length)
    uniform = [LAYERS // 2] * 2
    per_rank = run_ranks(_split_rank, 2, [uniform, chosen], m, args.vlm_length, args.split_repeats, timeout=1800)
    split_rows = per_rank[0]
    for i, (r, name) in enumerate(zip(split_rows, ("uniform", "cost model"))):
        r["name"], r["compute_per_rank"] = name, [ranks[i]["compute_s"] for ranks in per_rank]
    rows, ppt = vlm_rows(1, args.vlm_length)
    split_info = {"cost": cost, "patches_per_token": ppt, "m": m, "tokens": rows[0]["input_ids"].shape[0]}
    mem_rows = [r for ac in args.memory_ac for pp in args.memory_pp for r in memory(pp, m, args.vlm_length, ac)]

    table = tables(bubble_rows, split_rows, split_info, mem_rows)
    print(table)
    print(f"total {time.perf_counter() - t0:.0f} s", flush=True)
    result = {"bubble": bubble_rows, "split": {**split_info, "runs": split_rows}, "memory": mem_rows}
    write_results(args.out, "pipeline", table, result, lambda path: plot(bubble_rows, split_rows, mem_rows, path),
                  "gloo, CPU, fp32")


if __name__ == "__main__":
    main()
