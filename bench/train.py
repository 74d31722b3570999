"""Benchmark: ``omniweave train`` on packed data vs padded batches vs a plain transformers loop.

The same samples, the same initial weights, the same optimizer (AdamW, constant lr, clip 1.0,
no weight decay) and the same number of optimizer steps in three arms; step n of every arm holds
exactly the samples of step n of the packed run, so the three loss curves must agree (checked).

- **packed**: ``omniweave train`` on the packed dataset (``global_batch`` packs of ``max_len``
  tokens per step, varlen attention per document). Timings from its ``metrics.jsonl``.
- **padded**: ``omniweave train`` again, on a dataset rewritten so that step n is the samples of
  packed step n, each right-padded to the longest of them: one row of ``B x Lmax`` tokens whose
  documents are ``Lmax`` long (pad id 0, label -100), i.e. exactly the work of a ``[B, Lmax]``
  padded batch, through the same trainer, loader and model code.
- **transformers**: ``Qwen2_5_VLForConditionalGeneration`` loaded from ``export_hf`` of the
  same initial weights, trained by a plain PyTorch loop on ``[B, Lmax]`` right-padded batches
  with an attention mask (SDPA), ``torch.optim.AdamW`` + ``clip_grad_norm_``.

tokens/s counts real (non-pad) tokens only. MFU = useful FLOPs / step time / measured fp32
matmul peak, useful FLOPs = 6·N·real tokens + 6·layers·hidden·Σ len² over the real samples
(``omniweave.train.metrics.step_flops``); padding is wasted work, not useful FLOPs.

    python bench/train.py [--quick] [--samples 160] [--steps 8] [--repeats 2] [--threads 1] [--out bench/out]

``--quick`` (bench/quick.py): 24 samples, 2 steps, 512-token packs, a 64 x 1 foundation, 1 repeat;
not meaningful figures.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, also when run as a plain script

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))  # bench/quick.py, also when imported as bench.train
from figure import pyplot, save  # noqa: E402
from quick import HELP as QUICK_HELP, note, work_dir  # noqa: E402

# Single-token words of the demo tokenizer (" word" -> 1 token), so length targets are exact-ish.
WORDS = ("show are there object word look green scene sky second square water count circle who why the person "
         "last few first bottom image describe yes more shows less see red one eight right small sentence static "
         "tree two triangle car clip what where three people line little frame five many how here not number "
         "shape dot dog you yellow and left top blue black color objects six ten cat center contains after when").split()
# Text-only SFT lengths: the lognormal mixture of tests/test_packing.py (short / medium / long
# answers, 60/30/10 %, sigma 0.8) with its medians (300 / 900 / 3000 at capacity 8192) halved
# for a 2048-token capacity; lengths are clipped to the capacity.
MIX_P, MIX_MEDIANS, MIX_SIGMA = (0.6, 0.3, 0.1), (150, 450, 1500), 0.8


def model_overrides(hidden: int, layers: int) -> list[str]:
    """A bigger foundation than the demo's 64 x 2 (head_dim 64, GQA 2:1), on the demo tokenizer."""
    heads = max(1, hidden // 64)
    hd = hidden // heads
    sec = [hd // 8, 3 * hd // 16, 3 * hd // 16]  # mrope_section sums to head_dim / 2
    return [f"model.foundation.hidden_size={hidden}", f"model.foundation.num_layers={layers}",
            f"model.foundation.intermediate_size={3 * hidden}", f"model.foundation.num_heads={heads}",
            f"model.foundation.num_kv_heads={max(1, heads // 2)}", f"model.foundation.mrope_section=[{sec[0]},{sec[1]},{sec[2]}]"]


def train_overrides(args) -> list[str]:
    return [f"data.max_len={args.max_len}", f"train.seed={args.seed}", "train.lr=1.0e-3", "train.warmup=0",
            "train.schedule=constant", "train.weight_decay=0.0", "train.grad_clip=1.0", "train.save_interval=0",
            "train.log_interval=1", "train.precision=fp32", "train.ac=none", *model_overrides(args.hidden, args.layers)]


# ---------------------------------------------------------------------------- data


def make_jsonl(path: Path, n: int, max_len: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    kind = rng.choice(3, n, p=MIX_P)
    target = np.clip(rng.lognormal(np.log(np.array(MIX_MEDIANS))[kind], MIX_SIGMA), 24, max_len - 8).astype(int)
    rows = []
    for t in target:
        q = " ".join(rng.choice(WORDS, 8))
        a = " ".join(rng.choice(WORDS, max(1, int(t) - 20)))  # ~20 tokens of question + chatml template
        rows.append({"messages": [{"role": "user", "content": q.capitalize() + "?"},
                                  {"role": "assistant", "content": a.capitalize() + "."}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return target.tolist()


THREADS = {"n": 1}


def child_env() -> dict:
    n = str(THREADS["n"])
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n}


def om(*argv: str) -> None:
    """``python -m omniweave ARGV`` quietly; its output is shown if it fails."""
    env = child_env()
    res = subprocess.run([sys.executable, "-m", "omniweave", *argv], env=env, capture_output=True, text=True)
    if res.returncode:
        print(res.stdout[-3000:], res.stderr[-3000:], file=sys.stderr)
        raise SystemExit(f"omniweave {' '.join(argv[:2])} failed (exit {res.returncode})")


def plan_steps(packed: Path, global_batch: int, steps: int, seed: int) -> list[list[dict]]:
    """The documents of each packed training step, in the trainer's order (its loader's stream)."""
    from omniweave.data.loading.loader import PackedLoader
    from omniweave.data.packing.packed import PackedDataset

    ds, loader = PackedDataset(packed), PackedLoader(packed, global_batch, 0, 1, seed=seed)
    epoch, cursor, plan = 0, 0, []
    for _ in range(steps):
        ids, epoch, cursor = loader.global_batch_ids(epoch, cursor)
        docs = []
        for i in ids:
            p = ds[i]
            cu = p["cu_seqlens"].tolist()
            for a, b in zip(cu[:-1], cu[1:]):
                docs.append({"input_ids": p["input_ids"][a:b].copy(), "labels": p["labels"][a:b].copy(),
                             "position_ids": p["position_ids"][:, a:b].copy()})
        plan.append(docs)
    return plan


def write_padded(packed: Path, out: Path, plan: list[list[dict]], seed: int, pad_id: int = 0) -> None:
    """A packed-format dataset whose pack k is one step of ``plan`` as a padded [B, Lmax] batch
    laid out in one row (each sample + its padding = one Lmax-long causal document). Packs are
    placed so that the trainer's loader (global_batch 1, same seed) visits them in plan order."""
    from omniweave.data.packing.packed import FORMAT, MANIFEST, atomic_write_json

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    order = np.random.default_rng([seed, 0]).permutation(len(plan))  # PackedLoader.order(0)
    step_at = np.argsort(order)  # pack k holds step step_at[k]
    records, name = [], "packs-000000"
    with open(out / f"{name}.bin", "wb") as f:
        for k in range(len(plan)):
            docs = plan[int(step_at[k])]
            lmax, R = max(len(d["input_ids"]) for d in docs), docs[0]["position_ids"].shape[0]
            ids = np.full((len(docs), lmax), pad_id, np.int32)
            labels = np.full((len(docs), lmax), -100, np.int32)
            pos = np.tile(np.arange(lmax, dtype=np.int32), (R, len(docs), 1))
            for j, d in enumerate(docs):
                n = len(d["input_ids"])
                ids[j, :n], labels[j, :n], pos[:, j, :n] = d["input_ids"], d["labels"], d["position_ids"]
            L = ids.size
            rec = {"offset": f.tell(), "length": L, "rows": R, "cu_seqlens": list(range(0, L + 1, lmax)),
                   "docs": [{"id": f"step{int(step_at[k])}-{j}", "index": j, "length": lmax, "truncated": False}
                            for j in range(len(docs))],
                   "media": [], "num_loss_tokens": int((labels != -100).sum())}
            for a in (ids.reshape(-1), labels.reshape(-1), pos.reshape(R, -1)):
                f.write(np.ascontiguousarray(a, dtype="<i4").tobytes())
            records.append(rec)
        size = f.tell()
    atomic_write_json(out / f"{name}.json", {"format": FORMAT, "bytes": size, "packs": records})
    manifest = json.loads((packed / MANIFEST).read_text())
    manifest.update(packed_shards=[{"name": name, "packs": len(records), "bytes": size}], num_packs=len(records))
    atomic_write_json(out / MANIFEST, manifest)


# ---------------------------------------------------------------------------- arms


def run_trainer(data: Path, run_dir: Path, global_batch: int, steps: int, args) -> list[dict]:
    if run_dir.exists():
        shutil.rmtree(run_dir)
    om("train", "demo", f"data.path={data}", f"output_dir={run_dir}", f"train.steps={steps}",
       f"train.global_batch={global_batch}", *train_overrides(args))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def export_initial(hf_dir: Path, args) -> tuple[int, int, int]:
    """The trainer's initial weights (same seed, same build) as a transformers directory."""
    import torch

    from omniweave.config import load_recipe, to_dict
    from omniweave.models.hf.export import export_hf
    from omniweave.models.registry import build_model
    from omniweave.train.metrics import model_flop_counts

    cfg = load_recipe("demo", train_overrides(args))
    torch.manual_seed(args.seed)  # as omniweave.train.trainer.build
    model = build_model(to_dict(cfg.model))
    model.init_weights()
    export_hf(model, to_dict(cfg.model), hf_dir, data_cfg=to_dict(cfg.data))
    return model_flop_counts(model)


def hf_child(hf_dir: str, packed: str, global_batch: int, steps: int, seed: int) -> list[dict]:
    """Plain transformers training loop on [B, Lmax] right-padded batches with an attention mask."""
    import logging

    import torch
    from omniweave.models.hf.torchvision_guard import torchvision_loads

    torchvision_loads()  # where torchvision's ops do not load beside this torch, transformers is told it is absent
    from transformers import Qwen2_5_VLForConditionalGeneration

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32,
                                                               attn_implementation="sdpa").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    batches = []
    for docs in plan_steps(Path(packed), global_batch, steps, seed):
        lmax = max(len(d["input_ids"]) for d in docs)
        ids = torch.zeros(len(docs), lmax, dtype=torch.long)
        mask = torch.zeros(len(docs), lmax, dtype=torch.long)
        labels = torch.full((len(docs), lmax), -100, dtype=torch.long)
        for j, d in enumerate(docs):
            n = len(d["input_ids"])
            ids[j, :n], mask[j, :n] = torch.from_numpy(d["input_ids"].astype(np.int64)), 1
            labels[j, 1:n] = torch.from_numpy(d["labels"][: n - 1].astype(np.int64))  # HF shifts inside
        batches.append((ids, mask, labels, int(mask.sum())))
    records = []
    for step, (ids, mask, labels, tokens) in enumerate(batches, 1):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        records.append({"step": step, "loss": loss.item(), "grad_norm": float(grad_norm), "tokens": tokens,
                        "step_s": dt, "tokens_per_s": tokens / dt})
    return records


def run_hf(hf_dir: Path, packed: Path, global_batch: int, steps: int, args, out: Path) -> list[dict]:
    env = child_env()
    cmd = [sys.executable, __file__, "--hf-child", str(hf_dir), str(packed), str(global_batch), str(steps),
           "--seed", str(args.seed), "--out", str(out)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode:
        print(res.stderr[-3000:], file=sys.stderr)
        raise SystemExit("transformers arm failed")
    return json.loads((out / "hf_records.json").read_text())


# ---------------------------------------------------------------------------- report


def summarize(name: str, runs: list[list[dict]], plan: list[list[dict]], counts, peak: float, warmup: int) -> dict:
    """Medians over the timed steps of all repeats of one arm."""
    from omniweave.train.metrics import step_flops

    real = [sum(len(d["input_ids"]) for d in docs) for docs in plan]
    lens2 = [sum(len(d["input_ids"]) ** 2 for d in docs) for docs in plan]
    computed = real if name == "packed" else [len(docs) * max(len(d["input_ids"]) for d in docs) for docs in plan]
    timed = [r for records in runs for r in records if r["step"] > warmup]
    sel = [r["step"] - 1 for r in timed]
    tps = [real[r["step"] - 1] / r["step_s"] for r in timed]
    mfu = [step_flops(counts, real[r["step"] - 1], lens2[r["step"] - 1]) / r["step_s"] / peak for r in timed]
    per_repeat = [statistics.median(real[r["step"] - 1] / r["step_s"] for r in records if r["step"] > warmup)
                  for records in runs]
    return {
        "arm": name, "steps_timed": len(timed), "samples_per_step": statistics.mean(len(plan[i]) for i in sel),
        "real_tokens_per_step": statistics.mean(real[i] for i in sel),
        "computed_tokens_per_step": statistics.mean(computed[i] for i in sel),
        "padding": 1 - sum(real[i] for i in sel) / sum(computed[i] for i in sel),
        "median_step_s": statistics.median(r["step_s"] for r in timed),
        "tokens_per_s": statistics.median(tps), "mfu": statistics.median(mfu), "tokens_per_s_per_repeat": per_repeat,
        "trainer_mfu": statistics.median(r["mfu"] for r in timed) if "mfu" in timed[0] else None,
        "losses": [r["loss"] for r in runs[0]], "all_losses": [[r["loss"] for r in rs] for rs in runs],
        "step_tokens_per_s": tps,
    }


def plot(results: list[dict], out: Path, title: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["arm"] for r in results]
    vals = [r["tokens_per_s"] for r in results]
    axes[0].barh(names, vals, color=["#2a5", "#c84", "#68c"][: len(names)])
    for i, r in enumerate(results):
        axes[0].text(vals[i], i, f" {vals[i]:.0f} ({vals[0] / vals[i]:.2f}x less)" if i else f" {vals[i]:.0f}",
                     va="center")
    axes[0].invert_yaxis()
    axes[0].set_xlim(0, max(vals) * 1.45)
    axes[0].set(xlabel="real tokens/s (median over timed steps)", title=title)
    for r, style in zip(results, ("o-", "s--", "x:")):
        axes[1].plot(range(1, len(r["losses"]) + 1), r["losses"], style, label=r["arm"])
    axes[1].set(xlabel="optimizer step", ylabel="loss", title="same samples per step: same loss")
    axes[1].legend()
    save(fig, out, grid=axes[1:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help=QUICK_HELP + ": 24 samples, 2 steps, a 64 x 1 model")
    p.add_argument("--samples", type=int, default=160)
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per arm (at most one epoch of packs)")
    p.add_argument("--repeats", type=int, default=2, help="runs of every arm, round-robin; medians pool them")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    p.add_argument("--global-batch", type=int, default=2, help="packs per step in the packed arm")
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads of every arm (1: no OpenMP oversubscription on a shared box)")
    p.add_argument("--arms", nargs="+", default=["packed", "padded", "transformers"])
    p.add_argument("--work", help="scratch folder (default /tmp/omniweave-bench-train)")
    p.add_argument("--out", type=Path, default=Path("bench/out"))
    p.add_argument("--hf-child", nargs=4, metavar=("HF_DIR", "PACKED", "GB", "STEPS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.hf_child:
        hf_dir, packed, gb, steps = args.hf_child
        records = hf_child(hf_dir, packed, int(gb), int(steps), args.seed)
        (args.out / "hf_records.json").write_text(json.dumps(records))
        return 0
    if args.quick:
        args.samples, args.steps, args.warmup, args.max_len, args.hidden, args.layers = 24, 2, 1, 512, 64, 1
        args.repeats, args.global_batch = 1, 2
        note("24 samples, 2 steps, 512-token packs, 64 x 1 model, 1 repeat")
    args.work = work_dir(args.work, args.quick, "/tmp/omniweave-bench-train")

    import torch

    from omniweave.data.packing.packed import PackedDataset

    THREADS["n"] = args.threads
    torch.set_num_threads(args.threads)
    from omniweave.train.metrics import matmul_peak_flops

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    (work / "media").mkdir(parents=True)
    t0 = time.perf_counter()
    make_jsonl(work / "sft.jsonl", args.samples, args.max_len, args.seed)
    om("data", "convert", "--input", str(work / "sft.jsonl"), "--media-dir", str(work / "media"),
       "--output", str(work / "raw"), "--workers", "1", "--no-progress", "--strict")
    om("data", "pack", "--input", str(work / "raw"), "--output", str(work / "packed"), "--recipe", "demo",
       "--max-len", str(args.max_len), "--workers", "1")
    packs = len(PackedDataset(work / "packed"))
    steps = min(args.steps, packs // args.global_batch)
    plan = plan_steps(work / "packed", args.global_batch, steps, args.seed)
    write_padded(work / "packed", work / "padded", plan, args.seed)
    counts = export_initial(work / "hf", args)
    lengths = [len(d["input_ids"]) for docs in plan for d in docs]
    print(f"{args.samples} samples -> {packs} packs of <= {args.max_len} tokens; {steps} steps x {args.global_batch} "
          f"packs use {len(lengths)} samples (lengths {min(lengths)}..{max(lengths)}, median "
          f"{statistics.median(lengths):.0f}, mean {statistics.mean(lengths):.0f}); data ready in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)

    peak = max(matmul_peak_flops(torch.device("cpu"), repeats=10) for _ in range(2))
    records: dict[str, list[list[dict]]] = {a: [] for a in args.arms}
    for rep in range(args.repeats):  # round-robin, so slow phases of the shared box hit every arm
        for arm in args.arms:
            t1 = time.perf_counter()
            if arm == "packed":
                recs = run_trainer(work / "packed", work / "run-packed", args.global_batch, steps, args)
            elif arm == "padded":
                recs = run_trainer(work / "padded", work / "run-padded", 1, steps, args)
            else:
                recs = run_hf(work / "hf", work / "packed", args.global_batch, steps, args, args.out)
            records[arm].append(recs)
            print(f"  repeat {rep + 1}/{args.repeats} {arm}: {time.perf_counter() - t1:.0f} s", flush=True)
    results = [summarize(a, records[a], plan, counts, peak, args.warmup) for a in args.arms]

    n_params, layers, hidden = counts
    ref = results[0]
    print(f"\nmodel: Qwen2.5-VL shape, foundation hidden {hidden} x {layers} layers, {n_params / 1e6:.2f}M non-embedding "
          f"params; fp32; peak {peak / 1e9:.0f} GFLOP/s (fp32 matmul, measured); torch threads "
          f"{torch.get_num_threads()}; medians over steps {args.warmup + 1}..{steps} of {args.repeats} repeat(s)")
    print("| arm | samples/step | real tokens/step | computed tokens/step | padding | median step s "
          "| real tokens/s | MFU (useful) | packed speed-up | max abs loss diff vs packed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        dl = max(abs(a - b) for losses in r["all_losses"] for a, b in zip(losses, ref["losses"]))
        r["speedup_of_first"] = ref["tokens_per_s"] / r["tokens_per_s"]
        r["max_loss_diff"] = dl
        print(f"| {r['arm']} | {r['samples_per_step']:.1f} | {r['real_tokens_per_step']:.0f} | "
              f"{r['computed_tokens_per_step']:.0f} | {100 * r['padding']:.0f}% | {r['median_step_s']:.2f} | "
              f"{r['tokens_per_s']:.0f} | {100 * r['mfu']:.1f}% | {r['speedup_of_first']:.2f}x | {dl:.1e} |")
    for r in results[1:]:
        per = [a / b for a, b in zip(ref["tokens_per_s_per_repeat"], r["tokens_per_s_per_repeat"])]
        print(f"packed / {r['arm']} per repeat: " + ", ".join(f"{x:.2f}x" for x in per))
    (args.out / "train.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "steps": steps, "peak_flops": peak, "counts": counts,
         "lengths": lengths, "results": results}, indent=1))
    plot(results, args.out / "train.png", f"hidden {hidden} x {layers}, {args.max_len}-token packs, CPU fp32")
    print(f"wrote {args.out / 'train.png'} and {args.out / 'train.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
