"""Benchmark: VLA training on packed frames vs one frame per row, and sampling with vs without
prefix K/V reuse (issue 37, ``train.phase: vla``), CPU fp32.

Data: ``write_reach_dataset(--episodes, layout="ring")`` (the demo's simulator, docs/vla.md) ->
``data convert --format lerobot --horizon H`` (H = demo_vla's expert horizon, 4) -> packed twice
with the ``demo_vla`` recipe:

    packed   ``data pack`` as documented: best-fit decreasing at ``data.max_len`` (--max-len),
             ~16 frames of ~62 tokens per 1024-token row
    single   ``data pack --algorithm single``: one frame per row

1. Training: ``omniweave train demo_vla`` on each, --steps optimizer steps, the same model and
   settings; packed takes --global-batch rows a step, single as many rows as the packed run's mean
   frames per measured step, so both see (as near as whole rows allow) the same frames per step. The
   frames of each step come from the trainer's own loader order (checked against the ``tokens``
   the run logs); figures per run: the median over steps after --warmup of ``step_s`` (from
   metrics.jsonl) and of frames / step_s, then the median over --repeats (arms' order alternating).
   Ratio = packed frames/s / single frames/s.
2. Sampling: ``Policy.load`` of the first packed run builds the row of 1 and 8 observations
   (``ReachSim(seed, layout="ring").observation()``); timed alone, on the same row and noise:
       reuse   ``model.sample_actions(batch, noise, --num-steps)``: the backbone's prefix (ViT +
               decoder over the observation, keys / values kept) once, then the expert alone per step
       naive   ``euler_sample`` whose velocity recomputes ``model.prefix`` and ``model.chunks`` at
               every Euler step (the same public pieces sample_actions uses)
   Both must give the same actions within 1e-5. Median latency over --sample-repeats calls each
   (interleaved), speed-up = naive / reuse. The same for a wider backbone (``WIDE``: decoder
   512 x 4 layers, expert 256 x 4 layers, head_dim 64; trained one step only: latency does not
   depend on the weights) unless --no-wide.

    python bench/vla.py [--quick] [--episodes 300] [--max-len 1024] [--global-batch 4] [--steps 12]
        [--warmup 2] [--repeats 3] [--obs 1 8] [--num-steps 10] [--sample-repeats 20] [--no-wide]
        [--threads 1] [--work DIR] [--out bench/out]

Prints markdown tables and writes vla.png / .json / .md under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from statistics import mean, median

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: omniweave, bench
from bench.figure import pyplot, save, write_results  # noqa: E402
from bench.quick import HELP as QUICK_HELP, note, work_dir  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RECIPE = "demo_vla"
ARMS = ("packed", "single")
# a backbone 8x wider and 2x deeper than demo_vla's (64 x 2), an expert of half its width (Pi0.5's
# ratio: Gemma 2B's 2048 vs the expert's 1024); the expert must share depth, head_dim, kv heads
WIDE = ["model.foundation.hidden_size=512", "model.foundation.intermediate_size=1408", "model.foundation.num_layers=4",
        "model.foundation.num_heads=8", "model.foundation.num_kv_heads=2", "model.foundation.mrope_section=[8,12,12]",
        "model.action_expert.hidden_size=256", "model.action_expert.intermediate_size=512",
        "model.action_expert.num_layers=4", "model.action_expert.num_heads=4", "model.action_expert.num_kv_heads=2",
        "model.action_expert.head_dim=64"]


def child_env(threads: int) -> dict:
    n = str(threads)
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}


def om(args, *argv: str) -> None:
    """``python -m omniweave ARGV`` quietly; its output is shown if it fails."""
    res = subprocess.run([sys.executable, "-m", "omniweave", *argv], env=child_env(args.threads), cwd=REPO,
                         capture_output=True, text=True)
    if res.returncode:
        print(res.stdout[-3000:], res.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"omniweave {' '.join(argv[:2])} failed (exit {res.returncode})")


# ---------------------------------------------------------------------------- data


def horizon() -> int:
    from omniweave.config import load_recipe

    return int(load_recipe(RECIPE, []).model.action_expert.horizon)


def make_data(work: Path, args) -> dict[str, Path]:
    """The dataset, its conversion, and the two packings of it (kept across runs of the bench)."""
    from omniweave.vla.demo_data import write_reach_dataset

    tag = f"ep{args.episodes}_len{args.max_len}"
    out = {"packed": work / f"packed_{tag}", "single": work / f"single_{tag}"}
    if all((p / "manifest.json").is_file() for p in out.values()):
        return out
    t0 = time.perf_counter()
    ds, raw = work / f"dataset_ep{args.episodes}", work / f"raw_ep{args.episodes}"
    for p in (ds, raw, *out.values()):
        shutil.rmtree(p, ignore_errors=True)
    write_reach_dataset(ds, episodes=args.episodes, layout="ring")
    om(args, "data", "convert", "--format", "lerobot", "--input", str(ds), "--output", str(raw),
       "--horizon", str(horizon()), "--no-progress")
    for arm, path in out.items():
        om(args, "data", "pack", "--input", str(raw), "--output", str(path), "--recipe", RECIPE,
           "--max-len", str(args.max_len), "--workers", "1", *(["--algorithm", "single"] if arm == "single" else []))
    print(f"data: {args.episodes} episodes recorded, converted, packed twice in {time.perf_counter() - t0:.0f} s",
          flush=True)
    return out


def frames_per_pack(path: Path) -> list[int]:
    from omniweave.data.packing.packed import PackedDataset

    ds = PackedDataset(path)
    return [len(ds.record(i)["docs"]) for i in range(len(ds))]


def step_plan(path: Path, global_batch: int, steps: int, seed: int = 0) -> list[dict]:
    """Frames and tokens of each training step, in the trainer's loader order."""
    from omniweave.data.loading.loader import PackedLoader

    loader = PackedLoader(str(path), global_batch, 0, 1, seed=seed, kind="vla")
    epoch = cursor = 0
    plan = []
    for _ in range(steps):
        ids, epoch, cursor = loader.global_batch_ids(epoch, cursor)
        recs = [loader.source.record(i) for i in ids]
        plan.append({"frames": sum(len(r["docs"]) for r in recs), "tokens": sum(r["length"] for r in recs)})
    return plan


