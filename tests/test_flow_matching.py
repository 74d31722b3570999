"""Pi0.5's flow-matching pieces (omniweave/models/components/flow.py, adarms.py) against dense
references written here: the sinusoidal time embedding against math.sin/cos, the Beta time draws
against the Beta(1.5, 1) mean and CDF, targets and masked loss against hand-written loops, the
Euler sampler against ODEs with known discrete solutions, adaRMS against its formula (fp32, bf16),
and the prefix/suffix mask against big_vision's ``make_att_2d_masks`` rule
(the Pi0.5 research notes, reach_anchors.md §3.2-3.4)."""

from __future__ import annotations

import math

import pytest
import torch

from omniweave.models.components.adarms import AdaRMSNorm, gated_residual
from omniweave.models.components.flow import (
    att_2d_mask,
    euler_sample,
    flow_matching_loss,
    flow_matching_targets,
    prefix_suffix_mask,
    prefix_suffix_positions,
    sample_flow_time,
    sinusoidal_time_embedding,
)

# --- time embedding ----------------------------------------------------------------------------


def test_time_embedding_periods_and_halves_match_math():
    t = torch.tensor([0.0, 0.3, 0.987654], dtype=torch.float64)
    dim = 6  # periods 4e-3, 4e-3·1000^0.5, 4.0
    emb = sinusoidal_time_embedding(t, dim)
    assert emb.shape == (3, dim) and emb.dtype == torch.float64
    periods = [4e-3, 4e-3 * 1000**0.5, 4.0]
    for b, tb in enumerate(t.tolist()):
        for k, p in enumerate(periods):
            assert emb[b, k].item() == pytest.approx(math.sin(2 * math.pi * tb / p), abs=1e-12)  # sin half
            assert emb[b, 3 + k].item() == pytest.approx(math.cos(2 * math.pi * tb / p), abs=1e-12)  # cos half


def test_time_embedding_hand_value_and_float64_phase():
    # t = 0.5, dim 4: periods 4e-3 and 4 -> [sin 250π, sin π/4, cos 250π, cos π/4].
    emb = sinusoidal_time_embedding(torch.tensor([0.5]), 4)
    assert emb.dtype == torch.float32
    r = math.sqrt(0.5)
    assert torch.allclose(emb[0], torch.tensor([0.0, r, 1.0, r]), atol=1e-6)
    # The fastest phase (~1.55e3 rad) is taken in float64, so a float32 t still gives the value
    # rounded once to float32; a float32 phase would be off by up to ~1e-4.
    t = torch.tensor([0.987654], dtype=torch.float32)
    exact = math.sin(2 * math.pi * t.item() / 4e-3)
    assert abs(sinusoidal_time_embedding(t, 4)[0, 0].item() - exact) < 1e-6


def test_time_embedding_odd_dim_is_a_value_error():
    with pytest.raises(ValueError, match="even"):
        sinusoidal_time_embedding(torch.tensor([0.5]), 5)


# --- time sampling -----------------------------------------------------------------------------


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_time_sampling_is_reproducible_from_the_generator():
    a = sample_flow_time(64, _gen(7))
    assert torch.equal(a, sample_flow_time(64, _gen(7)))
    assert not torch.equal(a, sample_flow_time(64, _gen(8)))
    assert a.shape == (64,) and a.dtype == torch.float32


def test_time_sampling_range_mean_and_cdf_are_beta_1_5_1():
    t = sample_flow_time(200_000, _gen(0))
    assert t.min().item() > 0.001 and t.max().item() <= 1.0
    assert abs(t.double().mean().item() - (0.6 * 0.999 + 0.001)) < 0.005  # Beta(1.5, 1) mean 0.6
    x = (t.double() - 0.001) / 0.999
    for q in (0.1, 0.5, 0.9):  # Beta(1.5, 1) CDF: q^1.5
        assert abs((x <= q).double().mean().item() - q**1.5) < 0.005


def test_time_sampling_other_shapes_below_one():
    # alpha < 1 takes the boosted Gamma path: Beta(0.5, 2) has mean 0.2.
    x = (sample_flow_time(200_000, _gen(1), alpha=0.5, beta=2.0).double() - 0.001) / 0.999
    assert abs(x.mean().item() - 0.2) < 0.005


# --- targets and loss --------------------------------------------------------------------------


