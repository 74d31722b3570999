"""omniweave.rl.grpo against hand-computed values, verl's formulas, and TRL's own loss code."""

import math

import pytest
import torch

from omniweave.rl.grpo import (
    GRPOConfig,
    GRPOConfigError,
    aggregate,
    group_advantages,
    grpo_token_loss,
    kl_k1,
    kl_k3,
    policy_loss,
    token_entropy,
    zero_std_groups,
)

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0])


def test_group_advantages_hand_values():
    # G=2: groups [1,0] [0,1]; mean 0.5, unbiased std sqrt(0.5) = 0.70711 -> ±0.5/(0.70711+1e-6)
    a = 0.7071057811879616
    assert group_advantages(REWARDS, 2).tolist() == pytest.approx([a, -a, -a, a], abs=1e-6)
    # G=4: one group; mean 0.5, unbiased std sqrt(1/3) = 0.57735 -> ±0.5/(0.57735+1e-6)
    b = 0.8660239037870368
    assert group_advantages(REWARDS, 4).tolist() == pytest.approx([b, -b, -b, b], abs=1e-6)
    # Dr.GRPO (no std): the centred rewards, whatever G
    for g in (2, 4):
        assert group_advantages(REWARDS, g, scale=False).tolist() == [0.5, -0.5, -0.5, 0.5]
    # [N, G] input gives the same flat [N*G] result; a group of one has no baseline -> 0
    assert torch.equal(group_advantages(REWARDS.view(2, 2), 2), group_advantages(REWARDS, 2))
    assert group_advantages(REWARDS, 1).tolist() == [0.0, 0.0, 0.0, 0.0]
    # a group with equal rewards gets 0, not NaN (std 0 + eps)
    assert group_advantages(torch.tensor([0.3, 0.3]), 2).tolist() == [0.0, 0.0]


def test_group_advantages_rejects_bad_input():
    with pytest.raises(ValueError, match="N\\*G"):
        group_advantages(torch.ones(5), 2)
    with pytest.raises(ValueError, match=r"expected \[N, 2\]"):
        group_advantages(torch.ones(2, 3), 2)
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([1.0, float("nan")]), 2)


def test_zero_std_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    assert zero_std_groups(rewards, 4).tolist() == [False, True]
    assert zero_std_groups(rewards, 2).tolist() == [True, False, True, True]
    assert zero_std_groups(REWARDS, 1).tolist() == [True] * 4


# ratio, advantage -> loss with clip 0.2/0.28 and dual clip 3 (worked out by hand):
CASES = [
    (1.5, 1.0, -1.28),  # A>0 above 1+0.28: high clip, loss -A*1.28
    (0.5, 1.0, -0.5),  # A>0 below 1-0.2: the max keeps -A*r, no clip
    (0.5, -1.0, 0.8),  # A<0 below 1-0.2: low clip, loss -A*0.8
    (1.1, 2.0, -2.2),  # inside the trust region
    (4.0, -1.0, 3.0),  # A<0, ratio 4: max gives 4, the dual clip caps at -A*3
    (2.0, -1.0, 2.0),  # A<0, ratio 2: below the cap, untouched
    (4.0, 1.0, -1.28),  # A>0 never meets the dual clip
    (1.0, 0.0, 0.0),  # A=0
]


def _case_tensors():
    ratio, adv, loss = (torch.tensor(col) for col in zip(*CASES))
    return ratio.log().requires_grad_(True), torch.zeros(len(CASES)), adv, loss


