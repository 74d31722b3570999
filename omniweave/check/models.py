"""``omniweave check`` rows for whole components in bf16 against fp32: each decoder family's training
step (loss and every gradient) and each vision tower's forward and backward, on small random
models with packed rows (documents of 1 token and long ones; several media items).

bf16 here is what training uses without FSDP: ``torch.autocast(bfloat16)`` over fp32 weights, so
the attention backend chosen for bf16 on this device (``varlen`` on CUDA) runs inside the model.
Gradients are compared all together (relative L2 error, :func:`grad_error`).
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from omniweave.check import Row, rel_err, verdict
from omniweave.models.components.decoder import Decoder, DecoderConfig
from omniweave.models.components.qwen3_vit import Qwen3VisionTransformer, Qwen3ViTConfig
from omniweave.models.components.vit import (
    Qwen2ViTConfig,
    Qwen25ViTConfig,
    VisionTransformer,
)
from omniweave.models.text import CausalLM

# bf16 vs fp32 of a 2-layer random model: a broken kernel or mask gives errors of order 1.
LOSS_LIMIT = 2e-2  # a decoder's loss; a tower's output features
GRAD_LIMIT = 3e-2

_SMALL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2)
DECODERS: dict[str, Callable[[], DecoderConfig]] = {
    "qwen2 (M-RoPE, qkv bias)": lambda: DecoderConfig(**_SMALL, family="qwen2", qkv_bias=True, mrope_section=[4, 6, 6]),
    "llama-3 (llama3 rope)": lambda: DecoderConfig(**_SMALL, family="llama", rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64}),
    "qwen3 (qk-norm, head_dim 64)": lambda: DecoderConfig(**_SMALL, family="qwen3", qk_norm=True, head_dim=64),
    "qwen3-moe (8 experts, top-2)": lambda: DecoderConfig(
        **_SMALL, family="qwen3_moe", qk_norm=True, head_dim=64, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[1]),
    "deepseek-v3 (MLA qk 48 / v 32, sigmoid router)": lambda: DecoderConfig(
        **{**_SMALL, "num_kv_heads": 4}, family="deepseek_v3", q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1, norm_topk_prob=True),
}  # fmt: skip
# bf16 router logits flip a few near-tied top-k choices, and a flipped token's gradient goes to
# another expert: MoE gradients agree less (measured 1.2-1.6e-2 on CPU) than dense ones (5-9e-3).
# (DeepSeek-V3's routed_scaling_factor 2.5 would weigh those flips 2.5x: 4.4e-2; the row keeps 1.0: 2.1e-2.)
MOE_GRAD_LIMIT = 5e-2
_VIT = dict(depth=2, hidden_size=128, num_heads=4, intermediate_size=192)
TOWERS: dict[str, Callable[[], VisionTransformer]] = {
    "qwen2-vl vision tower": lambda: VisionTransformer(Qwen2ViTConfig(**_VIT)),
    "qwen2.5-vl vision tower (windows)": lambda: VisionTransformer(
        Qwen25ViTConfig(**_VIT, window_size=56, fullatt_block_indexes=[1])),
    "qwen3-vl vision tower (position table, DeepStack)": lambda: Qwen3VisionTransformer(
        Qwen3ViTConfig(**_VIT, num_position_embeddings=64, deepstack_visual_indexes=[0])),
}  # fmt: skip


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _run(model, step_fn, device, bf16: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=bf16):
        loss, compared = step_fn()
    loss.float().backward()
    return compared.detach().float(), _grads(model)


def bf16_vs_fp32(model, step_fn, device) -> tuple[float, float]:
    """(error of the compared tensor, gradient error) of bf16 autocast against fp32 on the same
    weights; ``step_fn() -> (loss to differentiate, tensor to compare)``."""
    ref, ref_grads = _run(model, step_fn, device, bf16=False)
    got, grads = _run(model, step_fn, device, bf16=True)
    if set(grads) != set(ref_grads):
        raise RuntimeError(f"bf16 left gradients out: {sorted(set(ref_grads) - set(grads))}")
    return rel_err(got, ref), grad_error(grads, ref_grads)


def grad_error(grads: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """||g - g_ref|| / ||g_ref|| over all parameters together (L2). Per-parameter max errors are
    not a bf16 criterion: a LayerNorm bias's gradient sums thousands of bf16-rounded rows that
    nearly cancel, so its relative error is large even when every kernel is right."""
    diff = sum(float((grads[n].double() - ref[n].double()).square().sum()) for n in ref)
    norm = sum(float(ref[n].double().square().sum()) for n in ref)
    return (diff / max(norm, 1e-60)) ** 0.5


def decoder_batch(vocab: int, lens: list[int], device, mrope: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (sum(lens),), generator=g)
    labels = torch.cat([torch.cat([ids[s + 1 : s + n], torch.tensor([-100])]) for s, n in
                        zip(torch.tensor([0, *lens]).cumsum(0).tolist(), lens)])  # fmt: skip
    pos = torch.cat([torch.arange(n) for n in lens])
    batch = {"input_ids": ids, "labels": labels, "position_ids": pos.expand(3, -1) if mrope else pos[None],
             "cu_seqlens": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)}
    return {k: v.to(device) for k, v in batch.items()}


def decoder_rows(device, quick: bool) -> Iterator[Row]:
    lens = [1, 60, 1, 300] if quick else [1, 300, 1, 2000, 40]
    for name, make in DECODERS.items():
        torch.manual_seed(0)
        cfg = make()
        model = CausalLM(Decoder(cfg)).to(device)
        model.foundation.init_weights()
        batch = decoder_batch(cfg.vocab_size, lens, device, cfg.mrope_section is not None)
        n = int((batch["labels"] != -100).sum())
        def step():
            loss = model(batch).loss_sum / n
            return loss, loss

        loss_err, grad_err = bf16_vs_fp32(model, step, device)
        yield verdict("models", f"{name}: step loss", loss_err, LOSS_LIMIT, f"docs {lens}")
        limit = MOE_GRAD_LIMIT if cfg.num_experts else GRAD_LIMIT
        yield verdict("models", f"{name}: step grads", grad_err, limit, "relative L2, all parameters")


def tower_rows(device, quick: bool) -> Iterator[Row]:
    grids = [[1, 4, 6], [2, 8, 8]] if quick else [[1, 16, 24], [4, 16, 16], [1, 2, 2]]  # images and a video
    grid = torch.tensor(grids, device=device)
    for name, make in TOWERS.items():
        torch.manual_seed(0)
        tower = make().to(device)
        tower.init_weights()
        g = torch.Generator().manual_seed(1)
        pixels = torch.randn(int(grid.prod(-1).sum()), tower.cfg.in_dim, generator=g).to(device)
        width = tower.cfg.hidden_size * (1 + getattr(tower, "deepstack_levels", 0))  # DeepStack levels ride along
        probe = torch.randn(pixels.shape[0], width, generator=g).to(device)
        def step():
            out = tower(pixels, grid).float()
            return (out * probe).sum(), out

        out_err, grad_err = bf16_vs_fp32(tower, step, device)
        yield verdict("models", f"{name}: forward", out_err, LOSS_LIMIT, f"grids {grids}")
        yield verdict("models", f"{name}: grads", grad_err, GRAD_LIMIT, "relative L2, all parameters")


def rows(device: torch.device, quick: bool) -> Iterator[Row]:
    yield from decoder_rows(device, quick)
    yield from tower_rows(device, quick)
