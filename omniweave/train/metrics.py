"""Training metrics: one log line per step, ``metrics.jsonl``, TensorBoard events, ``loss.png``.

FLOPs per step (for MFU) are the usual estimate: 6 × non-embedding parameters × tokens for the
matmuls plus 6 × layers × hidden × Σ doc_len² for causal attention (forward + backward, the
mask halving 12·L·d·n²). The peak is the device's: on CPU a measured fp32 matmul peak.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn


def matmul_peak_flops(device: torch.device, n: int = 1024, repeats: int = 5, timer=time.perf_counter,
                      dtype: torch.dtype = torch.float32) -> float:
    """Best observed FLOP/s of an n×n matmul in ``dtype`` on ``device`` (the MFU denominator on CPU);
    ``timer`` may be a CPU-time clock (benchmarks on a shared box)."""
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    mod = getattr(torch, device.type, None) if device.type != "cpu" else None
    sync = mod.synchronize if mod is not None and hasattr(mod, "synchronize") else (lambda: None)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = timer()
        a @ b
        sync()
        best = min(best, timer() - t0)
    return 2 * n**3 / best


# Dense bf16 peaks of common accelerators (FLOP/s); anything else is measured.
KNOWN_PEAKS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def device_peak_flops(device: torch.device, precision: str = "fp32") -> float:
    if device.type == "cuda" and precision == "bf16":
        name = torch.cuda.get_device_name(device)
        for key, peak in KNOWN_PEAKS.items():
            if key in name:
                return peak
    return matmul_peak_flops(device)


def model_flop_counts(model: nn.Module) -> tuple[int, int, int]:
    """(non-embedding parameters a token uses, decoder layers, attention width) for the FLOP
    estimate: the foundation's (``foundation_flop_counts``) plus every other component's weights;
    a video-diffusion model's generator (``generator_flop_counts``)."""
    if hasattr(model, "generator"):
        return generator_flop_counts(model.generator)
    f = model.foundation
    n, layers, width = foundation_flop_counts(f)
    ours = {id(p) for p in f.parameters()}
    expert = getattr(model, "action_expert", None)  # runs on its chunks' tokens: the objective counts it (flops)
    ours |= {id(p) for p in expert.parameters()} if expert is not None else set()
    n += sum(p.numel() for p in {id(p): p for p in model.parameters() if id(p) not in ours}.values())
    return n, layers, width


def foundation_flop_counts(f: nn.Module) -> tuple[int, int, int]:
    """A decoder's (non-embedding parameters a token uses, attention layers, attention width): routed
    MoE experts count k of E (DeepSeek-V3: 37B of 671B), the LM head counts even when tied, the width
    is heads · (qk + v head dims) / 2 (= hidden for most decoders; MLA's qk 192 and v 128 differ).
    A hybrid model (``layer_types``) counts its full-attention layers only for the Σ len² term and
    adds its linear layers' scan to the per-token work (``cost_model.linear_scan_equivalent``).
    Works on the meta device (the DP cost model counts a recipe's foundation without weights)."""
    from omniweave.models.components.moe import MoE
    from omniweave.parallel.cost_model import linear_scan_equivalent

    params = {id(p): p for p in f.parameters()}
    emb = f.embed_tokens.weight
    n = sum(p.numel() for p in params.values()) - (0 if f.lm_head.weight is emb else emb.numel())
    for m in f.modules():
        if isinstance(m, MoE):
            n -= int((m.experts.gate_up_proj.numel() + m.experts.down_proj.numel()) * (1 - m.active_fraction()))
    c = f.config
    linear = sum(c.is_linear_layer(i) for i in range(len(f.layers)))
    n += linear * linear_scan_equivalent(c) if linear else 0  # the linear layers' scan, linear in tokens
    v_dim = c.v_head_dim if c.mla else c.head_dim
    return n, len(f.layers) - linear, c.num_heads * (c.head_dim + v_dim) // 2


def generator_flop_counts(g: nn.Module) -> tuple[int, int, int]:
    """A DiT's (parameters a latent token uses, 2 x layers, width) for ``step_flops``: its blocks, patch
    embedding and head, less the cross-attention keys / values, which run on text tokens (the
    objective counts them and the cross-attention: ``cross_attention_flops``); the per-clip time and
    text embedders are negligible. Self-attention is bidirectional: each (query, key) pair costs
    twice a causal document's len² / 2 share, hence 2 x layers for ``step_flops``' 6 len² term."""
    text_kv = {id(p) for b in g.blocks for m in _context_kv(b) for p in m.parameters()}
    per_token = [*g.blocks.parameters(), *g.patch_embedding.parameters(), *g.proj_out.parameters()]
    n = sum(p.numel() for p in per_token if id(p) not in text_kv)
    return n, 2 * g.config.num_layers, g.config.inner_dim


def _context_kv(block: nn.Module) -> list[nn.Module]:
    """A DiT block's projections that run on its context (text; an I2V block's image tokens too)."""
    a = block.attn2
    return [a.to_k, a.to_v, *(getattr(a, name) for name in ("add_k_proj", "add_v_proj") if hasattr(a, name))]