def test_targets_match_the_interpolation_written_out():
    g = _gen(3)
    actions, noise = torch.randn(2, 3, 4, generator=g), torch.randn(2, 3, 4, generator=g)
    t = torch.tensor([0.25, 0.8])
    x_t, u_t = flow_matching_targets(actions, noise, t)
    for b in range(2):
        for h in range(3):
            for d in range(4):
                a, n, tb = actions[b, h, d].item(), noise[b, h, d].item(), t[b].item()
                assert x_t[b, h, d].item() == pytest.approx(tb * n + (1 - tb) * a, abs=1e-6)
                assert u_t[b, h, d].item() == pytest.approx(n - a, abs=1e-6)


def _masked_mse_reference(v, u, is_pad, action_dim):
    total, count = 0.0, 0
    for b in range(v.shape[0]):
        for h in range(v.shape[1]):
            if is_pad is not None and is_pad[b, h]:
                continue
            for d in range(action_dim):
                total += (v[b, h, d].item() - u[b, h, d].item()) ** 2
                count += 1
    return total, count


def test_loss_unmasked_is_the_plain_mean_squared_error():
    v, u = torch.zeros(2, 3, 4), torch.full((2, 3, 4), 2.0)
    loss = flow_matching_loss(v, u)
    assert loss.mean.item() == 4.0 and loss.sum.item() == 96.0 and loss.count.item() == 24


def test_loss_mask_excludes_exactly_the_padded_steps_and_truncates_columns():
    g = _gen(4)
    v, u = torch.randn(2, 5, 6, generator=g), torch.randn(2, 5, 6, generator=g)
    is_pad = torch.tensor([[False, False, False, True, True], [False] * 5])
    loss = flow_matching_loss(v, u, is_pad, action_dim=4)
    total, count = _masked_mse_reference(v, u, is_pad, 4)
    assert loss.count.item() == count == (3 + 5) * 4
    assert loss.sum.item() == pytest.approx(total, rel=1e-6)
    assert loss.mean.item() == pytest.approx(total / count, rel=1e-6)
    assert loss.mean.item() == pytest.approx(loss.sum.item() / loss.count.item(), rel=1e-7)

    padded_step, truncated_col, counted = v.clone(), v.clone(), v.clone()
    padded_step[0, 3] += 100.0
    truncated_col[1, 0, 4:] += 100.0
    counted[0, 2, 1] += 1.0
    assert flow_matching_loss(padded_step, u, is_pad, 4).mean.item() == loss.mean.item()
    assert flow_matching_loss(truncated_col, u, is_pad, 4).mean.item() == loss.mean.item()
    assert flow_matching_loss(counted, u, is_pad, 4).mean.item() != loss.mean.item()


def test_loss_of_an_all_padded_batch_is_zero_not_nan():
    v, u = torch.randn(1, 2, 3), torch.randn(1, 2, 3)
    loss = flow_matching_loss(v, u, torch.ones(1, 2, dtype=torch.bool))
    assert loss.mean.item() == 0.0 and loss.count.item() == 0


def test_loss_gradient_reaches_only_the_counted_predictions():
    v = torch.randn(1, 3, 2, requires_grad=True)
    flow_matching_loss(v, torch.zeros(1, 3, 2), torch.tensor([[False, True, False]])).mean.backward()
    assert torch.equal(v.grad[0, 1], torch.zeros(2))
    assert torch.allclose(v.grad[0, [0, 2]], 2 * v.detach()[0, [0, 2]] / 4, atol=1e-7)


# --- Euler sampling ----------------------------------------------------------------------------


def test_euler_with_the_straight_path_velocity_lands_on_the_actions():
    g = _gen(5)
    a, noise = torch.randn(2, 50, 32, generator=g), torch.randn(2, 50, 32, generator=g)
    out = euler_sample(lambda x, t: noise - a, noise, num_steps=10)
    assert torch.allclose(out, a, atol=1e-6)


def test_euler_linear_field_matches_a_dense_loop_and_the_closed_form():
    g = _gen(6)
    noise = torch.randn(3, 4, 5, generator=g, dtype=torch.float64)
    c, n = 0.7, 10
    out = euler_sample(lambda x, t: c * x, noise, num_steps=n)
    ref = noise.clone()
    for _ in range(n):
        ref = ref + (-1.0 / n) * (c * ref)
    assert torch.allclose(out, ref, atol=1e-6, rtol=0)
    assert torch.allclose(out, noise * (1 - c / n) ** n, atol=1e-6, rtol=0)


