"""Benchmark: one Gated DeltaNet layer (Qwen3.5's linear attention) vs one gated full-attention
layer, forward + backward, vs row length, single documents and packed rows (issue 34).

The two token mixers of a Qwen3.5 hybrid decoder, called directly on a row ``x [L, hidden]``
(the norms and the MLP around them are the same in both kinds of layer and are left out):

- **linear**: ``GatedDeltaNet`` (omniweave/models/components/linear_attention.py): in_proj_qkv /
  z / b / a, the varlen causal conv (kernel 4), the chunkwise gated delta rule
  (``gated_delta_rule_chunked``, components/gated_delta.py, chunk 64, l2-normalised q / k), the
  gated RMSNorm and out_proj; 4 key heads, 8 value heads, dk = dv = 64.
- **attention**: ``Attention`` (components/decoder.py) as Qwen3.5 has it: ``attn_output_gate``
  (a sigmoid gate from a doubled q_proj), ``qk_norm`` (zero-centred RMSNorm), partial rotary
  (``partial_rotary_factor`` 0.25: RoPE on 16 of the 64 dims); 8 query heads, 2 KV heads, head_dim
  64; ``attn_backend: auto`` (on CPU: ``sdpa`` per document, components/attention.py). RoPE's
  cos / sin are computed once, outside the timed step (a model shares them across layers).

Both with hidden 512 (0.92M parameters attention, 1.06M linear), fp32, on CPU, ``--threads``
intra-op threads. Each point (layer, row length, documents): one warm-up step on a 512-token row,
then ``--repeats`` steps of forward + backward (gradients of the weights and of x) of the whole
row; the step time is their wall-clock median. Peak memory is measured as in
bench/long_context.py (its ``_rss_bytes`` and ``POINT_ENV``), in a fresh process per point (the
same warm-up, then one step): the growth of the process's peak RSS over its RSS right before
the step (``VmHWM``, reset before the step; not ``ru_maxrss``, which a child process inherits
from its parent's RSS), with glibc's mmap threshold at 64 KiB so that freed tensors leave the RSS
(torch has no CPU allocator statistics): activations kept for the backward, gradients (of x too:
2 KiB a token) and transients. That allocator setting makes every large allocation a fresh
mapping (page faults, zeroing: up to 3x slower steps here), so the timed steps run apart from it,
in the benchmark's own process with the ordinary allocator.

(a) **one document** of each of ``--lengths`` tokens: step time, tokens/s and peak of both
    layers, attention / linear per length, and the crossover: the first length at which the
    linear layer's step is shorter than attention's.
(b) **a packed row** of ``--packed-length`` tokens in documents of ``--doc-lens`` tokens each:
    attention runs each document alone (its cost drops from ~L² to ~L · doc), the linear layer
    resets its state per document at the same cost per token; beside each layer's one-document
    point of the same length (from (a) when it ran that length, else run here).

(c) **context parallelism** of the linear layer (parallel/context/linear.py: each rank its zigzag
    share of the row, the pieces' windows and states passed down the ranks) on a row of
    ``--cp-length`` tokens in documents of ``--cp-doc-len``, at each of ``--cp`` gloo ranks
    (``--threads`` each: on a 2-core box cp 4 oversubscribes the cores): the slowest rank's
    median step, against one rank on the whole row, and what each rank sends per layer in the
    forward (its pieces' last K−1 inputs and their [S_x | M] summaries, fp32; the backward as much).

Every row carries its ``section``; the JSON keeps them by section (``--sections`` runs a subset).

    python bench/linear_attention.py [--lengths 2048 4096 8192 16384] [--packed-length 16384]
                                     [--doc-lens 2048] [--cp 1 2 4] [--cp-length 16384] [--cp-doc-len 4096]
                                     [--sections single packed cp] [--repeats 3] [--threads 1] [--out bench/out] [--quick]

The default lengths stop at 16K so that a run takes minutes on a 2-core box (attention is ~L²: a
64K step of this layer takes ~5 min on one core); longer rows: ``--lengths 8192 16384 32768 65536``.
A default run takes ~5 min (docs/benchmarks.md, "Linear attention").

``--quick`` (bench/quick.py): rows of 256 and 1024 tokens, a packed row of 1024 in documents of
256, cp 1 and 2 on 512 tokens in documents of 128, warm-up on 64 tokens, 1 repeat; not meaningful figures.
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
from figure import pyplot, save, write_results  # noqa: E402
from long_context import POINT_ENV, _rss_bytes  # noqa: E402  (peak memory on CPU: the same method)
from quick import HELP as QUICK_HELP, note  # noqa: E402

HIDDEN = 512
ATTENTION = dict(num_heads=8, num_kv_heads=2, head_dim=64, qk_norm=True, attn_output_gate=True,
                 partial_rotary_factor=0.25, norm_zero_centered=True)
LINEAR = dict(num_key_heads=4, num_value_heads=8, key_head_dim=64, value_head_dim=64, conv_kernel=4, chunk_size=64)
LAYERS = ("linear", "attention")
WARMUP = 512  # tokens of the warm-up step each point runs before it measures
MIB = 2**20


def _peak_rss_bytes() -> int:
    """This process's peak RSS (VmHWM). Not ``ru_maxrss``: that one starts from the parent's RSS
    at fork (it survives exec), so a child of a large process reads the parent's size."""
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmHWM:"))