def cross_attention_flops(g: nn.Module, clip_tokens: list[int], text_tokens: list[int],
                          image_tokens: list[int] | None = None) -> float:
    """A DiT's training FLOPs that scale with the text: each block's key / value projections over a
    clip's text tokens (6 N), and each clip's queries against its own text (12 width per pair); an
    image-to-video DiT's added key / value projections over its image tokens and the queries against
    them likewise (the image embedder's few tokens are left out)."""
    c = g.config
    kv = sum(p.numel() for b in g.blocks for m in (b.attn2.to_k, b.attn2.to_v) for p in m.parameters())
    pairs = sum(q * k for q, k in zip(clip_tokens, text_tokens))
    flops = 6.0 * kv * sum(text_tokens) + 12.0 * c.num_layers * c.inner_dim * pairs
    if image_tokens:
        added = sum(p.numel() for b in g.blocks for m in (b.attn2.add_k_proj, b.attn2.add_v_proj)
                    for p in m.parameters())
        pairs = sum(q * k for q, k in zip(clip_tokens, image_tokens))
        flops += 6.0 * added * sum(image_tokens) + 12.0 * c.num_layers * c.inner_dim * pairs
    return flops


def expert_flop_counts(expert: nn.Module) -> tuple[int, int, int]:
    """An action expert's (parameters a chunk token uses, layers, attention width heads · head_dim)."""
    c = expert.config
    return sum(p.numel() for p in expert.parameters()), c.num_layers, c.num_heads * c.head_dim


def chunk_flops(counts: tuple[int, int, int], chunk_tokens: int, pairs: int) -> float:
    """Training FLOPs of action chunks: 6·N per chunk token, and 12·width per (query, key) pair per
    layer (each chunk's H queries see its prefix and itself, no causal half: ``step_flops``' 6·len²
    is 12 per pair of a causal document's len²/2)."""
    n_params, layers, width = counts
    return 6.0 * n_params * chunk_tokens + 12.0 * layers * width * pairs


def step_flops(counts: tuple[int, int, int], tokens: int, sum_len2: int) -> float:
    n_params, layers, hidden = counts
    return 6.0 * n_params * tokens + 6.0 * layers * hidden * sum_len2


# The console line: (label, metrics key, format); "%" shows a fraction as a percentage, "GB" adds the unit.
SFT_LINE = (("loss", "loss", ".4f"), ("lr", "lr", ".3e"), ("grad_norm", "grad_norm", ".3f"),
            ("tokens/s", "tokens_per_s", ".0f"), ("MFU", "mfu", "%"), ("mem", "memory_gb", "GB"))


def _fmt_field(value: Any, fmt: str) -> str:
    if not isinstance(value, (int, float)):
        return str(value)
    if fmt == "%":
        return f"{100 * value:.1f}%"
    if fmt == "GB":
        return f"{value:.2f} GB"
    return format(value, fmt)


def _fmt_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class MetricsLogger:
    """Rank 0 only writes; other ranks get a logger whose methods do nothing."""

    def __init__(self, run_dir: Path, total_steps: int, start_step: int, enabled: bool, log_interval: int = 1,
                 tensorboard: bool = True, line=SFT_LINE):
        self.enabled, self.run_dir, self.total, self.log_interval = enabled, Path(run_dir), total_steps, log_interval
        self.line = line
        self.start_step, self.t0 = start_step, time.perf_counter()
        self.history: list[dict[str, Any]] = []
        self._jsonl = self._tb = self._bar = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / "metrics.jsonl"
        if path.exists():  # resuming: keep the steps before the checkpoint, drop the ones redone
            kept = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln).get("step", 0) <= start_step]
            path.write_text("".join(ln + "\n" for ln in kept))
            self.history = [json.loads(ln) for ln in kept]
        self._jsonl = path.open("a")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step + 1)
            except ImportError:  # tensorboard is optional
                self._tb = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        step = record["step"]
        done = step - self.start_step
        elapsed = time.perf_counter() - self.t0
        record["eta_s"] = round(elapsed / max(done, 1) * (self.total - step), 1)
        self.history.append(record)
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)) and v is not None and math.isfinite(v):
                    self._tb.add_scalar(f"train/{k}", v, step)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix({label: _fmt_field(record.get(key), fmt) for label, key, fmt in self.line[:3]},
                                  refresh=False)
        if step % self.log_interval == 0 or step == self.total:
            fields = [f"{label} {_fmt_field(record[key], fmt)}" for label, key, fmt in self.line if key in record]
            line = " | ".join([f"step {step}/{self.total}", *fields, f"ETA {_fmt_eta(record['eta_s'])}"])
            if record.get("skipped"):
                line += " | SKIPPED (non-finite)"
            (self._bar.write if self._bar is not None else print)(line)
            sys.stdout.flush()

    def log_eval(self, step: int, result: dict[str, Any]) -> None:
        if not self.enabled:
            return
        rec = {"step": step, **{k: v for k, v in result.items() if isinstance(v, (int, float))}}
        with (self.run_dir / "eval.jsonl").open("a") as f:
            f.write(json.dumps(rec) + "\n")
        if self._tb is not None:
            for k, v in rec.items():
                if k != "step":
                    self._tb.add_scalar(k.replace("eval_", "eval/", 1), v, step)
        print(f"eval at step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in rec.items() if k != "step"), flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()
        plot_loss(self.history, self.run_dir / "loss.png")


def plot_loss(history: list[dict[str, Any]], out: Path) -> None:
    if not history:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history if not r.get("skipped")]
    loss = [r["loss"] for r in history if not r.get("skipped")]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, loss, lw=1)
    ax.set(xlabel="step", ylabel="loss (per loss token)", title="training loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
