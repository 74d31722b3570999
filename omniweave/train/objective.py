"""The training objective: the one contract every training mode's loss fulfils.

A mode (SFT / pretraining, DPO, GRPO, KTO, …) is an :class:`Objective`; the engine's executor for
the run's layout (train/executors.py: plain rows, chunked rows, pipeline stages) calls it, and
never knows which mode runs:

    count      = objective.count(packs)              this rank's share of the step's normaliser
                                                     (loss tokens, pairs, sequences); the engine
                                                     sums it over the ranks and divides by it
    objective.prepare_step(model, micro_batches)     once per step, before any forward (no grad):
                                                     KTO's reference point over the step's rows
    row        = objective.row_inputs(model, mb)     per-row inputs at static shapes, no grad
                                                     (DPO's reference log-probs); {} for most
    loss, stats = objective.loss(model, h, target)   from the final hidden states ``h`` (after
                                                     the final norm) of one micro-batch, one
                                                     chunk of a row or a pipeline's last stage

``target`` (:class:`Target`) is what the hidden states are scored against: ``labels`` [L] and the
per-token values of the row (``token_data``: loss weights, pair slots, old log-probs, advantages,
all [L], cut like the labels by CP shards and chunks) and the row's own inputs. The objective
applies the LM head itself through the model (``model.token_logps`` / ``model.loss_sum``), so a
vocab-parallel head works under every layout.

``token_sum``: the loss and every statistic are sums over the row's tokens, so a chunk's (or a
CP shard's) are its own tokens' and the parts add up. A sequence-level loss (DPO, KTO, ORPO, …)
sets it False and is written as a function of per-row sums of token values instead:

    sums = objective.sums(model, h, target)          additive over tokens (e.g. [P, 4]: the
                                                     pairs' log-prob sums and token counts)
    loss, stats = objective.from_sums(sums, target)  the loss of the whole row from its sums

so that chunked rows carry the sums across chunks (train/executors.py) and a CP group sums its
shards' before the loss. ``stat_keys``: the statistics ``loss`` reports (every call returns each).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class Target:
    """What one micro-batch's (or chunk's, or pipeline row's) hidden states are scored against."""

    labels: Tensor  # [L] int64, -100: no loss
    tokens: dict[str, Tensor] = field(default_factory=dict)  # per-token [L] values (token_data)
    row: dict[str, Tensor] = field(default_factory=dict)  # the row's own inputs (Objective.row_inputs)

    @classmethod
    def of(cls, batch: dict, row: dict | None = None) -> "Target":
        return cls(batch["labels"], dict(batch.get("token_data") or {}), dict(row or {}))


def draw_seed(seed: int, step: int, sample: int) -> int:
    """A well-mixed 63-bit seed of (run seed, step, sample index) (numpy's SeedSequence hash): the
    seed of an objective's per-sample random draw (a VLA chunk's, a diffusion clip's), the same on
    every layout, rank count and resume."""
    import numpy as np

    return int(np.random.SeedSequence([seed, step, sample]).generate_state(2, np.uint64)[0] >> np.uint64(1))


def slot_sums(values: Tensor, slots: Tensor, num_slots: int) -> Tensor:
    """[num_slots, ...] fp32 sums of ``values`` [L, ...] over the tokens of each slot 1..num_slots
    (0: none): the per-row sums of a sequence-level objective (pairs', sequences', completions')."""
    out = values.new_zeros((num_slots + 1, *values.shape[1:]), dtype=torch.float32)
    return out.index_add(0, slots.to(torch.long), values.float())[1:]


