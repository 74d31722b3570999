"""Mixture-of-Experts feed-forward block: a router, routed experts run as grouped GEMMs, and
optional shared experts. Dropless: every token reaches all of its top-k experts.

Routers (``MoEConfig.router``):

- ``softmax`` (Qwen3-MoE, Qwen2-MoE): ``p = softmax(x·Wᵀ)`` in fp32, top-k of ``p``, renormalised
  to sum 1 when ``norm_topk_prob``.
- ``sigmoid`` (DeepSeek-V3): ``s = sigmoid(x·Wᵀ)`` in fp32 (router weight and input cast to fp32);
  experts are *selected* on ``s + e_score_correction_bias`` restricted to the ``topk_group`` best of
  ``n_group`` groups (a group scores the sum of its two best experts); the weights are the
  *unbiased* ``s`` of the selected experts, renormalised (``norm_topk_prob``, +1e-20) and multiplied
  by ``routed_scaling_factor``. ``n_shared_experts`` adds a SwiGLU of width
  ``n_shared_experts · moe_intermediate_size`` that every token goes through.

A gated shared expert (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE; ``shared_expert_intermediate_size``):
a SwiGLU ``shared_expert`` of that width every token goes through, scaled per token by
``sigmoid(shared_expert_gate(x))`` (a ``[1, D]`` linear), added to the routed output.

Expert weights are 3-D tensors, the layout of transformers v5 at runtime (``Qwen3MoeExperts``,
``DeepseekV3Experts``)::

    experts.gate_up_proj  [E, 2·I, D]   rows [:I] are gate, rows [I:] are up  (out × in, like nn.Linear)
    experts.down_proj     [E, D, I]

so an HF adapter only stacks (or splits) the per-expert ``gate_proj/up_proj/down_proj`` of a
checkpoint. Tokens are sorted by expert (a stable argsort of the ``[T·k]`` expert ids) and each
GEMM is one ``torch._grouped_mm`` over the sorted rows with ``offs = cumsum(tokens per expert)``
where the device and dtype support it (``grouped_mm_supported``), otherwise a loop over the
experts that received tokens. Never is an expert run on tokens not routed to it. The weighted
expert outputs are summed per token in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from omniweave.models.components.mlp import SwiGLU, activation
from omniweave.models.components.router_loss import (AUX_LEVELS, RouterStats, RouterStep, attach_loss, balance_probs,
                                                     global_aux, recomputing, sequence_aux, z_loss_sum)

ROUTERS = ("softmax", "sigmoid")
BACKENDS = ("auto", "grouped_mm", "loop")


@dataclass
class MoEConfig:
    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    router: str = "softmax"  # softmax (Qwen3-MoE) | sigmoid (DeepSeek-V3)
    norm_topk_prob: bool = False  # HF's default; released Qwen3-MoE / DeepSeek-V3 checkpoints set true
    n_group: int = 1  # sigmoid router: expert groups ...
    topk_group: int = 1  # ... of which the best topk_group are eligible
    routed_scaling_factor: float = 1.0
    n_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0  # a gated shared expert (Qwen3-Next / Qwen3.5-MoE); 0: none
    hidden_act: str = "silu"
    backend: str = "auto"  # auto | grouped_mm | loop
    # training signals (components/router_loss.py); 0 turns each off
    aux_loss_coef: float = 0.0
    aux_loss_level: str = "global"  # global | sequence
    z_loss_coef: float = 0.0
    bias_update_speed: float = 0.0  # aux-loss-free balancing of the sigmoid router's selection bias

    def __post_init__(self):
        if self.router not in ROUTERS:
            raise ValueError(f"moe router {self.router!r}: choose from {', '.join(ROUTERS)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"moe backend {self.backend!r}: choose from {', '.join(BACKENDS)}")
        if not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts={self.num_experts}")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"n_group={self.n_group} must divide num_experts={self.num_experts} "
                             f"and topk_group={self.topk_group} be in 1..n_group")  # fmt: skip
        if self.aux_loss_level not in AUX_LEVELS:
            raise ValueError(f"aux_loss_level {self.aux_loss_level!r}: choose from {', '.join(AUX_LEVELS)}")
        if min(self.aux_loss_coef, self.z_loss_coef, self.bias_update_speed) < 0:
            raise ValueError("router_aux_loss_coef, router_z_loss_coef and bias_update_speed must be >= 0")
        if self.bias_update_speed and self.router != "sigmoid":
            raise ValueError("bias_update_speed > 0 needs the sigmoid router (DeepSeek-V3's selection bias); "
                             "the softmax router balances with router_aux_loss_coef")
        if self.n_shared_experts and self.shared_expert_intermediate_size:
            raise ValueError("n_shared_experts (DeepSeek-V3's ungated shared experts) and "
                             "shared_expert_intermediate_size (a gated shared expert) exclude each other")
        if self.router == "sigmoid" and self.n_group > 1 and self.num_experts // self.n_group < 2:
            raise ValueError("the sigmoid router scores a group by its two best experts: needs >= 2 experts per group")


def grouped_mm_supported(x: torch.Tensor, *dims: int) -> bool:
    """Whether ``torch._grouped_mm`` runs [T, K] x [E, K, N] here: CPU (torch >= 2.9) in fp32 / bf16,
    CUDA sm90+ in bf16; every inner dim in ``dims`` a multiple of 16 bytes (its strides must be)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        ok = x.dtype in (torch.float32, torch.bfloat16)
    elif x.device.type == "cuda":
        ok = x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
    else:
        ok = False
    return ok and all(d * x.element_size() % 16 == 0 for d in dims)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype where autocast is on (as F.linear would compute), else x's dtype."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


