"""Gated DeltaNet as a component (models/components/linear_attention.py) against transformers
5.24's Qwen3_5GatedDeltaNet (fallback kernels) on tiny random weights with head sizes that are
not round: a packed row of documents of 1, 5, 64, 65 and 150 tokens equals HF on each document
alone (fp32, 2e-5); a document in two pieces with the LinearState carried equals it whole."""

from __future__ import annotations

import pytest
import torch

from omniweave.models.components.linear_attention import GatedDeltaNet, GatedDeltaNetConfig

LENGTHS = [1, 5, 64, 65, 150]


def _pair(seed=0):
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(seed)
    hf_cfg = Qwen3_5TextConfig(hidden_size=40, num_hidden_layers=4, linear_num_key_heads=2, linear_num_value_heads=6,
                               linear_key_head_dim=12, linear_value_head_dim=10, linear_conv_kernel_dim=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
                               vocab_size=64)
    hf = Qwen3_5GatedDeltaNet(hf_cfg, 0).float().eval()
    with torch.no_grad():
        for p in hf.parameters():  # non-trivial weights everywhere (the norm's too)
            p.add_(torch.randn_like(p) * 0.1)
    ours = GatedDeltaNet(GatedDeltaNetConfig(40, 2, 6, 12, 10, conv_kernel=4, rms_norm_eps=hf_cfg.rms_norm_eps))
    assert set(ours.state_dict()) == set(hf.state_dict())
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def test_a_packed_row_equals_transformers_on_each_document():
    hf, ours = _pair()
    x = torch.randn(sum(LENGTHS), 40)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()])
    with torch.no_grad():
        got, state = ours(x, cu)
        for s, e in zip(cu[:-1].tolist(), cu[1:].tolist()):
            want = hf(x[None, s:e])[0]
            assert (got[s:e] - want).abs().max() < 2e-5, (s, e)
    assert state.recurrent.shape == (len(LENGTHS), 6, 12, 10) and state.window.shape == (len(LENGTHS), 3, 2 * 24 + 60)


def test_a_document_in_two_pieces_with_its_state_carried_equals_it_whole():
    _, ours = _pair(1)
    x = torch.randn(150, 40, dtype=torch.float64)
    ours = ours.double()
    whole, end = ours(x, torch.tensor([0, 150]))
    a, mid = ours(x[:70], torch.tensor([0, 70]))
    b, end2 = ours(x[70:], torch.tensor([0, 80]), mid)
    assert (torch.cat([a, b]) - whole).abs().max() < 1e-10
    assert (end2.recurrent - end.recurrent).abs().max() < 1e-10 and (end2.window - end.window).abs().max() < 1e-12


def test_fla_backend_refused_in_one_line_where_missing_and_auto_stays_torch_on_cpu():
    from omniweave.errors import UserError
    from omniweave.models.components.linear_attention import check_linear_backend, fla_missing
    from omniweave.train.parallel_model import check_attn_backends

    assert fla_missing() is not None  # this machine: no fla, no CUDA
    with pytest.raises(UserError, match=r"^model\.foundation\.linear_backend: linear-attention backend 'fla' is not "
                                        r"available on this machine: "):
        check_attn_backends({"foundation": {"attn_backend": "auto", "linear_backend": "fla"}})
    with pytest.raises(UserError, match="unknown linear-attention backend 'triton'"):
        check_linear_backend("triton")
    assert check_linear_backend("auto") == "auto" and check_linear_backend("torch") == "torch"


def test_fla_call_matches_the_torch_kernel_through_a_stand_in(monkeypatch):
    """The fla path's plumbing (one batch row, [1, T, H, d] layout, GVA heads, int64 cu_seqlens,
    states in and out) against the torch kernel, with a stand-in ``fla.ops.gated_delta_rule``
    that runs our kernel on fla's argument layout (fla itself needs CUDA and Triton)."""
    import sys
    import types

    from omniweave.models.components import gated_delta
    from omniweave.models.components.linear_attention import GatedDeltaNet, GatedDeltaNetConfig

    calls = []

    def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None,
                               use_qk_l2norm_in_kernel=False):
        assert q.shape[0] == 1 and cu_seqlens.dtype == torch.long and output_final_state and use_qk_l2norm_in_kernel
        calls.append(q.shape)
        o, final = gated_delta.gated_delta_rule_chunked(q[0], k[0], v[0], g[0], beta[0], cu_seqlens, chunk_size=16,
                                                        initial_state=initial_state, qk_l2norm=True)
        return o[None], final

    module = types.ModuleType("fla.ops.gated_delta_rule")
    module.chunk_gated_delta_rule = chunk_gated_delta_rule
    for name in ("fla", "fla.ops"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", module)
    torch.manual_seed(0)
    cfg = dict(hidden_size=24, num_key_heads=2, num_value_heads=4, key_head_dim=6, value_head_dim=5, chunk_size=16)
    ref = GatedDeltaNet(GatedDeltaNetConfig(**cfg, backend="torch"))
    fla = GatedDeltaNet(GatedDeltaNetConfig(**cfg, backend="fla"))
    fla.load_state_dict(ref.state_dict())
    x, cu = torch.randn(40, 24), torch.tensor([0, 7, 33, 40], dtype=torch.int32)
    (y_ref, s_ref), (y, s) = ref(x, cu), fla(x, cu)
    assert calls == [torch.Size([1, 40, 2, 6])]
    torch.testing.assert_close(y, y_ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(s.recurrent, s_ref.recurrent, atol=1e-6, rtol=1e-5)
