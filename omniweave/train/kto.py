"""KTO (``train.phase=kto``): unpaired completions, each desirable or not, as a training objective.

A packed KTO row (data/packing/kto.py) holds n completions (documents 0..n-1, prompt ‖ answer,
labels on the answer) and then n KL documents (prompt_i ‖ answer_(i+1 mod n)). ``collate_pack``
gives each loss token its slot in ``token_data["kto_slot"]`` (1 + its document's index: 1..n the
completions, n+1..2n the KL documents) and marks the desirable answers' tokens
(``kto_desirable``), so a completion's sequence log-prob is the sum over its slot.

The loss (train/preference.py :func:`kto_loss`; Ethayarajh et al. 2024, TRL 1.16's
``KTOTrainer``), with r = log π(answer) − log π_ref(answer) per completion and the reference point

    z0 = max(0, mean over the step's KL documents of log π − log π_ref)      (detached)

is λ_D (1 − σ(β (r − z0))) for a desirable completion, λ_U (1 − σ(β (z0 − r))) for an
undesirable one, averaged over the global batch's completions (the engine divides the row sums by
their count over all ranks). z0 needs every row of the step before the first loss, so it comes
from a no-grad pass (:meth:`KTOObjective.prepare_step`: the policy's and the reference's
log-probs of all the step's rows, the completions' reference sums kept for their loss). z0 is the
mean over the *whole global batch* — whatever the layout, so every layout gives the same update;
TRL averages per-process means per micro-batch instead (the same with one micro-batch of equal
size per process).

Layouts: dp, cp (the per-completion sums of a row's shares summed over the cp group before the
loss, as DPO's), tp, chunked rows (the sums carried across chunks; the pre-pass forwards each row
whole, without grad); not under a pipeline (the reference's forward, and the pre-pass, would need
pipelines of their own: train/layouts.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from omniweave.train.dpo import Reference, document_slots, sum_over_group
from omniweave.train.objective import Objective, Target, slot_sums
from omniweave.train.preference import KTOConfig, kto_loss

KTO_LINE = (("loss", "loss", ".4f"), ("kl", "kl", ".3f"), ("margin", "reward_margin", ".3f"),
            ("lr", "lr", ".3e"), ("grad_norm", "grad_norm", ".3f"), ("tokens/s", "tokens_per_s", ".0f"),
            ("mem", "memory_gb", "GB"))


def kto_settings(cfg) -> KTOConfig:
    from omniweave.config import section

    k = section(cfg, "train").kto
    return KTOConfig(float(k.beta), float(k.desirable_weight), float(k.undesirable_weight), str(k.loss)).validate()


def kto_token_data(labels: Tensor, cu_seqlens: Tensor, docs: list[dict]) -> tuple[dict[str, Tensor], int]:
    """({"kto_slot": int64 [L], "kto_desirable": float32 [L]}, n) of a packed KTO row whose
    ``docs`` records are its n completions (``kto``: desirable) then its n KL documents."""
    n = sum("kto" in d for d in docs)
    if len(docs) != 2 * n or any("kto" not in d for d in docs[:n]) or any(not d.get("kto_kl") for d in docs[n:]):
        raise ValueError(f"a KTO row holds n completions then n KL documents; got {len(docs)} documents, {n} tagged")
    slots = document_slots(labels, cu_seqlens)
    desirable = torch.tensor([False] + [bool(d["kto"]) for d in docs[:n]] + [False] * n)  # by slot
    return {"kto_slot": slots, "kto_desirable": desirable[slots].to(torch.float32)}, n


def live_completions(slots: Tensor, n: int) -> int:
    """How many of a whole row's n completions still have loss tokens (media that did not decode
    take them off: ``drop_skipped_docs``)."""
    return int(((torch.unique(slots) >= 1) & (torch.unique(slots) <= n)).sum())


class KTOObjective(Objective):
    """``train.phase=kto``: sequence-level (``sums`` [n, 3] per row: each completion's answer
    log-prob sum, token count and desirable-token count), with a step pre-pass for z0."""

    name = "kto"
    token_sum = False
    step_pre_pass = True
    stat_keys = ("completions", "desirable", "reward_desirable", "reward_undesirable")
    line = KTO_LINE

    def __init__(self, cfg, engine):
        self.settings = kto_settings(cfg)
        self.engine = engine
        self.reference = Reference(cfg, engine)
        self.z0 = torch.zeros(())
        self._reference_sums: list[Tensor] = []  # the step's rows' completions' reference log-probs, in order

    def count(self, packs: list[dict]) -> float:
        return float(sum(live_completions(p["token_data"]["kto_slot"], int(p["num_kto"])) for p in packs))

    @torch.no_grad()
    def prepare_step(self, model, micro_batches: list[dict]) -> None:
        """z0 from the KL documents of all the step's rows (this rank's, summed over the data ranks),
        and each row's completions' reference log-probs for its loss."""
        cp_group = self.engine.meshes.cp.get_group() if self.engine.dims.cp > 1 else None
        total = torch.zeros(2, dtype=torch.float64, device=self.engine.device)  # Σ (log π − log π_ref), documents
        self._reference_sums = []
        for mb in micro_batches:
            slots, n = mb["token_data"]["kto_slot"], int(mb["num_kto"])
            ones = torch.ones_like(slots, dtype=torch.float32)
            per_token = torch.stack([model(mb, token_logprobs=True).token_logp.float(),
                                     self.reference.token_logps(model, mb).float(), ones], 1)
            sums = slot_sums(per_token, slots, 2 * n)  # [2n, 3]: policy, reference, tokens
            if cp_group is not None:  # each cp rank holds a share of every document's tokens
                dist.all_reduce(sums, group=cp_group)
            self._reference_sums.append(sums[:n, 1])
            kl = sums[n:]
            live = kl[:, 2] > 0
            total += torch.stack([(kl[live, 0] - kl[live, 1]).sum().double(), live.sum().double()])
        if self.engine.meshes.dp_cp.size() > 1:  # a cp group's ranks add the same sums: the ratio is the same
            dist.all_reduce(total, group=self.engine.meshes.dp_cp.get_group())
        self.z0 = (total[0] / total[1]).clamp(min=0).float() if total[1] > 0 else torch.zeros((), device=total.device)

    def row_inputs(self, model, mb: dict) -> dict[str, Tensor]:
        """The row's completion count, their reference log-probs (padded to one per two tokens: a
        shape of the row length) and z0, from :meth:`prepare_step` (rows in the step's order)."""
        slots, n = mb["token_data"]["kto_slot"], int(mb["num_kto"])
        if not self._reference_sums:
            raise RuntimeError("KTOObjective.row_inputs before prepare_step: the engine runs the pre-pass first")
        ref = torch.zeros(max(slots.shape[0] // 2, n), device=slots.device)
        ref[:n] = self._reference_sums.pop(0)
        return {"num_kto": torch.tensor([n], device=slots.device), "ref_logps": ref, "z0": self.z0.reshape(1)}

    def sums(self, model, h: Tensor, target: Target) -> Tensor:
        slots, n = target.tokens["kto_slot"], int(target.row["num_kto"][0])
        logp = model.token_logps(h, target.labels)
        per_token = torch.stack([logp.float(), torch.ones_like(logp, dtype=torch.float32),
                                 target.tokens["kto_desirable"].float()], 1)
        completions = torch.where(slots <= n, slots, 0)  # the KL documents (slots n+1..2n) are the pre-pass's
        return slot_sums(per_token, completions, n)  # [n, 3]

    def from_sums(self, sums: Tensor, target: Target) -> tuple[Tensor, dict[str, Tensor]]:
        cp = self.engine.dims.cp
        if cp > 1:  # each cp rank holds a share of every answer's tokens: whole sums before the loss
            sums = sum_over_group(sums, self.engine.meshes.cp.get_group())
        n = sums.shape[0]
        policy, live, desirable = sums[:, 0], sums[:, 1] > 0, sums[:, 2] > 0
        ref = target.row["ref_logps"][:n]
        losses, _, _ = kto_loss(policy, ref, desirable, target.row["z0"][0], self.settings)
        rewards = self.settings.beta * (policy.detach() - ref)
        good, bad = live & desirable, live & ~desirable
        stats = {"completions": live.sum().float(), "desirable": good.sum().float(),
                 "reward_desirable": torch.where(good, rewards, 0.0).sum(),
                 "reward_undesirable": torch.where(bad, rewards, 0.0).sum()}
        # every cp rank now holds the same completions' values: 1/cp each, so sums over ranks count them once
        return torch.where(live, losses, 0.0).sum() / cp, {k: v.double() / cp for k, v in stats.items()}

    def metrics(self, out: dict) -> dict:
        """The step's mean rewards of each kind and z0 (``kl``)."""
        good = out["desirable"]
        bad = out["completions"] - good
        desirable = out["reward_desirable"] / max(good, 1.0)
        undesirable = out["reward_undesirable"] / max(bad, 1.0)
        return {"completions": int(out["completions"]), "desirable": int(good), "reward_desirable": desirable,
                "reward_undesirable": undesirable, "reward_margin": desirable - undesirable, "kl": float(self.z0)}