# ---------------------------------------------------------------------------- 1. training


def train(args, data: Path, out: Path, global_batch: int, steps: int, overrides=()) -> list[dict]:
    shutil.rmtree(out, ignore_errors=True)
    om(args, "train", RECIPE, f"data.path={data}", f"output_dir={out}", f"train.steps={steps}",
       f"train.global_batch={global_batch}", f"data.max_len={args.max_len}", "train.log_interval=1",
       "train.save_interval=0", f"train.cpu_threads={args.threads}", *overrides)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def run_training(args, work: Path, data: dict[str, Path]) -> dict:
    per_pack = frames_per_pack(data["packed"])
    plans = {"packed": step_plan(data["packed"], args.global_batch, args.steps)}
    # single: one row per frame, as many rows as the packed arm's mean frames over the measured steps
    batch = {"packed": args.global_batch,
             "single": max(1, round(mean(p["frames"] for p in plans["packed"][args.warmup:])))}
    plans["single"] = step_plan(data["single"], batch["single"], args.steps)
    runs = {arm: [] for arm in ARMS}
    for rep in range(args.repeats):
        for arm in ARMS if rep % 2 == 0 else ARMS[::-1]:
            t0 = time.perf_counter()
            rows = train(args, data[arm], work / f"run_{arm}_{rep}", batch[arm], args.steps)
            got, want = [r["tokens"] for r in rows], [p["tokens"] for p in plans[arm]]
            if got != want:
                raise SystemExit(f"{arm}: the run's tokens per step {got} are not the loader plan's {want}")
            runs[arm].append(rows)
            print(f"  repeat {rep + 1} {arm} (global batch {batch[arm]}): {time.perf_counter() - t0:.0f} s, step_s "
                  f"{[round(r['step_s'], 3) for r in rows]}", flush=True)
    stats = {}
    for arm in ARMS:
        measured = plans[arm][args.warmup:]
        per_run = [{"step_s": median(r["step_s"] for r in rows[args.warmup:]),
                    "frames_s": median(p["frames"] / r["step_s"] for p, r in zip(measured, rows[args.warmup:])),
                    "tokens_s": median(r["tokens"] / r["step_s"] for r in rows[args.warmup:])} for rows in runs[arm]]
        stats[arm] = {"global_batch": batch[arm], "frames_per_step": mean(p["frames"] for p in measured),
                      "frames_per_step_min": min(p["frames"] for p in measured),
                      "frames_per_step_max": max(p["frames"] for p in measured),
                      "tokens_per_step": mean(p["tokens"] for p in measured),
                      **{k: median(r[k] for r in per_run) for k in ("step_s", "frames_s", "tokens_s")},
                      "frames_s_runs": [r["frames_s"] for r in per_run]}
    ratio = stats["packed"]["frames_s"] / stats["single"]["frames_s"]
    return {"stats": stats, "ratio": ratio, "frames": sum(per_pack), "packs": len(per_pack),
            "frames_per_pack": mean(per_pack), "policy_run": str(work / "run_packed_0"),
            "runs": {arm: [[{k: r.get(k) for k in ("step", "step_s", "tokens", "loss")} for r in rows] for rows in rs]
                     for arm, rs in runs.items()}, "plans": plans}


