"""The MoE router's training signals (components/router_loss.py), fp32, one process:

- the global load-balancing loss of one layer equals transformers' ``load_balancing_loss_func``
  (value and the gradient it sends into the router weight and the input), with the coefficient
  and the step's micro-step count applied;
- the sequence-level loss: each document's loss alone, averaged over the step's documents;
- the z-loss: mean logsumexp² of the router logits;
- padding rows (``token_valid`` False) change nothing; a checkpointed forward recomputed in the
  backward counts its tokens once; a zero coefficient adds no gradient;
- the aux-loss-free bias update moves the selection bias of overloaded experts down and of idle
  experts up by exactly ``bias_update_speed``;
- the metrics of a step (aux value, load max/mean) from ``finish_router_step``;
- bad settings (unknown level, negative coefficient, bias update on the softmax router) are refused.
"""

import pytest
import torch
from torch.utils.checkpoint import checkpoint
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from omniweave.models.components.moe import MoE, MoEConfig
from omniweave.models.components.router_loss import finish_router_step, start_router_step

D, I, E, K = 32, 16, 6, 2
TOL = 1e-6


def _moe(**kw) -> MoE:
    torch.manual_seed(0)
    m = MoE(MoEConfig(D, I, E, K, norm_topk_prob=True, **kw))
    m.reset_parameters(0.3)
    return m


def _x(T=23, seed=1) -> torch.Tensor:
    return torch.randn(T, D, generator=torch.Generator().manual_seed(seed))


