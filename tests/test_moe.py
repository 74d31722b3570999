"""The MoE block against transformers' blocks on the same weights (fp32): Qwen3-MoE
(``Qwen3MoeSparseMoeBlock``) and DeepSeek-V3 (``DeepseekV3MoE``: sigmoid, biased group-limited
selection, shared expert); grouped GEMM path vs the per-expert loop; experts with no tokens."""

import pytest
import torch
from transformers import DeepseekV3Config, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from omniweave.models.components.moe import (
    MoE,
    MoEConfig,
    expert_matmul,
    grouped_mm_supported,
)

D, I = 40, 20  # 2·I == D: a transposed gate_up would have the right shape and wrong values


def _qwen3(norm: bool, backend: str, E: int = 6, k: int = 2, hidden: int = D, inter: int = I):
    hf_cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=E, num_experts_per_tok=k,
                            norm_topk_prob=norm)  # fmt: skip
    hf_cfg._experts_implementation = "eager"  # transformers' readable per-expert loop as the reference
    hf = Qwen3MoeSparseMoeBlock(hf_cfg).float()
    ours = MoE(MoEConfig(hidden, inter, E, k, router="softmax", norm_topk_prob=norm, backend=backend))
    return hf, ours


def _deepseek(backend: str):
    hf_cfg = DeepseekV3Config(hidden_size=D, moe_intermediate_size=I, n_routed_experts=8, num_experts_per_tok=3,
                              n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
                              n_shared_experts=2)  # fmt: skip
    hf_cfg._experts_implementation = "eager"
    hf = DeepseekV3MoE(hf_cfg).float()
    ours = MoE(MoEConfig(D, I, 8, 3, router="sigmoid", norm_topk_prob=True, n_group=4, topk_group=2,
                         routed_scaling_factor=2.5, n_shared_experts=2, backend=backend))  # fmt: skip
    return hf, ours


def _same_random_weights(hf, ours, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in hf.state_dict(keep_vars=True).items():
            t.copy_(torch.randn(t.shape, generator=g) * (0.3 if "bias" not in name else 0.05))
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=True)
    assert not missing and not unexpected


def _err(a, b) -> float:
    """max |a - b| relative to max(1, max |b|) (fp32 rounding grows with the magnitude)."""
    return ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item() if b.numel() else 0.0


def _compare(hf, ours, T=29, seed=1, atol=1e-5):
    x = torch.randn(T, hf.gate.weight.shape[1], generator=torch.Generator().manual_seed(seed))
    xh, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref, got = hf(xh[None])[0], ours(xo)
    assert _err(got, ref) <= atol
    dy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 1))
    (ref * dy).sum().backward()
    (got * dy).sum().backward()
    assert _err(xo.grad, xh.grad) <= atol
    hp = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert _err(p.grad, hp[name].grad) <= atol, name
    return got


@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
@pytest.mark.parametrize("norm", [True, False])
def test_qwen3_moe_block_equals_transformers(backend, norm):
    hf, ours = _qwen3(norm, backend)
    _same_random_weights(hf, ours)
    _compare(hf, ours)


@pytest.mark.parametrize("backend", ["grouped_mm", "loop"])
def test_deepseek_v3_block_equals_transformers(backend):
    hf, ours = _deepseek(backend)
    _same_random_weights(hf, ours)
    assert ours.gate.e_score_correction_bias.abs().min() > 0  # the bias really shifts the selection
    x = torch.randn(29, D, generator=torch.Generator().manual_seed(1))
    _, w, idx = ours.gate(x)
    s = (x @ ours.gate.weight.t()).sigmoid()
    assert not torch.equal(idx.sort(-1).values, s.topk(3).indices.sort(-1).values)  # bias changed a choice
    groups = idx // 2  # 4 groups of 2 experts: at most topk_group=2 distinct groups per token
    assert all(len(set(r.tolist())) <= 2 for r in groups)
    chosen = s.gather(1, idx)  # weights come from the unbiased scores, renormalised, × routed_scaling_factor
    torch.testing.assert_close(w, chosen / chosen.sum(-1, keepdim=True) * 2.5)
    _compare(hf, ours)


def test_experts_without_tokens():
    hf, ours = _qwen3(True, "grouped_mm", E=16, k=2)
    _same_random_weights(hf, ours, seed=3)
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(4))
    counts = torch.bincount(ours.gate(x)[2].reshape(-1), minlength=16)
    assert (counts == 0).sum() >= 10  # 3 tokens × 2 experts leave most of 16 experts empty
    _compare(hf, ours, T=3, seed=4)
    # an empty row and a single token
    _compare(hf, ours, T=1, seed=5)
    assert ours(torch.zeros(0, D)).shape == (0, D)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_path_equals_loop_path(dtype):
    _, grouped = _qwen3(True, "grouped_mm", E=8, k=3, hidden=48, inter=32)
    loop = MoE(grouped.cfg.__class__(**{**grouped.cfg.__dict__, "backend": "loop"}))
    grouped.reset_parameters(0.2)
    loop.load_state_dict(grouped.state_dict())
    grouped.to(dtype), loop.to(dtype)
    x = torch.randn(41, 48, generator=torch.Generator().manual_seed(6)).to(dtype)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = grouped(xa), loop(xb)
    dy = torch.randn(a.shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    (a * dy).sum().backward()
    (b * dy).sum().backward()
    assert torch.equal(a, b) and torch.equal(xa.grad, xb.grad)
    for (n, p), q in zip(grouped.named_parameters(), loop.parameters()):
        assert torch.equal(p.grad, q.grad), n


def test_backend_choice_and_unaligned_fallback():
    x32, x16 = torch.zeros(1, 40), torch.zeros(1, 40, dtype=torch.bfloat16)
    assert grouped_mm_supported(x32, 40, 20) and not grouped_mm_supported(x32, 40, 15)
    assert grouped_mm_supported(x16, 40, 24) and not grouped_mm_supported(x16, 40, 20)  # 20 bf16 = 40 bytes
    assert not grouped_mm_supported(torch.zeros(1, 40, dtype=torch.float16), 40, 24)
    hf, ours = _qwen3(True, "auto", hidden=38, inter=15)  # unaligned: auto falls back to the loop
    _same_random_weights(hf, ours)
    assert not ours.experts.use_grouped_mm(torch.zeros(1, 38))
    _compare(hf, ours)
    bad = MoE(MoEConfig(38, 15, 4, 2, backend="grouped_mm"))
    with pytest.raises(ValueError, match="16-byte"):
        bad.experts.use_grouped_mm(torch.zeros(1, 38))


def test_loop_runs_only_experts_with_tokens(monkeypatch):
    calls = []
    orig = torch.nn.functional.linear
    monkeypatch.setattr(torch.nn.functional, "linear", lambda a, w, *r: calls.append(a.shape[0]) or orig(a, w, *r))
    xs = torch.randn(5, 16)
    out = expert_matmul(xs, torch.randn(6, 8, 16), torch.tensor([0, 2, 0, 0, 3, 0]), grouped=False)
    assert out.shape == (5, 8) and calls == [2, 3]


def test_config_errors():
    with pytest.raises(ValueError, match="router"):
        MoEConfig(8, 8, 4, 2, router="relu")
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoEConfig(8, 8, 4, 5)
    with pytest.raises(ValueError, match="n_group"):
        MoEConfig(8, 8, 6, 2, router="sigmoid", n_group=4)
