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
        d = cfg.train.get("dpo") or {}
        out = cls(float(d.get("beta", 0.1)), str(d.get("loss", "sigmoid")), float(d.get("label_smoothing", 0.0) or 0.0),
                  str(d.get("ref", "model")), d.get("ref_path") or None)
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


def check_layout(cfg) -> None:
    """``train.dpo.*`` valid, stored reference log-probs that fit the run, and a layout DPO runs
    (before any rank starts)."""
    if DPOConfig.from_recipe(cfg).ref == "precomputed":
        from omniweave.train.dpo_ref import StoredReference

        if (cfg.get("data") or {}).get("mix") is not None:
            raise UserError("train.dpo.ref=precomputed reads the reference log-probs of one packed dataset (data.path), "
                            "not of a data.mix yet; use train.dpo.ref=model with a mix")
        StoredReference(cfg)
    par = cfg.get("parallel") or {}
    if int(par.get("pp", 1) or 1) > 1:
        ref = DPOConfig.from_recipe(cfg).ref
        if ref == "model":
            raise UserError("train.dpo.ref=model does not run under parallel.pp > 1 yet (the reference's forward would "
                            "need a pipeline of its own); store the reference log-probs once with `omniweave dpo "
                            "precompute-ref` and set train.dpo.ref=precomputed, or use train.dpo.ref=none")
        if int(par.get("cp", 1) or 1) > 1:  # (parallel.seq_chunks refuses DPO at any pp: seq_chunks.py)
            raise UserError("train.phase=dpo with parallel.pp > 1 does not take parallel.cp yet")


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
    sums = token_logp.new_zeros(2 * num_pairs + 1, dtype=torch.float32)
    sums = sums.index_add(0, pair_slot.to(torch.long), token_logp.float())
    return sums[1:].view(num_pairs, 2)


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
    bounds = cu_seqlens.to(torch.long)
    doc = torch.searchsorted(bounds[1:], torch.arange(labels.shape[0]), right=True)
    return torch.where(labels != -100, 1 + doc, 0)


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


def reference_model(cfg, engine):
    """The frozen reference: the policy's initial weights (seed or ``train.init_from``), built and
    parallelised exactly like it (the same builder as GRPO's reference)."""
    from omniweave.train.parallel_model import build

    model = build(cfg, engine.device, engine.dims, engine.meshes)
    model.requires_grad_(False)
    return model.eval()


def only_adapters_train(model) -> bool:
    """The model has LoRA adapters and every trainable parameter is one of theirs (a component
    trained in full would move the adapters-off model away from the initial policy)."""
    from omniweave.models.lora import is_adapter_name

    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    return bool(trainable) and all(is_adapter_name(n) for n in trainable)