# ---------------------------------------------------------------------------- 2. sampling


def naive_sample(model, batch: dict, noise, num_steps: int):
    """Euler sampling that recomputes the backbone's prefix at every step (no K/V reuse)."""
    from omniweave.models.components.flow import euler_sample

    def velocity(x, t):
        prefix = model.prefix(batch)
        return model.velocity(model.chunks(prefix, batch["action_docs"]), x, t)

    return euler_sample(velocity, noise, num_steps)


def param_count(module) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def time_sampling(args, run_dir: Path, label: str) -> dict:
    import torch

    from omniweave.vla.policy import Policy
    from omniweave.vla.sim import ReachSim

    torch.set_num_threads(args.threads)
    policy = Policy.load(run_dir)
    model = policy.model
    expert = param_count(model.action_expert)
    sizes = {"backbone_params": param_count(model) - expert, "expert_params": expert}
    observations = [ReachSim(seed, layout="ring").observation() for seed in range(max(args.obs))]
    out = {"label": label, **sizes, "obs": {}}
    for n in args.obs:
        t0 = time.perf_counter()
        batch = policy.rows(observations[:n])
        row_s = time.perf_counter() - t0
        noise = torch.randn(n, policy.horizon, policy.width, generator=torch.Generator().manual_seed(n))
        calls = {"reuse": lambda: model.sample_actions(batch, noise, args.num_steps),
                 "naive": lambda: naive_sample(model, batch, noise, args.num_steps)}
        times = {k: [] for k in calls}
        with torch.no_grad():
            result = {k: f() for k, f in calls.items()}  # warm-up, and the equality check
            diff = float((result["reuse"] - result["naive"]).abs().max())
            if not diff <= 1e-5:
                raise SystemExit(f"{label}, {n} observations: reuse and naive sampling differ by {diff:.3g} (> 1e-5)")
            for rep in range(args.sample_repeats):
                for k in (calls if rep % 2 == 0 else list(calls)[::-1]):
                    t0 = time.perf_counter()
                    calls[k]()
                    times[k].append(time.perf_counter() - t0)
        stats = {k: median(v) for k, v in times.items()}
        out["obs"][str(n)] = {"tokens": int(batch["input_ids"].numel()), "row_build_s": row_s,
                              "reuse_s": stats["reuse"], "naive_s": stats["naive"],
                              "speedup": stats["naive"] / stats["reuse"], "max_abs_diff": diff,
                              "reuse_runs": times["reuse"], "naive_runs": times["naive"]}
        print(f"  {label}, {n} obs: reuse {stats['reuse'] * 1e3:.1f} ms, naive {stats['naive'] * 1e3:.1f} ms, "
              f"{stats['naive'] / stats['reuse']:.2f}x, max |diff| {diff:.1e}", flush=True)
    return out


def run(args) -> dict:
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    data = make_data(work, args)
    print("training: packed vs one frame per row", flush=True)
    training = run_training(args, work, data)
    print("sampling: with vs without prefix K/V reuse", flush=True)
    sampling = [time_sampling(args, Path(training["policy_run"]), "demo_vla")]
    if args.wide:
        wide_run = work / "run_wide"
        train(args, data["packed"], wide_run, 1, 1, WIDE)
        sampling.append(time_sampling(args, wide_run, "wide"))
    return {"recipe": RECIPE, "horizon": horizon(), "settings": vars(args) | {"out": str(args.out)},
            "wide_overrides": WIDE, "training": training, "sampling": sampling}


# ---------------------------------------------------------------------------- report


