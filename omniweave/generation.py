"""Rollouts: G sampled continuations of each of many prompts, with one encoding and one prefill per prompt.

    engine = TorchRollout(model, cp_group=…)          a plain model holding the policy's weights
    rollouts = engine.generate(prompts, group_size=G, params=SamplingParams(...), seed=s)

How a batch of N prompts is rolled out (``TorchRollout``):

1. The N prompts are packed into one row (documents side by side, no padding to the longest), so
   the vision encoder runs **once** over every image and video of the batch.
2. The row is prefilled **once** through the decoder (varlen causal attention); each prompt's keys
   and values stay in a :class:`GroupKVCache`, stored once for its G samples (a linear-attention
   layer's state — conv window and recurrent state, a fixed size — is copied to each sample). Under context
   parallelism the row is zigzag-sharded as in training: the vision split shares the encoding,
   the prefill runs the CP attention, and each rank keeps only its share of the prompt keys — a
   prompt longer than one rank's memory still rolls out.
3. The N·G samples decode in lockstep, one token each per step: a sample attends to its prompt's
   keys (the group's queries against the shared keys, one varlen call; partial results merged
   over the CP ranks by log-sum-exp) and to its own generated keys (``attention.decode`` over the
   samples' cache slots: on CUDA the varlen kernel reads them in place with ``seqused_k``), merged
   by log-sum-exp.

Sampling (temperature, top-k, top-p; temperature 0 = greedy) draws each sample's tokens from its
own generator seeded by (seed, prompt uid, sample index), so rollouts do not depend on the batch
composition or the parallel layout. A sample stops at a stop token (kept in its response) or
after ``max_new_tokens``. The log-probability returned for each token is ``log_softmax(logits /
temperature)`` at that token (before top-k / top-p), the quantity the update recomputes.

``NaiveRollout`` re-encodes and re-prefills every sample on its own (the reference the tests and
``bench/rl.py`` compare against). Another engine (vLLM, SGLang) plugs in by implementing
:class:`RolloutEngine`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from omniweave.models.components.attention import attn, decode
from omniweave.models.components.decoder import KVCache
from omniweave.models.components.linear_attention import LinearState
from omniweave.models.omni import cat_items
from omniweave.models.registry import MODALITIES
from omniweave.parallel.context.kernels import merge_partials


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    max_new_tokens: int = 64
    stop_ids: tuple[int, ...] = ()

    def validate(self) -> None:
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0 or self.max_new_tokens < 1:
            raise ValueError(f"bad sampling parameters {self}: need temperature >= 0, 0 < top_p <= 1, "
                             "top_k >= 0, max_new_tokens >= 1")


@dataclass
class Prompt:
    uid: int  # stable id of the prompt (its dataset index): part of every sample's seed
    batch: dict  # input_ids [L], position_ids [A, L] (optional), pixel_values, grid_thw, media_spans


@dataclass
class Rollout:
    uid: int
    sample: int
    tokens: list[int]
    logprobs: list[float]
    truncated: bool  # reached max_new_tokens without a stop token


class RolloutEngine(Protocol):
    def generate(self, prompts: list[Prompt], group_size: int, params: SamplingParams, seed: int) -> list[Rollout]: ...


# ---------------------------------------------------------------------------- sampling


def sample_seed(seed: int, uid: int, sample: int) -> int:
    """The seed of one sample (63 bits): a function of (seed, prompt uid, sample index) only."""
    state = np.random.SeedSequence([seed % 2**63, uid, sample]).generate_state(1, np.uint64)[0]
    return int(state >> np.uint64(1))


def sample_generator(seed: int, uid: int, sample: int, device="cpu") -> torch.Generator:
    """The generator of one sample, seeded by :func:`sample_seed`."""
    return torch.Generator(device=device).manual_seed(sample_seed(seed, uid, sample))


def sample_tokens(logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]):
    """logits [B, V] -> (tokens [B] int64, logprobs [B] fp32 of log_softmax(logits / T) at the token)."""
    logits = logits.float()
    if params.temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, F.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0]
    logp = F.log_softmax(logits / params.temperature, -1)
    probs = logp.exp()
    if params.top_k:
        kth = probs.topk(min(params.top_k, probs.shape[-1]), -1).values[:, -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
    if params.top_p < 1:
        sorted_p, order = probs.sort(-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the tokens ranked above: keep while < top_p
        probs = probs.scatter(-1, order, sorted_p.masked_fill(before >= params.top_p * sorted_p.sum(-1, True), 0))
    tokens = torch.stack([torch.multinomial(probs[i], 1, generator=g)[0] for i, g in enumerate(generators)])
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


# ---------------------------------------------------------------------------- the cache


class GroupKVCache:
    """Keys/values of a rollout batch: each prompt's once (this rank's real rows of it under CP),
    plus every sample's own generated tokens. See the module docstring for the attention."""

    def __init__(self, num_layers: int, group_size: int, max_new_tokens: int, prefix_counts: list[int],
                 keep_rows: torch.Tensor | None = None, cp_group=None):
        self.group_size, self.max_new = group_size, max_new_tokens
        self.keep_rows = keep_rows  # bool [local rows] of the prefill row: real (not a CP pad)
        self.cp_group = cp_group
        counts = torch.tensor([0, *prefix_counts], dtype=torch.int64)
        self.prefix_cu = counts.cumsum(0).to(torch.int32)  # per prompt: its keys held here
        self.num_samples = n = len(prefix_counts) * group_size
        self.prefix_k: list[torch.Tensor | None] = [None] * num_layers
        self.prefix_v: list[torch.Tensor | None] = [None] * num_layers
        self.own_k: list[torch.Tensor | None] = [None] * num_layers
        self.own_v: list[torch.Tensor | None] = [None] * num_layers
        self.linear: dict[int, LinearState] = {}  # per linear-attention layer: every sample's state
        self.active = torch.arange(n)  # samples (prompt * G + j) decoding this step, ascending
        self.t = -1  # index of the token being fed in the samples' own keys; -1 while prefilling

    def mix_linear(self, layer: int, mixer, h, cu_seqlens) -> torch.Tensor:
        """A linear-attention layer (Gated DeltaNet): the prefill's final state of each prompt (its
        conv window and recurrent state, a fixed size) copied to its G samples; each decode step
        moves the active samples' states one token on (O(1) per token)."""
        if self.t < 0:
            if self.cp_group is not None:
                raise NotImplementedError("rollouts under context parallelism with linear-attention layers "
                                          "(layer_types) are not supported yet: set parallel.cp=1 for the rollouts")
            y, final = mixer(h, cu_seqlens)
            self.linear[layer] = LinearState(final.window.repeat_interleave(self.group_size, 0),
                                             final.recurrent.repeat_interleave(self.group_size, 0))
            return y
        state, active = self.linear[layer], self.active.to(h.device)
        y, new = mixer(h, cu_seqlens, LinearState(state.window[active], state.recurrent[active]))
        state.window[active], state.recurrent[active] = new.window.to(state.window.dtype), new.recurrent
        return y

    def attend(self, layer: int, q, k, v, cu_seqlens, window: int | None, backend: str, attn_fn=None):
        if window is not None:
            raise NotImplementedError("rollouts with a sliding-window decoder are not supported yet")
        if self.t < 0:
            return self._prefill(layer, q, k, v, cu_seqlens, backend, attn_fn)
        return self._decode(layer, q, k, v, backend)

    def _prefill(self, layer, q, k, v, cu_seqlens, backend, attn_fn):
        if attn_fn is not None:  # the context-parallel kernel on this rank's share of the row
            out = attn_fn(q, k, v, cu_seqlens, None)
        else:
            out, _ = attn(q, k, v, cu_seqlens, cu_seqlens, True, None, backend=backend, need_lse=False)
        keep = self.keep_rows
        self.prefix_k[layer] = k if keep is None else k[keep.to(k.device)]
        self.prefix_v[layer] = v if keep is None else v[keep.to(v.device)]
        return out

    def _decode(self, layer, q, k, v, backend):
        if self.own_k[layer] is None:
            shape = (self.num_samples, self.max_new, *k.shape[1:])
            self.own_k[layer], self.own_v[layer] = k.new_zeros(shape), v.new_zeros(shape)
        active = self.active.to(k.device)
        self.own_k[layer][active, self.t] = k
        self.own_v[layer][active, self.t] = v
        lengths = torch.full((len(active),), self.t + 1, device=k.device)  # lockstep: all generated t + 1
        out, lse = decode(q, self.own_k[layer], self.own_v[layer], active, lengths, backend)
        for pre_out, pre_lse in self._prefix_partials(layer, q, backend):
            out, lse = merge_partials(out, lse, pre_out, pre_lse)
        return out.to(q.dtype)

    def _prefix_partials(self, layer, q, backend):
        """(out, lse) of the active queries over their prompts' keys: this rank's, or every CP rank's."""
        groups, counts = torch.unique_consecutive(self.active // self.group_size, return_counts=True)
        cu_q = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)
        lo, hi = self.prefix_cu[groups].tolist(), self.prefix_cu[groups + 1].tolist()
        if len(groups) == len(self.prefix_cu) - 1:  # every prompt still decoding: all keys, no copy
            k, v, cu_k = self.prefix_k[layer], self.prefix_v[layer], self.prefix_cu
        else:
            rows = torch.cat([torch.arange(a, b) for a, b in zip(lo, hi)]).to(q.device)
            k, v = self.prefix_k[layer][rows], self.prefix_v[layer][rows]
            cu_k = torch.tensor([0, *np.cumsum([b - a for a, b in zip(lo, hi)])], dtype=torch.int32)
        out, lse = attn(q, k, v, cu_q.to(q.device), cu_k.to(q.device), False, None, backend=backend)
        out = out.float()
        if self.cp_group is None:
            return [(out, lse)]
        outs = [torch.empty_like(out) for _ in range(dist.get_world_size(self.cp_group))]
        lses = [torch.empty_like(lse) for _ in outs]
        dist.all_gather(outs, out.contiguous(), group=self.cp_group)
        dist.all_gather(lses, lse.contiguous(), group=self.cp_group)
        return list(zip(outs, lses))