def _reset_peak_rss() -> None:
    """Lower the peak RSS to the current RSS (Linux 4.0+), so that the warm-up's peak does not count."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # the warm-up row is short: its peak is below the step's


def make_layer(kind: str) -> torch.nn.Module:
    from omniweave.models.components.decoder import Attention, DecoderConfig
    from omniweave.models.components.linear_attention import GatedDeltaNet, GatedDeltaNetConfig

    torch.manual_seed(0)
    if kind == "linear":
        return GatedDeltaNet(GatedDeltaNetConfig(HIDDEN, **LINEAR))
    cfg = DecoderConfig(vocab_size=16, hidden_size=HIDDEN, intermediate_size=16, num_layers=1, family="qwen3_5",
                        **ATTENTION)
    return Attention(cfg, 0)


def make_row(length: int, doc_len: int, seed: int = 1) -> dict:
    """x [L, HIDDEN] (requires grad), cu_seqlens of documents of ``doc_len`` tokens (0: one
    document; the last one shorter when doc_len does not divide L), positions from 0 per document."""
    doc_len = doc_len or length
    bounds = [*range(0, length, doc_len), length]
    pos = torch.cat([torch.arange(b - a) for a, b in zip(bounds, bounds[1:])])
    x = torch.randn(length, HIDDEN, generator=torch.Generator().manual_seed(seed))
    return {"x": x.requires_grad_(True), "cu_seqlens": torch.tensor(bounds, dtype=torch.int32), "position_ids": pos}


def layer_step(kind: str, layer: torch.nn.Module, row: dict):
    """forward(x) -> y [L, HIDDEN] of one layer on ``row``; RoPE's cos / sin made here, once."""
    if kind == "linear":
        return lambda x: layer(x, row["cu_seqlens"])[0]
    from omniweave.models.components.rope import rope_cos_sin

    cfg = layer.cfg
    cos, sin = rope_cos_sin(row["position_ids"][None], cfg.rope_dim, cfg.rope_theta)
    return lambda x: layer(x, cos, sin, row["cu_seqlens"])


def run_steps(forward, params: list[torch.Tensor], x: torch.Tensor, repeats: int) -> tuple[list[float], list[float]]:
    """``repeats`` forward + backward steps of ``forward(x)`` against a fixed target: (wall s, CPU s) each."""
    target = torch.linspace(-1, 1, x.numel()).view_as(x)
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        (forward(x) * target).sum().backward()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        for p in params:
            p.grad = None
    return wall, cpu