def expert_matmul(xs: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, grouped: bool) -> torch.Tensor:
    """Row block e of ``xs`` [N, K] (``counts[e]`` rows, sorted by expert) times ``w[e]ᵀ``
    (``w`` [E, out, K]) -> [N, out]; ``grouped``: one ``torch._grouped_mm``, else a loop over the
    experts that received rows (``counts`` read on the host)."""
    if grouped:
        offs = counts.cumsum(0).to(torch.int32)
        return torch._grouped_mm(xs, w.transpose(1, 2), offs=offs)
    # split, not slices: a slice's backward writes a zero gradient the size of all rows, per expert
    outs = [F.linear(rows, w[e]) for e, rows in enumerate(xs.split(counts.tolist())) if rows.shape[0]]
    if not outs:
        return xs.new_zeros(0, w.shape[1])
    return torch.cat(outs)


class Router(nn.Module):
    """``weight`` [E, D] (HF ``mlp.gate.weight``); the sigmoid router also holds the
    ``e_score_correction_bias`` [E] fp32 buffer (selection only; never updated here)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        if cfg.router == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> (logits [T, E], weights [T, k] fp32, expert ids [T, k])."""
        c = self.cfg
        if c.router == "softmax":
            logits = F.linear(x, self.weight)
            probs = logits.softmax(-1, dtype=torch.float32)
            weights, idx = probs.topk(c.num_experts_per_tok, dim=-1)
            if c.norm_topk_prob:
                weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights, idx
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid()
        choice = scores.detach() + self.e_score_correction_bias
        if c.n_group > 1:
            grouped = choice.view(-1, c.n_group, c.num_experts // c.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, n_group]
            keep = group_scores.topk(c.topk_group, dim=-1).indices
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = grouped.masked_fill(~mask[..., None], float("-inf")).view(-1, c.num_experts)
        idx = choice.topk(c.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, idx)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return logits, weights * c.routed_scaling_factor, idx


class Experts(nn.Module):
    """The routed experts' weights, 3-D (see the module docstring for the layout), and their
    computation over rows sorted by expert. ``dispatch`` is the seam through which
    ``parallel/expert.py`` sends the rows to the ranks owning their experts; being a module call,
    FSDP gathers the weights around it when the experts are sharded."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        E, D, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.cfg = cfg
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, I))
        self.act = activation(cfg.hidden_act)
        self.dispatch = None  # fn(experts, xs, counts) -> ys; None: every expert is here

    def forward(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows ``xs`` [N, D] sorted by expert, ``counts[e]`` of them for expert e -> [N, D]."""
        if self.dispatch is not None:
            return self.dispatch(self, xs, counts)
        return self.run(xs, counts, self.gate_up_proj, self.down_proj)

    def use_grouped_mm(self, x: torch.Tensor) -> bool:
        backend = self.cfg.backend
        if backend == "loop":
            return False
        probe = x.new_empty(0, dtype=_compute_dtype(x))
        ok = grouped_mm_supported(probe, self.cfg.hidden_size, self.cfg.moe_intermediate_size)
        if backend == "grouped_mm" and not ok:
            raise ValueError(f"moe backend grouped_mm: torch._grouped_mm does not run {probe.dtype} on "
                             f"{x.device.type} with hidden {self.cfg.hidden_size} / intermediate "
                             f"{self.cfg.moe_intermediate_size} (needs 16-byte aligned dims); use auto or loop")  # fmt: skip
        return ok

    def run(self, xs: torch.Tensor, counts: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """Rows ``xs`` [N, D] sorted by expert (``counts[e]`` rows for expert e of ``gate_up`` /
        ``down``, which may be a slice of the experts) -> [N, D], unweighted, in ``xs``'s dtype."""
        grouped = self.use_grouped_mm(xs)
        gate, up = expert_matmul(xs, gate_up.to(xs.dtype), counts, grouped).chunk(2, dim=-1)
        return expert_matmul(self.act(gate) * up, down.to(xs.dtype), counts, grouped)


class MoE(nn.Module):
    """x [T, D] -> [T, D]. Parameter names follow transformers v5 (``gate.weight``,
    ``experts.gate_up_proj``, ``experts.down_proj``, ``shared_experts.{gate,up,down}_proj.weight``;
    the gated shared expert ``shared_expert.{gate,up,down}_proj.weight``, ``shared_expert_gate.weight``)."""

    def __init__(self, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        if cfg.n_shared_experts:
            self.shared_experts = SwiGLU(cfg.hidden_size, cfg.n_shared_experts * cfg.moe_intermediate_size,
                                         bias=False, act=cfg.hidden_act)  # fmt: skip
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = SwiGLU(cfg.hidden_size, cfg.shared_expert_intermediate_size, bias=False,
                                        act=cfg.hidden_act)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        # router losses (router_loss.py): the step set by the trainer, the statistics' SUM over
        # the data x context-parallel ranks (global) / a row's context-parallel ranks (sequence),
        # set from outside (parallel/expert.set_router_groups), and the group sizes
        self.step = RouterStep()
        self.stats = RouterStats()
        self.reduce_global = self.reduce_sequence = None
        self.global_size = self.sequence_size = 1

    @torch.no_grad()
    def reset_parameters(self, std: float = 0.02) -> None:
        for p in (self.gate.weight, self.experts.gate_up_proj, self.experts.down_proj):
            nn.init.normal_(p, std=std)
        for name in ("shared_experts", "shared_expert"):
            if hasattr(self, name):
                mlp = getattr(self, name)
                for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                    nn.init.normal_(lin.weight, std=std)
        if hasattr(self, "shared_expert_gate"):
            nn.init.normal_(self.shared_expert_gate.weight, std=std)
        if self.cfg.router == "sigmoid":
            self.gate.e_score_correction_bias.zero_()

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                valid: torch.Tensor | None = None) -> torch.Tensor:
        """``cu_seqlens``: the row's documents (sequence-level aux loss); ``valid`` bool [T]: False
        for rows that are padding (context-parallel shards), which no statistic counts."""
        T, k = x.shape[0], self.cfg.num_experts_per_tok
        logits, weights, idx = self.gate(x)
        flat = idx.reshape(-1)  # [T·k]
        order = flat.argsort(stable=True)  # rows sorted by expert, tokens in order within one
        token = order // k
        counts = torch.bincount(flat, minlength=self.cfg.num_experts)
        xs = x[token].to(_compute_dtype(x))  # [T·k, D]
        ys = self.experts(xs, counts)  # [T·k, D]
        ys = ys.float() * weights.reshape(-1)[order, None].float()
        out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device).index_add_(0, token, ys)
        out = out.to(x.dtype)
        if self.cfg.n_shared_experts:
            out = out + self.shared_experts(x)
        if self.cfg.shared_expert_intermediate_size:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        if torch.is_grad_enabled():  # training: counts for the metrics / bias update, the losses
            out = self._router_signals(out, logits, idx, counts, cu_seqlens, valid)
        return out

    def _router_signals(self, out, logits, idx, counts, cu_seqlens, valid) -> torch.Tensor:
        c, step = self.cfg, self.step
        counting = not recomputing()  # a checkpointed forward's second run counts nothing
        if counting:
            self.stats.add_counts(counts if valid is None else
                                  torch.bincount(idx[valid].reshape(-1), minlength=c.num_experts))
        if c.aux_loss_coef:
            probs = balance_probs(logits, c.router)
            if c.aux_loss_level == "global":
                term, value = global_aux(probs, idx, valid, self.reduce_global)
                scale, share = c.aux_loss_coef / (step.micro_steps * step.layers), value / self.global_size
            else:
                if cu_seqlens is None:
                    cu_seqlens = torch.tensor([0, logits.shape[0]], device=logits.device)
                term, value = sequence_aux(probs, idx, cu_seqlens, valid, self.reduce_sequence)
                scale, share = c.aux_loss_coef / (step.documents * step.layers), value / self.sequence_size
            out = attach_loss(out, term, scale)
            if counting:
                self.stats.aux = self.stats.aux + share
        if c.z_loss_coef:
            z = z_loss_sum(logits, valid)
            out = attach_loss(out, z, c.z_loss_coef / (step.tokens * step.layers))
            if counting:
                self.stats.z = self.stats.z + z.detach()
        return out

    def active_fraction(self) -> float:
        """Share of the routed expert parameters one token uses (k / E)."""
        return self.cfg.num_experts_per_tok / self.cfg.num_experts


__all__ = ["MoE", "MoEConfig", "Router", "expert_matmul", "grouped_mm_supported"]