class DPOObjective:
    """What ``train.phase=dpo`` hands the engine's optimizer step: ``loss_fn`` (a micro-batch's
    pairs' loss sum and reward sums), ``normaliser`` (the global pair count) and ``metrics``."""

    def __init__(self, cfg, engine):
        self.settings = DPOConfig.from_recipe(cfg)
        self.engine = engine
        # LoRA that trains nothing but adapters: the policy with its adapters off IS the initial
        # policy, so it is the reference (no second copy); else a frozen copy
        self.base_is_reference = self.settings.ref == "model" and only_adapters_train(engine.model)
        self.reference = (reference_model(cfg, engine) if self.settings.ref == "model" and not self.base_is_reference
                          else None)
        self.stored = None
        if self.settings.ref == "precomputed":
            from omniweave.train.dpo_ref import StoredReference

            self.stored = StoredReference(cfg)
        if engine.pipeline is not None:  # parallel.pp: the last stage computes the pair loss (check_layout: ref none / precomputed)
            engine.pipeline.set_row_loss(self.pipeline_row_loss())

    def normaliser(self, packs: list[dict]) -> float:
        """The global count of pairs that still have loss tokens (a pair whose media did not decode
        has none left: ``drop_skipped_docs``)."""
        (pairs,) = self.engine.global_sum([sum(live_pairs(p["token_data"]["pair_slot"]) for p in packs)])
        return pairs

    @torch.no_grad()
    def reference_token_logps(self, model, mb: dict) -> Tensor | None:
        """The reference's per-token log-probs of the micro-batch, None when reference-free: the
        policy with its LoRA adapters off (``base_is_reference``) or the frozen copy."""
        from omniweave.models.lora import adapters_disabled

        if self.base_is_reference:
            with adapters_disabled(model):
                return model(mb, token_logprobs=True).token_logp
        if self.reference is None:
            return None
        return self.reference(mb, token_logprobs=True).token_logp

    def reference_logps(self, model, mb: dict) -> Tensor:
        """[P, 2] the reference's sequence log-probs of the micro-batch's pairs: the stored whole
        values (``precomputed``), else the sums over this rank's share of the answers' tokens."""
        slots, pairs = mb["token_data"]["pair_slot"], int(mb["num_pairs"])
        if self.stored is not None:
            return self.stored.pack(int(mb["pack_id"])).to(slots.device)
        tokens = self.reference_token_logps(model, mb)
        return (torch.zeros(pairs, 2, device=slots.device) if tokens is None
                else sequence_logps(tokens, slots, pairs))

    def loss_fn(self, model, mb: dict) -> tuple[Tensor, dict[str, Tensor]]:
        slots, pairs = mb["token_data"]["pair_slot"], int(mb["num_pairs"])
        token_logp = model(mb, token_logprobs=True).token_logp
        return self.pair_loss(token_logp, slots, pairs, self.reference_logps(model, mb))

    def pair_loss(self, token_logp: Tensor, slots: Tensor, pairs: int, ref: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The pairs' loss sum and reward sums from the policy's token log-probs and the reference's
        [P, 2] sequence log-probs (a micro-batch's, or a pipeline's last stage's row)."""
        cp = self.engine.dims.cp
        policy = sequence_logps(token_logp, slots, pairs)
        lengths = sequence_logps(torch.ones_like(slots, dtype=torch.float32), slots, pairs)
        if cp > 1:  # each cp rank holds a share of every answer's tokens: whole sums before the loss
            group = self.engine.meshes.cp.get_group()
            policy = _SumOverGroup.apply(policy, group)
            lengths = _SumOverGroup.apply(lengths, group)
            ref = ref if self.stored is not None else _SumOverGroup.apply(ref.detach(), group)
        live = lengths[:, 0] > 0  # a pair whose media did not decode has no tokens left: not a pair
        losses, chosen, rejected = dpo_loss(policy, ref, self.settings, lengths.clamp(min=1))  # (1: live pairs' own)
        losses, chosen, rejected = (torch.where(live, x, 0.0) for x in (losses, chosen, rejected))
        # every cp rank now holds the same pairs' values: 1/cp each, so sums over ranks count them once
        stats = {"pairs": live.sum().float(), "reward_chosen": chosen.sum(), "reward_rejected": rejected.sum(),
                 "reward_accuracy": ((chosen > rejected) & live).sum().float()}
        return losses.sum() / cp, {k: v.double() / cp for k, v in stats.items()}

    def pipeline_row_loss(self) -> "PipelineRowLoss":
        """The pair loss as a pipeline's last stage computes it (parallel.pp; ``ref`` none or precomputed)."""
        return PipelineRowLoss(self)

    @staticmethod
    def metrics(out: dict) -> dict:
        """The step's mean rewards over its pairs (``out``: the engine step's summed stats)."""
        n = max(out["pairs"], 1.0)
        chosen, rejected = out["reward_chosen"] / n, out["reward_rejected"] / n
        return {"pairs": int(out["pairs"]), "reward_chosen": chosen, "reward_rejected": rejected,
                "reward_margin": chosen - rejected, "reward_accuracy": out["reward_accuracy"] / n}


class PipelineRowLoss:
    """``Pipeline.set_row_loss`` for DPO: each row's pair slots, pair count and reference
    sequence log-probs (padded to the row length: one static shape) ride with the row's metadata;
    the last stage turns its hidden states into the label log-probs and the pairs' loss."""

    stat_keys = ("pairs", "reward_chosen", "reward_rejected", "reward_accuracy")

    def __init__(self, objective: DPOObjective):
        self.objective = objective

    def inputs(self, row: dict) -> dict[str, Tensor]:
        slots, pairs = row["token_data"]["pair_slot"], int(row["num_pairs"])
        ref = torch.zeros(slots.shape[0], 2)  # at most one pair per two tokens: room for every row's pairs
        ref[:pairs] = self.objective.reference_logps(None, row).cpu()
        return {"pair_slot": slots.to(torch.long), "num_pairs": torch.tensor([pairs]), "ref_logps": ref}

    def __call__(self, model, hidden: Tensor, labels: Tensor, inputs: dict) -> tuple[Tensor, dict[str, Tensor]]:
        token_logp = -model.ce_tokens(hidden, model.foundation.lm_head.weight, labels, model.loss_chunk)
        pairs = int(inputs["num_pairs"][0])
        return self.objective.pair_loss(token_logp, inputs["pair_slot"], pairs, inputs["ref_logps"][:pairs])


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
