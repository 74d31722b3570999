"""``omniweave check`` rows for a short training run: tokens/s and MFU of the decoder's training step
(forward, backward, AdamW) on one packed row, against the matmul peak measured in the same run.

The model is a Qwen2-family preset (``PRESETS``, shared with ``bench/model_step.py``): ``medium``
(~200M parameters) on an accelerator, ``small`` on CPU and with ``--quick``. Precision is bf16
autocast on CUDA (what training uses), fp32 elsewhere; the peak is measured for the same dtype.
MFU = useful FLOPs (6·N per token + causal attention, ``train.metrics.step_flops``) / median step
time / measured peak. The run passes when its loss is finite and falls over the steps (the same
row every step: a training step that does not learn is broken); tokens/s and MFU are reported.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Iterator

import torch

from omniweave.check import Row
from omniweave.check.models import decoder_batch
from omniweave.models.components.decoder import Decoder, DecoderConfig
from omniweave.models.text import CausalLM
from omniweave.train.metrics import matmul_peak_flops, model_flop_counts, step_flops

# Qwen2 family, GQA 2:1, head_dim 64 (transformers config keys, as bench/model_step.py builds them)
PRESETS = {
    "small": dict(vocab_size=8192, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=1),
    "medium": dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                   num_attention_heads=16, num_key_value_heads=8),
}  # fmt: skip


def preset_config(name: str) -> DecoderConfig:
    p = PRESETS[name]
    return DecoderConfig(vocab_size=p["vocab_size"], hidden_size=p["hidden_size"],
                         intermediate_size=p["intermediate_size"], num_layers=p["num_hidden_layers"],
                         num_heads=p["num_attention_heads"], num_kv_heads=p["num_key_value_heads"], family="qwen2",
                         qkv_bias=True)  # fmt: skip


def document_lengths(total: int, seed: int = 0) -> list[int]:
    """Document lengths (64..2048 tokens) summing to ``total`` (the benches' mix)."""
    g = torch.Generator().manual_seed(seed)
    lens, left = [], total
    while left > 0:
        n = min(left, int(torch.randint(64, 2049, (1,), generator=g)))
        lens.append(n)
        left -= n
    return lens


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_run(device: torch.device, preset: str, tokens: int, steps: int, warmup: int) -> dict:
    """Median step time, tokens/s, MFU and the losses of ``warmup + steps`` optimizer steps."""
    torch.manual_seed(0)
    cfg = preset_config(preset)
    model = CausalLM(Decoder(cfg)).to(device)
    model.foundation.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type == "cuda")
    lens = document_lengths(tokens)
    batch = decoder_batch(cfg.vocab_size, lens, device, mrope=False)
    n = int((batch["labels"] != -100).sum())
    bf16 = device.type == "cuda"
    times, losses = [], []
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(batch).loss_sum / n
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        _sync(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    step_s = statistics.median(times)
    dtype = torch.bfloat16 if bf16 else torch.float32
    peak = matmul_peak_flops(device, n=8192 if device.type == "cuda" else 1024, dtype=dtype)
    flops = step_flops(model_flop_counts(model), tokens, sum(x * x for x in lens))
    return {"preset": preset, "tokens": tokens, "step_s": step_s, "tokens_per_s": tokens / step_s,
            "peak": peak, "mfu": flops / step_s / peak, "losses": losses, "dtype": str(dtype).removeprefix("torch.")}


def rows(device: torch.device, quick: bool) -> Iterator[Row]:
    accel = device.type != "cpu"
    preset = "medium" if accel and not quick else "small"
    tokens = 16384 if accel else (1024 if quick else 4096)
    r = train_run(device, preset, tokens, steps=3 if quick else 10, warmup=1 if quick else 3)
    first, last = r["losses"][0], r["losses"][-1]
    learns = all(math.isfinite(x) for x in r["losses"]) and last < first
    what = f"{preset} preset, {r['dtype']}, {tokens} tokens/row"
    yield Row("speed", "training step learns", "pass" if learns else "FAIL", f"{first:.3f}->{last:.3f}", "falls",
              f"loss over {len(r['losses'])} steps, {what}")
    yield Row("speed", "training tokens/s", "info", f"{r['tokens_per_s']:.0f}", "", f"median of steps, {what}")
    yield Row("speed", f"matmul peak {r['dtype']} (measured)", "info", f"{r['peak'] / 1e12:.2f}", "TFLOP/s")
    yield Row("speed", "MFU vs measured peak", "info", f"{100 * r['mfu']:.1f}%", ">= 45% (GPU)" if accel else "",
              "6N + attention FLOPs / step time / peak")
