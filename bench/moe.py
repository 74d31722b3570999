"""Benchmark: the Mixture-of-Experts block (omniweave/models/components/moe.py) and expert parallelism.

Three measurements, each against its baseline in the same run:

(a) **one MoE layer**, forward + backward (``--experts`` 64, top-``--topk`` 8, renormalised
    softmax router, ``--tokens`` tokens, each ``--hidden`` size with experts of width hidden / 2),
    with the same weights and input in three implementations:

    - ``grouped_mm``: ``MoEConfig.backend="grouped_mm"``, rows sorted by expert, one
      ``torch._grouped_mm`` per projection (what omniweave runs where it can);
    - ``loop``: ``backend="loop"``, one matmul per expert that received tokens;
    - ``dense-all-experts``: THE THING WE NEVER DO, written here only as the baseline: every expert
      on every token, the outputs weighted by the router's full [T, E] weights (zero outside the
      top-k), i.e. E / k times the FLOPs. It computes the same function; the table shows each
      implementation's max |output difference| from ``grouped_mm`` (relative to max |output|).

(b) **expert parallelism** (``parallel/expert.py`` ``apply_ep``) of that layer (first hidden size)
    on ``--ep`` gloo ranks (``parallel/spawn.run_ranks``): bytes of the expert tensors each rank
    holds (exact; the target is 1/EP of EP = 1's) and the forward + backward step time with
    ``--tokens`` tokens on every rank (all-to-all included; the slowest rank's median). The box has
    2 cores: EP = 4 puts 4 ranks on them, so its time says little.

(c) **demo_moe vs demo**: ``omniweave train`` of ``omniweave/configs/recipes/demo_moe.yaml`` and
    ``demo.yaml`` (equal active parameters: top-2 of 8 experts of width 64 vs a dense MLP of 128)
    on the same packed demo data (the same batches), each run a fresh process, round-robin
    ``--repeats`` times: the median over the steps after ``--warmup`` of the step's tokens per
    CPU second of the training process (the recipes train on one thread) and, for reference, of
    ``metrics.jsonl``'s ``tokens_per_s`` (wall clock, which other jobs on a shared box move).

Layer timings use ``--threads`` intra-op threads and ``--clock`` (cpu: the process's CPU seconds,
which other jobs on a shared box barely move; wall: elapsed time); medians over ``--repeats``
after one warm-up step.

    python bench/moe.py [--tokens 4096] [--hidden 256 512] [--experts 64] [--topk 8] [--ep 1 2 4]
                        [--steps 30] [--warmup 5] [--repeats 3] [--threads 1] [--clock cpu]
                        [--packed runs/demo/packed] [--out bench/out] [--quick]

``--quick`` (bench/quick.py): 256 tokens, hidden 64, 16 experts top-4, EP = 1 and 2, 3 training
steps of each recipe on 40 demo samples, 1 repeat; not meaningful figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo: omniweave, also when run as a plain script
sys.path.insert(0, str(ROOT / "bench"))  # bench/quick.py
from figure import pyplot, save  # noqa: E402
from quick import HELP as QUICK_HELP, note, work_dir  # noqa: E402

from omniweave.models.components.moe import MoE, MoEConfig  # noqa: E402

IMPLS = ("grouped_mm", "loop", "dense-all-experts")


def make_layer(hidden: int, experts: int, topk: int, backend: str = "grouped_mm") -> MoE:
    torch.manual_seed(0)
    moe = MoE(MoEConfig(hidden, hidden // 2, experts, topk, norm_topk_prob=True, backend=backend))
    moe.reset_parameters(0.02)
    return moe


def make_input(tokens: int, hidden: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed))


def dense_all_experts(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """BASELINE ONLY — never done in omniweave: every expert runs on every token ([E, T, ·]
    activations, E / k times the useful FLOPs), then the router's full weights (zero outside each
    token's top-k) mix the E outputs. Equals ``moe(x)``."""
    _, weights, idx = moe.gate(x)
    full = torch.zeros(x.shape[0], moe.cfg.num_experts, dtype=weights.dtype).scatter(1, idx, weights)  # [T, E]
    gate, up = torch.einsum("td,efd->etf", x, moe.experts.gate_up_proj).chunk(2, dim=-1)
    y = torch.einsum("eti,edi->etd", moe.experts.act(gate) * up, moe.experts.down_proj)  # [E, T, D]
    return torch.einsum("te,etd->td", full, y.float()).to(x.dtype)