def test_euler_times_run_from_one_down_in_steps_of_one_over_n():
    seen = []

    def v(x, t):
        seen.append(t.clone())
        return t[:, None, None].to(x.dtype).expand_as(x)  # dx/dt = t

    noise = torch.zeros(2, 1, 1, dtype=torch.float64)
    out = euler_sample(v, noise, num_steps=10)
    assert [s.shape for s in seen] == [torch.Size([2])] * 10 and seen[0].dtype == torch.float32
    assert torch.allclose(torch.stack(seen)[:, 0], torch.tensor([1.0 - k / 10 for k in range(10)]), atol=1e-7)
    assert torch.allclose(out, torch.full_like(out, -0.1 * 5.5), atol=1e-6)  # −dt·Σ t_k = −0.1·5.5


# --- adaRMS ------------------------------------------------------------------------------------


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def test_adarms_at_init_is_plain_rms_norm_with_a_closed_gate():
    norm = AdaRMSNorm(8, 6, eps=1e-6)
    assert [n for n, _ in norm.named_parameters()] == ["dense.weight", "dense.bias"]  # no `weight`
    g = _gen(7)
    x, cond = torch.randn(2, 3, 8, generator=g), torch.randn(2, 6, generator=g)
    y, gate = norm(x, cond)
    assert torch.allclose(y, _rms(x.double(), 1e-6).float(), atol=1e-6, rtol=0)
    assert torch.equal(gate, torch.zeros(2, 1, 8))
    assert torch.equal(gated_residual(x, y, gate), x)


def test_adarms_with_random_modulation_matches_the_formula():
    dim, cond_dim, eps = 8, 6, 1e-6
    norm = AdaRMSNorm(dim, cond_dim, eps)
    g = _gen(8)
    with torch.no_grad():
        norm.dense.weight.copy_(0.3 * torch.randn(3 * dim, cond_dim, generator=g))
        norm.dense.bias.copy_(0.3 * torch.randn(3 * dim, generator=g))
    x, cond = torch.randn(2, 3, dim, generator=g), torch.randn(2, cond_dim, generator=g)
    y, gate = norm(x, cond)

    W, bias = norm.dense.weight.double(), norm.dense.bias.double()
    mod = cond.double() @ W.T + bias  # [B, 3D]
    scale, shift, gate_ref = mod[:, :dim, None], mod[:, dim : 2 * dim], mod[:, 2 * dim :]
    y_ref = _rms(x.double(), eps) * (1 + scale.transpose(1, 2)) + shift[:, None, :]
    assert torch.allclose(y.double(), y_ref, atol=1e-6, rtol=1e-6)
    assert torch.allclose(gate.double(), gate_ref[:, None, :], atol=1e-6, rtol=1e-6)
    assert torch.allclose(gated_residual(x, y, gate).double(), x.double() + y_ref * gate_ref[:, None, :], atol=1e-5)
    assert torch.equal(gated_residual(x, y, None), x + y)


def test_adarms_bf16_keeps_the_variance_in_fp32():
    dim = 64
    norm = AdaRMSNorm(dim, 4)
    g = _gen(9)
    with torch.no_grad():
        norm.dense.weight.copy_(0.2 * torch.randn(3 * dim, 4, generator=g))
        norm.dense.bias.copy_(0.2 * torch.randn(3 * dim, generator=g))
    norm = norm.to(torch.bfloat16)
    # Values spread over magnitudes, so a bf16 sum of squares rounds visibly.
    x = (torch.randn(2, 5, dim, generator=g) * torch.logspace(-1, 1, dim)).to(torch.bfloat16)
    cond = torch.randn(2, 4, generator=g).to(torch.bfloat16)
    y, gate = norm(x, cond)
    assert y.dtype == torch.bfloat16 and gate.dtype == torch.bfloat16

    scale, shift, _ = norm.dense(cond).float()[:, None, :].chunk(3, -1)
    fp32_variance = (_rms(x.float(), norm.eps) * (1 + scale) + shift).to(torch.bfloat16)
    xb = x  # the same formula with the variance taken in bf16
    bf16_variance = (xb * torch.rsqrt(xb.pow(2).mean(-1, keepdim=True) + norm.eps)).float()
    bf16_variance = (bf16_variance * (1 + scale) + shift).to(torch.bfloat16)
    assert torch.equal(y, fp32_variance)
    assert not torch.equal(y, bf16_variance)  # the test can tell the two apart


