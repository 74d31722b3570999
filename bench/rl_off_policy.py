"""Benchmark: one step off-policy GRPO (issue 36, ``rl.rollout.off_policy``), CPU fp32, random weights.

The demo GRPO recipe (``demo_grpo``; ``--engine vllm``: ``demo_grpo_vllm``, run in the vLLM venv)
on the demo's RL prompts, four arms, each a fresh ``omniweave rl`` process of --steps steps:

    on-policy     off_policy 0: sync, sample, update, one after the other (the default)
    off-seq       off_policy 1, overlap false: the same work as on-policy, but batch k+1 is sampled
                  by θ_k before batch k's update (the sequential schedule; its results equal
                  off-overlap's bit for bit: tests/test_rl_off_policy.py)
    off-overlap   off_policy 1: batch k+1 sampled in a background thread while batch k updates
    off-overlap-none  the same with rl.rollout.correction none: the engine's (step-old) log-probs
                  as π_old, so no recompute forward over the update rows (the three arms above
                  resolve auto: none on-policy, token_tis off-policy, whose recompute costs a forward)

Reward: the fraction of vowels among a response's letters (``vowel_fraction`` below; it varies on
random weights' text, exact_match would filter every group). Figures per arm: the median over
steps 2..S-1 (step 1 of an off-policy run samples two batches, its last step none) of
the step's wall time (``step_s``), its rollout and update times and, off-policy, how long the
update then waited for the next batch (``rollout_wait_s``); medians over --repeats, the arms'
order rotating. Speed-up = on-policy step_s / the arm's. The ideal overlap is
(rollout + update) / max(rollout, update); ``train.cpu_threads`` (intra-op threads, 1 in the
recipe) decides how much of the machine each of the two threads may use.

    python bench/rl_off_policy.py [--quick] [--engine native|vllm] [--steps 6] [--repeats 3]
        [--global-batch 8] [--group-size 8] [--max-new 32] [--threads 1] [--set KEY=VALUE ...] [--out bench/out]

Prints a markdown table and writes rl_off_policy.png / .json / .md under --out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: omniweave, bench
from bench.figure import pyplot, save, write_results  # noqa: E402

ARMS = {"on-policy": {"rl.rollout.off_policy": 0},
        "off-seq": {"rl.rollout.off_policy": 1, "rl.rollout.overlap": "false"},
        "off-overlap": {"rl.rollout.off_policy": 1},
        "off-overlap-none": {"rl.rollout.off_policy": 1, "rl.rollout.correction": "none"}}
FIELDS = ("step_s", "rollout_s", "update_s", "rollout_wait_s")
REPO = Path(__file__).resolve().parents[1]


def vowel_fraction(response: str, reference: str) -> float:
    """The bench's reward: it varies on random weights' text (exact_match is 0 for every sample
    there, so every group would be filtered and nothing updated)."""
    letters = [c for c in response.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / max(len(letters), 1)


def make_prompts(root: Path, recipe: str, samples: int) -> Path:
    """``data demo`` RL prompts -> convert -> pack with the recipe (one prompt per pack)."""
    cli = [sys.executable, "-m", "omniweave", "data"]
    if not (root / "prompts").exists():
        for args in (["demo", str(root / "demo"), "--samples", "4", "--eval-samples", "4", "--rl-samples", str(samples)],
                     ["convert", "--input", str(root / "demo/rl.jsonl"), "--media-dir", str(root / "demo/media"),
                      "--output", str(root / "raw"), "--workers", "1", "--no-progress"],
                     ["pack", "--input", str(root / "raw"), "--output", str(root / "prompts"), "--recipe", recipe,
                      "--workers", "1"]):
            subprocess.run(cli + args, check=True, capture_output=True)
    return root / "prompts"


def run_arm(recipe: str, prompts: Path, out: Path, arm: str, args) -> list[dict]:
    overrides = {"data.path": prompts, "output_dir": out, "train.steps": args.steps,
                 "train.global_batch": args.global_batch, "train.save_interval": 0, "train.log_interval": 1,
                 "train.cpu_threads": args.threads, "rl.group_size": args.group_size,
                 "rl.max_new_tokens": args.max_new, "rl.ppo_epochs": 1,
                 "rl.rewards": "[{name: 'bench.rl_off_policy:vowel_fraction'}]", **ARMS[arm],
                 **dict(kv.split("=", 1) for kv in args.set)}
    cmd = [sys.executable, "-m", "omniweave", "rl", recipe, *(f"{k}={v}" for k, v in overrides.items())]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if res.returncode != 0:
        raise SystemExit(f"{arm} failed:\n{res.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summary(runs: list[list[dict]]) -> dict:
    """Per field: the median over repeats of each run's median over steps 2..S-1 (step 1 of an
    off-policy run samples two batches, its last step none)."""
    out = {}
    for key in FIELDS:
        per_run = [median(r.get(key, 0.0) for r in rows[1:-1]) for rows in runs]
        out[key] = median(per_run)
    out["reward_last"] = median(rows[-1]["reward_mean"] for rows in runs)
    return out


def run(args) -> dict:
    recipe = "demo_grpo_vllm" if args.engine == "vllm" else "demo_grpo"
    work = args.out.resolve() / "rl_off_policy_work"  # absolute: the runs start in the repository root
    prompts = make_prompts(work / recipe, recipe, samples=max(48, args.global_batch * args.steps))
    arms = list(ARMS)
    runs = {arm: [] for arm in arms}
    for rep in range(args.repeats):
        for arm in arms[rep % len(arms):] + arms[: rep % len(arms)]:
            t0 = time.perf_counter()
            rows = run_arm(recipe, prompts, work / f"{arm}_{rep}", arm, args)
            runs[arm].append(rows)
            print(f"  repeat {rep + 1} {arm}: {time.perf_counter() - t0:.0f} s, step_s "
                  f"{[round(r['step_s'], 2) for r in rows]}", flush=True)
    stats = {arm: summary(r) for arm, r in runs.items()}
    base = stats["on-policy"]["step_s"]
    for arm in arms:
        stats[arm]["speedup"] = base / stats[arm]["step_s"]
    on = stats["on-policy"]
    stats["ideal"] = (on["rollout_s"] + on["update_s"]) / max(on["rollout_s"], on["update_s"])
    return {"engine": args.engine, "recipe": recipe, "settings": vars(args) | {"out": str(args.out)}, "stats": stats,
            "runs": {arm: [[{k: r.get(k) for k in (*FIELDS, "step", "reward_mean", "rollout/staleness")} for r in rows]
                           for rows in rs] for arm, rs in runs.items()}}


def table(result: dict) -> str:
    s = result["stats"]
    lines = ["| arm | step s | rollout s | update s | wait s | speed-up vs on-policy | reward (last step) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for arm in ARMS:
        a = s[arm]
        lines.append(f"| {arm} | {a['step_s']:.3f} | {a['rollout_s']:.3f} | {a['update_s']:.3f} | "
                     f"{a['rollout_wait_s']:.3f} | {a['speedup']:.2f}x | {a['reward_last']:.3f} |")
    lines.append(f"\nideal overlap (rollout + update) / max(rollout, update) of on-policy: {s['ideal']:.2f}x")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    s = result["stats"]
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for i, arm in enumerate(ARMS):
        a = s[arm]
        ax.bar(i, 0 if arm.startswith("off-overlap") else a["rollout_s"], color="tab:orange",
               label="rollout" if i == 0 else None)
        ax.bar(i, a["update_s"], bottom=0 if arm.startswith("off-overlap") else a["rollout_s"], color="tab:blue",
               label="update" if i == 0 else None)
        ax.plot([i - 0.4, i + 0.4], [a["step_s"]] * 2, color="black", label="step (wall)" if i == 0 else None)
        ax.text(i, a["step_s"] * 1.02, f"{a['speedup']:.2f}x", ha="center", fontsize=8)
    ax.set_xticks(range(len(ARMS)), list(ARMS))
    ax.set_ylabel("seconds per step (median)")
    ax.set_title(f"one step off-policy GRPO, {result['engine']} engine (CPU)")
    ax.legend(fontsize=8)
    save(fig, path, grid=(ax,))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="4 steps, 1 repeat, tiny batch (a smoke test)")
    p.add_argument("--engine", choices=["native", "vllm"], default="native")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new", type=int, default=32, help="rl.max_new_tokens")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="recipe overrides for every arm (e.g. a wider decoder: see docs/benchmarks.md)")
    p.add_argument("--threads", type=int, default=1, help="train.cpu_threads (intra-op threads per process)")
    p.add_argument("--out", type=Path, default=Path("bench/out"), help="every result file goes here (and only here)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.repeats, args.global_batch, args.group_size, args.max_new = 4, 1, 2, 4, 8
    result = run(args)
    text = table(result)
    print(text)
    write_results(args.out, "rl_off_policy", text, result, lambda path: plot(result, path),
                  f"{args.engine} engine, {args.steps} steps, global batch {args.global_batch} x G {args.group_size}, "
                  f"{args.max_new} new tokens, cpu_threads {args.threads}, {args.repeats} repeats"
                  + (f", {' '.join(args.set)}" if args.set else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