def test_policy_loss_clip_and_dual_clip_hand_values():
    logp, old_logp, adv, expected = _case_tensors()
    loss, stats = policy_loss(logp, old_logp, adv, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert loss.tolist() == pytest.approx(expected.tolist(), abs=1e-6)
    assert stats["clipped_high"].tolist() == [1, 0, 0, 0, 0, 0, 1, 0]
    assert stats["clipped_low"].tolist() == [0, 0, 1, 0, 0, 0, 0, 0]
    assert stats["clipped"].tolist() == [1, 0, 1, 0, 0, 0, 1, 0]
    assert stats["dual_clipped"].tolist() == [0, 0, 0, 0, 1, 0, 0, 0]
    assert stats["ratio"].tolist() == pytest.approx([c[0] for c in CASES], rel=1e-6)
    assert stats["ppo_kl"].tolist() == pytest.approx([-math.log(c[0]) for c in CASES], abs=1e-6)
    # d loss / d logp = -A*ratio where the unclipped term is live, 0 where any clip holds
    loss.sum().backward()
    assert logp.grad.tolist() == pytest.approx([0, -0.5, 0, -2.2, 0, 2.0, 0, 0], abs=1e-6)


def test_policy_loss_without_dual_clip():
    logp, old_logp, adv, expected = _case_tensors()
    loss, stats = policy_loss(logp, old_logp, adv, dual_clip=None)
    expected[4] = 4.0  # the A<0, ratio 4 token keeps max(4, 0.8·1) = 4
    assert loss.tolist() == pytest.approx(expected.tolist(), abs=1e-6)
    assert stats["dual_clipped"].sum() == 0


def test_policy_loss_matches_verl_formulas_on_random_tokens():
    """The loss and the clip statistics equal verl compute_policy_loss_vanilla's expressions."""
    g = torch.Generator().manual_seed(0)
    n = 4000
    old_logp = -torch.rand(n, generator=g) * 5
    logp = old_logp + torch.randn(n, generator=g) * 0.8  # ratios from ~0.05 to ~20
    adv = torch.randn(n, generator=g)
    adv[::7] = 0.0
    loss, stats = policy_loss(logp, old_logp, adv, 0.2, 0.28, 3.0)
    ratio = torch.exp(torch.clamp(logp - old_logp, -20, 20))
    losses1, losses2 = -adv * ratio, -adv * torch.clamp(ratio, 0.8, 1.28)
    clip_losses1 = torch.maximum(losses1, losses2)
    losses3 = -adv * 3.0
    verl_loss = torch.where(adv < 0, torch.min(losses3, clip_losses1), clip_losses1)
    assert torch.equal(loss, verl_loss)
    assert torch.equal(stats["clipped"], torch.gt(losses2, losses1).float())  # pg_clipfrac
    lower = torch.gt(clip_losses1, losses3) * (adv < 0).float()  # pg_clipfrac_lower
    assert torch.equal(stats["dual_clipped"], lower)
    assert stats["clipped_low"].sum() > 100 and stats["clipped_high"].sum() > 100
    assert stats["dual_clipped"].sum() > 10


def test_policy_loss_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="one shape"):
        policy_loss(torch.zeros(5), torch.zeros(5), torch.zeros(2))


def test_kl_estimators_known_values():
    ln2 = math.log(2)
    logp = torch.tensor([0.0, ln2, -1.5, -30.0, 0.0])
    ref = torch.tensor([ln2, 0.0, -1.5, 0.0, -30.0])
    # e^d - d - 1 with d = ref - logp: d=ln2 -> 2-ln2-1; d=-ln2 -> 0.5+ln2-1; d=0 -> 0;
    # d=30 -> clamped to 20 -> e^20-21 -> clamped to 10; d=-30 -> -20 -> e^-20+19 -> 10
    assert kl_k3(logp, ref).tolist() == pytest.approx([0.3068528, 0.1931472, 0, 10, 10], abs=1e-6)
    assert kl_k1(logp, ref).tolist() == pytest.approx([-ln2, ln2, 0.0, -30.0, 30.0], abs=1e-6)


def test_aggregate_modes_on_two_sequences_of_different_length():
    loss = torch.tensor([1.0, 2.0, 3.0, 4.0, 8.0], requires_grad=True)
    seq_ids = torch.tensor([0, 0, 0, 1, 1])  # sequence 0: 3 tokens, sequence 1: 2 tokens
    num, den = aggregate(loss, seq_ids, "token-mean")
    assert (num.item(), den) == (18.0, 5.0)  # 3.6: every token weighs 1/5
    num, den = aggregate(loss, seq_ids, "seq-mean-token-mean")
    assert (num.item(), den) == (8.0, 2.0)  # (2 + 6) / 2 = 4.0: the short sequence weighs more
    num, den = aggregate(loss, seq_ids, "seq-mean-token-sum")
    assert (num.item(), den) == (18.0, 2.0)  # (6 + 12) / 2 = 9.0
    num.backward()
    assert loss.grad.tolist() == [1.0] * 5
    # ids need not be sorted or contiguous
    num, den = aggregate(loss.detach(), torch.tensor([7, 7, 2, 7, 2]), "seq-mean-token-mean")
    assert (num.item(), den) == (pytest.approx((1 + 2 + 4) / 3 + (3 + 8) / 2), 2.0)


