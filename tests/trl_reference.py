"""Run TRL's own GRPO loss code on given tensors, as the reference for omniweave.rl.grpo.

``trl_grpo_loss`` calls ``GRPOTrainer._compute_loss`` (trl/trainer/grpo_trainer.py) unbound, on a
stand-in ``self`` that carries only the attributes that method reads; the model forward it asks
for (``_get_per_token_logps_and_entropies``) returns log-probs and entropies computed from given
logits with TRL's ``selective_log_softmax`` / ``entropy_from_logits``. Everything after that is
TRL's code: ratio, two-sided clip (``epsilon`` / ``epsilon_high``), k3 KL times ``beta``, the
``loss_type`` aggregation, the gradient-accumulation normalizer, and the logged metrics. TRL has
no dual clip, so comparisons use ``dual_clip=None``.

``trl_group_advantages`` has to replicate the few lines of ``_generate_and_score_completions``
(the ``sum_then_normalize`` branch, ``scale_rewards="group"|"none"``), which is not callable on
its own; it uses TRL's ``nanstd`` and TRL's eps of 1e-4.

Import this module only after ``pytest.importorskip("trl")``.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from types import SimpleNamespace

import torch
from trl.trainer import grpo_trainer as trl_grpo
from trl.trainer import utils as trl_utils


class _OneProcess:
    """The accelerator calls _compute_loss makes, for a single process."""

    num_processes = 1
    sync_gradients = True

    def reduce(self, tensor, reduction="sum"):
        return tensor

    def gather(self, tensor):
        return tensor

    gather_for_metrics = gather


@dataclasses.dataclass
class RolloutBatch:
    """A padded batch as TRL holds it: [B, T] ids / mask / log-probs, [B] advantages."""

    logits: torch.Tensor  # [B, T, V]
    ids: torch.Tensor
    mask: torch.Tensor  # 1 for response tokens, 0 for padding
    old_logp: torch.Tensor
    ref_logp: torch.Tensor
    advantages: torch.Tensor

    def rows(self, part: slice) -> RolloutBatch:
        return RolloutBatch(*(getattr(self, f.name)[part] for f in dataclasses.fields(self)))


def random_batch(seed: int, lengths: list[int], vocab: int = 11) -> RolloutBatch:
    """Random logits and ids; old / ref log-probs near the current ones (ratios in [0.61, 1.65])."""
    g = torch.Generator().manual_seed(seed)
    batch, width = len(lengths), max(lengths)
    logits = torch.randn(batch, width, vocab, generator=g) * 2
    ids = torch.randint(0, vocab, (batch, width), generator=g)
    mask = (torch.arange(width) < torch.tensor(lengths)[:, None]).long()
    logp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    old_logp = logp + (torch.rand(logp.shape, generator=g) - 0.5)
    ref_logp = logp + (torch.rand(logp.shape, generator=g) * 2 - 1)
    return RolloutBatch(logits, ids, mask, old_logp, ref_logp, torch.randn(batch, generator=g))


def trl_grpo_loss(
    logits: torch.Tensor,  # [B, T, V] leaf standing for the model output; gradients land in .grad
    b: RolloutBatch,
    loss_type: str,
    beta: float,
    epsilon: float = 0.2,
    epsilon_high: float = 0.28,
    grad_accum_steps: int = 1,
    num_items_in_batch: float | None = None,
    importance_sampling_level: str = "token",
) -> tuple[torch.Tensor, dict[str, list[float]]]:
    """(the loss TRL backpropagates for this micro-batch, TRL's logged metrics);
    ``importance_sampling_level="sequence"``: GSPO's sequence-level ratio."""

    def forward(model, input_ids, attention_mask, logits_to_keep, **kwargs):
        logps = trl_utils.selective_log_softmax(logits, b.ids)
        return logps, trl_utils.entropy_from_logits(logits), None

    metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    stand_in = SimpleNamespace(
        _get_per_token_logps_and_entropies=forward,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=importance_sampling_level,
        beta=beta,
        loss_type=loss_type,
        epsilon_low=epsilon,
        epsilon_high=epsilon_high,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=grad_accum_steps,
        accelerator=_OneProcess(),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics=metrics,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=grad_accum_steps),
    )
    rows = b.ids.shape[0]
    num_items = float(b.mask.sum()) if num_items_in_batch is None else num_items_in_batch
    inputs = {
        "prompt_ids": torch.zeros(rows, 1, dtype=torch.long),
        "prompt_mask": torch.ones(rows, 1, dtype=torch.long),
        "completion_ids": b.ids,
        "completion_mask": b.mask,
        "advantages": b.advantages,
        "old_per_token_logps": b.old_logp,
        "num_items_in_batch": torch.tensor(num_items),
    }
    if beta:
        inputs["ref_per_token_logps"] = b.ref_logp
    loss = trl_grpo.GRPOTrainer._compute_loss(stand_in, None, inputs)
    return loss, dict(metrics["train"])


def trl_group_advantages(rewards: torch.Tensor, num_generations: int, scale: bool) -> torch.Tensor:
    """TRL's group advantage (grpo_trainer.py, sum_then_normalize): (r - mean) / (nanstd + 1e-4)."""
    grouped = rewards.view(-1, num_generations)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(num_generations, dim=0)
    std = trl_utils.nanstd(grouped, dim=1).repeat_interleave(num_generations, dim=0)
    advantages = rewards - mean
    if scale:
        advantages = advantages / (std + 1e-4)
    return advantages