def _aux_grads(moe: MoE, x: torch.Tensor, **fwd) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients the router losses alone send into the router weight and the input."""
    x = x.clone().requires_grad_()
    (moe(x, **fwd) * 0).sum().backward()
    return moe.gate.weight.grad.clone(), x.grad.clone()


def _reference_grads(moe: MoE, x: torch.Tensor, loss_fn) -> tuple[torch.Tensor, torch.Tensor]:
    w = moe.gate.weight.detach().clone().requires_grad_()
    x = x.clone().requires_grad_()
    loss_fn(torch.nn.functional.linear(x, w)).backward()
    return w.grad, x.grad


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def test_global_aux_loss_matches_transformers_value_and_gradient():
    coef, micro = 0.01, 3
    moe, x = _moe(aux_loss_coef=coef), _x()
    start_router_step(moe, micro_steps=micro, tokens=x.shape[0], documents=1)
    got_w, got_x = _aux_grads(moe, x)
    metrics = finish_router_step(moe)
    hf = lambda logits: load_balancing_loss_func((logits,), E, K)  # noqa: E731
    ref_value = float(hf(torch.nn.functional.linear(x, moe.gate.weight.detach())))
    assert 1.0 < ref_value < 3.0  # not degenerate (uniform routing scores k = 2)
    assert abs(metrics["moe_aux_loss"] * micro - ref_value) < TOL * ref_value  # one of 3 micro-steps ran
    ref_w, ref_x = _reference_grads(moe, x, lambda logits: coef / micro * hf(logits))
    assert _rel(got_w, ref_w) < 1e-5 and _rel(got_x, ref_x) < 1e-5


def test_sequence_aux_loss_is_each_documents_loss_averaged_over_the_steps_documents():
    coef = 0.1
    moe, x = _moe(aux_loss_coef=coef, aux_loss_level="sequence"), _x(30)
    cu = torch.tensor([0, 7, 19, 30], dtype=torch.int32)
    start_router_step(moe, micro_steps=1, tokens=30, documents=5)  # two more documents elsewhere in the step
    got_w, got_x = _aux_grads(moe, x, cu_seqlens=cu)
    metrics = finish_router_step(moe)

    def per_doc(logits):
        return sum(load_balancing_loss_func((logits[a:b],), E, K) for a, b in zip(cu[:-1], cu[1:]))

    ref_sum = float(per_doc(torch.nn.functional.linear(x, moe.gate.weight)))
    assert abs(metrics["moe_aux_loss"] - ref_sum / 5) < TOL
    ref_w, ref_x = _reference_grads(moe, x, lambda logits: coef / 5 * per_doc(logits))
    assert _rel(got_w, ref_w) < 1e-5 and _rel(got_x, ref_x) < 1e-5


def test_z_loss_is_mean_squared_logsumexp_over_the_steps_tokens():
    coef = 1e-3
    moe, x = _moe(z_loss_coef=coef), _x()
    start_router_step(moe, micro_steps=1, tokens=40, documents=1)
    got_w, got_x = _aux_grads(moe, x)
    metrics = finish_router_step(moe)
    z = lambda logits: torch.logsumexp(logits, -1).pow(2).sum()  # noqa: E731
    assert abs(metrics["moe_z_loss"] - float(z(torch.nn.functional.linear(x, moe.gate.weight))) / 40) < TOL
    ref_w, ref_x = _reference_grads(moe, x, lambda logits: coef / 40 * z(logits))
    assert _rel(got_w, ref_w) < 1e-5 and _rel(got_x, ref_x) < 1e-5


def test_zero_coefficients_add_no_gradient_and_no_loss_metric():
    moe, x = _moe(), _x()
    start_router_step(moe, 1, 23, 1)
    got_w, got_x = _aux_grads(moe, x)
    assert float(got_w.abs().max()) == 0.0 and float(got_x.abs().max()) == 0.0
    metrics = finish_router_step(moe)
    assert set(metrics) == {"moe_load_max_mean"}


@pytest.mark.parametrize("level", ["global", "sequence"])
def test_padding_rows_count_nowhere(level):
    """Context-parallel pads: the same tokens plus pad rows marked invalid give the same loss,
    gradients and counts."""
    moe, x = _moe(aux_loss_coef=0.05, aux_loss_level=level, z_loss_coef=0.01), _x(20)
    start_router_step(moe, 1, 20, 2)
    ref = _aux_grads(moe, x, cu_seqlens=torch.tensor([0, 9, 20]))
    ref_counts, ref_metrics = moe.stats.counts.clone(), finish_router_step(moe)
    moe.zero_grad()
    padded = torch.cat([x[:9], torch.randn(3, D), x[9:], torch.randn(2, D)])
    valid = torch.tensor([True] * 9 + [False] * 3 + [True] * 11 + [False] * 2)
    start_router_step(moe, 1, 20, 2)
    got_w, got_x = _aux_grads(moe, padded, cu_seqlens=torch.tensor([0, 12, 25]), valid=valid)
    assert torch.equal(moe.stats.counts, ref_counts)
    got_metrics = finish_router_step(moe)
    assert all(abs(got_metrics[k] - ref_metrics[k]) < TOL for k in ref_metrics)
    assert _rel(got_w, ref[0]) < 1e-5
    assert _rel(got_x[valid], ref[1]) < 1e-5 and float(got_x[~valid].abs().max()) == 0.0


def test_recomputed_forward_counts_once():
    moe, x = _moe(aux_loss_coef=0.05), _x()
    start_router_step(moe, 1, 23, 1)
    x1 = x.clone().requires_grad_()
    moe(x1).sum().backward()
    plain = moe.stats.counts.clone()
    assert float(plain.sum()) == 23 * K
    start_router_step(moe, 1, 23, 1)
    x2 = x.clone().requires_grad_()
    checkpoint(moe, x2, use_reentrant=False).sum().backward()
    assert torch.equal(moe.stats.counts, plain)
    assert _rel(x2.grad, x1.grad) < 1e-6


def test_bias_update_lowers_overloaded_and_raises_idle_experts():
    speed = 1e-3
    moe = MoE(MoEConfig(D, I, 8, 2, router="sigmoid", norm_topk_prob=True, n_group=2, topk_group=1,
                        bias_update_speed=speed))  # fmt: skip
    moe.reset_parameters(0.3)
    with torch.no_grad():
        moe.gate.weight[0] += 1.0  # expert 0 wins for inputs along its row
    x = moe.gate.weight[0].detach().expand(10, D) + 0.01 * _x(10)
    start_router_step(moe, 1, 10, 1)
    moe(x.requires_grad_()).sum().backward()
    counts = moe.stats.counts.clone()
    metrics = finish_router_step(moe)
    bias = moe.gate.e_score_correction_bias
    mean = counts.mean()
    assert counts[0] == 10 and metrics["moe_load_max_mean"] == pytest.approx(float(10 / mean))
    expected = speed * torch.sign(mean - counts).float()
    assert torch.equal(bias, expected) and bias[0] == -speed and (bias[counts == 0] == speed).all()
    finish_router_step(moe, update_bias=False)  # a skipped (non-finite) step moves nothing
    assert torch.equal(bias, expected)


@pytest.mark.parametrize("kw,match", [
    ({"aux_loss_level": "batch"}, "aux_loss_level"),
    ({"aux_loss_coef": -1.0}, ">= 0"),
    ({"bias_update_speed": 1e-3}, "sigmoid router"),
])  # fmt: skip
def test_bad_router_loss_settings_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(D, I, E, K, **kw)


def test_model_gradients_match_transformers_with_its_aux_loss(tmp_path):
    """A Qwen3-MoE checkpoint with ``output_router_logits`` (transformers then adds
    ``router_aux_loss_coef`` x its balancing loss to the LM loss): loaded, our model trains on the
    same loss — every gradient within 1e-4 relative (one MoE layer, where the two definitions
    coincide; transformers concatenates layers before the product)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from omniweave.models.hf.loading import adapter_for, load_hf
    from tests.hf_factory import QWEN3_MOE

    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**QWEN3_MOE, "mlp_only_layers": [0, 2]}, output_router_logits=True,
                                            router_aux_loss_coef=0.3)).float()
    hf.save_pretrained(tmp_path)
    ours, cfg = load_hf(tmp_path)
    assert cfg["foundation"]["router_aux_loss_coef"] == 0.3
    ids = torch.randint(0, 1024, (41,), generator=torch.Generator().manual_seed(1))
    out = hf(input_ids=ids[None], labels=ids[None])
    assert float(out.aux_loss) > 0
    out.loss.backward()
    labels = torch.cat([ids[1:], ids.new_full((1,), -100)])
    start_router_step(ours, micro_steps=1, tokens=41, documents=1)
    (ours({"input_ids": ids, "labels": labels}).loss_sum / 40).backward()
    assert abs(finish_router_step(ours)["moe_aux_loss"] - float(out.aux_loss)) < 1e-5
    adapter, hf_params = adapter_for("qwen3_moe"), dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        ref = hf_params[adapter.model_name_to_hf(name)].grad
        assert _rel(p.grad, ref) < 1e-4, name
