"""The preference and RL objectives added beside DPO / GRPO, against TRL 1.16's own code on the
same tensors (fp32): ORPO's odds-ratio term (``ORPOTrainer.odds_ratio_loss``), SimPO
(``CPOTrainer.cpo_loss``, ``loss_type="simpo"``), KTO (``KTOTrainer._compute_loss`` on a stand-in
self and model, one process and two), GSPO (``GRPOTrainer._compute_loss`` with
``importance_sampling_level="sequence"``, through tests/trl_reference.py), RLOO's leave-one-out
advantages (``RLOOTrainer``: its formula, lines 1675-1691 of rloo_trainer.py, inlined below because
it sits inside the trainer's generation step). |Δloss| and |Δgrad| ≤ 1e-6."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from omniweave.errors import UserError
from omniweave.train.preference import (
    KTOConfig,
    ORPOConfig,
    SimPOConfig,
    kto_kl_reference,
    kto_loss,
    orpo_loss,
    simpo_loss,
)

TOL = 1e-6
TRL_CLIP_METRICS = {"clipped_low": "low_mean", "clipped_high": "high_mean", "clipped": "region_mean"}


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


class _Gatherer:
    """The accelerator KTOTrainer._compute_loss calls: one process, or all-gathers over a group."""

    device = torch.device("cpu")

    def __init__(self, group=None):
        self.group = group

    def gather_for_metrics(self, t):
        t = t.reshape(-1)
        if self.group is None:
            return t
        import torch.distributed as dist

        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts)


def _kto_case(n: int, seed: int, z0_sign: float = 1.0):
    """Token log-probs of n completions of unequal lengths (and of n mismatched KL completions),
    the reference's sequence log-probs, desirable flags of both kinds in mixed order; the KL pairs'
    mean log-ratio is about ``z0_sign`` (negative: TRL's clamp at 0 is active)."""
    g = torch.Generator().manual_seed(seed)
    T, T_kl = 13, 11
    mask = (torch.arange(T) < torch.randint(3, T + 1, (n, 1), generator=g)).float()
    kl_mask = (torch.arange(T_kl) < torch.randint(2, T_kl + 1, (n, 1), generator=g)).float()
    tokens = -torch.rand(n, T, generator=g) * 3
    kl_tokens = -torch.rand(n, T_kl, generator=g) * 3
    ref = (tokens * mask).sum(-1) + torch.randn(n, generator=g) * 2
    ref_kl = (kl_tokens * kl_mask).sum(-1) - z0_sign + torch.randn(n, generator=g) * 0.5
    desirable = torch.rand(n, generator=g) < 0.55
    desirable[:2] = torch.tensor([True, False])  # both kinds present
    return tokens, mask, kl_tokens, kl_mask, ref, ref_kl, desirable


def _trl_kto(tokens, mask, kl_tokens, kl_mask, ref, ref_kl, desirable, cfg, accelerator):
    """(loss, TRL's logged metrics) of TRL 1.16 ``KTOTrainer._compute_loss`` on a stand-in self
    (reference log-probs precomputed, as TRL's ``precompute_ref_log_probs``), whose model returns
    the given token log-probs (its ``fused_lm_head`` output; zeros off the completion)."""
    from trl.trainer.kto_trainer import KTOTrainer

    n, T = tokens.shape
    batch = {"input_ids": torch.zeros(n, T + 1, dtype=torch.long), "attention_mask": torch.ones(n, T + 1),
             "completion_mask": torch.cat([torch.zeros(n, 1), mask], 1).long(), "label": desirable,
             "ref_logps": ref}
    if cfg.loss == "kto":
        batch |= {"KL_input_ids": torch.ones(n, kl_tokens.shape[1] + 1, dtype=torch.long),
                  "KL_attention_mask": torch.ones(n, kl_tokens.shape[1] + 1),
                  "KL_completion_mask": torch.cat([torch.zeros(n, 1), kl_mask], 1).long(), "ref_KL_logps": ref_kl}

    def model(input_ids, labels, fused_lm_head, **kwargs):
        logps = kl_tokens * kl_mask if input_ids is batch.get("KL_input_ids") else tokens * mask
        return SimpleNamespace(log_probs=logps, entropy=torch.zeros_like(logps), mean_logits=torch.zeros_like(logps))

    metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trl = _trainer(KTOTrainer, accelerator=accelerator, model=SimpleNamespace(training=True), beta=cfg.beta,
                   loss_type=cfg.loss, desirable_weight=cfg.desirable_weight,
                   undesirable_weight=cfg.undesirable_weight, calculate_KL=cfg.loss == "kto",
                   precompute_ref_logps=True, aux_loss_enabled=False, _metrics=metrics, _total_train_tokens=0,
                   _tp_size=1)
    return KTOTrainer._compute_loss(trl, model, batch, return_outputs=False), dict(metrics["train"])


def _ours_kto(tokens, mask, kl_tokens, kl_mask, ref, ref_kl, desirable, cfg, group=None):
    z0 = kto_kl_reference((kl_tokens * kl_mask).sum(-1), ref_kl, group) if cfg.loss == "kto" else None
    losses, chosen, rejected = kto_loss((tokens * mask).sum(-1), ref, desirable, z0, cfg)
    return losses.mean(), chosen, rejected, z0


@pytest.mark.parametrize("loss, z0_sign, weights", [("kto", 1.0, (1.0, 1.0)), ("kto", -1.0, (1.0, 1.33)),
                                                    ("apo_zero_unpaired", 1.0, (0.8, 1.2))])
def test_kto_equals_trl_kto_trainer(loss, z0_sign, weights):
    """Loss, its gradient w.r.t. the policy's token log-probs, the reference point z0 and the rewards
    equal TRL's ``KTOTrainer._compute_loss`` on 9 completions of unequal lengths."""
    case = _kto_case(9, seed=4 + int(z0_sign), z0_sign=z0_sign)
    cfg = KTOConfig(beta=0.3, desirable_weight=weights[0], undesirable_weight=weights[1], loss=loss).validate()
    x, y = case[0].clone().requires_grad_(), case[0].clone().requires_grad_()
    want, metrics = _trl_kto(x, *case[1:], cfg, _Gatherer())
    want.backward()
    got, chosen, rejected, z0 = _ours_kto(y, *case[1:], cfg)
    got.backward()
    d_loss, d_grad = abs((got - want).item()), (y.grad - x.grad).abs().max().item()
    print(f"kto {loss} z0_sign={z0_sign}: |Δloss| {d_loss:.1e}, |Δgrad| {d_grad:.1e}")
    assert d_loss <= TOL and d_grad <= TOL and x.grad.abs().max() > 1e-3
    if loss == "kto":
        assert float(z0) == pytest.approx(metrics["kl"][0], abs=1e-6)
        assert (float(z0) > 0.5) == (z0_sign > 0)  # z0_sign < 0: clamped to 0
        assert float(z0) >= 0
    assert float(chosen.mean()) == pytest.approx(metrics["rewards/chosen"][0], abs=1e-6)
    assert float(rejected.mean()) == pytest.approx(metrics["rewards/rejected"][0], abs=1e-6)
    assert len(chosen) == int(case[-1].sum()) and len(rejected) == 9 - int(case[-1].sum())


def _kto_rank(rank: int, world: int):
    """One rank of the two-process KTO check: TRL's loss and ours on this rank's completions."""
    import torch.distributed as dist

    from tests import torchvision_shim

    torchvision_shim.install()  # as tests/conftest.py: trl imports transformers

    case = _kto_case(5 + 4 * rank, seed=10 + rank, z0_sign=1.0 - 0.6 * rank)  # 5 and 9 completions
    cfg = KTOConfig(beta=0.3).validate()
    x, y = case[0].clone().requires_grad_(), case[0].clone().requires_grad_()
    want, metrics = _trl_kto(x, *case[1:], cfg, _Gatherer(dist.group.WORLD))
    want.backward()
    got, _, _, z0 = _ours_kto(y, *case[1:], cfg, group=dist.group.WORLD)
    got.backward()
    local = float(((case[2] * case[3]).sum(-1) - case[5]).mean())
    return (got - want).item(), (y.grad - x.grad).abs().max().item(), float(z0), metrics["kl"][0], local


@pytest.mark.dist
def test_kto_reference_point_over_two_processes_equals_trl():
    """z0 is the mean of the processes' own batch means (5 and 9 completions: not the mean over
    all 14), clamped at 0, the same on both ranks, as TRL's ``gather_for_metrics`` then mean."""
    from omniweave.parallel.spawn import run_ranks

    results = run_ranks(_kto_rank, 2)
    for d_loss, d_grad, z0, trl_z0, _ in results:
        print(f"kto 2 ranks: z0 {z0:.4f}, |Δloss| {abs(d_loss):.1e}, |Δgrad| {d_grad:.1e}")
        assert abs(d_loss) <= TOL and d_grad <= TOL and z0 == pytest.approx(trl_z0, abs=1e-6)
    assert results[0][2] == results[1][2] == pytest.approx(max(0.0, (results[0][4] + results[1][4]) / 2), abs=1e-6)


def test_kto_settings_and_inputs_refused_in_one_line():
    for key, value in (("beta", 0.0), ("undesirable_weight", -1.0), ("desirable_weight", float("nan")),
                       ("loss", "bco")):
        with pytest.raises(UserError, match=rf"^train\.kto\.{key} must be"):
            KTOConfig(**{key: value}).validate()
    one = torch.zeros(3)
    with pytest.raises(ValueError, match="reference point z0"):
        kto_loss(one, one, one.bool(), None, KTOConfig())
    with pytest.raises(ValueError, match="non-empty"):
        kto_kl_reference(torch.zeros(0), torch.zeros(0))


def test_sequence_log_ratio_is_each_sequences_mean_on_interleaved_tokens():
    from omniweave.rl.grpo import sequence_log_ratio

    logp = torch.tensor([-1.0, -2.0, -3.0, -4.0, -5.0])
    old = torch.tensor([-1.5, -2.0, -2.0, -4.5, -5.0])
    seq_ids = torch.tensor([7, 3, 7, 3, 7])  # sequence 7: log-ratios 0.5, -1, 0; sequence 3: 0, 0.5
    want = torch.tensor([-0.5 / 3, 0.25, -0.5 / 3, 0.25, -0.5 / 3])
    assert torch.allclose(sequence_log_ratio(logp, old, seq_ids), want, atol=1e-7)


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("clip_low, clip_high", [(0.2, 0.28), (3e-4, 4e-4)])  # TRL's defaults, the GSPO paper's
def test_gspo_token_loss_on_packed_tokens_equals_trl_sequence_level(clip_low, clip_high, beta):
    """Five sequences of unequal lengths as one flat token tensor (shuffled, arbitrary seq ids),
    through gspo_token_loss and aggregate(seq-mean-token-mean), against TRL's padded [B, T]
    ``GRPOTrainer._compute_loss`` (importance_sampling_level="sequence", loss_type="grpo"): loss,
    gradient w.r.t. the logits, and TRL's clip fractions."""
    from omniweave.rl.grpo import GRPOConfig, aggregate, gspo_token_loss
    from tests.trl_reference import random_batch, trl_grpo_loss

    b = random_batch(4, [7, 2, 5, 9, 4])  # a seed whose sequences clip on both sides of the narrow range
    trl_logits, our_logits = (b.logits.clone().requires_grad_(True) for _ in range(2))
    want, metrics = trl_grpo_loss(trl_logits, b, "grpo", beta, clip_low, clip_high,
                                  importance_sampling_level="sequence")
    want.backward()
    keep = b.mask.bool()
    order = torch.randperm(int(keep.sum()), generator=torch.Generator().manual_seed(1))  # a packed row's order
    seq_ids = (torch.arange(len(b.advantages)) * 10 + 3)[:, None].expand(keep.shape)[keep][order]
    logp = torch.log_softmax(our_logits, -1).gather(-1, b.ids[..., None])[..., 0][keep][order]
    adv = b.advantages[:, None].expand(keep.shape)[keep][order]
    ref = b.ref_logp[keep][order] if beta else None
    cfg = GRPOConfig(clip_low=clip_low, clip_high=clip_high, dual_clip=None, kl_coef=beta,
                     loss_agg="seq-mean-token-mean")
    loss, stats = gspo_token_loss(logp, b.old_logp[keep][order], ref, adv, seq_ids, cfg)
    num, den = aggregate(loss, seq_ids, "seq-mean-token-mean")
    (num / den).backward()
    d_loss, d_grad = abs((num / den - want).item()), (our_logits.grad - trl_logits.grad).abs().max().item()
    print(f"gspo clip=({clip_low}, {clip_high}) beta={beta}: |Δloss| {d_loss:.1e}, |Δgrad| {d_grad:.1e}")
    assert d_loss <= TOL and d_grad <= TOL and trl_logits.grad.abs().max() > 1e-4
    for ours, theirs in TRL_CLIP_METRICS.items():
        num_c, den_c = aggregate(stats[ours], seq_ids, "seq-mean-token-mean")
        assert float(num_c / den_c) == pytest.approx(metrics[f"clip_ratio/{theirs}"][0], abs=1e-6)
    assert stats["clipped_low"].sum() > 0  # a sequence's ratio is below 0.8 with A < 0
    if clip_low < 0.01:  # the paper's narrow range clips sequences on both sides
        assert stats["clipped_high"].sum() > 0


def test_importance_sampling_setting_refused_in_one_line():
    from omniweave.rl.grpo import GRPOConfig, GRPOConfigError

    assert GRPOConfig().importance_sampling == "token"  # today's GRPO unless asked
    with pytest.raises(GRPOConfigError, match=r"^rl\.importance_sampling must be token or sequence; got 'seq'$"):
        GRPOConfig(importance_sampling="seq").validate()
    with pytest.raises(GRPOConfigError, match=r"set rl\.loss_agg=seq-mean-token-mean \(got token-mean\)$"):
        GRPOConfig(importance_sampling="sequence").validate()
    GRPOConfig(importance_sampling="sequence", loss_agg="seq-mean-token-mean").validate()


def test_gspo_ratio_gradient_spreads_over_the_sequence():
    """An unclipped sequence's loss −A·s_i gives each of its n tokens −A·s_i / n (no stop-gradient:
    TRL 1.16 differentiates through the mean); another sequence's tokens get nothing from it."""
    from omniweave.rl.grpo import GRPOConfig, gspo_token_loss

    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0], requires_grad=True)
    old = torch.tensor([-1.1, -1.9, -0.5, -3.0])  # sequence 0: mean log-ratio 0, s = 1
    seq_ids = torch.tensor([0, 0, 0, 1])
    adv = torch.tensor([2.0, 2.0, 2.0, 0.0])
    loss, _ = gspo_token_loss(logp, old, None, adv, seq_ids, GRPOConfig(dual_clip=None))
    assert torch.allclose(loss.detach(), torch.tensor([-2.0, -2.0, -2.0, 0.0]))
    loss[0].backward()  # one token's copy of sequence 0's loss
    assert torch.allclose(logp.grad, torch.tensor([-2 / 3, -2 / 3, -2 / 3, 0.0]))


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


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_gspo_objective_on_a_packed_row_equals_trl(beta):
    """The training objective (rl.importance_sampling=sequence) on one packed row — five sequences
    of unequal lengths, two prompt tokens before each — from its per-sequence sums: TRL 1.16's
    padded-batch loss and gradient w.r.t. the logits, and the token-wise spelling
    (gspo_token_loss + aggregate) the same value: one GSPO."""
    from omniweave.rl.grpo import GRPOConfig, aggregate, gspo_token_loss
    from omniweave.rl.objective import GRPOObjective
    from omniweave.train.objective import Target
    from tests.trl_reference import random_batch, trl_grpo_loss

    b = random_batch(4, [7, 2, 5, 9, 4])
    trl_logits, our_logits = (b.logits.clone().requires_grad_(True) for _ in range(2))
    want, _ = trl_grpo_loss(trl_logits, b, "grpo", beta, 0.2, 0.28, importance_sampling_level="sequence")
    want.backward()
    keep = b.mask.bool()
    n_seq = len(b.advantages)
    prompt = torch.zeros(n_seq, 2, dtype=torch.bool)
    row_keep = torch.cat([prompt, keep], 1)  # each sequence: 2 prompt tokens, then its response (and pads)
    in_row = torch.cat([torch.ones_like(prompt), keep], 1)  # pads are not in the packed row
    labels = torch.where(row_keep, 1, -100)[in_row]
    logp_padded = torch.log_softmax(our_logits, -1).gather(-1, b.ids[..., None])[..., 0]

    def packed(v):  # a [B, T] per-token value -> the row's tokens (0 on the prompts)
        return torch.cat([torch.zeros(n_seq, 2, dtype=v.dtype), v], 1)[in_row]

    slot = (torch.arange(n_seq) + 1)[:, None].expand(keep.shape)
    tokens = {"old_logp": packed(b.old_logp), "advantages": packed(b.advantages[:, None].expand(keep.shape)),
              "seq_slot": packed(torch.where(keep, slot, 0)), "ref_logp": packed(b.ref_logp),
              "weights": packed(keep.float())}
    cfg = GRPOConfig(clip_low=0.2, clip_high=0.28, dual_clip=None, kl_coef=beta, loss_agg="seq-mean-token-mean",
                     importance_sampling="sequence").validate()
    objective = GRPOObjective(cfg, 1.0)
    assert objective.token_sum is False
    target = Target(labels, tokens if beta else {k: v for k, v in tokens.items() if k != "ref_logp"},
                    {"num_seqs": torch.tensor([n_seq])})
    loss, stats = objective.loss(_LogpModel(), packed(logp_padded), target)
    (loss / n_seq).backward()
    d_loss, d_grad = abs(float(loss.detach() / n_seq - want.detach())), (our_logits.grad - trl_logits.grad).abs().max().item()
    print(f"gspo objective beta={beta}: |Δloss| {d_loss:.1e}, |Δgrad| {d_grad:.1e}")
    assert d_loss <= TOL and d_grad <= TOL and trl_logits.grad.abs().max() > 1e-4
    assert float(stats["tokens"]) == int(keep.sum())
    token_loss, _ = gspo_token_loss(logp_padded.detach()[keep], b.old_logp[keep], b.ref_logp[keep] if beta else None,
                                    b.advantages[:, None].expand(keep.shape)[keep], slot[keep], cfg)
    num, den = aggregate(token_loss, slot[keep], "seq-mean-token-mean")
    assert abs(float(num / den - loss.detach() / n_seq)) <= TOL  # the token-wise spelling, same tokens


