"""Gated DeltaNet as a component (models/components/linear_attention.py) against transformers
5.24's Qwen3_5GatedDeltaNet (fallback kernels) on tiny random weights with head sizes that are
not round: a packed row of documents of 1, 5, 64, 65 and 150 tokens equals HF on each document
alone (fp32, 2e-5); a document in two pieces with the LinearState carried equals it whole."""

from __future__ import annotations

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
