"""Benchmark: offline packing — plan time, packing efficiency against common baselines, and
``omniweave data pack`` end to end on the demo dataset.

1. Plan time of ``omniweave.data.packing.bins`` on 1M and 10M synthetic sample lengths (a lognormal
   mixture of text ~300, image ~900 and video ~3000 tokens, 60/30/10 %), one thread.
2. Efficiency (real tokens / tokens of all packs or padded batches) on the same 1M lengths at
   capacity 8K and 32K: padding to the longest of a fixed-size batch, sorted greedy (sort by
   length, next-fit), our ``bfd`` / ``balanced`` / ``sequential``, and TRL's ``pack_dataset``
   (bfd) when ``trl`` is importable. Also the spread of attention cost (sum of len² per pack).
3. ``omniweave data demo`` → ``data convert`` → ``data pack --max-len 4096`` with each pack phase
   (scan, plan, write) a fresh process: seconds per phase, samples/s, efficiency.

    python bench/pack.py [--sizes 1000000 10000000] [--repeats 3] [--demo-samples 8000] [--quick]

``--quick`` (bench/quick.py): 20K lengths, 1 repeat, 200 demo samples at --max-len 1024; not meaningful figures.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# One core for the plan-time numbers (numpy / BLAS must not use a second thread).
for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo, also when run as a plain script

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from omniweave.data.packing import bins as P  # noqa: E402
from figure import pyplot, save  # noqa: E402
from quick import HELP as QUICK_HELP, note, work_dir  # noqa: E402  (bench/, the script's folder)

CAPACITIES = (8192, 32768)
# The packing algorithms compared here (P.ALGORITHMS also has "single", one sample per pack for
# RL prompts: nothing to plan or compare).
ALGORITHMS = ("bfd", "balanced", "sequential")


def lognormal_mixture(n: int, capacity: int, seed: int = 0) -> np.ndarray:
    """Text (~300), image (~900) and video (~3000) sample lengths, clipped to the capacity
    (the same generator as tests/test_packing.py)."""
    rng = np.random.default_rng(seed)
    kind = rng.choice(3, n, p=[0.6, 0.3, 0.1])
    mu = np.log(np.array([300, 900, 3000]))[kind]
    return np.clip(rng.lognormal(mu, 0.8), 1, capacity).astype(np.int64)


# ------------------------------------------------------------------------------ baselines

def padding_to_longest(lengths: np.ndarray, capacity: int, grouped: bool = False) -> dict:
    """Fixed batches of B = capacity // mean length samples (one pack's token budget on average),
    each padded to its longest sample; in dataset order, or ``grouped`` by length (sorted first,
    like ``group_by_length`` samplers; batches of similar lengths, in practice shuffled)."""
    b = max(1, int(capacity // lengths.mean()))
    n = len(lengths) // b * b
    batches = (np.sort(lengths) if grouped else lengths)[:n].reshape(-1, b)
    padded = batches.max(axis=1) * b
    return {"efficiency": float(batches.sum() / padded.sum()), "rows": len(batches), "batch": b}


def sorted_greedy(lengths: np.ndarray, capacity: int) -> P.PackPlan:
    """Sort by length (longest first), then next-fit: a new pack when the next one does not fit."""
    order = np.argsort(-lengths, kind="stable")
    plan = P.sequential(lengths[order], capacity)
    return P.PackPlan(order[plan.items], plan.offsets, order[plan.dropped], plan.capacity)


def trl_bfd(lengths: np.ndarray, capacity: int, limit: int) -> dict | str:
    """TRL's ``pack_dataset(..., strategy="bfd")`` on the first ``limit`` lengths (it needs the
    token lists themselves, so the full 1M rows would not fit in memory here)."""
    if importlib.util.find_spec("trl") is None:
        return "not installed"
    try:
        from datasets import Dataset
        from trl import pack_dataset

        x = lengths[:limit]
        ds = Dataset.from_dict({"input_ids": [[1] * int(n) for n in x]})
        t0 = time.perf_counter()
        packed = pack_dataset(ds, capacity, strategy="bfd")
        seconds = time.perf_counter() - t0
        real = sum(len(r) for r in packed["input_ids"])
        return {"efficiency": real / (len(packed) * capacity), "rows": len(packed), "seconds": seconds, "n": len(x)}
    except Exception as e:  # noqa: BLE001  (an API change in TRL must not stop the benchmark)
        return f"failed: {type(e).__name__}: {e}"


# ------------------------------------------------------------------------------ sections

def median_time(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def plan_times(sizes: list[int], repeats: int, slow_up_to: int) -> list[dict]:
    """bfd at every size and capacity; balanced / sequential only up to ``slow_up_to`` samples."""
    rows = []
    for n in sizes:
        for cap in CAPACITIES:
            x = lognormal_mixture(n, cap)
            for algo in ALGORITHMS:
                if algo != "bfd" and n > slow_up_to:
                    continue
                reps = repeats if algo == "bfd" or n <= 100_000 else 1
                s, plan = median_time(lambda: P.pack(x, cap, algo), reps)
                rows.append({"algorithm": algo, "n": n, "capacity": cap, "seconds": s, "repeats": reps,
                             "packs": plan.num_packs, "efficiency": plan.efficiency(x)})
                print(f"  plan {algo:<10} n={n:>10,} capacity={cap:>6}: {s:7.3f} s (median of {reps}), "
                      f"{plan.num_packs:,} packs, efficiency {plan.efficiency(x):.4%}", flush=True)
    return rows


def efficiency_table(n: int, trl_limit: int) -> list[dict]:
    rows = []
    for cap in CAPACITIES:
        x = lognormal_mixture(n, cap)
        bound = int(np.ceil(x.sum() / cap))
        for grouped in (False, True):
            pad = padding_to_longest(x, cap, grouped)
            rows.append({"method": "padding, length-grouped" if grouped else "padding to longest",
                         "batch": pad["batch"], "capacity": cap, "efficiency": pad["efficiency"],
                         "rows": pad["rows"], "cv": None})
        plans = {"sorted greedy (next-fit)": sorted_greedy(x, cap)}
        for algo in ALGORITHMS:
            plans[f"omniweave {algo}"] = P.pack(x, cap, algo)
        for name, plan in plans.items():
            spread = P.cost_spread(plan.costs(x))
            rows.append({"method": name, "capacity": cap, "efficiency": plan.efficiency(x), "rows": plan.num_packs,
                         "cv": spread["cv"], "max_over_mean": spread["max_over_mean"]})
        trl = trl_bfd(x, cap, trl_limit)
        if isinstance(trl, dict):
            rows.append({"method": f"TRL pack_dataset bfd ({trl['n']:,} samples)", "capacity": cap,
                         "efficiency": trl["efficiency"], "rows": trl["rows"], "cv": None})
        else:
            rows.append({"method": "TRL pack_dataset bfd", "capacity": cap, "efficiency": None, "rows": None,
                         "cv": None, "note": trl})
        for r in rows:
            if r["capacity"] == cap:
                r["lower_bound_packs"] = bound
    return rows


def run_cli(args: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "omniweave", *args], check=True, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def demo_pack(samples: int, workers: int, max_len: int, work: Path) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    recipe = work / "recipe.yaml"
    recipe.write_text(f"data: {{tokenizer: demo, template: chatml, max_len: {max_len}, truncation: drop, rope: mrope,"
                      " vision: {min_pixels: 3136, video_min_pixels: 3136}}\n")
    res = {"samples": samples, "workers": workers, "max_len": max_len}
    res["demo_s"] = run_cli(["data", "demo", str(work / "demo"), "--samples", str(samples), "--eval-samples", "0"])
    res["convert_s"] = run_cli(["data", "convert", "--input", str(work / "demo/train.jsonl"), "--media-dir",
                                str(work / "demo/media"), "--output", str(work / "raw"), "--workers", str(workers),
                                "--no-progress"])
    base = ["data", "pack", "--input", str(work / "raw"), "--output", str(work / "packed"), "--recipe", str(recipe),
            "--workers", str(workers)]
    for phase in ("scan", "plan", "write"):
        res[f"{phase}_s"] = run_cli([*base, "--phase", phase])
    res["pack_s"] = res["scan_s"] + res["plan_s"] + res["write_s"]
    stats = json.loads((work / "packed/stats.json").read_text())
    res.update(samples_per_s=samples / res["pack_s"], efficiency=stats["efficiency"], packs=stats["packs"],
               real_tokens=stats["real_tokens"], plan_seconds=stats["plan_seconds"],
               optimal_packs=int(np.ceil(stats["real_tokens"] / max_len)),
               mean_sample_len=stats["sample_length"]["mean"], dropped=stats["dropped_total"])
    return res


# ------------------------------------------------------------------------------ report

def fmt_pct(x) -> str:
    return "—" if x is None else f"{100 * x:.3f}%"


def print_tables(times: list[dict], eff: list[dict], demo: dict | None) -> None:
    print("\nplan time (one thread)")
    print(f"| {'algorithm':<10} | {'samples':>10} | {'capacity':>8} | {'seconds':>8} | {'packs':>9} | {'efficiency':>10} |")
    print(f"|{'-' * 12}|{'-' * 11}:|{'-' * 9}:|{'-' * 9}:|{'-' * 10}:|{'-' * 11}:|")
    for r in times:
        print(f"| {r['algorithm']:<10} | {r['n']:>10,} | {r['capacity']:>8} | {r['seconds']:8.3f} | {r['packs']:>9,} "
              f"| {fmt_pct(r['efficiency']):>10} |")
    for cap in CAPACITIES:
        rows = [r for r in eff if r["capacity"] == cap]
        print(f"\nefficiency at capacity {cap} ({rows[0]['lower_bound_packs']:,} packs is the lower bound "
              "ceil(Σlen / capacity))")
        print(f"| {'method':<36} | {'efficiency':>13} | {'rows':>9} | {'cost CV':>7} | {'max/mean':>8} |")
        print(f"|{'-' * 38}|{'-' * 14}:|{'-' * 10}:|{'-' * 8}:|{'-' * 9}:|")
        for r in rows:
            name = f"{r['method']} (batch {r['batch']})" if "batch" in r else r["method"]
            eff_s = r.get("note") or fmt_pct(r["efficiency"])
            cv = "—" if r["cv"] is None else f"{r['cv']:.3f}"
            mm = "—" if r.get("max_over_mean") is None else f"{r['max_over_mean']:.2f}"
            rows_s = "—" if r["rows"] is None else f"{r['rows']:,}"
            print(f"| {name:<36} | {eff_s:>13} | {rows_s:>9} | {cv:>7} | {mm:>8} |")
        bfd = next(r for r in rows if r["method"] == "omniweave bfd")
        bal = next(r for r in rows if r["method"] == "omniweave balanced")
        print(f"balanced vs bfd attention-cost CV: {bal['cv']:.3f} vs {bfd['cv']:.3f} "
              f"({bal['cv'] / bfd['cv']:.2f}x)")
    if demo:
        d = demo
        print(f"\nomniweave data pack on the demo dataset: {d['samples']} samples (mean {d['mean_sample_len']:.1f} tokens), "
              f"--max-len {d['max_len']}, --workers {d['workers']}; every phase a fresh process (start-up and "
              f"imports included; the packing algorithm itself took {d['plan_seconds']:.3f} s of the plan phase)")
        print("| scan s | plan s | write s | pack s | samples/s | packs (optimal) | efficiency |")
        print("|-------:|-------:|--------:|-------:|----------:|----------------:|-----------:|")
        print(f"| {d['scan_s']:6.2f} | {d['plan_s']:6.2f} | {d['write_s']:7.2f} | {d['pack_s']:6.2f} | "
              f"{d['samples_per_s']:9.0f} | {d['packs']:>6} ({d['optimal_packs']}) | {fmt_pct(d['efficiency']):>10} |")


def plot(path: Path, times: list[dict], eff: list[dict], demo: dict | None) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3 if demo else 2, figsize=(15 if demo else 10, 4))
    ax = axes[0]
    labels = [f"{r['algorithm']} {r['n'] / 1e6:g}M @{r['capacity'] // 1024}K" for r in times]
    colors = {"bfd": "#4477aa", "balanced": "#228833", "sequential": "#aa3377"}
    ax.barh(range(len(times)), [r["seconds"] for r in times], color=[colors[r["algorithm"]] for r in times])
    ax.set_yticks(range(len(times)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set(xlabel="seconds (one thread, log scale)", title="packing plan time")
    for i, r in enumerate(times):
        ax.text(r["seconds"], i, f" {r['seconds']:.2f} s", va="center", fontsize=8)
    ax.set_xlim(right=max(r["seconds"] for r in times) * 8)
    ax = axes[1]
    methods = list(dict.fromkeys(r["method"] for r in eff if r["efficiency"] is not None))
    width = 0.38
    for j, cap in enumerate(CAPACITIES):
        vals = [next((r["efficiency"] for r in eff if r["method"] == m and r["capacity"] == cap), 0) or 0
                for m in methods]
        ax.barh(np.arange(len(methods)) + (j - 0.5) * width, [100 * v for v in vals], width, label=f"capacity {cap}")
    ax.set_yticks(range(len(methods)), [m.replace("omniweave ", "") for m in methods], fontsize=8)
    ax.invert_yaxis()
    ax.set(xlabel="efficiency % (real / all tokens)", title="efficiency, 1M lognormal-mixture lengths")
    ax.set_xlim(0, 118)
    for j, cap in enumerate(CAPACITIES):
        for i, m in enumerate(methods):
            v = next((r["efficiency"] for r in eff if r["method"] == m and r["capacity"] == cap), None)
            if v is not None:
                ax.text(100 * v, i + (j - 0.5) * width, f" {100 * v:.1f}", va="center", fontsize=7)
    ax.legend(fontsize=8, loc="upper right")
    if demo:
        ax = axes[2]
        left = 0.0
        for phase, color in (("scan", "#4477aa"), ("plan", "#ccbb44"), ("write", "#cc6677")):
            ax.barh([0], [demo[f"{phase}_s"]], left=left, color=color, label=f"{phase} {demo[f'{phase}_s']:.1f} s")
            left += demo[f"{phase}_s"]
        ax.set_yticks([0], [f"{demo['samples']} demo samples"])
        ax.set(xlabel="seconds (each phase a fresh process)",
               title=f"data pack (demo): {demo['samples_per_s']:.0f} samples/s, {100 * demo['efficiency']:.2f}%")
        ax.legend(fontsize=8)
    save(fig, path)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000], help="sample counts for plan time")
    p.add_argument("--slow-up-to", type=int, default=1_000_000, help="largest size for balanced / sequential")
    p.add_argument("--eff-samples", type=int, default=1_000_000, help="sample count of the efficiency table")
    p.add_argument("--trl-samples", type=int, default=100_000, help="lengths handed to TRL (it needs token lists)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--demo-samples", type=int, default=8000, help="0 skips the end-to-end run")
    p.add_argument("--demo-workers", type=int, default=2)
    p.add_argument("--max-len", type=int, default=4096, help="pack capacity of the end-to-end run")
    p.add_argument("--quick", action="store_true", help=QUICK_HELP + ": 20K lengths, 200 demo samples")
    p.add_argument("--work", help="scratch folder of the end-to-end run (default /tmp/omniweave-bench-pack)")
    p.add_argument("--out", default="bench/out")
    args = p.parse_args()
    if args.quick:
        args.sizes, args.slow_up_to, args.eff_samples, args.trl_samples = [20_000], 20_000, 20_000, 2_000
        args.repeats, args.demo_samples, args.max_len = 1, min(args.demo_samples, 200), min(args.max_len, 1024)
        note("20K lengths, 1 repeat, 200 demo samples at --max-len 1024")
    args.work = work_dir(args.work, args.quick, "/tmp/omniweave-bench-pack")

    print(f"plan time: sizes {args.sizes}, capacities {CAPACITIES}, os.cpu_count()={os.cpu_count()}", flush=True)
    times = plan_times(args.sizes, args.repeats, args.slow_up_to)
    print(f"efficiency: {args.eff_samples:,} lengths", flush=True)
    eff = efficiency_table(args.eff_samples, args.trl_samples)
    demo = None
    if args.demo_samples:
        print(f"end to end: {args.demo_samples} demo samples under {args.work}", flush=True)
        demo = demo_pack(args.demo_samples, args.demo_workers, args.max_len, Path(args.work))
    print_tables(times, eff, demo)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pack.json").write_text(json.dumps({"plan_times": times, "efficiency": eff, "demo": demo}, indent=2))
    plot(out / "pack.png", times, eff, demo)
    print(f"wrote {out / 'pack.png'} and {out / 'pack.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