class _LogpModel:
    """A model whose hidden states are the labels' log-probs already (objective unit tests)."""

    @staticmethod
    def token_logps(h, labels, temperature=1.0):
        return torch.where(labels != -100, h, 0.0)


@pytest.mark.parametrize("phase", ["simpo", "orpo"])
def test_pair_objectives_on_a_packed_row_equal_trl(phase):
    """SimPO's and ORPO's training objectives on one packed row of six pairs (answers of unequal
    lengths; for ORPO the chosen answers share one length, where TRL's token-mean NLL is ours),
    from DPO's per-row pair sums: TRL 1.16's loss on the padded batch (CPOTrainer.cpo_loss
    ``loss_type="simpo"``; ORPOTrainer's NLL − odds_ratio_loss) and its gradient w.r.t. the
    answers' token log-probs."""
    from trl.experimental.cpo import CPOTrainer
    from trl.experimental.orpo import ORPOTrainer

    from omniweave.train.dpo import pair_slots
    from omniweave.train.objective import Target
    from omniweave.train.preference import ORPOObjective, SimPOObjective

    g = torch.Generator().manual_seed(5)
    P, T = 6, 12
    lengths = torch.randint(2, T + 1, (P, 2), generator=g)
    if phase == "orpo":
        lengths[:, 0] = 7
    mask = (torch.arange(T) < lengths[..., None]).float()  # [P, 2, T]
    tokens = -torch.rand(P, 2, T, generator=g) * 2
    x = tokens.clone().requires_grad_()
    avg = (x * mask).sum(-1) / mask.sum(-1)  # TRL's get_batch_logps(average_log_prob=True)
    if phase == "simpo":
        cfg = SimPOConfig(2.5, 1.4, 0.1)
        trl = _trainer(CPOTrainer, beta=cfg.beta, simpo_gamma=cfg.gamma, label_smoothing=cfg.label_smoothing,
                       loss_type="simpo", cpo_alpha=0.0, alpha=0.0)
        want = trl.cpo_loss(avg[:, 0], avg[:, 1])[0].mean()
    else:
        cfg = ORPOConfig(0.2)
        trl = _trainer(ORPOTrainer, beta=cfg.beta)
        nll = -(x[:, 0] * mask[:, 0]).sum() / mask[:, 0].sum()  # the chosen tokens' mean NLL
        want = nll - trl.odds_ratio_loss(avg[:, 0], avg[:, 1])[0].mean()
    want.backward()
    # the packed row: per document (chosen, rejected, alternating) 3 prompt tokens then the answer
    y = tokens.clone().requires_grad_()
    labels, h_parts, lens = [], [], []
    for p in range(P):
        for side in range(2):
            k = int(lengths[p, side])
            labels += [-100] * 3 + [1] * k
            h_parts += [torch.zeros(3), y[p, side, :k]]
            lens.append(3 + k)
    labels, h = torch.tensor(labels), torch.cat(h_parts)
    cu = torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)
    slots = pair_slots(labels, cu, ["chosen", "rejected"] * P)
    objective = object.__new__(SimPOObjective if phase == "simpo" else ORPOObjective)
    objective.engine = SimpleNamespace(dims=SimpleNamespace(cp=1))
    setattr(objective, phase, cfg)
    row = {"num_pairs": torch.tensor([P]), "ref_logps": torch.zeros(P, 2)}
    loss, stats = objective.loss(_LogpModel(), h, Target(labels, {"pair_slot": slots}, row))
    (loss / P).backward()
    d_loss, d_grad = abs(float(loss.detach() / P - want.detach())), (y.grad - x.grad).abs().max().item()
    print(f"{phase} objective on a packed row: |Δloss| {d_loss:.1e}, |Δgrad| {d_grad:.1e}")
    assert d_loss <= TOL and d_grad <= TOL and x.grad.abs().max() > 1e-3
    assert float(stats["pairs"]) == P
