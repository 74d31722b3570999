"""Benchmark: LoRA (omniweave/models/lora.py) vs full fine-tuning of the same recipe, one CPU process, fp32.

The demo recipe with a bigger foundation (``MODEL``: hidden 512, intermediate 2816, 4 layers, GQA
8:2, vocabulary 32000; the demo's ViT and projector widened as in bench/context_parallel.py), on
the same video + text rows (bench/context_parallel.make_row). Arms, each from the same seeded
weights: **full** (every parameter trains) and **LoRA at each r** of ``--ranks``: adapters on every
Linear of the foundation and of the vision tower (``targets: all-linear``, alpha = 2r), the
projector trained in full, the rest frozen — what a LoRA recipe of this model would say:

    +model.foundation.lora={r: R, alpha: 2R, targets: all-linear}
    +model.image_encoder.lora={r: R, alpha: 2R, targets: all-linear}

Per arm: trainable parameters; gradient and AdamW state bytes after one step, exact (counted from
the tensors: the optimizer holds state only for what requires grad, train/optim.py); the step time
(forward + backward + AdamW step of ``--rows`` rows, median of ``--repeats`` after a warm-up step,
the arms taking turns step by step, wall clock, ``--threads`` intra-op threads). The first losses
of all arms are equal (a fresh adapter computes the base model). Ratios are against the full arm of the same run.

    python bench/lora.py [--ranks 8 16 64] [--length 512] [--rows 2] [--repeats 5] [--threads 1] [--out bench/out] [--quick]

``--quick`` (bench/quick.py): r = 16 only, 2 tiny layers, 128-token rows, 1 repeat; not meaningful figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: omniweave
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/
from context_parallel import MODEL as CP_MODEL, make_row  # noqa: E402
from figure import pyplot, save, write_results  # noqa: E402
from quick import HELP as QUICK_HELP, note  # noqa: E402

MODEL = [*CP_MODEL, "model.foundation.hidden_size=512", "model.foundation.intermediate_size=2816",
         "model.foundation.num_heads=8", "model.foundation.num_kv_heads=2", "model.foundation.vocab_size=32000",
         "model.projector.out_dim=512"]  # fmt: skip
QUICK_MODEL = [*CP_MODEL, "model.foundation.num_layers=2"]


def lora_overrides(r: int | None) -> list[str]:
    """The recipe overrides of an arm (None: full fine-tuning)."""
    if r is None:
        return []
    spec = f"{{r: {r}, alpha: {2 * r}, targets: all-linear}}"
    return [f"+model.foundation.lora={spec}", f"+model.image_encoder.lora={spec}"]


def build(model_overrides: list[str], r: int | None):
    """The arm's model: the seeded base weights (identical in every arm), then its adapters."""
    from omniweave.config import load_recipe, to_dict
    from omniweave.models.lora import apply_lora
    from omniweave.models.registry import build_model

    model_cfg = to_dict(load_recipe("demo", [*model_overrides, *lora_overrides(r)]).model)
    torch.manual_seed(0)
    model = build_model(model_cfg, adapters=False)
    model.init_weights()
    apply_lora(model, model_cfg)
    return model.train()


def tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class Arm:
    """One arm: its model and AdamW, stepped on the rows with the step times recorded."""

    def __init__(self, model_overrides: list[str], r: int | None):
        from omegaconf import OmegaConf

        from omniweave.train.optim import build_optimizer

        self.r, self.model = r, build(model_overrides, r)
        self.opt = build_optimizer(self.model, OmegaConf.create({"train": {"lr": 1e-4, "steps": 1, "global_batch": 1}, "model": {}}))
        self.times: list[float] = []
        self.grads_b = 0

    def step(self, rows: list[dict], record: bool) -> float:
        n = sum(row["num_loss_tokens"] for row in rows)
        t0 = time.perf_counter()
        loss = sum(self.model(row).loss_sum for row in rows) / n
        loss.backward()
        self.grads_b = tensor_bytes(p.grad for p in self.model.parameters() if p.grad is not None)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if record:
            self.times.append(time.perf_counter() - t0)
        return float(loss.detach())

    def result(self, first_loss: float) -> dict:
        state = [t for s in self.opt.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
        params = list(self.model.parameters())
        return {"arm": "full" if self.r is None else f"LoRA r={self.r}", "r": self.r,
                "params": sum(p.numel() for p in params), "trainable": sum(p.numel() for p in params if p.requires_grad),
                "grads_b": self.grads_b, "optim_b": tensor_bytes(state), "weights_b": tensor_bytes(params),
                "step_s": statistics.median(self.times), "steps_s": self.times, "first_loss": first_loss}


def measure(model_overrides: list[str], ranks: list[int], rows: list[dict], repeats: int) -> list[dict]:
    """Every arm warmed up by one step (which creates the AdamW state), then ``repeats`` rounds in
    which the arms take turns, so that all of them see the shared machine's load alike."""
    arms = [Arm(model_overrides, r) for r in [None, *ranks]]
    first = [arm.step(rows, record=False) for arm in arms]
    for _ in range(repeats):
        for arm in arms:
            arm.step(rows, record=True)
    return [arm.result(loss) for arm, loss in zip(arms, first)]


def table(results: list[dict]) -> str:
    full = results[0]
    lines = [f"model: {full['params'] / 1e6:.1f}M parameters; step = forward + backward + AdamW step", "",
             "| arm | trainable params | x full | grads MB | AdamW state MB | x full | step s (median) | x full |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        lines.append(f"| {r['arm']} | {r['trainable'] / 1e6:.3f}M | {r['trainable'] / full['trainable']:.4f} | "
                     f"{r['grads_b'] / 2**20:.1f} | {r['optim_b'] / 2**20:.1f} | {r['optim_b'] / full['optim_b']:.4f} | "
                     f"{r['step_s']:.3f} | {r['step_s'] / full['step_s']:.2f} |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    names = [r["arm"] for r in results]
    a.bar(names, [r["optim_b"] / 2**20 for r in results], label="AdamW state")
    a.bar(names, [r["grads_b"] / 2**20 for r in results], bottom=[r["optim_b"] / 2**20 for r in results],
          label="gradients")
    a.set_ylabel("MB")
    a.set_title("optimizer state + gradients")
    a.legend()
    b.bar(names, [r["step_s"] for r in results])
    b.set_ylabel("seconds")
    b.set_title("step time (forward + backward + AdamW)")
    save(fig, path, grid=(a, b))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 64], help="LoRA ranks r to measure")
    p.add_argument("--length", type=int, default=512, help="~tokens per row")
    p.add_argument("--rows", type=int, default=2, help="rows per step")
    p.add_argument("--repeats", type=int, default=5, help="measured steps per arm (after a warm-up step)")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads")
    p.add_argument("--out", type=Path, default=Path("bench/out"), help="every result file goes here (and only here)")
    p.add_argument("--quick", action="store_true", help=QUICK_HELP + ": r 16, 2 small layers, 128-token rows")
    args = p.parse_args()
    model = MODEL
    if args.quick:
        args.ranks, args.length, args.rows, args.repeats, model = [16], 128, 1, 1, QUICK_MODEL
        note("r 16, 2 small layers, 1 row of 128 tokens, 1 repeat")
    torch.set_num_threads(args.threads)
    rows = [make_row(args.length, seed) for seed in range(args.rows)]
    t0 = time.perf_counter()
    results = measure(model, args.ranks, rows, args.repeats)
    text = table(results)
    print(text)
    print(f"total {time.perf_counter() - t0:.0f} s", flush=True)
    write_results(args.out, "lora", text, results, lambda path: plot(results, path),
                  f"CPU, fp32, {args.threads} thread(s)")


if __name__ == "__main__":
    main()
