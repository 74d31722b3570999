"""Flow matching as a training objective (train.phase=vla): the loss of a VLA row's action chunks.

    loss  = Σ_chunks Σ_real steps, columns (v − u)²   [+ text_weight · Σ CE of the row's labelled text]
    count = Σ_chunks (unpadded steps × real action columns)     (the global normaliser)

so the step's loss is the mean squared velocity error over every real action value of the global
batch, whatever the layout. The chunks' actions, padding, widths and the flow-matching draw (noise,
time) ride in the row (models/vla.py ACTION_KEYS); the row is built with them, seeded per sample,
so every layout scores the same draw. Co-training (``text_weight`` > 0) adds the cross-entropy of
labelled tokens in the same rows (a causal tail after a prefix, or text-only documents) on the
same normaliser: a sum over tokens weighted against the action values, not a second mean.
"""

from __future__ import annotations

import torch
from torch import Tensor

from omniweave.models.vla import ACTION_KEYS
from omniweave.train.objective import Objective, Target


def action_values(pack: dict) -> int:
    """A row's real action values: unpadded steps × real columns, summed over its chunks."""
    if "num_action_values" in pack:
        return int(pack["num_action_values"])
    steps = (~pack["action_is_pad"].bool()).sum(-1)
    return int((steps * pack["action_dims"]).sum())


class FlowMatchingObjective(Objective):
    name = "flow_matching"
    stat_keys = ("flow_sse", "action_values", "text_loss_sum", "text_tokens")

    def __init__(self, text_weight: float = 0.0):
        if text_weight < 0:
            raise ValueError(f"text_weight must be >= 0, got {text_weight}")
        self.text_weight = float(text_weight)

    def count(self, packs: list[dict]) -> float:
        return float(sum(action_values(p) for p in packs))

    def row_inputs(self, model, mb: dict) -> dict[str, Tensor]:
        missing = [k for k in ACTION_KEYS if k not in mb]
        if missing:
            raise ValueError(f"train.phase=vla needs rows with action chunks; this row lacks {', '.join(missing)} "
                             "(pack a LeRobot conversion with a VLA recipe: docs/vla.md)")
        return {k: mb[k] for k in ACTION_KEYS}

    def loss(self, model, prefix, target: Target) -> tuple[Tensor, dict[str, Tensor]]:
        flow = model.flow_loss(prefix, target.row)
        loss = flow.sum
        text = torch.zeros((), dtype=torch.float32, device=loss.device)
        text_tokens = (target.labels != -100).sum()
        if self.text_weight:
            text = model.loss_sum(prefix.hidden, target.labels)
            loss = loss + self.text_weight * text
        return loss, {"flow_sse": flow.sum.detach(), "action_values": flow.count.to(torch.float32),
                      "text_loss_sum": text.detach(), "text_tokens": text_tokens.to(torch.float32)}

    def metrics(self, out: dict) -> dict:
        values = float(out.get("action_values", 0.0))
        record = {"flow_loss": float(out["flow_sse"]) / values if values else 0.0, "action_values": values}
        if self.text_weight:
            tokens = float(out.get("text_tokens", 0.0))
            record["text_loss"] = float(out["text_loss_sum"]) / tokens if tokens else 0.0
        return record
