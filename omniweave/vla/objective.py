"""Flow matching as a training objective (train.phase=vla): the loss of a VLA row's action chunks.

    loss  = Σ_chunks Σ_real steps, columns (v − u)²   [+ text_weight · Σ CE of the row's labelled text]
    count = Σ_chunks (unpadded steps × real action columns)     (the global normaliser)

so the step's loss is the mean squared velocity error over every real action value of the global
batch, whatever the layout. The chunks' actions, padding and widths ride in the row with each chunk's sample index
(``action_samples``: the frame's index in the raw dataset); the flow-matching draw (noise at the
expert's width, time ~ Beta) comes from a generator seeded by (train.seed, step, sample index), so
every layout, rank count and resume scores the same draw, and a frame seen again later gets a new one. Co-training (``text_weight`` > 0) adds the cross-entropy of
labelled tokens in the same rows (a causal tail after a prefix, or text-only documents) on the
same normaliser: a sum over tokens weighted against the action values, not a second mean.
"""

from __future__ import annotations

import torch
from torch import Tensor

from collections.abc import Callable

from omniweave.models.components.flow import sample_flow_time
from omniweave.train.objective import Objective, Target, draw_seed

ROW_KEYS = ("action_docs", "actions", "action_is_pad", "action_dims", "action_samples")  # what the loader puts in a row


def flow_draw(samples: torch.Tensor, seed: int, step: int, horizon: int, width: int, alpha: float = 1.5,
              beta: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(noise float32 [N, horizon, width], time float32 [N]) of each chunk, from its own generator
    (:func:`draw_seed` of its sample index), on the CPU: the same numbers on any device and layout."""
    noise, time = [], []
    for sample in samples.tolist():
        g = torch.Generator().manual_seed(draw_seed(seed, step, int(sample)))
        noise.append(torch.randn(horizon, width, generator=g))
        time.append(sample_flow_time(1, g, alpha, beta))
    if not noise:
        return torch.zeros(0, horizon, width), torch.zeros(0)
    return torch.stack(noise), torch.cat(time)


def action_values(pack: dict) -> int:
    """A row's real action values: unpadded steps × real columns, summed over its chunks."""
    if "num_action_values" in pack:
        return int(pack["num_action_values"])
    steps = (~pack["action_is_pad"].bool()).sum(-1)
    return int((steps * pack["action_dims"]).sum())


class FlowMatchingObjective(Objective):
    name = "flow_matching"
    stat_keys = ("flow_sse", "action_values", "text_loss_sum", "text_tokens")

    def __init__(self, seed: int = 0, step: Callable[[], int] = lambda: 0, text_weight: float = 0.0,
                 expert_counts: tuple[int, int, int] | None = None, horizon: int = 0):
        """``step()``: the optimizer step being computed (the engine's), part of every draw's seed;
        ``expert_counts`` (``metrics.expert_flop_counts``) and ``horizon``: the expert's, for :meth:`flops`."""
        if text_weight < 0:
            raise ValueError(f"text_weight must be >= 0, got {text_weight}")
        self.seed, self.step, self.text_weight = int(seed), step, float(text_weight)
        self.expert_counts, self.horizon = expert_counts, int(horizon)

    def count(self, packs: list[dict]) -> float:
        return float(sum(action_values(p) for p in packs))

    def flops(self, packs: list[dict]) -> float:
        """The expert's training FLOPs: each frame's chunk of H tokens over its prefix and itself."""
        from omniweave.train.metrics import chunk_flops

        if self.expert_counts is None:
            return 0.0
        prefixes = [int(n) for p in packs if "action_docs" in p for n in p["prefix_lens"][p["action_docs"]]]
        h = self.horizon
        return chunk_flops(self.expert_counts, h * len(prefixes), sum(h * (prefix + h) for prefix in prefixes))

    def row_inputs(self, model, mb: dict) -> dict[str, Tensor]:
        """The row's chunks at the expert's width (zero columns added) and their flow draw."""
        missing = [k for k in ROW_KEYS if k not in mb]
        if missing:
            raise ValueError(f"train.phase=vla needs rows with action chunks; this row lacks {', '.join(missing)} "
                             "(pack a LeRobot conversion with a VLA recipe: docs/vla.md)")
        cfg = model.action_expert.config
        actions = mb["actions"]
        if actions.shape[1:] != (cfg.horizon, actions.shape[2]) or actions.shape[2] > cfg.action_dim:
            raise ValueError(f"action chunks of shape {tuple(actions.shape[1:])} do not fit the expert "
                             f"(horizon {cfg.horizon}, action_dim {cfg.action_dim}): repack with data.vla.horizon "
                             f"= {cfg.horizon}, or widen model.action_expert.action_dim")
        actions = torch.nn.functional.pad(actions, (0, cfg.action_dim - actions.shape[2]))
        noise, time = flow_draw(mb["action_samples"], self.seed, self.step(), cfg.horizon, cfg.action_dim,
                                cfg.time_alpha, cfg.time_beta)
        return {"action_docs": mb["action_docs"], "actions": actions, "action_is_pad": mb["action_is_pad"],
                "action_dims": mb["action_dims"], "action_noise": noise.to(actions.device, actions.dtype),
                "action_time": time.to(actions.device, actions.dtype)}

    def loss(self, model, prefix, target: Target) -> tuple[Tensor, dict[str, Tensor]]:
        flow = model.flow_loss(prefix, target.row)
        loss = flow.sum
        text = torch.zeros((), dtype=torch.float32, device=loss.device)
        text_tokens = (target.labels != -100).sum()
        if self.text_weight:
            text = model.loss_sum(prefix.hidden, target.labels)
            loss = loss + self.text_weight * text
        else:  # the LM loss of no token (0 × the hidden states and the head): the backbone's last layers and
            # the LM head, off the flow loss's path, get (zero) gradients every step, so every rank's
            # optimizer holds state for every parameter and checkpoints restore whole (as
            # run_encoder_always does for idle encoders); under tp the vocab-parallel loss takes it too
            loss = loss + model.loss_sum(prefix.hidden, torch.full_like(target.labels, -100))
        return loss, {"flow_sse": flow.sum.detach(), "action_values": flow.count.to(torch.float32),
                      "text_loss_sum": text.detach(), "text_tokens": text_tokens.to(torch.float32)}

    def metrics(self, out: dict) -> dict:
        values = float(out.get("action_values", 0.0))
        record = {"flow_loss": float(out["flow_sse"]) / values if values else 0.0, "action_values": values}
        if self.text_weight:
            tokens = float(out.get("text_tokens", 0.0))
            record["text_loss"] = float(out["text_loss_sum"]) / tokens if tokens else 0.0
        return record
