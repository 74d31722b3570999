"""The MoE router's training signals: the load-balancing loss, the router z-loss, and the
statistics the aux-loss-free bias update and the step metrics read.

Losses (coefficients in the recipe, ``model.foundation.*``; 0 turns a loss off):

- load balancing, ``router_aux_loss_coef`` x ``E · Σ_i f_i · P_i`` with ``f_i`` = the share of the
  tokens' k choices that went to expert i (``count_i / T``, summing to k) and ``P_i`` the mean
  router probability of expert i (softmax; the sigmoid router's scores normalised to sum 1 per
  token). A uniform router scores k. For one layer this is transformers'
  ``load_balancing_loss_func`` exactly; over layers we average the per-layer losses (transformers
  concatenates every layer's logits into one set first, which mixes the layers' statistics).
  ``aux_loss_level``:

  - ``global`` (default, Megatron's ``global_aux_loss``, Qwen's global-batch balancing): the
    counts and probabilities of every data-parallel and context-parallel rank of one micro-step
    are summed before the product, and the per-micro-step losses are averaged over the step's
    micro-steps. The statistic therefore grows with the data-parallel size (``dp`` rows per
    micro-step instead of one): a run at dp=2 equals one process that packs the two rows into one.
  - ``sequence`` (DeepSeek-V3's sequence-wise loss): per document of a packed row (context-parallel
    shards of a document summed first), averaged over every document of the step. Independent of
    the layout: any dp / cp / ep / micro-batching gives the single-process value.

- router z-loss, ``router_z_loss_coef`` x the mean over the step's tokens of
  ``logsumexp(router logits)²`` (ST-MoE); layout independent.

A loss enters the backward without travelling through the model's outputs: ``attach_loss``
makes the layer's output carry it (identity forward; the backward also sends ``scale`` into the
loss), like Megatron's ``MoEAuxLossAutoScaler``. ``scale`` (coefficient / the step's micro-steps,
documents or tokens, / MoE layers) comes from :class:`RouterStep`, set by the trainer before each
step. Tokens marked invalid (context-parallel pads, ``token_valid``) count nowhere.

``RouterStats`` accumulates, over the step's forwards, each expert's token count (also what the
aux-loss-free bias update of DeepSeek-V3, ``bias_update_speed``, balances: ``b_i += speed ·
sign(mean - count_i)`` after the optimizer step), the loss values for the metrics and the bytes
expert parallelism moved. A forward recomputed in the backward (activation checkpointing) is
not counted twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

AUX_LEVELS = ("global", "sequence")

Reduce = Callable[[torch.Tensor], torch.Tensor]  # SUM over a process group (None: one process)


@dataclass
class RouterStep:
    """What the loss scales need to know about the current optimizer step, over all ranks."""

    layers: int = 1  # MoE layers of the model (the losses are averaged over them)
    micro_steps: int = 1  # forwards per rank (the same on every rank)
    tokens: float = 1.0  # valid tokens of the step (z-loss mean)
    documents: float = 1.0  # documents of the step (sequence-level aux mean)


@dataclass
class RouterStats:
    """Detached sums over the step's forwards (see the module docstring)."""

    counts: torch.Tensor | None = None  # [E] float64: tokens routed to each expert (k per token)
    aux: torch.Tensor | float = 0.0  # this rank's share of the aux-loss values (summed over ranks: the total)
    z: torch.Tensor | float = 0.0  # Σ logsumexp² over this rank's tokens
    a2a_bytes: float = 0.0  # bytes this rank sent to other EP ranks (dispatch + combine, forward)

    def add_counts(self, counts: torch.Tensor) -> None:
        c = counts.detach().to(torch.float64)
        self.counts = c if self.counts is None else self.counts + c


class _AttachLoss(torch.autograd.Function):
    """Identity on ``out``; the backward also seeds ``loss`` with ``scale``."""

    @staticmethod
    def forward(ctx, out, loss, scale):
        ctx.scale = scale
        ctx.loss_meta = (loss.dtype, loss.device)
        return out

    @staticmethod
    def backward(ctx, grad):
        dtype, device = ctx.loss_meta
        return grad, torch.full((), ctx.scale, dtype=dtype, device=device), None