def run_point(kind: str, length: int, doc_len: int, threads: int, repeats: int, warmup: int,
              memory: bool = False) -> dict:
    """One point in this process: a warm-up step on ``warmup`` tokens, then ``repeats`` timed
    steps; with ``memory`` one step, and the growth of the process's peak RSS over it."""
    torch.set_num_threads(threads)
    layer = make_layer(kind)
    params = list(layer.parameters())
    warm = make_row(warmup, 0)
    run_steps(layer_step(kind, layer, warm), [*params, warm["x"]], warm["x"], 1)  # kernels, thread pools, autograd
    row = make_row(length, doc_len)
    forward = layer_step(kind, layer, row)
    _reset_peak_rss()
    before = _rss_bytes()
    wall, cpu = run_steps(forward, [*params, row["x"]], row["x"], 1 if memory else repeats)
    if memory:
        return {"peak_bytes": _peak_rss_bytes() - before}
    step = statistics.median(wall)
    return {"layer": kind, "length": length, "doc_len": doc_len or length, "documents": len(row["cu_seqlens"]) - 1,
            "step_s": step, "times": wall, "cpu_s": statistics.median(cpu), "tokens_per_s": length / step,
            "params": sum(p.numel() for p in params)}


def point(kind: str, length: int, doc_len: int, args, section: str) -> dict:
    """A point's step times, measured here (the ordinary allocator), and its peak memory: one more
    step in a fresh process under ``POINT_ENV`` (its peak is that step's alone; every allocation
    over 64 KiB its own mapping, which slows the step, so it is not the one timed)."""
    t0 = time.perf_counter()
    res = {"section": section, **run_point(kind, length, doc_len, args.threads, args.repeats, args.warmup_tokens)}
    cmd = [sys.executable, __file__, "--point", kind, str(length), str(doc_len), "--threads", str(args.threads),
           "--warmup-tokens", str(args.warmup_tokens)]
    env = {**os.environ, **POINT_ENV, "OMP_NUM_THREADS": str(args.threads)}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"point {kind} L={length} documents of {doc_len or length} failed:\n{r.stderr[-3000:]}")
    res.update(json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"  {section} {kind:>9} L={length:>6} docs of {res['doc_len']:>6}: step {res['step_s']:.3f} s "
          f"(median of {len(res['times'])}), {res['tokens_per_s']:,.0f} tokens/s, peak +{res['peak_bytes'] / MIB:.0f} MiB "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return res


def pair(rows: list[dict], length: int, doc_len: int) -> dict[str, dict]:
    return {r["layer"]: r for r in rows if r["length"] == length and r["doc_len"] == doc_len}


# ---------------------------------------------------------------------------- (a) one document


def single_rows(args) -> list[dict]:
    return [point(kind, length, 0, args, "single") for length in args.lengths for kind in LAYERS]


def crossover(rows: list[dict]) -> int | None:
    """The first length at which the linear layer's step is shorter than attention's (None: none)."""
    for length in sorted({r["length"] for r in rows}):
        p = pair(rows, length, length)
        if len(p) == 2 and p["linear"]["step_s"] < p["attention"]["step_s"]:
            return length
    return None


def single_table(rows: list[dict]) -> str:
    lines = ["| tokens | linear s | attention s | attention / linear | linear tokens/s | attention tokens/s | "
             "linear peak MiB | attention peak MiB | attention / linear peak |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for length in sorted({r["length"] for r in rows}):
        p = pair(rows, length, length)
        if len(p) < 2:
            continue
        li, at = p["linear"], p["attention"]
        lines.append(f"| {length} | {li['step_s']:.3f} | {at['step_s']:.3f} | **{at['step_s'] / li['step_s']:.2f}x** | "
                     f"{li['tokens_per_s']:,.0f} | {at['tokens_per_s']:,.0f} | {li['peak_bytes'] / MIB:.0f} | "
                     f"{at['peak_bytes'] / MIB:.0f} | {at['peak_bytes'] / max(li['peak_bytes'], 1):.2f}x |")
    cross = crossover(rows)
    lines.append(f"\ncrossover (first length where the linear layer's step is shorter): "
                 f"{cross if cross else 'none at these lengths'}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- (b) a packed row of documents


def packed_rows(args, single: list[dict]) -> list[dict]:
    L, rows = args.packed_length, []
    have = pair(single, L, L)
    for kind in LAYERS:  # the one-document reference, unless (a) measured it
        rows.append({**have[kind], "section": "packed"} if kind in have else point(kind, L, 0, args, "packed"))
    for doc_len in args.doc_lens:
        rows += [point(kind, L, doc_len, args, "packed") for kind in LAYERS]
    return rows


def packed_table(rows: list[dict]) -> str:
    lines = ["| row tokens | documents | linear s | attention s | attention / linear | linear tokens/s | "
             "attention tokens/s | linear peak MiB | attention peak MiB |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for length, doc_len in sorted({(r["length"], r["doc_len"]) for r in rows}, key=lambda k: -k[1]):
        p = pair(rows, length, doc_len)
        li, at = p["linear"], p["attention"]
        lines.append(f"| {length} | {li['documents']} x {doc_len} | {li['step_s']:.3f} | {at['step_s']:.3f} | "
                     f"**{at['step_s'] / li['step_s']:.2f}x** | {li['tokens_per_s']:,.0f} | {at['tokens_per_s']:,.0f} | "
                     f"{li['peak_bytes'] / MIB:.0f} | {at['peak_bytes'] / MIB:.0f} |")
    one = pair(rows, rows[0]["length"], rows[0]["length"])
    for doc_len in sorted({r["doc_len"] for r in rows} - {rows[0]["length"]}):
        p = pair(rows, rows[0]["length"], doc_len)
        lines.append(f"\ndocuments of {doc_len}: step vs one document of the same row length: linear "
                     f"{p['linear']['step_s'] / one['linear']['step_s']:.2f}x, attention "
                     f"{p['attention']['step_s'] / one['attention']['step_s']:.2f}x")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- results


# ---------------------------------------------------------------------------- (c) context parallelism


def _cp_rank(rank: int, world: int, length: int, doc_len: int, repeats: int, threads: int, warmup: int) -> dict:
    """This CP rank's forward + backward of the linear layer on its zigzag share of the row
    (parallel/context/linear.py passing the states), or the whole row at world 1."""
    import torch.distributed as dist

    from omniweave.parallel.context.attention import CPContext
    from omniweave.parallel.context.linear import LinearCP
    from omniweave.parallel.context.sharding import plan_cp_shard, shard_rows

    torch.set_num_threads(threads)
    layer = make_layer("linear")
    params = list(layer.parameters())
    if world > 1:
        layer.cp_fn = LinearCP(CPContext(group=dist.group.WORLD))

    def local(row):
        if world == 1:
            return row["x"], row["cu_seqlens"]
        plan = plan_cp_shard(row["cu_seqlens"], world)
        return shard_rows(row["x"].detach(), plan, rank).requires_grad_(), plan.local_cu_seqlens()

    x, cu = local(make_row(warmup, 0))
    run_steps(lambda x: layer(x, cu)[0], [*params, x], x, 1)
    x, cu = local(make_row(length, doc_len))
    wall, _ = run_steps(lambda x: layer(x, cu)[0], [*params, x], x, repeats)
    return {"rank_rows": x.shape[0], "step_s": statistics.median(wall)}


def cp_rows(args) -> list[dict]:
    """(c): the linear layer on one row of ``--cp-length`` tokens (documents of ``--cp-doc-len``)
    at each of ``--cp`` ranks (gloo processes, ``--threads`` each), the slowest rank's median step."""
    from omniweave.parallel.spawn import run_ranks

    rows, L, n = [], args.cp_length, args.cp_doc_len
    docs = -(-L // n)
    cfg = LINEAR
    conv_dim = 2 * cfg["num_key_heads"] * cfg["key_head_dim"] + cfg["num_value_heads"] * cfg["value_head_dim"]
    state = cfg["num_value_heads"] * cfg["key_head_dim"] * (cfg["key_head_dim"] + cfg["value_head_dim"])
    for cp in args.cp:
        ranks = run_ranks(_cp_rank, cp, L, n, args.repeats, args.threads, args.warmup_tokens, timeout=3600, quiet=True)
        sent = 0 if cp == 1 else 2 * docs * (3 * conv_dim + state) * 4  # tails (K-1 = 3 rows) and [S_x | M], fp32
        row = {"section": "cp", "cp": cp, "length": L, "doc_len": n, "rank_rows": ranks[0]["rank_rows"],
               "step_s": max(r["step_s"] for r in ranks), "sent_bytes": sent}
        rows.append(row)
        print(f"  cp {cp}: {row['rank_rows']} rows per rank, step {row['step_s']:.3f} s, sends {sent / MIB:.2f} MiB")
    return rows


def cp_table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["cp"] == 1), None)
    lines = ["| cp | rows per rank | step s (slowest rank) | vs one rank | sent per rank per step, forward |",
             "|---:|---:|---:|---:|---:|"]
    for r in rows:
        ratio = f"{base['step_s'] / r['step_s']:.2f}x" if base else "-"
        lines.append(f"| {r['cp']} | {r['rank_rows']} | {r['step_s']:.3f} | {ratio} | {r['sent_bytes'] / MIB:.2f} MiB |")
    return "\n".join(lines)


def plot(sections: dict[str, list[dict]], path: Path) -> None:
    plt = pyplot()
    fig, (speed, memory, cp) = plt.subplots(1, 3, figsize=(16, 4.2))
    colours = {"linear": "C0", "attention": "C1"}
    for kind in LAYERS:
        pts = sorted((r for r in sections["single"] if r["layer"] == kind), key=lambda r: r["length"])
        label = {"linear": "Gated DeltaNet (chunked, C = 64)", "attention": "gated GQA attention (sdpa)"}[kind]
        speed.plot([r["length"] for r in pts], [r["tokens_per_s"] for r in pts], "o-", color=colours[kind],
                   label=f"{label}, one document")
        memory.plot([r["length"] for r in pts], [r["peak_bytes"] / MIB for r in pts], "o-", color=colours[kind],
                    label=label)
        for r in sections["packed"]:
            if r["layer"] == kind and r["doc_len"] != r["length"]:
                speed.plot(r["length"], r["tokens_per_s"], "s", color=colours[kind], mfc="none", ms=9,
                           label=f"{kind}, packed: documents of {r['doc_len']}")
                memory.plot(r["length"], r["peak_bytes"] / MIB, "s", color=colours[kind], mfc="none", ms=9)
    for ax in (speed, memory):
        ax.set_xlabel("row length (tokens)")
        if sections["single"] or sections["packed"]:
            ax.set_xscale("log", base=2)
    if sections["single"] or sections["packed"]:
        speed.set_yscale("log")
    if sections["cp"]:
        base = next((r["step_s"] for r in sections["cp"] if r["cp"] == 1), None)
        ranks = [r["cp"] for r in sections["cp"]]
        cp.plot(ranks, [base / r["step_s"] if base else 0 for r in sections["cp"]], "o-", color="C0",
                label="Gated DeltaNet, states passed down the ranks")
        cp.plot(ranks, ranks, ":", color="grey", label="ideal (cp x)")
        cp.set_xticks(ranks)
        cp.legend(fontsize=7)
    cp.set_xlabel("context-parallel ranks")
    cp.set_ylabel("one rank's step / the slowest CP rank's step")
    cp.set_title(f"Context parallelism ({sections['cp'][0]['length'] if sections['cp'] else '-'} tokens)")
    speed.set_ylabel("tokens/s, forward + backward of one layer")
    speed.set_title("Step throughput (wall-clock median)")
    speed.legend(fontsize=7)
    memory.set_ylabel("peak memory growth of the step (MiB, RSS)")
    memory.set_title("Peak memory")
    memory.legend(fontsize=7)
    save(fig, path, grid=[speed, memory, cp])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384],
                   help="(a) one-document rows of these lengths")
    p.add_argument("--packed-length", type=int, default=16384, help="(b) the packed row's length")
    p.add_argument("--doc-lens", type=int, nargs="+", default=[2048], help="(b) its documents' lengths, one row each")
    p.add_argument("--repeats", type=int, default=3, help="measured steps per point (median)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads")
    p.add_argument("--warmup-tokens", type=int, default=WARMUP, help="tokens of each point's warm-up step")
    p.add_argument("--out", type=Path, default=Path("bench/out"), help="every result file goes here (and only here)")
    p.add_argument("--quick", action="store_true",
                   help=QUICK_HELP + ": rows of 256 and 1024 tokens, packed 1024 in documents of 256, 1 repeat")
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="(c) context-parallel sizes (gloo ranks)")
    p.add_argument("--cp-length", type=int, default=16384, help="(c) the row's length")
    p.add_argument("--cp-doc-len", type=int, default=4096, help="(c) its documents' length")
    p.add_argument("--sections", nargs="+", default=["single", "packed", "cp"], choices=["single", "packed", "cp"],
                   help="which sections to run")
    p.add_argument("--point", nargs=3, help=argparse.SUPPRESS)  # internal: LAYER LENGTH DOC_LEN, peak as JSON on stdout
    args = p.parse_args()
    if args.point:
        kind, length, doc_len = args.point[0], int(args.point[1]), int(args.point[2])
        print(json.dumps(run_point(kind, length, doc_len, args.threads, 1, args.warmup_tokens, memory=True)))
        return
    if args.quick:
        note("rows of 256 and 1024 tokens, a packed row of 1024 in documents of 256, 1 repeat")
        args.lengths, args.packed_length, args.doc_lens, args.repeats, args.warmup_tokens = [256, 1024], 1024, [256], 1, 64
        args.cp, args.cp_length, args.cp_doc_len = [1, 2], 512, 128
    t0 = time.perf_counter()
    sections = {"single": single_rows(args) if "single" in args.sections else []}
    sections["packed"] = packed_rows(args, sections["single"]) if "packed" in args.sections else []
    sections["cp"] = cp_rows(args) if "cp" in args.sections else []
    text = "\n\n".join(part for part in (
        sections["single"] and f"(a) one document\n\n{single_table(sections['single'])}",
        sections["packed"] and f"(b) a packed row of {args.packed_length} tokens\n\n{packed_table(sections['packed'])}",
        sections["cp"] and f"(c) context parallelism, a row of {args.cp_length} tokens in documents of "
                           f"{args.cp_doc_len}\n\n{cp_table(sections['cp'])}") if part)
    print(text)
    setting = (f"CPU, fp32, {args.threads} thread(s), wall-clock median of {args.repeats}, hidden {HIDDEN}; "
               f"attention {ATTENTION}; linear {LINEAR}")
    data = {"hidden": HIDDEN, "attention": ATTENTION, "linear": LINEAR, "threads": args.threads,
            "repeats": args.repeats, "warmup_tokens": args.warmup_tokens, "crossover": crossover(sections["single"]),
            "sections": sections}
    write_results(args.out, "linear_attention", text, data, lambda path: plot(sections, path), setting)
    print(f"wrote {args.out / 'linear_attention.png'}, .json, .md; total {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