def test_adarms_packed_rows_with_per_token_cond_equal_the_batched_form():
    dim, cond_dim = 8, 5
    norm = AdaRMSNorm(dim, cond_dim)
    g = _gen(10)
    with torch.no_grad():
        norm.dense.weight.copy_(0.3 * torch.randn(3 * dim, cond_dim, generator=g))
        norm.dense.bias.copy_(0.3 * torch.randn(3 * dim, generator=g))
    lens = [3, 5]
    xs = [torch.randn(1, n, dim, generator=g) for n in lens]
    conds = [torch.randn(1, cond_dim, generator=g) for _ in lens]
    packed_x = torch.cat([x[0] for x in xs])  # [L, D]
    packed_cond = torch.cat([c.expand(n, -1) for c, n in zip(conds, lens)])  # [L, cond_dim]
    y, gate = norm(packed_x, packed_cond)
    start = 0
    for x, c, n in zip(xs, conds, lens):
        y_b, gate_b = norm(x, c)
        # Equal up to fp32 rounding: the dense runs as a [L, C] vs a [1, C] matmul.
        assert torch.allclose(y[start : start + n], y_b[0], atol=1e-6, rtol=1e-6)
        assert torch.allclose(gate[start : start + n], gate_b[0].expand(n, -1), atol=1e-6, rtol=1e-6)
        start += n
    # Two samples of equal length: [B, T, D] with cond [B, C] against the packed [B·T, D].
    x2, c2 = torch.randn(2, 4, dim, generator=g), torch.randn(2, cond_dim, generator=g)
    y2, gate2 = norm(x2, c2)
    y2_packed, gate2_packed = norm(x2.reshape(8, dim), c2.repeat_interleave(4, dim=0))
    assert torch.allclose(y2_packed, y2.reshape(8, dim), atol=1e-6, rtol=1e-6)
    assert torch.allclose(gate2_packed, gate2.expand(2, 4, dim).reshape(8, dim), atol=1e-6, rtol=1e-6)


# --- mask and positions ------------------------------------------------------------------------


def _rule_mask(att: list[int], valid: list[bool]) -> torch.Tensor:
    """make_att_2d_masks written out: i attends j iff cumsum(att)[j] <= cumsum(att)[i], both valid."""
    cum = [sum(att[: k + 1]) for k in range(len(att))]
    n = len(att)
    return torch.tensor([[cum[j] <= cum[i] and valid[i] and valid[j] for j in range(n)] for i in range(n)])


def test_prefix_suffix_mask_by_hand():
    expected = torch.tensor(
        [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool
    )  # prefix 2 (bidirectional, blind to actions), suffix 2 (sees all, bidirectional)
    assert torch.equal(prefix_suffix_mask([2], [2]), expected)


@pytest.mark.parametrize("prefix,suffix", [(1, 1), (3, 2), (5, 1), (4, 6), (0, 3), (7, 0)])
def test_prefix_suffix_mask_equals_make_att_2d_masks(prefix, suffix):
    att = [0] * prefix + ([1] + [0] * (suffix - 1) if suffix else [])
    valid = [True] * (prefix + suffix)
    ref = _rule_mask(att, valid)
    assert torch.equal(att_2d_mask(torch.tensor([att]), torch.tensor([valid]))[0], ref)
    assert torch.equal(prefix_suffix_mask([prefix], [suffix]), ref)


def test_att_2d_mask_hides_padding_both_ways():
    att = [0, 0, 0, 1, 0]
    valid = [True, True, False, True, True]  # a padded prefix slot
    got = att_2d_mask(torch.tensor([att, att]), torch.tensor([valid, [True] * 5]))
    assert torch.equal(got[0], _rule_mask(att, valid))
    assert not got[0][2].any() and not got[0][:, 2].any()
    assert torch.equal(got[1], _rule_mask(att, [True] * 5))


def test_prefix_suffix_mask_of_a_packed_row_is_block_diagonal():
    prefixes, suffixes = [2, 3, 1], [2, 1, 3]
    mask = prefix_suffix_mask(prefixes, suffixes)
    assert mask.shape == (12, 12)
    start = 0
    for p, s in zip(prefixes, suffixes):
        end = start + p + s
        assert torch.equal(mask[start:end, start:end], prefix_suffix_mask([p], [s]))
        assert not mask[start:end, :start].any() and not mask[start:end, end:].any()
        start = end


def test_positions_skip_padding_and_continue_into_the_suffix():
    prefix_valid = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]], dtype=torch.bool)
    expected = torch.tensor([[0, 1, 1, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6], [-1, 0, 1, 1, 2, 3, 4]])
    assert torch.equal(prefix_suffix_positions(prefix_valid, 3), expected)
    assert torch.equal(prefix_suffix_positions(torch.ones(2, dtype=torch.bool), 2), torch.tensor([0, 1, 2, 3]))