def test_aggregate_unknown_mode_and_empty_batch():
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-mean, seq-mean-token-sum"):
        aggregate(torch.zeros(2), torch.zeros(2, dtype=torch.long), "mean")
    empty = torch.zeros(0, requires_grad=True)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        num, den = aggregate(empty, torch.zeros(0, dtype=torch.long), mode)
        assert (num.item(), den) == (0.0, 0.0)
        num.backward()  # a rank with no tokens still takes part in backward


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_two_micro_batches_sum_to_the_whole_batch(mode):
    g = torch.Generator().manual_seed(1)
    lengths = [3, 1, 5, 2]
    loss = torch.randn(sum(lengths), generator=g)
    seq_ids = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))
    whole_num, whole_den = aggregate(loss, seq_ids, mode)
    split = lengths[0] + lengths[1]  # micro-batch 1: sequences 0, 1; micro-batch 2: 2, 3
    parts = [aggregate(loss[:split], seq_ids[:split], mode), aggregate(loss[split:], seq_ids[split:], mode)]
    total = sum(p[0] for p in parts) / sum(p[1] for p in parts)
    textbook = {
        "token-mean": loss.mean(),
        "seq-mean-token-mean": torch.stack([s.mean() for s in loss.split(lengths)]).mean(),
        "seq-mean-token-sum": torch.stack([s.sum() for s in loss.split(lengths)]).mean(),
    }[mode]
    assert total.item() == pytest.approx(textbook.item(), abs=1e-6)
    assert (whole_num / whole_den).item() == pytest.approx(textbook.item(), abs=1e-6)
    if mode == "token-mean":  # averaging the micro-batch means instead would weigh tokens unequally
        mean_of_means = sum(p[0] / p[1] for p in parts) / 2
        assert abs(mean_of_means.item() - textbook.item()) > 1e-3


def test_token_entropy_values_and_stability():
    logits = torch.tensor(
        [[0.0, 0.0, 0.0, 0.0], [1.0, 2.0, 3.0, float("-inf")], [1000.0, 1000.0, -1000.0, -1000.0]]
    )
    # uniform over 4: ln 4; softmax(1,2,3) with a masked 4th entry; two equal huge logits: ln 2
    expected = [math.log(4), 0.8323955818399389, math.log(2)]
    assert token_entropy(logits).tolist() == pytest.approx(expected, abs=1e-6)
    one_hot = torch.tensor([[5.0, float("-inf"), float("-inf")]], requires_grad=True)
    entropy = token_entropy(one_hot)
    entropy.sum().backward()
    assert entropy.item() == 0.0 and torch.isfinite(one_hot.grad).all()
    batched = torch.randn(2, 3, 7, dtype=torch.bfloat16)
    assert token_entropy(batched).dtype == torch.float32
    assert torch.allclose(token_entropy(batched), token_entropy(batched.reshape(6, 7)).view(2, 3))