# ---------------------------------------------------------------------------- packing the prompts


def pack_prompts(prompts: list[Prompt]) -> dict:
    """The prompts as one packed row (their documents side by side; each modality's items in
    prompt order)."""
    ids, pos, offset = [], [], 0
    media = {m: ([], [], [], []) for m in MODALITIES}  # spans, inputs, grids, sizes
    for p in prompts:
        b = p.batch
        n = b["input_ids"].shape[0]
        ids.append(b["input_ids"])
        pos.append(b["position_ids"] if b.get("position_ids") is not None else torch.arange(n)[None])
        for m, (spans, inputs, grids, sizes) in media.items():
            if b.get(m.grid) is not None and b[m.grid].shape[0]:
                spans.append(b[m.spans].reshape(-1, 2) + torch.tensor([offset, 0]))
                inputs.append(b[m.inputs])
                grids.append(b[m.grid])
                if m.sizes and b.get(m.sizes) is not None:
                    sizes.append(b[m.sizes])
        offset += n
    lens = [p.batch["input_ids"].shape[0] for p in prompts]
    row = {"input_ids": torch.cat(ids), "labels": torch.full((offset,), -100, dtype=torch.long),
           "position_ids": torch.cat([x if x.dim() == 2 else x[None] for x in pos], dim=-1),
           "cu_seqlens": torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)}
    for m, (spans, inputs, grids, sizes) in media.items():
        if grids:
            row.update({m.inputs: cat_items(inputs), m.grid: torch.cat(grids), m.spans: torch.cat(spans)})
        if sizes:
            row[m.sizes] = torch.cat(sizes)
    return row