def attach_loss(out: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
    return _AttachLoss.apply(out, loss, scale)


def recomputing() -> bool:
    """True inside a backward pass: a checkpointed forward being recomputed."""
    return torch._C._current_graph_task_id() != -1


def balance_probs(logits: torch.Tensor, router: str) -> torch.Tensor:
    """[T, E] fp32 probabilities the balance loss averages: softmax, or sigmoid normalised per token."""
    logits = logits.float()
    if router == "softmax":
        return logits.softmax(-1)
    s = logits.sigmoid()
    return s / (s.sum(-1, keepdim=True) + 1e-20)


def _onehot(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[T, E] fp32: 1 where a token chose the expert (k ones per row)."""
    out = torch.zeros(idx.shape[0], num_experts, device=idx.device, dtype=torch.float32)
    return out.scatter_add_(1, idx, torch.ones_like(idx, dtype=torch.float32))


def _balance(psum, g_counts, g_psum, g_tokens) -> tuple[torch.Tensor, torch.Tensor]:
    """``E · Σ f·P`` per group row (a document, or the one global row), summed: the term whose
    gradient flows into this rank's ``psum`` and the value over the reduced statistics."""
    E = psum.shape[-1]
    f = g_counts / g_tokens
    return E * (f * psum / g_tokens).sum(), (E * (f * g_psum / g_tokens).sum()).detach()


def global_aux(probs: torch.Tensor, idx: torch.Tensor, valid: torch.Tensor | None,
               reduce: Reduce | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(differentiable term whose gradient is the loss's w.r.t. this rank's tokens, the loss's
    value) over every token of the ``reduce`` group's micro-step."""
    E = probs.shape[1]
    if valid is not None:
        probs, idx = probs[valid], idx[valid]
    counts, psum = _onehot(idx, E).sum(0), probs.sum(0)
    stats = torch.cat([counts, psum.detach(), probs.new_full((1,), probs.shape[0])])
    if reduce is not None:
        stats = reduce(stats)
    return _balance(psum, stats[:E], stats[E : 2 * E], stats[2 * E].clamp_min(1))


def sequence_aux(probs: torch.Tensor, idx: torch.Tensor, cu_seqlens: torch.Tensor, valid: torch.Tensor | None,
                 reduce: Reduce | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ over the row's documents of their losses as a term for this rank's tokens, its value),
    each document's statistics summed over ``reduce`` (its context-parallel shards) first."""
    E = probs.shape[1]
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long)
    doc = torch.repeat_interleave(torch.arange(lens.numel(), device=probs.device), lens)
    onehot, ones = _onehot(idx, E), torch.ones_like(probs[:, :1])
    if valid is not None:
        keep = valid[:, None].to(probs.dtype)
        probs, onehot, ones = probs * keep, onehot * keep, ones * keep
    counts = onehot.new_zeros(lens.numel(), E).index_add_(0, doc, onehot)  # [D, E]
    psum = probs.new_zeros(lens.numel(), E).index_add(0, doc, probs)  # differentiable
    tokens = ones.new_zeros(lens.numel(), 1).index_add_(0, doc, ones)
    stats = torch.cat([counts, psum.detach(), tokens], dim=1)
    if reduce is not None:
        stats = reduce(stats)
    return _balance(psum, stats[:, :E], stats[:, E : 2 * E], stats[:, 2 * E :].clamp_min(1))


def z_loss_sum(logits: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Σ over this rank's valid tokens of logsumexp(logits)² (fp32)."""
    lse = torch.logsumexp(logits.float(), dim=-1)
    if valid is not None:
        lse = lse[valid]
    return (lse * lse).sum()


def router_layers(model: torch.nn.Module) -> list:
    """The MoE layers (modules carrying :class:`RouterStats`), in module order."""
    return [m for m in model.modules() if isinstance(getattr(m, "stats", None), RouterStats)]


def start_router_step(model: torch.nn.Module, micro_steps: int, tokens: float, documents: float,
                      total_layers: int | None = None) -> None:
    """Before a step's forwards: the counts the loss scales divide by (over all ranks).
    ``total_layers``: the whole model's MoE layers, where this rank holds some (pipeline stages)."""
    layers = router_layers(model)
    step = RouterStep(total_layers or len(layers), micro_steps, max(tokens, 1.0), max(documents, 1.0))
    for m in layers:
        m.step, m.stats = step, RouterStats()


Combine = Callable[[dict | None], list]  # this rank's layer totals -> every stage's (pipeline parallelism)


@torch.no_grad()
def finish_router_step(model: torch.nn.Module, reduce: Reduce | None = None, replicas: int = 1,
                       update_bias: bool = True, combine: Combine | None = None) -> dict[str, float]:
    """After the optimizer step: the step's statistics summed over all ranks (``reduce``; each
    value counted ``replicas`` times, e.g. by tensor-parallel ranks holding the same tokens), the
    aux-loss-free bias update (when ``update_bias``: the step was applied) and the metrics:
    ``moe_aux_loss`` / ``moe_z_loss`` (per layer, as the losses define them, before the
    coefficient), ``moe_load_max_mean`` (the most loaded expert over the mean, worst layer) and
    ``moe_a2a_bytes`` (expert parallelism: bytes all ranks sent to each other in the forwards).
    Under pipeline parallelism ``reduce`` sums over the ranks holding the same stages and
    ``combine`` gathers every stage's layer totals (a rank may hold no MoE layer), so that every
    rank reports the whole model's metrics."""
    layers = router_layers(model)
    mine = _layer_totals(layers, reduce, replicas, update_bias) if layers else None
    parts = [p for p in (combine(mine) if combine is not None else [mine]) if p is not None]
    return _router_metrics(parts) if parts else {}


def _layer_totals(layers: list, reduce: Reduce | None, replicas: int, update_bias: bool) -> dict:
    """This rank's MoE layers' step totals over ``reduce`` (and the bias update), as plain numbers."""
    device = layers[0].gate.weight.device
    E = [m.cfg.num_experts for m in layers]

    def on_device(x) -> torch.Tensor:  # the stats stay where they were summed: one host read below
        return torch.as_tensor(x, dtype=torch.float64, device=device).reshape(-1)

    scalars = [on_device(x) for m in layers for x in (m.stats.aux, m.stats.z, m.stats.a2a_bytes)]
    counts = [on_device(m.stats.counts if m.stats.counts is not None else torch.zeros(e)) for m, e in zip(layers, E)]
    flat = torch.cat([*scalars, *counts])
    if reduce is not None:
        flat = reduce(flat)
    flat = (flat / replicas).cpu()
    totals, flat = flat[: 3 * len(layers)].view(-1, 3), flat[3 * len(layers) :]
    step, cfg, load = layers[0].step, layers[0].cfg, []
    for m, e in zip(layers, E):
        c, flat = flat[:e], flat[e:]
        load.append(float(c.max() / c.mean().clamp_min(1e-12)) if c.sum() > 0 else 0.0)
        if update_bias and m.cfg.bias_update_speed and c.sum() > 0:
            bias = m.gate.e_score_correction_bias
            bias += (m.cfg.bias_update_speed * torch.sign(c.mean() - c)).to(bias)
        m.stats = RouterStats()
    return {"aux": float(totals[:, 0].sum()), "z": float(totals[:, 1].sum()), "a2a": float(totals[:, 2].sum()),
            "load": load, "layers": step.layers,
            "aux_per": (step.micro_steps if cfg.aux_loss_level == "global" else step.documents)
            if cfg.aux_loss_coef else None,
            "tokens": step.tokens if cfg.z_loss_coef else None}


def _router_metrics(parts: list[dict]) -> dict[str, float]:
    """The step's metrics from the layer totals of every part of the model (one part, or a stage's each)."""
    first, out = parts[0], {}
    n = first["layers"]  # the whole model's MoE layers
    if first["aux_per"] is not None:
        out["moe_aux_loss"] = sum(p["aux"] for p in parts) / (n * first["aux_per"])
    if first["tokens"] is not None:
        out["moe_z_loss"] = sum(p["z"] for p in parts) / (n * first["tokens"])
    out["moe_load_max_mean"] = max(x for p in parts for x in p["load"])
    a2a = sum(p["a2a"] for p in parts)
    if a2a:
        out["moe_a2a_bytes"] = a2a
    return out


__all__ = ["AUX_LEVELS", "RouterStats", "RouterStep", "attach_loss", "balance_probs", "finish_router_step",
           "global_aux", "recomputing", "router_layers", "sequence_aux", "start_router_step", "z_loss_sum"]
