"""The preference and RL objectives added beside DPO / GRPO, against TRL 1.16's own code on the
same tensors (fp32): ORPO's odds-ratio term (``ORPOTrainer.odds_ratio_loss``), SimPO
(``CPOTrainer.cpo_loss``, ``loss_type="simpo"``), RLOO's leave-one-out advantages
(``RLOOTrainer``: its formula, lines 1675-1691 of rloo_trainer.py, inlined below because it sits
inside the trainer's generation step). |Δloss| and |Δgrad| ≤ 1e-6."""

from __future__ import annotations

import pytest
import torch

from omniweave.train.preference import ORPOConfig, SimPOConfig, orpo_loss, simpo_loss

TOL = 1e-6


def _avg_logps(pairs: int = 7, seed: int = 0) -> torch.Tensor:
    """[P, 2] average answer log-probs (chosen, rejected), of answers of unequal lengths."""
    g = torch.Generator().manual_seed(seed)
    sums = -torch.rand(pairs, 2, generator=g) * 40 - 0.5
    lengths = torch.randint(3, 17, (pairs, 2), generator=g).float()
    return sums / lengths


def _trainer(cls, **attrs):
    """A TRL trainer object with just the attributes its loss method reads."""
    obj = object.__new__(cls)
    obj.accelerator = type("A", (), {"device": torch.device("cpu")})()
    for k, v in attrs.items():
        setattr(obj, k, v)
    return obj


def _grads(fn, x):
    x = x.clone().requires_grad_()
    out = fn(x)
    out.sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_orpo_odds_ratio_term_equals_trl(beta):
    from trl.experimental.orpo import ORPOTrainer

    avg = _avg_logps()
    trl = _trainer(ORPOTrainer, beta=beta)
    want, want_g = _grads(lambda a: trl.odds_ratio_loss(a[:, 0], a[:, 1])[0], avg)
    # ours: loss = NLL(chosen) − λ log σ(log_odds); TRL's term is +λ log σ (subtracted from the NLL)
    got, got_g = _grads(lambda a: -(orpo_loss(a, ORPOConfig(beta))[0] + a[:, 0]), avg)
    assert (got - want).abs().max() <= TOL and (got_g - want_g).abs().max() <= TOL
    _, chosen, rejected, _ = orpo_loss(avg, ORPOConfig(beta))
    _, trl_c, trl_r, _, _ = trl.odds_ratio_loss(avg[:, 0], avg[:, 1])
    assert torch.allclose(chosen, trl_c) and torch.allclose(rejected, trl_r)


def test_orpo_total_equals_trl_when_the_chosen_answers_have_one_length():
    """TRL adds the chosen answers' token-mean NLL; ours their per-answer means, averaged over
    pairs: equal when every chosen answer has the same length (the docs say so)."""
    from trl.experimental.orpo import ORPOTrainer

    avg = _avg_logps()
    trl = _trainer(ORPOTrainer, beta=0.1)
    ours = orpo_loss(avg, ORPOConfig(0.1))[0].mean()
    theirs = -avg[:, 0].mean() - trl.odds_ratio_loss(avg[:, 0], avg[:, 1])[0].mean()
    assert abs(float(ours - theirs)) <= TOL


@pytest.mark.parametrize("beta, gamma, eps", [(2.0, 0.5, 0.0), (2.5, 1.4, 0.1)])
def test_simpo_equals_trl_cpo_simpo(beta, gamma, eps):
    from trl.experimental.cpo import CPOTrainer

    avg = _avg_logps(9, seed=1)
    trl = _trainer(CPOTrainer, beta=beta, simpo_gamma=gamma, label_smoothing=eps, loss_type="simpo", cpo_alpha=0.0,
                   alpha=0.0)  # alpha: AlphaPO off (its default)
    want, want_g = _grads(lambda a: trl.cpo_loss(a[:, 0], a[:, 1])[0], avg)
    got, got_g = _grads(lambda a: simpo_loss(a, SimPOConfig(beta, gamma, eps))[0], avg)
    print(f"simpo beta={beta}: max |Δloss| {(got - want).abs().max():.1e}, |Δgrad| {(got_g - want_g).abs().max():.1e}")
    assert (got - want).abs().max() <= TOL and (got_g - want_g).abs().max() <= TOL
    _, c, r = simpo_loss(avg, SimPOConfig(beta, gamma, eps))
    _, trl_c, trl_r = trl.cpo_loss(avg[:, 0], avg[:, 1])
    assert torch.allclose(c, trl_c) and torch.allclose(r, trl_r)


def _trl_rloo(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """TRL 1.16 RLOOTrainer's advantages (normalize_advantages=False), its lines as written."""
    grouped_rewards = rewards.view(-1, num_generations)
    scorable_counts = (~torch.isnan(grouped_rewards)).sum(dim=1, keepdim=True)
    grouped_sum = torch.nansum(grouped_rewards, dim=1, keepdim=True)
    baselines = (grouped_sum - grouped_rewards) / (scorable_counts - 1)
    return torch.nan_to_num(rewards - baselines.view(-1), nan=0.0)


@pytest.mark.parametrize("group_size", [2, 5])
def test_rloo_advantages_equal_trl(group_size):
    from omniweave.rl.grpo import GRPOConfig, GRPOConfigError, rloo_advantages

    rewards = torch.rand(3 * group_size, generator=torch.Generator().manual_seed(group_size))
    got = rloo_advantages(rewards, group_size)
    assert (got - _trl_rloo(rewards, group_size)).abs().max() <= TOL
    centred = (rewards.view(-1, group_size) - rewards.view(-1, group_size).mean(1, keepdim=True)).view(-1)
    assert torch.allclose(got, centred * group_size / (group_size - 1), atol=1e-6)  # the identity in the docstring
    with pytest.raises(GRPOConfigError, match="rl.advantage must be one of grpo, rloo"):
        GRPOConfig(advantage="ppo").validate()


@pytest.mark.slow
def test_a_grpo_run_with_rloo_advantages_trains_on_them(tmp_path_factory, tmp_path):
    """``rl.advantage=rloo`` reaches the update: the same rollouts (seeded), a loss of the
    leave-one-out advantages, which for 4 samples a group is 4/3 of Dr.GRPO's (no std)."""
    from omniweave.config import load_recipe
    from omniweave.rl.trainer import train_rl
    from tests.rl_factory import make_rl_prompts, rl_overrides
    from tests.train_factory import read_metrics

    prompts = make_rl_prompts(tmp_path_factory.mktemp("prompts"))
    runs = {}
    for name, extra in (("rloo", {"rl__advantage": "rloo"}), ("drgrpo", {"rl__scale_rewards": False})):
        train_rl(load_recipe("demo_grpo", rl_overrides(prompts, tmp_path / name, steps=1, rl__mini_batches=1, **extra)))
        runs[name] = read_metrics(tmp_path / name)[0]
    assert runs["rloo"]["reward_mean"] == runs["drgrpo"]["reward_mean"]  # the same rollouts
    assert runs["rloo"]["loss"] == pytest.approx(runs["drgrpo"]["loss"] * 4 / 3, rel=1e-5)
