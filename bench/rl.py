"""Benchmark: GRPO rollouts and updates (issue 16) on long-video prompts, CPU fp32, random weights.

1. Rollout throughput, G = 4, 8, 16 (and G = 8 with --long-max-new tokens). One prompt: 16 text
   tokens | a video of --video-t temporal patches of 16x16 patches (2 frames of 224x224 px each,
   64 tokens after the 2x2 merge) | 24 question tokens: ~2,000 tokens by default.
   ``TorchRollout`` (one encoding + one prefill, G samples decoded in lockstep on a GroupKVCache)
   vs ``NaiveRollout`` (each sample re-encodes the video and re-prefills the prompt): same
   weights, seed and sampling (temperature 1, no top-k / top-p, no stop token: every sample
   generates exactly --max-new tokens). Generated tokens/s = G x new tokens / wall time of
   ``generate``; medians over --repeats, arms interleaved (the first alternates). Both engines
   must give identical tokens (asserted).
2. Per-rank memory of a CP rollout, CP = 1, 2, 4: fresh gloo ranks, ``build_rollout_model`` (ring
   attention, vision split), ``TorchRollout(cp_group=...)``, G = 8, a longer video (--cp-video-t).
   Per rank: the bytes of prompt keys/values it holds (``GroupKVCache.prefix_k/prefix_v``,
   exact); the peak of live bytes allocated during ``generate`` (torch profiler allocator
   events: exact, repeatable; covers the encoder and prefill transients, the cache, the logits);
   the peak RSS growth over the size before ``generate`` (noisy: the allocator keeps freed
   pages); the largest rank's figures. The profiled call is a second, identical ``generate``.
   All CP sizes must give CP = 1's tokens (asserted). Two series (--cp-kernels):
   *default* (the recipe's attention: fused SDPA at CP = 1; at CP > 1 the ring's block kernel,
   on CPU the math one with [H, L/CP, L/CP] fp32 scores) and *math* (attn_backend=math at every
   CP size: the same kernel throughout).
3. Update throughput, packed vs padded: --update-prompts prompts (a shorter video each) x G = 8
   samples, random response lengths (lognormal, median --response-median, 16..512), random
   tokens, old log-probs and advantages. *Packed*: the rows of ``rl/batch.update_rows`` (prompt +
   response documents, media once per prompt per row via ``feature_rows``, <= --capacity tokens).
   *Padded*: per prompt one row of G documents, each sample right-padded to its group's longest
   (pad id 0, label -100) with its own copy of the video: a [G, Lmax] batch with per-sample
   pixel_values, as a plain HF loop has it. Per row: ``forward(token_logprobs=True)`` +
   ``grpo_token_loss`` (defaults, token-mean) + backward. Real tokens/s = prompt + response tokens
   of every sample / time; the arms' summed loss and gradient norm must agree (asserted).

Model: bench/context_parallel.py's MODEL (foundation 256 x 4 layers, ViT 128 x 4, vocab 4096).
Positions are 1-D, repeated on the three M-RoPE axes (no effect on time or memory); the video
span holds one placeholder id (its embeddings are replaced by the video features).

    python bench/rl.py [--quick] [--groups 4 8 16] [--max-new 32] [--long-max-new 128] [--video-t 31]
        [--cp 1 2 4] [--cp-video-t 62] [--cp-kernels default math] [--update-prompts 2] [--update-video-t 8]
        [--response-median 128] [--capacity 8192] [--repeats 3] [--threads 1] [--out bench/out]

Prints three markdown tables and writes rl.png and rl.json under --out (only there). --quick:
tiny sizes, 1 repeat, CP = 1 and 2, default attention only (a smoke test, well under a minute).
``--engine vllm [its flags]``: the native engine against vLLM instead (bench/rl_engines.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import resource
import sys
import time
from pathlib import Path
from statistics import median

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: omniweave, bench
from bench.context_parallel import GRID_HW, MODEL  # noqa: E402
from bench.figure import pyplot, save  # noqa: E402
from omniweave.parallel.spawn import run_ranks  # noqa: E402
from omniweave.generation import NaiveRollout, Prompt, Rollout, SamplingParams, TorchRollout  # noqa: E402

VIDEO_ID, PRE, QUESTION, VOCAB = 7, 16, 24, 4096


def video_prompt(t: int, uid: int, seed: int) -> Prompt:
    """[PRE text | video of t temporal patches | QUESTION text]; 1-D positions on 3 axes."""
    g = torch.Generator().manual_seed(seed)
    video = t * (GRID_HW // 2) ** 2
    L = PRE + video + QUESTION
    ids = torch.randint(10, VOCAB, (L,), generator=g)
    ids[PRE : PRE + video] = VIDEO_ID
    return Prompt(uid, {"input_ids": ids, "position_ids": torch.arange(L)[None].expand(3, L).clone(),
                        "pixel_values": torch.randn(t * GRID_HW * GRID_HW, 3 * 2 * 14 * 14, generator=g),
                        "grid_thw": torch.tensor([[t, GRID_HW, GRID_HW]]), "media_spans": torch.tensor([[PRE, video]])})


def seeded_init(model):
    torch.manual_seed(0)
    model.init_weights()  # the same weights in every process and at every CP size
    return model


# ---------------------------------------------------------------------------- 1. rollout throughput


def bench_rollout(model, args) -> list[dict]:
    prompt = video_prompt(args.video_t, 0, 0)
    cases = [(g, args.max_new) for g in args.groups] + ([(8, args.long_max_new)] if args.long_max_new else [])
    engines = {"shared": TorchRollout(model), "naive": NaiveRollout(model)}
    engines["shared"].generate([video_prompt(1, 1, 1)], 2, SamplingParams(max_new_tokens=2), 0)  # warm-up
    times = {(c, e): [] for c in cases for e in engines}
    for rep in range(args.repeats):
        for g, n in cases:
            tokens = {}
            for e in ("shared", "naive")[:: 1 if rep % 2 == 0 else -1]:
                t0 = time.perf_counter()
                out = engines[e].generate([prompt], g, SamplingParams(temperature=1.0, max_new_tokens=n), seed=rep)
                times[((g, n), e)].append(time.perf_counter() - t0)
                tokens[e] = [r.tokens for r in out]
            assert all(len(t) == n for t in tokens["shared"]), "a sample stopped early (no stop ids are set)"
            assert tokens["shared"] == tokens["naive"], f"G={g}: shared and naive rollouts differ"
            print(f"  repeat {rep + 1} G={g} new={n}: shared {times[((g, n), 'shared')][-1]:.2f} s, "
                  f"naive {times[((g, n), 'naive')][-1]:.2f} s", flush=True)
    rows = []
    for g, n in cases:
        fast, slow = times[((g, n), "shared")], times[((g, n), "naive")]
        rows.append({"G": g, "max_new": n, "prompt_tokens": int(prompt.batch["input_ids"].numel()),
                     "shared_s": median(fast), "naive_s": median(slow), "shared_tok_s": g * n / median(fast),
                     "naive_tok_s": g * n / median(slow), "speedup": median(slow) / median(fast),
                     "speedup_per_repeat": [b / a for a, b in zip(fast, slow)], "identical_tokens": True})
    return rows


# ---------------------------------------------------------------------------- 2. memory per CP rank


def _cp_rank(rank: int, world: int, t: int, g: int, max_new: int, kernel: str) -> dict:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    import omniweave.generation as R
    from omniweave.config import load_recipe
    from omniweave.parallel.dims import ParallelDims

    backend = [] if kernel == "default" else [f"+model.foundation.attn_backend={kernel}"]
    cfg = load_recipe("demo", [*MODEL, *backend, f"parallel.cp={world}", "parallel.cp_attention=ring"])
    dims = ParallelDims.from_config(cfg.parallel, world, model=cfg.model)
    meshes = dims.build_meshes("cpu")
    model = seeded_init(R.build_rollout_model(cfg, dims, meshes, torch.device("cpu")))
    caches = []

    class Spy(R.GroupKVCache):  # keeps a handle on generate's cache, to size it afterwards
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            caches.append(self)

    R.GroupKVCache = Spy
    engine = R.TorchRollout(model, cp_group=meshes.cp.get_group() if world > 1 else None, cp=world,
                            cp_rank=meshes.cp_rank)
    prompt, params = video_prompt(t, 0, 0), SamplingParams(temperature=1.0, max_new_tokens=max_new)
    engine.generate([video_prompt(1, 1, 1)], 2, SamplingParams(max_new_tokens=2), 0)  # warm-up
    gc.collect()
    dist.barrier()
    rss0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, time.perf_counter()
    out = engine.generate([prompt], g, params, seed=0)
    wall, rss = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    kv = sum(x.nbytes for x in caches[-1].prefix_k + caches[-1].prefix_v)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:  # the same rollout again
        again = engine.generate([prompt], g, params, seed=0)
    live = peak = 0
    for _, n in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                       if e.name() == "[memory]"):
        live += n
        peak = max(peak, live)
    assert [r.tokens for r in out] == [r.tokens for r in again]
    return {"rank": rank, "prompt_tokens_held": int(caches[-1].prefix_cu[-1]), "kv_bytes": kv,
            "peak_alloc_bytes": peak, "rss_growth_bytes": rss, "wall_s": wall, "tokens": [r.tokens for r in out]}


def bench_cp(args) -> list[dict]:
    rows, ref = [], {}
    for kernel, cp in [(k, c) for k in args.cp_kernels for c in args.cp]:
        t0 = time.perf_counter()
        ranks = run_ranks(_cp_rank, cp, args.cp_video_t, 8, args.max_new, kernel, timeout=1200)
        tokens = ranks[0]["tokens"]
        assert all(r["tokens"] == tokens for r in ranks), f"CP={cp}: ranks disagree"
        assert tokens == ref.setdefault(kernel, tokens), f"{kernel}, CP={cp}: tokens differ from CP={args.cp[0]}"
        worst = {k: max(r[k] for r in ranks) for k in ranks[0] if k != "tokens"}
        rows.append({"kernel": kernel, "cp": cp, "tokens_per_rank": worst["prompt_tokens_held"],
                     "prompt_tokens": int(video_prompt(args.cp_video_t, 0, 0).batch["input_ids"].numel()),
                     "kv_mb": worst["kv_bytes"] / 2**20, "peak_alloc_mb": worst["peak_alloc_bytes"] / 2**20,
                     "rss_mb": worst["rss_growth_bytes"] / 2**20, "wall_s": worst["wall_s"],
                     "same_tokens_as_cp1": True, "same_tokens_as_first_kernel": tokens == ref[args.cp_kernels[0]],
                     "per_rank": [{k: v for k, v in r.items() if k != "tokens"} for r in ranks]})
        print(f"  {kernel} attention, CP={cp}: {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


# ---------------------------------------------------------------------------- 3. update: packed vs padded


def update_data(args):
    from omniweave.rl.batch import IGNORE, update_rows

    rng, G = np.random.default_rng(0), 8
    prompts = [video_prompt(args.update_video_t, i, 100 + i) for i in range(args.update_prompts)]
    lengths = np.clip(rng.lognormal(math.log(args.response_median), 0.8, len(prompts) * G), 16, 512).astype(int)
    old = [(-math.log(VOCAB) + 0.05 * rng.standard_normal(m)).tolist() for m in lengths]  # ~ the model's logp
    rollouts = [Rollout(k // G, k % G, rng.integers(10, VOCAB, m).tolist(), lp, True)
                for k, (m, lp) in enumerate(zip(lengths, old))]
    adv = torch.from_numpy(rng.standard_normal(len(rollouts))).float()
    packed = update_rows(prompts, rollouts, adv, list(range(len(prompts))), G, args.capacity, "token-mean")
    padded = []
    for i, p in enumerate(prompts):  # one [G, Lmax] batch per prompt, laid out as G documents of Lmax
        b, group, n = p.batch, rollouts[i * G : (i + 1) * G], p.batch["input_ids"].numel()
        lmax = n + max(len(r.tokens) for r in group)
        ids, labels = torch.zeros(G, lmax, dtype=torch.long), torch.full((G, lmax), IGNORE)
        td = torch.zeros(3, G, lmax)  # old_logp, advantages, weights
        for j, r in enumerate(group):
            resp, on = torch.tensor(r.tokens), slice(n - 1, n - 1 + len(r.tokens))  # the rows predicting resp
            ids[j, :n], ids[j, n : n + len(resp)], labels[j, on] = b["input_ids"], resp, resp
            td[0, j, on], td[1, j, on], td[2, j, on] = torch.tensor(r.logprobs), adv[i * G + j], 1.0
        ((start, span),) = b["media_spans"].tolist()
        padded.append({"input_ids": ids.reshape(-1), "labels": labels.reshape(-1),
                       "position_ids": torch.arange(lmax).repeat(G).expand(3, -1).clone(),
                       "cu_seqlens": torch.arange(0, G * lmax + 1, lmax, dtype=torch.int32),
                       "pixel_values": b["pixel_values"].repeat(G, 1), "grid_thw": b["grid_thw"].repeat(G, 1),
                       "media_spans": torch.tensor([[j * lmax + start, span] for j in range(G)]),
                       "token_data": dict(zip(("old_logp", "advantages", "weights"), td.reshape(3, -1)))})
    real = int(sum(p.batch["input_ids"].numel() * G for p in prompts) + lengths.sum())
    return packed, padded, real, int(lengths.sum())


def update_pass(model, rows: list[dict], loss_tokens: int) -> tuple[float, float]:
    """Forward + GRPO loss + backward of every row (gradients accumulate) -> (loss, grad norm)."""
    from omniweave.rl.grpo import GRPOConfig, grpo_token_loss

    total = 0.0
    for row in rows:
        td, mask = row["token_data"], row["labels"] != -100
        logp = model(row, token_logprobs=True).token_logp[mask]
        per_token, _ = grpo_token_loss(logp, td["old_logp"][mask], None, td["advantages"][mask], GRPOConfig())
        loss = (per_token * td["weights"][mask]).sum() / loss_tokens
        loss.backward()
        total += loss.item()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    model.zero_grad(set_to_none=True)
    return total, float(norm)


def bench_update(model, args) -> dict:
    packed, padded, real, loss_tokens = update_data(args)
    arms = {"packed": packed, "padded": padded}
    model.train()
    for rows in arms.values():  # warm-up
        update_pass(model, rows[:1], loss_tokens)
    times, checks = {a: [] for a in arms}, {}
    for rep in range(args.repeats):
        for arm in ("packed", "padded")[:: 1 if rep % 2 == 0 else -1]:
            t0 = time.perf_counter()
            checks[arm] = update_pass(model, arms[arm], loss_tokens)
            times[arm].append(time.perf_counter() - t0)
            print(f"  repeat {rep + 1} {arm}: {times[arm][-1]:.2f} s", flush=True)
    (la, ga), (lb, gb) = checks["packed"], checks["padded"]
    assert abs(la - lb) <= 1e-4 * max(1.0, abs(la)) and abs(ga - gb) <= 1e-3 * ga, f"arms disagree: {checks}"
    model.eval()
    res = {"real_tokens": real, "response_tokens": loss_tokens, "samples": args.update_prompts * 8,
           "prompt_tokens": int(video_prompt(args.update_video_t, 0, 0).batch["input_ids"].numel()),
           "loss": la, "grad_norm": ga, "loss_diff": abs(la - lb), "grad_norm_diff": abs(ga - gb),
           "speedup": median(times["padded"]) / median(times["packed"]),
           "speedup_per_repeat": [b / a for a, b in zip(times["packed"], times["padded"])]}
    for arm, rows in arms.items():
        computed, sec = sum(r["input_ids"].numel() for r in rows), median(times[arm])
        res[arm] = {"rows": len(rows), "computed_tokens": computed, "padding": 1 - real / computed, "s": sec,
                    "vit_patches": sum(int(r["grid_thw"].prod(-1).sum()) for r in rows), "tok_s": real / sec,
                    "s_per_repeat": times[arm]}
    return res


# ---------------------------------------------------------------------------- report


def plot(rollout: list[dict], cp: list[dict], update: dict, path: Path) -> None:
    plt = pyplot()
    fig, (ax, bx, cx) = plt.subplots(1, 3, figsize=(16, 4.2))
    main = [r for r in rollout if r["max_new"] == rollout[0]["max_new"]]
    gs = [r["G"] for r in main]
    ax.plot(gs, [r["shared_tok_s"] for r in main], "-o", label="TorchRollout (shared encoding + prefill)")
    ax.plot(gs, [r["naive_tok_s"] for r in main], "--x", label="NaiveRollout (per sample)")
    for r in main:
        ax.annotate(f"{r['speedup']:.1f}x", (r["G"], r["shared_tok_s"]), textcoords="offset points", xytext=(4, -12))
    ax.set(xlabel="group size G", ylabel="generated tokens/s", xticks=gs,
           title=f"rollout: {main[0]['prompt_tokens']}-token video prompt, {main[0]['max_new']} new tokens")
    cps, series = sorted({r["cp"] for r in cp}), {}
    for r in cp:
        series.setdefault(r["kernel"], []).append(r)
    first = next(iter(series.values()))
    bx.plot(cps, [r["kv_mb"] / first[0]["kv_mb"] for r in first], "-o", label="prompt KV held (exact)")
    for (kernel, sel), style in zip(series.items(), ("-s", "-.d")):
        bx.plot(cps, [r["peak_alloc_mb"] / sel[0]["peak_alloc_mb"] for r in sel], style,
                label=f"peak allocated, {kernel} attention")
    if first[0]["rss_mb"] >= 1:  # a ratio to less than 1 MB is meaningless
        bx.plot(cps, [r["rss_mb"] / first[0]["rss_mb"] for r in first], ":^", label="peak RSS growth (noisy)")
    bx.plot(cps, [cps[0] / c for c in cps], "k--", alpha=0.4, label="1/CP")
    bx.set(xlabel="CP ranks", ylabel=f"per rank, x CP={cps[0]}", xticks=cps,
           title=f"rollout memory per rank: {cp[0]['prompt_tokens']}-token prompt, G=8")
    vals = [update[a]["tok_s"] for a in ("packed", "padded")]
    cx.bar(["packed", "padded"], vals, color=["#2a5", "#c84"])
    for i, a in enumerate(("packed", "padded")):
        cx.text(i, vals[i], f"{vals[i]:.0f} ({100 * update[a]['padding']:.0f}% pad, {update[a]['vit_patches']} ViT "
                            "patches)", ha="center", va="bottom", fontsize=8)
    cx.set(ylabel="real tokens/s (forward + backward)", title=f"GRPO update: packed {update['speedup']:.2f}x padded")
    for a in (ax, bx):
        a.legend(fontsize=8)
    save(fig, path, grid=(ax, bx))


def tables(rollout, cp, update) -> str:
    out = ["| G | new tokens/sample | shared s | naive s | shared tok/s | naive tok/s | speedup | per repeat |",
           "|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rollout:
        per = ", ".join(f"{x:.2f}" for x in r["speedup_per_repeat"])
        out.append(f"| {r['G']} | {r['max_new']} | {r['shared_s']:.2f} | {r['naive_s']:.2f} | {r['shared_tok_s']:.1f} "
                   f"| {r['naive_tok_s']:.1f} | **{r['speedup']:.2f}x** | {per} |")
    out += ["", ("| attention | CP | prompt tokens/rank | prompt KV MB/rank | x CP=1 | peak alloc MB/rank | x CP=1 | "
                 "peak RSS growth MB/rank | x CP=1 | wall s | tokens = CP=1 |"), "|---|" + "---:|" * 9 + "---|"]
    for r in cp:
        b = next(x for x in cp if x["kernel"] == r["kernel"])
        out.append(f"| {r['kernel']} | {r['cp']} | {r['tokens_per_rank']} | {r['kv_mb']:.2f} | "
                   f"{r['kv_mb'] / b['kv_mb']:.3f} | {r['peak_alloc_mb']:.1f} | "
                   f"{r['peak_alloc_mb'] / b['peak_alloc_mb']:.3f} | {r['rss_mb']:.0f} | "
                   f"{r['rss_mb'] / b['rss_mb'] if b['rss_mb'] >= 1 else float('nan'):.2f} | {r['wall_s']:.1f} | yes |")
    out += ["", "| update arm | rows | computed tokens | padding | ViT patches | median s | real tokens/s | speedup |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for a in ("packed", "padded"):
        u, speed = update[a], f"**{update['speedup']:.2f}x**" if a == "packed" else "1.00x"
        out.append(f"| {a} | {u['rows']} | {u['computed_tokens']} | {100 * u['padding']:.0f}% | {u['vit_patches']} | "
                   f"{u['s']:.2f} | {u['tok_s']:.0f} | {speed} |")
    return "\n".join(out)


def main() -> int:
    if "--engine" in sys.argv:  # --engine vllm: native vs vLLM rollouts (bench/rl_engines.py; the vLLM venv)
        i = sys.argv.index("--engine")
        if sys.argv[i + 1 : i + 2] != ["vllm"]:
            sys.exit("bench/rl.py: --engine takes vllm (the native engine is this script's default)")
        from bench.rl_engines import main as engines_main

        return engines_main(sys.argv[1:i] + sys.argv[i + 2 :])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat (a smoke test)")
    p.add_argument("--groups", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--max-new", type=int, default=32, help="tokens generated per sample (no stop token)")
    p.add_argument("--long-max-new", type=int, default=128, help="also G=8 with this many new tokens (0: off)")
    p.add_argument("--video-t", type=int, default=31, help="temporal patches of the rollout video (64 tokens each)")
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--cp-video-t", type=int, default=62, help="temporal patches of the CP rollout's video")
    p.add_argument("--cp-kernels", nargs="+", default=["default", "math"], choices=["default", "math", "sdpa"],
                   help="decoder attention backends of the CP runs (default: the recipe's auto)")
    p.add_argument("--update-prompts", type=int, default=2)
    p.add_argument("--update-video-t", type=int, default=8)
    p.add_argument("--response-median", type=int, default=128, help="median response length of the update")
    p.add_argument("--capacity", type=int, default=8192, help="update row capacity (rl.update_max_len)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads of this process (CP ranks use 1)")
    p.add_argument("--out", type=Path, default=Path("bench/out"), help="every result file goes here (and only here)")
    args = p.parse_args()
    if args.quick:
        args.groups, args.max_new, args.long_max_new, args.video_t, args.repeats = [2, 4], 4, 0, 2, 1
        args.cp, args.cp_video_t, args.cp_kernels = [1, 2], 2, args.cp_kernels[:1]
        args.update_prompts, args.update_video_t, args.response_median = 1, 1, 24
    torch.set_num_threads(args.threads)
    from omniweave.config import load_recipe, to_dict
    from omniweave.models.registry import build_model

    model, res, secs = seeded_init(build_model(to_dict(load_recipe("demo", MODEL).model))), {}, {}
    for name, run in (("rollout", lambda: bench_rollout(model, args)), ("cp", lambda: bench_cp(args)),
                      ("update", lambda: bench_update(model, args))):
        print(name, flush=True)
        t0 = time.perf_counter()
        res[name] = run()
        secs[name] = round(time.perf_counter() - t0, 1)
    u = res["update"]
    print(f"\n{tables(res['rollout'], res['cp'], u)}\n\nupdate: {u['samples']} samples of {u['prompt_tokens']}-token "
          f"prompts, {u['real_tokens']} real tokens; |loss diff| {u['loss_diff']:.1e}, |grad-norm diff| "
          f"{u['grad_norm_diff']:.1e}; seconds {secs}")
    args.out.mkdir(parents=True, exist_ok=True)
    plot(res["rollout"], res["cp"], u, args.out / "rl.png")
    (args.out / "rl.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **res,
                                                  "threads": torch.get_num_threads(), "seconds": secs}, indent=1))
    print(f"wrote {args.out / 'rl.png'} and {args.out / 'rl.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