class Objective:
    """The base of the training objectives (see the module docstring); subclasses override
    :meth:`loss` (``token_sum``) or :meth:`sums` and :meth:`from_sums` (sequence-level)."""

    name = "objective"
    token_sum = True
    step_pre_pass = False  # prepare_step runs (the step's micro-batches then sit on the device together)
    stat_keys: tuple[str, ...] = ()
    line = None  # the console fields of the mode (train/metrics.py SFT_LINE format); None: SFT's

    def count(self, packs: list[dict]) -> float:
        """This rank's share of the step's normaliser; the loss tokens by default."""
        return float(sum(p["num_loss_tokens"] for p in packs))

    def flops(self, packs: list[dict]) -> float:
        """Training FLOPs of this rank's packs that the objective's own modules add to the
        foundation's per-token estimate (``metrics.step_flops``): an action expert's chunks; 0 by default."""
        return 0.0

    def prepare_step(self, model, micro_batches: list[dict]) -> None:
        """Before the step's first forward, with all of this rank's (CP-sharded) micro-batches: a
        step-level quantity every row's loss needs (KTO's reference point z0, from a no-grad
        pass over the step's rows), when ``step_pre_pass``. An objective that needs it refuses the
        pipeline layouts (train/layouts.py: a reference forward)."""

    def row_inputs(self, model, mb: dict) -> dict[str, Tensor]:
        """Per-row inputs computed before the row's forward (no grad), at shapes that depend on the
        row length only (a pipeline stacks them over its rows)."""
        return {}

    def loss(self, model, h: Tensor, target: Target) -> tuple[Tensor, dict[str, Tensor]]:
        """(loss sum, {stat: 0-d tensor}) of the hidden states ``h``."""
        if self.token_sum:
            raise NotImplementedError(f"{type(self).__name__} must define loss()")
        return self.from_sums(self.sums(model, h, target), target)

    def sums(self, model, h: Tensor, target: Target) -> Tensor:
        """A sequence-level objective's per-row sums of token values (additive over tokens)."""
        raise NotImplementedError(f"{type(self).__name__} is token_sum: it has no sums()")

    def from_sums(self, sums: Tensor, target: Target) -> tuple[Tensor, dict[str, Tensor]]:
        """A sequence-level objective's loss and statistics from the whole row's ``sums``."""
        raise NotImplementedError(f"{type(self).__name__} is token_sum: it has no from_sums()")

    def metrics(self, out: dict) -> dict:
        """The step's logged values from the engine step's summed statistics ``out``."""
        return {}

    # the heads the executors pass to the model's forward (``model(mb, head=...)``)

    @staticmethod
    def target(batch: dict, row: dict | None = None) -> Target:
        return Target.of(batch, row)

    def head(self, row: dict[str, Tensor]):
        """The micro-batch's (loss sum, stats)."""
        return lambda model, h, batch: self.loss(model, h, Target.of(batch, row))

    def sums_head(self, row: dict[str, Tensor]):
        """A chunk's sums (sequence-level); nothing, not even the LM head, for a token-sum objective."""
        if self.token_sum:
            return lambda model, h, batch: None
        return lambda model, h, batch: self.sums(model, h, Target.of(batch, row)).float()

    def surrogate_head(self, row: dict[str, Tensor], grad: Tensor):
        """``Σ grad · sums`` of a chunk: its gradient is the chunk's share of the row loss's when
        ``grad`` is d loss / d sums of the whole row (parallel/seq_chunks.py)."""
        return lambda model, h, batch: (self.sums(model, h, Target.of(batch, row)).float() * grad).sum()


class TokenCrossEntropy(Objective):
    """SFT and pretraining: the labels' cross-entropy, each token's loss times its
    ``token_data["loss_weight"]`` where the row has one (turns with a fractional loss weight)."""

    name = "token_ce"

    def loss(self, model, h: Tensor, target: Target) -> tuple[Tensor, dict[str, Tensor]]:
        return model.loss_sum(h, target.labels, target.tokens.get("loss_weight")), {}


class WithFault(Objective):
    """Tests' fault injection: ``hook(loss_sum) -> loss_sum`` applied to every loss of ``inner``."""

    def __init__(self, inner: Objective, hook):
        self.inner, self.hook = inner, hook
        self.name, self.token_sum, self.stat_keys, self.line = inner.name, inner.token_sum, inner.stat_keys, inner.line
        self.step_pre_pass = inner.step_pre_pass

    def count(self, packs):
        return self.inner.count(packs)

    def flops(self, packs):
        return self.inner.flops(packs)

    def prepare_step(self, model, micro_batches):
        self.inner.prepare_step(model, micro_batches)

    def row_inputs(self, model, mb):
        return self.inner.row_inputs(model, mb)

    def loss(self, model, h, target):
        if not self.token_sum:
            return super().loss(model, h, target)
        loss, stats = self.inner.loss(model, h, target)
        return self.hook(loss), stats

    def sums(self, model, h, target):
        return self.inner.sums(model, h, target)

    def from_sums(self, sums, target):
        loss, stats = self.inner.from_sums(sums, target)
        return self.hook(loss), stats

    def metrics(self, out):
        return self.inner.metrics(out)