def test_grpo_config_validate():
    assert GRPOConfig().validate() == GRPOConfig()
    bad = {
        "clip_low": (1.0, "rl.clip_low must be in (0, 1)"),
        "clip_high": (0.0, "rl.clip_high must be > 0"),
        "dual_clip": (1.0, "rl.dual_clip must be > 1"),
        "kl_coef": (-0.1, "rl.kl_coef must be >= 0"),
        "loss_agg": ("mean", "rl.loss_agg must be one of token-mean, seq-mean-token-mean"),
        "scale_rewards": ("yes", "rl.scale_rewards must be true or false"),
    }
    for key, (value, message) in bad.items():
        with pytest.raises(GRPOConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            GRPOConfig(**{key: value}).validate()
    with pytest.raises(ValueError, match="clip_low.*; rl.kl_coef"):  # every problem at once
        GRPOConfig(clip_low=0.0, kl_coef=-1.0).validate()
    GRPOConfig(dual_clip=None).validate()


def test_grpo_token_loss_adds_k3_kl():
    logp, old_logp, adv, expected = _case_tensors()
    ref = logp.detach() + 0.5
    k3 = math.exp(0.5) - 0.5 - 1  # 0.148721 on every token
    loss, stats = grpo_token_loss(logp, old_logp, ref, adv, GRPOConfig(kl_coef=0.1))
    assert loss.tolist() == pytest.approx((expected + 0.1 * k3).tolist(), abs=1e-6)
    assert stats["pg_loss"].tolist() == pytest.approx(expected.tolist(), abs=1e-6)
    assert stats["kl"].tolist() == pytest.approx([k3] * len(CASES), abs=1e-6)
    loss0, stats0 = grpo_token_loss(logp, old_logp, ref, adv, GRPOConfig(kl_coef=0.0))
    assert torch.equal(loss0, stats0["pg_loss"]) and "kl" in stats0  # logged, not trained on
    assert "kl" not in grpo_token_loss(logp, old_logp, None, adv, GRPOConfig())[1]
    with pytest.raises(ValueError, match="kl_coef is 0.1 but no ref_logp"):
        grpo_token_loss(logp, old_logp, None, adv, GRPOConfig(kl_coef=0.1))


# ---- TRL: the same numbers from TRL's GRPOTrainer._compute_loss (see tests/trl_reference.py) ----


def _ours(logits, b, mode, beta):
    """omniweave's (numerator, denominator, stats, entropy) on b's response tokens."""
    keep = b.mask.bool()
    logp = torch.log_softmax(logits, -1).gather(-1, b.ids[..., None])[..., 0][keep]
    seq_ids = torch.arange(len(b.advantages))[:, None].expand(keep.shape)[keep]
    cfg = GRPOConfig(clip_low=0.2, clip_high=0.28, dual_clip=None, kl_coef=beta)
    ref = b.ref_logp[keep] if beta else None
    loss, stats = grpo_token_loss(logp, b.old_logp[keep], ref, b.advantages[seq_ids], cfg)
    num, den = aggregate(loss, seq_ids, mode)
    return num, den, stats, token_entropy(logits.detach()[keep])


TRL_CLIP_METRICS = {"clipped_low": "low_mean", "clipped_high": "high_mean", "clipped": "region_mean"}


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize(
    "loss_type,mode", [("dapo", "token-mean"), ("bnpo", "token-mean"), ("grpo", "seq-mean-token-mean")]
)
def test_loss_gradients_and_metrics_match_trl(loss_type, mode, beta):
    pytest.importorskip("trl")
    from tests.trl_reference import random_batch, trl_grpo_loss

    b = random_batch(0, [7, 2, 5, 9])
    trl_logits, our_logits = (b.logits.clone().requires_grad_(True) for _ in range(2))
    trl_loss, metrics = trl_grpo_loss(trl_logits, b, loss_type, beta)
    trl_loss.backward()
    num, den, stats, entropy = _ours(our_logits, b, mode, beta)
    (num / den).backward()
    assert (num / den).item() == pytest.approx(trl_loss.item(), abs=1e-6)
    assert (our_logits.grad - trl_logits.grad).abs().max() < 1e-7
    assert stats["clipped_low"].sum() > 0 and stats["clipped_high"].sum() > 0  # both sides exercised
    for ours, theirs in TRL_CLIP_METRICS.items():
        fraction = stats[ours].sum().item() / b.mask.sum().item()
        assert fraction == pytest.approx(metrics[f"clip_ratio/{theirs}"][0], abs=1e-6)
    if beta:
        assert stats["kl"].mean().item() == pytest.approx(metrics["kl"][0], abs=1e-6)
    assert entropy.mean().item() == pytest.approx(metrics["entropy"][0], abs=1e-5)


def test_token_mean_over_two_micro_batches_matches_trl_dapo_accumulation():
    """TRL dapo divides each micro-batch by the whole window's token count; we sum num and den."""
    pytest.importorskip("trl")
    from tests.trl_reference import random_batch, trl_grpo_loss

    b = random_batch(3, [7, 2, 5, 9])
    micro_batches = [slice(0, 2), slice(2, 4)]  # 9 and 14 tokens
    trl_logits, our_logits = (b.logits.clone().requires_grad_(True) for _ in range(2))
    trl_total, parts = 0.0, []
    for rows in micro_batches:
        loss, _ = trl_grpo_loss(
            trl_logits[rows], b.rows(rows), "dapo", 0.04, 0.2, 0.28, 2, float(b.mask.sum())
        )
        loss.backward()
        trl_total += loss.item()
        parts.append(_ours(our_logits[rows], b.rows(rows), "token-mean", 0.04))
    total = sum(p[0] for p in parts) / sum(p[1] for p in parts)
    total.backward()
    assert total.item() == pytest.approx(trl_total, abs=1e-6)
    assert (our_logits.grad - trl_logits.grad).abs().max() < 1e-7


@pytest.mark.parametrize("scale", [True, False])
def test_group_advantages_match_trl(scale):
    pytest.importorskip("trl")
    from tests.trl_reference import trl_group_advantages

    g = torch.Generator().manual_seed(5)
    binary = torch.randint(0, 2, (32,), generator=g).float()  # pass/fail rewards, some zero-std groups
    continuous = torch.rand(32, generator=g) * 1.1
    for rewards in (binary, continuous):
        ours = group_advantages(rewards, 4, scale=scale, eps=1e-4)  # TRL's eps
        assert (ours - trl_group_advantages(rewards, 4, scale)).abs().max() < 1e-6


def test_token_entropy_matches_trl():
    pytest.importorskip("trl")
    from trl.trainer.utils import entropy_from_logits

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(300, 1000, generator=g) * 3 + torch.randn(300, 1, generator=g) * 50
    assert (token_entropy(logits) - entropy_from_logits(logits)).abs().max() < 1e-5
