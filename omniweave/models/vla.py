"""Vision-language-action model (Pi0.5-style): an OmniModel backbone reads the observation, an
action expert denoises chunks of future actions by flow matching.

    prefix   = backbone over the row: images, instruction and state tokens of each frame's
               document, bidirectional within its ``prefix_lens[d]`` tokens (a causal tail after
               them, e.g. co-trained text); each layer's keys / values kept
    velocity = expert(x_t, t) over every action chunk, chunk n's tokens seeing the prefix of
               document ``action_docs[n]`` and themselves (components/prefix_attention.py)
    loss     = Σ (velocity − (noise − actions))² over the real steps and action columns

The backbone never sees the actions, so it runs once, first; at sampling time the kept prefix
serves every Euler step. Which backbone is a recipe line (PaliGemma's SigLIP + Gemma for Pi0.5,
a Qwen2.5-VL one by naming its components): the expert needs only the backbone's depth, head_dim,
key/value heads and RoPE.

Batch keys beside OmniModel's (per row; N chunks of H steps, A the expert's action width):
``prefix_lens [D]`` (the bidirectional prefix of each document; absent: all causal),
``action_docs [N]`` (the document whose prefix chunk n reads), ``actions [N, H, A]`` (normalised,
zero-padded columns), ``action_is_pad [N, H]`` (steps past the episode's end), ``action_dims [N]``
(real columns), and the flow-matching draw ``action_noise [N, H, A]``, ``action_time [N]``
(made where the row is built, seeded per sample, so every layout sees the same).
A training head gets a :class:`Prefix` instead of the hidden states alone.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor, nn

from omniweave.models.components.flow import FlowLoss, euler_sample, flow_matching_loss, flow_matching_targets
from omniweave.models.components.prefix_attention import ChunkLayout
from omniweave.models.omni import OmniModel, Prefix

ACTION_KEYS = ("action_docs", "actions", "action_is_pad", "action_dims", "action_noise", "action_time")


class Chunks(NamedTuple):
    """What the expert needs of the prefix for a set of chunks, built once per set (sampling reuses it)."""

    layout: ChunkLayout
    cos: Tensor
    sin: Tensor


def check_expert_fits(backbone, expert) -> None:
    """The expert's layer i attends with the backbone's layer-i keys: equal depth, head_dim and
    key/value heads; a backbone without attention in every layer cannot serve."""
    mismatched = [f"{name}: backbone {getattr(backbone, b)}, expert {getattr(expert, e)}"
                  for name, b, e in (("layers", "num_layers", "num_layers"), ("head_dim", "head_dim", "head_dim"),
                                     ("key/value heads", "num_kv_heads", "num_kv_heads"))
                  if getattr(backbone, b) != getattr(expert, e)]
    if mismatched:
        raise ValueError("the action expert attends with the backbone's keys and values, so they must agree on "
                         + "; ".join(mismatched))
    if backbone.layer_types is not None and "linear_attention" in backbone.layer_types or backbone.mla:
        raise ValueError("the action expert needs a backbone whose every layer is standard attention "
                         "(no linear-attention or latent-attention layers)")


class VLAModel(OmniModel):
    def __init__(self, foundation: nn.Module, action_expert: nn.Module, **components: nn.Module | None):
        super().__init__(foundation, **components)
        check_expert_fits(foundation.config, action_expert.config)
        self.action_expert = action_expert

    def init_weights(self) -> None:
        super().init_weights()
        self.action_expert.init_weights()

    def prefix(self, batch: dict, keep_kv: bool = True) -> Prefix:
        """The backbone over the row (prefix-LM by ``prefix_lens``), always keeping its keys / values
        (the expert reads them; ``keep_kv`` is OmniModel's signature, not a choice here)."""
        return super().prefix(batch, keep_kv=True)

    def forward(self, batch: dict, token_logprobs: bool = False, temperature: float = 1.0, head=None):
        """``head(model, prefix, batch)`` with a :class:`Prefix` (the flow objective runs the expert
        from it); without a head the language-model loss of the row, as OmniModel's."""
        if head is None:
            return super().forward(batch, token_logprobs, temperature)
        return head(self, self.prefix(batch), batch)

    def chunks(self, prefix: Prefix, action_docs: Tensor) -> Chunks:
        horizon = self.action_expert.config.horizon
        layout = ChunkLayout(prefix.layout, action_docs, horizon, self.action_expert.config.knowledge_insulation)
        cos, sin = self.foundation.rope(prefix.layout.chunk_positions(prefix.position_ids, action_docs, horizon))
        return Chunks(layout, cos, sin)

    def velocity(self, chunks: Chunks, noisy_actions: Tensor, t: Tensor) -> Tensor:
        """The expert's velocity [N, H, A] for noisy chunks at flow times ``t`` [N]."""
        return self.action_expert(noisy_actions, t, chunks.cos, chunks.sin, chunks.layout)

    def flow_loss(self, prefix: Prefix, batch: dict) -> FlowLoss:
        """The flow-matching loss of the row's action chunks (sum and count over real values)."""
        missing = [k for k in ACTION_KEYS if k not in batch]
        if missing:
            raise ValueError(f"a VLA row needs the keys {', '.join(missing)}")
        actions = batch["actions"]
        x_t, u_t = flow_matching_targets(actions, batch["action_noise"].to(actions.dtype), batch["action_time"])
        v = self.velocity(self.chunks(prefix, batch["action_docs"]), x_t, batch["action_time"])
        return flow_matching_loss(v, u_t, batch["action_is_pad"], batch["action_dims"])

    @torch.no_grad()
    def sample_actions(self, batch: dict, noise: Tensor, num_steps: int | None = None) -> Tensor:
        """Action chunks [N, H, A] (normalised) for the row's observations: the prefix computed
        once, then ``num_steps`` Euler steps of the expert from ``noise`` [N, H, A] (t = 1) to t = 0."""
        prefix = self.prefix(batch)
        chunks = self.chunks(prefix, batch["action_docs"])
        steps = num_steps or self.action_expert.config.num_steps
        return euler_sample(lambda x, t: self.velocity(chunks, x, t), noise, steps)
