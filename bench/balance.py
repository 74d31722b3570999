"""Benchmark: data-parallel load balancing of packs (``omniweave.parallel.balance``).

Simulated (default): a realistic multimodal mixture packed to a fixed capacity with our packer,
then for 8, 64 and 512 DP ranks (``--per-rank`` packs per rank per step, ``--steps`` steps of a
seeded epoch stream, like ``PackedLoader``) the predicted cost of every rank under the FLOP model
of ``--recipe`` (Qwen2.5-VL-7B). Arms: the contiguous split (no balancing), balancing by Σ len²
only (the previous rule, ``CostModel.default()``), and balancing by the FLOP cost model. Reported:
max/mean rank cost per step (median, p90; the step waits for the max rank), the predicted step
time vs contiguous, and per step the time for the G packs' features (from their records) and
for ``assign``.

Measured (``--measure``): ``omniweave train demo --nproc 4`` on CPU (gloo) on a small packed
text dataset with mixed document lengths (``bench/train.py``'s lognormal mixture, 2048-token
packs), ``data.balance=cost`` vs the default, runs interleaved; median ``step_s`` of rank 0
(it waits for the slowest rank in every collective).

    python bench/balance.py [--samples 300000] [--steps 50] [--per-rank 4] [--dp 8 64 512]
    python bench/balance.py --measure [--measure-steps 8] [--repeats 2]

``--quick`` (bench/quick.py): 20K samples, dp 4 and 16, 5 steps; measured on 2 ranks (not 4), 24
samples, 3 steps, 1 repeat; not meaningful figures.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repo, also when run as a plain script

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from omniweave.data.packing import bins as P  # noqa: E402
from omniweave.parallel.balance import CostModel, assign, imbalance, pack_features, round_robin  # noqa: E402
from figure import pyplot, save  # noqa: E402
from quick import HELP as QUICK_HELP, note, work_dir  # noqa: E402  (bench/, the script's folder)

ARMS = ("contiguous", "Σlen² only", "cost model")


# ------------------------------------------------------------------------------ simulated


def mixture(samples: int, capacity: int, seed: int) -> tuple[list[dict], np.ndarray]:
    """Pack records (docs + media grids) of bfd packs and their features [K, F].

    60 % text chats: lognormal tokens, median 300 (sigma 0.7). 30 % single images: h, w patches
    lognormal median 20 (280 px, sigma 0.3, even), ~400 patches -> /4 vision tokens, + ~150 text
    tokens. 10 % videos: 256 patches per frame (224 px), temporal patches lognormal median 24
    (sigma 0.5) -> ~1500 vision tokens, tail to the capacity, + ~100 text tokens."""
    rng = np.random.default_rng(seed)
    kind = rng.choice(3, samples, p=[0.6, 0.3, 0.1])
    text = np.clip(rng.lognormal(np.log(np.array([300, 150, 100]))[kind], 0.7), 16, capacity).astype(np.int64)
    side = lambda med, sigma: 2 * np.clip(np.rint(rng.lognormal(np.log(med / 2), sigma, samples)), 4, 32)  # noqa: E731
    h, w = side(20, 0.3), side(20, 0.3)
    t = np.clip(np.rint(rng.lognormal(np.log(24), 0.5, samples)), 2, 128)
    grid = np.where((kind == 1)[:, None], np.stack([np.ones(samples), h, w], 1), 0)
    grid = np.where((kind == 2)[:, None], np.stack([t, np.full(samples, 16), np.full(samples, 16)], 1), grid)
    grid = grid.astype(np.int64)
    length = text + grid.prod(1) // 4
    keep = length <= capacity
    length, grid = length[keep], grid[keep]
    plan = P.pack(length, capacity)
    records = [{"docs": [{"length": int(length[i])} for i in items],
                "media": [{"grid_thw": grid[i].tolist()} for i in items if grid[i, 0]]} for items in plan.packs()]
    print(f"mixture: {keep.sum():,} samples (of {samples:,}; {(~keep).sum()} over capacity) -> {plan.num_packs:,} packs "
          f"of <= {capacity}, efficiency {plan.efficiency(length):.3%}", flush=True)
    return records, np.stack([pack_features(r) for r in records])


def simulate(records: list[dict], features: np.ndarray, flops: CostModel, dp: int, per_rank: int, steps: int,
             seed: int) -> dict:
    """Per step: max/mean of each arm under the FLOP model; seconds for the features of the G
    records (+ cost) and for ``assign`` with the FLOP model."""
    G, n = dp * per_rank, len(features)
    stream = np.concatenate([np.random.default_rng([seed, e]).permutation(n) for e in range(steps * G // n + 1)])
    models = {"Σlen² only": CostModel.default(), "cost model": flops}
    res = {arm: [] for arm in ARMS} | {"features_s": [], "assign_s": []}
    for s in range(steps):
        ids = stream[s * G : (s + 1) * G]
        true = flops.cost(features[ids])
        res["contiguous"].append(imbalance(true, round_robin(G, dp)))
        for arm, model in models.items():
            t0 = time.perf_counter()
            costs = model.cost(np.stack([pack_features(records[i]) for i in ids]))
            t1 = time.perf_counter()
            groups = assign(costs, dp)
            if arm == "cost model":
                res["features_s"].append(t1 - t0)
                res["assign_s"].append(time.perf_counter() - t1)
            res[arm].append(imbalance(true, groups))
    return res


def summarize(dp: int, res: dict) -> dict:
    row = {"dp": dp}
    for arm in ARMS:
        x = np.array(res[arm])
        row[arm] = {"median": float(np.median(x)), "p90": float(np.percentile(x, 90)), "max": float(x.max())}
    ratio = np.array(res["cost model"]) / np.array(res["contiguous"])  # predicted step time vs contiguous
    row["step_time_vs_contiguous"] = float(np.mean(ratio))
    for key in ("features", "assign"):
        x = 1e3 * np.array(res[f"{key}_s"])
        row[f"{key}_ms"] = {"median": float(np.median(x)), "p90": float(np.percentile(x, 90))}
    return row


# ------------------------------------------------------------------------------ measured


def measure(args, ranks: int = 4) -> dict:
    """``ranks``-rank CPU training, data.balance=cost vs default, runs interleaved."""
    from bench.train import make_jsonl
    from omniweave.config import load_recipe, to_dict
    from omniweave.data.loading.loader import PackedLoader

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    (work / "media").mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    om = lambda *a: subprocess.run([sys.executable, "-m", "omniweave", *a], env=env, check=True,  # noqa: E731
                                   capture_output=True, text=True)
    make_jsonl(work / "sft.jsonl", args.measure_samples, args.measure_len, args.seed)
    om("data", "convert", "--input", str(work / "sft.jsonl"), "--media-dir", str(work / "media"),
       "--output", str(work / "raw"), "--workers", "1", "--no-progress")
    om("data", "pack", "--input", str(work / "raw"), "--output", str(work / "packed"), "--recipe", "demo",
       "--max-len", str(args.measure_len), "--workers", "1")
    G = ranks * args.measure_per_rank
    overrides = [f"data.path={work / 'packed'}", f"data.max_len={args.measure_len}", f"train.steps={args.measure_steps}",
                 f"train.global_batch={G}", f"train.seed={args.seed}", "train.save_interval=0", "train.log_interval=1",
                 "train.warmup=0", "train.eval_interval=0", "train.cpu_threads=1"]
    model_cfg = to_dict(load_recipe("demo", overrides).model)
    flops = CostModel.from_model_config(model_cfg)
    loaders = {arm: PackedLoader(work / "packed", G, 0, ranks, seed=args.seed, balance=b, cost_model=CostModel.default())
               for arm, b in (("default", None), ("balance=cost", "cost"))}
    ds = loaders["default"].dataset
    feats = np.stack([pack_features(ds.record(i)) for i in range(len(ds))])
    pack_s = pack_seconds(model_cfg, ds, args.seed)
    refit = flops.refit(feats, pack_s)
    batches, epoch, cursor = [], 0, 0
    for _ in range(args.measure_steps):
        ids, epoch, cursor = loaders["default"].global_batch_ids(epoch, cursor)
        batches.append(ids)
    predicted, replay = {arm: [] for arm in loaders}, {arm: [] for arm in (*loaders, "balance=cost, refitted")}
    for ids in batches:  # the batches the runs see: predicted (demo FLOP model) and replayed max/mean
        costs, secs = flops.cost(feats[ids]), pack_s[ids]
        for arm, ld in loaders.items():
            groups = [[ids.index(i) for i in share] for share in ld.assignment(ids)]
            predicted[arm].append(imbalance(costs, groups))
            replay[arm].append(imbalance(secs, groups))
        replay["balance=cost, refitted"].append(imbalance(secs, assign(refit.cost(feats[ids]), ranks)))
    fit_err = {name: affine_error(cm.cost(feats), pack_s)
               for name, cm in (("flop", flops), ("default", CostModel.default()), ("refit", refit))}
    steps = {arm: [] for arm in loaders}
    for rep in range(args.repeats):
        for arm in loaders:
            run_dir = work / f"run-{rep}-{arm.split('=')[-1]}"
            extra = ["data.balance=cost"] if arm != "default" else []
            t0 = time.perf_counter()
            om("train", "demo", f"output_dir={run_dir}", *overrides, *extra, "--nproc", str(ranks))
            recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
            steps[arm].append([r["step_s"] for r in recs if r["step"] > args.warmup])
            print(f"  repeat {rep + 1} {arm}: {time.perf_counter() - t0:.0f} s, step_s "
                  f"{[round(r['step_s'], 2) for r in recs]}", flush=True)
    return {"global_batch": G, "packs": len(ds), "predicted": predicted, "replay": replay, "step_s": steps,
            "median_step_s": {arm: statistics.median(sum(v, [])) for arm, v in steps.items()},
            "per_repeat_ratio": [statistics.median(c) / statistics.median(d)
                                 for c, d in zip(steps["balance=cost"], steps["default"])],
            "pack_s": pack_s.tolist(),
            "fit_median_rel_err": fit_err, "refit": refit.to_dict(), "flops": flops.to_dict()}


def affine_error(cost: np.ndarray, seconds: np.ndarray) -> float:
    """Median |relative error| of seconds ≈ α·cost + β (a per-pack constant is the same on every
    rank, which all run as many packs: it does not matter for balancing)."""
    fit = np.column_stack([cost, np.ones_like(cost)]) @ np.linalg.lstsq(
        np.column_stack([cost, np.ones_like(cost)]), seconds, rcond=None)[0]
    return float(np.median(np.abs(fit / seconds - 1)))


def pack_seconds(model_cfg: dict, ds, seed: int, repeats: int = 3) -> np.ndarray:
    """Forward + backward seconds of every pack on the demo model, one process, one thread (min of
    ``repeats``, after one warm-up pack): what each pack costs a rank, free of the 4-rank contention."""
    import torch

    from omniweave.data.loading.loader import collate_pack
    from omniweave.models.registry import build_model

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = build_model(model_cfg)
    model.init_weights()
    batches = [collate_pack(ds[i], ds.manifest["data_cfg"]) for i in range(len(ds))]
    best = np.full(len(ds), np.inf)
    for i in [0] + [i for _ in range(repeats) for i in range(len(ds))]:
        t0 = time.perf_counter()
        model(batches[i]).loss_sum.backward()
        best[i] = min(best[i], time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    return best


# ------------------------------------------------------------------------------ report


def plot(path: Path, results: dict[int, dict], per_rank: int) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.8), sharey=True)
    for ax, (dp, res) in zip(np.atleast_1d(axes), results.items()):
        for arm, style in zip(ARMS, ("-", "--", "-")):
            ax.plot(range(1, len(res[arm]) + 1), res[arm], style, lw=1.3, label=arm)
        ax.axhline(1.05, color="gray", lw=0.8, ls=":", label="1.05")
        ax.set(title=f"dp = {dp} ({per_rank} packs per rank)", xlabel="step")
    np.atleast_1d(axes)[0].set_ylabel("predicted max / mean rank cost")
    np.atleast_1d(axes)[0].legend(fontsize=8)
    save(fig, path, grid=np.atleast_1d(axes), dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=300_000, help="mixture samples to pack")
    p.add_argument("--capacity", type=int, default=8192)
    p.add_argument("--dp", type=int, nargs="+", default=[8, 64, 512])
    p.add_argument("--per-rank", type=int, default=4, help="packs per rank per step")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--recipe", default="qwen2_5_vl_7b", help="recipe whose model gives the FLOP cost model")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--measure", action="store_true", help="also the measured 4-rank CPU training comparison")
    p.add_argument("--measure-samples", type=int, default=160)
    p.add_argument("--measure-len", type=int, default=2048)
    p.add_argument("--measure-per-rank", type=int, default=4)
    p.add_argument("--measure-steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2, help="first steps of every measured run left out")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--work", help="scratch folder of --measure (default /tmp/omniweave-bench-balance)")
    p.add_argument("--out", type=Path, default=Path("bench/out"), help="every result file goes here (and only here)")
    p.add_argument("--quick", action="store_true", help=QUICK_HELP + ": 20K samples, dp 4 and 16; measured on 2 ranks")
    args = p.parse_args()
    if args.quick:
        args.samples, args.dp, args.per_rank, args.steps = 20_000, [4, 16], 4, 5
        args.measure_samples, args.measure_len, args.measure_per_rank, args.measure_steps = 24, 512, 1, 3
        args.warmup, args.repeats = 1, 1
        note("20K samples, dp 4 and 16, 5 steps; measured: 2 ranks, 24 samples, 3 steps, 1 repeat")
    args.work = work_dir(args.work, args.quick, "/tmp/omniweave-bench-balance")
    from omniweave.config import load_recipe, to_dict

    flops = CostModel.from_model_config(to_dict(load_recipe(args.recipe, ["data.path=unused"]).model))
    print(f"FLOP cost model of {args.recipe}: {flops.to_dict()}", flush=True)
    records, features = mixture(args.samples, args.capacity, args.seed)
    share = features * flops.coefficients
    print("share of predicted cost: " + ", ".join(f"{n} {x:.1%}" for n, x in
          zip(("attention Σlen²", "decoder tokens", "documents", "ViT patches²", "ViT patches"), share.sum(0) / share.sum())))
    results, rows = {}, []
    for dp in args.dp:
        results[dp] = simulate(records, features, flops, dp, args.per_rank, args.steps, args.seed)
        rows.append(summarize(dp, results[dp]))
    print(f"\npredicted max/mean rank cost per step ({args.steps} steps, {args.per_rank} packs per rank, "
          f"FLOP model of {args.recipe}); median / p90")
    print("| dp | packs/step | contiguous | Σlen² only | cost model | step time vs contiguous | features ms | assign ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cells = " | ".join(f"{r[a]['median']:.3f} / {r[a]['p90']:.3f}" for a in ARMS)
        print(f"| {r['dp']} | {r['dp'] * args.per_rank} | {cells} | {r['step_time_vs_contiguous']:.3f} | "
              f"{r['features_ms']['median']:.1f} / {r['features_ms']['p90']:.1f} | "
              f"{r['assign_ms']['median']:.1f} / {r['assign_ms']['p90']:.1f} |")
    ranks = 2 if args.quick else 4
    measured = measure(args, ranks) if args.measure else None
    if measured:
        m = measured
        print(f"\nmeasured: omniweave train demo --nproc {ranks} (CPU, gloo), {m['packs']} packs of <= {args.measure_len}, "
              f"global batch {m['global_batch']}, steps {args.warmup + 1}..{args.measure_steps} of {args.repeats} "
              "interleaved runs per arm")
        print("| arm | predicted max/mean (median) | replayed max/mean (median) | median step s | step s vs default |")
        print("|---|---:|---:|---:|---:|")
        base = m["median_step_s"]["default"]
        for arm, rep in m["replay"].items():
            med = m["median_step_s"].get(arm)
            pred = statistics.median(m["predicted"][arm]) if arm in m["predicted"] else None
            print(f"| {arm} | {'—' if pred is None else f'{pred:.3f}'} | {statistics.median(rep):.3f} | "
                  f"{'—' if med is None else f'{med:.2f}'} | {'—' if med is None else f'{med / base:.3f}'} |")
        print("balance=cost / default, median step s per interleaved repeat: "
              + ", ".join(f"{x:.3f}" for x in m["per_repeat_ratio"]))
        err = m["fit_median_rel_err"]
        print(f"per-pack forward+backward seconds (one process, one thread): {min(m['pack_s']):.3f}..{max(m['pack_s']):.3f};"
              f" median |relative error| of α·cost + β: FLOP model {err['flop']:.1%}, Σlen² only "
              f"{err['default']:.1%}, refit {err['refit']:.1%}; refit {m['refit']}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "balance.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "cost_model": flops.to_dict(), "rows": rows,
         "per_step": {str(dp): res for dp, res in results.items()}, "measured": measured}, indent=1))
    plot(args.out / "balance.png", results, args.per_rank)  # docs/benchmarks/ gets a copy by hand, never a write
    print(f"wrote {args.out / 'balance.png'} and {args.out / 'balance.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