# ---------------------------------------------------------------------------- engines


def prompt_inputs(model, batch: dict) -> dict:
    """The foundation's prompt inputs: ``inputs_embeds`` [L, D] with the media features in place
    (an OmniModel encodes its media here, and adds its DeepStack levels, if any); a text-only
    CausalLM just embeds the ids."""
    if hasattr(model, "foundation_inputs"):
        return model.foundation_inputs(batch)
    return {"inputs_embeds": model.foundation.embed(batch["input_ids"])}


class TorchRollout:
    """Rollouts with ``model`` (an ``OmniModel`` / ``CausalLM``, plain weights on this rank). With
    ``cp_group`` (size ``cp``), this rank is ``cp_rank`` of a context-parallel group whose ranks
    call ``generate`` together on the same prompts; the model carries the CP hooks (vision split,
    CP attention) as in training."""

    def __init__(self, model, cp_group=None, cp: int = 1, cp_rank: int = 0):
        self.model, self.cp_group, self.cp, self.cp_rank = model, cp_group, cp, cp_rank

    @torch.no_grad()
    def generate(self, prompts: list[Prompt], group_size: int, params: SamplingParams, seed: int) -> list[Rollout]:
        params.validate()
        if not prompts:
            return []
        foundation, device = self.model.foundation, next(self.model.parameters()).device
        row = pack_prompts(prompts)
        next_pos = [int(p.batch["position_ids"].max()) + 1 if p.batch.get("position_ids") is not None
                    else p.batch["input_ids"].shape[0] for p in prompts]
        local, keep, counts, last_rows = self._shard(row)
        local = {k: v.to(device) if torch.is_tensor(v) else v for k, v in local.items()}
        cache = GroupKVCache(len(foundation.layers), group_size, params.max_new_tokens, counts, keep,
                             self.cp_group if self.cp > 1 else None)
        hidden = foundation(**prompt_inputs(self.model, local), position_ids=local["position_ids"],
                            cu_seqlens=local["cu_seqlens"], kv_cache=cache)
        logits = self._prompt_logits(foundation, hidden, last_rows)  # [N, V]
        n, g = len(prompts), group_size
        gens = [sample_generator(seed, p.uid, j) for p in prompts for j in range(g)]
        tokens, logp = sample_tokens(logits.repeat_interleave(g, 0), params, gens)
        out = [Rollout(p.uid, j, [], [], True) for p in prompts for j in range(g)]
        active = torch.arange(n * g)
        axes = row["position_ids"].shape[0]
        for t in range(params.max_new_tokens):
            for s, tok, lp in zip(active.tolist(), tokens.tolist(), logp.tolist()):
                out[s].tokens.append(tok)
                out[s].logprobs.append(lp)
            going = torch.tensor([tok not in params.stop_ids for tok in tokens.tolist()], dtype=torch.bool)
            for s in active[~going].tolist():
                out[s].truncated = False
            active, tokens = active[going], tokens[going]
            if active.numel() == 0 or t == params.max_new_tokens - 1:
                break
            cache.active, cache.t = active, t
            pos = torch.tensor([next_pos[s // g] + t for s in active.tolist()])
            hidden = foundation(input_ids=tokens.to(device), position_ids=pos.expand(axes, -1).to(device),
                                cu_seqlens=torch.arange(active.numel() + 1, dtype=torch.int32, device=device),
                                kv_cache=cache)
            tokens, logp = sample_tokens(foundation.logits(hidden), params, [gens[s] for s in active.tolist()])
        return out

    def _shard(self, row: dict):
        """(this rank's row, real-row mask or None, prompt keys held here per prompt, row of each
        prompt's last token in the local row or -1 when another rank holds it)."""
        cu = row["cu_seqlens"]
        ends = (cu[1:] - 1).tolist()
        if self.cp == 1:
            return row, None, (cu[1:] - cu[:-1]).tolist(), ends
        from omniweave.parallel.context import shard_micro_batch
        from omniweave.parallel.context.sharding import plan_cp_shard

        plan = plan_cp_shard(cu, self.cp)
        index = plan.local_index(self.cp_rank)  # original row of each local row, -1 = pad
        keep = index >= 0
        doc = torch.bucketize(index.clamp_min(0), cu[1:].to(torch.int64), right=True)
        counts = torch.bincount(doc[keep], minlength=len(ends)).tolist()
        where = {int(r): i for i, r in enumerate(index.tolist()) if r >= 0}
        return shard_micro_batch(row, self.cp, self.cp_rank), keep, counts, [where.get(e, -1) for e in ends]

    def _prompt_logits(self, foundation, hidden: torch.Tensor, last_rows: list[int]) -> torch.Tensor:
        held = torch.tensor([r >= 0 for r in last_rows])
        h = hidden.new_zeros(len(last_rows), hidden.shape[-1])
        h[held.to(h.device)] = hidden[torch.tensor([r for r in last_rows if r >= 0], dtype=torch.long,
                                                   device=hidden.device)]
        if self.cp > 1:  # each prompt's last token lives on one CP rank
            dist.all_reduce(h, group=self.cp_group)
        return foundation.logits(h).float()


class NaiveRollout:
    """The reference: every sample re-encodes its media and re-prefills its prompt alone."""

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def generate(self, prompts: list[Prompt], group_size: int, params: SamplingParams, seed: int) -> list[Rollout]:
        params.validate()
        foundation, device = self.model.foundation, next(self.model.parameters()).device
        out = []
        for p in prompts:
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in p.batch.items()}
            n = batch["input_ids"].shape[0]
            pos = batch.get("position_ids")
            pos = torch.arange(n, device=device)[None] if pos is None else (pos if pos.dim() == 2 else pos[None])
            for j in range(group_size):
                gen = sample_generator(seed, p.uid, j)
                cache = KVCache(len(foundation.layers))
                hidden = foundation(**prompt_inputs(self.model, batch), position_ids=pos, kv_cache=cache)
                r, next_pos = Rollout(p.uid, j, [], [], True), int(pos.max()) + 1
                for t in range(params.max_new_tokens):
                    tok, lp = sample_tokens(foundation.logits(hidden[-1:]), params, [gen])
                    r.tokens.append(int(tok))
                    r.logprobs.append(float(lp))
                    if int(tok) in params.stop_ids:
                        r.truncated = False
                        break
                    step_pos = torch.full((pos.shape[0], 1), next_pos + t, dtype=pos.dtype, device=device)
                    hidden = foundation(input_ids=tok.to(device), position_ids=step_pos, kv_cache=cache)
                out.append(r)
        return out


# ---------------------------------------------------------------------------- the policy's copy


def build_rollout_model(cfg, dims, meshes, device) -> torch.nn.Module:
    """The model that rolls out: the policy's architecture with full weights on this rank (see
    :func:`sync_weights`), the vision split and the CP attention applied as in training; no TP or
    FSDP, so decoding needs no collective except the CP merges (the tp ranks of a group decode
    the same prompts side by side)."""
    from omniweave.config import section, to_dict
    from omniweave.models.registry import build_model
    from omniweave.parallel.context import apply_cp, apply_vision_split

    model = build_model(to_dict(cfg.model)).to(device).eval()
    model.requires_grad_(False)
    apply_vision_split(model, meshes.vision_split)
    apply_cp(model, dims, meshes, head_groups=section(cfg, "parallel").cp_head_groups)
    return model


def sync_weights(policy: torch.nn.Module, rollout_model: torch.nn.Module, pp_group=None) -> None:
    """Collective over the policy's ranks: its current weights (FSDP / TP shards gathered) into
    ``rollout_model`` on every rank. ``pp_group`` (a pipelined policy: ``policy`` is this rank's
    stages' part, under the model's names): the parts of the pipeline's ranks gathered too."""
    import logging

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    # FSDP over TP shards gathers in two all-gathers, and DTensor logs that this is "suboptimal"
    # (and might reduce in another order: an all-gather reduces nothing); once per sync is fine.
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)  # setLevel, not the attribute: it also clears logging's level cache
    try:
        state = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True))
    finally:
        log.setLevel(level)
    if pp_group is not None:
        parts = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(parts, {k: v.cpu() for k, v in state.items()}, group=pp_group)
        state = {k: v for part in parts for k, v in part.items()}
    rollout_model.load_state_dict(state)