def clock(name: str):
    return time.process_time if name == "cpu" else time.perf_counter


def time_step(forward, params: list[torch.Tensor], x: torch.Tensor, repeats: int, clock_name: str) -> list[float]:
    """Forward + backward of ``forward(x)`` against a fixed target; one warm-up, then ``repeats``."""
    target = torch.linspace(-1, 1, x.numel()).view_as(x)
    now, times = clock(clock_name), []
    for i in range(repeats + 1):
        t0 = now()
        (forward(x) * target).sum().backward()
        if i:
            times.append(now() - t0)
        for p in params:
            p.grad = None
    return times


# ---------------------------------------------------------------------------- (a) one layer


def layer_rows(args) -> list[dict]:
    rows = []
    for hidden in args.hidden:
        x = make_input(args.tokens, hidden).requires_grad_(True)
        ref = None
        for impl in IMPLS:
            moe = make_layer(hidden, args.experts, args.topk, "loop" if impl == "loop" else "grouped_mm")
            fwd = (lambda t, m=moe: dense_all_experts(m, t)) if impl == "dense-all-experts" else moe
            with torch.no_grad():
                out = fwd(x)
            ref = out if ref is None else ref
            times = time_step(fwd, [*moe.parameters(), x], x, args.repeats, args.clock)
            useful = 6 * args.tokens * args.topk * 3 * hidden * (hidden // 2)  # fwd + bwd, k experts a token
            rows.append({"hidden": hidden, "moe_intermediate": hidden // 2, "impl": impl,
                         "step_s": statistics.median(times), "times": times,
                         "max_rel_diff": float((out - ref).abs().max() / ref.abs().max()), "useful_gflop": useful / 1e9})  # fmt: skip
            r = rows[-1]
            print(f"  hidden {hidden:>4} {impl:>18}: {r['step_s']:.3f} s (median of {len(times)}), "
                  f"max |out - grouped_mm| / max |grouped_mm| {r['max_rel_diff']:.1e}", flush=True)
    for r in rows:
        base = next(q for q in rows if q["hidden"] == r["hidden"] and q["impl"] == "grouped_mm")
        r["x_grouped"] = r["step_s"] / base["step_s"]
        r["tokens_per_s"] = args.tokens / r["step_s"]
    return rows


# ---------------------------------------------------------------------------- (b) expert parallelism


def _ep_body(rank: int, world: int, hidden: int, experts: int, topk: int, tokens: int, repeats: int, clock_name: str):
    from torch.distributed.device_mesh import init_device_mesh

    from omniweave.parallel.expert import EXPERT_WEIGHTS, _local, apply_ep

    moe = make_layer(hidden, experts, topk)
    full_bytes = sum(getattr(moe.experts, n).nbytes for n in EXPERT_WEIGHTS)
    apply_ep(moe, init_device_mesh("cpu", (world,)))
    local = [_local(getattr(moe.experts, n)) for n in EXPERT_WEIGHTS]
    x = make_input(tokens, hidden, seed=1 + rank).requires_grad_(True)  # this rank's own tokens
    times = time_step(moe, [*moe.parameters(), x], x, repeats, clock_name)
    return {"local_bytes": sum(t.nbytes for t in local), "local_experts": local[0].shape[0],
            "full_bytes": full_bytes, "step_s": statistics.median(times)}


def ep_rows(args) -> list[dict]:
    from omniweave.parallel.spawn import run_ranks

    hidden, rows = args.hidden[0], []
    for ep in args.ep:
        ranks = run_ranks(_ep_body, ep, hidden, args.experts, args.topk, args.tokens, args.repeats, args.clock,
                          timeout=900.0, quiet=True)  # fmt: skip
        rows.append({"ep": ep, "local_experts": ranks[0]["local_experts"],
                     "local_mb": max(r["local_bytes"] for r in ranks) / 2**20,
                     "full_mb": ranks[0]["full_bytes"] / 2**20, "step_s": max(r["step_s"] for r in ranks)})  # fmt: skip
        r = rows[-1]
        print(f"  EP={ep}: {r['local_experts']} experts, {r['local_mb']:.2f} MB of expert weights per rank, "
              f"step {r['step_s']:.3f} s (slowest rank)", flush=True)
    for r in rows:
        r["x_ep1"] = r["local_mb"] / rows[0]["local_mb"] * args.ep[0]  # args.ep[0] is normally 1
    return rows


# ---------------------------------------------------------------------------- (c) demo_moe vs demo


def om(*argv: str, child: list[str] | None = None) -> str:
    """``python -m omniweave ARGV`` (or this script with ``child`` arguments) quietly, one thread;
    its output is shown if it fails; returns its stdout."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, __file__, *child] if child else [sys.executable, "-m", "omniweave", *argv]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode:
        print(res.stdout[-3000:], res.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"{' '.join(cmd[1:4])} failed (exit {res.returncode})")
    return res.stdout


def demo_packs(args, work: Path) -> Path:
    if args.packed:
        return Path(args.packed)
    data, raw, packed = work / "data", work / "raw", work / "packed"
    om("data", "demo", str(data), "--samples", str(args.demo_samples), "--eval-samples", "8")
    om("data", "convert", "--input", str(data / "train.jsonl"), "--media-dir", str(data / "media"),
       "--output", str(raw), "--workers", "1", "--no-progress", "--strict")
    om("data", "pack", "--input", str(raw), "--output", str(packed), "--recipe", "demo", "--workers", "1")
    return packed


def param_counts(recipe: str) -> dict:
    from omniweave.config import load_recipe
    from omniweave.models.registry import build_model

    model = build_model(load_recipe(recipe).model)
    total = sum(p.numel() for p in model.parameters())
    unused = sum((m.experts.gate_up_proj.numel() + m.experts.down_proj.numel()) * (1 - m.active_fraction())
                 for m in model.modules() if isinstance(m, MoE))  # fmt: skip
    return {"total": total, "active": round(total - unused)}


def train_child(recipe: str, packed: str, run: str, steps: int) -> list[float]:
    """In a fresh process: ``omniweave.train`` of ``recipe``; the process CPU seconds of each step
    but the last, from one step's first micro-batch to the next's (``train``'s per-micro-batch
    ``fault_hook``, here a probe that returns the output unchanged)."""
    from omniweave.config import load_recipe
    from omniweave.train.trainer import train

    marks: dict[int, float] = {}

    def probe(step, out):
        marks.setdefault(step, time.process_time())
        return out

    cfg = load_recipe(recipe, [f"data.path={packed}", f"output_dir={run}", f"train.steps={steps}",
                               "train.log_interval=1", "train.save_interval=0", "train.eval_interval=0"])  # fmt: skip
    train(cfg, fault_hook=probe)
    t = [marks[k] for k in sorted(marks)]
    return [b - a for a, b in zip(t, t[1:])]


def demo_rows(args, work: Path) -> list[dict]:
    packed = demo_packs(args, work)
    recipes, total = ("demo", "demo_moe"), args.warmup + args.steps + 1  # the last step is not timed
    cpu_tps: dict[str, list[float]] = {r: [] for r in recipes}
    wall_tps: dict[str, list[float]] = {r: [] for r in recipes}
    for rep in range(args.repeats):  # round-robin: slow phases of the shared box hit both recipes
        for recipe in recipes:
            run = work / f"run-{recipe}-{rep}"
            out = om(child=["--train-child", recipe, str(packed), str(run), str(total)])
            cpu = json.loads(out.strip().splitlines()[-1])  # steps 1 .. total - 1
            metrics = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]
            timed = [m for m in metrics if args.warmup < m["step"] < total]
            cpu_tps[recipe].append(statistics.median(m["tokens"] / cpu[m["step"] - 1] for m in timed))
            wall_tps[recipe].append(statistics.median(m["tokens_per_s"] for m in timed))
            print(f"  repeat {rep + 1}/{args.repeats} {recipe}: median {cpu_tps[recipe][-1]:.0f} tokens per CPU "
                  f"second, {wall_tps[recipe][-1]:.0f} tokens/s by the wall clock over {len(timed)} steps", flush=True)
    rows = [{"recipe": r, **param_counts(r), "cpu_tokens_per_s": statistics.median(cpu_tps[r]),
             "wall_tokens_per_s": statistics.median(wall_tps[r]), "cpu_per_repeat": cpu_tps[r],
             "wall_per_repeat": wall_tps[r]} for r in recipes]  # fmt: skip
    for r in rows:
        r["x_demo_cpu"] = r["cpu_tokens_per_s"] / rows[0]["cpu_tokens_per_s"]
        r["x_demo_wall"] = r["wall_tokens_per_s"] / rows[0]["wall_tokens_per_s"]
    return rows


# ---------------------------------------------------------------------------- output


def tables(args, layer: list[dict], ep: list[dict], demo: list[dict]) -> str:
    out = [f"(a) one MoE layer, {args.experts} experts top-{args.topk}, {args.tokens} tokens, fp32, fwd+bwd, "
           f"{args.threads} thread(s), {args.clock} clock, median of {args.repeats}", "",
           "| hidden | expert width | impl | step s | tokens/s | x grouped_mm time | max rel diff vs grouped_mm |",
           "|---:|---:|---|---:|---:|---:|---:|"]  # fmt: skip
    out += [f"| {r['hidden']} | {r['moe_intermediate']} | {r['impl']} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | "
            f"{r['x_grouped']:.2f}x | {r['max_rel_diff']:.1e} |" for r in layer]  # fmt: skip
    out += ["", f"(b) expert parallelism, hidden {args.hidden[0]}, gloo ranks, {args.tokens} tokens per rank", "",
            "| EP | experts per rank | expert MB per rank | x EP=1 | step s (slowest rank) |", "|---:|---:|---:|---:|---:|"]
    out += [f"| {r['ep']} | {r['local_experts']} | {r['local_mb']:.2f} | {r['x_ep1']:.3f} | {r['step_s']:.3f} |" for r in ep]
    out += ["", f"(c) training on the packed demo data (one thread), steps {args.warmup + 1}..{args.warmup + args.steps}, "
            f"median of {args.repeats} repeat(s) round-robin", "",
            "| recipe | parameters | active per token | tokens per CPU s | x demo | tokens/s wall (median) | x demo | "
            "per repeat (CPU; wall) |", "|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    out += [f"| {r['recipe']} | {r['total'] / 1e6:.3f}M | {r['active'] / 1e6:.3f}M | {r['cpu_tokens_per_s']:.0f} | "
            f"{r['x_demo_cpu']:.2f}x | {r['wall_tokens_per_s']:.0f} | {r['x_demo_wall']:.2f}x | "
            f"{', '.join(f'{t:.0f}' for t in r['cpu_per_repeat'])}; {', '.join(f'{t:.0f}' for t in r['wall_per_repeat'])} |"
            for r in demo]  # fmt: skip
    return "\n".join(out)


def plot(layer: list[dict], ep: list[dict], demo: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(1, 3, figsize=(14, 4))
    hiddens = sorted({r["hidden"] for r in layer})
    for i, impl in enumerate(IMPLS):
        ys = [next(r["step_s"] for r in layer if r["hidden"] == h and r["impl"] == impl) for h in hiddens]
        ax[0].bar([j + 0.27 * (i - 1) for j in range(len(hiddens))], ys, 0.27, label=impl)
    ax[0].set(xticks=range(len(hiddens)), xticklabels=[f"hidden {h}" for h in hiddens], ylabel="fwd+bwd s",
              yscale="log", title="one MoE layer (dense-all-experts: baseline only)")
    ax[0].legend()
    eps = [r["ep"] for r in ep]
    ax[1].plot(eps, [r["local_mb"] for r in ep], "o-", label="measured")
    ax[1].plot(eps, [ep[0]["local_mb"] * ep[0]["ep"] / e for e in eps], "k--", label="1/EP")
    ax[1].set(xlabel="EP", ylabel="expert weights per rank (MB)", xticks=eps, title="expert memory per rank")
    ax[1].legend()
    names = [r["recipe"] for r in demo]
    ax[2].bar([i - 0.2 for i in range(len(demo))], [r["cpu_tokens_per_s"] for r in demo], 0.4, label="per CPU second")
    ax[2].bar([i + 0.2 for i in range(len(demo))], [r["wall_tokens_per_s"] for r in demo], 0.4, label="per wall second")
    ax[2].set(xticks=range(len(demo)), xticklabels=names, ylabel="training tokens/s",
              title="demo vs demo_moe (equal active params)")
    ax[2].legend()
    save(fig, path, grid=ax)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens through the layer per step (per rank under EP)")
    p.add_argument("--hidden", type=int, nargs="+", default=[256, 512], help="hidden sizes; expert width = hidden / 2")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4], help="expert-parallel sizes (gloo ranks)")
    p.add_argument("--steps", type=int, default=30, help="timed training steps of each demo recipe (after --warmup)")
    p.add_argument("--warmup", type=int, default=5, help="training steps before the timed ones")
    p.add_argument("--demo-samples", type=int, default=400, help="demo samples generated and packed (without --packed)")
    p.add_argument("--packed", help="reuse a packed demo dataset (e.g. runs/demo/packed) instead of building one")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of the layer timings")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="layer timings: process CPU s or wall s")
    p.add_argument("--skip", nargs="*", default=[], choices=("layer", "ep", "demo"), help="parts to leave out")
    p.add_argument("--work", help="scratch folder (default /tmp/omniweave-bench-moe)")
    p.add_argument("--out", type=Path, default=Path("bench/out"))
    p.add_argument("--quick", action="store_true", help=QUICK_HELP + ": 256 tokens, hidden 64, 16 experts, 3 steps")
    p.add_argument("--train-child", nargs=4, metavar=("RECIPE", "PACKED", "RUN", "STEPS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.train_child:
        recipe, packed, run, steps = args.train_child
        print(json.dumps(train_child(recipe, packed, run, int(steps))))
        return 0
    if args.quick:
        args.tokens, args.hidden, args.experts, args.topk, args.ep = 256, [64], 16, 4, [1, 2]
        args.steps, args.warmup, args.demo_samples, args.repeats, args.packed = 3, 1, 40, 1, None
        note("256 tokens, hidden 64, 16 experts top-4, EP 1 and 2, 3 demo steps, 1 repeat")
    work = Path(work_dir(args.work, args.quick, "/tmp/omniweave-bench-moe"))
    work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    layer = ep = demo = []
    if "layer" not in args.skip:
        print("(a) one MoE layer", flush=True)
        layer = layer_rows(args)
    if "ep" not in args.skip:
        print("(b) expert parallelism", flush=True)
        ep = ep_rows(args)
    if "demo" not in args.skip:
        print("(c) demo vs demo_moe", flush=True)
        demo = demo_rows(args, work)
    table = tables(args, layer, ep, demo)
    print(f"\n{table}\n\ntotal {time.perf_counter() - t0:.0f} s")
    (args.out / "moe.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                   "layer": layer, "ep": ep, "demo": demo}, indent=1))
    if layer and ep and demo:
        plot(layer, ep, demo, args.out / "moe.png")
        print(f"wrote {args.out / 'moe.png'} and {args.out / 'moe.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