def table(result: dict) -> str:
    tr = result["training"]
    lines = [f"Training ({tr['frames']} frames; packed {tr['packs']} rows, {tr['frames_per_pack']:.1f} frames a row):", "",
             "| rows | global batch | frames/step (min–max) | tokens/step | step s | frames/s | tokens/s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for arm in ARMS:
        s = tr["stats"][arm]
        lines.append(f"| {arm} | {s['global_batch']} | {s['frames_per_step']:.1f} ({s['frames_per_step_min']}–"
                     f"{s['frames_per_step_max']}) | {s['tokens_per_step']:.0f} | {s['step_s']:.3f} | "
                     f"{s['frames_s']:.0f} | {s['tokens_s']:.0f} |")
    lines += ["", f"packed / single frames/s: **{tr['ratio']:.2f}x**", "",
              f"Sampling ({result['settings']['num_steps']} Euler steps, median latency):", "",
              "| model | backbone / expert params | observations | row tokens | reuse ms | naive ms | speed-up | "
              "prefix ms | expert step ms | max abs diff |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    steps = result["settings"]["num_steps"]
    for s in result["sampling"]:
        for n, o in s["obs"].items():
            # reuse = P + S·E, naive = S·(P + E): the prefix's and one expert step's cost P, E
            prefix = (o["naive_s"] - o["reuse_s"]) / max(steps - 1, 1)
            expert = (o["reuse_s"] - prefix) / steps
            lines.append(f"| {s['label']} | {s['backbone_params'] / 1e6:.2f}M / {s['expert_params'] / 1e6:.2f}M | {n} | "
                         f"{o['tokens']} | {o['reuse_s'] * 1e3:.1f} | {o['naive_s'] * 1e3:.1f} | "
                         f"**{o['speedup']:.2f}x** | {prefix * 1e3:.1f} | {expert * 1e3:.2f} | {o['max_abs_diff']:.1e} |")
    lines.append(f"\nprefix ms, expert step ms: solved from reuse = P + {steps}·E and naive = {steps}·(P + E)")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.4))
    tr = result["training"]
    vals = [tr["stats"][arm]["frames_s"] for arm in ARMS]
    a1.bar(range(2), vals, color=["tab:blue", "tab:gray"])
    for i, arm in enumerate(ARMS):
        a1.scatter([i] * len(tr["stats"][arm]["frames_s_runs"]), tr["stats"][arm]["frames_s_runs"], color="black", s=8,
                   zorder=3)
    a1.set_xticks(range(2), [f"packed\n(gb {tr['stats']['packed']['global_batch']})",
                             f"one frame per row\n(gb {tr['stats']['single']['global_batch']})"])
    a1.set_ylabel("training frames/s (median)")
    a1.set_title(f"{RECIPE} training: {tr['ratio']:.2f}x")
    labels, reuse, naive = [], [], []
    for s in result["sampling"]:
        for n, o in s["obs"].items():
            labels.append(f"{s['label']}\n{n} obs")
            reuse.append(o["reuse_s"] * 1e3)
            naive.append(o["naive_s"] * 1e3)
    x = range(len(labels))
    a2.bar([i - 0.2 for i in x], naive, 0.4, label="prefix every step", color="tab:gray")
    a2.bar([i + 0.2 for i in x], reuse, 0.4, label="prefix K/V reused", color="tab:blue")
    for i in x:
        a2.text(i, max(naive[i], reuse[i]) * 1.03, f"{naive[i] / reuse[i]:.1f}x", ha="center", fontsize=8)
    a2.set_xticks(list(x), labels, fontsize=8)
    a2.set_ylabel("ms per call (median)")
    a2.set_yscale("log")
    a2.set_title(f"sampling, {result['settings']['num_steps']} Euler steps")
    a2.legend(fontsize=8)
    save(fig, path, grid=(a1, a2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help=QUICK_HELP)
    p.add_argument("--episodes", type=int, default=300, help="expert episodes recorded (~4 frames each)")
    p.add_argument("--max-len", type=int, default=1024, help="data.max_len: the packed rows' capacity")
    p.add_argument("--global-batch", type=int, default=4, help="packed rows per step (single: as many frames)")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per training run")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each run left out")
    p.add_argument("--repeats", type=int, default=3, help="training runs per arm")
    p.add_argument("--obs", type=int, nargs="+", default=[1, 8], help="observations per sampling call")
    p.add_argument("--num-steps", type=int, default=10, help="Euler steps per sampling call")
    p.add_argument("--sample-repeats", type=int, default=20, help="timed calls per sampling arm")
    p.add_argument("--no-wide", dest="wide", action="store_false", help="skip the wider backbone's sampling")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (train.cpu_threads, sampling)")
    p.add_argument("--work", default=None, help="data and runs (default bench/out/vla_work; --quick: a temp dir)")
    p.add_argument("--out", type=Path, default=Path("bench/out"), help="result files go here")
    args = p.parse_args(argv)
    if args.quick:
        note("20 episodes, 3 steps, 1 repeat, 2 sampling calls")
        args.episodes, args.steps, args.warmup, args.repeats, args.global_batch = 20, 3, 1, 1, 1
        args.obs, args.sample_repeats = [1, 2], 2
    args.work = work_dir(args.work, args.quick, str(args.out / "vla_work"))
    result = run(args)
    text = table(result)
    print(text)
    write_results(args.out, "vla", text, result, lambda path: plot(result, path),
                  f"{args.episodes} episodes, max_len {args.max_len}, packed global batch {args.global_batch}, "
                  f"{args.steps} steps (first {args.warmup} left out), {args.repeats} repeats, {args.num_steps} Euler "
                  f"steps, {args.sample_repeats} sampling calls, threads {args.threads}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
