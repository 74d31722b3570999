"""DPO (``train.phase=dpo``): the loss of preference pairs, and the objective the training loop runs.

A packed row holds whole pairs (data/packing/pairs.py): documents 2p and 2p+1 are ``prompt ‖ chosen`` and
``prompt ‖ rejected`` of its p-th pair, with labels on the answers only. ``collate_pack`` gives
each loss token its slot in ``token_data["pair_slot"]`` (1 + 2p for the chosen answer, 2 + 2p for
the rejected one, 0 elsewhere), so a pair's sequence log-prob is the sum of its answer's token
log-probs (``sequence_logps``), under context parallelism summed over the cp ranks first.

Per pair, with π the policy's and r the reference's sequence log-probs (Rafailov et al. 2023; the
same formulas as TRL's ``DPOTrainer.dpo_loss``, which tests/test_dpo.py runs on the same numbers):

    logits   = (π_chosen − r_chosen) − (π_rejected − r_rejected)
    sigmoid  loss = −(1 − ε)·log σ(β·logits) − ε·log σ(−β·logits)     (ε: label_smoothing, cDPO:
             TRL ≤ 0.x's sigmoid; TRL 1.x keeps this form in its ``aot`` loss, which equals it pair by pair)
    ipo      loss = (ipo_logits − 1 / (2β))²                          (Azar et al. 2023)
             ipo_logits: each side's log-ratio divided by its answer's token count first (TRL's
             length normalisation, confirmed by the IPO authors; β then does not depend on length)
    rewards  β·(π_chosen − r_chosen), β·(π_rejected − r_rejected)

The training step's loss is the mean over the global batch's pairs: each micro-batch returns its
pairs' loss SUM and the engine divides by the number of pairs over all ranks (the global-count
rule of docs/design.md), so every data-parallel layout gives the same update.

``train.dpo.ref``: ``model``, a frozen copy of the initial policy built and sharded like it
(train/parallel_model.build), run on the same micro-batch inside the loss; with LoRA adapters as the only
trainable weights (models/lora.py) the policy itself with its adapters disabled (no copy); ``none``, reference-free
(r = 0, TRL's ``reference_free``); ``precomputed``, each pair's values read from the file that
``omniweave dpo precompute-ref`` wrote (train/dpo_ref.py), found by the micro-batch's ``pack_id``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from omniweave.errors import UserError
from omniweave.train.objective import Objective, Target, slot_sums
from omniweave.train.parallel_model import frozen_reference

LOSSES = ("sigmoid", "ipo")
REFS = ("model", "none", "precomputed")
DPO_LINE = (("loss", "loss", ".4f"), ("margin", "reward_margin", ".3f"), ("acc", "reward_accuracy", ".3f"),
            ("lr", "lr", ".3e"), ("grad_norm", "grad_norm", ".3f"), ("tokens/s", "tokens_per_s", ".0f"),
            ("mem", "memory_gb", "GB"))
STAT_KEYS = ("pairs", "reward_chosen", "reward_rejected", "reward_margin", "reward_accuracy")


@dataclass(frozen=True)
class DPOConfig:
    beta: float = 0.1
    loss: str = "sigmoid"
    label_smoothing: float = 0.0
    ref: str = "model"
    ref_path: str | None = None

    @classmethod
    def from_recipe(cls, cfg) -> "DPOConfig":
        from omniweave.config import section

        d = section(cfg, "train").dpo
        out = cls(float(d.beta), d.loss, float(d.label_smoothing or 0.0), d.ref, d.ref_path or None)
        out.validate()
        return out

    def validate(self) -> None:
        if not self.beta > 0:
            raise UserError(f"train.dpo.beta must be > 0, got {self.beta}")
        if self.loss not in LOSSES:
            raise UserError(f"train.dpo.loss={self.loss!r}; choose one of {LOSSES}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise UserError(f"train.dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss != "sigmoid":
            raise UserError("train.dpo.label_smoothing applies to train.dpo.loss=sigmoid only")
        if self.ref not in REFS:
            raise UserError(f"train.dpo.ref={self.ref!r}; choose one of {REFS}")
        if self.ref_path and self.ref != "precomputed":
            raise UserError(f"train.dpo.ref_path applies to train.dpo.ref=precomputed only (train.dpo.ref={self.ref})")


def check_settings(cfg) -> None:
    """``train.dpo.*`` valid, and stored reference log-probs that fit the run (before any rank
    starts; which layouts DPO runs under: train/layouts.py)."""
    if DPOConfig.from_recipe(cfg).ref == "precomputed":
        from omniweave.train.dpo_ref import StoredReference

        if (cfg.get("data") or {}).get("mix") is not None:
            raise UserError("train.dpo.ref=precomputed reads the reference log-probs of one packed dataset (data.path), "
                            "not of a data.mix yet; use train.dpo.ref=model with a mix")
        StoredReference(cfg)


def dpo_loss(policy: Tensor, ref: Tensor, cfg: DPOConfig, lengths: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(loss per pair [P], chosen reward [P], rejected reward [P]), fp32; rewards are detached.
    ``policy`` / ``ref``: [P, 2] (chosen, rejected) sequence log-probs; ``lengths`` [P, 2]: the
    answers' token counts (``ipo`` only)."""
    ratios = policy.float() - ref.detach().float()  # [P, 2] log π/r of each side
    if cfg.loss == "sigmoid":
        logits, eps = ratios[:, 0] - ratios[:, 1], cfg.label_smoothing
        losses = -F.logsigmoid(cfg.beta * logits) * (1 - eps) - F.logsigmoid(-cfg.beta * logits) * eps
    else:
        if lengths is None:
            raise ValueError("the ipo loss needs the answers' token counts")
        per_token = ratios / lengths.float().clamp_min(1)
        losses = (per_token[:, 0] - per_token[:, 1] - 1 / (2 * cfg.beta)) ** 2
    rewards = cfg.beta * ratios.detach()
    return losses, rewards[:, 0], rewards[:, 1]


