"""Chunked rows through linear-attention layers: what a Gated DeltaNet layer carries from one chunk
of a row into the next, in place of attention's keys and values (parallel/seq_chunks.py).

A document cut by a chunk boundary at row b continues in the next chunk from the state it had
at b: the convolution's last K−1 inputs and the recurrent state (components/linear_attention.py,
``LinearState``). Only the document that crosses b carries anything; every other document of a
chunk starts from zero, as on a whole row. So per linear layer and boundary the store keeps one
state, written by the forward sweep (no grad), and in the backward sweep

- the chunk after b reads it as a leaf (``requires_grad``) whose gradient, once that chunk's
  backward ran, is kept as the gradient of the state at b;
- the chunk before b hands its final state on through :class:`InjectGrad`, an identity on the
  layer's output whose backward gives the final state that gradient, so the chunk's backward
  carries it into its own computation (and so into the earlier chunks' leaves, and the weights).

The sweeps run the backwards from the last chunk to the first, so every gradient a chunk needs
exists when it runs. Under a pipeline (``pipelined``: each chunk runs once, with grad) the
final state is also stored, detached, for the next chunk's forward. The result equals the
unchunked row's gradients (tests/test_seq_chunks.py).
"""

from __future__ import annotations

import torch

from omniweave.models.components.linear_attention import LinearState


class InjectGrad(torch.autograd.Function):
    """``y`` unchanged; its backward also gives ``window`` / ``recurrent`` the gradient ``grad()``
    returns then (None: nothing reached them)."""

    @staticmethod
    def forward(ctx, y, window, recurrent, grad):
        ctx.grad = grad
        return y.view_as(y)

    @staticmethod
    def backward(ctx, gy):
        got = ctx.grad()
        return gy, *(got if got is not None else (None, None)), None


class ChunkStates:
    """One row's linear-layer states at its chunk boundaries (see the module docstring)."""

    def __init__(self):
        self.states: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (layer, row) -> state at row
        self.grads: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.plan, self.grad, self.pipelined = None, False, False

    def begin(self, plan, grad: bool, pipelined: bool = False) -> None:
        self.plan, self.grad, self.pipelined = plan, grad, pipelined
        self.leaves: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def carry(self, layer: int) -> "ChunkCarry":
        return ChunkCarry(self, layer)

    def leaf(self, layer: int, key: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored state at ``key`` as leaves whose gradient becomes the state's (once)."""
        if layer not in self.leaves:
            leaves = tuple(t.detach().requires_grad_() for t in self.states[key])

            def keep(_):  # after both leaves' gradients are in (the hooks run per leaf)
                if all(t.grad is not None for t in leaves):
                    self.grads[key] = tuple(t.grad for t in leaves)

            for t in leaves:
                t.register_post_accumulate_grad_hook(keep)
            self.leaves[layer] = leaves
        return self.leaves[layer]


class ChunkCarry:
    """A Gated DeltaNet layer's ``carry`` hook over a row's :class:`ChunkStates`."""

    def __init__(self, store: ChunkStates, layer: int):
        self.store, self.layer = store, layer

    def initial(self, pre: torch.Tensor, cu_seqlens: torch.Tensor, hv: int, dk: int, dv: int) -> LinearState | None:
        """The chunk's per-document initial states: the crossing document's, zeros for the rest
        (None when no document crosses into the chunk)."""
        s, p = self.store, self.store.plan
        if p.doc_start >= p.start:
            return None
        key = (self.layer, p.start)
        window, recurrent = s.leaf(self.layer, key) if s.grad else s.states[key]
        n = len(cu_seqlens) - 1
        return LinearState(torch.cat([window[None], window.new_zeros(n - 1, *window.shape)]),
                           torch.cat([recurrent[None], recurrent.new_zeros(n - 1, *recurrent.shape)]))

    def final(self, y: torch.Tensor, state: LinearState) -> torch.Tensor:
        """Keep (or, with grad, connect) the last document's final state when it continues."""
        s, p = self.store, self.store.plan
        if p.doc_end <= p.end:
            return y
        key = (self.layer, p.end)
        window, recurrent = state.window[-1], state.recurrent[-1]
        if not s.grad or s.pipelined:
            s.states[key] = (window.detach(), recurrent.detach())
        if not s.grad:
            return y
        return InjectGrad.apply(y, window, recurrent, lambda: s.grads.get(key))


__all__ = ["ChunkCarry", "ChunkStates", "InjectGrad"]
