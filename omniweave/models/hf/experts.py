"""Expert tensors of MoE families (Qwen3-MoE, DeepSeek-V3): one HF tensor per expert on disk,
one 3-D tensor of ours. Three layouts:

- ours (= transformers v5 at runtime, ``Qwen3MoeExperts`` / ``DeepseekV3Experts``):
  ``layers.N.mlp.experts.gate_up_proj`` ``[E, 2·I, D]`` (gate rows first, then up) and
  ``layers.N.mlp.experts.down_proj`` ``[E, D, I]``;
- released checkpoints (Qwen3-30B-A3B, DeepSeek-V3 …) and transformers' own ``save_pretrained``:
  one tensor per expert, ``model.layers.N.mlp.experts.{e}.{gate,up,down}_proj.weight`` ``[I, D]`` /
  ``[D, I]``; loading stacks them (``MergeModulelist(dim=0)`` + ``Concatenate(dim=1)`` in
  transformers' ``conversion_mapping.py``), export writes this layout;
- a checkpoint holding the fused names (``model.layers.N.mlp.experts.gate_up_proj``) is read as
  transformers' runtime layout above, unchanged. The name decides the layout, never the shape:
  with ``2·I == D`` the transposed layout (Qwen3-VL-MoE's ``[E, D, 2·I]``) has the same shape.

:class:`PerExpertTensors` is the adapter mixin holding the three optional hooks of
``adapter.DecoderAdapter`` (whole-model load, sharded load, export) for this layout.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
FUSED_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(gate_up_proj|down_proj)$")


class PerExpertTensors:
    """Mixin for a ``DecoderAdapter`` whose MoE experts are stored one tensor per expert."""

    def model_tensors_to_ours(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Stack per-expert tensors (our names, from ``model_name_to_ours``) into the 3-D ones."""
        parts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
        out = {}
        for name, t in tensors.items():
            m = _PER_EXPERT.match(name)
            if m is None:
                out[name] = t
                continue
            prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
            parts.setdefault(prefix, {}).setdefault(proj, {})[e] = t
        for prefix, projs in parts.items():
            if f"{prefix}.gate_up_proj" in out or f"{prefix}.down_proj" in out:
                raise KeyError(f"{self.model_type}: {prefix} holds both per-expert and fused expert tensors")
            experts = set().union(*(p.keys() for p in projs.values()))
            for proj in ("gate", "up", "down"):
                lacking = sorted(set(range(max(experts) + 1)) - set(projs.get(proj, {})))
                if lacking:
                    raise KeyError(f"{self.model_type}: {prefix}: no {proj}_proj for expert(s) {lacking[:8]}")
            n = max(experts) + 1
            out[f"{prefix}.gate_up_proj"] = torch.cat([torch.stack([projs["gate"][e] for e in range(n)]),
                                                       torch.stack([projs["up"][e] for e in range(n)])], dim=1)  # fmt: skip
            out[f"{prefix}.down_proj"] = torch.stack([projs["down"][e] for e in range(n)])
        return out

    def model_tensors_to_hf(self, name: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """HF (name, tensor) pairs of one of our tensors: 3-D experts split per expert."""
        m = FUSED_EXPERT.match(name)
        if m is None:
            hf_name = self.model_name_to_hf(name)
            return [] if hf_name is None else [(hf_name, t)]
        prefix = self.model_name_to_hf(m.group(1))  # model.layers.N.mlp.experts
        if m.group(2) == "down_proj":
            return [(f"{prefix}.{e}.down_proj.weight", t[e]) for e in range(t.shape[0])]
        inter = t.shape[1] // 2
        return [pair for e in range(t.shape[0]) for pair in
                ((f"{prefix}.{e}.gate_proj.weight", t[e, :inter]), (f"{prefix}.{e}.up_proj.weight", t[e, inter:]))]

    def assemble(self, name: str, has: Callable[[str], bool], read: Callable[[str], torch.Tensor]) -> torch.Tensor | None:
        """Our 3-D expert tensor ``name`` read from a per-expert checkpoint (``load_hf_into``);
        None where the checkpoint holds ``name``'s own HF tensor (fused layout, other tensors)."""
        m = FUSED_EXPERT.match(name)
        if m is None or has(self.model_name_to_hf(name)):
            return None
        prefix, e, out = self.model_name_to_hf(m.group(1)), 0, []
        projs = ("down",) if m.group(2) == "down_proj" else ("gate", "up")
        while has(f"{prefix}.{e}.{projs[0]}_proj.weight"):
            out.append([read(f"{prefix}.{e}.{p}_proj.weight") for p in projs])
            e += 1
        if not out:
            raise KeyError(f"{self.model_type}: neither {self.model_name_to_hf(name)} nor {prefix}.0.{projs[0]}_proj.weight")
        return torch.stack([torch.cat(ts) for ts in out])
