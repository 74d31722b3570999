"""Benchmark: rollout engines, native vs vLLM (issue 36), CPU fp32, random weights.

Runs in the vLLM venv (``make venv-vllm``), as ``bench/rl.py --engine vllm`` or directly:

    .venv-vllm/bin/python bench/rl.py --engine vllm [--quick] [--groups 4 8 16] [--lengths 1024 2048 4096]
        [--max-new 32] [--repeats 3] [--threads 2] [--out bench/out]

One prompt per case: 16 text tokens | one image of ~L tokens after the 2x2 merge (a square of
side 28·round(√L) px) | 24 text tokens, M-RoPE positions as the data pipeline writes them. The
model is bench/context_parallel.py's (a Qwen2.5-VL shape: decoder 256 x 4 layers, head dim 64;
ViT 128 x 4), exported for vLLM without weights and synced in memory. Sampling: temperature 1,
no stop tokens (every sample generates exactly --max-new). Arms:

    native        TorchRollout: one encoding and one prefill per prompt, G samples in lockstep
    vllm-cached   VLLMRollout: our tower's features handed to vLLM as image_embeds (the time
                  includes our tower); G requests share the prefill through prefix caching
    vllm-pixels   vLLM encodes the image itself (a PIL image through its processor and tower)

Generated tokens/s = G x --max-new / wall time of one rollout call; every vLLM cache is reset
before each timed call (no prefix, encoder or processor cache carries over between calls);
medians over --repeats, the arms' order rotating. Also measured: greedy token agreement of
native and vllm-cached on the first case (the same weights and positions). Prints a markdown
table and writes rl_engines.png / rl_engines.json under --out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from statistics import median

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: omniweave, bench
from bench.context_parallel import MODEL  # noqa: E402
from bench.figure import pyplot, save  # noqa: E402
from omniweave.generation import Prompt, SamplingParams, TorchRollout  # noqa: E402

PRE, QUESTION, ARMS = 16, 24, ("native", "vllm-cached", "vllm-pixels")


def recipe(max_side: int):
    from omniweave.config import load_recipe

    pixels = max_side * max_side
    return load_recipe("demo", [*MODEL, "data.vision.min_pixels=3136", f"data.vision.max_pixels={pixels}"])


def image_prompt(side: int, engine, uid: int, seed: int) -> tuple[Prompt, dict]:
    """(our Prompt, vLLM's pixel prompt) of one image of side x side px between two texts."""
    from PIL import Image

    from omniweave.data.sample import MediaSpan
    from omniweave.data.text.rope_index import mrope_position_ids

    g = torch.Generator().manual_seed(seed)
    grid = side // 14
    n = (grid // 2) ** 2
    ids = torch.randint(10, 1000, (PRE + n + QUESTION,), generator=g)
    ids[PRE : PRE + n] = engine.image_id
    span = MediaSpan("image", "img0", (1, grid, grid), (side, side), PRE, n)
    pos = torch.from_numpy(mrope_position_ids(len(ids), [span], 2).astype(np.int64))
    batch = {"input_ids": ids, "position_ids": pos, "pixel_values": torch.randn(grid * grid, 3 * 2 * 14 * 14, generator=g),
             "grid_thw": torch.tensor([[1, grid, grid]]), "media_spans": torch.tensor([[PRE, n]])}
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    prompt = Prompt(uid, batch)
    return prompt, {"prompt_token_ids": engine.collapsed_ids(prompt), "multi_modal_data": {"image": Image.fromarray(pixels)}}


def run(args) -> dict:
    from omniweave.config import to_dict
    from omniweave.models.registry import build_model
    from omniweave.rl.vllm_engine import VLLMRollout

    torch.set_num_threads(args.threads)
    sides = [28 * round(math.sqrt(L)) for L in args.lengths]
    cfg = recipe(max(sides))
    torch.manual_seed(0)
    model = build_model(to_dict(cfg.model)).eval()
    model.init_weights()
    max_len = PRE + (max(sides) // 28) ** 2 + QUESTION + args.max_new + 8
    options = {"gpu_memory_utilization": args.kv_share, "enforce_eager": True, "sleep": False, "max_images": 1,
               "max_videos": 1}
    vllm = VLLMRollout(model, cfg, Path(args.out) / "rl_engines_engine", options, max_model_len=max_len)
    vllm.sync()
    native = TorchRollout(model)
    prompts = {side: image_prompt(side, vllm, 0, side) for side in sides}
    greedy = SamplingParams(temperature=0, max_new_tokens=args.max_new)
    a = native.generate([prompts[sides[0]][0]], 2, greedy, 0)
    b = vllm.generate([prompts[sides[0]][0]], 2, greedy, 0)
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra.tokens, rb.tokens))
    agreement = same / sum(len(r.tokens) for r in a)
    print(f"greedy agreement native vs vllm-cached ({sides[0] // 28}² image tokens): {agreement:.1%}", flush=True)

    def call(arm, side, g, rep):
        prompt, pixel_prompt = prompts[side]
        params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new)
        if arm == "native":
            return native.generate([prompt], g, params, rep)
        vllm.reset_caches()
        if arm == "vllm-cached":
            return vllm.generate([prompt], g, params, rep)
        return vllm.generate_inputs([pixel_prompt], [prompt.uid], g, params, rep)

    for arm in ARMS:  # warm-up: first calls build kernels and caches
        call(arm, sides[0], 2, 0)
    cases = [(side, g) for side in sides for g in args.groups]
    times = {(c, arm): [] for c in cases for arm in ARMS}
    for rep in range(args.repeats):
        for k, (side, g) in enumerate(cases):
            order = ARMS[(rep + k) % 3 :] + ARMS[: (rep + k) % 3]
            for arm in order:
                t0 = time.perf_counter()
                out = call(arm, side, g, rep)
                times[((side, g), arm)].append(time.perf_counter() - t0)
                assert all(len(r.tokens) == args.max_new for r in out), f"{arm}: a sample stopped early"
            print(f"  repeat {rep + 1} L={(side // 28) ** 2} G={g}: " + ", ".join(
                f"{arm} {times[((side, g), arm)][-1]:.2f} s" for arm in ARMS), flush=True)
    rows = []
    for side, g in cases:
        t = {arm: median(times[((side, g), arm)]) for arm in ARMS}
        rows.append({"prompt_tokens": PRE + (side // 28) ** 2 + QUESTION, "image_px": side, "G": g,
                     "max_new": args.max_new, **{f"{arm}_s": t[arm] for arm in ARMS},
                     **{f"{arm}_tok_s": g * args.max_new / t[arm] for arm in ARMS},
                     "vllm_cached_vs_native": t["native"] / t["vllm-cached"],
                     "cached_vs_pixels": t["vllm-pixels"] / t["vllm-cached"]})
    vllm.close()
    return {"rows": rows, "greedy_agreement": agreement, "threads": args.threads, "repeats": args.repeats}


def report(result: dict, out: Path) -> None:
    print("\n| prompt tokens | G | native tok/s | vLLM cached tok/s | vLLM pixels tok/s | cached / native | "
          "cached / pixels |\n|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['prompt_tokens']} | {r['G']} | {r['native_tok_s']:.0f} | {r['vllm-cached_tok_s']:.0f} | "
              f"{r['vllm-pixels_tok_s']:.0f} | {r['vllm_cached_vs_native']:.2f}x | {r['cached_vs_pixels']:.2f}x |")
    print(f"\ngreedy token agreement, native vs vLLM cached: {result['greedy_agreement']:.1%}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "rl_engines.json").write_text(json.dumps(result, indent=2) + "\n")
    plt = pyplot()
    fig, axes = plt.subplots(1, len({r["prompt_tokens"] for r in result["rows"]}), figsize=(12, 3.6), squeeze=False)
    for ax, length in zip(axes[0], sorted({r["prompt_tokens"] for r in result["rows"]})):
        rows = [r for r in result["rows"] if r["prompt_tokens"] == length]
        for arm in ARMS:
            ax.plot([r["G"] for r in rows], [r[f"{arm}_tok_s"] for r in rows], marker="o", label=arm)
        ax.set(title=f"{length}-token prompt", xlabel="G (samples per prompt)", ylabel="generated tokens/s", xscale="log")
        ax.set_xticks([r["G"] for r in rows], [str(r["G"]) for r in rows])
        ax.minorticks_off()
    axes[0][0].legend()
    save(fig, out / "rl_engines.png")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat (a smoke test)")
    p.add_argument("--groups", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="image tokens per prompt")
    p.add_argument("--max-new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv-share", type=float, default=0.1, help="vLLM's gpu_memory_utilization (CPU: of RAM)")
    p.add_argument("--out", default="bench/out")
    args = p.parse_args(argv)
    if args.quick:
        args.groups, args.lengths, args.max_new, args.repeats = [2, 4], [64, 256], 8, 1
    report(run(args), Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