def sequence_logps(token_logp: Tensor, pair_slot: Tensor, num_pairs: int) -> Tensor:
    """[P, 2] (chosen, rejected) sums of the token values in each slot (1 + 2p + side; 0: none)."""
    return slot_sums(token_logp, pair_slot, 2 * num_pairs).view(num_pairs, 2)


def live_pairs(pair_slot: Tensor) -> int:
    """How many pairs of a whole row still have loss tokens (their chosen slot, 1 + 2p, appears)."""
    slots = torch.unique(pair_slot)
    return int((slots % 2 == 1).sum())


def pair_slots(labels: Tensor, cu_seqlens: Tensor, sides: list[str]) -> Tensor:
    """int64 [L] slots of a packed row of pairs (``sides``: each document's ``chosen`` / ``rejected``,
    which must alternate starting with ``chosen``): 1 + 2p + side on loss tokens, 0 elsewhere."""
    expected = ["chosen", "rejected"] * (len(sides) // 2)
    if sides != expected:
        raise ValueError(f"a pair row's documents must alternate chosen, rejected; got {sides}")
    return document_slots(labels, cu_seqlens)


def document_slots(labels: Tensor, cu_seqlens: Tensor) -> Tensor:
    """int64 [L]: 1 + the index of each loss token's document in the packed row, 0 elsewhere."""
    bounds = cu_seqlens.to(torch.long)
    doc = torch.searchsorted(bounds[1:], torch.arange(labels.shape[0]), right=True)
    return torch.where(labels != -100, 1 + doc, 0)


def sum_over_group(x: Tensor, group) -> Tensor:
    """``x`` summed over ``group`` (an all-reduce whose gradient is the all-reduced gradient): the
    per-row sums of a sequence-level objective (DPO's pairs, GSPO's sequences) over a CP group."""
    return _SumOverGroup.apply(x, group)


class _SumOverGroup(torch.autograd.Function):
    """All-reduce (sum) over a process group whose gradient is the all-reduced gradient: every rank
    computes the loss from the same sums, so each share's gradient is the sum of theirs."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        import torch.distributed as dist

        ctx.group = group
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def only_adapters_train(model) -> bool:
    """The model has LoRA adapters and every trainable parameter is one of theirs (a component
    trained in full would move the adapters-off model away from the initial policy)."""
    from omniweave.models.lora import is_adapter_name

    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    return bool(trainable) and all(is_adapter_name(n) for n in trainable)


class Reference:
    """The frozen initial policy a preference objective (DPO's ``ref: model``, KTO) measures its
    log-ratios against. With LoRA that trains nothing but adapters the policy with its adapters off
    IS the initial policy, so it is the reference (no second copy); else a frozen copy built and
    sharded like the policy (train/parallel_model.frozen_reference)."""

    def __init__(self, cfg, engine):
        self.base_is_reference = only_adapters_train(engine.model)
        self.copy = None if self.base_is_reference else frozen_reference(cfg, engine)

    @torch.no_grad()
    def token_logps(self, policy, mb: dict) -> Tensor:
        """The reference's per-token log-probs [L] of the micro-batch's labels (``policy``: the
        model in training, whose adapters are switched off when it is the reference)."""
        from omniweave.models.lora import adapters_disabled

        if self.base_is_reference:
            with adapters_disabled(policy):
                return policy(mb, token_logprobs=True).token_logp
        return self.copy(mb, token_logprobs=True).token_logp


class DPOObjective(Objective):
    """``train.phase=dpo``: a sequence-level objective (train/objective.py) over the pairs of a row.
    ``sums`` [P, 4]: each pair's chosen and rejected answer log-prob sums and token counts;
    ``row_inputs``: the pair count and the reference's [P, 2] sequence log-probs (padded to one
    row per two tokens: a static shape under a pipeline)."""

    name = "dpo"
    token_sum = False
    stat_keys = ("pairs", "reward_chosen", "reward_rejected", "reward_accuracy")
    line = DPO_LINE

    def __init__(self, cfg, engine):
        self.settings = DPOConfig.from_recipe(cfg)
        self.engine = engine
        self.reference = Reference(cfg, engine) if self.settings.ref == "model" else None
        self.stored = None
        if self.settings.ref == "precomputed":
            from omniweave.train.dpo_ref import StoredReference

            self.stored = StoredReference(cfg)

    @property
    def reference_forward(self) -> bool:
        """Whether ``row_inputs`` runs a model forward (the frozen copy or the adapters-off policy)."""
        return self.settings.ref == "model"

    def count(self, packs: list[dict]) -> float:
        """The pairs that still have loss tokens (a pair whose media did not decode has none left:
        ``drop_skipped_docs``)."""
        return float(sum(live_pairs(p["token_data"]["pair_slot"]) for p in packs))

    def reference_logps(self, model, mb: dict) -> Tensor:
        """[P, 2] the reference's sequence log-probs of the micro-batch's pairs: the stored whole
        values (``precomputed``), else the sums over the answers' tokens (this rank's share summed
        over the cp group)."""
        slots, pairs = mb["token_data"]["pair_slot"], int(mb["num_pairs"])
        if self.stored is not None:
            return self.stored.pack(int(mb["pack_id"])).to(slots.device)
        if self.reference is None:  # reference-free
            return torch.zeros(pairs, 2, device=slots.device)
        ref = sequence_logps(self.reference.token_logps(model, mb), slots, pairs)
        if self.engine.dims.cp > 1:  # each cp rank holds a share of every answer's tokens
            import torch.distributed as dist

            dist.all_reduce(ref, group=self.engine.meshes.cp.get_group())
        return ref

    def row_inputs(self, model, mb: dict) -> dict[str, Tensor]:
        slots, pairs = mb["token_data"]["pair_slot"], int(mb["num_pairs"])
        ref = torch.zeros(max(slots.shape[0] // 2, pairs), 2, device=slots.device)  # room for every row's pairs
        ref[:pairs] = self.reference_logps(model, mb)
        return {"num_pairs": torch.tensor([pairs], device=slots.device), "ref_logps": ref}

    def sums(self, model, h: Tensor, target: Target) -> Tensor:
        slots, pairs = target.tokens["pair_slot"], int(target.row["num_pairs"][0])
        policy = sequence_logps(model.token_logps(h, target.labels), slots, pairs)
        lengths = sequence_logps(torch.ones_like(slots, dtype=torch.float32), slots, pairs)
        return torch.cat([policy, lengths], dim=1)  # [P, 4]

    def from_sums(self, sums: Tensor, target: Target) -> tuple[Tensor, dict[str, Tensor]]:
        """The pairs' loss sum and reward sums from the row's [P, 4] sums (a cp group's summed first)."""
        cp = self.engine.dims.cp
        if cp > 1:  # each cp rank holds a share of every answer's tokens: whole sums before the loss
            sums = sum_over_group(sums, self.engine.meshes.cp.get_group())
        pairs = sums.shape[0]
        policy, lengths, ref = sums[:, :2], sums[:, 2:], target.row["ref_logps"][:pairs]
        live = lengths[:, 0] > 0  # a pair whose media did not decode has no tokens left: not a pair
        losses, chosen, rejected = self.pair_losses(policy, ref, lengths.clamp(min=1))  # (1: live pairs' own)
        losses, chosen, rejected = (torch.where(live, x, 0.0) for x in (losses, chosen, rejected))
        # every cp rank now holds the same pairs' values: 1/cp each, so sums over ranks count them once
        stats = {"pairs": live.sum().float(), "reward_chosen": chosen.sum(), "reward_rejected": rejected.sum(),
                 "reward_accuracy": ((chosen > rejected) & live).sum().float()}
        return losses.sum() / cp, {k: v.double() / cp for k, v in stats.items()}

    def pair_losses(self, policy: Tensor, ref: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(loss [P], chosen reward [P], rejected reward [P]) from the pairs' [P, 2] policy and
        reference sequence log-probs and answer lengths; the preference losses of
        train/preference.py override it."""
        return dpo_loss(policy, ref, self.settings, lengths)

    def metrics(self, out: dict) -> dict:
        """The step's mean rewards over its pairs (``out``: the engine step's summed stats)."""
        n = max(out["pairs"], 1.0)
        chosen, rejected = out["reward_chosen"] / n, out["reward_rejected"] / n
        return {"pairs": int(out["pairs"]), "reward_chosen": chosen, "reward_rejected": rejected,
                "reward_margin": chosen - rejected, "reward_accuracy": out["reward_accuracy"] / n}


@torch.no_grad()
def preference_accuracy(model, packed_path) -> dict:
    """Held-out pairs (a packed pairs dataset): how often the model gives the chosen answer a higher
    log-prob than the rejected one (``accuracy``), and the mean log-prob margin, over ``n`` pairs."""
    from omniweave.data.loading.loader import collate_pack
    from omniweave.data.packing.packed import PackedDataset

    ds = PackedDataset(packed_path)
    wins, margin, n = 0, 0.0, 0
    for i in range(len(ds)):
        mb = collate_pack(ds[i], ds.manifest["data_cfg"])
        seq = sequence_logps(model(mb, token_logprobs=True).token_logp, mb["token_data"]["pair_slot"], mb["num_pairs"])
        wins += int((seq[:, 0] > seq[:, 1]).sum())
        margin += float((seq[:, 0] - seq[:, 1]).sum())
        n += seq.shape[0]
    return {"accuracy": wins / max(n, 1), "margin": margin / max(n, 1), "n": n}
