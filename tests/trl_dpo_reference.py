"""Run TRL's own DPO loss code on given log-probs, as the reference for omniweave.train.dpo.

``trl_dpo_loss`` calls ``DPOTrainer._compute_loss`` (trl/trainer/dpo_trainer.py) unbound, on a
stand-in ``self`` holding only the attributes that method reads, with precomputed reference
log-probs (``precompute_ref_logps``) and a stand-in model whose output carries the given per-token
log-probs of the completions (TRL sums them per sequence). Everything after that is TRL's code:
the log-ratios, the ``loss_type`` formula (``sigmoid``, ``ipo`` with its per-token normalisation,
``aot`` whose pair-by-pair form is the label-smoothed sigmoid), the mean over pairs and the
logged rewards / margins / accuracies.

Import this module only after ``pytest.importorskip("trl")``.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import torch
from trl.trainer.dpo_trainer import DPOTrainer


class _OneProcess:
    num_processes = 1
    device = torch.device("cpu")

    def gather(self, tensor):
        return tensor

    gather_for_metrics = gather


def trl_dpo_loss(token_logp: torch.Tensor, mask: torch.Tensor, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor,
                 loss_type: str, beta: float, label_smoothing: float = 0.0) -> tuple[float, dict]:
    """(TRL's loss, its logged metrics) for pairs given as padded rows: ``token_logp`` / ``mask``
    [2B, T] (the B chosen completions, then the B rejected ones; log-prob of each completion token,
    mask 1 on them), ``ref_chosen`` / ``ref_rejected`` [B] the reference's sequence log-probs."""
    rows, T = mask.shape
    outputs = SimpleNamespace(log_probs=token_logp * mask, entropy=torch.zeros(rows, T),
                              mean_logits=torch.zeros(rows, T), is_top1=torch.zeros(rows, T, dtype=torch.bool))
    stand_in = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_OneProcess(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0],
        beta=beta, label_smoothing=label_smoothing, use_weighting=False,
        _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    inputs = {  # TRL shifts: its completion_mask[:, 1:] is the mask of the predicted tokens
        "input_ids": torch.zeros(rows, T + 1, dtype=torch.long), "attention_mask": torch.ones(rows, T + 1),
        "completion_mask": torch.cat([torch.zeros(rows, 1), mask], 1),
        "ref_chosen_logps": ref_chosen, "ref_rejected_logps": ref_rejected,
    }
    loss = DPOTrainer._compute_loss(stand_in, lambda **kw: outputs, inputs, return_outputs=False)
    return float(loss), {k: v[-1] for k, v in stand_in._metrics["train"].items()}
