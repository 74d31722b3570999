"""Benchmark: one forward+backward step of omniweave's decoder vs the same transformers model.

Same config, same weights (the transformers model is saved and loaded into omniweave), same
documents. omniweave runs them as ONE packed row (varlen attention per document, chunked loss);
transformers runs them as a padded batch [D, max_len] with an attention mask (its standard way to
keep documents apart) and its own loss over full logits. Each measurement runs in a fresh
subprocess so peak memory is that step's alone (CUDA: max_memory_allocated; CPU: peak RSS growth
over the post-warm-up RSS). MFU = useful model FLOPs / step time / measured fp32 matmul peak
(useful = 6·N per real token + causal attention 6·layers·H·hd·Σ len²; padding is not useful).

On a shared CPU box, wall-clock times swing with other processes' load; ``--clock cpu`` times the
process's CPU seconds instead (``time.process_time``, all threads summed) and, with
``--threads 1``, gives per-core numbers that other load barely moves.

    python bench/model_step.py [--sizes 2048 8192 16384] [--device cpu] [--preset small] [--out bench/out]
                               [--repeats 1] [--threads N] [--clock wall|cpu] [--quick]

``--quick`` (bench/quick.py): one row of 512 tokens, the small preset, 1 repeat; not meaningful figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from omniweave.check.speed import PRESETS, document_lengths
from omniweave.train.metrics import matmul_peak_flops

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/ (also when imported)
from figure import pyplot, save  # noqa: E402
from quick import HELP as QUICK_HELP, note  # noqa: E402

CONFIG = dict(PRESETS["small"], max_position_embeddings=32768, tie_word_embeddings=False)



def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def make_step(impl: str, hf_dir: str, lens: list[int], device: torch.device, precision: str = "fp32"):
    def autocast():  # bf16: autocast over fp32 weights, as both trainers do without FSDP
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, CONFIG["vocab_size"], (sum(lens),), generator=g)
    if impl == "omniweave":
        from omniweave.models.hf.loading import load_hf

        model, _ = load_hf(hf_dir)
        model.to(device).train()
        labels = ids.roll(-1)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        labels[cu[1:] - 1] = -100
        batch = {"input_ids": ids, "labels": labels, "cu_seqlens": cu,
                 "position_ids": torch.cat([torch.arange(n) for n in lens])[None]}  # fmt: skip
        batch = {k: v.to(device) for k, v in batch.items()}

        def step():
            with autocast():
                out = model(batch)
            (out.loss_sum / out.num_tokens).backward()
    elif impl == "transformers":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="sdpa").float().to(device).train()
        width = max(lens)
        input_ids = torch.zeros(len(lens), width, dtype=torch.long)
        mask = torch.zeros(len(lens), width, dtype=torch.long)
        start = 0
        for i, n in enumerate(lens):
            input_ids[i, :n], mask[i, :n] = ids[start : start + n], 1
            start += n
        labels = input_ids.masked_fill(mask == 0, -100)
        input_ids, mask, labels = input_ids.to(device), mask.to(device), labels.to(device)

        def step():
            with autocast():
                loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
            loss.backward()
    else:  # transformers-packed-<attn>: DataCollatorWithFlattening, documents kept apart by position_ids
        from transformers import AutoModelForCausalLM, DataCollatorWithFlattening

        attn_impl = impl.removeprefix("transformers-packed-")
        model = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation=attn_impl).float().to(device).train()
        docs = ids.split(lens)
        batch = DataCollatorWithFlattening(return_flash_attn_kwargs=attn_impl == "flash_attention_2")(
            [{"input_ids": d.tolist()} for d in docs])
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}

        def step():
            with autocast():
                loss = model(**batch, use_cache=False).loss  # no cache: transformers then reads packing
            loss.backward()

    return model, step


def default_impls(device: torch.device) -> list[str]:
    """omniweave, transformers padded, and transformers packed (DataCollatorWithFlattening) with every
    attention implementation transformers can load here: its best configuration is among them."""
    import importlib.util

    attn = ["sdpa"]
    if device.type == "cuda":
        attn.append("flex_attention")
        if importlib.util.find_spec("flash_attn") is not None:
            attn.append("flash_attention_2")
    return ["omniweave", "transformers", *(f"transformers-packed-{a}" for a in attn)]


def speedups(rows: list[dict]) -> list[str]:
    """Per size: omniweave's tokens/s over the fastest transformers configuration's."""
    out = []
    for size in sorted({r["tokens"] for r in rows}):
        ours = [r for r in rows if r["tokens"] == size and r["impl"] == "omniweave"]
        theirs = [r for r in rows if r["tokens"] == size and r["impl"].startswith("transformers")]
        if ours and theirs:
            best = max(theirs, key=lambda r: r["tokens_per_s"])
            out.append(f"{size} tokens: omniweave {ours[0]['tokens_per_s'] / best['tokens_per_s']:.2f}x the fastest "
                       f"transformers configuration ({best['impl']})")
    return out


def clock_fn(name: str):
    return time.process_time if name == "cpu" else time.perf_counter


def child(impl: str, hf_dir: str, size: int, device_name: str, repeats: int, clock: str = "wall",
          precision: str = "fp32") -> dict:
    device = torch.device(device_name)
    lens = document_lengths(size)
    model, step = make_step(impl, hf_dir, document_lengths(512, seed=9), device, precision)
    step()  # warm-up on a short row (kernels, allocator, lazy imports)
    del model, step
    gc.collect()
    model, step = make_step(impl, hf_dir, lens, device, precision)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss_bytes()
    times, now = [], clock_fn(clock)
    for _ in range(repeats):
        t0 = now()
        step()
        sync()
        times.append(now() - t0)
        model.zero_grad(set_to_none=False)
    peak = (torch.cuda.max_memory_allocated() if device.type == "cuda" else peak_rss_bytes()) - base
    return {"impl": impl, "tokens": size, "docs": len(lens), "step_s": min(times),
            "peak_mb": max(peak, 0) / 2**20, "sum_len2": sum(n * n for n in lens),
            "padded_tokens": len(lens) * max(lens)}  # fmt: skip


def main() -> int:
    from omniweave.models.hf.torchvision_guard import torchvision_loads

    torchvision_loads()  # where torchvision's ops do not load beside this torch, transformers is told it is absent
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[2048, 8192, 16384])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--out", type=Path, default=Path("bench/out"))
    p.add_argument("--child", nargs=3, metavar=("IMPL", "HF_DIR", "SIZE"), help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="time steps by wall clock or by the process's CPU seconds (all threads summed)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="bf16: autocast over fp32 weights for every implementation (the matmul peak in bf16 too)")
    p.add_argument("--impls", nargs="+", default=None,
                   help="implementations to run (default: omniweave, transformers padded, and transformers "
                        "packed with every attention implementation it can load here)")
    p.add_argument("--quick", action="store_true", help=QUICK_HELP + ": one row of 512 tokens, small preset")
    args = p.parse_args()
    if args.quick and not args.child:
        args.sizes, args.preset, args.repeats = [512], "small", 1
        note("one row of 512 tokens, small preset, 1 repeat")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and args.device != "cpu":
        p.error("--clock cpu only makes sense with --device cpu")
    CONFIG.update(PRESETS[args.preset])
    if args.child:
        impl, hf_dir, size = args.child
        print(json.dumps(child(impl, hf_dir, int(size), args.device, args.repeats, args.clock, args.precision)))
        return 0

    from transformers import Qwen2Config, Qwen2ForCausalLM

    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    peak = matmul_peak_flops(device, n=512 if args.quick else 2048, timer=clock_fn(args.clock), dtype=dtype)
    impls = args.impls or default_impls(device)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        hf = Qwen2ForCausalLM(Qwen2Config(**CONFIG))
        n_params = sum(p.numel() for p in hf.parameters())
        n_nonembed = n_params - hf.model.embed_tokens.weight.numel()
        hf.save_pretrained(tmp)
        del hf
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        for size in args.sizes:
            for impl in impls:
                cmd = [sys.executable, __file__, "--child", impl, tmp, str(size), "--device", args.device,
                       "--repeats", str(args.repeats), "--preset", args.preset, "--threads", str(args.threads),
                       "--clock", args.clock, "--precision", args.precision]  # fmt: skip
                res = subprocess.run(cmd, capture_output=True, text=True, env=env)
                if res.returncode:
                    print(res.stderr[-3000:], file=sys.stderr)
                    return 1
                r = json.loads(res.stdout.strip().splitlines()[-1])
                hd = CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
                flops = 6 * n_nonembed * size + 6 * CONFIG["num_hidden_layers"] * CONFIG["num_attention_heads"] * hd * r["sum_len2"]
                r["tokens_per_s"] = size / r["step_s"]
                r["mfu"] = flops / r["step_s"] / peak
                rows.append(r)
                print(f"{impl:>32} {size:>6} tokens ({r['docs']} docs): {r['step_s']:.2f} s/step, "
                      f"{r['tokens_per_s']:.0f} tok/s, peak +{r['peak_mb']:.0f} MB, MFU {100 * r['mfu']:.1f}%", flush=True)  # fmt: skip

    header = "| tokens | docs | impl | step s | tokens/s | peak MB | MFU | padded tokens |"
    lines = [f"preset {args.preset}, device {args.device}, threads {torch.get_num_threads()}, {args.clock} clock, {args.precision}, {args.precision} matmul peak {peak / 1e9:.1f} GFLOP/s, model {n_params / 1e6:.1f}M params "
             f"({n_nonembed / 1e6:.1f}M non-embedding)", "", header, "|" + "---|" * 8]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['docs']} | {r['impl']} | {r['step_s']:.2f} | {r['tokens_per_s']:.0f} | "
                     f"{r['peak_mb']:.0f} | {100 * r['mfu']:.1f}% | {r['padded_tokens'] if r['impl'] == 'transformers' else r['tokens']} |")  # fmt: skip
    lines += ["", *speedups(rows)]
    table = "\n".join(lines)
    print(table)
    (args.out / "model_step.json").write_text(json.dumps({"peak_flops": peak, "rows": rows}, indent=2))

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for impl in impls:
        rs, style = [r for r in rows if r["impl"] == impl], "o-" if impl == "omniweave" else "s--"
        axes[0].plot([r["tokens"] for r in rs], [r["tokens_per_s"] for r in rs], style, label=impl)
        axes[1].plot([r["tokens"] for r in rs], [r["peak_mb"] for r in rs], style, label=impl)
    axes[0].set(xlabel="packed tokens per step", ylabel="tokens/s (fwd+bwd)", title=f"throughput ({args.device}, {args.clock} clock)")
    axes[1].set(xlabel="packed tokens per step", ylabel="peak memory growth (MB)", title="peak memory")
    for ax in axes:
        ax.legend()
    save(fig, args.out / "model_step.png", grid=axes)
    print(f"-> {args.out / 'model_step.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
